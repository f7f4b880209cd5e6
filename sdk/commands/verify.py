"""`colibri-sdk verify` (being written)."""


def register(sub) -> None:
    p = sub.add_parser("verify", help="(not available yet)")
    p.set_defaults(func=lambda args: 1)
