"""The byte layout of handles, and every check made on one before CUDA sees it.

All integers are little-endian. An array handle is a fixed 273-byte header
followed by ``ndim`` signed 64-bit extents and ``ndim`` signed 64-bit strides
(and, for memory shared by file descriptor, a 16-byte descriptor record);
an event handle is a fixed 164-byte record. Both start with a 4-byte magic and
a 2-byte format version. The README documents each field.
"""

from __future__ import annotations

import itertools
import math
import operator
import re
import reprlib
import struct
from typing import NamedTuple, TypeVar

import numpy as np

from ._args import shown
from ._errors import HandleError
from ._identity import Producer

__all__ = [
    "ARRAY_HEADER",
    "EVENT_RECORD",
    "VERSION",
    "ArrayFields",
    "DeviceId",
    "EventFields",
    "Kind",
    "byte_extent",
    "export_parts",
    "field_int",
    "field_ints",
    "field_items",
    "layout_of",
    "pack_array",
    "pack_event",
    "readable",
    "unpack_array",
    "unpack_event",
    "validate_array",
    "validate_layout",
    "with_allocation",
]

VERSION = 2  # 2: the flags bit 2 and the words at the start of the producer's segment file
ARRAY_MAGIC = b"CIPA"
EVENT_MAGIC = b"CIPE"
MAX_NDIM = 64
HANDLE_BYTES = 64
# The most bytes an array may hold or reach: NumPy and CuPy count sizes, strides and offsets in a signed
# 64-bit integer (ssize_t). Past it CuPy wraps around (2**64 elements make an array of size 0) or raises
# OverflowError at open.
MAX_BYTES = 2**63 - 1

FLAG_KEEPALIVE = 1  # the producer pins the memory; export_id/slot are valid
FLAG_EVENT = 2  # event_handle holds the producer's ordering event
FLAG_WORD = 4  # with FLAG_EVENT: the producer's GPU also writes the export's word in its segment (see _words)


class Kind:
    """How the memory is shared: the ``kind`` byte of an array handle."""

    LEGACY = 0  # cudaMalloc memory, cudaIpcGetMemHandle
    VMM = 1  # an allocation of the virtual memory API (cuMemCreate), by file descriptor
    POOL = 2  # a stream-ordered pool's allocation: the pool by file descriptor, the allocation's export data
    EMPTY = 255  # a size-0 array: nothing to map

    names = {LEGACY: "legacy", VMM: "vmm", POOL: "pool", EMPTY: "empty"}
    numbers = {name: number for number, name in names.items()}
    BY_DESCRIPTOR = frozenset({VMM, POOL})  # kinds whose handle ends with a descriptor record


# The array header in three parts: up to the device and producer fields; those
# fields (the origin); and what changes between two exports of one array (with
# the flags byte at offset 7): export id, slot and event. The rest is the
# array's static part.
_BODY = struct.Struct("<4sHBBB4s64sQQQQ")
_ORIGIN = struct.Struct("<i16si16s16s32s")
_DYNAMIC = struct.Struct("<QI64s")
_DYNAMIC_AT = _BODY.size + _ORIGIN.size
# Within the body, the allocation's fields: memory handle, offset, allocation size, base address, buffer id.
_ALLOCATION = struct.Struct("<64sQQQQ")
_ALLOCATION_AT = _BODY.size - _ALLOCATION.size
_ARRAY = struct.Struct(_BODY.format + _ORIGIN.format[1:] + _DYNAMIC.format[1:])
_EVENT = struct.Struct("<4sHBB64si16si16s16s32sI")
_FLAGS = FLAG_KEEPALIVE | FLAG_EVENT | FLAG_WORD
_EVENT_PAIRS = 256  # as many as a producer's segment has (_words.PAIRS)
_U64, _I64, _I32, _U32 = (0, 1 << 64), (-(1 << 63), 1 << 63), (-(1 << 31), 1 << 31), (0, 1 << 32)
_HOST_BYTES = 32
# After the extents and strides of a kind shared by descriptor: the descriptor's
# number in the producer, how many more pieces follow (virtual memory mapped
# piece by piece; 0 otherwise), and the producer's id, never reused, for what it
# names (the run of pieces, or a pool), so that a consumer imports each pool once
# and never takes a mapping it keeps for another run. Each further
# piece: its descriptor's number, 0, its size in bytes.
_DESCRIPTOR = struct.Struct("<iIQ")
MAX_PIECES = 4096
ARRAY_HEADER = _ARRAY.size
EVENT_RECORD = _EVENT.size
# The longest handle there may be, and the most descriptors one may carry (a pool's one, or a descriptor per
# piece of virtual memory).
MAX_WIRE_BYTES = ARRAY_HEADER + 16 * MAX_NDIM + _DESCRIPTOR.size * (MAX_PIECES + 1)
MAX_DESCRIPTORS = MAX_PIECES + 1

