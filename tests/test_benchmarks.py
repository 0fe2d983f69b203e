"""The benchmark suite: its report without a GPU, and a smoke run on tiny sizes on a GPU."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import time

import pytest

from cupy_ipc._cuda import unavailable_reason

SUITE = pathlib.Path(__file__).parent.parent / "benchmarks" / "suite.py"
STEPS = SUITE.parent / "steps.py"
PAIRED = SUITE.parent / "paired.py"
FLOOR = SUITE.parent / "floor.py"
PRIMITIVES = SUITE.parent / "primitives.py"
WAKE = SUITE.parent / "wake.py"
RELEASE = SUITE.parent / "release.py"
WRITERS = SUITE.parent / "writers.py"


def _benchmark_module(name):
    sys.path.insert(0, str(SUITE.parent))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(SUITE.parent))


@pytest.mark.parametrize(("script", "args", "prog"), [
    (SUITE, [], "suite"), (STEPS, [], "steps"), (RELEASE, ["--iters", "3"], "release"),
    (FLOOR, ["--methods", "raw,floor"], "roundtrip"), (WRITERS, ["--writers", "2"], "writers"),
    (PRIMITIVES, [], "primitives")])
def test_without_a_gpu_each_benchmark_says_so_and_measures_nothing(script, args, prog):
    if unavailable_reason() is None:
        pytest.skip("a GPU is visible: the benchmark's GPU run below runs instead")
    r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith(f"{prog}: no GPU:"), r.stderr[-2000:]
    assert "|" not in r.stdout  # no table row


def test_an_unknown_suite_step_is_refused_before_anything_runs():
    r = subprocess.run([sys.executable, str(SUITE), "--only", "peer_matrix,all-gather"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "unknown step(s) all-gather: choose from roundtrip," in r.stderr


def test_the_wake_timer_reports_every_case_it_was_given():
    r = subprocess.run([sys.executable, str(WAKE), "--busy", "0,50", "--idle", "0,100", "--iters", "20"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line.split("|")[1:3] for line in r.stdout.splitlines()[2:]]
    assert [(b.strip(), i.strip()) for b, i in rows] == [("0", "0"), ("0", "100"), ("50", "0"), ("50", "100")]


def test_the_release_timer_refuses_an_unknown_method_before_anything_runs():
    r = subprocess.run([sys.executable, str(RELEASE), "--methods", "raw,cupy-ipc"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "unknown method(s) cupy-ipc: choose from raw, raw-word," in r.stderr


@pytest.mark.gpu
def test_the_floor_prototype_carries_messages_with_each_part():
    methods = "raw,cupy_ipc,floor,floor-0,floor-A,floor-E,floor-L,floor-EL"
    r = subprocess.run([sys.executable, str(FLOOR), "--sizes", "4KiB", "--methods", methods, "--iters", "6",
                        "--rounds", "1", "--warmup", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for method in methods.split(","):  # the consumer read every message's value (roundtrip.py checks it)
        for kind in ("fresh", "re-sent"):
            assert re.search(rf"\| 4 KiB \| {kind} \| {re.escape(method)} \| \d", r.stdout), (method, kind)


@pytest.mark.gpu
def test_paired_carries_mp_with_either_order_of_its_sweep():
    r = subprocess.run([sys.executable, str(PAIRED), "--methods", "raw,mp,mp-eager", "--size", "4KiB", "--iters",
                        "20", "--warmup", "2"], capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "mp-eager ÷ mp" in r.stdout  # the consumer read every message's value (paired.py checks it)
    for kind in ("fresh", "re-sent"):
        assert re.search(rf"\| {kind} \| \d+\.\d \| \d+\.\d \| \d+\.\d \|", r.stdout), kind


def test_the_writers_timer_refuses_an_unknown_queue_before_anything_runs():
    r = subprocess.run([sys.executable, str(WRITERS), "--queues", "simple,joinable"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--queues: choose among simple, queue" in r.stderr


@pytest.mark.gpu
def test_the_writers_timer_carries_every_writers_arrays_in_both_orders():
    r = subprocess.run([sys.executable, str(WRITERS), "--writers", "1,3", "--hold", "0,5", "--iters", "10",
                        "--rounds", "2", "--check"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = r.stdout.split("\n\n")[-1]  # every array read back as its writer's (--check)
    cases = re.findall(r"^\| (simple|queue) \| (\d) \| (\d) \| \d+ \| \d+ \| \d+\.\d\d \|", table, re.M)
    assert cases == [(q, w, h) for q in ("simple", "queue") for w in ("1", "3") for h in ("0", "5")]


@pytest.mark.gpu
def test_the_step_timer_reports_every_step_of_each_method():
    r = subprocess.run([sys.executable, str(STEPS), "--iters", "5"], capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for method in ("raw", "cupy_ipc", "cupy_ipc-unsafe", "pool"):
        for kind in ("fresh", "re-sent"):
            section = r.stdout.split(f"\n{method}, {kind}:")[1].split("\n\n")[0]
            assert re.search(r"round trip +\d+\.\d +\(5\)", section)
            assert "consumer: open" in section and "consumer: close" in section
    assert re.search(r"producer _keepalive\.pin +\d", r.stdout)  # the library's own functions are timed
    assert re.search(r"consumer _mapping\.acquire +\d", r.stdout)


@pytest.mark.gpu
def test_the_primitives_timer_times_every_call():
    r = subprocess.run([sys.executable, str(PRIMITIVES), "--iters", "20", "--repeat", "3"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    times = re.findall(r"^  (.+?) +(\d+\.\d\d) µs$", r.stdout, re.MULTILINE)
    assert len(times) == 13 and all(float(t) >= 0 for _, t in times), r.stdout
    assert any(what.startswith("IpcArrayHandle.from_bytes()") for what, _ in times)


def test_markdown_reports_each_part():
    suite = _benchmark_module("suite")
    row = {"bytes": 4096, "iters": 3, "median_us": 100.0, "p10_us": 90.0, "p90_us": 110.0}
    doc = {
        "environment": {"gpus": 1, "gpu": "G", "driver": 1, "runtime": 1, "cupy": "14", "python": "3", "date": "d",
                        "cupy_ipc": "0", "command": "c"},
        "roundtrip": [{**row, "method": "cupy_ipc", "resent": True}, {**row, "method": "raw", "resent": True,
                                                                      "median_us": 50.0}],
        "events": {"event": {"median_us": 70.0, "p10_us": 60.0, "p90_us": 80.0}},
        "bandwidth": {"mapped_gbps": 4000.0, "local_gbps": 4040.0, "mapped_over_local": 0.99},
        "errors": {"x": "boom"},
    }
    doc["peer_matrix"] = [[{"gbps": 4000.0, "values_ok": True}, {"gbps": 390.0, "values_ok": True}],
                          [{"error": "GPU 1 cannot reach GPU 0: there is no peer access between them"},
                           {"gbps": 4100.0, "values_ok": True}]]
    doc["paired"] = [{"bytes": n, "iters": 3, "methods": ["raw", "cupy_ipc"], "cases": {
        "re-sent": {"median_us": {"raw": 80.0, "cupy_ipc": 120.0}, "paired": {"cupy_ipc ÷ raw": 1.46}}}}
        for n in (1 << 20, 1 << 30)]
    doc["all_gather"] = [{"ranks": 2, "bytes": 1 << 20, "median_us": {"cupy_ipc": 1300.0, "torch": 1360.0,
                                                                       "barrier": 90.0}}]
    text = suite.markdown(doc)
    assert "| 4 KiB | re-sent | 2.00 |" in text  # cupy_ipc ÷ raw
    assert "| GPU 0 | 4000 GB/s | 390 GB/s |" in text and "| GPU 1 | no peer access | 4100 GB/s |" in text
    assert "| 2 | 1300 | 1360 | 1.05 | 90 |" in text
    assert "| 1 MiB, 3 messages each | raw µs | cupy_ipc µs | cupy_ipc ÷ raw |" in text
    assert "| 1 GiB, 3 messages each | raw µs | cupy_ipc µs | cupy_ipc ÷ raw |" in text
    assert "| re-sent | 80.0 | 120.0 | 1.46 |" in text
    assert "| cupy_ipc.IpcEvent | 70.0 |" in text and "99.0% (target ≥ 98%)" in text and "**x failed:** boom" in text


def test_a_step_that_read_wrong_values_or_failed_to_open_is_a_failure():
    suite = _benchmark_module("suite")
    ok, no_peer = {"gbps": 1.0, "values_ok": True}, {"error": "GPU 1 ...: there is no peer access between them"}
    assert suite.failures("peer_matrix", [[ok, no_peer], [no_peer, ok]]) == []
    assert suite.failures("peer_matrix", [[{"error": "CUDA failed"}, ok], [ok, {**ok, "values_ok": False}]]) == [
        "GPU 0 could not open GPU 0's array: CUDA failed", "GPU 1 read wrong values of GPU 1"]
    assert suite.failures("bandwidth", {"peer_error": "GPU 1 has no peer access to GPU 0"}) == []
    assert suite.failures("bandwidth", {"peer_error": "IpcError: x"}) == ["the peer read failed: IpcError: x"]


@pytest.mark.gpu
def test_suite_smoke_run_on_tiny_sizes(tmp_path):
    r = subprocess.run(
        [sys.executable, str(SUITE), "--sizes", "4KiB", "--iters", "4", "--rounds", "1", "--warmup", "1",
         "--methods", "bare,raw,cupy_ipc,cupy_ipc-unsafe,mp,pool,vmm", "--paired-iters", "4", "--paired-sizes",
         "4KiB,1MiB", "--pingpong-iters", "20", "--release-spins", "1", "--release-iters", "3",
         "--bandwidth-bytes", "16MiB",
         "--all-gather-iters", "5", "--peer-bytes", "4MiB", "--out", str(tmp_path), "--watchdog", "150"],
        capture_output=True, text=True, timeout=200,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "suite.json").read_text())
    assert doc["errors"] == {}
    assert {(row["method"], row["resent"]) for row in doc["roundtrip"]} == {
        ("bare", False), ("raw", False), ("raw", True), ("cupy_ipc", False), ("cupy_ipc", True),
        ("cupy_ipc-unsafe", False), ("cupy_ipc-unsafe", True), ("mp", False),
        ("mp", True), ("pool", False), ("pool", True), ("vmm", False), ("vmm", True)}
    assert [pairs["bytes"] for pairs in doc["paired"]] == [4096, 1 << 20]
    for pairs in doc["paired"]:
        assert set(pairs["cases"]) == {"fresh", "re-sent"}
        for case in pairs["cases"].values():
            assert set(case["median_us"]) == set(pairs["methods"]) >= {"raw", "cupy_ipc", "mp"}
            assert {"cupy_ipc ÷ raw", "mp ÷ raw"} <= set(case["paired"])
            assert all(r > 0 for r in case["paired"].values())
    assert doc["events"]["event"]["median_us"] > 0 and doc["events"]["raw"]["median_us"] > 0
    assert [(row["consumer"], row["method"]) for row in doc["release"]] == [
        (mode, method) for mode in ("idle", "busy")
        for method in ("raw", "raw-word", "cupy_ipc", "cupy_ipc-polled", "event", "event-polled")]
    assert all(cell["median_us"] > 0 for row in doc["release"] for cell in row["late"].values())
    assert 0.5 < doc["bandwidth"]["mapped_over_local"] < 1.5
    if doc["environment"]["gpus"] > 1:
        n = doc["environment"]["gpus"]
        assert all(c["values_ok"] for row in doc["peer_matrix"] for c in row if "error" not in c)
        assert len(doc["peer_matrix"]) == n
    if doc["environment"]["gpus"] > 1 and "torch" in doc["environment"]:
        assert [g["ranks"] for g in doc["all_gather"]] == [k for k in (2, 4, 8) if k <= n]
        assert all(g["median_us"]["cupy_ipc"] > 0 for g in doc["all_gather"])
    assert (tmp_path / "suite.md").read_text().startswith("Machine:")
    assert re.search(r"\[1/\d\] roundtrip", r.stdout)  # progress


def test_waiting_on_a_dead_partner_ends_with_an_error():
    import multiprocessing
    import os

    roundtrip = _benchmark_module("roundtrip")
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=os._exit, args=(3,))
    p.start()
    with pytest.raises(RuntimeError, match="died with exit code 3"):
        roundtrip.receive(q, p, 60, "the partner")
    here, _ = ctx.Pipe()
    alive = ctx.Process(target=time.sleep, args=(30,), daemon=True)
    alive.start()
    try:
        with pytest.raises(TimeoutError, match="did not answer within 1 s"):
            roundtrip.receive(here, alive, 1, "the partner")
    finally:
        alive.kill()


def test_an_unknown_method_is_refused_before_anything_runs():
    roundtrip = _benchmark_module("roundtrip")
    with pytest.raises(ValueError, match="unknown method.*cupy-ipc.*choose from.*cupy_ipc-nosync"):
        roundtrip.run([4096], ["raw", "cupy-ipc"], 1, 1, 1)


def test_paired_ratios_are_medians_of_per_message_ratios():
    paired = _benchmark_module("paired")
    samples = {"raw": [1.0, 2.0, 4.0, 1.0], "cupy_ipc": [1.5, 2.0, 8.0, 3.0], "torch": [3.0, 6.0, 8.0, 6.0]}
    # Per message: cupy_ipc ÷ raw 1.5, 1, 2, 3; torch ÷ cupy_ipc 2, 3, 1, 2. Not the ratio of the medians (2.5 ÷ 1.5).
    assert paired.paired_ratios(samples) == {"cupy_ipc ÷ raw": 1.75, "torch ÷ cupy_ipc": 2.0}
    text = paired.markdown({"bytes": 4096, "iters": 4, "methods": ["raw", "cupy_ipc", "torch"], "cases": {
        "fresh": {"median_us": {"raw": 1.5, "cupy_ipc": 2.5, "torch": 6.0}, "paired": paired.paired_ratios(samples)}}})
    assert text.splitlines()[0] == ("| 4 KiB, 4 messages each | raw µs | cupy_ipc µs | torch µs | cupy_ipc ÷ raw "
                                    "| torch ÷ cupy_ipc |")
    assert text.splitlines()[2] == "| fresh | 1.5 | 2.5 | 6.0 | 1.75 | 2.00 |"


def test_paired_refuses_an_unknown_method_before_anything_runs():
    r = subprocess.run([sys.executable, str(PAIRED), "--methods", "raw,cupy-ipc"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "unknown method(s) cupy-ipc: choose from raw, cupy_ipc, mp, torch" in r.stderr
    with pytest.raises(ValueError, match="unknown method.*staging"):
        _benchmark_module("paired").run(["raw", "staging"], 4096, 1, 1)


def test_paired_takes_the_safety_variants_of_cupy_ipc():
    paired = _benchmark_module("paired")
    paired.check_methods(["raw", "cupy_ipc", "cupy_ipc-nosync", "cupy_ipc-nokeep", "cupy_ipc-unsafe"])
    with pytest.raises(ValueError, match="unknown method.*cupy_ipc-fast"):
        paired.check_methods(["cupy_ipc-fast"])


def test_mp_eager_sweeps_while_a_message_is_pickled_and_mp_after():
    paired = _benchmark_module("paired")
    paired.check_methods(["raw", "mp", "mp-eager"])
    roundtrip = _benchmark_module("roundtrip")
    from cupy_ipc import _keepalive

    real = _keepalive.deferral
    try:
        roundtrip._sweep_order("mp-eager")
        _keepalive.deferral.on = True  # what the sender's pickling sets: no effect here
        assert _keepalive.deferral is not real and not _keepalive.deferral.on
        roundtrip._sweep_order("mp")
        assert _keepalive.deferral is real
    finally:
        _keepalive.deferral = real


def test_the_ratio_table_has_every_case_not_only_those_cupy_ipc_ran():
    roundtrip = _benchmark_module("roundtrip")
    rows = [{"method": m, "bytes": 1 << 20, "resent": resent, "iters": 3, "median_us": us, "p10_us": us,
             "p90_us": us} for m, us in (("bare", 50.0), ("raw", 100.0), ("mp", 150.0), ("torch", 600.0))
            for resent in (False, True) if not (m == "bare" and resent)]
    lines = roundtrip.markdown({"results": rows}).splitlines()
    ratios = lines[lines.index("") + 1:]
    # mp ÷ raw and torch ÷ mp were measured: they are reported, though cupy_ipc did not run.
    assert ratios[2:] == ["| 1 MiB | fresh |  |  |  | 1.50 | 4.00 |  |  |  |",
                          "| 1 MiB | re-sent |  |  |  | 1.50 | 4.00 |  |  |  |"]


def test_the_floor_prototype_without_its_ordering_event_is_synchronized_before_sending():
    # As raw calls and cupy_ipc with ordering off: their user owes a synchronize, which the loops make untimed.
    code = "import floor, roundtrip; print(sorted(m for m in floor.FEATURES if roundtrip.unordered(m)))"
    r = subprocess.run([sys.executable, "-c", code], cwd=FLOOR.parent, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == "['floor-0', 'floor-A', 'floor-L']"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_suite_watchdog_ends_the_child_processes_of_a_hung_run(tmp_path):
    # A consumer waiting on a queue holds the queue's writing end too: it never sees its producer go.
    pidfile = tmp_path / "child.pid"
    code = f"""
