"""The least Python a fully safe message can take: a flat prototype of the protocol, beside raw calls and cupy_ipc.

For cudaMalloc memory, written as flat as it goes, with the calls cupy_ipc makes:
the producer ends the pins whose consumers are done, pins the buffer in a slot
of a shared file and records an interprocess ordering event when its stream is
busy; the consumer tests that the producer lives (its lock), takes the slot's
in-use lock, checks and counts the slot, maps the handle and checks the mapped
size, waits for the event on the GPU if it has not completed, and on release
orders after its stream, unmaps a fresh buffer and drops the lock. No checks
of the message, no handle objects, one producer and one consumer, no error
handling: a floor to measure the library against, not a library.

Methods added to ``roundtrip.py``'s: ``floor`` (all of it), and ``floor-0``,
``floor-A``, ``floor-E``, ``floor-L``, ``floor-EL`` with only some parts (A: the
mapped-size check, E: the ordering event, L: the pins and locks; ``floor-0``:
none), to see what each costs.

Usage::

    python benchmarks/floor.py --sizes 1MiB --methods raw,cupy_ipc,floor --iters 600 --rounds 3
"""

from __future__ import annotations

import atexit
import fcntl
import mmap
import os
import secrets
import struct
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import roundtrip  # noqa: E402

FEATURES = {"floor": "AEL", "floor-0": "", "floor-A": "A", "floor-E": "E", "floor-L": "L", "floor-EL": "EL"}
_RECORD = struct.Struct("<QII")  # export id, opens, state: as cupy_ipc's segment
_FLOCK = struct.Struct("hhqqi4x")
_LOCK_BASE = 1 << 40
_ALIVE_QUERY = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, _LOCK_BASE, 1, 0)
_SLOTS = 1024
_SIZE = 64 + 16 * _SLOTS


def _lock(kind: int, offset: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0)


def _in_use(slot: int) -> int:
    return _LOCK_BASE + 1 + 2 * slot


# --- the producer ------------------------------------------------------------------
class _Producer:
    def __init__(self) -> None:
        self.path = f"/dev/shm/floor-prototype-{secrets.token_hex(16)}"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        atexit.register(os.unlink, self.path)
        os.posix_fallocate(self.fd, 0, _SIZE)
        self.mm = mmap.mmap(self.fd, _SIZE)
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, _lock(fcntl.F_RDLCK, _LOCK_BASE))  # alive while it lives
        self.pins: dict[int, tuple[int, Any, int | None]] = {}  # slot -> (export id, buffer, event)
        self.free = list(range(_SLOTS - 1, -1, -1))
        self.export_id = 0
        self.events: list[int] = []  # recorded events whose pins ended, for reuse
        self.event_handles: dict[int, bytes] = {}

    def end(self, slot: int) -> None:
        _, _, event = self.pins.pop(slot)
        _RECORD.pack_into(self.mm, 64 + 16 * slot, 0, 0, 0)
        self.free.append(slot)
        if event is not None:
            self.events.append(event)


_producer: _Producer | None = None


def floor_message(arr: Any, resent: bool, cache: dict[str, Any], parts: str) -> tuple[Any, ...]:
    global _producer
    import cupy
    from cupy.cuda import runtime as rt

    from cupy_ipc import _cuda

    p = _producer = _producer or _Producer()
    mm = p.mm
    for slot in list(p.pins) if "L" in parts else ():  # end the pins whose consumer is done
        at = 64 + 16 * slot
        if _RECORD.unpack_from(mm, at)[1] >= 1:
            struct.pack_into("<I", mm, at + 12, 2)  # revoked, then free if nobody holds it
            got = fcntl.fcntl(p.fd, fcntl.F_OFD_GETLK, _lock(fcntl.F_WRLCK, _in_use(slot)))
            if _FLOCK.unpack(got)[0] == fcntl.F_UNLCK:
                p.end(slot)
    static = cache.get("static") if resent else None
    if static is None:
        base, size, _ = _cuda.legacy_info(arr.data.ptr)
        static = (bytes(rt.ipcGetMemHandle(base)), size, arr.data.ptr - base, arr.nbytes)
        if resent:
            cache["static"] = static
    stream = cupy.cuda.get_current_stream().ptr
    event = event_handle = None
    if "E" in parts and rt.streamQuery(stream) != 0:
        event = p.events.pop() if p.events else rt.eventCreateWithFlags(rt.eventDisableTiming | rt.eventInterprocess)
        rt.eventRecord(event, stream)
        event_handle = p.event_handles.get(event)
        if event_handle is None:
            event_handle = p.event_handles[event] = bytes(rt.ipcGetEventHandle(event))
    if "L" not in parts:
        if event is not None:
            p.events.append(event)
        return (static, 0, -1, event_handle, p.path, resent, parts)
    slot = p.free.pop()
    p.export_id += 1
    _RECORD.pack_into(mm, 64 + 16 * slot, p.export_id, 0, 0x101)  # pinned, one consumer
    p.pins[slot] = (p.export_id, arr, event)
    return (static, p.export_id, slot, event_handle, p.path, resent, parts)


