"""The consumer's mapping table, without a GPU: which idle mappings an import collides with."""

from __future__ import annotations

import collections
import contextlib

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


# --- interrupts (Ctrl-C) in the consumer's bookkeeping ------------------------------------------------------
@pytest.fixture
def producer(monkeypatch):
    """A producer's segment with export 9 pinned in slot 3, and this process's view of it as a consumer's."""
    import os
    import secrets

    from cupy_ipc import _segment
    from cupy_ipc._segment import ONE_CONSUMER, PINNED, Segment

    token = secrets.token_bytes(16)
    own, view = Segment.create(token), Segment.attach(token, pid=os.getpid())
    own.write(3, 9, PINNED | ONE_CONSUMER)
    monkeypatch.setattr(_mapping, "_active", {})
    monkeypatch.setattr(_mapping, "_claims", {})
    monkeypatch.setattr(_mapping, "_idle_limit", 0)
    yield token, own, view, lambda: own.held_by_other(_segment.in_use(3))
    view.close()
    own.close(unlink=True)


def test_a_release_interrupted_in_its_unmap_still_lets_the_claim_go(producer, monkeypatch):
    # The claim stayed held (the producer's memory pinned) until the consumer exited.
    import os

    token, own, view, held = producer

    class Runtime:
        getDevice = staticmethod(lambda: 0)

        def ipcCloseMemHandle(self, ptr):
            raise KeyboardInterrupt

    monkeypatch.setattr(_mapping._cuda, "rt", lambda: Runtime())
    with _mapping._lock:
        claim = _mapping._claim(view, token, os.getpid(), 9, 3)
        m = _mapping._Mapping(0x1000, 0, imported=True)
        m.users = 1
        _mapping._active[("k",)] = m
    assert held()
    with pytest.raises(KeyboardInterrupt):
        _mapping._finish(("k",), claim)
    assert not _mapping._claims and not held()


@pytest.mark.parametrize("kind", ["legacy", "pool"])
def test_a_legacy_mapping_is_closed_after_its_claim_goes_and_a_pools_before(producer, monkeypatch, kind):
    # Closing a legacy mapping waits until the whole GPU is idle (measured): while it waits, the producer must
    # have its memory back. A pool's import must be freed before the producer frees the memory (CUDA's rule).
    import os

    token, own, view, held = producer
    seen: list[bool] = []  # whether the claim was still held at each unmap

    class Runtime:
        getDevice = staticmethod(lambda: 0)

        def ipcCloseMemHandle(self, ptr):
            seen.append(held())

    monkeypatch.setattr(_mapping._cuda, "rt", lambda: Runtime())
    with _mapping._lock:
        claim = _mapping._claim(view, token, os.getpid(), 9, 3)
        m = _mapping._Mapping(0x1000, 0, imported=True,
                              close=(lambda ptr: seen.append(held())) if kind == "pool" else None)
        m.users = 1
        _mapping._active[("k",)] = m
    monkeypatch.setattr(_mapping._cuda, "using_device", lambda device, bind=False: contextlib.nullcontext())
    _mapping._finish(("k",), claim)
    assert seen == ([False] if kind == "legacy" else [True])
    assert not _mapping._claims and not held() and not _mapping._active


def test_an_open_interrupted_while_its_lease_is_made_lets_the_mapping_and_claim_go(producer, monkeypatch):
    import os

    token, own, view, held = producer
    unmapped = []

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(_mapping, "Lease", interrupted)
    monkeypatch.setattr(_mapping._Mapping, "unmap", lambda m: unmapped.append(m.ptr))
    monkeypatch.setattr(_mapping, "_checked", lambda m, *size: m)  # (the driver's mapped size)
    importer = (lambda: 0x2000, None, 0)
    with pytest.raises(KeyboardInterrupt):
        _mapping.acquire(("k",), 0, bytes(64), 64, None, None, view, token, os.getpid(), 9, 3, None, 0, 0,
                         importer, False)
    assert unmapped == [0x2000] and not _mapping._active and not _mapping._claims and not held()


def test_a_lease_interrupted_while_it_was_made_is_finalized_quietly():
    lease = _mapping.Lease.__new__(_mapping.Lease)  # no slot set: __del__ raised AttributeError
    lease.__del__()
