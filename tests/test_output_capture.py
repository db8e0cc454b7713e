"""Issue 61 item 8: the cache's old argument name and the collection of attentions / hidden states behave as they do
for Transformers' own encoder-decoder (BART) on the running release, for every model type.

- From Transformers 5.24 on, `past_key_values=` is deprecated: BART's `forward`s warn with `deprecate_kwarg` (a
  `FutureWarning`), ours the same way; on 5.23 it is the release's own name and neither warns. `cache=` never warns.
- `output_attentions` / `output_hidden_states` are collected by Transformers' `capture_outputs` hooks declared in
  `_can_record_outputs` (as BART's encoder and decoder do); Depth-Adaptive's early-exit decoder keeps its own
  collection (copied states above an exit are no block's output).

Runs on every supported Transformers release (the expectations are read off BART on the running one)."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

from flexformers.modeling.transformers_compat import NEW_CACHE_ARGUMENT, output_cache
from tests.test_conformance import (
    LEFT_TO_RIGHT_TYPES,
    MODEL_TYPES,
    PAD,
    label_batch,
    source_batch,
    teacher_forcing_inputs,
    tiny_model,
)


def tiny_bart() -> BartForConditionalGeneration:
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
        pad_token_id=PAD,
    )
    return BartForConditionalGeneration(config).eval()


def decoder_inputs(model, rows: int = 3) -> dict:
    if isinstance(model, BartForConditionalGeneration):
        labels = label_batch(rows)
        return {"decoder_input_ids": torch.cat([torch.full((rows, 1), 2), labels[:, :-1].clamp(min=5)], dim=1)}
    return teacher_forcing_inputs(model, label_batch(rows))


def cache_warnings(call) -> tuple[list[tuple[type, str]], object]:
    """The warnings `call()` emits that mention the cache's argument names (category, message), and its result."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    found = [
        (w.category, str(w.message)) for w in caught
        if "past_key_values" in str(w.message) or f"`{NEW_CACHE_ARGUMENT}`" in str(w.message)
    ]
    return found, result


def the_forwards(model) -> dict[str, torch.nn.Module]:
    """The public forwards that take the cache: the model with its head, the base model, the decoder."""
    return {"head": model, "base": model.model, "decoder": model.get_decoder()}


def call_with_cache_name(part: str, module, model, name: str, cache):
    source = source_batch()
    inputs = decoder_inputs(model)
    if part == "decoder":
        encoder_states = model.get_encoder()(input_ids=source).last_hidden_state
        method_inputs = {k: v for k, v in inputs.items() if k == "relative_positions"}  # InDIGO's decoder
        return module(
            input_ids=inputs["decoder_input_ids"], encoder_hidden_states=encoder_states,
            encoder_attention_mask=source.ne(PAD).long(), **method_inputs, **{name: cache},
        )
    extra = {k: v for k, v in inputs.items() if k != "decoder_attention_mask"}
    return module(input_ids=source, **extra, **{name: cache})


@pytest.mark.parametrize("part", ["head", "base", "decoder"])
@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_old_cache_name_warns_exactly_as_barts_does_on_the_running_release(model_type, part):
    """`past_key_values=` gives BART's warning (same category, same text but the class) — a `FutureWarning` from
    Transformers' `deprecate_kwarg` on 5.24+, nothing on 5.23 — and `cache=` warns on no release."""
    bart = tiny_bart()
    bart_module = the_forwards(bart)[part]
    with torch.no_grad():
        expected, _ = cache_warnings(lambda: call_with_cache_name(part, bart_module, bart, "past_key_values", None))
        bart_new, _ = cache_warnings(lambda: call_with_cache_name(part, bart_module, bart, NEW_CACHE_ARGUMENT, None))
    assert bart_new == []
    model = tiny_model(model_type)
    module = the_forwards(model)[part]
    ours = type(module).__name__
    expected = [(category, message.replace(type(bart_module).__name__, ours)) for category, message in expected]
    with torch.no_grad():
        old_warnings, by_old_name = cache_warnings(
            lambda: call_with_cache_name(part, module, model, "past_key_values", None)
        )
        new_warnings, by_new_name = cache_warnings(
            lambda: call_with_cache_name(part, module, model, NEW_CACHE_ARGUMENT, None)
        )
    assert old_warnings == expected
    assert new_warnings == []
    field = "logits" if part == "head" else "last_hidden_state"
    assert torch.equal(getattr(by_old_name, field), getattr(by_new_name, field))


