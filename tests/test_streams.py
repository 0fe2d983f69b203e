"""Streams and GPUs of an export, over a stubbed two-GPU CUDA runtime (no GPU needed): which stream the
ordering event goes on, and the errors of a stream of another GPU. The GPU tests cover one GPU for real."""

from __future__ import annotations

import collections
import gc
import threading
import types

import pytest

from cupy_ipc import IpcError, _array_handle, _cuda, _keepalive, _mapping, _reaper, _words

STREAMS = {0: 0xA0, 1: 0xB1}  # each GPU's current CuPy stream (CuPy keeps one per device)
DEVICE_OF = {0xA0: 0, 0xB1: 1}


class _Runtime:
    eventInterprocess, eventDisableTiming, eventBlockingSync = 4, 2, 1

    def __init__(self) -> None:
        self.device = 0
        self.busy: set[int] = set()
        self.recorded: list[tuple[int, int]] = []
        self.synchronized: list[int] = []
        self.events = 0

    def getDevice(self) -> int:
        return self.device

    def setDevice(self, d: int) -> None:
        self.device = d

    def ipcGetMemHandle(self, base: int) -> bytes:
        return base.to_bytes(8, "little") * 8

    def streamQuery(self, ptr: int) -> int:
        return 600 if ptr in self.busy else 0  # cudaErrorNotReady

    def streamSynchronize(self, ptr: int) -> None:
        self.synchronized.append(ptr)
        self.busy.discard(ptr)

    def eventQuery(self, ev: int) -> int:
        return 600 if self.recorded and self.recorded[-1][0] == ev and self.recorded[-1][1] in self.busy else 0

    def eventCreateWithFlags(self, flags: int) -> int:
        self.events += 1
        return 0xE00000 + (self.device << 16) + self.events  # (an event of the current GPU)

    def eventRecord(self, ev: int, stream: int) -> None:
        from cupy_backends.cuda.api.runtime import CUDARuntimeError

        if DEVICE_OF.get(stream, self.device) != (ev - 0xE00000) >> 16:  # CUDA: event and stream of one context
            raise CUDARuntimeError(400)  # cudaErrorInvalidResourceHandle
        self.recorded.append((ev, stream))

    def ipcGetEventHandle(self, ev: int) -> bytes:
        return ev.to_bytes(8, "little") * 8

    def eventDestroy(self, ev: int) -> None:
        pass


@pytest.fixture
def gpus(monkeypatch, libcuda):
    import cupy

    runtime = _Runtime()
    monkeypatch.setattr(_cuda, "rt", lambda: runtime)
    monkeypatch.setattr(_cuda, "device_uuid", lambda d: bytes([d + 1]) * 16)
    monkeypatch.setattr(_cuda, "legacy_info", lambda ptr: (ptr & ~0xFFF, 0x1000, 7 + (ptr >> 20)))
    monkeypatch.setattr(cupy.cuda, "get_current_stream",
                        lambda device_id=-1: type("S", (), {"ptr": STREAMS[runtime.device if device_id < 0
                                                                             else device_id]})())
    for name, value in (("_by_array", _array_handle._ById()), ("_layouts", {}), ("_handle_cache", {}),
                        ("_exported", collections.OrderedDict()), ("_device_ids", {})):
        monkeypatch.setattr(_array_handle, name, value)
    monkeypatch.setattr(_keepalive, "_event_pool", {})
    # The pins made here hold fake events, which a later sweep (cupy_ipc.collect) would hand to the real driver
    # (on a GPU machine: a crash); and no fake stream may reach a real driver's stream write through the words
    # (whose functions _words keeps once looked up, past the libcuda fixture).
    monkeypatch.setattr(_keepalive, "_pins", {})
    monkeypatch.setattr(_words, "disabled", True)
    yield runtime
    for pool in _keepalive._event_pool.values():  # fake events: no destroy with the real runtime
        for ev in pool:
            ev._finalizer.detach()


def _array_on(device: int):
    import cupy

    mem = cupy.cuda.UnownedMemory(0x100000 * (device + 1), 0x1000, None, device)
    return cupy.ndarray((16,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))


def test_default_stream_is_the_arrays_gpus_current_stream(gpus):
    # Work on the array is still queued on GPU 1's current stream; the caller's current GPU is 0, whose
    # stream is idle. The export must order the consumer after GPU 1's stream.
    a = _array_on(1)
    gpus.busy.add(STREAMS[1])
    h = _array_handle.get_ipc_handle(a)
    try:
        assert h.synced, "no ordering event: the consumer may read the array while GPU 1 still writes it"
        assert gpus.recorded and gpus.recorded[-1][1] == STREAMS[1]
    finally:
        h.release()


