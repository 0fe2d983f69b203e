"""Moving descriptors between processes, with the kernel's real rules (no GPU needed).

The memory of a shareable pool reaches a consumer as a file descriptor; these
tests move ordinary descriptors (a memfd with known content) the same ways:
over a Unix socket, and taken with ``pidfd_getfd``, which the kernel refuses
(EPERM) to a process that may not ptrace the producer.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct
import sys

import pytest

import cupy_ipc
from cupy_ipc import IpcArrayHandle, IpcError, ProducerExitedError
from cupy_ipc._descriptors import ptrace_scope, refused_message, take_fd
from cupy_ipc._wire import Kind

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux descriptors")

NOBODY = 65534
PR_SET_DUMPABLE = 4


def _memfd(content: bytes) -> int:
    fd = os.memfd_create("cupy_ipc-test")
    os.write(fd, content)
    return fd


def _read(fd: int) -> bytes:
    return os.pread(fd, 64, 0)


@contextlib.contextmanager
def _at_the_open_file_limit():
    """This process can open no descriptor more, for the block: the limit lowered to the lowest free number,
    and every number below it that comes free meanwhile taken."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    probe = os.dup(2)
    os.close(probe)
    resource.setrlimit(resource.RLIMIT_NOFILE, (probe, hard))
    filler = []
    try:
        while True:
            try:
                filler.append(os.dup(2))
            except OSError:
                break
        yield
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _pool_handle(fd_number: int = 9) -> IpcArrayHandle:
    return IpcArrayHandle(memory_handle=bytes(range(64)), offset=0, allocation_size=64, shape=(16,), strides=(4,),
                          dtype="float32", device=(0, bytes(16)), producer=(os.getpid(), b"t" * 16, b"b" * 16, "h"),
                          kind=Kind.POOL, fd=fd_number, resource=1)


def test_send_handle_passes_the_descriptor_itself():
    a, b = socket.socketpair()
    fd = _memfd(b"pool")
    h = _pool_handle(fd)
    try:
        # The producer's descriptor of its pool, as _descriptors() would find it.
        h._adopt_descriptors([os.dup(fd)])
        cupy_ipc.send_handle(a, h)
        got = cupy_ipc.recv_handle(b)
        assert got == h and got.kind == "pool"
        (received,) = got._take_fds()
        assert received != fd and _read(received) == b"pool"
        assert os.fstat(received).st_ino == os.fstat(fd).st_ino
        os.close(received)
    finally:
        for x in (a, b):
            x.close()
        os.close(fd)


def test_a_legacy_handle_travels_as_bytes_alone():
    a, b = socket.socketpair()
    h = IpcArrayHandle(memory_handle=bytes(64), offset=0, allocation_size=64, shape=(16,), strides=(4,),
                       dtype="float32", device=(0, bytes(16)), producer=(1, bytes(16), bytes(16), "h"))
    with a, b:
        cupy_ipc.send_handle(a, h)
        got = cupy_ipc.recv_handle(b)
        assert got == h and got._take_fds() is None


def test_many_descriptors_cross_in_several_messages():
    # Virtual memory in 300 pieces: more descriptors than one message carries (253).
    pieces = 300
    fds = [_memfd(f"piece {k}".encode()) for k in range(pieces)]
    h = IpcArrayHandle(memory_handle=bytes(64), offset=0, allocation_size=64 * pieces, shape=(16,), strides=(4,),
                       dtype="float32", device=(0, bytes(16)), producer=(os.getpid(), b"t" * 16, b"b" * 16, "h"),
                       kind=Kind.VMM, fd=fds[0], resource=1, more=[(fd, 64) for fd in fds[1:]])
    a, b = socket.socketpair()
    try:
        h._adopt_descriptors([os.dup(fd) for fd in fds])  # as a consumer that received them holds them
        cupy_ipc.send_handle(a, h)
        received = cupy_ipc.recv_handle(b)._take_fds()
        assert [_read(fd) for fd in received] == [f"piece {k}".encode() for k in range(pieces)]
        for fd in received:
            os.close(fd)
    finally:
        a.close()
        b.close()
        for fd in fds:
            os.close(fd)


