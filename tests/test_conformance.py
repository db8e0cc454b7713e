"""Generic checks every model type passes, from one table of tiny configs: what a Transformers user expects of any
model (a sixth model type added to `MODEL_TYPES` gets them for free).

Runs on every supported Transformers release (CI runs this module on the newest release and on the floor)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModel, AutoModelForSeq2SeqLM
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from flexformers import (
    DepthAdaptiveConfig,
    DepthAdaptiveForConditionalGeneration,
    FlexformerConfig,
    FlexformerForConditionalGeneration,
    InDIGOConfig,
    InDIGOForConditionalGeneration,
    IOTConfig,
    IOTForConditionalGeneration,
    MATConfig,
    MATForConditionalGeneration,
)
from flexformers.modeling.transformers_compat import CACHE_NAME, NEW_CACHE_ARGUMENT, output_cache
from tests.conftest import tiny_config_kwargs

#: model type -> (config class, model class, the tiny config's method fields)
MODEL_TYPES = {
    "flexformer": (FlexformerConfig, FlexformerForConditionalGeneration, {}),
    # four decoder orders and the predictor: beams of one batch decode under different orders
    # (and both encoder orders: encoder blocks run per-row orders too)
    "iot": (IOTConfig, IOTForConditionalGeneration, {"decoder_orders": [1, 2, 4, 6], "encoder_orders": [1, 2]}),
    "mat": (MATConfig, MATForConditionalGeneration, {"encoder_attention_branches": 2, "decoder_attention_branches": 2}),
    "indigo": (InDIGOConfig, InDIGOForConditionalGeneration, {}),
    # early exits by confidence: most tokens leave below the top block, so copied states are exercised
    "depth_adaptive": (
        DepthAdaptiveConfig,
        DepthAdaptiveForConditionalGeneration,
        {"exit_strategy": "confidence", "exit_thresholds": [0.02]},
    ),
}
#: the types whose generation is Transformers' `GenerationMixin` loop. InDIGO inserts words with its own loop and
#: state (no Transformers cache); its cached-vs-recomputed equivalence is test_indigo.py's
#: `test_incremental_decoding_equals_full_forward` and `test_greedy_equals_teacher_forced_argmax`.
LEFT_TO_RIGHT_TYPES = [name for name in MODEL_TYPES if name != "indigo"]


def tiny_model(model_type: str, seed: int = 0, **overrides):
    config_class, model_class, method_fields = MODEL_TYPES[model_type]
    torch.manual_seed(seed)
    config = config_class(**tiny_config_kwargs(**{**method_fields, **overrides}))
    return model_class(config).eval()


def source_batch(rows: int = 3, length: int = 7, seed: int = 1) -> torch.Tensor:
    """A padded batch of source ids (ids 5.. are words; 1 is padding, 2 is </s>)."""
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(5, 60, (rows, length), generator=generator)
    source[:, -1] = 2
    source[0, :2] = 1  # one left-padded row
    return source


@pytest.mark.parametrize("model_type", LEFT_TO_RIGHT_TYPES)
@pytest.mark.parametrize("options", [{"num_beams": 1}, {"num_beams": 3}], ids=["greedy", "beam3"])
def test_generation_with_the_cache_equals_generation_without_it(model_type, options):
    """The cache `generate()` builds and passes back under the running release's name (`past_key_values` up to
    5.23, `cache` from 5.24) is read by every step: the tokens equal recomputing the whole prefix each step."""
    model = tiny_model(model_type)
    source = source_batch()
    with torch.no_grad():
        cached = model.generate(source, max_new_tokens=8, min_new_tokens=8, **options)
        recomputed = model.generate(source, max_new_tokens=8, min_new_tokens=8, use_cache=False, **options)
    assert cached.shape[1] > 2
    assert torch.equal(cached, recomputed)


@pytest.mark.parametrize("model_type", LEFT_TO_RIGHT_TYPES)
@pytest.mark.parametrize("name", ["past_key_values", NEW_CACHE_ARGUMENT])
def test_forward_takes_the_cache_under_either_name_and_returns_it_under_the_releases(model_type, name):
    """A step-by-step forward continues from the cache whichever name it is passed under, and the output carries
    it in the field the running Transformers reads."""
    model = tiny_model(model_type)
    source = source_batch()
    target = torch.randint(5, 60, (source.shape[0], 4), generator=torch.Generator().manual_seed(2))
    target[:, 0] = 2
    with torch.no_grad():
        full = model(input_ids=source, decoder_input_ids=target, use_cache=False).logits
        first = model(input_ids=source, decoder_input_ids=target[:, :2], use_cache=True)
        cache = output_cache(first)
        assert cache is not None and CACHE_NAME in first.keys()
        step = model(input_ids=source, decoder_input_ids=target[:, 2:], use_cache=True, **{name: cache})
    torch.testing.assert_close(step.logits, full[:, 2:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        model(input_ids=source, decoder_input_ids=target[:, 2:], past_key_values=cache, **{NEW_CACHE_ARGUMENT: cache})



@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_generation_never_continues_a_hypothesis_with_the_padding_token(model_type):
    """As in fairseq's generator, `<pad>` is never generated, even where the model ranks it first: later steps would
    read it as padding, so the hypothesis would not be the one that was scored."""
    model = tiny_model(model_type)
    pad = model.config.pad_token_id

    def rank_padding_first(module, inputs, logits):
        logits = logits.clone()
        logits[..., pad] = logits.max() + 10.0
        return logits

    projections = model.vocabulary_projections()
    assert projections
    for projection in projections:
        projection.register_forward_hook(rank_padding_first)
    with torch.no_grad():
        for options in ({"num_beams": 1}, {"num_beams": 3}):
            sequences = model.generate(source_batch(), max_new_tokens=5, min_new_tokens=5, **options)
            assert sequences.shape[1] >= 6
            assert not (sequences == pad).any(), (options, sequences)


# --------------------------------------------------------------------------------------------------------------------
# What a Transformers user does with any model (issue 20)
# --------------------------------------------------------------------------------------------------------------------

PAD = 1
#: How the tables of words are shared: nothing (the FlexformerConfig default), the decoder's input table with the
#: output projection, or one table for encoder, decoder and output projection.
SHARINGS = {
    "untied": {},
    "decoder_tied": {"share_decoder_input_output_embed": True},
    "all_shared": {"share_all_embeddings": True},
}


def label_batch(rows: int = 3, length: int = 5, seed: int = 2) -> torch.Tensor:
    """Reading-order targets ending in </s>; the second row is one word shorter (padded with -100, as collators
    pad labels)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(5, 60, (rows, length), generator=generator)
    labels[:, -1] = 2
    labels[1, -2:] = torch.tensor([2, -100])
    return labels


