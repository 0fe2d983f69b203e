"""Array handles: export a GPU array with :func:`get_ipc_handle`, open it with :meth:`IpcArrayHandle.open`."""

from __future__ import annotations

import collections
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Iterable, NamedTuple

import numpy as np

from . import _cuda, _fdserver, _fork, _gates, _keepalive, _mapping, _pools, _segment, _vmm, _words
from ._args import checked_count, checked_lease
from ._descriptors import close_all
from ._errors import HandleError, IpcError, ProducerExitedError
from ._events import check_same_host, open_cached
from ._identity import Producer, this_process
from ._wire import (
    FLAG_EVENT,
    FLAG_KEEPALIVE,
    FLAG_WORD,
    VERSION,
    ArrayFields,
    DeviceId,
    Kind,
    byte_extent,
    dtype_of,
    export_parts,
    field_int,
    field_ints,
    field_items,
    layout_of,
    pack_array,
    readable,
    splice,
    unpack_array,
    validate_array,
    validate_layout,
    with_allocation,
    with_export,
)

__all__ = ["IpcArrayHandle", "OpenInfo", "get_ipc_handle", "open_info"]

_NO_HANDLE = bytes(64)

# Memory handles by the driver's buffer id, which is never reused in a process,
# so a new array in an allocation exported before skips cudaIpcGetMemHandle;
# and the other way, so that a handle of ours sent back to us by another
# process opens our own memory (CUDA refuses a legacy handle in its own
# process, and imports a pool's allocation again, at a second address).
# An allocation still here is never forgotten: past _HANDLE_CACHE_SIZE, each
# new entry looks at the two oldest, dropping them if their allocation is gone
# and sending them to the back of the line if not, so the table holds at most
# about twice the allocations that are alive.
_handle_cache: dict[int, bytes] = {}
_exported: "collections.OrderedDict[bytes, tuple[int, int]]" = collections.OrderedDict()  # -> (base, buffer id)
_HANDLE_CACHE_SIZE = 4096
_exported_lock = threading.Lock()
_fd_lock = threading.Lock()  # swaps a handle's descriptors: two threads closing it must not both close them


def _memory_handle(base: int, buffer_id: int) -> bytes:
    raw = _handle_cache.get(buffer_id)
    if raw is None:
        runtime = _cuda.rt()
        raw = bytes(_cuda.call("exporting the allocation", runtime.ipcGetMemHandle, base))
        _remember_export(raw, base, buffer_id)
        _handle_cache[buffer_id] = raw
    return raw


def _remember_export(handle: bytes, base: int, buffer_id: int) -> None:
    """Note that ``handle`` (a memory handle or pool export data) names our allocation at ``base``."""
    with _exported_lock:  # exports run on several threads (a queue pickles on its feeder's)
        if len(_exported) >= _HANDLE_CACHE_SIZE:
            for _ in range(2):
                old, (old_base, old_id) = next(iter(_exported.items()))
                if _still_here(old_base, old_id):
                    _exported.move_to_end(old)
                else:
                    del _exported[old]
                    _handle_cache.pop(old_id, None)
        prior = _exported.get(handle)
        if prior is not None and prior[1] != buffer_id:  # the same bytes for a later allocation at one address
            _handle_cache.pop(prior[1], None)
        _exported[handle] = (base, buffer_id)


def _still_here(base: int, buffer_id: int) -> bool:
    """Whether our allocation ``buffer_id`` at ``base`` has not been freed."""
    try:
        info = _cuda.pointer_info(base)
    except IpcError:
        return False
    return info.base == base and info.buffer_id == buffer_id


_warned_across: set[tuple[int, int]] = set()


def _default_device(home: int, current: int) -> int:
    """Where ``open()`` maps by default: the ``current`` GPU, if it can reach the memory's GPU ``home``.

    An IPC mapping is reachable only from the GPU it was made on (measured:
    a kernel of another GPU reading it faults, peer access or not), while CuPy
    runs an array's kernels on the current GPU. So the default follows the
    current GPU; without peer access it stays ``home``, where CuPy refuses
    cross-GPU use with a clear error instead.
    """
    if current == home or not _cuda.can_access_peer(current, home):
        return home
    if (current, home) not in _warned_across:
        _warned_across.add((current, home))
        import cupy

        warnings.warn(
            f"an array of GPU {home} was opened on the current GPU {current}, which reads it through peer "
            f"access (slower than its own GPU): make GPU {home} current, or open(device={home}), to work on it "
            "there", cupy._util.PerformanceWarning, stacklevel=4)
    return current


def _producer_numbers(f: ArrayFields) -> list[int]:
    """The numbers, in the producer, of the descriptors behind handle fields ``f``: the pool's, or each piece's."""
    return [f.fd, *(fd for fd, _ in f.more)]


def _check_still_allocated(base: int, buffer_id: int, f: ArrayFields) -> None:
    """That our allocation at ``base`` is still the one exported, and holds all that handle ``f`` claims."""
    if f.kind == Kind.VMM:
        # Virtual memory: the run of pieces exported under the handle's id, each still where it was exported.
        run = _vmm.exported_run(_producer_numbers(f), f.resource)
        if run is None:  # (as a freed allocation's are once its descriptors are closed)
            raise IpcError("this process exported that virtual memory and has since freed it (its descriptors "
                           "are closed), or the handle is forged")
        if run[0] != (base, buffer_id):
            raise HandleError("the handle names virtual memory that this process does not export under its "
                              "descriptors and id: it is forged or corrupt")
        mapped = _vmm.still_mapped(run)
        if mapped < f.allocation_size:
            raise IpcError(f"the handle claims {f.allocation_size} bytes of virtual memory where this process "
                           f"still maps {mapped} of the pieces it exported: it freed them, or the handle is forged")
        return
    info = _cuda.pointer_info(base)  # a cudaMalloc or pool allocation: one range
    if info.buffer_id != buffer_id or info.base != base:
        raise IpcError("this process exported that memory and has since freed it")
    if info.size < f.allocation_size:
        raise HandleError(f"the handle claims a {f.allocation_size}-byte allocation where this process has "
                          f"{info.size} bytes: the handle is forged or corrupt")


def _received_lease(owner: Any) -> "_mapping.Lease | None":
    """The lease of the mapping behind an array this process opened from another one, if it is one.

    ``owner`` is the array's memory's owner.
    """
    while isinstance(owner, _mapping.Lease):
        if owner.imported:
            return owner
        if owner.keep is None:  # our own memory
            return None
        # an export of ours that we opened ourselves: look at what it was
        owner = getattr(getattr(getattr(owner.keep, "data", None), "mem", None), "_owner", None)
    return None


# The validated fields and the wire form of an export of each live cupy.ndarray
# exported: an array's pointer and allocation cannot change while it lives (its
# layout can, by assigning its shape, which an export checks), so a re-sent
# array costs no driver query, no validation and no packing (only its flags and
# export part are spliced in).
class _ById:
    """Values kept for live objects that cannot be hashed (arrays), dropped when the object is collected."""

    __slots__ = ("_d",)

    def __init__(self) -> None:
        self._d: dict[int, tuple[Any, Any]] = {}

    def get(self, obj: Any) -> Any:
        hit = self._d.get(id(obj))
        return hit[1] if hit is not None and hit[0]() is obj else None

    def set(self, obj: Any, value: Any) -> None:
        key, d = id(obj), self._d  # bound here: the callback may run while the module is torn down

        def forget(ref: Any) -> None:
            hit = d.get(key)
            if hit is not None and hit[0] is ref:
                del d[key]

        d[key] = (weakref.ref(obj, forget), value)

    def clear(self) -> None:
        self._d.clear()