# --- the consumer --------------------------------------------------------------------
class _Lease:
    """Owner of the memory of one opened array: its release is the consumer's close."""

    __slots__ = ("ptr", "fd", "slot", "stream", "fresh")

    def __del__(self) -> None:
        from cupy.cuda import runtime as rt

        if rt.streamQuery(self.stream) != 0:
            rt.streamSynchronize(self.stream)  # (cupy_ipc waits on a background thread instead)
        if self.fresh:
            rt.ipcCloseMemHandle(self.ptr)
        if self.slot >= 0:
            fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, _lock(fcntl.F_UNLCK, _in_use(self.slot)))


_segments: dict[str, tuple[int, mmap.mmap]] = {}
_mapped: dict[bytes, int] = {}
_events: dict[bytes, int] = {}


def floor_consume(msg: tuple[Any, ...]) -> float:
    import cupy
    from cupy.cuda import runtime as rt

    from cupy_ipc import _cuda

    (handle, size, offset, nbytes), export_id, slot, event_handle, path, resent, parts = msg
    seg = _segments.get(path)
    if seg is None:
        fd = os.open(path, os.O_RDWR)
        seg = _segments[path] = (fd, mmap.mmap(fd, _SIZE))
    fd, mm = seg
    if "L" in parts:
        if _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _ALIVE_QUERY))[0] == fcntl.F_UNLCK:
            raise RuntimeError("the producer has exited")
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _lock(fcntl.F_RDLCK, _in_use(slot)))
        at = 64 + 16 * slot
        seen, opens, state = _RECORD.unpack_from(mm, at)
        if seen != export_id or state & 0xFF != 1:
            raise RuntimeError("the producer no longer shares this buffer")
        struct.pack_into("<I", mm, at + 8, opens + 1)
    ptr = _mapped.get(handle) if resent else None
    if ptr is None:
        ptr = rt.ipcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)
        if "A" in parts and _cuda.address_range(ptr)[1] < size:
            raise RuntimeError("mapped less than the handle claims")
        if resent:
            _mapped[handle] = ptr
    stream = cupy.cuda.get_current_stream()
    if event_handle is not None:
        event = _events.get(event_handle)
        if event is None:
            event = _events[event_handle] = rt.ipcOpenEventHandle(event_handle)
        if rt.eventQuery(event) != 0:
            rt.streamWaitEvent(stream.ptr, event, 0)
    lease = _Lease()
    lease.ptr, lease.fd, lease.slot, lease.stream, lease.fresh = ptr, fd, slot, stream.ptr, not resent
    mem = cupy.cuda.UnownedMemory(ptr, size, lease)
    arr = cupy.ndarray((nbytes // 4,), cupy.float32, cupy.cuda.MemoryPointer(mem, offset))
    return float(arr[0])


# --- roundtrip.py with these methods --------------------------------------------------
_consume, _message, _consumer, _free_buffers = (roundtrip.consume, roundtrip._message, roundtrip.consumer,
                                                roundtrip.free_buffers)


def consume(method: str, msg: Any, mapped: dict[bytes, int]) -> float:
    return floor_consume(msg) if method in FEATURES else _consume(method, msg, mapped)


def message(method: str, arr: Any, resent: bool, cache: dict[str, Any]) -> Any:
    return floor_message(arr, resent, cache, FEATURES[method]) if method in FEATURES else \
        _message(method, arr, resent, cache)


def consumer(method: str, inbox: Any, outbox: Any) -> None:
    # Defined here, so that the spawned consumer imports this module, which adds the methods there too.
    _consumer(method, inbox, outbox)


def free_buffers(method: str) -> None:
    # The pins end here, untimed, before the pool frees its blocks: the prototype has no sweep of its own
    # (cupy_ipc's pins end in its next export, timed, which makes its fresh messages look about 10 µs slower
    # against the floor than they would beside an untimed sweep).
    if method in FEATURES and _producer is not None:
        for slot in list(_producer.pins):
            _producer.end(slot)
    _free_buffers(method)


_unordered = roundtrip.unordered


def unordered(method: str) -> bool:
    # Without the ordering event (E) the prototype orders nothing: its buffers are synchronized, untimed, before
    # they are sent, as raw calls' and cupy_ipc's without ordering are.
    return "E" not in FEATURES[method] if method in FEATURES else _unordered(method)


roundtrip.consume, roundtrip._message, roundtrip.consumer, roundtrip.free_buffers = (consume, message, consumer,
                                                                                     free_buffers)
roundtrip.unordered = unordered
roundtrip.METHODS = (*roundtrip.METHODS, *FEATURES)

if __name__ == "__main__":
    sys.exit(roundtrip.main())
