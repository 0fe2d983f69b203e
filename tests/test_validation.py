"""Every check made on a handle before CUDA sees it; only HandleError may come out of parsing. CPU only."""

from __future__ import annotations

import collections
import itertools
import re
import string
import struct
import warnings
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from samples import BOOT_ID, DTYPES, MEMORY_HANDLE, PRODUCER, TOKEN, UUID

from cupy_ipc import DeviceId, HandleError, IpcArrayHandle, IpcError, IpcEventHandle, Producer
from cupy_ipc._wire import (
    _ARRAY,
    _EVENT,
    ARRAY_HEADER,
    EVENT_RECORD,
    VERSION,
    EventFields,
    Kind,
    pack_array,
    pack_event,
)


# --- the wire layout, read from the structs so that these tests follow the format ---------------------------
def layout(fmt, names):
    """``{field: (byte offset, struct code)}`` for a little-endian struct format."""
    assert fmt.startswith("<")
    codes = re.findall(r"\d*[a-zA-Z?]", fmt[1:])
    assert "<" + "".join(codes) == fmt and len(codes) == len(names)
    return {name: (struct.calcsize("<" + "".join(codes[:i])), "<" + code)
            for i, (name, code) in enumerate(zip(names, codes))}


ARRAY_FIELDS = layout(_ARRAY.format, (
    "magic", "version", "kind", "flags", "ndim", "dtype", "memory_handle", "offset", "allocation_size",
    "base_ptr", "buffer_id", "ordinal", "uuid", "pid", "token", "boot_id", "host", "export_id", "slot",
    "event_handle",
))
EVENT_FIELDS = layout(_EVENT.format, (
    "magic", "version", "block", "reserved", "event_handle", "ordinal", "uuid", "pid", "token", "boot_id",
    "host", "pair",
))


def patched(data, fields, **values):
    """``data`` with the named header fields overwritten."""
    buf = bytearray(data)
    for name, value in values.items():
        offset, code = fields[name]
        if code.endswith("x"):  # padding has no struct value: write raw bytes
            buf[offset:offset + len(value)] = value
        else:
            struct.pack_into(code, buf, offset, value)
    return bytes(buf)


def with_dims(data, shape, strides):
    """``data`` with its ndim byte and trailing extents and strides replaced."""
    head = patched(data[:ARRAY_HEADER], ARRAY_FIELDS, ndim=len(shape))
    return head + struct.pack(f"<{len(shape) + len(strides)}q", *shape, *strides)


def fields_of(name, fields=ARRAY_FIELDS):
    offset, code = fields[name]
    return offset, offset + struct.calcsize(code)


# --- handles ------------------------------------------------------------------------------------------------
def make(shape=(4, 2), strides=(8, 4), dtype="float32", offset=0, allocation_size=32, *,
         kind=Kind.LEGACY, memory_handle=MEMORY_HANDLE, device=(0, UUID), producer=PRODUCER):
    return IpcArrayHandle(memory_handle=memory_handle, offset=offset, allocation_size=allocation_size,
                          shape=shape, strides=strides, dtype=dtype, device=device, producer=producer, kind=kind)


VALID = make().to_bytes()
EVENT = pack_event(EventFields(bytes(range(64)), True, DeviceId(1, UUID), Producer(*PRODUCER)))


def rejected(match, fn, *args, **kwargs):
    """Assert ``fn`` raises a HandleError naming the problem; return it."""
    with pytest.raises(HandleError, match=match) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, IpcError)
    return info.value


def accepted_or_round_trips(data):
    """The property every parse must have: HandleError, or an exact round trip."""
    try:
        h = IpcArrayHandle.from_bytes(data)
    except HandleError:
        return None
    assert h.to_bytes() == bytes(data)
    assert pack_array(h._f) == bytes(data)  # to_bytes() gives the input back: the fields must give it too
    assert IpcArrayHandle.from_bytes(h.to_bytes()) == h
    return h


def event_accepted_or_round_trips(data):
    try:
        e = IpcEventHandle.from_bytes(data)
    except HandleError:
        return None
    assert e.to_bytes() == bytes(data)
    assert IpcEventHandle.from_bytes(e.to_bytes()) == e
    return e


def constructed_or_round_trips(**kwargs):
    """The constructor's property: HandleError, or a handle whose wire form gives it back exactly."""
    try:
        h = IpcArrayHandle(**kwargs)
    except HandleError:
        return None
    data = h.to_bytes()
    assert IpcArrayHandle.from_bytes(data) == h
    assert IpcArrayHandle.from_bytes(data).to_bytes() == data
    return h


def test_layout_finds_the_fields():
    """The offsets computed above point at the fields, or every corruption below would hit the wrong bytes."""
    assert struct.calcsize(_ARRAY.format) == ARRAY_HEADER
    assert struct.calcsize(_EVENT.format) == EVENT_RECORD
    h = make(offset=8, allocation_size=40, device=(3, UUID))
    data = h.to_bytes()

    def field(name, fields=ARRAY_FIELDS, data=data):
        offset, code = fields[name]
        return struct.unpack_from(code, data, offset)[0]

    assert (field("kind"), field("ndim"), field("dtype")) == (Kind.LEGACY, 2, b"<f4\0")
    assert (field("offset"), field("allocation_size"), field("ordinal"), field("pid")) == (8, 40, 3, 4242)
    assert (field("memory_handle"), field("uuid"), field("token"), field("boot_id")) == (MEMORY_HANDLE, UUID, TOKEN,
                                                                                          BOOT_ID)
    assert field("host").rstrip(b"\0") == b"gpu-host"
    assert (field("block", EVENT_FIELDS, EVENT), field("ordinal", EVENT_FIELDS, EVENT)) == (1, 1)
    assert field("event_handle", EVENT_FIELDS, EVENT) == bytes(range(64))
    assert field("host", EVENT_FIELDS, EVENT).rstrip(b"\0") == b"gpu-host"


# --- type and framing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["CIPA", VALID.decode("latin-1"), 273, 0, None, [1, 2], 1.5],
                         ids=["str", "str of handle", "int", "zero", "None", "list", "float"])
def test_wrong_type(value):
    err = rejected("must be bytes", IpcArrayHandle.from_bytes, value)
    assert type(value).__name__ in str(err)
    rejected("must be bytes", IpcEventHandle.from_bytes, value)


@pytest.mark.parametrize("length", [0, 1, 4, 6, ARRAY_HEADER - 1])
def test_too_short(length):
    rejected(f"array handle is {length} bytes; at least {ARRAY_HEADER} expected", IpcArrayHandle.from_bytes,
             VALID[:length])


@pytest.mark.parametrize("magic", [b"CIPE", b"cipa", b"\0\0\0\0", b"XIPA"])
def test_wrong_magic(magic):
    rejected("not a cupy_ipc array handle", IpcArrayHandle.from_bytes, patched(VALID, ARRAY_FIELDS, magic=magic))


def test_event_handle_is_not_an_array_handle():
    rejected("magic", IpcArrayHandle.from_bytes, EVENT + bytes(ARRAY_HEADER))
    rejected("magic", IpcEventHandle.from_bytes, VALID[:EVENT_RECORD])


@pytest.mark.parametrize("version", [0, VERSION + 1, 0xFFFF, 0x0100])
def test_wrong_version(version):
    rejected(f"format version {version}", IpcArrayHandle.from_bytes, patched(VALID, ARRAY_FIELDS, version=version))


@pytest.mark.parametrize("ndim", [65, 100, 255])
def test_ndim_over_64_from_bytes(ndim):
    data = with_dims(VALID, (1,) * ndim, (4,) * ndim)
    rejected(f"{ndim} dimensions; at most 64", IpcArrayHandle.from_bytes, data)
    # Even with a body too short for it: the count is checked before anything is read.
    rejected(f"{ndim} dimensions; at most 64", IpcArrayHandle.from_bytes, data[:ARRAY_HEADER])


