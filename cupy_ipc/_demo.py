"""``python -m cupy_ipc demo``: share an array and events with a consumer process."""

from __future__ import annotations

import multiprocessing
import sys
import time
from typing import Any, Callable, TypeVar

from ._cuda import unavailable_reason

__all__ = ["run_demo"]

T = TypeVar("T")


def _consumer(conn: Any) -> None:
    """The consumer process: open what arrives, check it, answer."""
    from . import IpcArrayHandle, IpcEvent, IpcEventHandle

    try:
        array_data = conn.recv()
        t = time.perf_counter()
        h = IpcArrayHandle.from_bytes(array_data)
        arr = h.open()  # the current stream waits for the producer's work on the GPU
        opened = time.perf_counter() - t
        conn.send(("opened", opened, float(arr.sum())))
        # Ordering by hand: wait for the producer's second write, then answer with our own event.
        IpcEventHandle.from_bytes(conn.recv()).open().wait()
        doubled = float(arr.sum())
        arr[0, :] = -1
        done = IpcEvent()
        done.record()
        conn.send(("doubled", doubled, done.get_ipc_handle().to_bytes()))
        conn.recv()  # the producer has waited on our event
        h.close()
        del arr
        done.close()
        conn.send(("closed",))
    except Exception as e:  # send it back rather than die silently
        conn.send(("error", f"{type(e).__name__}: {e}"))


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
    _timed("start a consumer process (spawn)", proc.start, rows)
    child.close()  # ours: a consumer that dies then ends our wait at once (EOF), not after its time-out
    try:
        base = cupy.arange(4096 * 4096, dtype=cupy.float32).reshape(4096, 4096)
        view = base[::2, 1::2]  # a strided view inside a pool block: the offset matters
        expected = float(view.sum())
        handle = _timed("export the array (get_ipc_handle)", lambda: cupy_ipc.get_ipc_handle(view), rows)
        ev = cupy_ipc.IpcEvent()
        stream = cupy.cuda.Stream(non_blocking=True)
        _timed("send the handle (273 bytes + 16 per dimension)", lambda: conn.send(handle.to_bytes()), rows)
        t = time.perf_counter()
        opened, got = _expect(conn, "opened")
        rows.append(("consumer: open (map + wait on producer's event)", opened))
        rows.append(("round trip: send, open, sum, answer", time.perf_counter() - t))
        if got != expected:
            raise RuntimeError(f"consumer read sum {got}, expected {expected}")
        with stream:
            view *= 2
            ev.record(stream)
        t = time.perf_counter()
        conn.send(ev.get_ipc_handle().to_bytes())
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
        conn.send("go")
        _expect(conn, "closed")
        t = time.perf_counter()
        while cupy_ipc.pinned() and time.perf_counter() - t < 10:
            time.sleep(0.001)
        rows.append(("consumer closed; producer's pin released", time.perf_counter() - t))
        if cupy_ipc.pinned():
            raise RuntimeError("the export is still pinned after the consumer closed")
    except Exception as e:
        print(f"cupy_ipc demo failed: {e}", file=sys.stderr)
        return 1
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()
    dev = cupy.cuda.runtime.getDeviceProperties(view.device.id)["name"].decode()
    print(f"cupy_ipc {cupy_ipc.__version__} demo on {dev}: shared a {view.shape} float32 view "
          f"({view.nbytes / 2**20:.0f} MiB) with process {proc.pid}; every value checked")
    for label, seconds in rows:
        print(f"  {label:<58} {seconds * 1e3:9.3f} ms")
    print("OK")
    return 0
