"""Stream-ordered pool memory shared by file descriptor, on a GPU, between real processes."""

from __future__ import annotations

import os
import socket
import time
from collections import Counter

import numpy as np
import pytest

from workers import open_fd_paths

pytestmark = pytest.mark.gpu

N = 1 << 16


def _shareable(n=N, offset=0.0):
    import cupy

    import cupy_ipc

    pool = cupy_ipc.ShareableMemoryPool()
    with cupy.cuda.using_allocator(pool.malloc):
        a = cupy.arange(n, dtype=cupy.float32) + offset
    return pool, a


def _expected_sum(n=N, offset=0.0):
    return float(np.arange(n, dtype=np.float64).sum() + n * offset)


def test_a_pool_array_that_the_garbage_collector_frees_inside_the_librarys_code_is_let_go(remote):
    # Letting an imported pool allocation go takes the pools' lock: run by a collection that interrupted code
    # holding it, on the same thread, it would wait forever.
    import cupy_ipc

    pool, a = _shareable()
    consumer = remote()
    r = consumer.call("collect_a_cycle_holding_the_pools_lock", cupy_ipc.get_ipc_handle(a).to_bytes())
    assert r == {"value": 0.0, "stuck": False, "mapped": 0}


def test_a_pool_array_released_on_the_librarys_thread_is_unmapped_there(remote):
    # That thread may have made no runtime call, and so have no CUDA context, which the driver's calls ask for:
    # the unmap makes the mapping's GPU current there. (On an H200 with driver 580 the free succeeded without
    # it too; a failed free would leave the import, and the claim would still go.)
    import cupy_ipc

    pool, a = _shareable()
    consumer = remote()
    r = consumer.call("release_on_the_librarys_thread", cupy_ipc.get_ipc_handle(a).to_bytes())
    assert r == {"value": 0.0, "mapped": 0, "imported": 0, "warned": []}


def test_pool_array_round_trips_as_bytes_through_pidfd_getfd(remote):
    import cupy

    import cupy_ipc

    pool, a = _shareable()
    h = cupy_ipc.get_ipc_handle(a)
    assert h.kind == "pool" and pool.used_bytes() >= a.nbytes
    assert not os.get_inheritable(h._f.fd)  # the exported pool's: programs started here do not keep it
    consumer = remote()
    r = consumer.call("open_pool_bytes", h.to_bytes())
    assert r == {"kind": "pool", "sum": _expected_sum(), "pools_imported": 1}
    assert float(a[0]) == -1  # the consumer's write landed in our memory
    # A second array of the same pool: the pool is not imported again.
    with cupy.cuda.using_allocator(pool.malloc):
        b = cupy.ones(N, dtype=cupy.float32)
    r = consumer.call("open_pool_bytes", cupy_ipc.get_ipc_handle(b).to_bytes())
    assert r["sum"] == N and r["pools_imported"] == 1


def test_pool_handle_and_descriptor_over_a_unix_socket(remote):
    import cupy_ipc

    pool, a = _shareable(offset=1.0)
    ours, theirs = socket.socketpair()
    consumer = remote()
    with ours:
        consumer.send("recv_pool_handle", theirs)  # the socket itself travels to the helper
        theirs.close()
        cupy_ipc.send_handle(ours, cupy_ipc.get_ipc_handle(a))
        r = consumer.result()
    assert r == {"sum": _expected_sum(offset=1.0), "descriptor_came_along": True, "pools_imported": 1}


def test_pool_arrays_through_cupy_ipc_multiprocessing():
    import cupy

    from cupy_ipc import _fdserver

    from workers import queue_worker

    with queue_worker() as (q, out):
        pool, a = _shareable()
        with cupy.cuda.using_allocator(pool.malloc):
            b = cupy.full(N, 3, dtype=cupy.float32)
        served = _fdserver.served()
        q.put(a)
        assert out.get(timeout=60)[:2] == (_expected_sum(), 1)
        q.put(b)
        assert out.get(timeout=60)[:2] == (3.0 * N, 1)  # same pool: imported once
        assert _fdserver.served() - served == 1  # its descriptor crossed once
        for k in range(300):  # the same array again and again: no descriptor crosses, none leaks
            q.put(b)
            fds = out.get(timeout=60)[2]
            if k == 100:
                mid = fds
        assert fds == mid and _fdserver.served() - served == 1