def test_ndim_over_64_in_constructor():
    rejected("65 dimensions; at most 64", make, (1,) * 65, (4,) * 65)


@pytest.mark.parametrize("delta", [-16, -8, -1, 1, 8, 16, 1000])
def test_length_not_matching_ndim(delta):
    data = VALID + bytes(max(delta, 0)) if delta > 0 else VALID[:delta]
    rejected(f"array handle is {len(data)} bytes; {len(VALID)} expected for 2 dimensions",
             IpcArrayHandle.from_bytes, data)


def test_ndim_byte_not_matching_dims():
    rejected("expected for 1 dimensions", IpcArrayHandle.from_bytes, patched(VALID, ARRAY_FIELDS, ndim=1))
    rejected("expected for 3 dimensions", IpcArrayHandle.from_bytes, patched(VALID, ARRAY_FIELDS, ndim=3))


def test_shape_and_strides_of_different_lengths_in_constructor():
    rejected("shape has 2 dimensions but strides has 1", make, (4, 2), (8,))
    rejected("shape has 0 dimensions but strides has 1", make, (), (4,))


# --- dtypes -------------------------------------------------------------------------------------------------
UNSUPPORTED = {
    "object": object,
    "str": str,
    "U": "U4",
    "bytes": "S4",
    "structured": [("a", "<f4"), ("b", "<i4")],
    "void": "V8",
    "big-endian f4": ">f4",
    "big-endian i8": ">i8",
    "big-endian c16": ">c16",
    "datetime": "datetime64[ns]",
    "timedelta": "timedelta64[s]",
    "longdouble": np.longdouble,
    "subarray": ("<f4", (2,)),
}


@pytest.mark.parametrize("dtype", list(UNSUPPORTED.values()), ids=list(UNSUPPORTED))
def test_unsupported_dtype_in_constructor(dtype):
    rejected("cannot be shared", make, dtype=dtype)


@pytest.mark.parametrize("values, why", [
    (dict(offset="8"), "offset must be an integer, not str"),
    (dict(offset=4.7), "offset must be an integer, not float"),  # once truncated to 4
    (dict(allocation_size=float("inf")), "allocation_size must be an integer, not float"),
    (dict(shape=5), "shape must be a sequence of integers, not int"),
    (dict(shape="42"), "shape must be a sequence of integers, not str"),  # once read as (4, 2)
    (dict(strides=(8.0, 4)), "each item of strides must be an integer, not float"),
    (dict(device=(0,)), "device must be \\(ordinal, uuid\\), not 1 values"),
    (dict(device=("0", UUID)), "the device ordinal must be an integer, not str"),
    (dict(producer=(1, UUID, UUID)), "producer must be \\(pid, token, boot id, host\\), not 3 values"),
    (dict(memory_handle=64), "memory_handle must be bytes, not int"),  # once 64 zero bytes
    (dict(memory_handle="x" * 64), "memory_handle must be bytes, not str"),
    (dict(kind="nope"), "unknown memory kind nope"),
    (dict(kind=1.0), "kind must be an integer, not float"),
    (dict(more=[(1,)]), "each piece of more must have 2 items, not 1"),
    (dict(more=5), "more must be a sequence of \\(descriptor, size\\) pairs, not int"),
])
def test_a_handle_built_from_values_of_the_wrong_type_is_refused(values, why):
    fields = dict(memory_handle=MEMORY_HANDLE, offset=0, allocation_size=32, shape=(4, 2), strides=(8, 4),
                  dtype="float32", device=(0, UUID), producer=PRODUCER)
    rejected(why, IpcArrayHandle, **{**fields, **values})


def test_a_kind_may_be_given_by_its_name():
    assert make(kind="legacy") == make() and make((0,), (4,), kind="empty").kind == "empty"


def test_a_handle_without_a_dtype_is_refused():
    # NumPy reads None as float64: a handle describes memory, whose dtype is no default.
    rejected("needs a dtype, not None", make, dtype=None)


@pytest.mark.parametrize("dtype", ["float33", "not a dtype", 3.5, "M8[parsec]", ",", "9)Ib"])
def test_not_a_dtype_in_constructor(dtype):
    rejected("not a dtype", make, dtype=dtype)


@pytest.mark.parametrize("text", [b">f4", b">i4", b"|O", b"<U1", b"|S4", b"|V4", b"<M8", b"<m8", b"<f16"])
def test_unsupported_dtype_on_the_wire(text):
    rejected("cannot be shared", IpcArrayHandle.from_bytes, patched(VALID, ARRAY_FIELDS, dtype=text))


# "," and the like are dtype syntax to NumPy, which raises SyntaxError on them.
@pytest.mark.parametrize("text", [b"", b"zz", b"\x00<f4", b"(2)f", b"<f4x", b",", b"06e\n", b"9)Ib"])
def test_garbage_dtype_on_the_wire(text):
    rejected("not a dtype", IpcArrayHandle.from_bytes, patched(VALID, ARRAY_FIELDS, dtype=text))


@pytest.mark.parametrize("text", [b"\xff<f4", b"<f\xe94"])
def test_non_ascii_dtype_on_the_wire(text):
    rejected("is not text", IpcArrayHandle.from_bytes, patched(VALID, ARRAY_FIELDS, dtype=text))


# Spellings that numpy reads as a supported dtype but that to_bytes() never writes.
NON_CANONICAL_DTYPES = [b"f4", b"=f4", b"f", b"?", b"b1", b"b", b"i1", b"=i8", b"c8", b"e", b"int"]


@pytest.mark.parametrize("text", NON_CANONICAL_DTYPES)
def test_non_canonical_dtype_on_the_wire_is_rejected(text):
    """Only NumPy's dtype.str is read, so that one handle has one wire form."""
    dt = np.dtype(text.decode())
    assert dt.str.encode() != text and dt in DTYPES  # a supported dtype, spelled differently
    data = make((4, 2), (2 * dt.itemsize, dt.itemsize), dt, 0, 8 * dt.itemsize).to_bytes()
    rejected("not written as NumPy's dtype.str", IpcArrayHandle.from_bytes, patched(data, ARRAY_FIELDS, dtype=text))


@pytest.mark.parametrize("text", [b"a", b"a4"])
def test_deprecated_dtype_alias_on_the_wire_raises_only_handle_error(text):
    """numpy deprecates the 'a' alias; its DeprecationWarning must not escape from parsing."""
    rejected("not a dtype|cannot be shared", IpcArrayHandle.from_bytes, patched(VALID, ARRAY_FIELDS, dtype=text))


def test_dtype_of_leaves_the_warnings_filters_alone():
    # They are process-wide: changed while NumPy parses, another thread's warnings would be silenced or
    # turned into errors meanwhile. NumPy reads a spec's dtype attribute while it parses: the spec sees them then.
    from cupy_ipc._wire import dtype_of

    seen = []

    class Spec:
        @property
        def dtype(self):
            seen.append((warnings.filters, list(warnings.filters)))
            return np.dtype("float32")

    filters, before = warnings.filters, list(warnings.filters)
    assert dtype_of(Spec()) == np.float32
    assert seen and all(now is filters and content == before for now, content in seen)
    assert warnings.filters is filters and warnings.filters == before


@pytest.mark.parametrize("text", ["a", "a4", "<a4", "|a8", "2a4", "a4,f4", "f4,(2)i4", "<(2)f4,", b"a4"])
def test_dtype_text_numpy_would_warn_about_is_refused_without_a_warning(text):
    # numpy's deprecated alias "a" and its parenthesized single repeat count: never a shareable dtype.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rejected("not a dtype", make, dtype=text)
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("text", ["(" + "1 " * 100_000, b"(" + b"1 " * 100_000, "f" * 10_000],
                         ids=["text", "bytes", "no parenthesis"])
