"""Words that a producer's GPU writes once the work on an export is done, and that consumers' GPUs wait for.

An export whose stream still has work queued carries an ordering event, and
a consumer's stream must wait for it. Waiting on the event itself cannot be
released if the producer is killed first (see ``_gates``); waiting on a word
that a thread of the consumer sets once it sees the event completed can, but
goes on only when that thread next looks (a poll, and the GIL): measured on
an H200 (``benchmarks/release.py``), 0.2 ms late after 10 ms of the producer's
work and 1 ms late after 100 ms, and later still while the consumer runs Python.

So the producer also has its stream write a word once that work is done
(``cuStreamWriteValue32``, queued before the event's record, so that the event
completed means the word written) and the consumer's stream waits for that
word (``cuStreamWaitValue32``): on the GPU, as soon as the write lands, with no
thread of either process involved. If the producer dies first, the consumer's
thread, which looks only for that, sets the word itself.

The words are the first :data:`BYTES` of the producer's segment file (one per
export slot, for the first :data:`COUNT` slots), mapped apart from its records
(which move when the file grows) and registered with CUDA in the producer and
in each consumer. An export's word is its slot's; its value, the export id's
low 32 bits, which rise from one export of a slot to the next. Waits compare
cyclically (``(int32)(word - value) >= 0``), and a slot taken again first gets
its word set just below the new value, so a slot left unused for 2**31
exports cannot look done. A slot is freed only once its event has completed
(``_keepalive``): no write of an earlier export of it is still queued.

Example:
    >>> reached(5, 5), reached(6, 5), reached(4, 5), reached(1, 0xFFFFFFFF)
    (True, True, False, True)
"""

from __future__ import annotations

import ctypes
import mmap
import struct
import threading
from typing import Any

from . import _cuda

__all__ = ["BYTES", "COUNT", "Words", "disabled", "of_producer", "park", "reached", "value_of", "wait", "write"]

COUNT = 4096
BYTES = 4 * COUNT
_U32 = struct.Struct("<I")
_REGISTER_FLAGS = 0x01 | 0x02  # CU_MEMHOSTREGISTER_PORTABLE (every context) | CU_MEMHOSTREGISTER_DEVICEMAP
GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, cyclic
disabled = False  # exports here write no word, and opens here wait for no producer's: for comparison
_lock = threading.Lock()
_fns: dict[str, Any] = {}


def value_of(export_id: int) -> int:
    """The value an export's word reaches once its work is done."""
    return export_id & 0xFFFFFFFF


def reached(word: int, value: int) -> bool:
    """Whether a word holding ``word`` says that the work of the export with ``value`` is done (cyclic)."""
    return (word - value) & 0xFFFFFFFF < 0x80000000


def _fn(name: str, *argtypes: Any) -> Any:
    fn = _fns.get(name)
    if fn is None:
        fn = _fns[name] = _cuda._libcuda_fn(name, *argtypes) or False
    return fn or None


def _write_fn() -> Any:
    return _fn("cuStreamWriteValue32_v2", ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)


def wait_fn() -> Any:
    """``cuStreamWaitValue32`` through ``ctypes`` (looked up once), or ``None`` where libcuda lacks it."""
    return _fn("cuStreamWaitValue32_v2", ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)


class Words:
    """A segment's words, mapped and registered here; ``base`` is their address on the host and every GPU."""

    __slots__ = ("mm", "base", "device")

    def __init__(self, mm: mmap.mmap, base: int, device: int) -> None:
        self.mm, self.base, self.device = mm, base, device

    def read(self, slot: int) -> int:
        return _U32.unpack_from(self.mm, 4 * slot)[0]

    def set(self, slot: int, value: int) -> None:
        _U32.pack_into(self.mm, 4 * slot, value)

    def release(self) -> None:
        """Unregister and unmap: no stream may wait on them any more (the caller's to know)."""
        unregister = _fn("cuMemHostUnregister", ctypes.c_void_p)
        if unregister is not None:
            try:
                _cuda._in_context(self.device, unregister, self.base)
            except Exception:  # noqa: BLE001 - at exit CUDA may be gone: the mapping goes with the process
                pass
        try:
            self.mm.close()
        except BufferError:  # (a view of it still exported: it goes with its last user)
            pass


def _register(fd: int, device: int) -> Words | None:
    """The first :data:`BYTES` of segment file ``fd`` mapped and registered with CUDA, or ``None`` where that
    cannot be (stream memory operations unsupported, no room to pin, a file too short)."""
    register = _fn("cuMemHostRegister_v2", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
    if register is None or _write_fn() is None or wait_fn() is None:
        return None
    try:
        mm = mmap.mmap(fd, BYTES)
    except (OSError, ValueError):
        return None
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))  # (a view: released by the next line's end)
    if _cuda._in_context(device, register, base, BYTES, _REGISTER_FLAGS):
        mm.close()
        return None
    return Words(mm, base, device)


def of_segment(seg: Any, device: int) -> Words | None:
    """``seg``'s words registered here (once; ``None`` for good where they cannot be)."""
    words = seg.words
    if words is None:
        with _lock:
            words = seg.words
            if words is None and seg.fd >= 0:
                words = seg.words = _register(seg.fd, device) or False
    return words or None


of_producer = of_segment  # a consumer's view of a producer's segment: the same


_parked: dict[int, Any] = {}


def park(seg: Any) -> None:
    """Keep ``seg`` (and so its words) for this process's life: an open that failed after its stream was
    made to wait on them holds no claim that would keep them until that wait is done."""
    _parked.setdefault(id(seg), seg)


def write(seg: Any, stream_ptr: int, slot: int, export_id: int, device: int) -> bool:
    """Producer: have ``stream_ptr`` (of GPU ``device``, current) write ``export_id``'s word in slot ``slot``
    of this process's segment ``seg`` once the work queued there is done; False where it cannot (the
    consumers then wait on the ordering event alone)."""
    if disabled or slot >= COUNT:
        return False
    words = of_segment(seg, device)
    if words is None:
        return False
    value = value_of(export_id)
    words.set(slot, (value - 1) & 0xFFFFFFFF)  # (no write of the slot's last export is still queued: see above)
    return _write_fn()(stream_ptr, words.base + 4 * slot, value, 0) == 0


def wait(words: Words, stream_ptr: int, slot: int, value: int) -> bool:
    """Consumer: have ``stream_ptr`` (current GPU's) wait for word ``slot`` of ``words`` to reach ``value``;
    False where the driver refused."""
    return wait_fn()(stream_ptr, words.base + 4 * slot, value, GEQ) == 0
