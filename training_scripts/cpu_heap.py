"""Keep freed memory in the process heap while training on the CPU (glibc's `mallopt`).

PyTorch's CPU tensors come from the C library's `malloc`. With glibc's defaults a training step's large
activations and gradients are mapped fresh from the kernel and unmapped when freed (or trimmed off the heap top),
so every step touches its memory anew: an InDIGO L2R step at `transformer_iwslt_de_en` size (batch 32 × 30, 2
cores) takes 60k–90k minor page faults, each a kernel entry that zero-fills a 4 KiB page. Telling glibc to serve
every size from the heap and never to trim it makes the steps after the first reuse the memory they freed: the
faults drop to ≈ 0 and the step gets faster (`benchmarks/bench_cpu_heap.py`; `docs/BENCHMARKS.md`), for a few
percent more resident memory (the heap keeps its peak).

This changes the whole process's allocator, so it is the application's decision: `flexformers-train` applies it
when it trains on the CPU (`--retain_cpu_memory false` turns it off); library code never calls it. It is a no-op
(returning False) where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

#: Larger requests than this would be mapped separately; the largest value `mallopt` takes (an `int`).
MMAP_THRESHOLD_BYTES = 2**31 - 1
#: Free memory at the heap top kept instead of returned to the kernel (never, in practice).
TRIM_THRESHOLD_BYTES = 2**31 - 1
#: Extra memory requested whenever the heap grows, so that growth happens in few, large steps.
TOP_PAD_BYTES = 512 * 2**20

_applied = False


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def retain_freed_memory() -> bool:
    """Make glibc keep freed memory in the heap (no separate mappings, no trimming). Returns True once applied
    (also on later calls), False where the C library is not glibc or refused a setting."""
    global _applied
    if _applied:
        return True
    libc = _glibc()
    if libc is None:
        logger.info("Not retaining freed CPU memory: the C library is not glibc (%s)", platform.libc_ver()[0] or "?")
        return False
    settings = {
        "M_MMAP_THRESHOLD": (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        "M_TOP_PAD": (M_TOP_PAD, TOP_PAD_BYTES),
    }
    for name, (parameter, value) in settings.items():
        if libc.mallopt(ctypes.c_int(parameter), ctypes.c_int(value)) != 1:
            logger.warning("glibc refused mallopt(%s, %d); CPU memory is returned to the kernel as usual", name, value)
            return False
    _applied = True
    logger.info("Retaining freed CPU memory in the heap (glibc mallopt): no per-step page faults")
    return True