# The dtypes CUDA kernels and CuPy handle natively: bool, integers, floats, complex.
_DTYPES = {
    np.dtype(t).str: np.dtype(t)
    for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
        np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
        np.complex128,
    )
}


_BY_IDENTITY = {id(dt): dt for dt in _DTYPES.values()}

# The dtype field as written (dtype.str, NUL-padded to 4 bytes) -> the dtype.
_DTYPE_FIELDS = {dt.str.encode().ljust(4, b"\0"): dt for dt in _DTYPES.values()}


class DeviceId(NamedTuple):
    """A GPU as the producer saw it: its ordinal there and its UUID.

    The consumer finds its own ordinal for the GPU by UUID, so processes with
    different ``CUDA_VISIBLE_DEVICES`` agree.

    Example:
        >>> DeviceId(0, bytes(16)).ordinal
        0
    """

    ordinal: int
    uuid: bytes


class ArrayFields(NamedTuple):
    kind: int
    flags: int
    dtype: np.dtype
    memory_handle: bytes
    offset: int
    allocation_size: int
    base_ptr: int
    buffer_id: int
    device: DeviceId
    producer: Producer
    export_id: int
    slot: int
    event_handle: bytes
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    fd: int = -1  # kinds shared by descriptor: the descriptor's number in the producer
    resource: int = 0  # and the producer's id for the run of pieces or the pool it names
    more: tuple[tuple[int, int], ...] = ()  # virtual memory: (descriptor, size) of each further piece


class EventFields(NamedTuple):
    event_handle: bytes
    block: bool
    device: DeviceId
    producer: Producer
    pair: int = 0  # 1 + the event's pair of words in the producer's segment (see _words); 0: none


# Dtype text that NumPy warns about while parsing it: its deprecated alias "a" (bytes) as a type code, and a
# parenthesized single number as a repeat count. Neither ever names a shareable dtype, so such text is
# refused before NumPy sees it: silencing the warning would take changing the warnings filters, which are
# process-wide, so another thread's warnings would be lost or turned into errors meanwhile. (A spec that is
# no text, a structured one say, is the caller's own, and so is NumPy's warning about it.)
_WARNING_TEXT = re.compile(r"(?<![A-Za-z_])a(?![A-Za-z_])|\( *[0-9][0-9 ]*\)")  # (one way to match: linear time)
_LONGEST_TEXT = 32  # longer dtype text names no shareable dtype: refused before it is parsed


