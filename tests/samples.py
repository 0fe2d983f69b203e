"""Field values shared by the CPU tests: distinctive bytes, so a test can tell whether they leak."""

import numpy as np

DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
]
MEMORY_HANDLE = bytes(range(0xA0, 0xE0))
EVENT_HANDLE = bytes(range(0x40, 0x80))
UUID = bytes(range(0x10, 0x20))
TOKEN = bytes(range(0xE0, 0xF0))
BOOT_ID = bytes(range(0x30, 0x40))
PRODUCER = (4242, TOKEN, BOOT_ID, "gpu-host")