# array -> [fields of one of its exports, that export's wire form, its lane or None (see _resend)]
_by_array = _ById()

# The layouts of cudaMalloc arrays exported: (dtype, shape, strides, GPU) -> (reach, see validate_layout;
# dtype, device and producer fields; the wire form's parts that do not change, see layout_of). A new
# array of a known layout (each fresh buffer of a pipeline) is then checked in three comparisons and
# packed in one join.
_layouts: dict[tuple[Any, ...], tuple[Any, ...]] = {}
_LAYOUTS_MAX = 1024


def _remember_layout(arr: Any, fields: ArrayFields, reach: tuple[int, int, int] | None) -> None:
    key = (arr.dtype, arr.shape, arr.strides, arr.data.device_id)
    if key not in _layouts:
        if len(_layouts) >= _LAYOUTS_MAX:
            _layouts.clear()
        _layouts[key] = (reach, fields.dtype, fields.device, fields.producer, layout_of(pack_array(fields)))


def _template(arr: Any) -> ArrayFields:
    """The handle fields of a non-empty array with no export part."""
    dtype = dtype_of(arr.dtype)
    owner = getattr(arr.data.mem, "_owner", None)
    opened_here = isinstance(owner, _mapping.Lease)
    if opened_here:
        # An array opened here may be mapped on another GPU than its memory's: the handle names the memory's.
        device, lease = owner.memory_device, _received_lease(owner)
    else:
        device, lease = arr.data.device_id, None
    if lease is not None and lease.mapping_key[1] == Kind.VMM:
        # Mapped here from the producer's pieces: sent on as this process's own
        # virtual memory, with the descriptors it imported them from.
        lease = None
    kind, fd, resource, more, plain = Kind.LEGACY, -1, 0, (), False
    if lease is not None:
        # Opened from another process: send on the original allocation's
        # handle (or pool export data); this process pins the array, and with
        # it its own claim on the original export.
        buffer_id = _cuda.pointer_info(lease.ptr).buffer_id
        memory_handle, base, size = lease.memory_handle, lease.ptr, lease.allocation_size
        if lease.mapping_key[1] == Kind.POOL:  # with this process's descriptor of the imported pool
            kind = Kind.POOL
            fd, resource = _pools.send_on(lease.mapping_key[2], lease.mapping_key[4])
    elif (legacy := _cuda.legacy_info(arr.data.ptr)) is not None:
        base, size, buffer_id = legacy
        if buffer_id in _handle_cache or _cuda.current_device() == device:
            memory_handle = _memory_handle(base, buffer_id)
        else:  # on the memory's GPU: the runtime would otherwise set up a context on the current one, unused
            with _cuda.using_device(device):
                memory_handle = _memory_handle(base, buffer_id)
        # A layout remembered for the fast path of plain arrays, whose GPU is the memory's: not our own
        # memory opened here, perhaps on a peer GPU (its handle names the memory's).
        plain = not opened_here
    else:
        info = _cuda.pointer_info(arr.data.ptr)
        if info.memory_type != "device":
            raise IpcError(_KIND_ADVICE[info.memory_type])
        base, size, buffer_id = info.base, info.size, info.buffer_id
        if info.legacy_ipc:  # only if the allocation changed since the first query
            memory_handle = _memory_handle(info.base, info.buffer_id)
        elif pool := _pools.pool_of(base):
            memory_handle, fd, resource = _pools.export(base, pool)
            kind = Kind.POOL
            _remember_export(memory_handle, base, buffer_id)
        elif _vmm.is_vmm(arr.data.ptr):  # not base: virtual memory's is its reservation's, maybe unmapped
            # Virtual memory is mapped piece by piece (PyTorch's expandable
            # segments): share every piece the array reaches.
            lo, hi = byte_extent(arr.shape, arr.strides, dtype.itemsize)
            with _cuda.using_device(device):
                pieces = _vmm.export_pieces(arr.data.ptr + lo, arr.data.ptr + hi, device)  # binds a context
                _vmm.sweep_if_grown()
            base, size = pieces[0][0], sum(p[1] for p in pieces)
            buffer_id = pieces[0][4]
            fd, resource = pieces[0][2], _vmm.pieces_id(tuple(p[3] for p in pieces))
            more = tuple((p[2], p[1]) for p in pieces[1:])
            memory_handle, kind = _NO_HANDLE, Kind.VMM
        else:
            raise IpcError(
                "the driver knows this pointer as device memory but neither as a cudaMalloc allocation, a "
                "stream-ordered pool's nor the virtual memory API's (was it mapped from another process by other "
                "means?), so cupy_ipc cannot share it; copy it into an array of CuPy's default MemoryPool"
            )
    fields = ArrayFields(
        kind, 0, dtype, memory_handle, arr.data.ptr - base, size, base, buffer_id,
        _device_id(device), this_process(), 0, 0, _NO_HANDLE, arr.shape, arr.strides, fd, resource, more,
    )
    reach = validate_layout(fields)  # every other field comes from the driver and this process
    if plain:
        _remember_layout(arr, fields, reach)
    return fields


_device_ids: dict[int, DeviceId] = {}


def _device_id(ordinal: int) -> DeviceId:
    """The ``DeviceId`` of a GPU of this process, made once."""
    d = _device_ids.get(ordinal)
    if d is None:
        d = _device_ids[ordinal] = DeviceId(ordinal, _cuda.device_uuid(ordinal))
    return d


def _as_cupy(array: Any) -> Any:
    cupy = _cuda.import_cupy()

    if isinstance(array, cupy.ndarray):
        return array
    if hasattr(array, "__dlpack_device__"):
        device_type, _ = array.__dlpack_device__()
        if int(device_type) != 2:  # kDLCUDA
            raise TypeError(f"{type(array).__name__} lives on DLPack device type {device_type}, not a CUDA GPU")
        return cupy.from_dlpack(array)
    if hasattr(array, "__cuda_array_interface__"):
        return cupy.asarray(array)
    raise TypeError(
        f"cannot share a {type(array).__name__}: pass a cupy.ndarray or an object with "
        "__cuda_array_interface__ or __dlpack__/__dlpack_device__ on a CUDA device"
    )


_KIND_ADVICE = {
    "managed": "managed memory (cudaMallocManaged) cannot be shared with CUDA IPC; copy it into device memory",
    "host": "host memory cannot be shared with CUDA IPC; copy it to the GPU first (cupy.asarray)",
    "unknown": "the driver does not know this pointer as device memory",
}


