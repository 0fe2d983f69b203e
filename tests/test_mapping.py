"""The consumer's mapping table, without a GPU: which idle mappings an import collides with."""

from __future__ import annotations

import collections
import contextlib
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_keepalive import _eventually

import cupy_ipc
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


@pytest.fixture
def growing(idle, monkeypatch):
    """The idle table of :func:`idle` with room for two, growing as by default, no mapping evicted yet."""
    monkeypatch.setattr(_mapping, "_idle_limit", 2)
    monkeypatch.setattr(_mapping, "_idle_grows", True)
    monkeypatch.setattr(_mapping, "_evicted", collections.OrderedDict())
    return idle


def test_the_idle_limit_grows_by_one_for_each_mapping_it_evicted_that_is_wanted_again(growing):
    # A consumer taking turns among more re-sent buffers than the limit mapped and unmapped one per message, at a
    # third of the messages a second (measured with eight producers of four buffers each).
    put, discarded = growing
    for ptr in (1, 2, 3):
        put(ptr, None)
    with _mapping._lock:
        _mapping._trim_idle()
        assert discarded == [1] and list(_mapping._evicted) == [("key", 1)]
        _mapping._wanted_again(("key", 4))  # never evicted: a buffer new to this consumer
        assert _mapping._idle_limit == 2
        _mapping._wanted_again(("key", 1))
        assert _mapping._idle_limit == 3 and not _mapping._evicted
        _mapping._wanted_again(("key", 1))  # counted once
        assert _mapping._idle_limit == 3


def test_the_idle_limit_grows_no_further_than_its_ceiling_nor_remembers_more_evictions(growing, monkeypatch):
    put, discarded = growing
    monkeypatch.setattr(_mapping, "IDLE_GROWS_TO", 3)
    for ptr in range(1, 7):
        put(ptr, None)
    with _mapping._lock:
        _mapping._trim_idle()
        assert list(_mapping._evicted) == [("key", 2), ("key", 3), ("key", 4)]  # the newest three
        for ptr in (2, 3, 4):
            _mapping._wanted_again(("key", ptr))
    assert _mapping._idle_limit == 3


def test_a_limit_set_by_hand_stays_as_set_unless_told_to_grow(growing):
    put, discarded = growing
    for ptr in (1, 2, 3):
        put(ptr, None)
    assert _mapping.set_idle_mapping_limit(2) == 2
    assert discarded == [1] and not _mapping._evicted  # nothing remembered: the limit does not grow
    with _mapping._lock:
        _mapping._wanted_again(("key", 1))
    assert _mapping._idle_limit == 2
    assert _mapping.set_idle_mapping_limit(1, grow=True) == 2
    assert discarded == [1, 2] and list(_mapping._evicted) == [("key", 2)]
    with _mapping._lock:
        _mapping._wanted_again(("key", 2))
    assert _mapping._idle_limit == 2
    assert cupy_ipc.idle_mapping_limit() == 2  # the grown limit, read without setting it (which stops growth)


@given(st.lists(st.integers(0, 24), max_size=300))
def test_a_consumer_taking_buffers_in_any_order_keeps_the_idle_table_within_a_limit_grown_only_by_evictions(turns):
    # Each turn opens a buffer and lets it go again, as a consumer of re-sent buffers does: from its idle mapping
    # if it has one, else by an import, which raises the limit only if the limit evicted that mapping before.
    discarded: list[int] = []
    saved = {name: getattr(_mapping, name) for name in ("_idle", "_idle_limit", "_idle_grows", "_evicted",
                                                        "_discard", "IDLE_GROWS_TO")}
    _mapping._idle, _mapping._evicted = collections.OrderedDict(), collections.OrderedDict()
    _mapping._idle_limit, _mapping._idle_grows, _mapping.IDLE_GROWS_TO = 4, True, 12
    _mapping._discard = lambda m: discarded.append(m.ptr)
    try:
        evicted_ever: set[int] = set()
        for buffer in turns:
            key = ("key", buffer)
            with _mapping._lock:
                before = _mapping._idle_limit
                if _mapping._unpark(key) is None:  # an import
                    grows = key in _mapping._evicted and before < _mapping.IDLE_GROWS_TO
                    _mapping._wanted_again(key)
                    assert _mapping._idle_limit == before + grows
                    assert not grows or buffer in evicted_ever
                _mapping._park(key, _mapping._Mapping(buffer, 0, imported=True))
                _mapping._trim_idle()
                evicted_ever.update(discarded)
                assert len(_mapping._idle) <= _mapping._idle_limit <= _mapping.IDLE_GROWS_TO
                assert len(_mapping._evicted) <= _mapping.IDLE_GROWS_TO
                assert not set(_mapping._evicted) & set(_mapping._idle)
    finally:
        for name, value in saved.items():
            setattr(_mapping, name, value)


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