def test_long_dtype_text_is_refused_at_once(text):
    # An unclosed parenthesis then digits and spaces took time in the square of the text's length to look at
    # (1 s for 30,000 characters, 21 s for 120,000), and the refusal quoted all of it.
    import time

    start = time.monotonic()
    error = rejected("not a dtype that can be shared", make, dtype=text)
    assert time.monotonic() - start < 1.0 and len(str(error)) < 200


@pytest.mark.parametrize("change", [dict(shape=(True, 2)), dict(offset=False), dict(device=(True, UUID)),
                                    dict(allocation_size=True)], ids=["shape", "offset", "device", "size"])
def test_a_bool_is_not_taken_for_an_integer(change):
    # Values are taken as they are, never converted: True became 1 where an integer was due.
    rejected("must be an integer, not bool", lambda: make(**change))


def test_a_handle_cannot_be_made_again_in_place():
    # Calling __init__ on a made handle changed its fields, bytes and hash (a set lost it), and dropped the
    # descriptors that came with it without closing them.
    h = make()
    kept = {h}
    with pytest.raises(AttributeError, match="immutable"):
        h.__init__(memory_handle=MEMORY_HANDLE, offset=0, allocation_size=64, shape=(16,), strides=(4,),
                   dtype="float32", device=(0, UUID), producer=PRODUCER)
    assert h.shape == (4, 2) and h in kept and h.to_bytes() == VALID


# --- shape, alignment, extent -------------------------------------------------------------------------------
def test_negative_shape_from_bytes():
    rejected("negative extent", IpcArrayHandle.from_bytes, with_dims(VALID, (4, -2), (8, 4)))
    rejected("negative extent", IpcArrayHandle.from_bytes, with_dims(VALID, (-(2**63),), (4,)))


@pytest.mark.parametrize("shape", [(-1,), (4, -2), (-3, 0), (0, -1)])
def test_negative_shape_in_constructor(shape):
    rejected("negative extent", make, shape, (4,) * len(shape))


@pytest.mark.parametrize("dtype, offset", [("float32", 2), ("float64", 4), ("int16", 1), ("complex128", 12),
                                           ("complex64", 6), ("uint64", 7), ("complex128", 8),
                                           ("complex64", 4)])
def test_misaligned_offset(dtype, offset):
    rejected(f"offset {offset} or strides .* not aligned", make, (2,), (np.dtype(dtype).itemsize,), dtype,
             offset, 4096)


def test_misaligned_offset_from_bytes():
    data = patched(VALID, ARRAY_FIELDS, offset=2, allocation_size=64)
    rejected("not aligned to the 4-byte alignment of float32", IpcArrayHandle.from_bytes, data)


@pytest.mark.parametrize("dtype, strides", [("float32", (8, 2)), ("float64", (12, 8)), ("int16", (3, 2)),
                                            ("complex128", (-4, 16)), ("float32", (4, -6)),
                                            ("complex128", (16, 24)), ("complex64", (8, 12))])
def test_misaligned_stride(dtype, strides):
    rejected("not aligned", make, (2, 2), strides, dtype, 64, 4096)


def test_misaligned_stride_from_bytes():
    rejected("not aligned", IpcArrayHandle.from_bytes, with_dims(VALID, (4, 2), (8, 5)))


def test_stride_of_a_size_one_dimension_is_not_checked():
    # Only index 0 is ever multiplied by it, so any value is safe; numpy and CuPy may leave any value there.
    assert make((1, 2), (3, 4)).strides == (3, 4)
    assert make((1,), (-(2**63),), allocation_size=4).strides == (-(2**63),)


@pytest.mark.parametrize("shape, strides, offset, allocation_size", [
    ((4, 2), (8, 4), 0, 31),  # one byte short
    ((4, 2), (8, 4), 4, 32),  # shifted past the end
    ((8,), (4,), 2**64 - 4, 2**64 - 1),  # near the top of u64: no wraparound
    ((2, 3), (4, 8), 0, 23),  # F-order
    ((1000, 1000), (0, 4), 0, 3996),  # a broadcast view still needs its last row
])
def test_extent_beyond_allocation_positive_strides(shape, strides, offset, allocation_size):
    rejected("outside the .*-byte allocation", make, shape, strides, "float32", offset, allocation_size)


@pytest.mark.parametrize("shape, strides, offset, allocation_size", [
    ((3,), (-8,), 8, 64),  # reaches back to byte -8
    ((3,), (-8,), 12, 64),  # reaches back to byte -4
    ((3, 4), (-16, -4), 43, 48),
    ((3, 4), (16, -4), 8, 48),
    ((2,), (-(2**62),), 2**62 - 4, 2**64 - 1),
])
def test_extent_beyond_allocation_negative_strides(shape, strides, offset, allocation_size):
    rejected("outside the .*-byte allocation", make, shape, strides, "int32" if offset % 4 == 0 else "int8",
             offset, allocation_size)


def test_extent_boundaries_are_exact():
    # Exactly fitting layouts pass, one byte less fails: the check is neither loose nor off by one.
    assert make((3,), (-8,), "float64", 16, 24)
    rejected("outside", make, (3,), (-8,), "float64", 16, 23)
    assert make((4, 2), (8, 4), "float32", 0, 32)
    rejected("outside", make, (4, 2), (8, 4), "float32", 8, 39)
    assert make((3, 4), (16, -4), "float32", 12, 48)
    rejected("outside", make, (3, 4), (16, -4), "float32", 8, 48)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 4), st.integers(-24, 24)), min_size=1, max_size=3),
    st.sampled_from(["int8", "int16", "float32", "float64", "complex64", "complex128"]),
    st.integers(0, 160), st.integers(0, 200),
)
def test_layout_check_agrees_with_every_element_reached(dims, dtype, offset, allocation_size):
    # The one-pass check against the layout spelled out element by element: accepted exactly when every
    # element's bytes lie inside the allocation and every offset a step reaches is aligned to the dtype.
    from cupy_ipc._wire import byte_extent

    shape = tuple(n for n, _ in dims)
    strides = tuple(step for _, step in dims)
    dt = np.dtype(dtype)
    starts = [offset + sum(i * step for i, step in zip(index, strides))
              for index in itertools.product(*(range(n) for n in shape))]
    fits = min(starts) >= 0 and max(starts) + dt.itemsize <= allocation_size
    align = dt.itemsize if dt.kind == "c" else dt.alignment  # a complex element is read whole
    aligned = all(start % align == 0 for start in starts)
    assert byte_extent(shape, strides, dt.itemsize) == (min(starts) - offset, max(starts) - offset + dt.itemsize)
    try:
        make(shape, strides, dtype, offset, allocation_size)
    except HandleError:
        assert not (fits and aligned)
    else:
        assert fits and aligned


def test_extent_beyond_allocation_from_bytes():
    rejected("outside the 31-byte allocation", IpcArrayHandle.from_bytes,
             patched(VALID, ARRAY_FIELDS, allocation_size=31))
    rejected("reaches bytes \\[-24, 8\\)", IpcArrayHandle.from_bytes, with_dims(VALID, (4, 2), (-8, 4)))


@pytest.mark.parametrize("offset, allocation_size", [(-4, 32), (0, -1), (-1, -1)])
def test_negative_offset_or_size_in_constructor(offset, allocation_size):
    rejected("must not be negative", make, offset=offset, allocation_size=allocation_size)


TOO_MANY = "more than the 9223372036854775807 \\(2\\*\\*63 - 1\\) bytes an array can hold"


