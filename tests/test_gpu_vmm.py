"""Memory of CUDA's virtual memory API shared by file descriptor, on a GPU, between real processes."""

from __future__ import annotations

import importlib.util
import os
import socket
import time
import warnings

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

N = 1 << 20  # 4 MiB: two pieces of the minimum granularity on an H200 (2 MiB)
EXPECTED = float(np.arange(N, dtype=np.float64).sum())


def test_vmm_array_round_trips_as_bytes_and_over_a_unix_socket(remote):
    import cupy_ipc

    from workers import vmm_array

    a = vmm_array(N)
    h = cupy_ipc.get_ipc_handle(a)
    assert h.kind == "vmm"
    assert not os.get_inheritable(h._f.fd)  # the exported piece's: programs started here do not keep it
    consumer = remote()
    r = consumer.call("open_pool_bytes", h.to_bytes())  # any kind: the descriptor taken with pidfd_getfd
    assert r["kind"] == "vmm" and r["sum"] == pytest.approx(EXPECTED, rel=1e-6)
    assert float(a[0]) == -1  # the consumer's write landed here
    a[0] = 0
    ours, theirs = socket.socketpair()
    with ours:
        consumer.send("recv_pool_handle", theirs)
        theirs.close()
        cupy_ipc.send_handle(ours, cupy_ipc.get_ipc_handle(a))
        r = consumer.result()
    assert r["sum"] == pytest.approx(EXPECTED, rel=1e-6) and r["descriptor_came_along"]


