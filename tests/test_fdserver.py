"""The producer's descriptor server, with real processes and the kernel's real rules (no GPU needed).

``cupy_ipc.multiprocessing`` sends arrays of memory shared by descriptor as bytes; the receiver asks the
producer's server for the descriptors. These tests serve ordinary descriptors (memfds with known content).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import struct
import sys
import threading
import time

import pytest

from cupy_ipc import IpcError, ProducerExitedError
from cupy_ipc._fdserver import fetch, serve

from test_descriptors import _as_nobody, _at_the_open_file_limit, _Driver, _memfd, _read, may_switch_user  # noqa: F401

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux descriptors")


def _child(work, *, pipe_out: int) -> int:
    """Fork; the child runs ``work()``, writes its text to ``pipe_out`` and exits."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            text = work()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            text, code = f"error {type(e).__name__}: {e}", 1
        os.write(pipe_out, text.encode() + b"\n")
        os._exit(code)
    return pid


def _child_line(work, r: int, w: int, *more: int) -> str:
    """Run ``work`` in a forked child that writes to pipe ``w``; its line, read from ``r`` once the child has
    exited. ``r``, ``w`` and the descriptors ``more`` are closed then."""
    pid = _child(work, pipe_out=w)
    line = _read_line(r)
    os.waitpid(pid, 0)
    for x in (r, w, *more):
        os.close(x)
    return line


def _read_line(fd: int) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


def _serve_memfd(content: bytes, w: int) -> int:
    """Serve a new memfd of ``content``; write the server's name and the descriptor's number to ``w``."""
    fd = _memfd(content)
    name = serve(lambda fds, _: fds == [fd])
    os.write(w, name.hex().encode() + f" {fd}\n".encode())
    return fd


def _serving_child(content: bytes) -> tuple[int, bytes, int, int, list[int]]:
    """Fork a producer that serves a new memfd of ``content`` until a byte arrives on its go pipe:
    ``(pid, its server's address, the descriptor's number there, the go pipe's write end, the pipes to close)``."""
    r, w = os.pipe()
    go_r, go_w = os.pipe()

    def producer() -> str:
        _serve_memfd(content, w)
        os.read(go_r, 1)  # until told to exit
        return "done"

    pid = _child(producer, pipe_out=w)
    name_hex, fd = _read_line(r).split()
    return pid, bytes.fromhex(name_hex), int(fd), go_w, [r, w, go_r, go_w]


def test_a_child_fetches_an_allowed_descriptor_and_is_refused_others():
    fd = _memfd(b"served")
    name = serve(lambda fds, _: fds == [fd])
    r, w = os.pipe()

    def consumer() -> str:
        (got,) = fetch(name, os.getppid(), [fd])
        content = _read(got).decode()
        try:
            fetch(name, os.getppid(), [0])  # stdin: not memory the producer exports
            refused = "not refused"
        except IpcError as e:
            refused = str(e)
        (again,) = fetch(name, os.getppid(), [fd])  # the connection survives a refusal
        return f"{content}|{refused}|{_read(again).decode()}"

    line = _child_line(consumer, r, w, fd)
    content, refused, again = line.split("|")
    assert content == "served" and again == "served", line
    assert "no longer shares this memory" in refused


def test_several_descriptors_in_one_request():
    fds = [_memfd(f"piece {k}".encode()) for k in range(5)]
    name = serve(lambda got, _: set(got) <= set(fds))
    got = fetch(name, os.getpid(), fds)
    try:
        assert [_read(g) for g in got] == [f"piece {k}".encode() for k in range(5)]
        assert not set(got) & set(fds)  # duplicates, the caller's to close
    finally:
        for x in (*got, *fds):
            os.close(x)
    with pytest.raises(IpcError, match="at once"):
        fetch(name, os.getpid(), [])


def test_more_descriptors_than_one_message_carries_come_in_several():
    # A run of virtual-memory pieces may have up to 4097 (PyTorch's expandable segments: one per 20 MiB).
    fds = [_memfd(f"piece {k}".encode()) for k in range(600)]
    name = serve(lambda got, resource: got == fds and resource == 1, 1)
    try:
        got = fetch(name, os.getpid(), fds, 1)
        assert [_read(g) for g in got] == [f"piece {k}".encode() for k in range(600)]
        os_close_all(got)
        with pytest.raises(IpcError, match="no longer shares this memory"):
            fetch(name, os.getpid(), fds[::-1], 1)  # other numbers than the run's: refused whole
        got = fetch(name, os.getpid(), fds, 1)  # and the connection goes on
        assert len(got) == 600
        os_close_all(got)
    finally:
        os_close_all(fds)


def os_close_all(fds):
    for fd in fds:
        os.close(fd)


