"""The CUDA calls cupy_ipc makes, with errors turned into :class:`IpcError`.

CuPy wraps the runtime; NVIDIA's cuda-bindings gives the driver calls CuPy
does not (the allocation range behind a pointer). Both are imported lazily so
that the package imports, and its handles validate, on machines with no GPU.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import threading
from typing import Any, Callable, NamedTuple, TypeVar

from ._args import shown
from ._errors import HandleError, IpcError

__all__ = [
    "PointerInfo",
    "address_range",
    "as_cupy_stream",
    "call",
    "can_access_peer",
    "checked_ordinal",
    "close_ipc_mapping",
    "create_allocation",
    "create_event",
    "create_pool",
    "current_device",
    "device_count",
    "device_uuid",
    "enable_peer_access",
    "export_allocation",
    "export_pool",
    "import_allocation",
    "import_pool",
    "import_pool_pointer",
    "open_ipc_event",
    "open_ipc_mapping",
    "ordinal_of_uuid",
    "legacy_info",
    "pointer_info",
    "reserve_addresses",
    "retain_allocation",
    "rt",
    "stream_idle",
    "stream_ptr",
    "unavailable_reason",
    "using_device",
    "uuid_name",
]

T = TypeVar("T")

# A hint for the CUDA errors that users of IPC meet, keyed by CUDA error name. Those of _OPENING_ONLY say what
# the error means when a handle is opened, and only such calls carry them (recording an event on a destroyed
# stream is no sign that a producer freed anything).
_HINTS = {
    "cudaErrorDeviceUninitialized": (
        "the handle was opened in a context that cannot import it; opening in "
        "the exporting process or after the producer exited causes this"
    ),
    "cudaErrorInvalidResourceHandle": "the producer freed this memory or event, or has exited",
    "cudaErrorMapBufferObjectFailed": (
        "the driver could not map the memory: the producer may have exited, or "
        "the two GPUs cannot access each other (no peer access)"
    ),
    "cudaErrorPeerAccessUnsupported": "these two GPUs cannot access each other's memory",
    "cudaErrorNotSupported": "CUDA IPC is not supported on this platform (WSL, or an old driver)",
    "cudaErrorInvalidValue": "the handle does not describe memory the driver knows",
    "cudaErrorInvalidDevice": "the GPU named by the handle is not usable here",
    "cudaErrorIllegalAddress": "a kernel touched memory it may not; the CUDA context is lost",
    "cudaErrorDevicesUnavailable": "the GPU is in a compute mode that admits one process only",
}
_OPENING_ONLY = frozenset({"cudaErrorDeviceUninitialized", "cudaErrorInvalidResourceHandle",
                           "cudaErrorMapBufferObjectFailed", "cudaErrorInvalidValue"})


NOT_READY = 600  # cudaErrorNotReady: what a query of unfinished work returns


def _cuda_error_name(exc: BaseException) -> str:
    return str(exc).split(":", 1)[0].strip()


def call(what: str, fn: Callable[..., T], *args: Any, error: type[IpcError] = IpcError, opening: bool = False) -> T:
    """Run a CUDA runtime call; raise ``error`` with the CUDA name and a hint (those about handles only where
    ``opening``: the call opens or creates what a handle names).

    Example:
        >>> call("adding", lambda a, b: a + b, 1, 2)
        3
    """
    try:
        return fn(*args)
    except _runtime_error() as e:
        raise _translated(what, e, error, opening=opening) from e


def _translated(what: str, e: Exception, error: type[IpcError] = IpcError, *, opening: bool = False) -> IpcError:
    name = _cuda_error_name(e)
    hint = _HINTS.get(name) if opening or name not in _OPENING_ONLY else None
    if name == "cudaErrorInsufficientDriver" and not _has_driver_library():  # (not old: missing)
        hint = "the NVIDIA driver is not installed: libcuda.so.1 cannot be loaded"
    return error(f"{what} failed: {e}" + (f" ({hint})" if hint else ""), cuda_error=name)


@functools.lru_cache(maxsize=None)
def rt() -> Any:
    """CuPy's runtime module (``cupy.cuda.runtime``), imported on first use.

    A cached call rather than ``from cupy.cuda import runtime`` in every hot
    function: that statement runs a Python-level import helper each time.
    """
    return import_cupy().cuda.runtime


_NO_CUPY = "cupy_ipc needs CuPy, which is not installed here: install cupy_ipc with its cuda12 or cuda13 extra " \
    "(pip install \"cupy_ipc[cuda12]\"), or the CuPy wheel of this machine's CUDA version"


def import_cupy() -> Any:
    """The ``cupy`` module; without it, :class:`ModuleNotFoundError` that says how to install it.

    Example:
        >>> import_cupy().__name__  # doctest: +SKIP
        'cupy'
    """
    try:
        import cupy
    except ModuleNotFoundError as e:
        if e.name != "cupy":  # (CuPy there, but something it needs missing: its own message says what)
            raise
        raise ModuleNotFoundError(_NO_CUPY, name="cupy") from None
    return cupy


@functools.lru_cache(maxsize=None)
def cupy_names() -> tuple[Any, Any, Any, Any]:
    """``cupy.cuda.get_current_stream``, ``UnownedMemory``, ``MemoryPointer`` and ``cupy.ndarray``, which every
    message's open and export use, looked up once (see :func:`rt`)."""
    cupy = import_cupy()
    return cupy.cuda.get_current_stream, cupy.cuda.UnownedMemory, cupy.cuda.MemoryPointer, cupy.ndarray


