"""Descriptors on request: a producer hands its exported memory's descriptors to consumers that ask, over a
Unix socket.

``cupy_ipc.multiprocessing`` sends an array as its handle's bytes alone; a
consumer that needs the descriptors behind it (a pool it has not imported
yet, or pieces of virtual memory) asks the producer for them here. So a
pool's descriptor crosses once per consumer, and arrays that need none cost
no more than their bytes. ``SCM_RIGHTS`` needs no ptrace permission.

The socket is in the abstract namespace, named after the producer's random
token and a random part of its own (the token shows in ``/dev/shm``: a name
made of it alone could be taken first by another user), where any process
can see its name once bound. So it serves only processes of the
same user (or root) that present the key of the memory they ask for (by the id
of the pool or run of pieces in the handle), made from the server's random
secret and that id and sent with the handle's bytes: a process that received
one array gets no other memory's descriptors. It hands out only the
descriptors that back that memory: never a descriptor whose number was reused
for other memory since the handle left.

Example:
    >>> import os
    >>> r, w = os.pipe()
    >>> address = serve(lambda fds, resource: fds == [r] and resource == 7, 7)
    >>> got = fetch(address, os.getpid(), [r], 7)
    >>> os.path.samestat(os.fstat(got[0]), os.fstat(r))
    True
    >>> for fd in (r, w, *got): os.close(fd)
"""

from __future__ import annotations

import atexit
import errno
import hmac
import itertools
import os
import secrets
import select
import socket
import struct
import threading
import time
from typing import Callable

from ._descriptors import close_all, dup_all, recv_fds, send_fds
from ._errors import IpcError, ProducerExitedError, warn_quietly
from ._identity import this_process
from ._wire import MAX_DESCRIPTORS

__all__ = ["fetch", "retire", "serve", "served"]

_COUNT = struct.Struct("<I")  # an answer: how many descriptors come with it (0: refused)
_SECRET_BYTES = 16
_REQUEST = struct.Struct(f"<{_SECRET_BYTES}sIQ")  # the resource's key, the count, the resource; then the numbers
_RESOURCE = struct.Struct("<Q")
TIMEOUT_S = 30.0  # for a producer's answer
_RETRY_S = 0.05  # before accepting again after a failed accept
_TRUNCATED = ("descriptors sent to this process were dropped on receipt: it is at its open-file limit "
              "(raise it with ulimit -n, or resource.setrlimit(RLIMIT_NOFILE))")
_PER_MESSAGE = 253  # SCM_MAX_FD: descriptors per message; an answer with more comes in several
_MAX = MAX_DESCRIPTORS  # per request: as many as a handle has
_FIRST_S = 5.0  # for a new connection's first request: one that sends none is closed
_IDLE_S = 300.0  # between requests: an idle connection is closed (its consumer reconnects when it asks again)
_MAX_SERVED = 1024  # connections served at once; more are closed at once
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# Every send: a peer that has gone raises EPIPE, never SIGPIPE, which kills a process that left it at its
# default (as command-line tools do, and programs that embed Python).
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)

_lock = threading.Lock()
_server: tuple[bytes, socket.socket, bytes] | None = None  # (name, listening socket, secret)
_allowed: Callable[[list[int], int], bool] = lambda fds, resource: False  # noqa: E731 - replaced by serve()
_connections: dict[bytes, tuple[threading.Lock, socket.socket]] = {}  # consumer: name -> connection
# Connections to producers that have gone are closed once the table has doubled since the last look
# (amortized), so that a consumer of many short-lived producers does not keep a socket for each.
_PRUNE_FROM = 16
_prune_at = _PRUNE_FROM
_accepted: set[socket.socket] = set()  # producer: connections being served
# The ids of the memory this process exports, pools and runs of pieces of virtual memory alike, never reused: a
# request's key is made from the id alone, so an id shared by two would let the key sent for one fetch the other.
resource_ids = itertools.count(1)


