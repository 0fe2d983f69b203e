"""Moving a file descriptor to another process: over a Unix socket, or taken with ``pidfd_getfd``.

Memory shared by descriptor (virtual-memory allocations, stream-ordered pools)
reaches a consumer as a POSIX file descriptor. A Unix socket carries one with
``SCM_RIGHTS`` and needs no permission beyond the socket. A transport that
carries only bytes leaves the consumer to take the descriptor out of the
producer with ``pidfd_getfd``, which the kernel allows only to a process that
may ptrace the producer: refused with ``EPERM`` under Yama ``ptrace_scope`` 1 or
more (unless the producer allowed it), in many containers, and whenever the
producer is not dumpable.
"""

from __future__ import annotations

import array
import ctypes
import errno
import os
import socket
import struct
from typing import Any, Iterable

from ._errors import IpcError, ProducerExitedError

__all__ = ["allow_ptrace_from_any", "close_all", "close_quietly", "dup_all", "not_inherited", "ptrace_scope",
           "recv_fds", "recv_handle", "send_fds", "send_handle", "take_fd"]

_SYS_PIDFD_GETFD = 438  # the same number on every architecture Linux has
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
_HEAD = struct.Struct("<II")  # handle bytes, descriptors
_FDS_PER_MESSAGE = 253  # SCM_MAX_FD
_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
# Every send: a peer that has gone raises EPIPE, never SIGPIPE, which kills a process that left it at its
# default (as command-line tools do, and programs that embed Python).
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


def close_quietly(fd: int) -> None:
    """Close ``fd``, which may already be closed (a copy after fork, a descriptor another path closed)."""
    try:
        os.close(fd)
    except OSError:
        pass


def close_all(fds: Iterable[int]) -> None:
    """:func:`close_quietly` each of ``fds``."""
    for fd in fds:
        close_quietly(fd)


def not_inherited(fd: int) -> int:
    """``fd``, made close-on-exec (as descriptors this process receives are): one the driver made for an
    export, kept open while the memory is shared, must not keep that memory alive in programs started here.

    Example:
        >>> r, w = os.pipe2(0)
        >>> os.get_inheritable(not_inherited(r))
        False
        >>> os.close(r); os.close(w)
    """
    try:
        os.set_inheritable(fd, False)
    except OSError as e:
        raise IpcError(f"could not mark an exported descriptor close-on-exec: {os.strerror(e.errno or 0)}") from e
    return fd