@functools.lru_cache(maxsize=None)
def _runtime_error() -> type[Exception]:
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    return CUDARuntimeError


class using_device:
    """Make ``ordinal`` the current device, restoring the previous one after.

    ``bind``: for driver calls, make its context current on this thread even
    if it is the current device already: a thread that has made no runtime
    call (the library's own) has device 0 current and no context at all.
    A class rather than a generator: it runs on every export and open.
    """

    __slots__ = ("ordinal", "previous", "bind")

    def __init__(self, ordinal: int, bind: bool = False) -> None:
        self.ordinal = ordinal
        self.bind = bind

    def __enter__(self) -> None:
        runtime = rt()
        try:
            self.previous = runtime.getDevice()
            if self.previous != self.ordinal or self.bind:
                runtime.setDevice(self.ordinal)
        except _runtime_error() as e:
            raise _translated(f"making GPU {self.ordinal} current", e) from e

    def __exit__(self, *exc: object) -> None:
        if self.previous != self.ordinal:
            runtime = rt()
            try:
                runtime.setDevice(self.previous)
            except _runtime_error() as e:
                raise _translated(f"making GPU {self.previous} current again", e) from e


def unavailable_reason() -> str | None:
    """One line saying why CUDA cannot be used here, or ``None`` if it can.

    Example:
        >>> reason = unavailable_reason()
        >>> reason is None or isinstance(reason, str)
        True
    """
    try:
        import cupy
        from cupy_backends.cuda.api.runtime import CUDARuntimeError
    except ImportError as e:
        return f"CuPy is not installed ({e}); install cupy_ipc with the cuda12 or cuda13 extra"
    except Exception as e:  # noqa: BLE001 - CuPy makes its kernel cache directory as it is imported (~/.cupy)
        return f"CuPy cannot be imported: {type(e).__name__}: {e}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except CUDARuntimeError as e:
        if not _has_driver_library():  # (the runtime then says the driver is too old, which misleads)
            return "no usable CUDA GPU or driver: the NVIDIA driver is not installed (libcuda.so.1 cannot be loaded)"
        return f"no usable CUDA GPU or driver: {e}"
    if count == 0:
        return "no CUDA GPU is visible to this process"
    try:
        _driver()
    except IpcError as e:
        return f"the CUDA driver cannot be used: {e}"
    return None


def _has_driver_library() -> bool:
    return _libcuda_fn("cuInit", ctypes.c_uint) is not None  # (loaded as the library's own driver calls load it)


@functools.lru_cache(maxsize=None)
def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python before 12.6 names the module differently
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError as e:
            raise IpcError("NVIDIA's cuda-bindings is not installed, and cupy_ipc calls the CUDA driver through "
                           "it: install cupy_ipc with its cuda12 or cuda13 extra, or pip install cuda-bindings "
                           "of the CUDA major version CuPy was built for") from e
    try:
        (err,) = driver.cuInit(0)
    except Exception as e:  # cuda-bindings raises its own error when libcuda cannot be loaded
        raise IpcError(f"the CUDA driver library cannot be loaded: {e}") from e
    if err != driver.CUresult.CUDA_SUCCESS:
        raise IpcError(f"cuInit failed: {_enum_name(err)}", cuda_error=_enum_name(err))
    return driver


_OUT_U64 = ctypes.POINTER(ctypes.c_uint64)  # where the driver writes a CUdeviceptr, an allocation handle or a pool
_OUT_FD = ctypes.POINTER(ctypes.c_int)  # where it writes a file descriptor


@functools.lru_cache(maxsize=None)
def _libcuda_fn(name: str, *argtypes: Any) -> Any:
    """libcuda's function ``name``, called through ``ctypes`` with ``argtypes`` and returning its ``CUresult``;
    ``None`` where the library does not load that way (cuda-bindings serves then).

    Through ``ctypes`` the caller can hand the driver a place of its own for what a call makes, which
    cuda-bindings returns as a value instead (see :func:`open_ipc_mapping`); and the call lets go of the GIL.
    """
    try:
        fn = ctypes.CDLL("libcuda.so.1")[name]  # a function object of its own, typed for this caller
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


