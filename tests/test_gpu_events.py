"""Interprocess events between real processes."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from workers import spin, warm_up

pytestmark = pytest.mark.gpu


def _write_after_spin(seconds: float, export_first: bool = False):
    """Queue a long kernel, then the final write, on a non-blocking stream; record an event (exported before
    the record with ``export_first``: the record then writes the event's word). The event's handle too."""
    import cupy

    import cupy_ipc

    warm_up()
    a = cupy.zeros(1 << 16, cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    ev = cupy_ipc.IpcEvent()
    data = ev.get_ipc_handle().to_bytes() if export_first else None
    spin(seconds, stream)
    with stream:
        a.fill(42)
    ev.record(stream)
    return a, ev, stream, data or ev.get_ipc_handle().to_bytes()


@pytest.mark.parametrize("wait, export_first", [(True, False), (True, True), (False, True)],
                         ids=["wait-recorded-first", "wait-exported-first", "no-wait-control"])
def test_event_orders_work_across_processes(consumer, wait, export_first):
    # Recorded before its export, the event's record has no word: the consumer's stream waits for a word of its
    # own, set by the library's thread once it sees the event completed. Exported first, each record writes the
    # event's word, which the consumer's stream waits for.
    import cupy_ipc

    consumer.call("warm_up")
    a, ev, stream, event_data = _write_after_spin(3.0, export_first)
    if export_first:
        assert cupy_ipc.IpcEventHandle.from_bytes(event_data)._f.pair  # (else this case tests the other)
    out = consumer.call(
        "read_after_event",
        cupy_ipc.get_ipc_handle(a, keepalive=False, sync=False).to_bytes(),
        event_data,
        wait,
    )
    stream.synchronize()
    if wait:
        assert (out == 42).all()
    else:
        # The control proves the check can fail: without the wait the consumer
        # reads while the producer's kernel still runs.
        assert (out == 0).all()


@pytest.mark.parametrize("how, export_first", [("wait", False), ("wait-now", False), ("synchronize", False),
                                                ("wait", True), ("wait-now", True)])
def test_a_wait_for_a_killed_producers_event_ends(remote, how, export_first):
    # Killed before its event's work has run, the producer never completes the event: a stream made to wait on
    # it before (for a word of its own, or, exported first, for the event's word) is released with a warning; a
    # stream made to wait after, or a wait on the host, raises ProducerExitedError.
    producer, consumer = remote(), remote()
    consumer.call("warm_up")
    consumer.call("hold_event", producer.call("event_after_spin", 4.0, export_first), "ev", how)
    producer.kill()
    out = consumer.call("wait_on_held_event", "ev", how, timeout=3.0)  # the producer would have been done by 4 s
    if how == "wait":
        assert out["error"] is None
        assert any(f"pid {producer.pid}" in w and "incomplete" in w for w in out["warnings"]), out["warnings"]
    else:
        assert out["error"] == ("ProducerExitedError", producer.pid)
    consumer.close()
    assert consumer.proc.exitcode == 0


@pytest.mark.parametrize("how, export_first", [("wait", False), ("wait-now", False), ("synchronize", False),
                                                ("wait", True)])
def test_a_wait_for_a_live_producers_event_ends_when_its_work_is_done(remote, how, export_first):
    producer, consumer = remote(), remote()
    consumer.call("warm_up")
    consumer.call("hold_event", producer.call("event_after_spin", 1.0, export_first), "ev", how)
    out = consumer.call("wait_on_held_event", "ev", how, timeout=30)
    assert out["error"] is None and out["warnings"] == []
    assert 0.3 < out["took"] < 5  # it waited for the kernel, and not for ever


@pytest.mark.parametrize("words", [True, False], ids=["words", "no-words-negative-control"])
def test_a_stream_waiting_for_an_exported_event_goes_on_with_no_thread_involved(remote, monkeypatch, words):
    # An event exported before its record: the record has the producer's stream write the event's word, and the
    # consumer's stream waits for that word on the GPU, so it goes on with the library's thread in the consumer
    # unable to run (its lock held). With the producer writing no word, the stream waits for a word of the
    # consumer's own, which only that thread sets: the copy never runs while the lock is held.
    import cupy_ipc
    from cupy_ipc import _words

    if not words:
        monkeypatch.setattr(_words, "disabled", True)
    consumer = remote()  # (the negative control's is killed)
    consumer.call("warm_up")
    a, ev, stream, event_data = _write_after_spin(1.5, export_first=True)
    assert bool(cupy_ipc.IpcEventHandle.from_bytes(event_data)._f.pair) is words
    arr_data = cupy_ipc.get_ipc_handle(a, keepalive=False, sync=False).to_bytes()
    if words:
        out = consumer.call("read_after_event_holding_the_library_thread", arr_data, event_data, timeout=10.0)
        assert out["values"] == [42.0] and out["took"] > 0.5, out
    else:
        with pytest.raises(TimeoutError):
            consumer.call("read_after_event_holding_the_library_thread", arr_data, event_data, timeout=6.0)
        consumer.kill()
    stream.synchronize()


def test_records_on_two_streams_order_a_consumers_wait_for_the_latest(consumer):
    # The second record, on another stream while the first's work still runs, could have its word written before
    # the first's: it gets none, and the consumer's wait polls the event (the latest record, as CUDA's wait).
    import cupy

    import cupy_ipc

    consumer.call("warm_up")
    a, ev, first, event_data = _write_after_spin(1.0, export_first=True)
    second = cupy.cuda.Stream(non_blocking=True)
    spin(3.0, second)
    with second:
        a += 1
    ev.record(second)
    out = consumer.call("read_after_event", cupy_ipc.get_ipc_handle(a, keepalive=False, sync=False).to_bytes(),
                        event_data, True)
    assert (out == 43).all()
    second.synchronize()


# A consumer's record marked the producer's "issued" word odd only where that consumer had registered the words
# with CUDA: another consumer took the producer's even value (its own record, long done) as the latest record's
# and its wait let its stream read before the first consumer's write.
def test_a_consumers_record_orders_another_consumers_wait_even_where_it_has_no_registered_words(remote):
    import cupy

    import cupy_ipc

    writer, reader = remote(), remote()
    writer.call("warm_up")
    reader.call("warm_up")
    a = cupy.zeros(1 << 16, cupy.float32)
    ev = cupy_ipc.IpcEvent()
    event_data = ev.get_ipc_handle().to_bytes()  # before the record: the record writes the producer's word
    ev.record()
    ev.synchronize()  # the producer's latest record: done
    arr_data = cupy_ipc.get_ipc_handle(a, keepalive=False, sync=False).to_bytes()
    writer.call("write_then_record_unregistered", arr_data, event_data, 2.0, 7.0)
    out = reader.call("read_after_event", arr_data, event_data, True)
    assert (out == 7).all()


def test_opened_event_is_destroyed_once(consumer):
    import cupy_ipc

    ev = cupy_ipc.IpcEvent(block=True)
    ev.record()
    r = consumer.call("event_lifecycle", ev.get_ipc_handle().to_bytes())
    assert r == {"opened": True, "closed": True, "raised": "this IpcEvent is closed", "gc_destroyed": True}


def test_event_api_in_one_process():
    import cupy

    import cupy_ipc

    ev = cupy_ipc.IpcEvent()
    s = cupy.cuda.Stream(non_blocking=True)
    ev.record(s)
    ev.wait()  # the current stream waits on the GPU
    cupy.cuda.get_current_stream().wait_event(ev)  # CuPy accepts it through .ptr
    ev.synchronize()
    assert ev.query()
    assert "IpcEvent ptr=0x" in repr(ev)
    # pickling in the creating process gives back the original object
    assert pickle.loads(pickle.dumps(ev)) is ev
    h = ev.get_ipc_handle()
    assert h.open() is ev
    assert cupy_ipc.IpcEventHandle.from_bytes(h.to_bytes()) == h
    ev.close()
    ev.close()
    with pytest.raises(cupy_ipc.ClosedError):
        ev.record()
    with pytest.raises(cupy_ipc.ClosedError):
        h.open()


def test_pickled_event_opens_in_another_process(consumer):
    import cupy_ipc

    ev = cupy_ipc.IpcEvent()
    ev.record()
    r = consumer.call("event_lifecycle", pickle.loads(pickle.dumps(ev.get_ipc_handle())).to_bytes())
    assert r["opened"] and r["gc_destroyed"]
    np.testing.assert_equal(ev.query(), True)


def test_a_cached_ordering_event_stays_usable_by_a_thread_holding_it_when_the_cache_lets_go(remote):
    # The consumer's cache of the ordering events it opened is emptied by collect(), by an exited producer and
    # by eviction, any of them on another thread while an open is about to wait on one of its events.
    import weakref

    import cupy_ipc
    from cupy_ipc import _events

    producer = remote()
    h = cupy_ipc.IpcArrayHandle.from_bytes(producer.call("export_after_spin", 1 << 16, 0.5, True))
    assert h.synced
    ev = _events.open_cached(h._f.event_handle, 0, h.producer)
    cupy_ipc.collect()  # lets go of every cached event
    assert not ev.closed
    ev.synchronize()
    assert ev.query()
    gone = weakref.ref(ev)
    del ev  # its last user: destroyed now
    assert gone() is None


def test_the_gpu_of_a_stream_is_found_on_a_driver_without_cuStreamGetDevice(monkeypatch):  # noqa: N802
    # That call came with CUDA 12.8; before, the stream's context says which GPU (what wait(stream) needs).
    import cupy

    import cupy_ipc
    from cupy_ipc import _cuda

    s = cupy.cuda.Stream(non_blocking=True)
    direct = _cuda.stream_device(s.ptr)
    driver = _cuda._driver()

    class Older:
        def __getattr__(self, name):
            if name == "cuStreamGetDevice":
                raise AttributeError(name)
            return getattr(driver, name)

    monkeypatch.setattr(_cuda, "_driver", lambda: Older())
    assert _cuda.stream_device(s.ptr) == direct == cupy.cuda.Device().id
    ev = cupy_ipc.IpcEvent()
    ev.record()
    ev.wait(s)  # through the fallback
    s.synchronize()
    ev.close()
