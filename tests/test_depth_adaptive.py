"""Depth-Adaptive Transformer model: equivalences of the early-exit decoder, training losses, generation."""

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, GenerationConfig

import flexformers.modeling  # noqa: F401  (registers the model types)
from flexformers.configuration.configuration_depth_adaptive import DepthAdaptiveConfig
from flexformers.configuration.configuration_flexformer import FlexformerConfig
from flexformers.modeling.depth_adaptive_equations import exit_loss_weights, scale_gradient
from flexformers.modeling.losses import label_smoothed_nll_loss
from flexformers.modeling.modeling_depth_adaptive import DepthAdaptiveForConditionalGeneration, DepthAdaptiveModel
from flexformers.modeling.modeling_flexformer import (
    FlexformerForConditionalGeneration,
    padding_mask,
)
from flexformers.modeling.transformers_compat import output_cache

TINY = dict(
    vocab_size=60,
    encoder_embed_dim=32,
    decoder_embed_dim=16,
    encoder_ffn_embed_dim=64,
    decoder_ffn_embed_dim=32,
    encoder_layers=2,
    decoder_layers=3,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    dropout=0.0,
    max_source_positions=64,
    max_target_positions=64,
)
PAD = 1


def make_model(seed=0, **overrides) -> DepthAdaptiveForConditionalGeneration:
    torch.manual_seed(seed)
    return DepthAdaptiveForConditionalGeneration(DepthAdaptiveConfig(**{**TINY, **overrides})).eval()


def make_batch(seed=1):
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(4, 60, (3, 7), generator=generator)
    source[1, 5:] = PAD
    source[2, 3:] = PAD
    target = torch.randint(4, 60, (3, 5), generator=generator)
    return source, target


def backbone_state(model, keep_layers=None, classifier_block=None):
    """The model's weights as a plain Flexformer state dict (optionally truncated after `keep_layers` blocks,
    with C_n as the output projection)."""
    state = {}
    for key, value in model.state_dict().items():
        if key.startswith(("exit_classifiers.", "halting.")):
            continue
        if keep_layers is not None and key.startswith("model.decoder.layers."):
            if int(key.split(".")[3]) >= keep_layers:
                continue
        state[key] = value
    if classifier_block is not None:
        state["lm_head.weight"] = model.exit_classifier(classifier_block).weight
    return state


def decoder_input_for(target):
    return torch.cat([torch.full((target.shape[0], 1), 2), target], dim=1)


def middle_gap(values: torch.Tensor) -> float:
    """A value halfway between the two middle order statistics: about half the values lie above it, and none is
    close enough to it for rounding to flip a decision."""
    ordered = values.flatten().sort().values
    middle = ordered.numel() // 2
    return ((ordered[middle - 1] + ordered[middle]) / 2).item()


@torch.no_grad()
def balance_exits(model, source, target, settings):
    """Make about half of the states exit at each block (halting biases or confidence thresholds at the median),
    so a random tiny model exercises batches that mix exits."""
    aligned = model(input_ids=source, labels=target, return_exit_logits=True)
    if settings.get("exit_strategy") == "confidence":
        confidence = [middle_gap(torch.softmax(logits, -1).amax(-1)) for logits in aligned.exit_logits[:-1]]
        return {**settings, "exit_thresholds": confidence}
    if model.config.halting_mechanism in ("token_geometric", "token_multinomial"):
        decoder = model.model.decoder
        encoder_states = model.get_encoder()(input_ids=source).last_hidden_state
        layer_kwargs = {
            "attention_mask": None,
            "encoder_hidden_states": encoder_states,
            "encoder_attention_mask": padding_mask(source.ne(PAD).long(), encoder_states.dtype),
        }
        states, _, _ = decoder.forward_layerwise(decoder.embed(decoder_input_for(target)), layer_kwargs, keep_states=True)
        if model.config.halting_mechanism == "token_multinomial":
            projection = model.halting.projection
            logits = projection(states[0])
            projection.bias -= logits.reshape(-1, model.num_exits).mean(0)  # centred: the argmax varies by token
            return settings
        for block in range(1, model.num_exits):
            model.halting.bias[block - 1] -= middle_gap(model.halting.halting_logits(block, states[block - 1]))
    return settings


# --------------------------------------------------------------------------------------------- equivalences


@pytest.mark.parametrize("normalize_before", [False, True])
def test_exiting_every_token_at_block_n_is_the_baseline_decoder(normalize_before):
    model = make_model(decoder_normalize_before=normalize_before, encoder_normalize_before=normalize_before)
    baseline = FlexformerForConditionalGeneration(FlexformerConfig(**TINY, decoder_normalize_before=normalize_before,
                                                                   encoder_normalize_before=normalize_before)).eval()
    baseline.load_state_dict(backbone_state(model))
    source, target = make_batch()
    with torch.no_grad():
        ours = model(input_ids=source, labels=target, return_exit_logits=True)
        theirs = baseline(input_ids=source, labels=target)
        torch.testing.assert_close(ours.exit_logits[-1], theirs.logits)
        torch.testing.assert_close(ours.per_exit_losses[-1], theirs.loss)
        for beams in (1, 3):
            mask = source.ne(PAD).long()
            ours_generated = model.generate(source, attention_mask=mask, max_new_tokens=8, num_beams=beams,
                                            exit_strategy="full")
            theirs_generated = baseline.generate(source, attention_mask=mask, max_new_tokens=8, num_beams=beams)
            assert torch.equal(ours_generated, theirs_generated)