@pytest.mark.parametrize("model_type", LEFT_TO_RIGHT_TYPES)
def test_a_step_continues_the_same_from_the_cache_under_either_name(model_type):
    """A decoding step from a real cache gives the same logits and the same cache contents by either name."""
    model = tiny_model(model_type)
    source = source_batch()
    target = decoder_inputs(model)["decoder_input_ids"][:, :4]
    steps = {}
    with torch.no_grad():
        for name in ("past_key_values", NEW_CACHE_ARGUMENT):
            first = model(input_ids=source, decoder_input_ids=target[:, :2], use_cache=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                step = model(input_ids=source, decoder_input_ids=target[:, 2:], use_cache=True,
                             **{name: output_cache(first)})
            steps[name] = step
    old, new = steps["past_key_values"], steps[NEW_CACHE_ARGUMENT]
    assert torch.equal(old.logits, new.logits)
    assert output_cache(old).get_seq_length() == output_cache(new).get_seq_length() == 4


# --------------------------------------------------------------------------------------------------------------------
# Attentions and hidden states: Transformers' `capture_outputs`
# --------------------------------------------------------------------------------------------------------------------


def record_blocks(model):
    """Forward hooks of our own on every encoder and decoder block: each block's input and output, per call."""
    records = {"encoder": [], "decoder": []}
    handles = []
    for side, stack in (("encoder", model.get_encoder()), ("decoder", model.get_decoder())):
        for layer in stack.layers:
            handles.append(layer.register_forward_hook(
                lambda module, args, output, side=side: records[side].append((args[0], output))
            ))
    return records, handles


def full_depth_inputs(model, model_type: str, inputs: dict) -> dict:
    """Depth-Adaptive: every position exits at the top block, so each block's output is the decoder's state."""
    if model_type != "depth_adaptive":
        return inputs
    target = inputs["decoder_input_ids"]
    return {**inputs, "token_exits": torch.full(target.shape, model.config.decoder_layers, dtype=torch.long)}


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_collected_outputs_are_the_blocks_outputs_a_forward_hook_sees(model_type):
    """Counts and shapes as the config says (a hidden state per block plus the embeddings; a self- and, in the
    decoder, a cross-attention per block), and the values are what the blocks return: the first hidden state is the
    first block's input, then each block's output, the last through the final LayerNorm (the last hidden state)."""
    model = tiny_model(model_type)
    config = model.config
    source = source_batch()
    inputs = full_depth_inputs(model, model_type, {"input_ids": source, **decoder_inputs(model)})
    records, handles = record_blocks(model)
    try:
        with torch.no_grad():
            output = model(**inputs, output_attentions=True, output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    for side, hidden, attentions, last, layers in (
        ("encoder", output.encoder_hidden_states, output.encoder_attentions, output.encoder_last_hidden_state,
         config.encoder_layers),
        ("decoder", output.decoder_hidden_states, output.decoder_attentions, None, config.decoder_layers),
    ):
        calls = records[side]
        assert len(calls) == layers
        assert len(hidden) == layers + 1 and len(attentions) == layers
        assert torch.equal(hidden[0], calls[0][0])
        for block, (_, block_output) in enumerate(calls):
            torch.testing.assert_close(attentions[block], block_output[1], rtol=0, atol=0)
            if block < layers - 1:
                torch.testing.assert_close(hidden[block + 1], block_output[0], rtol=0, atol=0)
        if last is not None:
            assert torch.equal(hidden[-1], last)
        stack = model.get_encoder() if side == "encoder" else model.get_decoder()
        final = calls[-1][1][0] if stack.layer_norm is None else stack.layer_norm(calls[-1][1][0])
        torch.testing.assert_close(hidden[-1], final, rtol=0, atol=1e-6)
    assert len(output.cross_attentions) == config.decoder_layers
    for block, (_, block_output) in enumerate(records["decoder"]):
        torch.testing.assert_close(output.cross_attentions[block], block_output[2], rtol=0, atol=0)


def test_iot_per_row_orders_collect_whole_blocks():
    """IOT with mixed per-sentence orders runs each attention once per row group: the collected weights are the
    whole block's (every row a distribution), not one group's."""
    model = tiny_model("iot")
    source = source_batch(rows=6, seed=3)
    inputs = {"input_ids": source, **decoder_inputs(model, rows=6)}
    with torch.no_grad():
        orders = model.encode_with_orders(source).decoder_order_index
        output = model(**inputs, output_attentions=True)
    assert orders.unique().numel() > 1, "the tiny IOT model should give this batch more than one decoder order"
    for weights in (*output.decoder_attentions, *output.cross_attentions):
        assert weights.shape[0] == source.shape[0]
        torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)), rtol=0, atol=1e-5)


