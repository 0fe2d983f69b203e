"""The producer's registry and the library's state across fork, without a GPU: pins without CUDA work (no
ordering event), segments, and the locks a forked child inherits."""

from __future__ import annotations

import gc
import math
import os
import secrets
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
from test_segment import claim

from cupy_ipc import _keepalive, _segment
from cupy_ipc._identity import this_process
from cupy_ipc._segment import REVOKED, STATE, Segment, segment_path

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux segments and fork")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def _forget(tokens: list[bytes], producers: list[Segment]) -> None:
    """Close this test's views of ``tokens`` and its ``producers`` (files removed)."""
    for t in tokens:
        seg = _segment._attached.pop(t, None)
        if seg is not None:
            seg.close()
    for p in producers:
        p.close(unlink=True)


def _leased_pin(lease: float) -> tuple[int, int]:
    """``(export id, slot)`` of a pin with a lease and no memory or ordering event."""
    export_id, slot, *_ = _keepalive.pin(None, (0, 64, 0), 0, 1, lease, None, ((16,), "float32"))
    return export_id, slot


def _revoked(slot: int) -> bool:
    return _segment.own_segment(this_process().token).read(slot)[2] & STATE == REVOKED


def _eventually(condition, timeout: float = 10.0) -> bool:
    """Whether ``condition()`` holds within ``timeout`` seconds (polled)."""
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return bool(condition())


def test_a_lease_runs_out_though_the_producer_never_exports_again():
    export_id, slot = _leased_pin(0.05)
    try:
        consumer = Segment.attach(this_process().token, pid=os.getpid())  # a consumer's own open file
        assert _eventually(lambda: _revoked(slot))
        assert not claim(consumer, slot, export_id)  # refused, holding nothing
        consumer.close()
    finally:
        _keepalive.release(export_id)
    assert all(p.export_id != export_id for p in _keepalive.pinned())


def test_a_lease_not_yet_run_out_still_admits_its_consumer():
    export_id, slot = _leased_pin(60.0)
    consumer = Segment.attach(this_process().token, pid=os.getpid())
    try:
        assert claim(consumer, slot, export_id)
        consumer.unlock(_segment.in_use(slot))
    finally:
        consumer.close()
        _keepalive.release(export_id)


@pytest.mark.parametrize("consumers", [1, 2])
def test_a_stale_open_of_a_reused_slot_leaves_the_claim_of_its_new_export(consumers):
    # A consumer holds export E2 when a late message of E1, whose slot E2 took, arrives: refusing E1 must not
    # drop the lock that keeps E2's memory (the lock is the slot's, one per process).
    from cupy_ipc import IpcError, _mapping

    token, pid = this_process().token, os.getpid()
    e1, s1 = _leased_pin(0.05)
    assert _eventually(lambda: _revoked(s1))
    _keepalive.sweep()  # E1 ends; its slot is free
    e2, s2, *_ = _keepalive.pin(None, (0, 64, 0), 0, consumers, None, None, ((16,), "float32"))
    assert s2 == s1
    consumer = Segment.attach(token, pid=pid)  # a consumer's own open file
    try:
        with _mapping._lock:
            held = _mapping._claim(consumer, token, pid, e2, s2)
            with pytest.raises(IpcError, match="no longer shares"):
                _mapping._claim(consumer, token, pid, e1, s1)
        _keepalive.release(e2)  # ends E2 once its consumer is done
        assert _keepalive.lookup(e2) is not None, "E2 was freed while its consumer held it"
        with _mapping._lock:
            _mapping._unclaim(held)
        _keepalive.sweep()
        assert _keepalive.lookup(e2) is None
    finally:
        _keepalive.release(e2)
        consumer.close()


def test_the_segments_of_exited_producers_are_let_go(monkeypatch):
    # A long-lived consumer of many short-lived producers must not keep a descriptor for each one gone.
    tokens = [secrets.token_bytes(16) for _ in range(40)]
    producers = [Segment.create(t) for t in tokens]
    try:
        views = [weakref.ref(_segment.attach(t, os.getpid())) for t in tokens[:20]]
        for p in producers[:20]:
            p.close()  # these producers have exited: their liveness locks went with them
        monkeypatch.setattr(_segment, "_prune_at", 1)  # look for exited ones at the next new producer
        for t in tokens[20:]:
            _segment.attach(t, os.getpid())
        assert not any(t in _segment._attached for t in tokens[:20])
        assert all(t in _segment._attached for t in tokens[20:])
        assert not any(os.path.exists(segment_path(t)) for t in tokens[:20])
        gc.collect()
        assert all(v() is None for v in views)  # closed with their last reference
    finally:
        _forget(tokens, producers)