def test_a_pool_array_sent_again_keeps_its_import_with_a_claim_on_the_producers_memory(remote):
    # An imported pool allocation must be freed before its producer frees it (CUDA's rule): the consumer keeps
    # one idle only with a claim, which keeps the producer's pin; and only for an allocation sent again.
    import cupy

    import cupy_ipc

    pool, a = _shareable()
    with cupy.cuda.using_allocator(pool.malloc):
        once = cupy.full(N, 7, dtype=cupy.float32)
    consumer = remote()
    before = len(cupy_ipc.pinned())
    got = consumer.call("open_each", [cupy_ipc.get_ipc_handle(once).to_bytes()])
    assert (got[0]["value"], got[0]["idle"], got[0]["claims"]) == (7.0, 0, 0)  # sent once: nothing kept
    got = consumer.call("open_each", [cupy_ipc.get_ipc_handle(a).to_bytes() for _ in range(4)])
    assert [g["value"] for g in got] == [0.0] * 4
    assert [(g["idle"], g["claims"]) for g in got] == [(0, 0), (1, 1), (1, 1), (1, 1)]
    assert got[3]["ptr"] == got[2]["ptr"] == got[1]["ptr"]  # re-opened from the idle import
    cupy_ipc.collect()
    assert len(cupy_ipc.pinned()) == before + 1  # the last export, claimed by the idle import
    assert consumer.call("collect_and_count") == {"mapped": 0, "idle": 0, "claims": 0, "idle_fds": 0}
    cupy_ipc.collect()
    assert len(cupy_ipc.pinned()) == before


def test_consumer_keeps_reading_after_the_producer_is_killed(remote):
    import cupy_ipc

    producer = remote()
    data = producer.call("pool_producer", N, 5.0)
    h = cupy_ipc.IpcArrayHandle.from_bytes(data)
    a = h.open()
    assert float(a.sum()) == _expected_sum(offset=5.0)
    second = producer.call("pool_producer", N, 7.0)
    producer.kill()
    time.sleep(0.5)
    # The driver counts references to the pool's memory: ours keeps it.
    assert float(a.sum()) == _expected_sum(offset=5.0)
    assert float(a[10]) == 15.0
    with pytest.raises(cupy_ipc.ProducerExitedError):
        cupy_ipc.IpcArrayHandle.from_bytes(second).open()
    h.close()
    del a


def test_a_consumer_lets_go_of_the_pool_of_a_producer_that_exited_once_it_maps_nothing_of_it(remote):
    consumer, first, second, third = remote(), remote(), remote(), remote()
    # A pool of a live producer first, held (collect() lets go of a pool nothing is mapped from): CUDA's own
    # descriptors are open before the count below.
    consumer.call("hold", second.call("pool_producer", N), "live")
    before = consumer.call("collect_pools")
    assert before["pools_imported"] == 1
    consumer.call("hold", first.call("pool_producer", N, 3.0), "a")
    first.kill()
    time.sleep(0.5)
    held = consumer.call("collect_pools")  # an array of the pool is alive: the pool stays
    assert held["pools_imported"] == before["pools_imported"] + 1
    np.testing.assert_array_equal(consumer.call("read_held", "a")[:3], [3.0, 4.0, 5.0])
    consumer.call("drop", "a")
    after = consumer.call("collect_pools")  # nothing mapped any more, and the producer is gone
    assert after == before  # the pool's descriptor is closed (collect() lets go of unused pools of live producers too)
    # A new producer's pool imports as before, with the access the import gives (a pool handle let go may
    # be the driver's value for the new one).
    r = consumer.call("open_pool_bytes", third.call("pool_producer", N, 1.0))
    assert r["sum"] == _expected_sum(offset=1.0) and r["pools_imported"] == before["pools_imported"] + 1


