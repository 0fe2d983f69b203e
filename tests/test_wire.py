"""Wire form of handles: round trips, pickling, equality, repr and properties. CPU only."""

from __future__ import annotations

import copy
import math
import pickle
import struct

import numpy as np
import pytest
from samples import BOOT_ID, DTYPES, EVENT_HANDLE, MEMORY_HANDLE, PRODUCER, TOKEN, UUID

from cupy_ipc import DeviceId, HandleError, IpcArrayHandle, IpcEventHandle, Producer
from cupy_ipc._wire import ARRAY_HEADER, EVENT_RECORD, VERSION, EventFields, Kind, pack_event


def c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def f_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in shape:
        strides.append(step)
        step *= max(n, 1)
    return tuple(strides)


def make(shape=(4, 2), strides=None, dtype=np.float32, offset=0, allocation_size=None, *,
         kind=Kind.LEGACY, memory_handle=MEMORY_HANDLE, device=(0, UUID),
         producer=PRODUCER):
    itemsize = np.dtype(dtype).itemsize
    if strides is None:
        strides = c_strides(shape, itemsize)
    if allocation_size is None:
        # Just large enough: the highest byte reached by a non-negative-stride array.
        reach = sum((n - 1) * s for n, s in zip(shape, strides) if n > 0 and s > 0)
        allocation_size = 0 if 0 in shape else offset + reach + itemsize
    return IpcArrayHandle(
        memory_handle=memory_handle, offset=offset, allocation_size=allocation_size, shape=shape,
        strides=strides, dtype=dtype, device=device, producer=producer, kind=kind,
    )


def make_event(block=False, handle=EVENT_HANDLE, device=(3, UUID), producer=PRODUCER):
    fields = EventFields(handle, block, DeviceId(*device), Producer(*producer))
    return IpcEventHandle.from_bytes(pack_event(fields))


def assert_round_trip(h):
    data = h.to_bytes()
    assert isinstance(data, bytes)
    assert len(data) == ARRAY_HEADER + 16 * h.ndim
    h2 = IpcArrayHandle.from_bytes(data)
    assert h2 == h
    assert h2.to_bytes() == data
    for name in ("shape", "strides", "dtype", "offset", "allocation_size", "memory_handle", "device",
                 "producer", "kind", "size", "nbytes", "ndim", "keepalive", "synced", "version"):
        assert getattr(h2, name) == getattr(h, name), name
    return h2


