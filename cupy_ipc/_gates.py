"""Ordering waits that a producer's death cannot leave stuck.

:meth:`IpcArrayHandle.open` makes the consumer's stream wait for the
producer's ordering event. A stream made to wait on another process's event
itself (``cudaStreamWaitEvent``) waits for ever if that process is killed
before the event's work has run: the event is never completed, CUDA has no
timeout, and a record of the same event by the consumer does not release the
wait (both measured on an H200). Every device-wide wait of the consumer
after that (a ``cudaFree``, a mapping's close, its exit) hung with it.

So an open whose event has not completed yet waits on a word of pinned host
memory instead (``cuStreamWaitValue32``). Where the producer's stream writes a
word of its own segment once the work is done (``_words``), the consumer's
stream waits for that one, and a thread of the library only looks, every
20 ms, whether the producer still lives. Otherwise (and for
:meth:`IpcEvent.wait` on an event opened from a handle) the stream waits on a
word of this process, and that thread polls the event and sets the word once
it has completed. Either way, once the thread sees the producer gone before
the word was reached, it sets the word itself: the stream goes on, the open's
arrays marked incomplete first (their handle's ``close()`` raises
:class:`ProducerExitedError`), and a warning says so at once. A wait on the
host for such an event (:func:`host_wait`) polls it too, and raises once the
producer is gone.

Each word of this process serves one wait at a time, each wait for a value
the word has not held before (its count goes up), so a word is free again as
soon as it is set. Waits compare cyclically (``(int32)(word - value) >= 0``):
a stream still queued behind its own work when its word is set, and the word
handed out again and set to a later value, still goes on.

Example:
    >>> [poll_interval(age) for age in (0.0005, 0.01, 1.0)]
    [2e-05, 0.0002, 0.002]
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
import weakref
from typing import Any

from . import _cuda, _segment, _words
from ._errors import ProducerExitedError, warn_quietly

__all__ = ["host_wait", "incomplete", "pending", "poll_interval", "wait", "wait_for", "wait_word"]

_WORDS = 4096  # waits at once; past that, opens wait on the event itself
_GEQ = _words.GEQ  # cyclic >=: EQ would hang a stream that reaches its wait only once its word has been handed
# out again and set to a later value
_HOST_ALLOC_FLAGS = 0x01 | 0x02  # CU_MEMHOSTALLOC_PORTABLE (every context) | CU_MEMHOSTALLOC_DEVICEMAP
_LIVENESS_EVERY = 0.02  # seconds between checks that a waited-on producer still lives

_cond = threading.Condition(threading.Lock())
_base = 0  # address of the words, the same on host and GPUs (unified addressing); 0: not made yet
_unsupported = False  # this driver cannot: opens wait on the event itself, as before
_free: list[int] = []
_taken: set[int] = set()  # words handed out and not yet set
_values: list[int] = []  # each word's last value handed out
_pending: dict[Any, "_Gate"] = {}  # by this process's word, or (words, slot, value) of a producer's


class _Gate:
    __slots__ = ("word", "value", "event", "device", "segment", "pid", "leases", "since", "check_at", "words")

    def __init__(self, word: Any, value: int, event: Any, device: int, segment: Any, pid: int, lease: Any,
                 words: Any = None) -> None:
        # ``word``: this process's word, set by the thread once ``event`` has completed; or, with ``words`` (the
        # producer's, ``event`` None), the producer's slot, which its GPU sets.
        self.word, self.value, self.event, self.device, self.words = word, value, event, device, words
        self.segment, self.pid = segment, pid  # the producer's segment tells whether it lives
        self.leases = [weakref.ref(lease)] if lease is not None else []  # the opens it serves (see wait_word)
        self.since = self.check_at = time.monotonic()


def poll_interval(age: float) -> float:
    """Seconds between polls of the pending waits, by the age of the youngest: short while most waits end."""
    if age < 0.002:
        return 2e-05
    if age < 0.05:
        return 0.0002
    return 0.002


def pending() -> int:
    """How many waits the library's thread has yet to release."""
    return len(_pending)


