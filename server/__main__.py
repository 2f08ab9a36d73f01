"""`python -m server serve|client ...`: the same subcommands as `jpaged serve|client`."""

from __future__ import annotations

import argparse
import sys

from server.cli import add_client_parser, add_serve_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_client_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
