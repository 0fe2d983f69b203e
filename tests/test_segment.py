"""The shared lock segment, with real processes: liveness and in-use locks survive only their holder."""

from __future__ import annotations

import errno
import fcntl
import gc
import multiprocessing
import os
import secrets
import signal
import struct
import subprocess
import sys
import time
import types

import pytest

from cupy_ipc import IpcError, ProducerExitedError, _segment
from cupy_ipc._segment import (
    ALIVE,
    FREE,
    ONE_CONSUMER,
    PINNED,
    READ,
    REVOKED,
    WRITE,
    Segment,
    in_use,
    mutex,
    segment_path,
)

pytestmark = pytest.mark.skipif(not hasattr(fcntl, "F_OFD_SETLK"), reason="needs Linux open-file-description locks")

CTX = multiprocessing.get_context("spawn")
START_TIMEOUT = 60  # a spawned child imports cupy_ipc and numpy first
JOIN_TIMEOUT = 30


def claim(seg: Segment, slot: int, export_id: int) -> bool:
    """A consumer's open that succeeds, on ``seg``: hold the slot's in-use lock, then count the open; False,
    holding nothing, if the slot no longer shares ``export_id``."""
    if not seg.hold(slot, export_id):
        return False
    seg.count_open(slot)
    return True


# --- workers (module level, so that spawn can import them) ------------------------------------
def _idle_until_orphaned(limit=120.0):
    # Never outlive the test run: stop when the parent is gone or after ``limit`` seconds.
    parent, end = os.getppid(), time.monotonic() + limit
    while os.getppid() == parent and time.monotonic() < end:
        time.sleep(0.05)


def _create_and_hold(token, ready):
    seg = Segment.create(token)  # noqa: F841 - held: a segment no longer referenced closes, dropping its locks
    ready.set()
    _idle_until_orphaned()


def _attach_and_hold_in_use(token, parent_pid, slot, ready):
    seg = Segment.attach(token, pid=parent_pid)
    assert seg.lock(in_use(slot), READ, wait=False)
    ready.set()
    _idle_until_orphaned()


def _make_own_segment(token):
    _segment.own_segment(token)


def _attach_and_write(token, parent_pid, slot, export_id, state, opens):
    seg = Segment.attach(token, pid=parent_pid)
    seg.write(slot, export_id, state, opens)
    seg.close()


def _claim_in_turns(token, parent_pid, slot, export_id, times, go, ready):
    seg = Segment.attach(token, pid=parent_pid)
    ready.set()
    go.wait(START_TIMEOUT)
    for _ in range(times):
        assert claim(seg, slot, export_id)
        seg.unlock(in_use(slot))
    seg.close()


# --- helpers ----------------------------------------------------------------------------------
@pytest.fixture
def token():
    token = secrets.token_bytes(16)
    yield token
    # A child killed with SIGKILL leaves its segment file behind.
    stale = _segment._attached.pop(token, None)
    if stale is not None:
        stale.close()
    try:
        os.unlink(segment_path(token))
    except FileNotFoundError:
        pass


@pytest.fixture
def start():
    """Start a spawned process running ``target`` and wait until it sets its ready event; kill survivors."""
    procs = []

    def start(target, *args, ready=True):
        event = CTX.Event() if ready else None
        p = CTX.Process(target=target, args=(*args, event) if ready else args, daemon=True)
        procs.append(p)
        p.start()
        if ready:
            assert event.wait(START_TIMEOUT), f"child {p.pid} did not become ready"
        return p

    yield start
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(JOIN_TIMEOUT)


def kill(p):
    os.kill(p.pid, signal.SIGKILL)
    p.join(JOIN_TIMEOUT)
    assert p.exitcode == -signal.SIGKILL


# --- liveness -----------------------------------------------------------------------------------
def test_segment_of_live_child_is_alive_and_dead_after_sigkill(token, start):
    p = start(_create_and_hold, token)
    seg = Segment.attach(token, pid=p.pid)
    try:
        assert seg.producer_alive()
        assert seg.held_by_other(ALIVE)
        kill(p)
        # The kernel dropped the child's lock with its last file descriptor: no grace period.
        assert not seg.producer_alive()
        assert not seg.held_by_other(ALIVE)
    finally:
        seg.close()


def test_module_attach_raises_and_removes_stale_file_after_sigkill(token, start):
    p = start(_create_and_hold, token)
    seg = _segment.attach(token, p.pid)
    assert seg.producer_alive()
    assert _segment.attach(token, p.pid) is seg  # opened once per process
    kill(p)
    with pytest.raises(ProducerExitedError) as info:
        _segment.attach(token, p.pid)
    assert info.value.pid == p.pid
    assert str(p.pid) in str(info.value)
    assert not os.path.exists(segment_path(token))
    assert token not in _segment._attached
    # With the file gone, even opening it says the producer exited.
    with pytest.raises(ProducerExitedError) as info:
        Segment.attach(token, pid=p.pid)
    assert info.value.pid == p.pid


