"""The CUDA layer without a GPU: error names, the cuda-bindings fallback against libcuda's path, and the device
switch's way back, over stubbed drivers and runtimes."""

from __future__ import annotations

import ctypes
import sys
import types

import pytest

from cupy_ipc import _cuda
from cupy_ipc._errors import IpcError

real = pytest.importorskip("cuda.bindings.driver")  # its CUresult: the enum the library gets errors as
CUresult = real.CUresult


class _Driver:
    CUresult = CUresult
    CUpointer_attribute = real.CUpointer_attribute
    CUmemorytype = real.CUmemorytype

    @staticmethod
    def cuPointerGetAttributes(n, attrs, ptr):  # noqa: N802 - the driver's names
        return CUresult.CUDA_ERROR_INVALID_VALUE, None

    @staticmethod
    def cuMemGetAddressRange(ptr):  # noqa: N802
        return CUresult.CUDA_ERROR_INVALID_VALUE, None, None


# IpcError.cuda_error is the CUDA error's name (as check() and libcuda's calls give it: CUDA_ERROR_INVALID_VALUE);
# these three gave str() of cuda-bindings' enum: "<CUresult.CUDA_ERROR_INVALID_VALUE: 1>" (cuda-bindings 12.9, 13),
# and "1" for an IntEnum on Python 3.11 and later.
def test_pointer_queries_name_the_cuda_error(monkeypatch, libcuda):
    monkeypatch.setattr(_cuda, "_driver", lambda: _Driver)
    monkeypatch.setattr(_cuda, "_queries", lambda: None)  # cuda-bindings serves
    monkeypatch.setattr(_cuda, "_attributes", lambda: (1, 2, 3, 4, 5, 6))
    for query in (_cuda.pointer_info, _cuda.address_range):
        with pytest.raises(IpcError) as e:
            query(0x1000)
        assert e.value.cuda_error == "CUDA_ERROR_INVALID_VALUE"
        assert "<CUresult" not in str(e.value)


def test_a_failed_cuinit_names_the_cuda_error(monkeypatch):
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = types.SimpleNamespace(CUresult=CUresult, cuInit=lambda flags: (CUresult.CUDA_ERROR_NO_DEVICE,))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    _cuda._driver.cache_clear()
    try:
        with pytest.raises(IpcError, match="cuInit failed: CUDA_ERROR_NO_DEVICE$") as e:
            _cuda._driver()
        assert e.value.cuda_error == "CUDA_ERROR_NO_DEVICE"
    finally:
        _cuda._driver.cache_clear()


class _Runtime:
    """One thread's runtime: no context until setDevice, the runtime's GPU 0 then."""

    def __init__(self) -> None:
        self.current: int | None = None
        self.calls: list[int] = []

    def getDevice(self) -> int:  # noqa: N802 - CuPy's names
        return 0 if self.current is None else self.current

    def setDevice(self, d: int) -> None:  # noqa: N802
        self.calls.append(d)
        self.current = d


POOL = 0x9001


@pytest.mark.parametrize("path", ["libcuda", "cuda-bindings"])
def test_a_creation_on_a_thread_with_no_context_is_made_in_the_gpus_context_on_either_path(monkeypatch, libcuda,
                                                                                          path):
    # A thread of the library's own has no context: libcuda's call is tried again with the GPU's context current
    # (_in_context); cuda-bindings' call, where libcuda does not load, failed with CUDA_ERROR_INVALID_CONTEXT.
    runtime = _Runtime()
    monkeypatch.setattr(_cuda, "rt", lambda: runtime)

    def create(props):
        if runtime.current != 1:
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        return CUresult.CUDA_SUCCESS, POOL

    def create_c(out, props):  # libcuda's cuMemPoolCreate
        err, made = create(props)
        if made is not None:
            out._obj.value = made
        return int(err)

    monkeypatch.setattr(_cuda, "_driver", lambda: types.SimpleNamespace(CUresult=CUresult, cuMemPoolCreate=create))
    if path == "libcuda":
        libcuda["cuMemPoolCreate"] = create_c
    out = ctypes.c_uint64()
    _cuda.create_pool(types.SimpleNamespace(getPtr=lambda: 0), 1, out)
    assert out.value == POOL


