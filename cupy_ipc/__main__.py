"""Command line: ``python -m cupy_ipc demo``."""

from __future__ import annotations

import argparse
import sys

from ._demo import run_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupy_ipc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="share an array and events with a consumer process, checked and timed")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