def test_what_is_kept_of_a_producer_is_let_go_when_it_is_found_exited(token, start, monkeypatch):
    # The ordering events opened from a producer's handles are kept for its later messages: once an open
    # finds it gone, the tables that keep things of it are told (a failing one does not stop the others).
    told = []

    def fails(gone):
        raise RuntimeError("boom")

    monkeypatch.setattr(_segment, "_on_exit", [])
    _segment.when_exited(fails)
    _segment.when_exited(told.append)
    p = start(_create_and_hold, token)
    _segment.attach(token, p.pid)
    assert told == []
    kill(p)
    with pytest.warns(RuntimeWarning, match="exited producer: boom"), pytest.raises(ProducerExitedError):
        _segment.attach(token, p.pid)
    assert told == [token]


def test_segments_of_producers_killed_unseen_are_removed_by_the_next_producer(token, start):
    # Producer and consumers all killed (a job cancelled): nobody was left to find the producer gone, and its
    # file stayed in /dev/shm for good. The next process to export removes it.
    p = start(_create_and_hold, token)
    kill(p)
    assert os.path.exists(segment_path(token))
    q = start(_make_own_segment, secrets.token_bytes(16), ready=False)
    q.join(JOIN_TIMEOUT)
    assert q.exitcode == 0
    assert not os.path.exists(segment_path(token))


def test_only_segments_nobody_holds_alive_are_removed_as_stale(token):
    live = Segment.create(token)
    dead_token = secrets.token_bytes(16)
    Segment.create(dead_token).close()  # its producer "died": the file stays, unlocked
    other = segment_path(secrets.token_bytes(16)) + "-not-a-segment"
    with open(other, "w"):
        pass
    try:
        assert _segment.remove_stale() >= 1
        assert not os.path.exists(segment_path(dead_token))
        assert os.path.exists(segment_path(token)) and os.path.exists(other)
        assert Segment.attach(token, pid=os.getpid()).producer_alive()
    finally:
        live.close(unlink=True)
        os.unlink(other)


def test_a_segment_left_half_set_up_is_removed_once_it_is_old(tmp_path, monkeypatch):
    # A producer killed while it set its segment up left the file under the name it is set up under, which
    # nothing removed. Unlocked only for microseconds in a live producer, it goes once unlocked and old.
    monkeypatch.setattr(_segment, "_dir", lambda: str(tmp_path))

    def setting_up(age):
        path = segment_path(secrets.token_bytes(16)) + _segment._NEW
        with open(path, "w"):
            pass
        os.utime(path, (time.time() - age,) * 2)
        return path

    killed, fresh, locked = setting_up(3600), setting_up(0), setting_up(3600)
    other = str(tmp_path / f"{_segment._PREFIX}notes{_segment._NEW}")  # not a segment's name
    with open(other, "w"):
        pass
    os.utime(other, (time.time() - 3600,) * 2)
    holder = Segment(os.open(locked, os.O_RDWR | os.O_CLOEXEC), secrets.token_bytes(16), locked, owner=True)
    dead_token = secrets.token_bytes(16)
    Segment.create(dead_token).close()  # a segment's own name: removed whatever its age
    try:
        assert holder.lock(ALIVE, READ)  # a live producer's, setting it up
        assert _segment.remove_stale() == 2
        assert not os.path.exists(killed) and not os.path.exists(segment_path(dead_token))
        assert os.path.exists(fresh) and os.path.exists(locked) and os.path.exists(other)
    finally:
        holder.close()


def test_a_segment_being_set_up_is_never_taken_for_a_stale_one(token, monkeypatch):
    # Between the file's creation and its lock of liveness, another producer's look for stale segments would
    # have removed it, and this producer's consumers would have found it gone: it gets its name only once
    # locked.
    real_lock = Segment.lock

    def lock(self, offset, kind, **kwargs):
        if offset == ALIVE:
            _segment.remove_stale()
        return real_lock(self, offset, kind, **kwargs)

    monkeypatch.setattr(Segment, "lock", lock)
    seg = Segment.create(token)
    try:
        assert Segment.attach(token, pid=os.getpid()).producer_alive()
        assert not os.path.exists(segment_path(token) + _segment._NEW)
    finally:
        seg.close(unlink=True)


