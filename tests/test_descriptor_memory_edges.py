"""Memory shared by descriptor at its edges: an interrupt once mapped, pools the library did not make, handles
that name another producer's token, a freed allocation's handle in its own process, own memory opened on a
peer GPU (over test_pool_housekeeping's stubbed driver)."""
from __future__ import annotations

import os
import types

import pytest
from test_pool_housekeeping import _vmm_driver

from cupy_ipc import _vmm


class _InterruptOnLastRelease:
    """Wraps a _VmmDriver: Ctrl-C arrives while the driver releases the last allocation handle (cuMemRelease),
    the call the `finally` of import_mapping/allocate makes after the mapping exists."""


@pytest.mark.parametrize("what", ["import_mapping", "allocate"])
def test_an_interrupt_in_the_last_handle_release_strands_no_mapping_and_no_descriptor(libcuda, monkeypatch, what):
    d = _vmm_driver(monkeypatch, libcuda, "never")  # nothing interrupted at make time
    real_release = d.cuMemRelease

    def release(handle):
        r = real_release(handle)
        if len(d.released) == 2:  # the second (last) handle released: Ctrl-C raised as the call returns
            raise KeyboardInterrupt
        return r

    d.cuMemRelease = release
    pipes = [os.pipe(), os.pipe()]
    with pytest.raises(KeyboardInterrupt):
        if what == "import_mapping":
            _vmm.import_mapping(1001, [(11, 0x200000), (12, 0x200000)], 0, tuple(r for r, _ in pipes))
        else:
            monkeypatch.setattr(_vmm._reaper, "start", lambda: None)
            monkeypatch.setattr(_vmm, "allocation_prop",
                                lambda device, shareable=True: types.SimpleNamespace(getPtr=lambda: 0))
            _vmm.allocate(0x400000, pieces=2)
    leaked_fds = []
    for r, w in pipes:
        try:
            os.fstat(r)
            leaked_fds.append(r)
        except OSError:
            pass
        os.close(w)
    for r in leaked_fds:
        os.close(r)
    # What the driver made is given back: pieces unmapped, addresses freed, descriptors closed.
    assert sorted(d.unmapped) == sorted(d.mapped), f"mapped {d.mapped}, unmapped {d.unmapped}"
    assert d.freed == d.reserved, f"reserved {d.reserved}, freed {d.freed}"
    if what == "import_mapping":
        assert not leaked_fds, f"descriptors left open: {leaked_fds}"


def test_a_pool_the_library_did_not_create_is_refused_not_cached_by_its_handle(libcuda, monkeypatch):
    """A shareable pool made outside ShareableMemoryPool (cudaMemPoolCreate by the user, RMM, ...) is exported and
    entered in _pools._exports by its handle; nothing removes the entry when the user destroys the pool. Its
    descriptor stays open for the process's life, and a later pool that the driver gives the same handle value is
    exported with the dead pool's descriptor and id."""
    from test_pool_housekeeping import _Driver

    from cupy_ipc import _pools

    d = _Driver()
    d.cuMemPoolExportPointer = lambda ptr: (0, types.SimpleNamespace(getPtr=lambda: id(b"x" * 64)))
    monkeypatch.setattr(_pools, "_driver", lambda: d)
    monkeypatch.setattr(_pools._cuda, "_driver", lambda: d)
    monkeypatch.setattr(_pools, "_exports", {})
    made = []

    def export(out, pool, kind, flags):
        out._obj.value = os.open(os.devnull, os.O_RDONLY)
        made.append(out._obj.value)
        return 0

    libcuda["cuMemPoolExportToShareableHandle"] = export
    H = 0x5000  # the user's own shareable pool (cudaMemPoolCreate, RMM, ...), not a ShareableMemoryPool's
    from cupy_ipc._errors import IpcError

    with pytest.raises(IpcError, match="ShareableMemoryPool"):
        _pools.export(0xA000, H)
    assert not made and _pools._exports == {}  # no descriptor made, none kept past the pool's life


