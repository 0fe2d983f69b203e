"""The cross-device open matrix: for every ordered pair of GPUs (i, j), a consumer on GPU j opens an array of
GPU i, checks its values and times a read kernel over it.

The producer (this process) makes one array per GPU, each filled with its GPU's number; one consumer process
opens each on each GPU (``open(device=j)``: the same GPU, or a peer mapping) and reports GB/s, or why the pair
cannot map (no peer access). Usage::

    python benchmarks/peer_matrix.py [--bytes 256MiB] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bandwidth import _read_gbps  # noqa: E402 - the benchmark modules sit next to this script
from roundtrip import in_consumer, no_gpu, parse_size  # noqa: E402


def _consumer(handles: list[bytes], reps: int, conn: Any) -> None:
    try:
        import cupy

        import cupy_ipc

        n = cupy.cuda.runtime.getDeviceCount()
        cells: list[list[Any]] = [[None] * n for _ in range(n)]
        for i, data in enumerate(handles):
            h = cupy_ipc.IpcArrayHandle.from_bytes(data)
            for j in range(n):
                with cupy.cuda.Device(j):
                    try:
                        a = h.open(device=j)
                    except cupy_ipc.IpcError as e:
                        cells[i][j] = {"error": str(e)}
                        continue
                    values_ok = bool((a == i).all())
                    cells[i][j] = {"gbps": round(_read_gbps(a.data.ptr, a.nbytes, reps), 1), "values_ok": values_ok}
                    del a
            h.close()
        conn.send(("ok", cells))
    except Exception as e:  # noqa: BLE001 - reported by the caller
        conn.send(("err", f"{type(e).__name__}: {e}"))


def run(nbytes: int = 256 << 20, reps: int = 10) -> list[list[Any]]:
    """``cells[i][j]``: GPU j reading GPU i's array, ``{"gbps", "values_ok"}`` or ``{"error"}``."""
    import cupy

    import cupy_ipc

    n = cupy.cuda.runtime.getDeviceCount()
    arrays, handles = [], []
    for i in range(n):
        with cupy.cuda.Device(i):
            a = cupy.full(nbytes // 4, i, dtype=cupy.float32)
            cupy.cuda.get_current_stream().synchronize()
            arrays.append(a)
            handles.append(cupy_ipc.get_ipc_handle(a, consumers=n).to_bytes())
    try:
        return in_consumer(_consumer, (handles, reps), 900, "the peer-matrix consumer")
    finally:
        for data in handles:  # each allowed n opens; end the pins now
            cupy_ipc.IpcArrayHandle.from_bytes(data).release()


def markdown(cells: list[list[Any]]) -> str:
    n = len(cells)
    lines = ["| memory on ↓ / read by → | " + " | ".join(f"GPU {j}" for j in range(n)) + " |",
             "|---|" + "---:|" * n]
    for i, row in enumerate(cells):
        shown = []
        for c in row:
            if "error" in c:
                shown.append("no peer access" if "no peer access" in c["error"] else f"failed: {c['error']}")
            else:
                shown.append(f"{c['gbps']:.0f} GB/s" + ("" if c["values_ok"] else " (WRONG VALUES)"))
        lines.append(f"| GPU {i} | " + " | ".join(shown) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", default="256MiB")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if no_gpu("peer_matrix"):
        return 1
    cells = run(parse_size(args.bytes))
    print(markdown(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(cells, f, indent=1)
    wrong = [(i, j) for i, row in enumerate(cells) for j, c in enumerate(row) if not c.get("values_ok", True)]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
