"""The bookkeeping of the words that stand in for a producer's ordering event (no GPU: words in host memory)."""

from __future__ import annotations

import ctypes

import pytest

from cupy_ipc import _gates


@pytest.fixture
def words(monkeypatch):
    """Four words in ordinary memory, as if made; the thread is not started."""
    buf = (ctypes.c_uint32 * 4)()
    monkeypatch.setattr(_gates, "_base", ctypes.addressof(buf))
    monkeypatch.setattr(_gates, "_free", [3, 2, 1, 0])
    monkeypatch.setattr(_gates, "_taken", set())
    monkeypatch.setattr(_gates, "_values", [0] * 4)
    monkeypatch.setattr(_gates, "_pending", {})
    return buf


def test_a_released_word_holds_the_value_its_wait_was_for_and_is_handed_out_again(words):
    word = _gates._take(0)
    value = _gates._values[word]
    assert value == 1 and words[word] == 0  # a new word's wait is for 1: it does not hold that yet
    _gates._set_free(word, value)
    assert words[word] == 1 and word in _gates._free
    again = _gates._take(0)
    assert again == word and _gates._values[word] == 2  # the next wait on it is for a value it never held


def test_a_word_is_released_once_even_when_two_parties_release_it(words):
    word = _gates._take(0)
    _gates._set_free(word, 1)
    _gates._set_free(word, 1)  # the thread and an interrupted wait() both let go
    assert _gates._free.count(word) == 1


def test_a_late_release_does_not_release_the_next_wait_on_the_same_word(words):
    word = _gates._take(0)
    _gates._set_free(word, 1)
    assert _gates._take(0) == word  # handed out again, for 2
    _gates._set_free(word, 1)  # a stale release of the first wait
    assert words[word] == 1 and word in _gates._taken  # the second wait still waits


def test_a_wait_counts_past_the_top_of_the_word_without_reaching_zero(words):
    word = _gates._free[-1]
    _gates._values[word] = 0xFFFFFFFF
    assert _gates._take(0) == word and _gates._values[word] == 1  # 0 is every word's start: never waited for


def test_without_words_the_open_waits_on_the_event_itself(monkeypatch):
    monkeypatch.setattr(_gates, "_base", 0)
    monkeypatch.setattr(_gates, "_unsupported", True)
    monkeypatch.setattr(_gates, "_free", [])
    assert _gates._take(0) is None
