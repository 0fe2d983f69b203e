"""The words that a producer's GPU writes when an export's work is done (no GPU: what needs none)."""

from __future__ import annotations

import secrets

import pytest
from conftest import gpu_skip_reason

from cupy_ipc import _segment, _words


@pytest.mark.parametrize("word, value, done", [
    (5, 5, True), (6, 5, True), (4, 5, False),
    (0, 0xFFFFFFFF, True),  # counted past the top: 0 comes after 0xFFFFFFFF
    (0xFFFFFFFF, 0, False),
    (0x80000006, 5, False),  # more than 2**31 ahead reads as behind: why a slot taken again is set just below
])
def test_a_word_is_compared_with_its_value_cyclically(word, value, done):
    assert _words.reached(word, value) is done


def test_a_value_is_its_exports_low_32_bits():
    assert _words.value_of(7) == 7 and _words.value_of((1 << 32) + 7) == 7


def test_the_records_of_a_segment_lie_after_its_words():
    seg = _segment.Segment.create(secrets.token_bytes(16))
    try:
        seg.write(0, 9, _segment.PINNED)
        with open(seg.path, "rb") as f:
            data = f.read()
        assert data[:_words.BYTES] == bytes(_words.BYTES)  # the record did not land among the words
        assert seg.read(0) == (9, 0, _segment.PINNED)
    finally:
        seg.close(unlink=True)


@pytest.mark.skipif(gpu_skip_reason() is None, reason="a GPU is here: the words can be registered (its tests: "
                    "test_gpu_lifetime.py, test_gpu_events.py)")
def test_without_a_gpu_an_export_writes_no_word_and_an_open_finds_none():
    seg = _segment.Segment.create(secrets.token_bytes(16))
    try:
        assert _words.write(seg, 0, 0, 1, 0) is False
        assert _words.of_producer(seg, 0) is None and seg.words is False  # not tried again
    finally:
        seg.close(unlink=True)


def test_a_slot_past_the_words_gets_none():
    seg = _segment.Segment.create(secrets.token_bytes(16))
    try:
        assert _words.write(seg, 0, _words.SLOTS, 1, 0) is False and seg.words is None  # nothing tried
    finally:
        seg.close(unlink=True)