def _enum_name(err: Any) -> str:
    """The name of cuda-bindings' ``CUresult`` ``err`` (``CUDA_ERROR_INVALID_VALUE``): not its ``str()``, which is
    its repr (``<CUresult.CUDA_ERROR_INVALID_VALUE: 1>``, cuda-bindings 12.9 and 13) or, for an ``IntEnum``
    on Python 3.11 and later, its number."""
    return str(getattr(err, "name", err))


def check(what: str, err: Any) -> None:
    """Raise :class:`IpcError` naming ``what`` unless a driver call's ``err`` is success."""
    driver = _driver()
    if err != driver.CUresult.CUDA_SUCCESS:
        name = _enum_name(err)
        raise IpcError(f"{what} failed: {name}", cuda_error=name)


def posix_fd() -> Any:
    """The POSIX file-descriptor handle type of the driver's shareable handles."""
    return _driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def access_desc(device: int) -> Any:
    """A read/write access descriptor for ``device``."""
    driver = _driver()
    desc = driver.CUmemAccessDesc()
    desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def device_count() -> int:
    runtime = rt()
    return call("counting GPUs", runtime.getDeviceCount)


@functools.lru_cache(maxsize=None)
def device_uuid(ordinal: int) -> bytes:
    """The 16-byte UUID of a local device ordinal."""
    return _driver_uuid(ordinal) or _runtime_uuid(ordinal)


def _driver_uuid(ordinal: int) -> bytes | None:
    # All 16 bytes from the driver, through ctypes: CuPy's device properties
    # end the UUID at its first zero byte (seen on an H200), as a C string.
    init = _libcuda_fn("cuInit", ctypes.c_uint)
    get_device = _libcuda_fn("cuDeviceGet", ctypes.POINTER(ctypes.c_int), ctypes.c_int)
    get_uuid = (_libcuda_fn("cuDeviceGetUuid_v2", ctypes.c_void_p, ctypes.c_int)  # _v2: MIG instances' own
                or _libcuda_fn("cuDeviceGetUuid", ctypes.c_void_p, ctypes.c_int))
    if init is None or get_device is None or get_uuid is None or init(0) != 0:
        return None
    dev = ctypes.c_int()
    buf = ctypes.create_string_buffer(16)
    if get_device(ctypes.byref(dev), ordinal) != 0 or get_uuid(buf, dev) != 0:
        return None
    return buf.raw


def _runtime_uuid(ordinal: int) -> bytes:
    runtime = rt()
    props = call("reading device properties", runtime.getDeviceProperties, ordinal)
    return bytes(props["uuid"])[:16].ljust(16, b"\0")


_ordinals: dict[bytes, int] = {}


def ordinal_of_uuid(uuid: bytes) -> int:
    """The local ordinal of the GPU with this UUID.

    Raises:
        HandleError: No GPU visible to this process has that UUID.
    """
    ordinal = _ordinals.get(uuid)
    if ordinal is not None:
        return ordinal
    for i in range(device_count()):
        if device_uuid(i) == uuid:
            _ordinals[uuid] = i
            return i
    raise HandleError(
        f"the GPU with UUID GPU-{_uuid_text(uuid)} is not visible to this process "
        "(check CUDA_VISIBLE_DEVICES)"
    )


def current_device() -> int:
    """The ordinal of this thread's current GPU (``cudaGetDevice``)."""
    try:  # not through call(): this runs on every open
        return rt().getDevice()
    except _runtime_error() as e:
        raise _translated("reading the current device", e) from e


def checked_ordinal(device: Any) -> int:
    """``device`` (an ordinal or a ``cupy.cuda.Device``) as a visible ordinal.

    Raises:
        TypeError: ``device`` is neither an integer nor a ``cupy.cuda.Device`` (a float, a string, a bool).
        IpcError: No such GPU in this process.
    """
    value = getattr(device, "id", device)
    try:
        if isinstance(value, bool):
            raise TypeError
        ordinal = operator.index(value)  # ints and NumPy integers; not 0.9, which int() makes GPU 0
    except TypeError:
        raise TypeError(f"device must be a GPU ordinal (an integer) or a cupy.cuda.Device, not "
                        f"{type(device).__name__}") from None
    if not 0 <= ordinal < device_count():
        raise IpcError(f"there is no GPU {shown(ordinal)} in this process ({device_count()} visible)")
    return ordinal


