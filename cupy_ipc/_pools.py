"""Stream-ordered pool memory (``cudaMallocAsync``) shared by file descriptor.

A pool created with a POSIX file-descriptor handle type can be exported as a
descriptor (``cuMemPoolExportToShareableHandle``); each of its allocations
then crosses as 64 bytes of export data (``cuMemPoolExportPointer``). A
consumer imports each producer's pool once and each allocation with
``cuMemPoolImportPointer``, and frees the imported pointer before the
producer may free the allocation (the keep-alive pin sees to that).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import weakref
from typing import Any, Callable

from . import _cuda, _fdserver, _fork, _reaper, _segment, _threads
from ._descriptors import close_quietly, not_inherited
from ._errors import HandleError, IpcError, ProducerExitedError, warn_quietly

__all__ = ["export", "exports", "forget", "import_pointer", "pool_of", "received_fd", "release_exited",
           "send_on", "ShareableMemoryPool"]

EXPORT_BYTES = 64
_lock = threading.Lock()
_ids = _fdserver.resource_ids  # one sequence for pools and virtual memory (see there)
# producer: pool handle -> (descriptor, pool id); also pools imported here whose allocations it sends on
_exports: dict[int, tuple[int, int]] = {}
# producer: the pools of live ShareableMemoryPools, the only ones exported: nothing tells when another pool is
# destroyed, and its entry above would outlive it (its descriptor open, and a later pool of the same handle value
# exported with it).
_owned: set[int] = set()
# consumer: (producer token, pool id) -> (pool, descriptor, producer pid)
_imports: dict[tuple[bytes, int], tuple[Any, int, int]] = {}
_access: set[tuple[int, int]] = set()  # consumer: (pool handle, device) given read/write access
# consumer: pointers imported from each pool and not freed yet (or being imported), and each one's pool:
# a pool with none, whose producer has exited, is let go (see release_exited).
_live: dict[tuple[bytes, int], int] = {}
# consumer: each imported pointer's pool key, once per mapping holding it: the driver returns one pointer
# for every import of an allocation (for another GPU's mapping, or the same allocation sent by two
# processes) and unmaps it for all at the first free.
_pointer_pool: dict[int, list[tuple[bytes, int]]] = {}

NOT_SHAREABLE = (
    "this memory comes from a stream-ordered pool (cudaMallocAsync) created without a shareable handle type "
    "(CuPy's MemoryAsyncPool uses such a pool), and no other process can import it; allocate it from "
    "cupy_ipc.ShareableMemoryPool, or from CuPy's default MemoryPool"
)


NOT_OURS = (
    "this memory comes from a shareable stream-ordered pool that cupy_ipc did not create, which it cannot tell "
    "has been destroyed (its exported descriptor would outlive it); allocate it from cupy_ipc.ShareableMemoryPool"
)


def _driver() -> Any:
    return _cuda._driver()


def pool_of(ptr: int) -> int:
    """The handle of the stream-ordered pool ``ptr`` was allocated from; 0 for other memory."""
    driver = _driver()
    err, pool = driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        return 0
    return int(pool) if pool is not None else 0


def export(ptr: int, pool: int) -> tuple[bytes, int, int]:
    """``(export data, descriptor, pool id)`` for the pool allocation starting at ``ptr``."""
    driver = _driver()
    err, types = driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
                                              ptr)
    _cuda.check("asking which handle types the pool allows", err)
    if not int(types) & int(_cuda.posix_fd()):
        raise IpcError(NOT_SHAREABLE)
    with _lock:
        if pool not in _owned:
            raise IpcError(NOT_OURS)
        hit = _exports.get(pool)
        if hit is None:
            fd = ctypes.c_int(-1)  # where the driver writes the descriptor (see _cuda.open_ipc_mapping)
            try:
                _cuda.export_pool(pool, fd)
                hit = _exports[pool] = (not_inherited(fd.value), next(_ids))
            except BaseException:  # an interrupt raised as the export returned, say: not left open unused
                if fd.value >= 0:
                    os.close(fd.value)
                raise
    err, data = driver.cuMemPoolExportPointer(ptr)
    _cuda.check("exporting the pool allocation", err)
    return ctypes.string_at(data.getPtr(), EXPORT_BYTES), hit[0], hit[1]


def _forget_export(pool: int) -> None:
    """Stop exporting pool ``pool`` (it is being destroyed): its descriptor closes and no longer serves."""
    with _lock:
        hit = _exports.pop(pool, None)
        _owned.discard(pool)
        _access.difference_update([a for a in _access if a[0] == pool])  # the handle may come back
    if hit is not None:
        _fdserver.retire([hit[0]])


def send_on(token: bytes, pool_id: int) -> tuple[int, int]:
    """``(descriptor, pool id)`` with which this process sends on allocations of the pool it imported from
    the producer ``token`` (its ``pool_id`` there): its own descriptor of that pool, under an id of its own."""
    with _lock:
        hit = _imports.get((token, pool_id))
        if hit is None:
            raise IpcError("this process no longer holds the pool this array was allocated from")
        pool, fd, _ = hit
        own = _exports.get(int(pool))
        if own is None:
            own = _exports[int(pool)] = (fd, next(_ids))
        return own


def producer_fd(pool_id: int) -> int | None:
    """This process's descriptor of its pool ``pool_id``, or of a pool it imported under that key."""
    with _lock:
        for fd, pid_ in _exports.values():
            if pid_ == pool_id:
                return fd
    return None


