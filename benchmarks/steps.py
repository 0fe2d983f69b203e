"""Where one message's time goes, step by step, on each side (not a benchmark of the whole).

The producer (this process) sends a 1 MiB array's handle over a ``Pipe`` to a
spawned consumer, which opens it, reads one element, closes it and answers with
how long each of its steps took. Both sides also time named library functions
(wrapped for the run), summed per message. Printed: the median per step and
function, for each method (``raw`` calls, ``cupy_ipc`` with safety on,
``cupy_ipc-unsafe`` with it off, ``pool``: arrays of a
``ShareableMemoryPool``, safety on, and ``torch``: a CUDA tensor pickled as
``torch.multiprocessing`` does, when PyTorch is there) and for fresh and
re-sent buffers.

``--profile`` runs each side's library calls under ``cProfile`` instead of
the step timers and prints, per method and side, the Python calls made per
message and the functions that take the most time of their own.

Usage::

    python benchmarks/steps.py --iters 300
"""

from __future__ import annotations

import argparse
import collections
import importlib
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from roundtrip import (  # noqa: E402 - the benchmark modules sit next to this script
    close_raw,
    free_buffers,
    fresh_buffer,
    new_buffer,
    no_gpu,
    open_raw,
    raw_handle,
    receive,
    runnable,
)

PRODUCER = ("_array_handle._template", "_array_handle._memory_handle", "_cuda.legacy_info", "_cuda.pointer_info",
            "_array_handle.validate_layout", "_array_handle.pack_array", "_array_handle._ById.set",
            "_keepalive.pin", "_keepalive._sweep", "_cuda.stream_idle", "_events.IpcEvent.get_ipc_handle",
            "_array_handle.splice", "_segment.own_segment")
CONSUMER = ("_array_handle.unpack_array", "_array_handle.check_same_host", "_cuda.ordinal_of_uuid",
            "_array_handle._default_device", "_array_handle._open_common", "_cuda.can_access_peer",
            "_segment.attach", "_mapping.acquire", "_mapping._claim", "_mapping._map", "_mapping._import",
            "_mapping._checked", "_array_handle.open_cached", "_events.IpcEvent.query", "_events.IpcEvent.wait_from",
            "_mapping.opened", "_mapping._release", "_cuda.stream_idle", "_mapping._finish", "_mapping._retire",
            "_mapping._Mapping.unmap", "_mapping._unclaim", "_mapping._trim_idle", "_pools.import_pointer",
            "_pools.free_imported")
# get_ipc_handle's options by method (None: raw runtime calls or torch's pickling); "pool": arrays of a
# ShareableMemoryPool.
METHODS = {"raw": None, "cupy_ipc": {}, "cupy_ipc-unsafe": {"sync": False, "keepalive": False}, "pool": {},
           "torch": None}


def instrument(names: tuple[str, ...]) -> "collections.Counter[str]":
    """Wrap ``cupy_ipc.<module>.<attr>[.<attr>]`` functions to add their time (ns) to the returned counter."""
    spent: collections.Counter[str] = collections.Counter()
    for name in names:
        module, *path = name.split(".")
        owner = importlib.import_module(f"cupy_ipc.{module}")
        for attr in path[:-1]:
            owner = getattr(owner, attr)
        fn = getattr(owner, path[-1], None)
        if fn is None:  # an older version of the library, timed against this one
            print(f"steps: cupy_ipc.{name} does not exist here; not timed", file=sys.stderr)
            continue

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


