"""GPU tests are skipped, with one printed reason, where no CUDA GPU is usable."""

from __future__ import annotations

import functools
import gc
import multiprocessing
import time
from typing import Any

import pytest


@functools.lru_cache(maxsize=None)
def gpu_skip_reason() -> str | None:
    """Why the GPU tests are skipped, or None. A GPU that CuPy sees and the library cannot use (without
    cuda-bindings, say) is no reason: its tests run, and fail saying why, instead of passing by skipping."""
    from cupy_ipc._cuda import unavailable_reason

    reason = unavailable_reason()
    if reason is None:
        return None
    try:
        import cupy

        return None if cupy.cuda.runtime.getDeviceCount() > 0 else reason
    except Exception:  # noqa: BLE001 - no CuPy, driver or GPU: the reason says which
        return reason


def gpu_count() -> int:
    if gpu_skip_reason():
        return 0
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def pytest_report_header(config: pytest.Config) -> str:
    reason = gpu_skip_reason()
    if reason:
        return f"cupy_ipc: GPU tests skipped: {reason}"
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    return f"cupy_ipc: GPU tests run on {gpu_count()} GPU(s), device 0 is {props['name'].decode()}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gpu") or item.get_closest_marker("multi_gpu"):
            reason = gpu_skip_reason()
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"no CUDA GPU: {reason}"))
                continue
        m = item.get_closest_marker("multi_gpu")
        if m and gpu_count() < m.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs {m.args[0]} GPUs, {gpu_count()} visible"))


def pytest_collection_finish(session: pytest.Session) -> None:
    # What collection imported stays for the whole run: frozen, a full collection before each test (below)
    # looks only at what the tests made, not at the millions of objects of the libraries (~0.1 s each).
    gc.freeze()


@pytest.fixture(autouse=True)
def _earlier_garbage_collected():
    """Cyclic garbage of earlier tests is collected before each test: a queue's semaphore collected inside a
    call into multiprocessing's resource tracker (starting a process pool, say) unregisters itself
    reentrantly, which Python 3.12 reports as an unraisable warning, an error here."""
    gc.collect()


@pytest.fixture(autouse=True)
def _cupy_names_looked_up_per_test():
    """``_cuda.cupy_names`` keeps what it looks up (``cupy.cuda.get_current_stream`` among them) for good: the
    stub of a test that replaced it would answer every later test's ``_resend`` and ``_open_common``, and a
    later test's own stub would never reach them. Looked up again in each test."""
    from cupy_ipc import _cuda

    _cuda.cupy_names.cache_clear()
    yield
    _cuda.cupy_names.cache_clear()


@pytest.fixture(autouse=True)
def _closes_done(monkeypatch):
    """The mappings a test let go are closed before its stubs go (with ``monkeypatch``, which is torn down
    after this): the closer thread would otherwise close them through the real driver, during a later test."""
    yield
    from cupy_ipc import _mapping

    _mapping.settle_closes()


@pytest.fixture(autouse=True)
def _no_export_left_pinned(request: pytest.FixtureRequest):
    """A GPU test ends with every export it made in this process unpinned: one left behind would be counted by
    each later test that checks what is pinned, so it fails here, named, and is released. Set up first, so
    torn down last, after the test's helper processes have exited."""
    node = request.node
    if not (node.get_closest_marker("gpu") or node.get_closest_marker("multi_gpu")) or gpu_skip_reason():
        yield
        return
    from cupy_ipc import _keepalive

    before = set(_keepalive._pins)
    yield
    deadline = time.monotonic() + 10.0  # a consumer's release may still wait for its GPU work
    while True:
        left = [p for p in _keepalive.pinned() if p.export_id not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for p in left:
        _keepalive.release(p.export_id)
    assert not left, f"the test left exports pinned: {left}"


@pytest.fixture
def ctrl_c_while_locked():
    """A context manager whose block must be interrupted (``KeyboardInterrupt``): another thread holds the
    library's lock, as an import does while it waits for a close, and SIGINT (Ctrl-C) comes to the main thread
    0.2 s in, while the block waits for that lock. The lock is held until the signal has been sent (and 0.2 s
    more), however late a loaded machine runs the thread that sends it."""
    import contextlib
    import signal
    import threading

    from cupy_ipc import _mapping

    @contextlib.contextmanager
    def interrupted():
        locked, sent = threading.Event(), threading.Event()

        def hold_the_lock_a_while() -> None:
            with _mapping._lock:
                locked.set()
                sent.wait(30)
                time.sleep(0.2)

        def ctrl_c() -> None:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            sent.set()

        # Python's own handler, also where SIGINT came ignored (a test run started in the background by a shell).
        handler = signal.signal(signal.SIGINT, signal.default_int_handler)
        holder = threading.Thread(target=hold_the_lock_a_while)
        holder.start()
        assert locked.wait(10)
        timer = threading.Timer(0.2, ctrl_c)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                yield
        finally:
            timer.join(30)
            holder.join(30)
            signal.signal(signal.SIGINT, handler)

    return interrupted


@pytest.fixture
def refuse_spawns(monkeypatch):
    """A function after whose call a spawned process cannot be started, as fork fails at the process limit
    (EAGAIN), once its arguments have been pickled. Multiprocessing's resource tracker, which a first start
    spawns the same way, is started first."""
    import errno
    import multiprocessing.resource_tracker
    import multiprocessing.util

    def refused(*args: object) -> None:
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")

    def refuse() -> None:
        multiprocessing.resource_tracker.ensure_running()
        monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", refused)

    return refuse


@pytest.fixture
def libcuda(monkeypatch):
    """libcuda's functions as a test gives them, by name, in the dict returned; any other does not load, so that
    cuda-bindings (or CuPy's runtime) serves it, as on a machine where ctypes cannot load libcuda."""
    from cupy_ipc import _cuda

    functions: dict[str, Any] = {}
    monkeypatch.setattr(_cuda, "_libcuda_fn", lambda name, *argtypes: functions.get(name))
    return functions


@pytest.fixture
def remote():
    """Start helper processes (spawn) that run functions of ``workers`` on request."""
    from workers import Remote

    started: list[Remote] = []

    def start() -> Remote:
        r = Remote(multiprocessing.get_context("spawn"))
        started.append(r)
        return r

    yield start
    for r in started:
        r.close()


@pytest.fixture(scope="module")
def consumer():
    """One consumer process shared by the tests of a module."""
    from workers import Remote

    r = Remote(multiprocessing.get_context("spawn"))
    yield r
    r.close()
