"""`colibri-sdk run` (being written)."""


def register(sub) -> None:
    p = sub.add_parser("run", help="(not available yet)")
    p.set_defaults(func=lambda args: 1)