def dup_all(fds: Iterable[int]) -> list[int]:
    """A copy (``dup``) of each of ``fds``, the caller's to close; all or none (:class:`IpcError`)."""
    copies: list[int] = []
    try:
        for fd in fds:
            copies.append(os.dup(fd))
    except OSError as e:
        close_all(copies)
        raise IpcError(f"could not copy the memory's descriptors: {os.strerror(e.errno or 0)}") from e
    return copies


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def ptrace_scope() -> int | None:
    """Yama's ``kernel.yama.ptrace_scope`` (0 to 3), or ``None`` where Yama is absent."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


_SCOPES = {
    None: "this host has no Yama (kernel.yama.ptrace_scope absent), so the kernel's own rule applies: the same "
          "user, and a dumpable producer",
    0: "kernel.yama.ptrace_scope is 0 here (classic: any process of the same user, if the producer is dumpable)",
    1: "kernel.yama.ptrace_scope is 1 here (restricted: only ancestors of the producer, or processes it named)",
    2: "kernel.yama.ptrace_scope is 2 here (admin only: CAP_SYS_PTRACE)",
    3: "kernel.yama.ptrace_scope is 3 here (no ptrace at all)",
}


def refused_message(pid: int) -> str:
    """Why ``pidfd_getfd`` on process ``pid`` was refused, and the ways around it that can work on this host."""
    scope = ptrace_scope()
    text = (
        f"the kernel refused to hand over a file descriptor of producer process {pid} (pidfd_getfd: EPERM, "
        "Operation not permitted). Taking a descriptor out of another process needs permission to ptrace it; "
        f"{_SCOPES.get(scope, _SCOPES[None])}. Send the handle over a Unix socket "
        "(cupy_ipc.send_handle / recv_handle) or through cupy_ipc.multiprocessing, which pass the descriptor "
        "itself and need no ptrace permission"
    )
    if scope == 1:  # the only rule the producer can relax itself
        text += ("; or call cupy_ipc.allow_ptrace_from_any() in the producer, which lets every process of the "
                 "same user ptrace it (a security trade-off)")
    return text


def _pidfd_getfd(pid: int, fd: int) -> tuple[int, int]:
    """``(descriptor or -1, errno)``; ``ProcessLookupError`` if there is no process ``pid``."""
    pidfd = os.pidfd_open(pid)
    try:
        got = _libc().syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        return got, (0 if got >= 0 else ctypes.get_errno())
    finally:
        os.close(pidfd)


def pidfd_getfd_errno(pid: int, fd: int) -> int:
    """0 if this process may take descriptor ``fd`` of process ``pid`` (closing it again), else the errno; -1 if
    this Python has no ``pidfd_open``."""
    if not hasattr(os, "pidfd_open"):
        return -1
    try:
        got, code = _pidfd_getfd(pid, fd)
    except OSError as e:
        return e.errno or -1
    if got >= 0:
        os.close(got)
    return code


def take_fd(pid: int, fd: int) -> int:
    """A duplicate, in this process, of descriptor ``fd`` of process ``pid`` (``pidfd_getfd``).

    Raises:
        ProducerExitedError: Process ``pid`` does not exist.
        IpcError: The kernel refused (the message explains the ptrace rule
            and the remedies) or lacks ``pidfd_getfd`` (Linux < 5.6).
    """
    try:
        got, code = _pidfd_getfd(pid, fd)
    except ProcessLookupError:
        raise ProducerExitedError(f"producer process {pid} has exited", pid=pid) from None
    except OSError as e:
        raise IpcError(f"pidfd_open({pid}) failed: {os.strerror(e.errno or 0)}") from e
    if got >= 0:
        return got
    if code == errno.EPERM:
        raise IpcError(refused_message(pid))
    if code == errno.ENOSYS:
        raise IpcError("this kernel has no pidfd_getfd (Linux 5.6 or newer has): send the handle over a Unix "
                       "socket (cupy_ipc.send_handle) or through cupy_ipc.multiprocessing")
    if code == errno.EBADF:
        raise IpcError(f"producer process {pid} no longer has descriptor {fd}: it has stopped sharing this memory")
    if code == errno.ESRCH:
        raise ProducerExitedError(f"producer process {pid} has exited", pid=pid)
    raise IpcError(f"pidfd_getfd on process {pid} failed: {os.strerror(code)}")


def allow_ptrace_from_any() -> None:
    """Let any process of this user ptrace this one, so that consumers may ``pidfd_getfd`` its descriptors.

    A security trade-off: any process running as the same user can then read
    and change this process's memory. Needed only where consumers receive
    handles as bytes on hosts with Yama ``ptrace_scope`` 1; sending handles
    over a Unix socket (:func:`send_handle`) or with
    ``cupy_ipc.multiprocessing`` needs no such permission. It does not help a
    process that is not dumpable, nor under ``ptrace_scope`` 2 or 3.

    Raises:
        IpcError: The kernel refused (no Yama, or not Linux).

    Example:
        >>> cupy_ipc.allow_ptrace_from_any()  # in the producer, before consumers open  # doctest: +SKIP
    """
    if _libc().prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise IpcError(f"prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) failed: {os.strerror(code)} (it needs Yama; "
                       "without Yama the kernel's default rule already lets the same user take descriptors)")


# Room for the other control messages the kernel may add to each message received: the sender's credentials
# (SCM_CREDENTIALS, on a socket with SO_PASSCRED), its security context (SCM_SECURITY, SO_PASSSEC) or pidfd
# (SCM_PIDFD, SO_PASSPIDFD). Without it, they took the place of the last descriptors, which the kernel dropped.
_OTHER_CONTROL = socket.CMSG_SPACE(1024)


def recv_fds(sock: socket.socket, bufsize: int, maxfds: int) -> tuple[bytes, list[int], int]:
    """``(data, descriptors, message flags)`` of one message, as :func:`socket.recv_fds` gives them, but with
    the descriptors closed on exec, as ``pidfd_getfd``'s are: a program this process runs must not keep the
    producer's memory alive. (Python 3.11's ``socket.recv_fds`` ignores its ``flags`` argument.)"""
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(bufsize, socket.CMSG_SPACE(maxfds * fds.itemsize) + _OTHER_CONTROL,
                                           _CLOEXEC)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), flags


def send_handle(sock: socket.socket, handle: Any) -> None:
    """Send an :class:`IpcArrayHandle` (or event handle) over an ``AF_UNIX`` stream socket, descriptors included.

    The socket blocks, or has a time-out: a non-blocking one is refused
    (:class:`IpcError`), since a handle cut short would leave its rest to be
    read as the next one. (A time-out applies until the handle's first part
    has gone: the rest follows whole.)

    The descriptors behind memory shared by descriptor travel as
    ``SCM_RIGHTS``, so the receiver needs no ptrace permission. Handles of
    legacy memory travel as their bytes alone.

    Raises:
        TypeError: ``handle`` is not an :class:`IpcArrayHandle` or
            :class:`IpcEventHandle`, or ``sock`` is not a socket.
        IpcError: ``sock`` is not a blocking (or time-out) ``AF_UNIX``
            ``SOCK_STREAM`` socket, the memory was freed since its export,
            or the handle could not be sent whole.

    Example:
        >>> a, b = socket.socketpair()                      # doctest: +SKIP
        >>> send_handle(a, cupy_ipc.get_ipc_handle(arr))   # doctest: +SKIP
        >>> h = recv_handle(b)                              # doctest: +SKIP
    """
    from . import _fdserver  # (which imports this module)
    from ._array_handle import IpcArrayHandle
    from ._events import IpcEventHandle

    _check_socket(sock, "send_handle")
    if not isinstance(handle, (IpcArrayHandle, IpcEventHandle)):
        raise TypeError(f"send_handle sends an IpcArrayHandle or IpcEventHandle, not {type(handle).__name__}")

    data = handle.to_bytes()
    # Copies, taken where the descriptors are checked: the memory may be freed, and a number closed and
    # reused, while the socket waits for its reader.
    fds = _fdserver.copies(handle._descriptors) if hasattr(handle, "_descriptors") else []
    try:
        message = _HEAD.pack(len(data), len(fds)) + data
        sent = send_fds(sock, message, fds[:_FDS_PER_MESSAGE])
        with _no_time_out(sock):  # started: the rest must follow, or the reader takes it for the next handle
            if sent < len(message):  # a socket with a time-out, or interrupted, takes part of what does not fit
                sock.sendall(message[sent:], _NOSIGNAL)
            for k in range(_FDS_PER_MESSAGE, len(fds), _FDS_PER_MESSAGE):  # at most 253 a message (the kernel's)
                send_fds(sock, b"+", fds[k:k + _FDS_PER_MESSAGE])
    finally:
        close_all(fds)


class _no_time_out:
    """The socket without its time-out, if it has one, for the rest of a handle once its first part has gone or
    come: a time-out part-way would leave that rest to be read as the next handle."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.timeout = sock, sock.gettimeout()

    def __enter__(self) -> None:
        if self.timeout is not None:
            self.sock.settimeout(None)

    def __exit__(self, *exc: object) -> None:
        if self.timeout is not None:
            self.sock.settimeout(self.timeout)


