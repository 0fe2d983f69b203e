"""A thread of the library's own, for work that must not run where it arises.

- A consumer's release waits there for the GPU work queued on the memory,
  without blocking the threads that use the library.
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

__all__ = ["WHOLE_DEVICE", "collecting", "later", "now_or_later", "start"]

# Made before anything that may hand work here exists: putting on a SimpleQueue is safe in a finalizer, where
# taking a lock (to make one, or to start the thread) is not.
_queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
_running = False
_start_lock = threading.Lock()
_collecting = False


def _note_collection(phase: str, info: dict[str, int]) -> None:
    global _collecting
    _collecting = phase == "start"


gc.callbacks.append(_note_collection)


def collecting() -> bool:
    """Whether the cyclic garbage collector is running: a finalizer called now hands its work to :func:`later`."""
    return _collecting


def start() -> None:
    """Start the thread, if it is not running: before making anything whose finalizer may call :func:`later`."""
    global _running
    if _note_collection not in gc.callbacks:  # (code that clears the list would silently undo the deferral)
        gc.callbacks.append(_note_collection)
    if _running:
        return
    with _start_lock:
        if not _running:
            threading.Thread(target=_run, args=(_queue,), name="cupy_ipc-reaper", daemon=True).start()
            _running = True


class _WholeDevice:
    """An ``after`` for :func:`later` that waits for all the GPU's work, where no event of the work is known."""

    def synchronize(self) -> None:
        _cuda.rt().deviceSynchronize()


WHOLE_DEVICE = _WholeDevice()


def later(then: Callable[..., Any], *args: Any, after: Any = None, device: int = 0) -> None:
    """Have the thread call ``then(*args)``, once the CUDA event ``after`` (of GPU ``device``), if any, has
    completed. Safe in a finalizer."""
    _queue.put((after, device, then, args))


def now_or_later(then: Callable[..., Any], *args: Any) -> None:
    """A finalizer's work: ``then(*args)`` now, or on the thread if a garbage collection is running."""
    if _collecting:
        later(then, *args)
    else:
        then(*args)


def _run(q: "queue.SimpleQueue[Any]") -> None:
    runtime = _cuda.rt()
    while True:
        done, device, then, args = q.get()
        if done is not None:
            try:
                runtime.setDevice(device)
                done.synchronize()
            except Exception as e:  # its work may still read the memory: kept, as a release that cannot order is
                warn_quietly(f"could not wait for a consumer's work, so its memory stays pinned: {e}")
                continue
        try:
            then(*args)
        except Exception as e:  # this thread serves every later release: it must not end
            warn_quietly(f"could not finish a release: {e}")


def _forget_after_fork() -> None:
    global _queue, _running, _start_lock
    _queue, _running, _start_lock = queue.SimpleQueue(), False, threading.Lock()  # the thread is the parent's


os.register_at_fork(after_in_child=_forget_after_fork)
