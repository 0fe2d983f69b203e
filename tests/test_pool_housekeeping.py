"""Imported pools let go, access given, frees and streams of ShareableMemoryPool, virtual memory in a
reservation with an unmapped head, and imports, exports and creations interrupted once the driver made what they
make, without a GPU: the driver is test_pool_imports's stub."""

from __future__ import annotations

import ctypes
import gc
import threading
import types

import numpy as np
import pytest
import test_pool_imports
from test_pool_imports import POOL, A, B

import cupy_ipc
from cupy_ipc import _array_handle, _cuda, _pools, _vmm
from cupy_ipc._errors import IpcError, ProducerExitedError
from cupy_ipc._wire import DeviceId, Kind

PTR = 0xB000


class _Err:
    name = "CUDA_ERROR_INVALID_CONTEXT"


class _Driver(test_pool_imports._Driver):
    """The stub of test_pool_imports, with pointer imports and frees that can fail, and what a pool's export and
    creation ask."""

    class CUpointer_attribute:  # noqa: N801 - the driver's names
        CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES = 1

    CUmemAllocationType = types.SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)

    def __init__(self) -> None:
        super().__init__()
        self.free_fails = 0

    def cuPointerGetAttribute(self, attribute, ptr):  # noqa: N802
        return 0, 1  # the pool allows POSIX descriptors

    def CUmemPoolProps(self):  # noqa: N802
        return types.SimpleNamespace(location=types.SimpleNamespace(), getPtr=lambda: 0)

    def cuMemPoolSetAccess(self, pool, descs, n):  # noqa: N802
        return (0,)

    def CUmemPoolPtrExportData(self):  # noqa: N802
        buf = ctypes.create_string_buffer(64)
        return types.SimpleNamespace(getPtr=lambda: ctypes.addressof(buf), buf=buf)

    def cuMemPoolImportPointer(self, pool, data):  # noqa: N802
        return 0, PTR  # one pointer for every import of the allocation

    def cuMemFree(self, ptr):  # noqa: N802
        if self.free_fails:
            self.free_fails -= 1
            return (_Err(),)
        return super().cuMemFree(ptr)


@pytest.fixture
def driver(monkeypatch, libcuda):
    d = _Driver()
    monkeypatch.setattr(_pools, "_driver", lambda: d)
    monkeypatch.setattr(_pools._cuda, "_driver", lambda: d)
    monkeypatch.setattr(_pools._cuda, "access_desc", lambda device: device)
    monkeypatch.setattr(_pools._cuda, "rt", lambda: types.SimpleNamespace(setDevice=lambda d: None))
    d.retired = []
    monkeypatch.setattr(_pools._fdserver, "retire", d.retired.extend)
    for name in ("_imports", "_live", "_pointer_pool", "_exports"):
        monkeypatch.setattr(_pools, name, {})
    monkeypatch.setattr(_pools, "_access", {(POOL, 0)})
    monkeypatch.setattr(_pools, "_owned", {POOL})
    return d


def _fields(key):
    return types.SimpleNamespace(producer=types.SimpleNamespace(token=key[0], pid=1001), resource=key[1], fd=5,
                                 memory_handle=bytes(64))


# A pool whose producer lives on but destroyed it (ShareableMemoryPool dropped) is never let go: on an H200 the
# consumer's import kept the pool's 1 GiB allocated on the GPU until the consumer exited, collect() or not.
def test_collect_lets_go_of_a_pool_nothing_is_mapped_from_even_if_its_producer_lives(driver, monkeypatch):
    _pools._imports[A] = (POOL, 101, 1001)
    monkeypatch.setattr(_pools._segment, "attach", lambda token, pid: object())  # the producer is alive
    cupy_ipc.collect()
    assert _pools._imports == {} and driver.destroyed == [POOL] and driver.retired == [101]


# An unrelated producer's segment that cannot be opened (EMFILE, EACCES, ...) makes release_exited raise, and
# with it the import of a new producer's pool, which calls it first.
def test_a_segment_that_cannot_be_opened_does_not_fail_an_unrelated_import(driver, monkeypatch):
    _pools._imports[A] = (POOL + 1, 101, 1001)

    def attach(token, pid):
        raise IpcError("cannot open the segment of the producer process (pid 1001): Too many open files")

    monkeypatch.setattr(_pools._segment, "attach", attach)
    r, w = _pipe()
    assert _pools._imported_pool(B[0], B[1], 1002, 5, lambda: (r,)) == POOL
    assert A in _pools._imports and _pools._live == {B: 1}
    _close(w)