def get_ipc_handle(
    array: Any,
    *,
    stream: Any = None,
    keepalive: bool = True,
    sync: bool = True,
    consumers: int = 1,
    lease: float | None = None,
) -> "IpcArrayHandle":
    """Export a GPU array so that other processes of this host can map it.

    Args:
        array: A ``cupy.ndarray`` of any layout, or any object with
            ``__dlpack__`` and ``__dlpack_device__``, or
            ``__cuda_array_interface__``, on a CUDA device
            (a PyTorch tensor, a Numba device array).
        stream: Where the work that produces the array was queued (default:
            CuPy's current stream of the array's GPU). With ``sync``, if
            that stream still has work queued, the handle carries an event
            recorded there and ``open()`` makes the consumer's stream wait on
            it on the GPU. (By default, for an array of a GPU other than the
            current one, the current GPU's stream is also waited for, on the
            host: CuPy runs its kernels on the current GPU.)
        keepalive: Keep the memory alive until ``consumers`` processes have
            opened the handle and finished with it. Turn off only if you keep
            the array alive yourself until every consumer is done.
        sync: Record the ordering event. Turn off only if you synchronize
            before sending.
        consumers: How many processes will open this handle. (A process
            that opens it again after its arrays from it were freed counts
            again; an open that fails does not count.)
        lease: Seconds after which the export is revoked (new opens are
            refused) if not all consumers opened it; ``None`` keeps it until
            :meth:`IpcArrayHandle.release`. It needs ``keepalive`` or
            ``sync``: without both there is no export to revoke.

    Returns:
        An immutable, picklable :class:`IpcArrayHandle`.

    Raises:
        TypeError: ``array`` is not a GPU array, ``consumers`` not an
            integer or ``lease`` not a number.
        ValueError: ``consumers`` or ``lease`` is not positive,
            ``consumers`` is above 2**32 - 1, or ``lease`` comes with
            ``keepalive=False, sync=False``.
        HandleError: Its dtype cannot be shared.
        IpcError: Its memory cannot be shared (managed or host memory, or
            pool or virtual-memory allocations made without a POSIX
            file-descriptor handle type), or a CUDA call failed.

    Example:
        >>> import cupy, cupy_ipc                         # doctest: +SKIP
        >>> a = cupy.arange(6, dtype=cupy.float32)        # doctest: +SKIP
        >>> h = cupy_ipc.get_ipc_handle(a)                # doctest: +SKIP
        >>> h                                             # doctest: +SKIP
        <IpcArrayHandle shape=(6,) dtype=float32 device=0 producer=pid 4242@gpu-host>
    """
    hit = _by_array.get(array)  # (only cupy.ndarrays are kept)
    if hit is not None and hit[2] is not None and stream is None and lease is None and type(consumers) is int \
            and consumers == 1 and keepalive and sync:
        h = _resend(array, hit[2])
        if h is not None:
            return h
    _fork.check()
    if type(consumers) is not int or not 1 <= consumers <= _segment.MAX_OPENS:  # (checked off the common path)
        consumers = checked_count(consumers, "consumers", 1, _segment.MAX_OPENS)  # what a segment counts
    if lease is not None:
        lease = checked_lease(lease)
        if not keepalive and not sync:
            raise ValueError("lease needs an export to revoke: it has none with keepalive=False and sync=False")
    arr = _as_cupy(array)
    if stream is not None and sync:
        _cuda.check_default_stream_of(stream, _cuda.stream_ptr(stream), arr.data.device_id, "the array")
    if arr.size == 0:
        device = arr.data.device_id
        fields = ArrayFields(Kind.EMPTY, 0, dtype_of(arr.dtype), _NO_HANDLE, 0, 0, 0, 0,
                             _device_id(device), this_process(), 0, 0, _NO_HANDLE, arr.shape, arr.strides)
        validate_layout(fields)  # CuPy allows empty shapes whose other extents from_bytes refuses: say so here
        return IpcArrayHandle._make(fields)
    # A live array's wire form is cached after its first export: later ones change only the export part,
    # unless the array was reshaped in place since (CuPy lets `a.shape = ...` change a live array's layout).
    # (A temporary that _as_cupy made of another library's array is never kept.)
    if arr is not array or hit is not None and (hit[0].shape != arr.shape or hit[0].strides != arr.strides):
        hit = None
    if hit is not None:
        template, static, lane = hit
        if lane is None and array is arr and template.device.ordinal == arr.data.device_id:
            hit[2] = _lane_of(arr, template, static)  # from its next export on (a buffer sent again)
    else:
        if keepalive and sync and consumers == 1 and lease is None and array is arr:
            h = _export_common(arr, stream)
            if h is not None:
                return h
        template, static = _template(arr), None
    if keepalive or sync:
        device = arr.data.device_id  # where the producer's stream and its event live
        stream_ptr = _cuda.stream_ptr(stream, device) if sync else None  # (by default the array's GPU's)
        current = _cuda.current_device()
        if sync and current != device and (stream is None or (
                stream_ptr in (0, 1, 2) and _cuda.default_stream_device(stream) is None)):
            # CuPy runs kernels on the current GPU, also on another GPU's array (peer access): work on the array
            # may be queued on the current GPU's stream, which no event of the array's GPU captures. Waited for.
            current_ptr = _cuda.stream_ptr(None) if stream is None else stream_ptr  # (a default stream: this GPU's)
            if not _cuda.stream_idle(current_ptr):
                _cuda.call("waiting for the current GPU's work", _cuda.rt().streamSynchronize, current_ptr)
        if stream_ptr is not None and template.device.ordinal != device:
            # An array opened here on a peer GPU, sent on: its handle names the memory's GPU, whose streams
            # must not wait on an event of this one (that ends the consumer's process). Waited for here.
            with _cuda.using_device(device):
                _cuda.call("waiting for the work on the array", _cuda.rt().streamSynchronize, stream_ptr)
            stream_ptr = None
        pin = (array if keepalive else None, (template.base_ptr, template.allocation_size, template.buffer_id),
               device, consumers, lease, stream_ptr, (arr.shape, template.dtype))
        if current == device:
            export_id, slot, event, ordered = _keepalive.pin(*pin)
        else:
            with _cuda.using_device(device):
                export_id, slot, event, ordered = _keepalive.pin(*pin)
        flags = (FLAG_KEEPALIVE if keepalive else 0) | ordered
        if event is None:
            event = _NO_HANDLE
    else:  # no export part
        _segment.own_segment(template.producer.token)  # lets consumers tell that we are alive
        flags, export_id, slot, event = 0, 0, 0, _NO_HANDLE
    try:
        fields = with_export(template, flags, export_id, slot, event)
        if static is None:
            wire = _first_wire(arr, array is arr, template, fields)
        else:
            wire = splice(export_parts(static), flags, export_id, slot, event)
        return IpcArrayHandle._make(fields, wire)
    except BaseException:
        _unpin_unsent(export_id)
        raise


def _unpin_unsent(export_id: int) -> None:
    """Release the pin of an export interrupted (Ctrl-C) before its handle existed: no handle could release it,
    nor any consumer open it, and without a lease it would last as long as the process."""
    if export_id:
        _keepalive.release(export_id)


