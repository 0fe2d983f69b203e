"""Who and where this process is, as every handle carries it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _in_own_uts_namespace(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "--uts", sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_a_host_name_that_is_not_utf8_does_not_stop_the_import():
    # Linux takes any bytes as a host name, which Python decodes with surrogate escapes.
    try:
        probe = _in_own_uts_namespace("import socket; socket.sethostname(b'gpu\\xff-node')")
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if probe.returncode != 0:
        pytest.skip(f"cannot set a host name of its own here: {probe.stderr.strip()}")
    r = _in_own_uts_namespace("import socket; socket.sethostname(b'gpu\\xff-node'); import cupy_ipc; "
                              "print(cupy_ipc._identity.host_name())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "gpu-node"


# This process's boot id field, where the kernel's boot id cannot be read, on a host of the given machine id
# ("": none readable either; "EMPTY+id": /etc/machine-id empty, D-Bus's id) and host name.
_KEY_WHERE_BOOT_ID_IS_UNREADABLE = """
import builtins, io, socket, sys

machine_id, host = sys.argv[1:]
real_open = builtins.open


def fake_open(path, *args, **kwargs):
    if path == "/proc/sys/kernel/random/boot_id":
        raise PermissionError(13, "Permission denied", path)
    if path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        if not machine_id:
            raise FileNotFoundError(2, "No such file or directory", path)
        if machine_id.startswith("EMPTY+"):
            return io.BytesIO(b"\\n" if path == "/etc/machine-id" else machine_id[6:].encode() + b"\\n")
        return io.BytesIO(machine_id.encode() + b"\\n")
    return real_open(path, *args, **kwargs)


builtins.open = fake_open
socket.gethostname = lambda: host
from cupy_ipc._identity import this_process

print(this_process().boot_id.hex())
"""


def test_hosts_whose_boot_id_cannot_be_read_still_differ():
    # The boot id decides which processes share a host (for all_gather's peers and for every open): zeros for
    # each host that cannot read it took them all for one host.
    def key(machine_id: str, host: str) -> str:
        r = subprocess.run([sys.executable, "-c", _KEY_WHERE_BOOT_ID_IS_UNREADABLE, machine_id, host],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    a = key("0123456789abcdef0123456789abcdef", "node-a")
    assert a != bytes(16).hex()
    assert key("0123456789abcdef0123456789abcdef", "node-a") == a  # every process of the host agrees
    assert key("fedcba9876543210fedcba9876543210", "node-a") != a  # another machine of the same name
    assert key("0123456789abcdef0123456789abcdef", "node-b") != a  # a clone that kept its image's machine id
    assert key("", "node-a") != key("", "node-b")
    # An empty /etc/machine-id (as images ship it) stopped the search: the host name alone made the key.
    assert key("EMPTY+0123456789abcdef0123456789abcdef", "node-a") == a


def test_the_boot_id_is_the_kernels_where_it_can_be_read():
    import uuid

    from cupy_ipc._identity import this_process

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            kernels = uuid.UUID(f.read().strip()).bytes
    except OSError as e:
        pytest.skip(f"no boot id to read here: {e}")
    assert this_process().boot_id == kernels