def test_a_segment_no_longer_referenced_closes_its_descriptors():
    token = secrets.token_bytes(16)
    producer = Segment.create(token)
    try:
        view = Segment.attach(token, pid=os.getpid())
        fd = view.fd
        assert os.path.exists(f"/proc/self/fd/{fd}")
        del view
        gc.collect()
        assert not os.path.exists(f"/proc/self/fd/{fd}") or os.path.realpath(f"/proc/self/fd/{fd}") != \
            os.path.realpath(segment_path(token))
    finally:
        producer.close(unlink=True)


def test_threads_attaching_one_producer_share_one_open_file():
    own = _segment.own_segment(this_process().token)
    tokens = [secrets.token_bytes(16) for _ in range(30)]
    producers = [Segment.create(t) for t in tokens]
    seen: list[list[Segment]] = [[] for _ in tokens]
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def attach_all() -> None:
        for k, t in enumerate(tokens):
            try:
                barrier.wait(10)
                seen[k].append(_segment.attach(t, os.getpid()))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

    threads = [threading.Thread(target=attach_all) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not errors
        assert all(len(s) == 8 and all(x is s[0] for x in s) for s in seen)
    finally:
        _forget(tokens, producers)
    assert own.fd >= 0


def test_a_forked_child_that_exits_leaves_its_parents_segment():
    # The child runs its exit handlers, which the parent registered: the parent's segment must stay, or no
    # consumer could open the parent's handles any more.
    done = _run("""
        import os, sys
        from cupy_ipc import _segment
        from cupy_ipc._identity import this_process
        own = _segment.own_segment(this_process().token)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # the exit handlers run
        os.waitpid(pid, 0)
        assert os.path.exists(own.path), "the child removed the parent's segment"
        view = _segment.Segment.attach(this_process().token, pid=os.getpid())
        assert view.producer_alive()
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_child_forked_while_another_thread_holds_the_librarys_locks_can_take_them():
    done = _run("""
        import os, threading
        from cupy_ipc import _events, _keepalive, _mapping, _pools, _segment, _vmm, _fdserver
        locks = [_keepalive._lock, _mapping._lock, _pools._lock, _vmm._lock, _segment._attach_lock,
                 _segment._create_lock, _fdserver._lock, _events._opened_lock]
        held, release = threading.Event(), threading.Event()

        def hold():
            for lock in locks:
                lock.acquire()
            held.set()
            release.wait()
            for lock in locks:
                lock.release()

        threading.Thread(target=hold, daemon=True).start()
        held.wait(10)
        pid = os.fork()
        if pid == 0:
            fresh = [_keepalive._lock, _mapping._lock, _pools._lock, _vmm._lock, _segment._attach_lock,
                     _segment._create_lock, _fdserver._lock, _events._opened_lock]
            os._exit(0 if all(lock.acquire(timeout=5) for lock in fresh) else 1)
        _, status = os.waitpid(pid, 0)
        release.set()
        print(os.waitstatus_to_exitcode(status))
    """)
    assert done.returncode == 0 and done.stdout.strip() == "0", (done.stdout, done.stderr)


def test_an_endless_lease_leaves_the_lease_keeper_running(monkeypatch):
    # A lease past the lock's longest timeout once ended the thread that revokes leases: no later lease ran out.
    # Only this test's deadlines, so that the endless ones come first, whatever earlier tests left behind.
    monkeypatch.setattr(_keepalive, "_leases", [])
    long_ids = [_leased_pin(lease)[0] for lease in (float("inf"), 1e12)]
    time.sleep(0.2)  # the keeper is waiting for the first of them to run out
    export_id, slot = _leased_pin(0.05)
    try:
        assert _eventually(lambda: _revoked(slot))
        assert _keepalive._keeper is not None and _keepalive._keeper.is_alive()
        assert {p.export_id: p.revoked for p in _keepalive.pinned() if p.export_id in long_ids} == \
            {i: False for i in long_ids}
    finally:
        for i in (*long_ids, export_id):
            _keepalive.release(i)


@pytest.mark.parametrize("lease, error", [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                          ("5", TypeError), (True, TypeError), ([], TypeError)])
def test_a_lease_that_is_no_positive_number_is_refused(lease, error):
    from cupy_ipc._args import checked_lease

    with pytest.raises(error, match="lease must be"):
        checked_lease(lease)
    assert checked_lease(None) is None and checked_lease(2) == 2.0
    assert checked_lease(10**400) == math.inf  # past the largest float: longer than any wait, as inf is


def test_the_deadlines_of_pins_that_ended_early_do_not_pile_up():
    # A leased message that its consumer received in time ends its pin long before its lease: on a busy queue
    # the keeper's list of deadlines must not keep one per message.
    for _ in range(1000):
        export_id, _ = _leased_pin(600.0)
        _keepalive.release(export_id)
    assert len(_keepalive._leases) <= 2 * len(_keepalive._pins) + 64


def test_a_pin_whose_record_cannot_be_written_gives_its_slot_back(monkeypatch):
    # A segment that cannot grow to the slot (a full /dev/shm) fails the export: the slot goes to the next
    # one, which would otherwise need a still larger segment.
    from cupy_ipc import IpcError

    def full(self, slot, export_id, state):
        raise IpcError("cannot grow the segment")

    _keepalive.sweep()
    monkeypatch.setattr(_segment.Segment, "write", full)
    with pytest.raises(IpcError, match="cannot grow"):
        _keepalive.pin(None, (0, 64, 0), 0, 1, None, None, ((16,), "float32"))
    lost = _keepalive._free_slots[-1]
    monkeypatch.undo()
    export_id, slot = _leased_pin(60.0)
    assert slot == lost
    _keepalive.release(export_id)


def test_a_sweep_owed_after_a_send_that_fails_warns_and_stays_owed(monkeypatch):
    # The message has left: its sender must not see an error, and the pins wait for the next sweep.
    from cupy_ipc import IpcError

    def failing(seg):
        raise IpcError("the query failed")

    export_id, _ = _leased_pin(60.0)
    monkeypatch.setattr(_keepalive, "_sweep", failing)
    _keepalive._owed = True  # as an export of a message leaves it
    with pytest.warns(RuntimeWarning, match="could not end the pins .*the query failed"):
        _keepalive.sweep_owed()
    assert _keepalive._owed
    monkeypatch.undo()
    _keepalive.sweep_owed()  # owed still: swept now
    assert not _keepalive._owed
    _keepalive.release(export_id)


@pytest.mark.parametrize("how", ["release", "sweep", "the next pin's sweep"])
def test_what_an_ended_pin_kept_is_let_go_of_outside_the_registrys_lock(how):
    # An array opened here from another producer and sent on is pinned; the last reference to it runs its
    # release, which may unmap and wait for the GPU: that ran under the lock, so every export of the process,
    # and the lease thread, waited for it.
    held: list[bool] = []

    class Kept:
        def __del__(self) -> None:
            held.append(_keepalive._lock._is_owned())

    export_id, slot, *_ = _keepalive.pin(Kept(), (0, 64, 0), 0, 1, None, None, ((16,), "float32"))
    seg = _segment.own_segment(this_process().token)
    if how == "release":
        assert _keepalive.release(export_id)
    else:
        seg.write_opens(slot, 1)  # its one consumer opened it and is done
        if how == "sweep":
            assert _keepalive.sweep() >= 1
        else:
            nxt, *_ = _keepalive.pin(None, (0, 64, 0), 0, 1, None, None, ((16,), "float32"))
            _keepalive.release(nxt)
    assert held == [False] and export_id not in _keepalive._pins


def test_more_consumers_than_a_segment_counts_are_refused():
    import cupy_ipc

    with pytest.raises(ValueError, match="consumers must be at most 4294967295"):
        cupy_ipc.get_ipc_handle(object(), consumers=2**32)  # checked before the array


def test_a_revoke_that_fails_leaves_the_lease_keeper_serving_later_leases(monkeypatch):
    real, failed = _keepalive._revoke, []

    def revoke_once_failing(seg, p):
        if not failed:
            failed.append(p.export_id)
            raise OSError("the segment is gone")
        real(seg, p)

    monkeypatch.setattr(_keepalive, "_revoke", revoke_once_failing)
    end = time.monotonic() + 10  # for both waits
    first, _ = _leased_pin(0.02)
    _eventually(lambda: failed, end - time.monotonic())
    export_id, slot = _leased_pin(0.02)
    try:
        assert _eventually(lambda: _revoked(slot), end - time.monotonic())
        assert failed == [first]
    finally:
        for i in (first, export_id):
            _keepalive.release(i)


_SENDER_THAT_ENDS = """
import multiprocessing, sys
from cupy_ipc import _keepalive, _sent

def send_and_end():
    _sent.set_exit_wait(0.5)
    export_id, *_ = _keepalive.pin(None, (0, 64, 0), 0, 1, None, None, ((16,), "float32"))
    _sent.note(export_id)  # as a message carrying the array does; nobody receives it

if __name__ == "__main__":
    method, main_sent = sys.argv[1], sys.argv[2] == "1"
    if main_sent:
        _sent.note(1)  # the main process sent an array (it does not wait, and learns so) before the child starts
    p = multiprocessing.get_context(method).Process(target=send_and_end)
    p.start()
    p.join(60)
    print(p.exitcode)
"""


@pytest.mark.parametrize("method, main_sent", [("spawn", False), ("fork", False), ("forkserver", False),
                                               ("fork", True)])
def test_a_child_of_every_start_method_awaits_the_receivers_of_what_it_sent(tmp_path, method, main_sent):
    # A child started by fork or forkserver drops the multiprocessing finalizers it inherited (or registered
    # while its target was unpickled) before its target runs: the exit wait, registered at import, went with
    # them, and the child ended at once, taking the memory of the arrays it sent. A forked child also kept
    # its parent's finding that it was no child of multiprocessing.
    script = tmp_path / "sender.py"
    script.write_text(_SENDER_THAT_ENDS)
    r = subprocess.run([sys.executable, str(script), method, str(int(main_sent))], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "0", r.stderr
    assert "exits with 1 array(s) it sent that no receiver opened within 0.5 s" in r.stderr, r.stderr


_PARENT_SETS_THE_WAIT = """
import multiprocessing, sys, time
import cupy_ipc.multiprocessing as mp
from cupy_ipc import _keepalive, _sent

def send_and_end():
    export_id, *_ = _keepalive.pin(None, (0, 64, 0), 0, 1, None, None, ((16,), "float32"))
    _sent.note(export_id)  # as a message carrying the array does; nobody receives it

if __name__ == "__main__":
    method, wait = sys.argv[1], float(sys.argv[2])
    mp.set_exit_wait(wait)  # in the parent only
    p = mp.get_context(method).Process(target=send_and_end)
    start = time.monotonic()
    p.start()
    p.join(60)
    print(p.exitcode, time.monotonic() - start)
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
@pytest.mark.parametrize("wait", [0.5, 0.0])
def test_a_child_takes_the_exit_wait_its_parent_set_and_none_says_nothing(tmp_path, method, wait):
    # A spawned or forkserver child imports the library afresh: it waited the default 10 s whatever its parent
    # had set. And a wait of 0 ("no wait") still warned at every child's exit.
    script = tmp_path / "parent.py"
    script.write_text(_PARENT_SETS_THE_WAIT)
    r = subprocess.run([sys.executable, str(script), method, str(wait)], capture_output=True, text=True,
                       timeout=120)
    exitcode, seconds = r.stdout.split()
    assert r.returncode == 0 and exitcode == "0", r.stderr
    assert float(seconds) < 8, r.stderr  # not the default's 10 s
    assert ("exits with 1 array(s) it sent that no receiver opened" in r.stderr) == bool(wait), r.stderr
    assert not wait or "within 0.5 s" in r.stderr, r.stderr


def test_a_lease_thread_that_cannot_start_leaves_no_pin_and_is_started_by_a_later_lease():
    # Thread creation can fail (a container's pids limit): "can't start new thread". The export that wanted the
    # keeper must then fail leaving nothing pinned, and a later lease must still get a keeper that revokes it.
    done = _run("""
        import threading, time
        from cupy_ipc import _keepalive, _segment
        from cupy_ipc._identity import this_process

        real = threading.Thread.start
        def no_thread(self):
            raise RuntimeError("can't start new thread")
        threading.Thread.start = no_thread
        try:
            _keepalive.pin(None, (0, 64, 0), 0, 1, 60.0, None, ((16,), "float32"))
            print("exported")
        except RuntimeError:
            print("refused")
        finally:
            threading.Thread.start = real
        print(len(_keepalive._pins))
        export_id, slot, *_ = _keepalive.pin(None, (0, 64, 0), 0, 1, 0.05, None, ((16,), "float32"))
        seg = _segment.own_segment(this_process().token)
        end = time.monotonic() + 10
        while time.monotonic() < end and seg.read(slot)[2] & _segment.STATE != _segment.REVOKED:
            time.sleep(0.01)
        print(seg.read(slot)[2] & _segment.STATE == _segment.REVOKED)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["refused", "0", "True"], (done.stdout, done.stderr)
