"""An open that fails once the consumer has claimed the export, without a GPU: the steps that need one are
stubbed. The failure must let go of the claim's lock at once (held, it pins the producer's memory) and leave
no count of opens (counted, the failed open takes the place of one of the export's consumers: the producer's
next sweep ends a one-consumer export, and a retry is refused)."""

from __future__ import annotations

import collections
import gc
import os
import secrets
import sys

import pytest

from cupy_ipc import HandleError, IpcArrayHandle, IpcError, _array_handle, _cuda, _keepalive, _mapping, _segment
from cupy_ipc._identity import this_process
from cupy_ipc._segment import ONE_CONSUMER, PINNED, Segment, in_use
from cupy_ipc._wire import FLAG_EVENT, FLAG_KEEPALIVE

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux segments")

MAPPED_AT = 0xA000  # where the stubbed import maps the producer's memory


class _Stream:
    ptr = 0x5EED  # not a default stream, whose release would ask the driver for the current GPU


def _in_use(seg: Segment, slot: int) -> bool:
    """Whether a consumer (another open file than ``seg``, the producer's) holds the slot's in-use lock."""
    return seg.held_by_other(in_use(slot))


# --- the consumer's table: acquire(), then opened() or abandon() -------------------------------------------------
@pytest.fixture
def opens(monkeypatch):
    """Opens of this process's exports through a consumer's own open file of its segment, with the steps that
    need a GPU stubbed: the import of the memory (raises the errors queued in ``failures``, else maps at
    ``MAPPED_AT``), the unmap (recorded) and the stream query of a release (idle)."""
    token = this_process().token
    _segment.own_segment(token)  # the producer's, made by its first export
    consumer = Segment.attach(token, pid=os.getpid())
    failures: list[BaseException] = []
    unmapped: list[int] = []

    def import_(device, memory_handle, allocation_size, origin=None):
        if failures:
            raise failures.pop(0)
        m = _mapping._Mapping(MAPPED_AT, device, imported=True)
        m.size = allocation_size
        return m

    monkeypatch.setattr(_mapping, "_import", import_)
    monkeypatch.setattr(_mapping._Mapping, "unmap", lambda m: unmapped.append(m.ptr))
    monkeypatch.setattr(_cuda, "stream_idle", lambda ptr: True)

    def acquire(export_id: int, slot: int):
        return _mapping.acquire((0, "legacy", bytes(64), token, export_id), 0, bytes(64), 64, None, None, consumer,
                                token, os.getpid(), export_id, slot, _Stream(), 0, 0, None, False)

    yield acquire, failures, unmapped
    consumer.close()


def _pin(consumers: int) -> tuple[int, int, Segment]:
    """An export of this process awaiting ``consumers`` (no memory, no ordering event): its id and slot, and the
    producer's segment."""
    export_id, slot, *_ = _keepalive.pin(None, (0, 64, 0), 0, consumers, None, None, ((16,), "float32"))
    return export_id, slot, _segment.own_segment(this_process().token)


@pytest.mark.parametrize("consumers", [1, 2])
def test_an_open_whose_import_fails_leaves_its_export_to_a_retry(opens, consumers):
    acquire, failures, unmapped = opens
    export_id, slot, own = _pin(consumers)
    try:
        failures.append(IpcError("opening the memory handle failed: cudaErrorMapBufferObjectFailed"))
        with pytest.raises(IpcError, match="cudaErrorMapBufferObjectFailed"):
            acquire(export_id, slot)
        assert (own.opens(slot), _in_use(own, slot)) == (0, False)
        assert (this_process().token, slot) not in _mapping._claims
        _keepalive.sweep()
        assert _keepalive.lookup(export_id) is not None, "the failed open ended the export"
        _, lease = acquire(export_id, slot)  # the retry
        _mapping.opened(lease)
        assert (own.opens(slot), _in_use(own, slot)) == (1, True)
        del lease  # released at once: its stream is idle
        _mapping.settle_closes()  # (the mapping's close is the closer thread's)
        assert unmapped == [MAPPED_AT] and not _in_use(own, slot)
        _keepalive.sweep()
        # The retry was the one consumer; of two, the other is still awaited.
        assert (_keepalive.lookup(export_id) is None) == (consumers == 1)
    finally:
        _keepalive.release(export_id)


