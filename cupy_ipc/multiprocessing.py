"""A drop-in for :mod:`multiprocessing` that sends GPU arrays and events by handle.

Everything the standard module has is here too. Importing this module
registers reducers with multiprocessing's pickler (and only with it: ordinary
``pickle`` is unchanged), so that queues, pipes, pools and
``concurrent.futures.ProcessPoolExecutor`` carry

- ``cupy.ndarray``: the receiver gets an array that maps the sender's memory,
  with the lifetime and ordering rules of :func:`cupy_ipc.get_ipc_handle`
  (the memory stays alive until the receiver's work on it has finished; the
  receiver's current stream waits for the sender's work). Its mapping is
  released when the array and all its views are garbage-collected. An array
  received this way can be sent on: the next process maps the original
  allocation, and an array sent back to its exporter is its own memory again;
  Memory shared by file descriptor (a ``ShareableMemoryPool``'s, virtual
  memory) travels as the handle's bytes; the receiver asks the sender's
  descriptor server (a Unix socket) for the descriptors when it lacks them:
  a pool's crosses once per receiving process;
- :class:`cupy_ipc.IpcEvent`, and ``cupy.cuda.Event`` created with
  ``interprocess=True`` (received as a ``cupy.cuda.Event``; the process that
  created it gets the same object back). A ``cupy.cuda.Event`` is labelled
  with the current GPU of the thread that pickles it (a ``Queue``'s own
  thread: GPU 0); send events of other GPUs as ``IpcEvent``.

An object that cannot be shared (an array of managed memory, say) raises
:class:`IpcError` in the sender, except on a ``Queue``: it pickles on a
background thread, which would print the error and drop the message, so the
receiver's ``get()`` raises the error instead and later messages still arrive.

A message that fails to pickle part-way (an unpicklable object after an
array, say) never leaves, and the exports of the arrays pickled before the
failure are released at once (the pickler's ``dump`` is wrapped for that);
so are those of a message whose write fails (a pipe whose receiver died:
connections' ``_send_bytes`` is wrapped too), when a queue, a pipe's
``send()`` or a pool pickled it (not bytes of your own ``dumps()``, which
may be sent again elsewhere); and those of a process's arguments
(``spawn``, ``forkserver``) when it cannot be started (``Process.start()``
raises ``OSError``: no process to be had, say). An array that is sent but
never received stays pinned in the sender, unless
:func:`set_message_lease` gave it a lease. A process started by
multiprocessing waits at its exit until the arrays it sent have been
opened, for at most :func:`set_exit_wait` seconds (10 by default).

An array or event that cannot be opened where it is received (its lease
ran out, say) raises there, in ``get()`` or ``recv()``; in a ``Pool`` or
``ProcessPoolExecutor``, whose workers and result readers would not survive
that, it fails its task instead, and their workers
import this module as they start.

Use the ``spawn`` or ``forkserver`` start method: a child forked after CUDA
was initialized cannot use CUDA, and cupy_ipc raises :class:`IpcError` there.
Starting such a child (with ``fork``, whether chosen or the default) warns
once; a process spawned, or forked before CUDA was initialized, does not.
The sender's ordering event is recorded when the message is pickled, which
for a ``Queue`` (or ``JoinableQueue``), a pool's tasks and an executor's
calls happens on a background thread, on that thread's current stream:
CUDA's default stream, which waits for the work of every blocking stream
(``SimpleQueue.put``, ``send()`` and a pool worker's results pickle on the
calling thread, on its current stream). Work queued on a ``non_blocking``
stream must be finished (or exported with ``get_ipc_handle(array, stream=s)``) before sending.

Workers of a spawned process are imported by name: define them in a module,
not in ``__main__`` of a notebook, and import ``cupy_ipc.multiprocessing``
in that module, so that a worker that returns arrays has the reducers too.

Example:
    >>> import cupy_ipc.multiprocessing as mp
    >>> ctx = mp.get_context("spawn")
    >>> q = ctx.Queue()
    >>> import cupy                               # doctest: +SKIP
    >>> q.put(cupy.arange(4))                     # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import errno
import functools
import importlib
import importlib.abc
import importlib.util
import multiprocessing as _mp
import multiprocessing.connection as _connection
import multiprocessing.process as _process
import multiprocessing.queues as _queues
import os
import sys
import threading
import warnings
import weakref
from multiprocessing import *  # noqa: F403 - the drop-in re-exports everything
from multiprocessing.queues import Queue as _PlainQueue
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

from . import _cuda, _fork, _keepalive, _sent
from ._args import checked_lease
from ._array_handle import IpcArrayHandle, get_ipc_handle
from ._errors import ClosedError, IpcError
from ._events import IpcEvent, IpcEventHandle, export_event, open_event
from ._identity import this_process
from ._sent import set_exit_wait

__all__ = [*_mp.__all__, "init_reductions", "set_exit_wait", "set_message_lease"]  # noqa: PLE0604


def __getattr__(name: str) -> Any:
    # Submodules and anything else of the standard module (mp.pool, mp.reduction, ...): a submodule not
    # imported yet is imported, as `import multiprocessing.pool` would. Not the module machinery's names: the
    # standard package's __path__ would make `import cupy_ipc.multiprocessing.pool` load copies of its files
    # (which _Submodules answers with the standard ones instead).
    if name.startswith("__"):
        raise AttributeError(f"module 'cupy_ipc.multiprocessing' has no attribute {name!r}")
    try:
        return getattr(_mp, name)
    except AttributeError:
        try:
            return importlib.import_module(f"multiprocessing.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"multiprocessing.{name}":  # the submodule is there, but something it imports is not
                raise
            raise AttributeError(f"module 'cupy_ipc.multiprocessing' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    # What __getattr__ finds too (SUBDEBUG, SUBWARNING, the submodules imported so far), as dir() of the standard
    # module lists them: for completion and introspection. Not its __path__ (see __getattr__).
    return sorted(set(globals()) | {name for name in dir(_mp) if not name.startswith("__")})


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import cupy_ipc.multiprocessing.pool`` (or ``from cupy_ipc.multiprocessing.dummy import connection``):
    the standard submodule itself, as ``mp.pool`` is, never a second copy of its file under this name (another
    ``Connection`` class, say, whose writes the library would not see)."""

    PREFIX = __name__ + "."

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith(self.PREFIX):
            return None
        standard = "multiprocessing." + fullname[len(self.PREFIX):]
        try:
            if importlib.util.find_spec(standard) is None:
                return None
        except ModuleNotFoundError:  # (its parent is not a package)
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=False)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module("multiprocessing." + spec.name[len(self.PREFIX):])
        spec.loader_state = module.__spec__  # which the import machinery replaces with ours next
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = module.__spec__.loader_state  # its own back: it stays the standard module in every way


