"""cupy_ipc.multiprocessing without a GPU: the drop-in, the reducer registration, fork checks."""

from __future__ import annotations

import concurrent.futures
import copyreg
import ctypes
import gc
import multiprocessing
import pickle
import subprocess
import sys
import threading
import time
import warnings

import pytest

import cupy_ipc
import cupy_ipc.multiprocessing as mp
from cupy_ipc import _keepalive

import mp_workers


def test_every_name_of_the_standard_module_is_there():
    for name in multiprocessing.__all__:
        assert getattr(mp, name) is getattr(multiprocessing, name), name
    assert set(multiprocessing.__all__) < set(mp.__all__)
    assert mp.reduction is multiprocessing.reduction  # and its submodules


def test_dir_lists_every_name_of_the_standard_module():
    # dir() (and so completion) missed what only __getattr__ finds: SUBDEBUG, SUBWARNING, the submodules.
    import multiprocessing.pool  # noqa: F401 - a submodule the standard module lists once imported

    missing = set(dir(multiprocessing)) - set(dir(mp)) - {"__path__"}
    assert not missing, sorted(missing)
    assert {"init_reductions", "set_exit_wait", "set_message_lease"} <= set(dir(mp))


def test_registration_is_idempotent_and_only_for_multiprocessing():
    import cupy

    reducers = multiprocessing.reduction.ForkingPickler._extra_reducers
    before = dict(reducers)
    mp.init_reductions()
    mp.init_reductions()
    assert reducers == before
    assert reducers[cupy.ndarray] is mp._reduce_ndarray
    assert reducers[cupy.cuda.Event] is mp._reduce_cupy_event
    assert reducers[cupy_ipc.IpcEvent] is mp._reduce_ipc_event
    assert multiprocessing.reduction.ForkingPickler.dump is mp._dump
    assert multiprocessing.connection.Connection._send_bytes is mp._send_bytes
    assert multiprocessing.connection.Connection.send_bytes is mp._checked_send
    assert multiprocessing.reduction.ForkingPickler.loads is mp._loads
    assert pickle.loads is not mp._loads
    assert multiprocessing.process.BaseProcess.start is mp._start
    assert cupy.ndarray not in copyreg.dispatch_table  # what pickle.dumps consults


def test_the_module_executed_again_still_pickles_through_the_standard_methods():
    # importlib.reload (IPython's autoreload) runs the module again in its own namespace: it took its own
    # wrappers, which it had put in ForkingPickler and Connection, for the standard methods, and every message
    # of the process then failed with RecursionError.
    code = """if True:
        import importlib
        import multiprocessing
        from multiprocessing.reduction import ForkingPickler
        import cupy_ipc.multiprocessing as mp
        importlib.reload(mp)

        class Exported:
            released = 0
            def release(self):
                self.released += 1

        ForkingPickler.register(Exported, lambda o: (mp._in_message.exports.append(o), (list, ()))[1])
        here, there = multiprocessing.Pipe()
        here.send([1, 2])
        print(there.recv())
        there.close()
        lost = Exported()
        try:
            here.send([lost])
        except OSError:
            print("released", lost.released)
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["[1, 2]", "released 1"], done.stderr[-2000:]


def _started(process) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python's warning about forking with threads
        process.start()
    process.join(60)
    assert process.exitcode == 0


def _fork_warnings(recwarn) -> list[str]:
    return [str(w.message) for w in recwarn if issubclass(w.category, RuntimeWarning) and "'fork'" in str(w.message)]


@pytest.mark.parametrize("default,chosen,cuda,warns", [
    ("fork", None, True, "default"),  # the default context's Process, the default being fork
    ("spawn", "fork", True, "chosen"),
    ("fork", "fork", True, "chosen"),  # chosen: not "the default" in the warning, though it is the default too
    ("fork", "fork", False, None),  # forked before CUDA: the child can use CUDA
    ("fork", "spawn", True, None),  # a spawn context, whatever the default
    ("fork", "forkserver", True, None),
])
def test_warns_once_when_a_process_is_forked_after_cuda(monkeypatch, recwarn, default, chosen, cuda, warns):
    monkeypatch.setattr(mp, "_warned_fork", False)
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: default)
    # (This machine may have no GPU: the warning's test of CUDA's state answers as a process with CUDA would.)
    monkeypatch.setattr(cupy_ipc._fork, "cuda_initialized", lambda: cuda)
    make = multiprocessing.Process if chosen is None else multiprocessing.get_context(chosen).Process
    for _ in range(2):
        _started(make(target=time.sleep, args=(0,)))
    messages = _fork_warnings(recwarn)
    assert len(messages) == (1 if warns else 0), messages
    if warns:
        assert "'spawn'" in messages[0] and "'forkserver'" in messages[0]
        assert ("(the default start method)" in messages[0]) == (warns == "default")


def test_the_fork_warning_made_an_error_still_starts_the_process(monkeypatch, capfd):
    # Raised in Process.start, the warning would fail a pool's thread that starts its workers.
    monkeypatch.setattr(mp, "_warned_fork", False)
    monkeypatch.setattr(cupy_ipc._fork, "cuda_initialized", lambda: True)
    p = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        p.start()  # printed instead of raised
    p.join(60)
    assert p.exitcode == 0
    assert "started with 'fork'" in capfd.readouterr().err


def test_fork_check_passes_in_a_child_of_a_process_without_cuda():
    # In a fresh interpreter: this one may have initialized CUDA (on a GPU host).
    code = """