import multiprocessing, sys, time
sys.path.insert(0, {str(SUITE.parent)!r})
import cupy, cupy_ipc._cuda, roundtrip, suite
cupy_ipc._cuda.unavailable_reason = lambda: None  # a GPU machine, as far as the suite can tell
cupy.cuda.runtime.getDeviceCount = lambda: 1
roundtrip.environment = lambda: {{}}

def hung(*args, **kwargs):  # a round trip whose consumer never answers
    p = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(300,), daemon=True)
    p.start()
    open({str(pidfile)!r}, "w").write(str(p.pid))
    time.sleep(300)

roundtrip.run = hung
sys.exit(suite.main(["--only", "roundtrip", "--watchdog", "3", "--out", {str(tmp_path)!r}]))
"""
    log = tmp_path / "log"
    try:
        with open(log, "w") as out:  # not a pipe: a child left alive would hold it open, and run() wait for it
            r = subprocess.run([sys.executable, "-c", code], stdout=out, stderr=out, timeout=120)
        assert r.returncode == 1, log.read_text()[-3000:]
        pid = int(pidfile.read_text())
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the hung run's child outlived the watchdog"
    finally:
        if pidfile.exists() and _alive(int(pidfile.read_text())):  # ours: end it
            import os
            import signal

            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_a_launcher_past_its_time_is_ended_so_that_its_workers_end_too(tmp_path):
    # Like torchrun: a worker in a session of its own, ended by the launcher only when it gets SIGTERM.
    pidfile = tmp_path / "worker.pid"
    launcher = f"""