def exports(fds: list[int], pool_id: int) -> bool:
    """True when ``fds`` is this process's descriptor of the pool it exports as ``pool_id``."""
    with _lock:
        return len(fds) == 1 and (fds[0], pool_id) in _exports.values()


def received_fd(token: bytes, pool_id: int) -> int | None:
    """The descriptor this process holds of another process's pool, if it imported it."""
    with _lock:
        hit = _imports.get((token, pool_id))
    return hit[1] if hit else None


def _live_change(key: tuple[bytes, int], n: int) -> None:
    # Under _lock.
    left = _live.get(key, 0) + n
    if left:
        _live[key] = left
    else:
        del _live[key]


def _imported_pool(token: bytes, pool_id: int, pid: int, fd_number: int,
                   descriptors: Callable[[], tuple[int, ...] | None]) -> Any:
    """The pool, imported once per process, counted as in use (by the pointer about to be imported) until
    :func:`free_imported` or ``_live_change(key, -1)``."""
    from ._descriptors import take_fd

    driver = _driver()
    key = (token, pool_id)
    with _lock:
        hit = _imports.get(key)
        if hit is not None and hit[2] != pid:
            raise HandleError(f"the handle names producer pid {pid}, but this process imported that producer's "
                              f"pool from pid {hit[2]}: it is forged or corrupt")
        if hit is not None:  # imported once per process: the descriptor need not cross again
            _live_change(key, 1)
            return hit[0]
    release_exited()  # a new producer's pool: a good time to let go of those whose producers have exited
    given = descriptors()
    fd = given[0] if given else take_fd(pid, fd_number)
    for extra in (given or ())[1:]:
        os.close(extra)
    with _lock:
        hit = _imports.get(key)
        if hit is None:
            # Imported and entered under one hold of the lock that release_exited destroys under: the driver
            # gives every import of a pool one handle, which must not be destroyed for another key meanwhile.
            pool = ctypes.c_uint64()  # where the driver writes the pool (see _cuda.open_ipc_mapping)
            try:
                _cuda.import_pool(fd, pool)
            except BaseException:
                os.close(fd)
                # Imported, then interrupted: let go, unless another key holds the same handle.
                if pool.value and not any(other[0] == pool.value for other in _imports.values()):
                    driver.cuMemPoolDestroy(pool.value)
                raise
            # Kept open: a handle sent on from here carries it (SCM_RIGHTS).
            hit = _imports[key] = (pool.value, fd, pid)
            fd = -1
        _live_change(key, 1)
    if fd >= 0:
        os.close(fd)  # another thread imported the pool meanwhile: its descriptor is the one kept
    return hit[0]


def release_exited(alive_too: bool = False) -> int:
    """Let go of the pools imported from producers that have exited (``alive_too``: from any producer), where
    nothing of them is mapped any more (arrays and idle mappings gone): their descriptors close and the driver
    releases them. Returns how many. (An import keeps the pool's memory allocated in its producer even after the
    producer destroys the pool: a live producer's pool is let go by ``collect()``, and imported again if needed.)"""
    with _lock:
        unused = [(key, hit) for key, hit in _imports.items() if key not in _live]
    exited = []
    for key, hit in unused:
        # Asked also with alive_too: an attach that finds the producer gone forgets it (its segment and the
        # events opened from it), as an open would.
        try:
            _segment.attach(key[0], hit[2])  # by the producer's segment, which a reused pid cannot fool
        except ProducerExitedError:
            exited.append((key, hit))
            continue
        except IpcError:  # cannot tell (too many open files, say): let the caller's work go on
            pass
        if alive_too:
            exited.append((key, hit))
    gone: list[int] = []
    try:
        return _release(exited, gone)
    finally:  # also if interrupted midway: the descriptors taken out of the tables are closed
        _fdserver.retire(gone)  # outside _lock, which the descriptor server's check takes


