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


@pytest.mark.gpu
def test_demo_on_a_gpu_checks_every_value_and_shows_each_step():
    r = subprocess.run([sys.executable, "-m", "cupy_ipc", "demo"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("cupy_ipc ") and "every value checked" in lines[0] and lines[-1] == "OK"
    steps = [line.rsplit(None, 2) for line in lines[1:-1]]
    assert len(steps) == 12 and all(unit == "ms" and float(ms) >= 0 for _, ms, unit in steps), r.stdout
    assert "re-sent array" in r.stdout and "new 1 MiB array" in r.stdout


def test_a_reader_that_goes_away_ends_the_command_without_a_traceback():
    # `python -m cupy_ipc doctor --json | head -c1`: the write into the closed pipe ended in BrokenPipeError's
    # traceback. (The doctor's report needs no GPU.)
    import os

    r, w = os.pipe()
    os.close(r)  # the reader is gone before the command writes
    try:
        p = subprocess.run([sys.executable, "-m", "cupy_ipc", "doctor", "--json"], stdout=w, stderr=subprocess.PIPE,
                           text=True, timeout=240)
    finally:
        os.close(w)
    assert p.returncode == 1
    assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, p.stderr
