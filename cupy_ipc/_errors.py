"""The exceptions of cupy_ipc.

::

    RuntimeError
    └── IpcError                  anything that went wrong sharing GPU memory
        ├── HandleError (+ValueError)   a handle that is malformed, forged,
        │                               from another host, or for a GPU
        │                               this process cannot see
        ├── ClosedError           use of an event that was closed
        └── ProducerExitedError   the exporting process is gone

CUDA failures are raised as :class:`IpcError` (or a subclass) chained
``from`` the CUDA exception, with the CUDA error name kept in
``cuda_error``. Every exception pickles, so a child process can send it back.
"""

from __future__ import annotations

__all__ = ["IpcError", "HandleError", "ClosedError", "ProducerExitedError"]


class IpcError(RuntimeError):
    """Root of the errors raised by cupy_ipc.

    Attributes:
        cuda_error: Name of the CUDA error behind this one
            (``"cudaErrorInvalidValue"``), or ``None``.

    Example:
        >>> import pickle
        >>> err = IpcError("mapping failed", cuda_error="cudaErrorInvalidValue")
        >>> pickle.loads(pickle.dumps(err)).cuda_error
        'cudaErrorInvalidValue'
    """

    def __init__(self, message: str, *, cuda_error: str | None = None) -> None:
        super().__init__(message)
        self.cuda_error = cuda_error


class HandleError(IpcError, ValueError):
    """A handle is malformed, forged, or cannot be opened here.

    Raised before any CUDA call for everything that validation can see
    (length, magic, version, dtype, shape, strides, extent), and after
    mapping when the driver reports a smaller allocation than claimed.

    Example:
        >>> from cupy_ipc import IpcArrayHandle
        >>> try:
        ...     IpcArrayHandle.from_bytes(b"junk")
        ... except ValueError as e:
        ...     print(type(e).__name__)
        HandleError
    """


class ClosedError(IpcError):
    """An event was used after ``close()``.

    Example:
        >>> issubclass(ClosedError, IpcError)
        True
    """


class ProducerExitedError(IpcError):
    """The process that exported a handle has exited.

    Attributes:
        pid: Process id of the exited producer.

    Example:
        >>> ProducerExitedError("gone", pid=1234).pid
        1234
    """

    def __init__(self, message: str, *, pid: int = 0, cuda_error: str | None = None) -> None:
        super().__init__(message, cuda_error=cuda_error)
        self.pid = pid


def warn_quietly(message: str) -> None:
    """A ``RuntimeWarning`` that never raises, for destructors and the library's threads, which must go on.

    A filter that makes warnings errors (``-W error``) would raise here: in a
    destructor that skips what comes after the warning (the release of a
    claim, say), in a thread it ends the thread and with it every later
    release or lease it serves. The message then goes to stderr instead.
    """
    import sys
    import warnings

    try:
        warnings.warn(f"cupy_ipc {message}", RuntimeWarning, stacklevel=3)
    except Exception:  # noqa: BLE001 - the filter's error, or a closed stderr's: the caller goes on
        try:
            print(f"cupy_ipc {message}", file=sys.stderr)
        except Exception:  # noqa: BLE001, S110 - stderr closed or gone: nowhere left to say it
            pass
