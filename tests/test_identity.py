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