def test_work_on_the_current_gpus_stream_is_not_the_arrays(gpus):
    # The current GPU's stream was asked, and its event recorded there failed with a hint that the producer
    # had freed the memory.
    a = _array_on(1)
    gpus.busy.add(STREAMS[0])
    h = _array_handle.get_ipc_handle(a)
    assert not h.synced and not gpus.recorded
    assert gpus.synchronized == [STREAMS[0]]  # CuPy's kernels on the array may have run there: waited for
    h.release()


def test_an_explicit_stream_of_another_gpu_is_refused_clearly(gpus, monkeypatch):
    import cupy_ipc

    monkeypatch.setattr(_cuda, "stream_device", lambda ptr: DEVICE_OF[ptr])
    a = _array_on(1)
    gpus.busy.add(STREAMS[0])
    s0 = type("S", (), {"ptr": STREAMS[0]})()
    with pytest.raises(IpcError, match="the stream belongs to GPU 0, and the array to GPU 1"):
        _array_handle.get_ipc_handle(a, stream=s0)
    assert not cupy_ipc.pinned()
    gpus.device = 1
    ev = cupy_ipc.IpcEvent()  # of GPU 1
    gpus.device = 0
    ev.record()  # GPU 1's current stream, though GPU 0 is current
    assert gpus.recorded[-1][1] == STREAMS[1]
    with pytest.raises(IpcError, match="the stream belongs to GPU 0, and the event to GPU 1"):
        ev.record(s0)
    ev._finalizer.detach()


@pytest.mark.parametrize("first", ["common", "general"])
@pytest.mark.parametrize("again", [dict(), dict(sync=False), dict(keepalive=False), dict(keepalive=False, sync=False),
                                   dict(consumers=3), dict(lease=60.0)])
def test_a_re_sent_array_carries_its_own_export_part(gpus, first, again):
    from cupy_ipc import IpcArrayHandle

    gpus.device = 0
    gpus.busy.add(STREAMS[0])
    _array_handle.get_ipc_handle(_array_on(0)).release()  # learns the layout: the next array takes the fast path
    a = _array_on(0) if first == "common" else _array_on(0)[::2]
    h1 = _array_handle.get_ipc_handle(a)
    h2 = _array_handle.get_ipc_handle(a, **again)
    for h in (h1, h2):
        assert IpcArrayHandle.from_bytes(h.to_bytes())._f == h._f
    assert h2._f.export_id != h1._f.export_id or not (again.get("keepalive", True) or again.get("sync", True))
    assert h2.keepalive == again.get("keepalive", True)
    assert h2.synced == again.get("sync", True)
    h1.release(), h2.release()


def test_the_gpu_of_a_stream_is_found_on_drivers_before_cuda_12_8(monkeypatch):
    # cuStreamGetDevice came with CUDA 12.8: before, the bindings raise (FunctionNotFoundError, a RuntimeError),
    # which reached IpcEvent.wait(stream) and open(stream=...) as is. The stream's context tells the same.
    calls = []

    class Driver:
        class CUresult:
            CUDA_SUCCESS = 0

        @staticmethod
        def cuStreamGetDevice(ptr):
            raise RuntimeError("function cuStreamGetDevice is not found")

        @staticmethod
        def cuStreamGetCtx(ptr):
            return 0, "context of GPU 1"

        @staticmethod
        def cuCtxPushCurrent(ctx):
            calls.append(("push", ctx))
            return (0,)

        @staticmethod
        def cuCtxGetDevice():
            return 0, 1

        @staticmethod
        def cuCtxPopCurrent():
            calls.append(("pop",))
            return 0, "context of GPU 1"

    monkeypatch.setattr(_cuda, "_driver", lambda: Driver)
    monkeypatch.setattr(_cuda, "rt", lambda: _Runtime())
    assert _cuda.stream_device(0xB1) == 1
    assert calls == [("push", "context of GPU 1"), ("pop",)]