# _give_access changes _access without _lock, while release_exited iterates it under _lock (collect() on
# another thread): "Set changed size during iteration" midway leaves the pool undestroyed, its key gone and
# its descriptor open.
def test_access_given_during_release_exited_does_not_break_it(driver, monkeypatch):
    other, threads = POOL + 1, []

    class Racy(set):
        def __iter__(self):
            inner = set.__iter__(self)
            yield next(inner)
            t = threading.Thread(target=_pools._give_access, args=(other, 0, 0), daemon=True)
            threads.append(t)
            t.start()
            t.join(0.5)  # an open on another thread gives its pool access meanwhile
            yield from inner

    monkeypatch.setattr(_pools, "_access", Racy({(POOL, 0), (POOL, 1)}))
    _pools._imports[A] = (POOL, 101, 1001)
    monkeypatch.setattr(_pools._segment, "attach", _exited(A))
    try:
        assert _pools.release_exited() == 1
        assert driver.destroyed == [POOL] and driver.retired == [101]
    finally:
        for t in threads:
            t.join(5)  # done before the stubs go
    assert (other, 0) in _pools._access


# A failed cuMemFree leaves the pointer's entry: the pool's count never drops (never released), and the next
# import of the allocation (same pointer) is appended to the stale entry, so its free is skipped as "another
# mapping still holds it" -- the import outlives the claim, and the producer frees first.
def test_a_failed_free_leaves_no_stale_entry_that_skips_the_next_free(driver):
    _pools._imports[A] = (POOL, 101, 1001)
    assert _pools.import_pointer(_fields(A), 0, 0, lambda: None) == PTR
    driver.free_fails = 1
    with pytest.raises(IpcError):
        _pools.free_imported(PTR, A)
    assert _pools.import_pointer(_fields(A), 0, 0, lambda: None) == PTR  # the allocation sent again
    _pools.free_imported(PTR, A)
    assert driver.freed == [PTR] and _pools._live == {} and _pools._pointer_pool == {}


# Ctrl-C during cuMemPoolImportPointer (12 µs) is raised as the call returns: the pointer, returned as a value, was
# lost, still mapped, and with it the producer's memory, held until this process exited.
@pytest.mark.parametrize("held", [False, True], ids=["alone", "held-by-another-mapping"])
def test_a_pool_import_interrupted_once_the_driver_mapped_the_pointer_frees_it(driver, libcuda, held):
    def import_then_interrupted(out, pool, data):  # the driver's import, then the interrupt's check
        out._obj.value = PTR
        raise KeyboardInterrupt

    libcuda["cuMemPoolImportPointer"] = import_then_interrupted
    _pools._imports[A] = (POOL, 101, 1001)
    if held:  # the same allocation imported before, by another mapping: the driver gives it the same pointer
        _pools._live_change(A, 1)
        _pools._pointer_pool[PTR] = [A]
    with pytest.raises(KeyboardInterrupt):
        _pools.import_pointer(_fields(A), 0, 0, lambda: None)
    if held:  # still mapped for the other: a free would unmap it under that mapping's arrays
        assert driver.freed == [] and _pools._live == {A: 1} and _pools._pointer_pool == {PTR: [A]}
    else:
        assert driver.freed == [PTR] and _pools._live == {} and _pools._pointer_pool == {}


# Ctrl-C during the driver's import, export or creation of a pool is raised as the call returns: the imported pool
# (which keeps the producer's pool memory allocated), the descriptor or the new pool was lost, returned as a value.
@pytest.mark.parametrize("held", [False, True], ids=["alone", "held-under-another-key"])
def test_a_pool_import_interrupted_once_the_driver_imported_the_pool_destroys_it(driver, libcuda, monkeypatch, held):
    import os

    def import_then_interrupted(out, fd, kind, flags):  # the driver's import, then the interrupt's check
        out._obj.value = POOL
        raise KeyboardInterrupt

    libcuda["cuMemPoolImportFromShareableHandle"] = import_then_interrupted
    monkeypatch.setattr(_pools._segment, "attach", lambda token, pid: object())  # the producers are alive
    if held:  # the pool imported before from another process (a relay): the driver gives it the same handle
        _pools._imports[B] = (POOL, 102, 1002)
    r, w = os.pipe()
    with pytest.raises(KeyboardInterrupt):
        _pools.import_pointer(_fields(A), 0, 0, lambda: (r,))
    with pytest.raises(OSError):
        os.fstat(r)  # the descriptor received is closed
    os.close(w)
    assert driver.destroyed == ([] if held else [POOL])  # not under the other key's imports
    assert A not in _pools._imports and _pools._live == {}