def _last_user(producer, device: int = 0, close=None) -> tuple[bytes, int]:
    """Export 9 of ``producer`` claimed, and mapped under key ``("k",)`` on ``device`` with one user; the claim."""
    import os

    token, _, view, _ = producer
    with _mapping._lock:
        claim = _mapping._claim(view, token, os.getpid(), 9, 3)
        m = _mapping._Mapping(0x1000, device, imported=True, close=close)
        m.users = 1
        _mapping._active[("k",)] = m
    return claim


def test_a_release_interrupted_in_its_unmap_still_lets_the_claim_go(producer, monkeypatch):
    # The claim stayed held (the producer's memory pinned) until the consumer exited. (Closed on the releasing
    # thread, as where the closer thread does not run.)
    held = producer[3]
    monkeypatch.setattr(_mapping._reaper, "_closer_runs", False)

    class Runtime:
        getDevice = staticmethod(lambda: 0)

        def ipcCloseMemHandle(self, ptr):
            raise KeyboardInterrupt

    monkeypatch.setattr(_mapping._cuda, "rt", lambda: Runtime())
    monkeypatch.setattr(_mapping._cuda, "close_ipc_mapping", lambda ptr, device: Runtime().ipcCloseMemHandle(ptr))
    claim = _last_user(producer)
    assert held()
    with pytest.raises(KeyboardInterrupt):
        _mapping._finish(("k",), claim)
    assert not _mapping._claims and not held()


def test_a_release_that_parks_its_mapping_and_is_interrupted_evicting_another_keeps_one_claim_each(producer,
                                                                                                    monkeypatch):
    # Parking a re-sent pool buffer's mapping with its claim evicted an older one; Ctrl-C in that eviction's
    # unmap let the parked mapping's claim go as well (it was released again later: by then, perhaps, the claim
    # of a later export in the same slot, whose memory the producer then freed in use) and left the evicted
    # mapping's claim held until exit.
    import os

    from cupy_ipc import _segment
    from cupy_ipc._segment import ONE_CONSUMER, PINNED

    token, own, view, held_new = producer
    monkeypatch.setattr(_mapping, "_idle", collections.OrderedDict())
    monkeypatch.setattr(_mapping, "_released", collections.OrderedDict())
    monkeypatch.setattr(_mapping, "_idle_limit", 1)
    monkeypatch.setattr(_mapping, "_idle_grows", False)
    monkeypatch.setattr(_mapping._cuda, "using_device", lambda device, bind=False: contextlib.nullcontext())

    def interrupted(ptr):  # Ctrl-C as the driver's unmap of the evicted pool import returns
        raise KeyboardInterrupt

    own.write(4, 7, PINNED | ONE_CONSUMER)  # export 7: the older buffer, idle here with its claim
    with _mapping._lock:
        old = _mapping._Mapping(0x2000, 0, imported=True, close=interrupted, hold_claim=True)
        old.held = _mapping._claim(view, token, os.getpid(), 7, 4)
        _mapping._park(("old",), old)
        claim = _mapping._claim(view, token, os.getpid(), 9, 3)
        m = _mapping._Mapping(0x1000, 0, imported=True, close=lambda ptr: None, hold_claim=True)
        m.users = 1
        _mapping._active[("k",)] = m
        _mapping._released[("k",)] = None  # released here before: a buffer sent again, kept idle
    with pytest.raises(KeyboardInterrupt):
        _mapping._finish(("k",), claim)
    assert list(_mapping._idle) == [("k",)] and _mapping._idle[("k",)].held == claim
    assert held_new() and list(_mapping._claims) == [claim]  # the parked mapping's, held once
    assert not own.held_by_other(_segment.in_use(4))  # the evicted mapping's, let go
    _mapping.collect_idle()
    assert not held_new() and not _mapping._claims