def test_threads_exporting_fresh_and_re_sent_arrays_get_consistent_handles(gpus):
    # Eight threads (queues pickle on their feeder threads), addresses reused, re-sent views: every wire form
    # matches its fields, every export its own number.
    import threading

    import cupy

    from cupy_ipc import IpcArrayHandle

    gpus.busy.add(STREAMS[0])
    shared = [_array_on(0)[i::3] for i in range(3)]
    errors, handles = [], []

    def work() -> None:
        try:
            for k in range(300):
                mem = cupy.cuda.UnownedMemory(0x100000 + 0x1000 * (k % 50), 0x1000, None, 0)
                a = cupy.ndarray((16,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
                for x in (a, shared[k % 3]):
                    h = _array_handle.get_ipc_handle(x)
                    assert IpcArrayHandle.from_bytes(h.to_bytes())._f == h._f
                    assert h._f.base_ptr + h._f.offset == x.data.ptr and h.shape == x.shape
                    handles.append(h)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [h._f.export_id for h in handles]
    for h in handles:
        h.release()
    assert not errors and len(set(ids)) == len(ids)


class _NullStream:
    ptr = 0  # CuPy's Stream.null, the current stream of every GPU unless the user sets one


def test_own_staged_open_waits_on_the_stream_that_copies(gpus, monkeypatch):
    # A process opens its own export on GPU 1 with copy=True (GPU 0 holds the memory), with CuPy's default
    # (legacy) stream current: the producer's event must be waited on by the stream that queues the copy (GPU 1's
    # legacy stream), not by GPU 0's, or the copy may read the array before the producer's kernel wrote it.
    import cupy

    waits, copies = [], []
    gpus.getDeviceCount = lambda: 2
    gpus.streamWaitEvent = lambda s, ev, flags: waits.append((gpus.device, s))
    gpus.memcpyPeerAsync = lambda dst, dd, src, sd, n, s: copies.append((gpus.device, s))
    monkeypatch.setattr(_cuda, "_ordinals", {})
    monkeypatch.setattr(_cuda, "can_access_peer", lambda a, b: a == b)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda device_id=-1: _NullStream)
    monkeypatch.setattr(cupy.cuda, "alloc", lambda n: cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(0x900000, n, None, gpus.device), 0))
    a = _array_on(0)
    busy = [True]  # the producer's kernel is still running on GPU 0's legacy stream
    gpus.streamQuery = lambda ptr: 600 if busy[0] and (gpus.device, ptr) == (0, 0) else 0
    h = _array_handle.get_ipc_handle(a)
    assert h.synced
    b = None
    try:
        b = h.open(device=1, copy=True)
        assert copies == [(1, 0)]
        assert waits and waits[-1] == copies[-1], f"event waited on {waits}, copy queued on {copies}"
    finally:
        busy[0] = False
        del b
        h.close()
        gc.collect()
        h.release()


def test_open_info_of_a_view_of_a_staged_copy_says_it_is_a_copy(gpus, monkeypatch):
    # open_info() answers for "an array that open() returned (or a view of it)": for a view of an array that
    # open(copy=True) returned, it answered None, which says that the array did not come from open() at all.
    import cupy

    from cupy_ipc import OpenInfo, open_info

    gpus.getDeviceCount = lambda: 2
    gpus.streamWaitEvent = lambda s, ev, flags: None
    gpus.memcpyPeerAsync = lambda dst, dd, src, sd, n, s: None
    monkeypatch.setattr(_cuda, "_ordinals", {})
    monkeypatch.setattr(_cuda, "can_access_peer", lambda a, b: a == b)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda device_id=-1: _NullStream)
    monkeypatch.setattr(cupy.cuda, "alloc", lambda n: cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(0x900000, n, None, gpus.device), 0))
    h = _array_handle.get_ipc_handle(_array_on(0))
    b = None
    try:
        b = h.open(device=1, copy=True)
        copied = OpenInfo(device=1, memory_device=0, copied=True)
        infos = [open_info(view) for view in (b, b[1:], b.reshape(4, 4).T)]
        assert infos == [copied] * 3
    finally:
        del b
        h.close()
        gc.collect()
        h.release()


class _PerThreadRuntime:
    """One GPU whose per-thread default stream (handle 2) has work queued on the threads ``busy()`` says, which
    the legacy default stream (handle 1) follows: it has work queued on every thread."""

    def __init__(self, busy, recorded) -> None:
        self.busy = busy
        self.recorded = recorded

    def getDevice(self):
        return 0

    def setDevice(self, d):
        pass

    def streamQuery(self, ptr):
        return 600 if ptr == 1 or ptr == 2 and self.busy() else 0

    def eventRecord(self, ev, stream):
        self.recorded.append((ev, stream))


class _Event:
    ptr = 0xE1