@pytest.mark.parametrize("shape, strides, dtype", [
    ((2**62, 2), (0, 0), "int8"),  # 2**63 one-byte elements, all at one byte
    ((2**61,), (0,), "float64"),  # 2**61 elements, 2**64 bytes
    ((2**32, 2**32, 2**32), (0, 0, 0), "int8"),  # each extent small, their product not
    ((2**42, 2**20), (0, 4), "float32"),  # a broadcast row
    ((2**33, 2**33), (4, 4), "float32"),  # overlapping strides
    ((3, 3074457345618258603), (0, 0), "int8"),  # 2**63 + 1 bytes: one over
])
def test_more_elements_than_an_array_can_hold(shape, strides, dtype):
    # NumPy and CuPy count elements and bytes in a signed 64-bit integer: such a shape would overflow it,
    # though the bytes its strides reach fit the allocation.
    rejected(TOO_MANY, make, shape, strides, dtype, 0, 2**36)
    data = with_dims(patched(VALID, ARRAY_FIELDS, dtype=np.dtype(dtype).str.encode(), allocation_size=2**36),
                     shape, strides)
    rejected(TOO_MANY, IpcArrayHandle.from_bytes, data)


@pytest.mark.parametrize("shape", [(0, 2**62, 2**62), (2**62, 0, 2), (0, 2**63 - 1, 2)])
def test_an_empty_shape_is_bounded_by_its_other_extents(shape):
    # As NumPy does: CuPy would compute the strides of such an empty array from those extents, past 2**63.
    rejected(TOO_MANY, make, shape, (0,) * len(shape), "int8", kind=Kind.EMPTY)
    data = with_dims(patched(VALID, ARRAY_FIELDS, kind=Kind.EMPTY, dtype=b"|i1"), shape, (0,) * len(shape))
    rejected(TOO_MANY, IpcArrayHandle.from_bytes, data)
    fitting = make((0, 2**63 - 1), (0, 0), "int8", kind=Kind.EMPTY)  # what NumPy allows: np.empty((0, 2**63 - 1))
    assert IpcArrayHandle.from_bytes(fitting.to_bytes()) == fitting


def test_element_count_boundary_is_exact():
    h = make((2**63 - 1,), (0,), "int8", 0, 1)  # 2**63 - 1 bytes in all: the most there may be
    assert IpcArrayHandle.from_bytes(h.to_bytes()) == h
    assert make((3, 3074457345618258602), (0, 0), "int8", 0, 1)  # 2**63 - 2 bytes
    rejected(TOO_MANY, make, (2**62,), (0,), "int16", 0, 2)  # 2**63 bytes


BEYOND = "beyond the first 9223372036854775807 \\(2\\*\\*63 - 1\\) an array can address"


@pytest.mark.parametrize("shape, strides, offset", [
    ((2,), (2**63 - 1,), 0),  # the second element is byte 2**63 of the allocation
    ((1,), (1,), 2**63 - 1),  # one past the element is byte 2**63
    ((2,), (-(2**62),), 2**63 - 1),  # reaching backwards from there
])
def test_reach_beyond_what_an_array_can_address(shape, strides, offset):
    # Inside the claimed allocation, but past what CuPy's signed 64-bit offsets and strides can reach.
    rejected(BEYOND, make, shape, strides, "int8", offset, 2**64 - 1)
    data = with_dims(patched(VALID, ARRAY_FIELDS, dtype=b"|i1", offset=offset, allocation_size=2**64 - 1),
                     shape, strides)
    rejected(BEYOND, IpcArrayHandle.from_bytes, data)


def test_reach_boundary_is_exact():
    assert make((2,), (2**63 - 2,), "int8", 0, 2**64 - 1)
    assert make((1,), (1,), "int8", 2**63 - 2, 2**64 - 1)
    rejected(BEYOND, make, (1,), (1,), "int8", 2**63 - 1, 2**64 - 1)


# --- kinds --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0,), (4, 0), (0, 0)])
def test_size_zero_shape_with_legacy_kind(shape):
    rejected("has no elements, so the handle kind must be empty", make, shape, (4,) * len(shape))
    rejected("must be empty", IpcArrayHandle.from_bytes, with_dims(VALID, shape, (4,) * len(shape)))


@pytest.mark.parametrize("shape", [(), (1,), (4, 2)])
def test_empty_kind_with_nonzero_size(shape):
    rejected("empty handle must have a size-0 shape", make, shape, (4,) * len(shape), kind=Kind.EMPTY)
    data = with_dims(patched(VALID, ARRAY_FIELDS, kind=Kind.EMPTY), shape, (4,) * len(shape))
    rejected("empty handle must have a size-0 shape", IpcArrayHandle.from_bytes, data)


@pytest.mark.parametrize("kind", [3, 7, 128, 254])
def test_unknown_kind_byte(kind):
    rejected(f"unknown memory kind {kind}", IpcArrayHandle.from_bytes, patched(VALID, ARRAY_FIELDS, kind=kind))
    rejected(f"unknown memory kind {kind}", make, kind=kind)


def make_pool(fd=7, resource=3, kind=Kind.POOL, more=()):
    return IpcArrayHandle(memory_handle=MEMORY_HANDLE, offset=0, allocation_size=32, shape=(4, 2), strides=(8, 4),
                          dtype="float32", device=(0, UUID), producer=PRODUCER, kind=kind, fd=fd,
                          resource=resource, more=more)


@pytest.mark.parametrize("kind,name", [(Kind.POOL, "pool"), (Kind.VMM, "vmm")])
def test_descriptor_kinds_carry_their_descriptor_record(kind, name):
    h = make_pool(kind=kind)
    data = h.to_bytes()
    assert len(data) == len(VALID) + 16 and h.kind == name
    got = IpcArrayHandle.from_bytes(data)
    assert got == h and (got._f.fd, got._f.resource, got._f.more) == (7, 3, ())


def test_pool_handle_without_or_with_a_bad_descriptor_record_is_refused():
    data = make_pool().to_bytes()
    rejected("321 expected for 2 dimensions", IpcArrayHandle.from_bytes, data[:-16])
    rejected("321 expected", IpcArrayHandle.from_bytes, patched(VALID, ARRAY_FIELDS, kind=Kind.POOL))
    rejected("337 expected", IpcArrayHandle.from_bytes, data[:-12] + b"\1" + data[-11:])  # a piece announced
    rejected("needs the producer's descriptor", make_pool, fd=-1)
    rejected("needs the producer's descriptor", make_pool, resource=0)
    rejected("descriptor .* does not fit", make_pool, fd=1 << 31)


def test_virtual_memory_in_pieces_round_trips_and_bad_pieces_are_refused():
    h = make_pool(kind=Kind.VMM, more=((8, 8), (9, 8)))
    data = h.to_bytes()
    assert len(data) == len(VALID) + 48 and IpcArrayHandle.from_bytes(data)._f.more == ((8, 8), (9, 8))
    rejected("353 expected", IpcArrayHandle.from_bytes, data[:-16])
    rejected("only virtual memory comes in pieces", make_pool, more=((8, 8),))
    rejected("do not fit the allocation size", make_pool, kind=Kind.VMM, more=((8, 32),))
    rejected("do not fit the allocation size", make_pool, kind=Kind.VMM, more=((-1, 8),))
    rejected("reserved bytes of a piece record", IpcArrayHandle.from_bytes, data[:-12] + b"\1" + data[-11:])


# --- a layout parsed before: each new allocation and export is checked as in a first handle ------------------
def parsed_fresh(data):
    """``from_bytes(data)`` as a first handle of its layout would parse (or the HandleError it raises)."""
    from cupy_ipc import _wire

    _wire._layouts.clear()
    _wire._resent.clear()
    try:
        return IpcArrayHandle.from_bytes(data)
    except HandleError as e:
        return str(e)


def parsed_known(data, known):
    """``from_bytes(data)`` right after ``known``, a handle of the same layout, was parsed."""
    IpcArrayHandle.from_bytes(known)
    try:
        return IpcArrayHandle.from_bytes(data)
    except HandleError as e:
        return str(e)


