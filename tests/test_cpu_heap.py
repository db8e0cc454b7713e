"""training_scripts/cpu_heap: with glibc told to keep freed memory, the steps of a training loop after the first
reuse the heap's pages instead of faulting fresh ones in; with glibc's defaults every step maps and zero-fills its
large tensors again. Each case runs in its own interpreter, since the setting is process-wide and cannot be undone."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent(
    """
    import resource, sys
    import torch
    from flexformers.training_scripts.cpu_heap import retain_freed_memory
    applied = retain_freed_memory() if sys.argv[1] == "retain" else False
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = torch.randn(4096, 1024)  # activations of 16-32 MiB
    faults = []
    for _ in range(9):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(applied, sum(faults[1:]))
    """
)


def probe(mode: str) -> tuple[bool, int]:
    """(applied, minor page faults of training steps 2-9) in a fresh interpreter."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True
    )
    applied, faults = result.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_retained_memory_is_reused_instead_of_faulted_in_again():
    applied, retained_faults = probe("retain")
    assert applied
    _, default_faults = probe("default")
    assert default_faults > 20_000  # glibc's default: each step maps its large tensors afresh (4 KiB per fault)
    assert retained_faults * 3 < default_faults


def test_retain_freed_memory_is_a_no_op_off_glibc(monkeypatch):
    from flexformers.training_scripts import cpu_heap

    monkeypatch.setattr(cpu_heap, "_applied", False)
    monkeypatch.setattr(cpu_heap.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert cpu_heap.retain_freed_memory() is False
