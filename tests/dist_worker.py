"""One rank of the all_gather checks, started by torchrun or mpirun (not collected by pytest).

    torchrun --standalone --nproc-per-node N tests/dist_worker.py torch gloo|nccl [MODE]
    mpirun -n N python tests/dist_worker.py mpi

Each rank writes its rank number into its buffer, gathers, and checks every
rank's buffer. MODE changes what follows:

- ``--early-exit``: rank 1 leaves right after the gather, without closing;
  rank 0 still reads rank 1's buffer, closes, and checks that its own export
  is released.
- ``--exit-in-turn``: ranks N-1, N-2, ..., 1 leave one after another, half a
  second apart, without closing; each rank still there reads every buffer
  between departures, and rank 0, last, closes and checks that its export is
  released.
- ``--rank-0-fails``: rank 0 asks for a GPU it does not have, so it cannot
  open its peers' arrays: every rank must raise ``IpcError`` naming rank 0,
  and no export may stay pinned.
- ``--by-descriptor pool|vmm``: each buffer comes from a
  ``ShareableMemoryPool`` or is virtual memory, and ``pidfd_getfd`` is
  refused, as where ptrace rules keep sibling ranks from it: the peers must
  take the descriptors from each rank's descriptor server.
"""

from __future__ import annotations

import os
import sys
import time


def _check_released() -> None:
    """This rank's export must be released within 10 s (its peers' claims are gone: dropped, or died with them)."""
    import cupy_ipc

    deadline = time.monotonic() + 10
    while cupy_ipc.pinned() and time.monotonic() < deadline:
        cupy_ipc.collect()
        time.sleep(0.05)
    assert not cupy_ipc.pinned(), cupy_ipc.pinned()


def _close_and_check_released(gathered) -> None:
    """Close the mappings; this rank's export must be released (the departed ranks' claims died with them)."""
    gathered.close()
    _check_released()


def main() -> None:
    import cupy

    import cupy_ipc

    engine, early, in_turn = sys.argv[1], "--early-exit" in sys.argv, "--exit-in-turn" in sys.argv
    ngpu = cupy.cuda.runtime.getDeviceCount()
    if engine == "torch":
        import torch
        import torch.distributed as dist

        device = int(os.environ["LOCAL_RANK"]) % ngpu
        cupy.cuda.Device(device).use()
        torch.cuda.set_device(device)
        dist.init_process_group(sys.argv[2])
        group, rank, barrier = dist.group.WORLD, dist.get_rank(), dist.barrier
    else:
        from mpi4py import MPI

        group = MPI.COMM_WORLD
        rank, barrier = group.Get_rank(), group.Barrier
        device = group.Split_type(MPI.COMM_TYPE_SHARED).Get_rank() % ngpu
        cupy.cuda.Device(device).use()

    kind = sys.argv[sys.argv.index("--by-descriptor") + 1] if "--by-descriptor" in sys.argv else None
    if kind == "pool":
        keep = cupy_ipc.ShareableMemoryPool()
        allocator = keep.malloc
    elif kind == "vmm":
        from cupy_ipc import _vmm

        allocator = _vmm.allocate
    if kind is not None:
        with cupy.cuda.using_allocator(allocator):
            a = cupy.full(1 << 20, rank, dtype=cupy.int32)
        from cupy_ipc import _descriptors

        def refused(pid, fd):  # as under Yama's ptrace_scope 1, where sibling ranks may not take each other's
            raise cupy_ipc.IpcError(f"pidfd_getfd on rank process {pid} refused: the descriptor server was not asked")

        _descriptors.take_fd = refused
    else:
        a = cupy.full(1 << 20, rank, dtype=cupy.int32)
    if "--rank-0-fails" in sys.argv:
        try:
            cupy_ipc.all_gather(a, group, device=ngpu if rank == 0 else None)
        except cupy_ipc.IpcError as e:
            assert "rank 0 could not open rank 1's array" in str(e), str(e)
        else:
            raise AssertionError(f"rank {rank}: all_gather did not raise")
        barrier()  # every rank has dropped its mappings of the others' arrays
        _check_released()
        print(f"RANK {rank} FAILURE-REPORTED OK", flush=True)
        barrier()
        if engine == "torch":
            dist.destroy_process_group()
        return
    gathered = cupy_ipc.all_gather(a, group)
    seen = []
    for r, b in enumerate(gathered):
        values = b.get()
        assert (values == r).all(), f"rank {rank} read {values[:4]} from rank {r}"
        info = cupy_ipc.open_info(b)
        seen.append("self" if r == rank else f"GPU {info.memory_device} mapped on GPU {info.device}")
    print(f"RANK {rank} OK on GPU {device}: {seen} local ranks {cupy_ipc.node_local_ranks(group)}", flush=True)
    if in_turn:
        size = len(gathered)
        for step in range(1, size):  # before step k, ranks size-1 .. size-k+1 have left
            if rank == size - step:
                os._exit(0)  # gone without closing: its claims die with it
            time.sleep(0.5)
            for r, b in enumerate(gathered):  # every buffer, the departed ranks' too, stays readable while mapped
                assert (b.get() == r).all(), f"rank {rank} read wrong values from rank {r} after {step} left"
        assert rank == 0
        _close_and_check_released(gathered)
        print(f"RANK {rank} EXIT-IN-TURN OK after {size - 1} ranks left", flush=True)
        os._exit(0)
    if early:
        if rank == 1:
            os._exit(0)  # gone without closing: its claims on rank 0's memory die with it
        time.sleep(2)
        assert (gathered[1].get() == 1).all(), "rank 1's buffer must stay readable while mapped"
        _close_and_check_released(gathered)
        print(f"RANK {rank} EARLY-EXIT OK", flush=True)
        os._exit(0)  # the group lost a member: no barrier or teardown
    gathered.close()
    barrier()
    if engine == "torch":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