def incomplete(lease: Any) -> "tuple[int, str] | None":
    """``(pid, reason)`` when the arrays of ``lease``'s open may hold incomplete values: their producer exited
    before the work that their ordering event waited for had run."""
    return getattr(lease, "incomplete", None)


def wait(event: Any, stream_ptr: int, device: int, segment: Any, pid: int, lease: Any) -> None:
    """Make stream ``stream_ptr`` of GPU ``device`` (current) wait on the GPU for ``event``, an opened event
    of producer ``pid`` (whose ``segment`` tells whether it lives), not completed yet; ``lease``: the open's,
    marked if the producer exits first."""
    word = _take(device)
    if word is None or not _queued(word, event, stream_ptr, device, segment, pid, lease):  # the event itself
        _cuda.call("waiting on an event", _cuda.rt().streamWaitEvent, stream_ptr, event.ptr, 0)


def wait_word(words: Any, slot: int, value: int, stream_ptr: int, device: int, segment: Any, pid: int,
              lease: Any) -> bool:
    """Make stream ``stream_ptr`` of GPU ``device`` (current) wait for producer ``pid``'s word ``slot`` of
    ``words`` (:class:`_words.Words`) to reach ``value``, which its GPU writes once the export's work is done;
    watched by the thread, which sets it if the producer exits first. False, nothing queued, where the driver
    refused (the caller waits on the event then)."""
    gate = _Gate(slot, value, None, device, segment, pid, lease, words)
    with _cond:
        if _unsupported or not _started():  # (the stream memory operations this needs; a thread to watch it)
            return False
    if not _words.wait(words, stream_ptr, slot, value):
        return False
    with _cond:
        served = _pending.get((words, slot, value))
        if served is None:
            _pending[(words, slot, value)] = gate
            _cond.notify()
        else:  # the same wait twice (two opens of one export): one watch serves, and marks, both
            served.leases += gate.leases
    return True


def wait_for(event: Any, stream_ptr: int, stream_device: int, segment: Any, pid: int, lease: Any) -> None:
    """:func:`wait`, for a stream of any GPU: one of another GPU than the event's cannot wait for it on the GPU
    (see :meth:`IpcEvent.wait`), and waits on the host (:func:`host_wait`)."""
    with _cuda.using_device(event.device):
        if stream_device == event.device:
            wait(event, stream_ptr, stream_device, segment, pid, lease)
        else:
            host_wait(event, segment, pid)


def _queued(word: int, event: Any, stream_ptr: int, device: int, segment: Any, pid: int, lease: Any) -> bool:
    """Make the stream wait on ``word``, taken for its next value, for the thread to set; False, the word let go,
    where the driver refused."""
    value = _values[word]
    gate = None
    try:
        gate = _Gate(word, value, event, device, segment, pid, lease)
        if _cuda._in_context(device, _words.wait_fn(), stream_ptr, _base + 4 * word, value, _GEQ):
            return False
        with _cond:
            _pending[word] = gate
            _cond.notify()
        return True
    finally:
        if _pending.get(word) is not gate:  # failed, or interrupted: no stream may wait on a word nobody sets
            _set_free(word, value)  # (nothing if the thread has released it already)