@pytest.mark.parametrize("values", [
    {"offset": 2, "allocation_size": 64},  # misaligned
    {"allocation_size": 31},  # one byte short
    {"offset": 4},  # shifted past the end
    {"offset": 2**64 - 4, "allocation_size": 2**64 - 1},  # no wraparound
    {"offset": 2**63, "allocation_size": 2**64 - 1},  # inside the allocation, beyond what an array can address
    {"offset": 32, "allocation_size": 64, "base_ptr": 7, "buffer_id": 9, "flags": 3, "export_id": 5, "slot": 2},
])
def test_a_known_layout_checks_each_allocation_as_a_first_handle(values):
    data = patched(VALID, ARRAY_FIELDS, **values)
    got = parsed_known(data, VALID)
    assert got == parsed_fresh(data)
    if "flags" in values:  # accepted, with this handle's own allocation and export fields
        assert (got._f.offset, got._f.base_ptr, got._f.export_id, got.keepalive) == (32, 7, 5, True)


def test_a_known_layout_reaching_backwards_checks_each_allocation():
    known = with_dims(patched(VALID, ARRAY_FIELDS, offset=16, allocation_size=24), (3,), (-8,))
    assert IpcArrayHandle.from_bytes(known).offset == 16
    for offset, size in ((8, 24), (16, 19), (12, 64), (20, 28)):
        data = with_dims(patched(VALID, ARRAY_FIELDS, offset=offset, allocation_size=size), (3,), (-8,))
        assert parsed_known(data, known) == parsed_fresh(data)
    assert isinstance(parsed_known(data, known), IpcArrayHandle)  # (20, 28) fits


def test_a_known_layout_in_pieces_checks_each_allocation_size():
    known = IpcArrayHandle(memory_handle=MEMORY_HANDLE, offset=0, allocation_size=64, shape=(4, 2), strides=(8, 4),
                           dtype="float32", device=(0, UUID), producer=PRODUCER, kind=Kind.VMM, fd=7, resource=3,
                           more=((8, 20), (9, 20))).to_bytes()
    for size in (41, 40, 32):  # the array's 32 bytes fit each, the further pieces' 40 leave no first piece in two
        data = patched(known, ARRAY_FIELDS, allocation_size=size)
        got = parsed_known(data, known)
        assert got == parsed_fresh(data)
        assert isinstance(got, IpcArrayHandle) is (size == 41)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(1, 4), st.integers(-24, 24)), min_size=1, max_size=3),
    st.sampled_from(["int8", "int16", "float32", "float64", "complex64", "complex128"]),
    st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 255),
)
def test_a_known_layout_parses_any_allocation_as_a_first_handle(dims, dtype, offset, allocation_size, flags):
    # The first handle of a layout, a valid one, makes it known; any other allocation and flags must then
    # give what a first handle gives: the same handle, or the same refusal.
    from cupy_ipc._wire import byte_extent

    shape = tuple(n for n, _ in dims)
    strides = tuple(step for _, step in dims)
    itemsize = np.dtype(dtype).itemsize
    lo, hi = byte_extent(shape, strides, itemsize)
    first = -lo + (-lo) % 16  # far enough in, and aligned for every dtype
    try:
        known = make(shape, strides, dtype, first, first + hi).to_bytes()
    except HandleError:
        return  # a misaligned stride: no layout to know
    data = patched(known, ARRAY_FIELDS, offset=offset, allocation_size=allocation_size, flags=flags)
    assert parsed_known(data, known) == parsed_fresh(data)


# --- lengths of the byte fields in the constructor ----------------------------------------------------------
@pytest.mark.parametrize("length", [0, 16, 63, 65, 128])
def test_memory_handle_of_wrong_length(length):
    rejected("must be 64 bytes", make, memory_handle=bytes(length))


@pytest.mark.parametrize("length", [0, 15, 17, 32])
def test_device_uuid_of_wrong_length(length):
    rejected("UUID must be 16 bytes", make, device=(0, bytes(length)))


@pytest.mark.parametrize("field", ["token", "boot_id"])
@pytest.mark.parametrize("length", [0, 15, 17])
def test_producer_ids_of_wrong_length(field, length):
    """The wire keeps 16 bytes of token and boot id; a cut token would name another producer."""
    pid, token, boot, host = PRODUCER
    producer = (pid, bytes(length), boot, host) if field == "token" else (pid, token, bytes(length), host)
    rejected("must be 16 bytes", IpcArrayHandle, memory_handle=MEMORY_HANDLE, offset=0, allocation_size=32,
             shape=(4, 2), strides=(8, 4), dtype="float32", device=(0, UUID), producer=producer)


@pytest.mark.parametrize("host", ["h" * 33, "ü" * 17, "gpu-host\0", "x" * 31 + "é"],
                         ids=["33 bytes", "34 UTF-8 bytes", "trailing NUL", "cut inside a character"])
def test_host_that_the_wire_cannot_keep(host):
    """The wire keeps 32 UTF-8 bytes of host name, without trailing NULs."""
    rejected("host name", IpcArrayHandle, memory_handle=MEMORY_HANDLE, offset=0, allocation_size=32, shape=(4, 2),
             strides=(8, 4), dtype="float32", device=(0, UUID), producer=(1, TOKEN, BOOT_ID, host))


OUT_OF_RANGE = {
    "offset 2**64": dict(offset=2**64, allocation_size=2**64 + 32),
    "allocation 2**64": dict(allocation_size=2**64),
    "extent 2**63": dict(shape=(2**63,), strides=(0,)),
    "stride 2**63": dict(shape=(1,), strides=(2**63,)),
    "stride -2**63-1": dict(shape=(1,), strides=(-(2**63) - 1,)),
    "device ordinal 2**31": dict(device=(2**31, UUID)),
    "device ordinal -2**31-1": dict(device=(-(2**31) - 1, UUID)),
    "pid 2**31": dict(producer=(2**31, TOKEN, BOOT_ID, "h")),
}


@pytest.mark.parametrize("change", list(OUT_OF_RANGE.values()), ids=list(OUT_OF_RANGE))
def test_integers_that_do_not_fit_the_wire(change):
    """Refused at construction, not later by to_bytes() with a struct.error."""
    kwargs = dict(memory_handle=MEMORY_HANDLE, offset=0, allocation_size=32, shape=(4, 2), strides=(8, 4),
                  dtype="float32", device=(0, UUID), producer=PRODUCER)
    rejected("does not fit the wire format", IpcArrayHandle, **{**kwargs, **change})


# Integers too long for str() (Python refuses past 4300 digits): once the refusal's own message raised a plain
# ValueError about integer string conversion, naming no field.
HUGE = 10**5000