@functools.lru_cache(maxsize=None)
def can_access_peer(device: int, peer: int) -> bool:
    """True when kernels on ``device`` can read and write memory of ``peer``."""
    runtime = rt()
    return device == peer or bool(call("asking for peer access", runtime.deviceCanAccessPeer, device, peer))


_peers_enabled: set[tuple[int, int]] = set()


def enable_peer_access(device: int, peer: int) -> None:
    """Let ``device`` access ``peer``'s memory in this process; idempotent."""
    if (device, peer) in _peers_enabled:
        return
    runtime = rt()
    with using_device(device):
        try:
            runtime.deviceEnablePeerAccess(peer)
        except _runtime_error() as e:
            if _cuda_error_name(e) != "cudaErrorPeerAccessAlreadyEnabled":
                raise _translated(f"enabling access from GPU {device} to GPU {peer}", e) from e
    _peers_enabled.add((device, peer))


def uuid_name(ordinal: int) -> str:
    """``GPU-<uuid>`` of a local ordinal, as ``nvidia-smi -L`` prints it."""
    return "GPU-" + _uuid_text(device_uuid(ordinal))


def _uuid_text(uuid: bytes) -> str:
    import uuid as uuidlib

    return str(uuidlib.UUID(bytes=bytes(uuid)))


class PointerInfo(NamedTuple):
    """What the driver knows about the allocation behind a device pointer."""

    base: int
    size: int
    buffer_id: int
    memory_type: str  # "device", "host", "managed", "unknown"
    legacy_ipc: bool


@functools.lru_cache(maxsize=None)
def _attributes() -> tuple[Any, ...]:
    a = _driver().CUpointer_attribute
    return (
        a.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        a.CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        a.CU_POINTER_ATTRIBUTE_BUFFER_ID,
        a.CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        a.CU_POINTER_ATTRIBUTE_IS_MANAGED,
        a.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    )