def _export_common(arr: Any, stream: Any) -> "IpcArrayHandle | None":
    """The first export of nearly every array, written out flat: CuPy's ``cudaMalloc`` memory of a layout
    exported before, on the current GPU, kept alive and ordered for one consumer. ``None``, having done
    nothing, for any other case (the general path then exports it, or says what is wrong).

    Flat for the reason :func:`_open_common` is.
    """
    data = arr.data
    device = data.device_id
    shape, strides = arr.shape, arr.strides
    known = _layouts.get((arr.dtype, shape, strides, device))
    if known is None or isinstance(getattr(data.mem, "_owner", None), _mapping.Lease):
        return None  # a new layout, or an array opened here (sent on as the original allocation)
    ptr = data.ptr
    legacy = _cuda.legacy_info(ptr)
    if legacy is None or _cuda.current_device() != device:
        return None
    base, size, buffer_id = legacy
    offset = ptr - base
    (lo, hi, align), dtype, device_id, producer, layout = known
    if offset % align or offset + lo < 0 or offset + hi > size:
        return None
    memory_handle = _memory_handle(base, buffer_id)
    export_id, slot, event, ordered = _keepalive.pin(arr, (base, size, buffer_id), device, 1, None,
                                                     _cuda.stream_ptr(stream), (shape, dtype))
    try:
        flags = FLAG_KEEPALIVE | ordered
        if event is None:
            event = _NO_HANDLE
        fields = ArrayFields(Kind.LEGACY, flags, dtype, memory_handle, offset, size, base, buffer_id, device_id,
                             producer, export_id, slot, event, shape, strides)
        wire = with_allocation(layout, flags, memory_handle, offset, size, base, buffer_id, export_id, slot, event)
        _by_array.set(arr, [fields, wire, None])
        return IpcArrayHandle._make(fields, wire)
    except BaseException:
        _unpin_unsent(export_id)
        raise


def _first_wire(arr: Any, keep: bool, template: ArrayFields, fields: ArrayFields) -> bytes:
    """The wire form of ``fields``, the first export of ``arr``; kept with ``template`` for its later exports
    (which splice their own export part in) if ``keep`` (not for a temporary made from a foreign array)."""
    wire = pack_array(fields)
    if keep:
        _by_array.set(arr, [template, wire, None])
    return wire


def _lane_of(arr: Any, template: ArrayFields, wire: bytes) -> tuple[Any, ...]:
    """What :func:`_resend` needs of an array exported before, the fields and wire form of one of its exports
    (which differ from another's only in their flags and export part), cut up once."""
    return (template.shape, template.strides, arr.data.device_id, template, export_parts(wire),
            (template.base_ptr, template.allocation_size, template.buffer_id), (template.shape, template.dtype))


def _resend(arr: Any, lane: tuple[Any, ...]) -> "IpcArrayHandle | None":
    """An array exported before, exported again, written out flat: what :func:`get_ipc_handle` does for it
    without a stream, lease or more than one consumer, kept alive and ordered on the current stream of its
    GPU, which is current. ``None``, having done nothing, for any other case. ``lane``: :func:`_lane_of`.

    Flat for the reason :func:`_open_common` is: a buffer sent again and again (a pipeline's) costs only
    its pin here.
    """
    shape, strides, device, template, parts, origin, description = lane
    if arr.shape != shape or arr.strides != strides:  # (a forked child has no lanes: see _forget_after_fork)
        return None  # reshaped in place since (CuPy allows it)
    try:
        if _cuda.rt().getDevice() != device:
            return None
        stream_ptr = _cuda.cupy_names()[0]().ptr
    except _cuda._runtime_error() as e:
        raise _cuda._translated("exporting the array", e) from e
    export_id, slot, event, ordered = _keepalive.pin(arr, origin, device, 1, None, stream_ptr, description)
    try:
        flags = FLAG_KEEPALIVE | ordered
        if event is None:
            event = _NO_HANDLE
        return IpcArrayHandle._make(with_export(template, flags, export_id, slot, event),
                                    splice(parts, flags, export_id, slot, event))
    except BaseException:
        _unpin_unsent(export_id)
        raise


class OpenInfo(NamedTuple):
    """How an array returned by :meth:`IpcArrayHandle.open` reaches the producer's memory.

    ``device``: the GPU the array belongs to here; ``memory_device``: the GPU
    holding the producer's memory (both ordinals of this process); ``copied``:
    a staged copy (no peer access), not a mapping.

    Example:
        >>> OpenInfo(device=1, memory_device=0, copied=False)
        OpenInfo(device=1, memory_device=0, copied=False)
        >>> info = cupy_ipc.open_info(handle.open(device=1))  # doctest: +SKIP
        >>> info.copied                                       # doctest: +SKIP
        False
    """

    device: int
    memory_device: int
    copied: bool


_opened_unmapped = _ById()  # copies and size-0 arrays that open() made: their memory says nothing


def open_info(array: Any) -> OpenInfo | None:
    """How an array that :meth:`IpcArrayHandle.open` returned (or a view of it) reaches the memory.

    ``None`` for arrays that did not come from ``open()``.

    Example:
        >>> import numpy
        >>> open_info(numpy.zeros(3)) is None
        True
    """
    owner = getattr(getattr(getattr(array, "data", None), "mem", None), "_owner", None)
    if isinstance(owner, _mapping.Lease):
        return OpenInfo(array.data.device_id, owner.memory_device, copied=False)
    info = _opened_unmapped.get(array)
    if info is None and (base := getattr(array, "base", None)) is not None:  # a view: CuPy's base is its root
        info = _opened_unmapped.get(base)
    return info


def _forget_after_fork() -> None:
    global _exported_lock, _fd_lock
    _exported_lock = threading.Lock()  # another thread may have held them at the fork
    _fd_lock = threading.Lock()
    _by_array.clear()  # the templates and layouts carry the parent's identity
    _layouts.clear()
    _opened_unmapped.clear()
    _pools.forget()
    _vmm.forget()
    _fdserver.forget()


os.register_at_fork(after_in_child=_forget_after_fork)


def _open_common(f: ArrayFields, claimed: list[bool] | None = None) -> Any:
    """The open of nearly every message, written out flat: another process's ``cudaMalloc`` memory, mapped
    on the current GPU, which holds it, ordered on its current stream. ``None``, having done nothing, for
    any other case (the general path then opens it). ``claimed``: see :meth:`IpcArrayHandle._open_once`.

    Flat because Python run once per message costs several times its loop time (measured on the H200
    machines: benchmarks/RESULTS.md), so every call left out of a message's path counts.
    """
    producer, me = f.producer, this_process()
    if producer.token == me.token or producer.boot_id != me.boot_id or f.memory_handle in _exported:
        return None  # our own memory, or another host's handle: the general path says what to do
    runtime = _cuda.rt()
    current_stream, UnownedMemory, MemoryPointer, ndarray = _cuda.cupy_names()
    try:
        device = runtime.getDevice()
        if _cuda._ordinals.get(f.device.uuid) != device:
            return None  # another GPU's memory (or a GPU not looked up yet)
        seg = _segment.attach(producer.token, producer.pid)  # ProducerExitedError if it has gone
        stream = current_stream()
        last_try = claimed is not None
        ptr, lease = _mapping.acquire(
            (device, Kind.LEGACY, f.memory_handle, producer.token, f.buffer_id), device, f.memory_handle,
            f.allocation_size, None, None, seg, producer.token, producer.pid, f.export_id, f.slot, stream, device,
            device, None, False, (f.memory_handle, producer.token, f.base_ptr, f.allocation_size), claimed)
        try:
            mem = UnownedMemory(ptr, f.allocation_size, lease, device)
            arr = ndarray(f.shape, f.dtype, MemoryPointer(mem, f.offset), f.strides)
            if f.flags & FLAG_EVENT:  # last: nothing but the count below can fail once the stream waits
                _wait_for_export(f, device, stream.ptr, seg, lease)
            _mapping.opened(lease)
        except BaseException:
            mem = arr = None  # no array of the mapping left in the traceback's frame once it is gone
            if f.flags & FLAG_WORD:  # a stream may wait on its words, which a close would unregister
                _words.park(seg)
            _mapping.abandon(lease, last_try)  # now, not when the traceback (which holds the lease) goes
            raise
    except _cuda._runtime_error() as e:
        raise _cuda._translated("opening the array", e, opening=True) from e
    return arr


