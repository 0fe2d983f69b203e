"""Several producers, one consumer, one queue: what each producer's sweep costs the others.

``--writers`` processes send re-sent arrays through one shared
``cupy_ipc.multiprocessing`` queue (a ``SimpleQueue``, which a ``Pool``'s and a
``ProcessPoolExecutor``'s results take, or a ``Queue``, whose feeder thread
writes) to this process. It opens each, keeps the last ``--hold`` of them alive
(so that the writers have that many exports pinned between them, as a pool's
parent collecting results does) and acks its writer on the writer's own pipe;
the writer then sends its next. Nothing is read from the arrays: the consumer
is as fast as it can be, which makes the queue's write lock as contended as it
gets.

Each export first ends the pins of its process whose consumers are done (its
sweep). The two orders of that sweep, each writer switching between them
round by round:

- ``after``: the library's, made by the sender once it has written the
  message and let go of the queue's write lock;
- ``eager``: made while the message is pickled, before that lock is taken.

Reported per case: messages a second over all writers, the writers' median
round trip, and ``eager ÷ after`` of each, as medians of per-round ratios.

Usage::

    python benchmarks/writers.py --queues simple,queue --writers 1,4,8 --hold 0,64 --iters 100 --rounds 6
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import roundtrip  # noqa: E402 - the benchmark modules sit next to this script

ORDERS = ("after", "eager")
QUEUES = ("simple", "queue")
WARMUP = 1  # rounds not counted


def writer(index: int, nbytes: int, buffers: int, queue: Any, inbox: Any) -> None:
    """Send ``buffers`` arrays in turn, one message in flight: each waits for its ack on ``inbox``, which also
    brings each round's ``(order, count)``; ``None`` ends it. After a round, its round trips go on the queue."""
    import cupy

    roundtrip.load_reductions(("mp",))  # this process pickles arrays for the queue
    arrays = [cupy.full(nbytes // 4, index + 1, dtype=cupy.float32) for _ in range(buffers)]
    cupy.cuda.Device().synchronize()  # nothing left to order: each export is its pin and sweep
    sent = 0
    while (command := inbox.recv()) is not None:
        order, count = command
        roundtrip._sweep_order(roundtrip.EAGER if order == "eager" else "mp")
        times = []
        for _ in range(count):
            arr = arrays[sent % buffers]
            sent += 1
            start = time.perf_counter()
            queue.put((index, arr))
            inbox.recv()
            times.append(time.perf_counter() - start)
        del arr
        queue.put((index, times))


def one_round(queue: Any, acks: list[Any], order: str, iters: int, hold: int, check: bool) -> tuple[float, float]:
    """``(messages a second, median round trip in s)`` of one round of every writer in ``order``; ``check``:
    read each array's first element, which must be its writer's number plus one."""
    for ack in acks:
        ack.send((order, iters))
    kept: collections.deque[Any] = collections.deque(maxlen=hold)
    times: list[float] = []
    done = 0
    start = time.perf_counter()
    while done < len(acks):
        index, payload = queue.get()
        if isinstance(payload, list):
            done += 1
            times += payload
            continue
        if check and float(payload[0]) != index + 1:
            raise SystemExit(f"writers: writer {index}'s array read {float(payload[0])}, not {index + 1}")
        if hold:
            kept.append(payload)  # (the oldest goes: its release lets a writer's next sweep end its pin)
        payload = None
        acks[index].send(1)
    wall = time.perf_counter() - start
    kept.clear()
    return len(acks) * iters / wall, statistics.median(times)


def run_case(kind: str, writers: int, holds: list[int], nbytes: int, iters: int, rounds: int, buffers: int,
             check: bool) -> list[dict[str, Any]]:
    import cupy_ipc.multiprocessing as cmp

    ctx = cmp.get_context("spawn")
    queue = ctx.SimpleQueue() if kind == "simple" else ctx.Queue()
    pipes = [ctx.Pipe(duplex=False) for _ in range(writers)]
    procs = [ctx.Process(target=writer, args=(i, nbytes, buffers, queue, pipes[i][0]), daemon=True)
             for i in range(writers)]
    for p in procs:
        p.start()
    acks = [send for _, send in pipes]
    rows = []
    try:
        for hold in holds:
            rate: dict[str, list[float]] = {o: [] for o in ORDERS}
            trip: dict[str, list[float]] = {o: [] for o in ORDERS}
            for r in range(WARMUP + rounds):
                for order in random.sample(ORDERS, len(ORDERS)):
                    per_s, median = one_round(queue, acks, order, iters, hold, check)
                    if r >= WARMUP:
                        rate[order].append(per_s)
                        trip[order].append(median)
            rows.append({
                "queue": kind, "writers": writers, "hold": hold,
                **{f"{o} msg/s": statistics.median(rate[o]) for o in ORDERS},
                **{f"{o} us": statistics.median(trip[o]) * 1e6 for o in ORDERS},
                "rate eager/after": statistics.median(e / a for e, a in zip(rate["eager"], rate["after"])),
                "trip eager/after": statistics.median(e / a for e, a in zip(trip["eager"], trip["after"])),
            })
            print(_line(rows[-1]), flush=True)
    finally:
        for ack in acks:
            ack.send(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return rows


COLUMNS = ("queue", "writers", "hold", "after msg/s", "eager msg/s", "rate eager/after", "after us", "eager us",
           "trip eager/after")


def _line(row: dict[str, Any]) -> str:
    return "| " + " | ".join(f"{row[c]:.2f}" if "/after" in c else f"{row[c]:.0f}" if isinstance(row[c], float)
                             else str(row[c]) for c in COLUMNS) + " |"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as one table.

    Example:
        >>> row = {"queue": "simple", "writers": 4, "hold": 64, "after msg/s": 9000.4, "eager msg/s": 9500.6,
        ...        "rate eager/after": 1.0556, "after us": 400.2, "eager us": 380.7, "trip eager/after": 0.951}
        >>> print(markdown([row]).splitlines()[-1])
        | simple | 4 | 64 | 9000 | 9501 | 1.06 | 400 | 381 | 0.95 |
    """
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * 3 + "---:|" * (len(COLUMNS) - 3)
    return "\n".join([head, *(_line(r) for r in rows)])


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queues", default="simple,queue", help="simple, queue or both")
    parser.add_argument("--writers", type=_ints, default=[1, 4, 8])
    parser.add_argument("--hold", type=_ints, default=[0, 64], help="arrays the consumer keeps alive")
    parser.add_argument("--size", default="1MiB")
    parser.add_argument("--buffers", type=int, default=4, help="arrays each writer sends in turn")
    parser.add_argument("--iters", type=int, default=100, help="messages per writer, order and round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--check", action="store_true", help="read every array (slower: for tests)")
    parser.add_argument("--idle", type=int, help="the consumer's idle mapping limit, fixed (default: the library's, "
                        "which grows)")
    args = parser.parse_args(argv)
    kinds = args.queues.split(",")
    if not set(kinds) <= set(QUEUES):
        parser.error(f"--queues: choose among {', '.join(QUEUES)}")
    if min(args.writers) < 1 or min(args.hold) < 0 or args.iters < 1 or args.rounds < 1 or args.buffers < 1 \
            or (args.idle or 0) < 0:
        parser.error("--writers, --iters, --rounds and --buffers must be positive, --hold and --idle not negative")
    if roundtrip.no_gpu("writers"):
        return 1
    nbytes = roundtrip.parse_size(args.size)
    if args.idle is not None:
        import cupy_ipc

        cupy_ipc.set_idle_mapping_limit(args.idle)
    print(markdown([]), flush=True)  # the header; each case's row follows as it is measured
    rows = [row for kind in kinds for n in args.writers
            for row in run_case(kind, n, args.hold, nbytes, args.iters, args.rounds, args.buffers,
                                    args.check)]
    import cupy_ipc

    print(f"\nthe consumer's idle mapping limit at the end: {cupy_ipc.idle_mapping_limit()}")
    print("\n" + markdown(rows))  # last: the table is what follows the last blank line
    return 0


if __name__ == "__main__":
    sys.exit(main())