def test_a_pool_export_interrupted_once_the_driver_made_the_descriptor_closes_it(driver, libcuda):
    import os

    made = []

    def export_then_interrupted(out, pool, kind, flags):
        out._obj.value = os.open(os.devnull, os.O_RDONLY)
        made.append(out._obj.value)
        raise KeyboardInterrupt

    libcuda["cuMemPoolExportToShareableHandle"] = export_then_interrupted
    with pytest.raises(KeyboardInterrupt):
        _pools.export(PTR, POOL)
    with pytest.raises(OSError):
        os.fstat(made[0])
    assert _pools._exports == {}


def test_a_pool_creation_interrupted_once_the_driver_made_the_pool_destroys_it(driver, libcuda, monkeypatch):
    def create_then_interrupted(out, props):
        out._obj.value = POOL
        raise KeyboardInterrupt

    libcuda["cuMemPoolCreate"] = create_then_interrupted
    monkeypatch.setattr(_pools._reaper, "start", lambda: None)
    monkeypatch.setattr(_pools._cuda, "device_count", lambda: 1)
    monkeypatch.setattr(_pools._cuda, "using_device", lambda device, bind=False: _Null())
    with pytest.raises(KeyboardInterrupt):
        _pools.ShareableMemoryPool()
    gc.collect()  # the pool object half made, and its driver pools, are gone: no second destroy
    assert driver.destroyed == [POOL]


