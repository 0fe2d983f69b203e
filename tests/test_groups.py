"""all_gather and node_local_ranks without a GPU: who is local, and what a rank alone gets back (and, on a GPU,
what a failed group leaves pinned).

The communicator here has mpi4py's interface over a fixed list of hosts, so
that the host logic runs without an MPI runtime; the GPU tests run the real
engines under torchrun and mpirun.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupy_ipc
from cupy_ipc._identity import this_process


class HostsComm:
    """mpi4py's Comm interface for rank ``rank`` of ranks living on ``hosts`` (this host: "here")."""

    def __init__(self, rank: int, hosts: list[str]) -> None:
        self.rank, self.hosts = rank, hosts

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return len(self.hosts)

    def Is_inter(self) -> bool:
        return False

    def allreduce(self, value):
        return value

    def allgather(self, obj):
        me = this_process()
        if isinstance(obj, tuple) and obj == (me.boot_id, me.host):
            return [(me.boot_id if h == "here" else h.encode().ljust(16, b"\0"), h) for h in self.hosts]
        return [obj if r == self.rank else None for r in range(len(self.hosts))]


def test_node_local_ranks_are_those_of_this_host():
    assert cupy_ipc.node_local_ranks(HostsComm(1, ["a", "here", "b", "here"])) == [1, 3]
    assert cupy_ipc.node_local_ranks(HostsComm(0, ["here"])) == [0]


def test_a_rank_alone_on_its_host_gets_its_own_array_and_none_for_the_others():
    a = np.arange(3)  # no peer on this host: nothing is exported or opened
    with cupy_ipc.all_gather(a, HostsComm(1, ["a", "here", "b"])) as got:
        assert len(got) == 3 and got[1] is a and got[0] is None and got[2] is None
        assert repr(got) == "<Gathered rank=1 [-, self, -]>"
    got.close()  # idempotent
    assert got[1] is a


def test_an_unknown_group_is_refused():
    with pytest.raises(TypeError, match="mpi4py communicator or a torch.distributed"):
        cupy_ipc.all_gather(np.zeros(1), object())


def test_hosts_are_gathered_once_per_group():
    class Counting(HostsComm):
        calls = 0

        def allgather(self, obj):
            Counting.calls += 1
            return super().allgather(obj)

        def allreduce(self, value):
            Counting.reductions += 1
            return super().allreduce(value)

    Counting.reductions = 0
    comm = Counting(1, ["a", "here", "b"])
    for gathers, reductions in ((2, 1), (3, 2), (4, 3)):  # hosts and handles, then handles; whether any failed
        cupy_ipc.all_gather(np.arange(3), comm).close()
        assert (Counting.calls, Counting.reductions) == (gathers, reductions)


def test_the_table_of_groups_does_not_keep_a_group_alive():
    import gc
    import weakref

    from cupy_ipc import _groups

    comm = HostsComm(1, ["a", "here", "b"])
    cupy_ipc.all_gather(np.arange(3), comm).close()
    assert _groups._known_ranks(comm) == [1]
    gone, key = weakref.ref(comm), id(comm)
    del comm
    gc.collect()
    assert gone() is None and key not in _groups._group_hosts


def test_a_group_without_weak_references_is_held_and_known_by_itself_only():
    from cupy_ipc import _groups

    class NoWeakReferences:
        __slots__ = ()

    group = NoWeakReferences()
    _groups._remember_ranks(group, [0, 2])
    try:
        assert _groups._known_ranks(group) == [0, 2] and _groups._known_ranks(NoWeakReferences()) is None
        assert _groups._group_hosts[id(group)][0]() is group
    finally:
        del _groups._group_hosts[id(group)]