def test_a_handle_naming_another_producers_token_is_not_keyed_as_that_producers_memory(monkeypatch):
    """A VMM handle that names producer P's token (P alive) but another pid and that pid's descriptor is keyed,
    mapped and kept as P's memory: P's own handles of the same run id and size then get the forger's mapping."""

    from cupy_ipc import _array_handle, _mapping
    from cupy_ipc._array_handle import IpcArrayHandle

    token, boot = b"T" * 16, _array_handle.this_process().boot_id
    host = _array_handle.this_process().host

    def handle(pid, fd):
        return IpcArrayHandle(memory_handle=bytes(64), offset=0, allocation_size=2 << 20, shape=(4,), strides=(4,),
                              dtype="float32", device=(0, bytes(16)), producer=(pid, token, boot, host),
                              kind="vmm", fd=fd, resource=1)

    forged, genuine = handle(2002, 9), handle(1001, 5)   # forger's pid and descriptor; the real producer's
    monkeypatch.setattr(_array_handle._segment, "attach", lambda token, pid: types.SimpleNamespace(fd=-1))
    keys = []

    class Stop(Exception):
        pass

    def acquire(key, *args):
        keys.append(key)
        raise Stop

    monkeypatch.setattr(_mapping, "acquire", acquire)
    for h in (forged, genuine):
        with pytest.raises(Stop):
            h._mapped(0, 0, types.SimpleNamespace(ptr=0), 0)
    assert keys[0] != keys[1], f"one mapping key for both producers: {keys[0]}"


def test_own_virtual_memory_freed_since_its_export_is_said_freed_not_forged(monkeypatch):
    """In the exporting process, a handle whose virtual memory has been freed (its pin ended, the sweep closed its
    descriptors) is refused as 'forged or corrupt' (HandleError, a ValueError), where the same stale handle of
    cudaMalloc or pool memory gets IpcError 'exported that memory and has since freed it'."""
    from cupy_ipc import _array_handle, _vmm
    from cupy_ipc._array_handle import IpcArrayHandle
    from cupy_ipc._errors import HandleError

    me = _array_handle.this_process()
    h = IpcArrayHandle(memory_handle=bytes(64), offset=0, allocation_size=2 << 20, shape=(4,), strides=(4,),
                       dtype="float32", device=(0, bytes(16)), producer=(me.pid, me.token, me.boot_id, me.host),
                       kind="vmm", fd=7, resource=3)
    monkeypatch.setattr(_vmm, "_by_fd", {})  # the sweep closed the descriptors of the freed allocation
    from cupy_ipc._errors import IpcError

    with pytest.raises(IpcError, match="has since freed it") as e:
        _array_handle._check_still_allocated(h._f.base_ptr, h._f.buffer_id, h._f)
    assert not isinstance(e.value, HandleError)


@pytest.mark.parametrize("kind", ["pool", "vmm"])
def test_own_pool_or_virtual_memory_opened_on_a_peer_gpu_is_made_accessible_there(monkeypatch, kind):
    """open(device=1) in the exporting process (or by default with GPU 1 current, or an array sent back by a
    relay) of its own GPU-0 pool / virtual memory: peer access (cudaDeviceEnablePeerAccess) does not apply to
    either kind; only cuMemPoolSetAccess / cuMemSetAccess makes them readable from GPU 1."""
    from cupy_ipc import _array_handle, _cuda, _keepalive, _mapping, _pools
    from cupy_ipc._array_handle import IpcArrayHandle

    me = _array_handle.this_process()
    h = IpcArrayHandle(memory_handle=bytes(64), offset=0, allocation_size=2 << 20, shape=(4,), strides=(4,),
                       dtype="float32", device=(0, bytes(16)), producer=(me.pid, me.token, me.boot_id, me.host),
                       kind=kind, fd=7, resource=3)
    f = h._f
    monkeypatch.setattr(_keepalive, "lookup", lambda export_id: (object(), (f.base_ptr, f.allocation_size,
                                                                           f.buffer_id)))
    object.__setattr__(h, "_f", f._replace(export_id=5))
    granted = []
    monkeypatch.setattr(_cuda, "enable_peer_access", lambda d, p: granted.append(("peer", d, p)))
    driver = types.SimpleNamespace(
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=0),
        cuMemPoolSetAccess=lambda pool, descs, n: (granted.append(("pool", descs)), (0,))[1],
        cuMemSetAccess=lambda ptr, size, descs, n: (granted.append(("vmm", descs)), (0,))[1])
    monkeypatch.setattr(_cuda, "_driver", lambda: driver)
    monkeypatch.setattr(_cuda, "access_desc", lambda device: device)
    monkeypatch.setattr(_pools, "pool_of", lambda ptr: 0x9001)
    monkeypatch.setattr(_pools, "_access", set())
    monkeypatch.setattr(_array_handle._segment, "attach", lambda token, pid: types.SimpleNamespace(fd=-1))

    class Stop(Exception):
        pass

    def acquire(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(_mapping, "acquire", acquire)
    with pytest.raises(Stop):
        h._mapped(1, 0, types.SimpleNamespace(ptr=0), 1)  # mapped on GPU 1, the memory on GPU 0
    assert (kind, [1]) in granted, f"only {granted}: GPU 1 gets no access to the {kind} memory it will read"
