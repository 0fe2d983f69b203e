"""Workers for the multiprocessing walkthrough.

A process started with ``spawn`` finds its target by importing it, and a
function defined in a notebook cell cannot be imported: keep workers in a
module like this one. It imports ``cupy_ipc.multiprocessing`` so that the
arrays a worker returns travel back by handle too.
"""

import cupy

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
