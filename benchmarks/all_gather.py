"""all_gather latency: ``cupy_ipc.all_gather`` against the hand-written PyTorch pattern.

One rank per GPU, started by torchrun (a gloo group carries the handles in both)::

    torchrun --standalone --nproc-per-node 2 benchmarks/all_gather.py [--iters 100] [--bytes 1MiB]

The hand-written pattern is what multi-GPU engines do today: ``reduce_tensor``
on the rank's tensor, ``all_gather_object`` of the rebuild arguments, and each
rank rebuilding the other ranks' tensors. One iteration of either is a gather
that maps every peer's buffer, then a barrier, so that it ends when the slowest
rank has its list; the barrier alone is measured too. Rank 0 prints one line,
``ALL_GATHER {json}``, with median microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roundtrip import parse_size  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--bytes", type=parse_size, default=1 << 20, help="per rank, e.g. 4096, 64KiB, 1MiB")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        parser.error("run it under torchrun, one rank per GPU (see the usage line at the top of this file)")
    try:
        import torch
    except ImportError:
        parser.error("it compares with PyTorch, which is not installed here")

    import cupy
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    import cupy_ipc

    device = int(os.environ["LOCAL_RANK"]) % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device).use()
    torch.cuda.set_device(device)
    dist.init_process_group("gloo")
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    n = args.bytes // 4
    ours = cupy.full(n, rank, dtype=cupy.int32)
    theirs = torch.full((n,), rank, dtype=torch.int32, device=f"cuda:{device}")
    torch.cuda.synchronize()

    def with_cupy_ipc() -> None:
        with cupy_ipc.all_gather(ours, group):
            dist.barrier()

    def by_hand() -> None:
        rebuild, rebuild_args = reduce_tensor(theirs)
        objects: list = [None] * world
        dist.all_gather_object(objects, (rebuild, rebuild_args))
        tensors = [theirs if r == rank else fn(*a) for r, (fn, a) in enumerate(objects)]
        dist.barrier()
        del tensors

    results = {}
    for name, step in (("barrier", dist.barrier), ("cupy_ipc", with_cupy_ipc), ("torch", by_hand)) * 2:
        times = []
        for i in range(args.warmup + args.iters):
            dist.barrier()
            t = time.perf_counter()
            step()
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
        results[name] = round(statistics.median(times) * 1e6, 1)  # the second pass counts
    torch.cuda.ipc_collect()
    if rank == 0:
        print("ALL_GATHER " + json.dumps({"ranks": world, "bytes": args.bytes, "iters": args.iters,
                                          "median_us": results}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
