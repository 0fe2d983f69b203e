"""``python -m cupy_ipc demo``: share an array and events with a consumer process."""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import time
from typing import Any, Callable, TypeVar

from ._cuda import unavailable_reason

__all__ = ["run_demo"]

T = TypeVar("T")

RESENT = 200  # messages of the same array, for the steady-state round trip
FRESH = 50  # messages of a new array each


def _warm_kernels() -> None:
    """Create this process's CUDA context and load the kernels the demo runs (a sum, a fill, a multiply), so
    that the times shown are the library's and not CUDA's one-time start (hundreds of milliseconds)."""
    import cupy

    w = cupy.ones(8, cupy.float32)
    w *= 2
    w[:2] = -1
    float(w.sum())


def _consumer(conn: Any) -> None:
    """The consumer process: open what arrives, check it, answer."""
    from . import IpcArrayHandle, IpcEvent, IpcEventHandle

    try:
        t = time.perf_counter()
        _warm_kernels()
        conn.send(("ready", time.perf_counter() - t))
        h = arr = done = None
        while (msg := conn.recv()) is not None:
            tag = msg[0]
            if tag == "open":  # keep it open for the exchange of events
                t = time.perf_counter()
                h = IpcArrayHandle.from_bytes(msg[1])
                arr = h.open()  # the current stream waits for the producer's work on the GPU
                opened = time.perf_counter() - t
                conn.send(("opened", opened, float(arr.sum())))
            elif tag == "event":  # ordering by hand: wait for the producer's second write, answer with our event
                IpcEventHandle.from_bytes(msg[1]).open().wait()
                doubled = float(arr.sum())
                arr[0, :] = -1
                done = IpcEvent()
                done.record()
                conn.send(("doubled", doubled, done.get_ipc_handle().to_bytes()))
            elif tag == "close":  # the producer has waited on our event
                h.close()
                h = arr = None
                done.close()
                conn.send(("closed",))
            else:  # "read": one message of a pipeline: open, read one value, close
                with IpcArrayHandle.from_bytes(msg[1]) as a:
                    value = float(a[(0,) * a.ndim])
                del a
                conn.send(("value", value))
    except Exception as e:  # send it back rather than die silently
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:  # the demo has gone (its end closed the pipe): nobody to tell
            pass


def _timed(label: str, fn: Callable[[], T], rows: list[tuple[str, float]]) -> T:
    t = time.perf_counter()
    out = fn()
    rows.append((label, time.perf_counter() - t))
    return out


def _expect(conn: Any, tag: str) -> tuple[Any, ...]:
    if not conn.poll(120):
        raise TimeoutError(f"the consumer did not answer ({tag}) within 120 s")
    try:
        msg = conn.recv()
    except EOFError:
        raise RuntimeError(f"the consumer process ended without answering ({tag})") from None
    if msg[0] == "error":
        raise RuntimeError(f"consumer failed: {msg[1]}")
    if msg[0] != tag:
        raise RuntimeError(f"consumer said {msg[0]!r}, expected {tag!r}")
    return msg[1:]


def _round_trips(conn: Any, arrays: Callable[[int], tuple[Any, float]], n: int) -> float:
    """The median seconds of ``n`` messages: export ``arrays(i)``'s array, send it, and have the consumer open
    it, read its first value and close it; every value read is checked against the one ``arrays`` gives."""
    import cupy_ipc

    times = []
    for i in range(n):
        arr, want = arrays(i)
        t = time.perf_counter()
        conn.send(("read", cupy_ipc.get_ipc_handle(arr).to_bytes()))
        (got,) = _expect(conn, "value")
        times.append(time.perf_counter() - t)
        if got != want:
            raise RuntimeError(f"consumer read {got} in message {i}, expected {want}")
        del arr
    return statistics.median(times)


