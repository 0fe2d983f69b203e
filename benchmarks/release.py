"""How late a consumer's stream goes on once the producer's work is done.

The producer queues a kernel that spins for ``--spins`` milliseconds and then
stamps the GPU's global timer into a shared buffer, and sends the buffer at
once. The consumer opens it, so that its stream waits for that work, and queues
a kernel that subtracts the stamp from the global timer: how late its stream
went on (one GPU, one clock). Meanwhile the consumer's main thread is either
*idle* (blocked in a synchronize) or *busy* running Python, as a pipeline
stage preparing its next input would be.

Methods:

- ``raw``: CuPy runtime calls by hand, the consumer's stream waiting on the
  producer's interprocess event itself (``cudaStreamWaitEvent``): the floor,
  which a killed producer leaves stuck for ever;
- ``raw-word``: by hand too, the producer's stream writing a word of a
  shared file registered with CUDA (``cuStreamWriteValue32``) and the
  consumer's stream waiting for it (``cuStreamWaitValue32``);
- ``cupy_ipc``: ``get_ipc_handle`` / ``IpcArrayHandle.open`` with the defaults;
- ``cupy_ipc-polled``: the same with the producer writing no word, so the
  consumer's stream waits for a word of its own that the library's thread sets
  once it sees the event completed;
- ``event``: the buffer sent once; each message, the producer records a
  ``cupy_ipc.IpcEvent`` (exported before its first record) after its work and
  the consumer's stream waits for it with ``IpcEvent.wait``;
- ``event-polled``: the same with the producer writing no word for the event.

Usage::

    python benchmarks/release.py --spins 1,10,100 --iters 20
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import mmap
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from roundtrip import no_gpu, receive  # noqa: E402 - the benchmark modules sit next to this script

from cupy_ipc._cuda import _libcuda_fn  # noqa: E402

METHODS = ("raw", "raw-word", "cupy_ipc", "cupy_ipc-polled", "event", "event-polled")
SOURCE = r"""
extern "C" __global__ void spin_stamp(unsigned long long ns, long long* stamp) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    stamp[0] = (long long)t;
}
extern "C" __global__ void late(const long long* stamp, long long* out) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    out[0] = (long long)t - stamp[0];
}
"""
_WORD_FILE_BYTES = 4096
_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ
_REGISTER_FLAGS = 0x01 | 0x02  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP


def _kernels() -> tuple[Any, Any]:
    import cupy

    module = cupy.RawModule(code=SOURCE)
    return module.get_function("spin_stamp"), module.get_function("late")


_registered: dict[str, tuple[mmap.mmap, int]] = {}


def _word_file() -> str:
    """A file of this process for ``raw-word``'s word, removed at exit."""
    path = f"/dev/shm/cupy_ipc-release-{os.getpid()}"
    if not os.path.exists(path):
        with open(path, "wb") as f:
            f.write(bytes(_WORD_FILE_BYTES))
        atexit.register(os.unlink, path)
    return path


def _registered_word(path: str) -> tuple[mmap.mmap, int]:
    """A shared file's first page mapped here and registered with CUDA, once a process (registered memory is
    never unmapped here: a stream may still wait on it); ``(map, address of its first word)``."""
    if path in _registered:
        return _registered[path]
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, _WORD_FILE_BYTES)
    finally:
        os.close(fd)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    err = _libcuda_fn("cuMemHostRegister_v2", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)(
        addr, _WORD_FILE_BYTES, _REGISTER_FLAGS)
    if err:
        raise RuntimeError(f"cuMemHostRegister failed: {err}")
    _registered[path] = (mm, addr)
    return mm, addr