@pytest.mark.parametrize("change, field", [
    (dict(offset=HUGE), "offset"),
    (dict(allocation_size=HUGE), "allocation size"),
    (dict(shape=(HUGE, 2)), "extent"),
    (dict(shape=(-HUGE, 2)), "extent"),
    (dict(strides=(-HUGE, 4)), "stride"),
    (dict(device=(HUGE, UUID)), "device ordinal"),
    (dict(producer=(-HUGE, TOKEN, BOOT_ID, "h")), "producer pid"),
    (dict(kind=HUGE), "unknown memory kind"),
    (dict(fd=HUGE), "descriptor"),
    (dict(resource=HUGE), "resource id"),
    (dict(kind="vmm", fd=3, resource=1, more=[(3, HUGE)]), "piece size"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_integers_too_long_to_print_are_refused_by_name(change, field):
    kwargs = dict(memory_handle=MEMORY_HANDLE, offset=0, allocation_size=32, shape=(4, 2), strides=(8, 4),
                  dtype="float32", device=(0, UUID), producer=PRODUCER)
    error = rejected(field, IpcArrayHandle, **{**kwargs, **change})
    assert "16610 bits" in str(error) and len(str(error)) < 200


def test_host_that_is_not_utf8_on_the_wire():
    """Decoding with replacement characters would change the bytes on the next to_bytes()."""
    start, _ = fields_of("host")
    buf = bytearray(VALID)
    buf[start] = 0xFF
    rejected("not valid UTF-8", IpcArrayHandle.from_bytes, bytes(buf))


@pytest.mark.parametrize("change", [dict(device=(0, "u" * 16)), dict(producer=(1, "t" * 16, BOOT_ID, "h")),
                                    dict(producer=(1, TOKEN, bytearray(BOOT_ID), "h")),
                                    dict(producer=(1, TOKEN, BOOT_ID, b"h"))],
                         ids=["text UUID", "text token", "bytearray boot id", "bytes host"])
def test_origin_fields_of_other_types_are_refused_by_the_constructor(change):
    """Accepted, they would fail later, in to_bytes(), with a struct.error."""
    kwargs = dict(memory_handle=MEMORY_HANDLE, offset=0, allocation_size=32, shape=(4, 2), strides=(8, 4),
                  dtype="float32", device=(0, UUID), producer=PRODUCER)
    rejected("must be int", IpcArrayHandle, **{**kwargs, **change})


@pytest.mark.parametrize("change", [dict(fd=7), dict(resource=5),
                                    dict(kind=Kind.EMPTY, shape=(0,), strides=(4,), fd=3, resource=1),
                                    dict(kind=Kind.EMPTY, shape=(0,), strides=(4,), more=[(3, 10)])],
                         ids=["legacy with a descriptor", "legacy with a resource id", "empty with both",
                              "empty in pieces"])
def test_descriptor_fields_on_a_kind_shared_without_one_are_refused(change):
    """The wire carries them only for memory shared by descriptor: accepted, they would be lost in a round trip."""
    kwargs = dict(memory_handle=MEMORY_HANDLE, offset=0, allocation_size=32, shape=(4, 2), strides=(8, 4),
                  dtype="float32", device=(0, UUID), producer=PRODUCER)
    rejected("carry no descriptor", IpcArrayHandle, **{**kwargs, **change})


def test_the_bytes_checked_are_the_bytes_kept():
    """A bytes subclass may say other bytes when asked again (``__bytes__``), a bytearray may change: what a
    handle sends on must be what was parsed and checked."""
    larger = make(shape=(8, 2), allocation_size=64).to_bytes()

    class Shifty(bytes):
        def __bytes__(self):
            return larger

    for data in (Shifty(VALID), bytearray(VALID), memoryview(VALID)):
        h = IpcArrayHandle.from_bytes(data)
        assert h.to_bytes() == VALID and type(h.to_bytes()) is bytes
        assert h.shape == (4, 2)


def test_released_memoryview_raises_handle_error():
    """bytes() of a released memoryview raises ValueError; that too becomes a HandleError."""
    view = memoryview(VALID)
    view.release()
    with pytest.raises(HandleError):
        IpcArrayHandle.from_bytes(view)


# --- event handles ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [0, 4, 6, EVENT_RECORD - 1])
def test_event_too_short(length):
    rejected(f"event handle is {length} bytes; at least {EVENT_RECORD} expected", IpcEventHandle.from_bytes,
             EVENT[:length])


@pytest.mark.parametrize("extra", [1, 4, 16, ARRAY_HEADER])
def test_event_too_long(extra):
    rejected(f"event handle is {EVENT_RECORD + extra} bytes; {EVENT_RECORD} expected", IpcEventHandle.from_bytes,
             EVENT + bytes(extra))


@pytest.mark.parametrize("magic", [b"CIPA", b"cipe", b"\0\0\0\0"])
def test_event_wrong_magic(magic):
    rejected("not a cupy_ipc event handle", IpcEventHandle.from_bytes, patched(EVENT, EVENT_FIELDS, magic=magic))


@pytest.mark.parametrize("version", [0, VERSION + 1, 0xFFFF])
def test_event_wrong_version(version):
    rejected(f"event handle format version {version}", IpcEventHandle.from_bytes,
             patched(EVENT, EVENT_FIELDS, version=version))


@pytest.mark.parametrize("flag", [2, 3, 128, 255])
def test_event_flag_byte(flag):
    rejected(f"event flags byte {flag} is not 0 or 1", IpcEventHandle.from_bytes,
             patched(EVENT, EVENT_FIELDS, block=flag))


@pytest.mark.parametrize("value", [1, 255])
def test_event_reserved_byte_is_rejected(value):
    """The reserved byte must be zero, so that an event handle has one wire form."""
    rejected("reserved byte", IpcEventHandle.from_bytes, patched(EVENT, EVENT_FIELDS, reserved=value))


@pytest.mark.parametrize("pair", [257, 2**32 - 1])
def test_event_pair_of_words_past_the_producers_is_rejected(pair):
    """A producer's segment has 256 pairs of words for events: a handle naming another is no handle of it."""
    rejected(f"pair of words {pair}; at most 256", IpcEventHandle.from_bytes, patched(EVENT, EVENT_FIELDS, pair=pair))


def test_event_pairs_are_as_many_as_a_segment_has():
    from cupy_ipc import _wire, _words

    assert _wire._EVENT_PAIRS == _words.PAIRS == 256


@pytest.mark.parametrize("pair", [0, 1, 256])
def test_event_pair_round_trips(pair):
    data = patched(EVENT, EVENT_FIELDS, pair=pair)
    h = IpcEventHandle.from_bytes(data)
    assert h._f.pair == pair and h.to_bytes() == data


def test_event_host_that_is_not_utf8():
    """As for array handles."""
    start, _ = fields_of("host", EVENT_FIELDS)
    buf = bytearray(EVENT)
    buf[start + 1] = 0xC3  # a lead byte followed by ASCII
    rejected("not valid UTF-8", IpcEventHandle.from_bytes, bytes(buf))


# --- properties: only HandleError escapes, and anything accepted round trips exactly ------------------------
# Each property is a @given function run by a plain test. As a test itself, a failing one makes
# Hypothesis's pytest plugin import libcst to write an @example patch under .hypothesis/patches, and
# libcst's import-time DeprecationWarning, an error under this project's filterwarnings, aborts the
# whole session with INTERNALERROR. Run this way, a failure is reported like any other.
# database=None: nothing is written under .hypothesis/examples; print_blob: a failure can be replayed anyway.
FUZZ = settings(max_examples=400, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow])

seen = collections.Counter()


def note(result):
    seen["accepted" if result is not None else "rejected"] += 1
    return result


def run(check, *, min_accepted=20, min_rejected=20):
    seen.clear()
    check()
    # A property that saw only rejections (or only acceptances) tested half of itself.
    assert seen["accepted"] >= min_accepted and seen["rejected"] >= min_rejected, seen


ARRAY_PREFIX = b"CIPA" + struct.pack("<H", VERSION)
EVENT_PREFIX = b"CIPE" + struct.pack("<H", VERSION)

valid_handles = st.sampled_from([
    VALID,
    make((), (), "complex128", 16, 32).to_bytes(),
    make((5,), (-2,), "float16", 8, 10).to_bytes(),
    make((3, 0), (4, 4), kind=Kind.EMPTY).to_bytes(),
    make((1,) * 64, (8,) * 64, "int64", 8, 16).to_bytes(),
])
valid_events = st.sampled_from([EVENT, pack_event(EventFields(bytes(64), False, DeviceId(0, bytes(16)),
                                                              Producer(1, bytes(16), bytes(16), "")))])

edits = st.lists(st.one_of(
    st.tuples(st.just("set"), st.integers(0, 2**16), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 2**16)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64)),
), min_size=1, max_size=6)


