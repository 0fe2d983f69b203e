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
export slot, for the first :data:`SLOTS` slots; then a pair per exported
:class:`IpcEvent`, see :func:`record_event`), mapped apart from its records
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
import os
import struct
import threading
from typing import Any

from . import _cuda, _threads

__all__ = ["BYTES", "COUNT", "PAIRS", "SLOTS", "EventWords", "Words", "disabled", "event_value", "hold", "mark_unworded",
           "of_producer", "park", "reached", "record_event", "take_pair", "value_of", "wait", "write"]

COUNT = 4096
BYTES = 4 * COUNT
SLOTS = 3584  # the exports' words, one per slot; then the exported events' pairs
PAIRS = (COUNT - SLOTS) // 2
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


_HELD_MOST = 64


def hold(seg: Any) -> bool:
    """Keep ``seg`` (and its words) for this process's life, for a wait on an event's word of it: a stream may
    still be about to read the word when the host sees it set (a lease keeps an open's segment that long).
    False past :data:`_HELD_MOST` producers held so: waits on their events poll them instead."""
    if id(seg) not in _parked:
        if len(_parked) >= _HELD_MOST:
            return False
        park(seg)
    return True


def write(seg: Any, stream_ptr: int, slot: int, export_id: int, device: int) -> bool:
    """Producer: have ``stream_ptr`` (of GPU ``device``, current) write ``export_id``'s word in slot ``slot``
    of this process's segment ``seg`` once the work queued there is done; False where it cannot (the
    consumers then wait on the ordering event alone)."""
    if disabled or slot >= SLOTS:
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


# --- exported events ------------------------------------------------------------------------------------
# An IpcEvent created here and exported gets a pair of words: "issued", which the host sets at each record to
# that record's value, and "done", which the recording stream writes once the work before the record is done.
# A consumer's wait reads "issued" and has its stream wait for "done" to reach it: on the GPU, like a wait on
# the event, which waits for its latest record. Values count up by 2; an odd "issued" says that the latest
# record has no word to wait for (consumers then poll the event itself). That is so for a record on another
# stream than the last one's while that one's write may still be queued: the two writes could land out of
# order, and "done" go back below a value already waited for. And for a record made by another process.

# Reentrant: an exported event's finalizer gives its pair back, and the cyclic garbage collector may run it on a
# thread that holds the lock (taking or giving back another pair); each holder's work is one list operation.
_pairs_lock = threading.RLock()
_free_pairs: list[tuple[int, int]] = []  # (pair, the value of the last write queued to its "done")
_next_pair = 0


class EventWords:
    """The producer's pair of words of one exported event: the stream of its last write to "done" (``chain``)
    and that write's value (``written``)."""

    __slots__ = ("words", "pair", "chain", "written", "lock")

    def __init__(self, words: Words, pair: int, written: int) -> None:
        self.words, self.pair, self.chain, self.written, self.lock = words, pair, None, written, threading.Lock()


def issued_word(pair: int) -> int:
    return SLOTS + 2 * pair


def done_word(pair: int) -> int:
    return SLOTS + 2 * pair + 1


def take_pair(seg: Any, device: int) -> EventWords | None:
    """A free pair of this process's segment ``seg`` for an event of GPU ``device``; ``None`` where none is
    left or words cannot be. Its words keep their values from an earlier event: the counts go on rising."""
    global _next_pair
    if disabled:
        return None
    words = of_segment(seg, device)
    if words is None:
        return None
    with _pairs_lock:
        if _free_pairs:
            pair, written = _free_pairs.pop()
        elif _next_pair < PAIRS:
            pair, written, _next_pair = _next_pair, 0, _next_pair + 1
        else:
            return None
    mark_unworded(words, pair)  # a record made before the export has no word: consumers poll for it
    return EventWords(words, pair, written)


def give_back(ew: EventWords) -> None:
    """The event that had ``ew`` is destroyed: its pair serves the next exported event."""
    with _pairs_lock:
        _free_pairs.append((ew.pair, ew.written))


def record_event(ew: EventWords, stream_ptr: int, record: Any) -> None:
    """Call ``record()`` (the event's record on ``stream_ptr``, of the current GPU) with the pair's words kept
    right: the stream writes the record's value to "done" first where that keeps the writes in order, and
    "issued" says the value (or, odd, that there is none) once the record is made.

    Also on a stream with nothing queued: another process sees such a record completed only some 100 us
    later (raw calls' event ping-pong on an H200: about 120 us a hop over the pipe's), and a wait that finds
    it not done yet goes on at once with a word, a poll later without."""
    words, issued, done = ew.words, issued_word(ew.pair), done_word(ew.pair)
    stream = stream_ptr if stream_ptr != 2 else (2, _threads.mark())  # (2: each thread's own default stream)
    with ew.lock:
        # Counted from the last write here, not from "issued", which a consumer's record also writes (its low
        # bit: read, then written back, so that it may undo a value set meanwhile); 0 stands for "never recorded".
        value = (ew.written + 2) & 0xFFFFFFFF or 2
        # In order: the last write was queued on this stream, or has landed (and so has every earlier one).
        ordered = stream == ew.chain or reached(words.read(done), ew.written)
        if ordered and _write_fn()(stream_ptr, words.base + 4 * done, value, 0) == 0:
            ew.chain, ew.written = stream, value  # (queued, whether or not the record below is made)
            record()
            words.set(issued, value)
        else:
            record()
            mark_unworded(words, ew.pair)


def mark_unworded(words: Words, pair: int) -> None:
    """Say that the event's latest record has no word ("issued" odd): one made without it by its producer, or
    one made in a consumer, of which the producer's words know nothing."""
    words.set(issued_word(pair), words.read(issued_word(pair)) | 1)


def mark_unworded_in(seg: Any, pair: int) -> None:
    """:func:`mark_unworded` through ``seg``'s plain view of its file (its first :data:`BYTES` are the words),
    which needs no registration with CUDA."""
    while True:
        mm = seg.mm
        if mm is None or len(mm) < BYTES:
            return
        try:
            mark_unworded(Words(mm, 0, -1), pair)
            return
        except ValueError:  # (closed by another thread's remap: the new view, then)
            continue


def event_value(words: Words, pair: int) -> int | None:
    """What a wait on the event of producer's pair ``pair`` waits for "done" to reach now: 0 for nothing
    (its latest record's work is done, or it was never recorded), ``None`` where its latest record has no
    word (poll the event)."""
    value = words.read(issued_word(pair))
    if value & 1:
        return None
    return 0 if reached(words.read(done_word(pair)), value) else value


def _forget_after_fork() -> None:
    global _pairs_lock, _free_pairs, _next_pair, _lock
    # The parent's pairs and registrations: a forked child exports no event of them.
    _pairs_lock, _lock, _free_pairs, _next_pair = threading.RLock(), threading.Lock(), [], 0


os.register_at_fork(after_in_child=_forget_after_fork)