def test_a_consumer_waits_while_the_producers_queue_of_connections_is_full():
    # A socket with a time-out is non-blocking: connect() to a full queue failed at once with EAGAIN, and the
    # message was lost, where the producer's thread would have accepted it a moment later.
    from cupy_ipc import _fdserver

    name = b"\0cupy_ipc-test-busy-" + os.urandom(4).hex().encode()
    fd = _memfd(b"busy")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen(0)
    queued = []
    while len(queued) < 8:  # fill the queue
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(name)
        except BlockingIOError:
            s.close()
            break
        queued.append(s)

    def accept_late():
        time.sleep(0.5)
        for s in queued:  # accepted first, then read to their end
            s.close()
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if conn.recv(_fdserver._REQUEST.size + 4):
                socket.send_fds(conn, [_fdserver._COUNT.pack(1)], [fd])
            conn.close()

    threading.Thread(target=accept_late, daemon=True).start()
    try:
        (got,) = fetch(name + bytes(16), os.getpid(), [fd], 1)
        assert _read(got) == b"busy"
        os.close(got)
    finally:
        for s in queued:
            s.close()
        listener.close()
        _fdserver._close_connections()
        os.close(fd)


def _ended_by_server(s: socket.socket, within: float = 10.0) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _export_a_pool_and_virtual_memory(conn) -> None:
    """A new process's first exports, a pool and an allocation of virtual memory: sends the address that goes
    with an array of the pool, the pool's id, both descriptors' numbers; serves until told to exit."""
    from cupy_ipc import _cuda, _pools, _vmm
    from cupy_ipc._array_handle import _may_serve as _exported

    pool, memory = _memfd(b"pool"), _memfd(b"virtual memory")
    driver = _Driver(pool, memory)
    _cuda._driver = lambda: driver
    _cuda._libcuda_fn = lambda name, *argtypes: None  # the fake driver serves, also where libcuda loads
    _pools._owned.add(0x5000)  # a ShareableMemoryPool's
    _, pool_fd, pool_id = _pools.export(0x1000, 0x5000)
    memory_fd, _ = _vmm.export(0x7F0000000000, 5)
    conn.send((serve(_exported, pool_id), pool_id, pool_fd, memory_fd))
    conn.recv()


def test_the_key_sent_with_an_array_of_a_pool_fetches_no_virtual_memory():
    # Pools and allocations of virtual memory were numbered apart, each from 1: the first of each that a
    # process exported had one id, so the key of an array of the pool was the allocation's key too.
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    producer = ctx.Process(target=_export_a_pool_and_virtual_memory, args=(theirs,))
    producer.start()
    try:
        assert ours.poll(60), "the producer sent nothing"
        address, pool_id, pool_fd, memory_fd = ours.recv()
        (got,) = fetch(address, producer.pid, [pool_fd], pool_id)
        assert _read(got) == b"pool"
        os.close(got)
        with pytest.raises(IpcError, match="no longer shares this memory"):
            os.close(*fetch(address, producer.pid, [memory_fd], pool_id))
    finally:
        ours.send("exit")
        producer.join(30)
        if producer.is_alive():
            producer.kill()
            producer.join(30)


def test_connections_that_send_nothing_or_a_wrong_secret_or_are_too_many_are_closed(monkeypatch):
    # Any process of this user may connect; each connection served holds a thread and a descriptor.
    from cupy_ipc import _fdserver

    monkeypatch.setattr(_fdserver, "_FIRST_S", 0.2)
    address = serve(lambda fds, resource: False)
    idle = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
    try:
        for s in idle:
            s.connect(address[:-16])
        assert all(_ended_by_server(s) for s in idle)
        wrong = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        idle.append(wrong)
        wrong.connect(address[:-16])
        wrong.sendall(_fdserver._REQUEST.pack(bytes(16), 1, 0) + struct.pack("<i", 0))
        assert wrong.recv(4) == _fdserver._COUNT.pack(0) and _ended_by_server(wrong)
        monkeypatch.setattr(_fdserver, "_MAX_SERVED", len(_fdserver._accepted))  # full
        extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        idle.append(extra)
        extra.connect(address[:-16])
        assert _ended_by_server(extra, 2.0)
    finally:
        for s in idle:
            s.close()


def test_a_request_that_does_not_arrive_whole_in_time_is_closed(monkeypatch):
    # The key is checked only once a whole request has come: a client without it that sent a request's head
    # alone held the connection's thread for the idle time-out (300 s) rather than the first request's
    # (5 s), and one that sent a byte now and then held it for ever; 1024 of them left no consumer served.
    from cupy_ipc import _fdserver

    monkeypatch.setattr(_fdserver, "_FIRST_S", 0.3)
    fd = _memfd(b"served")
    address = serve(lambda fds, _: fds == [fd])
    head_only = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    trickle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        head_only.connect(address[:-16])
        head_only.sendall(_fdserver._REQUEST.pack(bytes(16), 4, 0))  # four numbers announced, none sent
        assert _ended_by_server(head_only, 3.0)
        trickle.connect(address[:-16])
        trickle.settimeout(0.1)
        start, ended = time.monotonic(), False
        for byte in _fdserver._REQUEST.pack(bytes(16), 4, 0):  # a byte every 0.1 s: each read's wait is short
            try:
                trickle.sendall(bytes([byte]), socket.MSG_NOSIGNAL)
                ended = trickle.recv(1) == b""
            except TimeoutError:
                pass
            except OSError:
                ended = True
            if ended:
                break
        assert ended and time.monotonic() - start < 2.0, time.monotonic() - start
        (got,) = fetch(address, os.getpid(), [fd])  # and the server still serves
        assert _read(got) == b"served"
        os.close(got)
    finally:
        head_only.close()
        trickle.close()
        os.close(fd)