# --- exported events' pairs of words: the producer's bookkeeping (the GPU's part: test_gpu_events.py) ---------
class _Stream:
    """What the driver would be asked to queue: each ``cuStreamWriteValue32`` as (stream, word, value)."""

    def __init__(self, words, refuse=False):
        self.words, self.refuse, self.queued = words, refuse, []

    def __call__(self, stream, address, value, flags):
        if self.refuse:
            return 1  # CUDA_ERROR_INVALID_VALUE
        self.queued.append((stream, (address - self.words.base) // 4, value))
        return 0

    def land(self):
        """The queued writes land, in the order queued."""
        for _, word, value in self.queued:
            self.words.set(word, value)
        self.queued.clear()


@pytest.fixture
def pair(monkeypatch):
    import ctypes
    import mmap

    mm = mmap.mmap(-1, _words.BYTES)
    words = _words.Words(mm, ctypes.addressof(ctypes.c_char.from_buffer(mm)), 0)
    stream = _Stream(words)
    monkeypatch.setattr(_words, "_write_fn", lambda: stream)
    monkeypatch.setattr(_words, "of_segment", lambda seg, device: words)
    monkeypatch.setattr(_words, "_free_pairs", [])
    monkeypatch.setattr(_words, "_next_pair", 0)
    ew = _words.take_pair(None, 0)
    return ew, stream, _words.issued_word(ew.pair), _words.done_word(ew.pair)


def _records():
    """A record that notes it was made."""
    made: list[bool] = []
    return made, lambda: made.append(True)


def test_an_exported_events_records_on_one_stream_each_have_their_word(pair):
    ew, stream, issued, done = pair
    made, record = _records()
    assert _words.event_value(ew.words, ew.pair) is None  # a record made before the export: none to wait for
    _words.record_event(ew, 0x10, record)
    _words.record_event(ew, 0x10, record)  # the first's write not landed yet: the same stream keeps them in order
    assert made == [True, True] and stream.queued == [(0x10, done, 2), (0x10, done, 4)]
    assert _words.event_value(ew.words, ew.pair) == 4  # the latest record's
    stream.land()
    assert _words.event_value(ew.words, ew.pair) == 0  # done: nothing to wait for


def test_a_record_on_another_stream_while_the_last_write_may_be_queued_gets_no_word(pair):
    # Its write could land before the other stream's, and "done" then go back below a value waited for.
    ew, stream, issued, done = pair
    made, record = _records()
    _words.record_event(ew, 0x10, record)
    _words.record_event(ew, 0x20, record)
    assert made == [True, True] and stream.queued == [(0x10, done, 2)]
    assert _words.event_value(ew.words, ew.pair) is None  # consumers poll the event
    stream.land()
    _words.record_event(ew, 0x20, record)  # the other stream's write has landed: in order again
    assert stream.queued == [(0x20, done, 4)] and _words.event_value(ew.words, ew.pair) == 4


def test_a_write_the_driver_refuses_leaves_the_record_without_a_word(pair):
    ew, stream, issued, done = pair
    made, record = _records()
    stream.refuse = True
    _words.record_event(ew, 0x10, record)
    assert made == [True] and _words.event_value(ew.words, ew.pair) is None


def test_a_record_that_fails_after_its_write_leaves_issued_as_it_was_and_the_write_counted(pair):
    ew, stream, issued, done = pair
    made, record = _records()
    _words.record_event(ew, 0x10, record)

    def failing():
        raise RuntimeError("record failed")

    with pytest.raises(RuntimeError):
        _words.record_event(ew, 0x10, failing)
    assert ew.words.read(issued) == 2 and (ew.chain, ew.written) == (0x10, 4)  # its write is queued
    _words.record_event(ew, 0x20, record)  # so another stream must wait for it to land
    assert _words.event_value(ew.words, ew.pair) is None


def test_a_consumers_record_says_the_latest_record_has_no_word(pair):
    ew, stream, issued, done = pair
    _words.record_event(ew, 0x10, lambda: None)
    _words.mark_unworded(ew.words, ew.pair)
    assert _words.event_value(ew.words, ew.pair) is None
    _words.record_event(ew, 0x10, lambda: None)  # the producer's next record is the latest again
    assert _words.event_value(ew.words, ew.pair) == 4


def test_a_consumers_mark_written_back_over_a_newer_record_does_not_make_the_next_one_reuse_its_value(pair):
    # The consumer reads "issued", the producer records, the consumer writes its mark back over that record's
    # value: the producer's next record took the same value again, which its write before had set already, so
    # a wait for it went on before its work had run.
    ew, stream, issued, done = pair
    _words.record_event(ew, 0x10, lambda: None)
    seen = ew.words.read(issued)  # the consumer's read
    _words.record_event(ew, 0x10, lambda: None)
    ew.words.set(issued, seen | 1)  # ... and its write
    stream.land()
    _words.record_event(ew, 0x10, lambda: None)
    assert stream.queued == [(0x10, done, 6)] and _words.event_value(ew.words, ew.pair) == 6


def test_a_records_value_counts_past_the_top_without_reaching_zero(pair):
    # 0 says "never recorded": a record counted to it was taken as done at once (after 2**31 records of a pair).
    ew, stream, issued, done = pair
    _words.record_event(ew, 0x10, lambda: None)
    stream.land()
    ew.written = 0xFFFFFFFE
    ew.words.set(issued, 0xFFFFFFFE)
    ew.words.set(done, 0xFFFFFFFE)
    _words.record_event(ew, 0x10, lambda: None)
    assert stream.queued == [(0x10, done, 2)] and _words.event_value(ew.words, ew.pair) == 2
    stream.land()
    assert _words.event_value(ew.words, ew.pair) == 0


def test_a_pair_given_back_serves_the_next_event_with_its_counts_going_on(pair):
    ew, stream, issued, done = pair
    _words.record_event(ew, 0x10, lambda: None)
    _words.give_back(ew)
    again = _words.take_pair(None, 0)
    assert again.pair == ew.pair and again.written == 2 and again.chain is None
    assert _words.event_value(again.words, again.pair) is None  # the old event's record is not this one's
    _words.record_event(again, 0x20, lambda: None)  # the old write may still be queued on another stream
    assert stream.queued == [(0x10, done, 2)]
    stream.land()
    _words.record_event(again, 0x20, lambda: None)
    assert stream.queued[-1] == (0x20, done, 4)


def test_a_pair_given_back_by_a_finalizer_while_its_thread_takes_another_does_not_hang(pair, monkeypatch):
    # The cyclic garbage collector may finalize an exported event (giving its pair back) on a thread that holds
    # the lock of the pairs, taking another: the lock was not reentrant, and that thread waited for itself.
    import threading

    ew, stream, issued, done = pair
    other = _words.EventWords(ew.words, 5, 0)

    class Collected(list):
        def pop(self, *args):
            item = super().pop(*args)
            _words.give_back(other)  # as the finalizer of an event collected just now would
            return item

    monkeypatch.setattr(_words, "_free_pairs", Collected([(3, 0)]))
    taken: list = []
    t = threading.Thread(target=lambda: taken.append(_words.take_pair(None, 0)), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and taken[0].pair == 3 and list(_words._free_pairs) == [(5, 0)]


def test_past_the_pairs_an_event_gets_none(pair, monkeypatch):
    monkeypatch.setattr(_words, "_next_pair", _words.PAIRS)
    assert _words.take_pair(None, 0) is None
