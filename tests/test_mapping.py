"""The consumer's mapping table, without a GPU: which idle mappings an import collides with."""

from __future__ import annotations

import collections

import pytest

from cupy_ipc import _mapping

A, B = b"a" * 16, b"b" * 16  # two senders' tokens
H1, H2 = b"\x01" * 64, b"\x02" * 64


@pytest.fixture
def idle(monkeypatch):
    """An empty idle table whose discards are recorded instead of unmapped (unmapping needs a GPU)."""
    discarded: list[int] = []
    monkeypatch.setattr(_mapping, "_idle", collections.OrderedDict())
    monkeypatch.setattr(_mapping, "_discard", lambda m: discarded.append(m.ptr))

    def put(ptr: int, origin: _mapping.Origin | None, device: int = 0) -> None:
        m = _mapping._Mapping(ptr, device, imported=True)
        m.origin = origin
        _mapping._park(("key", ptr), m)

    return put, discarded


def test_an_import_drops_the_idle_mappings_it_collides_with(idle):
    put, discarded = idle
    put(1, (H1, B, 0x9000, 0x1000))  # the same handle bytes from another sender: the driver would hand it back
    put(2, (H2, A, 0x1000, 0x1000))  # the sender's freed allocation under the new one's first bytes
    put(3, (H2, A, 0x3000, 0x1000))  # under its last bytes
    put(4, (H2, A, 0x4000, 0x1000))  # right after it: another allocation
    put(5, (H2, B, 0x1000, 0x1000))  # the same addresses of another sender
    put(6, (H2, A, 0x1000, 0x1000), device=1)  # another GPU's mapping
    put(7, None)  # not a legacy import
    with _mapping._lock:
        n = _mapping._drop_idle_colliding(0, (H1, A, 0x1000, 0x3000))
    assert n == 3 and discarded == [1, 2, 3]
    assert [k[1] for k in _mapping._idle] == [4, 5, 6, 7]


def test_without_an_origin_every_idle_legacy_mapping_of_the_device_goes(idle):
    put, discarded = idle
    put(1, (H1, A, 0x1000, 0x1000))
    put(2, (H2, B, 0x1000, 0x1000), device=1)
    put(3, None)
    with _mapping._lock:
        assert _mapping._drop_idle_colliding(0, None) == 1
    assert discarded == [1] and [k[1] for k in _mapping._idle] == [2, 3]
