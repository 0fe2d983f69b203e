"""``python -m cupy_ipc doctor``: the report's schema, its advice, and the live self-test on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cupy_ipc._cuda import unavailable_reason
from cupy_ipc._doctor import _ok, _problems, render

from workers import answering_self_test_consumer, open_fds, stuck_self_test_consumer

HOST_KEYS = {"platform": str, "machine": str, "kernel": str, "python": str, "bits": int, "wsl": bool}
GPU_KEYS = {"ordinal": int, "name": str, "uuid": str, "memory_bytes": int, "compute_capability": str,
            "unified_addressing": bool, "async_engines": int, "concurrent_kernels": bool, "compute_mode": str}
MODE_KEYS = {"name": str, "title": str, "available": bool, "round_trip_us": dict, "detail": str, "cause": str,
             "remedy": str}


def check_schema(report: dict) -> None:
    assert set(report) == {"cupy_ipc", "host", "segments", "open_files", "start_method", "ptrace", "gpu_error",
                           "versions", "gpus", "peer_access", "modes", "problems", "ok"}
    assert all(n is None or (isinstance(n, int) and n > 0) for n in report["open_files"].values())
    for key, kind in HOST_KEYS.items():
        assert isinstance(report["host"][key], kind), key
    assert isinstance(report["segments"]["writable"], bool)
    assert report["segments"]["dev_shm"] in ("writable", "read-only", "missing")
    assert report["start_method"]["default"] in report["start_method"]["available"]
    assert report["ptrace"]["pidfd_getfd"] in ("allowed", "refused", "unavailable")
    assert report["ptrace"]["ptrace_scope"] in (None, 0, 1, 2, 3)
    assert report["ptrace"]["seccomp"] in (None, True, False)
    for g in report["gpus"]:
        for key, kind in GPU_KEYS.items():
            assert isinstance(g[key], kind), key
        assert g["uuid"].startswith("GPU-")
    n = len(report["gpus"])
    assert len(report["peer_access"]) == n and all(len(row) == n for row in report["peer_access"])
    for m in report["modes"]:
        for key, kind in MODE_KEYS.items():
            assert isinstance(m[key], kind), key
        assert m["works"] in (True, False, None)
    for p in report["problems"]:
        assert set(p) == {"what", "cause", "remedy"} and all(p.values())
    assert isinstance(report["ok"], bool)


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cupy_ipc", "doctor", *args], capture_output=True, text=True,
                          timeout=300)


def test_without_a_gpu_one_line_and_exit_1():
    if unavailable_reason() is None:
        pytest.skip("a GPU is visible: test_doctor_on_a_gpu checks the real report")
    r = _doctor()
    assert r.returncode == 1
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cupy_ipc doctor: no GPU to check:"), r.stdout


def test_json_is_one_line_with_the_schema():
    r = _doctor("--json")
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    check_schema(report)
    assert r.returncode == (0 if report["ok"] else 1)
    if unavailable_reason() is not None:
        assert report["gpu_error"] and not report["ok"] and report["modes"] == []


def _report(**changes):
    report = {
        "cupy_ipc": "0", "host": {"platform": "linux", "machine": "x86_64", "kernel": "6", "python": "3.12",
                                  "bits": 64, "wsl": False},
        "segments": {"dir": "/dev/shm", "writable": True, "shared_memory": True, "dev_shm": "writable"},
        "open_files": {"soft": 65536, "hard": 65536},
        "start_method": {"default": "spawn", "available": ["spawn"]},
        "ptrace": {"ptrace_scope": 1, "pidfd_getfd": "allowed", "pidfd_getfd_error": None, "seccomp": False},
        "gpu_error": None, "versions": {"cupy": "14", "driver_cuda": "13.0", "runtime": "13.0"},
        "gpus": [{"ordinal": 0, "name": "G", "uuid": "GPU-0", "memory_bytes": 2**30, "compute_capability": "9.0",
                  "unified_addressing": True, "async_engines": 4, "concurrent_kernels": True,
                  "compute_mode": "default"}],
        "peer_access": [[None]],
        "modes": [{"name": "legacy", "title": "legacy", "available": True, "works": True,
                   "round_trip_us": {"0": 120.0}, "detail": "", "cause": "", "remedy": ""}],
    }
    for path, value in changes.items():
        *parents, key = path.split("__")
        node = report
        for p in parents:
            node = node[p] if not p.isdigit() else node[int(p)]
        node[key] = value
    report["problems"] = _problems(report)
    report["ok"] = _ok(report)
    return report


@pytest.mark.parametrize("changes,what,remedy", [
    ({"host__wsl": True}, "WSL", "native Linux"),
    ({"host__platform": "win32"}, "platform win32", "Linux"),
    ({"segments__writable": False}, "not writable", "--ipc=host"),
    ({"segments__writable": False, "segments__dir": None}, "no writable directory", "mount /dev/shm writable"),
    ({"segments__shared_memory": False, "segments__dir": "/tmp", "segments__dev_shm": "read-only"},
     "/dev/shm read-only", "mount /dev/shm writable"),
    ({"segments__shared_memory": False, "segments__dir": "/tmp", "segments__dev_shm": "missing"},
     "no /dev/shm", "--ipc=host"),
    ({"gpus__0__compute_mode": "prohibited"}, "compute mode prohibited", "nvidia-smi -i 0 -c DEFAULT"),
    ({"start_method__default": "fork", "start_method__available": ["fork", "spawn"]}, "'fork'", "spawn"),
    ({"open_files__soft": 1024, "open_files__hard": 524288}, "open-file limit 1024", "ulimit -n 524288"),
    ({"open_files__soft": 1024, "open_files__hard": 1024}, "open-file limit 1024", "a higher hard limit"),
    ({"modes__0__works": False, "modes__0__cause": "the driver could not map", "modes__0__remedy": "--ipc=host"},
     "legacy failed", "--ipc=host"),
    ({"ptrace__pidfd_getfd": "refused", "ptrace__pidfd_getfd_error": "EPERM"}, "pidfd_getfd refused (EPERM)",
     "allow_ptrace_from_any"),
    ({"ptrace__pidfd_getfd": "refused", "ptrace__pidfd_getfd_error": "EPERM", "ptrace__ptrace_scope": 2},
     "pidfd_getfd refused", "cupy_ipc.send_handle"),
    # A container's seccomp profile, where Yama allows it: the cause named was Yama's rule that allows it.
    ({"ptrace__pidfd_getfd": "refused", "ptrace__pidfd_getfd_error": "EPERM", "ptrace__ptrace_scope": 0,
      "ptrace__seccomp": True}, "pidfd_getfd refused", "--cap-add SYS_PTRACE"),
    ({"ptrace__pidfd_getfd": "unavailable"}, "pidfd_getfd unavailable", "cupy_ipc.send_handle"),
    ({"versions__driver_cuda": "12.9", "versions__runtime": "13.0"}, "older than the runtime",
     "update the NVIDIA driver"),
])
def test_each_problem_has_a_cause_and_a_remedy(changes, what, remedy):
    report = _report(**changes)
    check_schema(report)
    [problem] = report["problems"]
    assert what in problem["what"] and remedy in problem["remedy"]
    text = render(report)
    assert problem["remedy"] in text


def test_a_driver_older_than_the_runtime_within_its_major_is_no_problem():
    # CUDA's minor-version compatibility: CuPy's CUDA 13.2 runtime runs on a CUDA 13.0 driver.
    assert _report(versions__driver_cuda="13.0", versions__runtime="13.2")["problems"] == []


def test_an_exclusive_gpu_is_a_problem_unless_the_self_test_shared_memory_on_it():
    # Under MPS, clients of an exclusive-process GPU can share memory: the self-test, run there too, tells.
    assert _report(gpus__0__compute_mode="exclusive-process")["problems"] == []
    report = _report(gpus__0__compute_mode="exclusive-process", modes__0__works=False,
                     modes__0__cause="cudaErrorDevicesUnavailable", modes__0__remedy="r")
    check_schema(report)
    problem = report["problems"][0]
    assert problem["what"] == "GPU 0 compute mode exclusive-process"
    assert "MPS" in problem["cause"] and "nvidia-smi -i 0 -c DEFAULT" in problem["remedy"]


def test_an_exclusive_gpu_that_shares_memory_under_mps_gets_a_verdict_that_it_works():
    # Its self-tests passed and no problem is listed: the verdict and the exit status must not say it fails.
    report = _report(gpus__0__compute_mode="exclusive-process")
    assert report["problems"] == [] and report["ok"] is True
    assert render(report).endswith("verdict: every available mode works")
    failing = _report(gpus__0__compute_mode="exclusive-process", modes__0__works=False, modes__0__cause="c",
                      modes__0__remedy="r")
    assert failing["ok"] is False


def test_a_prohibited_gpu_fails_the_verdict_though_the_other_gpus_work():
    report = _report()
    report["gpus"].append({**report["gpus"][0], "ordinal": 1, "uuid": "GPU-1", "compute_mode": "prohibited"})
    report["peer_access"] = [[None, True], [True, None]]
    assert _ok(report) is False
    assert not _ok({**report, "gpu_error": "no GPU"}) and not _ok({**report, "modes": []})


def test_gpus_without_peer_access_are_a_problem_with_a_remedy():
    report = _report()
    report["gpus"].append({**report["gpus"][0], "ordinal": 1, "uuid": "GPU-1"})
    report["peer_access"] = [[None, False], [True, None]]
    report["problems"] = _problems(report)
    check_schema(report)
    [problem] = report["problems"]
    assert problem["what"] == "GPU 0 has no peer access to GPU 1" and "open(copy=True)" in problem["remedy"]


def test_render_fits_one_screen_and_gives_a_verdict():
    ok = render(_report())
    assert len(ok.splitlines()) <= 24 and ok.endswith("verdict: every available mode works")
    assert "GPU 0 120 µs" in ok and "pidfd_getfd from another process: allowed" in ok
    bad = render(_report(modes__0__works=False, modes__0__detail="IpcError: x", modes__0__cause="c",
                         modes__0__remedy="r", ptrace__pidfd_getfd="refused", ptrace__pidfd_getfd_error="EPERM"))
    assert "FAILS: IpcError: x" in bad and bad.endswith("does NOT work here")


@pytest.mark.gpu
def test_doctor_on_a_gpu_reports_every_available_mode_working():
    r = _doctor("--json")
    report = json.loads(r.stdout)
    check_schema(report)
    assert r.returncode == 0 and report["ok"], report
    legacy = report["modes"][0]
    assert legacy["name"] == "legacy" and legacy["works"]
    assert set(legacy["round_trip_us"]) == {str(g["ordinal"]) for g in report["gpus"]}
    assert all(us > 0 for us in legacy["round_trip_us"].values())
    text = _doctor()
    assert text.returncode == 0 and "verdict: every available mode works" in text.stdout


@pytest.mark.gpu
def test_a_report_without_the_self_tests_calls_no_mode_failed():
    # A mode not tested ("works": None) was reported as failed, with no cause or remedy.
    from cupy_ipc._doctor import build_report

    report = build_report(self_test=False)
    check_schema(report)
    assert all(m["works"] is None for m in report["modes"] if m["available"])
    assert not [p for p in report["problems"] if "self-test" in p["what"]]


def test_segments_without_any_writable_directory_are_reported_not_raised(monkeypatch):
    # /dev/shm unusable and no writable temporary directory: tempfile raises, which must not end the doctor.
    from cupy_ipc import _doctor, _segment

    def nowhere() -> str:
        raise FileNotFoundError("No usable temporary directory found")

    monkeypatch.setattr(_segment, "_dir", nowhere)
    segments = _doctor._segments()
    assert segments["dir"] is None and segments["writable"] is False and segments["shared_memory"] is False
    report = {**_report(), "segments": segments}
    assert "no directory (NOT writable)" in render({**report, "problems": _problems(report)})


def _children() -> list[int]:
    """This process's child processes, those exited but never waited for (zombies) included."""
    me = str(os.getpid()).encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone since
            continue
        if stat[stat.rfind(b")") + 2:].split()[1] == me:  # the parent's pid follows the state
            found.append(int(pid))
    return found


