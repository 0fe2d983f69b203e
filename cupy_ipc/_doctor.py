"""``python -m cupy_ipc doctor``: what this host can do with CUDA IPC, and why.

The report is a plain dict (``--json`` prints it on one line): the platform,
versions, GPUs, peer access, the start method, ptrace rules, where the
liveness segments live, and each sharing mode with a live two-process
self-test. Each problem found comes with its cause and a remedy.
"""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

from . import _cuda
from ._cuda import unavailable_reason
from ._descriptors import _SCOPES, ptrace_scope

__all__ = ["build_report", "render", "run_doctor"]

_COMPUTE_MODES = {0: "default", 1: "exclusive-thread", 2: "prohibited", 3: "exclusive-process"}
_SELF_TEST_BYTES = 1 << 20
_SELF_TEST_TRIPS = 20
_ANSWER_S = 60.0  # for the self-test's consumer to answer one step
_QUIT_S = 20.0  # for it to quit when asked, and again once killed

# Remedies for the CUDA errors a self-test meets, by CUDA error name; the
# causes are the hints the library's errors already carry (``_cuda._HINTS``).
_REMEDIES = {
    "cudaErrorMapBufferObjectFailed": (
        "in a container, share the host's IPC and PID namespaces (docker run --ipc=host --pid=host); "
        "both processes must see the same GPU"
    ),
    "cudaErrorInvalidResourceHandle": "run producer and consumer in the same IPC namespace (docker run --ipc=host)",
    "cudaErrorDeviceUninitialized": "run producer and consumer as separate processes in the same IPC namespace",
    "cudaErrorNotSupported": "run on native Linux with a full GPU, or share through host memory",
    "cudaErrorDevicesUnavailable": "nvidia-smi -i <gpu> -c DEFAULT (as root)",
}