def dtype_of(value: object) -> np.dtype:
    """The dtype a handle may carry, or :class:`HandleError`."""
    hit = _BY_IDENTITY.get(id(value))
    if hit is value and hit is not None:  # NumPy's builtin dtypes are singletons: an array's is one of them
        return hit
    if value is None:  # NumPy's float64 by default: a handle describes memory, whose dtype is never a default
        raise HandleError("a handle needs a dtype, not None")
    key = value.str if isinstance(value, np.dtype) else value
    if isinstance(key, str) and key in _DTYPES:
        return _DTYPES[key]
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    if isinstance(text, str) and (len(text) > _LONGEST_TEXT or _WARNING_TEXT.search(text)):
        raise HandleError(f"not a dtype that can be shared: {reprlib.repr(value)}")
    try:
        dt = np.dtype(value)  # type: ignore[call-overload]
    except Exception as e:  # NumPy parses text as dtype syntax: "," raises SyntaxError
        raise HandleError(f"not a dtype: {shown(value)!r}") from e
    if dt.str not in _DTYPES:
        raise HandleError(
            f"dtype {dt} cannot be shared: only bool, integer, float and complex "
            "dtypes in little-endian order are supported"
        )
    return _DTYPES[dt.str]


def byte_extent(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """Lowest and one-past-highest byte the array reaches, relative to its first element.

    Example:
        >>> byte_extent((3,), (-8,), 8)   # a reversed view reaches backwards
        (-16, 8)
        >>> byte_extent((0, 5), (40, 8), 8)
        (0, 0)
    """
    if 0 in shape:
        return 0, 0
    lo, hi, _ = _reach(shape, strides, 1)
    return lo, hi + itemsize


def _reach(shape: tuple[int, ...], strides: tuple[int, ...], align: int) -> tuple[int, int, int]:
    """``(lowest, highest byte offset of an element, nonzero if a stride that moves is not a multiple of
    align)`` of a non-empty array: one loop, run for every new handle on each side."""
    lo = hi = misaligned = 0
    for n, step in zip(shape, strides):
        if n > 1:
            misaligned |= step % align
            if step > 0:
                hi += (n - 1) * step
            else:
                lo += (n - 1) * step
    return lo, hi, misaligned


def _in_range(what: str, value: int, bounds: tuple[int, int]) -> None:
    if not bounds[0] <= value < bounds[1]:
        raise HandleError(f"{what} {shown(value)} does not fit the wire format's field")


def validate_origin(device: DeviceId, producer: Producer) -> None:
    """Device and producer fields must be what the wire can hold, exactly."""
    if not (type(device.ordinal) is int and type(producer.pid) is int and type(device.uuid) is bytes
            and type(producer.token) is bytes and type(producer.boot_id) is bytes and type(producer.host) is str):
        raise HandleError("the device ordinal and producer pid must be int, the device UUID, producer token and "
                          "boot id bytes, the host name str")
    if len(device.uuid) != 16:
        raise HandleError("device UUID must be 16 bytes")
    if len(producer.token) != 16 or len(producer.boot_id) != 16:
        raise HandleError("producer token and boot id must be 16 bytes each")
    _in_range("device ordinal", device.ordinal, _I32)
    _in_range("producer pid", producer.pid, _I32)
    try:
        host = producer.host.encode()
    except UnicodeEncodeError:
        raise HandleError(f"host name {producer.host!r} is not valid text") from None
    if len(host) > _HOST_BYTES or b"\0" in host:
        raise HandleError(f"host name {producer.host!r} must be at most {_HOST_BYTES} UTF-8 bytes, with no NUL")


def validate_array(f: ArrayFields) -> None:
    """Raise :class:`HandleError` unless the fields describe memory safely and fit the wire exactly."""
    if len(f.shape) != len(f.strides):
        raise HandleError(f"shape has {len(f.shape)} dimensions but strides has {len(f.strides)}")
    if len(f.memory_handle) != HANDLE_BYTES or len(f.event_handle) != HANDLE_BYTES:
        raise HandleError("memory and event handles must be 64 bytes")
    validate_origin(f.device, f.producer)
    if f.offset < 0 or f.allocation_size < 0:
        raise HandleError("offset and allocation size must not be negative")
    for what, value in (("offset", f.offset), ("allocation size", f.allocation_size), ("base address", f.base_ptr),
                        ("buffer id", f.buffer_id), ("export id", f.export_id)):
        _in_range(what, value, _U64)
    _in_range("slot", f.slot, _U32)
    _in_range("descriptor", f.fd, _I32)
    _in_range("resource id", f.resource, _U64)
    for fd, size in f.more:
        _in_range("descriptor", fd, _I32)
        _in_range("piece size", size, _U64)
    for n in f.shape:
        _in_range("extent", n, _I64)
    for s in f.strides:
        _in_range("stride", s, _I64)
    validate_layout(f)


def validate_layout(f: ArrayFields) -> tuple[int, int, int] | None:
    """The safety checks alone, for fields whose widths the wire format or the driver already bound.

    Returns ``(lowest, one past the highest byte, alignment)`` the array reaches relative to its first
    element, what the checks of another allocation of the same layout need (``None`` for an empty one).
    """
    if f.kind not in Kind.names:
        raise HandleError(f"unknown memory kind {shown(f.kind)}")
    if f.flags & ~_FLAGS:
        raise HandleError(f"unknown flag bits 0x{f.flags & ~_FLAGS:x}")
    shape, strides = f.shape, f.strides
    if len(shape) > MAX_NDIM:
        raise HandleError(f"{len(shape)} dimensions; at most {MAX_NDIM} are allowed")
    if shape and min(shape) < 0:
        raise HandleError(f"negative extent in shape {shape}")
    if f.kind not in Kind.BY_DESCRIPTOR and (f.fd != -1 or f.resource or f.more):
        raise HandleError(f"{Kind.names[f.kind]} handles carry no descriptor, resource id or pieces")
    itemsize = f.dtype.itemsize
    # Strides of 0 (a broadcast) reach few bytes, but every element counts; and, as NumPy bounds them, the
    # extents of an empty array other than its 0 (CuPy would compute its strides from them).
    count = math.prod(n for n in shape if n)
    if count * itemsize > MAX_BYTES:
        raise HandleError(
            f"shape {shape} has {count} elements of {itemsize} bytes (its extents other than 0), "
            f"{count * itemsize} in all: more than the {MAX_BYTES} (2**63 - 1) bytes an array can hold"
        )
    if f.kind == Kind.EMPTY:
        if 0 not in shape:
            raise HandleError(f"an empty handle must have a size-0 shape, not {shape}")
        return None
    if 0 in shape:
        raise HandleError(f"shape {shape} has no elements, so the handle kind must be empty")
    if f.kind in Kind.BY_DESCRIPTOR and (f.fd < 0 or f.resource == 0):
        raise HandleError(f"a {Kind.names[f.kind]} handle needs the producer's descriptor and resource id")
    if f.more:
        if f.kind != Kind.VMM:
            raise HandleError(f"only virtual memory comes in pieces, not a {Kind.names[f.kind]} allocation")
        if len(f.more) > MAX_PIECES:
            raise HandleError(f"{len(f.more) + 1} pieces; at most {MAX_PIECES + 1} are allowed")
        if any(fd < 0 or size <= 0 for fd, size in f.more) or sum(size for _, size in f.more) >= f.allocation_size:
            raise HandleError("the pieces' descriptors or sizes do not fit the allocation size")
    # A complex element is read whole: CuPy's kernels use cuda::std::complex, aligned to its size (NumPy's
    # alignment is its parts'), and a misaligned read faults, which ends the consumer's CUDA context.
    align = f.dtype.itemsize if f.dtype.kind == "c" else f.dtype.alignment
    offset = f.offset
    lo, hi, misaligned = _reach(shape, strides, align)
    if misaligned or offset % align:
        raise HandleError(
            f"offset {offset} or strides {strides} are not aligned to the "
            f"{align}-byte alignment of {f.dtype}"
        )
    hi += itemsize
    if offset + lo < 0 or offset + hi > f.allocation_size:
        raise HandleError(
            f"shape {shape} with strides {strides} at offset {offset} reaches bytes "
            f"[{offset + lo}, {offset + hi}), outside the {f.allocation_size}-byte allocation"
        )
    if offset + hi > MAX_BYTES:  # below it, the offset and each element's position fit a signed 64-bit integer
        raise HandleError(
            f"shape {shape} with strides {strides} at offset {offset} reaches bytes "
            f"[{offset + lo}, {offset + hi}), beyond the first {MAX_BYTES} (2**63 - 1) an array can address"
        )
    return lo, hi, align


def field_int(value: object, what: str) -> int:
    """``value`` as an integer field of a handle built from values: an integer (not a float or text, which
    would be truncated or parsed), or :class:`HandleError`."""
    if isinstance(value, bool):  # (an int to Python, but never meant as one here)
        raise HandleError(f"{what} must be an integer, not bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise HandleError(f"{what} must be an integer, not {type(value).__name__}") from None


# The most items a field given as a sequence holds: more's pieces (extents and strides: 64 at most). An iterable
# is read no further, so that an endless or huge one is refused at once instead of filling memory.
MAX_ITEMS = MAX_PIECES + 1


def field_items(values: object, what: str, form: str) -> tuple[object, ...]:
    """``values``' items (at most :data:`MAX_ITEMS` of them), for a field given as ``form``, or :class:`HandleError`."""
    if isinstance(values, (str, bytes, bytearray, memoryview)):  # iterable, but never meant as a sequence of values
        raise HandleError(f"{what} must be {form}, not {type(values).__name__}")
    try:
        items = tuple(itertools.islice(values, MAX_ITEMS + 1))  # type: ignore[call-overload]
    except TypeError:
        raise HandleError(f"{what} must be {form}, not {type(values).__name__}") from None
    if len(items) > MAX_ITEMS:
        raise HandleError(f"{what} has more than {MAX_ITEMS} items: no field of a handle holds that many")
    return items


def field_ints(values: object, what: str, count: int | None = None) -> tuple[int, ...]:
    """``values`` as a tuple of integers (of ``count`` of them, if given), or :class:`HandleError`."""
    items = field_items(values, what, "a sequence of integers")
    if count is not None and len(items) != count:
        raise HandleError(f"{what} must have {count} items, not {len(items)}")
    return tuple(field_int(v, f"each item of {what}") for v in items)


def readable(data: object, what: str) -> bytes:
    """``data`` (bytes, a bytearray or a memoryview) as bytes, read once: what is checked is what is kept.
    Longer than any handle: refused before it is copied."""
    if type(data) is bytes:
        if len(data) > MAX_WIRE_BYTES:
            raise HandleError(f"{what} is {len(data)} bytes, more than any handle has ({MAX_WIRE_BYTES})")
        return data
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise HandleError(f"{what} must be bytes, not {type(data).__name__}")
    try:
        view = memoryview(data)  # the buffer itself: a bytes subclass's __bytes__ may say otherwise
        size = view.nbytes
    except (ValueError, TypeError) as e:  # a released memoryview
        raise HandleError(f"{what} cannot be read: {e}") from None
    if size > MAX_WIRE_BYTES:
        raise HandleError(f"{what} is {size} bytes, more than any handle has ({MAX_WIRE_BYTES})")
    try:
        return bytes(view)
    except (ValueError, TypeError) as e:  # a memoryview of another format
        raise HandleError(f"{what} cannot be read: {e}") from None


def _header(data: object, magic: bytes, what: str, minimum: int) -> bytes:
    data = readable(data, what)
    if len(data) < minimum:
        raise HandleError(f"{what} is {len(data)} bytes; at least {minimum} expected")
    if data[:4] != magic:
        raise HandleError(f"not a cupy_ipc {what} (magic {data[:4]!r}, expected {magic!r})")
    (version,) = struct.unpack_from("<H", data, 4)
    if version != VERSION:
        raise HandleError(f"{what} format version {version}; this cupy_ipc reads version {VERSION}")
    return data


def _host(raw: bytes) -> str:
    text = raw.rstrip(b"\0")
    if b"\0" in text:
        raise HandleError("host field has a NUL inside the name")
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError:
        raise HandleError("host field is not valid UTF-8") from None


def with_export(f: ArrayFields, flags: int, export_id: int, slot: int, event_handle: bytes) -> ArrayFields:
    """The fields of ``f`` with another export's dynamic part."""
    # A whole tuple, without NamedTuple's keyword handling: this runs for every export of a re-sent array.
    return _tuple_new(ArrayFields, (f[0], flags, *f[2:10], export_id, slot, event_handle, *f[13:]))


_tuple_new = tuple.__new__


def export_parts(wire: bytes) -> tuple[bytes, bytes, bytes]:
    """An array handle's wire form less its flags byte and its export part, which come between the three
    parts: what :func:`splice` joins another export's with."""
    return wire[:7], wire[8:_DYNAMIC_AT], wire[ARRAY_HEADER:]


_FLAG_BYTES = tuple(bytes((flags,)) for flags in range(256))


def splice(parts: tuple[bytes, bytes, bytes], flags: int, export_id: int, slot: int, event_handle: bytes) -> bytes:
    """The wire form of another export of an array, whose wire form cut by :func:`export_parts` is ``parts``."""
    return b"".join((parts[0], _FLAG_BYTES[flags], parts[1], _DYNAMIC.pack(export_id, slot, event_handle),
                     parts[2]))


def layout_of(wire: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    """The parts of an array handle's wire form that another allocation of its layout shares (every
    part but the flags, the allocation's fields and the export part), for :func:`with_allocation`."""
    return wire[:7], wire[8:_ALLOCATION_AT], wire[_BODY.size:_DYNAMIC_AT], wire[ARRAY_HEADER:]


def with_allocation(layout: tuple[bytes, bytes, bytes, bytes], flags: int, memory_handle: bytes, offset: int,
                    allocation_size: int, base_ptr: int, buffer_id: int, export_id: int, slot: int,
                    event_handle: bytes) -> bytes:
    """The wire form of a handle of ``layout`` (see :func:`layout_of`) for another allocation and export."""
    return b"".join((layout[0], bytes((flags,)), layout[1],
                     _ALLOCATION.pack(memory_handle, offset, allocation_size, base_ptr, buffer_id),
                     layout[2], _DYNAMIC.pack(export_id, slot, event_handle), layout[3]))


def pack_array(f: ArrayFields) -> bytes:
    ndim = len(f.shape)
    head = _ARRAY.pack(
        ARRAY_MAGIC, VERSION, f.kind, f.flags, ndim, f.dtype.str.encode(), f.memory_handle,
        f.offset, f.allocation_size, f.base_ptr, f.buffer_id, f.device.ordinal, f.device.uuid,
        f.producer.pid, f.producer.token, f.producer.boot_id, f.producer.host.encode()[:32],
        f.export_id, f.slot, f.event_handle,
    )
    tail = b""
    if f.kind in Kind.BY_DESCRIPTOR:
        tail = _DESCRIPTOR.pack(f.fd, len(f.more), f.resource) + b"".join(
            _DESCRIPTOR.pack(fd, 0, size) for fd, size in f.more)
    return head + struct.pack(f"<{2 * ndim}q", *f.shape, *f.strides) + tail


# Received layouts: all of a handle but its flags, its allocation's fields and its export part (kind,
# dtype, device, producer, extents, strides, descriptor record) -> the fields of a handle of that
# layout, validated, and the reach its allocations are checked against. A new allocation of a known
# layout (each fresh buffer of a pipeline) and a re-sent array then parse in a few comparisons.
_layouts: dict[bytes, tuple[ArrayFields, tuple[int, int, int] | None]] = {}
_LAYOUTS_MAX = 1024
# Received handles by all their bytes but the export part, which every value of passes validation: the fields
# of one of them. A re-sent array's handles then parse in one look-up.
_resent: dict[bytes, ArrayFields] = {}
# Neither keeps a handle longer than this: one of virtual memory in many pieces is up to 64 KiB on the wire and
# its fields about eight times that (1024 of them kept about 700 MB), so it is parsed whole each time. Every
# other handle is a few hundred bytes.
_CACHED_MAX = 1024


_V = TypeVar("_V")


def _keep(cache: dict[bytes, _V], key: bytes, value: _V) -> None:
    """Keep ``value`` in one of the parse caches, unless ``key`` is longer than :data:`_CACHED_MAX`; a full
    cache starts again."""
    if len(key) <= _CACHED_MAX:
        if len(cache) >= _LAYOUTS_MAX:
            cache.clear()
        cache[key] = value


_ARRAY_START = ARRAY_MAGIC + struct.pack("<H", VERSION)


def unpack_array(data: object) -> ArrayFields:
    """Parse and validate an array handle; only :class:`HandleError` escapes."""
    if type(data) is bytes and ARRAY_HEADER <= len(data) <= MAX_WIRE_BYTES and data[:6] == _ARRAY_START:
        raw = data  # what _header checks, for the common case
    else:
        raw = _header(data, ARRAY_MAGIC, "array handle", ARRAY_HEADER)
    exact = raw[:_DYNAMIC_AT] + raw[ARRAY_HEADER:]
    f = _resent.get(exact)
    if f is not None:
        return _tuple_new(ArrayFields, (*f[:10], *_DYNAMIC.unpack_from(raw, _DYNAMIC_AT), *f[13:]))
    fields = _unpack_new(raw)
    _keep(_resent, exact, fields)
    return fields


def _unpack_new(raw: bytes) -> ArrayFields:
    """:func:`unpack_array` of a handle not seen before but for its export part."""
    flags = raw[7]
    if flags & ~_FLAGS:
        raise HandleError(f"unknown flag bits 0x{flags & ~_FLAGS:x}")
    key = raw[:7] + raw[8:_ALLOCATION_AT] + raw[_BODY.size:_DYNAMIC_AT] + raw[ARRAY_HEADER:]
    hit = _layouts.get(key)
    if hit is None:
        fields, reach = _parse(raw)
        _keep(_layouts, key, (fields, reach))
        return fields
    f, reach = hit
    mem, offset, size, base, buffer_id = _ALLOCATION.unpack_from(raw, _ALLOCATION_AT)
    fields = ArrayFields(f.kind, flags, f.dtype, mem, offset, size, base, buffer_id, f.device, f.producer,
                         *_DYNAMIC.unpack_from(raw, _DYNAMIC_AT), f.shape, f.strides, f.fd, f.resource, f.more)
    # What validate_layout checks of another allocation (its pieces' sizes too, for virtual memory).
    if reach is not None and (offset % reach[2] or offset + reach[0] < 0 or offset + reach[1] > size
                              or size > MAX_BYTES or f.more):
        validate_layout(fields)
    return fields


# The device and producer of received handles by their bytes: a producer's
# handles all carry the same ones, parsed once.
_origins: dict[bytes, tuple[DeviceId, Producer]] = {}
_ORIGINS_MAX = 256


def _origin(raw: bytes) -> tuple[DeviceId, Producer]:
    at = _BODY.size
    key = raw[at:at + _ORIGIN.size]
    hit = _origins.get(key)
    if hit is None:
        ordinal, uuid, pid, token, boot, host = _ORIGIN.unpack(key)
        hit = (DeviceId(ordinal, uuid), Producer(pid, token, boot, _host(host)))
        if len(_origins) >= _ORIGINS_MAX:
            _origins.clear()
        _origins[key] = hit
    return hit


def _dtype_field(raw: bytes) -> np.dtype:
    dt = _DTYPE_FIELDS.get(raw)
    if dt is not None:
        return dt
    try:
        dtype_text = raw.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise HandleError(f"dtype field {raw!r} is not text") from None
    # Only NumPy's canonical spelling (dtype.str) is written, so only it is read.
    canonical = dtype_of(dtype_text).str  # raises first if it is no shareable dtype at all
    raise HandleError(f"dtype field {raw!r} is not written as NumPy's dtype.str {canonical!r}")


def _parse(raw: bytes) -> tuple[ArrayFields, tuple[int, int, int] | None]:
    """The fields of a handle, validated, and their reach (see :func:`validate_layout`)."""
    _, _, kind, flags, ndim, dtype, mem, offset, size, base, buffer_id = _BODY.unpack_from(raw)
    if ndim > MAX_NDIM:
        raise HandleError(f"{ndim} dimensions; at most {MAX_NDIM} are allowed")
    at = ARRAY_HEADER + 16 * ndim
    fd, pieces, resource, more = -1, 0, 0, ()
    by_descriptor = kind in Kind.BY_DESCRIPTOR
    if by_descriptor and len(raw) >= at + _DESCRIPTOR.size:
        fd, pieces, resource = _DESCRIPTOR.unpack_from(raw, at)
        if pieces > MAX_PIECES:
            raise HandleError(f"{pieces + 1} pieces; at most {MAX_PIECES + 1} are allowed")
    tail = _DESCRIPTOR.size * (1 + pieces) if by_descriptor else 0
    if len(raw) != at + tail:
        raise HandleError(f"array handle is {len(raw)} bytes; {at + tail} expected for {ndim} dimensions")
    dims = struct.unpack_from(f"<{2 * ndim}q", raw, ARRAY_HEADER)
    if pieces:
        records = [_DESCRIPTOR.unpack_from(raw, at + _DESCRIPTOR.size * (1 + k)) for k in range(pieces)]
        if any(zero for _, zero, _ in records):
            raise HandleError("reserved bytes of a piece record are not zero")
        more = tuple((piece_fd, size) for piece_fd, _, size in records)
    dt = _dtype_field(dtype)
    device, producer = _origin(raw)
    export_id, slot, event = _DYNAMIC.unpack_from(raw, _DYNAMIC_AT)
    fields = ArrayFields(
        kind, flags, dt, mem, offset, size, base, buffer_id, device, producer, export_id, slot,
        event, dims[:ndim], dims[ndim:], fd, resource, more,
    )
    return fields, validate_layout(fields)  # the struct bounds every width and range


def pack_event(f: EventFields) -> bytes:
    return _EVENT.pack(
        EVENT_MAGIC, VERSION, int(f.block), 0, f.event_handle, f.device.ordinal, f.device.uuid,
        f.producer.pid, f.producer.token, f.producer.boot_id, f.producer.host.encode()[:32], f.pair,
    )


def unpack_event(data: object) -> EventFields:
    """Parse and validate an event handle; only :class:`HandleError` escapes."""
    raw = _header(data, EVENT_MAGIC, "event handle", EVENT_RECORD)
    if len(raw) != EVENT_RECORD:
        raise HandleError(f"event handle is {len(raw)} bytes; {EVENT_RECORD} expected")
    _, _, block, reserved, handle, ordinal, uuid, pid, token, boot, host, pair = _EVENT.unpack(raw)
    if block not in (0, 1):
        raise HandleError(f"event flags byte {block} is not 0 or 1")
    if reserved:
        raise HandleError("the reserved byte of the event handle is not zero")
    if pair > _EVENT_PAIRS:
        raise HandleError(f"event handle names pair of words {pair}; at most {_EVENT_PAIRS} expected")
    return EventFields(handle, bool(block), DeviceId(ordinal, uuid), Producer(pid, token, boot, _host(host)), pair)
