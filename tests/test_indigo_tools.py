"""InDIGO training integration (method module, bootstrap callback, CF/RF cutoff), the trace renderer, subword
grouping for SYN, and an end-to-end check that a tiny model learns with the L2R order and with SAO."""

from __future__ import annotations

import random

import pytest
import torch

from flexformers.configuration.configuration_indigo import InDIGOConfig
from flexformers.modeling.indigo_insertion import relative_positions_from_absolute
from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration
from flexformers.training_scripts.indigo_orders import InDIGODataCollator, group_subword_tokens
from flexformers.training_scripts.indigo_trace import partial_sequences, render_png, render_text
from flexformers.training_scripts.methods.indigo import (
    SPEC,
    InDIGOArguments,
    SAOBootstrapCallback,
    build_indigo_model,
    make_indigo_callbacks,
    make_indigo_collator,
    update_indigo_config,
)
from flexformers.training_scripts.model_registry import get_method_spec
from tests.conftest import tiny_config_kwargs


def tiny_config(**overrides) -> InDIGOConfig:
    small = dict(vocab_size=24, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, max_target_positions=32)
    return InDIGOConfig(**tiny_config_kwargs(**{**small, **overrides}))


def test_method_spec_and_arguments():
    assert get_method_spec("indigo") is SPEC
    with pytest.raises(ValueError, match="--order"):
        InDIGOArguments(order="zigzag")
    with pytest.raises(ValueError, match="sao_train_orders"):
        InDIGOArguments(order="sao", sao_beam_size=4, sao_train_orders=5)
    config = update_indigo_config(tiny_config(), InDIGOArguments(indigo_encoder_positions=False))
    assert config.encoder_use_positions is False
    args = InDIGOArguments(order="sao", sao_beam_size=3, sao_bootstrap_steps=5, sao_train_orders=2, sao_cuda_graphs=True)
    model = build_indigo_model(None, args, tiny_config(), None)
    assert (model.sao_beam_size, model.sao_train_orders, model.use_searched_orders) == (3, 2, False)
    assert model.sao_search_cuda_graphs is True
    callbacks = make_indigo_callbacks(args)
    assert len(callbacks) == 1 and isinstance(callbacks[0], SAOBootstrapCallback)

    class State:
        global_step = 4

    callbacks[0].on_step_begin(None, State, None, model=model)
    assert model.use_searched_orders is False
    State.global_step = 5
    callbacks[0].on_step_begin(None, State, None, model=model)
    assert model.use_searched_orders is True
    assert make_indigo_callbacks(InDIGOArguments(order="l2r")) == []
    collator = make_indigo_collator(None, model, args)
    assert isinstance(collator, InDIGODataCollator) and collator.order == "sao"


def test_trainer_fills_the_frequency_cutoff(tmp_path):
    import datasets
    from transformers import Seq2SeqTrainingArguments

    from flexformers.training_scripts.methods.indigo import InDIGOSeq2SeqTrainer

    model = InDIGOForConditionalGeneration(tiny_config())
    collator = make_indigo_collator(None, model, InDIGOArguments(order="cf"))
    rows = [{"input_ids": [5, 6, 2], "labels": [5, 5, 5, 6, 7, 2]}, {"input_ids": [5, 2], "labels": [5, 8, 2]}]
    trainer = InDIGOSeq2SeqTrainer(
        model=model, args=Seq2SeqTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True),
        train_dataset=datasets.Dataset.from_list(rows), data_collator=collator,
    )
    assert collator.common_token_ids == {5}
    assert trainer.data_collator.order_for([6, 5, 7, 5]) == [1, 3, 0, 2]


def test_subword_grouping():
    assert group_subword_tokens(["the", "Ġcat", "Ġsat", "ting"]) == [[0], [1], [2, 3]]
    assert group_subword_tokens(["un@@", "do", "it"]) == [[0, 1], [2]]
    assert group_subword_tokens(["▁a", "b", "▁c"]) == [[0, 1], [2]]


def test_trace_rendering(tmp_path):
    # <s>, </s>, then "b" (z=2), "a" left of it (z=1), "c" right of "b" (z=3)
    ids = [0, 2, 11, 10, 12]
    relations = relative_positions_from_absolute(torch.tensor([0, 4, 2, 1, 3]))
    steps = partial_sequences(ids, relations)
    assert steps == [([0, 2, 1], 1), ([0, 3, 2, 1], 1), ([0, 3, 2, 4, 1], 3)]
    names = {10: "a", 11: "b", 12: "c"}
    assert render_text(ids, relations, names.get).splitlines() == ["  1 | [b]", "  2 | [a] b", "  3 | a b [c]"]
    picture = render_png(ids, relations, names.get, tmp_path / "trace.png", title="example")
    assert picture.stat().st_size > 1000


def _toy_batches(seed: int, steps: int, batch: int = 32):
    """Reverse the source: a task where the best order is not obvious from the source alone."""
    rng = random.Random(seed)
    for _ in range(steps):
        features = []
        for _ in range(batch):
            words = [rng.randrange(5, 24) for _ in range(rng.randrange(2, 6))]
            features.append({"input_ids": words + [2], "labels": words[::-1] + [2]})
        yield features


def _train(model, collator, steps, seed=0, lr=3e-3):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for features in _toy_batches(seed, steps):
        loss = model(**collator(features)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def _accuracy(model, seed=99, count=64):
    features = next(_toy_batches(seed, 1, count))
    batch = InDIGODataCollator(order="l2r")(features)
    result = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=8,
                            return_insertion_trace=True)
    correct = 0
    for row, feature in enumerate(features):
        output = [t for t in result.sequences[row].tolist() if t not in (0, 1, 2)]
        correct += output == feature["labels"][:-1]
    return correct / count, result


@pytest.fixture
def single_thread():
    """Tiny models train ~50x faster on one thread than on two oversubscribed ones (shared CI machines)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_tiny_model_learns_with_l2r_then_sao(single_thread):
    torch.manual_seed(0)
    model = _train(InDIGOForConditionalGeneration(tiny_config()), InDIGODataCollator(order="l2r"), 600)
    accuracy, result = _accuracy(model)
    assert accuracy > 0.8, accuracy
    # an L2R-trained model inserts every word right of the previous one
    l2r_steps = [anchor == (step + 1 if step else 0) and side == "right"
                 for trace in result.insertion_trace for step, (_, anchor, side, _) in enumerate(trace)]
    assert sum(l2r_steps) / len(l2r_steps) > 0.95
    # SAO bootstrapped from it keeps the accuracy. (Eq. 12's uniform weights over a beam whose other orders are
    # ~e^-40 less likely pull a converged L2R model away from its best order; train on the posterior-weighted beam.)
    model.use_searched_orders, model.sao_beam_size, model.sao_order_weighting = True, 4, "posterior"
    model = _train(model, InDIGODataCollator(order="sao"), 40, seed=1, lr=1e-3)
    sao_accuracy, _ = _accuracy(model)
    assert sao_accuracy > 0.8, sao_accuracy
