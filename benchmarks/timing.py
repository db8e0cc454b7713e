"""Side-by-side timing shared by the benchmark scripts: interleaved rounds, median seconds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[], object]) -> float:
    """Seconds of one call; a function that measures itself (e.g. the fairseq server) returns its own seconds."""
    start = time.perf_counter()
    reported = fn()
    return reported if isinstance(reported, float) else time.perf_counter() - start


def interleaved(functions: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each function, timed in interleaved rounds (one call of each per round) so that load
    drifting on a shared machine affects every compared system alike."""
    for fn in functions.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, fn in functions.items():
            times[name].append(timed(fn))
    return {name: statistics.median(values) for name, values in times.items()}