@pytest.mark.parametrize("block", [1, 2])
def test_fixed_exit_equals_the_model_truncated_after_block_n_with_classifier_n(block):
    model = make_model()
    truncated = FlexformerForConditionalGeneration(FlexformerConfig(**{**TINY, "decoder_layers": block})).eval()
    truncated.load_state_dict(backbone_state(model, keep_layers=block, classifier_block=block))
    source, target = make_batch()
    with torch.no_grad():
        aligned = model(input_ids=source, labels=target, return_exit_logits=True)
        torch.testing.assert_close(aligned.exit_logits[block - 1], truncated(input_ids=source, labels=target).logits)
        for beams in (1, 4):
            mask = source.ne(PAD).long()
            ours = model.generate(source, attention_mask=mask, max_new_tokens=8, num_beams=beams, exit_strategy="fixed",
                                  fixed_exit=block)
            theirs = truncated.generate(source, attention_mask=mask, max_new_tokens=8, num_beams=beams)
            assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "overrides, settings",
    [
        ({"halting_mechanism": "token_geometric"}, {}),
        ({"halting_mechanism": "token_geometric", "decoder_normalize_before": True}, {}),
        ({}, {"exit_strategy": "confidence"}),
        ({"halting_mechanism": "token_multinomial"}, {}),
        ({"halting_mechanism": "sequence"}, {}),
        ({"exit_classifiers": "shared", "halting_mechanism": "token_geometric"}, {}),
    ],
)
@pytest.mark.parametrize("dense_step_fraction", [0.0, 0.5, 2.0], ids=["dense", "mixed", "sparse"])
def test_incremental_early_exit_equals_recomputation_with_the_same_exits_and_copied_states(
    overrides, settings, dense_step_fraction
):
    model = make_model(seed=3, **overrides)
    model.model.decoder.dense_step_fraction = dense_step_fraction
    source, target = make_batch()
    settings = balance_exits(model, source, target, settings)
    attention_mask = source.ne(PAD).long()
    decoder_input = decoder_input_for(target)
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(input_ids=source, attention_mask=attention_mask)
        cache, step_logits, step_exits = None, [], []
        for t in range(decoder_input.shape[1]):
            step = model(
                encoder_outputs=encoder_outputs, attention_mask=attention_mask,
                decoder_input_ids=decoder_input[:, t : t + 1], past_key_values=cache, use_cache=True, **settings,
            )
            cache = output_cache(step)
            step_logits.append(step.logits)
            step_exits.append(step.exits)
        logits, exits = torch.cat(step_logits, 1), torch.cat(step_exits, 1)
        # the self-attention cache of every layer stayed complete
        assert all(layer.keys.shape[2] == decoder_input.shape[1] for layer in cache.self_attention_cache.layers)
        recomputed = model(
            encoder_outputs=encoder_outputs, attention_mask=attention_mask, decoder_input_ids=decoder_input,
            token_exits=exits, use_cache=False,
        )
        torch.testing.assert_close(recomputed.logits, logits, atol=1e-5, rtol=1e-5)
        decided = model(
            encoder_outputs=encoder_outputs, attention_mask=attention_mask, decoder_input_ids=decoder_input,
            use_cache=False, **settings,
        )
        assert torch.equal(decided.exits, exits)
        torch.testing.assert_close(decided.logits, logits, atol=1e-5, rtol=1e-5)
    # the exits are the ones the exit rule names (not only the same in both passes)
    planned, exits_at_one = exits_by_the_rule(model, source, target, settings, attention_mask)
    if planned is not None:
        assert torch.equal(exits, planned)
    else:
        assert torch.equal(exits == 1, exits_at_one)
    if overrides.get("halting_mechanism") == "sequence":
        assert bool((exits == exits[:, :1]).all())  # one exit per sentence
    else:
        assert exits.unique().numel() > 1, "the test should exercise mixed exits within a batch"