def teacher_forcing_inputs(model, labels: torch.Tensor) -> dict:
    """The decoder inputs of teacher forcing on `labels`: the shifted labels and their padding mask, or for a model
    that decodes by insertion its insertion-order inputs (left-to-right order) and their relative positions."""
    if hasattr(model, "insertion_batch_from_labels"):
        batch = model.insertion_batch_from_labels(labels)
        return {"decoder_input_ids": batch["decoder_input_ids"], "relative_positions": batch["relative_positions"]}
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels)
    return {"decoder_input_ids": decoder_input_ids, "decoder_attention_mask": decoder_input_ids.ne(PAD).long()}


def attention_heads(config, side: str) -> int:
    """Heads of one attention call: heads × branches (MAT runs its branches as extra heads of one call)."""
    return getattr(config, f"{side}_attention_heads") * getattr(config, f"{side}_attention_branches")


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_save_and_reload_round_trip(model_type, tmp_path):
    model = tiny_model(model_type)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base) is type(model.model)
    source, labels = source_batch(), label_batch()
    inputs = {"input_ids": source, **teacher_forcing_inputs(model, labels)}
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)
        assert torch.equal(loaded.generate(source, max_new_tokens=5), model.generate(source, max_new_tokens=5))


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_inputs_embeds_are_the_embedded_input_ids(model_type):
    """`inputs_embeds=model.get_input_embeddings()(ids)` (PEFT prompt tuning, soft prompts) is `input_ids=ids`: the
    model scales passed-in embeddings by √d as its own, and the padding mask numbers the positions. Same for
    `decoder_inputs_embeds`, for the training loss and for `generate(inputs_embeds=...)`."""
    model = tiny_model(model_type)
    source, labels = source_batch(), label_batch()
    mask = source.ne(PAD).long()
    decoder = teacher_forcing_inputs(model, labels)
    decoder_input_ids = decoder.pop("decoder_input_ids")
    embeds = model.get_input_embeddings()(source)
    decoder_embeds = model.get_decoder().embed_tokens(decoder_input_ids)
    with torch.no_grad():
        by_ids = model(input_ids=source, attention_mask=mask, decoder_input_ids=decoder_input_ids, **decoder)
        by_embeds = model(inputs_embeds=embeds, attention_mask=mask, decoder_inputs_embeds=decoder_embeds, **decoder)
        torch.testing.assert_close(by_embeds.logits, by_ids.logits, rtol=1e-6, atol=1e-6)
        options = {"attention_mask": mask, "max_new_tokens": 5, "min_new_tokens": 5}
        assert torch.equal(model.generate(inputs_embeds=embeds, **options), model.generate(source, **options))
    model.train()  # the training paths (IOT's order paths, Depth-Adaptive's aligned exits, InDIGO's insertions)
    torch.manual_seed(3)
    loss_by_ids = model(input_ids=source, attention_mask=mask, labels=labels).loss
    torch.manual_seed(3)
    loss_by_embeds = model(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(loss_by_embeds, loss_by_ids)


def training_gradients(model, inputs: dict) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(4)  # the same random draws (Gumbel noise, drop-branch, sampled exits) in every run
    model(**inputs).loss.backward()
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


def assert_checkpointing_keeps_the_gradients(model, inputs: dict, use_reentrant: bool) -> None:
    reference = training_gradients(model, inputs)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    assert layers and all(layer.gradient_checkpointing for layer in layers)
    checkpointed = training_gradients(model, inputs)
    model.activation_checkpointing_disable()
    assert checkpointed.keys() == reference.keys()
    for name, gradient in reference.items():
        torch.testing.assert_close(checkpointed[name], gradient, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_gives_the_gradients_of_training_without_it(model_type, use_reentrant):
    """Every block is a `GradientCheckpointingLayer` that receives what it differentiates (hidden states, encoder
    states) as positional inputs and its per-call state (IOT's stacked order paths) as arguments, so the
    recomputation in the backward pass — reentrant or not — runs exactly the forward's computation. IOT here trains
    its M·N = 8 order paths stacked in one decoder pass."""
    model = tiny_model(model_type).train()
    assert_checkpointing_keeps_the_gradients(model, {"input_ids": source_batch(), "labels": label_batch()}, use_reentrant)


@pytest.mark.parametrize(
    "model_type, fields",
    [
        ("iot", {"batch_order_paths": False}),
        ("depth_adaptive", {"training_mode": "mixed", "mixed_num_samples": 2}),
        ("depth_adaptive", {"gradient_scaling": 1.0, "halting_mechanism": "token_geometric", "exit_loss_alpha": 0.5}),
        ("indigo", {"searched_orders": True}),
    ],
    ids=["iot_path_by_path", "depth_adaptive_mixed", "depth_adaptive_halting", "indigo_sao"],
)
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_in_the_other_training_modes(model_type, fields, use_reentrant):
    """The methods' other training paths: IOT's order paths one by one, Depth-Adaptive's sampled exits (Eq. 5) and
    gradient scaling with a halting loss, InDIGO's searched orders (SAO: a cached search without gradients inside
    the training forward, which checkpointing must leave alone)."""
    fields = dict(fields)
    searched_orders = fields.pop("searched_orders", False)
    model = tiny_model(model_type, **fields).train()
    labels = label_batch()
    inputs = {"input_ids": source_batch(), "labels": labels}
    if searched_orders:
        model.use_searched_orders, model.sao_beam_size = True, 2
        target_ids, target_lengths = model._targets_from_labels(labels)
        inputs = {"input_ids": source_batch(), "target_ids": target_ids, "target_lengths": target_lengths}
    assert_checkpointing_keeps_the_gradients(model, inputs, use_reentrant)


def assert_attention_rows(weights: torch.Tensor, allow_skipped: bool) -> None:
    """Every query's weights are a distribution (or, where a block did not run for it, all zero)."""
    sums = weights.sum(-1)
    is_distribution = torch.isclose(sums, torch.ones_like(sums), atol=1e-5)
    if allow_skipped:
        is_distribution |= sums.eq(0)
    assert is_distribution.all()


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_forward_returns_attentions_and_hidden_states_with_the_documented_shapes(model_type):
    """`output_attentions` / `output_hidden_states` fill the standard fields: one tensor per block (one more hidden
    state: the embeddings), `[batch, heads × branches, queries, keys]` and `[batch, length, d]`; `return_dict=False`
    gives the tuple. Depth-Adaptive: blocks above a position's exit give its copied state and zero weights."""
    model = tiny_model(model_type)
    config = model.config
    source, labels = source_batch(), label_batch()
    inputs = {"input_ids": source, **teacher_forcing_inputs(model, labels)}
    batch, source_length = source.shape
    target_length = inputs["decoder_input_ids"].shape[1]
    skipped = model_type == "depth_adaptive"
    with torch.no_grad():
        output = model(**inputs, output_attentions=True, output_hidden_states=True)
        plain = model(**inputs)  # (with SDPA: `output_attentions` computes attention the eager way)
        as_tuple = model(**inputs, return_dict=False)
        with_labels = model(**inputs, labels=labels) if model_type != "indigo" else None
        loss_first = model(**inputs, labels=labels, return_dict=False) if model_type != "indigo" else None
    assert len(output.encoder_attentions) == config.encoder_layers
    for weights in output.encoder_attentions:
        assert weights.shape == (batch, attention_heads(config, "encoder"), source_length, source_length)
        assert_attention_rows(weights, allow_skipped=False)
        assert not weights[0, :, :, :2].any()  # the padding of the first row is never attended
    assert len(output.encoder_hidden_states) == config.encoder_layers + 1
    for states in output.encoder_hidden_states:
        assert states.shape == (batch, source_length, config.encoder_embed_dim)
    torch.testing.assert_close(output.encoder_hidden_states[-1], output.encoder_last_hidden_state)
    assert len(output.decoder_attentions) == len(output.cross_attentions) == config.decoder_layers
    heads = attention_heads(config, "decoder")
    for self_weights, cross_weights in zip(output.decoder_attentions, output.cross_attentions):
        assert self_weights.shape == (batch, heads, target_length, target_length)
        assert cross_weights.shape == (batch, heads, target_length, source_length)
        assert_attention_rows(self_weights, skipped)
        assert_attention_rows(cross_weights, skipped)
        assert not self_weights.triu(1).any()  # causal
    assert len(output.decoder_hidden_states) == config.decoder_layers + 1
    for states in output.decoder_hidden_states:
        assert states.shape == (batch, target_length, config.decoder_embed_dim)
    torch.testing.assert_close(output.logits, plain.logits, rtol=0, atol=1e-5)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], plain.logits)
    if loss_first is not None:
        assert isinstance(loss_first, tuple) and torch.equal(loss_first[0], with_labels.loss)
        assert torch.equal(loss_first[1], with_labels.logits)


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
@pytest.mark.parametrize("num_beams", [1, 2], ids=["greedy", "beam2"])
def test_generate_returns_attentions_and_hidden_states_of_every_step(model_type, num_beams):
    """`generate(..., return_dict_in_generate=True, output_attentions=True, output_hidden_states=True)`: the
    encoder's per block, and per generated token a tuple per block of `[rows, heads, new positions, keys]` weights
    and `[rows, new positions, d]` states (rows = sentences × beams), the keys growing by one position per step."""
    model = tiny_model(model_type)
    config = model.config
    source = source_batch()
    batch, source_length = source.shape
    with torch.no_grad():
        output = model.generate(
            source, max_new_tokens=4, min_new_tokens=4, num_beams=num_beams, return_dict_in_generate=True,
            output_attentions=True, output_hidden_states=True,
        )
    assert len(output.encoder_attentions) == config.encoder_layers
    for weights in output.encoder_attentions:
        assert weights.shape == (batch, attention_heads(config, "encoder"), source_length, source_length)
    assert len(output.encoder_hidden_states) == config.encoder_layers + 1
    steps = len(output.decoder_attentions)
    assert steps >= 4 and len(output.cross_attentions) == len(output.decoder_hidden_states) == steps
    rows = batch * num_beams
    heads = attention_heads(config, "decoder")
    first_keys = output.decoder_attentions[0][0].shape[-1]
    for step in range(steps):
        self_weights, cross_weights = output.decoder_attentions[step], output.cross_attentions[step]
        hidden_states = output.decoder_hidden_states[step]
        assert len(self_weights) == len(cross_weights) == config.decoder_layers
        assert len(hidden_states) == config.decoder_layers + 1
        queries = hidden_states[0].shape[1]
        assert queries == (first_keys if step == 0 else 1)
        for weights in self_weights:
            assert weights.shape == (rows, heads, queries, first_keys + step)
            assert_attention_rows(weights, model_type == "depth_adaptive")
        for weights in cross_weights:
            assert weights.shape == (rows, heads, queries, source_length)
        for states in hidden_states:
            assert states.shape == (rows, queries, config.decoder_embed_dim)