def host_wait(event: Any, segment: Any, pid: int) -> None:
    """Block the host until ``event``, opened from producer ``pid``'s handle, has completed, polling it
    (spinning, unless it was made with blocking sync: then as the thread does); where its ``segment`` shows
    the producer gone first, the event never will.

    Raises:
        ProducerExitedError: The producer exited before the event's work had run.
        IpcError: The query failed.
    """
    runtime = _cuda.rt()
    spin = not event.block
    start = check_at = time.monotonic()
    while True:
        status = runtime.eventQuery(event.ptr)  # (CuPy returns the status, raising for none)
        if status == 0:
            return
        if status != _cuda.NOT_READY:
            raise _cuda._translated("synchronizing an event", _cuda._runtime_error()(status))
        now = time.monotonic()
        if now >= check_at:
            check_at = now + _LIVENESS_EVERY
            if _exited_first(event, segment):
                raise ProducerExitedError(f"the producer (pid {pid}) exited before the work that its event waits "
                                          f"for had run: the event will never complete", pid=pid)
        # Spinning, as CUDA's own synchronize does for an event made without blocking sync: a sleep of 20 us
        # lasts about 70 here (the timer's slack), and an event of another process is seen completed some
        # 100 us after its record (measured on an H200), so a sleeping poll came up to a sleep late.
        # (sleep(0) lets other threads have the GIL.)
        time.sleep(0 if spin else poll_interval(now - start))


def _exited_first(event: Any, segment: Any) -> bool:
    """Whether the producer that ``segment`` belongs to has exited before ``event``'s work had run, which then
    never will; a producer found gone is forgotten as an open that finds it gone does."""
    if segment.producer_alive():
        return False
    _segment.found_exited(segment)
    return _cuda.rt().eventQuery(event.ptr) != 0  # (not done just before it exited)


def _take(device: int) -> int | None:
    """A free word, its next value counted up; ``None`` where there are none (or cannot be)."""
    with _cond:
        if not _base and not _unsupported:
            try:
                _make(device)
            except Exception as e:  # noqa: BLE001 - opens wait on the events themselves, as before
                warn_quietly(f"cannot make the words that stand in for other processes' events ({e!r}): a stream "
                             f"that waits for a killed producer's event may then wait for ever")
        if not _free:
            return None
        word = _free.pop()
        _taken.add(word)
        _values[word] = (_values[word] + 1) & 0xFFFFFFFF or 1  # (0, every word's start, never waited for)
        return word


def _make(device: int) -> None:
    """The words and the thread that sets them; on failure, opens wait on the events themselves."""
    global _base, _unsupported
    _unsupported = True  # until made
    alloc = _cuda._libcuda_fn("cuMemHostAlloc", ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)
    device_ptr = _cuda._libcuda_fn("cuMemHostGetDevicePointer_v2", ctypes.POINTER(ctypes.c_uint64),
                                   ctypes.c_void_p, ctypes.c_uint)
    if alloc is None or device_ptr is None or _words.wait_fn() is None:
        return
    host, dev = ctypes.c_void_p(), ctypes.c_uint64()
    if _cuda._in_context(device, alloc, ctypes.byref(host), 4 * _WORDS, _HOST_ALLOC_FLAGS) or not host.value:
        return
    if _cuda._in_context(device, device_ptr, ctypes.byref(dev), host, 0) or dev.value != host.value:
        return  # (kept: pinned memory freed while a stream may wait on it would be read after its free)
    ctypes.memset(host.value, 0, 4 * _WORDS)
    if not _started():
        return
    _free.extend(range(_WORDS - 1, -1, -1))
    _values.extend([0] * _WORDS)
    _base = host.value
    _unsupported = False


_thread: threading.Thread | None = None


