"""The consumer's side: one mapping per allocation, claims on producers' slots.

A *mapping* is one ``cudaIpcOpenMemHandle`` of an allocation (or, in the
exporting process, the producer's own pointer). Every array returned by
``open()`` is backed by a ``cupy.cuda.UnownedMemory`` whose owner is a
:class:`Lease`; when the last array or view using it is garbage-collected,
the lease is released:

1. if the stream the array was opened on still has work queued, an event is
   recorded there and a background thread waits for it;
2. then the mapping loses a user and the producer's slot loses a claim; a
   claim's last release drops the in-use lock, which lets the producer reuse
   the memory;
3. a mapping with no users is unmapped (a legacy handle's on the closer
   thread, since that close waits for the whole GPU), unless the same allocation was
   released here before (a buffer sent again): then it is kept idle for
   re-opening (up to :func:`set_idle_mapping_limit`, which grows while the
   mappings it evicts are wanted again) and unmapped when
   evicted or collected, or at the next import once its producer has
   exited. An imported pool allocation must be freed here
   before its producer frees it (CUDA's rule), so it is kept idle only with
   the last claim on it, which pins the producer's memory until the mapping
   is evicted. A mapping of virtual memory keeps one descriptor open per
   piece (to be sent on), so idle ones are also evicted, oldest first, once
   they hold more than a quarter of the process's open-file limit.

An open counts as one of the export's opens, in the producer's segment, only
once it has succeeded (:func:`opened`); one that fails after the claim lets
its mapping and claim go at once (:func:`abandon`), so that the producer still
awaits a consumer and the open may be retried.

An idle mapping of ``cudaMalloc`` memory holds no claim, so its producer may
free the allocation and give its addresses to a new one. Seen on an H200, the
new allocation's handle then differs from the old one's in its size bytes (the
driver refuses to import it while the old mapping lives:
``cudaErrorAlreadyMapped``), in one other byte, or not at all (the driver
hands back the old mapping, which then held the new allocation's memory). So
a mapping is reused only for the producer's same allocation (its buffer id is
in the key), and before an import the idle mappings it collides with are
unmapped. (CUDA's documentation calls such a free, before the importer's
close, undefined, as it does a free between a claim's release and the close
that follows it on the closer thread: what is handled here is what the driver
was seen to do.)
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import os
import resource
import threading
from typing import Any, Callable

from . import _cuda, _fork, _pools, _reaper, _segment, _threads
from ._args import checked_count
from ._errors import HandleError, IpcError, warn_quietly

__all__ = ["Lease", "abandon", "acquire", "collect_idle", "counts", "idle_mapping_limit", "opened",
           "set_idle_mapping_limit"]


# How memory other than a legacy handle's is mapped: (map() -> pointer, unmap(pointer), descriptors kept open).
Importer = tuple[Callable[[], int], Callable[[int], None], int]
# A legacy handle's memory as its sender knows it: (memory handle, sender's token, base address, size).
Origin = tuple[bytes, bytes, int, int]


class _Mapping:
    __slots__ = ("ptr", "device", "users", "imported", "close", "hold_claim", "held", "descriptors", "size",
                 "seg", "origin")

    def __init__(self, ptr: int, device: int, imported: bool, close: Callable[[int], None] | None = None,
                 hold_claim: bool = False, descriptors: int = 0) -> None:
        self.ptr = ptr
        self.device = device
        self.users = 0
        self.imported = imported
        self.close = close  # how to unmap an import of another kind than a legacy handle
        self.hold_claim = hold_claim  # kept idle only with a claim on the producer's memory (pool imports)
        self.held: tuple[bytes, int] | None = None  # that claim, while idle
        self.descriptors = descriptors  # open while mapped (virtual memory: one per piece)
        self.size: int | None = None  # bytes checked mapped, for an import
        self.seg: _segment.Segment | None = None  # the producer's of the handle it was imported from
        self.origin: Origin | None = None  # a legacy import's, to find idle mappings it collides with

    def unmap(self) -> None:
        if not self.imported:
            return
        try:
            if self.close is None and _cuda.rt().getDevice() == self.device:  # the common case: no switch
                _cuda.close_ipc_mapping(self.ptr, self.device)
                return
            with _cuda.using_device(self.device, bind=True):  # a pool's or pieces' unmap: driver calls
                if self.close is not None:
                    self.close(self.ptr)
                else:
                    _cuda.close_ipc_mapping(self.ptr, self.device)
        except Exception as e:  # destructor path: warn, never raise
            warn_quietly(f"could not unmap 0x{self.ptr:x}: {e}")


class _Claim:
    __slots__ = ("seg", "slot", "lock", "export_id", "count", "counted")

    def __init__(self, seg: _segment.Segment, slot: int, export_id: int) -> None:
        self.seg = seg
        self.slot = slot
        self.lock = _segment.in_use(slot)  # the slot's in-use lock, held while count > 0
        self.export_id = export_id
        self.count = 0
        self.counted = False  # whether an open under this claim succeeded, and was counted in the segment


_lock = threading.RLock()
_active: dict[tuple[Any, ...], _Mapping] = {}
_idle: "collections.OrderedDict[tuple[Any, ...], _Mapping]" = collections.OrderedDict()
_idle_limit = 16
_idle_grows = True  # the limit rises while the mappings it evicted are wanted again (set_idle_mapping_limit)
IDLE_GROWS_TO = 256
# Keys of mappings that the limit evicted, newest last: one imported again means the limit is below the number of
# buffers the consumer takes turns among.
_evicted: "collections.OrderedDict[tuple[Any, ...], None]" = collections.OrderedDict()
_idle_fds = 0  # descriptors that idle mappings keep open
_idle_fd_limit: int | None = None  # set on first use from the open-file limit
# By (producer's token, slot): the in-use lock is the slot's, one per process (open file description), whichever
# export holds the slot.
_claims: dict[tuple[bytes, int], _Claim] = {}
# Keys of imports released here at least once: only those are kept idle when released again.
_released: "collections.OrderedDict[tuple[Any, ...], None]" = collections.OrderedDict()
_RELEASED_MAX = 1024


def set_idle_mapping_limit(n: int, *, grow: bool = False) -> int:
    """Keep at most ``n`` unused mappings for re-opening; returns the limit before.

    A re-sent buffer whose mapping is idle opens without a CUDA IPC call, so
    a consumer that takes turns among more re-sent buffers than the limit
    (from several producers, say) would map and unmap one per message. By
    default the limit starts at 16 and rises by one each time a mapping it
    evicted is mapped again, up to 256: to the number of buffers in turn. A
    limit set here stays as set, unless ``grow``. ``0`` unmaps as soon as the
    last array using a mapping is gone. An idle mapping keeps its memory
    allocated even once its producer frees it, until it is evicted or
    :func:`cupy_ipc.collect` unmaps it. Idle
    mappings of virtual memory, which keep a descriptor per piece, are also
    evicted (oldest first) past a quarter of the open-file limit.

    Example:
        >>> old = set_idle_mapping_limit(0)
        >>> set_idle_mapping_limit(old, grow=True)
        0
    """
    global _idle_limit, _idle_grows
    n = checked_count(n, "the idle mapping limit", 0)
    with _lock:
        old, _idle_limit, _idle_grows = _idle_limit, n, bool(grow)
        _evicted.clear()
        _trim_idle()
    _close_pending()
    return old


def idle_mapping_limit() -> int:
    """How many unused mappings this process keeps for re-opening now: the limit that
    :func:`set_idle_mapping_limit` set, or that has grown since (see there).

    Example:
        >>> old = set_idle_mapping_limit(5)
        >>> idle_mapping_limit()
        5
        >>> _ = set_idle_mapping_limit(old, grow=True)
    """
    return _idle_limit


def _fd_limit() -> int:
    global _idle_fd_limit
    if _idle_fd_limit is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        _idle_fd_limit = 1 << 16 if soft == resource.RLIM_INFINITY else max(16, soft // 4)
    return _idle_fd_limit


def _park(key: tuple[Any, ...], m: _Mapping) -> None:
    global _idle_fds
    _idle[key] = m
    _idle_fds += m.descriptors


def _unpark(key: tuple[Any, ...]) -> _Mapping | None:
    global _idle_fds
    m = _idle.pop(key, None)
    if m is not None:
        _idle_fds -= m.descriptors
    return m


def _trim_idle() -> None:
    # Unmapped here rather than on the background thread: measured with fresh
    # buffers, an unmap there slowed the next open more than it saved here.
    while len(_idle) > _idle_limit:
        key = _discard_oldest()
        if _idle_grows:
            _evicted[key] = None
            if len(_evicted) > IDLE_GROWS_TO:
                _evicted.popitem(last=False)
    if _idle_fds and _idle_fds > _fd_limit():
        for key in [k for k, m in _idle.items() if m.descriptors]:  # oldest first
            _discard(_unpark(key))  # type: ignore[arg-type]
            if _idle_fds <= _fd_limit():
                break


def _discard_oldest() -> tuple[Any, ...]:
    key = next(iter(_idle))
    _discard(_unpark(key))  # type: ignore[arg-type]
    return key


def _wanted_again(key: tuple[Any, ...]) -> None:
    """An import of ``key``: if the limit evicted its mapping, raise the limit by one (see
    :func:`set_idle_mapping_limit`). The caller holds ``_lock``."""
    global _idle_limit
    if key in _evicted:
        del _evicted[key]
        if _idle_grows and _idle_limit < IDLE_GROWS_TO:
            _idle_limit += 1


def _discard(m: _Mapping) -> None:
    """Let an idle mapping go: a legacy handle's is closed once ``_lock`` is released (:func:`_close_later`);
    another is unmapped now, then its producer may free the memory (in that order: CUDA's rule)."""
    try:
        if m.imported and m.close is None:
            _close_later(m)
        else:
            m.unmap()
    finally:  # also if interrupted (Ctrl-C once the driver returned): the mapping is gone from the tables
        _drop_held(m)


def _drop_held(m: _Mapping) -> None:
    held, m.held = m.held, None
    _unclaim(held)


def collect_idle() -> int:
    """Unmap every idle mapping, and wait for the closes under way; returns how many were idle."""
    with _lock:
        n = len(_idle)
        while _idle:
            _discard_oldest()
    _close_pending()
    settle_closes()
    return n


def settle_closes() -> None:
    """Close every mapping let go and not closed yet (the closer thread's and other threads' too), or wait for
    the threads closing them."""
    while _close_one(lambda m: True, wait=True) is not None:
        pass


# --- closes outside the lock ----------------------------------------------------
# A legacy handle's mapping let go under _lock is closed once the lock is released: the close waits until the
# whole GPU is idle (see _cuda.close_ipc_mapping), which must hold up neither this process's other opens and
# releases nor, through their claims, the producers' memory. The last user's release hands its mapping to the
# closer thread (see _finish), so that the thread dropping an array does not wait either; an idle mapping that
# an open or release evicts is closed by that thread (before it imports, if the import collides with it). Until
# then an import that collides with it closes it first, or waits for the thread closing it: the driver would
# hand that import the mapping being closed.
_closing: dict[int, _Mapping] = {}  # by id: let go, not closed yet
_under_way: set[int] = set()  # of those, the ones a thread is closing
_closed = threading.Condition(threading.Lock())  # guards both, notified after each close; never taken before _lock


class _LetGo(threading.local):
    def __init__(self) -> None:
        self.mappings: list[_Mapping] = []  # the ones this thread let go, for it to close


_let_go = _LetGo()


def _close_later(m: _Mapping) -> None:
    """Have ``m``, a legacy import in neither table, closed once ``_lock`` (which the caller holds) is let go."""
    _closing[id(m)] = m
    _let_go.mappings.append(m)


def _close_pending() -> None:
    """Close the mappings this thread let go under ``_lock``, which it should no longer hold. (Another
    thread's are its own to close: closing them here would make this thread wait for the GPU.)"""
    mine = _let_go.mappings
    while mine:
        _close_let_go(mine.pop())


def _close_let_go(m: _Mapping) -> None:
    """Close ``m``, a mapping let go, unless another thread closes it or has (an import colliding with it):
    the closer thread's part of :func:`_finish`, and :func:`_close_pending`'s."""
    _close_one(lambda c: c is m, wait=False)


def _close_one(wanted: Callable[[_Mapping], bool], wait: bool) -> bool | None:
    """Close one of the mappings let go that are ``wanted`` and that no thread is closing: True. False if
    another thread is closing each one wanted (after waiting for one of those closes, if ``wait``); ``None``
    if none is wanted.

    Marked under way and closed in one ``try``: interrupted before the mark, the mapping stays in the table,
    for an import that collides with it or ``collect()`` to close; after it, the mapping leaves the table
    (even unclosed), so that no import waits for it for ever.
    """
    m = None
    try:
        with _closed:
            # A copy, made in one step: a release or eviction of another thread adds to the table under _lock
            # alone, and may do so while ``wanted`` runs.
            candidates = [c for c in list(_closing.values()) if wanted(c)]
            if not candidates:
                return None
            m = next((c for c in candidates if id(c) not in _under_way), None)
            if m is None:
                if wait:
                    _closed.wait(1.0)
                return False
            _under_way.add(id(m))
        m.unmap()
        return True
    finally:
        if m is not None and id(m) in _under_way:  # (only this thread marks ``m``, or unmarks it)
            _settle(m)


def _settle(m: _Mapping) -> None:
    """Take ``m``, which this thread marked under way, out of the tables of closes, and wake the threads waiting
    for it. Interrupted (Ctrl-C) meanwhile, it finishes first, then raises: left marked, the mapping would
    make every import that collides with it wait for ever, holding the library's lock."""
    interrupt = None
    while True:
        try:
            with _closed:
                _under_way.discard(id(m))
                _closing.pop(id(m), None)
                _closed.notify_all()
            break
        except KeyboardInterrupt as e:  # (each step can be done again)
            interrupt = e
    if interrupt is not None:
        raise interrupt


def _collides(m: _Mapping, device: int, origin: Origin | None) -> bool:
    """Whether an import of ``origin`` on ``device`` collides with legacy mapping ``m`` (every one there does,
    if ``None``): the same handle bytes, which the driver would hand back instead of mapping the new
    allocation, or the sender's addresses that the new allocation overlaps (that memory was freed, and the
    driver refuses to map the new one beside it)."""
    old = m.origin
    if old is None or m.device != device:
        return False
    return origin is None or old[0] == origin[0] or (
        old[1] == origin[1] and old[2] < origin[2] + origin[3] and origin[2] < old[2] + old[3])


def _await_closes(device: int, origin: Origin | None) -> bool:
    """Before an import of ``origin`` on ``device``: close the mappings let go that it collides with, or wait
    for the threads closing them; returns whether there were any. The caller holds ``_lock``."""
    seen = False
    while _close_one(lambda m: _collides(m, device, origin), wait=True) is not None:
        seen = True
    return seen


def counts() -> dict[str, int]:
    """Sizes of the consumer tables (mappings in use, idle, claims held) and the descriptors idle mappings keep."""
    with _lock:
        return {"mapped": len(_active), "idle": len(_idle), "claims": len(_claims), "idle_fds": _idle_fds}


# --- claims on a producer's slot --------------------------------------------
def _claim(seg: _segment.Segment, token: bytes, pid: int, export_id: int, slot: int) -> tuple[bytes, int]:
    """Hold an export's in-use lock (once per process) for an open; the caller holds ``_lock``. The open is
    counted in the producer's segment only by :func:`opened`."""
    key = (token, slot)
    c = _claims.get(key)
    if c is None:
        if seg.hold(slot, export_id):
            c = _claims[key] = _Claim(seg, slot, export_id)
    elif c.export_id != export_id:
        # We hold the slot for another export, so the producer cannot have reused it since: this one ended
        # before. (Asking the segment would refuse it too, and drop the lock the other export holds.)
        c = None
    if c is None:
        raise IpcError(
            f"the producer (pid {pid}) no longer shares this memory: its lease ran out, "
            "it called release(), or as many consumers as it allowed have opened it"
        )
    c.count += 1
    return key


def _unclaim(key: tuple[bytes, int] | None) -> None:
    # The last user of a claim that no open counted (they all failed) leaves the export as it found it.
    if key is None:
        return
    c = _claims.get(key)
    if c is None:
        return
    c.count -= 1
    if c.count == 0:
        try:
            if c.seg.fd >= 0:
                c.seg.unlock(c.lock)
        finally:  # after the unlock: interrupted between the two, no lock is left held without its record
            del _claims[key]


# --- mappings ----------------------------------------------------------------
def _map(key: tuple[Any, ...], device: int, memory_handle: bytes, allocation_size: int,
         own_ptr: int | None, importer: "Importer | None", hold_claim: bool = False,
         segment: _segment.Segment | None = None, origin: Origin | None = None) -> _Mapping:
    m = _active.get(key)  # a mapping is in use or idle, never both
    if m is not None:
        if m.size is not None and allocation_size > m.size:
            _refuse_larger(m, allocation_size)
    elif (m := _idle.get(key)) is not None:
        _refuse_larger(m, allocation_size)  # before it leaves its table
        _unpark(key)
        if m.held is not None:
            _drop_held(m)  # the caller's claim protects the memory now
    else:
        if own_ptr is not None:
            m = _Mapping(own_ptr, device, imported=False)
        else:
            if _evicted:
                _wanted_again(key)
            if _idle:
                _drop_idle_of_exited()
            if importer is not None:
                m = _checked(_Mapping(importer[0](), device, imported=True, close=importer[1],
                                      hold_claim=hold_claim, descriptors=importer[2]),
                             allocation_size, max(1, importer[2]))
            else:
                m = _import(device, memory_handle, allocation_size, origin)
            m.seg = segment
    _active[key] = m
    m.users += 1
    return m


def _import(device: int, memory_handle: bytes, allocation_size: int, origin: Origin | None = None) -> _Mapping:
    """Open a legacy handle on ``device``, the current GPU. The caller holds ``_lock``."""
    if origin is not None and _idle:
        _drop_idle_colliding(device, origin)
    if _closing:
        _await_closes(device, origin)
    out = ctypes.c_uint64()  # where the driver writes the pointer (see _cuda.open_ipc_mapping)
    m = None
    try:
        try:
            _cuda.open_ipc_mapping(memory_handle, device, out)
        except IpcError as e:
            if e.cuda_error != "cudaErrorAlreadyMapped":
                raise
            # An idle mapping of an allocation the driver counts as this one (sent on by another process, say).
            dropped = _drop_idle_colliding(device, None)
            if not _await_closes(device, None) and not dropped:
                raise IpcError(
                    f"{e} (this process still maps an earlier allocation at the producer's addresses, through an "
                    "array in use: was it exported with keepalive=False and freed before this array was made?)",
                    cuda_error=e.cuda_error) from e
            _cuda.open_ipc_mapping(memory_handle, device, out)
        m = _Mapping(out.value, device, imported=True)
        m.origin = origin
        size = _mapped_bytes(m.ptr, allocation_size, 1)
    except BaseException:
        if out.value:  # mapped, then interrupted (Ctrl-C during the driver's call, say): closed, not lost
            if m is None:
                m = _Mapping(out.value, device, imported=True)
                m.origin = origin
            _closing[id(m)] = m  # (for the closer, or an import colliding with it)
            _reaper.soon(_close_let_go, m, device=device)
        raise
    return _sized(m, size, allocation_size)


def _drop_idle_colliding(device: int, origin: Origin | None) -> int:
    """Let go of the idle legacy mappings on ``device`` that an import of ``origin`` collides with (see
    :func:`_collides`); returns how many. The caller holds ``_lock``, and closes them with
    :func:`_await_closes` before it imports."""
    stale = [key for key, m in _idle.items() if _collides(m, device, origin)]
    for key in stale:
        _discard(_unpark(key))  # type: ignore[arg-type]
    return len(stale)


def _drop_idle_of_exited() -> None:
    """Unmap the idle mappings whose producers have exited; the caller holds ``_lock``.

    No handle of a producer that has gone can be opened again, so such a
    mapping only keeps the memory allocated (the driver frees it with the
    last mapping anywhere) and, for virtual memory, its descriptors open.
    Looked for before each import: one liveness check per producer with idle
    mappings. A pool imported from such a producer is let go with them, and
    so is what other tables keep of it (see :func:`_segment.when_exited`).
    """
    if not _idle:
        return
    alive: dict[int, bool] = {}
    gone, exited = [], []
    for key, m in _idle.items():
        seg = m.seg
        if seg is None or seg.fd < 0:
            continue
        ok = alive.get(id(seg))
        if ok is None:
            try:
                ok = seg.producer_alive()
            except OSError:  # cannot tell: keep it (an eviction or collect() still ends it)
                ok = True
            alive[id(seg)] = ok
            if not ok:
                exited.append(seg)
        if not ok:
            gone.append(key)
    pools = False
    for key in gone:
        m = _unpark(key)
        pools = pools or m.hold_claim  # type: ignore[union-attr]
        _discard(m)  # type: ignore[arg-type]
    if pools:
        _pools.release_exited()
    for seg in exited:  # what other tables keep of those producers (their events) goes too
        _segment.found_exited(seg)


def _mapped_bytes(ptr: int, want: int, ranges: int) -> int:
    """How many bytes from ``ptr`` on are mapped without a gap, in at most ``ranges`` ranges (virtual memory
    imported in pieces is one range per piece; any other import is one), counting up to ``want``."""
    at = ptr
    while at - ptr < want and ranges > 0:
        try:
            base, size = _cuda.address_range(at)
        except IpcError:
            break
        if base != at:
            break
        at = base + size
        ranges -= 1
    return at - ptr


def _checked(m: _Mapping, allocation_size: int, ranges: int = 1) -> _Mapping:
    """``m``, unless the driver mapped less than the handle claims (then unmapped). Only the import's own
    ``ranges`` count: another mapping may lie right after it. Interrupted (Ctrl-C in the driver's size query),
    it unmaps ``m`` too, rather than lose it (a legacy import, see :func:`_import`, closes its own)."""
    try:
        size = _mapped_bytes(m.ptr, allocation_size, ranges)
    except BaseException:
        m.unmap()
        raise
    return _sized(m, size, allocation_size)


def _sized(m: _Mapping, size: int, allocation_size: int) -> _Mapping:
    """``m``, of which ``size`` bytes are mapped, unless that is less than the handle claims (then unmapped)."""
    if size < allocation_size:
        m.unmap()
        raise HandleError(_forged(allocation_size, size))
    m.size = size
    return m


def _refuse_larger(m: _Mapping, allocation_size: int) -> None:
    """A mapping reused for another handle of its allocation: that handle may claim no more than was mapped."""
    if m.size is not None and allocation_size > m.size:
        raise HandleError(_forged(allocation_size, m.size))


def _forged(claimed: int, mapped: int) -> str:
    return f"the handle claims a {claimed}-byte allocation but the driver mapped {mapped} bytes: the handle is " \
        "forged or corrupt"


def _retire(key: tuple[Any, ...], m: _Mapping, claim_key: tuple[bytes, int] | None,
            released: bool = True) -> tuple[bool, _Mapping | None]:
    """Mapping ``m`` has lost its last user: keep it idle or unmap it. Returns whether the idle mapping took
    over ``claim_key`` (the caller must not release it), and a legacy handle's mapping that the caller must
    close once it has let the claim go (see :func:`_finish`). Unless ``released``, that
    user's open failed: the mapping is unmapped, neither kept idle (with a claim that would outlive the
    failure) nor remembered as a buffer released here."""
    del _active[key]
    if not m.imported:  # the producer's own memory: nothing to unmap or keep
        return False, None
    # Only an allocation released here before (a buffer sent again) is kept
    # idle: one sent once is unmapped now, as a plain close would, rather than
    # later by the eviction of an older mapping (whose producer may have freed
    # it, which makes that unmap the one that frees the memory).
    held = m.hold_claim and claim_key is not None
    if _idle_limit and released and (held or not m.hold_claim) and _released_before(key):
        m.held = claim_key if held else None
        _park(key, m)  # (trimmed by the caller, once it knows that the claim was handed over)
        return held, None
    if m.close is None:
        return False, m
    # Other imports are unmapped here, before the claim goes: the producer may
    # free a pool allocation only once every importer has (CUDA's rule).
    m.unmap()
    return False, None


def _released_before(key: tuple[Any, ...]) -> bool:
    if key in _released:
        _released.move_to_end(key)
        return True
    _released[key] = None
    if len(_released) > _RELEASED_MAX:
        _released.popitem(last=False)
    return False


# --- leases -------------------------------------------------------------------
# A list, not a flag: module teardown sets globals to None, and a lease
# collected then must still see that the process is exiting.
_exiting: list[bool] = []


def _at_exit() -> None:
    # At exit the driver unmaps everything and the kernel drops the locks.
    _exiting.append(True)


atexit.register(_at_exit)


class Lease:
    """Owner of the ``UnownedMemory`` behind opened arrays; released when they are all gone.

    It also says which allocation the memory is (``ptr``, ``memory_handle``,
    ``allocation_size``), so that an opened array can be sent on.
    """

    __slots__ = ("keep", "mapping_key", "claim_key", "stream", "device", "ptr", "memory_handle",
                 "allocation_size", "imported", "memory_device", "opener", "incomplete", "__weakref__")

    def __init__(self, keep: Any, mapping_key: tuple[Any, ...], claim_key: tuple[bytes, int] | None,
                 stream: Any, device: int, mapping: _Mapping, memory_handle: bytes, allocation_size: int,
                 memory_device: int) -> None:
        self.keep = keep  # the producer's own array, when opened in its own process
        self.claim_key = claim_key
        self.stream = stream  # where the consumer's work on the memory is ordered
        self.device = device  # the stream's
        self.ptr = mapping.ptr
        self.imported = mapping.imported
        self.memory_handle = memory_handle
        self.allocation_size = allocation_size
        self.memory_device = memory_device  # the GPU holding the memory, which may differ from the mapping's
        self.opener = _threads.mark()  # whose per-thread default stream ``stream`` is, if it is one
        self.incomplete: tuple[int, str] | None = None  # (pid, why) once its producer exited before its work ran
        self.mapping_key = mapping_key  # last: a lease interrupted before it was made is let go by acquire alone

    def __del__(self, _exiting: list[bool] = _exiting) -> None:
        # (None: abandoned, already let go; unset: interrupted while it was made, let go by acquire)
        if _exiting or _release is None or getattr(self, "mapping_key", None) is None:
            return
        if _fork.forked_after_cuda():  # an array inherited by a forked child: its CUDA calls would crash or hang
            return
        _release(self.mapping_key, self.claim_key, self.stream, self.device, _reaper.collecting(),
                 opener=self.opener)


_new = object.__new__


def _finish(mapping_key: tuple[Any, ...], claim_key: tuple[bytes, int] | None, released: bool = True) -> None:
    """One user of a mapping, and its claim, fewer (``released``: see :func:`_retire`).

    A legacy handle's mapping is closed after its claim goes, on the library's closer thread: closing one
    waits until the whole GPU is idle (``cudaIpcCloseMemHandle`` does, as ``cudaFree`` does: measured on an
    H200), which must keep neither the producer's memory from it, nor this process's other opens and
    releases, nor the thread that dropped the array waiting while this process's other streams work. The
    producer may then free and reuse the allocation, which the mapping, whose last user is done, no longer
    reads; an open of the same handle meanwhile closes it first, or waits for the close (see
    :func:`_close_later`).
    """
    unmapped = None
    begun = False
    try:
        with _lock:
            begun = True
            kept = False
            try:
                m = _active.get(mapping_key)
                if m is not None:
                    m.users -= 1
                    if not m.users:
                        kept, unmapped = _retire(mapping_key, m, claim_key, released)
                        if (len(_idle) > _idle_limit or _idle_fds) and mapping_key in _idle:  # (parked)
                            _trim_idle()  # after: an eviction interrupted must not let the kept claim go
            finally:  # also if interrupted: a claim left held would pin the memory until exit
                try:
                    if claim_key is not None and not kept:
                        _unclaim(claim_key)
                finally:
                    if unmapped is not None:
                        _closing[id(unmapped)] = unmapped  # for the closer, or an import colliding with it
    except BaseException:
        if not begun:  # Ctrl-C while another thread held the lock (an import, for a close): nothing let go yet
            _reaper.later(_finish, mapping_key, claim_key, released)
        raise
    finally:
        try:
            if unmapped is not None:
                _reaper.soon(_close_let_go, unmapped, device=unmapped.device)
        finally:
            if _closing:  # (what this thread let go is there until it is closed)
                _close_pending()


_DEFAULT_STREAMS = (0, 1, 2)  # the legacy and per-thread default streams: of the current GPU (and thread)


def _release(mapping_key: tuple[Any, ...], claim_key: tuple[bytes, int] | None, stream: Any, device: int,
             defer: bool = False, opener: object = None) -> None:
    """Let the consumer's claim and mapping go once its work on ``stream`` is done: now, or on the library's
    thread if ``defer`` (a garbage collection runs) or that work is still queued. The stream is looked at
    here, on the thread that dropped the array, whose default stream it may be; a per-thread default stream
    of another thread, the ``opener``'s, cannot be named here: the legacy default stream, which follows the
    work of every thread's, stands for it."""
    try:
        ptr = stream.ptr
        if opener is not None:
            ptr = _threads.nameable(ptr, opener)
        if ptr in _DEFAULT_STREAMS and _cuda.rt().getDevice() != device:
            with _cuda.using_device(device):
                idle = _cuda.stream_idle(ptr)
        else:
            idle = _cuda.stream_idle(ptr)  # (the legacy stream's query counts the blocking streams' work: measured)
        done = None
        if not idle:
            import cupy

            with _cuda.using_device(device):
                done = cupy.cuda.Event(block=True, disable_timing=True)
                _cuda.call("ordering the release", _cuda.rt().eventRecord, done.ptr, ptr)
    except Exception as e:  # destructor path: keep the memory pinned rather than raise
        warn_quietly(f"could not order the release of a mapping: {e}")
        return
    except BaseException:  # Ctrl-C in the stream query, say: released on the library's thread once the GPU is idle
        _reaper.later(_finish, mapping_key, claim_key, after=_reaper.WHOLE_DEVICE, device=device)
        raise
    if done is None and not defer:  # the consumer's work on the memory is done
        _finish(mapping_key, claim_key)
    else:
        _reaper.later(_finish, mapping_key, claim_key, after=done, device=device)


def known(key: tuple[Any, ...]) -> bool:
    """Whether this process maps ``key``'s memory now, in use or idle (without the lock: a hint)."""
    return key in _active or key in _idle


def acquire(key: tuple[Any, ...], device: int, memory_handle: bytes, allocation_size: int,
            own_ptr: int | None, keep: Any, segment: _segment.Segment | None, producer_token: bytes,
            producer_pid: int, export_id: int, slot: int, stream: Any, stream_device: int, memory_device: int,
            importer: "Importer | None", hold_claim: bool, origin: Origin | None = None,
            claimed: list[bool] | None = None) -> tuple[int, Lease]:
    """Claim the export, map its allocation on ``device`` (the current GPU); returns ``(pointer, lease)``.

    The open is not counted yet: once it has succeeded the caller passes the
    lease to :func:`opened`, and if it fails after this, to :func:`abandon`.
    If this raises, it has let go of what it took. ``claimed``, given for an
    open that will not be retried (a message's), is set once the export is
    claimed: from then on a failure counts the open (here, or the caller's
    abandon), so that the producer does not wait for it; before (interrupted
    while another thread held the lock, say), the caller counts it.

    ``segment`` is the producer's (already checked alive). The lease must own
    the memory built on the pointer; ``stream`` (of ``stream_device``) is
    where the release is ordered; ``memory_device`` is the GPU holding the
    memory. ``importer`` maps and unmaps memory that is not a legacy
    handle's: ``(map() -> ptr, unmap(ptr), descriptors the mapping keeps
    open)``; ``hold_claim``: its mapping is kept idle only with the claim of
    its last user (pool imports). ``origin`` is a legacy handle's (see
    :data:`Origin`).
    """
    _reaper.start()  # before the first lease (see _reaper)
    try:
        with _lock:
            claim_key = _claim(segment, producer_token, producer_pid, export_id, slot) if export_id else None
            if claimed is not None:
                claimed[0] = True
            try:
                m = _map(key, device, memory_handle, allocation_size, own_ptr, importer, hold_claim, segment, origin)
            except BaseException:
                try:
                    if claimed is not None:
                        _count(claim_key)
                finally:
                    _unclaim(claim_key)
                raise
            lease = None
            try:
                # Bound before it is made, so that an interrupt at any step, also just after the lease is made,
                # finds it here: then the lease releases nothing, and the mapping and claim go once.
                lease = _new(Lease)
                lease.__init__(keep, key, claim_key, stream, stream_device, m, memory_handle, allocation_size,
                               memory_device)
            except BaseException:
                if lease is not None:
                    lease.mapping_key = None
                _finish(key, claim_key, released=False)
                raise
        return m.ptr, lease
    finally:
        if _closing:  # idle mappings of exited producers, let go by the import
            _close_pending()


def count_unclaimed(segment: _segment.Segment, producer_token: bytes, producer_pid: int, export_id: int,
                    slot: int) -> None:
    """An open that will not be retried (a message's) failed before :func:`acquire` claimed the export: claim
    it, count it and let it go, so that the producer does not keep the memory for it. Nothing if the export
    has ended, and no second count of a claim this process already counted."""
    with _lock:
        try:
            claim_key = _claim(segment, producer_token, producer_pid, export_id, slot)
        except IpcError:  # ended already (or its slot cannot be mapped here: then nothing can count it)
            return
        try:
            _count(claim_key)
        finally:
            _unclaim(claim_key)


def opened(lease: Lease) -> None:
    """The open that :func:`acquire` made ``lease`` for has succeeded: count it as one of the export's opens,
    once per claim (opens that share a claim count as one process's)."""
    if lease.claim_key is not None:
        with _lock:
            _count(lease.claim_key)


def _count(claim_key: tuple[bytes, int] | None) -> None:
    # Under _lock.
    c = _claims.get(claim_key) if claim_key is not None else None
    if c is not None and not c.counted:
        c.seg.count_open(c.slot)
        c.counted = True


def abandon(lease: Lease, count: bool = False) -> None:
    """The open that :func:`acquire` made ``lease`` for failed: let its mapping and claim go now, uncounted (so
    that the producer still awaits a consumer, and the open may be retried) unless ``count`` (it will not be
    retried). Now, not ordered on a stream: no work on the memory was queued. The lease then releases nothing
    when collected."""
    key = lease.mapping_key
    if key is None:
        return
    lease.mapping_key = None
    try:
        if count:
            opened(lease)
    finally:
        # Not a release: the mapping is unmapped, not kept idle as a buffer sent again.
        _finish(key, lease.claim_key, released=False)


def _forget_after_fork() -> None:
    global _idle_fds, _lock, _closed
    _lock = threading.RLock()  # another thread may have held it at the fork
    _active.clear()
    _idle.clear()
    _evicted.clear()
    _idle_fds = 0
    _claims.clear()
    _released.clear()
    _closing.clear()
    _under_way.clear()
    _let_go.mappings = []
    _closed = threading.Condition(threading.Lock())


os.register_at_fork(after_in_child=_forget_after_fork)
