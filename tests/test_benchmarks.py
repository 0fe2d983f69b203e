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


def test_without_a_gpu_the_suite_says_so():
    if unavailable_reason() is None:
        pytest.skip("a GPU is visible: the smoke run below runs instead")
    r = subprocess.run([sys.executable, str(SUITE)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("suite: no GPU:")


def test_an_unknown_suite_step_is_refused_before_anything_runs():
    r = subprocess.run([sys.executable, str(SUITE), "--only", "peer_matrix,all-gather"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "unknown step(s) all-gather: choose from roundtrip," in r.stderr


def test_without_a_gpu_the_step_timer_says_so():
    if unavailable_reason() is None:
        pytest.skip("a GPU is visible: the step timer's GPU run below runs instead")
    r = subprocess.run([sys.executable, str(STEPS)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("steps: no GPU:")


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


def test_markdown_reports_each_part():
    sys.path.insert(0, str(SUITE.parent))
    try:
        import suite
    finally:
        sys.path.remove(str(SUITE.parent))
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
                          [{"error": "no peer"}, {"gbps": 4100.0, "values_ok": True}]]
    doc["all_gather"] = [{"ranks": 2, "bytes": 1 << 20, "median_us": {"cupy_ipc": 1300.0, "torch": 1360.0,
                                                                       "barrier": 90.0}}]
    text = suite.markdown(doc)
    assert "| 4 KiB | re-sent | 2.00 |" in text  # cupy_ipc ÷ raw
    assert "| GPU 0 | 4000 GB/s | 390 GB/s |" in text and "| GPU 1 | no peer access | 4100 GB/s |" in text
    assert "| 2 | 1300 | 1360 | 1.05 | 90 |" in text
    assert "| cupy_ipc.IpcEvent | 70.0 |" in text and "99.0% (target ≥ 98%)" in text and "**x failed:** boom" in text


@pytest.mark.gpu
def test_suite_smoke_run_on_tiny_sizes(tmp_path):
    r = subprocess.run(
        [sys.executable, str(SUITE), "--sizes", "4KiB", "--iters", "4", "--rounds", "1", "--warmup", "1",
         "--methods", "bare,raw,cupy_ipc,cupy_ipc-unsafe,mp,pool,vmm", "--pingpong-iters", "20",
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
    assert doc["events"]["event"]["median_us"] > 0 and doc["events"]["raw"]["median_us"] > 0
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

    sys.path.insert(0, str(SUITE.parent))
    try:
        import roundtrip
    finally:
        sys.path.remove(str(SUITE.parent))
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
    sys.path.insert(0, str(SUITE.parent))
    try:
        import roundtrip
    finally:
        sys.path.remove(str(SUITE.parent))
    with pytest.raises(ValueError, match="unknown method.*cupy-ipc.*choose from.*cupy_ipc-nosync"):
        roundtrip.run([4096], ["raw", "cupy-ipc"], 1, 1, 1)