# --- round trips over shapes and layouts ---------------------------------------------------
LAYOUTS = {
    "0-d": dict(shape=(), strides=()),
    "1-d": dict(shape=(7,)),
    "2-d C": dict(shape=(4, 2)),
    "3-d F": dict(shape=(3, 4, 5), strides=f_strides((3, 4, 5), 4)),
    "strided slice": dict(shape=(3,), strides=(16,), offset=8, allocation_size=64),
    "zero strides (broadcast)": dict(shape=(1000, 1000), strides=(0, 0), allocation_size=4),
    "size-1 dims with odd strides": dict(shape=(1, 5, 1), strides=(3, 4, -7)),
    "reversed": dict(shape=(5,), strides=(-4,), offset=16, allocation_size=20),
    "reversed 2-d": dict(shape=(3, 4), strides=(-16, -4), offset=44, allocation_size=48),
    "mixed signs": dict(shape=(3, 4), strides=(16, -4), offset=12, allocation_size=48),
    "reversed in the middle of a larger allocation": dict(shape=(2, 2), strides=(-32, 8), offset=40,
                                                         allocation_size=4096),
    "63-d": dict(shape=(1,) * 60 + (2, 1, 3)),
    "64-d": dict(shape=(1,) * 58 + (2, 1, 3, 1, 2, 1)),
    "64-d F": dict(shape=(2, 1, 3) + (1,) * 61, strides=f_strides((2, 1, 3) + (1,) * 61, 4)),
    # 2**62 bytes in all, of the at most 2**63 - 1 an array may hold
    "64-d broadcast": dict(shape=(2,) * 60 + (1,) * 4, strides=(0,) * 64, allocation_size=4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_round_trip_layouts(layout):
    h = make(**layout)
    h2 = assert_round_trip(h)
    assert h2.shape == layout["shape"]
    assert h2.strides == layout.get("strides", c_strides(layout["shape"], 4))
    assert h2.offset == layout.get("offset", 0)



@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("kind", [Kind.LEGACY, Kind.POOL])
def test_another_export_of_a_handle_is_spliced_into_its_wire_form_and_parsed_as_a_first_handle(layout, kind):
    # A re-sent array's export joins its first wire form's parts with its own flags and export part; a
    # receiver that parsed the first looks the rest of the fields up.
    from cupy_ipc import _wire
    from cupy_ipc._wire import export_parts, pack_array, splice, unpack_array, with_export

    f = make(**layout)._f._replace(kind=kind, fd=5 if kind == Kind.POOL else -1, resource=9 if kind else 0)
    wire = pack_array(f)
    for flags, export_id, slot, event in ((f.flags, 1, 0, MEMORY_HANDLE), (3, 2**64 - 1, 2**32 - 1, EVENT_HANDLE),
                                          (1, 12, 4, bytes(64))):
        expected = with_export(f, flags, export_id, slot, event)
        other = splice(export_parts(wire), flags, export_id, slot, event)
        assert other == pack_array(expected)
        unpack_array(wire)  # the first export, seen before
        assert unpack_array(other) == expected
        assert unpack_array(other) == expected  # seen before as it is
        _wire._resent.clear()
        _wire._layouts.clear()
        assert unpack_array(other) == expected  # as a first handle


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize("kind", [Kind.LEGACY, Kind.POOL])
def test_a_layout_joined_with_another_allocation_and_export_is_their_wire_form(layout, kind):
    # How an export of a known layout is packed: the first array's unchanging bytes around the new fields.
    from cupy_ipc._wire import layout_of, pack_array, with_allocation, with_export

    f = make(**layout)._f._replace(kind=kind, fd=5 if kind == Kind.POOL else -1, resource=9 if kind else 0)
    other = with_export(f._replace(memory_handle=EVENT_HANDLE, offset=f.offset + 64, allocation_size=1 << 40,
                                   base_ptr=0x7F00_0000_0000, buffer_id=77), 3, 12, 4, MEMORY_HANDLE)
    joined = with_allocation(layout_of(pack_array(f)), 3, EVENT_HANDLE, f.offset + 64, 1 << 40, 0x7F00_0000_0000,
                             77, 12, 4, MEMORY_HANDLE)
    assert joined == pack_array(other)
    assert IpcArrayHandle.from_bytes(joined)._f == other

@pytest.mark.parametrize("ndim", range(65))
def test_round_trip_every_ndim(ndim):
    shape = tuple(2 if i % 16 == 0 else 1 for i in range(ndim))
    h = make(shape, dtype=np.int16)
    assert_round_trip(h)
    assert h.ndim == ndim
    assert h.size == 2 ** sum(n == 2 for n in shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_round_trip_every_dtype(dtype):
    dt = np.dtype(dtype)
    shape = (3, 5)
    for strides in (c_strides(shape, dt.itemsize), f_strides(shape, dt.itemsize)):
        h = make(shape, strides, dtype=dtype, offset=2 * dt.itemsize)
        assert h.dtype == dt
        assert type(h.dtype) is type(dt)
        assert h.nbytes == 15 * dt.itemsize
        assert h.allocation_size == 17 * dt.itemsize
        assert_round_trip(h)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_round_trip_every_dtype_reversed(dtype):
    """A reversed view whose first element is the last one of the allocation."""
    size = np.dtype(dtype).itemsize
    h = make((6,), (-size,), dtype=dtype, offset=5 * size, allocation_size=6 * size)
    assert_round_trip(h)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_dtype_spellings_give_equal_handles(dtype):
    dt = np.dtype(dtype)
    spellings = [dtype, dt, dt.str, dt.name, dt.char]
    handles = [make((2,), dtype=s) for s in spellings]
    assert all(h == handles[0] for h in handles)
    assert len({h.to_bytes() for h in handles}) == 1


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 0, 4), (2,) * 20 + (1,) * 43 + (0,)])
def test_round_trip_empty(shape):
    h = make(shape, kind=Kind.EMPTY)
    assert h.kind == "empty"
    assert h.size == 0
    assert h.nbytes == 0
    assert h.allocation_size == 0
    assert_round_trip(h)


