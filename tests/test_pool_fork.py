"""ShareableMemoryPool in a child forked after its parent initialized CUDA, without a GPU: such a child must make
no CUDA call (the library's own rule, see _fork: its calls would crash or hang). Neither the free of a block it
inherited (the virtual-memory allocator's and the opened arrays' destructors already skip theirs) nor the pool's
entry points, which raise IpcError saying what to do instead, as the library's other entry points do."""

from __future__ import annotations

import os
import types

import pytest

from cupy_ipc import _fork, _pools
from cupy_ipc._errors import IpcError


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def test_a_forked_child_dropping_an_inherited_block_makes_no_cuda_call():
    calls = []

    class Stream:
        ptr = 0x51

    stream = Stream()

    class Runtime:
        def mallocFromPoolAsync(self, size, pool, s):  # noqa: N802
            return 0x1000

        def freeAsync(self, ptr, s):  # noqa: N802
            calls.append(("freeAsync", ptr, s))

    def device(d):
        calls.append(("Device", d))  # cupy.cuda.Device(d).__enter__ calls cudaGetDevice/cudaSetDevice
        return _Null()

    pools = _pools._DriverPools(Runtime())
    pools.cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: stream, Device=device))
    pools.pools[0] = 0x9001
    try:
        ptr = pools.malloc(64, 0)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its copy of the array is dropped (a global replaced, a cycle collected)
            code = 1
            try:
                os.close(r)
                pools.free(ptr, 0)
                os.write(w, repr(calls).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r) as f:
            seen = f.read()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert seen == "[]", f"the forked child called CUDA to free its parent's block: {seen}"
        pools.free(ptr, 0)  # the parent's own free still goes to the driver
        assert calls == [("Device", 0), ("freeAsync", 0x1000, 0x51)]
    finally:
        pools.pools = {}


@pytest.mark.parametrize("call", ["create", "malloc", "used_bytes", "total_bytes", "free_all_blocks"])
def test_the_pool_raises_the_fork_error_in_a_child_forked_after_cuda(monkeypatch, call):
    monkeypatch.setattr(_fork, "_forked_after_cuda", True)
    if call == "create":
        with pytest.raises(IpcError, match="forked after its parent initialized CUDA"):
            _pools.ShareableMemoryPool()
        return
    pool = object.__new__(_pools.ShareableMemoryPool)  # as inherited from the parent
    pool._pools = _pools._DriverPools(types.SimpleNamespace())
    pool._pools.pools[0] = 0x9001
    # CuPy's allocator asks the runtime for the current GPU, then calls the pool's allocation (cudaMallocFromPoolAsync)
    pool._allocator = types.SimpleNamespace(malloc=lambda size: pytest.fail("a CUDA call in the forked child"))
    monkeypatch.setattr(_pools._cuda, "rt", lambda: pytest.fail("a CUDA call in the forked child"))
    try:
        with pytest.raises(IpcError, match="forked after its parent initialized CUDA"):
            getattr(pool, call)(*((64,) if call == "malloc" else ()))
    finally:
        pool._pools.pools = {}
