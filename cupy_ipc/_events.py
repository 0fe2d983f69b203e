"""Interprocess CUDA events: :class:`IpcEvent` and its picklable :class:`IpcEventHandle`."""

from __future__ import annotations

import collections
import ctypes
import os
import threading
import weakref
from typing import Any

from . import _cuda, _fork, _gates, _segment, _words
from ._errors import ClosedError, HandleError, IpcError, ProducerExitedError, warn_quietly
from ._identity import Producer, this_process
from ._wire import DeviceId, EventFields, pack_event, unpack_event

__all__ = ["IpcEvent", "IpcEventHandle", "export_event", "open_cached", "open_event"]

# Events this process created and shared, by raw CUDA handle: unpickling or
# opening one of them here gives back the original object.
_own: "weakref.WeakValueDictionary[bytes, IpcEvent]" = weakref.WeakValueDictionary()


def _destroy(event: ctypes.c_void_p, device: int) -> None:
    """Destroy the event held in ``event`` once, whoever calls first: its finalizer or a failed open's unwind."""
    try:
        _fork.check()
    except IpcError:  # the parent's event, inherited by a fork: the parent owns it, and the child may not use CUDA
        return
    ptr, event.value = event.value, None  # (no call between: no interrupt is raised there)
    if not ptr:  # an open that made none
        return
    runtime = _cuda.rt()
    try:
        with _cuda.using_device(device):
            runtime.eventDestroy(ptr)
    except Exception as e:  # on the destructor path: never raise
        warn_quietly(f"could not destroy CUDA event 0x{ptr:x}: {e}")


