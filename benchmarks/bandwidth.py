"""Read bandwidth of a consumer on a mapped array, against a local copy, and across GPUs.

The consumer process opens the producer's array and times a read kernel
(float4 loads, grid-stride, one partial sum per block) with CUDA events over
the mapped memory and over a copy in its own memory. With two GPUs and peer
access, it also opens the producer's GPU-0 array on GPU 1 (a peer mapping over
NVLink or PCIe) and reads it there, against ``memcpyPeer`` of the same size and
GPU 1 reading its own memory.
"""

from __future__ import annotations

import statistics
from typing import Any

from roundtrip import in_consumer

READ_SOURCE = r"""
extern "C" __global__ void read(const float4* x, unsigned long long n4, float* partial) {
    float acc = 0.0f;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n4;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float4 v = x[i];
        acc += v.x + v.y + v.z + v.w;
    }
    if (acc == 12345.678f) partial[blockIdx.x] = acc;  // keeps the loads; never true for our data
}
"""


def _gbps(nbytes: int, work: Any, reps: int) -> float:
    """Median bandwidth (GB/s) of ``work()`` moving ``nbytes`` on the current stream, timed with CUDA events."""
    import cupy

    work()  # load modules, set up peer mappings
    cupy.cuda.get_current_stream().synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        work()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return nbytes / statistics.median(times) / 1e9


def _read_gbps(ptr: int, nbytes: int, reps: int) -> float:
    """Median read bandwidth (GB/s) of the read kernel over ``nbytes`` at ``ptr``, on the current device."""
    import cupy
    import numpy as np

    kernel = cupy.RawKernel(READ_SOURCE, "read")
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    args = (np.uint64(ptr), np.uint64(nbytes // 16), cupy.zeros(sms * 8, cupy.float32))
    return _gbps(nbytes, lambda: kernel((sms * 8,), (256,), args), reps)


def _peer_read(h: Any, a: Any, dev: int, other: int, reps: int) -> dict[str, Any]:
    """GPU ``other`` reads ``a`` (on ``dev``) through a peer mapping; against memcpyPeer and a local read."""
    import cupy

    from cupy_ipc import _cuda

    with cupy.cuda.Device(dev):
        src = a.copy()  # memcpyPeer's reference: this process's own allocations on both GPUs
        cupy.cuda.get_current_stream().synchronize()
    with cupy.cuda.Device(other):
        peer = h.open(device=other)  # mapped on `other` through peer access
        own = cupy.empty(a.shape, a.dtype)
        stream = cupy.cuda.get_current_stream()
        for x, y in ((other, dev), (dev, other)):  # else memcpyPeer may stage through the host
            _cuda.enable_peer_access(x, y)

        def copy() -> None:
            cupy.cuda.runtime.memcpyPeerAsync(own.data.ptr, other, src.data.ptr, dev, a.nbytes, stream.ptr)

        out = {"peer_gbps": _read_gbps(peer.data.ptr, peer.nbytes, reps),
               "peer_local_gbps": _read_gbps(own.data.ptr, own.nbytes, reps),
               "memcpy_peer_gbps": _gbps(a.nbytes, copy, reps),
               "peer_devices": f"GPU {other} reads GPU {dev}"}
        del peer
    return out


def _consumer(data: bytes, reps: int, conn: Any) -> None:
    try:
        import cupy

        import cupy_ipc

        h = cupy_ipc.IpcArrayHandle.from_bytes(data)
        out: dict[str, Any] = {}
        with h as a:
            dev = a.device.id
            local = a.copy()
            cupy.cuda.get_current_stream().synchronize()
            out["mapped_gbps"] = _read_gbps(a.data.ptr, a.nbytes, reps)
            out["local_gbps"] = _read_gbps(local.data.ptr, local.nbytes, reps)
            del local
            if cupy.cuda.runtime.getDeviceCount() > 1:
                other = 1 - dev if dev < 2 else 0
                if cupy.cuda.runtime.deviceCanAccessPeer(other, dev):
                    try:
                        out.update(_peer_read(h, a, dev, other, reps))
                    except Exception as e:  # noqa: BLE001 - the same-GPU figures still count
                        out["peer_error"] = f"{type(e).__name__}: {e}"
                else:
                    out["peer_error"] = f"GPU {other} has no peer access to GPU {dev}"
        del a
        conn.send(("ok", out))
    except Exception as e:  # noqa: BLE001 - reported by the suite
        conn.send(("err", f"{type(e).__name__}: {e}"))


def run(nbytes: int = 1 << 30, reps: int = 20) -> dict[str, Any]:
    """Read bandwidths (GB/s) in a consumer process, with the mapped/local ratio."""
    import cupy

    import cupy_ipc

    a = cupy.ones(nbytes // 4, cupy.float32)
    cupy.cuda.runtime.deviceSynchronize()
    out = in_consumer(_consumer, (cupy_ipc.get_ipc_handle(a).to_bytes(), reps), 600, "the bandwidth consumer")
    out["bytes"] = nbytes
    out["mapped_over_local"] = out["mapped_gbps"] / out["local_gbps"]
    if "peer_gbps" in out:
        out["peer_over_memcpy_peer"] = out["peer_gbps"] / out["memcpy_peer_gbps"]
    print(f"read bandwidth: mapped {out['mapped_gbps']:.0f} GB/s, local copy {out['local_gbps']:.0f} GB/s "
          f"({out['mapped_over_local']:.1%})" + (f"; peer {out['peer_gbps']:.0f} GB/s ({out['peer_devices']})"
                                               if "peer_gbps" in out else ""), flush=True)
    return out