def test_an_array_over_several_pieces_maps_whole(remote):
    # Four allocations mapped one after another, as PyTorch's expandable segments map theirs.
    import cupy_ipc

    from workers import vmm_array

    n = 2 * N  # 8 MiB in four pieces of 2 MiB, the H200's granularity
    a = vmm_array(n, pieces=4)
    h = cupy_ipc.get_ipc_handle(a)
    assert len(h._f.more) >= 1, "the array should span several pieces"
    consumer = remote()
    expected = float(np.arange(n, dtype=np.float64).sum())
    assert consumer.call("open_pool_bytes", h.to_bytes())["sum"] == pytest.approx(expected, rel=1e-6)
    a[0] = 0  # the consumer wrote -1 there
    view = a[n // 8: n - n // 8]  # starts inside the first piece, ends inside the last
    r = consumer.call("open_pool_bytes", cupy_ipc.get_ipc_handle(view).to_bytes())
    assert r["sum"] == pytest.approx(float(np.arange(n // 8, n - n // 8, dtype=np.float64).sum()), rel=1e-6)
    ours, theirs = socket.socketpair()
    with ours:
        consumer.send("recv_pool_handle", theirs)
        theirs.close()
        cupy_ipc.send_handle(ours, cupy_ipc.get_ipc_handle(a))  # h allowed one open, and had it
        assert consumer.result()["descriptor_came_along"]


def test_vmm_arrays_through_cupy_ipc_multiprocessing():
    import cupy_ipc
    from cupy_ipc import _fdserver

    import workers

    with workers.queue_worker() as (q, out):
        served = _fdserver.served()
        q.put(workers.vmm_array(N))  # sent from the queue's feeder thread, which has no CUDA context of its own
        assert out.get(timeout=60)[0] == pytest.approx(EXPECTED, rel=1e-6)
        q.put(workers.vmm_array(2 * N, pieces=4))
        assert out.get(timeout=60)[0] == pytest.approx(float(np.arange(2 * N, dtype=np.float64).sum()), rel=1e-6)
        assert _fdserver.served() - served == 5  # one descriptor per piece, asked for by the receiver

        def trips(n):
            for _ in range(n):
                q.put(workers.vmm_array(4096))
                got = out.get(timeout=60)
                assert got[0] == float(np.arange(4096).sum())
            cupy_ipc.collect()
            return got[2], len(os.listdir("/proc/self/fd"))

        trips(100)
        mid = trips(200)
        assert trips(200) == mid  # fresh allocations: no descriptor leaks on either side


def test_consumer_keeps_reading_vmm_memory_after_the_producer_is_killed(remote):
    import cupy_ipc

    producer = remote()
    h = cupy_ipc.IpcArrayHandle.from_bytes(producer.call("vmm_producer", N))
    a = h.open()
    total = float(a.sum())
    assert total == pytest.approx(EXPECTED, rel=1e-6)
    producer.kill()
    time.sleep(0.5)
    assert float(a.sum()) == total and float(a[7]) == 7.0
    h.close()
    del a


def test_vmm_without_a_shareable_handle_type_is_refused_with_advice():
    import cupy_ipc

    from workers import vmm_array

    with pytest.raises(cupy_ipc.IpcError, match="without a shareable handle type"):
        cupy_ipc.get_ipc_handle(vmm_array(1024, shareable=False))


def test_the_producer_closes_descriptors_of_freed_allocations(remote):
    import cupy_ipc

    from workers import vmm_array

    consumer = remote()

    def trips(n):
        for _ in range(n):
            a = vmm_array(4096)
            assert consumer.call("open_pool_bytes", cupy_ipc.get_ipc_handle(a).to_bytes())["sum"] == \
                float(np.arange(4096).sum())
            del a

    def fds():
        cupy_ipc.collect()
        return len(os.listdir("/proc/self/fd")), consumer.call("open_fds")

    trips(100)
    mid = fds()
    trips(200)
    assert fds() == mid


def test_a_handle_whose_descriptor_number_went_to_other_memory_is_refused(remote):
    # Without keep-alive the producer may free the memory once the handle has left, close its descriptor, and
    # the kernel gives the number to the next export: a consumer asking for the old handle's number must not
    # be handed the new memory.
    import gc

    import cupy

    import cupy_ipc
    from cupy_ipc import _fdserver
    from cupy_ipc._array_handle import _may_serve as _exported

    from workers import vmm_array

    consumer = remote()
    old = cupy_ipc.get_ipc_handle(vmm_array(N), keepalive=False, sync=False)  # the array is gone at once
    data, number, address = old.to_bytes(), old._f.fd, _fdserver.serve(_exported, old._f.resource)
    del old
    gc.collect()
    cupy.cuda.runtime.deviceSynchronize()
    cupy_ipc.collect()  # closes the freed allocation's descriptor
    kept = []
    for _ in range(64):  # each export takes the lowest free number: one of them gets the old one
        b = vmm_array(N)
        b += 1
        kept.append(b)
        new = cupy_ipc.get_ipc_handle(b, keepalive=False, sync=False)
        if new._f.fd == number:
            break
    else:
        pytest.fail(f"no export got descriptor number {number} again")
    cupy.cuda.runtime.deviceSynchronize()
    assert "no longer shares this memory" in consumer.call("open_served", data, address)
    address = _fdserver.serve(_exported, new._f.resource)
    assert consumer.call("open_served", new.to_bytes(), address) == pytest.approx(EXPECTED + N, rel=1e-6)


def test_a_waiting_handle_of_several_pieces_is_served_however_many_runs_are_exported_after_it(remote, monkeypatch):
    # The descriptor server knows a run of pieces by the producer's run table; with that table bounded at
    # two runs, two more runs exported while the first handle waits must not make the server refuse it.
    import cupy

    import cupy_ipc
    from cupy_ipc import _fdserver, _vmm
    from cupy_ipc._array_handle import _may_serve as _exported

    from workers import vmm_array

    monkeypatch.setattr(_vmm, "_runs", {})  # this test's runs only
    monkeypatch.setattr(_vmm, "_RUNS_FLOOR", 2)
    monkeypatch.setattr(_vmm, "_runs_prune_at", 2)
    consumer = remote()
    arrays = [vmm_array(2 * N, pieces=2) for _ in range(3)]
    handles = [cupy_ipc.get_ipc_handle(a) for a in arrays]  # the first waits while the others are exported
    assert all(len(h._f.more) == 1 for h in handles)  # runs of two pieces each
    assert len({h._f.resource for h in handles}) == 3 and len(_vmm._runs) == 3
    cupy.cuda.runtime.deviceSynchronize()
    total = float(np.arange(2 * N, dtype=np.float64).sum())
    address = _fdserver.serve(_exported, handles[0]._f.resource)
    assert consumer.call("open_served", handles[0].to_bytes(), address) == pytest.approx(total, rel=1e-6)
    # A run with a piece freed goes at the next prune (the table holds 3 of a bound of 4 now); the live ones
    # stay.
    gone = handles[1]._f.resource
    handles.pop(1).release()  # unopened: its pin ends, and the memory goes with the array
    del arrays[1]
    cupy_ipc.collect()  # the sweep closes the freed pieces' descriptors
    assert gone in _vmm._runs.values()
    arrays += [vmm_array(2 * N, pieces=2) for _ in range(2)]
    handles += [cupy_ipc.get_ipc_handle(a) for a in arrays[-2:]]
    assert gone not in _vmm._runs.values()
    assert {h._f.resource for h in handles} <= set(_vmm._runs.values())
    address = _fdserver.serve(_exported, handles[1]._f.resource)
    assert consumer.call("open_served", handles[1].to_bytes(), address) == pytest.approx(total, rel=1e-6)
    for h in handles:
        h.release()


def test_descriptors_of_freed_allocations_stay_bounded_between_collects(remote):
    # Exports sweep only once the descriptors kept have doubled (64 at least): never more are open.
    import cupy_ipc
    from cupy_ipc import _vmm

    from workers import vmm_array

    consumer = remote()
    cupy_ipc.collect()
    start, kept = len(os.listdir("/proc/self/fd")), []
    for _ in range(300):
        a = vmm_array(4096)
        assert consumer.call("open_pool_bytes", cupy_ipc.get_ipc_handle(a).to_bytes())["sum"] == \
            float(np.arange(4096).sum())
        del a
        kept.append(len(_vmm._exports))
        # The descriptor server's index names exactly the descriptors of the table.
        assert _vmm._by_fd == {fd: alloc_id for alloc_id, (fd, _) in _vmm._exports.items()}
    assert max(kept) <= _vmm._SWEEP_FLOOR and min(kept[_vmm._SWEEP_FLOOR:]) < _vmm._SWEEP_FLOOR // 2, kept
    assert len(os.listdir("/proc/self/fd")) <= start + _vmm._SWEEP_FLOOR
    deadline = time.monotonic() + 10  # the consumer's release of the last one may still be on its way
    cupy_ipc.collect()
    while _vmm._exports and time.monotonic() < deadline:
        time.sleep(0.05)
        cupy_ipc.collect()
    assert not _vmm._exports and not _vmm._by_fd


def test_a_relay_lets_go_of_the_memory_once_its_mapping_is_gone(remote):
    # B sends our array on, then lets it go: the descriptor its export took over holds our memory until
    # B closes it, which must not wait for a collect() in B.
    import cupy

    import cupy_ipc
    from cupy_ipc import _vmm

    from workers import vmm_array

    relay = remote()
    relay.call("warm_up")  # its context made before the count of free memory starts
    cupy_ipc.collect()
    n = 1 << 28  # 1 GiB of float32
    free = cupy.cuda.runtime.memGetInfo()[0]
    first, a = vmm_array(4096), vmm_array(n)
    got = relay.call("relay_vmm_then_drop", [cupy_ipc.get_ipc_handle(x).to_bytes() for x in (first, a)])
    assert got[1]["sum"] == pytest.approx(float(np.arange(n, dtype=np.float64).sum()), rel=1e-4)
    assert [(g["mapped"], g["exports"]) for g in got] == [(0, 0), (0, 0)], got
    assert got[1]["fds"] == got[0]["fds"], got  # no descriptor of the second kept either
    del a, first
    cupy_ipc.collect()  # ends our pin: the array goes, and its export's descriptor with its mapping
    assert not _vmm._exports
    cupy.get_default_memory_pool().free_all_blocks()  # the fill's temporary GiB
    assert cupy.cuda.runtime.memGetInfo()[0] > free - (256 << 20)  # the GiB is back while B lives


def test_two_threads_sending_one_mapped_piece_at_once_share_its_descriptor(remote):
    import cupy_ipc

    from workers import vmm_array

    relay = remote()
    arrays = [vmm_array(4096) for _ in range(20)]
    got = relay.call("export_from_two_threads", [cupy_ipc.get_ipc_handle(a).to_bytes() for a in arrays])
    assert got == {"errors": [], "same": 20}


def test_a_new_allocation_mapped_where_an_old_one_was_shares_its_own_memory(remote):
    # PyTorch's expandable segments unmap freed pages and later map new allocations at the same addresses.
    import cupy

    import cupy_ipc

    from workers import vmm_array

    a = vmm_array(N)
    ptr, size = a.data.ptr, a.data.mem.size
    consumer = remote()
    assert consumer.call("open_pool_bytes", cupy_ipc.get_ipc_handle(a).to_bytes())["sum"] == \
        pytest.approx(EXPECTED, rel=1e-6)
    cupy.cuda.Device().synchronize()
    _replace_piece(a, ptr, size)
    b = _over(a, 4 * N)
    b.fill(3)
    assert consumer.call("open_pool_bytes", cupy_ipc.get_ipc_handle(b).to_bytes())["sum"] == 3.0 * N
    assert float(b[0]) == -1  # and the consumer wrote into the new allocation


def _over(a, nbytes):
    """A new float32 array over the first ``nbytes`` of ``a``'s addresses; ``a`` owns them (and unmaps every
    piece there when collected)."""
    import cupy

    mem = cupy.cuda.UnownedMemory(a.data.ptr, nbytes, a)
    return cupy.ndarray((nbytes // 4,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))


def _replace_piece(a, at, size):
    """Map a new allocation of ``size`` bytes at address ``at`` of ``a``'s virtual memory, in place of the old."""
    from cupy_ipc import _cuda, _vmm

    driver = _cuda._driver()
    (err,) = driver.cuMemUnmap(at, size)
    _cuda.check("unmapping", err)
    err, handle = driver.cuMemCreate(size, _vmm.allocation_prop(a.device.id), 0)
    _cuda.check("creating", err)
    (err,) = driver.cuMemMap(at, size, 0, handle, 0)
    _cuda.check("mapping", err)
    driver.cuMemRelease(handle)
    (err,) = driver.cuMemSetAccess(at, size, [_cuda.access_desc(a.device.id)], 1)
    _cuda.check("giving access", err)


def test_a_vmm_array_sent_again_opens_from_its_idle_mapping_but_not_once_a_piece_is_replaced(remote):
    # A consumer keeps the mapping of virtual memory sent again; PyTorch's expandable segments may since have
    # replaced a later piece with a new allocation at the same address and size, which must be mapped anew.
    import cupy

    import cupy_ipc

    from workers import vmm_array

    a = vmm_array(2 * N, pieces=2)  # two 4 MiB pieces
    h = cupy_ipc.get_ipc_handle(a)
    assert len(h._f.more) == 1
    piece = h._f.allocation_size // 2
    consumer = remote()
    got = consumer.call("open_each", [cupy_ipc.get_ipc_handle(a).to_bytes() for _ in range(3)], N)
    h.release()
    assert [g["value"] for g in got] == [float(N)] * 3
    assert [g["idle"] for g in got] == [0, 1, 1]
    assert [g["idle_fds"] for g in got] == [0, 2, 2]  # one descriptor per piece, kept for sending on
    assert got[2]["ptr"] == got[1]["ptr"]  # re-opened from the idle mapping
    cupy.cuda.Device().synchronize()
    _replace_piece(a, a.data.ptr + piece, piece)
    b = _over(a, 2 * piece)
    b[N:] = 5
    got = consumer.call("open_each", [cupy_ipc.get_ipc_handle(b).to_bytes()], N)
    assert got[0]["value"] == 5.0  # the new piece, not the idle mapping's old one
    assert got[0]["idle"] == 1  # that one stays idle; the new mapping, released once, is gone
    cupy_ipc.collect()
    assert consumer.call("collect_and_count") == {"mapped": 0, "idle": 0, "claims": 0, "idle_fds": 0}


def test_idle_vmm_mappings_are_evicted_oldest_first_once_their_descriptors_pass_the_budget(remote):
    # Each idle mapping of virtual memory keeps a descriptor per piece; past the budget (a quarter of the
    # open-file limit, 5 here) the oldest such mappings are unmapped and their descriptors closed.
    import cupy

    import cupy_ipc

    from workers import vmm_array

    arrays = [vmm_array(2 * N, pieces=2) for _ in range(3)]  # two pieces each
    consumer = remote()
    consumer.call("open_each", [cupy_ipc.get_ipc_handle(cupy.ones(4, cupy.float32)).to_bytes()])  # attach
    fds_before = consumer.call("open_fds")
    assert consumer.call("set_idle_fd_limit", 5) > 5
    counts = []
    for a in arrays:  # each sent twice: the second release keeps the mapping idle
        got = consumer.call("open_each", [cupy_ipc.get_ipc_handle(a).to_bytes() for _ in range(2)], N)
        assert [g["value"] for g in got] == [float(N)] * 2
        counts.append((got[-1]["idle"], got[-1]["idle_fds"]))
    assert counts == [(1, 2), (2, 4), (2, 4)]  # the third pushed the first out
    # The first array's mapping is gone: sent again, it is mapped anew (released before: kept idle again,
    # evicting the second).
    got = consumer.call("open_each", [cupy_ipc.get_ipc_handle(arrays[0]).to_bytes()], N)
    assert (got[0]["value"], got[0]["idle"], got[0]["idle_fds"]) == (float(N), 2, 4)
    assert consumer.call("collect_and_count") == {"mapped": 0, "idle": 0, "claims": 0, "idle_fds": 0}
    assert consumer.call("open_fds") == fds_before


@pytest.fixture
def expandable(monkeypatch):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("PyTorch is not installed")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def test_pytorch_expandable_segments_tensor_is_read_by_a_cupy_consumer(expandable, remote):
    import cupy_ipc

    producer = remote()  # started with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    for n in (1 << 18, 1 << 25):  # 1 MiB, and 128 MiB: over several of a segment's mapped pieces
        r = producer.call("torch_expandable_producer", n)
        assert r["conf"] == "expandable_segments:True" and r["kind"] == "vmm"
        with cupy_ipc.IpcArrayHandle.from_bytes(r["data"]) as a:
            assert float(a.sum()) == pytest.approx(2 * float(np.arange(n).sum()), rel=1e-6) and float(a[3]) == 6.0


def test_the_size_check_of_an_import_counts_only_its_own_ranges():
    """Pieces mapped one after another read as adjacent ranges: the check of a single-range import (a legacy
    handle, a pool's allocation) must stop after one, or a forged size would be vouched for by the neighbour."""
    from cupy_ipc import _mapping

    from workers import vmm_array

    a = vmm_array(2 * N, pieces=2)  # two 4 MiB pieces, adjacent
    ptr, piece = a.data.ptr, a.nbytes // 2
    assert _mapping._mapped_bytes(ptr, a.nbytes, 2) == a.nbytes
    assert _mapping._mapped_bytes(ptr, a.nbytes, 1) == piece
    assert _mapping._mapped_bytes(ptr, piece, 2) == piece  # counts no further than asked


def test_own_virtual_memory_in_pieces_opens_here_and_a_forged_size_is_refused():
    # Opened where it was exported (keepalive off: no pin vouches for it), a handle of virtual memory is checked
    # against the run of pieces exported under its descriptors and id, each still where it was exported.
    import cupy_ipc
    from cupy_ipc import _wire

    from workers import vmm_array

    a = vmm_array(2 * N, pieces=2)
    for view in (a, a[N + 8:]):  # the whole run, and a view within its second piece alone
        h = cupy_ipc.get_ipc_handle(view, keepalive=False, sync=False)
        assert h.kind == "vmm"
        with h as opened:
            assert float(opened[0]) == float(view[0]) and opened.data.ptr == view.data.ptr
        f = _wire.unpack_array(h.to_bytes())
        size = f.allocation_size + (4 << 20)  # one piece more than was exported
        forged = f._replace(allocation_size=size, more=(*f.more, (f.fd, 4 << 20)), offset=0, shape=(size,),
                            strides=(1,), dtype=np.dtype("uint8"))
        with pytest.raises(cupy_ipc.IpcError, match="forged"):
            cupy_ipc.IpcArrayHandle.from_bytes(_wire.pack_array(forged)).open()


def test_freeing_virtual_memory_waits_for_work_queued_on_it(remote):
    """An array of virtual memory dropped while a kernel still has to write it: the unmap waits (as cudaFree
    does), where an immediate unmap makes that kernel fault. In a process of its own: a fault ends its
    context."""
    assert remote().call("free_vmm_while_busy", N) == "ok"


def test_virtual_memory_that_cannot_be_freed_warns_instead_of_raising():
    """The free runs in a destructor, where an exception would be lost: a failure warns. Here a second owner
    frees an address range the first one freed already."""
    import cupy

    from cupy_ipc import _cuda, _vmm

    driver = _vmm._driver()
    cupy.cuda.Device(0).use()
    size = 2 << 20
    err, ptr = driver.cuMemAddressReserve(size, 0, 0, 0)
    _cuda.check("reserving an address range", err)
    first = _vmm._Owner(int(ptr), [size], 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del first  # frees the range
    assert not caught
    again = _vmm._Owner(int(ptr), [size], 0)
    with pytest.warns(RuntimeWarning, match="could not free the virtual memory at 0x.*CUDA_ERROR_INVALID_VALUE"):
        del again
    assert float(cupy.arange(3).sum()) == 3.0  # the GPU still works


def test_a_driver_error_of_a_call_that_writes_its_result_is_an_ipc_error_named_by_the_driver():
    # cuda-bindings 13 makes no CUresult of a number: such an error raised TypeError instead of IpcError.
    import ctypes

    import cupy

    from cupy_ipc import IpcError, _cuda

    cupy.zeros(1).sum()  # GPU 0's context made
    r, w = os.pipe()  # a descriptor that stands for no allocation
    try:
        out = ctypes.c_uint64()
        with pytest.raises(IpcError, match="importing the producer's allocation failed: CUDA_ERROR_") as info:
            _cuda.import_allocation(r, 0, out)
        assert info.value.cuda_error.startswith("CUDA_ERROR_") and out.value == 0
    finally:
        os.close(r)
        os.close(w)