def test_a_fifo_under_a_segments_name_does_not_hang_the_look_for_stale_segments(tmp_path, monkeypatch):
    # Any user can make a FIFO in /dev/shm: opened to be read, it blocks until someone writes to it, and
    # every process of the host stopped at its first export (holding the lock that other threads' wait for).
    import threading

    monkeypatch.setattr(_segment, "_dir", lambda: str(tmp_path))
    fifo = segment_path(secrets.token_bytes(16))
    os.mkfifo(fifo)
    dead_token = secrets.token_bytes(16)
    Segment.create(dead_token).close()  # a stale segment beside it: still removed
    done = []
    t = threading.Thread(target=lambda: done.append(_segment.remove_stale()), daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # let the stuck open go: a writer's open ends a reader's wait
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
    assert done == [1], "the look for stale segments hung on a FIFO"
    assert not os.path.exists(segment_path(dead_token))


def test_a_link_under_a_segments_name_is_not_followed(token, tmp_path):
    # Anyone may make a link in /dev/shm under the name of a producer that has exited: the consumer that opens
    # its stale handle must not map (and count in) the file it points to.
    victim = tmp_path / "victim"
    victim.write_bytes(bytes(4096))
    os.symlink(victim, segment_path(token))
    try:
        with pytest.raises(IpcError, match="cannot open the segment of the producer process"):
            Segment.attach(token, pid=4321)
    finally:
        os.unlink(segment_path(token))
    assert victim.read_bytes() == bytes(4096)


def test_attach_to_missing_segment_raises_producer_exited(token):
    with pytest.raises(ProducerExitedError, match="pid 4321") as info:
        Segment.attach(token, pid=4321)
    assert info.value.pid == 4321


def test_own_segment_is_alive_to_another_opener(token):
    seg = Segment.create(token)
    try:
        other = Segment.attach(token, pid=os.getpid())
        try:
            assert other.producer_alive()
            # The creator's own lock does not conflict with itself.
            assert not seg.held_by_other(ALIVE)
        finally:
            other.close()
    finally:
        seg.close(unlink=True)
    assert not os.path.exists(segment_path(token))


def test_create_refuses_an_existing_segment(token):
    seg = Segment.create(token)
    try:
        with pytest.raises(IpcError, match="cannot create the segment .*File exists"):
            Segment.create(token)
    finally:
        seg.close(unlink=True)


def test_a_segment_that_cannot_be_set_up_leaves_no_file(token, monkeypatch):
    # Left there, the file made every later export of the process fail: its segment already existed.
    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(IpcError, match="No space left on device"):
        Segment.create(token)
    assert not os.path.exists(segment_path(token))
    monkeypatch.undo()
    Segment.create(token).close(unlink=True)  # /dev/shm has room again: the process exports as before


def test_close_is_idempotent(token):
    seg = Segment.create(token)
    seg.close(unlink=True)
    seg.close(unlink=True)
    assert seg.fd == -1


# --- in-use locks ----------------------------------------------------------------------------------
def test_in_use_lock_of_child_blocks_write_until_sigkill(token, start):
    seg = Segment.create(token)
    try:
        p = start(_attach_and_hold_in_use, token, os.getpid(), 3)
        assert seg.held_by_other(in_use(3))
        assert seg.lock(in_use(3), WRITE, wait=False) is False
        # Only that slot: its neighbours and the slot's mutex are free.
        for offset in (in_use(2), in_use(4), mutex(3)):
            assert not seg.held_by_other(offset)
            assert seg.lock(offset, WRITE, wait=False) is True
            seg.unlock(offset)
        # A read lock is shared, so another consumer could still open the slot.
        assert seg.lock(in_use(3), READ, wait=False) is True
        seg.unlock(in_use(3))
        kill(p)
        assert not seg.held_by_other(in_use(3))
        assert seg.lock(in_use(3), WRITE, wait=False) is True
        seg.unlock(in_use(3))
    finally:
        seg.close(unlink=True)


def test_write_lock_conflicts_between_two_opens_in_one_process(token):
    """The locks belong to open file descriptions, not processes: two opens conflict even in one process."""
    seg = Segment.create(token)
    other = Segment.attach(token, pid=os.getpid())
    try:
        assert other.lock(mutex(0), WRITE, wait=False)
        assert seg.held_by_other(mutex(0))
        assert not seg.lock(mutex(0), WRITE, wait=False)
        assert not seg.lock(mutex(0), READ, wait=False)
        other.unlock(mutex(0))
        assert not seg.held_by_other(mutex(0))
        assert seg.lock(mutex(0), WRITE, wait=False)
        seg.unlock(mutex(0))
    finally:
        other.close()
        seg.close(unlink=True)


def test_lock_offsets_are_distinct():
    offsets = [ALIVE] + [f(slot) for slot in range(100) for f in (in_use, mutex)]
    assert len(set(offsets)) == len(offsets)


# --- records -------------------------------------------------------------------------------------------
def test_record_round_trip(token):
    seg = Segment.create(token)
    try:
        assert seg.read(0) == (0, 0, FREE)  # nothing written yet: past the end of the file
        seg.write(0, 7, PINNED)
        seg.write(5, 2**64 - 1, REVOKED, opens=2**32 - 1)
        seg.write(2, 11, PINNED, opens=3)
        assert seg.read(0) == (7, 0, PINNED)
        assert seg.read(5) == (2**64 - 1, 2**32 - 1, REVOKED)
        assert seg.read(2) == (11, 3, PINNED)
        assert seg.read(1) == (0, 0, FREE)  # a hole before a written slot reads as zeros
        assert seg.read(6) == (0, 0, FREE)
        seg.write(5, 8, FREE, opens=1)
        assert seg.read(5) == (8, 1, FREE)
        assert seg.read(2) == (11, 3, PINNED)  # neighbours untouched
    finally:
        seg.close(unlink=True)


def test_record_written_by_child_is_read_by_parent(token, start):
    seg = Segment.create(token)
    try:
        p = start(_attach_and_write, token, os.getpid(), 9, 123456789, PINNED, 4, ready=False)
        p.join(JOIN_TIMEOUT)
        assert p.exitcode == 0
        assert seg.read(9) == (123456789, 4, PINNED)
        assert seg.read(8) == (0, 0, FREE)
    finally:
        seg.close(unlink=True)


def test_records_beyond_the_first_mapping_are_shared():
    """The producer's mapped view grows; another open file reads the same records."""
    token = secrets.token_bytes(16)
    seg = Segment.create(token)
    try:
        for slot in (0, 1023, 1024, 5000):
            seg.write(slot, slot + 1, PINNED, opens=slot % 7)
        other = Segment.attach(token, pid=os.getpid())
        try:
            for slot in (0, 1023, 1024, 5000):
                assert other.read(slot) == (slot + 1, slot % 7, PINNED)
            other.write(5000, 5001, PINNED, opens=3)
            assert seg.read(5000) == (5001, 3, PINNED)
            assert (seg.opens(0), seg.opens(5000)) == (0, 3)
        finally:
            other.close()
    finally:
        seg.close(unlink=True)


def _no_map(*args):
    raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))