def test_a_full_message_of_descriptors_arrives_on_a_socket_that_passes_credentials():
    # With SO_PASSCRED set, the kernel adds the sender's credentials to every message received: they took the
    # room of the last descriptors of a message of 253, which the kernel then dropped, and recv_handle said
    # this process was at its open-file limit.
    pieces = 253
    one = _memfd(b"piece")
    fds = [os.dup(one) for _ in range(pieces)]
    h = IpcArrayHandle(memory_handle=bytes(64), offset=0, allocation_size=64 * pieces, shape=(16,), strides=(4,),
                       dtype="float32", device=(0, bytes(16)), producer=(os.getpid(), b"t" * 16, b"b" * 16, "h"),
                       kind=Kind.VMM, fd=fds[0], resource=1, more=[(fd, 64) for fd in fds[1:]])
    a, b = socket.socketpair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    try:
        h._adopt_descriptors([os.dup(fd) for fd in fds])
        cupy_ipc.send_handle(a, h)
        received = cupy_ipc.recv_handle(b)._take_fds()
        assert len(received) == pieces and _read(received[-1]) == b"piece"
        for fd in received:
            os.close(fd)
    finally:
        h.close()
        a.close()
        b.close()
        for fd in [one, *fds]:
            os.close(fd)


class _Driver:
    """The CUDA driver calls that export a pool and an allocation of virtual memory, each export a copy of a
    memfd that stands for the memory."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUmemAllocationHandleType:
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1

    class CUpointer_attribute:  # noqa: N801 - the driver's names
        CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES = 1

    CUmemoryPool = int

    def __init__(self, pool: int, memory: int) -> None:
        self.pool, self.memory = pool, memory
        self.export_data = ctypes.create_string_buffer(64)

    def cuPointerGetAttribute(self, attribute, ptr):  # noqa: N802
        return 0, 1

    def cuMemPoolExportToShareableHandle(self, pool, kind, flags):  # noqa: N802
        return 0, os.dup(self.pool)

    def cuMemPoolExportPointer(self, ptr):  # noqa: N802
        return 0, type("Data", (), {"getPtr": lambda _: ctypes.addressof(self.export_data)})()

    def cuMemRetainAllocationHandle(self, base):  # noqa: N802
        return 0, 0x77

    def cuMemRelease(self, handle):  # noqa: N802
        return (0,)

    def cuMemGetAllocationPropertiesFromHandle(self, handle):  # noqa: N802
        return 0, type("Prop", (), {"requestedHandleTypes": 1})()

    def cuMemExportToShareableHandle(self, handle, kind, flags):  # noqa: N802
        return 0, os.dup(self.memory)


def test_a_handle_of_our_virtual_memory_freed_since_is_not_sent(monkeypatch, libcuda):
    # Freeing the memory closes its export's descriptor; a later file may take the number. Sending the
    # handle then must not pass that file on: the numbers are checked against the exports, and copied, under
    # the lock that closes them.
    from cupy_ipc import _vmm
    from cupy_ipc._identity import this_process

    r, w = os.pipe()
    monkeypatch.setattr(_vmm._cuda, "_driver", lambda: _Driver(r, r))
    monkeypatch.setattr(_vmm, "_unmap", lambda ptr, sizes, total: [0])
    base = 0x7F0000000000
    fd, alloc_id = _vmm.export(base, 5)
    me = this_process()
    h = IpcArrayHandle(memory_handle=bytes(64), offset=0, allocation_size=4096, shape=(1024,), strides=(4,),
                       dtype="float32", device=(0, bytes(16)), producer=(me.pid, me.token, me.boot_id, me.host),
                       kind=Kind.VMM, fd=fd, resource=alloc_id)
    a, b = socket.socketpair()
    with a, b:
        cupy_ipc.send_handle(a, h)  # exported: sent, as a copy of the descriptor
        got = cupy_ipc.recv_handle(b)
        (sent,) = got._take_fds()
        assert os.path.samestat(os.fstat(sent), os.fstat(r))
        os.close(sent)
        del got
        _vmm.unmap(base, [4096])  # the array freed: the export's descriptor is closed
        other = _memfd(b"unrelated")  # the lowest free number: the one just closed
        try:
            assert other == fd
            with pytest.raises(IpcError, match="has been freed"):
                cupy_ipc.send_handle(a, h)
            b.setblocking(False)
            with pytest.raises(BlockingIOError):
                b.recv(1)  # nothing was sent
        finally:
            os.close(other)
    os.close(r)
    os.close(w)


def test_send_handle_refuses_other_sockets_and_recv_reports_a_closed_peer():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        with pytest.raises(IpcError, match="AF_UNIX"):
            cupy_ipc.send_handle(s, _pool_handle())
    a, b = socket.socketpair()
    a.close()
    with b, pytest.raises(IpcError, match="closed the socket"):
        cupy_ipc.recv_handle(b)


@pytest.mark.parametrize("with_descriptor", [True, False], ids=["pool", "legacy"])
def test_send_handle_to_a_peer_that_has_gone_raises_rather_than_kill_the_sender(with_descriptor):
    # send_handle wrote without MSG_NOSIGNAL: a process that keeps SIGPIPE's default action (command-line tools,
    # programs that embed Python) was killed by a peer that had closed its end, instead of seeing EPIPE.
    import signal

    fd = _memfd(b"pool")
    a, b = socket.socketpair()
    b.close()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            h = _pool_handle(fd)
            if with_descriptor:
                h._adopt_descriptors([os.dup(fd)])
            try:
                cupy_ipc.send_handle(a, h)
            except BrokenPipeError:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    a.close()
    os.close(fd)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}")


@pytest.mark.parametrize("kind", [socket.SOCK_SEQPACKET, socket.SOCK_DGRAM], ids=["seqpacket", "dgram"])
def test_message_sockets_are_refused_rather_than_left_waiting(kind):
    # A read of the header alone drops the rest of a message: recv_handle waited for ever for the handle.
    a, b = socket.socketpair(socket.AF_UNIX, kind)
    with a, b:
        with pytest.raises(IpcError, match="SOCK_STREAM"):
            cupy_ipc.send_handle(a, _pool_handle())
        a.send(b"message")
        with pytest.raises(IpcError, match="SOCK_STREAM"):
            cupy_ipc.recv_handle(b)
        assert b.recv(100) == b"message"  # left as it was


def test_non_blocking_sockets_are_refused_rather_than_left_part_way_through_a_handle():
    # A handle may arrive in parts (a large one, or one of more than 253 descriptors): recv_handle on a
    # non-blocking socket read the head and what had come, raised BlockingIOError and dropped them, and the
    # next call read the rest of that handle as a new head. send_handle likewise could leave half a handle.
    import select

    from cupy_ipc._descriptors import _HEAD

    fd = _memfd(b"pool")
    h = _pool_handle(fd)
    data = h.to_bytes()
    message = _HEAD.pack(len(data), 1) + data
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        socket.send_fds(a, [message[:20]], [fd])  # the first part of a handle
        select.select([b], [], [], 10)
        with pytest.raises(IpcError, match="non-blocking"):
            cupy_ipc.recv_handle(b)
        a.sendall(message[20:])
        b.setblocking(True)
        got = cupy_ipc.recv_handle(b)  # left whole
        assert got == h
        got.close()
        a.setblocking(False)
        with pytest.raises(IpcError, match="non-blocking"):
            cupy_ipc.send_handle(a, h)
    os.close(fd)


def test_two_threads_closing_a_received_handle_close_its_descriptor_once(monkeypatch):
    # The second close used to find the descriptor still there while the first closed it: closed twice, the
    # second time it may be another file's number by then.
    import threading
    import time

    fd = _memfd(b"pool")
    h = _pool_handle()
    h._adopt_descriptors([fd])
    real_close, closes = os.close, []

    def slow_close(n):
        if n == fd:
            closes.append(n)
            time.sleep(0.2)  # the other thread closes meanwhile
        real_close(n)

    monkeypatch.setattr(os, "close", slow_close)
    threads = [threading.Thread(target=h.close) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(30)
    assert closes == [fd]


def test_send_handle_and_recv_handle_refuse_what_is_no_socket_or_handle():
    with pytest.raises(TypeError, match="needs a socket, not NoneType"):
        cupy_ipc.send_handle(None, _pool_handle())
    with pytest.raises(TypeError, match="needs a socket, not NoneType"):
        cupy_ipc.recv_handle(None)
    a, b = socket.socketpair()
    with a, b, pytest.raises(TypeError, match="IpcArrayHandle or IpcEventHandle, not bytes"):
        cupy_ipc.send_handle(a, _pool_handle().to_bytes())


@pytest.mark.parametrize("header, why", [
    (struct.pack("<II", 300, 2**32 - 1), "announced a handle of 300 bytes with 4294967295 descriptors"),
    (struct.pack("<II", 2**32 - 1, 1), "announced a handle of 4294967295 bytes"),
    (b"abc", "sent 3 bytes where a handle's header has 8"),
])
def test_recv_handle_refuses_a_header_no_handle_has_without_waiting_for_more(header, why):
    # Trusted, such counts kept the receiver waiting for descriptors that never come, or sized its reads by
    # gigabytes.
    a, b = socket.socketpair()
    with a, b:
        a.sendall(header)
        if len(header) < 8:
            a.shutdown(socket.SHUT_WR)
        b.settimeout(10)
        with pytest.raises(IpcError, match=why):
            cupy_ipc.recv_handle(b)


def test_take_fd_from_a_live_process_and_a_dead_one():
    fd = _memfd(b"mine")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child holds the descriptor until told to go
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        got = take_fd(pid, fd)
        assert _read(got) == b"mine"
        os.close(got)
        with pytest.raises(IpcError, match="no longer has descriptor"):
            take_fd(pid, 999)
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)
        os.close(fd)
    with pytest.raises(ProducerExitedError):
        take_fd(pid, fd)


def _as_nobody(dumpable: int | None = None) -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    if dumpable is not None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, dumpable, 0, 0, 0)


def _producer_and_consumer(dumpable: int) -> tuple[str, bytes]:
    """Producer and consumer as the same non-root user; the consumer takes the descriptor, then receives it."""
    sp = socket.socketpair()
    info_r, info_w = os.pipe()
    out_r, out_w = os.pipe()
    go_r, go_w = os.pipe()
    producer = os.fork()
    if producer == 0:
        code = 0
        try:
            _as_nobody(dumpable)
            fd = _memfd(b"shared")
            os.write(info_w, f"{os.getpid()} {fd}\n".encode())
            os.read(go_r, 1)  # the consumer has tried pidfd_getfd
            socket.send_fds(sp[0], [b"x"], [fd])
            os.read(go_r, 1)  # the consumer is done
        except BaseException:
            code = 1
        os._exit(code)
    consumer = os.fork()
    if consumer == 0:
        code = 0
        try:
            _as_nobody()
            pid, fd = (int(x) for x in os.read(info_r, 64).split())
            try:
                taken = take_fd(pid, fd)
                outcome = "taken " + _read(taken).decode()
            except IpcError as e:
                outcome = "refused " + str(e)
            os.write(go_w, b"x")
            _, fds, _, _ = socket.recv_fds(sp[1], 1, 1)
            os.write(out_w, (outcome + "\0").encode() + _read(fds[0]))
            os.write(go_w, b"x")
        except BaseException as e:
            os.write(out_w, f"error {e!r}\0".encode())
            os.write(go_w, b"xx")
            code = 1
        os._exit(code)
    for fd in (info_w, out_w, go_r, info_r, go_w):
        os.close(fd)
    data = b""
    while chunk := os.read(out_r, 4096):
        data += chunk
    os.close(out_r)
    for pid in (consumer, producer):
        os.waitpid(pid, 0)
    sp[0].close()
    sp[1].close()
    outcome, _, received = data.partition(b"\0")
    return outcome.decode(), received


@pytest.fixture
def may_switch_user():
    if os.geteuid() != 0:
        pytest.skip("switching to an unprivileged user for the ptrace rule needs root")


def test_pidfd_getfd_refused_by_a_non_dumpable_producer_and_a_unix_socket_still_works(may_switch_user):
    outcome, received = _producer_and_consumer(dumpable=0)
    assert outcome.startswith("refused "), outcome
    assert "EPERM" in outcome and "ptrace" in outcome and "send_handle" in outcome
    assert "cupy_ipc.multiprocessing" in outcome
    assert ("allow_ptrace_from_any" in outcome) == (ptrace_scope() == 1)  # the one rule a producer can relax
    assert received == b"shared"  # the same pair, over a Unix socket


def test_the_same_pair_may_take_the_descriptor_from_a_dumpable_producer(may_switch_user):
    # The control: only the producer's dumpable flag differs, so the refusal above is the ptrace rule's.
    outcome, received = _producer_and_consumer(dumpable=1)
    if ptrace_scope() not in (None, 0):
        pytest.skip(f"kernel.yama.ptrace_scope is {ptrace_scope()}: even a dumpable producer refuses")
    assert outcome == "taken shared" and received == b"shared"


def test_the_refusal_names_the_hosts_rule():
    text = refused_message(4242)
    assert "process 4242" in text and ("ptrace_scope" in text)


@pytest.mark.parametrize("scope", [None, 0, 1, 2, 3])
def test_the_refusal_offers_allow_ptrace_from_any_only_where_it_helps(monkeypatch, scope):
    from cupy_ipc import _descriptors

    monkeypatch.setattr(_descriptors, "ptrace_scope", lambda: scope)
    text = refused_message(4242)
    assert "send_handle" in text and "cupy_ipc.multiprocessing" in text
    assert ("allow_ptrace_from_any" in text) == (scope == 1)


def test_a_run_of_virtual_memory_pieces_has_one_id_never_given_to_another_run():
    # What a consumer keys a kept mapping by: the same run of exported allocations gets the same id, any other
    # run (one piece replaced by a new allocation, say) a new one, and a forgotten run a new one when seen again.
    from cupy_ipc import _vmm

    a, b, c = (next(_vmm._ids) for _ in range(3))  # allocation ids, as export() draws them
    assert _vmm.pieces_id((a,)) == a  # one piece: the allocation's own id
    run = _vmm.pieces_id((a, b))
    assert _vmm.pieces_id((a, b)) == run
    other = _vmm.pieces_id((a, c))
    assert len({a, b, c, run, other}) == 5
    _vmm._runs.clear()
    assert _vmm.pieces_id((a, b)) not in (a, b, c, run, other)


def test_the_run_table_forgets_only_runs_with_a_piece_no_longer_exported(monkeypatch):
    # The descriptor server serves a run only while this table knows it: a run whose pieces are all still
    # exported keeps its id however many runs come after it; runs with a piece gone are dropped once the
    # table reaches its bound, which then follows what is left.
    from cupy_ipc import _vmm

    monkeypatch.setattr(_vmm, "_runs", {})
    monkeypatch.setattr(_vmm, "_RUNS_FLOOR", 4)
    monkeypatch.setattr(_vmm, "_runs_prune_at", 4)
    live = [next(_vmm._ids) for _ in range(6)]
    monkeypatch.setattr(_vmm, "_exports", {a: (-1, None) for a in live})  # exported: the sweep has not closed them
    waiting = _vmm.pieces_id((live[0], live[1]))
    for _ in range(40):  # runs of allocations no longer exported
        _vmm.pieces_id((next(_vmm._ids), next(_vmm._ids)))
        assert len(_vmm._runs) <= 4
    assert _vmm._runs[(live[0], live[1])] == waiting
    held = [_vmm.pieces_id((live[k], live[k + 1])) for k in range(1, 5)]  # four more live runs: all kept
    assert _vmm.pieces_id((live[0], live[1])) == waiting
    assert [_vmm._runs[(live[k], live[k + 1])] for k in range(1, 5)] == held
    assert _vmm._runs_prune_at >= len(_vmm._runs)


def test_descriptors_dropped_at_the_open_file_limit_are_reported_and_the_next_handle_is_whole():
    # The kernel drops descriptors a receiver at its limit cannot take (MSG_CTRUNC): recv_handle says so, and
    # reads no further than that handle's messages, so the next handle comes with its own descriptor.
    a, b = socket.socketpair()
    b.settimeout(10)
    one, two = _memfd(b"ONE"), _memfd(b"TWO")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with _at_the_open_file_limit():
                try:
                    cupy_ipc.recv_handle(b)
                    out = "received"
                except IpcError as e:
                    out = str(e)
            (fd,) = cupy_ipc.recv_handle(b)._take_fds()
            out += "|" + _read(fd).decode()
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = f"error {e!r}"
        os.write(w, out.encode() + b"\n")
        os._exit(code)
    try:
        for fd in (one, two):
            h = _pool_handle(fd)
            h._adopt_descriptors([os.dup(fd)])
            cupy_ipc.send_handle(a, h)
        line = os.read(r, 4096).decode().strip()
    finally:
        os.waitpid(pid, 0)
        for x in (a, b):
            x.close()
        for x in (one, two, r, w):
            os.close(x)
    first, _, second = line.partition("|")
    assert "open-file limit" in first, line
    assert second == "TWO", line


def test_a_handle_sent_into_a_nearly_full_socket_arrives_whole():
    # The kernel takes part of a message that does not fit a socket with a time-out (or one interrupted): the
    # rest of the handle was never sent, and the next message's bytes took its place in the stream.
    import resource
    import threading
    import time

    pieces = 1000  # a handle of 24 KiB, three times the smallest send buffer; four descriptors a piece here
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * pieces + 256
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"needs {want} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    one = _memfd(b"piece")
    fds = [os.dup(one) for _ in range(pieces)]
    h = IpcArrayHandle(memory_handle=bytes(64), offset=0, allocation_size=64 * pieces, shape=(16,), strides=(4,),
                       dtype="float32", device=(0, bytes(16)), producer=(os.getpid(), b"t" * 16, b"b" * 16, "h"),
                       kind=Kind.VMM, fd=fds[0], resource=1, more=[(fd, 64) for fd in fds[1:]])
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # (the kernel makes it 8 KiB)
    a.settimeout(10)
    got: list[object] = []

    def receive() -> None:
        time.sleep(0.3)  # the sender meets a full socket
        try:
            got.append(cupy_ipc.recv_handle(b))
        except Exception as e:  # noqa: BLE001 - the test reads it
            got.append(e)

    reader = threading.Thread(target=receive)
    try:
        h._adopt_descriptors([os.dup(fd) for fd in fds])
        reader.start()
        cupy_ipc.send_handle(a, h)
        reader.join(10)
        assert len(got) == 1 and isinstance(got[0], IpcArrayHandle), got
        received = got[0]._take_fds()
        assert len(received) == pieces and _read(received[-1]) == b"piece"
        for fd in received:
            os.close(fd)
    finally:
        a.close()
        b.close()
        for fd in [one, *fds]:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_recv_handle_stops_at_the_first_descriptor_more_than_announced():
    # A peer could attach 253 descriptors to every byte of a handle: they were all taken (up to the open-file
    # limit) before the count was checked, and a peer that then sent nothing more kept the receiver waiting.
    from cupy_ipc._descriptors import _HEAD

    a, b = socket.socketpair()
    extra = [_memfd(b"x") for _ in range(3)]
    with a, b:
        b.settimeout(10)
        before = len(os.listdir("/proc/self/fd"))
        a.sendall(_HEAD.pack(100, 0))  # 100 bytes, no descriptor
        socket.send_fds(a, [b"?"], extra)
        with pytest.raises(IpcError, match="more descriptors than the 0 it announced"):
            cupy_ipc.recv_handle(b)
        assert len(os.listdir("/proc/self/fd")) == before
    for fd in extra:
        os.close(fd)


def test_a_receiver_with_a_time_out_takes_a_handle_that_comes_slowly_whole_and_the_next_one_too():
    # A socket with a time-out (a poll loop's settimeout(1)) gave up part-way through a slow handle: TimeoutError,
    # and the next recv_handle read the rest of that handle as its own, and every one after it out of step.
    import threading
    import time

    from cupy_ipc import _descriptors

    first, second = _pool_handle(), IpcArrayHandle._make(_pool_handle()._f._replace(offset=0, fd=11))
    a, b = socket.socketpair()
    b.settimeout(0.2)

    def slow_sender() -> None:
        data = first.to_bytes()
        message = _descriptors._HEAD.pack(len(data), 0) + data
        a.sendall(message[:20])
        time.sleep(0.6)  # longer than the receiver's time-out
        a.sendall(message[20:])
        a.sendall(_descriptors._HEAD.pack(len(second.to_bytes()), 0) + second.to_bytes())

    with a, b:
        with pytest.raises(TimeoutError):  # nothing sent yet: the time-out is the caller's, and nothing is lost
            cupy_ipc.recv_handle(b)
        t = threading.Thread(target=slow_sender)
        t.start()
        try:
            assert cupy_ipc.recv_handle(b) == first
            assert cupy_ipc.recv_handle(b) == second
            assert b.gettimeout() == 0.2
        finally:
            t.join(10)