class _Ptds:
    ptr = 2


class _Mapping:
    ptr, imported = 0x1000, True


def _stub_release(monkeypatch, busy):
    """The runtime of :class:`_PerThreadRuntime`; returns the lists of releases made at once, of the waits of
    releases handed to the library's thread and of the events recorded ``(event, stream)``."""
    import cupy

    finished, deferred, recorded = [], [], []
    runtime = _PerThreadRuntime(busy, recorded)
    monkeypatch.setattr(_cuda, "rt", lambda: runtime)
    monkeypatch.setattr(cupy.cuda, "Event", lambda **options: _Event())
    monkeypatch.setattr(_mapping, "_finish", lambda *a, **k: finished.append(a))
    monkeypatch.setattr(_reaper, "later", lambda then, *a, after=None, device=0: deferred.append(after))
    return finished, deferred, recorded


def _ptds_lease():
    return _mapping.Lease(None, ("key",), None, _Ptds(), 0, _Mapping(), b"", 0x1000, 0)


def _on_a_thread(fn):
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_release_of_a_per_thread_stream_is_ordered_on_the_openers_stream(monkeypatch):
    # An array opened on the per-thread default stream (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1) and dropped on
    # another thread: that thread's own per-thread stream is idle, the opener's still reads the memory. The
    # release must not let the producer's memory go at once.
    opener = threading.get_ident()
    finished, deferred, recorded = _stub_release(monkeypatch, lambda: threading.get_ident() == opener)
    box = [_ptds_lease()]
    _on_a_thread(box.clear)  # the last reference: Lease.__del__ runs on that thread
    assert not finished, "released at once: the opener's per-thread stream may still be reading the memory"
    # Ordered by an event of the legacy default stream, which follows the opener's: not by a wait for the whole
    # GPU, which would hold up every later release behind the GPU's other work.
    assert recorded == [(_Event.ptr, 1)]
    assert len(deferred) == 1 and isinstance(deferred[0], _Event)


def test_release_on_the_openers_own_thread_is_ordered_on_its_per_thread_stream(monkeypatch):
    opener = threading.get_ident()
    finished, deferred, recorded = _stub_release(monkeypatch, lambda: threading.get_ident() == opener)
    box = [_ptds_lease()]
    box.clear()
    assert not finished and recorded == [(_Event.ptr, 2)] and len(deferred) == 1


def test_release_on_a_thread_that_took_a_finished_openers_ident_is_still_ordered(monkeypatch):
    # CPython gives a finished thread's ident to a later one: the opener of an array on its per-thread stream
    # exits, its work still queued, and a thread with its ident drops the array. That thread's own per-thread
    # stream is idle; the opener's may still read the memory.
    box = []
    opener = threading.Thread(target=lambda: box.append(_ptds_lease()))
    finished, deferred, recorded = _stub_release(monkeypatch, lambda: threading.current_thread() is opener)
    # The reuse made certain: every thread shows one ident to the module (what it compared before).
    monkeypatch.setattr(_mapping, "threading", types.SimpleNamespace(get_ident=lambda: 0x7F00))
    opener.start()
    opener.join()
    _on_a_thread(box.clear)  # the last reference: Lease.__del__ runs on that thread
    assert not finished, "released at once: the finished opener's per-thread stream may still read the memory"
    assert recorded == [(_Event.ptr, 1)] and len(deferred) == 1  # ordered on the legacy stream, ended later


def test_the_current_stream_passed_explicitly_orders_as_the_default_does(gpus):
    # GPU 0 current, the array on GPU 1: `a[...] = x` queued on GPU 0's legacy stream, and the export given
    # cupy.cuda.get_current_stream() (Stream.null, which names no GPU), which means what no stream means.
    import cupy

    gpus.streamQuery = lambda ptr: 600 if (gpus.device, ptr) == (0, 0) else 0
    synced = []
    gpus.streamSynchronize = lambda ptr: synced.append((gpus.device, ptr))
    h = _array_handle.get_ipc_handle(_array_on(1), stream=cupy.cuda.Stream.null)
    try:
        assert h.synced or (0, 0) in synced, "GPU 0's pending write on the array is not ordered before the consumer"
    finally:
        h.release()


