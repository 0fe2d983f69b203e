"""The producer's registry of exported memory that must stay alive.

Every export with ``keepalive`` or ``sync`` on takes a slot in this process's
segment (see ``_segment``) and a *pin* here holding the exported array (so
CuPy's pool cannot hand its memory out again) and the ordering event. A pin
ends when

- ``consumers`` processes have opened the export, or it was revoked (by
  :meth:`IpcArrayHandle.release` or by its lease running out), and
- no consumer still holds the slot's in-use lock, which a consumer keeps until
  the GPU work it queued on the memory has finished.

The registry is swept on :func:`collect` and on exports: on every export
while it holds fewer than 64 pins, so that a pipeline with buffers in flight
frees each at the next export; past that, once per eighth of the pins left
by the last sweep, so that an export costs a constant number of checks on
average however many exports await their consumers (a pool mapping over
thousands of arrays), for at most an eighth more pins held. An export made
while a sender of ``multiprocessing`` pickles its message (see
``cupy_ipc.multiprocessing``) leaves that sweep to the sender, which makes it
once the message has left (a queue's, once its write lock is released, which
the queue's other writers wait for): then the receiver's open, not the
message's trip, waits for it. A lease that runs
out is revoked at once by a background thread, so that consumers are refused
even if this process never exports again; its memory goes at the next sweep.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from typing import Any, Iterable, NamedTuple

from . import _cuda, _segment, _words
from ._errors import IpcError, warn_quietly
from ._events import IpcEvent
from ._identity import this_process
from ._segment import ONE_CONSUMER, PINNED, REVOKED
from ._wire import FLAG_EVENT, FLAG_WORD

__all__ = ["PinInfo", "awaiting", "deferral", "lookup", "pin", "pinned", "release", "reset", "sweep", "sweep_owed",
           "wait_own_event"]


class PinInfo(NamedTuple):
    """One export the producer keeps alive, as :func:`cupy_ipc.pinned` reports it.

    ``nbytes`` is the size of the allocation the pin keeps alive (the whole ``cudaMalloc`` block or pool
    allocation, which other pinned arrays may share), not the array's own; ``consumers`` is how many processes
    the export was made for (``get_ipc_handle(consumers=...)``) and ``opens`` how many opens it has counted
    so far; ``age_s`` the seconds since the export and ``lease_left_s`` those before its lease runs out
    (``None``: no lease); ``revoked`` that no further open is let in.

    Example:
        >>> import cupy_ipc
        >>> [p.export_id for p in cupy_ipc.pinned()]      # what this process keeps alive for consumers
        []
    """

    export_id: int
    nbytes: int
    device: int
    consumers: int
    opens: int
    age_s: float
    lease_left_s: float | None
    revoked: bool
    description: str


class _Pin:
    __slots__ = ("export_id", "slot", "keep", "origin", "device", "consumers", "deadline",
                 "event", "revoked", "created", "description")

    def __init__(self, export_id: int, slot: int, keep: Any, origin: tuple[int, int, int], device: int,
                 consumers: int, deadline: float | None, event: IpcEvent | None, description: Any) -> None:
        self.export_id = export_id
        self.slot = slot
        self.keep = keep
        self.origin = origin  # (base, size, buffer id)
        self.device = device
        self.consumers = consumers
        self.deadline = deadline
        self.event = event
        self.revoked = False
        self.created = time.monotonic()
        self.description = description


_lock = threading.RLock()
_pins: dict[int, _Pin] = {}
_free_slots: list[int] = []
_slot_counter = itertools.count()
_export_ids = itertools.count(1)
_event_pool: dict[int, list[IpcEvent]] = {}
_SWEEP_ALWAYS_BELOW = 64  # pins
_SWEEP_SHARE = 8
_exports_to_sweep = 0  # exports left before the next one sweeps, once there are many pins


class _Deferral(threading.local):
    on = False  # this thread pickles a message that its sender writes at once: its exports' sweep waits for that


deferral = _Deferral()
_owed = False  # an export left its sweep to the sender of its message (see sweep_owed)


def _segment_here() -> _segment.Segment:
    return _segment.own_segment(this_process().token)


def _take_event(device: int) -> IpcEvent:
    pool = _event_pool.setdefault(device, [])
    return pool.pop() if pool else IpcEvent()


def pin(keep: Any, origin: tuple[int, int, int], device: int, consumers: int, lease: float | None,
        stream_ptr: int | None, description: Any) -> tuple[int, int, bytes | None, int]:
    """Register an export; returns ``(export_id, slot, event handle or None, flags)``, the flags
    :data:`FLAG_EVENT` and :data:`FLAG_WORD` where the export carries them.

    ``keep`` is held until the pin ends; ``origin`` is the exported
    allocation's ``(base, size, buffer id)``. ``stream_ptr``, when given, is where
    the ordering event is recorded (the current device must be ``device``),
    after the write of the export's word (see ``_words``) where that can be;
    a stream with no work left needs no event, and gets none.
    """
    global _exports_to_sweep, _owed
    seg = _segment_here()
    with _lock:
        if _exports_to_sweep and len(_pins) >= _SWEEP_ALWAYS_BELOW:
            _exports_to_sweep -= 1
        elif _pins:
            if deferral.on:
                _owed = True
            else:
                _sweep(seg)
        if lease is not None:
            _start_keeper()  # before anything is taken: a thread that cannot start fails the export, leaving nothing
        slot = _free_slots.pop() if _free_slots else next(_slot_counter)
        export_id = next(_export_ids)
        event = handle = None
        flags = 0
        try:
            # (The legacy default stream's query counts the work of the blocking streams it waits for: measured.)
            if stream_ptr is not None and not _cuda.stream_idle(stream_ptr):
                event = _take_event(device)
                # The word before the event, so that the event completed means the word written: a slot is freed
                # only then (_try_free), and no write of it is still queued when it is taken again.
                flags = FLAG_EVENT | FLAG_WORD if _words.write(seg, stream_ptr, slot, export_id, device) else FLAG_EVENT
                try:
                    _cuda.call("recording the ordering event", _cuda.rt().eventRecord, event._ptr, stream_ptr)
                except IpcError as e:
                    raise _cuda.of_another_gpu(e, stream_ptr, device, "the array") from e
                handle = event._handle  # a pooled event's, once exported
                if handle is None:
                    handle = event._export(False)  # before the pin: a pin without a handle would leak
                handle = handle.event_handle
            seg.write(slot, export_id, PINNED | ONE_CONSUMER if consumers == 1 else PINNED)
        except BaseException:  # the segment could not grow to the slot, say: both are there for the next pin
            if not flags & FLAG_WORD:  # (else a write of the slot's word may still be queued: the slot is left out)
                _free_slots.append(slot)
            if event is not None:
                _event_pool.setdefault(device, []).append(event)
            raise
        deadline = None if lease is None else time.monotonic() + lease
        _pins[export_id] = _Pin(export_id, slot, keep, origin, device, consumers, deadline, event, description)
        if deadline is not None:
            _watch(deadline, export_id)
    if _unkept:  # (its sweep ended pins)
        _let_go()
    return export_id, slot, handle, flags


# --- leases: revoked when they run out, whether or not this process exports or collects again ---------
_leases: list[tuple[float, int]] = []  # a heap of (deadline, export id)
_leases_changed = threading.Condition(threading.Lock())
_keeper: threading.Thread | None = None


def _watch(deadline: float, export_id: int) -> None:
    # The caller holds _lock. The heap keeps the deadlines of pins that ended before their lease: dropped
    # once they outnumber the live pins (amortized), so that leased messages on a busy queue do not pile up.
    with _leases_changed:
        if len(_leases) >= 2 * len(_pins) + 64:
            _leases[:] = [entry for entry in _leases if entry[1] in _pins]
            heapq.heapify(_leases)
        heapq.heappush(_leases, (deadline, export_id))
        if _leases[0][1] == export_id:  # else the keeper waits for an earlier deadline: no need to wake it
            _leases_changed.notify()


def _start_keeper() -> None:
    # The caller holds _lock. Kept only once started: a thread that could not start ("can't start new thread",
    # a container's limit on processes) is tried again by the next lease, not taken for one that runs.
    global _keeper
    if _keeper is None:
        keeper = threading.Thread(target=_keep_leases, name="cupy_ipc-leases", daemon=True)
        keeper.start()
        _keeper = keeper


_LONGEST_WAIT = 3600.0  # s: a longer wait (an infinite lease) would overflow the lock's timeout


def _keep_leases() -> None:
    # Revoking is a write to the segment, so consumers are refused as soon as a lease runs out; the memory
    # itself is let go by the next sweep (an export or collect()), on the threads that use CUDA.
    while True:
        with _leases_changed:
            while not _leases or _leases[0][0] > time.monotonic():
                _leases_changed.wait(None if not _leases else min(_leases[0][0] - time.monotonic(), _LONGEST_WAIT))
            _, export_id = heapq.heappop(_leases)
        try:
            with _lock:
                p = _pins.get(export_id)
                if p is not None and not p.revoked:
                    _revoke(_segment_here(), p)
        except Exception as e:  # this thread serves every later lease: it must not end
            warn_quietly(f"could not revoke export {export_id} at the end of its lease: {e}")


def lookup(export_id: int) -> tuple[Any, tuple[int, int, int]] | None:
    """``(the object pinned or None, the allocation's (base, size, buffer id))`` of a live export of this
    process, or ``None``."""
    p = _pins.get(export_id)
    return None if p is None else (p.keep, p.origin)


def _revoke(seg: _segment.Segment, p: _Pin) -> None:
    # A consumer that read PINNED just before this still holds the in-use
    # lock, so the memory stays until it is done: revoking only stops new opens.
    seg.write_state(p.slot, REVOKED)
    p.revoked = True


def _try_free(seg: _segment.Segment, p: _Pin) -> bool:
    # Called once the export is revoked or has all its consumers: the slot is
    # closed to further opens first, then freed if no consumer holds it and
    # the work its event orders is done (its word written: see pin).
    if p.event is not None and _cuda.rt().eventQuery(p.event._ptr) == _cuda.NOT_READY:
        seg.write_state(p.slot, REVOKED)
        return False
    if not seg.try_free(p.slot):
        return False  # a consumer still uses it
    del _pins[p.export_id]
    _free_slots.append(p.slot)
    if p.event is not None:
        _event_pool.setdefault(p.device, []).append(p.event)
    _unkept.append(p.keep)  # let go of once _lock is released (_let_go): see there
    p.keep = None
    return True


_unkept: list[Any] = []  # what ended pins kept, to let go of outside _lock


def _let_go() -> None:
    """Drop what ended pins kept, outside ``_lock``: the last reference to an array opened here from another
    producer (sent on) runs its release, which may unmap (and wait for the GPU) while every export of this
    process, and the lease thread, would wait for the lock."""
    global _unkept
    if _unkept:
        _unkept = []  # (a list another thread swapped out meanwhile goes with its last reference, outside too)


def sweep() -> int:
    """End every pin whose consumers are done; returns how many ended."""
    if not _pins:
        return 0
    try:
        return _sweep(_segment_here())
    finally:
        _let_go()


def sweep_owed() -> None:
    """The sweep that exports left to the sender of their message (see :data:`deferral`), once it has sent it.
    A failure is a warning (the message has left: its sender must not see an error) and leaves the sweep owed."""
    global _owed
    if _owed:
        try:
            sweep()
        except Exception as e:  # noqa: BLE001 - collect() or an export outside a message sweeps again, and raises
            _owed = True
            warn_quietly(f"could not end the pins of exports whose consumers are done: {e}")


def _sweep(seg: _segment.Segment) -> int:
    global _exports_to_sweep, _owed
    now = None
    ended = 0
    with _lock:
        _owed = False
        for p in list(_pins.values()):
            if not p.revoked and p.deadline is not None:
                now = time.monotonic() if now is None else now
                if now >= p.deadline:
                    _revoke(seg, p)
            if p.revoked or seg.opens(p.slot) >= p.consumers:
                ended += _try_free(seg, p)
        _exports_to_sweep = len(_pins) // _SWEEP_SHARE
    return ended


def release(export_id: int) -> bool:
    """Stop new opens of an export and end its pin once current consumers are done.

    Returns True if the export was still pinned.
    """
    try:
        with _lock:
            p = _pins.get(export_id)
            if p is None:
                return False
            seg = _segment_here()
            if not p.revoked:
                _revoke(seg, p)
            _try_free(seg, p)
            return True
    finally:
        _let_go()


def pinned() -> list[PinInfo]:
    """What this process keeps alive for consumers, after a sweep."""
    sweep()
    now = time.monotonic()
    with _lock:
        seg = _segment_here() if _pins else None
        return [
            PinInfo(p.export_id, p.origin[1], p.device, p.consumers, seg.read(p.slot)[1] if seg else 0,
                    now - p.created, None if p.deadline is None else max(0.0, p.deadline - now),
                    p.revoked, "{} {}".format(*p.description))
            for p in _pins.values()
        ]


def awaiting(export_ids: Iterable[int]) -> tuple[list[int], set[int]]:
    """Of ``export_ids``, the exports that fewer than their ``consumers`` have opened and that may still be
    opened (neither revoked nor past their lease); and the GPUs of every export still pinned."""
    with _lock:
        if not _pins:
            return [], set()
        seg = _segment_here()
        now = time.monotonic()
        left = [i for i in export_ids if (p := _pins.get(i)) is not None and not p.revoked
                and (p.deadline is None or now < p.deadline) and seg.opens(p.slot) < p.consumers]
        return left, {p.device for p in _pins.values()}


_inherited: list[Any] = []  # a forked child's copies of its parent's pins and events, never freed


def reset() -> None:
    """Forget every pin (in a forked child, whose parent owns them).

    A new lock, since another thread may have held the old one at the fork.
    The pinned arrays and pooled events are kept, not freed: freeing them
    would make CUDA calls, which a forked child must not.
    """
    global _lock, _pins, _event_pool, _slot_counter, _exports_to_sweep, _leases_changed, _keeper, _owed, _unkept
    _lock = threading.RLock()
    _leases_changed, _keeper = threading.Condition(threading.Lock()), None  # the keeper thread is the parent's
    _leases.clear()
    _inherited.append((_pins, _event_pool, _unkept))
    _pins, _event_pool, _unkept = {}, {}, []
    _free_slots.clear()
    _slot_counter = itertools.count()
    _exports_to_sweep = 0
    _owed = False


os.register_at_fork(after_in_child=reset)


def wait_own_event(export_id: int, stream_ptr: int, stream_device: int) -> None:
    """In the exporting process: make raw stream ``stream_ptr`` of GPU ``stream_device`` wait on an export's
    ordering event (the device given, not the current one: a default stream's GPU is not the current one on a
    staged open)."""
    p = _pins.get(export_id)
    if p is not None and p.event is not None:
        p.event.wait_from(stream_ptr, stream_device)