import os
from cupy_ipc import _fork
assert not _fork.cuda_initialized()
pid = os.fork()
if pid == 0:
    try:
        _fork.check()
    except BaseException:
        os._exit(3)
    os._exit(0)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


class _Unshareable:
    """Stands for an array whose memory cannot be shared (no GPU needed to reduce it)."""


@mp._errors_reach_the_receiver
def _refuse(obj: _Unshareable) -> None:
    raise cupy_ipc.IpcError("this memory is managed memory, which CUDA cannot share", cuda_error="cudaErrorX")


def _registered(cls: type, reducer: object):
    """Register ``reducer`` for ``cls`` with multiprocessing's pickler for one test."""
    multiprocessing.reduction.ForkingPickler.register(cls, reducer)
    yield
    multiprocessing.reduction.ForkingPickler._extra_reducers.pop(cls, None)


@pytest.fixture
def unshareable():
    yield from _registered(_Unshareable, _refuse)


def test_a_refusal_on_a_queues_feeder_thread_reaches_the_receiver(unshareable):
    # A real queue: put() pickles on its feeder thread, which would print the error and drop the message.
    q = multiprocessing.get_context("spawn").Queue()
    try:
        q.put(_Unshareable())
        q.put("next")
        with pytest.raises(cupy_ipc.IpcError, match="could not share a .*_Unshareable.*managed memory") as e:
            q.get(timeout=10)
        assert e.value.cuda_error == "cudaErrorX"
        assert q.get(timeout=10) == "next"  # nothing else lost
    finally:
        q.close()
        q.join_thread()


class _Closed:
    """Stands for an IpcEvent closed before it was put on a queue."""


class _Broken:
    """Stands for an object whose reducer fails with an error that is not the library's."""


@mp._errors_reach_the_receiver
def _closed(obj: _Closed) -> None:
    raise cupy_ipc.ClosedError("this IpcEvent is closed")


@mp._errors_reach_the_receiver
def _broken(obj: _Broken) -> None:
    raise OSError(24, "Too many open files")


@pytest.fixture
def closed_and_broken():
    multiprocessing.reduction.ForkingPickler.register(_Closed, _closed)
    yield from _registered(_Broken, _broken)
    multiprocessing.reduction.ForkingPickler._extra_reducers.pop(_Closed, None)


def test_any_error_on_a_queues_feeder_thread_reaches_the_receiver_with_its_type(closed_and_broken):
    # Only IpcError was sent on: any other error was printed by the feeder and the message dropped, so the
    # receiver waited for ever; and a ClosedError arrived as a plain IpcError, not to be caught by its type.
    q = multiprocessing.get_context("spawn").Queue()
    try:
        q.put(_Closed())
        q.put(_Broken())
        q.put("next")
        with pytest.raises(cupy_ipc.ClosedError, match="could not share a .*_Closed.*: this IpcEvent is closed"):
            q.get(timeout=10)
        with pytest.raises(cupy_ipc.IpcError, match="could not share a .*_Broken.*OSError: .*Too many open files"):
            q.get(timeout=10)
        assert q.get(timeout=10) == "next"
    finally:
        q.close()
        q.join_thread()


@pytest.fixture
def spawn_pool():
    with mp.get_context("spawn").Pool(1) as pool:
        yield pool