def test_an_open_that_fails_after_its_import_lets_go_of_it_at_once(opens, monkeypatch):
    # Failing later (opening the ordering event, say), the open abandons its lease: unmapped and unclaimed now,
    # not when the exception's traceback (which holds the lease) goes, and uncounted; the lease then releases
    # nothing more when collected.
    acquire, _, unmapped = opens
    export_id, slot, own = _pin(1)
    try:
        _, lease = acquire(export_id, slot)
        assert _in_use(own, slot)
        _mapping.abandon(lease)
        _mapping.settle_closes()  # (the mapping's close is the closer thread's)
        assert (own.opens(slot), _in_use(own, slot), unmapped) == (0, False, [MAPPED_AT])
        assert (this_process().token, slot) not in _mapping._claims
        released = []
        monkeypatch.setattr(_mapping, "_release", lambda *args: released.append(args))
        del lease
        gc.collect()
        assert released == []
        _keepalive.sweep()
        assert _keepalive.lookup(export_id) is not None
    finally:
        _keepalive.release(export_id)


@pytest.mark.parametrize("consumers", [1, 2])
def test_opens_that_share_a_claim_count_once_whichever_of_them_fails(opens, consumers):
    # Two threads of one consumer open one export: they share its claim, and its one count. The one that
    # fails, before or after the other succeeds, must not take that count (or the lock) from it.
    acquire, _, _ = opens
    export_id, slot, own = _pin(consumers)
    try:
        _, failing = acquire(export_id, slot)
        _, ok = acquire(export_id, slot)
        _mapping.opened(ok)
        _mapping.abandon(failing)
        assert (own.opens(slot), _in_use(own, slot)) == (1, True)
        _, again = acquire(export_id, slot)  # a third open while the claim lives: not a new consumer
        _mapping.opened(again)
        assert own.opens(slot) == 1
        del ok, again
        assert not _in_use(own, slot)
        _keepalive.sweep()
        assert (_keepalive.lookup(export_id) is None) == (consumers == 1)
    finally:
        _keepalive.release(export_id)


# --- IpcArrayHandle.open() over a stubbed CUDA runtime -----------------------------------------------------------
class _Runtime:
    """The runtime calls an open and a release make; ``ipcOpenMemHandle`` raises while ``failing``."""

    cudaIpcMemLazyEnablePeerAccess = 1

    def __init__(self) -> None:
        self.failing = False
        self.closed: list[int] = []

    def getDevice(self) -> int:
        return 0

    def ipcOpenMemHandle(self, handle: bytes, flags: int) -> int:
        if self.failing:
            from cupy_backends.cuda.api.runtime import CUDARuntimeError

            raise CUDARuntimeError(205)  # cudaErrorMapBufferObjectFailed
        return MAPPED_AT

    def ipcCloseMemHandle(self, ptr: int) -> None:
        self.closed.append(ptr)

    def streamQuery(self, ptr: int) -> int:
        return 0

    def eventQuery(self, ptr: int) -> int:
        return 0


class _Event:
    _ptr = 0xE0

    def query(self) -> bool:
        return True


