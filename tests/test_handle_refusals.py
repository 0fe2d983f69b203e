"""What the handle API refuses that it let through before: a forged release, values too long to print, an
empty array no consumer could parse, a lease with nothing to revoke (over test_streams' stubbed runtime)."""
import pickle
import struct
import time

import numpy as np
import pytest
from test_streams import _NullStream, gpus  # noqa: F401 - gpus: the fixture

from cupy_ipc import HandleError, IpcArrayHandle, IpcError, _array_handle, _cuda, _keepalive
from cupy_ipc._wire import _DYNAMIC_AT


@pytest.fixture
def own(gpus, monkeypatch):  # noqa: F811 - the fixture imported above
    import cupy
    gpus.getDeviceCount = lambda: 1
    monkeypatch.setattr(_cuda, "_ordinals", {})
    monkeypatch.setattr(_cuda, "can_access_peer", lambda a, b: a == b)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda device_id=-1: _NullStream)
    return gpus


def _on_page(page):
    import cupy
    mem = cupy.cuda.UnownedMemory(0x100000 * page, 0x1000, None, 0)
    return cupy.ndarray((16,), np.float32, cupy.cuda.MemoryPointer(mem, 0))


def test_release_of_a_forged_handle_leaves_other_exports_alone(own):
    a, b = _on_page(3), _on_page(4)
    ha, hb = _array_handle.get_ipc_handle(a), _array_handle.get_ipc_handle(b)
    raw = bytearray(ha.to_bytes())
    struct.pack_into("<Q", raw, _DYNAMIC_AT, hb._f.export_id)  # a's memory, b's export id
    forged = IpcArrayHandle.from_bytes(bytes(raw))
    try:
        with pytest.raises(HandleError, match="forged or corrupt"):
            forged.open()
        with pytest.raises(HandleError, match="forged or corrupt"):
            forged.release()
        assert hb._f.export_id in {p.export_id for p in _keepalive.pinned()}
    finally:
        ha.release()
        hb.release()


@pytest.mark.parametrize("dtype", [10**5000 * 10**10, [10**5000 * 10**10], ("f4", 10**5000 * 10**10)],
                         ids=["int", "list", "tuple"])
def test_a_dtype_too_long_to_print_is_refused_as_a_handle_error(dtype):
    with pytest.raises(HandleError, match="not a dtype"):
        IpcArrayHandle(memory_handle=bytes(64), offset=0, allocation_size=64, shape=(4,), strides=(4,), dtype=dtype,
                       device=(0, bytes(16)), producer=(1, bytes(16), bytes(16), "h"))


def test_a_gpu_ordinal_too_long_to_print_is_refused_by_name(own, monkeypatch):
    monkeypatch.setattr(_cuda, "device_count", lambda: 1)
    h = _array_handle.get_ipc_handle(_on_page(5))
    try:
        with pytest.raises(IpcError, match="there is no GPU .an integer of"):
            h.open(device=10**5000 * 10**10)
    finally:
        h.release()


def test_an_empty_array_that_no_consumer_could_parse_is_refused_at_export(own):
    import cupy
    mem = cupy.cuda.UnownedMemory(0x900000, 0, None, 0)
    ok = cupy.ndarray((0, 3), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
    h = _array_handle.get_ipc_handle(ok)
    assert pickle.loads(pickle.dumps(h)) == h
    huge = cupy.ndarray((0, 2**62), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))  # CuPy allows it, NumPy does not
    with pytest.raises(HandleError, match="2\\*\\*63 - 1"):
        _array_handle.get_ipc_handle(huge)


def test_a_lease_without_an_export_to_revoke_is_refused(own, monkeypatch):
    from cupy_ipc._cuda import PointerInfo
    monkeypatch.setattr(_cuda, "pointer_info",
                        lambda p: PointerInfo(p & ~0xFFF, 0x1000, 7 + (p >> 20), "device", True))
    with pytest.raises(ValueError, match="lease"):
        _array_handle.get_ipc_handle(_on_page(6), keepalive=False, sync=False, lease=0.05)
    h = _array_handle.get_ipc_handle(_on_page(6), keepalive=False, lease=0.05)  # sync alone pins: the lease holds
    time.sleep(0.2)
    with pytest.raises(IpcError, match="no longer shares"):
        h.open()
    h.release()