def vocabulary_sizes(model) -> dict[str, int]:
    return {
        "encoder table": model.get_encoder().embed_tokens.num_embeddings,
        "encoder rows": model.get_encoder().embed_tokens.weight.shape[0],
        "decoder table": model.get_decoder().embed_tokens.num_embeddings,
        "decoder rows": model.get_decoder().embed_tokens.weight.shape[0],
        **{
            f"projection {name}": module.weight.shape[0]
            for name, module in model.named_modules()
            if any(module is projection for projection in model.vocabulary_projections())
        },
    }


def tied_pointers(model) -> set[tuple[str, str]]:
    every = dict(model.named_parameters(remove_duplicate=False))
    return {(a, b) for a in every for b in every if a < b and every[a] is every[b]}


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
@pytest.mark.parametrize("sharing", list(SHARINGS))
def test_resized_vocabulary_reaches_every_table_and_projection_and_reloads(model_type, sharing, tmp_path):
    """`resize_token_embeddings(n)` resizes the encoder table, the decoder table, every output projection
    (Depth-Adaptive's per-exit classifiers included) and `config.vocab_size`; the new ids work in the encoder and
    the decoder; the tying is kept; the model saves and reloads."""
    model = tiny_model(model_type, **SHARINGS[sharing])
    tied_before = tied_pointers(model)
    new_size = model.config.vocab_size + 7
    model.resize_token_embeddings(new_size, mean_resizing=False)
    assert model.config.vocab_size == model.config.decoder_vocab_size == new_size
    assert set(vocabulary_sizes(model).values()) == {new_size}, vocabulary_sizes(model)
    assert tied_pointers(model) == tied_before
    source, labels = source_batch(), label_batch()
    source[2, 1] = new_size - 1
    labels[0, 1] = new_size - 2
    inputs = {"input_ids": source, **teacher_forcing_inputs(model, labels)}
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[-1] == new_size
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert tied_pointers(loaded) == tied_before
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, logits, rtol=0, atol=0)