class _VmmDriver:
    """The driver calls of an import, export or allocation of virtual memory, recorded: allocation handles
    imported, created or retained and those released, descriptors exported, addresses reserved and freed, pieces
    mapped and unmapped."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUmemAllocationHandleType:
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1

    CUmemAllocationGranularity_flags = types.SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)

    def __init__(self, interrupted: str) -> None:
        self.interrupted = interrupted
        self.made: list[int] = []
        self.descriptors: list[int] = []
        self.released: list[int] = []
        self.reserved: list[tuple[int, int]] = []
        self.freed: list[tuple[int, int]] = []
        self.mapped: list[tuple[int, int]] = []
        self.unmapped: list[tuple[int, int]] = []

    def _then(self, step):  # the interrupt, raised as the driver's call of this step returns
        if step == self.interrupted:
            raise KeyboardInterrupt
        return 0

    def import_(self, out, fd, kind):  # libcuda's cuMemImportFromShareableHandle
        out._obj.value = 0x100 + len(self.made)
        self.made.append(out._obj.value)
        return self._then("import" if len(self.made) == 2 else "")

    def create(self, out, size, prop, flags):  # libcuda's cuMemCreate
        out._obj.value = 0x100 + len(self.made)
        self.made.append(out._obj.value)
        return self._then("create" if len(self.made) == 2 else "")

    def retain(self, out, ptr):  # libcuda's cuMemRetainAllocationHandle
        out._obj.value = 0x100 + len(self.made)
        self.made.append(out._obj.value)
        return self._then("retain")

    def export(self, out, handle, kind, flags):  # libcuda's cuMemExportToShareableHandle
        import os

        out._obj.value = os.open(os.devnull, os.O_RDONLY)
        self.descriptors.append(out._obj.value)
        return self._then("export")

    def cuMemGetAllocationPropertiesFromHandle(self, handle):  # noqa: N802
        return 0, types.SimpleNamespace(requestedHandleTypes=1)

    def cuMemGetAllocationGranularity(self, prop, flags):  # noqa: N802
        return 0, 0x200000

    def reserve(self, out, size, alignment, addr, flags):  # libcuda's cuMemAddressReserve
        out._obj.value = 0x7F0000000000
        self.reserved.append((out._obj.value, size))
        return self._then("reserve")

    def cuMemMap(self, at, size, offset, handle, flags):  # noqa: N802 - the driver's names
        self.mapped.append((at, size))
        return (self._then("map" if len(self.mapped) == 2 else ""),)

    def cuMemSetAccess(self, ptr, size, descs, n):  # noqa: N802
        return (0,)

    def cuMemUnmap(self, at, size):  # noqa: N802
        self.unmapped.append((at, size))
        return (0,)

    def cuMemAddressFree(self, ptr, size):  # noqa: N802
        self.freed.append((ptr, size))
        return (0,)

    def cuMemRelease(self, handle):  # noqa: N802
        self.released.append(handle)
        return (0,)


def _vmm_driver(monkeypatch, libcuda, step: str) -> _VmmDriver:
    """A :class:`_VmmDriver` interrupted at ``step``, serving libcuda's calls and cuda-bindings'; empty tables."""
    d = _VmmDriver(step)
    monkeypatch.setattr(_vmm._cuda, "_driver", lambda: d)
    monkeypatch.setattr(_vmm._cuda, "rt", lambda: types.SimpleNamespace(getDevice=lambda: 0,
                                                                        setDevice=lambda device: None))
    monkeypatch.setattr(_vmm._cuda, "access_desc", lambda device: device)
    libcuda.update(cuMemImportFromShareableHandle=d.import_, cuMemAddressReserve=d.reserve, cuMemCreate=d.create,
                   cuMemRetainAllocationHandle=d.retain, cuMemExportToShareableHandle=d.export)
    for name in ("_exports", "_by_mapping", "_by_fd", "_kept"):
        monkeypatch.setattr(_vmm, name, {})
    return d


# Ctrl-C during the driver's import of a piece, reservation of addresses or map of a piece is raised as the call
# returns: the allocation handle (which keeps the producer's memory allocated until this process exits) or the
# address range was lost, returned as a value, and a piece mapped but not counted made the unwind's free of the
# addresses fail.
@pytest.mark.parametrize("step", ["import", "reserve", "map"])
def test_a_vmm_import_interrupted_once_the_driver_made_something_releases_all_it_made(libcuda, monkeypatch, step):
    import os

    d = _vmm_driver(monkeypatch, libcuda, step)
    pipes = [os.pipe(), os.pipe()]
    with pytest.raises(KeyboardInterrupt):
        _vmm.import_mapping(1001, [(11, 0x200000), (12, 0x200000)], 0, tuple(r for r, _ in pipes))
    assert sorted(d.released) == d.made and d.made  # each handle made, released once
    assert sorted(d.unmapped) == sorted(d.mapped)
    assert d.freed == d.reserved
    for r, w in pipes:
        with pytest.raises(OSError):
            os.fstat(r)  # the descriptors received are closed too
        os.close(w)
    assert not _vmm._kept


# The same on the producer's side: a reference to the allocation (cuMemRetainAllocationHandle, which an export and
# the question whether memory is virtual both take) kept it allocated for ever, a lost descriptor kept its memory
# alive, and a lost piece of a new allocation (cuMemCreate) stayed allocated.
@pytest.mark.parametrize("call, step", [("export", "retain"), ("export", "export"), ("is_vmm", "retain")])
def test_a_vmm_export_interrupted_once_the_driver_made_something_lets_go_of_all_it_made(libcuda, monkeypatch, call,
                                                                                        step):
    import os

    d = _vmm_driver(monkeypatch, libcuda, step)
    with pytest.raises(KeyboardInterrupt):
        _vmm.export(0x7F0000000000, 5) if call == "export" else _vmm.is_vmm(0x7F0000000000)
    assert d.released == d.made == [0x100]  # the reference, released once
    for fd in d.descriptors:
        with pytest.raises(OSError):
            os.fstat(fd)
    assert not _vmm._exports and not _vmm._by_fd


def test_an_allocation_interrupted_once_the_driver_created_a_piece_releases_every_piece(libcuda, monkeypatch):
    d = _vmm_driver(monkeypatch, libcuda, "create")  # interrupted as the second piece is made
    monkeypatch.setattr(_vmm._reaper, "start", lambda: None)
    monkeypatch.setattr(_vmm, "allocation_prop", lambda device, shareable=True: types.SimpleNamespace(getPtr=lambda: 0))
    with pytest.raises(KeyboardInterrupt):
        _vmm.allocate(0x300000, pieces=2)
    assert sorted(d.released) == d.made == [0x100, 0x101]
    assert not d.reserved


# cuPointerGetAttributes reports virtual memory's base as the whole reservation's (on an H200: base = start
# of a 6 MiB reservation whose first 2 MiB were unmapped, size 6 MiB). _template asks is_vmm() at that base:
# an array whose reservation starts with an unmapped range is refused as "neither ... virtual memory API's".
def test_virtual_memory_in_a_reservation_with_an_unmapped_head_exports(monkeypatch):
    va, g = 0x7F0000000000, 2 << 20
    mapped = range(va + g, va + 3 * g)
    monkeypatch.setattr(_cuda, "legacy_info", lambda p: None)
    monkeypatch.setattr(_cuda, "pointer_info", lambda p: _cuda.PointerInfo(va, 3 * g, 7, "device", False))
    monkeypatch.setattr(_pools, "pool_of", lambda p: 0)
    monkeypatch.setattr(_vmm, "_handle_at",
                        lambda p: (None, 0x77) if p in mapped else ("CUDA_ERROR_INVALID_VALUE", None))
    monkeypatch.setattr(_vmm, "export_pieces", lambda lo, hi, d: [(va + g, g, 11, 1, 5), (va + 2 * g, g, 12, 2, 6)])
    monkeypatch.setattr(_vmm, "sweep_if_grown", lambda: 0)
    monkeypatch.setattr(_vmm, "pieces_id", lambda ids: 99)
    monkeypatch.setattr(_cuda, "using_device", lambda d: _Null())
    monkeypatch.setattr(_array_handle, "_device_id", lambda d: DeviceId(0, bytes(16)))
    arr = types.SimpleNamespace(dtype=np.dtype("float32"), shape=(g // 4,), strides=(4,),
                                data=types.SimpleNamespace(ptr=va + g + g // 2, device_id=0,
                                                           mem=types.SimpleNamespace(_owner=None)))
    f = _array_handle._template(arr)
    assert (f.kind, f.base_ptr, f.offset, f.allocation_size, f.more) == (Kind.VMM, va + g, g // 2, 2 * g, ((12, g),))


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _exited(*keys):
    def attach(token, pid):
        if any(token == k[0] for k in keys):
            raise ProducerExitedError("gone", pid=pid)
        return object()

    return attach


def _pipe():
    import os

    return os.pipe()


def _close(fd):
    import os

    os.close(fd)


# A block is freed (cudaFreeAsync) on whatever stream is current where its last reference goes -- a pin let go
# by the library's sweep, say -- not on the stream it was allocated and used on, as CuPy's own MemoryAsync
# does. With a non-blocking (or per-thread default) stream, the pool may hand the block to the next allocation
# while work queued on the first stream still reads or writes it.
def test_a_block_is_freed_on_the_stream_it_was_allocated_on():
    calls = []

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

    current = [Stream(0x51)]

    class Runtime:
        def mallocFromPoolAsync(self, size, pool, stream):  # noqa: N802
            calls.append(("malloc", stream))
            return 0x1000

        def freeAsync(self, ptr, stream):  # noqa: N802
            calls.append(("free", stream))

    pools = _pools._DriverPools(Runtime())
    pools.cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: current[0],
                                                                  Device=lambda d: _Null()))
    pools.pools[0] = POOL
    try:
        ptr = pools.malloc(64, 0)  # allocated, and used, on stream 0x51 (non-blocking, say)
        first, current[0] = current[0], Stream(0x52)  # dropped where another stream is current
        pools.free(ptr, 0)
        assert calls == [("malloc", 0x51), ("free", 0x51)]
        del first
        ptr = pools.malloc(64, 0)  # on 0x52, whose stream object then goes (destroyed): never named to the driver
        current[0] = Stream(0x53)
        gc.collect()
        pools.free(ptr, 0)
        assert calls[2:] == [("malloc", 0x52), ("free", 0x53)]
    finally:
        pools.pools = {}


def test_a_block_of_a_per_thread_stream_freed_on_another_thread_is_freed_after_every_threads_work():
    # Allocated on a thread's per-thread default stream (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1: CuPy's one
    # Stream.ptds, handle 2) and freed on another thread (the library's, ending a pin): handle 2 there names the
    # freeing thread's own stream, which the allocating thread's work does not precede. On the allocating
    # thread it stays 2.
    calls = []

    class Stream:
        ptr = 2

    ptds = Stream()

    class Runtime:
        def mallocFromPoolAsync(self, size, pool, stream):  # noqa: N802
            return 0x1000 + len(calls)

        def freeAsync(self, ptr, stream):  # noqa: N802
            calls.append(stream)

    pools = _pools._DriverPools(Runtime())
    pools.cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: ptds,
                                                                  Device=lambda d: _Null()))
    pools.pools[0] = POOL
    try:
        ptr = pools.malloc(64, 0)
        t = threading.Thread(target=pools.free, args=(ptr, 0))
        t.start()
        t.join()
        pools.free(pools.malloc(64, 0), 0)
        assert calls == [1, 2]  # cudaStreamLegacy, ordered after every thread's per-thread default stream
    finally:
        pools.pools = {}
