"""The exception tree of cupy_ipc, and that every exception survives pickling."""

from __future__ import annotations

import pickle
import sys

import pytest

import cupy_ipc
from cupy_ipc import ClosedError, HandleError, IpcArrayHandle, IpcError, ProducerExitedError


def test_ipc_error_is_a_runtime_error():
    assert issubclass(IpcError, RuntimeError)
    assert not issubclass(IpcError, ValueError)


def test_handle_error_is_an_ipc_error_and_a_value_error():
    assert issubclass(HandleError, IpcError)
    assert issubclass(HandleError, ValueError)
    assert issubclass(HandleError, RuntimeError)


@pytest.mark.parametrize("cls", [ClosedError, ProducerExitedError])
def test_other_errors_are_ipc_errors_only(cls):
    assert issubclass(cls, IpcError)
    assert not issubclass(cls, ValueError)
    assert not issubclass(cls, HandleError)


def test_exceptions_are_exported():
    for name in ("IpcError", "HandleError", "ClosedError", "ProducerExitedError"):
        assert name in cupy_ipc.__all__
        assert getattr(cupy_ipc, name) is getattr(cupy_ipc._errors, name)


def test_handle_error_is_caught_as_value_error():
    # Callers that validate input generically catch ValueError; a bad handle must be one.
    with pytest.raises(ValueError):
        IpcArrayHandle.from_bytes(b"junk")
    with pytest.raises(IpcError):
        IpcArrayHandle.from_bytes(b"junk")


def test_default_attributes():
    assert IpcError("m").cuda_error is None
    assert HandleError("m").cuda_error is None
    assert ClosedError("m").cuda_error is None
    e = ProducerExitedError("m")
    assert (e.pid, e.cuda_error) == (0, None)


def test_attributes_are_keyword_only():
    # Positional use would be ambiguous between cuda_error and pid.
    with pytest.raises(TypeError):
        IpcError("m", "cudaErrorInvalidValue")  # type: ignore[misc]
    with pytest.raises(TypeError):
        ProducerExitedError("m", 12)  # type: ignore[misc]


EXCEPTIONS = [
    IpcError("mapping failed"),
    IpcError("mapping failed", cuda_error="cudaErrorInvalidValue"),
    HandleError("bad handle"),
    HandleError("handle claims 4096 bytes, driver mapped 2048", cuda_error="cudaErrorInvalidDevicePointer"),
    ClosedError("this IpcEvent is closed"),
    ClosedError("closed", cuda_error="cudaErrorInvalidResourceHandle"),
    ProducerExitedError("the producer process (pid 1234) has exited", pid=1234),
    ProducerExitedError("gone", pid=2**31 - 1, cuda_error="cudaErrorMapBufferObjectFailed"),
    ProducerExitedError("gone"),
]


@pytest.mark.parametrize("exc", EXCEPTIONS, ids=lambda e: f"{type(e).__name__}-{e.cuda_error}")
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickles_with_attributes(exc, protocol):
    copy = pickle.loads(pickle.dumps(exc, protocol=protocol))
    assert type(copy) is type(exc)
    assert str(copy) == str(exc)
    assert copy.args == exc.args
    assert copy.cuda_error == exc.cuda_error
    if isinstance(exc, ProducerExitedError):
        assert copy.pid == exc.pid


def test_pickled_error_can_be_raised_and_caught_by_its_bases():
    """What a child process sends back is caught by the same except clauses as the original."""
    copy = pickle.loads(pickle.dumps(HandleError("bad", cuda_error="cudaErrorX")))
    with pytest.raises(ValueError, match="^bad$") as info:
        raise copy
    assert isinstance(info.value, IpcError)
    assert info.value.cuda_error == "cudaErrorX"


def test_raised_handle_error_pickles():
    with pytest.raises(HandleError) as info:
        IpcArrayHandle.from_bytes(b"CIPA")
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is HandleError
    assert str(copy) == str(info.value)
    assert "4 bytes" in str(copy)


def test_a_gpu_that_cannot_be_made_current_raises_ipc_error_naming_it():
    # Here the driver refuses (no GPU: every call fails; on a GPU machine: no such ordinal); either way the
    # CUDA error comes out as the library's, as every other CUDA failure does.
    from cupy_ipc import _cuda

    with pytest.raises(IpcError, match="making GPU 999 current failed") as e:
        with _cuda.using_device(999):
            pass
    assert e.value.cuda_error


def test_without_cuda_bindings_the_driver_says_what_to_install(monkeypatch):
    from cupy_ipc import _cuda

    for name in ("cuda.bindings", "cuda.bindings.driver", "cuda.cuda"):  # None: importing it fails
        monkeypatch.setitem(sys.modules, name, None)
    _cuda._driver.cache_clear()
    try:
        with pytest.raises(IpcError, match="cuda-bindings is not installed.*cuda12 or cuda13 extra"):
            _cuda._driver()
    finally:
        _cuda._driver.cache_clear()


@pytest.mark.parametrize("flags", [[], ["-W", "error"]], ids=["warnings", "warnings-as-errors"])
def test_a_quiet_warning_with_stderr_closed_does_not_raise(flags):
    # The library's threads warn this way: raised there, the error would end the thread, and with it every
    # release it serves. A closed stderr (a daemon's, a notebook's torn-down one) made writes raise ValueError.
    # (In a process of its own: pytest's capture of warnings would not write to stderr.)
    import subprocess

    code = """
import io, sys
from cupy_ipc._errors import warn_quietly
closed = io.StringIO()
closed.close()
sys.stderr = closed
warn_quietly("could not do something")
print("went on")
"""
    r = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "went on\n", (r.stdout, r.stderr)


def test_without_cupy_every_entry_point_says_how_to_install_it():
    # Each raised a bare "No module named 'cupy'" from inside the library.
    import subprocess

    code = "\n".join([
        "import sys",
        "sys.modules['cupy'] = None  # as if not installed",
        "import cupy_ipc",
        "for call in (lambda: cupy_ipc.get_ipc_handle(object()), cupy_ipc.IpcEvent, cupy_ipc.ShareableMemoryPool,",
        "             lambda: __import__('cupy_ipc.multiprocessing')):",
        "    try:",
        "        call()",
        "    except ModuleNotFoundError as e:",
        "        print(e.name, 'cuda12 or cuda13 extra' in str(e))",
    ])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:4] == ["cupy True"] * 4