def test_a_consumer_that_leaves_its_answers_unread_holds_up_no_one():
    # The server sends descriptors holding the lock that every request's check and send and every close of an
    # exported descriptor take: it must drop a consumer whose answers fill its socket rather than wait for it
    # (it waited up to the idle time-out, 300 s, as its socket had a time-out).
    from cupy_ipc import _fdserver

    fd = _memfd(b"served")
    address = serve(lambda fds, _: fds == [fd])
    greedy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    greedy.connect(address[:-16])
    greedy.setblocking(False)
    request = _fdserver._REQUEST.pack(address[-16:], 1, 0) + struct.pack("<i", fd)
    closing = threading.Thread(target=_fdserver.retire, args=([os.dup(fd)],))
    try:
        with contextlib.suppress(OSError):
            for _ in range(100_000):  # until the server reads no more (or drops the connection)
                greedy.send(request)
        time.sleep(0.5)  # the server answers what it read
        closing.start()
        closing.join(5)
        assert not closing.is_alive(), "closing an exported descriptor waited for a consumer's reading"
        (got,) = fetch(address, os.getpid(), [fd])
        assert _read(got) == b"served"
        os.close(got)
    finally:
        greedy.close()  # which ends a wait for it
        if closing.ident is not None:
            closing.join(30)
        os.close(fd)


def test_a_request_without_the_servers_secret_or_for_other_memory_is_refused():
    fd = _memfd(b"served")
    allowed = {41, 42}
    address = serve(lambda fds, resource: fds == [fd] and resource in allowed, 42)
    try:
        (got,) = fetch(address, os.getpid(), [fd], 42)
        assert _read(got) == b"served"
        os.close(got)
        # The socket's name is public (/proc/net/unix); the secret is not.
        with pytest.raises(IpcError, match="no longer shares this memory"):
            fetch(address[:-16] + bytes(16), os.getpid(), [fd], 42)
        # Memory this process exports, but whose key the consumer was not sent (with another array's key).
        with pytest.raises(IpcError, match="no longer shares this memory"):
            fetch(address, os.getpid(), [fd], 41)
        (got,) = fetch(serve(lambda fds, resource: fds == [fd] and resource in allowed, 41), os.getpid(), [fd], 41)
        os.close(got)
        # The right number and key for memory no longer exported: a descriptor number reused since it left.
        allowed.clear()
        with pytest.raises(IpcError, match="no longer shares this memory"):
            fetch(address, os.getpid(), [fd], 42)
        with pytest.raises(IpcError, match="not a descriptor server's address"):
            fetch(b"short", os.getpid(), [fd], 42)
    finally:
        os.close(fd)


def test_a_check_that_raises_refuses_the_request_and_the_connection_goes_on(capfd):
    # The check of a request raised: the consumer is refused with the usual error, the producer says why
    # (on stderr, as the warning raises under this project's warnings-as-errors filter), and the next
    # request on the same connection is served.
    fd = _memfd(b"served")

    def broken(fds, resource):
        raise RuntimeError("the check broke")

    address = serve(broken)
    try:
        with pytest.raises(IpcError, match="no longer shares this memory"):
            fetch(address, os.getpid(), [fd])
        assert "checking them failed: RuntimeError('the check broke')" in capfd.readouterr().err
        serve(lambda fds, _: fds == [fd])
        (got,) = fetch(address, os.getpid(), [fd])  # over the connection of the refused request
        assert _read(got) == b"served"
        os.close(got)
    finally:
        os.close(fd)


def test_connections_to_producers_that_have_gone_are_closed_as_new_ones_open(monkeypatch):
    # A consumer of many short-lived producers must not keep a socket for each: once the table has grown,
    # a new connection closes those whose producer has gone, and keeps the live ones.
    from cupy_ipc import _fdserver

    started, pipes = [], []

    def fetch_from_new_producer(content: bytes) -> tuple[int, bytes]:
        pid, address, fd, go_w, fds = _serving_child(content)
        pipes.extend(fds)
        started.append((pid, go_w))
        (got,) = fetch(address, pid, [fd])
        assert _read(got) == content
        os.close(got)
        return pid, address[:-16]

    try:
        gone_pid, gone = fetch_from_new_producer(b"gone soon")
        _, alive = fetch_from_new_producer(b"alive")
        gone_sock = _fdserver._connections[gone][1]
        os.write(started[0][1], b"x")
        os.waitpid(gone_pid, 0)
        assert gone in _fdserver._connections  # nothing looked yet
        monkeypatch.setattr(_fdserver, "_prune_at", len(_fdserver._connections))  # the table has grown
        _, new = fetch_from_new_producer(b"new")  # a new connection: the table is looked at
        assert gone not in _fdserver._connections and gone_sock.fileno() == -1
        assert alive in _fdserver._connections and new in _fdserver._connections  # alive, idle: kept
    finally:
        for pid, go_w in started:
            try:
                os.write(go_w, b"x")
                os.waitpid(pid, 0)
            except (ChildProcessError, BrokenPipeError):
                pass
        for x in pipes:
            os.close(x)


