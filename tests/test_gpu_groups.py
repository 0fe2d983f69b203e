"""Several GPUs: cross-device opens (with differing CUDA_VISIBLE_DEVICES) and all_gather under torchrun and MPI."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multi_gpu(2)

WORKER = str(pathlib.Path(__file__).parent / "dist_worker.py")


@pytest.fixture
def reversed_consumer(remote, monkeypatch):
    """A helper process that sees the two GPUs in the other order."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    return remote()


def test_cross_device_open_both_ways_and_staged(reversed_consumer):
    import cupy

    import cupy_ipc

    arrays, data = {}, {}
    for physical in (0, 1):
        with cupy.cuda.Device(physical):
            arrays[physical] = cupy.arange(1 << 20, dtype=cupy.float32) + 1000 * physical
            data[physical] = cupy_ipc.get_ipc_handle(arrays[physical], consumers=8).to_bytes()
    try:
        for physical, theirs in ((0, 1), (1, 0)):  # the consumer's ordinal of each physical GPU
            for device, copy in ((None, False), (1 - theirs, False), (1 - theirs, True)):
                r = reversed_consumer.call("cross_device_open", data[physical], device, copy)
                assert r["equal"], (physical, device, copy)
                assert r["memory_device"] == theirs  # found by UUID despite the reversed order
                assert r["device"] == (0 if device is None else device)  # by default, the current GPU
                assert r["copied"] == (copy and device is not None)
            # Opened where the memory is, used from the consumer's other, current GPU.
            total = reversed_consumer.call("sum_from_current_device", data[physical], 1 - theirs)
            with cupy.cuda.Device(physical):
                assert total == pytest.approx(float(arrays[physical].sum()), rel=1e-6)
            # A write through the peer mapping lands in the producer's memory.
            reversed_consumer.call("write_through", data[physical], 1 - theirs, -5.0)
            assert float(arrays[physical][0]) == -5.0
    finally:
        for d in data.values():  # allowed 8 consumers, had fewer: end the pins for the tests after this one
            cupy_ipc.IpcArrayHandle.from_bytes(d).release()


def test_our_memory_opened_on_a_peer_gpu_and_sent_on_leaves_plain_arrays_of_its_layout_their_own_gpu():
    # The export of our own memory opened on GPU 1 names the memory's GPU 0: the layout kept for the fast
    # export of plain arrays must not carry that GPU to GPU 1's own arrays of the same layout.
    import cupy

    import cupy_ipc

    with cupy.cuda.Device(0):
        a = cupy.arange(24, dtype=cupy.float32)
    with cupy.cuda.Device(1):
        opened = cupy_ipc.get_ipc_handle(a).open(device=1)
        handles = [cupy_ipc.get_ipc_handle(opened)]
        assert handles[0].device.ordinal == 0
        for _ in range(2):  # a first array of the layout on GPU 1, then one the fast path exports
            plain = cupy.arange(24, dtype=cupy.float32)
            handles.append(cupy_ipc.get_ipc_handle(plain))
            assert handles[-1].device.ordinal == 1
    for h in handles:  # never opened: pinned until released (the first also holds `opened`, which holds a's)
        h.release()


def test_a_pool_array_opened_on_both_gpus_stays_readable_on_one_when_the_other_is_dropped(remote):
    # Both mappings import one allocation of the pool, for which the driver returns one pointer, and unmaps
    # it for both at the first free: the second must keep it.
    import cupy

    import cupy_ipc

    pool = cupy_ipc.ShareableMemoryPool(device=0)
    with cupy.cuda.Device(0), cupy.cuda.using_allocator(pool.malloc):
        a = cupy.arange(1 << 16, dtype=cupy.float32)
        r = remote().call("open_on_both_gpus_drop_one", cupy_ipc.get_ipc_handle(a).to_bytes())
    assert r == {"both": 2, "values": (0.0, 12345.0, 65535.0), "mapped": 0}


def test_waiting_on_another_gpus_event_orders_on_the_host(remote):
    # A stream of another GPU cannot wait on an opened IPC event (the process dies): wait() blocks the host instead.
    import cupy

    import cupy_ipc

    from workers import spin, warm_up

    helper = remote()
    warm_up()
    with cupy.cuda.Device(1):
        spin(0.01)
        ev = cupy_ipc.IpcEvent()
        ev.record()
        cupy.cuda.Device().synchronize()
        helper.call("wait_from_another_gpu", ev.get_ipc_handle().to_bytes(), 0)  # CUDA set up there
        spin(3.0)
        ev.record()
        r = helper.call("wait_from_another_gpu", ev.get_ipc_handle().to_bytes(), 0)
    assert r["event_device"] == 1 and r["done_after_wait"] and r["waited_s"] > 1.0, r
    ev.close()


def _run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})})
    return r, r.stdout + r.stderr


def _ranks() -> int:
    from conftest import gpu_count

    return gpu_count()  # one rank per GPU


@pytest.mark.parametrize("backend,mode", [("gloo", None), ("nccl", None), ("gloo", "--early-exit"),
                                          ("gloo", "--exit-in-turn"), ("gloo", "--rank-0-fails"),
                                          ("nccl", "--rank-0-fails")],
                         ids=["gloo", "nccl", "gloo-rank-1-exits-early", "gloo-ranks-exit-in-turn",
                              "gloo-rank-0-cannot-open", "nccl-rank-0-cannot-open"])
def test_all_gather_under_torchrun(backend, mode):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("PyTorch is not installed")
    n = _ranks()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), WORKER, "torch",
           backend] + ([mode] if mode else [])
    r, out = _run(cmd)
    assert r.returncode == 0, out[-4000:]
    if mode == "--rank-0-fails":
        assert all(f"RANK {k} FAILURE-REPORTED OK" in out for k in range(n)), out[-4000:]
        return
    assert all(f"RANK {k} OK" in out for k in range(n)) and "mapped on GPU" in out, out[-4000:]
    if mode == "--early-exit":
        assert "RANK 0 EARLY-EXIT OK" in out, out[-4000:]
    if mode == "--exit-in-turn":
        assert f"RANK 0 EXIT-IN-TURN OK after {n - 1} ranks left" in out, out[-4000:]


def test_all_gather_under_mpi():
    # A rank leaving early is checked under torchrun: MPI launchers abort the job when a rank skips MPI_Finalize.
    launcher = shutil.which("mpirun") or shutil.which("mpiexec")
    if launcher is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip(f"no MPI launcher (mpirun/mpiexec) on PATH, or no mpi4py: launcher={launcher}")
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    n = _ranks()
    r, out = _run([launcher, "-n", str(n), sys.executable, WORKER, "mpi"], env)
    assert r.returncode == 0, out[-4000:]
    assert all(f"RANK {k} OK" in out for k in range(n)), out[-4000:]
