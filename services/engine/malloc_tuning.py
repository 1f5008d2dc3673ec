"""glibc malloc settings for processes that allocate and free multi-MiB buffers over and over:
a CPU engine's activations and gathered KV (every step), a worker's KV chunks (every message).

By default glibc serves such buffers with a fresh mmap and hands them back with munmap, or trims
freed heap memory soon after, so every new buffer page-faults (and the kernel zeroes) its pages
again. Serving buffers below 64 MiB from the heap and keeping up to 1 GiB of freed heap memory
makes later buffers reuse pages already mapped:
  - CPU engine, benchmarks/throughput.py's kvrelay run: 29.1-32.5 s without, 24.6-25.7 s with,
    same peak RSS;
  - KV hand-off, benchmarks/disagg.py at 4096 tokens: 0.90-1.01 GB/s without, 1.07-1.09 with
    (about 1 ms per 4 MiB chunk and side).
The same as MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in the environment; a no-op where
the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 2**20
TRIM_THRESHOLD_BYTES = 2**30


def keep_large_buffers_mapped() -> bool:
    """Apply the settings above; False where they cannot be (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        log.info("mallopt refused the large-buffer settings; multi-MiB buffers will page-fault on every reuse")
    return ok