import signal, subprocess, sys, time
w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
open({str(pidfile)!r}, "w").write(str(w.pid))
def stop(*_):
    w.kill()
    w.wait()
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print("started", flush=True)
time.sleep(300)
"""
    suite = _benchmark_module("suite")
    try:
        with pytest.raises(subprocess.TimeoutExpired) as caught:
            suite.run_ended([sys.executable, "-c", launcher], 3, grace=20)
        assert "started" in caught.value.stdout
        assert not _alive(int(pidfile.read_text())), "the launcher's worker outlived it"
        r = suite.run_ended([sys.executable, "-c", "print('done')"], 30)
        assert (r.returncode, r.stdout) == (0, "done\n")
    finally:
        if pidfile.exists() and _alive(int(pidfile.read_text())):
            import os
            import signal

            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_the_step_timer_sends_a_new_buffer_in_every_fresh_message(monkeypatch):
    import collections
    import types

    steps = _benchmark_module("steps")
    free_blocks, made = [], [0]  # a caching pool: a buffer let go is handed out again until the pool is freed

    class Buffer:
        def __init__(self):
            if free_blocks:
                self.block = free_blocks.pop()
            else:
                self.block, made[0] = made[0], made[0] + 1

        def __del__(self):
            free_blocks.append(self.block)

    sent = []

    def raw_handle(arr, resent, cache):
        sent.append((resent, arr.block))
        return b"handle"

    class Conn:
        def send(self, msg):
            pass

        def close(self):
            pass

    class Proc:
        def __init__(self, **kwargs):
            pass

        def start(self):
            pass

        def join(self, timeout=None):
            pass

        def is_alive(self):
            return False

    ctx = types.SimpleNamespace(Pipe=lambda: (Conn(), Conn()), Process=Proc)
    monkeypatch.setattr(steps, "multiprocessing", types.SimpleNamespace(get_context=lambda name: ctx))
    monkeypatch.setattr(steps, "instrument", lambda names: collections.Counter())
    monkeypatch.setattr(steps, "runnable", lambda methods: ["raw"])
    monkeypatch.setattr(steps, "new_buffer", lambda method, nbytes, value: Buffer())
    monkeypatch.setattr(steps, "fresh_buffer", lambda method, nbytes: Buffer())
    monkeypatch.setattr(steps, "free_buffers", lambda method: free_blocks.clear())
    monkeypatch.setattr(steps, "raw_handle", raw_handle)
    monkeypatch.setattr(steps, "receive", lambda conn, proc, timeout, who: (1.0, {}, {}))
    out = steps.run(5, 4096)
    assert len(out[("raw", False)]["round trip"]) == 5
    fresh = [block for resent, block in sent if not resent]
    assert len(fresh) == 25
    for i in range(20, 25):  # the counted ones (after 20 of warm-up): none a buffer sent before
        assert fresh[i] not in fresh[:i], (i, fresh)