def test_a_producer_that_has_exited_is_named():
    pid, name, fd, _, pipes = _serving_child(b"x")
    (got,) = fetch(name, pid, [fd])  # alive: served, and the connection is cached
    os.close(got)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    for x in pipes:
        os.close(x)
    with pytest.raises(ProducerExitedError, match=f"process {pid} has exited"):
        fetch(name, pid, [fd])  # over the cached, now broken connection
    with pytest.raises(ProducerExitedError):
        fetch(name, pid, [fd])  # and connecting anew


def test_a_non_dumpable_producer_serves_where_pidfd_getfd_is_refused(may_switch_user):  # noqa: F811
    # The pair of the EPERM test: both the same non-root user, the producer not dumpable.
    from cupy_ipc._descriptors import take_fd

    info_r, info_w = os.pipe()
    out_r, out_w = os.pipe()
    go_r, go_w = os.pipe()

    def producer() -> str:
        _as_nobody(dumpable=0)
        fd = _memfd(b"no ptrace needed")
        name = serve(lambda fds, _: fds == [fd])
        os.write(info_w, f"{os.getpid()} {fd} {name.hex()}\n".encode())
        os.read(go_r, 1)
        return "producer done"

    def consumer() -> str:
        _as_nobody()
        pid, fd, name_hex = _read_line(info_r).split()
        try:
            take_fd(int(pid), int(fd))
            taken = "taken"
        except IpcError as e:
            taken = "refused" if "EPERM" in str(e) else str(e)
        (got,) = fetch(bytes.fromhex(name_hex), int(pid), [int(fd)])
        os.write(go_w, b"x")
        return f"{taken}|{_read(got).decode()}"

    prod = _child(producer, pipe_out=out_w)
    cons = _child(consumer, pipe_out=out_w)
    for x in (info_r, info_w, out_w, go_r, go_w):
        os.close(x)
    data = b""
    while chunk := os.read(out_r, 4096):  # until both have exited
        data += chunk
    os.close(out_r)
    for pid in (prod, cons):
        os.waitpid(pid, 0)
    lines = set(data.decode().split("\n")) - {""}
    assert lines == {"producer done", "refused|no ptrace needed"}, lines


def test_another_user_is_not_served(may_switch_user):  # noqa: F811
    fd = _memfd(b"root's")
    name = serve(lambda fds, _: fds == [fd])
    r, w = os.pipe()

    def consumer() -> str:
        _as_nobody()
        try:
            fetch(name, os.getppid(), [fd])
            return "served"
        except IpcError as e:
            return str(e)

    line = _child_line(consumer, r, w, fd)
    assert "closed the connection" in line, line


def test_a_forked_child_serves_under_its_own_name():
    name = serve(lambda *_: False)
    r, w = os.pipe()
    pid = _child(lambda: serve(lambda *_: False).hex(), pipe_out=w)
    child_name = bytes.fromhex(_read_line(r))
    os.waitpid(pid, 0)
    os.close(r)
    os.close(w)
    assert child_name != name and serve(lambda *_: False) == name


def test_a_child_forked_while_a_thread_sends_descriptors_can_close_its_own():
    # The lock held while descriptors are sent or closed: held by another thread at the fork, it would stay
    # held in the child for good.
    from cupy_ipc import _fdserver

    held, release = threading.Event(), threading.Event()

    def sender():
        with _fdserver._sending:
            held.set()
            release.wait(30)

    t = threading.Thread(target=sender)
    t.start()
    held.wait(30)
    r, w = os.pipe()
    try:
        def child():
            signal.alarm(10)  # a child that blocks is killed, and its line is empty
            extra = os.dup(r)
            _fdserver.retire([extra])
            return "closed"

        line = _child_line(child, r, w)
    finally:
        release.set()
        t.join(30)
    assert line == "closed"


def test_a_forked_child_hands_out_none_of_its_parents_exported_descriptors():
    # The parent's export tables name descriptors the child must not serve: it forgets them at fork.
    from cupy_ipc import _vmm
    from cupy_ipc._array_handle import _may_serve as _exported

    r, w = os.pipe()
    fd = os.dup(r)
    key = (0x7F0000000000, 1, 2)
    with _vmm._lock:
        _vmm._exports[-1], _vmm._by_mapping[key], _vmm._by_fd[fd] = (fd, key), -1, -1
        saved_sweep_at, _vmm._sweep_at = _vmm._sweep_at, 10_000
    try:
        assert _exported([fd], -1)
        pid = _child(lambda: f"{_exported([fd], -1)} {_vmm._sweep_at} {len(_vmm._exports)}", pipe_out=w)
        line = _read_line(r)
        os.waitpid(pid, 0)
    finally:
        with _vmm._lock:
            del _vmm._exports[-1], _vmm._by_mapping[key], _vmm._by_fd[fd]
            _vmm._sweep_at = saved_sweep_at
        for x in (r, w, fd):
            os.close(x)
    assert line == f"False {_vmm._SWEEP_FLOOR} 0", line


