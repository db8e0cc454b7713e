"""The benchmark tooling itself: the device and static-cache checks run end to end (here on the CPU, so every check
must pass exactly), and the shared timing helper times each function once per round in both schedules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from timing import interleaved  # noqa: E402
from zoo_gpu_budget import budget_for, training_rate  # noqa: E402


@pytest.mark.parametrize("blocked", [False, True])
def test_interleaved_calls_every_function_warmup_plus_repeats_times(blocked):
    calls = []
    functions = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    times = interleaved(functions, repeats=3, warmup=1, blocked=blocked)
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    # warm-up, then: one call of each per round (interleaved), or all of one function before the next (blocked)
    assert calls == (["a"] * 4 + ["b"] * 4 if blocked else ["a", "b"] * 4)


def test_interleaved_takes_a_self_timed_function_at_its_word():
    assert interleaved({"peer": lambda: 0.25}, repeats=3) == {"peer": 0.25}


@pytest.mark.slow
def test_check_device_passes_on_the_cpu():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "check_device.py"), "--device", "cpu"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "0 failed" in result.stdout and result.stdout.count("ok  ") == 24


@pytest.mark.slow
def test_check_static_cache_passes_on_the_cpu():
    """Paper-size greedy and beam-5 with a static cache, the decoding step captured in one graph, equal the default
    cache's tokens (the script the GPU rows of the compiled step come from)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "check_static_cache.py"), "--device", "cpu", "--batch", "4"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("static tokens identical") == 2


@pytest.mark.parametrize("word_query_projection", [True, False])
def test_sao_floor_prices_exactly_the_searchs_weight_products(word_query_projection, monkeypatch):
    """`sao_floor.py`'s kernel floor runs the same weight-product arithmetic as the real SAO search (FLOPs of every
    `mm`/`addmm`: its products plus the source keys/values it leaves out), no more and no less, so the floor it
    prints is the search's own arithmetic at the best product speed."""
    from torch.utils.flop_counter import FlopCounterMode

    from flexformers.modeling import cpu_kernels

    # the FLOP counter sees `mm`/`addmm` only, not the packed oneDNN product: plain products on both sides
    monkeypatch.setattr(cpu_kernels, "PREPACK_INFERENCE_WEIGHTS", False)

    from tests.conftest import tiny_config_kwargs
    from flexformers.configuration.configuration_indigo import InDIGOConfig
    from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration
    from sao_floor import SearchKernels

    batch, length, beams = 3, 5, 4
    torch.manual_seed(0)
    config = InDIGOConfig(**tiny_config_kwargs(dropout=0.1, word_query_projection=word_query_projection))
    model = InDIGOForConditionalGeneration(config).train()
    source = torch.randint(5, config.vocab_size, (batch, length))
    target_ids = torch.randint(5, config.vocab_size, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    encoder_states = model.model.encoder(source, attention_mask=mask).last_hidden_state.detach()

    def weight_product_flops(run) -> int:
        with FlopCounterMode(display=False) as counter:
            run()
        counts = counter.get_flop_counts()["Global"]
        return sum(counts.get(op, 0) for op in (torch.ops.aten.mm, torch.ops.aten.addmm))

    search = weight_product_flops(
        lambda: model.search_adaptive_orders(encoder_states, mask, target_ids, torch.full((batch,), length), beams)
    )
    kernels = SearchKernels(model, batch, length, beams)
    floor = weight_product_flops(lambda: (kernels.products(), kernels.source_key_values()))
    assert floor == search > 0


def test_the_gpu_zoo_budget_comes_from_the_slowest_training_bar_of_the_probe():
    log = ("Map: 100%|##| 42795/42795 [00:01<00:00, 3e4 examples/s]\n"
           " 10%|#  | 300/750 [00:40<01:00,  7.0it/s]\r100%|##| 10/10 [00:02<00:00,  4.1it/s]\r"
           " 13%|#  | 480/750 [01:00<00:33,  8.0it/s]")
    assert training_rate(log, probe_budget=750) == 8.0  # the last training bar; corpus and evaluation bars ignored
    assert training_rate("100%| 2/2 [01:02:00<00:00]\n 1/2 [1:00:00<00:10]", probe_budget=2) == 1 / 3600
    with pytest.raises(ValueError, match="no training progress"):
        training_rate("Map: 100%|##| 42795/42795 [00:01<00:00]", probe_budget=750)
    assert budget_for({"fast": 8.0, "slow": 3.35}, train_seconds=303, eval_every=250) == 750
    assert budget_for({"slow": 0.1}, train_seconds=100, eval_every=250) == 250  # at least one curve interval
