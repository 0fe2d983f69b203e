"""Workers for the notebook walkthroughs.

A process started with ``spawn`` finds its target by importing it, and a
function defined in a notebook cell cannot be imported: keep workers in a
module like this one. It imports ``cupy_ipc.multiprocessing`` so that the
arrays a worker returns travel back by handle too.
"""

import cupy

import cupy_ipc
import cupy_ipc.multiprocessing  # noqa: F401 - arrays sent back travel by handle


def normalize(a):
    """A new array, made in the worker: the caller maps the worker's memory."""
    return (a - a.mean()) / a.std()


def scale_in_place(inbox, outbox):
    """Receive arrays and scale them where they are: the sender sees the change."""
    while True:
        a = inbox.get()
        if a is None:
            return
        a *= 10
        outbox.put(a)  # sending it back orders the sender's reads after this kernel
        del a


def info(a):
    return {"device": a.device.id, "shape": a.shape, "sum": float(cupy.asnumpy(a).sum())}


def open_and_sum(data):
    """Open a handle's bytes in this (other) process and sum the array it names."""
    with cupy_ipc.IpcArrayHandle.from_bytes(data) as a:
        return float(a.sum()), a.shape


def double_buffer_consumer(conn):
    """The consumer of the double-buffered pipeline: GPU-side waits only, no device sync.

    Protocol on ``conn``: the two buffers' handles, the producer's ``filled``
    events; we answer with our ``drained`` events. Then per step ``(i, k)``:
    wait for ``filled[i]`` on our stream, sum buffer ``i`` into slot ``k``,
    record ``drained[i]``, acknowledge. ``None`` ends it; we send the sums.
    """
    stream = cupy.cuda.Stream(non_blocking=True)
    # Opened on the stream that works on them: the mapping is released once that stream's work is done.
    buffers = [cupy_ipc.IpcArrayHandle.from_bytes(d).open(stream=stream) for d in conn.recv()]
    filled = [cupy_ipc.IpcEventHandle.from_bytes(d).open() for d in conn.recv()]
    drained = [cupy_ipc.IpcEvent() for _ in buffers]
    conn.send([e.get_ipc_handle().to_bytes() for e in drained])
    sums = []
    while (msg := conn.recv()) is not None:
        i, k = msg
        filled[i].wait(stream)  # the GPU waits; this thread goes on
        with stream:
            sums.append(buffers[i].sum())
        drained[i].record(stream)
        conn.send(k)  # drained[i] is recorded: the producer may queue its next write after it
    # The only host sync, at the end. Reading the sums copies on the default
    # stream, which does not wait for a non-blocking stream: wait for ours.
    stream.synchronize()
    conn.send([float(s) for s in sums])