def test_round_trip_large_field_values():
    """Values at the top of each wire field survive: u64 sizes, i32 device and pid; and offsets at the top of the
    2**63 - 1 bytes an array can address."""
    big = 2**64 - 1
    h = make((2,), (8,), dtype=np.float64, offset=2**63 - 24, allocation_size=big,
             device=(2**31 - 1, UUID), producer=(2**31 - 1, TOKEN, BOOT_ID, "h" * 32))
    h2 = assert_round_trip(h)
    assert h2.offset == 2**63 - 24
    assert h2.producer.host == "h" * 32


def test_round_trip_non_ascii_host():
    host = "gpü-ホスト"  # 16 UTF-8 bytes
    h = make(producer=(7, TOKEN, BOOT_ID, host))
    assert assert_round_trip(h).producer.host == host


def test_from_bytes_accepts_bytearray_and_memoryview():
    h = make()
    data = h.to_bytes()
    assert IpcArrayHandle.from_bytes(bytearray(data)) == h
    assert IpcArrayHandle.from_bytes(memoryview(data)) == h


def test_to_bytes_is_deterministic():
    assert make().to_bytes() == make().to_bytes()
    assert make().to_bytes() != make(offset=4, allocation_size=36).to_bytes()


def test_wire_layout_is_the_documented_one():
    """Fixed header sizes, magic, little-endian version and dims at the end: other versions depend on them."""
    assert (ARRAY_HEADER, EVENT_RECORD) == (273, 164)
    h = make((3, 5), f_strides((3, 5), 4), offset=4, allocation_size=64)
    data = h.to_bytes()
    assert data[:4] == b"CIPA"
    assert struct.unpack_from("<H", data, 4) == (VERSION,)
    assert struct.unpack_from("<4q", data, ARRAY_HEADER) == (3, 5, 4, 12)
    ev = make_event().to_bytes()
    assert ev[:4] == b"CIPE"
    assert struct.unpack_from("<H", ev, 4) == (VERSION,)


# --- properties --------------------------------------------------------------------------
def test_properties():
    h = make((3, 4), (16, 4), dtype=np.int32, offset=8, allocation_size=64, device=(2, UUID),
             producer=(99, TOKEN, BOOT_ID, "node-7"))
    assert h.shape == (3, 4)
    assert h.strides == (16, 4)
    assert h.dtype == np.dtype(np.int32)
    assert h.offset == 8
    assert h.allocation_size == 64
    assert h.memory_handle == MEMORY_HANDLE
    assert h.device == DeviceId(2, UUID)
    assert h.device.ordinal == 2 and h.device.uuid == UUID
    assert h.producer == Producer(99, TOKEN, BOOT_ID, "node-7")
    assert h.kind == "legacy"
    assert h.ndim == 2
    assert h.size == 12
    assert h.nbytes == 48
    assert h.version == VERSION
    # Built from field values, so nothing pins the memory and there is no event.
    assert h.keepalive is False
    assert h.synced is False


def test_zero_d_properties():
    h = make((), (), dtype=np.complex128)
    assert (h.ndim, h.size, h.nbytes, h.strides) == (0, 1, 16, ())


def test_size_is_exact_up_to_the_limit():
    # 2**63 - 1 bytes in all is the most a handle may describe (more is refused: see test_validation).
    h = make((2**63 - 1,), (0,), dtype=np.int8, allocation_size=1)
    assert h.size == h.nbytes == 2**63 - 1
    h = make((2,) * 59, (0,) * 59, dtype=np.float64, allocation_size=8)
    assert h.size == 2**59
    assert h.nbytes == 2**62
    assert isinstance(h.size, int)


@pytest.mark.parametrize("flags, keepalive, synced",
                         [(0, False, False), (1, True, False), (2, False, True), (3, True, True), (7, True, True)])