def send_fds(sock: socket.socket, data: bytes, fds: list[int]) -> int:
    """``socket.send_fds`` with ``MSG_NOSIGNAL`` (which Python 3.11's ``send_fds`` would not pass on)."""
    return sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))], _NOSIGNAL)


def _check_count(fds: list[int], announced: int) -> None:
    # At once, not once the handle is read: a peer could otherwise fill this process's open files first.
    if len(fds) > announced:
        raise IpcError(f"the peer sent more descriptors than the {announced} it announced with the handle: it is "
                       "no handle sent with send_handle")


def _check_socket(sock: Any, what: str) -> None:
    if not isinstance(sock, socket.socket):
        raise TypeError(f"{what} needs a socket, not {type(sock).__name__}")
    if sock.family != socket.AF_UNIX:
        raise IpcError(f"{what} needs an AF_UNIX socket, not {sock.family!r}")
    if sock.type != socket.SOCK_STREAM:  # a message socket drops what a read leaves of a message
        raise IpcError(f"{what} needs a SOCK_STREAM socket, not {sock.type!r}")
    if sock.gettimeout() == 0.0:  # gives up part-way through a handle: the next call takes the rest for its own
        raise IpcError(f"{what} needs a blocking socket (or one with a time-out), not a non-blocking one: a handle "
                       "comes in several parts, and one cut short would leave the rest to be read as the next")


