"""`python -m server serve|client ...`: the same subcommands as `jpaged serve|client`, with the
same one-line errors (`--debug` for a traceback)."""

from __future__ import annotations

import argparse
import sys

from jpaged.entrypoints.cli import run
from server.cli import add_client_parser, add_serve_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_client_parser(sub)
    return run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