def _started() -> bool:
    """Whether the thread that releases the waits runs, started now if need be (the caller holds ``_cond``)."""
    global _thread
    if _thread is None:
        thread = threading.Thread(target=_watch, name="cupy_ipc-gates", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no new thread (the interpreter is exiting, say): nothing would release the waits
            return False
        atexit.register(_drain)  # (after CuPy's: runs before its teardown, which may wait for the GPU)
        _thread = thread
    return True


def _set_free(word: int, value: int) -> None:
    """Release the stream that waits on ``word`` for ``value``, and hand the word out again (once)."""
    with _cond:
        if word not in _taken or _values[word] != value:
            return  # released already, and maybe handed out again for a later wait
        gate = _pending.get(word)
        if gate is not None and gate.value == value:
            del _pending[word]
        _taken.discard(word)
        ctypes.c_uint32.from_address(_base + 4 * word).value = value
        _free.append(word)


def _watch() -> None:
    device = None
    while True:
        with _cond:
            while not _pending:
                _cond.wait()
            gates = list(_pending.values())
        now = time.monotonic()
        for g in gates:
            try:
                if g.words is not None:
                    _check_word(g, now)
                    continue
                if g.device != device:  # (never left on GPU 0 by default: that would make a context there)
                    _cuda.rt().setDevice(g.device)
                    device = g.device
                _check(g, now)
            except BaseException as e:  # noqa: BLE001 - this thread releases every later wait: it must not end
                _mark(g, f"the producer's {'event' if g.words is None else 'word'} could not be queried ({e!r})")
                _release(g)
        del gates, g  # (the events and segments they hold go now, not at the next poll)
        with _cond:
            if not _pending:
                continue
            # Events are polled, fast while young; the producers' words need a look only for their liveness. A
            # new wait wakes the thread (notify), so that its event is polled at once.
            youngest = max((p.since for p in _pending.values() if p.words is None), default=None)
            _cond.wait(_LIVENESS_EVERY if youngest is None else poll_interval(now - youngest))


def _release(g: _Gate) -> None:
    """Let ``g``'s stream go on now."""
    if g.words is None:
        _set_free(g.word, g.value)
        return
    try:
        g.words.set(g.word, g.value)  # (the producer's, which has gone: nobody else writes it)
    except (ValueError, OSError):  # unmapped (at exit, or in a forked child): no stream here waits any more
        pass
    _drop(g)


def _drop(g: _Gate) -> None:
    with _cond:
        key = (g.words, g.word, g.value)
        if _pending.get(key) is g:
            del _pending[key]


def _check_word(g: _Gate, now: float) -> None:
    """A wait for a producer's word: forgotten once the word is reached; released, marked incomplete, once the
    producer is seen gone before that."""
    if _words.reached(g.words.read(g.word), g.value):
        _drop(g)
        return
    if now < g.check_at:
        return
    g.check_at = now + _LIVENESS_EVERY
    if g.segment.producer_alive():
        return
    _segment.found_exited(g.segment)
    if _words.reached(g.words.read(g.word), g.value):  # (done just before it exited)
        _drop(g)
        return
    _mark(g, f"the producer (pid {g.pid}) exited before the work that its export waits for had run")
    _release(g)


def _check(g: _Gate, now: float) -> None:
    status = _cuda.rt().eventQuery(g.event.ptr)  # (CuPy returns the status, raising for none)
    if status == 0:
        _set_free(g.word, g.value)
        return
    if status == _cuda.NOT_READY:
        if now < g.check_at:
            return
        g.check_at = now + _LIVENESS_EVERY
        if not _exited_first(g.event, g.segment):
            return  # alive, or its work done just before it exited: the next poll releases the wait
        reason = f"the producer (pid {g.pid}) exited before the work that its event waits for had run"
    else:
        reason = f"the producer's event could not be queried: {_cuda._runtime_error()(status)}"
    _mark(g, reason)  # before the stream goes on
    _release(g)


def _mark(g: _Gate, reason: str) -> None:
    for ref in g.leases:
        lease = ref()
        if lease is not None:
            lease.incomplete = (g.pid, reason)
    warn_quietly(f"released a stream that waited for another process's work: {reason}; what the stream reads of "
                 f"that work may be incomplete")


def _drain() -> None:
    """At exit, before CuPy's teardown: wait until the thread has released every stream (its event completed or
    its producer exited), since that teardown waits for the GPU, and the thread stops with it."""
    while _pending:
        time.sleep(0.001)


def _forget_after_fork() -> None:
    # The words are the parent's pinned memory, and its thread does not run here: a forked child makes no CUDA call.
    global _cond, _base, _unsupported, _free, _taken, _values, _pending, _thread
    _cond, _base, _unsupported, _thread = threading.Condition(threading.Lock()), 0, False, None
    _free, _taken, _values, _pending = [], set(), [], {}


os.register_at_fork(after_in_child=_forget_after_fork)