def test_a_release_interrupted_waiting_for_the_lock_is_finished_on_the_librarys_thread(producer, monkeypatch,
                                                                                      ctrl_c_while_locked):
    # Another thread holds the lock as long as its import waits for a close (until the GPU is idle, measured):
    # Ctrl-C meanwhile left the claim held (the producer's memory pinned) and the mapping in use until exit.
    held = producer[3]
    monkeypatch.setattr(_mapping._Mapping, "unmap", lambda m: None)
    claim = _last_user(producer)
    _mapping._reaper.start()
    with ctrl_c_while_locked():
        _mapping._finish(("k",), claim)
    assert _eventually(lambda: not _mapping._claims)
    assert not held() and not _mapping._active


@pytest.mark.parametrize("kind", ["legacy", "pool"])
def test_a_legacy_mapping_is_closed_after_its_claim_goes_and_a_pools_before(producer, monkeypatch, kind):
    # Closing a legacy mapping waits until the whole GPU is idle (measured): while it waits, the producer must
    # have its memory back. A pool's import must be freed before the producer frees the memory (CUDA's rule).
    held = producer[3]
    seen: list[bool] = []  # whether the claim was still held at each unmap

    class Runtime:
        getDevice = staticmethod(lambda: 0)

        def ipcCloseMemHandle(self, ptr):
            seen.append(held())

    monkeypatch.setattr(_mapping._cuda, "rt", lambda: Runtime())
    monkeypatch.setattr(_mapping._cuda, "close_ipc_mapping", lambda ptr, device: Runtime().ipcCloseMemHandle(ptr))
    claim = _last_user(producer, close=(lambda ptr: seen.append(held())) if kind == "pool" else None)
    monkeypatch.setattr(_mapping._cuda, "using_device", lambda device, bind=False: contextlib.nullcontext())
    _mapping._finish(("k",), claim)
    _mapping.settle_closes()  # (a legacy mapping's close is the closer thread's)
    assert seen == ([False] if kind == "legacy" else [True])
    assert not _mapping._claims and not held() and not _mapping._active


def test_an_open_interrupted_while_its_lease_is_made_lets_the_mapping_and_claim_go(producer, monkeypatch):
    import os

    token, own, view, held = producer
    unmapped = []

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(_mapping.Lease, "__init__", interrupted)
    monkeypatch.setattr(_mapping._Mapping, "unmap", lambda m: unmapped.append(m.ptr))
    monkeypatch.setattr(_mapping, "_checked", lambda m, *size: m)  # (the driver's mapped size)
    importer = (lambda: 0x2000, None, 0)
    with pytest.raises(KeyboardInterrupt):
        _mapping.acquire(("k",), 0, bytes(64), 64, None, None, view, token, os.getpid(), 9, 3, None, 0, 0,
                         importer, False)
    _mapping.settle_closes()  # (the mapping's close is the closer thread's)
    assert unmapped == [0x2000] and not _mapping._active and not _mapping._claims and not held()


def _interrupted_in_its_last_step(monkeypatch) -> None:
    def interrupted() -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(_mapping._threads, "mark", interrupted)


def _interrupted_once_made(monkeypatch) -> None:
    # As at the check for interrupts that follows the lease's making.
    made = _mapping.Lease.__init__

    def made_then_interrupted(self, *args):
        made(self, *args)
        raise KeyboardInterrupt

    monkeypatch.setattr(_mapping.Lease, "__init__", made_then_interrupted)


