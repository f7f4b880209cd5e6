"""`colibri-sdk build` (being written)."""


def register(sub) -> None:
    p = sub.add_parser("build", help="(not available yet)")
    p.set_defaults(func=lambda args: 1)