@pytest.fixture(params=["common", "general"])
def sender(request, monkeypatch, libcuda):
    """Another producer (a segment of its own, made here) and a handle of an export of its ``cudaMalloc``
    memory, with an ordering event; opened through the common path or the general one. Returns the handle,
    the producer's segment, the stubbed runtime, and the list of ordering-event errors to raise."""
    import cupy

    me = this_process()
    token, uuid = secrets.token_bytes(16), secrets.token_bytes(16)
    producer = Segment.create(token)
    producer.write(0, 7, PINNED | ONE_CONSUMER)
    base = IpcArrayHandle(memory_handle=secrets.token_bytes(64), offset=0, allocation_size=64, shape=(16,),
                          strides=(4,), dtype="float32", device=(0, uuid),
                          producer=(os.getpid(), token, me.boot_id, me.host))
    f = base._f._replace(flags=FLAG_KEEPALIVE | FLAG_EVENT, export_id=7, slot=0, event_handle=bytes(range(64)),
                         base_ptr=0x7000, buffer_id=1)
    handle = IpcArrayHandle._make(f)
    runtime = _Runtime()
    event_errors: list[BaseException] = []

    def open_cached(event_handle, device, producer):
        if event_errors:
            raise event_errors.pop(0)
        return _Event()

    monkeypatch.setattr(_cuda, "rt", lambda: runtime)
    monkeypatch.setattr(_cuda, "close_ipc_mapping", lambda ptr, device: runtime.ipcCloseMemHandle(ptr))
    monkeypatch.setattr(_cuda, "address_range", lambda ptr: (ptr, 64))  # the driver's size of the mapping
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *args: _Stream())
    monkeypatch.setattr(_array_handle, "open_cached", open_cached)
    monkeypatch.setattr(_mapping, "_idle", collections.OrderedDict())  # this test's own tables of mappings
    monkeypatch.setattr(_mapping, "_released", collections.OrderedDict())
    if request.param == "common":
        monkeypatch.setitem(_cuda._ordinals, uuid, 0)
    else:  # an unknown GPU sends it to the general path, which looks it up
        monkeypatch.setattr(_cuda, "ordinal_of_uuid", lambda u: 0)
    try:
        yield handle, producer, runtime, event_errors
    finally:
        _mapping.collect_idle()  # through the stubs
        seg = _segment._attached.pop(token, None)
        if seg is not None:
            seg.close()
        producer.close(unlink=True)


def _failing(step: str, handle: IpcArrayHandle, runtime: _Runtime, event_errors: list[BaseException]):
    """Make an open of ``handle`` fail at ``step``: ``(the handle to open, the error it raises)``."""
    if step == "import":
        runtime.failing = True
    elif step == "size":  # a corrupt copy of the handle, which claims more memory than the driver maps
        return IpcArrayHandle._make(handle._f._replace(allocation_size=128)), HandleError
    else:
        event_errors.append(IpcError("opening the producer's ordering event failed: cudaErrorMapBufferObjectFailed"))
    return handle, IpcError


@pytest.mark.parametrize("step", ["import", "size", "event"])
def test_a_handle_whose_open_fails_after_its_claim_opens_on_a_retry(sender, step):
    handle, producer, runtime, event_errors = sender
    bad, error = _failing(step, handle, runtime, event_errors)
    with pytest.raises(error) as failed:
        bad.open()
    # Checked while the error, and with it the failed open's frames, is still held.
    assert failed.value is not None
    assert (producer.opens(0), _in_use(producer, 0)) == (0, False)
    _mapping.settle_closes()  # (the mapping's close is the closer thread's)
    assert runtime.closed == ([] if step == "import" else [MAPPED_AT])  # what it mapped is unmapped
    assert not _mapping._idle
    runtime.failing = False
    arr = handle.open()  # the retry
    assert arr.data.ptr == MAPPED_AT and arr.shape == (16,)
    assert (producer.opens(0), _in_use(producer, 0)) == (1, True)
    handle.close()
    del arr
    assert (producer.opens(0), _in_use(producer, 0)) == (1, False)
    # Released once: unmapped, not kept idle as a buffer sent again.
    _mapping.settle_closes()
    assert runtime.closed[-1] == MAPPED_AT and not _mapping._idle


@pytest.mark.parametrize("step", ["import", "size", "event"])
def test_a_failed_open_that_is_not_retried_counts_so_the_producer_lets_the_memory_go(sender, step):
    # A message's open (cupy_ipc.multiprocessing) is its last try: failed, it still ends the producer's wait.
    handle, producer, runtime, event_errors = sender
    bad, error = _failing(step, handle, runtime, event_errors)
    with pytest.raises(error):
        bad._open(last_try=True)
    assert (producer.opens(0), _in_use(producer, 0)) == (1, False)
    assert not _mapping._idle and not _mapping._claims