@pytest.mark.parametrize("model_type", ["flexformer", "depth_adaptive"])
def test_separate_target_vocabulary_resizes_on_its_own(model_type, tmp_path):
    """With a separate target vocabulary (`target_vocab_size`), `resize_token_embeddings` resizes the source side
    and `resize_decoder_token_embeddings` (Marian's name) the target side: decoder table and output projections."""
    model = tiny_model(model_type, target_vocab_size=50)
    model.resize_token_embeddings(64, mean_resizing=False)
    assert model.config.vocab_size == 64 and model.config.decoder_vocab_size == 50
    assert model.get_encoder().embed_tokens.weight.shape[0] == 64
    assert {size for name, size in vocabulary_sizes(model).items() if not name.startswith("encoder")} == {50}
    model.resize_decoder_token_embeddings(57, mean_resizing=False)
    assert model.config.vocab_size == 64 and model.config.target_vocab_size == 57
    assert {size for name, size in vocabulary_sizes(model).items() if not name.startswith("encoder")} == {57}
    source, labels = source_batch(), label_batch()
    labels = torch.where(labels > 4, 5 + labels % 40, labels)  # words of the 50-word target vocabulary
    source[0, 3], labels[0, 0] = 63, 56
    inputs = {"input_ids": source, **teacher_forcing_inputs(model, labels)}
    with torch.no_grad():
        logits = model(**inputs).logits
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForSeq2SeqLM.from_pretrained(tmp_path)(**inputs).logits, logits)