def _release(exited: list[tuple[tuple[bytes, int], tuple[Any, int, int]]], gone: list[int]) -> int:
    """release_exited's part under _lock: ``gone`` receives the descriptors to close; returns how many keys went."""
    ended = 0
    with _lock:
        for key, hit in exited:
            if key in _live or _imports.get(key) is not hit:  # a pointer was imported meanwhile
                continue
            del _imports[key]
            ended += 1
            pool = int(hit[0])
            own = _exports.get(pool)  # sent on from here, under an id of ours, with one key's descriptor
            # The driver imports a pool once per process: the same pool sent by two processes (its producer
            # and one sending its allocations on) is one handle under two keys, destroyed for both at once.
            if any(int(other[0]) == pool for other in _imports.values()):
                if own is None or own[0] != hit[1]:  # else it still serves what was sent on: closed with the pool
                    gone.append(hit[1])
                continue
            gone.append(hit[1])
            if own is not None:
                del _exports[pool]
                if own[0] != hit[1]:  # a key gone before, whose descriptor was kept for what was sent on
                    gone.append(own[0])
            _access.difference_update([a for a in _access if a[0] == pool])  # the handle may come back
            _driver().cuMemPoolDestroy(hit[0])  # under the lock that imports take (see _imported_pool)
    return ended


def _give_access(pool: Any, device: int, home: int) -> None:
    driver = _driver()
    key = (int(pool), device)
    with _lock:  # release_exited iterates and trims _access under it
        if key in _access:
            return
    (err,) = driver.cuMemPoolSetAccess(pool, [_cuda.access_desc(device)], 1)
    if err != driver.CUresult.CUDA_SUCCESS and device != home:
        _cuda.check(f"giving GPU {device} access to the imported pool", err)
    with _lock:
        _access.add(key)


def import_pointer(f: Any, device: int, home: int, descriptors: Callable[[], tuple[int, ...] | None]) -> int:
    """Map the pool allocation of handle fields ``f`` for ``device`` (current there); its pointer.

    ``descriptors()``, called only if this process has not imported the pool yet: the pool's descriptor, the
    caller's no more, or ``None`` to take it from the producer with ``pidfd_getfd``."""
    runtime = _cuda.rt()
    runtime.setDevice(device)  # the driver calls below need the device's context current on this thread
    key = (f.producer.token, f.resource)
    pool = _imported_pool(f.producer.token, f.resource, f.producer.pid, f.fd, descriptors)
    ptr = ctypes.c_uint64()  # where the driver writes the pointer (see _cuda.open_ipc_mapping)
    entered = False
    try:
        _give_access(pool, device, home)
        _cuda.import_pool_pointer(pool, f.memory_handle, device, ptr)
        with _lock:
            _pointer_pool[ptr.value] = [*_pointer_pool.get(ptr.value, ()), key]
            entered = True  # (no call since the store, so no interrupt raised between)
    except BaseException:
        if not ptr.value:
            with _lock:
                _live_change(key, -1)
            raise
        # Mapped, then interrupted (Ctrl-C during the driver's call, say): freed as a mapping let go would be, not
        # lost with the producer's memory held until this process exits.
        if not entered:
            with _lock:
                _pointer_pool.setdefault(ptr.value, []).append(key)
        try:
            free_imported(ptr.value, key)
        except Exception as e:  # noqa: BLE001 - the import's own error (or interrupt) is the one raised
            warn_quietly(f"could not free the imported pool allocation 0x{ptr.value:x}: {e}")
        raise
    return ptr.value


def free_imported(ptr: int, key: tuple[bytes, int] | None = None) -> None:
    """Unmap an imported pool allocation (the producer may free it once every importer has), once the last
    mapping holding its pointer lets it go; ``key``: the pool's that mapping imported it from."""
    with _lock:
        keys = _pointer_pool.get(ptr)
        if keys is not None and len(keys) > 1:  # another mapping still holds the pointer
            mine = key if key in keys else keys[-1]
            keys.remove(mine)
            _live_change(mine, -1)
            return
    (err,) = _driver().cuMemFree(ptr)
    with _lock:  # also when the free failed: a stale entry would make the next import's free skip cuMemFree
        keys = _pointer_pool.pop(ptr, None)
        if keys:
            _live_change(keys[0], -1)
    _cuda.check("freeing the imported pool allocation", err)