def _consumer(method: str, busy: bool, conn: Any) -> None:
    import cupy

    import cupy_ipc

    spin, late = _kernels()
    out = cupy.zeros(1, cupy.int64)
    scratch = cupy.zeros(1, cupy.int64)
    spin((1,), (1,), (cupy.uint64(1000), scratch))  # loaded and run once: a first launch waits for the GPU
    late((1,), (1,), (scratch, out))
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.get_current_stream()
    wait_value = _libcuda_fn("cuStreamWaitValue32_v2", ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
    mapped: dict[bytes, Any] = {}
    word = None
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        deadline = time.perf_counter() + msg["busy_s"]
        if method.startswith("raw"):
            handle = msg["handle"]
            if handle not in mapped:
                ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
                mem = cupy.cuda.UnownedMemory(ptr, 8, None)
                mapped[handle] = cupy.ndarray((1,), cupy.int64, cupy.cuda.MemoryPointer(mem, 0))
            stamp = mapped[handle]
            if method == "raw":
                if "event" not in mapped:
                    mapped["event"] = cupy.cuda.runtime.ipcOpenEventHandle(msg["event"])
                cupy.cuda.runtime.streamWaitEvent(stream.ptr, mapped["event"], 0)
            else:
                if word is None:
                    word = _registered_word(msg["path"])
                wait_value(stream.ptr, word[1], msg["value"], _GEQ)
            late((1,), (1,), (stamp, out))
            del stamp
        elif method.startswith("event"):
            if "event" not in mapped:
                mapped["event"] = cupy_ipc.IpcEventHandle.from_bytes(msg["event"]).open()
                mapped["stamp"] = cupy_ipc.IpcArrayHandle.from_bytes(msg["handle"]).open()
            mapped["event"].wait(stream)
            late((1,), (1,), (mapped["stamp"], out))
        else:
            with cupy_ipc.IpcArrayHandle.from_bytes(msg["handle"]) as stamp:
                late((1,), (1,), (stamp, out))
            del stamp
        if busy:  # Python that holds the GIL until the producer's work is surely done
            n = 0
            while time.perf_counter() < deadline:
                n += 1
        stream.synchronize()
        conn.send(int(out.get()[0]))


def measure(method: str, busy: bool, spins_ms: list[float], iters: int) -> dict[float, list[float]]:
    """``{spin ms: [µs late, ...]}`` for one method and consumer mode, with one consumer process."""
    import cupy

    import cupy_ipc

    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(method, busy, child), daemon=True)
    proc.start()
    child.close()
    spin, _ = _kernels()
    stamp = cupy.zeros(1, cupy.int64)
    spin((1,), (1,), (cupy.uint64(1000), stamp))
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.get_current_stream()
    out: dict[float, list[float]] = {s: [] for s in spins_ms}
    polled = None
    if method.endswith("-polled"):  # the producer's words off: the consumer polls the event
        from cupy_ipc import _words as polled

        polled.disabled = True
    word_path = None
    try:
        receive(conn, proc, 120, "the consumer")
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(stamp.data.ptr))
        rt = cupy.cuda.runtime
        event = rt.eventCreateWithFlags(rt.eventInterprocess | rt.eventDisableTiming)
        event_handle = bytes(rt.ipcGetEventHandle(event))
        write_value = _libcuda_fn("cuStreamWriteValue32_v2", ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32,
                               ctypes.c_uint)
        word = None
        if method == "raw-word":
            word_path = _word_file()
            word = _registered_word(word_path)
        value = int.from_bytes(word[0][:4], "little") if word is not None else 0
        if method.startswith("event"):
            ipc_event = cupy_ipc.IpcEvent()
            sent = {"event": ipc_event.get_ipc_handle().to_bytes(),
                    "handle": cupy_ipc.get_ipc_handle(stamp, keepalive=False, sync=False).to_bytes()}
        for _ in range(iters + 2):  # two warm-up messages
            for s in spins_ms:
                spin((1,), (1,), (cupy.uint64(int(s * 1e6)), stamp))
                msg: dict[str, Any] = {"busy_s": s / 1e3 + 0.01}
                if method == "raw":
                    rt.eventRecord(event, stream.ptr)
                    msg.update(handle=handle, event=event_handle)
                elif method.startswith("event"):
                    ipc_event.record(stream)
                    msg.update(sent)
                elif method == "raw-word":
                    value += 1
                    err = write_value(stream.ptr, word[1], value, 0)
                    if err:
                        raise RuntimeError(f"cuStreamWriteValue32 failed: {err}")
                    msg.update(handle=handle, path=word_path, value=value)
                else:
                    msg.update(handle=cupy_ipc.get_ipc_handle(stamp).to_bytes())
                conn.send(msg)
                out[s].append(receive(conn, proc, 120, "the consumer") / 1e3)
                stream.synchronize()
        for s in spins_ms:
            del out[s][:2]  # warm-up
        return out
    finally:
        if polled is not None:
            polled.disabled = False
        conn.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def run(spins_ms: list[float], methods: list[str], iters: int) -> list[dict[str, Any]]:
    """Every method with the consumer idle, then busy: one row each, ``{"consumer", "method", "late": {spin ms:
    {"median_us", "p90_us"}}}``, each printed once measured."""
    rows = []
    for busy in (False, True):
        for method in methods:
            late = measure(method, busy, spins_ms, iters)
            row = {"consumer": "busy" if busy else "idle", "method": method,
                   "late": {s: {"median_us": statistics.median(v), "p90_us": statistics.quantiles(v, n=10)[-1]}
                            for s, v in late.items()}}
            rows.append(row)
            print(f"release: {markdown([row]).splitlines()[-1]}", flush=True)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a table: how late, median µs (p90), by the producer's work.

    Example:
        >>> print(markdown([{"consumer": "idle", "method": "raw", "late": {1.0: {"median_us": 140.0, "p90_us": 141.0}}}]))
        | consumer | method | 1 ms: median µs (p90) |
        |---|---|---:|
        | idle | raw | 140.0 (141.0) |
    """
    spins = list(rows[0]["late"]) if rows else []
    lines = ["| consumer | method | " + " | ".join(f"{float(s):g} ms: median µs (p90)" for s in spins) + " |",
             "|---|---|" + "---:|" * len(spins)]
    for row in rows:
        cells = [f"{c['median_us']:.1f} ({c['p90_us']:.1f})" for c in row["late"].values()]
        lines.append(f"| {row['consumer']} | {row['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spins", default="1,10,100", help="the producer's work before its stamp, ms")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    if unknown := [m for m in methods if m not in METHODS]:
        print(f"release: unknown method(s) {', '.join(unknown)}: choose from {', '.join(METHODS)}", file=sys.stderr)
        return 2
    if no_gpu("release"):
        return 1
    print(markdown(run([float(s) for s in args.spins.split(",")], methods, args.iters)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