@pytest.mark.parametrize("word", [False, True], ids=["event alone", "with a word"])
def test_a_failed_open_keeps_the_producers_segment_only_where_a_stream_may_wait_on_its_words(sender, monkeypatch,
                                                                                           word):
    # Every open that failed once claimed kept its producer's segment (descriptors, a file, registered memory)
    # for the rest of the process, also where no stream could be waiting on the segment's words.
    from cupy_ipc import _words
    from cupy_ipc._wire import FLAG_WORD

    handle, producer, runtime, event_errors = sender
    monkeypatch.setattr(_words, "_parked", {})
    if word:
        handle = IpcArrayHandle._make(handle._f._replace(flags=handle._f.flags | FLAG_WORD))
    event_errors.append(IpcError("opening the producer's ordering event failed: cudaErrorMapBufferObjectFailed"))
    with pytest.raises(IpcError):
        handle.open()
    assert [seg.path for seg in _words._parked.values()] == ([producer.path] if word else [])


def test_a_message_whose_open_fails_before_its_claim_counts_too(sender, monkeypatch):
    # The producer's GPU not visible here (another CUDA_VISIBLE_DEVICES) fails the open before it claims the
    # export: uncounted, the message left the producer's memory pinned for the life of the producer.
    handle, producer, runtime, event_errors = sender

    def not_visible(uuid):
        raise HandleError("the GPU with that UUID is not visible to this process")

    monkeypatch.setattr(_cuda, "_ordinals", {})
    monkeypatch.setattr(_cuda, "ordinal_of_uuid", not_visible)
    with pytest.raises(HandleError, match="not visible"):
        handle._open(last_try=True)
    assert (producer.opens(0), _in_use(producer, 0)) == (1, False)
    assert not _mapping._claims
    with pytest.raises(HandleError, match="not visible"):
        handle.open()  # an open that may be retried counts nothing
    assert producer.opens(0) == 1


def test_a_message_whose_open_is_interrupted_before_its_claim_counts_too(sender, ctrl_c_while_locked):
    # Ctrl-C while the open waited for the library's lock (another thread's import holds it while it waits for a
    # close): the open counted as claimed though it had claimed nothing, so nothing counted it, and the message
    # left the producer's memory pinned for the life of the producer.
    handle, producer, runtime, event_errors = sender
    with ctrl_c_while_locked():
        handle._open(last_try=True)
    assert (producer.opens(0), _in_use(producer, 0)) == (1, False)
    assert not _mapping._claims


def test_an_open_whose_view_of_the_producer_cannot_be_remapped_raises_ipc_error_and_opens_on_a_retry(sender,
                                                                                                  monkeypatch):
    # The producer grew its segment for an export after this process mapped it: the open remaps its view to
    # reach the export's slot. A map that failed there (no memory, or too many maps) escaped as an OSError.
    import errno
    import mmap
    import types

    handle, producer, _, _ = sender
    _segment.attach(producer.token, os.getpid())  # mapped before the producer grew it
    producer.write(5000, 8, PINNED | ONE_CONSUMER)
    later = IpcArrayHandle._make(handle._f._replace(export_id=8, slot=5000))

    def no_map(*args):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(_segment, "mmap", types.SimpleNamespace(mmap=no_map))
    with pytest.raises(IpcError, match="cannot remap the segment .*Cannot allocate memory"):
        later.open()
    assert (producer.opens(5000), _in_use(producer, 5000)) == (0, False)
    assert not _mapping._claims
    monkeypatch.setattr(_segment, "mmap", mmap)
    arr = later.open()  # the retry
    assert (producer.opens(5000), _in_use(producer, 5000)) == (1, True)
    later.close()
    del arr
    assert not _in_use(producer, 5000)


def test_a_message_whose_open_fails_after_a_counted_open_of_its_export_counts_once(sender):
    # Several consumers may open one export: a second, failed open of this process counts no second time.
    handle, producer, runtime, event_errors = sender
    producer.write_state(0, PINNED)  # an export for several consumers, whose count must be exact
    arr = handle.open()
    assert producer.opens(0) == 1
    runtime.failing = True
    with pytest.raises(IpcError):
        IpcArrayHandle._make(handle._f._replace(allocation_size=128))._open(last_try=True)
    assert producer.opens(0) == 1
    del arr
    handle.close()
    gc.collect()
    assert not _mapping._claims


