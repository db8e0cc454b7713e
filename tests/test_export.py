"""`torch.export` of the full forward (issue 61, item 7): every model type exports in eval mode, as BART does — the
Transformers way (`torch.export.export(model, args=(), kwargs=..., strict=False)`, `use_cache=False`: a cache in the
output is not an exportable type, for BART either), with dynamic batch and sequence dimensions — and the exported
program computes what the eager model does on batches other than the one it was traced with.

IOT chooses a sub-layer order per sentence and Depth-Adaptive an exit per token; eager inference groups rows by their
choice on the host, which an exported graph cannot hold, so under export they compute with row masks instead. The
batches here are checked to mix orders (exits) — on the model's own reported choices — so the masked paths are the
ones compared."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.export import Dim
from transformers import BartConfig, BartForConditionalGeneration

from flexformers.modeling.modeling_indigo import build_insertion_batch
from tests.test_conformance import MODEL_TYPES, source_batch, tiny_model

PAD = 1
#: (rows, source length, target length, seed): the batch the model is traced with, then a second batch of another
#: size (the exported program's batch and sequence dimensions are dynamic).
TRACED_BATCH = (5, 6, 6, 3)
OTHER_BATCH = (6, 8, 4, 4)
#: Depth-Adaptive with three exits and confidence thresholds that the tiny model's first two classifiers pass for
#: some tokens and not others: the batches exit at all three depths.
DEPTH_ADAPTIVE_MIXED_EXITS = {"decoder_layers": 3, "exit_thresholds": [0.11, 0.125]}


def tiny_bart() -> BartForConditionalGeneration:
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=PAD,
    )
    return BartForConditionalGeneration(config).eval()


def model_for(model_type: str):
    if model_type == "bart":
        return tiny_bart()
    if model_type == "depth_adaptive":
        return tiny_model(model_type, **DEPTH_ADAPTIVE_MIXED_EXITS)
    return tiny_model(model_type)


def forward_inputs(model_type: str, rows: int, source_length: int, target_length: int, seed: int) -> dict:
    """What `forward` takes at inference: source ids and mask, decoder inputs (InDIGO's: an insertion batch of random
    generation orders, with the relative positions its decoder reads)."""
    source = source_batch(rows, source_length, seed)
    generator = torch.Generator().manual_seed(seed)
    inputs = {"input_ids": source, "attention_mask": source.ne(PAD).long()}
    if model_type == "indigo":
        words = target_length - 2  # <s> and </s> come with the insertion batch
        targets = torch.randint(5, 60, (rows, words), generator=generator)
        orders = torch.stack([torch.randperm(words, generator=generator) for _ in range(rows)])
        batch = build_insertion_batch(targets, torch.full((rows,), words), orders)
        decoder_inputs = ("decoder_input_ids", "decoder_attention_mask", "relative_positions")
        inputs.update({key: batch[key] for key in decoder_inputs})
    else:
        target = torch.randint(5, 60, (rows, target_length), generator=generator)
        target[:, 0] = 2
        inputs["decoder_input_ids"] = target
    return {**inputs, "use_cache": False}


def dynamic_shapes(inputs: dict) -> dict:
    """Batch and sequence dimensions of every tensor input dynamic (`Dim.AUTO`: the ranges the model allows)."""
    return {
        name: {dim: Dim.AUTO for dim in range(value.dim())} if isinstance(value, torch.Tensor) else None
        for name, value in inputs.items()
    }


def export(model, inputs: dict):
    return torch.export.export(model, args=(), kwargs=inputs, dynamic_shapes=dynamic_shapes(inputs), strict=False)


@functools.cache
def eager_and_exported(model_type: str):
    """The model, its exported program, and for each test batch: (inputs, eager output, exported output)."""
    model = model_for(model_type)
    traced = forward_inputs(model_type, *TRACED_BATCH)
    with torch.no_grad():
        program = export(model, traced).module()
        runs = []
        for batch in (TRACED_BATCH, OTHER_BATCH):
            inputs = forward_inputs(model_type, *batch)
            runs.append((inputs, model(**inputs), program(**inputs)))
    return model, runs


@pytest.mark.parametrize("model_type", ["bart", *MODEL_TYPES])
def test_the_exported_forward_computes_the_eager_logits_for_any_batch_shape(model_type):
    _, runs = eager_and_exported(model_type)
    shapes = {tuple(inputs["decoder_input_ids"].shape) for inputs, _, _ in runs}
    assert len(shapes) == 2  # a second batch and length: the dimensions are dynamic
    for inputs, eager, exported in runs:
        assert exported.logits.shape == eager.logits.shape
        torch.testing.assert_close(exported.logits, eager.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(exported.encoder_last_hidden_state, eager.encoder_last_hidden_state)


def test_exported_iot_chooses_each_sentences_orders_as_eager_iot_does():
    """Sentences of one batch choose different encoder and decoder orders (Eq. 4); the exported program reports the
    same choice per sentence and the logits of that sentence's order."""
    model, runs = eager_and_exported("iot")
    decoder_orders_mixed = encoder_orders_mixed = 0
    for _, eager, exported in runs:
        decoder_orders_mixed += eager.decoder_order_index.unique().numel() > 1
        encoder_orders_mixed += eager.encoder_order_index.unique().numel() > 1
        assert torch.equal(exported.decoder_order_index, eager.decoder_order_index)
        assert torch.equal(exported.encoder_order_index, eager.encoder_order_index)
        torch.testing.assert_close(exported.logits, eager.logits, rtol=1e-5, atol=1e-5)
    assert decoder_orders_mixed == len(runs)  # every batch mixes decoder orders
    assert encoder_orders_mixed >= 1
    # ...and the per-sentence path matters: a forced single order gives other logits for some sentence
    inputs, eager, _ = runs[0]
    with torch.no_grad():
        forced = model(**inputs, encoder_outputs=model.encode_with_orders(
            inputs["input_ids"], inputs["attention_mask"], decoder_order=model.config.decoder_orders[0]))
    assert not torch.allclose(forced.logits, eager.logits, atol=1e-3)