class IpcEvent:
    """A CUDA event that other processes can wait on.

    Timing is disabled, as CUDA requires for interprocess events. An event
    is destroyed when closed or garbage-collected, also one created here
    while other processes still use it (CUDA leaves their waits undefined
    then): keep it as long as any consumer may open or wait on it.

    Args:
        block: Make :meth:`synchronize` sleep instead of spinning
            (``cudaEventBlockingSync``).

    Example:
        >>> import cupy
        >>> ev = IpcEvent()                               # doctest: +SKIP
        >>> ev.record()                                   # doctest: +SKIP
        >>> cupy.cuda.get_current_stream().wait_event(ev) # doctest: +SKIP
        >>> data = ev.get_ipc_handle().to_bytes()         # send to a consumer # doctest: +SKIP
        >>> ev.close()                                    # doctest: +SKIP
    """

    __slots__ = ("_ptr", "_device", "_block", "_handle", "_opened", "_finalizer", "_words", "_words_back",
                 "__weakref__")

    def __init__(self, *, block: bool = False) -> None:
        _fork.check()
        runtime = _cuda.rt()
        flags = runtime.eventInterprocess | runtime.eventDisableTiming
        if block:
            flags |= runtime.eventBlockingSync
        device = _cuda.current_device()
        out = ctypes.c_void_p()  # where the driver writes the event (see _cuda.open_ipc_mapping)
        # Adopted before the create, as an opened event is before its open (see _opened_from).
        self._adopt(out, device, bool(block), None, opened=False)  # its handle's flags byte is 0 or 1
        try:
            _cuda.create_event(flags, device, out)
        except BaseException:  # made, then interrupted: destroyed now, not once this half-made object is collected
            _destroy(out, device)
            raise
        self._ptr = out.value

    @classmethod
    def _opened_from(cls, event_handle: bytes, device: int, block: bool, handle: "IpcEventHandle | None",
                     what: str) -> "IpcEvent":
        """Another process's event, opened on GPU ``device``."""
        ev = cls.__new__(cls)
        out = ctypes.c_void_p()
        ev._adopt(out, device, block, handle, opened=True)  # before the open: its finalizer destroys what it makes
        open_event(event_handle, device, out, what)
        ev._ptr = out.value
        return ev

    def _adopt(self, event: ctypes.c_void_p, device: int, block: bool, handle: "IpcEventHandle | None", *,
               opened: bool) -> None:
        self._ptr = event.value
        self._device = device
        self._block = block
        self._handle = handle
        self._opened = opened
        self._words: "_words.EventWords | None" = None  # once exported, if created here (see _words)
        self._words_back: Any = None  # gives the pair back, once: at close or collection
        self._finalizer = weakref.finalize(self, _destroy, event, device)
        self._finalizer.atexit = False  # the driver frees everything at exit

    @property
    def ptr(self) -> int:
        """The raw ``cudaEvent_t``, for ``cupy.cuda.Stream.wait_event``.

        Record an exported event with :meth:`record` only: consumers' streams
        waiting on its word (see :meth:`wait`) would not see a record made
        through the raw pointer."""
        _fork.check()  # the parent's event: no use in a child forked from it (every method comes through here)
        if not self._finalizer.alive:
            raise ClosedError("this IpcEvent is closed")
        return self._ptr

    @property
    def device(self) -> int:
        """Ordinal of the GPU the event belongs to, in this process."""
        return self._device

    @property
    def block(self) -> bool:
        """Whether a host wait on the event sleeps (blocking synchronization) rather than spins."""
        return self._block

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (every method then raises :class:`ClosedError`)."""
        return not self._finalizer.alive

    @property
    def opened(self) -> bool:
        """True for an event opened from a handle; False for one created here."""
        return self._opened

    def record(self, stream: Any = None) -> None:
        """Record the event on ``stream`` (default: the current stream of the event's GPU), a stream of the
        event's GPU."""
        ptr = self.ptr  # first: it checks for a fork
        stream_ptr = _cuda.stream_ptr(stream, self._device)
        _cuda.check_default_stream_of(stream, stream_ptr, self._device, "the event")
        seg = self._words_segment()
        if seg is not None:  # before the record: a wait that sees the record must find "issued" odd
            _words.mark_unworded_in(seg, self._handle._f.pair - 1)
        try:
            with _cuda.using_device(self._device):  # (a default stream acts on the current GPU)
                def record() -> None:
                    _cuda.call("recording an event", _cuda.rt().eventRecord, ptr, stream_ptr)

                if self._words is not None:  # exported: its consumers' streams wait for its word
                    _words.record_event(self._words, stream_ptr, record)
                else:
                    record()
        except IpcError as e:
            raise _cuda.of_another_gpu(e, stream_ptr, self._device, "the event") from e
        if seg is not None:  # and after: over a value that a record of the producer's may have set meanwhile
            _words.mark_unworded_in(seg, self._handle._f.pair - 1)

    def _words_segment(self) -> Any:
        """For an opened event that has the producer's pair of words, the producer's segment, through whose
        plain view a record made here tells every consumer that its latest record has no word (they poll the
        event then), whether or not this process could register the words with CUDA; else ``None``."""
        if not (self._opened and self._handle is not None and self._handle._f.pair):
            return None
        try:
            return _segment.attach(self._handle.producer.token, self._handle.producer.pid)
        except ProducerExitedError:  # nobody waits for its words any more
            return None

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (default: current) wait for the event on the GPU; the host does not block.

        An event opened from another process can be waited on by streams of
        its own GPU only (measured: a stream of another GPU waiting on it ends
        the process). For such a stream this waits on the host instead.

        For an event created by :class:`IpcEvent` in another process and
        recorded there with :meth:`record`, the stream waits for a word that
        the producer's GPU writes once the work before the latest record is
        done: it goes on as soon as that work is, with no thread of either
        process involved. (Otherwise, for a record made before the event's
        export, on another stream while the last one's work still ran, or by
        a consumer, the library's thread polls the event and releases the
        stream.)

        A stream that waits for an event opened from a handle is released if
        the producer is killed before the event's work has run (which then
        never completes), with a ``RuntimeWarning``; a wait on the host raises
        :class:`ProducerExitedError` then, as does a wait that starts after it.
        """
        _fork.check()  # before asking CUDA for the stream's device
        ptr = _cuda.stream_ptr(stream)
        owner = _cuda.default_stream_device(stream) if ptr in (0, 1, 2) else None  # (torch's default streams)
        self.wait_from(ptr, _cuda.stream_device(ptr) if owner is None else owner)

    def wait_from(self, stream_ptr: int, stream_device: int) -> None:
        """:meth:`wait` for a raw stream of a known GPU (``0``: that GPU's default stream)."""
        ptr = self.ptr  # first: it checks for a fork
        runtime = _cuda.rt()
        producer = self._producer()
        if producer is not None:  # (a wait that the producer's death must not leave stuck)
            seg = self._producer_segment(producer)
            if seg is not None and not self._wait_word(stream_ptr, stream_device, seg, producer.pid):
                _gates.wait_for(self, stream_ptr, stream_device, seg, producer.pid, None)
        elif self._opened and stream_device != self._device:
            _cuda.call("synchronizing an event", runtime.eventSynchronize, ptr)
        else:
            with _cuda.using_device(stream_device):
                _cuda.call("waiting on an event", runtime.streamWaitEvent, stream_ptr, ptr, 0)

    def _wait_word(self, stream_ptr: int, stream_device: int, seg: Any, pid: int) -> bool:
        """Make the stream wait on the GPU for the word the producer's GPU writes once the work before the
        event's latest record is done (see ``_words``), if it writes one; False, nothing done, where not."""
        pair = self._handle._f.pair - 1 if self._handle is not None else -1
        if pair < 0 or stream_device != self._device or _words.disabled:
            return False
        words = _words.of_producer(seg, self._device)
        if words is None:
            return False
        value = _words.event_value(words, pair)
        if value is None:
            return False
        if not value:
            return True  # its work is done
        if not _words.hold(seg):  # (only for a wait queued on its words)
            return False
        with _cuda.using_device(self._device):
            return _gates.wait_word(words, _words.done_word(pair), value, stream_ptr, self._device, seg, pid, None)

    def synchronize(self) -> None:
        """Block the host until the work captured by the last record has finished.

        For an event opened from a handle, this polls the event (and whether
        its producer lives), spinning as CUDA's own synchronize does unless
        the event was made with ``block=True``: then it sleeps between polls.

        Raises:
            ProducerExitedError: The event was opened from a handle, and its
                producer exited before the event's work had run.
        """
        ptr = self.ptr  # first: it checks for a fork
        producer = self._producer()
        if producer is None:
            _cuda.call("synchronizing an event", _cuda.rt().eventSynchronize, ptr)
        elif (seg := self._producer_segment(producer)) is not None:
            with _cuda.using_device(self._device):  # polled: a killed producer's event never completes
                _gates.host_wait(self, seg, producer.pid)

    def _producer(self) -> "Producer | None":
        """The process an event opened from a handle came from (``None`` for one created here)."""
        return self._handle.producer if self._opened and self._handle is not None else None

    def _producer_segment(self, producer: Producer) -> Any:
        """``producer``'s segment, for a wait on the event; ``None`` once the event has completed (no wait).

        Raises:
            ProducerExitedError: The producer has exited before the event's work had run.
        """
        if self.query():
            return None
        try:
            return _segment.attach(producer.token, producer.pid)
        except ProducerExitedError:
            if self.query():  # its work finished just before it exited
                return None
            raise

    def query(self) -> bool:
        """True when the work captured by the last record has finished."""
        ptr = self.ptr  # first: it checks for a fork
        # CuPy's eventQuery returns the status, raising for none: an error is no "not finished yet".
        status = _cuda.call("querying an event", _cuda.rt().eventQuery, ptr)
        if status == 0:
            return True
        if status == _cuda.NOT_READY:
            return False
        raise _cuda._translated("querying an event", _cuda._runtime_error()(status))

    def get_ipc_handle(self) -> "IpcEventHandle":
        """The handle another process opens this event with."""
        return self._export(True)

    def _export(self, words: bool) -> "IpcEventHandle":
        """:meth:`get_ipc_handle`; with ``words`` (not for the library's pooled ordering events, which it records
        itself), the first export of an event created here takes a pair of words for it (see ``_words``)."""
        ptr = self.ptr  # (which checks for a fork, also when the handle was made before it)
        if self._handle is None:
            ew = None
            if words and not self._opened:
                ew = _words.take_pair(_segment.own_segment(this_process().token), self._device)
            try:
                self._handle = export_event(ptr, self._device, self._block, 0 if ew is None else ew.pair + 1)
            except BaseException:
                if ew is not None:
                    _words.give_back(ew)
                raise
            if ew is not None:
                self._words = ew
                self._words_back = weakref.finalize(self, _words.give_back, ew)
                self._words_back.atexit = False
            _own[self._handle.event_handle] = self
        return self._handle

    def close(self) -> None:
        """Destroy the event. Idempotent.

        In a child forked from the process that has it, only marks it closed: the event is the parent's.
        """
        self._finalizer()
        if self._words_back is not None:
            self._words_back()

    def __enter__(self) -> "IpcEvent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_open_event, (self.get_ipc_handle().to_bytes(),))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"ptr=0x{self._ptr:x}"
        origin = "opened" if self._opened else "created"
        return f"<IpcEvent {state} device={self._device} {origin}>"


def export_event(ptr: int, device: int, block: bool, pair: int = 0) -> "IpcEventHandle":
    """The handle of an interprocess event of this process, on GPU ``device``; ``pair``: its pair of words'
    number (see :class:`IpcEvent`), 0 for none."""
    _fork.check()
    runtime = _cuda.rt()
    raw = _cuda.call("exporting an event", runtime.ipcGetEventHandle, ptr)
    me = this_process()
    _segment.own_segment(me.token)  # lets consumers tell that we are alive
    return IpcEventHandle._make(EventFields(bytes(raw), block, DeviceId(device, _cuda.device_uuid(device)), me,
                                            pair))


def _open_event(data: bytes) -> IpcEvent:
    return IpcEventHandle.from_bytes(data).open()


class IpcEventHandle:
    """A picklable value that names an :class:`IpcEvent` of some process.

    Example:
        >>> from cupy_ipc import IpcEventHandle
        >>> IpcEventHandle.from_bytes(b"CIPE")
        Traceback (most recent call last):
        ...
        cupy_ipc._errors.HandleError: event handle is 4 bytes; at least 164 expected
    """

    __slots__ = ("_f",)

    def __init__(self, *args: object, **kwargs: object) -> None:
        # Without it, IpcEventHandle() made a handle with no fields, unvalidated, that raised AttributeError on use.
        raise TypeError("an IpcEventHandle is made by IpcEvent.get_ipc_handle() or IpcEventHandle.from_bytes(), "
                        "not called")

    @classmethod
    def _make(cls, fields: EventFields) -> "IpcEventHandle":
        h = cls.__new__(cls)
        object.__setattr__(h, "_f", fields)
        return h

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("IpcEventHandle is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("IpcEventHandle is immutable")

    @classmethod
    def from_bytes(cls, data: bytes) -> "IpcEventHandle":
        """Parse and validate the output of :meth:`to_bytes`.

        Raises:
            HandleError: The bytes are not a valid event handle.
        """
        return cls._make(unpack_event(data))

    def to_bytes(self) -> bytes:
        """The handle's wire form: the bytes :meth:`from_bytes` reads back, to send by any channel.

        Example:
            >>> h = cupy_ipc.IpcEvent().get_ipc_handle()              # doctest: +SKIP
            >>> cupy_ipc.IpcEventHandle.from_bytes(h.to_bytes()) == h  # doctest: +SKIP
            True
        """
        return pack_event(self._f)

    @property
    def event_handle(self) -> bytes:
        """The 64-byte CUDA interprocess event handle (``cudaIpcEventHandle_t``)."""
        return self._f.event_handle

    @property
    def block(self) -> bool:
        """Whether the event was created with blocking synchronization (a host wait sleeps, not spins)."""
        return self._f.block

    @property
    def device(self) -> DeviceId:
        """``(ordinal, uuid)`` of the GPU the event belongs to, as its creator numbers it."""
        return self._f.device

    @property
    def producer(self) -> Producer:
        """``(pid, token, boot id, host)`` of the process that created the event."""
        return self._f.producer

    def open(self) -> IpcEvent:
        """Open the event in this process.

        In the process that created it, returns the original event.

        Raises:
            HandleError: The event is from another host or for a GPU this
                process cannot see.
            ProducerExitedError: The creating process has exited.
            ClosedError: Opened in its own process after it was closed.
        """
        if self._f.producer.token == this_process().token:
            ev = _own.get(self._f.event_handle)
            if ev is None or ev.closed:
                raise ClosedError("this event was closed in the process that created it")
            return ev
        return IpcEvent._opened_from(self._f.event_handle, self._home(), self._f.block, self,
                                     "opening an event handle")

    def _home(self) -> int:
        """This process's ordinal of the event's GPU, once it is known that the event can be opened here."""
        _fork.check()
        check_same_host(self._f.producer)
        _segment.attach(self._f.producer.token, self._f.producer.pid)
        return _cuda.ordinal_of_uuid(self._f.device.uuid)

    def __reduce__(self) -> tuple[Any, ...]:
        return (IpcEventHandle.from_bytes, (self.to_bytes(),))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IpcEventHandle) and self._f == other._f

    def __hash__(self) -> int:
        return hash(self._f)

    def __repr__(self) -> str:
        p = self._f.producer
        return f"<IpcEventHandle device={self._f.device.ordinal} producer={p.where()}>"


def open_event(event_handle: bytes, device: int, out: ctypes.c_void_p, what: str) -> None:
    """Open another process's event on GPU ``device``; it is written to ``out``, the caller's once this returns.

    If anything raises, the event is destroyed, also one the driver made before an interrupt (Ctrl-C) that
    arrived during its call was raised as the call returned.
    """
    try:
        with _cuda.using_device(device):
            _cuda.open_ipc_event(event_handle, device, out, what)
    except BaseException:
        _destroy(out, device)
        raise


def check_same_host(producer: Producer) -> None:
    """Raise :class:`HandleError` unless ``producer`` runs on this host (same kernel boot)."""
    me = this_process()
    if producer.boot_id != me.boot_id:
        raise HandleError(
            f"this handle comes from host {producer.host!r} (pid {producer.pid}); CUDA IPC works only "
            f"between processes of one host, and this is {me.host!r}"
        )


# Events opened from other processes' handles, kept so that an event the
# producer re-records for later exports is opened once per consumer.
_OPEN_CACHE_SIZE = 256
_opened: "collections.OrderedDict[tuple[bytes, bytes], IpcEvent]" = collections.OrderedDict()
_opened_lock = threading.Lock()


def open_cached(event_handle: bytes, device: int, producer: Producer) -> IpcEvent:
    """An opened event for a raw handle, from the consumer's cache when possible."""
    key = (producer.token, event_handle)
    with _opened_lock:
        ev = _opened.get(key)
        if ev is not None:
            _opened.move_to_end(key)
            return ev
    ev = IpcEvent._opened_from(event_handle, device, False, None, "opening the producer's ordering event")
    with _opened_lock:
        _opened[key] = ev
        while len(_opened) > _OPEN_CACHE_SIZE:
            _opened.popitem(last=False)  # destroyed with its last user (see drop_cached)
    return ev


def drop_cached(token: bytes | None = None) -> None:
    """Let go of cached opened events (of one producer, or all): each is destroyed once no caller of
    :func:`open_cached` still holds it, so that a thread that has one can still wait on it."""
    with _opened_lock:
        for key in [k for k in _opened if token is None or k[0] == token]:
            del _opened[key]


_segment.when_exited(drop_cached)  # an exited producer's events are never recorded again

_inherited: list[Any] = []  # a forked child's copies of its parent's opened events, never destroyed


def _forget_after_fork() -> None:
    # The cached events are the parent's: destroying them would make CUDA calls, which a forked child must
    # not. A new lock, since another thread may have held the old one at the fork.
    global _opened, _opened_lock
    _inherited.append(_opened)
    _opened, _opened_lock = collections.OrderedDict(), threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
