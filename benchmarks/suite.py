"""The benchmark suite: one command, every comparison side by side, JSON + Markdown + PNG.

Runs, on a GPU machine and in one go:

1. message round trips (``roundtrip.py``) for each size, fresh and re-sent:
   cupy_ipc, ``cupy_ipc.multiprocessing``, raw CuPy runtime calls (the floor),
   ``torch.multiprocessing`` (when PyTorch is installed) and host staging;
   then the same messages for each size again, every method in turn in short
   runs through one consumer, and the median of the paired runs' ratios
   (``paired.py``), which moves far less between runs;
2. event ping-pong between two processes (``events.py``), and how late a
   consumer's stream goes on once the producer's work is done, with raw calls
   and with cupy_ipc (``release.py``);
3. read bandwidth of a consumer on a mapped array against a local copy, and
   with two GPUs, peer reads (``bandwidth.py``);
4. with two or more GPUs, the cross-device open matrix: every GPU reading
   every GPU's array, values checked, GB/s (``peer_matrix.py``);
5. with two or more GPUs and PyTorch, ``all_gather`` latency under torchrun
   for 2, 4 and 8 ranks (as many as there are GPUs) against the hand-written
   ``reduce_tensor`` pattern (``all_gather.py``).

It prints progress, then writes ``suite.json``, ``suite.md`` and
``roundtrip.png`` (latency against size, log axes, one line per method) to
``--out``.

Usage::

    python benchmarks/suite.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bandwidth  # noqa: E402 - the benchmark modules sit next to this script
import events  # noqa: E402
import paired  # noqa: E402
import peer_matrix  # noqa: E402
import plots  # noqa: E402
import release  # noqa: E402
import roundtrip  # noqa: E402


def markdown(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    out = [f"Machine: {env['gpus']} × {env['gpu']}; driver CUDA {env['driver']}, runtime {env['runtime']}, "
           f"CuPy {env['cupy']}, PyTorch {env.get('torch', 'not installed')}, Python {env['python']}, "
           f"cupy_ipc {env['cupy_ipc']}; {env['date']}.", f"Command: `{env['command']}`", ""]
    if "roundtrip" in doc:
        out += ["### Message round trips", "", roundtrip.markdown({"results": doc["roundtrip"]})]
    if "paired" in doc:
        out += ["### Message round trips in pairs (every method in turn, in runs of "
                f"{paired.RUN}; ratios: medians over the rounds)", ""]
        out += [paired.markdown(run) for run in doc["paired"]]
    if "events" in doc:
        e = doc["events"]
        out += ["### Event ping-pong between two processes", "",
                "| exchange | median µs | p10–p90 µs |", "|---|---:|---:|"]
        names = {"pipe": "pipe message alone", "raw": "events, raw CuPy runtime calls", "event": "cupy_ipc.IpcEvent"}
        out += [f"| {names.get(k, k)} | {v['median_us']:.1f} | {v['p10_us']:.0f}–{v['p90_us']:.0f} |"
                for k, v in e.items()]
        out.append("")
    if "release" in doc:
        out += ["### How late a consumer's stream goes on once the producer's work is done", "",
                "By the producer's work before it; *busy*: the consumer runs Python meanwhile.", "",
                release.markdown(doc["release"]), ""]
    if "bandwidth" in doc:
        b = doc["bandwidth"]
        out += ["### Consumer read bandwidth", "", "| read | GB/s |", "|---|---:|",
                f"| mapped array (another process's memory) | {b['mapped_gbps']:.0f} |",
                f"| local copy | {b['local_gbps']:.0f} |",
                f"| mapped ÷ local | {b['mapped_over_local']:.1%} (target ≥ 98%) |"]
        if "peer_gbps" in b:
            out += [f"| peer mapping read, {b['peer_devices']} | {b['peer_gbps']:.0f} |",
                    f"| memcpyPeer of the same size | {b['memcpy_peer_gbps']:.0f} |",
                    f"| peer read ÷ memcpyPeer | {b['peer_over_memcpy_peer']:.1%} (target ≥ 90%) |",
                    f"| the reading GPU's own memory | {b['peer_local_gbps']:.0f} |"]
        elif "peer_error" in b:
            out.append(f"| peer read | failed: {b['peer_error']} |")
        out.append("")
    if "peer_matrix" in doc:
        out += ["### Cross-device opens: every GPU reading every GPU's array", "",
                peer_matrix.markdown(doc["peer_matrix"])]
    if "all_gather" in doc:
        runs = doc["all_gather"]
        out += [f"### all_gather ({runs[0]['bytes'] >> 10} KiB per rank, one rank per GPU, torchrun, gloo), median µs",
                "", "| ranks | cupy_ipc.all_gather | reduce_tensor + all_gather_object + rebuild | ÷ cupy_ipc "
                "| the barrier both include |", "|---:|---:|---:|---:|---:|"]
        for g in runs:
            m = g["median_us"]
            out.append(f"| {g['ranks']} | {m['cupy_ipc']:.0f} | {m['torch']:.0f} | {m['torch'] / m['cupy_ipc']:.2f} "
                       f"| {m['barrier']:.0f} |")
        out.append("")
    for step, error in doc.get("errors", {}).items():
        out.append(f"**{step} failed:** {error}")
    return "\n".join(out) + "\n"


def run_ended(cmd: list[str], timeout: float, grace: float = 30) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` that, past ``timeout``, ends the command with
    SIGTERM before SIGKILL, then raises ``subprocess.TimeoutExpired``.

    torchrun starts its workers in sessions of their own: killed outright, it leaves them running, holding
    their GPUs until the process group's own timeout. SIGTERM it passes on to them.
    """
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                out, err = p.communicate(timeout=grace)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def all_gather_run(ranks: int, iters: int) -> dict[str, Any]:
    """``all_gather.py`` under torchrun, one rank per GPU; its rank 0's figures."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "all_gather.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), script,
           "--iters", str(iters)]
    r = run_ended(cmd, 300)
    lines = [line for line in r.stdout.splitlines() if line.startswith("ALL_GATHER ")]
    if r.returncode or not lines:
        raise RuntimeError(f"torchrun exited with {r.returncode}: {(r.stdout + r.stderr)[-1500:]}")
    out = json.loads(lines[0].split(" ", 1)[1])
    print(f"all_gather of {ranks} ranks: median {out['median_us']}", flush=True)
    return out


def start_watchdog(seconds: float) -> None:
    """After ``seconds``: print every thread's stack, kill this run's child processes and exit with 1.

    The children must be killed: a consumer waiting on a ``Queue`` holds the queue's writing end too, so it
    never sees the producer go and would outlive the run, holding its GPU memory and mappings. faulthandler's
    own timer, a little later, still ends a run whose main thread never lets this one run.
    """
    import faulthandler
    import multiprocessing
    import threading

    def fire() -> None:
        print(f"suite: watchdog: still running after {seconds:g} s", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        for child in multiprocessing.active_children():
            child.kill()
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(seconds + 30, exit=True)


STEPS = ("roundtrip", "paired", "events", "release", "bandwidth", "peer_matrix", "all_gather")


def failures(name: str, result: Any) -> list[str]:
    """What a step that ran reports as wrong: values read wrong, an open that failed for another reason than
    a missing peer access (which the matrix shows), a peer read that failed.

    Example:
        >>> failures("peer_matrix", [[{"gbps": 1.0, "values_ok": True}, {"error": "... no peer access ..."}],
        ...                          [{"error": "... no peer access ..."}, {"gbps": 1.0, "values_ok": False}]])
        ['GPU 1 read wrong values of GPU 1']
    """
    wrong = []
    if name == "peer_matrix":
        for i, row in enumerate(result):
            for j, cell in enumerate(row):
                if "error" in cell and (i == j or "no peer access" not in cell["error"]):
                    wrong.append(f"GPU {j} could not open GPU {i}'s array: {cell['error']}")
                elif "error" not in cell and not cell["values_ok"]:
                    wrong.append(f"GPU {j} read wrong values of GPU {i}")
    elif name == "bandwidth" and "peer_error" in result and "has no peer access" not in result["peer_error"]:
        wrong.append(f"the peer read failed: {result['peer_error']}")
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4KiB,1MiB,64MiB,1GiB")
    parser.add_argument("--methods", default=",".join(roundtrip.METHODS))
    parser.add_argument("--iters", type=int, default=900, help="messages per round-trip case, over all rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--paired-methods", default=",".join(paired.METHODS))
    parser.add_argument("--paired-sizes", default="4KiB,1MiB,64MiB,1GiB")
    parser.add_argument("--paired-iters", type=int, default=300, help="messages of each method and kind")
    parser.add_argument("--pingpong-iters", type=int, default=2000)
    parser.add_argument("--release-spins", default="1,10", help="the producer's work before its stamp, ms")
    parser.add_argument("--release-iters", type=int, default=10)
    parser.add_argument("--bandwidth-bytes", default="1GiB")
    parser.add_argument("--all-gather-iters", type=int, default=100, help="on 2 or more GPUs, with PyTorch")
    parser.add_argument("--peer-bytes", default="256MiB", help="array size of the cross-device matrix")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--only", help=f"comma-separated steps to run, of {', '.join(STEPS)} (default: all)")
    parser.add_argument("--watchdog", type=float, default=0,
                        help="after this many seconds, print every thread's stack and exit (0: never)")
    args = parser.parse_args(argv)
    only = STEPS if args.only is None else tuple(args.only.split(","))
    if unknown := [name for name in only if name not in STEPS]:
        print(f"suite: unknown step(s) {', '.join(unknown)}: choose from {', '.join(STEPS)}", file=sys.stderr)
        return 2
    if args.watchdog:
        start_watchdog(args.watchdog)

    if roundtrip.no_gpu("suite"):
        return 1
    import cupy

    os.makedirs(args.out, exist_ok=True)
    env = roundtrip.environment()
    env["gpus"] = cupy.cuda.runtime.getDeviceCount()
    doc: dict[str, Any] = {"environment": env, "errors": {}}
    steps = [
        ("roundtrip", lambda: roundtrip.run([roundtrip.parse_size(s) for s in args.sizes.split(",")],
                                            args.methods.split(","), args.iters, args.rounds, args.warmup)),
        ("paired", lambda: [paired.run(args.paired_methods.split(","), roundtrip.parse_size(size), args.paired_iters,
                                       paired.WARMUP) for size in args.paired_sizes.split(",")]),
        ("events", lambda: events.run(args.pingpong_iters, max(1, args.pingpong_iters // 10))),
        ("release", lambda: release.run([float(x) for x in args.release_spins.split(",")], list(release.METHODS),
                                        args.release_iters)),
        ("bandwidth", lambda: bandwidth.run(roundtrip.parse_size(args.bandwidth_bytes))),
    ]
    if env["gpus"] > 1:
        steps.append(("peer_matrix", lambda: peer_matrix.run(roundtrip.parse_size(args.peer_bytes))))
    if env["gpus"] > 1 and importlib.util.find_spec("torch") is not None:
        counts = [n for n in (2, 4, 8) if n <= env["gpus"]]
        steps.append(("all_gather", lambda: [all_gather_run(n, args.all_gather_iters) for n in counts]))
    for name in only:  # asked for by name, and this machine cannot run it: a failure, not a quiet omission
        if args.only is not None and name not in {n for n, _ in steps}:
            doc["errors"][name] = "cannot run here: it needs 2 or more GPUs (all_gather: and PyTorch)"
    steps = [(name, step) for name, step in steps if name in only]
    for i, (name, step) in enumerate(steps, 1):
        t = time.perf_counter()
        print(f"[{i}/{len(steps)}] {name} ...", flush=True)
        try:
            doc[name] = step()
        except Exception as e:  # record it, run the other steps
            doc["errors"][name] = f"{type(e).__name__}: {e}"
            print(f"[{i}/{len(steps)}] {name} FAILED: {e}", flush=True)
        else:
            if wrong := failures(name, doc[name]):  # it ran, and some of what it read was wrong
                doc["errors"][name] = "; ".join(wrong)
                print(f"[{i}/{len(steps)}] {name} FAILED: {doc['errors'][name]}", flush=True)
        print(f"[{i}/{len(steps)}] {name} took {time.perf_counter() - t:.0f} s", flush=True)
    with open(os.path.join(args.out, "suite.json"), "w") as f:
        json.dump(doc, f, indent=1)
    table = markdown(doc)
    with open(os.path.join(args.out, "suite.md"), "w") as f:
        f.write(table)
    if "roundtrip" in doc:
        plots.draw_roundtrip(doc["roundtrip"], os.path.join(args.out, "roundtrip.png"),
                             f"Per-message round trip between two processes, {env['gpu']}")
    print(table)
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