def _name(token: bytes) -> bytes:
    # With a random part: the token is no secret (a segment's name in /dev/shm shows it to every user), and a
    # name known in advance could be bound first by another user's process, leaving this one no server.
    return b"\0cupy_ipc-fd-" + token.hex().encode() + b"-" + secrets.token_hex(8).encode()


def _key(secret: bytes, resource: int) -> bytes:
    return hmac.digest(secret, _RESOURCE.pack(resource), "sha256")[:_SECRET_BYTES]


def serve(allowed: Callable[[list[int], int], bool], resource: int = 0) -> bytes:
    """Start this process's descriptor server (once) and return its address for the memory exported under id
    ``resource``, for :func:`fetch`: the socket's name and the key a request for that memory must carry.
    Send it only to the processes meant to have that memory's descriptors.

    ``allowed(fds, resource)`` says whether descriptors ``fds`` (numbers in
    this process) back the memory this process exports under id ``resource``
    (a pool's or a run of pieces'); no other descriptor is ever handed out.
    The latest call's ``allowed`` applies.

    Raises:
        IpcError: The server's socket could not be opened (this process is at its open-file limit, say) or
            bound to its name, or no thread could be started to serve it.
    """
    global _server, _allowed
    with _lock:
        _allowed = allowed
        if _server is not None:
            return _server[0] + _key(_server[2], resource)
        name, secret = _name(this_process().token), secrets.token_bytes(_SECRET_BYTES)
        listener = _new_socket()
        try:
            listener.bind(name)
            listener.listen(64)
        except OSError as e:  # its name taken (by a process that has this one's token: a copy of its handle)
            listener.close()
            raise IpcError(f"could not start this process's descriptor server: {os.strerror(e.errno or 0)}") from e
        # Started before the server is recorded, under the lock: an address handed out always has a server.
        try:
            threading.Thread(target=_accept, args=(listener, secret), name="cupy_ipc-fd-server", daemon=True).start()
        except RuntimeError as e:  # no thread to be had ("can't start new thread")
            listener.close()
            raise IpcError(f"could not start this process's descriptor server: {e}") from e
        _server = (name, listener, secret)
    return name + _key(secret, resource)


def _new_socket() -> socket.socket:
    try:
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as e:  # at the open-file limit, say
        raise IpcError(f"could not open a socket to pass the memory's descriptors: {os.strerror(e.errno or 0)}") from e


def _accept(listener: socket.socket, secret: bytes) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError as e:
            if listener.fileno() < 0 or e.errno in (errno.EBADF, errno.EINVAL):  # closed
                return
            # At the open-file limit or short of memory: the server must outlive it, or every consumer
            # after would wait on a socket nobody serves.
            time.sleep(_RETRY_S)
            continue
        try:
            pid, uid, _ = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            with _lock:
                full = len(_accepted) >= _MAX_SERVED
                if uid in (os.geteuid(), 0) and not full:  # the rule pidfd_getfd would apply, less ptrace_scope
                    _accepted.add(conn)
            if conn not in _accepted:
                conn.close()
                continue
            threading.Thread(target=_answer, args=(conn, secret), name=f"cupy_ipc-fd-server-{pid}",
                             daemon=True).start()
        except (OSError, RuntimeError):  # gone already, or no thread to serve it: the consumer sees it closed
            with _lock:
                _accepted.discard(conn)
            conn.close()


_served = [0]


def _count(n: int) -> None:
    with _lock:
        _served[0] += n


def served() -> int:
    """How many descriptors this process's server has handed out."""
    return _served[0]