def test_flags_from_the_wire(flags, keepalive, synced):
    data = bytearray(make().to_bytes())
    data[struct.calcsize("<4sHB")] = flags  # the flags byte follows magic, version and kind
    h = IpcArrayHandle.from_bytes(bytes(data))
    assert (h.keepalive, h.synced) == (keepalive, synced)
    assert h.to_bytes() == bytes(data)
    assert (h == make()) == (flags == 0)


@pytest.mark.parametrize("bit", [8, 0x80])
def test_an_unknown_flag_is_refused(bit):
    data = bytearray(make().to_bytes())
    data[struct.calcsize("<4sHB")] = 3 | bit
    with pytest.raises(HandleError, match=f"unknown flag bits 0x{bit:x}"):
        IpcArrayHandle.from_bytes(bytes(data))


def test_constructor_converts_field_values():
    """Iterables and int-like values are accepted and stored as tuples of ints and bytes."""
    h = IpcArrayHandle(memory_handle=bytearray(MEMORY_HANDLE), offset=np.int64(4), allocation_size=np.uint64(64),
                       shape=iter([np.int32(3), 2]), strides=[np.int64(8), 4], dtype="float32",
                       device=(0, UUID), producer=(1, TOKEN, BOOT_ID, "h"))
    assert h.shape == (3, 2) and h.strides == (8, 4)
    assert all(type(v) is int for v in (*h.shape, *h.strides, h.offset, h.allocation_size))
    assert type(h.memory_handle) is bytes
    assert h == make((3, 2), (8, 4), offset=4, allocation_size=64, producer=(1, TOKEN, BOOT_ID, "h"))


def test_kind_default_is_legacy_and_names_are_stable():
    assert make().kind == "legacy"
    assert make((0,), kind=Kind.EMPTY).kind == "empty"
    assert (Kind.LEGACY, Kind.EMPTY) == (0, 255)


# --- equality and hash ----------------------------------------------------------------------
def test_equality_and_hash():
    a, b = make(), make()
    assert a == b
    assert (a != b) is False
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert {a: 1}[b] == 1


@pytest.mark.parametrize("change", [
    dict(offset=8, allocation_size=40),
    dict(allocation_size=64),
    dict(shape=(2, 4)),
    dict(strides=f_strides((4, 2), 4)),
    dict(dtype=np.int32),
    dict(memory_handle=bytes(64)),
    dict(device=(1, UUID)),
    dict(device=(0, bytes(16))),
    dict(producer=(4243, TOKEN, BOOT_ID, "gpu-host")),
    dict(producer=(4242, bytes(16), BOOT_ID, "gpu-host")),
    dict(producer=(4242, TOKEN, bytes(16), "gpu-host")),
    dict(producer=(4242, TOKEN, BOOT_ID, "other-host")),
], ids=lambda d: ",".join(d))
def test_any_field_difference_makes_handles_unequal(change):
    a, b = make(), make(**change)
    assert a != b
    assert a.to_bytes() != b.to_bytes()
    assert len({a, b}) == 2


def test_not_equal_to_other_types():
    h = make()
    assert h != h.to_bytes()
    assert h != make_event()
    assert h != None  # noqa: E711 - __eq__ itself is under test


# --- pickling --------------------------------------------------------------------------------
PICKLE_CASES = [make(), make((), ()), make((0, 3), kind=Kind.EMPTY), make(**LAYOUTS["reversed 2-d"]),
                make(**LAYOUTS["64-d"]), make((5,), dtype=np.complex128)]


@pytest.mark.parametrize("h", PICKLE_CASES, ids=repr)
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trip(h, protocol):
    h2 = pickle.loads(pickle.dumps(h, protocol=protocol))
    assert type(h2) is IpcArrayHandle
    assert h2 == h
    assert h2.to_bytes() == h.to_bytes()


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_goes_through_from_bytes(protocol):
    h = make()
    assert h.__reduce_ex__(protocol) == (IpcArrayHandle.from_bytes, (h.to_bytes(),))
    stream = pickle.dumps(h, protocol=protocol)
    # No pickled fields inside: no field tuple, dtype or identity class is named in the stream.
    for name in (b"ArrayFields", b"numpy", b"dtype", b"DeviceId", b"Producer", b"_f"):
        assert name not in stream
    assert b"from_bytes" in stream