@pytest.mark.parametrize("consumer,works", [(answering_self_test_consumer, True), (stuck_self_test_consumer, False)])
def test_self_tests_run_again_and_again_leave_no_process_and_no_open_file(consumer, works, monkeypatch):
    # A notebook may call the doctor many times: a consumer that did not answer was killed and never waited
    # for, a zombie holding a descriptor here. Its GPU work is all that is stood in for; the processes are real.
    from cupy_ipc import _doctor

    def share_on(conn, proc, d, allocator):
        return _doctor._ask(conn, proc, ("array", d, b"", None))

    monkeypatch.setattr(_doctor, "_self_test_consumer", consumer)
    monkeypatch.setattr(_doctor, "_share_on", share_on)
    monkeypatch.setattr(_doctor, "_ANSWER_S", 30.0 if works else 0.2)  # an answerer may take seconds to start
    monkeypatch.setattr(_doctor, "_QUIT_S", 2.0 if works else 0.2)
    _doctor._self_test([0], _doctor._LEGACY)  # starts multiprocessing's resource tracker, which stays
    before = open_fds(), _children()
    for _ in range(3):
        result = _doctor._self_test([0], _doctor._LEGACY)
        assert result["works"] is works, result
        assert not works or result["round_trip_us"] == {"0": 0.0}
        assert works or "did not answer within 0.2 s" in result["detail"]
        assert (open_fds(), _children()) == before