def test_a_task_whose_array_cannot_be_opened_in_the_worker_fails_and_the_pool_goes_on(spawn_pool):
    # The worker read its task, raised unpickling it and died: the task was lost, and the pool waited for ever.
    unopenable = mp_workers.Unopenable()
    with pytest.raises(cupy_ipc.HandleError, match="comes from host 'elsewhere'"):
        spawn_pool.apply_async(len, ((unopenable, 1),)).get(timeout=120)
    with pytest.raises(cupy_ipc.HandleError, match="comes from host 'elsewhere'"):  # two in one message
        spawn_pool.apply_async(len, ((unopenable, mp_workers.Unopenable()),)).get(timeout=120)
    with pytest.raises(cupy_ipc.HandleError):
        spawn_pool.map_async(len, [[1], (unopenable,), [1, 2]], chunksize=1).get(timeout=120)
    assert spawn_pool.map_async(len, [[1], [1, 2]]).get(timeout=120) == [1, 2]


def test_a_result_that_cannot_be_opened_fails_its_task_and_the_pool_goes_on(spawn_pool):
    # The result handler raised unpickling the result, and its thread ended: every later result was lost too.
    with pytest.raises(cupy_ipc.HandleError, match="comes from host 'elsewhere'"):
        spawn_pool.apply_async(mp_workers.unopenable).get(timeout=120)
    assert spawn_pool.apply_async(len, ([1, 2],)).get(timeout=120) == 2


def test_an_executor_task_whose_array_or_result_cannot_be_opened_fails_alone():
    # The worker died unpickling the task, or the executor's manager thread raised unpickling the result:
    # either broke the executor (BrokenProcessPool for every task, pending or later).
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        pending = ex.submit(time.sleep, 0.5)
        argument = ex.submit(len, (mp_workers.Unopenable(), 1))
        result = ex.submit(mp_workers.unopenable)
        with pytest.raises(cupy_ipc.HandleError, match="comes from host 'elsewhere'"):
            argument.result(120)
        with pytest.raises(cupy_ipc.HandleError, match="comes from host 'elsewhere'"):
            result.result(120)
        assert pending.result(120) is None
        assert ex.submit(len, [1, 2, 3]).result(120) == 3


def test_outside_a_pool_an_array_that_cannot_be_opened_raises_where_it_is_received():
    here, there = multiprocessing.Pipe()
    with here, there:
        here.send((mp_workers.Unopenable(), 1))
        with pytest.raises(cupy_ipc.HandleError, match="comes from host 'elsewhere'"):
            there.recv()
        here.send("next")
        assert there.recv() == "next"


def test_the_submodules_of_the_standard_module_are_reached_through_the_drop_in():
    done = subprocess.run([sys.executable, "-c", "import cupy_ipc.multiprocessing as mp; "
                           "print(mp.pool.Pool.__module__, mp.shared_memory.__name__)"],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["multiprocessing.pool", "multiprocessing.shared_memory"], done.stderr


def test_a_submodule_imported_by_its_dotted_name_is_never_a_second_copy_of_the_standard_one():
    # The drop-in passed on the standard package's __path__, so `import cupy_ipc.multiprocessing.connection`
    # loaded connection.py again under that name: another Connection class, whose writes the library does not
    # wrap (a failed send left its arrays pinned), and another Queue, whose feeder is not known as a sender.
    code = """if True:
        import multiprocessing.connection
        import cupy_ipc.multiprocessing
        try:
            from cupy_ipc.multiprocessing.connection import Connection
        except ImportError:
            print("refused")
        else:
            print("standard" if Connection is multiprocessing.connection.Connection else "copy")
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["standard"], done.stdout + done.stderr


def test_every_way_of_importing_a_submodule_through_the_drop_in_gives_the_standard_one_unchanged():
    # `import cupy_ipc.multiprocessing.pool` and the like raised "is not a package".
    code = """if True:
        import sys
        import cupy_ipc.multiprocessing as mp
        import cupy_ipc.multiprocessing.pool
        from cupy_ipc.multiprocessing.pool import ThreadPool
        from cupy_ipc.multiprocessing.dummy import connection
        import cupy_ipc.multiprocessing.shared_memory as shm
        import multiprocessing.dummy.connection, multiprocessing.pool, multiprocessing.shared_memory
        print(ThreadPool is multiprocessing.pool.ThreadPool, connection is multiprocessing.dummy.connection,
              shm is multiprocessing.shared_memory, mp.pool is multiprocessing.pool,
              multiprocessing.pool.__spec__.name, multiprocessing.dummy.connection.__spec__.name)
        try:
            import cupy_ipc.multiprocessing.no_such_module
        except ModuleNotFoundError as e:
            print(e.name)
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True"] * 4 + ["multiprocessing.pool", "multiprocessing.dummy.connection",
                                                  "cupy_ipc.multiprocessing.no_such_module"], done.stderr