def test_unpickling_validates():
    """A pickle whose wire bytes were tampered with fails in from_bytes, like the bytes would."""
    h = make()
    data = h.to_bytes()
    stream = pickle.dumps(h, protocol=pickle.HIGHEST_PROTOCOL)
    assert stream.count(data) == 1
    bad = data[:4] + struct.pack("<H", VERSION + 1) + data[6:]
    with pytest.raises(HandleError, match="version"):
        pickle.loads(stream.replace(data, bad))


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_event_pickle_round_trip(block, protocol):
    e = make_event(block)
    e2 = pickle.loads(pickle.dumps(e, protocol=protocol))
    assert type(e2) is IpcEventHandle
    assert e2 == e
    assert e2.block is block


def test_event_pickle_goes_through_from_bytes():
    e = make_event()
    assert e.__reduce_ex__(pickle.HIGHEST_PROTOCOL) == (IpcEventHandle.from_bytes, (e.to_bytes(),))
    stream = pickle.dumps(e)
    for name in (b"EventFields", b"DeviceId", b"Producer", b"_f"):
        assert name not in stream


# --- repr --------------------------------------------------------------------------------------
def assert_no_raw_bytes(text):
    for raw in (MEMORY_HANDLE, EVENT_HANDLE, UUID, TOKEN, BOOT_ID):
        assert repr(raw) not in text
        assert raw.hex() not in text
        assert raw[:4].hex() not in text
        assert repr(raw[:4])[2:-1] not in text  # e.g. \xa0\xa1\xa2\xa3


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_repr(dtype):
    h = make((4, 2), dtype=dtype, device=(3, UUID), producer=PRODUCER)
    text = repr(h)
    assert text.startswith("<IpcArrayHandle ") and text.endswith(">")
    assert "shape=(4, 2)" in text
    assert f"dtype={np.dtype(dtype).name}" in text
    assert "device=3" in text
    assert "4242" in text and "gpu-host" in text
    assert_no_raw_bytes(text)


def test_repr_of_0d_and_empty():
    assert "shape=()" in repr(make((), ()))
    assert "shape=(3, 0)" in repr(make((3, 0), kind=Kind.EMPTY))


@pytest.mark.parametrize("host", ["gpu\nFAKE LOG LINE", "\x1b[2Jx", "tab\there"])
def test_a_host_name_that_is_not_plain_text_is_shown_escaped(host):
    # The host comes from the wire: a forged handle's repr, logged, must stay on one line and print no escapes.
    for text in (repr(make(producer=(5, TOKEN, BOOT_ID, host))), repr(make_event(producer=(5, TOKEN, BOOT_ID, host)))):
        assert text.isprintable() and repr(host) in text, text


def test_event_repr():
    text = repr(make_event(device=(5, UUID), producer=(31337, TOKEN, BOOT_ID, "node-9")))
    assert text.startswith("<IpcEventHandle ") and text.endswith(">")
    assert "device=5" in text
    assert "31337" in text and "node-9" in text
    assert_no_raw_bytes(text)


# --- immutability ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["shape", "strides", "dtype", "offset", "allocation_size", "memory_handle",
                                  "device", "producer", "kind", "size", "nbytes", "new_attribute", "_f"])
def test_array_handle_is_immutable(name):
    h = make()
    before = h.to_bytes()
    with pytest.raises(AttributeError):
        setattr(h, name, getattr(h, name, 0))
    assert h.to_bytes() == before


def test_array_handle_attributes_cannot_be_deleted():
    h = make()
    with pytest.raises(AttributeError):
        del h.shape
    with pytest.raises(AttributeError):
        del h.nonexistent


@pytest.mark.parametrize("name", ["_f", "_wire", "_opened", "_fd", "_server"])
def test_array_handle_slots_cannot_be_deleted(name):
    # A deleted slot would leave a handle that raises on every later use, pickling included.
    h = make()
    before = h.to_bytes()
    with pytest.raises(AttributeError, match="immutable"):
        delattr(h, name)
    assert h.to_bytes() == before and pickle.loads(pickle.dumps(h)) == h


