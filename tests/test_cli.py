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


def test_a_demo_that_cannot_start_its_consumer_says_so_in_one_line(monkeypatch, capsys):
    # Out of processes (EAGAIN) or memory: a traceback before, the demo's one line of failure now.
    import multiprocessing.context

    from cupy_ipc import _demo

    def refused(self):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(_demo, "unavailable_reason", lambda: None)  # as far as the demo can tell, a GPU
    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", refused)
    assert _demo.run_demo() == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.strip().splitlines() == [
        "cupy_ipc demo failed: could not start a consumer process: [Errno 11] Resource temporarily unavailable"]


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


def test_a_closed_stdout_ends_the_command_without_a_traceback():
    # `python -m cupy_ipc doctor --json >&-`: Python sets sys.stdout to None where descriptor 1 is closed, and
    # the flush after the command ended in AttributeError's traceback. (The doctor's report needs no GPU.)
    p = subprocess.run(["sh", "-c", 'exec "$0" -m cupy_ipc doctor --json >&-', sys.executable],
                       stderr=subprocess.PIPE, text=True, timeout=240)
    assert p.returncode in (0, 1)
    assert "Traceback" not in p.stderr and "Error" not in p.stderr, p.stderr


@pytest.mark.parametrize("command", [["demo"], ["doctor"], ["doctor", "--json"]])
def test_a_cupy_that_cannot_be_imported_is_reported_in_one_line_not_a_traceback(command, tmp_path):
    # CuPy makes its kernel cache directory (~/.cupy/kernel_cache) as it is imported: as a user whose home is
    # not writable (docker --user 1000 gives HOME=/) `import cupy` raises PermissionError, which escaped
    # unavailable_reason() (it caught ImportError only) as a traceback of the demo and of the doctor.
    import json
    import os

    (tmp_path / "file").write_text("")
    env = {**os.environ, "CUPY_CACHE_DIR": str(tmp_path / "file" / "kernel_cache")}  # cannot be made
    r = subprocess.run([sys.executable, "-m", "cupy_ipc", *command], capture_output=True, text=True, timeout=240,
                       env=env)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr, r.stderr
    out = r.stderr if command == ["demo"] else r.stdout
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    if command == ["doctor", "--json"]:
        report = json.loads(lines[0])
        assert "CuPy cannot be imported" in report["gpu_error"] and not report["ok"]
    else:
        assert lines[0].startswith(f"cupy_ipc {command[0]}: no GPU to ") and "CuPy cannot be imported" in lines[0]


def test_without_the_driver_the_reason_names_the_missing_driver_not_an_old_one(monkeypatch):
    # CUDA's runtime says "CUDA driver version is insufficient" when there is no driver at all.
    from cupy_ipc import _cuda

    try:
        import cupy  # noqa: F401
    except ImportError:
        pytest.skip("no CuPy")
    if _cuda._has_driver_library():
        monkeypatch.setattr(_cuda, "_has_driver_library", lambda: False)
        from cupy_backends.cuda.api.runtime import CUDARuntimeError

        def insufficient():
            raise CUDARuntimeError(35)  # cudaErrorInsufficientDriver, as without libcuda

        monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", insufficient)
    assert unavailable_reason() == ("no usable CUDA GPU or driver: the NVIDIA driver is not installed "
                                    "(libcuda.so.1 cannot be loaded)")
