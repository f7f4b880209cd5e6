"""One module per `colibri-sdk` subcommand; each exposes `register(subparsers)`."""