def _gloo_ranks(target, args_by_rank: list[tuple], store: str) -> list:
    """What ``target(rank, size, store, *args, conn)`` sent back from one spawned process per rank, by rank."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    conns, procs = [], []
    for rank, args in enumerate(args_by_rank):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=target, args=(rank, len(args_by_rank), store, *args, theirs), daemon=True)
        p.start()
        conns.append(mine)
        procs.append(p)
    try:
        out = []
        for rank, conn in enumerate(conns):
            assert conn.poll(120), f"rank {rank} did not answer"
            status, value = conn.recv()
            assert status == "ok", value
            out.append(value)
        return out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def test_torch_engine_gathers_short_missing_and_long_handles_and_any_failure(tmp_path):
    # gloo on the CPU: the tensor gather of fixed-size rows, its spill for a handle longer than a row,
    # and the failure reduction, as every rank sees them.
    pytest.importorskip("torch.distributed")
    from cupy_ipc._groups import _ROW

    from workers import gloo_engine_rank

    datas = [b"\x01handle" * 10, None, bytes(range(256)) * (2 * _ROW // 256), b""]
    out = _gloo_ranks(gloo_engine_rank, [(data, rank == 2) for rank, data in enumerate(datas)],
                      str(tmp_path / "store"))
    for rank in range(len(datas)):
        assert out[rank] == {"rank": rank, "size": 4, "handles": datas, "failed": True, "none_failed": False,
                             "objects": [0, 1, 2, 3]}


def test_a_torch_rank_outside_the_group_is_refused_and_the_members_do_not_wait_for_it(tmp_path):
    # new_group gives the ranks it leaves out GroupMember.NON_GROUP_MEMBER (-100), which was refused as
    # "not a group"; rank 0, the only member, gathers alone before rank 1 calls.
    pytest.importorskip("torch.distributed")
    from workers import gloo_outsider_rank

    member, outsider = _gloo_ranks(gloo_outsider_rank, [(), ()], str(tmp_path / "store"))
    assert member == [[0], "<Gathered rank=0 [self]>"]
    assert [outcome[0] for outcome in outsider] == ["ValueError"] * 2, outsider
    for _, message in outsider:
        assert "(global rank 1) is not in the torch.distributed group" in message and "NON_GROUP_MEMBER" in message


def test_mpi_inter_and_null_communicators_are_refused_and_the_members_do_not_wait(tmp_path):
    # An inter-communicator's allgather gathers the other group: all_gather took the remote ranks for its
    # own. MPI.COMM_NULL, which Split gives the ranks it leaves out, failed in MPI_Comm_rank.
    import json
    import os
    import pathlib
    import shutil
    import subprocess
    import sys

    pytest.importorskip("mpi4py")
    bin_dir = os.path.dirname(sys.executable)  # where pip's mpich puts mpiexec
    launcher = shutil.which("mpiexec", path=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    if launcher is None:
        pytest.skip("no mpiexec beside this Python or on PATH")
    tests = pathlib.Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)]),
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    r = subprocess.run([launcher, "-n", "2", sys.executable, "-c", "import workers; workers.mpi_bad_groups()"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    out = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in (0, 1):
        assert [outcome[0] for outcome in out[rank]["inter"]] == ["TypeError"] * 2, out[rank]["inter"]
        assert all("inter-communicator" in message and "Merge()" in message for _, message in out[rank]["inter"])
    assert out[0]["alone"] == [[0], "<Gathered rank=0 [self]>"]
    assert [outcome[0] for outcome in out[1]["alone"]] == ["ValueError"] * 2, out[1]["alone"]
    assert all("MPI.COMM_NULL" in message and "not in the communicator" in message for _, message in out[1]["alone"])


class ThreadsComm:
    """mpi4py's Comm interface for ranks that are threads of this process (one host), with real collectives."""

    def __init__(self, rank: int, shared: dict) -> None:
        self.rank, self.shared = rank, shared

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.shared["size"]

    def Is_inter(self) -> bool:
        return False

    def allgather(self, obj):
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = obj
        barrier.wait(30)
        out = list(slots)
        barrier.wait(30)
        return out

    def allreduce(self, value):
        return sum(self.allgather(value))