def _wait_for_export(f: ArrayFields, device: int, stream_ptr: int, seg: Any, lease: Any) -> None:
    """Make stream ``stream_ptr`` of GPU ``device`` (current, the event's) wait on the GPU for the work that
    ``f``'s export orders, unless it is done: for the producer's word where it writes one (see ``_words``),
    else for its event; either way released if the producer dies first (see ``_gates``)."""
    producer = f.producer
    if f.flags & FLAG_WORD and f.slot < _words.SLOTS and not _words.disabled:
        words = _words.of_producer(seg, device)
        if words is not None:
            value = _words.value_of(f.export_id)
            if _words.reached(words.read(f.slot), value):
                return
            if _gates.wait_word(words, f.slot, value, stream_ptr, device, seg, producer.pid, lease):
                return
    runtime = _cuda.rt()
    ev = open_cached(f.event_handle, device, producer)  # held here: the cache may let go of it
    status = runtime.eventQuery(ev._ptr)  # a finished event needs no wait: the GPU-side wait is slow
    if status == _cuda.NOT_READY:  # a wait that the producer's death must not leave stuck
        _gates.wait(ev, stream_ptr, device, seg, producer.pid, lease)
    elif status:
        _cuda.call("waiting on the producer's event", runtime.streamWaitEvent, stream_ptr, ev._ptr, 0)  # (as before)


def _count_unclaimed(f: ArrayFields) -> None:
    """Count a message's open that failed before it claimed the export (see :func:`_mapping.count_unclaimed`)."""
    if not f.export_id:
        return
    try:
        seg = _segment.attach(f.producer.token, f.producer.pid)
        _mapping.count_unclaimed(seg, f.producer.token, f.producer.pid, f.export_id, f.slot)
    except Exception:  # noqa: BLE001 - the producer has gone: nothing waits for this open; the open's error stands
        pass


def _parts(value: Any, what: str, form: str) -> tuple[Any, ...]:
    """``value``'s items, for a field given as a tuple of the ``form`` given, or :class:`HandleError`."""
    items = field_items(value, what, form)
    if form.startswith("(") and len(items) != form.count(",") + 1:
        raise HandleError(f"{what} must be {form}, not {len(items)} values")
    return items


