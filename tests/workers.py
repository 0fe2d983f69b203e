"""Functions that run in helper processes, and the proxy that calls them.

Each helper is a spawned process serving calls over a pipe, so one CUDA
context serves many checks; exceptions travel back and are re-raised.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
import warnings
from typing import Any, Iterator

import numpy as np

_held: dict[str, Any] = {}  # state a helper keeps between calls


# --- the proxy ------------------------------------------------------------------
class Remote:
    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.pid = self.call("getpid")

    def call(self, name: str, *args: Any, timeout: float = 120, **kwargs: Any) -> Any:
        self.conn.send((name, args, kwargs))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"helper {self.proc.pid} did not answer {name} within {timeout} s")
        status, value = self.conn.recv()
        if status == "err":
            raise value
        return value

    def send(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Start a call without waiting; collect it with :meth:`result`."""
        self.conn.send((name, args, kwargs))

    def result(self, timeout: float = 120) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"helper {self.proc.pid} did not answer within {timeout} s")
        status, value = self.conn.recv()
        if status == "err":
            raise value
        return value

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def _serve(conn: Any) -> None:
    import pickle

    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        name, args, kwargs = msg
        try:
            reply = ("ok", globals()[name](*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the test
            import traceback

            where = "the helper's traceback:\n" + traceback.format_exc()
            try:
                pickle.dumps(e)
            except Exception:
                e = RuntimeError(f"{type(e).__name__}: {e}")
            if hasattr(e, "add_note"):  # Python 3.11+: shown with the test's failure
                e.add_note(where)
            reply = ("err", e)
        conn.send(reply)


# --- helpers used on both sides ------------------------------------------------
SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def spin(seconds: float, stream: Any = None) -> None:
    """Queue a kernel that keeps the GPU busy for about ``seconds``."""
    import cupy

    kernel = _held.get("spin")
    if kernel is None:
        kernel = _held["spin"] = cupy.RawKernel(SPIN_SOURCE, "spin")
    rate_khz = cupy.cuda.Device().attributes["ClockRate"]
    cycles = int(seconds * rate_khz * 1000)
    with stream or cupy.cuda.get_current_stream():
        kernel((1,), (1,), (np.int64(cycles),))


def warm_up() -> None:
    """Compile and load every kernel a check uses before timing-sensitive work.

    With lazy module loading a first launch can block the host until the GPU
    is idle, which would hide a missing wait.
    """
    import cupy

    spin(0.001)
    a = cupy.zeros(16, cupy.float32)
    a.fill(1)
    a += 1
    float(a.sum())
    float((a[:1] * 1)[0])
    cupy.cuda.runtime.deviceSynchronize()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def open_fd_paths() -> list[str]:
    """What this process's descriptors name, sorted."""
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed since
            pass
    return sorted(paths)


def segments() -> int:
    from cupy_ipc._segment import _dir

    return sum(1 for n in os.listdir(_dir()) if n.startswith("cupy_ipc-"))


# --- consumer calls ------------------------------------------------------------
def getpid() -> int:
    return os.getpid()


def read(data: bytes) -> np.ndarray:
    import cupy

    from cupy_ipc import IpcArrayHandle

    h = IpcArrayHandle.from_bytes(data)
    with h as arr:
        out = cupy.asnumpy(arr)
    del arr
    return out


def read_many(items: list[bytes]) -> list[np.ndarray]:
    return [read(d) for d in items]


def write(data: bytes, value: float) -> None:
    import cupy

    from cupy_ipc import IpcArrayHandle

    with IpcArrayHandle.from_bytes(data) as arr:
        arr[...] = value
        cupy.cuda.get_current_stream().synchronize()
    del arr


def open_error(data: bytes) -> tuple[str, str, float]:
    """Try to open; return the exception type, message and seconds taken."""
    from cupy_ipc import IpcArrayHandle

    t = time.perf_counter()
    try:
        arr = IpcArrayHandle.from_bytes(data).open()
    except Exception as e:
        return type(e).__name__, str(e), time.perf_counter() - t
    del arr
    return "", "", time.perf_counter() - t


def open_failing(data: bytes, step: str) -> dict[str, Any]:
    """Open with one step failing: ``"import"`` (the CUDA import of the memory), ``"event"`` (the open of the
    producer's ordering event), ``"copy"`` (the target GPU's buffer of a staged copy to GPU 1), else none
    patched (a forged handle fails by itself). Returns the error and this process's tables, the error still
    held (its traceback holds the failed open's frames)."""
    import cupy
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    import cupy_ipc
    from cupy_ipc import _array_handle, _cuda, _mapping, _words

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise CUDARuntimeError(205)  # cudaErrorMapBufferObjectFailed

    def out_of_memory(*args: Any, **kwargs: Any) -> Any:
        raise cupy.cuda.memory.OutOfMemoryError(0, 0)

    libcuda_fn = _cuda._libcuda_fn

    def failing_open(name: str, *argtypes: Any) -> Any:  # the driver's open fails: CUDA_ERROR_MAP_FAILED
        return (lambda out, handle, flags: 205) if name == "cuIpcOpenMemHandle_v2" else libcuda_fn(name, *argtypes)

    patches = {"import": [(_cuda, "_libcuda_fn", failing_open)],
               # the ordering step: the producer's word where it writes one, else its event
               "event": [(_array_handle, "open_cached", failing), (_words, "of_producer", failing)],
               "copy": [(cupy.cuda, "alloc", out_of_memory)]}.get(step, [])
    reals = [(target, name, getattr(target, name)) for target, name, _ in patches]
    for target, name, stub in patches:
        setattr(target, name, stub)
    error: BaseException | None = None
    try:
        h = cupy_ipc.IpcArrayHandle.from_bytes(data)
        h.open(device=1, copy=True) if step == "copy" else h.open()
    except Exception as e:
        error = e
    finally:
        for target, name, real in reals:
            setattr(target, name, real)
    return {"error": f"{type(error).__name__}: {error}", "counts": _mapping.counts()}


def open_interrupted_once_mapped(data: bytes) -> dict[str, Any]:
    """Open with Ctrl-C raised right after the driver's open returns (where one that arrives during the call is
    raised), then open again and read; what the first open did, the second's values, and whether the
    interrupted open's address is still mapped once the second array is dropped."""
    import cupy

    from cupy_ipc import IpcArrayHandle, IpcError, _cuda, _mapping

    libcuda_fn = _cuda._libcuda_fn
    mapped_at: list[int] = []

    def interrupted_open(name: str, *argtypes: Any) -> Any:
        real = libcuda_fn(name, *argtypes)
        if name != "cuIpcOpenMemHandle_v2":
            return real

        def open_then_interrupted(out: Any, handle: Any, flags: int) -> int:
            real(out, handle, flags)
            mapped_at.append(out._obj.value)
            raise KeyboardInterrupt

        return open_then_interrupted

    _cuda._libcuda_fn = interrupted_open
    try:
        IpcArrayHandle.from_bytes(data).open()
        first = "opened"
    except KeyboardInterrupt:
        first = "interrupted"
    finally:
        _cuda._libcuda_fn = libcuda_fn
    with IpcArrayHandle.from_bytes(data) as arr:
        values = cupy.asnumpy(arr)
        arr.device.synchronize()
    del arr
    left = _mapped_once_released()
    _mapping.settle_closes()
    try:
        _cuda.address_range(mapped_at[0])
        still_mapped = True
    except IpcError:
        still_mapped = False
    return {"first": first, "values": values, "mapped": left, "still_mapped": still_mapped}


def open_twice(data: bytes, close_first: int) -> dict[str, Any]:
    """Open one handle through two handle objects; close them in the given order."""
    import cupy

    from cupy_ipc import IpcArrayHandle, _mapping

    h = [IpcArrayHandle.from_bytes(data), IpcArrayHandle.from_bytes(data)]
    arrays = [h[0].open(), h[1].open()]
    same_ptr = arrays[0].data.ptr == arrays[1].data.ptr
    mapped_both = _mapping.counts()["mapped"]
    first, second = close_first, 1 - close_first
    h[first].close()
    arrays[first] = None
    gc.collect()
    survivor = cupy.asnumpy(arrays[second])
    mapped_one = _mapping.counts()["mapped"]
    h[second].close()
    arrays = None
    gc.collect()
    return {
        "same_ptr": same_ptr, "mapped_both": mapped_both, "mapped_one": mapped_one,
        "mapped_none": _mapping.counts()["mapped"], "survivor": survivor,
    }


def view_outlives_close(data: bytes) -> dict[str, Any]:
    import warnings

    import cupy

    from cupy_ipc import IpcArrayHandle

    h = IpcArrayHandle.from_bytes(data)
    arr = h.open()
    view = arr[1:]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h.close()
    del arr
    gc.collect()
    values = cupy.asnumpy(view)
    return {"warnings": [(w.category.__name__, str(w.message)) for w in caught], "values": values}


def hold(data: bytes, name: str) -> None:
    from cupy_ipc import IpcArrayHandle

    _held[name] = IpcArrayHandle.from_bytes(data).open()


def hold_and_send_on(data: bytes, name: str) -> bytes:
    """Open handle bytes, keep the array as ``name``, and export it again: the new handle's bytes."""
    import cupy_ipc

    _held[name] = cupy_ipc.IpcArrayHandle.from_bytes(data).open()
    return cupy_ipc.get_ipc_handle(_held[name]).to_bytes()


def hold_open(data: bytes, name: str) -> None:
    """Open on the current stream, keeping the handle and its array for :func:`read_then_close`."""
    from cupy_ipc import IpcArrayHandle

    recording, caught = _record_warnings()  # from now: the library's thread may warn at any time
    handle = IpcArrayHandle.from_bytes(data)
    _held[name] = (handle, handle.open(), recording, caught)


def _record_warnings() -> tuple[Any, list]:
    """Record every warning from now on, the library's threads' too, until the returned context is exited."""
    import warnings

    recording = warnings.catch_warnings(record=True)
    caught = recording.__enter__()
    warnings.simplefilter("always")
    return recording, caught


def read_then_close(name: str) -> dict:
    """Read the first element of a :func:`hold_open` array, then close its handle: the value, the seconds the read
    took, the close's error (type, pid, message) and the warnings given since the open."""
    handle, arr, recording, caught = _held.pop(name)
    out: dict[str, Any] = {"error": None}
    try:
        t0 = time.monotonic()
        out["value"] = float(arr[0])
        out["took"] = time.monotonic() - t0
        del arr
        try:
            handle.close()
        except Exception as e:  # noqa: BLE001 - the outcome is the point
            out["error"] = (type(e).__name__, getattr(e, "pid", None), str(e))
    finally:
        recording.__exit__(None, None, None)
    out["warnings"] = [str(w.message) for w in caught]
    return out


def open_then_first_launch(data: bytes) -> dict:
    """Open (its stream made to wait for the producer's work), then load and launch a kernel never loaded here
    before, which adds 1 to the array: with lazy loading, a first launch may wait for the whole GPU, the stream
    held by the open included. How many waits the library held after the open, and the first value."""
    import cupy

    from cupy_ipc import IpcArrayHandle, _gates

    source = 'extern "C" __global__ void add_one_%d(float* a) { a[threadIdx.x] += 1.0f; }' % os.getpid()
    kernel = cupy.RawKernel(source, f"add_one_{os.getpid()}")
    with IpcArrayHandle.from_bytes(data) as arr:
        out = {"gated": _gates.pending()}
        kernel((1,), (32,), (arr,))
        out["value"] = float(arr[0])
    return out


def hold_event(data: bytes, name: str, how: str) -> None:
    """Open an event from its handle, recording the warnings given from now, for :func:`wait_on_held_event`;
    ``how`` ``"wait"``: a stream of its own waits for it now."""
    import cupy

    from cupy_ipc import IpcEventHandle

    recording, caught = _record_warnings()
    ev = IpcEventHandle.from_bytes(data).open()
    s = cupy.cuda.Stream(non_blocking=True)
    if how == "wait":
        ev.wait(s)
    _held[name] = (ev, s, recording, caught)


def wait_on_held_event(name: str, how: str) -> dict:
    """Wait for a :func:`hold_event` event: ``"wait"``, the stream that waits for it since then, on the host;
    ``"wait-now"``, a stream made to wait now, on the host; ``"synchronize"``, the event on the host. The
    seconds it took, its error (type, pid) and the warnings given since the open."""
    ev, s, recording, caught = _held.pop(name)
    out: dict[str, Any] = {"error": None}
    t0 = time.monotonic()
    try:
        if how == "synchronize":
            ev.synchronize()
        else:
            if how == "wait-now":
                ev.wait(s)
            s.synchronize()
    except Exception as e:  # noqa: BLE001 - the outcome is the point
        out["error"] = (type(e).__name__, getattr(e, "pid", None))
    finally:
        recording.__exit__(None, None, None)
    out["took"] = time.monotonic() - t0
    out["warnings"] = [str(w.message) for w in caught]
    return out


def event_after_spin(seconds: float, export_first: bool = False) -> bytes:
    """An interprocess event recorded after a kernel of ``seconds``; its handle, made before the record with
    ``export_first`` (so the record writes the event's word, which consumers' streams then wait for)."""
    import cupy

    import cupy_ipc

    warm_up()
    s = cupy.cuda.Stream(non_blocking=True)
    ev = cupy_ipc.IpcEvent()
    data = ev.get_ipc_handle().to_bytes() if export_first else None
    spin(seconds, s)
    ev.record(s)
    _held["event"] = (ev, s)
    return data or ev.get_ipc_handle().to_bytes()


def without_gates() -> None:
    """Make opens wait on the producer's event itself, as CUDA IPC does by hand (a negative control)."""
    from cupy_ipc import _gates, _words

    _gates._unsupported = True
    _words.disabled = True


def without_words() -> None:
    """Have this process's exports write no word, and its opens wait on no producer's: a stream then waits on a
    word of its own process, set by the library's thread once it sees the event completed (as before words)."""
    from cupy_ipc import _words

    _words.disabled = True


def with_equal_waits() -> None:
    """Make this process's streams wait for their own words with CUDA's ``EQ`` comparison (a negative control)."""
    from cupy_ipc import _gates

    _gates._GEQ = 1  # CU_STREAM_WAIT_VALUE_EQ


def export_two_after_spins(n: int, first: float, second: float) -> list[bytes]:
    """Two arrays filled on this process's stream, after ``first`` seconds and ``first + second`` seconds of
    spinning, exported at once with no host sync."""
    import cupy

    import cupy_ipc

    warm_up()
    arrays = [cupy.zeros(n, cupy.float32) for _ in range(2)]
    cupy.cuda.runtime.deviceSynchronize()
    out = []
    for a, seconds, value in zip(arrays, (first, second), (3, 4)):
        spin(seconds)
        a.fill(value)
        _held.setdefault("exported", []).append(a)
        out.append(cupy_ipc.get_ipc_handle(a).to_bytes())
    return out


def open_behind_own_work_then_another(first: bytes, second: bytes, own: float, gap: float) -> dict:
    """Open ``first`` on a stream of ours queued behind ``own`` seconds of our own work, ``gap`` seconds later
    ``second`` on another stream, then wait for both streams: the values read and how long the waits took. The
    first open's wait, still queued when its producer's work is done, is made before the second's."""
    import cupy

    from cupy_ipc import IpcArrayHandle, _gates

    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    spin(own, streams[0])
    values, words = [], []
    t0 = time.monotonic()
    for data, stream in zip((first, second), streams):
        with stream:
            arr = IpcArrayHandle.from_bytes(data).open()
            words.append(sorted(g.word for g in list(_gates._pending.values()) if g.words is None))
            values.append(arr[:1] * 1)  # read on that stream, after its wait
        time.sleep(gap)
    for stream in streams:
        stream.synchronize()
    return {"values": [float(v[0]) for v in values], "took": time.monotonic() - t0, "words": words}


def read_holding_the_library_thread(name: str) -> dict:
    """Read the first element of a :func:`hold_open` array while holding the lock that the library's waiting
    thread needs for anything it does: only a stream released on the GPU can go on then."""
    from cupy_ipc import _gates

    handle, arr, recording, caught = _held[name]
    t0 = time.monotonic()
    with _gates._cond:
        value = float(arr[0])
    return {"value": value, "took": time.monotonic() - t0}


def read_held(name: str) -> np.ndarray:
    import cupy

    return cupy.asnumpy(_held[name])


def drop(name: str) -> None:
    _held.pop(name, None)
    gc.collect()


def spin_then_drop(data: bytes, seconds: float) -> None:
    """Queue a long kernel and a write on the mapped array, then drop the array at once."""
    from cupy_ipc import IpcArrayHandle

    warm_up()
    arr = IpcArrayHandle.from_bytes(data).open()
    spin(seconds)
    arr += 1
    del arr
    gc.collect()


def open_on_a_thread_then_drop(data: bytes, seconds: float, unrelated: float) -> int:
    """With CuPy's per-thread default streams: a thread opens the array, queues a long kernel and a write on it on
    its own stream and ends; then a kernel of ``unrelated`` seconds is queued on a non-blocking stream, and the
    array is dropped here, on another thread, whose own stream is idle. Returns the stream the opener used."""
    import threading

    import cupy

    from cupy_ipc import IpcArrayHandle

    warm_up()
    box: list[Any] = []

    def opener() -> None:
        arr = IpcArrayHandle.from_bytes(data).open()
        spin(seconds)
        arr += 1
        box.append((arr, cupy.cuda.get_current_stream().ptr))

    t = threading.Thread(target=opener)
    t.start()
    t.join()
    stream = box[0][1]
    spin(unrelated, cupy.cuda.Stream(non_blocking=True))  # not ordered with the default streams: never waited for
    box.clear()
    gc.collect()
    return stream


def drop_on_a_thread_while_busy(first: bytes, second: bytes, unrelated: float) -> dict[str, float]:
    """Open ``first``, queue a kernel of ``unrelated`` seconds on a non-blocking stream, and drop the array on a
    thread, whose release lets the mapping go (a buffer sent once) to a close that waits for that kernel; that
    thread then waits for the close. Meanwhile, here: count Python loops for 0.2 s, then open ``second`` (read
    once the close is done). Returns when each ended, in seconds from the drop, with the value read."""
    import threading

    import cupy

    from cupy_ipc import IpcArrayHandle, _mapping

    warm_up()
    box = [IpcArrayHandle.from_bytes(first).open()]
    float(box[0][0])
    spin(unrelated, cupy.cuda.Stream(non_blocking=True))
    times: dict[str, float] = {}
    started = threading.Event()

    def dropper() -> None:
        times["drop"] = time.monotonic()
        started.set()
        box.clear()  # the last array: its release lets the mapping go
        times["dropped"] = time.monotonic()
        _mapping.settle_closes()  # the close, waited for
        times["closed"] = time.monotonic()

    t = threading.Thread(target=dropper)
    t.start()
    started.wait(10)
    loops, end = 0, time.monotonic() + 0.2
    while time.monotonic() < end:
        loops += 1
    times["looped"] = time.monotonic()
    arr = IpcArrayHandle.from_bytes(second).open()
    times["second"] = time.monotonic()
    t.join(60)
    value = float(arr[0])  # after the close: a kernel launch waits for another thread's close (measured)
    del arr
    drop = times.pop("drop")
    return {**{k: v - drop for k, v in times.items()}, "value": value, "loops": loops}


def drop_two_after_work_on_two_streams(first: bytes, second: bytes, long: float, short: float) -> None:
    """Open ``first`` on one non-blocking stream and ``second`` on another, queue a kernel of ``long`` seconds
    and a write on the first, of ``short`` seconds and a write on the second, then drop both, the first
    first: both releases wait for their stream's work."""
    import cupy

    from cupy_ipc import IpcArrayHandle

    warm_up()
    streams = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    arrays = []
    for data, seconds, stream in zip((first, second), (long, short), streams):
        with stream:
            arr = IpcArrayHandle.from_bytes(data).open()
            spin(seconds)
            arr += 1
        arrays.append(arr)
        del arr
    arrays.clear()
    gc.collect()


def spin_then_drop_interrupted(data: bytes, seconds: float) -> str:
    """As :func:`spin_then_drop`, with Ctrl-C arriving in the release's stream query; returns the name of what
    the dropping reported (a destructor's exception is reported, not raised)."""
    import sys

    from cupy_ipc import IpcArrayHandle, _cuda

    warm_up()
    arr = IpcArrayHandle.from_bytes(data).open()
    spin(seconds)
    arr += 1
    seen: list[str] = []
    hook, query = sys.unraisablehook, _cuda.stream_idle

    def interrupted(ptr: int) -> bool:
        raise KeyboardInterrupt

    sys.unraisablehook = lambda unraisable: seen.append(type(unraisable.exc_value).__name__)
    _cuda.stream_idle = interrupted
    try:
        del arr
        gc.collect()
    finally:
        sys.unraisablehook, _cuda.stream_idle = hook, query
    return ",".join(seen)


def read_after_event(arr_data: bytes, event_data: bytes, wait: bool) -> np.ndarray:
    """Open an array and an event; read with or without waiting on the event."""
    import cupy

    from cupy_ipc import IpcArrayHandle, IpcEventHandle

    warm_up()
    ev = IpcEventHandle.from_bytes(event_data).open()
    stream = cupy.cuda.Stream(non_blocking=True)
    arr = IpcArrayHandle.from_bytes(arr_data).open(stream=stream)
    if wait:
        ev.wait(stream)
    with stream:
        out = arr.copy()
    stream.synchronize()
    ev.close()
    return cupy.asnumpy(out)


def write_then_record_unregistered(arr_data: bytes, event_data: bytes, seconds: float, value: float) -> None:
    """Open an array and an event whose words this process cannot register with CUDA (as at the pinned-memory
    limit), queue ``seconds`` of spinning then a fill with ``value`` on a stream, and record the event there.
    Returns at once; the array and event are kept."""
    import cupy

    from cupy_ipc import IpcArrayHandle, IpcEventHandle, _words

    warm_up()
    _words.of_producer = lambda seg, device: None  # no registered words in this process
    ev = IpcEventHandle.from_bytes(event_data).open()
    stream = cupy.cuda.Stream(non_blocking=True)
    arr = IpcArrayHandle.from_bytes(arr_data).open(stream=stream)
    spin(seconds, stream)
    with stream:
        arr.fill(value)
    ev.record(stream)
    _held["recorded"] = (ev, arr, stream)


def read_after_event_holding_the_library_thread(arr_data: bytes, event_data: bytes) -> dict:
    """Open an array and an event, make a stream wait for the event, then copy the array on that stream while
    holding the lock that the library's waiting thread needs: only a wait released on the GPU lets the copy
    run then. The copy's distinct values, and the seconds the copy took."""
    import cupy

    from cupy_ipc import IpcArrayHandle, IpcEventHandle, _gates

    warm_up()
    ev = IpcEventHandle.from_bytes(event_data).open()
    stream = cupy.cuda.Stream(non_blocking=True)
    arr = IpcArrayHandle.from_bytes(arr_data).open(stream=stream)
    with stream:
        arr[:1].copy()  # the copy's kernel loaded before the wait (a first launch may wait for the whole GPU)
    ev.wait(stream)
    t0 = time.monotonic()
    with _gates._cond:
        with stream:
            out = arr.copy()
        stream.synchronize()
    took = time.monotonic() - t0
    return {"values": sorted(set(cupy.asnumpy(out).tolist())), "took": took}


def event_lifecycle(event_data: bytes) -> dict[str, Any]:
    from cupy_ipc import ClosedError, IpcEventHandle

    ev = IpcEventHandle.from_bytes(event_data).open()
    opened = ev.opened
    ev.synchronize()
    ev.close()
    ev.close()
    try:
        _ = ev.ptr
        raised = ""
    except ClosedError as e:
        raised = str(e)
    ev2 = IpcEventHandle.from_bytes(event_data).open()
    fin = ev2._finalizer
    del ev2
    gc.collect()
    return {"opened": opened, "closed": ev.closed, "raised": raised, "gc_destroyed": not fin.alive}


def state() -> dict[str, Any]:
    import cupy

    from cupy_ipc import _events, _mapping, _pools

    cupy.cuda.runtime.deviceSynchronize()
    _mapping.settle_closes()  # what was let go is closed on the library's thread, maybe still now
    return {
        **_mapping.counts(), "events": len(_events._opened), "fds": open_fds(), "segments": segments(),
        "free_mem": cupy.cuda.runtime.memGetInfo()[0], "pools": len(_pools._imports),
    }


def collect() -> None:
    import cupy_ipc

    gc.collect()
    cupy_ipc.collect()


def release_exited() -> int:
    """Let go of the pools imported from producers that have exited (collect() lets go of every unused one)."""
    from cupy_ipc import _pools

    gc.collect()
    return _pools.release_exited()


def open_each(items: list[bytes], index: int = 0) -> list[dict[str, Any]]:
    """Open, read element ``index``, close each handle in turn; the value, the pointer and the consumer's tables
    after each."""
    from cupy_ipc import IpcArrayHandle, _mapping

    out = []
    for d in items:
        with IpcArrayHandle.from_bytes(d) as arr:
            value, ptr = float(arr[index]), arr.data.ptr
            arr.device.synchronize()  # the release needs no background wait
        del arr
        out.append({"value": value, "ptr": ptr, **_mapping.counts()})
    return out


def set_idle_fd_limit(n: int) -> int:
    """Let idle mappings keep at most ``n`` descriptors; returns the default the library computed."""
    from cupy_ipc import _mapping

    old = _mapping._fd_limit()
    _mapping._idle_fd_limit = n
    return old


def collect_and_count() -> dict[str, int]:
    from cupy_ipc import _mapping

    collect()
    return _mapping.counts()


def read_first(data: bytes) -> float:
    """Open, read one element, close: one message of the cycle and benchmark loops."""
    from cupy_ipc import IpcArrayHandle

    with IpcArrayHandle.from_bytes(data) as arr:
        value = float(arr.ravel()[0])
    del arr
    return value


def torch_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# --- producer calls ------------------------------------------------------------
def export_filled(n: int, value: float, **options: Any) -> bytes:
    import cupy

    import cupy_ipc

    a = cupy.full(n, value, cupy.float32)
    _held.setdefault("exported", []).append(a)
    return cupy_ipc.get_ipc_handle(a, **options).to_bytes()


def export_times(n: int, value: float, times: int, pool: bool = False) -> list[bytes]:
    """One array of ``n`` float32 of ``value`` (from a shareable pool if ``pool``), kept, exported ``times``
    times: a buffer sent again."""
    import cupy

    import cupy_ipc

    if pool and "pool" not in _held:
        _held["pool"] = cupy_ipc.ShareableMemoryPool()
    with cupy.cuda.using_allocator(_held["pool"].malloc) if pool else contextlib.nullcontext():
        a = cupy.full(n, value, cupy.float32)
    _held.setdefault("exported", []).append(a)
    return [cupy_ipc.get_ipc_handle(a).to_bytes() for _ in range(times)]


def export_ring(n: int, buffers: int, rounds: int) -> list[bytes]:
    """``buffers`` arrays of ``n`` float32, the ``i``-th filled with ``i``, kept, and exported in turn ``rounds``
    times: a pipeline's ring of buffers sent again."""
    import cupy

    import cupy_ipc

    ring = [cupy.full(n, i, cupy.float32) for i in range(buffers)]
    _held.setdefault("exported", []).extend(ring)
    return [cupy_ipc.get_ipc_handle(a).to_bytes() for _ in range(rounds) for a in ring]


def replace_exported(n: int, value: float) -> tuple[bytes, bool]:
    """Free the arrays this helper exported (their memory goes back to the driver once their pins end), then
    export a new array of ``n`` float32 of ``value``; its handle, and whether the driver gave it the freed
    addresses."""
    import cupy

    import cupy_ipc
    from cupy_ipc import _cuda

    old = {_cuda.legacy_info(a.data.ptr)[0] for a in _held.pop("exported", [])}
    gc.collect()
    cupy_ipc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    a = cupy.full(n, value, cupy.float32)
    _held["exported"] = [a]
    return cupy_ipc.get_ipc_handle(a).to_bytes(), _cuda.legacy_info(a.data.ptr)[0] in old


def export_then_overwrite(n: int, keepalive: bool, rounds: int = 20) -> bytes:
    """Export an array of ones, drop it at once, then fill same-size arrays with 99s."""
    import cupy

    import cupy_ipc

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    a = cupy.ones(n, cupy.float32)
    data = cupy_ipc.get_ipc_handle(a, keepalive=keepalive).to_bytes()
    del a
    for _ in range(rounds):
        b = cupy.full(n, 99, cupy.float32)
        del b
    cupy.cuda.runtime.deviceSynchronize()
    return data


def export_after_spin(n: int, seconds: float, sync: bool) -> bytes:
    """Fill an array after a long kernel and export it at once, with no host sync."""
    import cupy

    import cupy_ipc

    warm_up()
    a = cupy.zeros(n, cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()
    spin(seconds)
    a.fill(7)
    _held.setdefault("exported", []).append(a)
    return cupy_ipc.get_ipc_handle(a, sync=sync).to_bytes()


def pinned_count() -> int:
    import cupy_ipc

    return len(cupy_ipc.pinned())


def reopen_after_eviction(items: list[bytes]) -> list[float]:
    """Open handles in turn with room for one idle mapping, so each open evicts the last one."""
    import cupy_ipc
    from cupy_ipc import _mapping

    grows = _mapping._idle_grows
    old = cupy_ipc.set_idle_mapping_limit(1)
    try:
        return [read_first(d) for d in items]
    finally:
        cupy_ipc.set_idle_mapping_limit(old, grow=grows)


def set_idle_limit(n: int, grow: bool) -> int:
    import cupy_ipc

    return cupy_ipc.set_idle_mapping_limit(n, grow=grow)


def cross_device_open(data: bytes, device: int | None, copy: bool) -> dict[str, Any]:
    """Open on ``device`` (this process's ordinal), compare with a copy read back, report how it was opened."""
    import cupy

    import cupy_ipc

    h = cupy_ipc.IpcArrayHandle.from_bytes(data)
    arr = h.open(device=device, copy=copy)
    info = cupy_ipc.open_info(arr)
    with cupy.cuda.Device(arr.device.id):
        values = arr.get()
    h.close()
    del arr
    expected = np.arange(values.size, dtype=np.float32) + values[0]
    return {"equal": bool((values == expected).all()), "device": info.device, "memory_device": info.memory_device,
            "copied": info.copied}


def sum_from_current_device(data: bytes, current: int) -> float:
    """Open with the defaults while ``current`` is the current GPU, and sum there (CuPy reads across GPUs)."""
    import cupy

    import cupy_ipc

    h = cupy_ipc.IpcArrayHandle.from_bytes(data)
    with cupy.cuda.Device(current), warnings.catch_warnings():
        warnings.simplefilter("ignore", cupy._util.PerformanceWarning)  # "peer access activated"
        arr = h.open()
        total = float(arr.sum())
    h.close()
    del arr
    return total


def wait_from_another_gpu(data: bytes, current: int) -> dict[str, Any]:
    """Open an event of another GPU and wait on it from ``current``'s stream; say whether it had finished."""
    import cupy

    import cupy_ipc

    ev = cupy_ipc.IpcEventHandle.from_bytes(data).open()
    with cupy.cuda.Device(current):
        t = time.perf_counter()
        ev.wait()
        waited = time.perf_counter() - t
        done = ev.query()
        cupy.cuda.get_current_stream().synchronize()
    return {"event_device": ev.device, "done_after_wait": done, "waited_s": waited}


def fill_on_a_peer_and_send_on(data: bytes, device: int, value: float) -> bytes:
    """Open on ``device`` (a peer of the memory's GPU), queue a long fill there, and send it on at once."""
    import cupy

    import cupy_ipc

    with cupy.cuda.Device(device):
        arr = cupy_ipc.IpcArrayHandle.from_bytes(data).open()
        _held["peer"] = arr
        spin(0.5)  # the fill waits behind this, on the same stream
        arr[...] = value
        return cupy_ipc.get_ipc_handle(arr).to_bytes()


def write_through(data: bytes, device: int, value: float) -> None:
    """Write element 0 through a mapping on ``device`` and finish the write."""
    import cupy

    import cupy_ipc

    h = cupy_ipc.IpcArrayHandle.from_bytes(data)
    with cupy.cuda.Device(device):
        arr = h.open(device=device)
        arr[0] = value
        cupy.cuda.get_current_stream().synchronize()
    h.close()
    del arr


# --- memory shared by file descriptor ------------------------------------------------
def pool_producer(n: int, value_offset: float = 0.0) -> bytes:
    """Allocate ``n`` float32 from a shareable pool, fill them, keep them; the handle's bytes."""
    import cupy

    import cupy_ipc

    pool = _held.get("pool")
    if pool is None:
        pool = _held["pool"] = cupy_ipc.ShareableMemoryPool()
    with cupy.cuda.using_allocator(pool.malloc):
        a = cupy.arange(n, dtype=cupy.float32) + value_offset
    _held.setdefault("pool_arrays", []).append(a)
    return cupy_ipc.get_ipc_handle(a).to_bytes()


def open_pool_bytes(data: bytes) -> dict[str, Any]:
    """Open a pool handle from bytes (the descriptor is taken with pidfd_getfd), sum, write -1 at 0."""
    import cupy

    import cupy_ipc
    from cupy_ipc import _pools

    h = cupy_ipc.IpcArrayHandle.from_bytes(data)
    with h as a:
        total = float(a.sum())
        a[0] = -1
        cupy.cuda.get_current_stream().synchronize()
    del a
    return {"kind": h.kind, "sum": total, "pools_imported": len(_pools._imports)}


def collect_a_cycle_holding_the_pools_lock(data: bytes) -> dict[str, Any]:
    """Open a pool array, leave it in a reference cycle, and have a thread holding the pools' lock collect it
    (as an allocation in the library's code would); whether that thread got stuck, and what is mapped after."""
    import threading

    from cupy_ipc import IpcArrayHandle, _pools

    arr = IpcArrayHandle.from_bytes(data)._open()
    value = float(arr[0])
    gc.disable()  # no automatic collection on this thread frees the cycle before the collector's
    try:
        cycle: list[Any] = [arr]
        cycle.append(cycle)
        del arr, cycle

        def collect() -> None:
            with _pools._lock:
                gc.collect()

        collector = threading.Thread(target=collect, daemon=True)
        collector.start()
        collector.join(20)
    finally:
        gc.enable()
    return {"value": value, "stuck": collector.is_alive(), "mapped": _mapped_once_released()}


def release_on_the_librarys_thread(data: bytes) -> dict[str, Any]:
    """Open a pool array with no idle mapping kept, drop it in a collected cycle (so that the library's thread,
    which has made no CUDA call yet, unmaps it), and report what is left imported and what was warned."""
    import warnings

    from cupy_ipc import IpcArrayHandle, _mapping, _pools

    old = _mapping.set_idle_mapping_limit(0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            arr = IpcArrayHandle.from_bytes(data)._open()
            value = float(arr[0])
            cycle: list[Any] = [arr]
            cycle.append(cycle)
            del arr, cycle
            gc.collect()
            mapped = _mapped_once_released()
        return {"value": value, "mapped": mapped, "imported": len(_pools._pointer_pool),
                "warned": [str(w.message) for w in caught]}
    finally:
        _mapping.set_idle_mapping_limit(old)


def open_on_both_gpus_drop_one(data: bytes) -> dict[str, Any]:
    """Open one handle on GPU 0 and on GPU 1, drop the first array, read the second on its GPU."""
    import cupy

    from cupy_ipc import IpcArrayHandle, _mapping

    h = IpcArrayHandle.from_bytes(data)
    first, second = h._open(device=0), h._open(device=1)
    both = _mapping.counts()["mapped"]
    del first
    gc.collect()
    cupy.cuda.Device(0).synchronize()
    with cupy.cuda.Device(1):
        values = (float(second[0]), float(second[12345]), float(second[-1]))
    del second
    gc.collect()
    return {"both": both, "values": values, "mapped": _mapped_once_released()}


def _mapped_once_released(timeout: float = 10.0) -> int:
    """The mappings left once the releases handed to the library's thread have run (within ``timeout``)."""
    from cupy_ipc import _mapping

    deadline = time.monotonic() + timeout
    while _mapping.counts()["mapped"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return _mapping.counts()["mapped"]


def collect_pools() -> dict[str, int]:
    """``cupy_ipc.collect()`` after a garbage collection; the pools imported after it, and the descriptors."""
    import cupy_ipc
    from cupy_ipc import _pools

    gc.collect()
    cupy_ipc.collect()
    return {"pools_imported": len(_pools._imports), "fds": open_fds()}


def recv_pool_handle(sock: Any) -> dict[str, Any]:
    """Receive a handle and its descriptor over a Unix socket, and open it."""
    import cupy_ipc
    from cupy_ipc import _pools

    h = cupy_ipc.recv_handle(sock)
    got_fd = h._fd is not None
    with h as a:
        total = float(a.sum())
    del a
    return {"sum": total, "descriptor_came_along": got_fd, "pools_imported": len(_pools._imports)}


def sum_from_queue(q: Any, out: Any) -> None:
    """Receive arrays on ``q`` until None; answer each one's sum, the pools imported and this process's open
    descriptors (after letting the array go) on ``out``, or the text of the error receiving raised."""
    import cupy_ipc.multiprocessing  # noqa: F401 - the reducers
    from cupy_ipc import _pools

    while True:
        try:
            a = q.get()
        except Exception as e:  # noqa: BLE001 - the test reads it
            out.put(f"{type(e).__name__}: {e}")
            continue
        if a is None:
            break
        total = float(a.sum())
        del a
        out.put((total, len(_pools._imports), len(os.listdir("/proc/self/fd"))))


@contextlib.contextmanager
def queue_worker() -> Iterator[tuple[Any, Any]]:
    """A spawned process running :func:`sum_from_queue` on ``cupy_ipc.multiprocessing`` queues: ``(inbox,
    outbox)``; told to stop at the end."""
    import cupy_ipc.multiprocessing as mp

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=sum_from_queue, args=(inbox, outbox))
    p.start()
    try:
        yield inbox, outbox
    finally:
        inbox.put(None)
        p.join(30)


def vmm_array(n: int, shareable: bool = True, pieces: int = 1) -> Any:
    """``n`` float32 (0, 1, 2, ...) in memory of the virtual memory API, on the current GPU, in ``pieces``."""
    import cupy

    from cupy_ipc import _vmm

    a = cupy.ndarray((n,), cupy.float32, _vmm.allocate(4 * n, shareable, pieces))
    a[...] = cupy.arange(n, dtype=cupy.float32)
    return a


def free_vmm_while_busy(n: int) -> str:
    """Drop an array of virtual memory while a kernel queued after a long one still has to write it; what
    synchronizing says then ("ok", or the CUDA error: the write faulted on unmapped memory)."""
    import cupy

    warm_up()
    a = vmm_array(n)
    spin(0.3)
    a.fill(2)  # runs once the spin is done
    del a
    try:
        cupy.cuda.runtime.deviceSynchronize()
    except Exception as e:  # noqa: BLE001 - the answer is the error itself
        return str(e)
    return "ok"


def open_served(data: bytes, server: bytes) -> float | str:
    """Open handle bytes whose descriptors come from the producer's descriptor server at ``server``: the
    array's sum, or the error's text."""
    import cupy_ipc

    h = cupy_ipc.IpcArrayHandle.from_bytes(data)
    h._ask_producer(server)
    try:
        with h as a:
            return float(a.sum())
    except cupy_ipc.IpcError as e:
        return f"{type(e).__name__}: {e}"


def vmm_producer(n: int) -> bytes:
    """Keep ``n`` float32 of virtual memory here; the handle's bytes."""
    import cupy_ipc

    a = vmm_array(n)
    _held.setdefault("vmm_arrays", []).append(a)
    return cupy_ipc.get_ipc_handle(a).to_bytes()


def relay_vmm_then_drop(items: list[bytes]) -> list[dict[str, Any]]:
    """For each handle of virtual memory: open it, send the array on (export it again, then release that
    export) and let it go, without a collect; the sum, and the mappings, exports and open descriptors this
    process has then (the first handle also opens what this process keeps per producer)."""
    import cupy_ipc
    from cupy_ipc import _vmm

    got = []
    for data in items:
        h = cupy_ipc.IpcArrayHandle.from_bytes(data)
        a = h.open()
        total = float(a.sum())
        relayed = cupy_ipc.get_ipc_handle(a)
        relayed.release()
        h.close()
        del a, relayed
        gc.collect()
        got.append({"sum": total, "mapped": _mapped_once_released(), "exports": len(_vmm._exports),
                    "fds": open_fds()})
    return got


def export_from_two_threads(items: list[bytes]) -> dict[str, Any]:
    """For each handle of virtual memory: open it, and have two threads export the array at the same moment
    (as two queues sending it on would); the errors raised, and whether both exports named one descriptor."""
    import sys
    import threading

    import cupy_ipc

    errors: list[str] = []
    same = 0

    def export(a: Any, barrier: threading.Barrier, got: list[Any]) -> None:
        barrier.wait()
        try:
            got.append(cupy_ipc.get_ipc_handle(a))
        except Exception as e:  # noqa: BLE001 - the test reads it
            errors.append(f"{type(e).__name__}: {e}")

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to meet the window
    try:
        for data in items:
            h = cupy_ipc.IpcArrayHandle.from_bytes(data)
            a = h.open()
            got: list[Any] = []
            args = (a, threading.Barrier(2), got)
            threads = [threading.Thread(target=export, args=args) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            same += len(got) == 2 and got[0]._f.fd == got[1]._f.fd
            for g in got:
                g.release()
            h.close()
            del a, got, args, threads
    finally:
        sys.setswitchinterval(old)
    return {"errors": errors, "same": same}


def torch_expandable_producer(n: int) -> dict[str, Any]:
    """A tensor of PyTorch's expandable segments (the environment asks for them), exported."""
    import torch

    import cupy_ipc

    t = torch.arange(n, dtype=torch.float32, device="cuda") * 2
    torch.cuda.synchronize()
    _held.setdefault("tensors", []).append(t)
    h = cupy_ipc.get_ipc_handle(t)
    return {"kind": h.kind, "data": h.to_bytes(), "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}


# --- process groups --------------------------------------------------------------
def gloo_engine_rank(rank: int, size: int, store: str, data: Any, fail: bool, conn: Any) -> None:
    """One rank of a gloo group on the CPU: what all_gather's collectives give it, sent on ``conn``."""
    try:
        import torch.distributed as dist

        from cupy_ipc._groups import _Engine

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
        engine = _Engine(dist.group.WORLD)
        out = {"rank": engine.rank, "size": engine.size, "handles": engine.handles(data),
               "failed": engine.failed(fail), "none_failed": engine.failed(False), "objects": engine.objects(rank)}
        dist.destroy_process_group()
        conn.send(("ok", out))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        conn.send(("err", repr(e)))


# --- stand-ins for the doctor's self-test consumer (which needs a GPU) ----------------
def answering_self_test_consumer(conn: Any) -> None:
    """One on a GPU that works: it answers each step, and quits when asked."""
    while conn.recv() is not None:
        conn.send(("ok", 0.0))


def stuck_self_test_consumer(conn: Any) -> None:
    """One hung (in the driver, say): it answers nothing, not even the request to quit."""
    time.sleep(300)


def gloo_outsider_rank(rank: int, size: int, store: str, conn: Any) -> None:
    """One rank of a gloo world of two with a group of rank 0 alone: what node_local_ranks and all_gather
    give or raise on it, sent on ``conn``. Rank 0 calls them before rank 1, which it does not wait for."""
    try:
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=30))
        group = dist.new_group([0])
        if rank:
            dist.barrier()
        out = _group_outcomes(group)
        if not rank:
            dist.barrier()
        dist.barrier()  # a collective that a refused rank made on the world would not match this one
        dist.destroy_process_group()
        conn.send(("ok", out))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        conn.send(("err", repr(e)))


def mpi_bad_groups() -> None:
    """Under ``mpiexec -n 2``: what node_local_ranks and all_gather give or raise on each rank with an
    inter-communicator, and with the communicator of rank 0 alone (MPI.COMM_NULL on rank 1), written as JSON
    to ``rank<N>.json`` in the working folder. Rank 0 calls them on its communicator before rank 1, which it
    does not wait for."""
    import json

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    inter = world.Split(rank, 0).Create_intercomm(0, world, 1 - rank)
    alone = world.Split(0 if rank == 0 else MPI.UNDEFINED, 0)
    out = {"inter": _group_outcomes(inter)}
    if rank:
        world.Barrier()
    out["alone"] = _group_outcomes(alone)
    if not rank:
        world.Barrier()
    world.Barrier()  # a collective that a refused rank made on the world would not match this one
    with open(f"rank{rank}.json", "w") as f:  # not stdout, where the launcher may run the ranks' lines together
        json.dump(out, f)


def _group_outcomes(group: Any) -> list[Any]:
    """What node_local_ranks and all_gather give on ``group``, or the type's name and message of what they raised.
    The array is host memory: enough where no peer shares the host."""
    import cupy_ipc

    out: list[Any] = []
    for call in (cupy_ipc.node_local_ranks, lambda g: repr(cupy_ipc.all_gather(np.arange(2), g))):
        try:
            out.append(call(group))
        except Exception as e:  # noqa: BLE001 - the outcome is the point
            out.append([type(e).__name__, str(e)])
    return out