def test_exported_depth_adaptive_exits_each_token_where_eager_depth_adaptive_does():
    """Tokens of one batch exit at every depth (confidence thresholds); the exported program reports the same exit
    per token and the logits of that exit's classifier."""
    model, runs = eager_and_exported("depth_adaptive")
    for _, eager, exported in runs:
        assert eager.exits.unique().tolist() == [1, 2, 3]
        assert torch.equal(exported.exits, eager.exits)
        torch.testing.assert_close(exported.logits, eager.logits, rtol=1e-5, atol=1e-5)


def test_exporting_iot_with_the_cache_is_refused_with_a_clear_error():
    """Under export, rows of different orders run some sub-layers on every row (masked), which would write the
    self-attention cache twice: the export asks for `use_cache=False`, as BART's does (its cache is not an exportable
    output type)."""
    model = model_for("iot")
    inputs = {**forward_inputs("iot", *TRACED_BATCH), "use_cache": True}
    with pytest.raises(ValueError, match="use_cache=False"):
        torch.export.export(model, args=(), kwargs=inputs, strict=False)


@pytest.mark.parametrize("halting_mechanism", ["sequence", "token_multinomial", "token_geometric"])
def test_exported_depth_adaptive_takes_the_exits_its_halting_mechanism_chooses(halting_mechanism):
    """`exit_strategy="halting"` (Sec. 3): the sequence-specific depth (Eq. 8) and the token-specific ones (Eq. 11,
    Eq. 12–13) choose mixed exits; the exported program takes the same ones."""
    # the geometric halting mechanism (zero bias at initialisation) reads thresholds: τ = 0.5 mixes its exits
    model = tiny_model(
        "depth_adaptive", decoder_layers=3, exit_thresholds=[0.5, 0.5], halting_mechanism=halting_mechanism
    )
    inputs = {**forward_inputs("depth_adaptive", *TRACED_BATCH), "exit_strategy": "halting"}
    with torch.no_grad():
        program = torch.export.export(model, args=(), kwargs=inputs, strict=False).module()
        eager, exported = model(**inputs), program(**inputs)
    assert eager.exits.unique().numel() > 1
    assert torch.equal(exported.exits, eager.exits)
    torch.testing.assert_close(exported.logits, eager.logits, rtol=1e-5, atol=1e-5)