__path__: list[str] = []  # a package to the import system, whose submodules _Submodules finds (no file of its own)
if not any(type(finder).__qualname__ == "_Submodules" and type(finder).__module__ == __name__
           for finder in sys.meta_path):  # (once, also if the module is reloaded)
    sys.meta_path.insert(0, _Submodules())  # first: a nested one (dummy.connection) would be found in the files


_warned_fork = False


def _warn_if_forked_after_cuda(process: Any) -> None:
    """Warn once when ``process`` is about to be forked from this process after it initialized CUDA: the child
    cannot use CUDA, so the arrays sent to it would raise there. A spawned child, or one forked before CUDA,
    is fine, whatever the default start method."""
    global _warned_fork
    default = _mp.get_start_method(allow_none=True) or _mp.get_all_start_methods()[0]
    chosen = getattr(process, "_start_method", None)  # (None: the default context's Process)
    if (chosen or default) != "fork" or not _fork.cuda_initialized():
        return
    _warned_fork = True
    text = (f"{process.name} is started with 'fork'{'' if chosen else ' (the default start method)'} "
            "after this process initialized CUDA: a forked child cannot use CUDA, and the GPU arrays sent to it "
            "raise IpcError there; use get_context('spawn') or get_context('forkserver'), or call "
            "set_start_method('spawn') once at start-up")
    try:
        warnings.warn(text, RuntimeWarning, stacklevel=3)  # (the caller of Process.start)
    except Exception:  # noqa: BLE001 - a filter that makes it an error: raised here, it would fail a pool's thread
        print(f"RuntimeWarning: {text}", file=sys.stderr)


