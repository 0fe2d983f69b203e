"""The words that a producer's GPU writes when an export's work is done (no GPU: what needs none)."""

from __future__ import annotations

import secrets

import pytest

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
        assert _words.write(seg, 0, _words.COUNT, 1, 0) is False and seg.words is None  # nothing tried
    finally:
        seg.close(unlink=True)