def _recv_exactly(conn: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, or ``b""`` if the connection ended first; ``TimeoutError`` once ``deadline`` (a
    ``time.monotonic()``) has passed: a time-out for each read alone would let a client that sends a byte at a
    time hold the connection's thread for ever."""
    data = b""
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(errno.ETIMEDOUT, "a request did not arrive whole in time")
        conn.settimeout(left)
        chunk = conn.recv(n - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


def _answer(conn: socket.socket, secret: bytes) -> None:
    """Serve one consumer's requests: the resource's key, a count, the resource, then that many descriptor numbers;
    the answer is the count of descriptors sent (0: refused) with the descriptors."""
    try:
        _serve_requests(conn, secret)
    finally:
        with _lock:
            _accepted.discard(conn)
        conn.close()


def _serve_requests(conn: socket.socket, secret: bytes) -> None:
    # Time-outs (an OSError) close a connection that sends no whole request at first, or none for a long time:
    # any process of this user may connect, and each connection holds a thread here. A request comes in one
    # write: the first must arrive whole within _FIRST_S of the connection, a later one within _FIRST_S of its
    # first byte (its key is checked only once it has all come, so any client could otherwise hold the thread
    # for the idle time-out, or for ever by sending a byte now and then).
    deadline: float | None = time.monotonic() + _FIRST_S
    while True:
        try:
            head = b""
            if deadline is None:  # between requests
                conn.settimeout(_IDLE_S)
                head = conn.recv(1)
                if not head:
                    return
                deadline = time.monotonic() + _FIRST_S
            head += _recv_exactly(conn, _REQUEST.size - len(head), deadline)
            if len(head) != _REQUEST.size:
                return
            presented, n, resource = _REQUEST.unpack(head)
            if not 0 < n <= _MAX:
                return
            numbers = list(struct.unpack(f"<{n}i", _recv_exactly(conn, 4 * n, deadline)))
            deadline = None
            conn.settimeout(_IDLE_S)  # for the answer
            if not hmac.compare_digest(presented, _key(secret, resource)):  # not sent that memory: refused, no more
                conn.sendall(_COUNT.pack(0), _NOSIGNAL)
                return
            with _sending:
                sent = _checked_allowed(numbers, resource)
                if sent:
                    # Without waiting, holding the lock: a consumer that leaves its answers unread is dropped.
                    # Non-blocking, as MSG_DONTWAIT is not: Python waits for a socket with a time-out to take
                    # more before it sends. Each message of the answer says how many descriptors it carries.
                    conn.setblocking(False)
                    for k in range(0, n, _PER_MESSAGE):
                        part = numbers[k:k + _PER_MESSAGE]
                        send_fds(conn, _COUNT.pack(len(part)), part)
                    conn.settimeout(_IDLE_S)
            if sent:
                _count(n)
            else:
                conn.sendall(_COUNT.pack(0), _NOSIGNAL)
        except (OSError, struct.error):  # the consumer went away, sent garbage, or nothing in time
            return


def _checked_allowed(numbers: list[int], resource: int) -> bool:
    """``_allowed``, where a check that raises refuses the request (and says why here) rather than end the
    connection's thread: the consumer then gets a refusal, and its later requests are served."""
    try:
        return bool(_allowed(numbers, resource))
    except Exception as e:
        warn_quietly(f"refused a request for descriptors {numbers}: checking them failed: {e!r}")
        return False


# Held while a request's descriptors are checked and sent, and while an exporter closes one (retire): a
# number closed between the check and the send could be reused for another file, which would be sent.
_sending = threading.Lock()


def retire(fds: list[int]) -> None:
    """Close descriptors this process exports (that :func:`serve`'s check may have let go), never between a
    request's check and its send. Call it holding none of the locks that the check takes."""
    with _sending:
        close_all(fds)


def copies(numbers: Callable[[], list[int]]) -> list[int]:
    """Copies of the descriptors that ``numbers()`` names, looked up and copied under the lock that
    :func:`retire` closes under, so that none is closed, and its number given to another file, in between.
    The caller closes them."""
    with _sending:
        return dup_all(numbers())


def _connection(name: bytes, pid: int) -> tuple[threading.Lock, socket.socket]:
    with _lock:
        hit = _connections.get(name)
    if hit is not None:
        return hit
    sock = _new_socket()
    sock.settimeout(TIMEOUT_S)  # a producer that is alive but does not answer must not hang us
    try:
        _connect(sock, name)
        # Any process may bind a name in the abstract namespace once the producer has gone: the key and
        # our trust go only to the producer itself (the process that listens there, as the kernel says).
        server_pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    except OSError as e:
        sock.close()
        if not _alive(pid):
            raise ProducerExitedError(f"producer process {pid} has exited", pid=pid) from None
        raise IpcError(f"could not reach producer process {pid} for the memory's descriptors: "
                       f"{os.strerror(e.errno or 0)}") from e
    if server_pid != pid or uid not in (os.geteuid(), 0) and os.geteuid() != 0:  # (root may ask any user's)
        sock.close()
        if not _alive(pid):
            raise ProducerExitedError(f"producer process {pid} has exited", pid=pid)
        raise IpcError(f"the descriptor server of producer process {pid} is process {server_pid} (user {uid}): "
                       "not the producer, so it is not asked")
    with _lock:
        if name not in _connections and len(_connections) >= _prune_at:
            _prune_connections()
        hit = _connections.setdefault(name, (threading.Lock(), sock))
    if hit[1] is not sock:
        sock.close()
    return hit


def _connect(sock: socket.socket, name: bytes) -> None:
    """Connect, waiting up to :data:`TIMEOUT_S` while the producer's queue of connections to accept is full
    (a socket with a time-out is non-blocking, and on a Unix socket that fails at once with EAGAIN)."""
    deadline = time.monotonic() + TIMEOUT_S
    pause = 0.001
    while True:
        try:
            sock.connect(name)
            return
        except BlockingIOError:
            if time.monotonic() + pause > deadline:
                raise TimeoutError(errno.ETIMEDOUT, "the producer accepted no connection in time") from None
            time.sleep(pause)
            pause = min(2 * pause, 0.05)


def _prune_connections() -> None:
    """Close the connections whose producer has closed its end (exited); the caller holds ``_lock``. One in
    use by a request is left for that request to judge."""
    global _prune_at
    for name, (lock, sock) in list(_connections.items()):
        if not lock.acquire(blocking=False):
            continue
        try:
            if _closed_by_peer(sock):
                del _connections[name]
                sock.close()
        finally:
            lock.release()
    _prune_at = max(_PRUNE_FROM, 2 * len(_connections))


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle connection is over: the producer closed it, or something unasked-for waits on it."""
    poller = select.poll()  # not select(): descriptors past 1023 are common in processes with many files
    try:
        poller.register(sock, select.POLLIN)
        # Between requests nothing is due: an end of file, or a late answer to a request given up on.
        return bool(poller.poll(0))
    except (OSError, ValueError):  # closed meanwhile
        return True


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: one that has exited but that its parent has not waited for yet (a zombie,
    as a multiprocessing child is until joined) exists, and has gone all the same."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:  # gone since
        return False
    except OSError:  # no /proc here: the signal's answer stands
        return True
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")  # (the state follows the name, which may hold ")")


def fetch(address: bytes, pid: int, numbers: list[int], resource: int = 0) -> list[int]:
    """Descriptors ``numbers`` of producer ``pid``, backing the memory it exports under id ``resource``, asked
    of its server at ``address`` (as :func:`serve` returned it): duplicates, the caller's to close.

    Raises:
        ProducerExitedError: The producer has exited.
        IpcError: It refused (it no longer exports that memory, or the address is wrong) or could not be
            reached.
    """
    if not 0 < len(numbers) <= _MAX:
        raise IpcError(f"cannot ask for {len(numbers)} descriptors at once (1 to {_MAX})")
    if len(address) <= _SECRET_BYTES:
        raise IpcError("not a descriptor server's address")
    name, key = address[:-_SECRET_BYTES], address[-_SECRET_BYTES:]
    request = _REQUEST.pack(key, len(numbers), resource) + struct.pack(f"<{len(numbers)}i", *numbers)
    for attempt in (0, 1):  # a connection may have broken since its last use: one retry on a new one
        lock, sock = _connection(name, pid)
        with lock:
            try:
                sock.sendall(request, _NOSIGNAL)
                state, fds, truncated = _answer_of(sock, len(numbers))
            except BaseException as e:
                # Interrupted or failed between request and answer: an answer may still come, which the next
                # request on this connection would take as its own. So it is closed before anyone else may
                # use it.
                _forget_connection(name, sock)
                if isinstance(e, TimeoutError):
                    raise IpcError(f"producer process {pid} did not answer a request for descriptors within "
                                   f"{TIMEOUT_S:g} s") from None
                if not isinstance(e, OSError):
                    raise
                if e.errno not in (errno.EPIPE, errno.ECONNRESET, errno.EBADF):  # EBADF: another thread closed it
                    raise IpcError(f"asking producer process {pid} for descriptors failed: {e}") from e
                state, fds, truncated = "closed", [], False
            if state in ("garbled", "closed") or truncated:
                # The rest of the answer may follow: closed before the lock goes, or the next request, another
                # thread's, would take it (and its descriptors) as its own.
                _forget_connection(name, sock)
        if state == "given" and not truncated:
            return fds
        close_all(fds)
        if truncated:  # the kernel dropped descriptors it could not install here
            raise IpcError(_TRUNCATED)
        if state in ("refused", "garbled"):
            raise IpcError(f"producer process {pid} no longer shares this memory (it refused its descriptors)")
        if attempt == 0 and _alive(pid):  # (broken: forgotten above)
            continue
        break
    if not _alive(pid):
        raise ProducerExitedError(f"producer process {pid} has exited", pid=pid)
    raise IpcError(f"producer process {pid} closed the connection instead of sending descriptors")


def _answer_of(sock: socket.socket, n: int) -> tuple[str, list[int], bool]:
    """The answer to a request for ``n`` descriptors: ``(state, descriptors, truncated)``, the state "given"
    (all ``n``), "refused" (a first message of count 0 carrying none), "garbled" (a message carrying other than
    its count says, or descriptors dropped on receipt: more of the answer may follow) or "closed" (the
    connection ended). Each of its messages carries at most 253 and says how many."""
    fds: list[int] = []
    truncated = False
    try:
        while True:
            head, more, flags = recv_fds(sock, _COUNT.size, _PER_MESSAGE)
            fds += more
            truncated |= bool(flags & socket.MSG_CTRUNC)
            if len(head) != _COUNT.size:
                return "closed", fds, truncated
            (count,) = _COUNT.unpack(head)
            if not (fds or truncated) and count == 0:
                return "refused", fds, truncated
            if truncated or not more or count != len(more) or len(fds) > n:
                return "garbled", fds, truncated
            if len(fds) == n:
                return "given", fds, truncated
    except BaseException:
        close_all(fds)
        raise


def _forget_connection(name: bytes, sock: socket.socket) -> None:
    with _lock:
        if _connections.get(name, (None, None))[1] is sock:
            del _connections[name]
    sock.close()


def _close_connections() -> None:
    with _lock:
        for _, sock in _connections.values():
            sock.close()
        _connections.clear()


atexit.register(_close_connections)


def forget() -> None:
    """After fork: the parent's server and connections are not this process's (a server restarts on demand).
    Closing our copies leaves the parent's open."""
    global _lock, _sending, _server
    _lock = threading.Lock()  # another thread may have held them at the fork
    _sending = threading.Lock()
    _close_connections()
    for conn in list(_accepted):  # or a consumer of the parent would wait on us after the parent died
        conn.close()
    _accepted.clear()
    if _server is not None:
        _server[1].close()
        _server = None
