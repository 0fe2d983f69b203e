"""The producer's caches of its exports, without a GPU."""

from __future__ import annotations

from cupy_ipc import _array_handle


class _Array:
    """Stands for an exported array (weakly referenced by the cache of wire forms)."""


def test_the_export_caches_are_emptied_together(monkeypatch):
    # A handle that skips the driver (cached with its buffer id, or with its array) must still be known as
    # ours when another process sends it back: emptied alone, the table of our handles forgot live ones.
    monkeypatch.setattr(_array_handle, "_HANDLE_CACHE_SIZE", 4)
    monkeypatch.setattr(_array_handle, "_handle_cache", {})
    monkeypatch.setattr(_array_handle, "_exported", {})
    monkeypatch.setattr(_array_handle, "_by_array", _array_handle._ById())
    array = _Array()
    _array_handle._by_array.set(array, ("fields", b"wire"))
    for i in range(4):
        _array_handle._remember_export(bytes([i]) * 64, 0x1000 * i, i)
        _array_handle._handle_cache[i] = bytes([i]) * 64
    assert len(_array_handle._exported) == 4 and _array_handle._by_array.get(array) is not None
    _array_handle._remember_export(b"\x09" * 64, 0x9000, 9)
    assert _array_handle._exported == {b"\x09" * 64: (0x9000, 9)}
    assert _array_handle._handle_cache == {} and _array_handle._by_array.get(array) is None
