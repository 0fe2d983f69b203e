"""Run every notebook in notebooks/ top to bottom with nbclient; exit 1 if a cell fails.

Each notebook runs in its own directory, so that it imports the worker
modules kept next to it. ``--write DIR`` saves the executed notebooks there
(commit those). Usage: ``python scripts/run_notebooks.py [--write DIR] [paths...]``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time


def main(argv: list[str]) -> int:
    import nbclient
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", help="directory for the executed notebooks")
    parser.add_argument("paths", nargs="*")
    args = parser.parse_args(argv)
    root = pathlib.Path(__file__).resolve().parent.parent
    paths = [pathlib.Path(p) for p in args.paths] or sorted((root / "notebooks").glob("*.ipynb"))
    failed = 0
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        t = time.perf_counter()
        try:
            nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                    resources={"metadata": {"path": str(path.parent)}}).execute()
        except Exception as e:  # a failing cell: report it, go on with the others
            failed += 1
            print(f"FAILED {path.name} ({time.perf_counter() - t:.1f} s): {type(e).__name__}: {e}", flush=True)
        else:
            print(f"ok     {path.name} ({time.perf_counter() - t:.1f} s)", flush=True)
        if args.write:  # failed ones too: their error outputs say what went wrong
            pathlib.Path(args.write).mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, pathlib.Path(args.write) / path.name)
    print(f"notebooks: {len(paths) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