def forget() -> None:
    """After fork: the parent's descriptors and imports are not this process's to use."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    fds = {fd for fd, _ in _exports.values()} | {fd for _, fd, _ in _imports.values()}
    _exports.clear()
    _owned.clear()
    _imports.clear()
    _access.clear()
    _live.clear()
    _pointer_pool.clear()
    for fd in fds:  # this process's copies: the parent's stay open
        close_quietly(fd)


class _DriverPools:
    """The driver's pools of a :class:`ShareableMemoryPool`, with the allocator's functions. Every block holds
    this object (through the allocator's free), the pool object too, and nothing here holds them: so it goes
    with the last of them, by reference count, and destroys the pools then."""

    __slots__ = ("pools", "pid", "finalizing", "cupy", "runtime", "streams")

    def __init__(self, runtime: Any) -> None:
        cupy = _cuda.import_cupy()

        self.pools: dict[int, Any] = {}
        self.streams: dict[int, Any] = {}  # each live block's allocation stream (a weak reference), where it is freed
        self.pid, self.finalizing = os.getpid(), sys.is_finalizing  # what __del__ needs, even if creation fails
        self.cupy, self.runtime = cupy, runtime

    def pool(self, device: int) -> int:
        pool = self.pools.get(device)
        if pool is None:
            raise IpcError(f"this ShareableMemoryPool allocates on GPU {', '.join(map(str, self.pools))}, "
                           f"not on GPU {device}: make one with device=None for every GPU")
        return int(pool)

    def malloc(self, size: int, device: int) -> int:
        stream = self.cupy.cuda.get_current_stream()
        ptr = self.runtime.mallocFromPoolAsync(size, self.pool(device), stream.ptr)
        self.streams[ptr] = (weakref.ref(stream), _threads.mark())  # and the thread, whose per-thread stream it may be
        return ptr

    def free(self, ptr: int, device: int, _nameable: Callable[[int, object], int] = _threads.nameable,
             _getpid: Callable[[], int] = os.getpid) -> None:
        # Bound names only: blocks are also freed while the interpreter shuts down, when imports fail and
        # module globals are gone; the driver releases the pool's memory with the process then anyway.
        ref, owner = self.streams.pop(ptr, (None, None))
        if self.finalizing() or self.pid != _getpid():
            return  # (a forked child's copy of a block: the parent's memory, and its CUDA calls would crash or hang)
        with self.cupy.cuda.Device(device):
            # After the work queued where the block was allocated, as CuPy's MemoryAsync frees: the current
            # stream may be another, non-blocking one (a pin let go on the library's thread, say). A stream
            # object gone since was destroyed with it: the current one then, as CuPy does.
            stream = ref() if ref is not None else None
            if stream is None:
                stream = self.cupy.cuda.get_current_stream()
            self.runtime.freeAsync(ptr, _nameable(stream.ptr, owner))

    def __del__(self, _getpid: Callable[[], int] = os.getpid) -> None:
        # Nothing allocated here is still in use, nor awaited by a consumer (a pin holds its array). Destroying
        # the pools gives their memory back to the driver (they keep freed blocks otherwise), and the export's
        # descriptor is closed before the driver can hand the pool's handle to a new pool. (os.getpid is bound
        # as a default: module globals may be gone when the last block goes at exit.)
        if getattr(self, "pid", None) != _getpid() or self.finalizing():
            return  # shutting down, or a forked child's copy: the driver's state is not ours to change
        pools, self.pools = list(self.pools.items()), {}
        _reaper.now_or_later(_destroy, pools)  # (in a cycle of the user's making, the collector frees it)


def _destroy(pools: list[tuple[int, Any]]) -> None:
    """Destroy ``(GPU, pool)`` pools, each with its GPU current (on the library's thread, none may be yet)."""
    for device, pool in pools:
        _forget_export(int(pool))
        try:
            with _cuda.using_device(device, bind=True):  # driver calls, maybe on the library's thread
                (err,) = _driver().cuMemPoolDestroy(pool)  # frees still queued on a stream finish first
            _cuda.check("destroying a shareable memory pool", err)
        except Exception as e:  # destructor path: warn, never raise
            warn_quietly(f"could not destroy the memory pool of GPU {device}: {e}")


class ShareableMemoryPool:
    """A CuPy allocator whose blocks other processes can map, by file descriptor.

    One stream-ordered pool per GPU, created with a POSIX file-descriptor
    handle type; blocks are allocated (``cudaMallocFromPoolAsync``) and freed
    (``cudaFreeAsync``) on the current stream. Each array's handle carries the
    allocation's 64 bytes of export data; the pool's descriptor crosses once
    per consumer.
    Built on these calls rather than on CuPy's ``MemoryAsyncPool``, which
    allocates from the device's *current* pool and so makes its pool current
    for the whole process: every other stream-ordered allocation would land
    in it, and a second pool would take over the first's allocations. The
    driver's pools are destroyed, giving their memory back, once this object
    and everything allocated from it are gone.

    Args:
        device: The GPU to allocate on; ``None``: every GPU. Allocating on
            another GPU raises ``IpcError``.

    Example:
        >>> pool = cupy_ipc.ShareableMemoryPool()                  # doctest: +SKIP
        >>> with cupy.cuda.using_allocator(pool.malloc):           # doctest: +SKIP
        ...     a = cupy.arange(10.0)
        >>> h = cupy_ipc.get_ipc_handle(a)                         # doctest: +SKIP
    """

    def __init__(self, device: int | None = None) -> None:
        cupy = _cuda.import_cupy()
        _fork.check()  # a forked child's CUDA calls would crash or hang
        _reaper.start()  # for _DriverPools.__del__
        driver = _driver()
        n = _cuda.device_count()  # also initializes the driver
        devices = range(n) if device is None else [_cuda.checked_ordinal(device)]
        self._pools = _DriverPools(cupy.cuda.runtime)
        for d in devices:
            props = driver.CUmemPoolProps()
            props.allocType = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            props.handleTypes = _cuda.posix_fd()
            props.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            props.location.id = d
            pool = ctypes.c_uint64()  # where the driver writes the pool (see _cuda.open_ipc_mapping)
            try:
                _cuda.create_pool(props, d, pool)
            except BaseException:  # made, then interrupted: destroyed, not left holding its memory
                if pool.value:
                    _destroy([(d, pool.value)])
                raise
            self._pools.pools[d] = pool.value  # (no call since the create: no interrupt raised between)
            with _lock:
                _owned.add(pool.value)
            # Keep freed memory in the pool for the next allocation, as CuPy's pools do.
            (err,) = driver.cuMemPoolSetAttribute(
                pool.value, driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, driver.cuuint64_t(2**64 - 1))
            _cuda.check("setting the pool's release threshold", err)
        self._allocator = cupy.cuda.memory.PythonFunctionAllocator(self._pools.malloc, self._pools.free)

    def malloc(self, size: int) -> Any:
        """Allocate ``size`` bytes on the current GPU and stream (``cupy.cuda.set_allocator(pool.malloc)``)."""
        _fork.check()  # a forked child's CUDA calls would crash or hang (CuPy's allocator makes them)
        return self._allocator.malloc(size)

    def _attribute(self, name: str) -> int:
        _fork.check()
        runtime = _cuda.rt()
        pool = self._pools.pools.get(runtime.getDevice())
        return 0 if pool is None else int(runtime.memPoolGetAttribute(int(pool), getattr(runtime, name)))

    def used_bytes(self) -> int:
        """Bytes in use on the current GPU."""
        return self._attribute("cudaMemPoolAttrUsedMemCurrent")

    def total_bytes(self) -> int:
        """Bytes the pool holds on the current GPU, in use or not."""
        return self._attribute("cudaMemPoolAttrReservedMemCurrent")

    def free_bytes(self) -> int:
        """Bytes the pool holds on the current GPU and has not handed out (``total_bytes() - used_bytes()``)."""
        return self.total_bytes() - self.used_bytes()

    def free_all_blocks(self, stream: Any = None) -> None:
        """Give the current GPU's unused memory back to the driver (after ``stream``'s frees)."""
        import cupy

        _fork.check()
        runtime = _cuda.rt()
        (stream or cupy.cuda.get_current_stream()).synchronize()
        pool = self._pools.pools.get(runtime.getDevice())
        if pool is not None:
            runtime.memPoolTrimTo(int(pool), 0)

    @property
    def handles(self) -> dict[int, int]:
        """The ``cudaMemPool_t`` of each GPU this pool allocates on, by ordinal."""
        return {d: int(p) for d, p in self._pools.pools.items()}