def test_a_view_that_cannot_be_remapped_leaves_the_segment_usable(token, monkeypatch):
    # Growing the file remaps it; a map that fails then (no memory, or the process's limit of maps) must not
    # leave a closed view behind, or every later export and open of this producer would fail. The export
    # that failed is told so as an IpcError, not the OSError of the map.
    seg = Segment.create(token)
    try:
        seg.write(0, 7, PINNED)
        monkeypatch.setattr(_segment, "mmap", types.SimpleNamespace(mmap=_no_map))
        with pytest.raises(IpcError, match=f"cannot remap the segment {seg.path}: Cannot allocate memory"):
            seg.write(5000, 9, PINNED)  # past the first mapping: the file grows, the view is remapped
        monkeypatch.undo()
        assert seg.read(0) == (7, 0, PINNED)
        seg.write(5000, 9, PINNED)
        assert seg.read(5000) == (9, 0, PINNED)
    finally:
        seg.close(unlink=True)


def test_a_fork_leaves_the_child_no_view_of_a_segments_words(token):
    # A producer's words, mapped apart from its records (``_words``), kept a descriptor of their own (mmap's
    # copy) in a forked child: the parent's liveness lock outlived its death as long as the child lived, and
    # consumers' waits for its words were never released.
    import mmap

    from cupy_ipc import _words

    producer = Segment.create(token)
    try:
        # As _words._register maps them; held elsewhere too, as an exported event's pair of words holds them.
        words = producer.words = _words.Words(mmap.mmap(producer.fd, _words.BYTES), 0, 0)
        said = _forked_copies(segment_path(token))
    finally:
        words.mm.close()
        producer.words = None
        producer.close(unlink=True)
    assert said == "0,0"


@pytest.mark.parametrize("consumers_flag", [ONE_CONSUMER, 0], ids=["one consumer", "several consumers"])
def test_a_claim_whose_view_cannot_be_remapped_holds_and_counts_nothing(token, monkeypatch, consumers_flag):
    # An export in a slot the producer grew its file for after the consumer mapped it: the consumer's view is
    # remapped to reach it. Failed, the open is told so as an IpcError (the OSError of the map escaped the
    # library), holding no lock and counting nothing, and may be retried.
    producer = Segment.create(token)
    consumer = Segment.attach(token, pid=os.getpid())
    try:
        producer.write(5000, 9, PINNED | consumers_flag)
        monkeypatch.setattr(_segment, "mmap", types.SimpleNamespace(mmap=_no_map))
        with pytest.raises(IpcError, match="cannot remap the segment .*Cannot allocate memory"):
            claim(consumer, 5000, 9)
        assert (producer.opens(5000), producer.held_by_other(in_use(5000))) == (0, False)
        monkeypatch.undo()
        assert claim(consumer, 5000, 9)  # the retry
        assert (producer.opens(5000), producer.held_by_other(in_use(5000))) == (1, True)
        consumer.unlock(in_use(5000))
    finally:
        consumer.close()
        producer.close(unlink=True)


