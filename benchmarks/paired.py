"""Round trips measured in pairs: every method in turn, in short runs, through one consumer.

``roundtrip.py`` runs each method with its own consumer, one after another,
so a ratio between two methods compares two stretches of time; on a shared
machine one such ratio moves by a third or more between runs of unchanged
code. Here one producer and one consumer carry every method over one pair of
``spawn`` queues, in rounds: each round sends a short run of messages of each
method (in a shuffled order), so the runs of one round are taken within a few
milliseconds of each other. Reported: each method's median over all rounds,
and per pair of methods the median over the rounds of the ratio of the two
runs' medians.

Runs, not single messages, because a message pays for what the one before it
left to do (the consumer's release of the last array, the other library's
bookkeeping): interleaved one by one, every method would carry the average
of the others' after-work, which adds the same time to each and pulls every
ratio towards 1. The first messages of each run, which follow another method,
are not counted, so each counted message follows one of its own method, as in
a loop of its own.

The message is the one of ``roundtrip.py``: put → open → read one element →
close → ack. Fresh buffers (a new allocation every message) run before
re-sent ones, so that no mapping a method keeps for a re-sent buffer stands in
for a fresh one.

Usage::

    python benchmarks/paired.py --methods raw,cupy_ipc,mp,torch --size 1MiB --iters 300
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import roundtrip  # noqa: E402 - the benchmark modules sit next to this script

METHODS = ("raw", "cupy_ipc", "mp", "torch")
# Accepted too: cupy_ipc with parts of its safety off, to see in pairs what each part costs, and mp with its
# exports' sweep made before the message leaves, to see what making it after saves.
KNOWN = METHODS + tuple(roundtrip.VARIANTS) + (roundtrip.EAGER,)
# (numerator, denominator): the ratios the targets are stated in, and mp-eager's against mp.
PAIRS = (("cupy_ipc", "raw"), ("torch", "cupy_ipc"), ("mp", "raw"), ("torch", "mp"), (roundtrip.EAGER, "mp"))


def consumer(methods: list[str], inbox: Any, outbox: Any) -> None:
    roundtrip.load_reductions(methods)
    mapped: dict[bytes, int] = {}
    while True:
        msg = inbox.get()
        if msg is None:
            break
        method, payload = msg
        del msg
        if isinstance(payload, str) and payload == roundtrip.FLUSH:  # raw calls' buffers are freed next
            for ptr in mapped.values():
                roundtrip.close_raw(ptr, False)
            mapped.clear()
            outbox.put(roundtrip.FLUSH)
            continue
        value = roundtrip.consume(method, payload, mapped)
        del payload
        outbox.put(value)


def paired_ratios(samples: dict[str, list[float]]) -> dict[str, float]:
    """Per pair of :data:`PAIRS` whose methods both ran: the median of the ratios of paired samples (the
    medians of one round's runs).

    Example:
        >>> paired_ratios({"raw": [1.0, 2.0, 4.0], "cupy_ipc": [1.5, 2.0, 8.0]})
        {'cupy_ipc ÷ raw': 1.5}
    """
    out = {}
    for num, den in PAIRS:
        a, b = samples.get(num), samples.get(den)
        if a and b:
            out[f"{num} ÷ {den}"] = statistics.median(x / y for x, y in zip(a, b, strict=True))
    return out


RUN = 20  # messages counted per method and round
SETTLE = 5  # messages sent first in each run, not counted
WARMUP = 10  # rounds of one message of each method, not counted


def check_methods(methods: list[str]) -> None:
    """``ValueError`` naming any of ``methods`` this benchmark does not know."""
    if unknown := [m for m in methods if m not in KNOWN]:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(KNOWN)}")


def run(methods: list[str], nbytes: int, iters: int, warmup: int) -> dict[str, Any]:
    """Fresh, then re-sent: ``iters`` messages of every method (rounded up to whole runs), in rounds of one run
    of each; medians and paired ratios. ``warmup`` rounds of one message each come first."""
    check_methods(methods)
    methods = roundtrip.runnable(methods)
    if not methods:
        raise ValueError("none of the methods named can run here")
    roundtrip.load_reductions(methods)
    rounds = -(-iters // RUN)
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(methods, inbox, outbox), daemon=True)
    proc.start()
    cases: dict[str, Any] = {}
    order = random.Random(0)  # the same sequence in every run
    try:
        for resent in (False, True):
            samples: dict[str, list[float]] = {m: [] for m in methods}
            caches: dict[str, dict[str, Any]] = {m: {} for m in methods}
            kept = {m: roundtrip.new_buffer(m, nbytes, 1) for m in methods} if resent else {}
            if kept:
                import cupy

                cupy.cuda.runtime.deviceSynchronize()  # untimed: raw calls order nothing (see roundtrip.py)
            runs: dict[str, list[float]] = {m: [] for m in methods}  # one median per method and round
            for r in range(warmup + rounds):
                counted = r >= warmup
                for method in order.sample(methods, len(methods)):
                    times = []
                    for i in range(SETTLE + RUN if counted else 1):
                        arr = kept[method] if resent else roundtrip.fresh_buffer(method, nbytes)
                        t = time.perf_counter()
                        inbox.put((method, roundtrip._message(method, arr, resent, caches[method])))
                        value = roundtrip.receive(outbox, proc, 600, "the consumer")
                        elapsed = time.perf_counter() - t
                        if value != 1.0:
                            raise RuntimeError(f"{method}: consumer read {value}, expected 1.0")
                        if counted and i >= SETTLE:
                            times.append(elapsed)
                        if not resent:
                            arr = None
                            roundtrip.free_buffers(method)
                    if times:
                        samples[method] += times
                        runs[method].append(statistics.median(times))
            if resent and "raw" in methods:
                inbox.put(("raw", roundtrip.FLUSH))
                roundtrip.receive(outbox, proc, 600, "the consumer")
            kept.clear()
            for method in methods:
                roundtrip.free_buffers(method)
            cases["re-sent" if resent else "fresh"] = {
                "median_us": {m: statistics.median(t) * 1e6 for m, t in samples.items()},
                "paired": paired_ratios(runs),
            }
    finally:
        inbox.put(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return {"bytes": nbytes, "iters": rounds * RUN, "methods": methods, "cases": cases}


def markdown(result: dict[str, Any]) -> str:
    """The medians and the paired ratios, one row per kind of buffer.

    Example:
        >>> print(markdown({"bytes": 1 << 20, "iters": 3, "methods": ["raw", "cupy_ipc"], "cases": {
        ...     "fresh": {"median_us": {"raw": 100.0, "cupy_ipc": 150.0}, "paired": {"cupy_ipc ÷ raw": 1.4}}}}))
        | 1 MiB, 3 messages each | raw µs | cupy_ipc µs | cupy_ipc ÷ raw |
        |---|---:|---:|---:|
        | fresh | 100.0 | 150.0 | 1.40 |
        <BLANKLINE>
    """
    methods = result["methods"]
    pairs = [f"{a} ÷ {b}" for a, b in PAIRS if a in methods and b in methods]
    lines = [f"| {roundtrip.size_label(result['bytes'])}, {result['iters']} messages each | "
             + " | ".join(f"{m} µs" for m in methods) + " | " + " | ".join(pairs) + " |",
             "|---|" + "---:|" * (len(methods) + len(pairs))]
    for kind, case in result["cases"].items():
        lines.append(f"| {kind} | " + " | ".join(f"{case['median_us'][m]:.1f}" for m in methods) + " | "
                     + " | ".join(f"{case['paired'][p]:.2f}" for p in pairs) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(KNOWN)}")
    parser.add_argument("--size", default="1MiB")
    parser.add_argument("--iters", type=int, default=300, help="messages of each method and kind of buffer")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="rounds of one message of each method first")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    try:
        check_methods(methods)
    except ValueError as e:
        print(f"paired: {e}", file=sys.stderr)
        return 2

    if roundtrip.no_gpu("paired"):
        return 1
    result = run(methods, roundtrip.parse_size(args.size), args.iters, args.warmup)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": roundtrip.environment(), "paired": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