def test_a_rank_that_cannot_share_its_array_fails_every_rank_instead_of_leaving_them_waiting():
    # Rank 0's array is host memory, which cannot be shared: it must still take part in the collectives,
    # so that every rank raises the same error rather than rank 1 waiting for rank 0's handle for ever.
    import threading

    shared = {"size": 2, "slots": [None, None], "barrier": threading.Barrier(2)}
    errors: list[BaseException | None] = [None, None]

    def rank(r: int) -> None:
        try:
            cupy_ipc.all_gather(np.arange(3), ThreadsComm(r, shared)).close()
        except BaseException as e:  # noqa: BLE001 - checked below
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    for e in errors:
        assert isinstance(e, cupy_ipc.IpcError), e
        assert "rank 0 could not share its array" in str(e) and "rank 1 could not share its array" in str(e)


def test_closing_a_result_drops_the_other_ranks_arrays_wherever_its_lists_are_held():
    # A failed all_gather closes its result and raises: the exception keeps its frame, which holds the same
    # lists, and the peers' mappings (with their claims on the peers' memory) must still go.
    from cupy_ipc._groups import Gathered

    class Handle:
        closed = False

        def close(self) -> None:
            self.closed = True

    arrays, handles = ["mine", "theirs", "another"], [Handle(), Handle()]
    opened = list(handles)
    Gathered(0, arrays, handles).close()
    assert arrays == ["mine", None, None] and handles == []
    assert all(h.closed for h in opened)


def test_closing_a_result_closes_every_handle_even_past_one_that_raises():
    # A peer that exited before its work had run makes its handle's close() raise: the loop stopped there, and
    # the other peers' mappings (and their claims on the peers' memory) stayed as long as the result lived.
    from cupy_ipc._groups import Gathered

    class Handle:
        def __init__(self, fails: bool) -> None:
            self.fails, self.closed = fails, False

        def close(self) -> None:
            self.closed = True
            if self.fails:
                raise cupy_ipc.ProducerExitedError("the producer (pid 7) exited before its work had run", pid=7)

    handles = [Handle(False), Handle(False), Handle(True)]  # closed last first
    opened = list(handles)
    with pytest.raises(cupy_ipc.ProducerExitedError):
        Gathered(0, ["mine", "a", "b", "c"], handles).close()
    assert handles == [] and all(h.closed for h in opened)


@pytest.mark.parametrize("backend, device", [("nccl", "cuda"), ("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"),
                                             ("cuda:nccl", "cuda"), ("cpu:gloo", "cpu"), ("mpi", "cpu")])
def test_the_flags_travel_on_the_device_that_the_groups_backend_moves(monkeypatch, backend, device):
    # A group made with a device-qualified backend ("cuda:nccl") was given CPU tensors, which it cannot move.
    torch = pytest.importorskip("torch")
    from cupy_ipc import _groups

    engine = _groups._Engine.__new__(_groups._Engine)
    engine.group = object()
    engine.dist = type("Dist", (), {"get_backend": staticmethod(lambda group: backend)})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert engine._device().type == device


class BrokenComm(HostsComm):
    """Two ranks of this host, whose gather of the handles fails (a peer died, or the group timed out)."""

    def allgather(self, obj):
        if obj is None or isinstance(obj, bytes):
            raise RuntimeError("the group failed")
        return super().allgather(obj)


@pytest.mark.gpu
def test_a_group_that_fails_while_gathering_the_handles_releases_this_ranks_export():
    # No peer got the handle, so none will open it: pinned for a consumer, it would stay pinned for good.
    import cupy

    a = cupy.arange(4, dtype=cupy.float32)
    before = len(cupy_ipc.pinned())
    with pytest.raises(RuntimeError, match="the group failed"):
        cupy_ipc.all_gather(a, BrokenComm(0, ["here", "here"]))
    assert len(cupy_ipc.pinned()) == before


def test_a_failed_gather_whose_close_fails_still_releases_this_ranks_export(monkeypatch):
    # The export's release came after the result's close, which a failed unmap can make raise: the export,
    # pinned for peers that will not open it any more, then stayed pinned for good.
    from cupy_ipc import _groups

    released = []

    class Export:
        def to_bytes(self) -> bytes:
            return b"handle"

        def release(self) -> None:
            released.append(True)

    def failing_close(self) -> None:
        raise cupy_ipc.IpcError("could not unmap")

    monkeypatch.setattr(_groups, "get_ipc_handle", lambda array, consumers: Export())
    monkeypatch.setattr(_groups.Gathered, "close", failing_close)
    with pytest.raises(cupy_ipc.IpcError, match="could not unmap"):
        cupy_ipc.all_gather(np.arange(3), BrokenComm(0, ["here", "here"]))
    assert released == [True]