def test_a_view_whose_size_cannot_be_read_raises_ipc_error(token, monkeypatch):
    # The file's size is read before its view is remapped: failed, that is told as an IpcError too.
    producer = Segment.create(token)
    consumer = Segment.attach(token, pid=os.getpid())
    try:
        producer.write(5000, 9, PINNED)

        def no_stat(fd):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(os, "fstat", no_stat)
        with pytest.raises(IpcError, match="cannot remap the segment .*Input/output error"):
            consumer.read(5000)
        monkeypatch.undo()
        assert consumer.read(5000) == (9, 0, PINNED)
    finally:
        consumer.close()
        producer.close(unlink=True)


# --- the claim and free protocol -------------------------------------------------------------------
@pytest.mark.parametrize("consumers_flag", [ONE_CONSUMER, 0], ids=["one consumer", "several consumers"])
def test_a_held_claim_keeps_the_slot_and_a_free_slot_refuses_claims(token, consumers_flag):
    producer = Segment.create(token)
    consumer = Segment.attach(token, pid=os.getpid())  # another open file: its locks are separate
    try:
        producer.write(4, 77, PINNED | consumers_flag)
        assert claim(consumer, 4, 77)
        assert producer.opens(4) == 1
        assert consumer.held_by_other(ALIVE) and producer.held_by_other(in_use(4))
        assert not producer.try_free(4)  # held: marked, not freed
        assert producer.read(4) == (77, 1, REVOKED)
        late = Segment.attach(token, pid=os.getpid())
        assert not claim(late, 4, 77)  # a late consumer is refused
        late.close()
        consumer.unlock(in_use(4))
        assert producer.try_free(4)
        assert producer.read(4) == (0, 0, FREE)
        assert not claim(consumer, 4, 77)
        assert not producer.held_by_other(in_use(4))  # a refused claim holds nothing
    finally:
        consumer.close()
        producer.close(unlink=True)


@pytest.mark.parametrize("consumers_flag", [ONE_CONSUMER, 0], ids=["one consumer", "several consumers"])
def test_a_held_slot_counts_no_open_until_the_open_is_counted(token, consumers_flag):
    """An open holds the slot from its claim on, but is counted only once it has succeeded: one that fails drops
    its lock and leaves the export as it found it, for a retry."""
    producer = Segment.create(token)
    consumer = Segment.attach(token, pid=os.getpid())
    try:
        producer.write(4, 77, PINNED | consumers_flag)
        assert consumer.hold(4, 77)
        assert producer.opens(4) == 0 and producer.held_by_other(in_use(4))
        consumer.unlock(in_use(4))  # the open failed
        assert producer.read(4) == (77, 0, PINNED | consumers_flag) and not producer.held_by_other(in_use(4))
        assert consumer.hold(4, 77)  # the retry
        producer.write_state(4, REVOKED)  # revoked meanwhile: the open holds the slot, so it still counts
        consumer.count_open(4)
        assert producer.read(4) == (77, 1, REVOKED)
        assert not producer.try_free(4)
        consumer.unlock(in_use(4))
        assert producer.try_free(4)
    finally:
        consumer.close()
        producer.close(unlink=True)


def test_a_claim_names_its_export(token):
    """A slot freed and given to another export refuses the old export's handle, and holds nothing."""
    producer = Segment.create(token)
    consumer = Segment.attach(token, pid=os.getpid())
    try:
        producer.write(0, 5, PINNED | ONE_CONSUMER)
        assert not claim(consumer, 0, 4)
        assert not claim(consumer, 1, 5)  # a slot never written
        assert not producer.held_by_other(in_use(0))
        assert producer.try_free(0)
    finally:
        consumer.close()
        producer.close(unlink=True)


def test_the_producer_frees_a_slot_once_its_last_holder_is_killed(token, start):
    producer = Segment.create(token)
    try:
        producer.write(3, 9, PINNED | ONE_CONSUMER)
        p = start(_attach_and_hold_in_use, token, os.getpid(), 3)
        assert not producer.try_free(3)
        kill(p)
        assert producer.try_free(3)
    finally:
        producer.close(unlink=True)


def test_opens_of_an_export_for_several_consumers_are_counted_exactly(token, start):
    """Four processes claim one slot 200 times each at once: no open is lost (the count goes through the mutex)."""
    producer = Segment.create(token)
    try:
        producer.write(2, 1, PINNED)
        go = CTX.Event()
        procs = [start(_claim_in_turns, token, os.getpid(), 2, 1, 200, go) for _ in range(4)]  # all wait for go
        go.set()
        for p in procs:
            p.join(JOIN_TIMEOUT)
            assert p.exitcode == 0
        assert producer.read(2) == (1, 800, PINNED)
    finally:
        producer.close(unlink=True)