def test_a_request_that_timed_out_leaves_no_answer_for_the_next(monkeypatch):
    # The server answers the first request late: the consumer gives up on it, and the late answer must not
    # be taken as the answer to its next request (which asks for another descriptor).
    from cupy_ipc import _fdserver

    slow, fast = _memfd(b"slow"), _memfd(b"fast")
    asked = []

    def allowed(numbers: list[int], resource: int) -> bool:
        (n,) = numbers
        asked.append(n)
        if n == slow and asked.count(slow) == 1:
            time.sleep(1.0)
        return n in (slow, fast)

    name = serve(allowed)
    _fdserver._close_connections()  # a connection cached by an earlier test has the default timeout
    monkeypatch.setattr(_fdserver, "TIMEOUT_S", 0.2)
    try:
        with pytest.raises(IpcError, match="did not answer"):
            fetch(name, os.getpid(), [slow])
        monkeypatch.setattr(_fdserver, "TIMEOUT_S", 30.0)  # the server checks one request at a time
        (got,) = fetch(name, os.getpid(), [fast])
        assert _read(got) == b"fast"
        os.close(got)
    finally:
        _fdserver._close_connections()
        for x in (slow, fast):
            os.close(x)


def test_descriptors_dropped_at_the_open_file_limit_are_reported():
    fd = _memfd(b"served")
    name = serve(lambda fds, _: fds == [fd])
    r, w = os.pipe()

    def consumer() -> str:
        from cupy_ipc import _fdserver

        _fdserver._connection(name[:-16], os.getppid())  # connected first: the limit is for the answer's descriptor
        with _at_the_open_file_limit():
            try:
                fetch(name, os.getppid(), [fd])
                first = "served"
            except IpcError as e:
                first = str(e)
        (got,) = fetch(name, os.getppid(), [fd])  # the same connection, in step
        return f"{first}|{_read(got).decode()}"

    line = _child_line(consumer, r, w, fd)
    first, again = line.split("|")
    assert "open-file limit" in first, line
    assert again == "served", line


def test_a_process_at_its_open_file_limit_gets_the_librarys_error_from_fetch_and_serve():
    # Neither could open its socket, and the OSError escaped: a receiver catching IpcError missed it.
    fd = _memfd(b"served")
    name = serve(lambda fds, _: fds == [fd])
    r, w = os.pipe()

    def child() -> str:
        outcomes = []
        with _at_the_open_file_limit():  # the parent's server and connections are not the child's: it opens its own
            for call in (lambda: fetch(name, os.getppid(), [fd]), lambda: serve(lambda *_: False)):
                try:
                    call()
                    outcomes.append("no error")
                except Exception as e:  # noqa: BLE001 - its type is the point
                    outcomes.append(f"{type(e).__name__}: {e}")
        return "|".join(outcomes)

    line = _child_line(child, r, w, fd)
    fetched, served = line.split("|")
    assert fetched.startswith("IpcError: ") and "Too many open files" in fetched, line
    assert served.startswith("IpcError: ") and "Too many open files" in served, line


def test_the_server_outlives_a_failed_accept():
    # A producer at its open-file limit cannot accept a connection: its server waits and accepts it later,
    # rather than ending and leaving every later consumer waiting on a socket nobody serves. (The accept
    # already waiting when the limit falls has its descriptor: the first consumer is served; the next
    # accept is the one that fails.)
    from cupy_ipc import _fdserver

    r, w = os.pipe()
    go_r, go_w = os.pipe()

    def producer() -> str:
        fd = _memfd(b"later")
        name = serve(lambda fds, _: fds == [fd])
        with _at_the_open_file_limit():
            os.write(w, name.hex().encode() + f" {fd}\n".encode())
            time.sleep(0.5)  # the consumer's connection waits, unaccepted
        os.read(go_r, 1)
        return "done"

    pid = _child(producer, pipe_out=w)
    name_hex, fd = _read_line(r).split()
    try:
        for _ in range(2):  # each over a new connection
            (got,) = fetch(bytes.fromhex(name_hex), pid, [int(fd)])
            assert _read(got) == b"later"
            os.close(got)
            _fdserver._close_connections()
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)
        for x in (r, w, go_r, go_w):
            os.close(x)


def test_a_child_forked_by_the_producer_does_not_keep_its_consumers_waiting():
    # The producer forks, then exits: its child must not hold the consumer's connection open, or the
    # consumer's next request would wait for an answer nobody sends instead of learning the producer is gone.
    r, w = os.pipe()
    go_r, go_w = os.pipe()

    def producer() -> str:
        _serve_memfd(b"x", w)
        os.read(go_r, 1)  # the consumer's connection is accepted and served
        child = os.fork()
        if child == 0:
            time.sleep(60)  # outlives the producer
            os._exit(0)
        return str(child)

    pid = _child(producer, pipe_out=w)
    name_hex, fd = _read_line(r).split()
    name = bytes.fromhex(name_hex)
    (got,) = fetch(name, pid, [int(fd)])
    os.close(got)
    os.write(go_w, b"x")
    grandchild = int(_read_line(r))
    os.waitpid(pid, 0)
    try:
        t = time.monotonic()
        with pytest.raises(ProducerExitedError):
            fetch(name, pid, [int(fd)])  # over the cached connection
        assert time.monotonic() - t < 10
    finally:
        os.kill(grandchild, signal.SIGKILL)
        for x in (r, w, go_r, go_w):
            os.close(x)


def test_a_connection_closed_under_a_request_is_replaced():
    # Another thread may drop a connection (after its own request failed) just before this one uses it.
    from cupy_ipc import _fdserver

    fd = _memfd(b"again")
    name = serve(lambda fds, _: fds == [fd])
    try:
        (got,) = fetch(name, os.getpid(), [fd])  # the connection is cached
        os.close(got)
        _fdserver._connections[name[:-16]][1].close()  # closed, still in the table
        (got,) = fetch(name, os.getpid(), [fd])
        assert _read(got) == b"again"
        os.close(got)
    finally:
        _fdserver._close_connections()
        os.close(fd)