# --- errors while pickling ---------------------------------------------------------
def _errors_reach_the_receiver(reduce: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A reducer whose error reaches the receiver when raised on a queue's feeder thread.

    A queue pickles on that thread, which can only print the error and drop
    the message: the receiver would wait forever. It gets the error instead;
    elsewhere (pipes, pools, the caller's own thread) the error is raised to
    the sender as usual.
    """

    @functools.wraps(reduce)
    def wrapper(obj: Any) -> Any:
        try:
            return reduce(obj)
        except Exception as e:  # any: the feeder thread would only print it and drop the message
            if threading.current_thread().name != "QueueFeederThread" or _feeder_handles_errors():
                raise
            raise _Refused(f"{type(obj).__module__}.{type(obj).__qualname__}", e) from None

    return wrapper


class _Refused(Exception):
    """A part of a message that a queue's feeder thread cannot share: the message's exports are released
    (see :func:`_dump`) and the message is sent as this error instead (:func:`_dumps`), so that no part of it
    stays pinned for a receiver that raises before opening it."""


class _Refusal:
    """What the receiver unpickles instead of a refused message: the error, raised there, with its type and
    attributes if it is one of the library's (they pickle whole), else as an :class:`IpcError` with its text."""

    def __init__(self, what: str, error: BaseException) -> None:
        if not isinstance(error, IpcError):
            error = IpcError(f"{type(error).__name__}: {error}")
        self.what, self.error = what, error

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _raise_received, (self.what, self.error)


def _feeder_handles_errors() -> bool:
    """Whether the queue this feeder thread serves handles a pickling error itself (``ProcessPoolExecutor``'s
    call queue fails the task's future; its worker would die unpickling a raising message instead)."""
    # The feeder's arguments include the queue's bound _on_queue_feeder_error (CPython 3.8 to 3.13).
    for arg in getattr(threading.current_thread(), "_args", ()):
        if getattr(arg, "__name__", None) == "_on_queue_feeder_error":
            # The plain queue's is a static method: its function itself. A subclass's, static or not, handles.
            return getattr(arg, "__func__", arg) is not _PlainQueue._on_queue_feeder_error
    return False


def _raise_received(what: str, error: IpcError) -> Any:
    error.args = (f"the sender could not share a {what} put on this queue: {error}",)
    raise error  # caught by its type, as the sender would have caught it (a ClosedError, say)


# --- messages that fail to pickle ---------------------------------------------------
# The exports a message makes while it is pickled (per thread, as queues pickle on a feeder thread): if a
# later part of the message fails to pickle, the message never leaves, so no consumer will open them and
# their pins are released at once instead of holding the memory for good.
class _MessageState(threading.local):
    exports: "list[Any] | None" = None  # the exports of the message being pickled
    dumped: "list[Any] | None" = None  # those of the last whole message pickled
    pickled: "tuple[Any, list[Any]] | None" = None  # (its buffer, its exports), until a sender writes it
    unopened: "tuple[Any, Any, Exception] | None" = None  # a pool's task that fails (see _fails_the_task)
    locked = False  # this thread writes under a queue's write lock: the sweep waits for its release (_Unlocked)


_in_message = _MessageState()
# The standard methods that the wrappers below call. Executed again (importlib.reload), this module would find
# its own wrappers in their place, which would call themselves: it keeps those that its first execution found.
_plain_dump: Any = globals().get("_plain_dump", ForkingPickler.dump)


def _release_all(exports: list[Any]) -> None:
    for h in exports:
        try:
            h.release()
        except Exception:  # noqa: BLE001 - the caller's error is the one to raise
            pass


def _dump(pickler: ForkingPickler, obj: Any) -> None:
    outer = _in_message.exports
    _in_message.exports = exports = []
    try:
        _plain_dump(pickler, obj)
    except BaseException:
        _release_all(exports)
        raise
    finally:
        _in_message.exports = outer
    if outer is not None:  # pickled inside another message (by a reducer), whose failure releases these too
        outer.extend(exports)
    else:  # a whole message: its exports, for the send that follows (see _send_bytes)
        _in_message.dumped = exports or None


_plain_dumps: Any = globals().get("_plain_dumps", ForkingPickler.dumps.__func__)  # type: ignore[attr-defined]


def _dumps(cls: type, obj: Any, protocol: int | None = None) -> Any:
    # What queues' feeder threads, SimpleQueue.put and Connection.send pickle each message with.
    sender = sys._getframe(1).f_code in _SENDERS
    outer = _in_message.exports
    deferred = _keepalive.deferral.on
    if sender:  # a message of its own, sent at once (by a reducer of another message, say): never a part of that
        _in_message.exports = None
        _keepalive.deferral.on = True  # its exports' sweep waits until it has left (see _send_bytes)
    try:
        _in_message.dumped = None
        try:
            buf = _plain_dumps(cls, obj, protocol)
        except _Refused as e:
            if _in_message.exports is not None:  # a part of another message: refused whole
                raise
            buf = _plain_dumps(cls, _Refusal(*e.args), protocol)
        exports, _in_message.dumped = _in_message.dumped, None
    finally:
        _in_message.exports = outer
        _keepalive.deferral.on = deferred
    if sender:  # for its send, which follows on this thread (see _send_bytes)
        _in_message.pickled = None if exports is None else (buf.obj, exports)
    return buf


# --- messages that are not sent -------------------------------------------------------
# A message pickled whole and then not sent (a pipe whose receiver died: BrokenPipeError) would leave its
# arrays pinned for good: no receiver will open them. The exports of a message that a sender of the standard
# module pickled (each sends its bytes at once, and never again) are kept, per thread, until that send, and
# released if its write fails. Not those of a message pickled by the user's own dumps(): its bytes may be sent
# anywhere, any number of times. And only on the write's own failure, which leaves no whole message with a
# receiver: an error raised after the bytes left (a signal handler's) must leave the receiver its arrays.
_plain_feed: Any = globals().get("_plain_feed", _queues.Queue._feed)
_plain_put: Any = globals().get("_plain_put", _queues.SimpleQueue.put)
_SENDERS = frozenset({_plain_feed.__code__, _plain_put.__code__, _connection._ConnectionBase.send.__code__})
_NOT_SENT = frozenset({errno.EPIPE, errno.ECONNRESET, errno.EBADF, errno.ENOTCONN, errno.ESHUTDOWN})
_plain_send_bytes: Any = globals().get("_plain_send_bytes", _connection.Connection._send_bytes)


def _send_bytes(conn: Any, buf: Any) -> None:
    # Connection._send_bytes: what send() and send_bytes() both call, however their callers bound them.
    pickled = _in_message.pickled
    if pickled is not None and pickled[0] is getattr(buf, "obj", buf):  # (send_bytes sends a view of them)
        _in_message.pickled = None
    else:
        pickled = None  # other bytes: that message's send is still to come
    try:
        _plain_send_bytes(conn, buf)
    except OSError as e:
        if pickled is not None and e.errno in _NOT_SENT:
            _release_all(pickled[1])
        raise
    finally:
        # The sweep its exports left (see _keepalive.deferral): now, while the receiver opens the message; a
        # queue's, once its write lock is released (see _Unlocked), so that its other writers need not wait.
        if not _in_message.locked:
            _keepalive.sweep_owed()


class _Unlocked:
    """A queue's write lock as the queue's feeder thread takes it: while it is held, the sweep that a message's
    exports left to its sender waits (see _send_bytes), and releasing it makes the sweep. (A feeder started
    before this module was imported has the plain lock: its writes sweep at once, inside it.)"""

    __slots__ = ("_acquire", "_release")

    def __init__(self, lock: Any) -> None:
        self._acquire, self._release = lock.acquire, lock.release

    def acquire(self, *args: Any) -> Any:
        got = self._acquire(*args)
        _in_message.locked = True
        return got

    def release(self) -> None:
        _in_message.locked = False
        self._release()
        _keepalive.sweep_owed()


def _feed(buffer: Any, notempty: Any, send_bytes: Any, writelock: Any, *rest: Any) -> Any:
    # Queue._feed, each queue's feeder thread (writelock: None on Windows, whose pipe writes need no lock).
    return _plain_feed(buffer, notempty, send_bytes, None if writelock is None else _Unlocked(writelock), *rest)


def _put(queue: Any, obj: Any) -> None:
    # SimpleQueue.put, which writes under the queue's write lock: the sweep once the lock is released.
    outer, _in_message.locked = _in_message.locked, True
    try:
        _plain_put(queue, obj)
    finally:
        _in_message.locked = outer
        if not outer:
            _keepalive.sweep_owed()


_plain_checked_send: Any = globals().get("_plain_checked_send", _connection._ConnectionBase.send_bytes)


def _checked_send(conn: Any, buf: Any, offset: int = 0, size: int | None = None) -> None:
    # Connection.send_bytes, which SimpleQueue.put calls with the message it pickled: a connection found closed
    # (or not writable) refuses it before any write, so _send_bytes never sees it.
    try:
        _plain_checked_send(conn, buf, offset, size)
    except OSError:
        pickled = _in_message.pickled
        if pickled is not None and pickled[0] is getattr(buf, "obj", buf):  # (_send_bytes clears what it wrote)
            _in_message.pickled = None
            _release_all(pickled[1])
        raise


# --- processes that do not start -------------------------------------------------------
# A spawned (or forkserver) process's arguments are pickled whole, then the process is made and they are written
# to it. A start that fails with an OSError (os.pipe or fork refused, the executable missing, the pipe's write
# refused by a child that died) failed before they wholly left: no one will open their arrays. Any other error
# may come after (a signal handler's), and the process then has its arguments: their exports are left to it.
_plain_start: Any = globals().get("_plain_start", _process.BaseProcess.start)


class _Reductions:
    """Unpickled in a spawned (or forkserver) process: this module, imported there, so that its reducers and
    :func:`_loads` are in place before the process reads its first message (see :func:`_start`)."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return importlib.import_module, (__name__,)


class _ExitWait:
    """Unpickled in a spawned (or forkserver) process: the exit wait its parent set (see :func:`set_exit_wait`),
    which a process started so would not have otherwise."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self) -> tuple[Any, tuple[float]]:
        return set_exit_wait, (self.seconds,)


def _start(process: Any) -> None:
    if not _warned_fork:
        _warn_if_forked_after_cuda(process)
    target = getattr(process, "_target", None)
    if target is _pool.worker or target is _executor._process_worker:
        # A pool's worker would import this module only while it unpickles its first task that holds an array:
        # too late for that task (see _loads). It comes with the process instead.
        process._cupy_ipc_reductions = _Reductions()
    if _sent._wait != _sent.DEFAULT_WAIT:
        process._cupy_ipc_exit_wait = _ExitWait(_sent._wait)  # (a forked child has it already)
    outer = _in_message.exports
    _in_message.exports = exports = []  # the arguments are one message, whatever dumps pickle them
    try:
        _plain_start(process)
    except OSError:
        _release_all(exports)
        raise
    finally:
        _in_message.exports = outer


def _forget_after_fork() -> None:
    # A child forked by start() runs its target inside _start, and exits there: no message is its own yet.
    _in_message.exports = _in_message.dumped = _in_message.pickled = _in_message.unopened = None


os.register_at_fork(after_in_child=_forget_after_fork)


# --- what cannot be opened where a pool unpickles it ------------------------------------
# The standard Pool does not survive an error raised while a message is unpickled: in a worker reading its task
# the worker dies and the task is lost, in the result handler the thread ends; either way the pool waits for
# ever. ProcessPoolExecutor's end the same way, and it breaks (BrokenProcessPool for every pending task). Where
# one of them unpickles (the open that fails finds it up its stack, as _dumps finds senders), an array or event
# that cannot be opened (a lease run out, a GPU hidden there) fails its task instead: the caller's get() or
# result() raises the error, and the pool goes on.
def _failed_task(task: Any, error: Exception) -> Any:
    job, i = task[:2]
    return job, i, _raise, (error,), {}  # run by the worker: its error is the task's result


def _failed_result(result: Any, error: Exception) -> Any:
    job, i = result[:2]
    return job, i, (False, error)


def _failed_call(item: Any, error: Exception) -> Any:
    item.fn, item.args, item.kwargs = _raise, (error,), {}  # a _CallItem, run by the worker
    return item


def _failed_call_result(item: Any, error: Exception) -> Any:
    item.exception, item.result = error, None  # a _ResultItem: the future's exception
    return item


def _raise(error: Exception) -> None:
    raise error


_pool = importlib.import_module("multiprocessing.pool")
_executor = importlib.import_module("concurrent.futures.process")
_POOL_READERS = {_pool.worker.__code__: _failed_task, _pool.Pool._handle_results.__code__: _failed_result,
                 _executor._process_worker.__code__: _failed_call,
                 _executor._ExecutorManagerThread.wait_result_broken_or_wakeup.__code__: _failed_call_result}
_plain_loads: Any = globals().get("_plain_loads", ForkingPickler.loads)


def _loads(data: Any, /, *args: Any, **kwargs: Any) -> Any:
    # ForkingPickler.loads: what queues, pipes and pools unpickle each message with. Nothing more per message
    # than a look at _in_message: the open that fails looks for the pool (see _fails_the_task).
    try:
        message = _plain_loads(data, *args, **kwargs)
    except BaseException:
        kept = _in_message.unopened
        if kept is not None and kept[0] is sys._getframe():
            _in_message.unopened = None
        del kept  # (this frame: kept in its own locals, a cycle that holds the message's buffer)
        raise
    kept = _in_message.unopened
    if kept is None or kept[0] is not sys._getframe():  # (one of an outer message, unpickled by a reducer)
        return message
    _in_message.unopened = None
    # The error's traceback leads to this frame (the open that raised it was called from here), and the failed
    # task holds the error: nothing of this frame may hold the message's buffer (a memoryview of the reader's
    # BytesIO), or both end in a reference cycle, which the cycle collector of Python 3.12 frees in an order that
    # crashes the process (bytesiobuf_releasebuffer), nor lead back to the error.
    del data
    failed, error = kept[1], kept[2]
    del kept
    try:
        return failed(message, error)
    finally:
        del message, error


def _fails_the_task(error: Exception) -> bool:
    """Whether ``error``, raised opening part of a message, is kept to fail the message's task: where a pool's
    reader unpickles it (through :func:`_loads`, a queue's or connection's method, then the reader); if not,
    the caller raises it. The first error of a message is its task's."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _loads.__code__:
        frame = frame.f_back
    receiver = frame.f_back if frame is not None else None
    reader = receiver.f_back if receiver is not None else None
    failed = _POOL_READERS.get(reader.f_code) if reader is not None else None
    if failed is None:
        return False
    kept = _in_message.unopened
    if kept is None:
        _in_message.unopened = (frame, failed, error)
        return True
    return kept[0] is frame


# --- cupy.ndarray ----------------------------------------------------------------
_message_lease: float | None = None


def set_message_lease(seconds: float | None) -> float | None:
    """Revoke an array this process sends from now on if it is not received within ``seconds``; returns the
    old setting (each process has its own: a worker that returns arrays sets its own). "From now on": every
    array pickled after the call, and a queue pickles on its feeder thread, shortly after ``put()``: an array
    put just before a change may get the new setting.

    An array sent through a queue, pipe or pool stays pinned here until its
    receiver has opened it and is done with it. One that is never received
    (its receiver died, or the message sits in a queue nobody reads) stays
    pinned for the life of this process, unless a lease ends it: once the
    lease runs out, receiving the array raises :class:`IpcError` and its
    memory goes at the next export or :func:`cupy_ipc.collect`. A receiver
    that opened it in time keeps it as long as it needs. ``None`` (the
    default) sets no lease: choose one longer than any wait in your queues.

    Example:
        >>> import cupy_ipc.multiprocessing as mp
        >>> mp.set_message_lease(60.0)
        >>> mp.set_message_lease(None)
        60.0
    """
    global _message_lease
    old, _message_lease = _message_lease, checked_lease(seconds)
    return old


@_errors_reach_the_receiver
def _reduce_ndarray(array: Any) -> tuple[Any, tuple[Any, ...]]:
    h = get_ipc_handle(array, lease=_message_lease)
    exports = _in_message.exports
    if exports is not None:
        exports.append(h)
    _sent.note(h._f.export_id)
    # Memory shared by descriptor: the receiver asks this process's descriptor server for them, over a Unix
    # socket (no ptrace permission needed), only when it lacks them: a pool it imported before needs nothing
    # more than these bytes.
    server = h._served()
    return _rebuild_ndarray, (h.to_bytes(), server) if server is not None else (h.to_bytes(),)


def _rebuild_ndarray(data: bytes, server: bytes | None = None) -> Any:
    try:
        h = IpcArrayHandle.from_bytes(data)
        if server is not None:
            h._ask_producer(server)
        return h._open(last_try=True)  # the message is consumed: a failed open is not retried
    except Exception as e:
        if not _fails_the_task(e):
            raise
        return None


# --- events ----------------------------------------------------------------------
@_errors_reach_the_receiver
def _reduce_ipc_event(event: IpcEvent) -> tuple[Any, tuple[bytes]]:
    return _rebuild_ipc_event, (event.get_ipc_handle().to_bytes(),)


def _rebuild_ipc_event(data: bytes) -> IpcEvent | None:
    try:
        return IpcEventHandle.from_bytes(data).open()
    except Exception as e:
        if not _fails_the_task(e):
            raise
        return None


# cupy.cuda.Event objects this process sent, by raw CUDA handle, so that one
# coming back is the original object (CUDA cannot open it in its own process);
# and the handles of those it received, so that it can send them on.
_cupy_events: "weakref.WeakValueDictionary[bytes, Any]" = weakref.WeakValueDictionary()
_received_events: "weakref.WeakKeyDictionary[Any, bytes]" = weakref.WeakKeyDictionary()


@_errors_reach_the_receiver
def _reduce_cupy_event(event: Any) -> tuple[Any, tuple[bytes]]:
    from cupy.cuda import runtime

    _fork.check()  # before any CUDA call: a forked child would fail on it with a less helpful error
    received = _received_events.get(event)
    if received is not None:
        return _rebuild_cupy_event, (received,)
    try:
        handle = export_event(event.ptr, runtime.getDevice(), block=False)
    except IpcError as e:
        if e.cuda_error is None:  # not CUDA's refusal of the event (this process is exiting, say): as it is
            raise
        raise IpcError(
            "this cupy.cuda.Event cannot be sent to another process: create it with "
            "cupy.cuda.Event(disable_timing=True, interprocess=True), or use cupy_ipc.IpcEvent",
            cuda_error=e.cuda_error,
        ) from e
    _cupy_events[handle.event_handle] = event
    return _rebuild_cupy_event, (handle.to_bytes(),)


def _rebuild_cupy_event(data: bytes) -> Any:
    try:
        return _opened_cupy_event(data)
    except Exception as e:
        if not _fails_the_task(e):
            raise
        return None


def _opened_cupy_event(data: bytes) -> Any:
    import cupy

    handle = IpcEventHandle.from_bytes(data)
    if handle.producer.token == this_process().token:
        event = _cupy_events.get(handle.event_handle)
        if event is None:
            raise ClosedError("this cupy.cuda.Event was destroyed in the process that created it")
        return event
    device = handle._home()
    # cupy.cuda.Event has no constructor for an existing event; one built
    # around the opened handle destroys it when collected, which is the
    # release CUDA asks for. Built before the open: between the open's
    # return and the store of its event there is no call, where an
    # interrupt would be raised.
    event = cupy.cuda.Event.__new__(cupy.cuda.Event)
    event.ptr = 0  # (what its __del__ reads, should the open raise)
    out = ctypes.c_void_p()
    open_event(handle.event_handle, device, out, "opening an event handle")
    event.ptr = out.value
    _received_events[event] = data
    return event


_registered = False


def init_reductions() -> None:
    """Register the reducers with ``multiprocessing.reduction.ForkingPickler``. Idempotent.

    Importing this module calls it, so code that uses the standard
    :mod:`multiprocessing` module directly needs only that import; calling it
    again does nothing.

    Example:
        >>> import cupy_ipc.multiprocessing
        >>> cupy_ipc.multiprocessing.init_reductions()
    """
    global _registered
    if _registered:
        return
    cupy = _cuda.import_cupy()
    ForkingPickler.register(cupy.ndarray, _reduce_ndarray)
    ForkingPickler.register(IpcEvent, _reduce_ipc_event)
    ForkingPickler.register(cupy.cuda.Event, _reduce_cupy_event)
    ForkingPickler.dump = _dump  # type: ignore[method-assign]  # every message, by Connection.send,
    # queues (dumps) and a spawned Process's arguments (reduction.dump)
    ForkingPickler.dumps = classmethod(_dumps)  # type: ignore[assignment,method-assign]
    _connection.Connection._send_bytes = _send_bytes  # type: ignore[method-assign]  # every message's write
    _connection._ConnectionBase.send_bytes = _checked_send  # type: ignore[method-assign]  # SimpleQueue.put's
    _queues.Queue._feed = staticmethod(_feed)  # type: ignore[method-assign]  # each feeder thread, as it starts
    _queues.SimpleQueue.put = _put  # type: ignore[method-assign]
    _process.BaseProcess.start = _start  # type: ignore[method-assign]  # every process's, whatever its context
    ForkingPickler.loads = staticmethod(_loads)  # type: ignore[assignment]  # every message received
    _registered = True


init_reductions()
