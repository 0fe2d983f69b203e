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


# --- waits for a producer's word (its GPU writes it; the thread here only watches its liveness) ---
class _Producer:
    """A producer's segment as the thread sees it: whether it lives, and its token."""

    def __init__(self, alive: bool) -> None:
        self.alive, self.token = alive, b"\0" * 16

    def producer_alive(self) -> bool:
        return self.alive


class _Lease:
    incomplete = None


def _watched(alive: bool, word: int, value: int) -> tuple[object, object, object]:
    import mmap

    from cupy_ipc import _words

    words = _words.Words(mmap.mmap(-1, _words.BYTES), 0, 0)
    words.set(3, word)
    lease = _Lease()
    gate = _gates._Gate(3, value, None, 0, _Producer(alive), 4242, lease, words)
    gate.check_at = 0.0
    _gates._pending[(words, 3, value)] = gate
    return words, gate, lease


def test_a_wait_for_a_producers_word_is_forgotten_once_the_word_is_reached(words):
    producer_words, gate, lease = _watched(alive=True, word=7, value=7)
    _gates._check_word(gate, 1.0)
    assert not _gates._pending and lease.incomplete is None


def test_a_wait_for_a_live_producers_word_stays_until_reached(words):
    producer_words, gate, lease = _watched(alive=True, word=6, value=7)
    _gates._check_word(gate, 1.0)
    assert list(_gates._pending.values()) == [gate] and producer_words.read(3) == 6


def test_a_wait_for_a_gone_producers_word_is_released_and_its_open_marked(words):
    producer_words, gate, lease = _watched(alive=False, word=6, value=7)
    with pytest.warns(RuntimeWarning, match=r"pid 4242\) exited"):
        _gates._check_word(gate, 1.0)
    assert producer_words.read(3) == 7 and not _gates._pending  # the stream goes on
    assert lease.incomplete[0] == 4242 and "exited before" in lease.incomplete[1]


def test_a_gone_producers_word_reached_before_it_exited_marks_nothing(words):
    producer_words, gate, lease = _watched(alive=False, word=8, value=7)
    _gates._check_word(gate, 1.0)
    assert not _gates._pending and lease.incomplete is None


def test_two_opens_waiting_for_the_same_word_of_a_gone_producer_are_both_marked(words, monkeypatch):
    # Two opens of one export in this process wait for the same word: the second wait replaced the first's watch,
    # so only the second open was marked, and the first's close() did not say that its values may be incomplete.
    import mmap

    from cupy_ipc import _words

    monkeypatch.setattr(_gates, "_started", lambda: True)
    monkeypatch.setattr(_words, "wait", lambda *args: True)  # the stream's wait, queued
    producer_words = _words.Words(mmap.mmap(-1, _words.BYTES), 0, 0)
    producer_words.set(3, 6)
    segment, first, second = _Producer(alive=False), _Lease(), _Lease()
    assert _gates.wait_word(producer_words, 3, 7, 0, 0, segment, 4242, first)
    assert _gates.wait_word(producer_words, 3, 7, 0, 0, segment, 4242, second)
    (gate,) = _gates._pending.values()
    gate.check_at = 0.0
    with pytest.warns(RuntimeWarning, match=r"pid 4242\) exited"):
        _gates._check_word(gate, 1.0)
    assert first.incomplete is not None and second.incomplete == first.incomplete