@pytest.mark.parametrize("consumers_flag", [0, ONE_CONSUMER], ids=["several consumers", "one consumer"])
def test_only_an_export_for_several_consumers_counts_under_the_mutex(token, consumers_flag):
    """With another consumer on the slot, a claim of a several-consumer export waits for the slot's mutex; one
    of a single-consumer export does not take it."""
    import threading

    producer = Segment.create(token)
    first, second, holder = (Segment.attach(token, pid=os.getpid()) for _ in range(3))
    try:
        producer.write(6, 3, PINNED | consumers_flag)
        assert claim(first, 6, 3)
        assert holder.lock(mutex(6), WRITE, wait=False)
        done = threading.Event()
        t = threading.Thread(target=lambda: done.set() if claim(second, 6, 3) else None, daemon=True)
        t.start()
        if consumers_flag:
            assert done.wait(5)
        else:
            assert not done.wait(0.3)  # waits for the mutex
            holder.unlock(mutex(6))
            assert done.wait(5)
        t.join(5)
        assert producer.opens(6) == 2
    finally:
        for seg in (first, second, holder):
            seg.close()
        producer.close(unlink=True)


def test_idle_mappings_of_a_producer_that_has_gone_are_dropped_before_an_import(token, start, monkeypatch):
    # The consumer's table with real producer segments: before each import, the idle mappings of
    # producers that have exited are let go (they can never be opened again), the others stay; and the
    # other tables are told of the exit (its cached events go), as when an open finds a producer gone.
    import collections

    from cupy_ipc import _mapping

    other = secrets.token_bytes(16)
    gone, alive = start(_create_and_hold, token), start(_create_and_hold, other)
    told = []
    monkeypatch.setattr(_segment, "_on_exit", [told.append])
    segs = {token: _segment.attach(token, gone.pid), other: _segment.attach(other, alive.pid)}
    discarded = []
    monkeypatch.setattr(_mapping, "_idle", collections.OrderedDict())
    monkeypatch.setattr(_mapping, "_discard", lambda m: discarded.append(m.ptr))  # (unmapping needs a GPU)
    for ptr, t in ((1, token), (2, other), (3, token)):
        m = _mapping._Mapping(ptr, 0, imported=True)
        m.seg = segs[t]
        _mapping._idle[("key", ptr)] = m
    try:
        with _mapping._lock:
            _mapping._drop_idle_of_exited()
        assert discarded == [] and len(_mapping._idle) == 3 and told == []
        kill(gone)
        with _mapping._lock:
            _mapping._drop_idle_of_exited()
        assert discarded == [1, 3] and list(_mapping._idle) == [("key", 2)]
        assert told == [token] and token not in _segment._attached and other in _segment._attached
    finally:
        for t, seg in segs.items():
            _segment._attached.pop(t, None)
            seg.close()
        alive.kill()
        alive.join(JOIN_TIMEOUT)
        os.unlink(segment_path(other))


def test_collect_forgets_the_producer_of_an_unused_pool_that_has_exited(token, start, monkeypatch):
    # collect() lets go of every unused imported pool, of live producers too; one whose producer has exited
    # also takes the producer's segment out of the table (its descriptor closes) and tells the other tables
    # (its cached events go), as an open that finds the producer gone does. Before, its segment stayed open.
    import cupy_ipc
    from cupy_ipc import _pools

    gone = start(_create_and_hold, token)
    told = []
    monkeypatch.setattr(_segment, "_on_exit", [told.append])
    _segment.attach(token, gone.pid)
    released = []
    monkeypatch.setattr(_pools, "_imports", {(token, 7): ("pool", -1, gone.pid)})
    monkeypatch.setattr(_pools, "_release", lambda exited, fds: released.extend(k for k, _ in exited) or 0)
    kill(gone)
    cupy_ipc.collect()
    assert released == [(token, 7)] and told == [token] and token not in _segment._attached


