"""cupy_ipc.multiprocessing on a GPU: every channel both ways, pools, relays, the fork guard, leaks."""

from __future__ import annotations

import concurrent.futures
import gc
import pickle
import subprocess
import sys
import time
import warnings
from collections import Counter

import numpy as np
import pytest

import cupy_ipc
import cupy_ipc.multiprocessing as mp

import mp_workers

pytestmark = pytest.mark.gpu

N = 1 << 18  # 1 MiB of float32


@pytest.fixture
def ctx(request):
    """A spawn context (or the start method a test is parametrized with, as ``method``) whose processes are
    killed if a test leaves them running."""
    context = mp.get_context(getattr(request, "param", "spawn"))
    started = []
    real = context.Process

    def process(*args, **kwargs):
        p = real(*args, daemon=True, **kwargs)
        started.append(p)
        return p

    context = _ContextWith(context, process)
    yield context
    for p in started:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(10)


class _ContextWith:
    def __init__(self, context, process):
        self._context = context
        self.Process = process

    def __getattr__(self, name):
        return getattr(self._context, name)


def _array(value=0.0):
    import cupy

    a = cupy.arange(N, dtype=cupy.float32) + value
    return a, cupy.asnumpy(a)


def _check_answer(answer, sent, expected_before):
    result, back = answer
    np.testing.assert_array_equal(result.get(), expected_before * 2)
    assert back.data.ptr == sent.data.ptr, "the array sent back must be the sender's own memory"
    np.testing.assert_array_equal(sent.get(), expected_before + 1)


@pytest.mark.parametrize("kind", ["Queue", "SimpleQueue", "JoinableQueue"])
def test_queues_carry_arrays_both_ways(ctx, kind):
    inbox, outbox = getattr(ctx, kind)(), getattr(ctx, kind)()
    p = ctx.Process(target=mp_workers.serve_queue, args=(inbox, outbox))
    p.start()
    get = outbox.get if kind == "SimpleQueue" else lambda: outbox.get(timeout=60)  # SimpleQueue has no timeout
    for value in (0.0, 5.0):
        a, expected = _array(value)
        inbox.put(a)
        _check_answer(get(), a, expected)
    if kind == "JoinableQueue":
        inbox.join()
    inbox.put(None)
    p.join(30)
    assert p.exitcode == 0


def test_pipe_carries_arrays_both_ways(ctx):
    here, there = ctx.Pipe()
    p = ctx.Process(target=mp_workers.serve_pipe, args=(there,))
    p.start()
    a, expected = _array(3.0)
    here.send(a)
    assert here.poll(60)
    _check_answer(here.recv(), a, expected)
    here.send(None)
    p.join(30)
    assert p.exitcode == 0


def test_forkserver_start_method():
    context = mp.get_context("forkserver")
    inbox, outbox = context.Queue(), context.Queue()
    p = context.Process(target=mp_workers.serve_queue, args=(inbox, outbox), daemon=True)
    p.start()
    try:
        a, expected = _array(1.0)
        inbox.put(a)
        _check_answer(outbox.get(timeout=60), a, expected)
        inbox.put(None)
        p.join(30)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()


def test_pool_of_four_maps_over_a_hundred_arrays():
    import cupy

    arrays = [cupy.full(4096, i, dtype=cupy.float32) for i in range(100)]
    with mp.get_context("spawn").Pool(4) as pool:
        results = pool.map(mp_workers.double, arrays, chunksize=5)
        single = pool.apply_async(mp_workers.double, (arrays[7],)).get(60)
        sums = pool.map(mp_workers.double_sum, arrays[:10])
        assert len(results) == 100
        for i, r in enumerate(results):
            assert isinstance(r, cupy.ndarray)
            assert cupy_ipc.open_info(r) is not None, "a result came as a copy, not by handle"
            assert float(r[0]) == 2 * i and float(r[-1]) == 2 * i
        assert float(single[0]) == 14 and cupy_ipc.open_info(single) is not None
        assert sums == [2.0 * i * 4096 for i in range(10)]


def test_process_pool_executor():
    import cupy

    arrays = [cupy.full(1024, i, dtype=cupy.float32) for i in range(8)]
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as ex:
        results = list(ex.map(mp_workers.double, arrays))
        one = ex.submit(mp_workers.double, arrays[3]).result(60)
        assert [float(r[0]) for r in results] == [2.0 * i for i in range(8)]
        assert float(one[5]) == 6
        assert all(cupy_ipc.open_info(r) is not None for r in [*results, one]), "a result came as a copy"


