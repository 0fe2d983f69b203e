"""Targets of the multiprocessing tests: module-level, so that spawned children import them.

They import ``cupy_ipc.multiprocessing`` so that the arrays they send back
travel by handle too.
"""

from __future__ import annotations

import gc
import os
import re
from typing import Any

import numpy as np

import cupy_ipc.multiprocessing  # noqa: F401 - registers the reducers in the child


def double(a: Any) -> Any:
    """A new array of the worker's own: the result travels back by handle. ``a`` must have come by handle."""
    assert cupy_ipc.open_info(a) is not None, "the worker received a copy, not the sender's memory"
    return a * 2


def double_sum(a: Any) -> float:
    return float((a * 2).sum())


def _answer(a: Any) -> tuple[Any, Any]:
    """``(a * 2, a)`` after adding 1 to ``a`` in place, which the sender must see."""
    result = a * 2
    a += 1
    return result, a


def serve_queue(inbox: Any, outbox: Any) -> None:
    """Answer arrays from ``inbox`` on ``outbox`` until ``None``; works for every kind of queue."""
    while True:
        a = inbox.get()
        if a is None:
            break
        outbox.put(_answer(a))
        del a
        if hasattr(inbox, "task_done"):
            inbox.task_done()


class _PipeEnd:
    def __init__(self, conn: Any) -> None:
        self.get, self.put = conn.recv, conn.send


def serve_pipe(conn: Any) -> None:
    end = _PipeEnd(conn)
    serve_queue(end, end)


def forward(inbox: Any, onward: Any, back: Any) -> None:
    """Pass a received array on to a third process and back to its sender, then drop it."""
    a = inbox.get()
    onward.put(a)
    back.put(a)
    del a
    gc.collect()
    inbox.get()  # stay alive until the test is done: our pin keeps the chain


def write_value(inbox: Any, done: Any, value: float) -> None:
    a = inbox.get()
    a[...] = value
    a.data.device.synchronize()
    done.put(a.shape)


def read_both(direct: Any, relayed: Any, out: Any, drop: str) -> None:
    """Receive one allocation twice (from its producer and relayed), drop one array, read the other."""
    from cupy_ipc import _mapping

    first, second = direct.get(), relayed.get()
    same = first.data.ptr == second.data.ptr
    kept = second if drop == "direct" else first
    del first, second
    gc.collect()
    kept.data.device.synchronize()
    out.put((same, _mapping.counts()["mapped"], np.asarray(kept.get())))
    del kept
    gc.collect()
    out.put(_mapping.counts()["mapped"])


def run_threads(target: Any, count: int, timeout: float) -> list[int]:
    """Run ``target(i)`` for ``i`` in ``range(count)`` on threads of their own; the ``i`` of those still running
    after ``timeout`` seconds."""
    import threading

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return [i for i, t in enumerate(threads) if t.is_alive()]


def check_from_threads(inbox: Any, outbox: Any, threads: int) -> None:
    """Receive ``(expected value, array or handle bytes)`` on ``threads`` threads at once, each on its own stream,
    until one ``None`` per thread; check each array at once, and some again later on another thread after
    holding them. Reports ``(checks by kind, wrong values, errors, state())``."""
    import random
    import threading
    from collections import Counter

    import cupy

    from cupy_ipc import IpcArrayHandle

    lock = threading.Lock()
    held: list[tuple[float, Any]] = []
    checks: Counter[str] = Counter()
    wrong: list[tuple[str, float, float, float]] = []
    errors: list[str] = []

    def check(expected: float, arr: Any, kind: str) -> None:
        ok = bool((arr == expected).all())  # a host sync: the array's GPU work is done once it returns
        with lock:
            checks[kind] += 1
            if not ok:
                wrong.append((kind, expected, float(arr.min()), float(arr.max())))

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with cupy.cuda.Stream():
                while True:
                    msg = inbox.get(timeout=120)  # an array is opened here, on this thread's stream
                    if msg is None:
                        return
                    expected, item = msg
                    del msg
                    arr = IpcArrayHandle.from_bytes(item).open() if isinstance(item, bytes) else item
                    del item
                    check(expected, arr, "at once")
                    with lock:
                        if rng.random() < 0.5:
                            held.append((expected, arr))  # dropped later, by whichever thread picks it
                        older = held.pop(rng.randrange(len(held))) if len(held) > 8 else None
                    del arr
                    if older is not None:
                        check(*older, "held")
                        del older
        except Exception as e:  # noqa: BLE001 - the test reads it
            with lock:
                errors.append(f"{type(e).__name__}: {e}")

    errors += [f"thread {i} still running" for i in run_threads(work, threads, 300)]
    while held:
        check(*held.pop(), "held")
    outbox.put((dict(checks), wrong, errors, state()))


