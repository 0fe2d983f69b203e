"""The library's own thread, without a GPU: the finalizers that the garbage collector runs hand their work to
it, and no failure ends it."""

from __future__ import annotations

import gc
import threading
import time

import pytest
from test_keepalive import _eventually

from cupy_ipc import _mapping, _pools, _reaper, _vmm


def _lease() -> _mapping.Lease:
    return _mapping.Lease(None, ("key",), None, None, 0, _mapping._Mapping(0x1000, 0, imported=True), b"", 64, 0)


def _driver_pools() -> _pools._DriverPools:
    pools = _pools._DriverPools(None)
    pools.pools[0] = 1  # a pool of GPU 0, whose handle the recorder gets
    return pools


# What each finalizer calls (recorded instead: the real calls need a GPU), and how to make its object.
FINALIZED = {
    "pool": (_pools, "_destroy", _driver_pools),
    "virtual memory": (_vmm, "_free_allocated", lambda: _vmm._Owner(0x1000, [64], 0)),
}


@pytest.mark.parametrize("kind", list(FINALIZED))
def test_an_object_that_the_garbage_collector_frees_is_finalized_on_the_librarys_thread(kind, monkeypatch):
    # The collector runs wherever an allocation sets it off, inside the library's locked code too: a finalizer
    # run there, on the thread holding the lock, could wait on it forever (destroying a pool takes _pools._lock)
    # or change a table that thread is going through.
    module, name, make = FINALIZED[kind]
    ran: list[str] = []
    monkeypatch.setattr(module, name, lambda *args: ran.append(threading.current_thread().name))
    _reaper.start()
    dropped = make()
    del dropped  # by its last reference: finalized here and now
    assert ran == [threading.current_thread().name]
    cycle: list[object] = [make()]
    cycle.append(cycle)
    del cycle
    with _pools._lock:  # as if the collection had interrupted the library's code
        gc.collect()
    assert _eventually(lambda: len(ran) == 2)
    assert ran[1].startswith("cupy_ipc-reaper-")  # one of the library's threads


def test_a_lease_that_the_garbage_collector_frees_defers_the_end_of_its_release(monkeypatch):
    # Its consumer's stream is looked at on the finalizing thread (whose default stream it may be); the claim
    # and mapping, which take the library's locks, are let go on the library's thread (a GPU test runs it).
    deferred: list[bool] = []
    monkeypatch.setattr(_mapping, "_release", lambda *args, **kw: deferred.append(args[-1]))
    dropped = _lease()
    del dropped
    cycle: list[object] = [_lease()]
    cycle.append(cycle)
    del cycle
    gc.collect()
    assert deferred == [False, True]


def test_the_release_thread_outlives_failures_whose_warnings_are_errors():
    # The consumer's thread that waits for GPU work before releasing serves every later release: a failure,
    # reported as a warning that the filters here turn into an error, must not end it. A release whose wait
    # failed is not made (its work may still read the memory), as one that cannot be ordered is not.
    released = []

    class FailingWait:
        def synchronize(self):
            raise RuntimeError("waiting failed")

    def failing_release():
        raise RuntimeError("releasing failed")

    _reaper.start()
    _reaper.later(released.append, "unordered", after=FailingWait())
    _reaper.later(failing_release)
    _reaper.later(released.append, "second")
    assert _eventually(lambda: released)
    assert released == ["second"]


class _Stream:
    ptr = 0x5000  # not a default stream


def test_a_release_interrupted_while_it_orders_is_finished_on_the_librarys_thread_once_the_gpu_is_idle(
        monkeypatch):
    # Ctrl-C in the consumer's stream query used to end the release there: the mapping and the claim stayed
    # until exit. The interrupt still reaches the caller.
    def interrupted(ptr):
        raise KeyboardInterrupt

    handed: list[tuple[object, ...]] = []
    monkeypatch.setattr(_mapping._cuda, "stream_idle", interrupted)
    monkeypatch.setattr(_reaper, "later", lambda then, *args, after=None, device=0: handed.append(
        (then, args, after, device)))
    with pytest.raises(KeyboardInterrupt):
        _mapping._release(("key",), (b"token", 3), _Stream(), 1)
    assert handed == [(_mapping._finish, (("key",), (b"token", 3)), _reaper.WHOLE_DEVICE, 1)]


def test_a_release_whose_work_takes_long_holds_up_no_release_behind_it(monkeypatch):
    # One thread waited for each release in turn: a release whose consumer's work was done waited behind an
    # earlier one's long kernel on another stream, and the producer's memory stayed pinned as long.
    import types

    monkeypatch.setattr(_reaper._cuda, "rt", lambda: types.SimpleNamespace(setDevice=lambda device: None))
    gate = threading.Event()

    class Slow:
        def synchronize(self):
            gate.wait(10)

    class Done:
        def synchronize(self):
            pass

    ran: list[str] = []
    _reaper.start()
    for _ in range(_reaper._MAX_WAITERS - 1):
        _reaper.later(ran.append, "slow", after=Slow())
    _reaper.later(ran.append, "done", after=Done())
    try:
        assert _eventually(lambda: ran == ["done"])
    finally:
        gate.set()
    assert _eventually(lambda: len(ran) == _reaper._MAX_WAITERS)


def test_work_that_no_new_waiter_can_take_is_done_by_the_thread_handing_it_over(monkeypatch):
    # Where no thread can be started (at the process's thread limit, say), the work is done where it is handed
    # over. It was taken back from the waiters' queue, where a waiter freed meanwhile took it first: the thread
    # handing work over then waited for ever for work that only it hands over, and every later release too.
    import queue
    import types

    waits = queue.SimpleQueue()
    monkeypatch.setattr(_reaper, "_waits", waits)
    monkeypatch.setattr(_reaper, "_count_lock", threading.Lock())
    monkeypatch.setattr(_reaper, "_waiters", 1)
    monkeypatch.setattr(_reaper, "_free", 0)
    monkeypatch.setattr(_reaper, "_backlog", 0)
    busy = threading.Event()
    waits.put((None, 0, busy.wait, (10,)))  # the one waiter's work, under way
    threading.Thread(target=_reaper._wait, args=(waits,), daemon=True).start()

    class Unstartable:
        def __init__(self, *args, **kwargs):
            pass

        def start(self):
            busy.set()  # the waiter is done meanwhile, and waits for more
            assert _eventually(lambda: _reaper._free)
            time.sleep(0.2)  # (for it to take the work, if the work was queued)
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(_reaper, "threading", types.SimpleNamespace(Thread=Unstartable))
    ran: list[str] = []
    handing = threading.Thread(target=_reaper._hand_to_a_waiter, args=((None, 0, ran.append, ("handed",)),),
                               daemon=True)
    handing.start()
    handing.join(5)
    assert not handing.is_alive() and ran == ["handed"]
