"""What each call on a message's path costs alone, in one process: the floor under every method's round trip.

A safe message (keep-alive and ordering, ``cupy_ipc``) makes, beyond what raw
calls make, a few CUDA queries (the stream's, the event's), lock tests and
takes on the producer's segment file, and the library's own Python: the
export, the parse, the tables. Each is timed here in a tight loop, medians of
``--repeat`` batches of ``--iters`` calls, so that their sum can be set against
the budget a target leaves (1.2 times a raw round trip, say).

Usage::

    python benchmarks/primitives.py --iters 2000 --repeat 15
"""

from __future__ import annotations

import argparse
import fcntl
import os
import statistics
import struct
import sys
import tempfile
import time
from typing import Any, Callable

_FLOCK = struct.Struct("hhqqi4x")  # struct flock, as the library's segment packs it


def timed(fn: Callable[[], Any], iters: int, repeat: int) -> float:
    """Median µs per call of ``fn`` over ``repeat`` batches of ``iters`` calls (after one batch of warm-up)."""
    per_batch = []
    for r in range(repeat + 1):
        t = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        if r:
            per_batch.append((time.perf_counter_ns() - t) / iters / 1e3)
    return statistics.median(per_batch)


def cases() -> list[tuple[str, Callable[[], Any]]]:
    """``(what, call)`` for each primitive, set up on the current GPU."""
    import cupy
    from cupy.cuda import runtime as rt

    import cupy_ipc

    stream = cupy.cuda.get_current_stream()
    arr = cupy.ones(1 << 18, cupy.float32)  # 1 MiB
    stream.synchronize()
    ev = rt.eventCreateWithFlags(rt.eventInterprocess | rt.eventDisableTiming)
    rt.eventRecord(ev, stream.ptr)
    rt.eventSynchronize(ev)
    fd, path = tempfile.mkstemp(prefix="cupy_ipc-primitives-")
    os.unlink(path)
    os.ftruncate(fd, 4096)
    query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
    take = _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 8, 1, 0)
    drop = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 8, 1, 0)
    ptr, size = arr.data.ptr, arr.nbytes
    safe = cupy_ipc.get_ipc_handle(arr)
    data = safe.to_bytes()
    safe.release()

    def view() -> Any:
        mem = cupy.cuda.UnownedMemory(ptr, size, None, 0)
        return cupy.ndarray((size // 4,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))

    def safe_export() -> None:
        h = cupy_ipc.get_ipc_handle(arr)
        h.to_bytes()
        h.release()  # (no consumer here: its pin ends at once)

    return [
        ("cudaStreamQuery, idle stream", lambda: rt.streamQuery(stream.ptr)),
        ("cudaGetDevice", rt.getDevice),
        ("cupy.cuda.get_current_stream()", cupy.cuda.get_current_stream),
        ("cudaEventQuery, completed event", lambda: rt.eventQuery(ev)),
        ("cudaEventRecord, idle stream", lambda: rt.eventRecord(ev, stream.ptr)),
        ("cudaStreamWaitEvent, completed event", lambda: rt.streamWaitEvent(stream.ptr, ev, 0)),
        ("fcntl F_OFD_GETLK (is the producer alive?)", lambda: fcntl.fcntl(fd, fcntl.F_OFD_GETLK, query)),
        ("fcntl F_OFD_SETLK take and drop (a claim)",
         lambda: (fcntl.fcntl(fd, fcntl.F_OFD_SETLK, take), fcntl.fcntl(fd, fcntl.F_OFD_SETLK, drop))),
        ("UnownedMemory + ndarray of a pointer (raw calls' open too)", view),
        ("float(a[0]) of a 1 MiB array (every method's read)", lambda: float(arr[0])),
        ("get_ipc_handle(a).to_bytes(), re-sent, safe (+ release)", safe_export),
        ("get_ipc_handle(a, keepalive=False, sync=False).to_bytes()",
         lambda: cupy_ipc.get_ipc_handle(arr, keepalive=False, sync=False).to_bytes()),
        ("IpcArrayHandle.from_bytes(), a layout seen before", lambda: cupy_ipc.IpcArrayHandle.from_bytes(data)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args(argv)
    from roundtrip import no_gpu  # (next to this script)

    if no_gpu("primitives"):
        return 1
    for what, fn in cases():
        print(f"  {what:<64} {timed(fn, args.iters, args.repeat):8.2f} µs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