@torch.no_grad()
def exits_by_the_rule(model, source, target, settings, attention_mask):
    """The exit decisions computed by hand from aligned states: `(planned exits, None)` for the sequence-specific
    (argmax of Eq. 8) and token multinomial (argmax of Eq. 11 on h¹) halting, else `(None, exits at block 1)`:
    χ¹_t > τ_1 (geometric-like, Eq. 12) or max_y p(y|h¹_t) > τ_1 (confidence). Block 1 runs for every position, so
    its states do not depend on the exits of earlier positions."""
    encoder_states = model.get_encoder()(input_ids=source, attention_mask=attention_mask).last_hidden_state
    if model.config.halting_mechanism == "sequence" and settings.get("exit_strategy") != "confidence":
        sequence_exits = model.halting(encoder_states, attention_mask).argmax(-1) + 1
        return sequence_exits[:, None].expand(-1, target.shape[1] + 1), None
    decoder = model.model.decoder
    layer_kwargs = {
        "attention_mask": None,
        "encoder_hidden_states": encoder_states,
        "encoder_attention_mask": padding_mask(attention_mask, encoder_states.dtype),
    }
    states, _, _ = decoder.forward_layerwise(decoder.embed(decoder_input_for(target)), layer_kwargs, keep_states=True)
    thresholds = settings.get("exit_thresholds") or model.config.default_exit_thresholds
    if settings.get("exit_strategy") == "confidence":
        confidence = torch.softmax(model.classify(1, states[0]).float(), -1).amax(-1)
        return None, confidence > thresholds[0]
    if model.config.halting_mechanism == "token_multinomial":
        return model.halting(states[0]).argmax(-1) + 1, None
    chi = torch.sigmoid(model.halting.halting_logits(1, states[0]))
    return None, chi > thresholds[0]


def test_copied_key_values_follow_a_fused_optimizer_step():
    """The copied states' K/V use all blocks' projections fused into one matrix, rebuilt when a weight changes — also
    after a fused AdamW step (the Trainer's default), which writes the weights without bumping their versions."""
    model = make_model(seed=5)
    decoder = model.model.decoder
    states = torch.randn(3, 2, TINY["decoder_embed_dim"])

    def per_block_reference():
        return [decoder.layers[i].self_attn.project_key_value(states) for i in (1, 2)]

    with torch.no_grad():
        decoder.copied_key_values(1, states)  # builds the fused matrix
    model.train()
    source, target = make_batch()
    model(input_ids=source, labels=target).loss.backward()
    torch.optim.AdamW(model.parameters(), lr=0.05, fused=True).step()
    model.eval()
    with torch.no_grad():
        for (keys, values), (reference_keys, reference_values) in zip(decoder.copied_key_values(1, states),
                                                                      per_block_reference()):
            torch.testing.assert_close(keys, reference_keys)
            torch.testing.assert_close(values, reference_values)


def test_copied_states_feed_the_upper_blocks_keys_and_values():
    """A token that exits at block 1 leaves, in every block above, that block's K/V projections of h¹."""
    model = make_model(seed=5)
    source, target = make_batch()
    decoder_input = decoder_input_for(target)
    with torch.no_grad():
        output = model(input_ids=source, decoder_input_ids=decoder_input[:, :1], use_cache=True,
                       exit_strategy="fixed", fixed_exit=1)
        decoder = model.model.decoder
        embedded = decoder.embed(decoder_input[:, :1])
        mask = {"attention_mask": None, "encoder_hidden_states": output.encoder_last_hidden_state,
                "encoder_attention_mask": padding_mask(source.ne(PAD).long(), torch.float32)}
        first = decoder.run_layer(0, embedded, **mask)[0]
        for layer_idx in (1, 2):
            keys, values = decoder.layers[layer_idx].self_attn.project_key_value(first)
            cached = output_cache(output).self_attention_cache.layers[layer_idx]
            torch.testing.assert_close(cached.keys, keys)
            torch.testing.assert_close(cached.values, values)


@pytest.mark.parametrize("beams, dense_step_fraction", [(1, 0.5), (3, 0.0), (3, 2.0)])
def test_batched_early_exit_generation_equals_per_sentence_generation(beams, dense_step_fraction):
    model = make_model(seed=3, halting_mechanism="token_geometric")
    model.model.decoder.dense_step_fraction = dense_step_fraction
    source, target = make_batch()
    balance_exits(model, source, target, {})
    with torch.no_grad():
        batched = model.generate(source, max_new_tokens=10, num_beams=beams, return_exits=True)
        assert batched.exits.shape == (3, batched.sequences.shape[1] - 1)
        assert batched.exits[batched.exits > 0].unique().numel() > 1
        for row in range(3):
            length = int(source[row].ne(PAD).sum())
            single = model.generate(source[row : row + 1, :length], max_new_tokens=10, num_beams=beams, return_exits=True)
            width = single.sequences.shape[1]
            assert torch.equal(batched.sequences[row, :width], single.sequences[0])
            assert bool((batched.sequences[row, width:] == PAD).all())
            assert torch.equal(batched.exits[row, : width - 1], single.exits[0])


def _generate_with_cache(model, source, defer, **kwargs):
    model.defer_copied_states = defer
    try:
        with torch.no_grad():
            kwargs.setdefault("max_new_tokens", 8)
            return model.generate(source, return_dict_in_generate=True, output_scores=True, **kwargs)
    finally:
        model.defer_copied_states = True