def test_a_submodule_that_fails_to_import_says_why():
    # Any ModuleNotFoundError became "has no attribute", also one of a module that the submodule imports.
    code = """if True:
        import sys
        sys.modules["_posixshmem"] = None  # as on a platform without it
        import cupy_ipc.multiprocessing as mp
        try:
            mp.shared_memory
        except ModuleNotFoundError as e:
            print(e.name)
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["_posixshmem"], done.stdout + done.stderr


def test_a_refusal_elsewhere_is_raised_to_the_sender(unshareable):
    a, b = multiprocessing.Pipe()
    with a, b, pytest.raises(cupy_ipc.IpcError, match="managed memory"):
        a.send(_Unshareable())  # a pipe pickles in the caller's thread


def test_a_refusal_in_a_process_pool_fails_the_task_and_keeps_the_pool(unshareable):
    # The executor's call queue pickles on a feeder thread too, and fails the task's future itself; a message
    # that raises when unpickled would kill the worker instead (BrokenProcessPool for every later task).
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        failed = ex.submit(len, _Unshareable())
        with pytest.raises(cupy_ipc.IpcError, match="managed memory"):
            failed.result(60)
        assert ex.submit(len, [1, 2, 3]).result(60) == 3


class _Exported:
    """Stands for an array whose reducer exported it (no GPU needed): records whether it was released."""

    def __init__(self) -> None:
        self.released = False

    def release(self) -> None:
        self.released = True


def _reduce_exported(obj: _Exported) -> tuple[type, tuple[()]]:
    mp._in_message.exports.append(obj)  # what _reduce_ndarray does with its handle
    return list, ()


class _Nested:
    """Pickles its content as a message of its own, as a reducer that pickles a part itself does."""

    def __init__(self, content: object) -> None:
        self.content = content

    def __reduce__(self) -> tuple[type, tuple[bytes]]:
        return bytes, (bytes(multiprocessing.reduction.ForkingPickler.dumps(self.content)),)


@pytest.fixture
def exported():
    yield from _registered(_Exported, _reduce_exported)


def test_a_message_that_fails_to_pickle_releases_its_exports(exported):
    dumps = multiprocessing.reduction.ForkingPickler.dumps
    sent = _Exported()
    dumps([sent, 1])
    assert not sent.released  # delivered: the consumer's opens end it
    first, second = _Exported(), _Exported()
    with pytest.raises((AttributeError, TypeError, multiprocessing.reduction.pickle.PicklingError)):
        dumps([first, _Nested([second]), lambda: 0])  # the lambda fails after both were exported
    assert first.released and second.released  # including the one a nested message exported
    inner = _Exported()
    with pytest.raises((AttributeError, TypeError, multiprocessing.reduction.pickle.PicklingError)):
        dumps(_Nested([inner, lambda: 0]))
    assert inner.released
    assert getattr(mp._in_message, "exports", None) is None  # nothing left over for the next message


def test_a_message_whose_send_fails_releases_its_exports(exported):
    # A pipe or queue whose receiver has gone: the message never leaves, so nobody will open its arrays.
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    there.close()
    lost = _Exported()
    with pytest.raises(OSError):
        here.send([lost, 1])
    assert lost.released
    q = ctx.SimpleQueue()  # pickles, then sends the bytes (as queues' feeders and pools do)
    q._reader.close()
    lost = _Exported()
    with pytest.raises(OSError):
        q.put([lost])
    assert lost.released
    # Delivered: kept for its receiver, also when a later send of other bytes on this thread fails.
    here, there = ctx.Pipe()
    sent = _Exported()
    here.send([sent])
    assert there.recv() == [[]]
    pickled = multiprocessing.reduction.ForkingPickler.dumps([sent])
    there.close()
    with pytest.raises(OSError):
        here.send_bytes(b"other bytes")
    assert not sent.released
    del pickled


def test_a_message_put_on_a_closed_simple_queue_releases_its_exports(exported):
    # SimpleQueue.put pickles the message, then finds the queue closed before it writes anything: the message
    # never left, and its arrays stayed pinned for good.
    q = multiprocessing.get_context("spawn").SimpleQueue()
    q.close()
    lost = _Exported()
    with pytest.raises(OSError, match="handle is closed"):
        q.put([lost])
    assert lost.released
    assert getattr(mp._in_message, "pickled", None) is None


def test_bytes_of_ones_own_dumps_sent_elsewhere_after_a_failed_send_keep_their_exports(exported):
    # A task pickled once and offered to one worker after another: the bytes that a dead worker's pipe refused
    # reach the next, whose opens need the exports.
    ctx = multiprocessing.get_context("spawn")
    dead, gone = ctx.Pipe()
    gone.close()
    live, there = ctx.Pipe()
    task = _Exported()
    pickled = multiprocessing.reduction.ForkingPickler.dumps([task])
    with pytest.raises(OSError):
        dead.send_bytes(pickled)
    live.send_bytes(pickled)
    assert there.recv() == [[]] and not task.released
    assert getattr(mp._in_message, "pickled", None) is None  # nothing of a user's dumps kept on the thread


class _SendsOnTheSide:
    """Sends a message of its own on another connection while the message it is part of is pickled."""

    def __init__(self, conn: object, payload: object) -> None:
        self.conn, self.payload = conn, payload

    def __reduce__(self) -> tuple[type, tuple[()]]:
        self.conn.send(self.payload)  # delivered here and now
        return list, ()


def test_a_message_sent_while_another_is_pickled_keeps_its_exports_when_that_one_fails(exported):
    here, there = multiprocessing.Pipe()
    inner = _Exported()
    with pytest.raises((AttributeError, TypeError, multiprocessing.reduction.pickle.PicklingError)):
        here.send([_SendsOnTheSide(here, [inner]), lambda: 0])
    assert there.recv() == [[]] and not inner.released


def test_an_error_raised_after_the_message_left_keeps_its_exports(exported, monkeypatch):
    # A signal handler's TimeoutError, say, raised just after the last write returned.
    here, there = multiprocessing.Pipe()
    plain = type(here)._send

    def send_then_interrupted(self, buf, *args):
        plain(self, buf, *args)
        raise TimeoutError("alarm")

    monkeypatch.setattr(type(here), "_send", send_then_interrupted)
    sent = _Exported()
    with pytest.raises(TimeoutError):
        here.send([sent])
    monkeypatch.undo()
    assert there.recv() == [[]] and not sent.released


class _PinsOnPickling:
    """Pins an export when pickled, as an array's reducer does (no GPU needed), and notes whether the pin
    ``done`` was still there then."""

    def __init__(self, done: int) -> None:
        self.done, self.pinned, self.done_was_pinned = done, None, None

    def __reduce__(self) -> tuple[type, tuple[()]]:
        self.pinned = _keepalive.pin(None, (0, 64, 0), 0, 1, None, None, ((16,), "float32"))[0]
        self.done_was_pinned = _keepalive.lookup(self.done) is not None
        return list, ()


def _finished_pin() -> int:
    """An export whose one consumer opened it and is done with it: the next sweep ends its pin."""
    export_id, slot, *_ = _keepalive.pin(None, (0, 64, 0), 0, 1, None, None, ((16,), "float32"))
    _keepalive._segment_here().write_opens(slot, 1)
    return export_id


def test_a_sent_message_ends_the_pins_of_finished_exports_once_it_has_left():
    # The sweep that an export makes is left to the sender, after its write: the receiver's open, not the
    # message's trip, waits for it. Bytes pickled by one's own dumps are not sent by the library: swept at once.
    here, there = multiprocessing.Pipe()
    for send in (here.send, lambda m: multiprocessing.reduction.ForkingPickler.dumps(m)):
        done = _finished_pin()
        part = _PinsOnPickling(done)
        send([part])
        assert part.done_was_pinned is (send == here.send)
        assert _keepalive.lookup(done) is None
        assert not _keepalive.deferral.on
        _keepalive.release(part.pinned)
    assert there.recv() == [[]]


def _ended(export_id: int) -> bool:
    deadline = time.monotonic() + 30
    while _keepalive.lookup(export_id) is not None and time.monotonic() < deadline:
        time.sleep(0.01)  # (a Queue's feeder thread sweeps after its write, maybe after the receiver's get)
    return _keepalive.lookup(export_id) is None


@pytest.mark.parametrize("kind", ["SimpleQueue", "Queue"])
def test_a_queues_message_ends_the_pins_of_finished_exports_once_its_write_lock_is_released(kind, monkeypatch):
    # The queue's other writers (a pool's workers sending results) wait for that lock: not for the sweep too.
    q = getattr(multiprocessing.get_context("spawn"), kind)()
    held = []
    sweep_owed = _keepalive.sweep_owed

    def noting_the_lock() -> None:
        if _keepalive._owed:
            free = q._wlock.acquire(False)
            if free:
                q._wlock.release()
            held.append(not free)
        sweep_owed()

    monkeypatch.setattr(_keepalive, "sweep_owed", noting_the_lock)
    done = _finished_pin()
    part = _PinsOnPickling(done)
    q.put([part])
    assert q.get() == [[]]
    assert _ended(done) and part.done_was_pinned
    assert held == [False]
    _keepalive.release(part.pinned)


def test_a_queue_whose_feeder_started_before_the_import_still_ends_finished_pins():
    # Its feeder thread has the plain write lock, whose release is not seen: its writes sweep inside the lock.
    code = """if True:
        import multiprocessing, time
        q = multiprocessing.get_context("spawn").Queue()
        q.put("started")
        import cupy_ipc.multiprocessing
        from cupy_ipc import _keepalive

        class PinsOnPickling:
            def __reduce__(self):
                self.pinned = _keepalive.pin(None, (0, 64, 0), 0, 1, None, None, ((16,), "float32"))[0]
                return list, ()

        done, slot, *_ = _keepalive.pin(None, (0, 64, 0), 0, 1, None, None, ((16,), "float32"))
        _keepalive._segment_here().write_opens(slot, 1)
        q.put([PinsOnPickling()])
        assert q.get(timeout=60) == "started" and q.get(timeout=60) == [[]]
        deadline = time.monotonic() + 30
        while _keepalive.lookup(done) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        print("ended" if _keepalive.lookup(done) is None else "pinned")
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["ended"], out.stderr[-2000:]