def mutate(data, ops):
    buf = bytearray(data)
    for op in ops:
        if op[0] == "set" and buf:
            buf[op[1] % len(buf)] = op[2]
        elif op[0] == "truncate":
            del buf[op[1] % (len(buf) + 1):]
        elif op[0] == "extend":
            buf += op[1]
    return bytes(buf)


@FUZZ
@given(st.one_of(st.binary(max_size=1500), st.binary(max_size=1500).map(ARRAY_PREFIX.__add__)))
def check_array_arbitrary_bytes(data):
    note(accepted_or_round_trips(data))


def test_fuzz_array_arbitrary_bytes():
    run(check_array_arbitrary_bytes, min_accepted=0)  # random bytes are practically never a valid handle


@FUZZ
@given(st.one_of(st.binary(max_size=400), st.binary(min_size=EVENT_RECORD - 6, max_size=EVENT_RECORD - 6)
                 .map(EVENT_PREFIX.__add__)))
def check_event_arbitrary_bytes(data):
    note(event_accepted_or_round_trips(data))


def test_fuzz_event_arbitrary_bytes():
    """Fails on the event reserved-byte and host bugs above."""
    run(check_event_arbitrary_bytes, min_accepted=0)


@FUZZ
@given(valid_handles, edits)
def check_array_mutations(data, ops):
    note(accepted_or_round_trips(mutate(data, ops)))


def test_fuzz_array_mutations():
    """Byte edits, truncations and extensions of valid handles. Fails on the host and dtype bugs above."""
    run(check_array_mutations, min_accepted=5)  # most edits break a handle; some hit fields left free


@FUZZ
@given(valid_events, edits)
def check_event_mutations(data, ops):
    note(event_accepted_or_round_trips(mutate(data, ops)))


def test_fuzz_event_mutations():
    """Fails on the event reserved-byte and host bugs above."""
    run(check_event_mutations, min_accepted=5)


@FUZZ
@given(valid_handles, edits)
def check_array_mutations_wrapped(data, ops):
    data = mutate(data, ops)
    results = []
    for wrapped in (bytearray(data), memoryview(data)):
        try:
            results.append(IpcArrayHandle.from_bytes(wrapped))
        except HandleError:
            results.append(None)
    assert results[0] == results[1]
    note(results[0])


def test_fuzz_array_mutations_as_bytearray_and_memoryview():
    run(check_array_mutations_wrapped, min_accepted=5)


# Wire headers built field by field, spelling every field the way to_bytes() would, so that the only
# way to be rejected is validation itself. The verdict is checked against a brute-force reference.
CANONICAL_DTYPES = [np.dtype(t).str for t in DTYPES]
BAD_DTYPES = [">f4", ">i8", "|O", "<U1", "|S2", "|V4", "<M8", "<m8", "zz", "", "<f16"]


def reference_verdict(kind, flags, dtype_text, shape, strides, offset, allocation_size):
    """Whether a handle is safe, computed without cupy_ipc: by visiting every element."""
    if flags & ~7:  # only the keep-alive, event and word bits are defined
        return False
    if kind not in (Kind.LEGACY, Kind.EMPTY) or dtype_text not in CANONICAL_DTYPES or len(shape) > 64:
        return False
    if any(n < 0 for n in shape):
        return False
    if kind == Kind.EMPTY or 0 in shape:
        return kind == Kind.EMPTY and 0 in shape
    dt = np.dtype(dtype_text)
    align = dt.itemsize if dt.kind == "c" else dt.alignment  # a complex element is read whole, as CuPy's kernels do
    if offset % align or any(s % align for n, s in zip(shape, strides) if n > 1):
        return False
    starts = [offset + sum(i * s for i, s in zip(index, strides)) for index in itertools.product(*map(range, shape))]
    return min(starts) >= 0 and max(starts) + dt.itemsize <= allocation_size


@st.composite
def wire_headers(draw):
    # Weighted towards valid values, so that about half the headers pass and both verdicts are tested.
    dtype_text = draw(st.sampled_from(CANONICAL_DTYPES * 4 + BAD_DTYPES))
    itemsize = np.dtype(dtype_text).itemsize if dtype_text in CANONICAL_DTYPES else 4
    if draw(st.integers(0, 4)):
        ndim = draw(st.integers(0, 4))
        shape = draw(st.lists(st.integers(0, 4) | st.integers(-1, 4), min_size=ndim, max_size=ndim))
    else:  # around the dimension limit; size 1 keeps the reference cheap
        ndim = draw(st.integers(62, 67))
        shape = [1] * ndim
    fitting_kind = Kind.EMPTY if 0 in shape else Kind.LEGACY
    kind = draw(st.sampled_from([fitting_kind] * 4 + [Kind.LEGACY, Kind.EMPTY, None]))
    if kind is None:
        kind = draw(st.integers(0, 255))
    unit = draw(st.sampled_from([itemsize] * 5 + [1, 2, 3]))
    strides = [unit * draw(st.integers(-8, 8)) for _ in shape]
    offset = draw(st.integers(0, 64)) * draw(st.sampled_from([itemsize] * 5 + [1]))
    allocation_size = draw(st.integers(0, 4096) | st.integers(0, 128))
    host = draw(st.text(string.ascii_letters + string.digits + "-.", max_size=32)).encode()
    values = dict(kind=kind, dtype=dtype_text.encode(), offset=offset, allocation_size=allocation_size, host=host,
                  flags=draw(st.sampled_from([0, 1, 2, 3, 7] * 8) | st.integers(0, 255)),
                  base_ptr=draw(st.integers(0, 2**64 - 1)),
                  export_id=draw(st.integers(0, 2**64 - 1)), slot=draw(st.integers(0, 2**32 - 1)),
                  pid=draw(st.integers(-(2**31), 2**31 - 1)), ordinal=draw(st.integers(-(2**31), 2**31 - 1)),
                  uuid=draw(st.binary(min_size=16, max_size=16)),
                  event_handle=draw(st.binary(min_size=64, max_size=64)))
    data = with_dims(patched(VALID, ARRAY_FIELDS, **values), shape, strides)
    return data, (kind, values["flags"], dtype_text, tuple(shape), tuple(strides), offset, allocation_size)


@FUZZ
@given(wire_headers())
def check_structured_headers(case):
    data, args = case
    h = note(accepted_or_round_trips(data))
    assert (h is not None) == reference_verdict(*args), args


def test_fuzz_structured_headers_against_reference():
    run(check_structured_headers)


# Field values for the constructor: a valid set with any subset of fields replaced. All are well typed
# (ints, bytes, str, dtypes), so int() and bytes() cannot fail on them and only HandleError may escape.
BASE_FIELDS = dict(memory_handle=MEMORY_HANDLE, offset=0, allocation_size=32, dims=((4, 2), (8, 4)), dtype="float32",
                   device=(0, UUID), producer=PRODUCER, kind=Kind.LEGACY)


def field_values(ints, signed64, unsigned64, int32, id16, host):
    dims = st.integers(0, 4).flatmap(lambda n: st.tuples(
        st.lists(st.integers(-1, 4) | signed64, min_size=n, max_size=n),
        st.lists(st.integers(-6, 6).map(lambda k: 4 * k) | signed64, min_size=n, max_size=n)
        | st.lists(st.integers(-6, 6).map(lambda k: 4 * k), min_size=n, max_size=n + 1),
    ))
    return st.fixed_dictionaries({}, optional=dict(
        dims=dims,
        dtype=st.sampled_from(DTYPES + list(UNSUPPORTED.values())),
        offset=st.integers(-8, 64) | unsigned64 | ints,
        allocation_size=st.integers(-8, 256) | unsigned64 | ints,
        kind=st.sampled_from([Kind.LEGACY, Kind.EMPTY]) | st.integers(0, 255) | ints,
        memory_handle=st.binary(min_size=60, max_size=68),
        device=st.tuples(int32, st.binary(min_size=16, max_size=16) | st.binary(min_size=14, max_size=18)),
        producer=st.tuples(int32, id16, id16, host),
    )).map(lambda changes: {**BASE_FIELDS, **changes})


