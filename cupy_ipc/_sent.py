"""Arrays sent in messages, which a process started by :mod:`multiprocessing` awaits at its exit.

CUDA frees a process's memory when it exits. An array it sent that its receiver opens after that raises
:class:`ProducerExitedError` there (in a ``Pool``, it fails the task whose result it is). A worker that
returns its result and ends (one of a ``Pool`` with ``maxtasksperchild``, a ``Process`` whose target puts its
result on a queue) raced its receiver that way. An array opened before keeps its memory (the driver holds it for the mapping: measured
on an H200 with the sender killed), so such a process, at its exit, once its queues have flushed, waits
until every array it sent has been opened or refused (revoked, past its lease), its parent has ended, or
:func:`set_exit_wait` seconds have passed; then until its GPUs have finished the work queued on memory still
pinned, which the process's end would otherwise cut short.

The main process does not wait: it closes its segment at exit before its queues flush, so an array it sends
must be received before it ends (as the standard module asks of any message, by joining its receivers).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import time

from . import _cuda, _fork, _keepalive
from ._args import checked_wait
from ._errors import warn_quietly

__all__ = ["note", "set_exit_wait"]

DEFAULT_WAIT = 10.0
_wait = DEFAULT_WAIT
_sent: set[int] = set()  # export ids of arrays sent; pruned of opened ones as it grows
_prune_at = 1024
_child: bool | None = None  # whether this process waits: one started by multiprocessing
_any = False  # whether it has sent an array


def set_exit_wait(seconds: float) -> float:
    """Wait at most ``seconds`` at this process's exit for the receivers of the arrays it sent to open them
    (default 10; ``0``: no wait, and no warning; ``math.inf``: until they are opened or refused); returns the
    old setting. Only a process started by :mod:`multiprocessing` waits (see the module's notes); the processes
    started from this one (by any start method) take the setting this one has when it starts them.

    Example:
        >>> set_exit_wait(2.5)
        10.0
        >>> set_exit_wait(10)
        2.5
    """
    global _wait
    old, _wait = _wait, checked_wait(seconds, "the exit wait")
    return old


def note(export_id: int) -> None:
    """Export ``export_id`` was sent in a message: in a process started by multiprocessing, await it at exit."""
    global _child, _prune_at, _any
    if _child is None:  # (known once the process runs its target: not yet while its module is imported)
        _child = multiprocessing.parent_process() is not None
    if not _child or not export_id:  # (no export id: sent with keep-alive off, nothing to await)
        return
    _any = True
    _sent.add(export_id)
    if len(_sent) >= _prune_at:
        seen = set(_sent)  # (a copy: another thread may add meanwhile, and what it adds stays)
        _sent.difference_update(seen.difference(_keepalive.awaiting(seen)[0]))
        _prune_at = max(1024, 2 * len(_sent))


def _await_receivers() -> None:
    if not _any or _fork.forked_after_cuda():
        return
    try:
        deadline = time.monotonic() + _wait
        parent = multiprocessing.parent_process()
        while True:
            left, devices = _keepalive.awaiting(tuple(_sent))  # (a copy: a thread still running may send more)
            if not left or (parent is not None and not parent.is_alive()):
                break
            if time.monotonic() >= deadline:
                if not _wait:  # no wait asked for: nor a warning
                    break
                warn_quietly(f"process {multiprocessing.current_process().name} exits with {len(left)} array(s) it "
                             f"sent that no receiver opened within {_wait:g} s: opening them will raise "
                             "ProducerExitedError (receive messages before joining their sender, or raise "
                             "cupy_ipc.multiprocessing.set_exit_wait)")
                break
            time.sleep(0.002)
        for device in sorted(devices):
            with _cuda.using_device(device):
                _cuda.rt().deviceSynchronize()
    except Exception as e:  # noqa: BLE001 - at exit: say so, and let the process end
        warn_quietly(f"could not await the receivers of the arrays this process sent: {e}")


_finalizer: multiprocessing.util.Finalize | None = None


def _register(_: object = None) -> None:
    # Run after the queues' own finalizers, which flush what they hold (priority -5 joins their threads).
    global _finalizer
    if _finalizer is None or not _finalizer.still_active():
        _finalizer = multiprocessing.util.Finalize(None, _await_receivers, exitpriority=-10)


def _forget_after_fork() -> None:
    # What the parent sent is the parent's to await, and whether it is a child of multiprocessing too.
    global _child, _any, _prune_at
    _child, _any, _prune_at = None, False, 1024
    _sent.clear()


# Registered now, not at the first array sent: a queue pickles on its own thread, which may send the first
# array after the exit has begun running the finalizers. A child started by fork or forkserver drops the
# finalizers it inherited, or registered while its target was unpickled, before its target runs
# (BaseProcess._after_fork), then runs the after-fork hooks: registered again there.
_register()
multiprocessing.util.register_after_fork(_await_receivers, _register)
os.register_at_fork(after_in_child=_forget_after_fork)