def test_a_queue_made_before_the_import_releases_what_its_failed_send_exported():
    # Queues bind their writer's send_bytes when they are made (and unpickled): the write itself is wrapped.
    code = """if True:
        import multiprocessing
        q = multiprocessing.get_context("spawn").Queue()
        import cupy_ipc.multiprocessing as mp
        from multiprocessing.reduction import ForkingPickler

        class Exported:
            released = False
            def release(self):
                self.released = True

        ForkingPickler.register(Exported, lambda o: (mp._in_message.exports.append(o), (list, ()))[1])
        q._reader.close()
        lost = Exported()
        q.put([lost])  # its feeder thread's write fails (and reports it)
        q.close()
        q.join_thread()
        print("released" if lost.released else "pinned")
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["released"], out.stderr[-2000:]


def test_a_refusal_on_a_queues_feeder_thread_releases_what_its_message_exported(unshareable, exported):
    # The receiver raises where the refused part was: the parts exported before it would stay pinned for good.
    q = multiprocessing.get_context("spawn").Queue()
    before = _Exported()
    try:
        q.put([before, _Unshareable(), _Exported()])
        with pytest.raises(cupy_ipc.IpcError, match="could not share a .*_Unshareable"):
            q.get(timeout=10)
        assert before.released
    finally:
        q.close()
        q.join_thread()


def test_a_process_that_cannot_be_started_releases_the_exports_of_its_arguments(exported, refuse_spawns):
    # Its arguments are pickled before the process is made: when it cannot be, no one will open their arrays,
    # which stayed pinned for good (or, in a child of multiprocessing, kept its exit waiting).
    ctx = multiprocessing.get_context("spawn")
    sent = _Exported()
    started = ctx.Process(target=len, args=([sent],))
    started.start()
    started.join(60)
    assert started.exitcode == 0 and not sent.released  # started: its opens end them
    refuse_spawns()
    lost = _Exported()
    with pytest.raises(BlockingIOError):
        ctx.Process(target=len, args=([lost],)).start()
    assert lost.released


def test_a_forked_child_keeps_nothing_it_pickles():
    # A child forked by Process.start runs its target inside the start, which collects the exports of the
    # arguments it pickles (a spawned process's): the child must not collect, and keep, those of its messages.
    code = """if True:
        import gc, multiprocessing, weakref
        import cupy_ipc.multiprocessing as mp
        from multiprocessing.reduction import ForkingPickler

        class Exported:
            def release(self):
                pass

        ForkingPickler.register(Exported, lambda o: (mp._in_message.exports.append(o), (list, ()))[1])

        def pickles(out):
            sent = Exported()
            gone = weakref.ref(sent)
            ForkingPickler.dumps([sent])
            del sent
            gc.collect()
            out.send("kept" if gone() else "freed")

        if __name__ == "__main__":
            r, w = multiprocessing.Pipe(duplex=False)
            child = multiprocessing.get_context("fork").Process(target=pickles, args=(w,))
            child.start()
            print(r.recv())
            child.join(60)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.stdout.split() == ["freed"], out.stderr[-2000:]


