"""Threads of the library's own, for work that must not run where it arises.

- A consumer's release waits there for the GPU work queued on the memory,
  without blocking the threads that use the library. Each wait has a thread
  to itself (up to eight wait at once), so that a release whose work takes
  long holds up no release behind it whose work is done.
- A legacy handle's mapping that a release lets go is closed on a thread of
  its own: the close waits until the whole GPU is idle, which would hold up
  the thread that dropped the array (or the waiter whose release it was) as
  long as any other work of the process's GPU runs.
- Finalizers that the cyclic garbage collector runs hand their work there.
  The collector runs wherever an allocation sets it off, inside this
  library's locked regions too, on the thread holding the lock: run there, a
  finalizer that takes that lock would wait forever, or change a table the
  thread is going through.

Example:
    >>> import threading
    >>> done = threading.Event()
    >>> start()
    >>> later(done.set)
    >>> done.wait(10)
    True
"""

from __future__ import annotations

import gc
import os
import queue
import threading
from typing import Any, Callable

from . import _cuda
from ._errors import warn_quietly

__all__ = ["WHOLE_DEVICE", "collecting", "later", "now_or_later", "soon", "start"]

# Made before anything that may hand work here exists: putting on a SimpleQueue is safe in a finalizer, where
# taking a lock (to make one, or to start the thread) is not.
_queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
_running = False
_start_lock = threading.Lock()
_collecting = False
# The waiters: threads that each wait for one piece of work's event, then do it. Counted under _count_lock
# by the thread that hands them work (the one _run runs on) and by themselves.
_MAX_WAITERS = 8
_waits: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
_count_lock = threading.Lock()
_waiters = 0  # started
_free = 0  # waiting for work that no other waiter will take
_backlog = 0  # work handed over while every waiter was busy
# The closer: one thread for work that waits for nothing but may take long (a close), in the order handed over.
_closes: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
_closer_runs = False  # its thread runs


def _note_collection(phase: str, info: dict[str, int]) -> None:
    global _collecting
    _collecting = phase == "start"


gc.callbacks.append(_note_collection)


def collecting() -> bool:
    """Whether the cyclic garbage collector is running: a finalizer called now hands its work to :func:`later`."""
    return _collecting


def start() -> None:
    """Start the threads, if they are not running: before making anything whose finalizer may call
    :func:`later` or :func:`soon`."""
    global _running, _closer_runs
    if _note_collection not in gc.callbacks:  # (code that clears the list would silently undo the deferral)
        gc.callbacks.append(_note_collection)
    if _running and _closer_runs:
        return
    with _start_lock:
        if not _running:
            threading.Thread(target=_run, args=(_queue,), name="cupy_ipc-reaper", daemon=True).start()
            _running = True
        if not _closer_runs:
            threading.Thread(target=_close_all, args=(_closes,), name="cupy_ipc-closer", daemon=True).start()
            _closer_runs = True


class _WholeDevice:
    """An ``after`` for :func:`later` that waits for all the GPU's work, where no event of the work is known."""

    def synchronize(self) -> None:
        _cuda.rt().deviceSynchronize()


WHOLE_DEVICE = _WholeDevice()


def later(then: Callable[..., Any], *args: Any, after: Any = None, device: int = 0) -> None:
    """Have the thread call ``then(*args)``, once the CUDA event ``after`` (of GPU ``device``), if any, has
    completed. Safe in a finalizer."""
    _queue.put((after, device, then, args))


def soon(then: Callable[..., Any], *args: Any, device: int | None = None) -> None:
    """Have the closer thread call ``then(*args)`` (after what was handed to it before), with GPU ``device``, if
    given, made current there first; here and now, on this thread's current GPU, if it does not run (in a
    forked child). Safe in a finalizer.

    The GPU is left current on that thread: it has none of its own to go back to, and going back to the
    runtime's default, GPU 0, would make a context there in a process that never used GPU 0.
    """
    if _closer_runs:
        _closes.put((then, args, device))
    else:
        then(*args)


def now_or_later(then: Callable[..., Any], *args: Any) -> None:
    """A finalizer's work: ``then(*args)`` now, or on the thread if a garbage collection is running."""
    if _collecting:
        later(then, *args)
    else:
        then(*args)


def _run(q: "queue.SimpleQueue[Any]") -> None:
    # Only hands the work on: a finalizer may put work on the queue, but not start a thread.
    while True:
        _hand_to_a_waiter(q.get())


def _close_all(q: "queue.SimpleQueue[Any]") -> None:
    while True:
        then, args, device = q.get()
        try:
            if device is not None:
                try:
                    _cuda.rt().setDevice(device)
                except Exception:  # noqa: BLE001, S110 - then the work fails too, and says so
                    pass
            then(*args)
        except BaseException as e:  # noqa: BLE001 - this thread serves every later close: it must not end
            warn_quietly(f"could not close a mapping: {e!r}")
        del then, args  # (what they hold goes now, not when the next close comes)


def _hand_to_a_waiter(work: tuple[Any, ...]) -> None:
    global _waiters, _free, _backlog
    with _count_lock:
        start = False
        if _free:
            _free -= 1
        elif _waiters < _MAX_WAITERS:
            _waiters += 1
            start = True
        else:
            _backlog += 1
    if start:
        try:
            threading.Thread(target=_wait, args=(_waits,), name=f"cupy_ipc-reaper-{_waiters}", daemon=True).start()
        except RuntimeError:  # no new thread (the interpreter is shutting down, say): done here
            with _count_lock:
                _waiters -= 1
            _do(*work)  # (not queued: a waiter freed meanwhile would take it, and this thread wait for ever)
            return
    _waits.put(work)


def _wait(q: "queue.SimpleQueue[Any]") -> None:
    global _free, _backlog
    while True:
        _do(*q.get())
        with _count_lock:
            if _backlog:
                _backlog -= 1  # this waiter takes work handed over while all were busy
            else:
                _free += 1


def _do(done: Any, device: int, then: Callable[..., Any], args: tuple[Any, ...]) -> None:
    if done is not None:
        try:
            _cuda.rt().setDevice(device)
            done.synchronize()
        except Exception as e:  # its work may still read the memory: kept, as a release that cannot order is
            warn_quietly(f"could not wait for a consumer's work, so its memory stays pinned: {e}")
            return
    try:
        then(*args)
    except Exception as e:  # these threads serve every later release: they must not end
        warn_quietly(f"could not finish a release: {e}")


def _forget_after_fork() -> None:
    global _queue, _running, _start_lock, _waits, _count_lock, _waiters, _free, _backlog, _closes, _closer_runs
    _queue, _running, _start_lock = queue.SimpleQueue(), False, threading.Lock()  # the threads are the parent's
    _closes, _closer_runs = queue.SimpleQueue(), False
    _waits, _count_lock, _waiters, _free, _backlog = queue.SimpleQueue(), threading.Lock(), 0, 0, 0


os.register_at_fork(after_in_child=_forget_after_fork)