# --- pools and virtual memory ----------------------------------------------------------------------------------
def test_a_failed_open_of_a_pool_buffer_sent_again_lets_go_of_its_claim(monkeypatch):
    # A pool import's idle mapping keeps its last user's claim (the producer must not free the memory while
    # it is mapped). A failed open must not leave its mapping idle with that claim: the export would stay
    # pinned, and open after the producer's release().
    token = this_process().token
    _segment.own_segment(token)
    consumer = Segment.attach(token, pid=os.getpid())
    unmapped: list[int] = []
    monkeypatch.setattr(_mapping._Mapping, "unmap", lambda m: unmapped.append(m.ptr))
    monkeypatch.setattr(_cuda, "stream_idle", lambda ptr: True)
    monkeypatch.setattr(_cuda, "address_range", lambda ptr: (ptr, 64))
    monkeypatch.setattr(_mapping, "_idle", collections.OrderedDict())
    monkeypatch.setattr(_mapping, "_released", collections.OrderedDict())
    importer = (lambda: MAPPED_AT, lambda ptr: None, 0)

    def acquire(export_id, slot):  # the same pool allocation each time
        return _mapping.acquire((0, "pool", token, 1, 9), 0, bytes(64), 64, None, None, consumer, token,
                                os.getpid(), export_id, slot, _Stream(), 0, 0, importer, True)

    first, slot1, own = _pin(1)
    second = None
    try:
        _, lease = acquire(first, slot1)  # sent once, opened and released: remembered as released here
        _mapping.opened(lease)
        del lease
        assert unmapped == [MAPPED_AT]
        second, slot2, _ = _pin(1)  # sent again
        _, lease = acquire(second, slot2)
        _mapping.abandon(lease)  # its open failed (the ordering event, say)
        assert (own.opens(slot2), _in_use(own, slot2)) == (0, False)
        assert unmapped == [MAPPED_AT, MAPPED_AT] and not _mapping._idle and not _mapping._claims
        _keepalive.release(second)
        assert _keepalive.lookup(second) is None
        with pytest.raises(IpcError, match="no longer shares this memory"):
            acquire(second, slot2)
    finally:
        for export_id in (first, second):
            if export_id is not None:
                _keepalive.release(export_id)
        _mapping.collect_idle()
        consumer.close()


def test_a_vmm_handle_received_with_its_descriptors_has_them_again_for_a_retry(sender, monkeypatch):
    # The open hands the importer copies: a retry after a failure (which closed the first copies with the
    # mapping) gets the descriptors again, rather than taking them with pidfd_getfd, which ptrace rules may
    # refuse where they came over a socket.
    from cupy_ipc import _vmm
    from cupy_ipc._wire import Kind

    handle, producer, runtime, event_errors = sender
    f = handle._f._replace(kind=Kind.VMM, fd=42, resource=3)
    vmm = IpcArrayHandle._make(f)
    r, w = os.pipe()
    os.close(w)
    vmm._adopt_descriptors([r])  # as recv_handle does
    given: list[tuple[int, ...] | None] = []

    def import_mapping(pid, pieces, device, fds):
        given.append(fds)
        if fds is None:
            raise IpcError("pidfd_getfd refused")
        for fd in fds:
            os.close(fd)  # the mapping's own copies, closed with it
        return MAPPED_AT

    monkeypatch.setattr(_vmm, "import_mapping", import_mapping)
    monkeypatch.setattr(_vmm, "unmap", lambda ptr, sizes: None)
    monkeypatch.setattr(_cuda, "ordinal_of_uuid", lambda u: 0)
    monkeypatch.setattr(_cuda, "current_device", lambda: 0)
    event_errors.append(IpcError("opening the producer's ordering event failed"))
    with pytest.raises(IpcError, match="ordering event"):
        vmm.open()
    arr = vmm.open()  # the retry
    assert arr.data.ptr == MAPPED_AT and len(given) == 2 and None not in given
    vmm.close()  # and with it the handle's own descriptors
    del arr
    assert vmm._fd is None
    with pytest.raises(OSError):
        os.fstat(r)