def test_received_array_passed_on_to_a_third_process(ctx):
    to_b, b_to_c, back, done = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    b = ctx.Process(target=mp_workers.forward, args=(to_b, b_to_c, back))
    c = ctx.Process(target=mp_workers.write_value, args=(b_to_c, done, 7.0))
    b.start()
    c.start()
    a, _ = _array()
    to_b.put(a)
    returned = back.get(timeout=60)
    assert returned.data.ptr == a.data.ptr  # B's relay of our memory opens as our memory
    assert done.get(timeout=60) == (N,)
    # C wrote through its own mapping of our allocation: not a copy.
    assert (a.get() == 7).all()
    del returned
    to_b.put(None)


@pytest.mark.parametrize("drop", ["direct", "relayed"])
def test_an_allocation_received_directly_and_relayed_outlives_either_array_dropped(ctx, drop):
    # One allocation reaches C twice, from us and relayed by B: two entries in C's mapping table (each
    # sender's), two opens of one handle, which the driver gives as one pointer (seen on an H200), counted
    # so that the first entry's unmap leaves the second's memory mapped. Either order of drops.
    to_b, b_to_c, back, direct, out = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    b = ctx.Process(target=mp_workers.forward, args=(to_b, b_to_c, back))
    c = ctx.Process(target=mp_workers.read_both, args=(direct, b_to_c, out, drop))
    b.start()
    c.start()
    a, expected = _array(3.0)
    direct.put(a)
    to_b.put(a)
    back.get(timeout=60)  # B's relay of our memory, sent back to us (dropped at once)
    same, mapped, values = out.get(timeout=60)
    assert same, "the driver gave two pointers: the case of one mapping under two entries is not exercised"
    assert mapped == 1  # the dropped array's entry is gone, the other's stays
    np.testing.assert_array_equal(values, expected)
    assert out.get(timeout=60) == 0
    to_b.put(None)
    b.join(60)
    c.join(60)
    assert b.exitcode == 0 and c.exitcode == 0


@pytest.mark.parametrize("kind", ["pool", "vmm"])
def test_received_array_shared_by_descriptor_passed_on_to_a_third_process(ctx, kind):
    # B sends on a stream-ordered pool's allocation with its own descriptor of the pool it imported, and
    # virtual memory (here in two pieces) as the pieces it mapped; C maps the original memory either way.
    import cupy

    import cupy_ipc

    from workers import vmm_array

    if kind == "pool":
        pool = cupy_ipc.ShareableMemoryPool()
        with cupy.cuda.using_allocator(pool.malloc):
            a = cupy.zeros(N, dtype=cupy.float32)
    else:
        a = vmm_array(N, pieces=2)
        a[...] = 0
    h = cupy_ipc.get_ipc_handle(a)
    assert h.kind == kind
    h.release()  # opened by no one: it would stay pinned
    to_b, b_to_c, back, done = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    b = ctx.Process(target=mp_workers.forward, args=(to_b, b_to_c, back))
    c = ctx.Process(target=mp_workers.write_value, args=(b_to_c, done, 7.0))
    b.start()
    c.start()
    to_b.put(a)
    returned = back.get(timeout=60)
    assert done.get(timeout=60) == (N,)
    assert (a.get() == 7).all()  # C wrote through its own mapping of our memory: not a copy
    if kind == "pool":
        assert returned.data.ptr == a.data.ptr  # B's relay of our pool's allocation opens as our memory
    else:  # a mapping of our own pieces, made again here
        returned[1] = 5
        returned.data.device.synchronize()
        assert float(a[1]) == 5
    del returned
    to_b.put(None)
    b.join(60)
    c.join(60)
    assert b.exitcode == 0 and c.exitcode == 0


