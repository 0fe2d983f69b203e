"""Share CuPy arrays and CUDA events between processes of one host, with no copy.

Example:
    Producer::

        import cupy, cupy_ipc
        a = cupy.arange(10, dtype=cupy.float32)
        data = cupy_ipc.get_ipc_handle(a).to_bytes()    # send these bytes

    Consumer::

        h = cupy_ipc.IpcArrayHandle.from_bytes(data)
        with h as b:                                    # maps the producer's memory
            print(b.sum())

    ``import cupy_ipc.multiprocessing as mp`` is the standard ``multiprocessing``
    module whose queues, pipes and pools send arrays and events this way.
    Memory of a :class:`ShareableMemoryPool` is shared by file descriptor:
    :func:`send_handle` / :func:`recv_handle` (or ``cupy_ipc.multiprocessing``)
    pass the descriptor itself over a Unix socket.
"""

from __future__ import annotations

from . import _events, _keepalive, _mapping, _pools, _vmm
from ._array_handle import IpcArrayHandle, OpenInfo, get_ipc_handle, open_info
from ._descriptors import allow_ptrace_from_any, recv_handle, send_handle
from ._errors import ClosedError, HandleError, IpcError, ProducerExitedError
from ._events import IpcEvent, IpcEventHandle
from ._groups import Gathered, all_gather, node_local_ranks
from ._identity import Producer
from ._keepalive import PinInfo
from ._mapping import idle_mapping_limit, set_idle_mapping_limit
from ._pools import ShareableMemoryPool
from ._wire import DeviceId

__version__ = "0.1.0"

__all__ = [
    "ClosedError",
    "DeviceId",
    "Gathered",
    "HandleError",
    "IpcArrayHandle",
    "IpcError",
    "IpcEvent",
    "IpcEventHandle",
    "OpenInfo",
    "PinInfo",
    "Producer",
    "ProducerExitedError",
    "ShareableMemoryPool",
    "all_gather",
    "allow_ptrace_from_any",
    "collect",
    "get_ipc_handle",
    "idle_mapping_limit",
    "node_local_ranks",
    "open_info",
    "pinned",
    "recv_handle",
    "send_handle",
    "set_idle_mapping_limit",
]


def collect() -> None:
    """Free what is no longer needed, now.

    In a producer: end the pins of exports whose consumers are done. In a
    consumer: unmap idle mappings (and wait for the closes under way on the
    library's thread), destroy cached producer events, and let
    go of the pools imported of which nothing is mapped any more.

    Example:
        >>> import cupy_ipc
        >>> cupy_ipc.collect()
    """
    _keepalive.sweep()
    _vmm.sweep()
    _mapping.collect_idle()
    _events.drop_cached()
    _pools.release_exited(alive_too=True)


def pinned() -> list[PinInfo]:
    """The exports this process keeps alive for consumers, with their sizes.

    Example:
        >>> import cupy_ipc
        >>> cupy_ipc.pinned()
        []
    """
    return _keepalive.pinned()
