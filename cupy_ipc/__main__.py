"""Command line: ``python -m cupy_ipc demo`` and ``python -m cupy_ipc doctor [--json]``."""

from __future__ import annotations

import argparse
import os
import sys

from ._demo import run_demo
from ._doctor import run_doctor


def main(argv: list[str] | None = None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="python -m cupy_ipc",
                                     description="Share CuPy arrays and CUDA events between processes of one host.")
    parser.add_argument("--version", action="version", version=f"cupy_ipc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="share an array and events with a consumer process, checked and timed",
                   description="Start a consumer process, share a strided view of a 64 MiB array and events with it "
                               "both ways, then send the view 200 times and 50 new 1 MiB arrays, checking each and "
                               "timing the round trips. Exit 0 when every check passed, 1 otherwise (also where no "
                               "GPU can be used).")
    doctor = sub.add_parser("doctor", help="say what this host can do with CUDA IPC, and why (exit 1 if it cannot)",
                            description="Report what this host can do with CUDA IPC and why: platform, GPUs, versions, "
                                        "peer access, segments, ptrace, start method, open-file limit, and a round "
                                        "trip of each sharing mode on each GPU. Exit 0 when every available mode works, "
                                        "1 otherwise (also where no GPU can be used; --json still prints the report).")
    doctor.add_argument("--json", action="store_true", help="print the report as one line of JSON")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo()
    return run_doctor(as_json=args.json)


def _run() -> int:
    try:
        code = main()
        if sys.stdout is not None:  # None where descriptor 1 was closed (`>&-`): print() wrote nothing
            sys.stdout.flush()  # here, where a reader that went away (`| head`) can be told apart
    except BrokenPipeError:
        # Not an error of this command: no traceback. Python flushes stdout again at exit, into nothing now.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    sys.exit(_run())
