"""Who and where this process is: producer identity carried by every handle."""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import uuid
from typing import NamedTuple

__all__ = ["Producer", "this_process", "boot_id", "host_name"]

_HOST_BYTES = 32


class Producer(NamedTuple):
    """Identity of the process that exported a handle.

    ``token`` is random per process, so a recycled pid never matches;
    ``boot_id`` is the kernel's, shared by every container on one host
    (where ``/proc/sys/kernel/random/boot_id`` cannot be read, a key made
    of the machine id and the host name).

    Example:
        >>> h = cupy_ipc.get_ipc_handle(cupy.zeros(4))   # doctest: +SKIP
        >>> h.producer.pid == os.getpid()                 # doctest: +SKIP
        True
    """

    pid: int
    token: bytes
    boot_id: bytes
    host: str

    def where(self) -> str:
        """``pid N@host`` for a message or a repr; a host name that is not plain text (it comes from the wire,
        and a forged handle could fake a log line with it) quoted with its escapes.

        Example:
            >>> print(Producer(7, bytes(16), bytes(16), "gpu\\nx").where())
            pid 7@'gpu\\nx'
        """
        host = self.host if self.host.isprintable() else repr(self.host)
        return f"pid {self.pid}@{host}"


def _read_boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):
        pass
    # Zeros here would make every such host one host. The machine id tells apart hosts (and VMs); the host
    # name, clones of one image that kept its machine id. Version 5: never equal to a boot id (version 4).
    machine_id = b""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path, "rb") as f:
                machine_id = f.read().strip()
        except OSError:
            continue
        if machine_id:  # (an image's /etc/machine-id may be there but empty: the next one, then)
            break
    name = socket.gethostname().encode(errors="surrogateescape")
    return uuid.UUID(bytes=hashlib.sha1(b"cupy_ipc host\0" + machine_id + b"\0" + name).digest()[:16], version=5).bytes


def host_name() -> str:
    """This host's name, cut to the width the wire format keeps."""
    # Bytes of a name that are not UTF-8 come as surrogate escapes, which text cannot carry: they are dropped.
    return socket.gethostname().encode(errors="surrogateescape")[:_HOST_BYTES].decode(errors="ignore")


_BOOT_ID = _read_boot_id()


def boot_id() -> bytes:
    """The kernel's boot id (16 bytes), which processes of one host share and of two hosts do not.

    Where it cannot be read, a key of the machine id (``/etc/machine-id``)
    and host name stands in for it, so that hosts still differ.

    Example:
        >>> len(boot_id())
        16
    """
    return _BOOT_ID


def _new_identity() -> Producer:
    return Producer(os.getpid(), secrets.token_bytes(16), _BOOT_ID, host_name())


_current = _new_identity()


def _after_fork() -> None:
    global _current
    _current = _new_identity()


os.register_at_fork(after_in_child=_after_fork)


def this_process() -> Producer:
    """The identity of this process (a forked child gets its own)."""
    return _current
