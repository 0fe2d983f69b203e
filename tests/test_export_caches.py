"""The producer's caches of its exports, without a GPU."""

from __future__ import annotations

import collections

import pytest

from cupy_ipc import _array_handle


@pytest.fixture
def caches(monkeypatch):
    """Empty export caches of at most 4 entries before they turn over; the allocations in ``alive`` are the
    ones still allocated."""
    alive: set[int] = set()
    monkeypatch.setattr(_array_handle, "_HANDLE_CACHE_SIZE", 4)
    monkeypatch.setattr(_array_handle, "_handle_cache", {})
    monkeypatch.setattr(_array_handle, "_exported", collections.OrderedDict())
    monkeypatch.setattr(_array_handle, "_still_here", lambda base, buffer_id: buffer_id in alive)
    return alive


def _export(i: int) -> bytes:
    handle = bytes([i]) * 64
    _array_handle._remember_export(handle, 0x1000 * i, i)
    _array_handle._handle_cache[i] = handle
    return handle


def test_an_allocation_still_here_is_never_forgotten(caches):
    # Our handle sent back to us by another process must open as our memory for as long as the memory is
    # ours: emptied once full, the table forgot live allocations, and the handle was imported as another's.
    caches.update(range(8))
    handles = [_export(i) for i in range(8)]
    assert set(_array_handle._exported) == set(handles)  # all alive: the table grows past its size
    assert _array_handle._handle_cache == {i: handles[i] for i in range(8)}


def test_freed_allocations_are_forgotten_as_new_ones_come(caches):
    caches.update({0, 2})
    for i in range(4):
        _export(i)
    for i in range(4, 40):  # each new allocation is freed before the next
        caches.add(i)
        _export(i)
        caches.discard(i)
    assert set(_array_handle._exported.values()) >= {(0x0, 0), (0x2000, 2)}  # the live ones stay
    assert len(_array_handle._exported) <= 6
    assert set(_array_handle._handle_cache) == {v[1] for v in _array_handle._exported.values()}


def test_the_same_bytes_for_a_later_allocation_replace_the_earlier_ones(caches):
    caches.update({1, 2})
    handle = _export(1)
    _array_handle._remember_export(handle, 0x1000, 2)  # the driver gave the same bytes to a new allocation
    _array_handle._handle_cache[2] = handle
    assert _array_handle._exported[handle] == (0x1000, 2) and _array_handle._handle_cache == {2: handle}