def pointer_info(ptr: int) -> PointerInfo:
    """Base, size, device and kind of the allocation that holds ``ptr``.

    One driver call (``cuPointerGetAttributes``); a pointer the driver does
    not know comes back with ``size == 0``.
    """
    driver = _driver()
    attrs = _attributes()
    err, values = driver.cuPointerGetAttributes(len(attrs), attrs, ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise IpcError(f"cuPointerGetAttributes failed for 0x{ptr:x}: {_enum_name(err)}", cuda_error=_enum_name(err))
    base, size, buffer_id, mtype, managed, legacy = values
    mtype = int(mtype)
    if managed:
        kind = "managed"
    elif mtype == int(driver.CUmemorytype.CU_MEMORYTYPE_DEVICE):
        kind = "device"
    elif mtype == int(driver.CUmemorytype.CU_MEMORYTYPE_HOST):
        kind = "host"
    else:
        kind = "unknown"
    return PointerInfo(int(base), int(size), int(buffer_id), kind, bool(legacy))


@functools.lru_cache(maxsize=None)
def _ipc_attributes() -> tuple[Any, ...]:
    a = _driver().CUpointer_attribute
    return (a.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, a.CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            a.CU_POINTER_ATTRIBUTE_BUFFER_ID, a.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE)


# The two pointer queries of every new buffer (the export's, and the consumer's check of what it mapped)
# go to the driver through ctypes where it loads: cuda-bindings builds Python objects for each argument
# and result (the export's query: 19 µs of a fresh message on an H200, 13 this way; benchmarks/RESULTS.md).
class _Results(threading.local):
    """Where the driver writes a query's results: one set per thread."""

    def __init__(self) -> None:
        self.values = (ctypes.c_uint64 * 4)()  # the attributes of _ipc_attributes(), 8 bytes each
        self.data = (ctypes.c_void_p * 4)(*(ctypes.addressof(self.values) + 8 * i for i in range(4)))
        self.base = ctypes.c_uint64()
        self.size = ctypes.c_size_t()


_results = _Results()


@functools.lru_cache(maxsize=None)
def _queries() -> tuple[Any, Any, Any] | None:
    """libcuda's ``cuPointerGetAttributes`` and ``cuMemGetAddressRange``, typed, and the attributes of
    :func:`legacy_info` as C ints; ``None`` where the library does not load (then cuda-bindings serves)."""
    attrs = _ipc_attributes()  # initializes the driver
    get = _libcuda_fn("cuPointerGetAttributes", ctypes.c_uint, ctypes.POINTER(ctypes.c_int),
                      ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64)
    address = _libcuda_fn("cuMemGetAddressRange_v2", _OUT_U64, ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64)
    if get is None or address is None:
        return None
    return get, address, (ctypes.c_int * 4)(*(int(a) for a in attrs))


def legacy_info(ptr: int) -> tuple[int, int, int] | None:
    """``(base, size, buffer id)`` of the ``cudaMalloc`` allocation holding ``ptr``; ``None`` for other memory.

    The common case of an export, in fewer attributes than :func:`pointer_info` (no enum to build).
    """
    queries = _queries()
    if queries is not None:
        values = _results.values
        values[3] = 0  # the driver writes a one-byte bool there
        if queries[0](4, queries[2], _results.data, ptr) != 0 or not values[3]:
            return None
        return values[0], values[1], values[2]
    driver = _driver()
    err, values = driver.cuPointerGetAttributes(4, _ipc_attributes(), ptr)
    if err != driver.CUresult.CUDA_SUCCESS or not values[3]:
        return None
    return int(values[0]), int(values[1]), int(values[2])


_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: the thread has no context bound
_NOT_INITIALIZED = 3  # CUDA_ERROR_NOT_INITIALIZED: no runtime call has initialized the driver yet


def _in_context(device: int | None, fn: Callable[..., int], *args: Any) -> int:
    """The ``CUresult`` of ``fn(*args)``, called again with GPU ``device``'s context made current where the thread
    had none (the library's own threads make no runtime call) or the process had not initialized the driver;
    ``device`` ``None``: not again (a caller that does not know the GPU, or has made its context current)."""
    err = fn(*args)
    if device is not None and err in (_INVALID_CONTEXT, _NOT_INITIALIZED):
        with using_device(device, bind=True):
            err = fn(*args)
    return err


def _checked(what: str, device: int | None, fn: Callable[..., int], *args: Any) -> None:
    """:func:`_in_context`, raising :class:`IpcError` with the driver's name of an error."""
    err = _in_context(device, fn, *args)
    if err:
        name = _error_name(err)
        raise IpcError(f"{what} failed: {name}", cuda_error=name)


def _error_name(err: int) -> str:
    """The driver's name of its error code ``err`` (``CUDA_ERROR_INVALID_VALUE``): libcuda's, else
    cuda-bindings' (whose enums of 13.x are not made from a number), else the number."""
    name_of = _libcuda_fn("cuGetErrorName", ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
    text = ctypes.c_char_p()
    if name_of is not None and name_of(err, ctypes.byref(text)) == 0 and text.value:
        return text.value.decode()
    try:
        return str(_driver().CUresult(err).name)
    except Exception:  # noqa: BLE001 - no driver, or an enum that cannot be made from a number
        return f"CUresult {err}"


def close_ipc_mapping(ptr: int, device: int) -> None:
    """Unmap a legacy handle's mapping of GPU ``device``, the GIL let go meanwhile.

    The close waits until the whole GPU is idle (measured on an H200: 1.95 s behind a 2 s kernel of another
    stream, while the process's other threads' kernel launches waited too), and CuPy's ``ipcCloseMemHandle``
    holds the GIL all that time, which stopped every Python thread of the process. A ``ctypes`` call lets go
    of it; cuda-bindings, where libcuda does not load that way, does too.
    """
    close = _libcuda_fn("cuIpcCloseMemHandle", ctypes.c_uint64) or (
        lambda p: int(_driver().cuIpcCloseMemHandle(p)[0]))
    _checked("closing the memory handle", device, close, ptr)


class _Opaque64(ctypes.Structure):
    # CUipcMemHandle and CUipcEventHandle (passed by value), CUmemPoolPtrExportData (by pointer)
    _fields_ = [("reserved", ctypes.c_char * 64)]


_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, cudaIpcMemLazyEnablePeerAccess


def open_ipc_mapping(handle: bytes, device: int, out: ctypes.c_uint64) -> None:
    """Map a legacy memory handle on GPU ``device``, the current one; the driver writes the pointer to ``out``.

    ``out`` is the caller's, made before the call, so that the pointer of a mapping made cannot be lost: an
    interrupt (Ctrl-C) that arrives while the driver maps, which takes about 50 µs, is raised right after the
    call returns, and a pointer returned as a value would be dropped with the call's result. The caller that
    sees anything raised with ``out`` set owns that mapping. Errors carry the runtime's names (the driver's
    codes for these errors are the runtime's).

    Example:
        >>> import ctypes
        >>> out = ctypes.c_uint64()
        >>> open_ipc_mapping(b"\\0" * 63, 0, out)
        Traceback (most recent call last):
        ...
        cupy_ipc._errors.HandleError: a memory handle is 64 bytes, not 63
    """
    if len(handle) != 64:
        raise HandleError(f"a memory handle is 64 bytes, not {len(handle)}")
    open_ = _libcuda_fn("cuIpcOpenMemHandle_v2", _OUT_U64, _Opaque64, ctypes.c_uint)
    _make_as_runtime("opening the memory handle", device, out, open_,
                     (_Opaque64.from_buffer_copy(handle), _LAZY_ENABLE_PEER_ACCESS),
                     lambda: rt().ipcOpenMemHandle(handle, _LAZY_ENABLE_PEER_ACCESS))


def open_ipc_event(handle: bytes, device: int, out: ctypes.c_void_p, what: str) -> None:
    """Open another process's interprocess event (its 64-byte handle) on GPU ``device``, the current one; the
    driver writes the event (a ``cudaEvent_t``, which is a ``CUevent``) to ``out``.

    As with :func:`open_ipc_mapping`, the caller that sees anything raised with ``out`` set owns that event, and
    errors carry the runtime's names.
    """
    open_ = _libcuda_fn("cuIpcOpenEventHandle", ctypes.POINTER(ctypes.c_void_p), _Opaque64)
    _make_as_runtime(what, device, out, open_, (_Opaque64.from_buffer_copy(handle),),
                     lambda: rt().ipcOpenEventHandle(handle))


def create_event(flags: int, device: int, out: ctypes.c_void_p) -> None:
    """Create an event with ``flags`` (``cudaEventCreateWithFlags``'s, which are ``cuEventCreate``'s) on GPU
    ``device``, the current one; the driver writes it to ``out``, as :func:`open_ipc_event` does."""
    create = _libcuda_fn("cuEventCreate", ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
    _make_as_runtime("creating an interprocess event", device, out, create, (flags,),
                     lambda: rt().eventCreateWithFlags(flags))


def _make(what: str, device: int | None, out: ctypes.c_uint64 | ctypes.c_int, fn: Any, args: tuple[Any, ...],
          fallback: Callable[[], tuple[Any, Any]]) -> None:
    """Have the driver write what it makes to ``out``: libcuda's ``fn(&out, *args)``, or where libcuda does not
    load (``fn`` is ``None``) cuda-bindings' ``fallback()``, which returns ``(error, what it made)``. As with
    :func:`open_ipc_mapping`, the caller that sees anything raised with ``out`` set owns what it holds.
    ``device``: see :func:`_in_context`."""
    if fn is None:  # (returned as a value: an interrupt raised as the call returns loses it)
        failed: list[Any] = []

        def via_bindings() -> int:  # tried again in the device's context, as libcuda's fn is (see _in_context)
            err, made = fallback()
            if err != _driver().CUresult.CUDA_SUCCESS:
                failed.append(err)
                return int(err)
            out.value = int(made)
            return 0

        if _in_context(device, via_bindings):
            check(what, failed[-1])
        return
    _checked(what, device, fn, ctypes.byref(out), *args)


def _make_as_runtime(what: str, device: int, out: ctypes.c_uint64 | ctypes.c_void_p, fn: Any, args: tuple[Any, ...],
                     fallback: Callable[[], Any]) -> None:
    """:func:`_make` where CuPy's runtime serves without libcuda (``fallback()`` returns what it made), with the
    runtime's names in errors (the driver's codes for these errors are the runtime's)."""
    if fn is None:
        out.value = call(what, fallback, opening=True)
        return
    err = _in_context(device, fn, ctypes.byref(out), *args)
    if err:
        raise _translated(what, _runtime_error()(err), opening=True)


def import_pool_pointer(pool: Any, data: bytes, device: int, out: ctypes.c_uint64) -> None:
    """Map the allocation of pool export ``data`` (64 bytes) from the imported ``pool`` for GPU ``device``, the
    current one (``cuMemPoolImportPointer``); the pointer, to be freed with ``cuMemFree``, is written to ``out``."""

    def fallback() -> tuple[Any, Any]:
        driver = _driver()
        share = driver.CUmemPoolPtrExportData()
        ctypes.memmove(share.getPtr(), data, ctypes.sizeof(_Opaque64))
        return driver.cuMemPoolImportPointer(pool, share)

    fn = _libcuda_fn("cuMemPoolImportPointer", _OUT_U64, ctypes.c_void_p, ctypes.POINTER(_Opaque64))
    _make("importing the pool allocation", device, out, fn, (int(pool), ctypes.byref(_Opaque64.from_buffer_copy(data))),
          fallback)


def import_allocation(fd: int, device: int, out: ctypes.c_uint64) -> None:
    """Import the allocation of virtual memory that descriptor ``fd`` stands for (``cuMemImportFromShareableHandle``);
    its handle, to be released with ``cuMemRelease``, is written to ``out``."""
    fn = _libcuda_fn("cuMemImportFromShareableHandle", _OUT_U64, ctypes.c_void_p, ctypes.c_int)
    _make("importing the producer's allocation", device, out, fn, (fd, int(posix_fd())),  # (the descriptor as void *)
          lambda: _driver().cuMemImportFromShareableHandle(fd, posix_fd()))


def reserve_addresses(size: int, device: int, out: ctypes.c_uint64) -> None:
    """Reserve ``size`` bytes of addresses (``cuMemAddressReserve``); the first, whose range is to be freed with
    ``cuMemAddressFree``, is written to ``out``."""
    fn = _libcuda_fn("cuMemAddressReserve", _OUT_U64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64,
                     ctypes.c_ulonglong)
    _make("reserving addresses for the mapping", device, out, fn, (size, 0, 0, 0),
          lambda: _driver().cuMemAddressReserve(size, 0, 0, 0))


def create_allocation(size: int, prop: Any, device: int, out: ctypes.c_uint64) -> None:
    """Allocate ``size`` bytes of virtual memory with properties ``prop`` (cuda-bindings' ``CUmemAllocationProp``)
    on GPU ``device`` (``cuMemCreate``); its handle, to be released with ``cuMemRelease``, is written to ``out``."""
    fn = _libcuda_fn("cuMemCreate", _OUT_U64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_ulonglong)
    _make("creating virtual memory", device, out, fn, (size, prop.getPtr(), 0),
          lambda: _driver().cuMemCreate(size, prop, 0))


def retain_allocation(ptr: int, out: ctypes.c_uint64) -> None:
    """The handle of the allocation of virtual memory mapped at ``ptr`` (``cuMemRetainAllocationHandle``), a
    reference to be released with ``cuMemRelease``, written to ``out``; the thread's context is used as it is."""
    fn = _libcuda_fn("cuMemRetainAllocationHandle", _OUT_U64, ctypes.c_void_p)
    _make("finding the allocation behind the pointer", None, out, fn, (ptr,),
          lambda: _driver().cuMemRetainAllocationHandle(ptr))


def export_allocation(handle: int, out: ctypes.c_int) -> None:
    """A file descriptor of the allocation of virtual memory ``handle`` (``cuMemExportToShareableHandle``),
    written to ``out``, in the thread's context."""
    fn = _libcuda_fn("cuMemExportToShareableHandle", _OUT_FD, ctypes.c_uint64, ctypes.c_int, ctypes.c_ulonglong)
    _make("exporting the allocation", None, out, fn, (handle, int(posix_fd()), 0),
          lambda: _driver().cuMemExportToShareableHandle(handle, posix_fd(), 0))


def create_pool(props: Any, device: int, out: ctypes.c_uint64) -> None:
    """Create a stream-ordered pool with properties ``props`` (cuda-bindings' ``CUmemPoolProps``) on GPU ``device``
    (``cuMemPoolCreate``); it is written to ``out``, to be destroyed with ``cuMemPoolDestroy``."""
    fn = _libcuda_fn("cuMemPoolCreate", _OUT_U64, ctypes.c_void_p)
    _make(f"creating a shareable memory pool on GPU {device}", device, out, fn, (props.getPtr(),),
          lambda: _driver().cuMemPoolCreate(props))


def export_pool(pool: int, out: ctypes.c_int) -> None:
    """A file descriptor of stream-ordered pool ``pool`` (``cuMemPoolExportToShareableHandle``), written to
    ``out``, in the thread's context."""
    fn = _libcuda_fn("cuMemPoolExportToShareableHandle", _OUT_FD, ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong)
    _make("exporting the memory pool", None, out, fn, (pool, int(posix_fd()), 0),
          lambda: _driver().cuMemPoolExportToShareableHandle(_driver().CUmemoryPool(pool), posix_fd(), 0))


def import_pool(fd: int, out: ctypes.c_uint64) -> None:
    """Import the stream-ordered pool that descriptor ``fd`` stands for (``cuMemPoolImportFromShareableHandle``),
    in the thread's context; the pool, to be destroyed with ``cuMemPoolDestroy``, is written to ``out``."""
    fn = _libcuda_fn("cuMemPoolImportFromShareableHandle", _OUT_U64, ctypes.c_void_p, ctypes.c_int,
                     ctypes.c_ulonglong)
    _make("importing the producer's memory pool", None, out, fn, (fd, int(posix_fd()), 0),  # (the descriptor as void *)
          lambda: _driver().cuMemPoolImportFromShareableHandle(fd, posix_fd(), 0))


def address_range(ptr: int) -> tuple[int, int]:
    """Base and size of the allocation (or mapping) that holds ``ptr`` (``cuMemGetAddressRange``)."""
    queries = _queries()
    if queries is not None and queries[1](_results.base, _results.size, ptr) == 0:
        return _results.base.value, _results.size.value
    driver = _driver()  # (an error: its name, from cuda-bindings)
    err, base, size = driver.cuMemGetAddressRange(ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise IpcError(f"cuMemGetAddressRange failed for 0x{ptr:x}: {_enum_name(err)}", cuda_error=_enum_name(err))
    return int(base), int(size)


def stream_idle(ptr: int) -> bool:
    """True when every piece of work queued on the stream has finished (``cudaStreamQuery``)."""
    runtime = rt()
    try:  # not through call(): this runs on every export and release
        return runtime.streamQuery(ptr) == 0
    except _runtime_error() as e:
        raise _translated("querying a stream", e) from e


def stream_ptr(stream: Any, device: int = -1) -> int:
    """The raw handle of a CuPy stream, of an object with ``__cuda_stream__``, or the current one (of GPU
    ``device``: CuPy keeps one per GPU; default the current GPU's)."""
    if stream is None:
        import cupy

        return cupy.cuda.get_current_stream(device).ptr
    if hasattr(stream, "ptr"):
        return int(stream.ptr)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return int(stream.cuda_stream)
    raise TypeError(f"not a CUDA stream: {stream!r}")


def default_stream_device(stream: Any) -> int | None:
    """The GPU that an object of a default stream (handle 0, 1 or 2) says it is of: a PyTorch stream's
    ``device_index``, a ``cupy.cuda.ExternalStream``'s ``device_id``; ``None`` where it does not say (CuPy's
    ``Stream.null`` and ``Stream.ptds``: the current GPU's)."""
    for name in ("device_index", "device_id"):
        d = getattr(stream, name, None)
        if isinstance(d, int) and d >= 0:
            return d
    return None


def check_default_stream_of(stream: Any, ptr: int, device: int, what: str) -> None:
    """Refuse a default stream (handle 0, 1 or 2) whose object says it is of a GPU other than ``device``, where
    ``what`` is: a handle that names no GPU would act on ``device``'s own default stream instead."""
    if ptr in (0, 1, 2) and (owner := default_stream_device(stream)) not in (None, device):
        raise IpcError(f"the stream belongs to GPU {owner}, and {what} to GPU {device}: pass a stream of GPU "
                       f"{device}")


def stream_device(ptr: int) -> int:
    """Ordinal of the GPU a raw stream belongs to; the current GPU for the default streams."""
    runtime = rt()
    if ptr in (0, 1, 2):  # the legacy and per-thread default streams act on the current GPU
        return runtime.getDevice()
    driver = _driver()
    try:
        err, dev = driver.cuStreamGetDevice(ptr)
    except (AttributeError, RuntimeError):  # a driver (or bindings) older than CUDA 12.8: ask the stream's context
        err, dev = _stream_device_by_context(driver, ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise IpcError(f"could not tell which GPU stream {ptr:#x} belongs to: {err.name}")
    return int(dev)


def _stream_device_by_context(driver: Any, ptr: int) -> tuple[Any, Any]:
    """``cuStreamGetDevice`` for drivers before CUDA 12.8: the device of the stream's context."""
    err, ctx = driver.cuStreamGetCtx(ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        return err, None
    (err,) = driver.cuCtxPushCurrent(ctx)
    if err != driver.CUresult.CUDA_SUCCESS:
        return err, None
    try:
        return driver.cuCtxGetDevice()
    finally:
        driver.cuCtxPopCurrent()


def of_another_gpu(error: IpcError, ptr: int, device: int, what: str) -> IpcError:
    """``error`` of a call that used stream ``ptr`` for GPU ``device``'s ``what``, said plainly if the stream is
    another GPU's (CUDA reports an invalid resource handle, which says nothing of the cause)."""
    try:
        owner = stream_device(ptr) if ptr not in (0, 1, 2) else device
    except Exception:  # noqa: BLE001 - the call's own error stands
        return error
    if owner == device:
        return error
    return IpcError(f"the stream belongs to GPU {owner}, and {what} to GPU {device}: pass a stream of GPU "
                    f"{device}", cuda_error=error.cuda_error)


class _StreamProtocol:
    __slots__ = ("_ptr",)

    def __init__(self, ptr: int) -> None:
        self._ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._ptr)


def as_cupy_stream(stream: Any) -> Any:
    """A ``cupy.cuda.Stream`` for ``stream``: CuPy's, foreign (PyTorch, cuda.core), or the current one."""
    import cupy

    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, cupy.cuda.stream._BaseStream):
        return stream
    ptr = stream_ptr(stream)
    if hasattr(cupy.cuda.Stream, "from_external"):
        s = cupy.cuda.Stream.from_external(_StreamProtocol(ptr))
    else:  # CuPy 13
        s = cupy.cuda.ExternalStream(ptr)
    s._cupy_ipc_source = stream  # keep the foreign stream alive as long as ours
    return s