def test_a_pool_that_its_live_producer_dropped_gives_its_memory_back_at_the_consumers_collect(remote):
    # A consumer's import keeps the pool's memory allocated, even once its producer destroyed the pool: collect()
    # lets go of every imported pool nothing is mapped from (before, only those of producers that had exited).
    import cupy

    import cupy_ipc

    consumer = remote()
    consumer.call("warm_up")
    cupy.cuda.Device().synchronize()
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    n = 1 << 28  # 1 GiB of float32
    pool, a = _shareable(n)
    assert consumer.call("open_pool_bytes", cupy_ipc.get_ipc_handle(a).to_bytes())["kind"] == "pool"
    assert consumer.call("collect_pools")["pools_imported"] == 0  # let go of: nothing of it is mapped
    a[0] = 7.0
    r = consumer.call("open_pool_bytes", cupy_ipc.get_ipc_handle(a).to_bytes())  # imported again
    assert r["kind"] == "pool" and r["pools_imported"] == 1
    assert float(a[0]) == -1.0  # its write landed in this memory
    consumer.call("collect_pools")  # its idle mapping and the pool let go of, as after the first open
    del a, pool  # the pool is destroyed once its pin ends: the consumer has closed the array
    deadline = time.monotonic() + 10
    while cupy_ipc.pinned() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cupy_ipc.pinned() == []
    consumer.call("collect_pools")
    deadline = time.monotonic() + 10
    while cupy.cuda.runtime.memGetInfo()[0] < free_before - (256 << 20) and time.monotonic() < deadline:
        time.sleep(0.05)
    held = free_before - cupy.cuda.runtime.memGetInfo()[0]
    assert held < 256 << 20, f"{held >> 20} MiB still held after the producer dropped the pool"


def test_a_pool_received_from_its_producer_and_from_a_relay_that_exits_stays_imported(remote):
    # The driver imports a pool once per process (seen on an H200: one handle for every descriptor of it), so
    # C's import from us and its import of B's relay are one pool under two keys. B exiting must let go of
    # B's key only: destroying the pool for it would destroy ours.
    import cupy

    import cupy_ipc

    relay, consumer = remote(), remote()
    pool, a = _shareable(offset=1.0)
    with cupy.cuda.using_allocator(pool.malloc):  # two more allocations of the same pool
        b = cupy.arange(N, dtype=cupy.float32) + 2.0
        c = cupy.arange(N, dtype=cupy.float32) + 3.0
    consumer.call("hold", cupy_ipc.get_ipc_handle(a).to_bytes(), "direct")
    relayed = relay.call("hold_and_send_on", cupy_ipc.get_ipc_handle(b).to_bytes(), "b")
    consumer.call("hold", relayed, "relayed")
    np.testing.assert_array_equal(consumer.call("read_held", "relayed")[:2], [2.0, 3.0])
    np.testing.assert_array_equal(consumer.call("read_held", "direct")[:2], [1.0, 2.0])
    two_keys = consumer.call("state")["pools"]
    consumer.call("drop", "relayed")
    consumer.call("drop", "direct")  # (the driver defers a pool's destruction while a pointer of it lives)
    relay.kill()
    time.sleep(0.5)
    consumer.call("release_exited")  # B's key goes: B exited, and nothing of it is mapped
    assert consumer.call("state")["pools"] == two_keys - 1
    assert consumer.call("open_pool_bytes", cupy_ipc.get_ipc_handle(c).to_bytes())["sum"] == \
        _expected_sum(offset=3.0)  # the pool, imported under our key, still imports its allocations


def test_a_pool_without_a_shareable_handle_type_is_refused_with_advice():
    import cupy

    import cupy_ipc

    with cupy.cuda.using_allocator(cupy.cuda.MemoryAsyncPool("default").malloc):  # the device's default pool
        a = cupy.zeros(16, cupy.float32)
    with pytest.raises(cupy_ipc.IpcError, match="ShareableMemoryPool"):
        cupy_ipc.get_ipc_handle(a)


