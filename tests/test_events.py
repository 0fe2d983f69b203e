"""Opens of another process's event and creations of events, without a GPU: the driver and the runtime are
stubbed."""

from __future__ import annotations

import types

import pytest
from cupy.cuda import runtime as cupy_runtime

from cupy_ipc import IpcEvent, IpcEventHandle, _cuda, _events
from cupy_ipc import multiprocessing as cupy_mp
from cupy_ipc._identity import Producer, this_process
from cupy_ipc._wire import DeviceId, EventFields

EVENT = 0xE000  # the event the stubbed driver opens


@pytest.fixture
def destroyed(monkeypatch, libcuda):
    """A handle of another process's event, whose open is interrupted as the driver's call returns, having made
    the event; the events destroyed, recorded in the list returned."""
    gone: list[int] = []

    def open_then_interrupted(out, handle):  # the driver's open, then the interrupt's check
        out._obj.value = EVENT  # (out: ctypes.byref of the caller's c_void_p)
        raise KeyboardInterrupt

    libcuda["cuIpcOpenEventHandle"] = open_then_interrupted
    flags = {name: getattr(cupy_runtime, name) for name in ("eventInterprocess", "eventDisableTiming",
                                                            "eventBlockingSync")}  # the values IpcEvent passes
    runtime = types.SimpleNamespace(getDevice=lambda: 0, setDevice=lambda device: None, eventDestroy=gone.append,
                                    **flags)
    monkeypatch.setattr(_cuda, "rt", lambda: runtime)
    monkeypatch.setattr(_cuda, "ordinal_of_uuid", lambda uuid: 0)
    monkeypatch.setattr(_events._segment, "attach", lambda token, pid: None)  # the producer is alive
    return gone


def _handle() -> IpcEventHandle:
    me = this_process()
    producer = Producer(me.pid + 1, b"p" * 16, me.boot_id, me.host)
    return IpcEventHandle._make(EventFields(bytes(64), False, DeviceId(0, bytes(16)), producer))


# Ctrl-C during the driver's open is raised as the call returns: the event, returned as a value, was lost, never
# destroyed.
@pytest.mark.parametrize("opening", [
    lambda h: h.open(),
    lambda h: _events.open_cached(h.event_handle, 0, h.producer),
    lambda h: cupy_mp._rebuild_cupy_event(h.to_bytes()),
], ids=["IpcEventHandle.open", "open_cached", "cupy.cuda.Event"])
def test_an_event_open_interrupted_once_the_driver_opened_it_destroys_the_event_once(destroyed, opening):
    import gc

    with pytest.raises(KeyboardInterrupt):
        opening(_handle())
    gc.collect()  # what the open made, and dropped, is collected: no second destroy
    assert destroyed == [EVENT]
    assert not _events._opened


# Ctrl-C during the runtime's create (cudaEventCreateWithFlags) is raised as the call returns: the event, returned as
# a value, was lost, never destroyed.
@pytest.mark.parametrize("block", [False, True], ids=["spin", "block"])
def test_an_event_creation_interrupted_once_the_driver_made_it_destroys_the_event_once(destroyed, libcuda, block):
    import gc

    given: list[int] = []

    def create_then_interrupted(out, flags):
        given.append(flags)
        out._obj.value = EVENT
        raise KeyboardInterrupt

    libcuda["cuEventCreate"] = create_then_interrupted
    with pytest.raises(KeyboardInterrupt):
        IpcEvent(block=block)
    gc.collect()  # what the create made, and dropped, is collected: no second destroy
    assert destroyed == [EVENT]
    # The runtime's flags are cuda.h's: CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING (| CU_EVENT_BLOCKING_SYNC).
    assert given == [0x4 | 0x2 | (0x1 if block else 0)]


# CuPy's runtime.eventQuery returns the CUDA status as it is and raises for none: query() read every error as "not
# finished yet" (False), so that a caller polling it after a kernel fault (a sticky error) or on an event the
# producer destroyed waited for ever, never told why.
@pytest.mark.parametrize("status", [700, 400], ids=["cudaErrorIllegalAddress", "cudaErrorInvalidResourceHandle"])
def test_an_event_query_that_cuda_fails_raises_rather_than_reads_not_finished(destroyed, libcuda, status):
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    from cupy_ipc import IpcError

    def create(out, flags):
        out._obj.value = EVENT
        return 0

    libcuda["cuEventCreate"] = create
    runtime = _cuda.rt()
    answers = {EVENT: 0}
    runtime.eventQuery = lambda ev: answers[ev]
    ev = IpcEvent()
    try:
        assert ev.query() is True
        answers[EVENT] = 600  # cudaErrorNotReady: recorded work still running
        assert ev.query() is False
        answers[EVENT] = status
        with pytest.raises(IpcError) as e:
            ev.query()
        assert e.value.cuda_error == CUDARuntimeError(status).__str__().split(":")[0]
    finally:
        ev.close()
    assert destroyed == [EVENT]