def capture_declarations(model) -> dict[str, set[str]]:
    return {side: set(_CAN_RECORD_REGISTRY.get(stack)) for side, stack in
            (("encoder", model.get_encoder()), ("decoder", model.get_decoder()))}


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_capture_outputs_as_transformers_common_test_checks_it(model_type):
    """What Transformers' common capture-outputs test checks of a model with `_can_record_outputs` (BART here too):
    the encoder and decoder declare what they record (the same keys as BART's); the outputs come with the flags
    passed or set on the config; `output_hidden_states` given as indices keeps those hidden states only (negative
    ones counted from the end, the others None); nothing is hooked before outputs are first asked for; and
    `return_dict=False` gives the output's tuple."""
    bart = tiny_bart()
    model = tiny_model(model_type)
    assert capture_declarations(model) == capture_declarations(bart)
    source = source_batch()
    inputs = full_depth_inputs(model, model_type, {"input_ids": source, **decoder_inputs(model)})
    blocks = [*model.get_encoder().layers, *model.get_decoder().layers]
    with torch.no_grad():
        plain = model(**inputs)
        assert not any(block._forward_hooks for block in blocks)  # nothing requested: no hook installed
        by_flags = model(**inputs, output_attentions=True, output_hidden_states=True)
        model.set_attn_implementation("eager")  # Transformers refuses `config.output_attentions` with SDPA
        model.config.output_attentions = model.config.output_hidden_states = True
        by_config = model(**inputs)
        model.config.output_attentions = model.config.output_hidden_states = False
        as_tuple = model(**inputs, output_attentions=True, output_hidden_states=True, return_dict=False)
    assert plain.encoder_attentions is None and plain.decoder_hidden_states is None
    for field in ("encoder_hidden_states", "encoder_attentions", "decoder_hidden_states", "decoder_attentions",
                  "cross_attentions"):
        assert len(getattr(by_config, field)) == len(getattr(by_flags, field))
        for a, b in zip(getattr(by_config, field), getattr(by_flags, field)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    expected_tuple = by_flags.to_tuple()
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(expected_tuple)
    for got, want in zip(as_tuple, expected_tuple):
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want)
    # The encoder alone, as BART's: `return_dict=False` gives (last state, hidden states, attentions).
    encoder = model.get_encoder()
    with torch.no_grad():
        encoded = encoder(input_ids=source, output_attentions=True, output_hidden_states=True)
        encoded_tuple = encoder(input_ids=source, output_attentions=True, output_hidden_states=True, return_dict=False)
        bart_tuple = bart.get_encoder()(input_ids=source, output_attentions=True, output_hidden_states=True,
                                        return_dict=False)
    assert len(encoded_tuple) == len(bart_tuple) == 3
    assert torch.equal(encoded_tuple[0], encoded.last_hidden_state)
    # Nothing asked for (each decoding step): the last state alone, as BART's.
    with torch.no_grad():
        bare = encoder(input_ids=source, output_attentions=False, output_hidden_states=False, return_dict=False)
        bart_bare = bart.get_encoder()(input_ids=source, output_attentions=False, output_hidden_states=False,
                                       return_dict=False)
    assert len(bare) == len(bart_bare) == 1 and torch.equal(bare[0], encoded.last_hidden_state)
    if model_type == "depth_adaptive":
        return  # its decoder's outputs are its own collection (copied states above an exit), not selectable
    with torch.no_grad():
        selected = model(**inputs, output_hidden_states=[0, -1])
        bart_selected = bart(input_ids=source, **decoder_inputs(bart), output_hidden_states=[0, -1])
    for field in ("encoder_hidden_states", "decoder_hidden_states"):
        kept = getattr(selected, field)
        assert [state is None for state in kept] == [state is None for state in getattr(bart_selected, field)]
        assert torch.equal(kept[0], getattr(by_flags, field)[0])
        assert torch.equal(kept[-1], getattr(by_flags, field)[-1])
        assert all(state is None for state in kept[1:-1])
