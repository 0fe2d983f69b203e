"""Fork safety: a child forked after its parent initialized CUDA cannot use CUDA.

Such a child would crash or hang on its first CUDA call. Every entry point of
the library calls :func:`check` first, so the child gets an :class:`IpcError`
that says what to do instead.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ._errors import IpcError

__all__ = ["check", "cuda_initialized", "forked_after_cuda"]

_parent_had_cuda = False
_forked_after_cuda = False


def cuda_initialized() -> bool:
    """True when this process has initialized the CUDA driver (``cuInit``).

    Asks the driver without initializing it, and only when a Python module that
    initializes CUDA (CuPy, cuda-bindings, PyTorch, Numba's CUDA) has been
    imported, so that it is cheap enough to run before every fork: CUDA
    initialized only by another library (JAX, PyCUDA, ``ctypes``) is not seen.

    Example:
        >>> cuda_initialized() in (True, False)
        True
    """
    if _forked_after_cuda:  # inherited; and the driver's calls may crash or hang in such a child
        return True
    if not any(m in sys.modules for m in ("cupy", "cuda.bindings.driver", "cuda.cuda", "torch", "numba.cuda")):
        return False
    try:
        try:
            from cuda.bindings import driver
        except ImportError:  # cuda-python before 12.6 names the module differently
            from cuda import cuda as driver  # type: ignore[no-redef]

        err, _ = driver.cuCtxGetCurrent()
    except Exception:  # no driver library: nothing was initialized
        return False
    return err not in _not_initialized(driver)


def _not_initialized(driver: Any) -> tuple[Any, ...]:
    """The driver's answers that say CUDA was not initialized: not yet, or its initialization failed (a stub
    library, no GPU, a driver that does not match its kernel module or this GPU), after which a child's CUDA
    calls fail as the parent's do."""
    names = ("CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_STUB_LIBRARY", "CUDA_ERROR_NO_DEVICE",
             "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "CUDA_ERROR_SYSTEM_NOT_READY",
             "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE")
    return tuple(getattr(driver.CUresult, name) for name in names if hasattr(driver.CUresult, name))


def _before_fork() -> None:
    global _parent_had_cuda
    _parent_had_cuda = cuda_initialized()


def _after_fork_in_child() -> None:
    global _forked_after_cuda
    _forked_after_cuda = _parent_had_cuda


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def forked_after_cuda() -> bool:
    """Whether this process was forked after its parent initialized CUDA: then no destructor may call CUDA.

    Example:
        >>> forked_after_cuda()
        False
    """
    return _forked_after_cuda


def check() -> None:
    """Raise :class:`IpcError` in a process forked after CUDA was initialized.

    Example:
        >>> check()  # this process was not forked from a CUDA process
    """
    if _forked_after_cuda:
        raise IpcError(
            f"this process (pid {os.getpid()}) was forked after its parent initialized CUDA, so it "
            "cannot use CUDA: start it with the 'spawn' or 'forkserver' method instead, e.g. "
            "multiprocessing.get_context('spawn'), or call multiprocessing.set_start_method('spawn') "
            "once at the start of the program"
        )
