"""Where one message's time goes, step by step, on each side (not a benchmark of the whole).

The producer (this process) sends a 1 MiB array's handle over a ``Pipe`` to a
spawned consumer, which opens it, reads one element, closes it and answers with
how long each of its steps took. Both sides also time named library functions
(wrapped for the run), summed per message. Printed: the median per step and
function, for each method (``raw`` calls, ``cupy_ipc`` with safety on,
``cupy_ipc-unsafe`` with it off, and ``pool``: arrays of a
``ShareableMemoryPool``, safety on) and for fresh and re-sent buffers.

Usage::

    python benchmarks/steps.py --iters 300
"""

from __future__ import annotations

import argparse
import collections
import importlib
import multiprocessing
import statistics
import sys
import time
from typing import Any

PRODUCER = ("_array_handle._template", "_array_handle._memory_handle", "_cuda.pointer_info", "_keepalive.pin",
            "_keepalive.sweep", "_cuda.stream_idle", "_events.IpcEvent.get_ipc_handle", "_array_handle.splice",
            "_segment.own_segment")
CONSUMER = ("_array_handle.check_same_host", "_cuda.ordinal_of_uuid", "_array_handle._default_device",
            "_cuda.can_access_peer", "_segment.attach", "_mapping.acquire", "_mapping._claim", "_mapping._map",
            "_mapping._import", "_mapping._checked", "_array_handle.open_cached", "_events.IpcEvent.query",
            "_events.IpcEvent.wait_from", "_mapping._release", "_cuda.stream_idle", "_mapping._finish",
            "_mapping._trim_idle", "_pools.import_pointer", "_pools.free_imported")
# get_ipc_handle's options by method (None: raw runtime calls); "pool": arrays of a ShareableMemoryPool.
METHODS = {"raw": None, "cupy_ipc": {}, "cupy_ipc-unsafe": {"sync": False, "keepalive": False}, "pool": {}}


def instrument(names: tuple[str, ...]) -> "collections.Counter[str]":
    """Wrap ``cupy_ipc.<module>.<attr>[.<attr>]`` functions to add their time (ns) to the returned counter."""
    spent: collections.Counter[str] = collections.Counter()
    for name in names:
        module, *path = name.split(".")
        owner = importlib.import_module(f"cupy_ipc.{module}")
        for attr in path[:-1]:
            owner = getattr(owner, attr)
        fn = getattr(owner, path[-1])

        def timed(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            t = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter_ns() - t

        setattr(owner, path[-1], timed)
    return spent


class Laps:
    """``lap(step)`` records the time since the last lap (or since creation) under ``step``."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}
        self.t = time.perf_counter_ns()

    def __call__(self, step: str) -> None:
        now = time.perf_counter_ns()
        self.steps[step], self.t = now - self.t, now


def consumer(conn: Any, idle: int | None, no_gc: bool) -> None:
    import gc

    import cupy

    import cupy_ipc
    from cupy_ipc import IpcArrayHandle

    if no_gc:
        gc.disable()
    if idle is not None:
        cupy_ipc.set_idle_mapping_limit(idle)
    spent = instrument(CONSUMER)
    mapped: dict[bytes, int] = {}
    while (msg := conn.recv()) is not None:
        method, data, nbytes, resent = msg
        spent.clear()
        lap = Laps()
        if method == "raw":
            ptr = mapped.get(data) if resent else None
            if ptr is None:
                ptr = cupy.cuda.runtime.ipcOpenMemHandle(data)
                if resent:
                    mapped[data] = ptr
            arr = cupy.ndarray((nbytes // 4,), cupy.float32,
                               cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, nbytes, None), 0))
        else:
            h = IpcArrayHandle.from_bytes(data)
            lap("parse")
            arr = h.open()
        lap("open")
        value = float(arr[0])
        lap("read")
        if method == "raw":
            del arr
            if not resent:
                cupy.cuda.runtime.ipcCloseMemHandle(ptr)
        else:
            h.close()
            del arr
        lap("close")
        conn.send((value, lap.steps, dict(spent)))


def run(iters: int, nbytes: int, idle: int | None = None,
        no_gc: bool = False) -> dict[tuple[str, bool], dict[str, list[float]]]:
    import gc

    import cupy

    import cupy_ipc

    if no_gc:
        gc.disable()
    spent = instrument(PRODUCER)
    pool = cupy_ipc.ShareableMemoryPool()

    def new() -> Any:
        with cupy.cuda.using_allocator(pool.malloc if method == "pool" else None):
            return cupy.full(nbytes // 4, 1, cupy.float32)

    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=consumer, args=(child, idle, no_gc), daemon=True)
    proc.start()
    out: dict[tuple[str, bool], dict[str, list[float]]] = {}
    try:
        for method, options in METHODS.items():
            for resent in (False, True):
                rows: dict[str, list[float]] = collections.defaultdict(list)
                arr = new()
                cached = None
                for i in range(iters + 20):
                    if not resent:
                        arr = new()
                    spent.clear()
                    t0 = time.perf_counter_ns()
                    if options is None:
                        data = cached if resent and cached else bytes(cupy.cuda.runtime.ipcGetMemHandle(arr.data.ptr))
                        cached = data
                    else:
                        data = cupy_ipc.get_ipc_handle(arr, **options).to_bytes()
                    t1 = time.perf_counter_ns()
                    conn.send((method, data, nbytes, resent))
                    value, steps, theirs = conn.recv()
                    t2 = time.perf_counter_ns()
                    if value != 1.0:
                        raise RuntimeError(f"{method}: read {value}")
                    if i < 20:
                        continue
                    rows["producer: export"].append(t1 - t0)
                    rows["round trip"].append(t2 - t0)
                    for k, v in steps.items():
                        rows[f"consumer: {k}"].append(v)
                    for k, v in spent.items():
                        rows[f"  producer {k}"].append(v)
                    for k, v in theirs.items():
                        rows[f"  consumer {k}"].append(v)
                    if not resent:
                        del arr
                        cupy_ipc.collect()
                        cupy.get_default_memory_pool().free_all_blocks()
                        pool.free_all_blocks()
                out[(method, resent)] = rows
    finally:
        conn.send(None)
        proc.join(10)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--bytes", type=int, default=1 << 20)
    parser.add_argument("--idle", type=int, help="the consumer's idle mapping limit (default: the library's)")
    parser.add_argument("--no-gc", action="store_true", help="both sides run with the garbage collector off")
    args = parser.parse_args(argv)
    from cupy_ipc._cuda import unavailable_reason

    if reason := unavailable_reason():
        print(f"steps: no GPU: {reason}", file=sys.stderr)
        return 1
    for (method, resent), rows in run(args.iters, args.bytes, args.idle, args.no_gc).items():
        print(f"\n{method}, {'re-sent' if resent else 'fresh'}: median µs (messages where the step ran)")
        for name, values in rows.items():
            print(f"  {name:<48} {statistics.median(values) / 1e3:9.1f}  ({len(values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