def construct(fields):
    fields = dict(fields)  # the drawn value is printed on failure: leave it as drawn
    shape, strides = fields.pop("dims")
    return note(constructed_or_round_trips(shape=shape, strides=strides, **fields))


# Values every wire field can hold; the constructor must reject the unsafe ones itself.
IN_RANGE = field_values(
    ints=st.integers(-(2**31), 2**31 - 1),
    signed64=st.integers(-(2**63), 2**63 - 1),
    unsigned64=st.integers(0, 2**64 - 1),
    int32=st.integers(-(2**31), 2**31 - 1),
    id16=st.binary(min_size=16, max_size=16),
    host=st.one_of(st.text(max_size=8), st.text(string.printable, max_size=32))
    .filter(lambda s: not s.endswith("\0")),
)

# Any values of the right types, including ones the wire cannot hold.
EDGES = st.sampled_from([-1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64 - 1, 2**64])
ANY = field_values(ints=st.integers() | EDGES, signed64=st.integers() | EDGES, unsigned64=st.integers() | EDGES,
                   int32=st.integers() | EDGES, id16=st.binary(max_size=20), host=st.text(max_size=40))


@FUZZ
@given(IN_RANGE)
def check_constructor_in_range(fields):
    construct(fields)


def test_fuzz_constructor_in_range():
    run(check_constructor_in_range)


@FUZZ
@given(ANY)
def check_constructor_any_values(fields):
    construct(fields)


def test_fuzz_constructor_any_values():
    """Fails on the constructor bugs above (ids, host, integers the wire cannot hold)."""
    run(check_constructor_any_values, min_accepted=5)  # most of these values must be rejected


@pytest.mark.parametrize("host", ["\x000", "a\x00b", "x\x00"])
def test_a_host_name_with_a_nul_is_refused_by_the_constructor_as_by_the_parser(host):
    # Found by the constructor fuzz: the wire pads the name with NULs, so one inside would not read back.
    with pytest.raises(HandleError, match="no NUL"):
        IpcArrayHandle(memory_handle=MEMORY_HANDLE, offset=0, allocation_size=32, shape=(8,), strides=(4,),
                       dtype="float32", device=(0, UUID), producer=(1, TOKEN, TOKEN, host))


@pytest.mark.parametrize("consumers, error", [("2", TypeError), (1.5, TypeError), (True, TypeError),
                                              (None, TypeError), (0, ValueError), (-3, ValueError)])
def test_get_ipc_handle_refuses_a_count_of_consumers_that_is_no_positive_integer(consumers, error):
    import cupy_ipc

    with pytest.raises(error, match="consumers must be"):
        cupy_ipc.get_ipc_handle(object(), consumers=consumers)
    # A NumPy integer is a count: the check passes and the object is refused for what it is.
    with pytest.raises(TypeError, match="cannot share a object"):
        cupy_ipc.get_ipc_handle(object(), consumers=np.int64(2))


@pytest.mark.parametrize("limit, error", [("3", TypeError), (1.5, TypeError), (None, TypeError), (-1, ValueError)])
def test_the_idle_mapping_limit_is_a_count(limit, error):
    import cupy_ipc

    with pytest.raises(error, match="the idle mapping limit must be"):
        cupy_ipc.set_idle_mapping_limit(limit)
    old = cupy_ipc.set_idle_mapping_limit(np.int64(4))  # unchanged by the refusals above
    assert cupy_ipc.set_idle_mapping_limit(old, grow=True) == 4


_LONG = "16610 bits"
_LONG_FRACTION = "a Fraction too long to print"


@pytest.mark.parametrize("name, args, kwargs, match, said", [
    ("get_ipc_handle", (object(),), dict(consumers=10**5000), "consumers must be at most", _LONG),
    ("get_ipc_handle", (object(),), dict(consumers=-(10**5000)), "consumers must be at least", _LONG),
    ("get_ipc_handle", (object(),), dict(lease=-(10**5000)), "lease must be a positive number", _LONG),
    ("set_idle_mapping_limit", (-(10**5000),), {}, "the idle mapping limit must be at least", _LONG),
    ("checked_wait", (-(10**5000), "the exit wait"), {}, "the exit wait must be zero", _LONG),
    ("checked_wait", (Fraction(-1, 10**5000), "the exit wait"), {}, "the exit wait must be zero", _LONG_FRACTION),
    ("get_ipc_handle", (object(),), dict(lease=Fraction(-1, 10**5000)), "lease must be a positive number",
     _LONG_FRACTION),
], ids=["consumers", "negative consumers", "lease", "idle mapping limit", "wait", "wait fraction",
        "lease fraction"])
def test_an_argument_too_long_to_print_is_refused_by_name(name, args, kwargs, match, said):
    # Past 4300 digits str() of an integer raises ValueError: once the refusal's message did, naming no argument.
    import cupy_ipc
    from cupy_ipc import _args

    with pytest.raises(ValueError, match=match) as info:
        getattr(_args if name.startswith("checked") else cupy_ipc, name)(*args, **kwargs)
    assert said in str(info.value) and len(str(info.value)) < 200


def test_a_positive_lease_too_short_for_a_float_is_refused():
    # It passed the check, then became a lease of 0.0 seconds.
    from cupy_ipc import _args

    with pytest.raises(ValueError, match=r"lease must be a positive number.*\(0\.0 as a float\)"):
        _args.checked_lease(Fraction(1, 10**400))


# --- bounded work for any input ---------------------------------------------------------------------------
def endless(item, limit=100_000):
    """An iterable that never ends; reading more of it than any handle field holds fails the test."""
    for _ in range(limit):
        yield item
    raise AssertionError(f"read more than {limit} items of an iterable: no handle field holds that many")


@pytest.mark.parametrize("field, values", [
    ("shape", lambda: endless(1)),
    ("strides", lambda: endless(4)),
    ("more", lambda: endless((7, 8))),
    ("device", lambda: endless(0)),
    ("producer", lambda: endless(1)),
])
def test_the_constructor_reads_no_more_of_an_iterable_than_a_handle_holds(field, values):
    # Once tuple() of the whole of it: an endless iterator hung, taking memory until MemoryError (shape=range(10**12)
    # raised MemoryError at once; shape and strides of range(3 * 10**7) took 25 s and 2.6 GB before their refusal).
    fields = dict(memory_handle=MEMORY_HANDLE, offset=0, allocation_size=32, shape=(4, 2), strides=(8, 4),
                  dtype="float32", device=(0, UUID), producer=PRODUCER, kind="vmm", fd=3, resource=1)
    rejected("more than 4097 items", IpcArrayHandle, **{**fields, field: values()})


def test_the_parse_caches_hold_little_of_handles_with_many_pieces():
    # Received handles are cached by their bytes, 1024 of each cache at most: once whatever their size, so that
    # 1024 handles of virtual memory in 4096 pieces (64 KiB each on the wire) kept about 700 MB.
    import gc
    import tracemalloc

    from cupy_ipc import _wire

    h = IpcArrayHandle(memory_handle=bytes(64), offset=0, allocation_size=2**40, shape=(8,), strides=(4,),
                       dtype="float32", device=(0, UUID), producer=PRODUCER, kind="vmm", fd=3, resource=1,
                       more=[(1000 + i, 2**21 + i) for i in range(4096)])
    wire = h.to_bytes()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k in range(100):  # each a handle not seen before: its last piece's size differs
            IpcArrayHandle.from_bytes(wire[:-8] + struct.pack("<Q", 2**30 + k))
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        _wire._resent.clear()
        _wire._layouts.clear()
    assert kept < 32 * 2**20, f"{kept / 2**20:.0f} MiB kept by 100 parsed handles"