def test_relayed_array_stays_alive_after_sender_and_relay_drop_it(ctx):
    import cupy

    to_b, b_to_c, back, go, out = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    b = ctx.Process(target=mp_workers.forward, args=(to_b, b_to_c, back))
    c = ctx.Process(target=mp_workers.read_when_told, args=(b_to_c, go, out))
    b.start()
    c.start()
    a = cupy.full(N, 3, dtype=cupy.float32)
    to_b.put(a)
    back.get(timeout=60)
    del a
    gc.collect()
    # The pool would hand the same block to these arrays if nothing pinned it.
    for _ in range(20):
        junk = cupy.full(N, 99, dtype=cupy.float32)
        del junk
    go.put(True)
    out_values = out.get(timeout=60)
    assert (out_values == 3).all()
    to_b.put(None)


def test_only_a_process_forked_after_cuda_was_initialized_warns():
    # A fresh interpreter, where CUDA starts uninitialized and nothing has warned yet.
    code = """
import multiprocessing, time, warnings
import cupy
import cupy_ipc.multiprocessing as mp

def start(method):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        p = mp.get_context(method).Process(target=time.sleep, args=(0,))
        p.start()
    p.join(60)
    print(method, p.exitcode, sum("'fork'" in str(w.message) for w in seen))

start("fork")  # before CUDA: the child could use CUDA
cupy.zeros(1).sum()
start("spawn")
start("fork")
start("fork")  # once
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.split("\n")[:4] == ["fork 0 0", "spawn 0 0", "fork 0 1", "fork 0 0"], done.stderr[-2000:]


def test_fork_after_cuda_raises_ipc_error_in_the_child(monkeypatch):
    import cupy

    import cupy_ipc
    from cupy_ipc import _keepalive

    cupy.zeros(1).sum()  # CUDA is initialized in this process
    before = {p.export_id for p in cupy_ipc.pinned()}
    context = mp.get_context("fork")
    here, there = context.Pipe()
    monkeypatch.setattr(mp, "_warned_fork", False)
    with warnings.catch_warnings(), pytest.warns(RuntimeWarning, match="started with 'fork'"):
        warnings.simplefilter("ignore", DeprecationWarning)  # Python's warning about forking with threads
        p = context.Process(target=mp_workers.receive_error, args=(there,), daemon=True)
        p.start()
    try:
        here.send(cupy.arange(4, dtype=cupy.float32))
        assert here.poll(60)
        message = here.recv()
        assert message.startswith("IpcError") and "forked" in message and "spawn" in message
        p.join(30)
    finally:
        if p.is_alive():
            p.kill()
        for pin in cupy_ipc.pinned():  # the child never opened what we sent: it stays pinned until released
            if pin.export_id not in before:
                _keepalive.release(pin.export_id)


def test_ordinary_pickle_still_copies():
    import cupy

    import cupy_ipc

    a = cupy.arange(1000, dtype=cupy.float64)
    before = len(cupy_ipc.pinned())
    b = pickle.loads(pickle.dumps(a))
    assert isinstance(b, cupy.ndarray) and b.data.ptr != a.data.ptr
    assert (b == a).all()
    assert len(cupy_ipc.pinned()) == before


def test_no_leak_after_a_thousand_messages(ctx):
    import cupy

    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=mp_workers.echo_plus_one, args=(inbox, outbox))
    p.start()

    def exchange(n):
        for i in range(n):
            a = cupy.full(16384, i, dtype=cupy.float32)
            inbox.put(a)
            r = outbox.get(timeout=60)
            assert float(r[0]) == i + 1
            del a, r

    def snapshots():
        inbox.put("state")
        return mp_workers.state(), outbox.get(timeout=60)  # both settled alike

    # Warm-up, then two equal halves. A leak grows in both halves; what is
    # made once shows in the first at most (seen on an H200: the driver opens
    # one more /dev/shm/cuda.shm.* file within the first few hundred messages).
    exchange(100)
    snapshots()
    exchange(500)
    ours_mid, theirs_mid = snapshots()
    exchange(500)
    ours_after, theirs_after = snapshots()
    inbox.put("stop")
    outbox.get(timeout=60)
    p.join(30)
    for side, mid, after in (("ours", ours_mid, ours_after), ("theirs", theirs_mid, theirs_after)):
        opened = Counter(after["fds"]) - Counter(mid["fds"])
        assert not opened, f"{side}: descriptors opened and kept: {dict(opened)}"
        assert after == mid, side
        assert after["pinned"] == 0 and after["mapped"] == 0 and after["claims"] == 0, side


def test_threads_on_both_sides_share_arrays_without_loss(ctx):
    # Four producer threads send fresh and re-sent arrays, by queue and as handle bytes exported on the thread
    # itself, and reallocate the freed memory at once; four consumer threads open and check them, and hold
    # some to check and drop them later on another thread. Memory let go too early would read -99.
    import cupy

    import cupy_ipc

    threads, per_thread, n = 4, 120, 1 << 16
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=mp_workers.check_from_threads, args=(inbox, outbox, threads))
    p.start()
    errors = []

    def produce(t):
        try:
            # A blocking stream: the event a Queue records while pickling, on the default stream, follows it.
            with cupy.cuda.Stream():
                kept = cupy.full(n, -1.0 - t, cupy.float32)
                for k in range(per_thread):
                    if k % 4 == 0:  # the same array again
                        value, item = -1.0 - t, kept
                    else:
                        value = float(t * 1000 + k)
                        item = cupy.full(n, value, cupy.float32)
                    if t % 2:  # exported here, on this thread's stream
                        item = cupy_ipc.get_ipc_handle(item).to_bytes()
                    inbox.put((value, item))
                    del item
                    cupy.full(n, -99.0, cupy.float32)  # takes a block freed too early, if any
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"producer thread {t}: {type(e).__name__}: {e}")

    stuck = mp_workers.run_threads(produce, threads, 120)
    for _ in range(threads):
        inbox.put(None)
    checks, wrong, their_errors, theirs = outbox.get(timeout=300)
    p.join(30)
    assert stuck == [], "producer threads did not finish"
    assert errors == [] and their_errors == []
    assert wrong == []
    assert checks["at once"] == threads * per_thread and checks["held"] > 0
    assert theirs["mapped"] == 0 and theirs["claims"] == 0
    deadline = time.monotonic() + 20  # the consumer has exited: nothing holds our exports any more
    while cupy_ipc.pinned() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cupy_ipc.pinned() == []


def test_events_travel_and_come_back_as_the_same_objects(ctx):
    import cupy

    import cupy_ipc

    from workers import spin, warm_up

    warm_up()
    here, there = ctx.Pipe()
    p = ctx.Process(target=mp_workers.check_event, args=(there,))
    p.start()
    ev = cupy.cuda.Event(disable_timing=True, interprocess=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    spin(2.0, stream)
    ev.record(stream)
    here.send(ev)
    assert here.poll(60)
    kind, done_at_arrival, waited, same = here.recv()
    assert kind == "cupy.cuda.stream.Event"
    assert not done_at_arrival and waited > 0.5  # the child really waited on our kernel
    assert same is ev
    stream.synchronize()

    own = cupy_ipc.IpcEvent()
    here2, there2 = ctx.Pipe()
    q = ctx.Process(target=mp_workers.check_event, args=(there2,))
    q.start()
    own.record()
    here2.send(own)
    assert here2.poll(60)
    kind, _, _, same = here2.recv()
    assert kind == "cupy_ipc._events.IpcEvent" and same is own


def test_non_interprocess_event_is_refused_clearly():
    import cupy

    from cupy_ipc import IpcError

    with pytest.raises(IpcError, match="interprocess=True"):
        mp.reduction.ForkingPickler.dumps(cupy.cuda.Event())


@pytest.mark.multi_gpu(2)
def test_array_on_another_device_arrives_mapped_on_the_receivers_gpu(ctx):
    import cupy

    from cupy_ipc._cuda import device_uuid

    with cupy.cuda.Device(1):
        a = cupy.full(1000, 2, dtype=cupy.float32)
    with mp.get_context("spawn").Pool(1) as pool:
        ordinal, uuid, total = pool.apply(mp_workers.device_of, (a,))
    # The worker's current GPU is 0: the array is mapped there, the memory found on GPU 1 by UUID.
    assert ordinal == 0 and uuid == device_uuid(1) and total == 2000


def test_an_array_that_cannot_be_shared_reaches_the_receiver_as_an_error():
    # A queue pickles on its feeder thread: without care the message is dropped and the receiver waits forever.
    import cupy

    from workers import queue_worker

    with queue_worker() as (inbox, out):
        managed = cupy.ndarray((256,), cupy.float32, cupy.cuda.MemoryPointer(cupy.cuda.memory.ManagedMemory(1024), 0))
        inbox.put(managed)
        inbox.put(cupy.ones(256, cupy.float32))
        got = out.get(timeout=60)
        assert got.startswith("IpcError: the sender could not share a cupy.ndarray") and "managed memory" in got
        assert out.get(timeout=60)[0] == 256.0  # the next message still arrives


def test_a_message_that_fails_to_pickle_releases_the_arrays_it_exported(ctx):
    import time

    import cupy

    import cupy_ipc

    a, b = cupy.ones(256, cupy.float32), cupy.zeros(256, cupy.float32)
    before = {p.export_id for p in cupy_ipc.pinned()}

    def new_pins():
        return {p.export_id for p in cupy_ipc.pinned()} - before

    send, _ = ctx.Pipe()
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        send.send((a, b, lambda: 0))  # a lambda cannot be pickled: the message never leaves
    assert not new_pins()
    # A queue pickles on its feeder thread, which reports the error and drops the message.
    q = ctx.Queue()
    q.put([a, lambda: 0])
    q.put(b)  # after the failed one: once it arrives, the feeder is done with that
    got = q.get(timeout=30)
    assert got.data.ptr == b.data.ptr and float(got.sum()) == 0
    del got  # its own export ends once this view is gone
    deadline = time.monotonic() + 10
    while new_pins() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not new_pins()
    q.close()
    q.join_thread()


def test_an_array_put_on_a_queue_after_work_on_a_blocking_stream_arrives_finished():
    # The queue's feeder thread exports on the legacy default stream, which waits for the blocking streams.
    import cupy

    from workers import queue_worker, spin, warm_up

    warm_up()
    with queue_worker() as (inbox, outbox):
        inbox.put(cupy.ones(16, cupy.float32))  # the consumer's kernels, loaded before the test
        assert outbox.get(timeout=60)[0] == 16
        a = cupy.zeros(1 << 20, cupy.float32)
        cupy.cuda.runtime.deviceSynchronize()
        s = cupy.cuda.Stream()  # blocking
        spin(3.0, s)
        with s:
            a.fill(7)
        inbox.put(a)
        assert outbox.get(timeout=60)[0] == 7 * (1 << 20)


def test_an_array_whose_send_fails_is_not_left_pinned(ctx):
    import cupy

    import cupy_ipc

    a = cupy.ones(256, cupy.float32)
    before = {p.export_id for p in cupy_ipc.pinned()}
    here, there = ctx.Pipe()
    there.close()  # a receiver that died
    with pytest.raises(OSError):
        here.send(a)
    q = ctx.SimpleQueue()
    q._reader.close()
    with pytest.raises(OSError):
        q.put([a, a[1:]])
    assert {p.export_id for p in cupy_ipc.pinned()} - before == set()


def test_an_array_given_to_a_process_that_cannot_be_started_is_not_left_pinned(refuse_spawns):
    import cupy

    import cupy_ipc

    a = cupy.ones(256, cupy.float32)
    before = {p.export_id for p in cupy_ipc.pinned()}
    refuse_spawns()
    with pytest.raises(BlockingIOError):
        mp.get_context("spawn").Process(target=len, args=(a,)).start()  # its arguments pickled, then refused
    assert {p.export_id for p in cupy_ipc.pinned()} - before == set()


def test_a_message_lease_ends_the_pin_of_an_array_nobody_received_in_time(ctx):
    import time

    import cupy

    import cupy_ipc

    a, b = cupy.ones(256, cupy.float32), cupy.zeros(256, cupy.float32)
    before = {p.export_id for p in cupy_ipc.pinned()}
    here, there = ctx.Pipe()
    assert mp.set_message_lease(0.3) is None
    try:
        here.send(a)  # nobody receives it in time (a receiver that died, a queue nobody reads)
    finally:
        assert mp.set_message_lease(None) == 0.3
    here.send(b)  # sent with no lease: the control
    time.sleep(1.0)
    cupy_ipc.collect()
    left = [p for p in cupy_ipc.pinned() if p.export_id not in before]
    assert [(p.lease_left_s, p.revoked) for p in left] == [(None, False)], left  # b's; a's has ended
    receiver = ctx.Process(target=mp_workers.receive_error, args=(there,))
    receiver.start()
    got = here.recv()
    assert got.startswith("IpcError:") and "no longer shares this memory" in got, got
    receiver.join(30)
    got = there.recv()  # b, still shared (here: the sender's own memory)
    assert got.data.ptr == b.data.ptr and float(got.sum()) == 0
    with pytest.raises(ValueError, match="lease must be"):
        mp.set_message_lease(0)
    assert mp.set_message_lease(None) is None


def test_a_pool_task_whose_array_is_received_after_its_lease_fails_and_the_pool_goes_on():
    # The worker raised unpickling the task and died, the task lost: the pool's caller waited for ever.
    import cupy

    import cupy_ipc

    a = cupy.full(N, 2, dtype=cupy.float32)
    with mp.get_context("spawn").Pool(1) as pool:
        assert pool.apply_async(mp_workers.double_sum, (a,)).get(timeout=120) == 4 * N  # the worker is up
        old = mp.set_message_lease(1.0)  # (the pool pickles its tasks on a thread of its own: kept until done)
        try:
            busy = pool.apply_async(time.sleep, (3,))
            late = pool.apply_async(mp_workers.double_sum, (a,))  # read by the worker after its lease
            with pytest.raises(cupy_ipc.IpcError, match="no longer shares this memory"):
                late.get(timeout=120)
            busy.get(timeout=60)
            assert pool.apply_async(mp_workers.double_sum, (a,)).get(timeout=120) == 4 * N  # in time
        finally:
            mp.set_message_lease(old)


def test_an_executor_task_whose_array_is_received_after_its_lease_fails_alone():
    # The worker died unpickling the task: the executor broke, every pending task with it.
    import cupy

    import cupy_ipc

    a = cupy.full(N, 2, dtype=cupy.float32)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        assert ex.submit(mp_workers.double_sum, a).result(120) == 4 * N  # the worker is up
        old = mp.set_message_lease(1.0)  # (the executor pickles its tasks on a thread of its own)
        try:
            busy = ex.submit(time.sleep, 3)
            late = ex.submit(mp_workers.double_sum, a)  # read by the worker after its lease
            after = ex.submit(len, [1, 2])
            with pytest.raises(cupy_ipc.IpcError, match="no longer shares this memory"):
                late.result(120)
            assert busy.result(60) is None and after.result(60) == 2
        finally:
            mp.set_message_lease(old)


@pytest.mark.parametrize("ctx", ["spawn", "forkserver"], indirect=True)
@pytest.mark.parametrize("busy", [0.0, 2.0], ids=["sender-idle", "sender-gpu-busy"])
def test_an_array_from_a_process_that_ends_at_once_arrives_whole(ctx, busy):
    # A worker that puts its result and returns ends, and CUDA frees its memory: received after that, the array
    # raised ProducerExitedError (the receiver raced the sender's exit). It now waits at exit until the array is
    # opened, then until its GPU has finished the work on the memory, which its end would cut short. A
    # forkserver child dropped that wait with the finalizers it inherited, before its target ran.
    q = ctx.Queue()
    p = ctx.Process(target=mp_workers.put_filled_and_end, args=(q, N, 3.0, busy))
    p.start()
    if not busy:
        time.sleep(1.5)  # by now the sender has put its array and returned
    got = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    assert cupy_ipc.open_info(got) is not None  # by handle: a copy would not race the sender's exit
    assert float(got.min()) == 3.0 == float(got.max())


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_pool_whose_workers_end_after_each_task_returns_every_array(method):
    # A worker that ends after its task raced the pool's result handler for its result: opened after the
    # worker's exit, it raised there, which ends the handler's thread, and the pool waited for ever.
    with mp.get_context(method).Pool(2, maxtasksperchild=1) as pool:
        results = pool.map_async(mp_workers.filled, [float(i) for i in range(6)]).get(120)
    assert [(float(r.min()), float(r.max())) for r in results] == [(float(i), float(i)) for i in range(6)]
    assert all(cupy_ipc.open_info(r) is not None for r in results)  # by handle: a copy races no worker's exit


def test_a_process_whose_array_nobody_receives_ends_after_its_exit_wait(ctx, capfd):
    q = ctx.Queue()  # never read
    p = ctx.Process(target=mp_workers.put_filled_and_end, args=(q, 256, 1.0, 0.0, 0.5))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    err = capfd.readouterr().err
    assert "exits with 1 array(s) it sent that no receiver opened within 0.5 s" in err, err