class _VmmDriver:
    """The driver calls that export an allocation of virtual memory, each allocation a memfd that stands for it:
    the allocation handle at a base is the base, and its export a copy of that memfd."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUmemAllocationHandleType:
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1

    def __init__(self, memory: dict) -> None:
        self.memory = memory

    def cuMemRetainAllocationHandle(self, base):  # noqa: N802 - the driver's names
        return 0, base

    def cuMemRelease(self, handle):  # noqa: N802
        return (0,)

    def cuMemGetAllocationPropertiesFromHandle(self, handle):  # noqa: N802
        import types

        return 0, types.SimpleNamespace(requestedHandleTypes=1)

    def cuMemExportToShareableHandle(self, handle, kind, flags):  # noqa: N802
        import os

        return 0, os.dup(self.memory[handle])


def test_ranks_take_a_peers_descriptors_from_its_server_not_with_pidfd_getfd(monkeypatch, libcuda):
    # Virtual memory (PyTorch's expandable segments) and shareable pools reach a peer by descriptor. The ranks
    # of a group are siblings (torchrun, mpirun), which Yama's ptrace_scope 1 (Ubuntu's and Debian's default)
    # forbids to pidfd_getfd each other: the handles gathered as bytes alone made every rank fail, advising
    # send_handle or cupy_ipc.multiprocessing, neither of which all_gather can use. Each rank's descriptor
    # server must come with its handle, as cupy_ipc.multiprocessing sends it.
    import os
    import threading

    from cupy_ipc import IpcArrayHandle, _groups, _vmm
    from cupy_ipc._descriptors import close_all
    from cupy_ipc._wire import Kind

    for name in ("_exports", "_by_mapping", "_by_fd", "_kept"):
        monkeypatch.setattr(_vmm, name, {})
    bases = [0x7F0000000000, 0x7F0000200000]
    memory = {}
    for r, base in enumerate(bases):
        memory[base] = os.memfd_create("cupy_ipc-test")
        os.write(memory[base], f"rank {r}".encode())
    monkeypatch.setattr(_vmm._cuda, "_driver", lambda: _VmmDriver(memory))
    me = this_process()

    def share(rank, consumers):  # get_ipc_handle's export of each rank's virtual memory
        fd, alloc_id = _vmm.export(bases[rank], 5 + rank)
        return IpcArrayHandle(memory_handle=bytes(64), offset=0, allocation_size=4096, shape=(1024,), strides=(4,),
                              dtype="float32", device=(0, bytes(16)), producer=(me.pid, me.token, me.boot_id, me.host),
                              kind=Kind.VMM, fd=fd, resource=alloc_id)

    def open_(self, device=None, copy=False):  # the import's first step: the descriptors, else pidfd_getfd
        fds = self._take_fds()
        if fds is None:
            raise cupy_ipc.IpcError("no descriptors came with the handle: pidfd_getfd, which ptrace rules refuse")
        try:
            return [os.pread(fd, 16, 0) for fd in fds]
        finally:
            close_all(fds)

    monkeypatch.setattr(_groups, "get_ipc_handle", share)
    monkeypatch.setattr(IpcArrayHandle, "open", open_)
    shared = {"size": 2, "slots": [None, None], "barrier": threading.Barrier(2)}
    got: list = [None, None]

    def rank(r: int) -> None:
        try:
            with cupy_ipc.all_gather(r, ThreadsComm(r, shared), device=0) as bufs:
                got[r] = list(bufs)
        except BaseException as e:  # noqa: BLE001 - checked below
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert got == [[0, [b"rank 1"]], [[b"rank 0"], 1]], got
    finally:
        close_all(fd for fd, _ in _vmm._exports.values())
        close_all(memory.values())