def clear_source_check_cache(model_class: type) -> None:
    for cls in model_class.__mro__:
        if "_can_set_attn_implementation_cached_value" in vars(cls):
            delattr(cls, "_can_set_attn_implementation_cached_value")


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_transformers_source_check_accepts_every_model_class_whichever_is_checked_first(model_type):
    """`set_attn_implementation` first reads the module source of the model class (an attention module must go
    through `ALL_ATTENTION_FUNCTIONS.get_interface`) and caches the answer on the class, where subclasses inherit
    it: each model module must pass on its own, not because its parent class was checked first."""
    config_class, model_class, _ = MODEL_TYPES[model_type]
    base_class = type(tiny_model(model_type).model)
    for checked in (model_class, base_class):
        for cls in (model_class, base_class, FlexformerForConditionalGeneration):
            clear_source_check_cache(cls)
        assert checked._can_set_attn_implementation(), checked


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_attention_implementation_switch_after_loading_takes_effect(model_type, tmp_path, monkeypatch):
    """Load with SDPA, switch to eager and back: every attention reads `config._attn_implementation` at call time, so
    SDPA is called exactly while it is selected (counted through Transformers' attention interface), eager returns
    the weights, and the two agree to 1e-5."""
    tiny_model(model_type).save_pretrained(tmp_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    sdpa_calls = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def counted_sdpa(*args, **kwargs):
        sdpa_calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", counted_sdpa)
    inputs = {"input_ids": source_batch(), **teacher_forcing_inputs(model, label_batch())}
    with torch.no_grad():
        assert model.config._attn_implementation == "sdpa"
        by_sdpa = model(**inputs).logits
        assert sdpa_calls
        model.set_attn_implementation("eager")
        assert model.config._attn_implementation == "eager"
        sdpa_calls.clear()
        by_eager = model(**inputs, output_attentions=True)
        assert not sdpa_calls
        assert len(by_eager.decoder_attentions) == model.config.decoder_layers
        torch.testing.assert_close(by_eager.logits, by_sdpa, rtol=0, atol=1e-5)
        model.set_attn_implementation("sdpa")
        model(**inputs)
        assert sdpa_calls


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
@pytest.mark.parametrize("sharing", list(SHARINGS))
def test_num_parameters_counts_each_shared_tensor_once(model_type, sharing):
    model = tiny_model(model_type, **SHARINGS[sharing])
    unique = {id(param): param for param in model.parameters()}
    total = sum(param.numel() for param in unique.values())
    assert model.num_parameters() == model.num_parameters(only_trainable=True) == total
    embeddings = {
        id(module.weight): module.weight.numel() for module in model.modules() if isinstance(module, nn.Embedding)
    }
    assert model.num_parameters(exclude_embeddings=True) == total - sum(embeddings.values())


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
@pytest.mark.parametrize("sharing", list(SHARINGS))
def test_tied_weights_declaration_matches_named_parameters(model_type, sharing):
    """The tying Transformers reads (`all_tied_weights_keys`, {target: source}) names as source the name
    `named_parameters()` reports for a shared tensor and as targets exactly its other names, for the seq2seq model
    and the base model alike."""
    model = tiny_model(model_type, **SHARINGS[sharing])
    for owner in (model, model.model):
        reported = dict(owner.named_parameters())
        every = dict(owner.named_parameters(remove_duplicate=False))
        declared = owner.all_tied_weights_keys
        assert set(declared) == set(every) - set(reported)
        for target, source in declared.items():
            assert source in reported and every[target] is reported[source], (target, source)


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_checkpoint_naming_the_shared_table_after_the_decoder_still_loads(model_type, tmp_path):
    """Checkpoints saved while the tie's source was the decoder's table hold the shared table under
    `model.decoder.embed_tokens.weight` only; Transformers ties either way round, so they load as they were."""
    from safetensors.torch import load_file, save_file

    model = tiny_model(model_type, share_all_embeddings=True)
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    state["model.decoder.embed_tokens.weight"] = state.pop("model.encoder.embed_tokens.weight")
    save_file(state, path, metadata={"format": "pt"})
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert tied_pointers(loaded) == tied_pointers(model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
