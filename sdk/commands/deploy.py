"""`colibri-sdk deploy` (being written)."""


def register(sub) -> None:
    p = sub.add_parser("deploy", help="(not available yet)")
    p.set_defaults(func=lambda args: 1)