def test_event_handle_slot_cannot_be_deleted():
    e = make_event()
    with pytest.raises(AttributeError, match="immutable"):
        del e._f
    assert IpcEventHandle.from_bytes(e.to_bytes()) == e


def test_array_handle_has_no_instance_dict():
    # With a __dict__, vars(h)["x"] = ... would sidestep __setattr__.
    assert not hasattr(make(), "__dict__")


@pytest.mark.parametrize("name", ["event_handle", "block", "device", "producer", "new_attribute", "_f"])
def test_event_handle_is_immutable(name):
    e = make_event()
    before = e.to_bytes()
    with pytest.raises(AttributeError):
        setattr(e, name, getattr(e, name, 0))
    assert e.to_bytes() == before
    assert not hasattr(e, "__dict__")


@pytest.mark.parametrize("args", [(), (EVENT_HANDLE,)])
def test_an_event_handle_is_made_only_by_from_bytes_or_an_event(args):
    # IpcEventHandle() once made a handle with no fields: unvalidated, and its repr, hash, == and pickling raised
    # AttributeError.
    with pytest.raises(TypeError, match="from_bytes"):
        IpcEventHandle(*args)
    e = make_event()
    assert copy.copy(e) == copy.deepcopy(e) == e == pickle.loads(pickle.dumps(e))


# --- event handles -------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("host", ["", "h", "gpu-host", "x" * 32, "gpü-ホスト"])
def test_event_round_trip(block, host):
    e = make_event(block, device=(7, UUID), producer=(2**31 - 1, TOKEN, BOOT_ID, host))
    data = e.to_bytes()
    assert len(data) == EVENT_RECORD
    e2 = IpcEventHandle.from_bytes(data)
    assert e2 == e
    assert e2.to_bytes() == data
    assert e2.event_handle == EVENT_HANDLE
    assert e2.block is block
    assert e2.device == DeviceId(7, UUID)
    assert e2.producer == Producer(2**31 - 1, TOKEN, BOOT_ID, host)


def test_event_from_bytearray_and_memoryview():
    e = make_event()
    assert IpcEventHandle.from_bytes(bytearray(e.to_bytes())) == e
    assert IpcEventHandle.from_bytes(memoryview(e.to_bytes())) == e


def test_event_equality_and_hash():
    a, b = make_event(), make_event()
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    others = [make_event(block=True), make_event(handle=bytes(64)), make_event(device=(0, UUID)),
              make_event(producer=(1, TOKEN, BOOT_ID, "gpu-host"))]
    for other in others:
        assert other != a
    assert len({a, *others}) == 5
    assert a != a.to_bytes()


def test_shapes_match_numpy_views():
    """Strides of real (CPU) numpy views round trip: the layouts get_ipc_handle would export."""
    base = np.zeros((6, 8, 10), dtype=np.float64)
    views = [base, base.T, base[::-1], base[:, ::-2, 3:], base[2, ::-1, ::3], base[..., 5], base[1:2, 1:2, 1:2],
             base[::-1, ::-1, ::-1]]
    for v in views:
        start = v.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        h = make(v.shape, v.strides, dtype=v.dtype, offset=start, allocation_size=base.nbytes)
        assert_round_trip(h)
        assert h.nbytes == v.nbytes
        assert h.size == v.size
        assert math.prod(h.shape) == v.size


@pytest.mark.parametrize("make", [bytes, bytearray, lambda b: memoryview(bytes(b))], ids=["bytes", "bytearray",
                                                                                        "memoryview"])
@pytest.mark.parametrize("parse", [IpcArrayHandle.from_bytes, IpcEventHandle.from_bytes], ids=["array", "event"])
def test_bytes_longer_than_any_handle_are_refused_before_they_are_copied(make, parse):
    # Copied whole (twice, for the layout cache's key) before any length check, 400 MiB raised MemoryError.
    import tracemalloc

    from cupy_ipc._wire import MAX_WIRE_BYTES

    data = make(b"CIPA" + struct.pack("<H", VERSION) + bytes(8 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(HandleError, match=f"more than any handle has \\({MAX_WIRE_BYTES}\\)"):
            parse(data)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