def recv_handle(sock: socket.socket) -> Any:
    """Receive a handle sent with :func:`send_handle`; its descriptors come with it.

    Raises:
        TypeError: ``sock`` is not a socket.
        IpcError: The peer closed the socket, sent something else than a
            handle, or its descriptors were dropped (this process is at its
            open-file limit).
        HandleError: The handle's bytes are invalid.

    Example:
        >>> a, b = socket.socketpair()                      # doctest: +SKIP
        >>> send_handle(a, cupy_ipc.get_ipc_handle(arr))   # doctest: +SKIP
        >>> with recv_handle(b) as view:                    # doctest: +SKIP
        ...     print(view.sum())
    """
    _check_socket(sock, "recv_handle")
    head, fds, flags = recv_fds(sock, _HEAD.size, _FDS_PER_MESSAGE)  # (a time-out here leaves nothing read)
    truncated = flags & socket.MSG_CTRUNC
    try:
        with _no_time_out(sock):
            return _rest_of_handle(sock, head, fds, truncated)
    except OSError as e:  # (the peer reset the connection part-way, say)
        raise IpcError(f"receiving a handle failed part-way: {e}") from e
    finally:
        for fd in fds:  # not taken by a handle
            os.close(fd)


def _rest_of_handle(sock: socket.socket, head: bytes, fds: list[int], truncated: int) -> Any:
    """:func:`recv_handle` once its header has come; the descriptors it takes into a handle are removed from
    ``fds``, which may grow."""
    from ._array_handle import IpcArrayHandle
    from ._events import IpcEventHandle
    from ._wire import ARRAY_MAGIC, MAX_DESCRIPTORS, MAX_WIRE_BYTES

    if not head:
        raise IpcError("the peer closed the socket before sending a handle")
    if len(head) != _HEAD.size:
        raise IpcError(f"the peer sent {len(head)} bytes where a handle's header has {_HEAD.size}: it is no "
                       "handle sent with send_handle")
    n, nfds = _HEAD.unpack(head)
    if n > MAX_WIRE_BYTES or nfds > MAX_DESCRIPTORS:  # read no further: the counts say what to wait for
        raise IpcError(f"the peer announced a handle of {n} bytes with {nfds} descriptors, more than any "
                       f"handle has ({MAX_WIRE_BYTES} bytes, {MAX_DESCRIPTORS} descriptors): it is no handle "
                       "sent with send_handle")
    _check_count(fds, nfds)
    data = b""
    while len(data) < n:
        chunk, more, flags = recv_fds(sock, n - len(data), _FDS_PER_MESSAGE)
        fds += more
        _check_count(fds, nfds)
        truncated |= flags & socket.MSG_CTRUNC
        if not chunk:
            raise IpcError("the peer closed the socket in the middle of a handle")
        data += chunk
    # Exactly the marker messages the sender wrote (one per 253 descriptors past the first 253), so
    # that a short count never reads into the next handle.
    for _ in range(max(0, -(-nfds // _FDS_PER_MESSAGE) - 1)):
        marker, more, flags = recv_fds(sock, 1, _FDS_PER_MESSAGE)
        fds += more
        _check_count(fds, nfds)
        truncated |= flags & socket.MSG_CTRUNC
        if not marker:
            raise IpcError("the peer closed the socket before sending all descriptors")
    if truncated:
        raise IpcError("descriptors sent with this handle were dropped on receipt: this process is at its "
                       "open-file limit (raise it with ulimit -n, or resource.setrlimit(RLIMIT_NOFILE))")
    if len(fds) != nfds:
        raise IpcError(f"the handle came with {len(fds)} descriptors where its sender wrote {nfds}")
    if data[:4] == ARRAY_MAGIC:
        h = IpcArrayHandle.from_bytes(data)
        h._adopt_descriptors(list(fds))
        fds.clear()
        return h
    return IpcEventHandle.from_bytes(data)