def test_work_queued_on_the_current_gpu_for_an_array_of_another_is_waited_for(gpus):
    # CuPy runs a kernel on the current GPU (0) even for an array of GPU 1 (peer access): `a[...] = x` with GPU 0
    # current queues the write on GPU 0's current stream. The default export orders on GPU 1's stream only,
    # idle here: the handle goes out unordered while the write may still run.
    synced: list[int] = []
    gpus.streamSynchronize = lambda ptr: (synced.append(ptr), gpus.busy.discard(ptr))
    a = _array_on(1)
    gpus.busy.add(STREAMS[0])
    h = _array_handle.get_ipc_handle(a)
    try:
        assert h.synced or STREAMS[0] in synced, "GPU 0's pending write on the array is not ordered before the consumer"
    finally:
        h.release()


class _TorchDefaultStream:
    """What torch.cuda.default_stream(1) is: the legacy stream (handle 0) of a given GPU."""

    cuda_stream = 0
    device_index = 1


def test_waiting_with_a_default_stream_of_another_gpu_orders_that_gpus_stream(gpus):
    import cupy_ipc

    waits = []
    gpus.streamWaitEvent = lambda s, ev, flags: waits.append((gpus.device, s))
    gpus.device = 1
    ev = cupy_ipc.IpcEvent()  # of GPU 1, created here
    gpus.device = 0
    try:
        ev.wait(_TorchDefaultStream())
        assert waits == [(1, 0)], f"GPU 1's default stream was to wait; the waits queued: {waits}"
    finally:
        ev._finalizer.detach()


class _TorchDefaultStreamOfGpu0:
    """What ``torch.cuda.default_stream(0)`` looks like: the legacy handle 0, and the GPU it names."""

    cuda_stream = 0
    device_index = 0


def test_a_default_stream_naming_another_gpu_is_refused_where_the_handle_alone_would_act_on_this_one(
        gpus, monkeypatch):
    # Handle 0 names no GPU: taken alone, it would order the array's GPU's own legacy stream, not the one given.
    import cupy_ipc

    gpus.getDeviceCount = lambda: 2
    monkeypatch.setattr(_cuda, "_ordinals", {})
    a = _array_on(1)
    gpus.busy.add(STREAMS[0])
    with pytest.raises(IpcError, match="the stream belongs to GPU 0, and the array to GPU 1"):
        _array_handle.get_ipc_handle(a, stream=_TorchDefaultStreamOfGpu0())
    assert not cupy_ipc.pinned()
    gpus.device = 1
    ev = cupy_ipc.IpcEvent()
    try:
        with pytest.raises(IpcError, match="the stream belongs to GPU 0, and the event to GPU 1"):
            ev.record(_TorchDefaultStreamOfGpu0())
        assert not gpus.recorded
        h = _array_handle.get_ipc_handle(a, sync=False, keepalive=False)
        with pytest.raises(IpcError, match="the stream belongs to GPU 0, and the array is opened on GPU 1"):
            h.open(device=1, stream=_TorchDefaultStreamOfGpu0())
    finally:
        ev._finalizer.detach()


@pytest.mark.parametrize("block", [4, 0.5, "yes", 0])
def test_an_events_handle_reads_back_whatever_value_set_its_blocking_flag(gpus, block):
    # The event made blocking by any true value, not by True alone: the flag went on the wire as int(block),
    # a flags byte the receiver refuses (4), a non-blocking event's 0 (0.5), or a ValueError in to_bytes().
    import cupy_ipc

    ev = cupy_ipc.IpcEvent(block=block)
    try:
        h = ev.get_ipc_handle()
        assert cupy_ipc.IpcEventHandle.from_bytes(h.to_bytes()) == h
        assert ev.block is h.block is bool(block)
    finally:
        ev._finalizer.detach()


def test_a_re_sent_array_is_ordered_on_the_current_stream_the_test_gives(gpus, monkeypatch):
    # _resend asks for the current stream through _cuda.cupy_names, cached on first use: a stub of
    # cupy.cuda.get_current_stream cached by an earlier test (test_failed_opens' returns stream 0x5EED) answered
    # here instead of this one, and the re-sent array went out unordered though its stream had work queued.
    import cupy

    current = type("S", (), {"ptr": 0xF00D})()  # this test's own current stream of GPU 0
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda device_id=-1: current)
    gpus.busy.add(0xF00D)
    a = _array_on(0)
    handles = [_array_handle.get_ipc_handle(a) for _ in range(4)]  # from the third on: _resend
    try:
        for h in handles:
            assert h.synced, "a re-sent array went out unordered while its current stream has work queued"
        assert [s for _, s in gpus.recorded] == [0xF00D] * 4
    finally:
        for h in handles:
            h.release()
