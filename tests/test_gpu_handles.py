"""Array handles between real processes: layouts, dtypes, pool offsets, closing."""

from __future__ import annotations

import collections
import gc
import warnings

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]


def _layouts():
    import cupy

    base = cupy.arange(4 * 5 * 6, dtype=cupy.float64).reshape(4, 5, 6)
    return {
        "c": base,
        "f": cupy.asfortranarray(base),
        "slice": base[1:3, ::2, 1:],
        "reversed": base[::-1],
        "negative_inner": base[:, :, ::-2],
        "transposed": base.transpose(2, 0, 1),
        "0-d": cupy.asarray(7.5),
        "size-0": base[:, 2:2],
        "size-0 1-d": cupy.empty(0, cupy.float32),
        "column": base[:, 3, 4],
    }


def test_every_layout_round_trips(consumer):
    import cupy

    import cupy_ipc

    layouts = _layouts()
    handles = {k: cupy_ipc.get_ipc_handle(v).to_bytes() for k, v in layouts.items()}
    got = consumer.call("read_many", list(handles.values()))
    for (name, arr), out in zip(layouts.items(), got):
        expected = cupy.asnumpy(arr)
        assert out.shape == expected.shape, name
        np.testing.assert_array_equal(out, expected, err_msg=name)


@pytest.mark.parametrize("order", ["C", "F"])
def test_every_dtype_round_trips(consumer, order):
    import cupy

    import cupy_ipc

    rng = np.random.default_rng(0)
    arrays = []
    for name in DTYPES:
        host = (rng.standard_normal((3, 7)) * 100).astype(name)
        if np.dtype(name).kind == "c":
            host = host + 1j * host[::-1]
        arrays.append(cupy.asarray(host, order=order))
    got = consumer.call("read_many", [cupy_ipc.get_ipc_handle(a).to_bytes() for a in arrays])
    for name, arr, out in zip(DTYPES, arrays, got):
        assert out.dtype == np.dtype(name)
        np.testing.assert_array_equal(out, cupy.asnumpy(arr), err_msg=name)


def test_two_arrays_from_one_pool_block_open_to_their_own_data(consumer):
    import cupy

    import cupy_ipc

    pool = cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(pool.malloc):
        block = cupy.empty(2 << 20, cupy.uint8)
        del block  # the pool now splits this 2 MiB block for the next two arrays
        a = cupy.full(1 << 18, 1, cupy.float32)
        b = cupy.full(1 << 18, 2, cupy.float32)
    ha, hb = cupy_ipc.get_ipc_handle(a), cupy_ipc.get_ipc_handle(b)
    assert ha.memory_handle == hb.memory_handle  # the situation that misleads raw IPC
    assert ha.offset != hb.offset
    out_a, out_b = consumer.call("read_many", [ha.to_bytes(), hb.to_bytes()])
    assert (out_a == 1).all() and (out_b == 2).all()


def test_new_arrays_of_an_exported_layout_open_to_their_own_data(consumer):
    # An export checks a layout in full the first time; new arrays of that layout (each fresh buffer of a
    # pipeline) take a shorter path, which must give the same handles.
    import cupy

    import cupy_ipc
    from cupy_ipc import _array_handle

    arrays = []
    for k in range(4):
        base = cupy.arange(64, dtype=cupy.float64) + 100 * k
        arrays += [base[::-2], base[1:33]]  # reaching backwards from the first element, and at an offset
    handles = [cupy_ipc.get_ipc_handle(a) for a in arrays]
    for a in arrays[:2]:  # known layouts, which is what the later exports were checked against
        assert (a.dtype, a.shape, a.strides, a.data.device_id) in _array_handle._layouts
    for h, a in zip(handles, arrays):
        assert cupy_ipc.IpcArrayHandle.from_bytes(h.to_bytes()) == h
        assert (h.shape, h.strides) == (a.shape, a.strides)
    for (h1, h2), (a1, a2) in zip(zip(handles[::2], handles[1::2]), zip(arrays[::2], arrays[1::2])):
        assert h1.memory_handle == h2.memory_handle  # views of one base: their offsets tell them apart
        assert h2.offset - h1.offset == a2.data.ptr - a1.data.ptr
    outs = consumer.call("read_many", [h.to_bytes() for h in handles])
    for out, a in zip(outs, arrays):
        np.testing.assert_array_equal(out, cupy.asnumpy(a))