_EXITING_PRODUCER = """
import multiprocessing, multiprocessing.util, os, sys, time  # (its exit function registered first)
from cupy_ipc import _segment
from cupy_ipc._identity import this_process

def consumer(token, pid):
    time.sleep(1.0)  # still at work when the producer's script has ended
    from cupy_ipc import _segment
    try:
        _segment.attach(token, pid)
        print("producer alive", flush=True)
    except Exception as e:
        print(type(e).__name__, e, flush=True)

def child_producer(out):
    out.put(_segment.own_segment(this_process().token).path)

if __name__ == "__main__":
    method = sys.argv[1]
    ctx = multiprocessing.get_context(method)
    seg = _segment.own_segment(this_process().token)
    print(seg.path, flush=True)
    out = ctx.Queue()
    child = ctx.Process(target=child_producer, args=(out,))
    child.start()
    print(out.get(timeout=60), flush=True)
    child.join(60)
    ctx.Process(target=consumer, args=(this_process().token, os.getpid())).start()
    # no join: multiprocessing joins the consumer at exit
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_a_producer_stays_alive_while_it_waits_for_its_children_at_exit(tmp_path, method):
    # At exit, multiprocessing joins the children (and the queues' feeder threads, which may still send
    # arrays) only after atexit's later functions: the segment, removed by one of those, told a consumer still
    # at work that its producer had exited. Its children, which end without atexit's functions, left theirs.
    script = tmp_path / "producer.py"
    script.write_text(_EXITING_PRODUCER)
    r = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    own, child, verdict = r.stdout.split("\n")[:3]
    assert verdict == "producer alive"
    assert not os.path.exists(own) and not os.path.exists(child)  # removed at exit all the same


def test_an_export_after_the_segment_was_removed_at_exit_is_refused(token, monkeypatch):
    seg = Segment.create(token)
    monkeypatch.setattr(_segment, "_own", seg)
    seg.close(unlink=True)  # as at exit
    with pytest.raises(IpcError, match="this process is exiting"):
        _segment.own_segment(token)


def test_a_segment_that_cannot_be_opened_for_lack_of_descriptors_raises_ipc_error(token):
    import resource

    seg = Segment.create(token)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    spare = []
    gc.collect()  # no earlier test's segment left to close its descriptor while the table is full
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        try:
            while True:
                spare.append(os.dup(0))
        except OSError:
            pass
        with pytest.raises(IpcError, match="cannot open the segment .*Too many open files"):
            Segment.attach(token, pid=os.getpid())
    finally:
        for fd in spare:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        seg.close(unlink=True)


def test_a_fork_while_the_segment_is_created_leaves_the_child_none_of_it(token, monkeypatch):
    # The child of a fork made mid-creation kept the new segment's descriptor, whose lock of liveness then
    # made this process look alive to its consumers after its death, for as long as the child lived.
    import threading

    monkeypatch.setattr(_segment, "_own", None)
    slow_grow = Segment._grow
    started = threading.Event()

    def grow(self, size):
        started.set()
        time.sleep(0.5)
        slow_grow(self, size)

    monkeypatch.setattr(Segment, "_grow", grow)
    maker = threading.Thread(target=_segment.own_segment, args=(token,))
    maker.start()
    started.wait(30)
    path = segment_path(token)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        # (Under either of its names: it is set up under another and then given its own.)
        held = [fd for fd in os.listdir("/proc/self/fd")
                if os.path.realpath(f"/proc/self/fd/{fd}") in (path, path + _segment._NEW)]
        os.write(w, str(len(held)).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    said = os.read(r, 100).decode()
    os.close(r)
    maker.join(30)
    _segment._own.close(unlink=True)
    assert said == "0"


def _forked_copies(path: str) -> str:
    """Fork; the child says how many descriptors and views of the file at ``path`` it has (``"descriptors,views"``).

    Told by the file's inode: a producer's own descriptors name it by the name it was made under (see
    :meth:`Segment.create`), which it no longer has."""
    file = os.stat(path)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        held = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                st = os.fstat(int(fd))
            except OSError:  # (the listing's own descriptor)
                continue
            held += (st.st_dev, st.st_ino) == (file.st_dev, file.st_ino)
        with open("/proc/self/maps") as maps:
            views = sum(len(f) > 5 and f[4] == str(file.st_ino) and f[5].startswith("/dev/shm/")
                        for f in map(str.split, maps))
        os.write(w, f"{held},{views}".encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    said = os.read(r, 100).decode()
    os.close(r)
    return said


@pytest.mark.parametrize("when", ["before its view", "after its view"])
def test_a_fork_while_another_process_segment_is_opened_leaves_the_child_none_of_it(token, when, monkeypatch):
    # The child kept the descriptor (or the view, which keeps the open file too) of a segment being opened by
    # another thread: the in-use locks this process then took outlived its death, pinning the producer's
    # memory for as long as the child lived.
    import threading

    producer = Segment.create(token)
    remap = Segment._remap
    started = threading.Event()

    def slow_remap(self):
        if when == "after its view":
            remap(self)
        if not self.owner:
            started.set()
            time.sleep(0.5)
        if when == "before its view":
            remap(self)

    monkeypatch.setattr(Segment, "_remap", slow_remap)
    opener = threading.Thread(target=_segment.attach, args=(token, os.getpid()))
    opener.start()
    started.wait(30)
    said = _forked_copies(segment_path(token))
    opener.join(30)
    _segment._attached.pop(token).close()
    producer.close(unlink=True)
    assert said == "0,0"


def test_a_fork_leaves_the_child_no_view_of_a_segment_dropped_from_the_tables(token):
    # A producer found exited is dropped from the table while claims still use its segment.
    producer = Segment.create(token)
    consumer = Segment.attach(token, pid=os.getpid())
    try:
        said = _forked_copies(segment_path(token))
    finally:
        consumer.close()
        producer.close(unlink=True)
    assert said == "0,0"


@pytest.mark.parametrize("consumers_flag", [ONE_CONSUMER, 0], ids=["one consumer", "several consumers"])
def test_the_count_of_opens_stops_at_its_largest_value(token, consumers_flag):
    # Reopens count too: a count at the top of its u32 raised struct.error on every later open of the export.
    producer = Segment.create(token)
    consumer = Segment.attach(token, pid=os.getpid())
    try:
        producer.write(2, 9, PINNED | consumers_flag)
        producer.write_opens(2, _segment.MAX_OPENS)
        assert consumer.hold(2, 9)
        consumer.count_open(2)
        assert producer.opens(2) == _segment.MAX_OPENS
        consumer.unlock(in_use(2))
    finally:
        consumer.close()
        producer.close(unlink=True)


def test_an_interrupt_just_as_the_count_of_opens_takes_the_mutex_leaves_it_free(token, monkeypatch):
    # Ctrl-C that arrives while the mutex's lock call returns is raised at that call, once the lock is taken (as
    # hold()'s notes say of its own lock): the mutex stayed held by this process's open file, and every other
    # consumer of the slot waited for it for ever in its count of opens, holding its library's lock.
    producer = Segment.create(token)
    consumer, other = Segment.attach(token, pid=os.getpid()), Segment.attach(token, pid=os.getpid())
    try:
        producer.write(4, 11, PINNED)  # an export for several consumers: counted under the mutex
        assert consumer.hold(4, 11)
        real = fcntl.fcntl

        def signalled_on_return(fd, cmd, arg=0):
            got = real(fd, cmd, arg)
            if cmd == fcntl.F_OFD_SETLKW and _segment._FLOCK.unpack(arg)[2] == mutex(4):
                raise KeyboardInterrupt  # the handler of a signal that came during the call
            return got

        monkeypatch.setattr(fcntl, "fcntl", signalled_on_return)
        with pytest.raises(KeyboardInterrupt):
            consumer.count_open(4)
        monkeypatch.undo()
        assert other.lock(mutex(4), WRITE, wait=False), "the interrupted count left the slot's mutex held"
        other.unlock(mutex(4))
        consumer.unlock(in_use(4))
    finally:
        consumer.close()
        other.close()
        producer.close(unlink=True)


def test_a_segment_set_up_interrupted_just_as_it_takes_its_name_leaves_no_file(token, monkeypatch):
    # Ctrl-C that arrives during the link that gives the segment its name is raised at that call, once the link
    # is made: the file stayed under the segment's name, unlocked, and the process (whose token is for life)
    # could never make its segment again: every later export failed with "File exists".
    real = os.link

    def signalled_on_return(src, dst, *args, **kwargs):
        real(src, dst, *args, **kwargs)
        raise KeyboardInterrupt  # the handler of a signal that came during the call

    monkeypatch.setattr(os, "link", signalled_on_return)
    with pytest.raises(KeyboardInterrupt):
        Segment.create(token)
    monkeypatch.undo()
    assert not os.path.exists(segment_path(token))
    assert not os.path.exists(segment_path(token) + _segment._NEW)
    Segment.create(token).close(unlink=True)  # the next export makes it as before


class _RecordReadPreempted:
    """``_segment._RECORD``, read field by field in the order ``struct`` reads them, with the reading thread
    "preempted" once after the export id: there ``while_preempted`` runs. Writes, and the other reads, pass."""

    def __init__(self, real, view, while_preempted):
        self.real, self.view, self.while_preempted = real, view, while_preempted
        self.size = real.size

    def unpack_from(self, buf, offset=0):
        if buf is not self.view() or self.while_preempted is None:
            return self.real.unpack_from(buf, offset)
        (export_id,) = struct.unpack_from("<Q", buf, offset)
        run, self.while_preempted = self.while_preempted, None
        run()
        opens, state = struct.unpack_from("<II", buf, offset + 8)
        return export_id, opens, state

    def pack_into(self, *args):
        self.real.pack_into(*args)


def test_a_hold_preempted_while_its_slot_is_freed_and_reused_is_refused(token, monkeypatch):
    # ABA: the producer has seen no lock (its try_free's check) when the consumer takes its lock and reads the
    # slot's record; the consumer is preempted between the record's export id (still the old one) and its
    # state, while the producer frees the slot and pins a new export there. The consumer must not come away
    # holding the old export, which the producer has let go, nor the new one's slot, whose opens it would count.
    producer = Segment.create(token)
    consumer = Segment.attach(token, pid=os.getpid())
    try:
        producer.write(3, 7, PINNED)
        producer.write_state(3, REVOKED)  # try_free's first step,
        assert not producer.held_by_other(in_use(3))  # and its check: no consumer holds the slot

        def free_and_reuse():
            producer.write(3, 0, FREE)  # try_free's last step (its record write)
            producer.write(3, 8, PINNED)  # the next pin takes the slot

        monkeypatch.setattr(_segment, "_RECORD",
                            _RecordReadPreempted(_segment._RECORD, lambda: consumer.mm, free_and_reuse))
        held = consumer.hold(3, 7)
        monkeypatch.undo()
        assert not held, "holds export 7, which its producer freed, in the slot of export 8"
        assert not producer.held_by_other(in_use(3))
    finally:
        consumer.close()
        producer.close(unlink=True)