def test_the_ptrace_probe_finds_the_package_where_the_doctor_found_it(tmp_path):
    # A notebook that put a checkout of cupy_ipc on sys.path itself: the probe, a fresh interpreter, could not
    # import the package, printed nothing, and the report said pidfd_getfd was "unavailable" -- on a host where
    # it is allowed, and on one where Yama refuses it (no "pidfd_getfd refused" problem then).
    from cupy_ipc import _doctor

    expected = _doctor._ptrace()["pidfd_getfd"]
    base = getattr(sys, "_base_executable", sys.executable)
    if base == sys.executable or expected == "unavailable":
        pytest.skip("needs an interpreter outside this virtual environment, and pidfd_getfd")
    root = os.path.dirname(os.path.dirname(os.path.abspath(_doctor.__file__)))
    code = (f"import sys; sys.path.insert(0, {root!r}); from cupy_ipc._doctor import _ptrace; "
            "print(_ptrace()['pidfd_getfd'])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([base, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    if r.returncode != 0:
        pytest.skip(f"the base interpreter cannot import cupy_ipc's dependencies: {r.stderr[-300:]}")
    assert r.stdout.split() == [expected], r.stderr


def test_a_self_test_whose_pipe_cannot_be_made_is_reported_not_raised(monkeypatch):
    # At the open-file limit (what the doctor is there to explain) the self-test's pipe could not be made, outside
    # the self-test's error handling: the doctor ended in a traceback, with no report and, with --json, no JSON.
    import errno as errno_

    from cupy_ipc import _doctor

    class Spawn:
        def Pipe(self):  # noqa: N802 - multiprocessing's name
            raise OSError(errno_.EMFILE, "Too many open files")

        def Process(self, *args, **kwargs):  # noqa: N802
            pytest.fail("no process without its pipe")

    monkeypatch.setattr(_doctor.multiprocessing, "get_context", lambda method: Spawn())
    result = _doctor._self_test([0], _doctor._LEGACY)
    assert result["works"] is False and "Too many open files" in result["detail"] and result["remedy"]


# The pools' self-test made a ShareableMemoryPool of every GPU, also of one in the prohibited compute mode, which
# the self-tests leave out: where its pool could not be made, the mode failed on the usable GPUs too.
def test_the_pools_self_test_makes_pools_on_the_gpus_it_tests_alone(monkeypatch):
    from cupy_ipc import _cuda, _doctor

    made = []

    class Pool:
        def __init__(self, device):
            made.append(device)
            self.device = device

        def malloc(self, size):
            return (self.device, size)

    malloc = _doctor._pools_malloc(Pool, [0, 2])
    assert made == [0, 2]
    monkeypatch.setattr(_cuda, "current_device", lambda: 2)
    assert malloc(64) == (2, 64)