@pytest.mark.parametrize("path", ["libcuda", "cuda-bindings"])
def test_a_failed_creation_names_the_same_error_on_either_path(monkeypatch, libcuda, path):
    runtime = _Runtime()
    runtime.current = 1
    monkeypatch.setattr(_cuda, "rt", lambda: runtime)
    driver = types.SimpleNamespace(CUresult=CUresult, cuMemPoolCreate=lambda props: (CUresult.CUDA_ERROR_NOT_SUPPORTED,
                                                                                    None))
    monkeypatch.setattr(_cuda, "_driver", lambda: driver)
    if path == "libcuda":
        libcuda["cuMemPoolCreate"] = lambda out, props: int(CUresult.CUDA_ERROR_NOT_SUPPORTED)
    out = ctypes.c_uint64()
    with pytest.raises(IpcError, match="CUDA_ERROR_NOT_SUPPORTED$") as e:
        _cuda.create_pool(types.SimpleNamespace(getPtr=lambda: 0), 1, out)
    assert e.value.cuda_error == "CUDA_ERROR_NOT_SUPPORTED" and out.value == 0


def test_going_back_restores_the_previous_gpu_also_on_an_exception(monkeypatch):
    runtime = _Runtime()
    runtime.current = 0
    monkeypatch.setattr(_cuda, "rt", lambda: runtime)
    with pytest.raises(KeyError):
        with _cuda.using_device(1):
            raise KeyError
    assert runtime.calls == [1, 0] and runtime.current == 0


# open(device=...) and ShareableMemoryPool(device=...) took any value int() accepts: 0.9 opened on GPU 0 and 1.5 on
# GPU 1 without a word, "1" and True on GPU 1; the library's other integer arguments refuse these (checked_count).
@pytest.mark.parametrize("bad", [0.9, 1.5, "1", True])
def test_a_gpu_ordinal_that_is_not_an_integer_is_refused(monkeypatch, bad):
    import numpy as np

    monkeypatch.setattr(_cuda, "device_count", lambda: 2)
    with pytest.raises(TypeError, match="device"):
        _cuda.checked_ordinal(bad)
    assert _cuda.checked_ordinal(1) == _cuda.checked_ordinal(np.int64(1)) == 1
    assert _cuda.checked_ordinal(types.SimpleNamespace(id=1)) == 1  # a cupy.cuda.Device
    with pytest.raises(IpcError, match="there is no GPU 2"):
        _cuda.checked_ordinal(2)


def test_a_runtime_error_where_no_driver_is_installed_says_so_not_that_the_driver_is_too_old(monkeypatch):
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    from cupy_ipc import _cuda

    monkeypatch.setattr(_cuda, "_has_driver_library", lambda: False)

    def no_driver():
        raise CUDARuntimeError(35)  # cudaErrorInsufficientDriver: what the runtime says without libcuda.so.1

    with pytest.raises(_cuda.IpcError, match="driver is not installed"):
        _cuda.call("counting GPUs", no_driver)


# Every runtime error carried the hints about handles: recording an event on a destroyed stream said "the
# producer freed this memory or event".
def test_the_hints_about_handles_come_with_opens_only():
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    from cupy_ipc import _cuda

    def invalid_handle():
        raise CUDARuntimeError(400)  # cudaErrorInvalidResourceHandle

    with pytest.raises(_cuda.IpcError, match="invalid resource handle") as e:
        _cuda.call("recording an event", invalid_handle)
    assert "producer" not in str(e.value) and e.value.cuda_error == "cudaErrorInvalidResourceHandle"
    with pytest.raises(_cuda.IpcError, match="the producer freed this memory or event"):
        _cuda.call("opening the event", invalid_handle, opening=True)

    def illegal_address():
        raise CUDARuntimeError(700)  # what any call says once the context is lost

    with pytest.raises(_cuda.IpcError, match="the CUDA context is lost"):
        _cuda.call("recording an event", illegal_address)


# CuPy's device properties end a UUID at its first zero byte: the driver's whole one is the device's.
def test_a_device_uuid_is_whole_where_cupys_properties_cut_it(monkeypatch, libcuda):
    from cupy_ipc import _cuda

    whole = bytes.fromhex("5a1f00c29b3e4d7fa0b1c2d3e4f50617")
    libcuda.update(cuInit=lambda flags: 0, cuDeviceGet=lambda out, i: 0,
                   cuDeviceGetUuid_v2=lambda buf, dev: ctypes.memmove(buf, whole, 16) and 0)
    monkeypatch.setattr(_cuda, "rt", lambda: types.SimpleNamespace(getDeviceProperties=lambda i: {"uuid": whole[:2]}))
    assert _cuda.device_uuid(0) == whole
