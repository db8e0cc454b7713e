"""Side-by-side timing shared by the benchmark scripts: interleaved rounds, median seconds.

GPU work is asynchronous: every timed call is bracketed by `synchronize()`, so a call's seconds include the
device work it queued (and none of the previous call's)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize() -> None:
    """Wait for the queued CUDA work (a no-op on CPU-only runs)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    """Seconds of one call; a function that measures itself (e.g. the fairseq server) returns its own seconds."""
    synchronize()
    start = time.perf_counter()
    reported = fn()
    synchronize()
    return reported if isinstance(reported, float) else time.perf_counter() - start


def interleaved(
    functions: dict[str, Callable[[], object]], repeats: int, warmup: int = 1, blocked: bool = False
) -> dict[str, float]:
    """Median seconds of each function, timed in interleaved rounds (one call of each per round) so that load
    drifting on a shared machine affects every compared system alike. ``blocked=True`` times all repetitions of
    one function before the next (warm-up included) — a check on whether alternating systems costs any of them
    (caches, allocator state), not the default."""
    times = {name: [] for name in functions}
    if blocked:
        for name, fn in functions.items():
            for _ in range(warmup):
                fn()
            times[name] = [timed(fn) for _ in range(repeats)]
        return {name: statistics.median(values) for name, values in times.items()}
    for fn in functions.values():
        for _ in range(warmup):
            fn()
    for _ in range(repeats):
        for name, fn in functions.items():
            times[name].append(timed(fn))
    return {name: statistics.median(values) for name, values in times.items()}


def fastest(fn: Callable[[], object], repeats: int, calls: int = 1, warmup: int = 1) -> float:
    """Fastest of `repeats` averages of `calls` calls (seconds per call), after `warmup` calls: what a lower bound
    wants — the machine's best, not its typical load. CPU only (no synchronisation)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return min(samples)


def autocast(device: torch.device | str, enabled: bool):
    """bf16 autocast on the device the model runs on."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=enabled)


def describe_device(device: torch.device | str, threads: int) -> str:
    """One line naming where the numbers were taken (GPU name, or CPU threads)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"CPU, {threads} threads, torch {torch.__version__}"
