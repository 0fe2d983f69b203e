"""Memory of CUDA's virtual memory API (``cuMemCreate`` + ``cuMemMap``) shared by file descriptor.

PyTorch's ``expandable_segments`` and custom CuPy allocators make such
memory. An allocation created with a POSIX file-descriptor handle type is
exported as a descriptor (``cuMemExportToShareableHandle``); the consumer
imports it, reserves an address range, maps it there and gives its GPU
read/write access. The driver counts references to the physical memory: it
lives while the producer or any consumer maps it.

The producer keeps one descriptor per exported allocation, for consumers that
take it with ``pidfd_getfd``, and closes it once the allocation is no longer
mapped in the producer: at ``collect()``, or at the first new export after the
descriptors kept have doubled since the last such sweep (64 at least). Each
export then costs a constant number of driver queries on average, however many
allocations are exported, and at most about twice as many descriptors stay open
as exported allocations are still mapped.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Any

from . import _cuda, _fdserver, _fork, _reaper
from ._descriptors import close_quietly, not_inherited
from ._errors import IpcError, warn_quietly
from ._wire import MAX_PIECES

__all__ = ["allocate", "allocation_prop", "export", "export_pieces", "exported_run", "exports", "import_mapping",
           "is_vmm", "pieces_id", "pieces_of", "still_mapped", "sweep", "sweep_if_grown", "unmap"]

_lock = threading.Lock()
_ids = _fdserver.resource_ids  # one sequence for pools and virtual memory (see there)
# producer: allocation id -> (descriptor, (base, buffer id, allocation handle)). PyTorch's expandable
# segments map new allocations at freed addresses, so the address alone does not name an allocation, nor
# does the handle with it: handle values are reused once an allocation is released (seen on an H200: three
# allocations in turn at one address, the first and third with one handle value). The buffer id is unique
# in the process and to each piece of a mapping, where the base that cuPointerGetAttributes reports is the
# whole mapping's.
_Key = tuple[int, int, int]
_exports: dict[int, tuple[int, _Key]] = {}
_by_mapping: dict[_Key, int] = {}
_by_fd: dict[int, int] = {}  # descriptor -> allocation id: the descriptor server checks a request in O(1) per number
# producer: an id for each run of pieces that exports share (see pieces_id), never reused.
_runs: dict[tuple[int, ...], int] = {}
_RUNS_FLOOR = 4096  # runs kept before those with a piece no longer exported are looked for
_runs_prune_at = _RUNS_FLOOR
# consumer: the descriptor each piece mapped by import_mapping was imported from, by the piece's address,
# until export() adopts it (an imported allocation cannot be exported again) or unmap() closes it.
_kept: dict[int, int] = {}

NOT_SHAREABLE = (
    "this memory comes from CUDA's virtual memory API (cuMemCreate) without a shareable handle type, and no "
    "other process can import it; create it with requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR "
    "(PyTorch's expandable segments do), or allocate from cupy_ipc.ShareableMemoryPool or CuPy's default MemoryPool"
)


def _driver() -> Any:
    return _cuda._driver()


def _handle_at(ptr: int) -> tuple[str | None, int | None]:
    """``(None, handle of the allocation mapped at ptr)``, or ``(CUDA error name, None)``
    (``cuMemRetainAllocationHandle``)."""
    handle = ctypes.c_uint64()  # where the driver writes its reference (see _cuda.open_ipc_mapping)
    try:
        _cuda.retain_allocation(ptr, handle)
    except IpcError as e:
        return e.cuda_error, None
    finally:  # also one an interrupt was raised after: the allocation would never be freed
        _release([handle])
    return None, handle.value


def is_vmm(ptr: int) -> bool:
    """True when ``ptr`` is mapped from an allocation of the virtual memory API."""
    return _handle_at(ptr)[1] is not None


def export(base: int, buffer_id: int) -> tuple[int, int]:
    """``(descriptor, allocation id)`` of the allocation mapped at ``base`` (whose buffer id is
    ``buffer_id``); one descriptor per allocation. A piece this process imported is exported with the
    descriptor it came from."""
    driver = _driver()
    # Where the driver writes its reference and the descriptor (see _cuda.open_ipc_mapping): each is let go
    # below, also one that an interrupt (Ctrl-C) arriving during the driver's call was raised after.
    handle, fd = ctypes.c_uint64(), ctypes.c_int(-1)
    try:
        try:
            _cuda.retain_allocation(base, handle)
            key = (base, buffer_id, handle.value)
            with _lock:
                hit = _by_mapping.get(key)
                if hit is None and (kept := _kept.pop(base, None)) is not None:
                    hit = _register(kept, key)  # in the same block: another thread sending it too finds it here
                if hit is not None:
                    return _exports[hit][0], hit
            err, prop = driver.cuMemGetAllocationPropertiesFromHandle(handle.value)
            _cuda.check("reading the allocation's properties", err)
            if not int(prop.requestedHandleTypes) & int(_cuda.posix_fd()):
                raise IpcError(NOT_SHAREABLE)
            _cuda.export_allocation(handle.value, fd)
        finally:
            _release([handle])
        not_inherited(fd.value)
        with _lock:
            hit = _by_mapping.get(key)
            if hit is None:
                hit = _register(fd.value, key)
                ours, fd.value = fd.value, -1  # the tables' now (no call since _register's stores)
                return ours, hit
            theirs = _exports[hit][0]
    finally:  # ours, never handed out: another thread exported the allocation meanwhile, or something raised
        if fd.value >= 0:
            os.close(fd.value)
    return theirs, hit


def _register(fd: int, key: _Key) -> int:
    """Enter an exported allocation in the tables; its id. The caller holds ``_lock``."""
    alloc_id = next(_ids)
    _exports[alloc_id] = (fd, key)  # closed by the sweep once unmapped
    _by_mapping[key] = alloc_id
    _by_fd[fd] = alloc_id
    return alloc_id


def exports(fds: list[int], resource: int) -> bool:
    """True when ``fds`` are the descriptors, in order, of the run of pieces this process exports as
    ``resource`` (see :func:`pieces_id`)."""
    return exported_run(fds, resource) is not None


def exported_run(fds: list[int], resource: int) -> list[tuple[int, int]] | None:
    """``(base, buffer id)`` of each piece, in order, if ``fds`` are the descriptors of the run of pieces this
    process exports as ``resource``; else ``None``."""
    with _lock:
        ids = tuple(_by_fd.get(fd) for fd in fds)
        if None in ids or (ids[0] if len(ids) == 1 else _runs.get(ids)) != resource:  # type: ignore[arg-type]
            return None
        return [_exports[i][1][:2] for i in ids]  # type: ignore[index]


def still_mapped(run: list[tuple[int, int]]) -> int:
    """How many bytes from the first piece of ``run`` (as :func:`exported_run` gives it) on are its pieces,
    each still mapped where it was exported, one after another."""
    at = start = run[0][0]
    for base, buffer_id in run:
        try:
            mapped, size = _cuda.address_range(base)
            if base != at or mapped != base or _cuda.pointer_info(base).buffer_id != buffer_id:
                break
        except IpcError:  # nothing mapped there any more
            break
        at = base + size
    return at - start


# Errors that say nothing about the address (no context on this thread, a driver shutting down): keep.
_UNSURE = ("CUDA_ERROR_INVALID_CONTEXT", "CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_DEINITIALIZED",
           "CUDA_ERROR_CONTEXT_IS_DESTROYED")


def _still_mapped(key: _Key) -> bool:
    base, buffer_id, handle = key
    err, now = _handle_at(base)
    if now is None:
        return err in _UNSURE
    try:
        return now == handle and _cuda.pointer_info(base).buffer_id == buffer_id
    except IpcError as e:
        return any(name in str(e.cuda_error) for name in _UNSURE)


_SWEEP_FLOOR = 64
_sweep_at = _SWEEP_FLOOR  # how many descriptors kept make the next export sweep


def sweep() -> int:
    """Close the descriptors of exported allocations no longer mapped where they were; returns how many."""
    global _sweep_at
    with _lock:
        items = list(_exports.items())
    gone = [alloc_id for alloc_id, (_, key) in items if not _still_mapped(key)]
    with _lock:
        closing = _forget_exports(gone)
        _sweep_at = max(_SWEEP_FLOOR, 2 * len(_exports))
    _fdserver.retire(closing)  # outside _lock, which the descriptor server's check takes
    return len(gone)


def _forget_exports(alloc_ids: list[int]) -> list[int]:
    """Drop exported allocations ``alloc_ids`` from the tables; their descriptors, to be retired. The caller
    holds ``_lock``."""
    closing = []
    for alloc_id in alloc_ids:
        entry = _exports.pop(alloc_id, None)
        if entry is None:
            continue
        fd, key = entry
        if _by_fd.get(fd) == alloc_id:  # before the close, which frees the number for reuse
            del _by_fd[fd]
        closing.append(fd)
        if _by_mapping.get(key) == alloc_id:
            del _by_mapping[key]
    return closing


def sweep_if_grown() -> int:
    """:func:`sweep`, once the descriptors kept have doubled since the last sweep (64 at least)."""
    return sweep() if len(_exports) >= _sweep_at else 0


def export_pieces(lo: int, hi: int, device: int) -> list[tuple[int, int, int, int, int]]:
    """Export every mapped piece covering addresses ``[lo, hi)`` of ``device``'s memory: ``(base, size,
    descriptor, id, buffer id)`` each. Leaves ``device`` current."""
    runtime = _cuda.rt()
    # The driver calls need a current context, which a thread of its own (a queue's feeder) lacks until
    # the runtime binds one.
    runtime.setDevice(device)
    pieces = []
    at = lo
    while at < hi:
        if len(pieces) > MAX_PIECES:  # before exporting one more: the exports of a refused array would stay
            raise IpcError(f"the array spans more than {MAX_PIECES + 1} pieces of virtual memory, the most that "
                           "can be shared: copy it into one array first")
        try:
            base, size = _cuda.address_range(at)
        except IpcError as e:
            raise IpcError(f"the array reaches 0x{at:x}, where no virtual memory is mapped") from e
        buffer_id = _cuda.pointer_info(base).buffer_id
        fd, alloc_id = export(base, buffer_id)
        pieces.append((base, size, fd, alloc_id, buffer_id))
        at = base + size
    return pieces


def pieces_id(alloc_ids: tuple[int, ...]) -> int:
    """An id, never reused in this process, for the run of exported allocations ``alloc_ids`` (as
    :func:`export_pieces` gives them): what a consumer keys its mapping by, so that a mapping kept idle is
    never taken for another run, such as one where a later piece was replaced by a new allocation."""
    if len(alloc_ids) == 1:
        return alloc_ids[0]
    with _lock:
        run = _runs.get(alloc_ids)
        if run is None:
            if len(_runs) >= _runs_prune_at:
                _prune_runs()
            run = _runs[alloc_ids] = next(_ids)
    return run


def _prune_runs() -> None:
    """Forget the runs with a piece no longer exported; looked for again once the table has doubled (amortized).

    Only those: the descriptor server checks a request against this table, so a handle of a run whose pieces
    all live is served however many runs were exported after it; one with a piece gone is refused anyway (its
    descriptor is closed), and allocation ids are never reused, so a forgotten run never comes back. The
    caller holds ``_lock``.
    """
    global _runs_prune_at
    for ids in [ids for ids in _runs if not all(a in _exports for a in ids)]:
        del _runs[ids]
    _runs_prune_at = max(_RUNS_FLOOR, 2 * len(_runs))


def pieces_of(f: Any) -> list[tuple[int, int]]:
    """``(descriptor number in the producer, size)`` of each piece of handle fields ``f``, in address order."""
    first = f.allocation_size - sum(size for _, size in f.more)
    return [(f.fd, first), *f.more]


def import_mapping(pid: int, pieces: list[tuple[int, int]], device: int, given: tuple[int, ...] | None) -> int:
    """Import the producer's pieces and map them, in order, at new addresses for ``device``; the first address.

    ``given``: the pieces' descriptors, received with the handle; else each is taken from the producer.
    The descriptors stay open while the mapping lives, so that an array of it can be sent on (:func:`export`
    adopts them); :func:`unmap` closes the others.
    """
    from ._descriptors import take_fd

    given_fds = list(given) if given is not None else []
    fds: list[int] = []
    # Each handle's place before its import: one that an interrupt (Ctrl-C) arriving during the driver's call is
    # raised after is released too, not lost with the producer's memory held until this process exits.
    handles: list[tuple[ctypes.c_uint64, int]] = []
    sizes = [size for _, size in pieces]
    ptr = 0
    try:
        try:
            _cuda.rt().setDevice(device)  # the driver calls below need the device's context current on this thread
            for k, (number, size) in enumerate(pieces):
                fd = given_fds[k] if k < len(given_fds) else take_fd(pid, number)
                if k < len(given_fds):
                    given_fds[k] = -1
                fds.append(fd)
                handle = ctypes.c_uint64()
                handles.append((handle, size))
                _cuda.import_allocation(fd, device, handle)
            ptr = _map([(handle.value, size) for handle, size in handles], device)
        finally:  # the mapping holds the memory now, if made
            _release([handle for handle, _ in handles])
        with _lock:
            at = ptr
            for fd, size in zip(fds, sizes):
                _kept[at] = fd
                at += size
    except BaseException:  # also one raised once mapped (Ctrl-C in a release above): nothing made is stranded
        if ptr:
            with _lock:
                at = ptr
                for size in sizes:
                    _kept.pop(at, None)
                    at += size
            _unmap(ptr, sizes, sum(sizes))
        _close(fds + given_fds)  # the descriptors received too: each would keep the producer's memory alive
        raise
    return ptr


def _close(fds: list[int]) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


def _map(handles: list[tuple[Any, int]], device: int) -> int:
    """Map allocations ``(handle, size)``, in order, at new contiguous addresses readable and writable by
    ``device``; the first address. The caller releases the handles (the mappings hold the memory)."""
    driver = _driver()
    total = sum(size for _, size in handles)
    ptr = ctypes.c_uint64()  # where the driver writes the first address (see _cuda.open_ipc_mapping)
    mapped: list[int] = []
    try:
        _cuda.reserve_addresses(total, device, ptr)
        at = ptr.value
        for handle, size in handles:
            mapped.append(size)  # before the call: a piece that an interrupt is raised after is unmapped too
            (err,) = driver.cuMemMap(at, size, 0, handle, 0)
            if err != driver.CUresult.CUDA_SUCCESS:
                mapped.pop()
                _cuda.check("mapping the allocation", err)
            at += size
        (err,) = driver.cuMemSetAccess(ptr.value, total, [_cuda.access_desc(device)], 1)
        _cuda.check(f"giving GPU {device} access to the mapping", err)
    except BaseException:
        if ptr.value:
            _unmap(ptr.value, mapped, total)
        raise
    return ptr.value


def give_access(ptr: int, size: int, device: int) -> None:
    """Let ``device`` read and write this process's own mapped virtual memory ``[ptr, ptr + size)``: peer access
    does not reach virtual memory, ``cuMemSetAccess`` does."""
    (err,) = _driver().cuMemSetAccess(ptr, size, [_cuda.access_desc(device)], 1)
    _cuda.check(f"giving GPU {device} access to the memory", err)


def _release(places: list[ctypes.c_uint64]) -> None:
    """Release the allocation handles the driver wrote into ``places`` (an empty place: it wrote none)."""
    for place in places:
        if place.value:
            _driver().cuMemRelease(place.value)


def _unmap(ptr: int, sizes: list[int], total: int) -> list[Any]:
    driver = _driver()
    errors = []
    offset = 0
    for size in sizes:
        (err,) = driver.cuMemUnmap(ptr + offset, size)
        errors.append(err)
        offset += size
    (err,) = driver.cuMemAddressFree(ptr, total)
    return [*errors, err]


def unmap(ptr: int, sizes: list[int]) -> None:
    """Undo :func:`import_mapping` (or a mapping of :func:`allocate`): unmap each piece, free the addresses.

    The descriptors of exports of these pieces are closed too: each holds its allocation's memory, which
    for a piece sent on is another process's, until a sweep would find it unmapped.
    """
    kept, at = [], ptr
    end = ptr + sum(sizes)
    with _lock:
        for size in sizes:
            kept.append(_kept.pop(at, -1))
            at += size
        exported = _forget_exports([i for i, (_, key) in _exports.items() if ptr <= key[0] < end])
    _close(kept)
    _fdserver.retire(exported)
    for err in _unmap(ptr, sizes, sum(sizes)):
        _cuda.check("unmapping the producer's allocation", err)


def forget() -> None:
    """After fork: the parent's descriptors are not this process's to hand out."""
    global _sweep_at, _lock, _runs_prune_at
    _lock = threading.Lock()  # another thread may have held it at the fork
    fds = {fd for fd, _ in _exports.values()} | set(_kept.values())
    _exports.clear()
    _runs.clear()
    _by_mapping.clear()
    _by_fd.clear()
    _kept.clear()
    for fd in fds:  # this process's copies: the parent's stay open
        close_quietly(fd)
    _sweep_at = _SWEEP_FLOOR
    _runs_prune_at = _RUNS_FLOOR


class _Owner:
    """Unmaps an allocation made by :func:`allocate` once no array uses it."""

    def __init__(self, ptr: int, sizes: list[int], device: int) -> None:
        self.ptr, self.sizes, self.device = ptr, sizes, device

    def __del__(self, _finalizing: Any = sys.is_finalizing) -> None:
        # Bound as a default: at interpreter exit module globals may be gone,
        # and the driver frees everything with the process then anyway.
        if _finalizing() or _fork.forked_after_cuda():  # (a forked child's CUDA calls would crash or hang)
            return
        _reaper.now_or_later(_free_allocated, self.ptr, self.sizes, self.device)


def _free_allocated(ptr: int, sizes: list[int], device: int) -> None:
    try:
        # Unlike cudaFree, unmapping does not wait for the GPU: work still
        # queued on the memory would fault. Wait as cudaFree would.
        with _cuda.using_device(device):
            _cuda.rt().deviceSynchronize()
        unmap(ptr, sizes)
    except Exception as e:  # destructor path: warn, never raise
        warn_quietly(f"could not free the virtual memory at 0x{ptr:x}: {e}")


def allocation_prop(device: int, shareable: bool = True) -> Any:
    """The properties of a ``cuMemCreate`` allocation on ``device``, with a POSIX file-descriptor handle type
    if ``shareable``."""
    driver = _driver()
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    if shareable:
        prop.requestedHandleTypes = _cuda.posix_fd()
    return prop


def allocate(nbytes: int, shareable: bool = True, pieces: int = 1) -> Any:
    """A ``cupy.cuda.MemoryPointer`` to ``nbytes`` (rounded up to the granularity) of virtual memory on the
    current GPU, created with a POSIX file-descriptor handle type (unless not ``shareable``), as ``pieces``
    allocations mapped one after another (as PyTorch's expandable segments map theirs).

    Usable as a CuPy allocator: ``cupy.cuda.using_allocator(allocate)``.
    """
    import cupy

    _reaper.start()  # for _Owner.__del__
    runtime = _cuda.rt()
    driver = _driver()
    device = runtime.getDevice()
    runtime.setDevice(device)  # the context, current for the driver calls
    prop = allocation_prop(device, shareable)
    err, granularity = driver.cuMemGetAllocationGranularity(
        prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    _cuda.check("reading the allocation granularity", err)
    g = int(granularity)
    size = max(1, -(-nbytes // (g * pieces))) * g  # per piece
    handles: list[ctypes.c_uint64] = []  # each made before its call, as in import_mapping
    sizes = [size] * pieces
    ptr = 0
    try:
        try:
            for _ in range(pieces):
                handles.append(ctypes.c_uint64())
                _cuda.create_allocation(size, prop, device, handles[-1])
            ptr = _map([(handle.value, size) for handle in handles], device)
        finally:  # the mapping holds the memory now, if made
            _release(handles)
        owner = _Owner(ptr, sizes, device)
    except BaseException:  # also one raised once mapped (Ctrl-C in a release above): unmapped, not stranded
        if ptr:
            _unmap(ptr, sizes, size * pieces)
        raise
    mem = cupy.cuda.UnownedMemory(ptr, size * pieces, owner, device)
    return cupy.cuda.MemoryPointer(mem, 0)