def read_when_told(inbox: Any, go: Any, out: Any) -> None:
    a = inbox.get()
    go.get()
    out.put(np.asarray(a.get()))


def echo_plus_one(inbox: Any, outbox: Any) -> None:
    """The leak check's partner: returns ``a + 1`` per message, reports its state on request."""
    while True:
        msg = inbox.get()
        if isinstance(msg, str):
            outbox.put(state())
            if msg == "stop":
                return
            continue
        outbox.put(msg + 1)
        del msg


def _fd_targets() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(re.sub(r"\[\d+\]", "[]", os.readlink(f"/proc/self/fd/{fd}")))  # socket:[inode] -> socket:[]
        except OSError:  # the directory's own descriptor, closed by now
            pass
    return out


def state() -> dict[str, Any]:
    import time

    import cupy

    from cupy_ipc import _mapping

    gc.collect()
    deadline = time.monotonic() + 10
    while True:  # releases ordered after GPU work finish on a background thread
        cupy.cuda.runtime.deviceSynchronize()
        cupy_ipc.collect()
        counts = _mapping.counts()
        if not (counts["mapped"] or counts["claims"] or cupy_ipc.pinned()) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return {
        **counts, "pinned": len(cupy_ipc.pinned()), "fds": sorted(_fd_targets()),
        "used_bytes": cupy.get_default_memory_pool().used_bytes(),
    }


def receive_error(conn: Any) -> None:
    """In a forked child: report what receiving an array raises."""
    try:
        conn.recv()
        conn.send("received without error")
    except Exception as e:  # noqa: BLE001 - the test reads it
        conn.send(f"{type(e).__name__}: {e}")


def check_event(conn: Any) -> None:
    """Receive a cupy.cuda.Event recorded behind a long kernel; report what it did, send it back."""
    import time

    import cupy

    ev = conn.recv()
    done_at_arrival = ev.query() if hasattr(ev, "query") else ev.done
    t = time.perf_counter()
    ev.synchronize()
    conn.send((type(ev).__module__ + "." + type(ev).__qualname__, done_at_arrival, time.perf_counter() - t, ev))
    del ev
    cupy.cuda.runtime.deviceSynchronize()


def device_of(a: Any) -> tuple[int, bytes, float]:
    """The GPU the array arrived on, the UUID of the GPU holding its memory, and its sum (read where it arrived)."""
    import cupy

    import cupy_ipc
    from cupy_ipc._cuda import device_uuid

    with cupy.cuda.Device(a.device.id):
        return a.device.id, device_uuid(cupy_ipc.open_info(a).memory_device), float(a.sum())



def put_filled_and_end(q: Any, n: int, value: float, busy: float = 0.0, exit_wait: float | None = None) -> None:
    """Put a new array of ``value``s on ``q``, filled behind ``busy`` seconds of other GPU work, and end at once
    (waiting at most ``exit_wait`` seconds at exit, if given, for its receiver)."""
    import cupy

    from workers import spin

    if exit_wait is not None:
        cupy_ipc.multiprocessing.set_exit_wait(exit_wait)
    a = cupy.empty(n, cupy.float32)
    if busy:
        spin(busy)
    a.fill(value)
    q.put(a)


def filled(value: float) -> Any:
    """A new array of the worker's own, of 1 MiB."""
    import cupy

    return cupy.full(1 << 18, value, dtype=cupy.float32)


class Unopenable:
    """Pickled by multiprocessing as an array of another host, which no process here can open (the open fails
    before any CUDA call, so no GPU is needed)."""

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        from cupy_ipc import IpcArrayHandle

        h = IpcArrayHandle(memory_handle=bytes(64), offset=0, allocation_size=8, shape=(2,), strides=(4,),
                           dtype="float32", device=(0, bytes(16)), producer=(1, bytes(16), bytes(16), "elsewhere"))
        return cupy_ipc.multiprocessing._rebuild_ndarray, (h.to_bytes(),)


def unopenable() -> Unopenable:
    """A result that the pool's result handler cannot open."""
    return Unopenable()
