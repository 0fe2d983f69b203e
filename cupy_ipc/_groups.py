"""Process groups: every rank maps the arrays of the other ranks on its host.

:func:`all_gather` works over an ``mpi4py`` communicator or a
``torch.distributed`` process group (gloo or nccl). It takes two collectives:
the handles (``comm.allgather``, or one ``torch.distributed.all_gather`` of
fixed-size byte rows; for memory shared by descriptor, each with the address
of its rank's descriptor server, as ``cupy_ipc.multiprocessing`` sends it:
ranks are siblings, which Yama's ptrace rule keeps from ``pidfd_getfd`` on
each other), and a reduction saying whether any rank failed to open
them, so that a failure raises on every rank rather than leaving some
waiting (the messages are gathered only then); the first call on a group
takes one more, to learn which ranks share the host.
"""

from __future__ import annotations

import struct
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ._array_handle import IpcArrayHandle, get_ipc_handle
from ._errors import IpcError
from ._identity import this_process

__all__ = ["Gathered", "all_gather", "node_local_ranks"]


class _Engine:
    """The collectives all_gather needs, over an mpi4py communicator or a torch.distributed group."""

    def __init__(self, group: Any) -> None:
        # Refused before any collective. Where this process is not in the group, its members do not wait for
        # it; an inter-communicator is refused on every rank alike.
        self.group = group
        self.mpi = hasattr(group, "allgather") and hasattr(group, "Get_rank")  # mpi4py.MPI.Comm
        if self.mpi:
            if not group:  # mpi4py's null communicator is false
                raise ValueError(
                    "group is MPI.COMM_NULL: this process is not in the communicator (Split with MPI.UNDEFINED "
                    "and Create give that to the processes they leave out), or it was freed; call this only on "
                    "the processes whose communicator is not MPI.COMM_NULL")
            if group.Is_inter():
                raise TypeError(
                    "group is an mpi4py inter-communicator, whose allgather gathers the other group's values, not "
                    "this group's; pass the intra-communicator that group.Merge() makes of its two groups")
            self.rank, self.size = group.Get_rank(), group.Get_size()
        elif (dist := _torch_distributed(group)) is not None:
            self.dist = dist
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
            if self.rank < 0:
                raise ValueError(
                    f"this process (global rank {dist.get_rank()}) is not in the torch.distributed group: "
                    "new_group gives GroupMember.NON_GROUP_MEMBER to the ranks it leaves out; call this only on "
                    "the group's ranks (where group != dist.GroupMember.NON_GROUP_MEMBER)")
        else:
            raise TypeError(
                f"group must be an mpi4py communicator or a torch.distributed process group, not {group!r}")

    def objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank."""
        if self.mpi:
            return self.group.allgather(obj)
        out: list[Any] = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def handles(self, data: bytes | None) -> list[bytes | None]:
        """Every rank's handle bytes, or ``None``, by rank.

        Over torch.distributed: one tensor gather of fixed-size rows, where
        ``all_gather_object`` makes two (sizes, then data) and pickles. A
        handle too long for its row follows in an object gather, which every
        rank then makes, having seen the same lengths.
        """
        if self.mpi:
            return self.group.allgather(data)  # pickled in one collective
        import torch

        row = bytearray(_ROW)
        n = -1 if data is None else len(data)
        _LENGTH.pack_into(row, 0, n)
        if 0 <= n <= _ROW - _LENGTH.size:
            row[_LENGTH.size:_LENGTH.size + n] = data  # type: ignore[index]
        mine = torch.frombuffer(row, dtype=torch.uint8).to(self._device())
        rows = [torch.empty_like(mine) for _ in range(self.size)]
        self.dist.all_gather(rows, mine, group=self.group)
        everything = torch.cat(rows).cpu().numpy().tobytes()
        out: list[bytes | None] = []
        spill = False
        for at in range(0, self.size * _ROW, _ROW):
            (length,) = _LENGTH.unpack_from(everything, at)
            spill |= length > _ROW - _LENGTH.size
            out.append(None if length < 0 else everything[at + _LENGTH.size:at + _LENGTH.size + length])
        if spill:
            long = self.objects(data if n > _ROW - _LENGTH.size else None)
            out = [b if b is not None else a for a, b in zip(out, long)]
        return out

    def failed(self, flag: bool) -> bool:
        """Whether any rank passed True: one reduction."""
        if self.mpi:
            return self.group.allreduce(int(flag)) > 0
        import torch

        t = torch.tensor([int(flag)], dtype=torch.int32, device=self._device())
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def _device(self) -> Any:
        import torch

        # nccl moves CUDA tensors only; gloo, and groups with a CPU backend ("cpu:gloo,cuda:nccl"), CPU ones.
        backend = str(self.dist.get_backend(self.group))
        if backend == "nccl" or "cpu:" not in backend and "cuda:" in backend:  # ("cuda:nccl": CUDA only)
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _torch_distributed(group: Any) -> Any:
    """``torch.distributed`` where ``group`` is one of its groups, or what its ``new_group`` gives non-members;
    else ``None``."""
    if type(group).__module__.startswith("torch"):
        import torch.distributed as dist

        return dist
    dist = sys.modules.get("torch.distributed")  # imported already where the group came from it
    if dist is not None and dist.is_available() and group is dist.GroupMember.NON_GROUP_MEMBER:
        return dist
    return None


_ROW = 1024  # bytes per rank in a handle gather: the length, then the payload (see _payload)
_LENGTH = struct.Struct("<q")
_WIRE = struct.Struct("<I")  # a payload's handle bytes (273 + 16 per dimension, + 16 per descriptor)


def _payload(h: Any) -> bytes:
    """What a rank gathers of its export ``h``: the handle's bytes, then, for memory shared by descriptor, the
    address of this process's descriptor server, from which the peers take the descriptors over a Unix socket.
    Without it they would take them with ``pidfd_getfd``, which Yama's ``ptrace_scope`` 1 (Ubuntu's default)
    refuses between ranks, siblings under torchrun or mpirun."""
    wire = h.to_bytes()
    try:
        server = h._served() or b""
    except Exception:  # noqa: BLE001 - before the collective, which must not be skipped: the peers try pidfd_getfd
        server = b""
    return _WIRE.pack(len(wire)) + wire + server


def _opened_handle(payload: bytes) -> IpcArrayHandle:
    """The handle of a peer's payload (see :func:`_payload`), set to ask the peer's server for descriptors."""
    if len(payload) < _WIRE.size:
        raise IpcError(f"a peer's payload is {len(payload)} bytes, shorter than its header: not all_gather's")
    (n,) = _WIRE.unpack_from(payload)
    h = IpcArrayHandle.from_bytes(payload[_WIRE.size:_WIRE.size + n])
    server = payload[_WIRE.size + n:]
    if server:
        h._ask_producer(server)
    return h


def _local_ranks(engine: _Engine) -> list[int]:
    """The ranks on this host (same boot id, which the opens of handles compare too), gathered with one collective."""
    me = this_process()
    return [r for r, (boot_id, _) in enumerate(engine.objects((me.boot_id, me.host))) if boot_id == me.boot_id]


def node_local_ranks(group: Any) -> list[int]:
    """The ranks of ``group`` on this host (same kernel boot), this one included. Collective.

    Raises:
        TypeError: ``group`` is neither an mpi4py intra-communicator nor a
            torch.distributed group.
        ValueError: This process is not in ``group`` (``MPI.COMM_NULL``,
            ``GroupMember.NON_GROUP_MEMBER``); raised before any collective,
            so the group's members are not kept waiting.

    Example:
        >>> from mpi4py import MPI                       # doctest: +SKIP
        >>> cupy_ipc.node_local_ranks(MPI.COMM_WORLD)    # doctest: +SKIP
        [0, 1]
    """
    return _local_ranks(_Engine(group))


class Gathered(Sequence[Any]):
    """The arrays of every rank, by rank: ``None`` for ranks on other hosts.

    This rank's own array is at its own index, as passed. ``close()`` (or the
    end of a ``with`` block) drops the mappings of the other ranks' arrays;
    each rank's memory stays pinned until every peer that opened it is done.

    Example:
        >>> import numpy
        >>> with Gathered(0, [numpy.zeros(2), None], []) as got:   # as all_gather returns it
        ...     print(len(got), got[1])
        2 None
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
        # In place: the lists may be held elsewhere too (by the frame of a failed all_gather, which its
        # exception keeps), and their arrays' mappings must go now.
        arrays = self._arrays
        arrays[:] = [a if r == self.rank else None for r, a in enumerate(arrays)]
        handles = self._handles
        first = None
        while handles:  # every one, also past one that raises (a peer that exited before its work had run)
            try:
                handles.pop().close()
            except Exception as e:  # noqa: BLE001 - raised once the others are closed
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> "Gathered":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kinds = ["self" if r == self.rank else "-" if a is None else "mapped" for r, a in enumerate(self._arrays)]
        return f"<Gathered rank={self.rank} [{', '.join(kinds)}]>"