@pytest.mark.parametrize("beams", [1, 3])
@pytest.mark.parametrize(
    "settings",
    [
        {"exit_strategy": "fixed", "fixed_exit": 1},
        {"exit_strategy": "fixed", "fixed_exit": 2},
        {"exit_strategy": "halting"},
        {"exit_strategy": "confidence"},
    ],
    ids=["fixed1", "fixed2", "geometric", "confidence"],
)
def test_deferred_copied_states_give_the_eager_generation_and_cache(beams, settings):
    """Projecting a skipped block's copied states only when a later token runs the block (CopiedStateCache) is
    Algorithm 2: same hypotheses, scores and exits, and the returned cache holds every block's keys/values."""
    model = make_model(seed=3, halting_mechanism="token_geometric")
    source, target = make_batch()
    settings = balance_exits(model, source, target, settings)
    deferred = _generate_with_cache(model, source, True, num_beams=beams, return_exits=True, **settings)
    eager = _generate_with_cache(model, source, False, num_beams=beams, return_exits=True, **settings)
    assert torch.equal(deferred.sequences, eager.sequences)
    assert torch.equal(deferred.exits, eager.exits)
    for deferred_scores, eager_scores in zip(deferred.scores, eager.scores):
        torch.testing.assert_close(deferred_scores, eager_scores, rtol=1e-5, atol=1e-5)
    deferred_cache = output_cache(deferred).self_attention_cache
    eager_cache = output_cache(eager).self_attention_cache
    assert type(deferred_cache).__name__ == "CopiedStateCache" and not deferred_cache.defer_copied_states
    if settings["exit_strategy"] == "fixed":  # every step stopped below the top: its copied states were recorded
        assert deferred_cache._recorded_until == deferred.sequences.shape[1] - 1
    for deferred_layer, eager_layer in zip(deferred_cache.layers, eager_cache.layers):
        assert deferred_layer.keys.shape == eager_layer.keys.shape
        torch.testing.assert_close(deferred_layer.keys, eager_layer.keys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(deferred_layer.values, eager_layer.values, rtol=1e-5, atol=1e-6)


def test_deferred_copied_states_over_a_generation_longer_than_the_first_buffer():
    """40 steps (the recorded states' buffer grows past its first 32 positions) with beams reordering it."""
    model = make_model(seed=3, halting_mechanism="token_geometric")
    source, target = make_batch()
    settings = balance_exits(model, source, target, {"exit_strategy": "halting"})
    kwargs = dict(num_beams=2, min_new_tokens=40, max_new_tokens=40, return_exits=True, **settings)
    deferred = _generate_with_cache(model, source, True, **kwargs)
    eager = _generate_with_cache(model, source, False, **kwargs)
    assert deferred.sequences.shape[1] == 41
    assert torch.equal(deferred.sequences, eager.sequences) and torch.equal(deferred.exits, eager.exits)
    for deferred_layer, eager_layer in zip(output_cache(deferred).self_attention_cache.layers,
                                           output_cache(eager).self_attention_cache.layers):
        torch.testing.assert_close(deferred_layer.keys, eager_layer.keys, rtol=1e-5, atol=1e-6)


def _deferred_cache_after_steps(model, source, steps=4):
    """A CopiedStateCache after `steps` early-exit steps at exit 1 (upper blocks never run), and the eager one."""
    from flexformers.modeling.depth_adaptive_cache import CopiedStateCache
    from flexformers.modeling.kv_caches import new_decoder_cache

    caches = []
    for defer in (True, False):
        cache = new_decoder_cache(model.config)
        if defer:
            cache.self_attention_cache = CopiedStateCache(config=model.config, defer_copied_states=True)
        encoder_outputs = model.get_encoder()(input_ids=source)
        tokens = torch.full((source.shape[0], 1), 2)
        with torch.no_grad():
            for step in range(steps):
                output = model(encoder_outputs=encoder_outputs, attention_mask=source.ne(PAD).long(),
                               decoder_input_ids=tokens, past_key_values=cache, use_cache=True,
                               exit_strategy="fixed", fixed_exit=1 if step != 1 else 3)
                tokens = output.logits.argmax(-1)
        caches.append(cache)
    return caches


@pytest.mark.parametrize("operation", ["crop", "crop-one", "select", "repeat", "repeat-reorder", "reorder",
                                       "reorder-select-reorder"])
def test_copied_state_cache_operations_commute_with_completing_it(operation):
    """Cropping, selecting/repeating rows or reordering beams of a cache with recorded copied states, then
    completing it, gives the eager cache with the same operation applied (and a crop leaves the length asked for)."""
    model = make_model(seed=5)
    source, _ = make_batch()
    deferred, eager = _deferred_cache_after_steps(model, source)
    assert deferred.self_attention_cache.layers[2].get_seq_length() == 2  # steps 0 and 1 only: the rest deferred
    apply = {
        "crop": lambda cache: cache.crop(-2),
        "crop-one": lambda cache: cache.crop(-1),  # one token: the lower blocks (all 4 positions) lose one
        "select": lambda cache: cache.batch_select_indices(torch.tensor([2, 0])),
        "repeat": lambda cache: cache.batch_repeat_interleave(2),
        # rows expanded (for beams), then a beam step: the reorder needs a spare buffer of the expanded size
        "repeat-reorder": lambda cache: (
            cache.batch_repeat_interleave(2),
            cache.self_attention_cache.reorder_cache(torch.tensor([5, 0, 3, 3, 1, 2])),
        ),
        "reorder": lambda cache: cache.self_attention_cache.reorder_cache(torch.tensor([1, 1, 0])),
        # a beam step, rows dropped, another beam step: the second reorder needs a spare buffer of the new size
        "reorder-select-reorder": lambda cache: (
            cache.self_attention_cache.reorder_cache(torch.tensor([1, 2, 0])),
            cache.batch_select_indices(torch.tensor([2, 0])),
            cache.self_attention_cache.reorder_cache(torch.tensor([1, 0])),
        ),
    }[operation]
    apply(deferred)
    apply(eager)
    if operation.startswith("crop"):
        expected = 3 if operation == "crop-one" else 2
        assert deferred.get_seq_length() == eager.get_seq_length() == expected
        for layer in eager.self_attention_cache.layers:
            assert layer.get_seq_length() == expected
    model.model.decoder.complete_copied_states(deferred)
    for deferred_layer, eager_layer in zip(deferred.self_attention_cache.layers, eager.self_attention_cache.layers):
        torch.testing.assert_close(deferred_layer.keys, eager_layer.keys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(deferred_layer.values, eager_layer.values, rtol=1e-5, atol=1e-6)


def test_a_cropped_cache_with_recorded_states_decodes_on_like_the_eager_one():
    """Assisted decoding crops the cache and decodes on from there: after `crop`, new steps that exit early record
    their copied states at the cropped positions, and completing the cache gives what eager projection writes."""
    model = make_model(seed=5)
    source, _ = make_batch()
    deferred, eager = _deferred_cache_after_steps(model, source)
    encoder_outputs = model.get_encoder()(input_ids=source)
    for cache in (deferred, eager):
        cache.crop(-2)
        assert cache.get_seq_length() == 2
        tokens = torch.full((source.shape[0], 1), 7)
        with torch.no_grad():
            for exit_block in (1, 2):
                model(encoder_outputs=encoder_outputs, attention_mask=source.ne(PAD).long(), decoder_input_ids=tokens,
                      past_key_values=cache, use_cache=True, exit_strategy="fixed", fixed_exit=exit_block)
                tokens = tokens + 1
        assert cache.get_seq_length() == 4
    model.model.decoder.complete_copied_states(deferred)
    for deferred_layer, eager_layer in zip(deferred.self_attention_cache.layers, eager.self_attention_cache.layers):
        torch.testing.assert_close(deferred_layer.keys, eager_layer.keys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(deferred_layer.values, eager_layer.values, rtol=1e-5, atol=1e-6)


def test_generate_honours_generation_config_and_returns_exits_with_dict_outputs():
    model = make_model(seed=3, halting_mechanism="token_geometric")
    source, target = make_batch()
    config = GenerationConfig(max_new_tokens=4, num_beams=2, num_return_sequences=2, decoder_start_token_id=2,
                              eos_token_id=2, pad_token_id=PAD, return_dict_in_generate=True, output_scores=True)
    config.exit_strategy = "fixed"
    config.fixed_exit = 2
    with torch.no_grad():
        output = model.generate(source, generation_config=config, return_exits=True, labels=target)
    assert output.sequences.shape[0] == 6 and output.sequences.shape[1] <= 5
    valid = output.sequences[:, 1:].ne(PAD)
    assert bool((output.exits[valid] == 2).all())


def test_generate_refuses_a_static_cache_by_name():
    model = make_model()
    source, _ = make_batch()
    with pytest.raises(ValueError, match="DepthAdaptiveForConditionalGeneration cannot generate with a static cache"):
        model.generate(source, max_new_tokens=4, cache_implementation="static")


def test_generate_reads_exit_settings_from_the_models_own_generation_config():
    """Without a passed generation config, exit settings on `model.generation_config` apply; an explicit argument
    still wins."""
    model = make_model(seed=3, halting_mechanism="token_geometric")
    source, _ = make_batch()
    model.generation_config.exit_strategy = "fixed"
    model.generation_config.fixed_exit = 2
    with torch.no_grad():
        output = model.generate(source, max_new_tokens=4, return_exits=True)
        overridden = model.generate(source, max_new_tokens=4, return_exits=True, fixed_exit=1)
    assert bool((output.exits[output.sequences[:, 1:].ne(PAD)] == 2).all())
    assert bool((overridden.exits[overridden.sequences[:, 1:].ne(PAD)] == 1).all())


@pytest.mark.parametrize("where", ["passed", "model"])
def test_generate_reads_confidence_thresholds_from_a_generation_config(where):
    """`exit_thresholds` on the generation config (passed, or the model's own) set the confidence exits: thresholds
    of 0 exit every token at block 1, thresholds of 1 (never reached by a softmax maximum here) at the last block."""
    model = make_model(seed=3)
    source, _ = make_batch()
    exits_by_threshold = {}
    for threshold in (0.0, 1.0):
        config = GenerationConfig(max_new_tokens=4, decoder_start_token_id=2, eos_token_id=2, pad_token_id=PAD)
        config.exit_strategy = "confidence"
        config.exit_thresholds = [threshold] * (model.num_exits - 1)
        with torch.no_grad():
            if where == "passed":
                output = model.generate(source, generation_config=config, return_exits=True)
            else:
                model.generation_config = config
                output = model.generate(source, return_exits=True)
        exits_by_threshold[threshold] = output.exits[output.sequences[:, 1:].ne(PAD)]
    assert bool((exits_by_threshold[0.0] == 1).all())
    assert bool((exits_by_threshold[1.0] == model.num_exits).all())


class _GenerateOnceInside:
    """A logits processor that runs the same model's generate() once, with other exit settings, during the outer
    call's first step (as a model serving as its own draft model does)."""

    def __init__(self, model, source):
        self.model, self.source, self.inner_exits = model, source, None

    def __call__(self, input_ids, scores):
        if self.inner_exits is None:
            inner = self.model.generate(self.source, max_new_tokens=2, exit_strategy="fixed", fixed_exit=3,
                                        return_exits=True)
            self.inner_exits = inner.exits[inner.sequences[:, 1:].ne(PAD)]
        return scores


def test_a_generate_inside_generate_leaves_the_outer_calls_exit_settings_in_place():
    """Each generate() restores the exit settings it found, so a nested call (a model as its own assistant, a
    processor that decodes) does not change the outer call's exits."""
    from transformers import LogitsProcessorList

    model = make_model(seed=3)
    source, _ = make_batch()
    nested = _GenerateOnceInside(model, source)
    with torch.no_grad():
        outer = model.generate(source, max_new_tokens=4, exit_strategy="fixed", fixed_exit=1, return_exits=True,
                               logits_processor=LogitsProcessorList([nested]))
        plain = model.generate(source, max_new_tokens=4, exit_strategy="fixed", fixed_exit=1, return_exits=True)
    assert bool((nested.inner_exits == 3).all())
    assert bool((outer.exits[outer.sequences[:, 1:].ne(PAD)] == 1).all())
    assert torch.equal(outer.sequences, plain.sequences)
    assert model._generation_exit_settings is None


# --------------------------------------------------------------------------------------------- training


def test_aligned_loss_is_the_weighted_average_of_the_exit_losses():
    model = make_model(exit_loss_weighting="n", label_smoothing=0.1)
    source, target = make_batch()
    target[0, 3:] = -100
    output = model(input_ids=source, labels=target, return_exit_logits=True)
    per_exit = torch.stack([label_smoothed_nll_loss(logits, target, 0.1)[0] for logits in output.exit_logits])
    torch.testing.assert_close(output.per_exit_losses, per_exit.detach())
    expected = (exit_loss_weights("n", 3).float() * per_exit).sum()
    torch.testing.assert_close(output.loss, expected)
    output.loss.backward()
    assert all(p.grad is not None for p in model.exit_classifiers.parameters())


def test_gradient_scaling_keeps_the_loss_and_follows_algorithm_1():
    source, target = make_batch()
    plain = make_model(seed=7).train()
    scaled = make_model(seed=7, gradient_scaling=0.5).train()
    plain_out = plain(input_ids=source, labels=target)
    scaled_out = scaled(input_ids=source, labels=target)
    torch.testing.assert_close(plain_out.loss, scaled_out.loss)
    plain_out.loss.backward()
    scaled_out.loss.backward()
    # Top block (n = N): only its own loss (γ_N = 1) reaches it → identical gradients.
    grads = lambda m: dict((name, p.grad) for name, p in m.named_parameters())  # noqa: E731
    plain_grads, scaled_grads = grads(plain), grads(scaled)
    torch.testing.assert_close(plain_grads["lm_head.weight"], scaled_grads["lm_head.weight"])
    torch.testing.assert_close(
        plain_grads["model.decoder.layers.2.ffn.fc1.weight"], scaled_grads["model.decoder.layers.2.ffn.fc1.weight"]
    )
    # C_1 gets its own loss amplified by γ_1 = γ(N − 1) = 1.0; C_2 by γ_2 = 0.5.
    torch.testing.assert_close(plain_grads["exit_classifiers.0.weight"], scaled_grads["exit_classifiers.0.weight"])
    torch.testing.assert_close(0.5 * plain_grads["exit_classifiers.1.weight"], scaled_grads["exit_classifiers.1.weight"])
    # Block 1 receives C_1's loss ×γ_1 and, through the h¹ link scaled by 1/γ_2, the losses above ×(1/γ_2):
    # Algorithm 1 changes the lower blocks' gradients.
    assert not torch.allclose(
        plain_grads["model.decoder.layers.0.ffn.fc1.weight"], scaled_grads["model.decoder.layers.0.ffn.fc1.weight"]
    )
    assert scale_gradient(torch.ones(1), 0.5).item() == 1.0


def test_mixed_training_samples_exits_and_trains_every_classifier():
    model = make_model(training_mode="mixed", mixed_num_samples=3).train()
    source, target = make_batch()
    torch.manual_seed(0)
    output = model(input_ids=source, labels=target)
    assert output.exits.shape == target.shape and output.exits.unique().numel() > 1
    output.loss.backward()
    assert model.exit_classifiers[0].weight.grad is not None
    # eval mode: the aligned loss, deterministic
    model.eval()
    with torch.no_grad():
        assert model(input_ids=source, labels=target).loss.item() == model(input_ids=source, labels=target).loss.item()


def test_mixed_training_records_the_blocks_of_the_exit_sequence_it_returns():
    """With several sampled exit sequences (Eq. 5), the recorded hidden states and attentions are those of the last
    one, the sequence whose exits and logits the output returns: replaying those exits gives the same values."""
    model = make_model(training_mode="mixed", mixed_num_samples=3).train()  # dropout 0: train and eval agree
    source, target = make_batch()
    torch.manual_seed(0)
    output = model(input_ids=source, labels=target, output_hidden_states=True, output_attentions=True)
    assert len(output.decoder_hidden_states) == TINY["decoder_layers"] + 1
    assert len(output.decoder_attentions) == TINY["decoder_layers"]
    model.eval()
    with torch.no_grad():
        replay = model(input_ids=source, labels=target, token_exits=output.exits, output_hidden_states=True,
                       output_attentions=True)
    torch.testing.assert_close(output.logits, replay.logits)
    for recorded, replayed in zip(output.decoder_hidden_states + output.decoder_attentions,
                                  replay.decoder_hidden_states + replay.decoder_attentions):
        torch.testing.assert_close(recorded, replayed)


@pytest.mark.parametrize(
    "mechanism, oracle", [("sequence", "likelihood"), ("sequence", "correctness"), ("token_multinomial", "likelihood"),
                          ("token_geometric", "correctness"), ("token_geometric", "likelihood")]
)
def test_exit_loss_eq7_trains_the_halting_mechanism(mechanism, oracle):
    model = make_model(halting_mechanism=mechanism, oracle=oracle, exit_loss_alpha=0.5, oracle_sigma=1.0,
                       oracle_lambda=0.01).train()
    source, target = make_batch()
    target[2, 2:] = -100
    output = model(input_ids=source, labels=target)
    tokens = target.ne(-100).sum()
    torch.testing.assert_close(output.loss, output.decoding_loss + 0.5 * output.exit_loss)
    # Eq. 6: −Σ log q(n*) normalised like the decoding loss
    chosen = output.exit_log_probs.gather(-1, (output.oracle_exits - 1).unsqueeze(-1)).squeeze(-1)
    if mechanism != "sequence":
        chosen = chosen * target.ne(-100)
    torch.testing.assert_close(output.exit_loss, -chosen.sum() / tokens)
    output.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.halting.parameters())
    # stage one of the two-stage schedule: α = 0 leaves the halting mechanism out of the loss
    model.config.exit_loss_alpha = 0.0
    assert model(input_ids=source, labels=target).exit_loss is None


def test_logits_loss_is_the_cross_entropy_of_the_returned_logits_beside_the_training_loss():
    """`loss` stays the training objective (Eq. 7 on the aligned pass, also in eval mode: what Trainer reports as
    eval_loss); `logits_loss` / `logits_nll_loss` are the label-smoothed cross-entropy of the returned `logits` and its
    NLL (exp = their perplexity), for evaluation to report."""
    model = make_model(label_smoothing=0.1, halting_mechanism="token_geometric", exit_loss_alpha=0.5)
    source, target = make_batch()
    target[2, 3:] = -100
    with torch.no_grad():
        output = model(input_ids=source, labels=target)
    smoothed, nll = label_smoothed_nll_loss(output.logits, target, 0.1)
    torch.testing.assert_close(output.logits_loss, smoothed)
    torch.testing.assert_close(output.logits_nll_loss, nll)
    torch.testing.assert_close(output.logits_loss, output.per_exit_losses[-1])  # the top classifier's logits
    torch.testing.assert_close(output.loss, output.decoding_loss + 0.5 * output.exit_loss)
    assert abs(output.loss.item() - output.logits_loss.item()) > 1e-3
    # mixed training: the logits of the last sampled exit sequence
    model = make_model(label_smoothing=0.1, training_mode="mixed", mixed_num_samples=2).train()
    output = model(input_ids=source, labels=target)
    torch.testing.assert_close(output.logits_loss, label_smoothed_nll_loss(output.logits.detach(), target, 0.1)[0])
    assert not output.logits_loss.requires_grad and output.loss.requires_grad
    # given exits: the loss is that of the returned logits
    model.eval()
    with torch.no_grad():
        output = model(input_ids=source, labels=target, token_exits=torch.ones_like(target).masked_fill(target < 0, 1))
    torch.testing.assert_close(output.loss, output.logits_loss)


# --------------------------------------------------------------------------------------------- plumbing


def test_iwslt_setting_parameter_count_and_untied_classifiers():
    config = DepthAdaptiveConfig(vocab_size=100, encoder_embed_dim=512, decoder_embed_dim=256, encoder_ffn_embed_dim=1024,
                                 decoder_ffn_embed_dim=1024, encoder_attention_heads=4, decoder_attention_heads=4)
    model = DepthAdaptiveForConditionalGeneration(config)
    d_e, d_d, f, v = 512, 256, 1024, 100
    encoder_layer = 4 * d_e * d_e + 4 * d_e + 2 * d_e * f + f + d_e + 4 * d_e
    decoder_layer = (4 * d_d * d_d + 4 * d_d) + (2 * d_d * d_d + 2 * d_e * d_d + 4 * d_d) + (2 * d_d * f + f + d_d) + 6 * d_d
    expected = v * d_e + v * d_d + 6 * encoder_layer + 6 * decoder_layer + 6 * d_d * v
    assert sum(p.numel() for p in model.parameters()) == expected
    classifiers = [model.exit_classifier(n).weight for n in range(1, 7)]
    assert len({c.data_ptr() for c in classifiers}) == 6


def test_shared_classifiers_tied_to_embeddings():
    model = make_model(exit_classifiers="shared", share_decoder_input_output_embed=True)
    embedding = model.model.decoder.embed_tokens
    assert all(model.exit_classifier(n).weight.data_ptr() == embedding.weight.data_ptr() for n in (1, 2, 3))


def test_save_load_and_auto_classes(tmp_path):
    model = make_model(halting_mechanism="token_geometric", exit_thresholds=[0.3, 0.6])
    model.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), DepthAdaptiveConfig)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, DepthAdaptiveForConditionalGeneration)
    assert isinstance(AutoModel.from_config(model.config), DepthAdaptiveModel)
    source, _ = make_batch()
    with torch.no_grad():
        assert torch.equal(model.generate(source, max_new_tokens=6), loaded.generate(source, max_new_tokens=6))


