"""Event ping-pong between two processes, against the same ping-pong without events.

One round: the producer records its event and pokes the consumer through a
pipe; the consumer's stream waits on that event on the GPU, records its own
event and pokes back; the producer synchronizes on the consumer's event. The
*pipe* baseline is the same exchange with no CUDA call.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

from roundtrip import receive, summary


def _partner(conn: Any) -> None:
    import cupy_ipc

    theirs = cupy_ipc.IpcEventHandle.from_bytes(conn.recv()).open()
    ours = cupy_ipc.IpcEvent()
    conn.send(ours.get_ipc_handle().to_bytes())
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if msg == "event":
            theirs.wait()
            ours.record()
        conn.send(msg)


def run(iters: int = 2000, warmup: int = 200) -> dict[str, Any]:
    """Median round trips (µs) of ``event`` and ``pipe`` ping-pong."""
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
        out = {}
        for kind in ("pipe", "event", "pipe", "event"):  # twice, interleaved; the second pass counts
            times = []
            for i in range(warmup + iters):
                t = time.perf_counter()
                if kind == "event":
                    ours.record()
                conn.send(kind)
                conn.recv()
                if kind == "event":
                    theirs.synchronize()
                if i >= warmup:
                    times.append(time.perf_counter() - t)
            out[kind] = {"iters": len(times), **summary(times)}
        print(f"event ping-pong: median {out['event']['median_us']:.1f} us "
              f"(pipe alone {out['pipe']['median_us']:.1f} us)", flush=True)
        return out
    finally:
        if proc.is_alive():
            conn.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
