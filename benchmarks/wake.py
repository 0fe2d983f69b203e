"""What a process pays to wake: a queue hop and a fixed piece of Python, after waits of several lengths.

No GPU and no library: two processes and a pair of ``spawn`` queues, as in
``roundtrip.py``. For each case the producer waits ``--idle`` µs (busy) after
an answer before it sends the next message, and the consumer, once it has the
message, runs a fixed piece of Python (``WORK``: dictionary and tuple work, as
a library's bookkeeping is), then stays busy until ``--busy`` µs have passed
since the message came, then answers. Reported per case (medians over runs of
messages of each case in turn, rounds shuffled, as ``paired.py`` does):

- the round trip, less the consumer's busy time: what the two queue hops cost;
- the piece of Python as the consumer ran it just after its wait, against the
  same piece in a tight loop in the same process.

If hops grow with the time the other side was busy, or the piece of Python
takes longer after longer waits, a message's cost grows faster than the work
done for it: each microsecond of work on one side also makes the other side's
wait longer, and its wake slower.

Usage::

    python benchmarks/wake.py --busy 0,50,100,200,400 --idle 0,100,400 --iters 300
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import time
from typing import Any

RUN, SETTLE, WARMUP = 20, 5, 3  # messages counted per case and round, sent first uncounted, warm-up rounds


def work(n: int = 40) -> int:
    """A fixed piece of Python: ``n`` rounds of small dictionary, tuple and attribute work.

    Example:
        >>> work(3)
        3
    """
    table: dict[tuple[int, int], int] = {}
    for i in range(n):
        key = (i, i & 7)
        table[key] = table.get(key, 0) + len(key)
    return sum(1 for key in table if key[0] in range(n))


def spin_until(deadline: float) -> None:
    while time.perf_counter() < deadline:
        pass


def consumer(inbox: Any, outbox: Any) -> None:
    hot = []
    for _ in range(2000):
        t = time.perf_counter()
        work()
        hot.append(time.perf_counter() - t)
    outbox.put(statistics.median(hot[1000:]))
    while True:
        busy = inbox.get()
        if busy is None:
            break
        t = time.perf_counter()
        work()
        cold = time.perf_counter() - t
        spin_until(t + busy)
        outbox.put(cold)


def run(busies: list[float], idles: list[float], iters: int) -> dict[str, Any]:
    """Median hop and cold-work times (µs) per ``(busy, idle)`` case, and the work's tight-loop time."""
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(inbox, outbox), daemon=True)
    proc.start()
    cases = [(b, i) for b in busies for i in idles]
    hops: dict[tuple[float, float], list[float]] = {c: [] for c in cases}
    colds: dict[tuple[float, float], list[float]] = {c: [] for c in cases}
    order = random.Random(0)
    try:
        hot = outbox.get(timeout=60)
        for r in range(WARMUP + -(-iters // RUN)):
            for busy, idle in order.sample(cases, len(cases)):
                for k in range(SETTLE + RUN):
                    spin_until(time.perf_counter() + idle * 1e-6)
                    t = time.perf_counter()
                    inbox.put(busy * 1e-6)
                    cold = outbox.get(timeout=60)
                    elapsed = time.perf_counter() - t
                    if r >= WARMUP and k >= SETTLE:
                        hops[(busy, idle)].append(elapsed * 1e6 - max(busy, cold * 1e6))
                        colds[(busy, idle)].append(cold * 1e6)
    finally:
        inbox.put(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return {"hot_us": hot * 1e6,
            "cases": [{"busy_us": b, "idle_us": i, "hops_us": statistics.median(hops[(b, i)]),
                       "work_us": statistics.median(colds[(b, i)])} for b, i in cases]}


def markdown(result: dict[str, Any]) -> str:
    """The table of :func:`run`'s result.

    Example:
        >>> print(markdown({"hot_us": 2.0, "cases": [
        ...     {"busy_us": 0, "idle_us": 0, "hops_us": 50.0, "work_us": 3.0}]}), end="")
        | consumer busy µs | producer idle µs | two hops µs | work after the wait µs (in a loop: 2.0) |
        |---:|---:|---:|---:|
        | 0 | 0 | 50.0 | 3.0 |
    """
    lines = [f"| consumer busy µs | producer idle µs | two hops µs | work after the wait µs (in a loop: "
             f"{result['hot_us']:.1f}) |", "|---:|---:|---:|---:|"]
    for c in result["cases"]:
        lines.append(f"| {c['busy_us']:g} | {c['idle_us']:g} | {c['hops_us']:.1f} | {c['work_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", default="0,50,100,200,400", help="µs the consumer stays busy per message")
    parser.add_argument("--idle", default="0,100,400", help="µs the producer waits before each message")
    parser.add_argument("--iters", type=int, default=300, help="messages per case")
    args = parser.parse_args(argv)
    busies = [float(x) for x in args.busy.split(",")]
    idles = [float(x) for x in args.idle.split(",")]
    print(markdown(run(busies, idles, args.iters)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