# A producer that exits right after its event's work has run leaves an event that has completed: a wait on it has
# nothing to wait for. synchronize() asked for the producer before it looked at the event, and raised.
@pytest.mark.parametrize("done", [True, False], ids=["completed", "never-completes"])
def test_a_host_wait_for_the_event_of_an_exited_producer_raises_only_if_the_event_has_not_completed(
        destroyed, libcuda, monkeypatch, done):
    from cupy_ipc import ProducerExitedError

    def opened(out, handle):
        out._obj.value = EVENT
        return 0

    def exited(token, pid):
        raise ProducerExitedError(f"the producer process (pid {pid}) has exited", pid=pid)

    libcuda["cuIpcOpenEventHandle"] = opened
    _cuda.rt().eventQuery = lambda ev: 0 if done else 600
    h = _handle()
    ev = h.open()  # while the producer lives
    monkeypatch.setattr(_events._segment, "attach", exited)
    try:
        if done:
            ev.synchronize()
        else:
            with pytest.raises(ProducerExitedError) as e:
                ev.synchronize()
            assert e.value.pid == h.producer.pid
    finally:
        ev.close()


# An event of another process completes some 100 us after its record (measured on an H200); a poll that slept 20 us
# between queries (70 us with the timer's slack) came back up to a sleep late: the event ping-pong was 400 us a
# round against raw calls' 281. A wait for an event made without blocking sync spins now, as CUDA's does.
@pytest.mark.parametrize("block", [False, True], ids=["spins", "blocking-sync-sleeps"])
def test_a_host_wait_spins_unless_the_event_was_made_with_blocking_sync(destroyed, libcuda, monkeypatch, block):
    class Alive:
        def producer_alive(self):
            return True

    def opened(out, handle):
        out._obj.value = EVENT
        return 0

    libcuda["cuIpcOpenEventHandle"] = opened
    polls = iter([600] * 6 + [0])
    _cuda.rt().eventQuery = lambda ev: next(polls)
    slept = []
    monkeypatch.setattr(_events._gates.time, "sleep", slept.append)
    monkeypatch.setattr(_events._segment, "attach", lambda token, pid: Alive())
    h = _handle()
    h = IpcEventHandle._make(h._f._replace(block=block))
    ev = h.open()
    try:
        ev.synchronize()
    finally:
        ev.close()
    assert len(slept) == 5  # (the first query is synchronize's own: not done, so it polls)
    assert set(slept) == ({_events._gates.poll_interval(0)} if block else {0})


# A consumer's record marked the producer's "issued" word odd only where it could register the words with CUDA
# (host registration fails at the pinned-memory limit): another consumer, whose registration worked, read the
# producer's even value as the latest record's and its wait skipped this consumer's work.
def test_a_consumers_record_marks_the_producers_word_before_recording_even_without_registered_words(monkeypatch):
    import ctypes
    import os
    import secrets

    from cupy_ipc import _segment, _words

    token = secrets.token_bytes(16)
    producer_seg = _segment.Segment.create(token)
    try:
        plain = _words.Words(producer_seg.mm, 0, 0)
        plain.set(_words.issued_word(0), 4)  # the producer's latest record, its work done
        plain.set(_words.done_word(0), 4)
        seen_at_record: list[int] = []
        runtime = types.SimpleNamespace(
            getDevice=lambda: 0, setDevice=lambda device: None, eventDestroy=lambda ev: None,
            eventRecord=lambda ev, s: seen_at_record.append(plain.read(_words.issued_word(0))))
        monkeypatch.setattr(_cuda, "rt", lambda: runtime)
        monkeypatch.setattr(_words, "of_producer", lambda seg, device: None)  # could not register
        me = this_process()
        handle = IpcEventHandle._make(EventFields(bytes(64), False, DeviceId(0, bytes(16)),
                                                  Producer(os.getpid(), token, me.boot_id, me.host), pair=1))
        ev = IpcEvent.__new__(IpcEvent)
        ev._adopt(ctypes.c_void_p(0), 0, False, handle, opened=True)
        ev._ptr = EVENT
        ev.record(types.SimpleNamespace(ptr=0x5000))
        assert seen_at_record and seen_at_record[0] & 1  # odd already when the record was made
        assert _words.event_value(plain, 0) is None  # every other consumer polls the event
    finally:
        producer_seg.close(unlink=True)
