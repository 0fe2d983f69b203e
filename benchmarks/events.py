"""Event ping-pong between two processes, against the same ping-pong without events.

One round: the producer records its event and pokes the consumer through a
pipe; the consumer's stream waits on that event on the GPU, records its own
event and pokes back; the producer synchronizes on the consumer's event. The
*pipe* baseline is the same exchange with no CUDA call, and *raw* the same
events made and used with CuPy's runtime calls alone (the floor).
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

from roundtrip import receive, summary


def _raw_event() -> tuple[int, bytes]:
    from cupy.cuda import runtime as rt

    ev = rt.eventCreateWithFlags(rt.eventInterprocess | rt.eventDisableTiming)
    return ev, rt.ipcGetEventHandle(ev)


def _partner(conn: Any) -> None:
    from cupy.cuda import runtime as rt

    import cupy_ipc

    theirs = cupy_ipc.IpcEventHandle.from_bytes(conn.recv()).open()
    ours = cupy_ipc.IpcEvent()
    conn.send(ours.get_ipc_handle().to_bytes())
    theirs_raw = rt.ipcOpenEventHandle(conn.recv())
    ours_raw, handle = _raw_event()
    conn.send(handle)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if msg == "event":
            theirs.wait()
            ours.record()
        elif msg == "raw":
            rt.streamWaitEvent(0, theirs_raw, 0)
            rt.eventRecord(ours_raw, 0)
        conn.send(msg)


def run(iters: int = 2000, warmup: int = 200) -> dict[str, Any]:
    """Median round trips (µs) of ``event``, ``raw`` and ``pipe`` ping-pong."""
    from cupy.cuda import runtime as rt

    import cupy_ipc

    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_partner, args=(child,), daemon=True)
    proc.start()
    child.close()  # so that a partner that dies ends our waits
    try:
        ours = cupy_ipc.IpcEvent()
        conn.send(ours.get_ipc_handle().to_bytes())
        theirs = cupy_ipc.IpcEventHandle.from_bytes(receive(conn, proc, 120, "the ping-pong partner")).open()
        ours_raw, handle = _raw_event()
        conn.send(handle)
        theirs_raw = rt.ipcOpenEventHandle(receive(conn, proc, 120, "the ping-pong partner"))
        out = {}
        for kind in ("pipe", "raw", "event") * 2:  # twice, interleaved; the second pass counts
            times = []
            for i in range(warmup + iters):
                t = time.perf_counter()
                if kind == "event":
                    ours.record()
                elif kind == "raw":
                    rt.eventRecord(ours_raw, 0)
                conn.send(kind)
                conn.recv()
                if kind == "event":
                    theirs.synchronize()
                elif kind == "raw":
                    rt.eventSynchronize(theirs_raw)
                if i >= warmup:
                    times.append(time.perf_counter() - t)
            out[kind] = {"iters": len(times), **summary(times)}
        print(f"event ping-pong: median {out['event']['median_us']:.1f} us (raw calls {out['raw']['median_us']:.1f}, "
              f"pipe alone {out['pipe']['median_us']:.1f} us)", flush=True)
        return out
    finally:
        if proc.is_alive():
            conn.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