def test_descriptors_received_close_on_exec():
    # A program this process runs must not keep the producer's memory alive.
    fd = _memfd(b"served")
    name = serve(lambda fds, _: fds == [fd])
    (got,) = fetch(name, os.getpid(), [fd])
    try:
        assert not os.get_inheritable(got)
        assert _read(got) == b"served"
    finally:
        os.close(got)
        os.close(fd)


def test_a_server_that_is_not_the_producers_is_not_asked():
    # Once a producer has gone, any process may listen at its name: the consumer must not send it the secret
    # nor take descriptors from it. Here the server is this process's, and the producer named another one.
    from cupy_ipc import _fdserver

    fd = _memfd(b"served")
    name = serve(lambda fds, _: fds == [fd])
    _fdserver._close_connections()  # the check is made on connecting
    try:
        with pytest.raises(IpcError, match="not the producer"):
            fetch(name, os.getppid(), [fd])  # a live process, not the one listening
        pid = _child(lambda: "gone", pipe_out=os.open(os.devnull, os.O_WRONLY))
        os.waitpid(pid, 0)
        with pytest.raises(ProducerExitedError):
            fetch(name, pid, [fd])  # a process that has exited
    finally:
        os.close(fd)


def test_an_exporter_closing_a_descriptor_waits_for_a_request_being_served():
    # Closed between a request's check and its send, the number could be reused by another file, which the
    # server would send in its place.
    from cupy_ipc import _fdserver

    fd = _memfd(b"exported")
    checking, go = threading.Event(), threading.Event()

    def allowed(numbers: list[int], resource: int) -> bool:
        checking.set()
        go.wait(10)
        return numbers == [fd]

    name = serve(allowed)
    got: list[int] = []
    asking = threading.Thread(target=lambda: got.extend(fetch(name, os.getpid(), [fd])))
    asking.start()
    try:
        assert checking.wait(10)
        closing = threading.Thread(target=_fdserver.retire, args=([fd],))
        closing.start()
        closing.join(0.3)
        assert closing.is_alive(), "the descriptor was closed while a request for it was being checked"
    finally:
        go.set()
        asking.join(10)
    closing.join(10)
    assert not closing.is_alive() and len(got) == 1
    assert _read(got[0]) == b"exported"
    os.close(got[0])


@pytest.mark.parametrize("kind", ["vmm", "pool"])
def test_descriptors_are_asked_of_the_producer_before_the_librarys_lock_is_taken(kind, monkeypatch):
    # The import used to ask for them under the lock every open and release takes: a producer slow to answer
    # (stopped, say) held up this process's opens and releases of every other array for up to 30 s.
    import cupy

    from cupy_ipc import IpcArrayHandle, _fdserver, _mapping, _segment
    from cupy_ipc._wire import Kind

    fd = _memfd(b"piece")
    steps: list[str] = []
    fetch = _fdserver.fetch

    def fetching(*args):
        steps.append("fetch")
        return fetch(*args)

    class Stop(Exception):
        pass

    def acquire(*args, **kwargs):
        steps.append("acquire")
        raise Stop

    monkeypatch.setattr(_fdserver, "fetch", fetching)
    monkeypatch.setattr(_mapping, "acquire", acquire)
    monkeypatch.setattr(_segment, "attach", lambda token, pid: None)
    h = IpcArrayHandle(memory_handle=bytes(range(64)), offset=0, allocation_size=64, shape=(16,), strides=(4,),
                       dtype="float32", device=(0, bytes(16)), producer=(os.getpid(), b"t" * 16, b"b" * 16, "h"),
                       kind=Kind.POOL if kind == "pool" else Kind.VMM, fd=fd, resource=3)
    h._ask_producer(serve(lambda fds, resource: fds == [fd] and resource == 3, 3))
    try:
        with pytest.raises(Stop):
            h._mapped(0, 0, cupy.cuda.Stream.null, 0)
        assert steps == ["fetch", "acquire"]
        assert _read(h._fd[0]) == b"piece"  # kept by the handle: the import takes copies
    finally:
        h.close()
        os.close(fd)


