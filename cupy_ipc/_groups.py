"""Process groups: every rank maps the arrays of the other ranks on its host.

:func:`all_gather` works over an ``mpi4py`` communicator or a
``torch.distributed`` process group (gloo or nccl), and moves the handles with
that engine's own object collective (``comm.allgather``,
``torch.distributed.all_gather_object``). It takes two collectives: the
handles, and whether every rank could open them, so that a failure raises on
every rank rather than leaving some waiting; the first call on a group takes
one more, to learn which ranks share the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ._array_handle import IpcArrayHandle, get_ipc_handle
from ._errors import IpcError
from ._identity import this_process

__all__ = ["Gathered", "all_gather", "node_local_ranks"]


def _engine(group: Any) -> tuple[int, int, Callable[[Any], list[Any]]]:
    """``(rank, size, allgather)`` for an mpi4py communicator or a torch.distributed group."""
    if hasattr(group, "allgather") and hasattr(group, "Get_rank"):  # mpi4py.MPI.Comm
        return group.Get_rank(), group.Get_size(), group.allgather
    if type(group).__module__.startswith("torch"):
        import torch.distributed as dist

        size = dist.get_world_size(group)

        def gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * size
            dist.all_gather_object(out, obj, group=group)
            return out

        return dist.get_rank(group), size, gather
    raise TypeError(f"group must be an mpi4py communicator or a torch.distributed process group, not {group!r}")


def _local_ranks(gather: Callable[[Any], list[Any]]) -> list[int]:
    """The ranks on this host (same kernel boot), gathered with one collective."""
    me = this_process()
    return [r for r, (boot_id, _) in enumerate(gather((me.boot_id, me.host))) if boot_id == me.boot_id]


def node_local_ranks(group: Any) -> list[int]:
    """The ranks of ``group`` on this host (same kernel boot), this one included. Collective.

    Example:
        >>> from mpi4py import MPI                       # doctest: +SKIP
        >>> cupy_ipc.node_local_ranks(MPI.COMM_WORLD)    # doctest: +SKIP
        [0, 1]
    """
    return _local_ranks(_engine(group)[2])


class Gathered(Sequence[Any]):
    """The arrays of every rank, by rank: ``None`` for ranks on other hosts.

    This rank's own array is at its own index, as passed. ``close()`` (or the
    end of a ``with`` block) drops the mappings of the other ranks' arrays;
    each rank's memory stays pinned until every peer that opened it is done.
    """

    def __init__(self, rank: int, arrays: list[Any], handles: list[IpcArrayHandle]) -> None:
        self.rank = rank
        self._arrays = arrays
        self._handles = handles

    def __getitem__(self, i: Any) -> Any:
        return self._arrays[i]

    def __len__(self) -> int:
        return len(self._arrays)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._arrays)

    def close(self) -> None:
        """Drop the other ranks' arrays. Idempotent."""
        self._arrays = [a if r == self.rank else None for r, a in enumerate(self._arrays)]
        for h in self._handles:
            h.close()
        self._handles = []

    def __enter__(self) -> "Gathered":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kinds = ["self" if r == self.rank else "-" if a is None else "mapped" for r, a in enumerate(self._arrays)]
        return f"<Gathered rank={self.rank} [{', '.join(kinds)}]>"


# id(group) -> (group, its ranks on this host); the group is held so that its id stays its own.
_group_hosts: dict[int, tuple[Any, list[int]]] = {}


def all_gather(array: Any, group: Any, *, device: int | None = None, copy: bool = False) -> Gathered:
    """Every rank passes its array; every rank gets all of them, mapped, indexed by rank. Collective.

    The other ranks' arrays are opened on ``device`` (default: CuPy's current
    device), across GPUs through peer access (see
    :meth:`IpcArrayHandle.open`, whose ``copy`` this passes on). Ranks see
    each other's GPUs by UUID, so differing ``CUDA_VISIBLE_DEVICES`` work. With
    an nccl group, set ``torch.cuda.set_device`` first, as its collectives ask.

    Args:
        array: This rank's GPU array (any layout or dtype cupy_ipc shares).
        group: An ``mpi4py`` communicator or a ``torch.distributed`` group.

    Returns:
        A :class:`Gathered`: a sequence and a context manager.

    Raises:
        IpcError: On every rank, if any rank of this host could not open a
            peer's array (the message names them).

    Example:
        >>> with cupy_ipc.all_gather(buf, MPI.COMM_WORLD) as bufs:   # doctest: +SKIP
        ...     total = sum(b.sum() for b in bufs)
    """
    rank, size, gather = _engine(group)
    known = _group_hosts.get(id(group))
    if known is None or known[0] is not group:
        # Every rank calls all_gather on the group alike, so all learn it in the same call.
        known = _group_hosts[id(group)] = (group, _local_ranks(gather))
    local = known[1]
    peers = len(local) - 1
    data = get_ipc_handle(array, consumers=peers).to_bytes() if peers else None
    everything = gather(data)
    if peers and device is None:
        import cupy

        device = cupy.cuda.runtime.getDevice()
    arrays: list[Any] = [None] * size
    handles: list[IpcArrayHandle] = []
    error = None
    arrays[rank] = array
    for r in local:
        if r == rank:
            continue
        try:
            h = IpcArrayHandle.from_bytes(everything[r])
            arrays[r] = h.open(device=device, copy=copy)
            handles.append(h)
        except Exception as e:  # reported to every rank below
            error = f"rank {rank} could not open rank {r}'s array: {type(e).__name__}: {e}"
            break
    errors = [e for e in gather(error) if e]
    result = Gathered(rank, arrays, handles)
    if errors:
        result.close()
        raise IpcError("all_gather failed: " + "; ".join(errors))
    return result