# id(group) -> (what gives the group back, its ranks on this host). A weak reference where the group takes one
# (a torch.distributed group does), so that the table does not keep groups alive; the entry goes with the group,
# and a new group at its id is not taken for it. Else the group is held, so that its id stays its own.
_group_hosts: dict[int, tuple[Callable[[], Any], list[int]]] = {}


def _known_ranks(group: Any) -> list[int] | None:
    known = _group_hosts.get(id(group))
    return known[1] if known is not None and known[0]() is group else None


def _remember_ranks(group: Any, local: list[int]) -> None:
    key = id(group)
    try:
        ref: Callable[[], Any] = weakref.ref(group, lambda _, key=key: _group_hosts.pop(key, None))
    except TypeError:  # a group that takes no weak reference: held, and known by itself only
        ref = lambda group=group: group  # noqa: E731
    _group_hosts[key] = (ref, local)


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
        TypeError, ValueError: As :func:`node_local_ranks`, before any collective.
        IpcError: On every rank, if any rank of this host could not share
            its array or open a peer's (the message names them); each rank's
            export is then released once the peers that opened it are done.

    Example:
        >>> with cupy_ipc.all_gather(buf, MPI.COMM_WORLD) as bufs:   # doctest: +SKIP
        ...     total = sum(b.sum() for b in bufs if b is not None)  # (None: a rank of another host)
    """
    engine = _Engine(group)
    rank, size = engine.rank, engine.size
    local = _known_ranks(group)
    if local is None:
        # Every rank calls all_gather on the group alike, so all learn it in the same call.
        local = _local_ranks(engine)
        _remember_ranks(group, local)
    peers = len(local) - 1
    mine, error = None, None
    if peers:
        try:
            mine = get_ipc_handle(array, consumers=peers)
        except Exception as e:  # reported to every rank below: raising alone would leave the others waiting
            error = f"rank {rank} could not share its array: {type(e).__name__}: {e}"
    arrays: list[Any] = [None] * size
    handles: list[IpcArrayHandle] = []
    arrays[rank] = array
    result = Gathered(rank, arrays, handles)  # filled in below
    gave_up = True  # until every rank has said that it succeeded (or the group itself failed under us)
    try:
        everything = engine.handles(_payload(mine) if mine is not None else None)
        failed = error is not None
        if peers and device is None and not failed:
            try:
                import cupy

                device = cupy.cuda.runtime.getDevice()
            except Exception as e:  # reported to every rank below
                error, failed = f"rank {rank} could not find its current GPU: {type(e).__name__}: {e}", True
        for r in local:
            if failed:
                break
            if r == rank:
                continue
            if everything[r] is None:  # that rank could not share its array: its own message says why
                failed = True
                break
            try:
                h = _opened_handle(everything[r])
                arrays[r] = h.open(device=device, copy=copy)
                handles.append(h)
            except Exception as e:  # reported to every rank below
                error = f"rank {rank} could not open rank {r}'s array: {type(e).__name__}: {e}"
                failed = True
        gave_up = engine.failed(failed)
        if gave_up:  # only then are the messages gathered
            raise IpcError("all_gather failed: " + "; ".join(e for e in engine.objects(error) if e))
    finally:
        if gave_up:
            try:
                result.close()
            finally:  # also if a close failed: pinned for peers that will not open it, it would stay for good
                if mine is not None:  # not every peer opened it: let it go once those that did are done
                    mine.release()
    return result