def test_no_descriptor_leak_over_many_round_trips(remote):
    import cupy

    import cupy_ipc

    pool, _ = _shareable()
    consumer = remote()

    def trips(n):
        for i in range(n):
            with cupy.cuda.using_allocator(pool.malloc):
                a = cupy.full(1024, i, dtype=cupy.float32)
            assert consumer.call("open_pool_bytes", cupy_ipc.get_ipc_handle(a).to_bytes())["sum"] == 1024.0 * i
            del a

    def fds():
        cupy_ipc.collect()
        return open_fd_paths(), consumer.call("open_fd_paths")

    # Warm-up, then two equal halves: a leak grows in both. Seen on an H200:
    # the driver opens one more /dev/shm/cuda.shm.* file after some hundreds of
    # exports (between the 300th and 550th here), so the halves start at 600.
    trips(100)
    fds()
    trips(500)
    mid = fds()
    trips(500)
    after = fds()
    assert after[1] == mid[1], Counter(after[1]) - Counter(mid[1])
    assert after[0] == mid[0], Counter(after[0]) - Counter(mid[0])


def test_two_pools_keep_their_own_blocks_and_leave_the_devices_current_pool_alone():
    import cupy
    from cupy.cuda import runtime

    import cupy_ipc
    from cupy_ipc import _pools

    before = runtime.deviceGetMemPool(0)
    first, second = cupy_ipc.ShareableMemoryPool(), cupy_ipc.ShareableMemoryPool(device=0)
    assert runtime.deviceGetMemPool(0) == before
    with cupy.cuda.using_allocator(first.malloc):
        a = cupy.ones(N, cupy.float32)
    with cupy.cuda.using_allocator(second.malloc):
        b = cupy.ones(N, cupy.float32)
    assert _pools.pool_of(a.data.ptr) == first.handles[0] != _pools.pool_of(b.data.ptr) == second.handles[0]
    assert first.used_bytes() >= a.nbytes and first.total_bytes() >= first.used_bytes()
    del a
    cupy.cuda.get_current_stream().synchronize()
    first.free_all_blocks()
    assert first.used_bytes() == 0


def test_a_dropped_pool_gives_its_memory_and_its_descriptor_back():
    import gc
    import weakref

    import cupy
    from cupy.cuda import runtime

    import cupy_ipc
    from cupy_ipc import _pools

    cupy.cuda.Device(0).use()
    gc.collect()  # what earlier tests left to collect goes now, not during the count below
    free = runtime.memGetInfo()[0]
    pool = cupy_ipc.ShareableMemoryPool(device=0)
    with cupy.cuda.using_allocator(pool.malloc):
        a = cupy.ones(64 << 20, cupy.float32)  # 256 MiB
    h = cupy_ipc.get_ipc_handle(a)  # exports the pool: a descriptor of it opens here
    handle = pool.handles[0]
    fd = _pools._exports[handle][0]
    exported = os.fstat(fd)
    h.release()
    del a, h
    cupy.cuda.get_current_stream().synchronize()
    assert pool.used_bytes() == 0 and pool.total_bytes() >= 256 << 20  # freed blocks stay in the pool
    assert runtime.memGetInfo()[0] <= free - (256 << 20)
    gone = weakref.ref(pool)
    del pool  # the last reference to it, and to its driver pools: they go now, without the garbage collector
    assert gone() is None
    assert handle not in _pools._exports
    try:
        now = os.fstat(fd)
    except OSError:  # closed
        pass
    else:
        assert not os.path.samestat(now, exported), "the pool's descriptor is still open"
    assert runtime.memGetInfo()[0] >= free - (32 << 20)  # back to the driver
    # A new pool (the driver may give it the old handle's value) exports and opens as usual.
    pool, b = _shareable()
    assert float(cupy_ipc.get_ipc_handle(b).open().sum()) == _expected_sum()


@pytest.mark.parametrize("kind", ["pool", "vmm"])
def test_all_gather_of_memory_shared_by_descriptor_needs_no_pidfd_getfd(kind):
    # Ranks under torchrun are siblings, which Yama's ptrace_scope 1 keeps from pidfd_getfd on each other: the
    # descriptors must come from each rank's server, whose address is gathered with its handle. Two ranks on one GPU.
    import importlib.util
    import pathlib
    import subprocess
    import sys

    if importlib.util.find_spec("torch") is None:
        pytest.skip("PyTorch is not installed")
    worker = pathlib.Path(__file__).parent / "dist_worker.py"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(worker), "torch", "gloo", "--by-descriptor", kind], capture_output=True, text=True,
                       timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "RANK 0 OK" in out and "RANK 1 OK" in out, out[-4000:]
