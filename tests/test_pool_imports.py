"""The consumer's table of imported pools, without a GPU: the driver calls are stubbed and recorded.

The driver imports a pool once per process: every descriptor of one pool gives the same handle (seen on an
H200), and destroying it destroys it for all of them. A pool that reaches a consumer from its producer and,
sent on, from another process is one handle under two keys; each import of one allocation gives one pointer.
The GPU test of the same case is in test_gpu_pools.py.
"""

from __future__ import annotations

import os
import threading

import pytest

from cupy_ipc import _pools
from cupy_ipc._errors import ProducerExitedError

POOL = 0x9001
A, B = (b"a" * 16, 1), (b"b" * 16, 7)  # (producer token, pool id): the producer's key, and a relay's


class _Driver:
    class CUresult:
        CUDA_SUCCESS = 0

    class CUmemAllocationHandleType:
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1

    def __init__(self) -> None:
        self.destroyed: list[int] = []
        self.freed: list[int] = []
        self.calls: list[str] = []
        self.on_destroy = lambda: None

    def cuMemPoolDestroy(self, pool):  # noqa: N802 - the driver's name
        self.on_destroy()
        self.destroyed.append(int(pool))
        self.calls.append("destroy")
        return (0,)

    def cuMemPoolImportFromShareableHandle(self, fd, kind, flags):  # noqa: N802
        self.calls.append("import")
        return 0, POOL  # one handle for every descriptor of the pool

    def cuMemFree(self, ptr):  # noqa: N802
        self.freed.append(ptr)
        return (0,)


@pytest.fixture
def driver(monkeypatch, libcuda):
    d = _Driver()
    monkeypatch.setattr(_pools, "_driver", lambda: d)
    monkeypatch.setattr(_pools._cuda, "_driver", lambda: d)  # for _cuda.check
    d.retired = []
    monkeypatch.setattr(_pools._fdserver, "retire", d.retired.extend)
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


def test_a_mapping_let_go_takes_the_count_off_its_own_key(driver, monkeypatch):
    # One pointer, mapped from the producer's import (A) and the relay's (B). The producer's mapping goes
    # first: A's count drops, not B's, whose mapping still holds the pointer and may still be sent on.
    ptr = 0xB000
    for key in (A, B):
        _pools._live_change(key, 1)
        _pools._pointer_pool.setdefault(ptr, []).append(key)
    _pools.free_imported(ptr, A)
    assert _pools._live == {B: 1}
    monkeypatch.setattr(_pools._segment, "attach", _exited(B))  # the relay exits: B still maps, so it stays
    assert _pools.release_exited() == 0 and _pools.send_on(*B)[0] == 102


def test_what_was_sent_on_with_a_key_gone_keeps_its_descriptor_while_the_pool_lives(driver, monkeypatch):
    _pools._live_change(A, 1)  # an array of A's is alive, and was sent on from here
    sent = _pools.send_on(*B)
    assert _pools.send_on(*A) == sent == (102, sent[1])  # one entry per pool handle: B's descriptor
    monkeypatch.setattr(_pools._segment, "attach", _exited(B))
    assert _pools.release_exited() == 1 and B not in _pools._imports
    assert _pools.exports([102], sent[1]) and 102 not in driver.retired  # still served
    monkeypatch.setattr(_pools._segment, "attach", _exited(A, B))
    _pools._live_change(A, -1)
    assert _pools.release_exited() == 1 and driver.destroyed == [POOL]
    assert sorted(driver.retired) == [101, 102] and not _pools._exports


def test_no_import_lands_between_the_decision_to_destroy_a_pool_and_its_destruction(driver, monkeypatch):
    # The producer (A) has exited; the relay (B) is alive. While collect() destroys the pool, an open of the
    # relay's array imports its descriptor, for which the driver gives the same handle: it must wait until
    # the destruction is done (and get a new import), not be handed the handle about to be destroyed.
    del _pools._imports[B]
    monkeypatch.setattr(_pools._segment, "attach", _exited(A))
    r, w = os.pipe()
    os.close(w)
    opener = threading.Thread(target=_pools._imported_pool, args=(B[0], B[1], 1002, 5, lambda: (r,)))

    def destroying():
        opener.start()
        opener.join(0.2)  # as far as it gets while the pool is being destroyed

    driver.on_destroy = destroying
    assert _pools.release_exited() == 1
    opener.join(5)
    assert driver.calls == ["destroy", "import"] and _pools._imports[B] == (POOL, r, 1002)
    os.close(r)