def test_consumer_writes_are_seen_by_the_producer(consumer):
    import cupy

    import cupy_ipc

    a = cupy.zeros((64, 64), cupy.float32)[::2, 1::3]
    consumer.call("write", cupy_ipc.get_ipc_handle(a).to_bytes(), 3.5)
    assert (a == 3.5).all()


def test_open_in_the_exporting_process_views_its_own_memory():
    import cupy

    import cupy_ipc

    a = cupy.arange(10, dtype=cupy.int32)
    h = cupy_ipc.get_ipc_handle(a[2:])
    with h as view:
        assert view.data.ptr == a.data.ptr + 8
        view[0] = 100
    del view
    assert int(a[2]) == 100


@pytest.mark.parametrize("close_first", [0, 1])
def test_same_handle_opened_twice_closed_in_either_order(consumer, close_first):
    import cupy

    import cupy_ipc

    a = cupy.arange(1000, dtype=cupy.float32)
    r = consumer.call("open_twice", cupy_ipc.get_ipc_handle(a, consumers=1).to_bytes(), close_first)
    assert r["same_ptr"], "two opens of one allocation must share one mapping"
    assert r["mapped_both"] == 1 and r["mapped_one"] == 1 and r["mapped_none"] == 0
    np.testing.assert_array_equal(r["survivor"], cupy.asnumpy(a))


def test_view_outliving_close_stays_readable_and_warns(consumer):
    import cupy

    import cupy_ipc

    a = cupy.arange(20, dtype=cupy.int64)
    r = consumer.call("view_outlives_close", cupy_ipc.get_ipc_handle(a).to_bytes())
    assert [c for c, _ in r["warnings"]] == ["ResourceWarning"]
    assert "1 other array(s) or view(s)" in r["warnings"][0][1]
    np.testing.assert_array_equal(r["values"], np.arange(1, 20))


