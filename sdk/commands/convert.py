"""`colibri-sdk convert` (being written)."""


def register(sub) -> None:
    p = sub.add_parser("convert", help="(not available yet)")
    p.set_defaults(func=lambda args: 1)
