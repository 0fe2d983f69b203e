"""The consumer's table of imported pools, without a GPU: the driver calls are stubbed and recorded.

The driver imports a pool once per process: every descriptor of one pool gives the same handle (seen on an
H200), and destroying it destroys it for all of them. A pool that reaches a consumer from its producer and,
sent on, from another process is one handle under two keys; each import of one allocation gives one pointer.
The GPU test of the same case is in test_gpu_pools.py.
"""

from __future__ import annotations

import pytest

from cupy_ipc import _pools
from cupy_ipc._errors import ProducerExitedError

POOL = 0x9001
A, B = (b"a" * 16, 1), (b"b" * 16, 7)  # (producer token, pool id): the producer's key, and a relay's


class _Driver:
    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self) -> None:
        self.destroyed: list[int] = []
        self.freed: list[int] = []

    def cuMemPoolDestroy(self, pool):  # noqa: N802 - the driver's name
        self.destroyed.append(int(pool))
        return (0,)

    def cuMemFree(self, ptr):  # noqa: N802
        self.freed.append(ptr)
        return (0,)


@pytest.fixture
def driver(monkeypatch):
    d = _Driver()
    monkeypatch.setattr(_pools, "_driver", lambda: d)
    monkeypatch.setattr(_pools._cuda, "_driver", lambda: d)  # for _cuda.check
    monkeypatch.setattr(_pools._fdserver, "retire", lambda fds: None)
    for name in ("_imports", "_live", "_pointer_pool", "_exports"):
        monkeypatch.setattr(_pools, name, {})
    monkeypatch.setattr(_pools, "_access", {(POOL, 0)})
    _pools._imports[A] = (POOL, 101, 1001)
    _pools._imports[B] = (POOL, 102, 1002)  # the same pool, imported again from the relay's descriptor
    return d


def _exited(*keys):
    def attach(token, pid):
        if any(token == k[0] for k in keys):
            raise ProducerExitedError("gone", pid=pid)

    return attach


def test_a_relay_that_exits_lets_go_of_its_key_but_not_of_the_pool_its_producer_still_shares(driver, monkeypatch):
    monkeypatch.setattr(_pools._segment, "attach", _exited(B))
    assert _pools.release_exited() == 1
    assert list(_pools._imports) == [A] and driver.destroyed == []
    assert (POOL, 0) in _pools._access  # the handle lives on: its access stays given
    monkeypatch.setattr(_pools._segment, "attach", _exited(A, B))
    assert _pools.release_exited() == 1
    assert _pools._imports == {} and driver.destroyed == [POOL] and not _pools._access


def test_one_allocation_imported_under_both_keys_is_counted_under_each(driver, monkeypatch):
    # The same pointer for both imports: each key counts one live pointer until its mapping lets go of it.
    ptr = 0xB000
    for key in (A, B):
        _pools._live_change(key, 1)
        _pools._pointer_pool.setdefault(ptr, []).append(key)
    _pools.free_imported(ptr)
    assert driver.freed == [] and sum(_pools._live.values()) == 1  # still mapped for the other
    _pools.free_imported(ptr)
    assert driver.freed == [ptr] and _pools._live == {} and _pools._pointer_pool == {}
    monkeypatch.setattr(_pools._segment, "attach", _exited(A, B))
    assert _pools.release_exited() == 2 and driver.destroyed == [POOL]  # once, for both keys
