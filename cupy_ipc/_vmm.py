"""Memory of CUDA's virtual memory API (``cuMemCreate`` + ``cuMemMap``) shared by file descriptor.

PyTorch's ``expandable_segments`` and custom CuPy allocators make such
memory. An allocation created with a POSIX file-descriptor handle type is
exported as a descriptor (``cuMemExportToShareableHandle``); the consumer
imports it, reserves an address range, maps it there and gives its GPU
read/write access. The driver counts references to the physical memory: it
lives while the producer or any consumer maps it.

The producer keeps one descriptor per exported allocation, for consumers that
take it with ``pidfd_getfd``, and closes it at the first export or
``collect()`` after the allocation is no longer mapped in the producer.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

from . import _cuda
from ._errors import IpcError

__all__ = ["allocate", "export", "import_mapping", "is_vmm", "producer_fd", "sweep", "unmap"]

_lock = threading.Lock()
_ids = itertools.count(1)
# producer: allocation id -> (descriptor, base, buffer id)
_exports: dict[int, tuple[int, int, int]] = {}
_by_buffer: dict[int, int] = {}  # buffer id -> allocation id

NOT_SHAREABLE = (
    "this memory comes from CUDA's virtual memory API (cuMemCreate) without a shareable handle type, and no "
    "other process can import it; create it with requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR "
    "(PyTorch's expandable segments do), or allocate from cupy_ipc.ShareableMemoryPool or CuPy's default MemoryPool"
)


def _driver() -> Any:
    return _cuda._driver()


def is_vmm(ptr: int) -> bool:
    """True when ``ptr`` is mapped from an allocation of the virtual memory API."""
    driver = _driver()
    err, handle = driver.cuMemRetainAllocationHandle(ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        return False
    driver.cuMemRelease(handle)
    return True


def export(base: int, buffer_id: int) -> tuple[int, int]:
    """``(descriptor, allocation id)`` of the allocation mapped at ``base``; one descriptor per allocation."""
    driver = _driver()
    with _lock:
        hit = _by_buffer.get(buffer_id)
        if hit is not None and _exports[hit][1] == base:
            return _exports[hit][0], hit
    err, handle = driver.cuMemRetainAllocationHandle(base)
    _cuda.check("finding the allocation behind the pointer", err)
    try:
        err, prop = driver.cuMemGetAllocationPropertiesFromHandle(handle)
        _cuda.check("reading the allocation's properties", err)
        if not int(prop.requestedHandleTypes) & int(_cuda.posix_fd()):
            raise IpcError(NOT_SHAREABLE)
        err, fd = driver.cuMemExportToShareableHandle(handle, _cuda.posix_fd(), 0)
        _cuda.check("exporting the allocation", err)
    finally:
        driver.cuMemRelease(handle)
    with _lock:
        alloc_id = next(_ids)
        _exports[alloc_id] = (int(fd), base, buffer_id)
        _by_buffer[buffer_id] = alloc_id
    return int(fd), alloc_id


def producer_fd(alloc_id: int) -> int | None:
    """This process's descriptor of its exported allocation ``alloc_id``."""
    with _lock:
        hit = _exports.get(alloc_id)
    return hit[0] if hit else None


def sweep() -> int:
    """Close the descriptors of exported allocations no longer mapped here; returns how many."""
    with _lock:
        items = list(_exports.items())
    gone = []
    for alloc_id, (fd, base, buffer_id) in items:
        try:
            info = _cuda.pointer_info(base)
            alive = info.buffer_id == buffer_id and info.base == base
        except IpcError:
            alive = False
        if not alive:
            gone.append((alloc_id, fd, buffer_id))
    with _lock:
        for alloc_id, fd, buffer_id in gone:
            if _exports.pop(alloc_id, None) is not None:
                os.close(fd)
                if _by_buffer.get(buffer_id) == alloc_id:
                    del _by_buffer[buffer_id]
    return len(gone)


def import_mapping(pid: int, fd_number: int, size: int, device: int, given_fd: int | None) -> int:
    """Import the producer's allocation and map its ``size`` bytes for ``device``; the mapped address."""
    from cupy.cuda import runtime

    from ._descriptors import take_fd

    driver = _driver()
    runtime.setDevice(device)  # the driver calls below need the device's context current on this thread
    fd = given_fd if given_fd is not None else take_fd(pid, fd_number)
    try:
        err, handle = driver.cuMemImportFromShareableHandle(fd, _cuda.posix_fd())
        _cuda.check("importing the producer's allocation", err)
    finally:
        os.close(fd)  # the imported handle holds the memory
    return _map_and_release(handle, size, device)


def _map_and_release(handle: Any, size: int, device: int) -> int:
    """Map allocation ``handle`` at new addresses, readable and writable by ``device``; the handle is released
    (the mapping holds the memory). Returns the address."""
    driver = _driver()
    ptr = 0
    try:
        err, ptr = driver.cuMemAddressReserve(size, 0, 0, 0)
        _cuda.check("reserving addresses for the mapping", err)
        ptr = int(ptr)
        (err,) = driver.cuMemMap(ptr, size, 0, handle, 0)
        _cuda.check("mapping the allocation", err)
        (err,) = driver.cuMemSetAccess(ptr, size, [_cuda.access_desc(device)], 1)
        _cuda.check(f"giving GPU {device} access to the mapping", err)
    except BaseException:
        if ptr:
            driver.cuMemUnmap(ptr, size)
            driver.cuMemAddressFree(ptr, size)
        raise
    finally:
        driver.cuMemRelease(handle)
    return ptr


def unmap(ptr: int, size: int) -> None:
    """Undo :func:`import_mapping`."""
    driver = _driver()
    (err,) = driver.cuMemUnmap(ptr, size)
    _cuda.check("unmapping the producer's allocation", err)
    (err,) = driver.cuMemAddressFree(ptr, size)
    _cuda.check("freeing the mapping's addresses", err)


def forget() -> None:
    """After fork: the parent's descriptors are not this process's to hand out."""
    _exports.clear()
    _by_buffer.clear()


class _Owner:
    """Unmaps an allocation made by :func:`allocate` once no array uses it."""

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr, self.size = ptr, size

    def __del__(self) -> None:
        try:
            unmap(self.ptr, self.size)
        except Exception:  # noqa: BLE001 - a destructor; the driver frees everything at exit
            pass


def allocate(nbytes: int, shareable: bool = True) -> Any:
    """A ``cupy.cuda.MemoryPointer`` to ``nbytes`` (rounded up to the granularity) of virtual memory on the
    current GPU, created with a POSIX file-descriptor handle type (unless not ``shareable``).

    Usable as a CuPy allocator: ``cupy.cuda.using_allocator(allocate)``.
    """
    import cupy
    from cupy.cuda import runtime

    driver = _driver()
    device = runtime.getDevice()
    runtime.setDevice(device)  # the context, current for the driver calls
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    if shareable:
        prop.requestedHandleTypes = _cuda.posix_fd()
    err, granularity = driver.cuMemGetAllocationGranularity(
        prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    _cuda.check("reading the allocation granularity", err)
    size = max(1, -(-nbytes // int(granularity))) * int(granularity)
    err, handle = driver.cuMemCreate(size, prop, 0)
    _cuda.check("creating virtual memory", err)
    ptr = _map_and_release(handle, size, device)
    mem = cupy.cuda.UnownedMemory(ptr, size, _Owner(ptr, size), device)
    return cupy.cuda.MemoryPointer(mem, 0)