def run_demo() -> int:
    """Run the demo; returns the process exit status."""
    reason = unavailable_reason()
    if reason:
        print(f"cupy_ipc demo: no GPU to run on: {reason}", file=sys.stderr)
        return 1
    import cupy

    import cupy_ipc

    rows: list[tuple[str, float]] = []
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child,), daemon=True)
    try:
        _timed("start a consumer process (spawn)", proc.start, rows)
    except Exception as e:  # out of processes or memory, say
        conn.close()
        child.close()
        print(f"cupy_ipc demo failed: could not start a consumer process: {e}", file=sys.stderr)
        return 1
    child.close()  # ours: a consumer that dies then ends our wait at once (EOF), not after its time-out
    try:
        _warm_kernels()
        (started,) = _expect(conn, "ready")
        rows.append(("consumer: CUDA start and kernels loaded (once a process)", started))
        base = cupy.arange(4096 * 4096, dtype=cupy.float32).reshape(4096, 4096)
        view = base[::2, 1::2]  # a strided view inside a pool block: the offset matters
        expected = float(view.sum())
        handle = _timed("export the array (get_ipc_handle)", lambda: cupy_ipc.get_ipc_handle(view), rows)
        ev = cupy_ipc.IpcEvent()
        ev_data = ev.get_ipc_handle().to_bytes()  # before its record: the record then writes its word too
        stream = cupy.cuda.Stream(non_blocking=True)
        _timed("send the handle (273 bytes + 16 per dimension)", lambda: conn.send(("open", handle.to_bytes())), rows)
        t = time.perf_counter()
        opened, got = _expect(conn, "opened")
        rows.append(("consumer: first open in the process (map + wait for the producer's work)", opened))
        rows.append(("round trip: send, open, sum, answer", time.perf_counter() - t))
        if got != expected:
            raise RuntimeError(f"consumer read sum {got}, expected {expected}")
        with stream:
            view *= 2
            ev.record(stream)
        t = time.perf_counter()
        conn.send(("event", ev_data))
        doubled, done_data = _expect(conn, "doubled")
        rows.append(("event round trip: write, record, consumer waits on GPU", time.perf_counter() - t))
        if doubled != 2 * expected:
            raise RuntimeError(f"consumer read {doubled} after the event, expected {2 * expected}")
        done = cupy_ipc.IpcEventHandle.from_bytes(done_data).open()
        _timed("wait on the consumer's event (GPU side)", done.wait, rows)
        first_row = float(view[0, :].sum())
        if first_row != -view.shape[1]:
            raise RuntimeError(f"producer sees {first_row} in the row the consumer wrote, expected {-view.shape[1]}")
        done.close()
        conn.send(("close",))
        _expect(conn, "closed")
        _wait_unpinned("consumer closed; producer's pin released", rows)
        # A pipeline's messages: the same buffer sent again (its handle and mapping are reused), then a new
        # buffer each time (exported, mapped and unmapped anew); each read checked.
        resent = _round_trips(conn, lambda i: (view, float(view[0, 0])), RESENT)
        rows.append((f"re-sent array, median of {RESENT}: export, send, open, read, close, answer", resent))
        fresh = _round_trips(conn, lambda i: (cupy.full(1 << 18, i, cupy.float32), float(i)), FRESH)
        rows.append((f"new 1 MiB array, median of {FRESH}: the same", fresh))
        _wait_unpinned("every pin released after the last message", rows)
    except Exception as e:
        print(f"cupy_ipc demo failed: {e}", file=sys.stderr)
        return 1
    finally:
        try:
            conn.send(None)
        except OSError:  # the consumer has gone: its error, if any, is the one reported
            pass
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join(5)  # reaped: run_demo() may be called by a process that lives on
        conn.close()
    dev = cupy.cuda.runtime.getDeviceProperties(view.device.id)["name"].decode()
    print(f"cupy_ipc {cupy_ipc.__version__} demo on {dev}: shared a {view.shape} float32 view "
          f"({view.nbytes / 2**20:.0f} MiB) with process {proc.pid}, then {RESENT + FRESH} messages; "
          "every value checked")
    for label, seconds in rows:
        print(f"  {label:<72} {seconds * 1e3:9.3f} ms")
    print("OK")
    return 0


def _wait_unpinned(label: str, rows: list[tuple[str, float]]) -> None:
    """Wait (10 s at most) until this process pins nothing: its consumer is done with everything sent."""
    import cupy_ipc

    t = time.perf_counter()
    while cupy_ipc.pinned() and time.perf_counter() - t < 10:
        time.sleep(0.001)
    rows.append((label, time.perf_counter() - t))
    if cupy_ipc.pinned():
        raise RuntimeError(f"exports are still pinned 10 s after the consumer was done: {cupy_ipc.pinned()}")