def test_bad_exit_settings_raise_clear_errors():
    model = make_model()
    source, _ = make_batch()
    with pytest.raises(ValueError, match="halting_mechanism"):
        model.generate(source, max_new_tokens=3, exit_strategy="halting")
    with pytest.raises(ValueError, match="fixed_exit"):
        model.generate(source, max_new_tokens=3, exit_strategy="fixed", fixed_exit=4)
    with pytest.raises(ValueError, match="thresholds"):
        model.generate(source, max_new_tokens=3, exit_strategy="confidence", exit_thresholds=[0.5])
    with pytest.raises(ValueError, match="exit_strategy"):
        model.generate(source, max_new_tokens=3, exit_strategy="maybe")


def test_bfloat16_generation_runs():
    model = make_model(halting_mechanism="token_geometric").to(torch.bfloat16)
    source, _ = make_batch()
    with torch.no_grad():
        output = model.generate(source, max_new_tokens=5, num_beams=2, return_exits=True)
    assert output.sequences.dtype == torch.long and output.exits.max() <= 3


# ---- issue 65, round 3: the held-out sample's (seed 2) survivors ----


@pytest.mark.parametrize("exit_classifiers", ["independent", "shared"])
def test_resize_token_embeddings_resizes_every_exit_classifier(exit_classifiers):
    """C_1 … C_N all project onto the target vocabulary: `resize_token_embeddings` resizes each (independent ones
    keep their trained rows), and every exit still produces logits of the new size."""
    model = make_model(exit_classifiers=exit_classifiers)
    before = [model.exit_classifier(block).weight.detach().clone() for block in (1, 2, 3)]
    model.resize_token_embeddings(70)
    for block, old in zip((1, 2, 3), before):
        weight = model.exit_classifier(block).weight
        assert weight.shape[0] == 70, block
        torch.testing.assert_close(weight[:60], old)
    source, target = make_batch()
    with torch.no_grad():
        out = model(input_ids=source, labels=target, return_exit_logits=True)
    assert [logits.shape[-1] for logits in out.exit_logits] == [70, 70, 70]
