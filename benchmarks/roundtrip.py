"""Per-message round trip of a GPU buffer between two processes, side by side.

The producer (this process) sends a buffer through a ``spawn``
``multiprocessing.Queue``; the consumer maps it, reads one element, closes it
and acknowledges on a second queue. One message = put → open → read → close →
ack, timed by the producer. Methods:

- ``bare``: a 200-byte message, no GPU work (the queue's own floor);
- ``raw``: CuPy runtime calls by hand (``ipcGetMemHandle``/``ipcOpenMemHandle``),
  no keep-alive and no ordering: the floor for zero-copy sharing (the producer
  synchronizes each buffer's fill, untimed, as its user would have to; the
  consumer closes its cached mappings before the producer frees the buffers);
- ``cupy_ipc``: ``get_ipc_handle``/``IpcArrayHandle.open`` with keep-alive and
  ordering on (the defaults), the handle's bytes on the queue;
- ``cupy_ipc-nosync``, ``cupy_ipc-nokeep``, ``cupy_ipc-unsafe`` (only when
  named): as ``cupy_ipc`` with ordering, keep-alive or both off, to show what
  each costs (the producer synchronizes a fresh buffer, untimed, when ordering
  is off);
- ``mp``: the array itself on a queue, through ``cupy_ipc.multiprocessing``
  (the same guarantees; the array is pickled by handle);
- ``pool``: as ``mp``, with arrays of a ``cupy_ipc.ShareableMemoryPool``
  (shared by file descriptor: the pool once, then a handle with 64 bytes of export data per array);
- ``vmm``: as ``mp``, with arrays of CUDA's virtual memory API (one
  descriptor per allocation);
- ``mp-eager`` (only when named): as ``mp``, with each export's sweep (which
  ends the pins of finished exports) made while its message is pickled, as
  the library did before 2026-12-03, to show what making it once the message
  has left saves;
- ``torch``: ``torch.multiprocessing`` with a CUDA tensor (when installed);
- ``staging``: ``cupy.asnumpy`` → queue → ``cupy.asarray``.

*fresh*: every message is a new allocation the consumer has never mapped (the
previous one is freed, untimed, after its ack). *re-sent*: the same buffer
every message, so handles and mappings may be reused where a method can.

The methods run in ``--rounds`` rounds, in an order that gives each method
the same mean position over each pair of rounds (see :func:`order`), and the
samples of all rounds are pooled: a machine whose speed drifts during the run
then shifts every method alike, and the ratios stay fair. Each method gets one
consumer process per round, which serves all its sizes. Re-sent cases get three
warm-up messages at least (a re-sent buffer takes its fastest path from its
third message on), and fresh ones run at most 8 GiB of buffers per case.

Usage::

    python benchmarks/roundtrip.py --sizes 4KiB,1MiB,64MiB,1GiB --iters 1500 --json results.json

``--profile`` runs each side's per-message work under ``cProfile`` and prints
where the time goes, per method (timings are then not comparable).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing
import os
import platform
import statistics
import struct
import sys
import time
from collections.abc import Collection
from typing import Any

METHODS = ("bare", "raw", "cupy_ipc", "mp", "pool", "vmm", "torch", "staging")
# cupy_ipc with parts of its safety off, to see what each costs (not in the default list):
# get_ipc_handle's keyword arguments by method.
VARIANTS = {"cupy_ipc-nosync": {"sync": False}, "cupy_ipc-nokeep": {"keepalive": False},
            "cupy_ipc-unsafe": {"sync": False, "keepalive": False}}
# mp with each export's sweep made while its message is pickled, as before 2026-12-03, to show what making it
# once the message has left saves (not in the default list either).
EAGER = "mp-eager"
BY_MODULE = ("mp", "pool", "vmm", EAGER)  # the array itself on a queue of cupy_ipc.multiprocessing
SENT_WHOLE = ("torch", *BY_MODULE)  # the array itself on the queue
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
FLUSH = "flush"  # to a consumer: close the mappings kept for re-sent buffers, which are about to be freed


def parse_size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def size_label(n: int) -> str:
    for unit, factor in reversed(UNITS.items()):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit}"
    return f"{n} B"


_PROFILE = "ROUNDTRIP_PROFILE"  # set: both sides profile their per-message work


def _profiler() -> cProfile.Profile | None:
    return cProfile.Profile() if os.environ.get(_PROFILE) else None


def _print_profile(profiler: cProfile.Profile | None, title: str) -> None:
    if profiler is None:
        return
    import pstats

    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    print(f"===== profile: {title} =====\n{out.getvalue()}", flush=True)


# --- raw runtime calls, the floor every method is compared with -----------------------
def open_raw(handle: bytes, nbytes: int, resent: bool, mapped: dict[bytes, int]) -> tuple[Any, int]:
    """``(float32 array, pointer)`` of a legacy handle; a re-sent handle's mapping is cached in ``mapped``."""
    import cupy

    ptr = mapped.get(handle) if resent else None
    if ptr is None:
        ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        if resent:
            mapped[handle] = ptr
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, None)
    return cupy.ndarray((nbytes // 4,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0)), ptr


def close_raw(ptr: int, resent: bool) -> None:
    """Unmap a fresh buffer's mapping (a re-sent one's stays cached); its arrays must be gone."""
    if not resent:
        import cupy

        cupy.cuda.runtime.ipcCloseMemHandle(ptr)


def raw_handle(arr: Any, resent: bool, cache: dict[str, Any]) -> bytes:
    """The legacy handle of ``arr``'s memory; a re-sent buffer's is cached in ``cache``."""
    handle = cache.get("handle") if resent else None
    if handle is None:
        import cupy

        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(arr.data.ptr))
        if resent:
            cache["handle"] = handle
    return handle


# --- the consumer ---------------------------------------------------------------
def load_reductions(methods: Collection[str]) -> None:
    """Register the picklers that messages of ``methods`` need on either side: torch's for tensors,
    ``cupy_ipc.multiprocessing``'s for arrays (so that results would travel by handle too)."""
    if "torch" in methods:
        import torch  # noqa: F401 - importing torch registers its reductions
    if not set(BY_MODULE).isdisjoint(methods):
        import cupy_ipc.multiprocessing  # noqa: F401


def consumer(method: str, inbox: Any, outbox: Any) -> None:
    load_reductions((method,))
    mapped: dict[bytes, int] = {}
    profiler = _profiler()
    while True:
        if profiler is not None:  # before get(): arrays from a queue are opened while unpickled (the wait shows too)
            profiler.enable()
        msg = inbox.get()
        if msg is None:
            break
        if isinstance(msg, str) and msg == FLUSH:  # the producer frees its buffers next: close what raw keeps mapped
            for ptr in mapped.values():
                close_raw(ptr, False)
            mapped.clear()
            outbox.put(FLUSH)
            continue
        value = consume(method, msg, mapped)
        del msg
        if profiler is not None:
            profiler.disable()
        outbox.put(value)
    if profiler is not None:
        profiler.disable()
    _print_profile(profiler, f"{method} consumer")


def consume(method: str, msg: Any, mapped: dict[bytes, int]) -> float:
    """Open one message of ``method``, read its first element, close it; the value read."""
    if method == "bare":
        return float(len(msg))
    if method == "raw":
        handle, nbytes, resent = msg
        arr, ptr = open_raw(handle, nbytes, resent, mapped)
        value = float(arr[0])
        del arr
        close_raw(ptr, resent)
        return value
    if method == "cupy_ipc" or method in VARIANTS:
        from cupy_ipc import IpcArrayHandle

        with IpcArrayHandle.from_bytes(msg) as arr:
            value = float(arr[0])
        del arr
        return value
    if method in SENT_WHOLE:
        return float(msg[0])  # the caller drops the message, and with it the array
    import cupy

    arr = cupy.asarray(msg)  # staging
    return float(arr[0])


# --- the producer -----------------------------------------------------------------
def _message(method: str, arr: Any, resent: bool, cache: dict[str, Any]) -> Any:
    import cupy

    if method == "bare":
        return b"x" * 200
    if method == "raw":
        return (raw_handle(arr, resent, cache), arr.nbytes, resent)
    if method == "cupy_ipc" or method in VARIANTS:
        import cupy_ipc

        return cupy_ipc.get_ipc_handle(arr, **VARIANTS.get(method, {})).to_bytes()
    if method in SENT_WHOLE:
        if method in BY_MODULE:
            _sweep_order(method)
        return arr
    return cupy.asnumpy(arr)


class _NeverDeferred:
    """Stands for ``cupy_ipc._keepalive.deferral`` in mp-eager's messages: never on, so that each export sweeps
    as it pins."""

    on = property(lambda self: False, lambda self, value: None)


_deferral: list[Any] = []  # cupy_ipc's own, once swapped out


def _sweep_order(method: str) -> None:
    """Make the exports of the messages to come sweep as ``method``'s do: while pickled (mp-eager), or once
    their message has left (the library's way, every other method's)."""
    from cupy_ipc import _keepalive

    if not _deferral:
        _deferral.append(_keepalive.deferral)
    _keepalive.deferral = _NeverDeferred() if method == EAGER else _deferral[0]


def fill(ptr: int, nbytes: int, value: float, stream: int) -> None:
    """Queue the filling of ``nbytes`` at ``ptr`` with float32 ``value`` on ``stream``, by the driver's memset.

    Every method's buffers are filled by this one call, because a fresh message waits for its buffer's fill:
    on an H200, CuPy's fill kernel took 1.27 ms for 1 GiB where PyTorch's and this memset took 0.24 ms.
    """
    from cupy_ipc._cuda import _driver, check

    (pattern,) = struct.unpack("<I", struct.pack("<f", value))
    (err,) = _driver().cuMemsetD32Async(ptr, pattern, nbytes // 4, stream)
    check("filling a buffer", err)


def new_buffer(method: str, nbytes: int, value: int) -> Any:
    """A float32 buffer of ``nbytes`` filled with ``value`` (queued, not waited for), of ``method``'s kind."""
    import cupy

    if method == "torch":
        import torch

        t = torch.empty((nbytes // 4,), dtype=torch.float32, device="cuda")
        fill(t.data_ptr(), nbytes, value, torch.cuda.current_stream().cuda_stream)
        return t
    if method == "pool":
        with cupy.cuda.using_allocator(_shareable_pool().malloc):
            arr = cupy.empty(nbytes // 4, cupy.float32)
    elif method == "vmm":
        from cupy_ipc import _vmm

        with cupy.cuda.using_allocator(_vmm.allocate):
            arr = cupy.empty(nbytes // 4, cupy.float32)
    else:
        arr = cupy.empty(nbytes // 4, cupy.float32)
    fill(arr.data.ptr, nbytes, value, cupy.cuda.get_current_stream().ptr)
    return arr


def unordered(method: str) -> bool:
    """Whether ``method`` orders nothing (raw calls, and the variants without ordering): its user owes a
    synchronize before sending, which these loops make untimed."""
    return method == "raw" or VARIANTS.get(method, {}).get("sync") is False


def fresh_buffer(method: str, nbytes: int) -> Any:
    """A new buffer of ones for one message; synchronized, untimed, for a method without ordering."""
    arr = new_buffer(method, nbytes, 1)
    if unordered(method):
        import cupy

        cupy.cuda.get_current_stream().synchronize()
    return arr


_pool: list[Any] = []


def _shareable_pool() -> Any:
    if not _pool:
        import cupy_ipc

        _pool.append(cupy_ipc.ShareableMemoryPool())
    return _pool[0]


def free_buffers(method: str) -> None:
    # Untimed: give the memory back so the next fresh buffer is a new allocation. A cupy_ipc pin ends at the
    # next export's sweep, timed as in a pipeline; its buffer goes to CuPy's pool then, and is freed here
    # after that message, while that message's buffer is already allocated. The pools and virtual memory,
    # whose allocations could come back at once, are let go here.
    import cupy

    if method in ("pool", "vmm"):
        import cupy_ipc

        cupy_ipc.collect()
    if method == "torch":
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    cupy.cuda.runtime.deviceSynchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    if method == "pool":
        _shareable_pool().free_all_blocks()


def receive(source: Any, proc: Any, timeout: float, who: str) -> Any:
    """The next message from a ``Connection`` or ``Queue``, or an error once ``proc`` died or ``timeout`` passed."""
    import queue

    deadline = time.monotonic() + timeout
    while True:
        if hasattr(source, "poll"):
            if source.poll(0.5):
                return source.recv()
        else:
            try:
                return source.get(timeout=0.5)
            except queue.Empty:
                pass
        if not proc.is_alive():
            raise RuntimeError(f"{who} (pid {proc.pid}) died with exit code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{who} (pid {proc.pid}) did not answer within {timeout:.0f} s")


def in_consumer(target: Any, args: tuple[Any, ...], timeout: float, who: str) -> Any:
    """Run ``target(*args, conn)`` in a spawned process that answers ``("ok", value)`` or ``("err", text)``
    on ``conn``; its value, or ``RuntimeError``."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    child.close()  # so that a consumer that dies ends our wait
    try:
        status, out = receive(conn, proc, timeout, who)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if status == "err":
        raise RuntimeError(out)
    return out


def _context(method: str) -> Any:
    if method == "torch":
        import torch.multiprocessing as tmp

        return tmp.get_context("spawn")
    if method in BY_MODULE:
        import cupy_ipc.multiprocessing as cmp

        return cmp.get_context("spawn")
    return multiprocessing.get_context("spawn")


def measure(method: str, cases: list[tuple[int, bool, int, int]], report: Any) -> None:
    """Time ``(nbytes, resent, iters, warmup)`` cases with one consumer; ``report(case, seconds)``."""
    ctx = _context(method)
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(method, inbox, outbox), daemon=True)
    proc.start()
    profiler = _profiler()
    try:
        for nbytes, resent, iters, warmup in cases:
            times: list[float] = []
            cache: dict[str, Any] = {}
            arr = new_buffer(method, nbytes, 1) if resent else None
            if resent and unordered(method):
                import cupy

                cupy.cuda.runtime.deviceSynchronize()
            for i in range(warmup + iters):
                if not resent:
                    arr = fresh_buffer(method, nbytes)
                if profiler is not None:
                    profiler.enable()
                t = time.perf_counter()
                inbox.put(_message(method, arr, resent, cache))
                value = receive(outbox, proc, 600, f"the {method} consumer")
                elapsed = time.perf_counter() - t
                if profiler is not None:
                    profiler.disable()
                if method != "bare" and value != 1.0:
                    raise RuntimeError(f"{method}: consumer read {value}, expected 1.0")
                if i >= warmup:
                    times.append(elapsed)
                if not resent:
                    arr = None
                    free_buffers(method)
            arr = None
            if resent and method == "raw":
                inbox.put(FLUSH)
                receive(outbox, proc, 600, f"the {method} consumer")
            free_buffers(method)
            report((nbytes, method, resent), times)
        _print_profile(profiler, f"{method} producer")
    finally:
        inbox.put(None)
        proc.join(10)
        if proc.is_alive():
            print(f"{method}: the consumer did not exit within 10 s; killed", file=sys.stderr, flush=True)
            proc.kill()


def no_gpu(prog: str) -> bool:
    """Whether no GPU can run a benchmark here; if so, says why on stderr as ``prog``'s (its exit status: 1)."""
    from cupy_ipc._cuda import unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"{prog}: no GPU: {reason}", file=sys.stderr)
    return bool(reason)


def unavailable(method: str) -> str | None:
    """Why ``method`` cannot run here, or ``None``."""
    if method != "torch":
        return None
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    return None if torch.cuda.is_available() else "PyTorch sees no CUDA device"


def runnable(methods: list[str]) -> list[str]:
    """``methods`` less those that cannot run here, each of those named on stderr with the reason."""
    kept = []
    for method in methods:
        reason = unavailable(method)
        if reason is None:
            kept.append(method)
        else:
            print(f"{method}: left out ({reason})", file=sys.stderr, flush=True)
    return kept


def environment() -> dict[str, Any]:
    import cupy

    import cupy_ipc

    props = cupy.cuda.runtime.getDeviceProperties(0)
    env = {
        "gpu": props["name"].decode(),
        "driver": cupy.cuda.runtime.driverGetVersion(),
        "runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cupy": cupy.__version__,
        "cupy_ipc": cupy_ipc.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        pass
    return env


def summary(t: list[float]) -> dict[str, float]:
    """Median, 10th and 90th percentiles of times in seconds, in µs."""
    return {
        "median_us": statistics.median(t) * 1e6,
        "p10_us": statistics.quantiles(t, n=10)[0] * 1e6 if len(t) >= 10 else min(t) * 1e6,
        "p90_us": statistics.quantiles(t, n=10)[-1] * 1e6 if len(t) >= 10 else max(t) * 1e6,
    }


def order(methods: list[str], r: int) -> list[str]:
    """The methods in round ``r``: rotated by ``r // 2``, reversed in odd rounds, so that each pair of rounds
    gives every method the same mean position (a machine drifting within a round then shifts all alike).

    Example:
        >>> [order(["a", "b", "c"], r) for r in range(4)]
        [['a', 'b', 'c'], ['c', 'b', 'a'], ['b', 'c', 'a'], ['a', 'c', 'b']]
    """
    k = (r // 2) % len(methods)
    rotated = methods[k:] + methods[:k]
    return rotated if r % 2 == 0 else rotated[::-1]


def run(sizes: list[int], methods: list[str], iters: int, rounds: int, warmup: int) -> list[dict[str, Any]]:
    """Every (size, method, fresh/re-sent) case, in rotated rounds; one result row per case."""
    unknown = [m for m in methods if m not in METHODS and m not in VARIANTS and m != EAGER]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}: choose from "
                         f"{', '.join((*METHODS, *VARIANTS, EAGER))}")
    methods = runnable(methods)
    cases = [(nbytes, method, resent) for nbytes in sizes for method in methods for resent in (False, True)
             if not (method == "bare" and resent)]
    samples: dict[tuple[int, str, bool], list[float]] = {case: [] for case in cases}
    for r in range(rounds):
        for method in order(methods, r):
            todo = []
            for nbytes, m, resent in cases:
                if m != method:
                    continue
                total = iters
                if not resent or method == "staging":  # each message fills (or copies) a whole buffer
                    total = max(3, min(iters, (8 << 30) // max(nbytes, 1) // (1 if method != "staging" else 8)))
                n = max(1, total // rounds)
                # A re-sent buffer takes its fastest path from its third message on (cupy_ipc keeps a mapping
                # idle once released twice): three warm-up messages at least.
                todo.append((nbytes, resent, n, max(3 if resent else 1, min(warmup, n // 10))))

            def report(case: tuple[int, str, bool], t: list[float], r: int = r) -> None:
                samples[case].extend(t)
                nbytes, method, resent = case
                print(f"round {r + 1}/{rounds} {size_label(nbytes):>8} {method:<9} "
                      f"{'re-sent' if resent else 'fresh':<8} median {statistics.median(t) * 1e6:10.1f} us "
                      f"({len(t)} messages)", flush=True)

            measure(method, todo, report)
    return [{"method": method, "bytes": nbytes, "resent": resent, "iters": len(t), **summary(t)}
            for (nbytes, method, resent), t in samples.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1MiB", help="comma-separated sizes, e.g. 4KiB,1MiB,64MiB")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"of {', '.join(METHODS)}; also {', '.join(VARIANTS)} (cupy_ipc with safety parts off) "
                             f"and {EAGER} (mp, each export's sweep made before the message leaves)")
    parser.add_argument("--iters", type=int, default=1000, help="messages per case, over all rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--profile", action="store_true", help="profile both sides' per-message work")
    args = parser.parse_args(argv)
    if args.profile:
        os.environ[_PROFILE] = "1"  # the spawned consumers inherit it

    if no_gpu("roundtrip"):
        return 1
    results = run([parse_size(s) for s in args.sizes.split(",")], args.methods.split(","), args.iters,
                  args.rounds, args.warmup)
    doc = {"environment": environment(), "results": results}
    table = markdown(doc)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    return 0


def markdown(doc: dict[str, Any]) -> str:
    """Median round trips per size and method, with ratios against cupy_ipc."""
    rows = doc["results"]
    lines = ["| size | kind | method | median µs | p10–p90 µs | ÷ cupy_ipc |", "|---|---|---|---:|---:|---:|"]
    ours = {(r["bytes"], r["resent"]): r["median_us"] for r in rows if r["method"] == "cupy_ipc"}
    for r in rows:
        ref = ours.get((r["bytes"], r["resent"]))
        ratio = f"{r['median_us'] / ref:.2f}×" if ref else ""
        kind = "re-sent" if r["resent"] else ("message" if r["method"] == "bare" else "fresh")
        lines.append(f"| {size_label(r['bytes'])} | {kind} | {r['method']} | {r['median_us']:.1f} | "
                     f"{r['p10_us']:.0f}–{r['p90_us']:.0f} | {ratio} |")
    median = {(r["method"], r["bytes"], r["resent"]): r["median_us"] for r in rows}
    lines += ["", "| size | kind | cupy_ipc ÷ raw | torch ÷ cupy_ipc | staging ÷ cupy_ipc | mp ÷ raw "
              "| torch ÷ mp | staging ÷ mp | pool ÷ mp | vmm ÷ mp |", "|---|---|" + "---:|" * 8]
    # Every case some method ran (not only those cupy_ipc ran: mp ÷ raw, torch ÷ mp, ... stand without it).
    for nbytes, resent in dict.fromkeys((r["bytes"], r["resent"]) for r in rows if r["method"] != "bare"):
        cells = []
        for num, den in (("cupy_ipc", "raw"), ("torch", "cupy_ipc"), ("staging", "cupy_ipc"),
                         ("mp", "raw"), ("torch", "mp"), ("staging", "mp"), ("pool", "mp"), ("vmm", "mp")):
            a, b = median.get((num, nbytes, resent)), median.get((den, nbytes, resent))
            cells.append(f"{a / b:.2f}" if a and b else "")
        lines.append(f"| {size_label(nbytes)} | {'re-sent' if resent else 'fresh'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