class _NoCuda:
    """Stands for the CUDA helpers in a forked child: any use fails the test."""

    def __getattr__(self, name: str):
        pytest.fail(f"a forked child called CUDA (_cuda.{name})")


@pytest.fixture
def inherited_event(monkeypatch):
    """An IpcEvent as a child forked from a CUDA process sees it (no GPU needed: CUDA is never reached)."""
    from cupy_ipc import _events, _fork

    ev = cupy_ipc.IpcEvent.__new__(cupy_ipc.IpcEvent)
    ev._adopt(ctypes.c_void_p(0x1234), 0, False, None, opened=False)
    monkeypatch.setattr(_fork, "_forked_after_cuda", True)
    monkeypatch.setattr(_events, "_cuda", _NoCuda())
    yield ev
    ev._finalizer.detach()  # should a test leave it open: the parent's (fake) event is not to be destroyed


@pytest.mark.parametrize("use", [
    lambda ev: ev.ptr,
    lambda ev: ev.record(),
    lambda ev: ev.wait(),
    lambda ev: ev.wait_from(0, 0),
    lambda ev: ev.synchronize(),
    lambda ev: ev.query(),
    lambda ev: ev.get_ipc_handle(),
    lambda ev: pickle.dumps(ev),
], ids=["ptr", "record", "wait", "wait_from", "synchronize", "query", "get_ipc_handle", "pickle"])
def test_an_event_inherited_by_a_forked_child_raises_the_fork_error(inherited_event, use):
    with pytest.raises(cupy_ipc.IpcError, match="forked after its parent initialized CUDA.*'spawn'"):
        use(inherited_event)
    assert not inherited_event.closed


