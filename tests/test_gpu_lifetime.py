"""Keep-alive and ordering across processes, producer death, leaks."""

from __future__ import annotations

import gc
import time

import pytest

from workers import open_fds, segments, spin

pytestmark = pytest.mark.gpu

N = 1 << 20  # 4 MiB of float32: its own pool block


@pytest.mark.parametrize("keepalive", [True, False], ids=["keepalive", "no-keepalive-control"])
def test_dropped_array_stays_alive_for_the_consumer(remote, keepalive):
    producer, consumer = remote(), remote()
    data = producer.call("export_then_overwrite", N, keepalive)
    out = consumer.call("read", data)
    if keepalive:
        assert (out == 1).all()
    else:
        # The control proves the check can fail: without keep-alive the pool
        # handed the memory to the next arrays and the consumer reads their 99s.
        assert (out == 99).all()


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "no-sync-control"])
def test_consumer_sees_values_written_after_a_long_kernel(remote, sync):
    producer, consumer = remote(), remote()
    consumer.call("warm_up")
    data = producer.call("export_after_spin", N, 3.0, sync)
    out = consumer.call("read", data)
    if sync:
        assert (out == 7).all()
    else:
        assert (out == 0).all()


def test_a_kernel_loaded_after_an_open_that_waits_runs_once_the_producer_is_done(remote):
    # The open's stream waits for a word that a thread of the library sets; a first launch, which with lazy
    # loading may wait for the whole GPU while it holds the caller's thread, must not stop that thread.
    producer, consumer = remote(), remote()
    consumer.call("warm_up")
    data = producer.call("export_after_spin", N, 2.0, True)
    out = consumer.call("open_then_first_launch", data, timeout=30)
    assert out == {"gated": 1, "value": 8.0}


