"""The command line on a machine without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cupy_ipc._cuda import unavailable_reason


def test_demo_without_a_gpu_says_so_in_one_line():
    if unavailable_reason() is None:
        pytest.skip("a GPU is visible: scripts/gpu_check.sh runs the demo for real")
    r = subprocess.run([sys.executable, "-m", "cupy_ipc", "demo"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cupy_ipc demo: no GPU to run on:"), r.stderr


def test_unknown_command_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "cupy_ipc", "frobnicate"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "invalid choice" in r.stderr