def test_an_event_inherited_by_a_forked_child_gives_no_handle_even_one_made_before_the_fork(inherited_event):
    inherited_event._handle = object()  # exported in the parent: still refused, as when it was not
    with pytest.raises(cupy_ipc.IpcError, match="forked after its parent initialized CUDA"):
        inherited_event.get_ipc_handle()


def test_an_event_inherited_by_a_forked_child_closes_and_is_collected_without_cuda(inherited_event):
    # Destroying it would be a CUDA call, and the event is the parent's.
    inherited_event.close()
    assert inherited_event.closed
    inherited_event.close()
    ev = cupy_ipc.IpcEvent.__new__(cupy_ipc.IpcEvent)
    ev._adopt(ctypes.c_void_p(0x5678), 0, False, None, opened=True)
    finalizer = ev._finalizer
    del ev
    gc.collect()
    assert not finalizer.alive


class _StaticHandler(multiprocessing.queues.Queue):
    @staticmethod
    def _on_queue_feeder_error(e, obj):  # a handler of its own, static as the plain queue's
        pass


class _BoundHandler(multiprocessing.queues.Queue):
    def _on_queue_feeder_error(self, e, obj):
        pass


@pytest.mark.parametrize("queue_type,handles", [(multiprocessing.queues.Queue, False), (_StaticHandler, True),
                                                (_BoundHandler, True)], ids=["plain", "static", "bound"])
def test_a_queue_subclass_with_its_own_feeder_error_handler_gets_the_error(queue_type, handles):
    # A static override looked like the plain queue's: its handler was never called.
    q = queue_type(ctx=multiprocessing.get_context("spawn"))
    seen = []
    t = threading.Thread(target=lambda *args: seen.append(mp._feeder_handles_errors()),
                         args=(None, q._on_queue_feeder_error))
    t.start()
    t.join()
    q.close()
    assert seen == [handles]


@pytest.mark.parametrize("value, error", [(-1, ValueError), (float("nan"), ValueError), ("1", TypeError),
                                          (True, TypeError), (None, TypeError)])
def test_a_bad_exit_wait_is_refused_and_the_setting_kept(value, error):
    with pytest.raises(error, match="exit wait"):
        mp.set_exit_wait(value)
    assert mp.set_exit_wait(10) == 10.0


def test_the_main_process_notes_no_array_sent(monkeypatch):
    # Its queues flush at exit after the library has closed its segment: it could not wait for its receivers.
    from cupy_ipc import _sent

    monkeypatch.setattr(_sent, "_child", None)
    monkeypatch.setattr(_sent, "_sent", set())
    _sent.note(5)
    assert _sent._child is False and not _sent._sent