@pytest.mark.parametrize("interrupt", [_interrupted_in_its_last_step, _interrupted_once_made])
def test_an_open_interrupted_late_in_making_its_lease_lets_go_of_it_once(producer, monkeypatch, interrupt):
    # Interrupted once the lease named its mapping, or once it was whole, the open let the mapping and claim go,
    # and so did the lease when collected: another open's array, which shared them, lost them (its mapping
    # closed, and the producer free to reuse the memory).
    import gc
    import os

    token, own, view, held = producer
    unmapped = []
    monkeypatch.setattr(_mapping._Mapping, "unmap", lambda m: unmapped.append(m.ptr))
    monkeypatch.setattr(_mapping, "_checked", lambda m, *size: m)  # (the driver's mapped size)
    monkeypatch.setattr(_mapping._cuda, "stream_idle", lambda ptr: True)
    monkeypatch.setattr(_mapping._reaper, "collecting", lambda: False)  # (released where collected)

    class Stream:
        ptr = 0x5EED  # not a default stream

    def acquire() -> _mapping.Lease:
        return _mapping.acquire(("k",), 0, bytes(64), 64, None, None, view, token, os.getpid(), 9, 3, Stream(), 0,
                                0, (lambda: 0x2000, None, 0), False)[1]

    in_use = acquire()
    interrupt(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        acquire()
    gc.collect()  # (the lease, whole or half-made, which the traceback held)
    assert _mapping._active[("k",)].users == 1 and _mapping._claims[(token, 3)].count == 1 and held()
    del in_use
    _mapping.settle_closes()  # (the mapping's close is the closer thread's)
    assert unmapped == [0x2000] and not _mapping._active and not _mapping._claims and not held()


def test_a_lease_interrupted_while_it_was_made_is_finalized_quietly():
    lease = _mapping.Lease.__new__(_mapping.Lease)  # no slot set: __del__ raised AttributeError
    lease.__del__()


# --- a legacy mapping's close, after the lock -----------------------------------------------------------------
@pytest.fixture
def closes(monkeypatch, libcuda):
    """Empty tables of closes; a runtime whose opens and closes are recorded, in order, in the list returned."""
    seen: list[str] = []

    class Runtime:
        cudaIpcMemLazyEnablePeerAccess = 1
        getDevice = staticmethod(lambda: 0)

        def ipcOpenMemHandle(self, handle, flags):
            seen.append("open")
            return 0x5000

    monkeypatch.setattr(_mapping, "_closing", {})
    monkeypatch.setattr(_mapping, "_under_way", set())
    monkeypatch.setattr(_mapping, "_idle", collections.OrderedDict())
    monkeypatch.setattr(_mapping._cuda, "rt", lambda: Runtime())
    monkeypatch.setattr(_mapping._cuda, "close_ipc_mapping", lambda ptr, device: seen.append(f"close {ptr:#x}"))
    monkeypatch.setattr(_mapping, "_mapped_bytes", lambda ptr, want, ranges: want)  # (the driver's mapped size)
    return seen


def _let_go(ptr: int, origin: _mapping.Origin, device: int = 0) -> _mapping._Mapping:
    m = _mapping._Mapping(ptr, device, imported=True)
    m.origin = origin
    with _mapping._lock:
        _mapping._close_later(m)
    return m


def test_a_legacy_mapping_is_closed_once_the_lock_is_let_go(producer, closes, monkeypatch):
    # The close waits until the GPU is idle: under the lock, every other open and release of the process waited.
    import threading

    held = producer[3]
    free: list[bool] = []

    def take_the_lock() -> None:
        free.append(_mapping._lock.acquire(timeout=5))
        if free[-1]:
            _mapping._lock.release()

    def close(ptr, device):
        t = threading.Thread(target=take_the_lock)
        t.start()
        t.join(10)

    monkeypatch.setattr(_mapping._cuda, "close_ipc_mapping", close)
    claim = _last_user(producer)
    _mapping._finish(("k",), claim)
    _mapping.settle_closes()  # (the close is the closer thread's)
    assert free == [True]
    assert not _mapping._closing and not _mapping._under_way and not held()


def test_an_import_colliding_with_a_close_not_under_way_closes_it_first(closes):
    _let_go(0x1000, (H1, B, 0x9000, 0x1000))  # the same handle bytes
    _let_go(0x2000, (H2, A, 0x1000, 0x1000))  # the sender's freed allocation at the new one's addresses
    _let_go(0x3000, (H2, A, 0x4000, 0x1000))  # another allocation
    _let_go(0x4000, (H2, A, 0x1000, 0x1000), device=1)  # another GPU's
    with _mapping._lock:
        m = _mapping._import(0, H1, 0x3000, (H1, A, 0x1000, 0x3000))
    assert m.ptr == 0x5000
    assert sorted(closes[:2]) == ["close 0x1000", "close 0x2000"] and closes[2:] == ["open"]
    left = sorted(m.ptr for m in _mapping._closing.values())
    assert left == [0x3000, 0x4000]  # for the threads that let them go
    _mapping._close_pending()
    assert not _mapping._closing and not _mapping._under_way


@pytest.mark.parametrize("where", ["driver", "size"])
def test_an_import_interrupted_once_the_driver_mapped_it_closes_the_mapping(closes, libcuda, monkeypatch, where):
    # Ctrl-C during the driver's open (about 50 µs) is raised as the call returns: the pointer, returned as a
    # value, was lost with the mapping still made. The allocation's next import then failed (the driver
    # refuses to map it twice), naming an array in use that did not exist.
    def open_then_interrupted(out, handle, flags):  # the driver's open, then the interrupt's check
        out._obj.value = 0x7000  # (out: ctypes.byref of the caller's c_uint64)
        if where == "driver":
            raise KeyboardInterrupt
        return 0

    def interrupted(ptr, want, ranges):
        raise KeyboardInterrupt

    libcuda["cuIpcOpenMemHandle_v2"] = open_then_interrupted
    if where == "size":
        monkeypatch.setattr(_mapping, "_mapped_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt), _mapping._lock:
        _mapping._import(0, H1, 64, (H1, A, 0x1000, 64))
    _mapping.settle_closes()  # (the close is the closer thread's)
    assert closes == ["close 0x7000"]
    assert not _mapping._closing and not _mapping._under_way


def test_an_import_colliding_with_a_close_under_way_waits_for_it(closes, monkeypatch):
    import threading
    import time

    gate = threading.Event()

    def slow_close(ptr, device):
        gate.wait(10)
        closes.append(f"close {ptr:#x}")

    def let_go_and_close() -> None:  # as a release does
        _let_go(0x1000, (H1, B, 0x9000, 0x1000))
        _mapping._close_pending()

    monkeypatch.setattr(_mapping._cuda, "close_ipc_mapping", slow_close)
    closer = threading.Thread(target=let_go_and_close)
    closer.start()
    deadline = time.monotonic() + 10
    while not _mapping._under_way and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _mapping._under_way  # its close has begun

    def import_it() -> None:
        with _mapping._lock:
            _mapping._import(0, H1, 64, (H1, A, 0x1000, 64))

    importer = threading.Thread(target=import_it)
    importer.start()
    time.sleep(0.3)
    assert closes == [] and importer.is_alive()
    gate.set()  # the close ends
    closer.join(10)
    importer.join(10)
    assert closes == ["close 0x1000", "open"] and not _mapping._closing and not _mapping._under_way


def test_a_release_hands_its_mappings_close_to_the_closer_thread(producer, closes, monkeypatch):
    # The close waits until the whole GPU is idle: the thread that dropped the array waited as long.
    import threading

    held = producer[3]
    gate, closing = threading.Event(), []

    def slow_close(ptr, device):
        closing.append(threading.current_thread().name)
        gate.wait(10)
        closes.append(f"close {ptr:#x}")

    monkeypatch.setattr(_mapping._cuda, "close_ipc_mapping", slow_close)
    _mapping._reaper.start()
    claim = _last_user(producer)
    _mapping._finish(("k",), claim)  # returns with the close still to come, or under way
    assert not held() and closes == []
    deadline = time.monotonic() + 10
    while not closing and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closing == ["cupy_ipc-closer"]
    gate.set()
    _mapping.settle_closes()
    assert closes == ["close 0x1000"] and not _mapping._closing and not _mapping._under_way


def test_the_closer_thread_makes_only_the_gpu_of_the_mapping_it_closes_current(producer, closes, monkeypatch):
    # Going back to the thread's "previous" device after the close, the runtime's default GPU 0, would make a
    # context there (cudaSetDevice does) in a process that never used GPU 0.
    import threading

    devices: list[tuple[str, int]] = []

    class Runtime:
        current = 0  # a thread that made no runtime call reads GPU 0

        def getDevice(self):
            return self.current

        def setDevice(self, device):
            devices.append((threading.current_thread().name, device))
            self.current = device

    runtime = Runtime()
    monkeypatch.setattr(_mapping._cuda, "rt", lambda: runtime)
    monkeypatch.setattr(_mapping._cuda, "close_ipc_mapping",
                        lambda ptr, device: closes.append(f"close {ptr:#x} on GPU {runtime.current}"))
    _mapping._reaper.start()
    claim = _last_user(producer, device=1)
    _mapping._finish(("k",), claim)  # its last user: sent once, closed
    deadline = time.monotonic() + 10
    while _mapping._closing and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closes == ["close 0x1000 on GPU 1"]
    assert devices == [("cupy_ipc-closer", 1)]


def test_a_close_looking_through_the_table_while_another_thread_adds_to_it_goes_on(closes):
    # Releases and evictions add to the table under the library's lock only; the closer thread (or an import)
    # looks through it meanwhile, and the table changing size under that loop raised RuntimeError.
    first = _let_go(0x1000, (H1, B, 0x9000, 0x1000))

    def wanted(m):
        if m is first:
            _let_go(0x2000, (H2, A, 0x1000, 0x1000))  # another thread's, at a switch inside the loop
        return m is first

    assert _mapping._close_one(wanted, wait=False) is True
    assert closes == ["close 0x1000"] and [m.ptr for m in _mapping._closing.values()] == [0x2000]
    _mapping.settle_closes()
    assert closes == ["close 0x1000", "close 0x2000"]


class _Interrupting:
    """``_closed`` (a condition) whose ``with`` is interrupted (Ctrl-C) at its ``nth`` entry."""

    def __init__(self, cond, nth):
        self.cond, self.nth, self.entries = cond, nth, 0

    def __enter__(self):
        self.entries += 1
        if self.entries == self.nth:
            raise KeyboardInterrupt
        return self.cond.__enter__()

    def __exit__(self, *exc):
        return self.cond.__exit__(*exc)

    def wait(self, timeout):
        return self.cond.wait(timeout)

    def notify_all(self):
        self.cond.notify_all()


def test_a_close_interrupted_as_it_leaves_the_table_leaves_it_all_the_same(closes, monkeypatch):
    # Interrupted (Ctrl-C) while it took the mapping out of the table, which another thread held for a moment,
    # the close left it marked as being closed: every import colliding with it then waited for ever.
    import threading

    monkeypatch.setattr(_mapping, "_closed", _Interrupting(_mapping._closed, nth=2))
    _let_go(0x1000, (H1, B, 0x9000, 0x1000))
    with pytest.raises(KeyboardInterrupt):
        _mapping._close_pending()
    assert closes == ["close 0x1000"] and not _mapping._closing and not _mapping._under_way
    t = threading.Thread(target=_mapping.settle_closes, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive()


def test_a_close_interrupted_before_it_marked_its_mapping_leaves_it_to_the_next(closes, monkeypatch):
    # Interrupted (Ctrl-C) before it marked the mapping as being closed, the close took it out of the table all
    # the same: never closed, it stayed mapped until exit.
    class InterruptedMark(set):
        def add(self, item):
            raise KeyboardInterrupt

    monkeypatch.setattr(_mapping, "_under_way", InterruptedMark())
    _let_go(0x1000, (H1, B, 0x9000, 0x1000))
    with pytest.raises(KeyboardInterrupt):
        _mapping._close_pending()
    assert closes == [] and len(_mapping._closing) == 1
    monkeypatch.setattr(_mapping, "_under_way", set())
    _mapping.settle_closes()
    assert closes == ["close 0x1000"] and not _mapping._closing


def test_a_thread_closes_only_the_mappings_it_let_go(closes):
    # Another thread's close, taken over by this one's open or release, made this one wait for the GPU.
    import threading

    t = threading.Thread(target=_let_go, args=(0x1000, (H1, B, 0x9000, 0x1000)))
    t.start()
    t.join(10)
    _mapping._close_pending()
    assert closes == [] and len(_mapping._closing) == 1
    _mapping.collect_idle()  # collect() closes every one
    assert closes == ["close 0x1000"] and not _mapping._closing


def test_a_close_interrupted_in_the_driver_call_leaves_the_table(closes, monkeypatch):
    # Interrupted (Ctrl-C) with the mapping still in the table as being closed, an import colliding with it
    # would wait for ever.
    def interrupted(ptr, device):
        raise KeyboardInterrupt

    monkeypatch.setattr(_mapping._cuda, "close_ipc_mapping", interrupted)
    _let_go(0x1000, (H1, B, 0x9000, 0x1000))
    with pytest.raises(KeyboardInterrupt):
        _mapping._close_pending()
    assert not _mapping._closing and not _mapping._under_way
    with _mapping._lock:
        assert _mapping._import(0, H1, 64, (H1, A, 0x1000, 64)).ptr == 0x5000


def test_a_close_on_a_thread_with_no_context_makes_the_mappings_gpu_current_and_tries_again(libcuda, monkeypatch):
    # The library's own threads have made no runtime call: the driver then has no context to close in.
    calls: list[object] = []

    def close(ptr):
        calls.append(ptr)
        return 201 if len(calls) == 1 else 0  # CUDA_ERROR_INVALID_CONTEXT, then success

    libcuda["cuIpcCloseMemHandle"] = close
    monkeypatch.setattr(_mapping._cuda, "using_device",
                        lambda device, bind=False: calls.append(("current", device, bind)) or contextlib.nullcontext())
    _mapping._cuda.close_ipc_mapping(0x1000, 1)
    assert calls == [0x1000, ("current", 1, True), 0x1000]


@pytest.mark.parametrize("kind", ["pool", "vmm"])
def test_an_import_by_descriptor_interrupted_in_its_size_check_unmaps_it(producer, monkeypatch, kind):
    # Ctrl-C during the driver's size query of a pool or virtual-memory import (cuMemGetAddressRange, raised as
    # the call returns) lost the mapping: the pool allocation was never freed (the producer's memory stayed
    # imported, and the pool with it) nor the pieces unmapped. A legacy import closes its mapping there.
    import os

    token, own, view, held = producer
    unmapped: list[int] = []

    def interrupted(ptr, want, ranges):
        raise KeyboardInterrupt

    monkeypatch.setattr(_mapping, "_mapped_bytes", interrupted)
    monkeypatch.setattr(_mapping._cuda, "using_device", lambda device, bind=False: contextlib.nullcontext())
    importer = (lambda: 0x2000, unmapped.append, 0 if kind == "pool" else 2)
    with pytest.raises(KeyboardInterrupt):
        _mapping.acquire(("k",), 0, bytes(64), 64, None, None, view, token, os.getpid(), 9, 3, None, 0, 0,
                         importer, kind == "pool")
    assert unmapped == [0x2000]
    assert not _mapping._active and not _mapping._claims and not held()