def test_an_export_on_the_legacy_stream_waits_for_a_blocking_streams_work(remote):
    """The legacy default stream waits for the blocking streams: so must its consumer (a queue's feeder thread
    exports on it). Its query counts their work: an event is recorded."""
    import cupy

    import cupy_ipc

    from workers import warm_up

    consumer = remote()
    consumer.call("warm_up")
    warm_up()
    a = cupy.zeros(N, cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()
    s = cupy.cuda.Stream()  # blocking
    spin(3.0, s)
    with s:
        a.fill(7)
    data = cupy_ipc.get_ipc_handle(a, stream=cupy.cuda.Stream.null).to_bytes()
    assert (consumer.call("read", data) == 7).all()


def test_pin_outlives_consumer_gpu_work(remote):
    """The producer keeps the memory until the consumer's queued kernel has finished."""
    import cupy

    import cupy_ipc

    consumer = remote()
    a = cupy.zeros(N, cupy.float32)
    data = cupy_ipc.get_ipc_handle(a).to_bytes()
    del a
    consumer.call("spin_then_drop", data, 2.0)  # returns as soon as the array is dropped
    dropped = time.monotonic()
    assert len(cupy_ipc.pinned()) == 1
    deadline = dropped + 20
    while cupy_ipc.pinned() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cupy_ipc.pinned() == []
    assert time.monotonic() - dropped > 1.0, "the pin ended before the consumer's 2 s kernel could have"


def test_an_array_dropped_off_its_openers_per_thread_stream_is_released_after_that_streams_work_only(
        remote, monkeypatch):
    """An array opened on a thread's per-thread default stream and dropped on another thread, which cannot name
    that stream: the release waits for the opener's work (through the legacy default stream, which follows
    every thread's), not for the GPU's other work, as a device-wide wait did."""
    import cupy

    import cupy_ipc

    monkeypatch.setenv("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "1")
    consumer = remote()  # spawned with it: its CuPy uses per-thread default streams
    a = cupy.zeros(N, cupy.float32)
    data = cupy_ipc.get_ipc_handle(a).to_bytes()
    assert consumer.call("open_on_a_thread_then_drop", data, 1.0, 6.0) == 2  # cudaStreamPerThread
    dropped = time.monotonic()
    assert len(cupy_ipc.pinned()) == 1  # the opener's kernel still runs
    while cupy_ipc.pinned() and time.monotonic() < dropped + 20:
        time.sleep(0.02)
    waited = time.monotonic() - dropped
    assert cupy_ipc.pinned() == []
    assert (a == 1).all()  # the consumer's write, done before the memory was let go
    assert waited < 4.0, f"released after {waited:.1f} s: it waited for the unrelated 6 s kernel"


def test_a_mapping_closed_while_the_gpu_is_busy_holds_up_no_thread_and_no_open(remote):
    """Closing a buffer's mapping waits until the consumer's whole GPU is idle. It used to hold the GIL all that
    time (every thread of the consumer stopped), and the library's lock (every other open and release waited);
    then the thread that dropped the array still waited in it."""
    import cupy

    import cupy_ipc

    consumer = remote()
    a, b = cupy.zeros(N, cupy.float32), cupy.full(N, 3, cupy.float32)
    first, second = cupy_ipc.get_ipc_handle(a).to_bytes(), cupy_ipc.get_ipc_handle(b).to_bytes()
    t = consumer.call("drop_on_a_thread_while_busy", first, second, 3.0)
    assert t["closed"] > 2.0, f"the close did not wait for the GPU ({t['closed']:.2f} s): the check proves nothing"
    assert t["value"] == 3.0
    assert t["dropped"] < 1.0, f"the thread that dropped the array waited for the close ({t['dropped']:.2f} s)"
    assert t["looped"] < 1.0, f"the other thread ran no Python while the close waited ({t['looped']:.2f} s)"
    assert t["second"] < 1.0, f"another open waited for the close ({t['second']:.2f} s)"
    deadline = time.monotonic() + 20
    while cupy_ipc.pinned() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cupy_ipc.pinned() == []


def test_a_release_whose_work_takes_long_holds_up_no_release_behind_it(remote):
    """A consumer drops an array whose stream runs a 4 s kernel, then one whose stream's work takes 0.3 s:
    the second's memory goes back to the producer once that work is done. One thread used to wait for each
    release in turn, and the second waited for the first's kernel."""
    import cupy

    import cupy_ipc

    consumer = remote()
    a, b = cupy.zeros(N, cupy.float32), cupy.zeros(N, cupy.float32)
    ha, hb = cupy_ipc.get_ipc_handle(a), cupy_ipc.get_ipc_handle(b)
    ids = {ha._f.export_id: "long", hb._f.export_id: "short"}
    consumer.call("drop_two_after_work_on_two_streams", ha.to_bytes(), hb.to_bytes(), 4.0, 0.3)
    dropped = time.monotonic()

    def pinned() -> set[str]:
        return {ids[p.export_id] for p in cupy_ipc.pinned() if p.export_id in ids}

    while "short" in pinned() and time.monotonic() < dropped + 20:
        time.sleep(0.02)
    waited, left = time.monotonic() - dropped, pinned()
    assert "short" not in left
    assert waited < 2.0, f"released after {waited:.1f} s: it waited for the other release's 4 s kernel"
    assert left == {"long"}  # its kernel still runs
    assert (b == 1).all()  # the consumer's write, done before the memory was let go
    while pinned() and time.monotonic() < dropped + 20:
        time.sleep(0.02)
    assert pinned() == set() and (a == 1).all()


def test_a_release_interrupted_by_ctrl_c_still_ends_once_the_consumers_work_is_done(remote):
    """Ctrl-C in the release's stream query: the release goes on on the library's thread, after the GPU's
    work (before, the memory stayed pinned until the consumer exited)."""
    import cupy

    import cupy_ipc

    consumer = remote()
    a = cupy.zeros(N, cupy.float32)
    data = cupy_ipc.get_ipc_handle(a).to_bytes()
    del a
    assert consumer.call("spin_then_drop_interrupted", data, 2.0) == "KeyboardInterrupt"
    assert len(cupy_ipc.pinned()) == 1  # the consumer's kernel still runs
    deadline = time.monotonic() + 20
    while cupy_ipc.pinned() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cupy_ipc.pinned() == []
    assert consumer.call("read", cupy_ipc.get_ipc_handle(cupy.ones(N, cupy.float32)).to_bytes()).all()


def test_unopened_export_stays_pinned_until_release_or_lease():
    import cupy

    import cupy_ipc

    a = cupy.ones(N, cupy.float32)
    h = cupy_ipc.get_ipc_handle(a)
    h_lease = cupy_ipc.get_ipc_handle(a, lease=0.2)
    infos = cupy_ipc.pinned()
    assert len(infos) == 2 and all(i.nbytes >= 4 * N for i in infos)
    time.sleep(0.3)
    assert len(cupy_ipc.pinned()) == 1  # the lease ran out
    with pytest.raises(cupy_ipc.IpcError, match="no longer shares"):
        h_lease.open()
    h.release()
    assert cupy_ipc.pinned() == []
    with pytest.raises(cupy_ipc.IpcError, match="no longer shares"):
        h.open()


def test_a_refused_late_handle_leaves_the_array_of_the_export_that_took_its_slot_alive(remote):
    # A late message of an ended export names the slot a newer export now holds; the consumer that holds the
    # newer one's array must keep it when the late one is refused.
    import cupy

    import cupy_ipc

    consumer = remote()
    a = cupy.full(N, 1.0, cupy.float32)
    late = cupy_ipc.get_ipc_handle(a, lease=0.05).to_bytes()
    del a
    time.sleep(0.2)
    cupy_ipc.collect()  # the lease has run out: its slot is free
    a = cupy.full(N, 2.0, cupy.float32)
    data = cupy_ipc.get_ipc_handle(a).to_bytes()
    del a
    parse = cupy_ipc.IpcArrayHandle.from_bytes
    assert parse(data)._f.slot == parse(late)._f.slot, "the test needs the new export in the ended one's slot"
    consumer.call("hold", data, "a")
    kind, message, _ = consumer.call("open_error", late)
    assert kind == "IpcError" and "no longer shares" in message
    cupy_ipc.collect()
    junk = [cupy.full(N, 99.0, cupy.float32) for _ in range(20)]  # would take its memory, were it let go
    assert (consumer.call("read_held", "a") == 2).all()
    del junk


def test_consumers_count_allows_several_processes(remote):
    import cupy

    import cupy_ipc

    a = cupy.full(16, 5, cupy.int32)
    data = cupy_ipc.get_ipc_handle(a, consumers=2).to_bytes()
    c1, c2 = remote(), remote()
    assert c1.call("read_first", data) == 5
    assert c2.call("read_first", data) == 5
    assert cupy_ipc.pinned() == []
    kind, message, _ = remote().call("open_error", data)
    assert kind == "IpcError" and "no longer shares" in message


def _failed_then_retried(consumer, step: str) -> None:
    """An open of an export failing at ``step`` (see ``workers.open_failing``) after the consumer has claimed it,
    then its retry. The failure must let go of the claim at once, though the error is still held, and not count
    as the export's consumer: the producer keeps the memory, not revoked, and the retry opens it."""
    import cupy

    import cupy_ipc

    a = cupy.full(N, 3.0, cupy.float32)
    if step == "event":
        spin(1.0)  # still running at the export: the handle carries an ordering event
    else:
        cupy.cuda.get_current_stream().synchronize()
    h = cupy_ipc.get_ipc_handle(a)
    assert h.synced == (step == "event")
    data = h.to_bytes()
    del a
    bad = data
    if step == "size":  # a corrupt copy of the handle, which claims more memory than was exported
        bad = cupy_ipc.IpcArrayHandle._make(h._f._replace(allocation_size=2 * h.allocation_size)).to_bytes()
    failed = consumer.call("open_failing", bad, step)
    expected = {"import": "cudaErrorMapBufferObjectFailed", "event": "cudaErrorMapBufferObjectFailed",
                "size": "HandleError", "copy": "OutOfMemoryError"}[step]
    assert expected in failed["error"]
    assert (failed["counts"]["claims"], failed["counts"]["mapped"]) == (0, 0)
    infos = cupy_ipc.pinned()  # after a sweep
    assert [(i.opens, i.revoked) for i in infos] == [(0, False)], "the failed open ended the export"
    assert (consumer.call("read", data) == 3).all()  # the retry
    deadline = time.monotonic() + 20
    while cupy_ipc.pinned() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cupy_ipc.pinned() == []


@pytest.mark.parametrize("step", ["import", "size", "event"])
def test_an_open_that_fails_after_its_claim_leaves_the_export_to_a_retry(remote, step):
    consumer = remote()
    consumer.call("warm_up")
    _failed_then_retried(consumer, step)


def test_an_open_interrupted_once_the_driver_mapped_the_memory_leaves_nothing_mapped(remote):
    # Ctrl-C that arrives during the driver's open (about 50 µs of a new buffer's) is raised as the call
    # returns: the mapping it made was lost, never closed, for the life of the process.
    consumer, producer = remote(), remote()
    consumer.call("warm_up")
    data = producer.call("export_filled", 1 << 18, 5.0)
    got = consumer.call("open_interrupted_once_mapped", data)
    assert got["first"] == "interrupted"
    assert (got["values"] == 5.0).all()
    assert got["mapped"] == 0
    assert not got["still_mapped"], "the interrupted open's mapping was left mapped"


@pytest.mark.multi_gpu(2)
def test_a_staged_open_whose_copy_fails_leaves_the_export_to_a_retry(remote):
    consumer = remote()
    consumer.call("warm_up")
    _failed_then_retried(consumer, "copy")


def test_exports_awaiting_consumers_are_checked_a_constant_number_of_times_per_export(remote, monkeypatch):
    # A thousand exports that no consumer opens yet (a pool mapping over many arrays): each export
    # checking every pin would read a pin's count about 500,000 times; amortized, about 8 per export.
    import cupy

    import cupy_ipc
    from cupy_ipc import _keepalive, _segment

    checks = []
    opens = _segment.Segment.opens
    monkeypatch.setattr(_segment.Segment, "opens", lambda self, slot: checks.append(slot) or opens(self, slot))
    stuck = cupy.zeros(16, cupy.float32)
    waiting = [cupy_ipc.get_ipc_handle(stuck) for _ in range(1000)]
    assert len(checks) < 16 * 1000, len(checks)
    # A buffer sent now and done with is still freed within an eighth of the pins' worth of exports.
    a = cupy.full(16, 3, cupy.float32)
    h = cupy_ipc.get_ipc_handle(a)
    assert remote().call("read_first", h.to_bytes()) == 3
    time.sleep(0.1)  # the consumer's release of its claim
    export_id = h._f.export_id
    for _ in range(len(waiting) // 8 + 2):
        waiting.append(cupy_ipc.get_ipc_handle(stuck))
    assert _keepalive.lookup(export_id) is None
    for w in waiting:
        w.release()
    assert cupy_ipc.pinned() == []


def test_ten_thousand_cycles_leak_nothing(remote):
    import cupy

    import cupy_ipc

    consumer = remote()
    pool = cupy.get_default_memory_pool()

    def one_cycle(i: int) -> None:
        a = cupy.full(1024, i, cupy.float32)
        assert consumer.call("read_first", cupy_ipc.get_ipc_handle(a).to_bytes()) == i

    for i in range(20):  # reach the steady state: caches filled, pools warm
        one_cycle(i)
    consumer.call("collect")
    cupy_ipc.collect()
    gc.collect()
    before = (pool.used_bytes(), len(cupy_ipc.pinned()), segments(), open_fds(), consumer.call("state"))
    for i in range(10_000):
        one_cycle(i % 1000)
    consumer.call("collect")
    cupy_ipc.collect()
    gc.collect()
    after = (pool.used_bytes(), len(cupy_ipc.pinned()), segments(), open_fds(), consumer.call("state"))
    assert after == before


def test_open_after_producer_sigkill_fails_fast(remote):
    producer, consumer = remote(), remote()
    data = producer.call("export_filled", N, 3.0)
    producer.kill()
    kind, message, seconds = consumer.call("open_error", data)
    assert kind == "ProducerExitedError"
    assert f"pid {producer.pid}" in message
    assert seconds < 1.0
    # still usable afterwards
    assert consumer.call("read_first", _local_handle()) == 1


def test_the_cached_events_of_a_producer_found_exited_are_destroyed(remote):
    # A consumer keeps the ordering events it opened from a producer's handles, for its later messages; an
    # open that finds the producer gone destroys them (they can never be recorded again).
    import cupy_ipc

    producer, consumer = remote(), remote()
    consumer.call("without_words")  # so that it opens the producer's event, not its word
    data = producer.call("export_after_spin", N, 0.5, True)  # exported while its stream was busy
    assert cupy_ipc.IpcArrayHandle.from_bytes(data).synced
    assert consumer.call("read_first", data) == 7
    assert consumer.call("state")["events"] == 1
    producer.kill()
    kind, _, _ = consumer.call("open_error", data)
    assert kind == "ProducerExitedError"
    assert consumer.call("state")["events"] == 0
    assert consumer.call("read_first", _local_handle()) == 1


def _local_handle() -> bytes:
    import cupy

    import cupy_ipc

    a = cupy.ones(8, cupy.float32)
    _keep.append(a)
    return cupy_ipc.get_ipc_handle(a).to_bytes()


_keep: list = []


def test_mapping_held_when_producer_dies(remote):
    """A consumer keeps reading the last values after the producer is killed (measured behaviour)."""
    producer, consumer = remote(), remote()
    data = producer.call("export_filled", N, 4.0)
    consumer.call("hold", data, "x")
    producer.kill()
    out = consumer.call("read_held", "x")
    assert (out == 4).all()
    consumer.call("drop", "x")
    assert consumer.call("read_first", _local_handle()) == 1


def test_a_producer_killed_with_work_in_flight_releases_the_consumer_with_an_error(remote):
    # Killed before the work its ordering event captures has run, the producer never completes the event, and a
    # stream made to wait on that event would wait for ever (CUDA has no timeout): the consumer's read, its other
    # work on that stream and its exit with it. The library's wait is released once the producer is seen gone:
    # the read returns (values incomplete: the fill never ran), a warning says so, and close() raises.
    producer, consumer = remote(), remote()
    consumer.call("warm_up")
    data = producer.call("export_after_spin", N, 4.0, True)  # the fill runs after 4 s of spinning
    consumer.call("hold_open", data, "x")  # on the default stream, which everything after it waits for
    killed = time.monotonic()
    producer.kill()
    out = consumer.call("read_then_close", "x", timeout=3.0)  # the producer would have been done by 4 s
    print(f"the read returned {time.monotonic() - killed:.3f} s after the kill (itself {out['took']:.3f} s)")
    assert out["value"] == 0.0  # zeros, synchronized before the spin: the fill never ran
    assert out["error"] is not None and out["error"][:2] == ("ProducerExitedError", producer.pid), out
    assert "incomplete" in out["error"][2]
    assert any(f"pid {producer.pid}" in w and "incomplete" in w for w in out["warnings"]), out["warnings"]
    assert consumer.call("read_first", _local_handle()) == 1.0
    t0 = time.monotonic()
    consumer.close()
    assert consumer.proc.exitcode == 0 and time.monotonic() - t0 < 10


def test_without_the_release_a_killed_producers_wait_stays_stuck(remote):
    # The negative control of the test above: an open that makes its stream wait on the producer's event itself,
    # as raw CUDA IPC does, never returns from the read.
    producer, consumer = remote(), remote()
    consumer.call("warm_up")
    consumer.call("without_gates")
    data = producer.call("export_after_spin", N, 4.0, True)
    consumer.call("hold_open", data, "x")
    producer.kill()
    with pytest.raises(TimeoutError):
        consumer.call("read_then_close", "x", timeout=6.0)
    consumer.kill()  # asked to exit, it would not: 20 s of the fixture's wait saved


@pytest.mark.parametrize("pool", [False, True], ids=["cudaMalloc-exited", "pool-killed"])
def test_idle_mappings_of_a_producer_that_has_gone_are_unmapped_at_the_next_import(remote, pool):
    # A buffer sent twice stays mapped, idle, for its next message. Once its producer has gone nothing can
    # open it again, and the idle mapping only keeps the memory allocated: the driver frees it with the
    # last mapping anywhere. The next import (of another producer's array) unmaps it, and lets go of the
    # pool it came from.
    consumer, first, second = remote(), remote(), remote()
    n = 1 << 26  # 256 MiB of float32
    got = consumer.call("open_each", first.call("export_times", n, 5.0, 2, pool=pool))
    assert [g["value"] for g in got] == [5.0, 5.0] and got[-1]["idle"] == 1
    if pool:
        first.kill()
    else:
        first.close()
    probe = second.call("export_filled", 1024, 2.0)  # the second producer's context is up before the measure
    before = consumer.call("state")
    assert before["idle"] == 1  # nothing looked for the producer yet: the memory is still held
    assert consumer.call("open_each", [probe])[0]["value"] == 2.0
    after = consumer.call("state")
    assert after["idle"] == 0 and after["claims"] == 0
    assert after["pools"] == before["pools"] - pool
    assert after["free_mem"] - before["free_mem"] >= 0.9 * 4 * n  # the gone producer's memory is free again


@pytest.mark.parametrize("grow", [True, False], ids=["growing", "fixed-limit-control"])
def test_a_consumer_taking_turns_among_more_buffers_than_the_idle_limit_keeps_them_all_mapped(remote, grow):
    # With the limit fixed at 16, a ring of 24 re-sent buffers mapped and unmapped one per message (a third of
    # the messages a second, measured). By default the limit grows to the ring: its last round reuses every
    # mapping of the round before.
    consumer, producer = remote(), remote()
    buffers = 24
    if not grow:
        assert consumer.call("set_idle_limit", 16, False) == 16  # the default's start
    got = consumer.call("open_each", producer.call("export_ring", 1024, buffers, 4))
    assert [g["value"] for g in got] == [float(i % buffers) for i in range(4 * buffers)]
    third, last = got[2 * buffers:3 * buffers], got[3 * buffers:]
    if grow:
        assert [g["idle"] for g in last] == [buffers] * buffers
        assert [g["ptr"] for g in last] == [g["ptr"] for g in third]
    else:
        assert [g["idle"] for g in last] == [16] * buffers


@pytest.mark.parametrize("first, second", [(1 << 10, 1 << 18), (1 << 18, 1 << 18)],
                         ids=["4KiB-then-1MiB", "same-size"])
def test_a_new_allocation_at_the_addresses_of_an_idle_mapping_opens_as_itself(remote, first, second):
    # An idle mapping holds no claim: the producer may free the buffer and the driver give its addresses to
    # the next allocation. Seen on an H200, a larger one's handle differs from the old one in its size bytes
    # alone, and the driver refused to map it beside the idle mapping (cudaErrorAlreadyMapped); one of the
    # same size differs in one byte. The consumer must map the new allocation, read its values, and let the
    # stale mapping go.
    consumer, producer = remote(), remote()
    got = consumer.call("open_each", producer.call("export_times", first, 1.0, 2))
    assert [g["value"] for g in got] == [1.0, 1.0] and got[-1]["idle"] == 1
    data, reused = producer.call("replace_exported", second, 2.0)
    assert reused, "the new allocation did not take the freed addresses, so this case is not exercised"
    out = consumer.call("open_each", [data])[0]
    assert out["value"] == 2.0
    assert out["idle"] == 0 and out["mapped"] == 0


def test_an_opened_array_dropped_in_a_forked_child_makes_no_cuda_call(remote):
    # A child forked after CUDA was initialized crashes or hangs on a CUDA call: the release of an array it
    # inherited (a stream query, an event) must not make one, nor let go of the parent's claim.
    import os
    import warnings

    import cupy_ipc

    producer = remote()
    arr = cupy_ipc.IpcArrayHandle.from_bytes(producer.call("export_filled", 1024, 3.0)).open()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop the array, report what was warned
        code = 1
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                del arr
                gc.collect()
            os.write(w, "|".join(str(c.message) for c in caught).encode() or b"nothing")
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + 60
    while (ended := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the child hung dropping the array")
        time.sleep(0.05)
    said = os.read(r, 65536).decode()
    os.close(r)
    assert os.waitstatus_to_exitcode(ended[1]) == 0 and said == "nothing"
    # The claim is a lock of an open file description that the child shares: let go of there, the producer's
    # sweep would end its pin (the memory stays valid here only because the producer keeps the array too).
    assert producer.call("pinned_count") == 1
    assert float(arr.sum()) == 3.0 * 1024  # the parent's mapping is untouched


@pytest.mark.multi_gpu(2)
def test_an_array_opened_on_a_peer_gpu_and_sent_on_is_ordered_for_its_next_consumer(remote):
    # Its handle names the memory's GPU; an ordering event recorded on the peer GPU would have the next
    # consumer's stream of the memory's GPU wait on another GPU's event, which ends that process.
    import cupy

    import cupy_ipc

    a = cupy.zeros(N, dtype=cupy.float32)
    relay, consumer = remote(), remote()
    relayed = relay.call("fill_on_a_peer_and_send_on", cupy_ipc.get_ipc_handle(a).to_bytes(), 1, 5.0)
    assert (consumer.call("read", relayed) == 5.0).all()
    assert float(a.sum()) == 5.0 * N


@pytest.mark.multi_gpu(2)
def test_a_stream_of_another_gpu_than_the_one_opened_on_is_refused():
    # Neither the wait on the producer's event nor the release could be ordered on it: the memory stayed pinned.
    import cupy

    import cupy_ipc

    a = cupy.arange(4, dtype=cupy.float32)
    h = cupy_ipc.get_ipc_handle(a)
    with cupy.cuda.Device(0):
        s = cupy.cuda.Stream(non_blocking=True)
    with pytest.raises(cupy_ipc.IpcError, match="stream belongs to GPU 0, and the array is opened on GPU 1"):
        h.open(stream=s, device=1)
    assert float(h.open(stream=s, device=0).sum()) == 6.0
    h.close()
    h.release()


@pytest.mark.parametrize("path", ["first", "general", "again"])
def test_an_export_interrupted_before_its_handle_exists_leaves_nothing_pinned(monkeypatch, path):
    # Ctrl-C once the memory is pinned but before the handle is made: no handle could release the pin, no
    # consumer open it, and without a lease it stayed for the life of the process.
    import cupy

    import cupy_ipc
    from cupy_ipc import IpcArrayHandle

    a = cupy.ones(N, cupy.float32)
    earlier = [cupy_ipc.get_ipc_handle(a) for _ in range(2 if path == "again" else 0)]  # the second makes its lane
    for h in earlier:
        h.release()
    cupy_ipc.collect()
    before = {p.export_id for p in cupy_ipc.pinned()}
    def interrupted(cls, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(IpcArrayHandle, "_make", classmethod(interrupted))
    with pytest.raises(KeyboardInterrupt):
        cupy_ipc.get_ipc_handle(a, lease=60.0) if path == "general" else cupy_ipc.get_ipc_handle(a)
    monkeypatch.undo()
    cupy_ipc.collect()
    assert {p.export_id for p in cupy_ipc.pinned()} <= before
    h = cupy_ipc.get_ipc_handle(a)  # and the array exports as before
    assert h.keepalive and {p.export_id for p in cupy_ipc.pinned()} - before
    h.release()


def test_a_consumers_stream_goes_on_once_the_producers_work_is_done_with_no_thread_of_it_involved(remote):
    # The producer's GPU writes the export's word once its work is done, and the consumer's stream waits for that
    # word on the GPU: it goes on with the library's thread in the consumer unable to run (its lock held), as a
    # thread starved of the GIL by Python that the consumer runs would be.
    producer, consumer = remote(), remote()
    consumer.call("warm_up")
    data = producer.call("export_after_spin", N, 1.5, True)
    consumer.call("hold_open", data, "x")
    out = consumer.call("read_holding_the_library_thread", "x", timeout=10.0)
    assert out["value"] == 7.0 and out["took"] > 0.5, out
    assert consumer.call("read_then_close", "x")["error"] is None


def test_a_stream_waiting_for_a_word_of_its_own_needs_the_librarys_thread(remote):
    # The negative control of the test above: with the producer writing no word, the consumer's stream waits for
    # a word of its own, which only the library's thread sets, so the read never returns while it cannot run.
    producer, consumer = remote(), remote()
    consumer.call("warm_up")
    producer.call("without_words")
    data = producer.call("export_after_spin", N, 1.5, True)
    consumer.call("hold_open", data, "x")
    with pytest.raises(TimeoutError):
        consumer.call("read_holding_the_library_thread", "x", timeout=6.0)
    consumer.kill()


@pytest.mark.parametrize("equal", [False, True], ids=["cyclic", "equal-negative-control"])
def test_a_stream_that_reaches_its_wait_after_its_word_was_handed_out_again_goes_on(remote, equal):
    # A stream queued behind its own work reaches its wait for a word of its process only after the library's
    # thread has set that word (the producer's work done) and handed it out again to a later open, whose value
    # it then holds. Compared for equality, that first wait would never end; compared cyclically (>=), it does.
    producer, consumer = remote(), remote()
    consumer.call("warm_up")
    producer.call("without_words")  # so the consumer's streams wait for words of its own
    if equal:
        consumer.call("with_equal_waits")
    # The first export's work is done 1 s on, the second's 2.5 s on; the consumer opens the first at once and the
    # second 1.5 s on, and its own work keeps the first open's stream busy for 5 s.
    first, second = producer.call("export_two_after_spins", N, 1.0, 1.5)
    if equal:
        with pytest.raises(TimeoutError):
            consumer.call("open_behind_own_work_then_another", first, second, 5.0, 1.5, timeout=14.0)
        consumer.kill()
        return
    out = consumer.call("open_behind_own_work_then_another", first, second, 5.0, 1.5, timeout=14.0)
    assert out["words"][0] == out["words"][1] and len(out["words"][0]) == 1, out  # the case this is about
    assert out["values"] == [3.0, 4.0] and out["took"] > 4.0, out