def test_the_arrays_a_child_awaits_at_exit_keep_those_not_opened_when_pruned(monkeypatch):
    from cupy_ipc import _sent

    opened = set(range(0, 2000, 2))  # every other export has been opened
    monkeypatch.setattr(_sent, "_child", True)
    monkeypatch.setattr(_sent, "_sent", set())
    monkeypatch.setattr(_sent, "_prune_at", 1024)
    monkeypatch.setattr(_sent._keepalive, "awaiting", lambda ids: ([i for i in ids if i not in opened], set()))
    for export_id in range(1, 2000):
        _sent.note(export_id)
    assert {i for i in range(1, 2000) if i not in opened} <= _sent._sent  # every one not opened is kept
    assert len(_sent._sent) < 1500  # and opened ones went


@pytest.mark.parametrize("cuda_error", [None, "cudaErrorInvalidResourceHandle"])
def test_only_cudas_refusal_of_an_event_is_told_to_use_an_interprocess_one(monkeypatch, cuda_error):
    # Every error of the export said to create the event with interprocess=True, also one that had nothing to
    # do with the event (this process exiting, its segment not made).
    import cupy

    def refused(ptr, device, block):
        raise cupy_ipc.IpcError("the export failed", cuda_error=cuda_error)

    monkeypatch.setattr(mp, "export_event", refused)
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    class Event:  # (no GPU here: what the reducer reads of a cupy.cuda.Event)
        ptr = 0

    with pytest.raises(cupy_ipc.IpcError) as e:
        mp._reduce_cupy_event(Event())
    told = "interprocess=True" in str(e.value)
    assert told == (cuda_error is not None), e.value


def _reads_for_a_pool(conn):
    return conn.recv()


def test_a_failed_task_leaves_no_reference_cycle_through_its_message(monkeypatch):
    # The error kept to fail the task stayed in _loads's locals, and its traceback holds that frame: a cycle
    # through the message's buffer (a memoryview of a BytesIO), which Python 3.12.1's cycle collector freed in
    # an order that crashed the process (bytesiobuf_releasebuffer) in a pool whose result could not be opened.
    import weakref

    monkeypatch.setitem(mp._POOL_READERS, _reads_for_a_pool.__code__, lambda message, error: ("failed", error))
    here, there = multiprocessing.Pipe()
    try:
        there.send(mp_workers.Unopenable())
        gc.collect()
        gc.disable()
        try:
            failed, error = _reads_for_a_pool(here)
            assert failed == "failed" and isinstance(error, cupy_ipc.HandleError)
            gone = weakref.ref(error)
            del error
            assert gone() is None, "the error of a failed task is kept alive by a reference cycle"
        finally:
            gc.enable()
    finally:
        here.close()
        there.close()


@pytest.mark.parametrize("answer, initialized", [
    ("CUDA_SUCCESS", True), ("CUDA_ERROR_NOT_INITIALIZED", False), ("CUDA_ERROR_STUB_LIBRARY", False),
    ("CUDA_ERROR_NO_DEVICE", False), ("CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", False)])
def test_a_driver_that_could_not_initialize_is_not_taken_for_cuda_initialized(monkeypatch, answer, initialized):
    # Every answer but "not initialized" counted as initialized: with the toolkit's stub library (a build
    # container) every fork warned, and every forked child's use of the library raised IpcError.
    import cuda.bindings.driver as driver

    result = getattr(driver.CUresult, answer)  # (here: an error inside the call reads as "no driver")
    monkeypatch.setattr(driver, "cuCtxGetCurrent", lambda: (result, None))
    monkeypatch.setattr(cupy_ipc._fork, "_forked_after_cuda", False)
    assert cupy_ipc._fork.cuda_initialized() is initialized


def test_a_child_forked_after_cuda_asks_the_driver_nothing_before_its_own_fork(monkeypatch):
    # The driver's calls may crash or hang in such a child: Process.start's fork check and the before-fork hook
    # must tell from the library's own flag that CUDA was initialized (the child inherited it).
    import cuda.bindings.driver as driver

    asked = []
    monkeypatch.setattr(driver, "cuCtxGetCurrent", lambda: asked.append(1) or (driver.CUresult.CUDA_SUCCESS, None))
    monkeypatch.setattr(cupy_ipc._fork, "_forked_after_cuda", True)
    assert cupy_ipc._fork.cuda_initialized()
    assert asked == []