# --- host ---------------------------------------------------------------------------
def _host() -> dict[str, Any]:
    try:
        with open("/proc/version") as f:
            wsl = "microsoft" in f.read().lower()
    except OSError:
        wsl = False
    return {
        "platform": sys.platform,
        "machine": platform.machine(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "bits": 64 if sys.maxsize > 2**32 else 32,
        "wsl": wsl,
    }


def _segments() -> dict[str, Any]:
    from ._segment import _dir

    try:
        path: str | None = _dir()
    except OSError:  # /dev/shm unusable, and no writable temporary directory either
        path = None
    shm = "missing" if not os.path.isdir("/dev/shm") else "writable" if os.access("/dev/shm", os.W_OK) else "read-only"
    return {"dir": path, "writable": path is not None and os.access(path, os.W_OK),
            "shared_memory": path == "/dev/shm", "dev_shm": shm}


def _open_files() -> dict[str, int | None]:
    """The open-file limits (``None``: unlimited)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return {"soft": None if soft == resource.RLIM_INFINITY else soft,
            "hard": None if hard == resource.RLIM_INFINITY else hard}


# Below this many open files, a consumer cannot map a large tensor of PyTorch's expandable segments.
_FEW_FILES = 4096
_PIECE_MIB = 20  # the size of one piece of an expandable segment


def _start_method() -> dict[str, Any]:
    default = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    return {"default": default, "available": multiprocessing.get_all_start_methods()}


# The package's directory goes with it: the doctor's interpreter may have found cupy_ipc on a path of its own
# (a notebook's sys.path.insert), which a new interpreter lacks.
_PIDFD_PROBE = """
import errno, sys
sys.path.append(sys.argv[2])
from cupy_ipc._descriptors import pidfd_getfd_errno
code = pidfd_getfd_errno(int(sys.argv[1]), 0)
print("allowed 0" if code == 0 else ("unavailable" if code in (errno.ENOSYS, -1) else "refused"), max(code, 0))
"""


def _ptrace() -> dict[str, Any]:
    """Yama's ptrace rule, and whether a process may take a descriptor of one it did not start."""
    scope = ptrace_scope()
    # The child asks for a descriptor of its parent: the relation of a consumer
    # to a producer it did not start, which ptrace_scope 1 refuses.
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where this cupy_ipc is
        out = subprocess.run([sys.executable, "-c", _PIDFD_PROBE, str(os.getpid()), root], capture_output=True,
                             text=True, timeout=30).stdout.split()
        state, code = out[0], int(out[1])
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        state, code = "unavailable", 0
    return {
        "ptrace_scope": scope,
        "pidfd_getfd": state,
        "pidfd_getfd_error": errno.errorcode.get(code, str(code)) if code else None,
        "seccomp": _seccomp(),
    }


def _seccomp() -> bool | None:
    """Whether a seccomp filter runs this process's system calls (a container's profile, say); ``None`` where
    the kernel does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Seccomp:"):
                    return line.split()[1] == "2"  # SECCOMP_MODE_FILTER
    except (OSError, IndexError):
        pass
    return None


def _versions() -> dict[str, Any]:
    """What is installed, and the CUDA versions of the driver and the runtime: gathered whether or not a GPU
    is usable, since a driver of an older CUDA major than the runtime is a common reason why not."""
    try:
        import cupy
    except Exception:  # noqa: BLE001 - not installed, or not importable here: gpu_error says why
        return {}
    out: dict[str, Any] = {"cupy": cupy.__version__}
    try:
        from cuda import bindings

        out["cuda_bindings"] = bindings.__version__
    except ImportError:
        out["cuda_bindings"] = None
    for key, version in (("driver_cuda", cupy.cuda.runtime.driverGetVersion),
                         ("runtime", cupy.cuda.runtime.runtimeGetVersion)):
        try:
            v = version()
        except Exception:  # noqa: BLE001 - no driver, or no runtime library: the report says so elsewhere
            v = 0
        out[key] = f"{v // 1000}.{v % 1000 // 10}" if v else None  # 0: no driver
    return out


def _gpus() -> list[dict[str, Any]]:
    import cupy

    from ._cuda import uuid_name

    rt = cupy.cuda.runtime
    gpus = []
    for i in range(rt.getDeviceCount()):
        p = rt.getDeviceProperties(i)
        mode = rt.deviceGetAttribute(rt.cudaDevAttrComputeMode, i)
        gpus.append({
            "ordinal": i,
            "name": p["name"].decode(),
            "uuid": uuid_name(i),
            "memory_bytes": int(p["totalGlobalMem"]),
            "compute_capability": f"{p['major']}.{p['minor']}",
            "unified_addressing": bool(rt.deviceGetAttribute(rt.cudaDevAttrUnifiedAddressing, i)),
            "async_engines": int(rt.deviceGetAttribute(rt.cudaDevAttrAsyncEngineCount, i)),
            "concurrent_kernels": bool(rt.deviceGetAttribute(rt.cudaDevAttrConcurrentKernels, i)),
            "compute_mode": _COMPUTE_MODES.get(mode, str(mode)),
        })
    return gpus


def _peer_matrix(n: int) -> list[list[bool | None]]:
    return [[None if i == j else _cuda.can_access_peer(i, j) for j in range(n)] for i in range(n)]


# --- the live self-test ---------------------------------------------------------------
def _self_test_consumer(conn: Any) -> None:
    """In a spawned process: open each array handle, check it, answer; open events and wait."""
    import cupy

    from . import IpcEventHandle

    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, device, data, server = msg
        try:
            with cupy.cuda.Device(device):  # the GPU the producer's test runs on
                if kind == "array":
                    with _received(data, server) as a:
                        first = float(a[0])
                    del a
                    conn.send(("ok", first))
                elif kind == "write":  # open, write -1 at 0, finish, answer with the sum before writing
                    with _received(data, server) as a:
                        total = float(a.sum())
                        a[0] = -1
                        cupy.cuda.get_current_stream().synchronize()
                    del a
                    conn.send(("ok", total))
                else:  # "event"
                    ev = IpcEventHandle.from_bytes(data).open()
                    ev.wait()
                    ev.close()
                    conn.send(("ok", None))
        except Exception as e:  # noqa: BLE001 - reported by the doctor
            conn.send(("err", (type(e).__name__, str(e), getattr(e, "cuda_error", None))))


def _received(data: bytes, server: bytes | None) -> Any:
    from . import IpcArrayHandle

    h = IpcArrayHandle.from_bytes(data)
    if server is not None:
        h._ask_producer(server)
    return h


def _sent(kind: str, device: int, handle: Any) -> tuple[str, int, bytes, bytes | None]:
    """A self-test message: the handle's bytes and, for memory shared by descriptor, the producer's descriptor
    server, as ``cupy_ipc.multiprocessing`` sends arrays (no ptrace permission needed: that one is reported
    on its own, under "ptrace")."""
    return kind, device, handle.to_bytes(), getattr(handle, "_served", lambda: None)()  # (an event's: none)


def _ask(conn: Any, proc: Any, msg: Any) -> Any:
    conn.send(msg)
    if not conn.poll(_ANSWER_S):
        raise TimeoutError(f"the self-test's consumer process did not answer within {_ANSWER_S:g} s")
    try:
        status, value = conn.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"the self-test's consumer process died (exit code {proc.exitcode}) "
                           f"during the {msg[0]!r} step on GPU {msg[1]}") from None
    if status == "err":
        name, text, cuda_error = value
        raise _ConsumerError(f"{name}: {text}", cuda_error)
    return value


class _ConsumerError(Exception):
    def __init__(self, message: str, cuda_error: str | None) -> None:
        super().__init__(message)
        self.cuda_error = cuda_error


_LEGACY: dict[str, Any] = {"name": "legacy", "title": "legacy handles (cudaMalloc memory)", "available": True,
                           "works": False, "round_trip_us": {}, "detail": "", "cause": "", "remedy": ""}


_VMM: dict[str, Any] = {"name": "vmm-fd", "title": "descriptors, virtual-memory allocations (cuMemCreate)",
                        "available": True, "works": False, "round_trip_us": {}, "detail": "", "cause": "",
                        "remedy": ""}
_POOL: dict[str, Any] = {"name": "pool-fd", "title": "descriptors, stream-ordered pools (cudaMallocAsync)",
                         "available": True, "works": False, "round_trip_us": {}, "detail": "", "cause": "",
                         "remedy": ""}


def _descriptor_support(devices: list[int], attribute: str, what: str) -> str | None:
    """Why ``what`` cannot be shared by POSIX descriptor on ``devices`` (the device ``attribute`` says), or None."""
    driver = _cuda._driver()
    attr = getattr(driver.CUdevice_attribute, attribute)
    posix = _cuda.posix_fd()
    for d in devices:
        err, value = driver.cuDeviceGetAttribute(attr, d)
        # The pool attribute is a mask of handle types; the virtual-memory one is a yes or no.
        ok = err == driver.CUresult.CUDA_SUCCESS and (
            int(value) & int(posix) if "MEMPOOL" in attribute else bool(value))
        if not ok:
            return f"GPU {d} cannot share {what} by POSIX file descriptor"
    return None


def _self_test(devices: list[int], mode: dict[str, Any], allocator: Any = None) -> dict[str, Any]:
    """Share a 1 MiB array per GPU with a spawned process; time re-sent round trips.

    ``allocator`` (a ``malloc``) makes the arrays; default: CuPy's current one.
    """
    result: dict[str, Any] = {**mode, "round_trip_us": {}}
    ctx = multiprocessing.get_context("spawn")
    conn = child = proc = None
    try:
        conn, child = ctx.Pipe()  # (at the open-file limit, this fails: reported as the rest is)
        proc = ctx.Process(target=_self_test_consumer, args=(child,), daemon=True)
        proc.start()
        child.close()  # so that a consumer that dies ends our waits
        for d in devices:
            result["round_trip_us"][str(d)] = _share_on(conn, proc, d, allocator)
        result["works"] = True
        result["detail"] = "shared an array and an event with a spawned process, both directions, values checked"
    except Exception as e:  # the report explains it
        result["detail"] = f"{type(e).__name__}: {e}"
        name = getattr(e, "cuda_error", None) or ""
        result["cause"] = _cuda._HINTS.get(name, str(e))
        result["remedy"] = _REMEDIES.get(
            name, "run `python -m cupy_ipc demo` to see the failing step; check the items above")
    finally:
        if proc is not None:
            _stop(conn, child, proc)
        elif conn is not None:
            conn.close()
            child.close()
    return result


def _share_on(conn: Any, proc: Any, d: int, allocator: Any) -> float:
    """The self-test on GPU ``d`` with the consumer at ``conn``: its median round trip, in microseconds."""
    import cupy

    import cupy_ipc

    using = cupy.cuda.using_allocator(allocator) if allocator else contextlib.nullcontext()
    with cupy.cuda.Device(d):
        with using:
            a = cupy.arange(_SELF_TEST_BYTES // 8, dtype=cupy.int64)  # integer sums: exact on both sides
        expected = float(a.sum())
        if _ask(conn, proc, _sent("write", d, cupy_ipc.get_ipc_handle(a))) != expected:
            raise RuntimeError(f"GPU {d}: the consumer read other values than were written")
        if float(a[0]) != -1:
            raise RuntimeError(f"GPU {d}: the consumer's write did not reach the producer's memory")
        ev = cupy_ipc.IpcEvent()
        ev.record()
        _ask(conn, proc, _sent("event", d, ev.get_ipc_handle()))
        ev.close()
        a[0] = 7
        times = []
        for _ in range(_SELF_TEST_TRIPS):
            t = time.perf_counter()
            if _ask(conn, proc, _sent("array", d, cupy_ipc.get_ipc_handle(a))) != 7:
                raise RuntimeError(f"GPU {d}: the consumer read a wrong value")
            times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e6, 1)


def _stop(conn: Any, child: Any, proc: Any) -> None:
    """End the self-test's consumer, asked to or else killed, and wait for it; close both ends of its pipe
    and the process's own descriptor. A long-lived process (a notebook, say) may run the doctor again and
    again: nothing of a self-test may outlive it, however it ended."""
    child.close()  # still open where the start failed
    if proc.is_alive():
        with contextlib.suppress(OSError):
            conn.send(None)
        proc.join(_QUIT_S)
    if proc.is_alive():  # stuck, in the driver say
        proc.kill()
        proc.join(_QUIT_S)
    conn.close()
    if not proc.is_alive():  # one that outlives even SIGKILL cannot be closed
        proc.close()


def _descriptor_mode(usable: list[int], mode: dict[str, Any], self_test: bool, attribute: str, what: str,
                     allocator: Any) -> dict[str, Any]:
    """A mode shared by descriptor: unavailable (and why), self-tested with ``allocator()``, or not tested."""
    try:
        missing = _descriptor_support(usable, attribute, what) if usable else "no GPU admits a process"
    except Exception as e:  # noqa: BLE001 - the check itself failed: the mode cannot be said to work
        return {**mode, "works": False, "detail": f"{type(e).__name__}: {e}", "cause": str(e),
                "remedy": "run `python -m cupy_ipc demo` to see the failing step; check the items above"}
    if missing:
        return {**mode, "available": False, "works": None, "detail": missing}
    if not self_test:
        return {**mode, "works": None, "detail": "self-test not run"}
    try:
        malloc = allocator()
    except Exception as e:  # noqa: BLE001 - the report explains it
        return {**mode, "detail": f"{type(e).__name__}: {e}", "cause": str(e),
                "remedy": "run `python -m cupy_ipc demo` to see the failing step; check the items above"}
    return _self_test(usable, mode, malloc)


# --- the report ---------------------------------------------------------------------------
def _problems(report: dict[str, Any]) -> list[dict[str, str]]:
    out = []
    host = report["host"]
    if host["platform"] != "linux":
        out.append({"what": f"platform {host['platform']}", "cause": "CUDA IPC works on Linux only",
                    "remedy": "run on Linux"})
    if host["bits"] != 64:
        out.append({"what": "32-bit interpreter", "cause": "CUDA IPC needs a 64-bit process",
                    "remedy": "use a 64-bit Python"})
    if host["wsl"]:
        out.append({"what": "WSL", "cause": "WSL does not support CUDA IPC handles",
                    "remedy": "run on native Linux"})
    seg = report["segments"]
    if not seg["writable"]:
        out.append({"what": f"{seg['dir']} not writable" if seg["dir"] else "no writable directory for segments",
                    "cause": "cupy_ipc keeps each producer's liveness segment in /dev/shm (else the temporary "
                    "directory)",
                    "remedy": "mount /dev/shm writable (in a container: --ipc=host or --shm-size)"})
    elif not seg["shared_memory"]:
        read_only = seg.get("dev_shm") == "read-only"
        out.append({"what": "/dev/shm read-only" if read_only else "no /dev/shm",
                    "cause": f"segments fall back to {seg['dir']}, which processes in other containers, or with "
                    "another TMPDIR, may not see",
                    "remedy": "mount /dev/shm writable (in a container: --ipc=host or --shm-size)" if read_only
                    else "share /dev/shm between the processes (--ipc=host)"})
    legacy_works = any(m["name"] == "legacy" and m["works"] is True for m in report["modes"])
    for g in report["gpus"]:
        # An exclusive GPU served by MPS admits its clients, whose sharing the self-test then shows working.
        if g["compute_mode"] == "prohibited" or (g["compute_mode"] != "default" and not legacy_works):
            cause = "no process can open a context on it" if g["compute_mode"] == "prohibited" else (
                "a second process cannot open a context on it unless an MPS server serves both")
            out.append({"what": f"GPU {g['ordinal']} compute mode {g['compute_mode']}",
                        "cause": f"{cause}, so no consumer can map its memory",
                        "remedy": f"nvidia-smi -i {g['ordinal']} -c DEFAULT (as root), or start the MPS server "
                        "(nvidia-cuda-mps-control -d)" if g["compute_mode"] != "prohibited"
                        else f"nvidia-smi -i {g['ordinal']} -c DEFAULT (as root)"})
        if not g["unified_addressing"]:
            out.append({"what": f"GPU {g['ordinal']} without unified addressing",
                        "cause": "CUDA IPC needs unified virtual addressing", "remedy": "use a 64-bit Linux host"})
    soft, hard = report["open_files"]["soft"], report["open_files"]["hard"]
    if soft is not None and soft < _FEW_FILES:
        higher = "the hard limit" if hard is None or hard > soft else "a higher hard limit (as root)"
        out.append({"what": f"open-file limit {soft}",
                    "cause": "memory shared by descriptor keeps one open per piece of virtual memory mapped (a "
                    f"PyTorch tensor of expandable segments has one per {_PIECE_MIB} MiB), so a process can map "
                    f"about {soft * _PIECE_MIB // 1024} GiB of such tensors at once",
                    "remedy": f"ulimit -n {hard if hard is not None and hard > soft else _FEW_FILES} before starting "
                    f"the processes ({higher}; in a container: --ulimit nofile=...)"})
    if report["start_method"]["default"] == "fork":
        out.append({"what": "default start method 'fork'",
                    "cause": "a child forked after CUDA was initialized cannot use CUDA",
                    "remedy": "multiprocessing.get_context('spawn') or set_start_method('spawn')"})
    v = report["versions"]
    # Within a CUDA major, a runtime runs on an older driver (CUDA's minor-version compatibility): only an
    # older major is a problem.
    if v.get("driver_cuda") and v.get("runtime") and _older(v["driver_cuda"].split(".")[0], v["runtime"].split(".")[0]):
        out.append({"what": f"driver (CUDA {v['driver_cuda']}) older than the runtime (CUDA {v['runtime']})",
                    "cause": "CuPy's runtime needs a driver of its CUDA major version at least",
                    "remedy": "update the NVIDIA driver, or install CuPy built for the driver's CUDA major "
                    "(cupy_ipc's cuda12 or cuda13 extra)"})
    p = report["ptrace"]
    takes = "a consumer that opens a handle of memory shared by descriptor (virtual memory, stream-ordered pools) " \
        "received as bytes takes the descriptor out of the producer"
    send = "send such handles with cupy_ipc.send_handle or cupy_ipc.multiprocessing, which pass the descriptors " \
        "themselves"
    if p["pidfd_getfd"] == "refused":
        seccomp = p.get("seccomp") and p["ptrace_scope"] in (None, 0)  # Yama does not explain the refusal
        out.append({"what": f"pidfd_getfd refused ({p['pidfd_getfd_error']})",
                    "cause": f"{takes}, which needs permission to ptrace it: "
                    + ("this process runs under a seccomp filter, as containers do (Docker's default profile allows "
                       "pidfd_getfd only with CAP_SYS_PTRACE)" if seccomp
                       else _SCOPES.get(p["ptrace_scope"], _SCOPES[None])),
                    "remedy": send
                    + ("; or call cupy_ipc.allow_ptrace_from_any() in the producer" if p["ptrace_scope"] == 1
                       else "; or run the container with --cap-add SYS_PTRACE" if seccomp else "")})
    elif p["pidfd_getfd"] == "unavailable":
        out.append({"what": "pidfd_getfd unavailable",
                    "cause": f"{takes} with pidfd_getfd, which this kernel lacks (Linux before 5.6) or a seccomp "
                    "filter hides",
                    "remedy": send})
    for i, row in enumerate(report["peer_access"]):
        for j, ok in enumerate(row):
            if ok is False:
                out.append({"what": f"GPU {i} has no peer access to GPU {j}",
                            "cause": f"an array of GPU {j} cannot be mapped on GPU {i}",
                            "remedy": f"open it on GPU {j} (where it opens by default), or on GPU {i} with "
                            "open(copy=True), which stages a copy"})
    for m in report["modes"]:
        if m["available"] and m["works"] is False:  # (None: the self-test was not run)
            out.append({"what": f"mode {m['name']} failed its self-test", "cause": m["cause"], "remedy": m["remedy"]})
    return out


def _older(a: str, b: str) -> bool:
    """Whether CUDA version ``a`` ("12.4") is older than ``b``."""
    return tuple(map(int, a.split("."))) < tuple(map(int, b.split(".")))


def build_report(self_test: bool = True) -> dict[str, Any]:
    """Everything ``doctor`` knows about this host, as a JSON-able dict.

    Example:
        >>> report = build_report(self_test=False)
        >>> sorted(report)[:3]
        ['cupy_ipc', 'gpu_error', 'gpus']
    """
    from . import __version__

    report: dict[str, Any] = {
        "cupy_ipc": __version__,
        "host": _host(),
        "segments": _segments(),
        "open_files": _open_files(),
        "start_method": _start_method(),
        "ptrace": _ptrace(),
        "gpu_error": unavailable_reason(),
        "versions": _versions(),
        "gpus": [],
        "peer_access": [],
        "modes": [],
    }
    if report["gpu_error"] is None:
        report["gpus"] = _gpus()
        report["peer_access"] = _peer_matrix(len(report["gpus"]))
        # Exclusive GPUs are tried too: under MPS they admit several processes, and the self-test tells.
        usable = [g["ordinal"] for g in report["gpus"] if g["compute_mode"] != "prohibited"]
        if not usable:
            legacy = {**_LEGACY, "works": False, "detail": "no GPU admits a process",
                      "cause": "every GPU is in the prohibited compute mode",
                      "remedy": "nvidia-smi -c DEFAULT (as root)"}
        elif self_test:
            legacy = _self_test(usable, _LEGACY)
        else:
            legacy = {**_LEGACY, "works": None, "detail": "self-test not run"}
        from . import _vmm
        from ._pools import ShareableMemoryPool

        report["modes"] = [legacy] + [
            _descriptor_mode(usable, mode, self_test, attribute, what, allocator)
            for mode, attribute, what, allocator in (
                (_VMM, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", "virtual-memory allocations",
                 lambda: _vmm.allocate),
                (_POOL, "CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES", "stream-ordered pools",
                 lambda: _pools_malloc(ShareableMemoryPool, usable)),
            )
        ]
    report["problems"] = _problems(report)
    report["ok"] = _ok(report)
    return report


def _pools_malloc(make: Any, devices: list[int]) -> Any:
    """A ``malloc`` from a pool ``make(d)`` of each of ``devices`` (the current GPU's): pools of these GPUs alone,
    none of a GPU left out of the self-tests (one in the prohibited compute mode admits no context)."""
    pools = {d: make(d) for d in devices}
    return lambda size: pools[_cuda.current_device()].malloc(size)


def _ok(report: dict[str, Any]) -> bool:
    """Whether every available mode works on every GPU: the exit status's verdict."""
    available = [m for m in report["modes"] if m["available"]]
    # A GPU left out of the self-tests for its compute mode (prohibited) cannot share its memory: not every mode
    # works. An exclusive one was self-tested, which shows whether an MPS server lets it share.
    return (report["gpu_error"] is None and bool(available) and all(m["works"] for m in available)
            and all(g["compute_mode"] != "prohibited" for g in report["gpus"]))


def render(report: dict[str, Any]) -> str:
    """The one-screen text form of a report."""
    h, lines = report["host"], []
    lines.append(f"cupy_ipc {report['cupy_ipc']} doctor")
    lines.append(f"host          {h['platform']} {h['kernel']} {h['machine']}, Python {h['python']} "
                 f"({h['bits']}-bit){', WSL' if h['wsl'] else ''}")
    v = report["versions"]
    lines.append(f"versions      driver (CUDA) {v.get('driver_cuda')}, runtime {v.get('runtime')}, "
                 f"CuPy {v.get('cupy')}, cuda-bindings {v.get('cuda_bindings')}")
    for g in report["gpus"]:
        lines.append(
            f"GPU {g['ordinal']:<9} {g['name']}  {g['uuid']}  {g['memory_bytes'] / 2**30:.1f} GiB  "
            f"cc {g['compute_capability']}  UVA {'yes' if g['unified_addressing'] else 'NO'}  "
            f"async engines {g['async_engines']}  concurrent kernels "
            f"{'yes' if g['concurrent_kernels'] else 'no'}  compute mode {g['compute_mode']}")
    m = report["peer_access"]
    if len(m) > 1:
        pairs = ", ".join(f"{i}->{j} {'yes' if m[i][j] else 'no'}" for i in range(len(m)) for j in range(len(m))
                          if i != j)
        lines.append(f"peer access   {pairs}")
    elif m:
        lines.append("peer access   one GPU: nothing to pair")
    s = report["segments"]
    lines.append(f"segments      {s['dir'] or 'no directory'} ({'writable' if s['writable'] else 'NOT writable'})")
    p = report["ptrace"]
    scope = "no Yama (not restricted)" if p["ptrace_scope"] is None else str(p["ptrace_scope"])
    getfd = p["pidfd_getfd"] + (f" ({p['pidfd_getfd_error']})" if p["pidfd_getfd_error"] else "")
    lines.append(f"ptrace        ptrace_scope {scope}; pidfd_getfd from another process: {getfd}")
    lines.append(f"start method  default '{report['start_method']['default']}'")
    o = report["open_files"]
    lines.append(f"open files    limit {o['soft'] or 'unlimited'} (hard {o['hard'] or 'unlimited'})")
    if report["modes"]:
        lines.append("modes")
    for mode in report["modes"]:
        if not mode["available"]:
            verdict = f"not available: {mode['detail']}"
        elif mode["works"]:
            rt = ", ".join(f"GPU {d} {us:.0f} µs" for d, us in mode["round_trip_us"].items())
            verdict = f"works (round trip {rt})"
        elif mode["works"] is None:
            verdict = mode["detail"]
        else:
            verdict = f"FAILS: {mode['detail']}"
        lines.append(f"  {mode['title']:<55} {verdict}")
    if report["problems"]:
        lines.append("problems")
        for pr in report["problems"]:
            lines.append(f"  {pr['what']}: {pr['cause']}. Remedy: {pr['remedy']}")
    lines.append("verdict: every available mode works" if report["ok"] else "verdict: CUDA IPC does NOT work here")
    return "\n".join(lines)


def run_doctor(as_json: bool = False) -> int:
    """Print the report; returns 0 when every available mode works, else 1."""
    reason = unavailable_reason()
    if reason and not as_json:
        print(f"cupy_ipc doctor: no GPU to check: {reason}")
        return 1
    report = build_report()
    print(json.dumps(report) if as_json else render(report))
    return 0 if report["ok"] else 1