def test_a_producer_that_has_exited_but_was_not_waited_for_is_told_as_exited():
    # A child that exits stays a zombie until its parent waits for it (a multiprocessing child until joined):
    # the signal test took it for alive, and a receiver that could not reach its server was told "could not
    # reach producer" instead of ProducerExitedError.
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(f"/proc/{child.pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1][1:2] == b"Z":
                    break
            time.sleep(0.02)
        else:
            pytest.fail("the child did not exit")
        with pytest.raises(ProducerExitedError, match=f"producer process {child.pid} has exited"):
            fetch(b"\0cupy_ipc-no-server-" + bytes(16), child.pid, [3])
    finally:
        child.wait()


def test_a_server_whose_name_is_taken_raises_ipc_error_and_keeps_no_socket(monkeypatch):
    # Any process may bind a name in the abstract namespace: the bind's OSError escaped, and its socket stayed.
    from cupy_ipc import _fdserver

    taken = b"\0cupy_ipc-taken-" + os.urandom(8).hex().encode()
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(taken)
    monkeypatch.setattr(_fdserver, "_server", None)
    monkeypatch.setattr(_fdserver, "_name", lambda token: taken)
    try:
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(IpcError, match="could not start this process's descriptor server"):
            serve(lambda fds, resource: False)
        assert len(os.listdir("/proc/self/fd")) == before
        assert _fdserver._server is None
    finally:
        squatter.close()


def test_a_server_whose_thread_cannot_start_raises_ipc_error_and_a_later_export_starts_one(monkeypatch):
    # The failed start left the server recorded: later exports handed out the address of a socket nobody served.
    from cupy_ipc import _fdserver

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    name = b"\0cupy_ipc-threadless-" + os.urandom(8).hex().encode()
    monkeypatch.setattr(_fdserver, "_server", None)
    monkeypatch.setattr(_fdserver, "_name", lambda token: name)
    r, w = os.pipe()
    try:
        with monkeypatch.context() as m:
            m.setattr(threading.Thread, "start", no_thread)
            before = len(os.listdir("/proc/self/fd"))
            with pytest.raises(IpcError, match="could not start this process's descriptor server: can't start"):
                serve(lambda fds, resource: False)
            assert len(os.listdir("/proc/self/fd")) == before
        got = fetch(serve(lambda fds, resource: fds == [r] and resource == 7, 7), os.getpid(), [r], 7)
        assert os.path.samestat(os.fstat(got[0]), os.fstat(r))
        os.close(got[0])
    finally:
        os.close(r)
        os.close(w)
        if _fdserver._server is not None:
            _fdserver._server[1].close()


def test_an_answer_cut_short_at_the_open_file_limit_is_not_taken_for_the_next_request():
    # An answer of more than 253 descriptors comes in several messages. Dropped on receipt at the open-file limit,
    # the first one ended the request, and the rest stayed on the connection: the next request, for other
    # memory, took the descriptors of the first as its own.
    first = [_memfd(f"first {k}".encode()) for k in range(300)]
    other = [_memfd(f"other {k}".encode()) for k in range(47)]

    def allowed(fds: list[int], resource: int) -> bool:
        return (resource, fds) in ((1, first), (2, other))

    address_first, address_other = serve(allowed, 1), serve(allowed, 2)
    r, w = os.pipe()

    def consumer() -> str:
        from cupy_ipc import _fdserver

        _fdserver._connection(address_first[:-16], os.getppid())  # connected first: the limit is for the answer
        with _at_the_open_file_limit():
            try:
                os_close_all(fetch(address_first, os.getppid(), first, 1))
                dropped = "served"
            except IpcError as e:
                dropped = str(e)
        got = fetch(address_other, os.getppid(), other, 2)
        return f"{dropped}|{','.join(_read(g).decode() for g in got)}"

    line = _child_line(consumer, r, w, *first, *other)
    dropped, got = line.split("|")
    assert "open-file limit" in dropped, line
    assert got.split(",") == [f"other {k}" for k in range(47)], line


def _ended_by(status: int) -> str:
    return signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"


def test_a_consumer_gone_before_its_answer_does_not_kill_the_producer():
    # The server's sends went without MSG_NOSIGNAL: in a producer that keeps SIGPIPE's default action (as
    # command-line tools set it, and programs embedding Python have it), a consumer that gave up on its answer
    # (timed out, interrupted, killed) before the answer left killed the producer.
    from cupy_ipc import _fdserver

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            fd = _memfd(b"late")
            address = serve(lambda fds, _: time.sleep(0.5) or fds == [fd], 1)  # a check that takes a while
            os.write(w, address.hex().encode() + f" {fd}\n".encode())
            time.sleep(2.0)  # the answer goes to a consumer gone meanwhile
        except BaseException:  # noqa: BLE001 - the exit code tells
            code = 1
        os._exit(code)
    try:
        address_hex, fd = _read_line(r).split()
        address = bytes.fromhex(address_hex)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(address[:-16])
        s.sendall(_fdserver._REQUEST.pack(address[-16:], 1, 1) + struct.pack("<i", int(fd)))
        s.close()
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(r)
        os.close(w)
    assert _ended_by(status) == "exit 0"


def test_a_consumer_whose_connection_the_producer_closed_as_idle_is_not_killed(monkeypatch):
    # The request went without MSG_NOSIGNAL: a consumer that keeps SIGPIPE's default action, asking again on a
    # connection the producer had closed (idle for 300 s), was killed rather than reconnecting.
    from cupy_ipc import _fdserver

    monkeypatch.setattr(_fdserver, "_IDLE_S", 0.2)
    fd = _memfd(b"again")
    address = serve(lambda fds, _: fds == [fd], 1)
    r, w = os.pipe()

    def consumer() -> str:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os_close_all(fetch(address, os.getppid(), [fd], 1))
        time.sleep(1.0)  # the producer closes the connection
        (got,) = fetch(address, os.getppid(), [fd], 1)
        return _read(got).decode()

    pid = _child(consumer, pipe_out=w)
    _, status = os.waitpid(pid, 0)
    line = _read_line(r) if _ended_by(status) == "exit 0" else ""
    for x in (r, w, fd):
        os.close(x)
    assert _ended_by(status) == "exit 0" and line == "again", (_ended_by(status), line)


def test_another_user_cannot_take_the_servers_name_before_it_starts(may_switch_user, monkeypatch):  # noqa: F811
    # The server's name was made of the producer's token alone, which every user sees in /dev/shm's listing (its
    # segment's name): another user could bind it first, and the producer could then hand out no descriptor.
    from cupy_ipc import _fdserver, _segment
    from cupy_ipc._identity import this_process

    me = this_process()
    producer = me._replace(token=os.urandom(16))  # a producer that has not served yet
    monkeypatch.setattr(_fdserver, "this_process", lambda: producer)
    monkeypatch.setattr(_fdserver, "_server", None)
    seg = _segment.Segment.create(producer.token)  # what any producer that exported something has
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _as_nobody()
            for name in os.listdir(os.path.dirname(seg.path)):  # all another user needs
                if name == os.path.basename(seg.path):
                    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    squatter.bind(b"\0cupy_ipc-fd-" + name.removeprefix("cupy_ipc-").encode())
                    squatter.listen(1)
        except BaseException:  # noqa: BLE001
            code = 1
        os.write(ready_w, b"x")
        os.read(go_r, 1)
        os._exit(code)
    try:
        os.read(ready_r, 1)
        r, w = os.pipe()
        address = serve(lambda fds, resource: fds == [r] and resource == 9, 9)
        (got,) = fetch(address, os.getpid(), [r], 9)
        assert os.path.samestat(os.fstat(got), os.fstat(r))
        for x in (got, r, w):
            os.close(x)
    finally:
        os.write(go_w, b"x")
        _, status = os.waitpid(pid, 0)
        seg.close(unlink=True)
        if _fdserver._server is not None:
            _fdserver._server[1].close()
        for x in (ready_r, ready_w, go_r, go_w):
            os.close(x)
    assert _ended_by(status) == "exit 0"


def test_a_garbled_answers_connection_is_closed_before_another_thread_may_send_on_it(monkeypatch):
    # The rest of an answer cut short may still follow on its connection: it was closed only once the
    # connection's lock was let go, so a thread waiting for that lock sent its request there and took the rest
    # of the first answer (another array's descriptors) as its own.
    import secrets

    from cupy_ipc import _fdserver

    name = b"\0cupy_ipc-test-" + secrets.token_hex(8).encode()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen()
    leftover = _memfd(b"the rest of the first answer")
    answered: list[int] = []

    def producer() -> None:  # a server of this process (the producer, as the kernel tells its consumer)
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:
                    while conn.recv(4096):
                        if not answered:  # the first request: an answer that says 2 and carries 1, then its rest
                            socket.send_fds(conn, [_fdserver._COUNT.pack(2)], [leftover])
                            socket.send_fds(conn, [_fdserver._COUNT.pack(1)], [leftover])
                        else:
                            conn.sendall(_fdserver._COUNT.pack(0))  # refused
                        answered.append(1)
                except OSError:  # the consumer closed it with the rest of an answer unread
                    pass

    threading.Thread(target=producer, daemon=True).start()
    real = _fdserver._answer_of
    waiting = threading.Event()

    def answer_of(sock, n):
        got = real(sock, n)
        if got[0] == "garbled":
            waiting.set()
            time.sleep(0.3)  # the other thread is now waiting for the connection's lock
        return got

    monkeypatch.setattr(_fdserver, "_answer_of", answer_of)
    close_all = _fdserver.close_all

    def slow_close_all(fds):  # the first thread switched out just after its lock was let go
        time.sleep(0.3)
        close_all(fds)

    monkeypatch.setattr(_fdserver, "close_all", slow_close_all)
    address = name + bytes(16)
    second: list = []

    def other() -> None:
        waiting.wait(10)
        try:
            second.append(fetch(address, os.getpid(), [7]))
        except IpcError as e:
            second.append(e)

    t = threading.Thread(target=other)
    t.start()
    try:
        with pytest.raises(IpcError):
            fetch(address, os.getpid(), [3, 4])
        t.join(30)
        [got] = second
        if not isinstance(got, IpcError):
            contents = [_read(fd) for fd in got]
            os_close_all(got)
            pytest.fail(f"the second request took the first answer's descriptors: {contents}")
        assert "refused" in str(got)
    finally:
        listener.close()
        os.close(leftover)
        _fdserver._close_connections()


def test_root_is_served_by_another_users_producer(may_switch_user):  # noqa: F811
    # The server serves its own user and root, but a root consumer asked only servers of its own user or root:
    # a producer of another user was refused as "not the producer".
    from cupy_ipc import _fdserver

    r, w = os.pipe()
    go_r, go_w = os.pipe()

    def producer() -> str:
        _as_nobody()
        _serve_memfd(b"nobody's", w)
        os.read(go_r, 1)  # until told to exit
        return "done"

    pid = _child(producer, pipe_out=w)
    name_hex, fd = _read_line(r).split()
    try:
        (got,) = fetch(bytes.fromhex(name_hex), pid, [int(fd)])
        assert _read(got) == b"nobody's"
        os.close(got)
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)
        _fdserver._close_connections()
        for x in (r, w, go_r, go_w):
            os.close(x)