class Profiles:
    """One ``cProfile`` per case, enabled around the library calls of a message (``with profiles(case):``)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.by_case: dict[Any, Any] = {}
        self.case: Any = None

    def __call__(self, case: Any) -> "Profiles":
        self.case = case
        return self

    def __enter__(self) -> None:
        if self.enabled:
            import cProfile

            self.by_case.setdefault(self.case, cProfile.Profile()).enable()

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.by_case[self.case].disable()

    def report(self, side: str, messages: int, top: int = 15) -> None:
        import pstats

        for (method, resent), profile in self.by_case.items():
            # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
            stats = pstats.Stats(profile).stats
            calls = sum(v[1] for v in stats.values())
            print(f"\n{method}, {'re-sent' if resent else 'fresh'}, {side}: {calls / messages:.0f} Python calls "
                  f"per message; own time per message, µs:")
            rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
            for (path, line, name), (n, _, own, cum, _) in rows:
                where = f"{path.rsplit('/', 1)[-1]}:{line}({name})" if line else name
                print(f"  {own / messages * 1e6:8.2f} own {cum / messages * 1e6:8.2f} cum "
                      f"{n / messages:6.2f}x  {where}")
        sys.stdout.flush()


def consumer(conn: Any, idle: int | None, no_gc: bool, profile: bool = False) -> None:
    import gc

    import cupy_ipc

    if no_gc:
        gc.disable()
    if idle is not None:
        cupy_ipc.set_idle_mapping_limit(idle)
    spent = instrument(() if profile else CONSUMER)
    profiles = Profiles(profile)
    mapped: dict[bytes, int] = {}
    counted: collections.Counter[Any] = collections.Counter()
    while (msg := conn.recv()) is not None:
        method, data, nbytes, resent = msg
        spent.clear()
        counted[(method, resent)] += 1
        lap = Laps()
        with profiles((method, resent)):
            value, steps = _consume(method, data, nbytes, resent, mapped, lap)
        conn.send((value, steps, dict(spent)))
    profiles.report("consumer", max(counted.values(), default=1))


def _consume(method: str, data: bytes, nbytes: int, resent: bool, mapped: dict[bytes, int],
             lap: Laps) -> tuple[float, dict[str, int]]:
    from cupy_ipc import IpcArrayHandle

    if method == "raw":
        arr, ptr = open_raw(data, nbytes, resent, mapped)
    elif method == "torch":
        from multiprocessing.reduction import ForkingPickler

        import torch  # noqa: F401 - registers its reductions

        arr = ForkingPickler.loads(data)  # maps the tensor (its handle cached by torch when re-sent)
    else:
        h = IpcArrayHandle.from_bytes(data)
        lap("parse")
        arr = h.open()
    lap("open")
    first = arr[0]
    lap("index")
    value = float(first)
    del first  # a view: it holds the mapping too
    lap("read")
    if method == "raw":
        del arr
        close_raw(ptr, resent)
    elif method == "torch":
        del arr  # torch's own release: a count in shared memory the producer reads
    else:
        h.close()
        del arr
    lap("close")
    return value, lap.steps


def run(iters: int, nbytes: int, idle: int | None = None, no_gc: bool = False,
        profile: bool = False) -> dict[tuple[str, bool], dict[str, list[float]]]:
    import gc

    import cupy_ipc

    if no_gc:
        gc.disable()
    spent = instrument(() if profile else PRODUCER)
    profiles = Profiles(profile)
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=consumer, args=(child, idle, no_gc, profile), daemon=True)
    proc.start()
    child.close()  # ours: a consumer that dies then ends our wait
    out: dict[tuple[str, bool], dict[str, list[float]]] = {}
    try:
        for method in runnable(list(METHODS)):
            options = METHODS[method]
            for resent in (False, True):
                rows: dict[str, list[float]] = collections.defaultdict(list)
                arr = new_buffer(method, nbytes, 1) if resent else None  # "pool": a ShareableMemoryPool's
                cache: dict[str, Any] = {}
                for i in range(iters + 20):
                    if not resent:
                        arr = fresh_buffer(method, nbytes)  # synchronized for a method without ordering
                    spent.clear()
                    t0 = time.perf_counter_ns()
                    if method == "torch":
                        from multiprocessing.reduction import ForkingPickler

                        data = bytes(ForkingPickler.dumps(arr))
                    elif options is None:
                        data = raw_handle(arr, resent, cache)
                    else:
                        with profiles((method, resent)):
                            data = cupy_ipc.get_ipc_handle(arr, **options).to_bytes()
                    t1 = time.perf_counter_ns()
                    conn.send((method, data, nbytes, resent))
                    value, steps, theirs = receive(conn, proc, 600, "the steps consumer")
                    t2 = time.perf_counter_ns()
                    if value != 1.0:
                        raise RuntimeError(f"{method}: read {value}")
                    if i < 20:
                        if not resent:  # as below: else the pool hands a buffer already sent back as "fresh"
                            del arr
                            free_buffers(method)
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
                        free_buffers(method)
                out[(method, resent)] = rows
    finally:
        try:
            conn.send(None)
        except OSError:  # the consumer died: its error is the one to see
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    profiles.report("producer", iters + 20)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--bytes", type=int, default=1 << 20)
    parser.add_argument("--idle", type=int, help="the consumer's idle mapping limit (default: the library's)")
    parser.add_argument("--no-gc", action="store_true", help="both sides run with the garbage collector off")
    parser.add_argument("--profile", action="store_true",
                        help="profile each side's library calls (then the step times include the profiler's cost)")
    args = parser.parse_args(argv)
    if no_gpu("steps"):
        return 1
    for (method, resent), rows in run(args.iters, args.bytes, args.idle, args.no_gc, args.profile).items():
        print(f"\n{method}, {'re-sent' if resent else 'fresh'}: median µs (messages where the step ran)")
        for name, values in rows.items():
            print(f"  {name:<48} {statistics.median(values) / 1e3:9.1f}  ({len(values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