class IpcArrayHandle:
    """An immutable, picklable value naming a GPU array of some process.

    Fields: the 64-byte memory handle of the base allocation, the array's
    byte offset in it, the allocation size, shape, strides (bytes), dtype,
    device (ordinal and UUID) and producer (pid, random token, boot id,
    host). Build one with :func:`get_ipc_handle`, or from field values for
    tests and custom transports; either way it is validated. Built from
    values, it also takes ``kind`` (``"legacy"``, ``"pool"``, ``"vmm"`` or
    ``"empty"``) and, for memory shared by descriptor, ``fd`` (the
    producer's descriptor), ``resource`` (its pool's or allocation's id) and
    ``more`` (``(descriptor, size)`` of each further piece of virtual
    memory). Values are taken as they are, never converted: a float where an
    integer belongs, or text where bytes do, raises :class:`HandleError`.

    ``open()`` maps the memory and returns a ``cupy.ndarray``; ``close()``
    drops the arrays this handle returned. When the last array or view using
    the mapping is garbage-collected, the mapping is unmapped, or kept idle for
    the next open where this process released the same allocation before (see
    :func:`cupy_ipc.set_idle_mapping_limit`), so closing never strands an array.

    Example:
        >>> h = IpcArrayHandle(memory_handle=bytes(64), offset=0, allocation_size=64,
        ...                    shape=(4, 2), strides=(8, 4), dtype="float32",
        ...                    device=(0, bytes(16)), producer=(1, bytes(16), bytes(16), "gpu-host"))
        >>> h
        <IpcArrayHandle shape=(4, 2) dtype=float32 device=0 producer=pid 1@gpu-host>
        >>> IpcArrayHandle.from_bytes(h.to_bytes()) == h
        True
    """

    __slots__ = ("_f", "_wire", "_opened", "_fd", "_server", "__weakref__")

    def __init__(
        self,
        *,
        memory_handle: bytes,
        offset: int,
        allocation_size: int,
        shape: Iterable[int],
        strides: Iterable[int],
        dtype: Any,
        device: tuple[int, bytes],
        producer: tuple[int, bytes, bytes, str],
        kind: int | str = Kind.LEGACY,
        fd: int = -1,
        resource: int = 0,
        more: Iterable[tuple[int, int]] = (),
    ) -> None:
        if getattr(self, "_f", None) is not None:  # made already: __init__ called again
            raise AttributeError("IpcArrayHandle is immutable")
        # Each value taken as it is, never converted (a float truncated, text parsed): a wrong type is refused.
        ordinal, uuid = _parts(device, "device", "(ordinal, uuid)")
        pid, token, boot_id, host = _parts(producer, "producer", "(pid, token, boot id, host)")
        fields = ArrayFields(
            Kind.numbers.get(kind, kind) if isinstance(kind, str) else field_int(kind, "kind"), 0,  # type: ignore
            dtype_of(dtype), readable(memory_handle, "memory_handle"), field_int(offset, "offset"),
            field_int(allocation_size, "allocation_size"), 0, 0,
            DeviceId(field_int(ordinal, "the device ordinal"), uuid),
            Producer(field_int(pid, "the producer's pid"), token, boot_id, host), 0, 0, _NO_HANDLE,
            field_ints(shape, "shape"), field_ints(strides, "strides"), field_int(fd, "fd"),
            field_int(resource, "resource"),
            tuple(field_ints(piece, "each piece of more", 2)
                  for piece in _parts(more, "more", "a sequence of (descriptor, size) pairs")),
        )
        validate_array(fields)
        _fill(self, fields, None)

    @classmethod
    def _make(cls, fields: ArrayFields, wire: bytes | None = None) -> "IpcArrayHandle":
        h = _new(cls)
        _fill(h, fields, wire)  # only canonical bytes are accepted, so they are the wire form
        return h

    # --- the descriptors of memory shared by file descriptor ----------------
    def _wanted(self) -> int:
        """How many descriptors come with this handle: the pool's, or one per piece of virtual memory."""
        f = self._f
        return 0 if f.kind not in Kind.BY_DESCRIPTOR else 1 + len(f.more)

    def _adopt_descriptors(self, fds: list[int]) -> None:
        """Keep the descriptors that came with this handle (``SCM_RIGHTS``) if they are all there; close the rest."""
        keep = tuple(fds) if fds and len(fds) == self._wanted() else None
        if keep is None:
            close_all(fds)
        _fdserver.retire(list(self._swap_fds(keep) or ()))

    def _swap_fds(self, new: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """Replace the descriptors that came with this handle; the old ones, now the caller's to close (through
        :func:`_fdserver.retire`, under the lock that copies them for an open or a send)."""
        with _fd_lock:
            old = self._fd
            object.__setattr__(self, "_fd", new)
        return old

    def _ask_producer(self, server: bytes) -> None:
        """Take the descriptors, when an import needs them, from the producer's descriptor server ``server``."""
        object.__setattr__(self, "_server", server)

    def _take_fds(self) -> tuple[int, ...] | None:
        """Copies of the descriptors that came with this handle, else those the producer's server sends, now
        the caller's to close; ``None``: neither (the importer takes them with ``pidfd_getfd``).

        Copies: the handle keeps its own until it is closed, so that an open that fails may be retried
        without ``pidfd_getfd``, which ptrace rules may refuse where a socket was the way in."""
        if self._fd is not None:
            fds = _fdserver.copies(lambda: list(self._fd or ()))  # (closed meanwhile: none)
            if fds:
                return tuple(fds)
        if self._server is not None:
            return tuple(_fdserver.fetch(self._server, self._f.producer.pid, _producer_numbers(self._f),
                                         self._f.resource))
        return None

    def _descriptors(self) -> list[int]:
        """The descriptors to send with this handle: this process's own of the memory's pool or pieces, if any."""
        f = self._f
        if f.kind not in Kind.BY_DESCRIPTOR:
            return []
        if f.producer.token == this_process().token:
            if f.kind == Kind.VMM:  # our own descriptors, open while the memory is mapped
                numbers = _producer_numbers(f)
                if _vmm.exported_run(numbers, f.resource) is None:
                    raise IpcError("this handle's memory has been freed (its descriptors are closed): there is "
                                   "nothing to send")
                return numbers
            fd = _pools.producer_fd(f.resource)
            return [] if fd is None else [fd]
        if f.kind == Kind.POOL and (fd := _pools.received_fd(f.producer.token, f.resource)) is not None:
            return [fd]
        return list(self._fd or ())

    def _served(self) -> bytes | None:
        """The address of this process's descriptor server for this handle's memory, to send with its bytes to
        the processes meant to open it (no ptrace permission needed then); ``None`` when it has no descriptors
        to hand out.

        Raises:
            IpcError: The server could not be started (see :func:`_fdserver.serve`).
        """
        if self._f.kind in Kind.BY_DESCRIPTOR and self._descriptors():
            return _fdserver.serve(_may_serve, self._f.resource)
        return None

    def __del__(self) -> None:
        if getattr(self, "_fd", None):
            close_all(self._fd)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("IpcArrayHandle is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("IpcArrayHandle is immutable")

    # --- the value ------------------------------------------------------------
    version = property(lambda self: VERSION, doc="Wire format version.")
    kind = property(lambda self: Kind.names[self._f.kind],
                    doc="How the memory is shared: 'legacy', 'vmm' or 'pool' (by file descriptor), or 'empty'.")
    memory_handle = property(lambda self: self._f.memory_handle, doc="64-byte CUDA memory handle of the allocation.")
    offset = property(lambda self: self._f.offset, doc="Byte offset of element 0 in the allocation.")
    allocation_size = property(lambda self: self._f.allocation_size, doc="Bytes in the base allocation.")
    shape = property(lambda self: self._f.shape, doc="The array's shape.")
    strides = property(lambda self: self._f.strides, doc="Strides in bytes.")
    dtype = property(lambda self: self._f.dtype, doc="The array's ``numpy.dtype``.")
    device = property(lambda self: self._f.device, doc="The producer's ``DeviceId(ordinal, uuid)``.")
    producer = property(lambda self: self._f.producer, doc="``Producer(pid, token, boot_id, host)``.")
    keepalive = property(lambda self: bool(self._f.flags & FLAG_KEEPALIVE), doc="The producer pins the memory.")
    synced = property(lambda self: bool(self._f.flags & FLAG_EVENT), doc="open() waits for the producer's work.")
    ndim = property(lambda self: len(self._f.shape), doc="Number of dimensions.")
    size = property(lambda self: int(np.prod(self._f.shape, dtype=object)), doc="Number of elements.")
    nbytes = property(lambda self: self.size * self._f.dtype.itemsize, doc="Bytes of its elements (size × itemsize).")

    @classmethod
    def from_bytes(cls, data: bytes) -> "IpcArrayHandle":
        """Parse and validate the output of :meth:`to_bytes`; no CUDA call is made.

        Raises:
            HandleError: The bytes are malformed or describe memory unsafely.
        """
        raw = readable(data, "array handle")
        return cls._make(unpack_array(raw), raw)

    def to_bytes(self) -> bytes:
        """The wire form: versioned, fixed layout, no pickle inside; :meth:`from_bytes` reads it back.

        Example:
            >>> h = IpcArrayHandle(memory_handle=bytes(64), offset=0, allocation_size=8, shape=(2,), strides=(4,),
            ...                    dtype="float32", device=(0, bytes(16)), producer=(1, bytes(16), bytes(16), "h"))
            >>> IpcArrayHandle.from_bytes(h.to_bytes()) == h
            True
        """
        if self._wire is None:
            object.__setattr__(self, "_wire", pack_array(self._f))
        return self._wire

    def __reduce__(self) -> tuple[Any, ...]:
        return (IpcArrayHandle.from_bytes, (self.to_bytes(),))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IpcArrayHandle) and self._f == other._f

    def __hash__(self) -> int:
        return hash(self._f)

    def __repr__(self) -> str:
        p = self._f.producer
        return (f"<IpcArrayHandle shape={self._f.shape} dtype={self._f.dtype} "
                f"device={self._f.device.ordinal} producer={p.where()}>")

    # --- opening ------------------------------------------------------------------
    def open(self, *, stream: Any = None, device: int | None = None, copy: bool = False) -> Any:
        """Map the array into this process and return it as a ``cupy.ndarray``.

        The consumer's ``stream`` (default: the current one of the GPU the
        array opens on) waits on the GPU for the producer's work on the
        array, if the handle says some was still queued at its export and it
        has not finished yet (for a word that the producer's stream writes
        once it has; see the README). Queue the
        work that uses the array on that stream (or after it): its completion
        is what releases the producer's memory once the array is gone. If the
        producer is killed before that event's work has run, the stream is
        released all the same, with a ``RuntimeWarning``, and :meth:`close`
        raises :class:`ProducerExitedError`: the values may be incomplete.

        In the exporting process this returns a view of the producer's own
        memory without any CUDA IPC call, and so it does in a process that
        receives, from a third one, an array it exported itself.

        An open that fails leaves the export as it found it (not counted as
        one of its consumers, nothing held): it may be retried.

        Args:
            stream: Where the consumer orders its work on the array.
            device: The GPU (an ordinal of this process) to open the array
                on, and that CuPy then uses it from: a mapping is reachable
                from its own GPU only. By default the current GPU, if it is
                the GPU holding the memory (found by UUID) or has peer access
                to it (NVLink or PCIe; CuPy's ``cupy._util.PerformanceWarning``, a
                ``RuntimeWarning``, says so once per pair of GPUs),
                else the GPU holding the memory.
            copy: When ``device`` is not the memory's GPU, copy the array
                there instead of mapping it across GPUs (needed where the
                two have no peer access); :func:`open_info` says which.

        Raises:
            HandleError: The handle is from another host, names a GPU this
                process cannot see, or claims more memory than was mapped.
            ProducerExitedError: The producer has exited.
            IpcError: ``device`` cannot access the memory's GPU (and not
                ``copy``), ``stream`` belongs to another GPU than the one
                the array is opened on, the producer no longer shares the
                memory, or CUDA failed.
        """
        arr = self._open_once(stream, device, copy, None)
        self._opened.append(arr)
        return arr

    def _open(self, stream: Any = None, device: int | None = None, copy: bool = False, last_try: bool = False) -> Any:
        """:meth:`open` without tracking the array: it lives until it is garbage-collected. ``last_try``: an
        open that will not be retried (a message's), counted as one of the export's even if it fails, so that
        the producer does not keep the memory for it."""
        if not last_try:
            return self._open_once(stream, device, copy, None)
        claimed = [False]
        try:
            return self._open_once(stream, device, copy, claimed)
        except BaseException:
            if not claimed[0]:  # failed before it claimed (the producer's GPU not visible here, say)
                _count_unclaimed(self._f)
            raise

    def _open_once(self, stream: Any, device: int | None, copy: bool, claimed: list[bool] | None) -> Any:
        """:meth:`_open`. ``claimed``, given for an open that is not retried (``last_try``), is set once the
        open has claimed the export (by :func:`_mapping.acquire`), which counts any failure from there on."""
        _fork.check()
        f = self._f
        last_try = claimed is not None
        if stream is None and device is None and f.kind == Kind.LEGACY:
            arr = _open_common(f, claimed)  # (without CuPy, _cuda.rt() there says how to install it)
            if arr is not None:
                return arr
        cupy = _cuda.import_cupy()
        if f.producer.boot_id != this_process().boot_id:
            check_same_host(f.producer)
        home = _cuda.ordinal_of_uuid(f.device.uuid)
        current = _cuda.current_device()
        if device is not None:
            target = _cuda.checked_ordinal(device)
        else:
            target = home if current == home else _default_device(home, current)
        if f.kind == Kind.EMPTY:
            with cupy.cuda.Device(target):
                arr = cupy.empty(f.shape, f.dtype)
            _opened_unmapped.set(arr, OpenInfo(target, home, copied=False))
            return arr
        staged = False
        if target != home:
            peer = _cuda.can_access_peer(target, home)
            staged = copy or not peer
            if not peer and not copy:
                raise IpcError(
                    f"GPU {target} ({_cuda.uuid_name(target)}) cannot access the memory of GPU {home} "
                    f"({_cuda.uuid_name(home)}), where this array lives: there is no peer access between them. "
                    f"Open it with copy=True to stage a copy on GPU {target}, or open it on GPU {home}"
                )
        if stream is not None:
            stream_obj = _cuda.as_cupy_stream(stream)
            sptr = stream_obj.ptr  # a default stream's GPU is the one its object names, if any (PyTorch's do)
            owner = _cuda.default_stream_device(stream) if sptr in (0, 1, 2) else _cuda.stream_device(sptr)
            if owner is not None and owner != target:
                # Its work could not be ordered, nor the release recorded on it: the memory stayed pinned.
                raise IpcError(f"the stream belongs to GPU {owner}, and the array is opened on GPU {target}: "
                               f"pass a stream of GPU {target}, or open it there")
        elif target == current:
            stream_obj = cupy.cuda.get_current_stream()
        else:
            with _cuda.using_device(target):
                stream_obj = cupy.cuda.get_current_stream()
        if not staged:
            if target == current:  # no device to switch to and back
                return self._mapped(target, home, stream_obj, target, claimed=claimed)
            with _cuda.using_device(target):
                return self._mapped(target, home, stream_obj, target, claimed=claimed)
        # Map on the memory's GPU, copy to the target on the consumer's
        # stream, and let the mapping go once that copy is done. The open
        # counts only once the copy is queued: one that fails there (no
        # memory on the target, say) may be retried.
        with _cuda.using_device(home):
            src = self._mapped(home, home, stream_obj, target, count=False, claimed=claimed)
        lease = src.data.mem._owner
        lo, hi = byte_extent(f.shape, f.strides, f.dtype.itemsize)
        runtime = _cuda.rt()
        with _cuda.using_device(target):
            try:
                dst = cupy.cuda.alloc(hi - lo)
                _cuda.call("copying the array between GPUs", runtime.memcpyPeerAsync, dst.ptr, target,
                           src.data.ptr + lo, home, hi - lo, stream_obj.ptr)
            except BaseException:
                src = None  # no array of the mapping left in the traceback's frame once it is gone
                _mapping.abandon(lease, last_try)  # nothing was queued on the mapping
                raise
            _mapping.opened(lease)
            arr = cupy.ndarray(f.shape, f.dtype, cupy.cuda.MemoryPointer(dst.mem, -lo), f.strides)
        del src, lease
        _opened_unmapped.set(arr, OpenInfo(target, home, copied=True))
        return arr

    def _mapped(self, map_device: int, home: int, stream_obj: Any, stream_device: int, count: bool = True,
                claimed: list[bool] | None = None) -> Any:
        """The array mapped on ``map_device`` (``home``, or a GPU with peer access to it), which is current.
        Unless ``count``, the open is not counted yet: the caller passes the array's lease to
        :func:`_mapping.opened` once its open has succeeded, or to :func:`_mapping.abandon`. ``claimed``:
        see :meth:`_open_once`."""
        import cupy

        f = self._f
        producer = f.producer
        from_us = producer.token == this_process().token
        keep = own_ptr = None
        if from_us:
            pin = _keepalive.lookup(f.export_id) if f.export_id else None
            own_ptr, buffer_id = f.base_ptr, f.buffer_id
            if pin is not None and pin[1] != (own_ptr, f.allocation_size, buffer_id):
                raise HandleError("the handle names other memory than the export it carries the number of: it "
                                  "is forged or corrupt")
            keep = pin[0] if pin is not None else None
            if keep is None:
                _check_still_allocated(own_ptr, buffer_id, f)
        elif (ours := _exported.get(f.memory_handle)) is not None:  # our memory, sent back by another process
            own_ptr, buffer_id = ours
            _check_still_allocated(own_ptr, buffer_id, f)
        if own_ptr is not None and map_device != home:
            _cuda.enable_peer_access(map_device, home)  # CUDA IPC would have done it for an import
            # Neither pool nor virtual memory follows peer access: map_device is given access as an import's is.
            if f.kind == Kind.POOL:
                _pools._give_access(_pools.pool_of(own_ptr), map_device, home)
            elif f.kind == Kind.VMM:
                _vmm.give_access(own_ptr, f.allocation_size, map_device)
        # Raises ProducerExitedError if the producer is gone; in our own
        # process it is a second open file, so that our locks are separate.
        seg = _segment.attach(producer.token, producer.pid)
        importer = origin = None
        if own_ptr is not None:
            key: tuple[Any, ...] = (map_device, "own", buffer_id)
        elif f.kind == Kind.LEGACY:
            # The same bytes may name a later allocation at the same addresses: a mapping serves only the
            # sender's same allocation (its buffer id, never reused in the sender).
            key = (map_device, f.kind, f.memory_handle, producer.token, f.buffer_id)
            origin = (f.memory_handle, producer.token, f.base_ptr, f.allocation_size)
        elif f.kind == Kind.POOL:  # the same allocation may come with other export bytes
            key = (map_device, f.kind, producer.token, f.buffer_id, f.resource, producer.pid)
            pool_key = (producer.token, f.resource)
            importer = (lambda: _pools.import_pointer(f, map_device, home, self._take_fds),
                        lambda ptr: _pools.free_imported(ptr, pool_key), 0)
        else:
            # With the pid the descriptors are taken from: a handle naming this producer's token with another
            # process's pid (and that process's memory) must not be keyed as this producer's memory.
            key = (map_device, f.kind, producer.token, f.resource, f.allocation_size, producer.pid)
            pieces = _vmm.pieces_of(f)
            importer = (lambda: _vmm.import_mapping(producer.pid, pieces, map_device, self._take_fds()),
                        lambda ptr: _vmm.unmap(ptr, [size for _, size in pieces]), len(pieces))
        if importer is not None and self._fd is None and self._server is not None and (
                not _mapping.known(key) if f.kind == Kind.VMM else _pools.received_fd(*pool_key) is None):
            # The descriptors the import will need, asked of the producer now, outside the library's lock: a
            # producer slow to answer must not hold up the opens and releases of this process's other arrays.
            self._adopt_descriptors(list(self._take_fds() or ()))
        last_try = claimed is not None
        ptr, lease = _mapping.acquire(
            key, map_device, f.memory_handle, f.allocation_size, own_ptr, keep, seg, producer.token,
            producer.pid, f.export_id, f.slot, stream_obj, stream_device, home, importer,
            f.kind == Kind.POOL, origin, claimed,
        )
        try:
            mem = cupy.cuda.UnownedMemory(ptr, f.allocation_size, lease, map_device)
            arr = cupy.ndarray(f.shape, f.dtype, cupy.cuda.MemoryPointer(mem, f.offset), f.strides)
            if f.flags & FLAG_EVENT:  # last: nothing but the count below can fail once the stream waits
                if from_us:
                    _keepalive.wait_own_event(f.export_id, stream_obj.ptr, stream_device)
                elif stream_device == home:
                    with _cuda.using_device(home):
                        _wait_for_export(f, home, stream_obj.ptr, seg, lease)
                else:
                    ev = open_cached(f.event_handle, home, producer)
                    if not ev.query():  # a finished event needs no wait, and the GPU-side wait is slow
                        _gates.wait_for(ev, stream_obj.ptr, stream_device, seg, producer.pid, lease)
            if count:
                _mapping.opened(lease)
        except BaseException:
            mem = arr = None  # no array of the mapping left in the traceback's frame once it is gone
            if f.flags & FLAG_WORD:  # a stream may wait on its words, which a close would unregister
                _words.park(seg)
            _mapping.abandon(lease, last_try)  # now, not when the traceback (which holds the lease) goes
            raise
        return arr

    def close(self) -> None:
        """Drop the arrays this handle opened, and close the descriptors that came with it. Idempotent.

        Memory is unmapped (or kept idle for the next open, see
        :func:`cupy_ipc.set_idle_mapping_limit`) when the last array or view
        using it is freed. If views other than the returned array outlive this
        call, a ``ResourceWarning`` says how many.

        Raises:
            ProducerExitedError: The producer exited before the work that the
                open waited for had run: the values read may be incomplete
                (the handle is closed all the same).
        """
        if self._fd is not None:  # the imports hold their own copies
            _fdserver.retire(list(self._swap_fds(None) or ()))
        opened = self._opened  # taken one by one (a pop is atomic): an open racing this close is not lost untracked
        outliving = 0
        incomplete = None
        while True:
            try:
                arr = opened.pop()
            except IndexError:
                break
            if arr.size == 0:
                continue
            mem = arr.data.mem
            incomplete = incomplete or _gates.incomplete(getattr(mem, "_owner", None))
            ref = weakref.ref(arr)
            del arr
            a = ref()
            # References to the memory: one per array or view, plus ``mem`` and the call's argument.
            users = sys.getrefcount(mem) - 2
            if a is None:
                outliving += users
            else:
                others = users - 1
                holders = sys.getrefcount(a) - 2
                outliving += others if others else max(0, holders - 1)
                del a
        if outliving:
            warnings.warn(
                f"IpcArrayHandle closed while {outliving} other array(s) or view(s) still use its memory; "
                "it stays mapped until they are freed",
                ResourceWarning,
                stacklevel=2,
            )
        if incomplete is not None:
            pid, reason = incomplete
            raise ProducerExitedError(f"the array read through this handle may be incomplete: {reason}", pid=pid)

    def release(self) -> None:
        """Producer side: stop new opens and let the memory go once current consumers are done.

        Raises:
            IpcError: Called in a process other than the producer.
            HandleError: The handle carries the number of another export
                than the memory it names: it is forged or corrupt.
        """
        f = self._f
        if f.producer.token != this_process().token:
            raise IpcError("release() is for the process that exported the handle")
        if f.export_id:
            pin = _keepalive.lookup(f.export_id)
            if pin is not None and pin[1] != (f.base_ptr, f.allocation_size, f.buffer_id):
                raise HandleError("the handle names other memory than the export it carries the number of: it "
                                  "is forged or corrupt")
            _keepalive.release(f.export_id)

    def __enter__(self) -> Any:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _may_serve(fds: list[int], resource: int) -> bool:
    """Whether descriptors ``fds`` back the pool or the run of pieces this process exports as ``resource``: what
    its descriptor server may hand out."""
    return _pools.exports(fds, resource) or _vmm.exports(fds, resource)


_new = object.__new__
# The slots' own setters: a handle is made for every message, and object.__setattr__ costs twice as much.
_setters = tuple(getattr(IpcArrayHandle, name).__set__ for name in ("_f", "_wire", "_opened", "_fd", "_server"))


def _fill(h: IpcArrayHandle, fields: ArrayFields, wire: bytes | None) -> None:
    set_fields, set_wire, set_opened, set_fd, set_server = _setters
    set_fields(h, fields)
    set_wire(h, wire)
    set_opened(h, [])
    set_fd(h, None)
    set_server(h, None)