def test_with_statement_alone_does_not_warn():
    import cupy

    import cupy_ipc

    h = cupy_ipc.get_ipc_handle(cupy.ones(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with h as arr:
            arr += 1
        h.close()  # idempotent


def test_forged_allocation_size_is_refused_after_mapping(consumer):
    import cupy

    import cupy_ipc

    a = cupy.ones(1 << 20, cupy.uint8)  # 1 MiB: its own cudaMalloc allocation
    real = cupy_ipc.get_ipc_handle(a, keepalive=False, sync=False)
    forged = cupy_ipc.IpcArrayHandle(
        memory_handle=real.memory_handle, offset=0, allocation_size=real.allocation_size * 4,
        shape=(real.allocation_size * 4,), strides=(1,), dtype="uint8",
        device=real.device, producer=real.producer,
    )
    kind, message, _ = consumer.call("open_error", forged.to_bytes())
    assert kind == "HandleError", message
    assert "forged" in message
    # the consumer is still healthy and maps the real handle
    assert consumer.call("read_first", real.to_bytes()) == 1


def test_forged_allocation_size_is_refused_on_a_mapping_in_use(consumer):
    # The driver's size check runs when an allocation is first mapped; a second handle of the same allocation
    # reuses that mapping and must not claim more of it.
    import cupy

    import cupy_ipc

    a = cupy.ones(1 << 20, cupy.uint8)
    real = cupy_ipc.get_ipc_handle(a, keepalive=False, sync=False)
    forged = cupy_ipc.IpcArrayHandle(
        memory_handle=real.memory_handle, offset=real.allocation_size * 2, allocation_size=real.allocation_size * 4,
        shape=(16,), strides=(1,), dtype="uint8", device=real.device, producer=real.producer,
    )
    consumer.call("hold", real.to_bytes(), "genuine")
    try:
        kind, message, _ = consumer.call("open_error", forged.to_bytes())
        assert kind == "HandleError" and "forged" in message, message
        assert float(consumer.call("read_held", "genuine")[0]) == 1  # the mapping in use is untouched
    finally:
        consumer.call("drop", "genuine")


def _forged_bytes(handle, factor, kind="legacy", sender="us"):
    """``handle``'s wire bytes with its allocation size, and a shape reaching all of it, ``factor`` times larger,
    saying the memory is of ``kind``; signed by another process of this host unless ``sender`` is "us"."""
    import secrets

    from cupy_ipc import _wire

    f = _wire.unpack_array(handle.to_bytes())
    size = f.allocation_size * factor
    f = f._replace(allocation_size=size, offset=0, shape=(size,), strides=(1,), dtype=np.dtype("uint8"))
    if kind == "vmm":  # a descriptor and a run id, as virtual memory needs
        f = f._replace(kind=_wire.Kind.VMM, fd=3, resource=1)
    if sender != "us":  # the handle of our memory as a process that received it sends it back
        f = f._replace(producer=f.producer._replace(token=secrets.token_bytes(16)))
    return _wire.pack_array(f)


@pytest.mark.parametrize("kind", ["legacy", "vmm"])
@pytest.mark.parametrize("sender", ["us", "another process"])
@pytest.mark.parametrize("pinned", [True, False])
def test_forged_handle_of_our_own_memory_is_refused(pinned, sender, kind):
    # Opened in the exporting process (or sent back to it), a handle maps nothing: it must still claim no more
    # than the allocation, whatever kind of memory it says that is.
    import cupy

    import cupy_ipc

    a = cupy.ones(1 << 20, cupy.uint8)
    neighbour = cupy.full(1 << 20, 42, cupy.uint8)  # what a view past the allocation would reach
    real = cupy_ipc.get_ipc_handle(a, keepalive=pinned, sync=pinned)
    with pytest.raises(cupy_ipc.HandleError, match="forged"):
        cupy_ipc.IpcArrayHandle.from_bytes(_forged_bytes(real, 4, kind, sender)).open()
    assert int(neighbour[0]) == 42
    with real as view:  # the genuine handle still opens
        assert int(view[0]) == 1
    real.release()


@pytest.mark.parametrize("kind", ["legacy", "pool"])
def test_our_memory_sent_back_after_many_other_exports_opens_as_ours(remote, monkeypatch, kind):
    # The table that tells our handles from others' turns over past its size: it must keep every allocation
    # still here, or our memory sent back by a relay is imported as another's (CUDA refuses a legacy handle
    # in its own process; a pool would be imported into its own process, then freed and destroyed as another's).
    import cupy

    import cupy_ipc
    from cupy_ipc import _array_handle

    monkeypatch.setattr(_array_handle, "_HANDLE_CACHE_SIZE", 4)
    # A table of this test's exports only: allocations that earlier tests left alive would hold its places, and
    # how many of them are alive depends on which tests ran before.
    monkeypatch.setattr(_array_handle, "_exported", collections.OrderedDict())
    monkeypatch.setattr(_array_handle, "_handle_cache", {})
    allocator = cupy_ipc.ShareableMemoryPool().malloc if kind == "pool" else cupy.get_default_memory_pool().malloc
    relay = remote()
    with cupy.cuda.using_allocator(allocator):
        a = cupy.arange(1 << 16, dtype=cupy.float32)
        relayed = relay.call("hold_and_send_on", cupy_ipc.get_ipc_handle(a).to_bytes(), "a")
        kept = []
        for i in range(12):  # other allocations exported, every other one freed
            x = cupy.full((1 << 16) + 256 * (i + 1), i, dtype=cupy.float32)
            cupy_ipc.get_ipc_handle(x, keepalive=False, sync=False)
            if i % 2:
                kept.append(x)
            del x
            cupy.get_default_memory_pool().free_all_blocks()
    if kind == "legacy":
        assert len(_array_handle._exported) < 13  # the freed ones went
    h = cupy_ipc.IpcArrayHandle.from_bytes(relayed)
    assert h.kind == kind
    with h as back:
        assert back.data.ptr == a.data.ptr  # our own memory, not an import of it
        back[0] = 7
    del back
    assert float(a[0]) == 7 and float(a[1]) == 1
    relay.call("drop", "a")
    with cupy.cuda.using_allocator(allocator):  # the pool still allocates and exports
        b = cupy.ones(16, dtype=cupy.float32)
        assert float(relay.call("read", cupy_ipc.get_ipc_handle(b).to_bytes()).sum()) == 16
    assert all(float(x[0]) == i for x, i in zip(kept, range(1, 12, 2)))


def test_an_array_reshaped_in_place_is_exported_with_its_new_shape(consumer):
    import cupy

    import cupy_ipc

    a = cupy.arange(6, dtype=cupy.float32)
    for _ in range(2):  # exported again too: its later exports take a shorter path, which must see it
        first = cupy_ipc.get_ipc_handle(a)
        assert first.shape == (6,)
        first.release()
    a.shape = (2, 3)  # CuPy changes a live array's layout in place
    h = cupy_ipc.get_ipc_handle(a)
    assert h.shape == (2, 3) and h.strides == (12, 4)
    np.testing.assert_array_equal(consumer.call("read", h.to_bytes()), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_an_array_sent_again_and_again_is_exported_as_the_first_time_and_ordered_each_time(consumer):
    # From its second export on, an array with the default options takes a shorter path (a pipeline's
    # buffer, sent again and again): it must give the handle the general path gives, with its own export
    # part, and order the work queued on the array before each export.
    import cupy

    import cupy_ipc
    from cupy_ipc._wire import pack_array

    from workers import spin, warm_up

    warm_up()
    for name, arr in _layouts().items():
        if arr.size == 0:
            continue
        handles = [cupy_ipc.get_ipc_handle(arr) for _ in range(3)]
        general = cupy_ipc.get_ipc_handle(arr, lease=600.0)  # a lease: the general path
        for h in handles + [general]:
            f = h._f
            assert f == general._f._replace(flags=f.flags, export_id=f.export_id, slot=f.slot,
                                            event_handle=f.event_handle), name
            assert h.to_bytes() == pack_array(f) and h.keepalive, name
        assert len({h._f.export_id for h in handles + [general]}) == 4, name
        for h in handles + [general]:
            np.testing.assert_array_equal(consumer.call("read", h.to_bytes()), cupy.asnumpy(arr), err_msg=name)
    a = cupy.zeros(1 << 20, cupy.float32)
    cupy_ipc.get_ipc_handle(a).release()
    for value in range(1, 5):
        spin(0.2)  # the fill below runs after it: the consumer reads the old values unless it waits
        a.fill(value)
        h = cupy_ipc.get_ipc_handle(a)
        assert h.synced
        out = consumer.call("read", h.to_bytes())
        assert (out == value).all(), (value, np.unique(out))


@pytest.mark.parametrize("first, then", [({}, {"keepalive": False, "sync": False}),
                                         ({"keepalive": False, "sync": False}, {})])
def test_an_array_exported_again_with_other_options_carries_only_its_own(consumer, first, then):
    # An array's later exports reuse the wire form of its first: each must still say its own options.
    import cupy

    import cupy_ipc

    a = cupy.arange(6, dtype=cupy.float32)
    cupy.cuda.get_current_stream().synchronize()
    handles = [cupy_ipc.get_ipc_handle(a, **first), cupy_ipc.get_ipc_handle(a, **then)]
    for h, options in zip(handles, (first, then)):
        assert cupy_ipc.IpcArrayHandle.from_bytes(h.to_bytes()) == h
        assert h.keepalive is options.get("keepalive", True)
        np.testing.assert_array_equal(consumer.call("read", h.to_bytes()), np.arange(6, dtype=np.float32))
    for h in handles:
        h.release()


def test_handle_from_another_host_is_refused_before_cuda(consumer):
    import cupy

    import cupy_ipc

    real = cupy_ipc.get_ipc_handle(cupy.ones(8), keepalive=False, sync=False)
    p = real.producer
    other = cupy_ipc.IpcArrayHandle(  # a memory handle the driver would refuse: a CUDA call made first says so
        memory_handle=bytes(64), offset=0, allocation_size=real.allocation_size,
        shape=(8,), strides=(8,), dtype="float64", device=real.device,
        producer=(p.pid, p.token, bytes(reversed(p.boot_id)), "elsewhere"),
    )
    kind, message, _ = consumer.call("open_error", other.to_bytes())
    assert kind == "HandleError" and "elsewhere" in message


def test_unknown_gpu_uuid_is_refused(consumer):
    import cupy

    import cupy_ipc

    real = cupy_ipc.get_ipc_handle(cupy.ones(8), keepalive=False, sync=False)
    other = cupy_ipc.IpcArrayHandle(
        memory_handle=real.memory_handle, offset=0, allocation_size=real.allocation_size,
        shape=(8,), strides=(8,), dtype="float64", device=(0, b"\x01" * 16), producer=real.producer,
    )
    kind, message, _ = consumer.call("open_error", other.to_bytes())
    assert kind == "HandleError" and "01010101-0101" in message


def test_pytorch_tensor_is_read_by_a_cupy_consumer(consumer):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA")
    import cupy_ipc

    t = torch.arange(24, dtype=torch.float32, device="cuda").reshape(4, 6).t()[1:]
    torch.cuda.synchronize()
    out = consumer.call("read", cupy_ipc.get_ipc_handle(t).to_bytes())
    np.testing.assert_array_equal(out, t.cpu().numpy())


def test_unsupported_memory_is_refused_with_advice():
    import cupy

    import cupy_ipc

    managed = cupy.cuda.MemoryPointer(cupy.cuda.memory.ManagedMemory(1024), 0)
    arr = cupy.ndarray((256,), cupy.float32, managed)
    with pytest.raises(cupy_ipc.IpcError, match="managed memory"):
        cupy_ipc.get_ipc_handle(arr)
    with pytest.raises(TypeError, match="not a CUDA GPU"):
        cupy_ipc.get_ipc_handle(np.ones(3))
    gc.collect()


def test_reopening_an_evicted_mapping_reads_the_right_data(consumer):
    import cupy

    import cupy_ipc

    arrays = [cupy.full(1 << 20, v, cupy.float32) for v in (1, 2, 3)]  # three allocations
    data = [cupy_ipc.get_ipc_handle(a, keepalive=False, sync=False).to_bytes() for a in arrays]
    order = [0, 1, 0, 2, 0, 1, 1, 2]
    assert consumer.call("reopen_after_eviction", [data[i] for i in order]) == [i + 1 for i in order]


def test_a_buffer_freed_while_its_mapping_is_idle_does_not_shadow_the_next_allocation_there(remote):
    # The consumer keeps the mapping of a buffer sent twice idle; the producer then frees the buffer and
    # allocates another of the same size. Seen on an H200: the driver placed it at the same address with the
    # very same IPC handle while the old one stayed mapped elsewhere. Each allocation must read its own values.
    import cupy

    import cupy_ipc

    consumer = remote()
    pool = cupy.get_default_memory_pool()
    got, handles = [], set()
    for v in range(1, 7):
        a = cupy.full(1 << 18, v, cupy.float32)
        data = [cupy_ipc.get_ipc_handle(a).to_bytes() for _ in range(2)]
        handles.add(cupy_ipc.IpcArrayHandle.from_bytes(data[0]).memory_handle)
        got.append([g["value"] for g in consumer.call("open_each", data)])
        del a
        cupy_ipc.collect()
        cupy.cuda.runtime.deviceSynchronize()
        pool.free_all_blocks()
    assert got == [[float(v)] * 2 for v in range(1, 7)], f"{len(handles)} distinct handles"


def test_device_uuids_are_whole():
    # CuPy's device properties end a UUID at its first zero byte; handles carry all 16, as nvidia-smi shows them.
    import os
    import shutil
    import subprocess

    import cupy

    from cupy_ipc._cuda import _uuid_text, device_uuid

    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout \
        if shutil.which("nvidia-smi") else None
    from cuda.bindings import driver

    for i in range(cupy.cuda.runtime.getDeviceCount()):
        uuid = device_uuid(i)
        assert len(uuid) == 16
        assert uuid.startswith(bytes(cupy.cuda.runtime.getDeviceProperties(i)["uuid"]))
        err, dev = driver.cuDeviceGet(i)
        assert err == driver.CUresult.CUDA_SUCCESS
        err, whole = driver.cuDeviceGetUuid(dev)  # the driver's, through cuda-bindings: another path than ours
        assert err == driver.CUresult.CUDA_SUCCESS
        assert uuid == bytes(whole.bytes)[:16], "not the driver's whole UUID"
        if listing is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
            assert f"GPU-{_uuid_text(uuid)}" in listing


def test_the_pointer_queries_agree_with_cuda_bindings(monkeypatch):
    # The export's and the mapped-size check's queries go to libcuda directly; cuda-bindings must say the same.
    import cupy

    from cupy_ipc import IpcError, _cuda

    plain = cupy.empty(1000, cupy.float32)
    with cupy.cuda.using_allocator(cupy.cuda.MemoryAsyncPool().malloc):
        pooled = cupy.empty(1000, cupy.float32)  # stream-ordered: no legacy IPC
    host = np.zeros(4)
    pointers = [plain.data.ptr, plain[10:].data.ptr, pooled.data.ptr, host.ctypes.data]

    def answers():
        ranges = [_cuda.address_range(p) for p in pointers[:3]]
        with pytest.raises(IpcError):
            _cuda.address_range(host.ctypes.data)
        return [_cuda.legacy_info(p) for p in pointers], ranges

    assert _cuda._queries() is not None  # libcuda loads here: its answers are the ones compared
    direct = answers()
    monkeypatch.setattr(_cuda, "_queries", lambda: None)
    assert answers() == direct
    (whole, inside, pool, on_host), ranges = direct
    assert whole is not None and whole == inside and whole[0] <= plain.data.ptr < whole[0] + whole[1]
    assert pool is None and on_host is None
    assert ranges[0] == ranges[1] == whole[:2] and ranges[2][0] <= pooled.data.ptr
