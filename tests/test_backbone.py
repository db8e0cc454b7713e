"""The baseline model: fairseq semantics, Transformers conventions, and the seams the methods extend."""

import math

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSeq2SeqLM,
    CompileConfig,
    GenerationConfig,
)
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    EncoderDecoderCache,
    StaticCache,
)

import flexformers  # noqa: F401  (registers the model types)
from flexformers.configuration import PRESETS, FlexformerConfig
from flexformers.modeling.branch_merge import merge_branches, merge_projection
from flexformers.modeling.cpu_kernels import (
    dropout,
    project_vocabulary,
    scaled_keep_mask,
)
from flexformers.modeling.kv_caches import (
    PreallocatedKVLayer,
    StepKVCollector,
    new_decoder_cache,
    static_cache_capacity,
)
from flexformers.modeling.losses import label_smoothed_nll_loss, token_loss_terms
from flexformers.modeling.modeling_flexformer import (
    FlexformerDecoder,
    FlexformerForConditionalGeneration,
    FlexformerModel,
)
from flexformers.modeling.positional_embeddings import (
    _positions_for,
    make_positions,
    sinusoidal_table,
)
from flexformers.modeling.sublayer_order import PerRowSublayerOrder
from flexformers.modeling.transformers_compat import cache_field, output_cache
from tests.conftest import tiny_config_kwargs

PAD = 1


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return FlexformerForConditionalGeneration(FlexformerConfig(**tiny_config_kwargs(**overrides))).eval()


def batch(seed=1, rows=3, src_len=7, tgt_len=6, vocab=60):
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(5, vocab, (rows, src_len), generator=generator)
    source[-1, src_len - 2 :] = PAD  # one right-padded sentence
    target = torch.randint(5, vocab, (rows, tgt_len), generator=generator)
    return source, target


def incremental_logits(model, source, decoder_input_ids, cache=None, **kwargs):
    out = model(
        input_ids=source, decoder_input_ids=decoder_input_ids[:, :1], use_cache=True, past_key_values=cache, **kwargs
    )
    logits, cache = [out.logits], output_cache(out)
    for t in range(1, decoder_input_ids.shape[1]):
        out = model(
            encoder_outputs=(out.encoder_last_hidden_state,),
            attention_mask=source.ne(PAD).long(),
            decoder_input_ids=decoder_input_ids[:, t : t + 1],
            past_key_values=cache,
            use_cache=True,
            **kwargs,
        )
        logits.append(out.logits)
    return torch.cat(logits, dim=1)


# ---- parameter counts and presets ----------------------------------------------------------------------------------


def test_iwslt_preset_has_exactly_fairseqs_parameter_count():
    config = FlexformerConfig.from_preset("transformer_iwslt_de_en", vocab_size=10152)
    with torch.device("meta"):
        model = FlexformerForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == 36_741_120


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_with_its_architecture(name):
    config = FlexformerConfig.from_preset(name, vocab_size=1000)
    for key, value in PRESETS[name].items():
        assert getattr(config, key) == value
    with torch.device("meta"):
        model = FlexformerForConditionalGeneration(config)
    assert len(model.model.encoder.layers) == config.encoder_layers
    assert len(model.model.decoder.layers) == config.decoder_layers


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="preset"):
        FlexformerConfig.from_preset("transformer_tiny_nonexistent")


@pytest.mark.parametrize(
    "field, value",
    [
        ("encoder_attention_heads", 3),
        ("decoder_attention_heads", 5),
        ("dropout", -0.1),
        ("attention_dropout", 1.5),
        ("decoder_layers", 0),
        ("activation_function", "sigmoid-ish"),
        ("label_smoothing", 1.0),
        ("encoder_layerdrop", 1.0),
        ("decoder_attention_branches", 0),
    ],
)
def test_bad_config_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        FlexformerConfig(**tiny_config_kwargs(**{field: value}))


def test_share_all_embeddings_needs_equal_dims():
    with pytest.raises(ValueError, match="share_all_embeddings"):
        FlexformerConfig(**tiny_config_kwargs(share_all_embeddings=True, decoder_embed_dim=16))


def test_separate_encoder_and_decoder_dims_build_and_run():
    """The Depth-Adaptive IWSLT setting: d_enc ≠ d_dec (cross-attention keys come from the encoder width)."""
    model = tiny_model(decoder_embed_dim=16, decoder_ffn_embed_dim=32, target_vocab_size=40)
    source, target = batch()
    logits = model(input_ids=source, decoder_input_ids=target % 40).logits
    assert logits.shape == (3, 6, 40)


def test_auto_classes_know_every_flexformer_type():
    config = AutoConfig.for_model("flexformer", **tiny_config_kwargs())
    assert isinstance(AutoModelForSeq2SeqLM.from_config(config), FlexformerForConditionalGeneration)
    assert isinstance(AutoModel.from_config(config), FlexformerModel)


# ---- fairseq semantics ---------------------------------------------------------------------------------------------


def test_positions_skip_padding_like_fairseq():
    ids = torch.tensor([[7, 8, 9, PAD], [PAD, 7, 8, 9]])
    assert make_positions(ids, PAD).tolist() == [[2, 3, 4, 1], [1, 2, 3, 4]]


def test_sinusoidal_table_matches_fairseq_layout():
    table = sinusoidal_table(10, 8, PAD)
    assert torch.all(table[PAD] == 0)
    half = 4
    frequency = math.exp(-math.log(10000) / (half - 1))
    assert table[3, 1].item() == pytest.approx(math.sin(3 * frequency), abs=1e-6)
    assert table[3, half + 1].item() == pytest.approx(math.cos(3 * frequency), abs=1e-6)


def test_sinusoidal_positions_are_not_parameters_and_embeddings_are_scaled():
    model = tiny_model()
    names = [name for name, _ in model.named_parameters()]
    assert not any("embed_positions" in name for name in names)
    assert model.model.encoder.embed_scale == pytest.approx(math.sqrt(32))


def test_initialisation_follows_fairseq():
    model = tiny_model(vocab_size=2000, encoder_embed_dim=64, decoder_embed_dim=64, share_all_embeddings=True)
    embeddings = model.model.encoder.embed_tokens.weight
    assert torch.all(embeddings[PAD] == 0)
    assert embeddings.std().item() == pytest.approx(64**-0.5, rel=0.05)
    fc1 = model.model.encoder.layers[0].ffn.fc1
    bound = math.sqrt(6 / (fc1.in_features + fc1.out_features))
    assert fc1.weight.abs().max().item() <= bound and torch.all(fc1.bias == 0)
    layer_norm = model.model.decoder.layers[0].final_layer_norm
    assert torch.all(layer_norm.weight == 1) and torch.all(layer_norm.bias == 0)


def test_label_smoothed_loss_matches_fairseq_formula():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11)
    labels = torch.tensor([[1, 2, 3], [4, -100, -100]])
    epsilon = 0.1
    loss, nll = label_smoothed_nll_loss(logits, labels, epsilon)
    log_probs = torch.log_softmax(logits, -1)
    expected_loss, expected_nll, count = 0.0, 0.0, 0
    for b in range(2):
        for t in range(3):
            if labels[b, t] == -100:
                continue
            count += 1
            token_nll = -log_probs[b, t, labels[b, t]]
            smooth = -log_probs[b, t].sum()
            eps_i = epsilon / (11 - 1)
            expected_loss += (1 - epsilon - eps_i) * token_nll + eps_i * smooth
            expected_nll += token_nll
    assert loss.item() == pytest.approx(expected_loss.item() / count, rel=1e-5)
    assert nll.item() == pytest.approx(expected_nll.item() / count, rel=1e-5)


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_fused_label_smoothed_loss_gradient_matches_autograd_of_the_formula(epsilon):
    """The fused backward (`softmax − (1−ε−ε')·onehot − ε'`) equals autograd through fairseq's formula, padding
    positions included (zero gradient); gradcheck in float64 as well."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 13, requires_grad=True)
    labels = torch.tensor([[1, 2, 3, -100], [4, 12, -100, -100]])
    loss, _ = label_smoothed_nll_loss(logits, labels, epsilon)
    (fused_grad,) = torch.autograd.grad(loss, logits)
    log_probs = torch.log_softmax(logits, -1)
    kept = labels.ne(-100)
    token_nll = -log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    spread = epsilon / 12
    reference = (((1 - epsilon - spread) * token_nll - spread * log_probs.sum(-1)) * kept).sum() / kept.sum()
    (reference_grad,) = torch.autograd.grad(reference, logits)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert torch.allclose(fused_grad, reference_grad, atol=1e-7)
    assert torch.all(fused_grad[0, 3] == 0) and torch.all(fused_grad[1, 2:] == 0)
    double = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    double_labels = torch.tensor([0, 6, -100, 3, 2])
    assert torch.autograd.gradcheck(
        lambda z: label_smoothed_nll_loss(z, double_labels, epsilon)[0], (double,), eps=1e-6, atol=1e-6
    )


def test_token_loss_terms_match_log_softmax_values_and_gradients():
    """Per-token (nll, smooth) and their fused backward under arbitrary upstream gradients equal autograd through
    log_softmax (IOT weights each sentence's terms separately, so both outputs carry gradients)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 17, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 17, (3, 5))
    labels[2, 3:] = -100
    nll, smooth = token_loss_terms(logits, labels)
    log_probs = torch.log_softmax(logits, -1)
    kept = labels.ne(-100)
    want_nll = -log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * kept
    want_smooth = -log_probs.sum(-1) * kept
    assert torch.allclose(nll, want_nll) and torch.allclose(smooth, want_smooth)
    upstream = torch.randn(2, 3, 5, dtype=torch.float64)
    got = torch.autograd.grad((nll * upstream[0] + smooth * upstream[1]).sum(), logits)[0]
    want = torch.autograd.grad((want_nll * upstream[0] + want_smooth * upstream[1]).sum(), logits)[0]
    assert torch.allclose(got, want)
    assert torch.autograd.gradcheck(lambda z: token_loss_terms(z, labels), (logits,))


def test_dropout_keeps_fairseq_semantics():
    """CPU dropout (masks from `scaled_keep_mask`): drops with probability p, scales kept values by 1/(1−p), identity in eval
    or at p = 0, all zeros at p = 1, and the backward uses the same mask."""
    torch.manual_seed(0)
    hidden = torch.ones(400, 500, requires_grad=True)
    out = dropout(hidden, 0.3, training=True)
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.005
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / 0.7))
    out.sum().backward()
    assert torch.equal(hidden.grad != 0, kept)
    assert dropout(hidden, 0.3, training=False) is hidden and dropout(hidden, 0.0, training=True) is hidden
    assert torch.all(dropout(hidden, 1.0, training=True) == 0)


@pytest.mark.parametrize("keep", [0.9, 0.7, 0.5, 0.1])
def test_scaled_keep_masks_are_independent_draws_with_the_keep_probability(keep):
    """Two mask elements per 32-bit draw: each half keeps with probability `keep` (to 2^-15), the two halves of a
    draw are uncorrelated, odd sizes and other dtypes work, and the kept value is exactly 1/keep."""
    torch.manual_seed(0)
    mask = scaled_keep_mask(torch.empty(1_000_001, dtype=torch.float64), keep)
    assert mask.shape == (1_000_001,) and mask.dtype == torch.float64
    assert set(mask.unique().tolist()) == {0.0, 1 / keep}
    kept = (mask > 0).double()
    tolerance = 5 * (keep * (1 - keep) / mask.numel()) ** 0.5
    assert abs(kept.mean().item() - keep) < tolerance
    first_halves, second_halves = kept[0:-1:2], kept[1::2]  # the two halves of each draw
    for halves in (first_halves, second_halves):
        assert abs(halves.mean().item() - keep) < 2 * tolerance
    covariance = ((first_halves - keep) * (second_halves - keep)).mean().item()
    assert abs(covariance) < 5 * keep * (1 - keep) / first_halves.numel() ** 0.5
    assert scaled_keep_mask(torch.empty(3, 5, 7, dtype=torch.bfloat16), keep).shape == (3, 5, 7)


def test_token_loss_backward_twice_with_retained_graph_gives_the_same_gradient():
    """The first backward reuses the forward's exp buffer in place; a second one recomputes it bit for bit."""
    torch.manual_seed(0)
    logits = torch.randn(6, 11, requires_grad=True)
    labels = torch.tensor([0, 3, -100, 10, 5, 5])
    loss = label_smoothed_nll_loss(logits, labels, 0.1)[0]
    first = torch.autograd.grad(loss, logits, retain_graph=True)[0]
    second = torch.autograd.grad(loss, logits)[0]
    assert torch.equal(first, second)
    log_probs = torch.log_softmax(logits, -1)
    spread = 0.1 / 10
    kept = labels.ne(-100)
    want = -((1 - 0.1 - spread) * log_probs[kept].gather(1, labels[kept].unsqueeze(1)).sum() + spread * log_probs[kept].sum())
    assert torch.allclose(torch.autograd.grad(want / kept.sum(), logits)[0], first, atol=1e-6)


def test_loss_normalised_by_num_items_keeps_gradient_accumulation_exact():
    """Two half-batches, each divided by the full batch's token count, sum to the full batch's loss."""
    model = tiny_model(label_smoothing=0.1)
    source, target = batch(rows=4)
    target[1, 3:] = -100
    full = model(input_ids=source, labels=target).loss
    total_tokens = target.ne(-100).sum()
    halves = sum(
        model(input_ids=source[i : i + 2], labels=target[i : i + 2], num_items_in_batch=total_tokens).loss
        for i in (0, 2)
    )
    assert halves.item() == pytest.approx(full.item(), rel=1e-5)


# ---- incremental decoding, batching, attention implementations ----------------------------------------------------


@pytest.mark.parametrize("normalize_before", [False, True])
@pytest.mark.parametrize("learned_pos", [False, True])
def test_incremental_decoding_equals_full_forward(normalize_before, learned_pos):
    model = tiny_model(
        encoder_normalize_before=normalize_before,
        decoder_normalize_before=normalize_before,
        encoder_learned_pos=learned_pos,
        decoder_learned_pos=learned_pos,
    )
    source, target = batch()
    with torch.no_grad():
        full = model(input_ids=source, decoder_input_ids=target).logits
        incremental = incremental_logits(model, source, target)
    torch.testing.assert_close(incremental, full, atol=1e-5, rtol=0)


def test_padded_batch_equals_each_sentence_alone():
    model = tiny_model()
    source, target = batch()
    with torch.no_grad():
        together = model(input_ids=source, decoder_input_ids=target).logits
        for row in range(source.shape[0]):
            length = int(source[row].ne(PAD).sum())
            alone = model(input_ids=source[row : row + 1, :length], decoder_input_ids=target[row : row + 1]).logits
            torch.testing.assert_close(together[row : row + 1], alone, atol=1e-5, rtol=0)


def test_left_padded_source_equals_right_padded():
    model = tiny_model()
    right = torch.tensor([[7, 8, 9, 10, PAD, PAD]])
    left = torch.tensor([[PAD, PAD, 7, 8, 9, 10]])
    target = torch.tensor([[2, 11, 12]])
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=left, decoder_input_ids=target).logits,
            model(input_ids=right, decoder_input_ids=target).logits,
            atol=1e-5,
            rtol=0,
        )


def test_eager_equals_sdpa(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    source, target = batch()
    sdpa = FlexformerForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    eager = FlexformerForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        a = sdpa(input_ids=source, decoder_input_ids=target).logits
        b = eager(input_ids=source, decoder_input_ids=target, output_attentions=True)
    torch.testing.assert_close(a, b.logits, atol=1e-5, rtol=0)
    assert len(b.decoder_attentions) == 2 and b.decoder_attentions[0].shape == (3, 4, 6, 6)
    assert b.cross_attentions[0].shape == (3, 4, 6, 7)


def test_hidden_states_and_tuple_outputs():
    model = tiny_model()
    source, target = batch()
    out = model(input_ids=source, decoder_input_ids=target, output_hidden_states=True)
    assert len(out.decoder_hidden_states) == 3 and len(out.encoder_hidden_states) == 3
    as_tuple = model(input_ids=source, decoder_input_ids=target, return_dict=False)
    torch.testing.assert_close(as_tuple[0], out.logits)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny_model(label_smoothing=0.1).train()
    source, target = batch()
    model(input_ids=source, labels=target).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.model.decoder.layers[0].gradient_checkpointing
    model(input_ids=source, labels=target).loss.backward()
    for name, param in model.named_parameters():
        if name in reference:
            torch.testing.assert_close(param.grad, reference[name], atol=1e-6, rtol=1e-5)


def test_save_load_round_trip_is_bit_identical(tmp_path):
    model = tiny_model(share_all_embeddings=True)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.decoder.embed_tokens.weight.data_ptr()
    assert loaded.model.encoder.embed_tokens.weight.data_ptr() == loaded.model.decoder.embed_tokens.weight.data_ptr()
    source, target = batch()
    with torch.no_grad():
        assert torch.equal(
            model(input_ids=source, decoder_input_ids=target).logits,
            loaded(input_ids=source, decoder_input_ids=target).logits,
        )


def test_untied_output_projection_round_trip(tmp_path):
    model = tiny_model(share_decoder_input_output_embed=False)
    assert model.lm_head.weight.data_ptr() != model.model.decoder.embed_tokens.weight.data_ptr()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


# ---- generation ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        dict(do_sample=False),
        dict(num_beams=4, length_penalty=1.2),
        dict(num_beams=4, num_return_sequences=3, early_stopping=True),
        dict(num_beams=3, no_repeat_ngram_size=2, min_new_tokens=3),
    ],
)
def test_generation_with_cache_equals_without(options):
    model = tiny_model()
    source, _ = batch()
    with_cache = model.generate(source, max_new_tokens=8, **options)
    without = model.generate(source, max_new_tokens=8, use_cache=False, **options)
    assert torch.equal(with_cache, without)


def test_greedy_generation_is_argmax_of_full_forward():
    model = tiny_model()
    source, _ = batch()
    generated = model.generate(source, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    with torch.no_grad():
        logits = model(input_ids=source, decoder_input_ids=generated[:, :-1]).logits
    assert torch.equal(logits.argmax(-1), generated[:, 1:])


def test_generation_options_are_honoured():
    model = tiny_model()
    source, _ = batch()
    forced = model.generate(source, max_new_tokens=5, forced_bos_token_id=9, do_sample=False)
    assert torch.all(forced[:, 1] == 9)
    torch.manual_seed(0)
    sampled = model.generate(source, max_new_tokens=5, do_sample=True, top_k=5, num_return_sequences=2)
    assert sampled.shape[0] == 6
    config = GenerationConfig(max_new_tokens=4, num_beams=2, decoder_start_token_id=2, pad_token_id=1, eos_token_id=2)
    out = model.generate(source, generation_config=config, return_dict_in_generate=True, output_scores=True)
    assert out.sequences.shape[1] <= 5 and out.sequences_scores.shape == (3,)


def test_batched_beam_search_equals_each_sentence_alone():
    model = tiny_model()
    # A random tiny model is nearly uniform, so beams tie up to float noise; sharpen it so the search has one answer.
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    source, _ = batch()
    together = model.generate(source, max_new_tokens=6, num_beams=3, min_new_tokens=6)
    for row in range(source.shape[0]):
        length = int(source[row].ne(PAD).sum())
        alone = model.generate(source[row : row + 1, :length], max_new_tokens=6, num_beams=3, min_new_tokens=6)
        assert torch.equal(together[row, : alone.shape[1]], alone[0])


def test_preallocated_layer_behaves_like_dynamic_layer():
    """Growing past its capacity, beam reordering, cropping, batch selection and repetition all leave exactly what a
    `DynamicLayer` holds after the same calls."""
    torch.manual_seed(0)
    preallocated, dynamic = PreallocatedKVLayer(), DynamicLayer()
    PreallocatedKVLayer.min_capacity, saved = 4, PreallocatedKVLayer.min_capacity
    try:
        for step in range(11):  # 3 prefill positions, then one per step: grows 4 → 8 → 16
            new = 3 if step == 0 else 1
            keys, values = torch.randn(6, 2, new, 5), torch.randn(6, 2, new, 5)
            got = preallocated.update(keys, values)
            want = dynamic.update(keys, values)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            if step % 3 == 2:
                order = torch.randint(0, 6, (6,))
                preallocated.reorder_cache(order)
                dynamic.reorder_cache(order)
        assert preallocated.get_seq_length() == dynamic.get_seq_length() == 13
        assert preallocated._key_buffer.shape[2] == 16  # doubled, not reallocated every step
        for layer in (preallocated, dynamic):
            layer.crop(-2)
            layer.batch_select_indices(torch.tensor([0, 2, 5]))
            layer.batch_repeat_interleave(2)
        assert torch.equal(preallocated.keys, dynamic.keys) and torch.equal(preallocated.values, dynamic.values)
        keys, values = torch.randn(6, 2, 1, 5), torch.randn(6, 2, 1, 5)
        assert torch.equal(preallocated.update(keys, values)[1], dynamic.update(keys, values)[1])
        preallocated.reset()
        assert preallocated.get_seq_length() == 0 and not preallocated.is_initialized
    finally:
        PreallocatedKVLayer.min_capacity = saved


def test_layers_of_one_cache_share_one_spare_pair():
    """Beam reordering in a cache of L layers (built as `generate()` builds it) gives what `DynamicLayer`s give,
    with L + 1 key/value buffer pairs in all — each layer reorders into the pair the previous one left."""
    torch.manual_seed(0)
    config = FlexformerConfig(**tiny_config_kwargs())
    ours = new_decoder_cache(config).self_attention_cache
    plain = DynamicCache(config=config)
    layers = len(ours.layers)
    seen = set()
    for step in range(6):
        for layer_idx in range(layers):
            keys, values = torch.randn(4, 2, 1, 8), torch.randn(4, 2, 1, 8)
            got, want = ours.update(keys, values, layer_idx), plain.update(keys, values, layer_idx)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        order = torch.randint(0, 4, (4,))
        ours.reorder_cache(order)
        plain.reorder_cache(order)
        seen.update(layer._key_buffer.data_ptr() for layer in ours.layers)
    for mine, theirs in zip(ours.layers, plain.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    assert layers > 1 and len(seen) == layers + 1


@pytest.mark.parametrize("options", [dict(do_sample=False), dict(num_beams=4, num_return_sequences=2)])
def test_generation_with_preallocated_cache_equals_dynamic_cache(options):
    """`generate()` uses `PreallocatedKVLayer`s; a user-supplied plain `DynamicCache` gives the same tokens/scores."""
    model = tiny_model()
    source, _ = batch()
    kwargs = dict(max_new_tokens=40, min_new_tokens=40, return_dict_in_generate=True, output_scores=True, **options)
    ours = model.generate(source, **kwargs)
    plain_cache = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
    plain = model.generate(source, **cache_field(plain_cache), **kwargs)
    assert torch.equal(ours.sequences, plain.sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours.scores, plain.scores))
    assert type(output_cache(ours).self_attention_cache.layers[0]) is PreallocatedKVLayer
    assert type(output_cache(plain).self_attention_cache.layers[0]) is DynamicLayer


# ---- static cache (generate(cache_implementation="static"), the compiled decoding step) ---------------------------


def test_positions_after_a_tensor_past_length_equal_those_after_an_int():
    ids = torch.tensor([[7, 8, 9], [7, PAD, 9]])
    for past in (0, 3):
        assert torch.equal(_positions_for(ids, PAD, torch.tensor(past)), _positions_for(ids, PAD, past))
    assert torch.equal(_positions_for(ids, PAD, torch.tensor(0)), make_positions(ids, PAD))


@pytest.mark.parametrize("padded", [False, True])
def test_static_cache_mask_is_the_dynamic_mask_with_unwritten_slots_hidden(padded):
    """With a static cache the keys are the whole buffer: the mask covers all of it, hides the slots after the
    query's position, and otherwise equals the dynamic cache's mask over the filled part."""
    batch_size, past, capacity = 2, 3, 8
    decoder_mask = torch.ones(batch_size, past + 1, dtype=torch.long)
    if padded:
        decoder_mask[1, 0] = 0
    dynamic = FlexformerDecoder.self_attention_mask(batch_size, 1, past, decoder_mask, torch.float32, "cpu")
    static = FlexformerDecoder.self_attention_mask(
        batch_size, 1, torch.tensor(past), decoder_mask, torch.float32, "cpu", key_length=capacity
    )
    assert static.shape == (batch_size, 1, 1, capacity)
    filled = static[..., : past + 1]
    if dynamic is None:
        assert bool((filled == 0).all())
    else:
        assert torch.equal(filled, dynamic)
    assert bool((static[..., past + 1 :] == torch.finfo(torch.float32).min).all())


@pytest.mark.parametrize(
    "options",
    [
        dict(do_sample=False),
        dict(num_beams=4, length_penalty=1.2),
        dict(num_beams=3, num_return_sequences=2),
        dict(do_sample=True, top_k=5),
    ],
)
@pytest.mark.parametrize("learned_pos", [False, True])
def test_static_cache_generation_equals_default_cache(options, learned_pos):
    model = tiny_model(decoder_learned_pos=learned_pos, encoder_learned_pos=learned_pos)
    source, _ = batch()
    kwargs = dict(max_new_tokens=12, return_dict_in_generate=True, output_scores=True, **options)
    torch.manual_seed(3)
    default = model.generate(source, **kwargs)
    torch.manual_seed(3)
    static = model.generate(source, cache_implementation="static", **kwargs)
    assert static_cache_capacity(output_cache(static)) is not None
    assert torch.equal(static.sequences, default.sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(static.scores, default.scores))


def test_static_cache_incremental_decoding_equals_full_forward():
    """A StaticCache passed to `forward` step by step (the past length a device tensor) gives the full logits."""
    model = tiny_model()
    source, target = batch()
    cache = EncoderDecoderCache(
        StaticCache(config=model.config, max_cache_len=16),
        StaticCache(config=model.config, max_cache_len=source.shape[1]),
    )
    with torch.no_grad():
        full = model(input_ids=source, decoder_input_ids=target).logits
        incremental = incremental_logits(model, source, target, cache=cache)
    torch.testing.assert_close(incremental, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("options", [dict(do_sample=False), dict(do_sample=True, top_k=5)])
def test_static_cache_decoding_step_compiles_into_one_graph(options):
    """What `generate()` compiles on a GPU — the decoding step with a static cache — traces as one graph
    (`fullgraph=True` turns any graph break into an error) and gives the default cache's tokens. The "eager"
    backend checks the capture without compiling code, so this runs on a CPU in seconds."""
    torch._dynamo.reset()
    model = tiny_model()
    source, _ = batch()
    compile_config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    compile_config._compile_all_devices = True  # generate() compiles only on accelerators unless told
    torch.manual_seed(5)
    default = model.generate(source, max_new_tokens=8, **options)
    torch.manual_seed(5)
    compiled = model.generate(
        source, max_new_tokens=8, cache_implementation="static", compile_config=compile_config, **options
    )
    assert hasattr(model, "_compiled_call")
    assert torch.equal(compiled, default)


@pytest.mark.parametrize("prepack", [True, False], ids=["packed", "transposed-product"])
def test_vocabulary_projection_equals_linear_with_and_without_gradients(prepack, monkeypatch):
    import flexformers.modeling.cpu_kernels as kernels

    monkeypatch.setattr(kernels, "PREPACK_INFERENCE_WEIGHTS", prepack and kernels.PREPACK_INFERENCE_WEIGHTS)
    torch.manual_seed(0)
    projection = torch.nn.Linear(16, 50, bias=True)
    for rows in (1, 7, 200):  # below and above the transposed-product threshold
        hidden = torch.randn(rows, 1, 16)
        reference = torch.nn.functional.linear(hidden, projection.weight, projection.bias)
        with torch.no_grad():
            fast = project_vocabulary(projection, hidden)
        assert fast.shape == reference.shape and fast.is_contiguous()
        assert torch.allclose(fast, reference, atol=1e-5)
    hidden = torch.randn(4, 3, 16, requires_grad=True)
    project_vocabulary(projection, hidden).sum().backward()
    assert hidden.grad is not None and projection.weight.grad is not None


# ---- seams -----------------------------------------------------------------------------------------------------------


def test_branch_merge_with_one_branch_is_nn_linear():
    torch.manual_seed(0)
    merge, branch_biases = merge_projection(1, 8, 5)
    assert type(merge) is torch.nn.Linear and branch_biases is None
    torch.nn.init.normal_(merge.weight)
    torch.nn.init.normal_(merge.bias)
    x = torch.randn(2, 3, 1, 8)
    assert torch.equal(merge_branches(merge, None, x), torch.nn.functional.linear(x[:, :, 0], merge.weight, merge.bias))
    weights = torch.tensor([[0.5], [2.0]])  # one weight per row: w (x W + b)
    torch.testing.assert_close(merge_branches(merge, None, x, weights), weights[:, :, None] * merge(x[:, :, 0]))


def test_branch_merge_is_the_weighted_sum_of_branch_linears():
    torch.manual_seed(0)
    projection, bias = merge_projection(3, 4, 5)
    assert type(projection) is torch.nn.Linear and projection.bias is None and bias.shape == (3, 5)
    torch.nn.init.normal_(projection.weight)
    torch.nn.init.normal_(bias)

    def merge(x, weights=None):
        return merge_branches(projection, bias, x, weights)

    def branch_weight(b):
        return projection.weight[:, b * 4 : (b + 1) * 4]

    x = torch.randn(2, 6, 3, 4)
    weights = torch.tensor([0.5, 0.0, 2.0])
    expected = sum(weights[b] * (x[:, :, b] @ branch_weight(b).T + bias[b]) for b in range(3))
    torch.testing.assert_close(merge(x, weights), expected, atol=1e-5, rtol=1e-5)
    per_row = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    out = merge(x, per_row)
    torch.testing.assert_close(out[0], x[0, :, 0] @ branch_weight(0).T + bias[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], x[1, :, 2] @ branch_weight(2).T + bias[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merge(x), merge(x, torch.full((3,), 1 / 3)), atol=1e-6, rtol=1e-6)


def test_branched_attention_equals_average_of_independent_attentions():
    """The MAT seam: B branches in one fused call = the average of B separate single-branch attentions."""
    branched = tiny_model(seed=3, decoder_attention_branches=2, encoder_attention_branches=2)
    source, target = batch()
    singles = []
    for branch in range(2):
        single = tiny_model(seed=4)
        state = single.state_dict()
        for name, value in branched.state_dict().items():
            if any(p in name for p in ("q_proj", "k_proj", "v_proj")):
                d = value.shape[0] // 2
                state[name] = value[branch * d : (branch + 1) * d].clone()
            elif "out_proj.weight" in name:
                d = value.shape[1] // 2
                state[name] = value[:, branch * d : (branch + 1) * d].clone()
            elif "out_proj_branch_bias" in name:
                state[name.replace("out_proj_branch_bias", "out_proj.bias")] = value[branch].clone()
            else:
                state[name] = value.clone()
        single.load_state_dict(state)
        singles.append(single)
    attention = branched.model.encoder.layers[0].self_attn
    x = torch.randn(3, 7, 32)
    expected = sum(s.model.encoder.layers[0].self_attn(x)[0] for s in singles) / 2
    torch.testing.assert_close(attention(x)[0], expected, atol=1e-5, rtol=1e-5)


def test_relative_position_bias_seam_changes_the_logits():
    model = tiny_model()
    source, target = batch()
    attention = model.model.decoder.layers[0].self_attn
    with torch.no_grad():
        plain = model(input_ids=source, decoder_input_ids=target).logits
        attention.relative_position_bias = lambda query, rows=None, **kw: torch.zeros(
            query.shape[0], query.shape[1], query.shape[2], query.shape[2]
        )
        zero_bias = model(input_ids=source, decoder_input_ids=target).logits
        attention.relative_position_bias = lambda query, rows=None, **kw: torch.randn(
            query.shape[0], query.shape[1], query.shape[2], query.shape[2]
        )
        random_bias = model(input_ids=source, decoder_input_ids=target).logits
    torch.testing.assert_close(zero_bias, plain, atol=1e-5, rtol=0)
    assert not torch.allclose(random_bias, plain, atol=1e-3)


def test_decoder_without_absolute_positions_is_order_blind_for_a_bag():
    """InDIGO's seam: with no positions and no relative bias, self-attention cannot see where tokens are."""
    model = tiny_model(decoder_use_positions=False, encoder_use_positions=False)
    assert model.model.decoder.embed_positions is None
    source = torch.tensor([[7, 8, 9, 10]])
    with torch.no_grad():
        a = model.model.encoder(input_ids=source).last_hidden_state
        b = model.model.encoder(input_ids=source.flip(1)).last_hidden_state
    torch.testing.assert_close(a.flip(1), b, atol=1e-5, rtol=0)


ORDERS = [("self_attn", "encoder_attn", "ffn"), ("ffn", "self_attn", "encoder_attn"), ("encoder_attn", "ffn", "self_attn")]


def test_sublayer_order_is_data_and_changes_the_function():
    model = tiny_model()
    source, target = batch()
    with torch.no_grad():
        default = model(input_ids=source, decoder_input_ids=target).logits
        explicit = model(input_ids=source, decoder_input_ids=target, decoder_sublayer_order=ORDERS[0]).logits
        other = model(input_ids=source, decoder_input_ids=target, decoder_sublayer_order=ORDERS[1]).logits
    assert torch.equal(default, explicit)
    assert not torch.allclose(default, other, atol=1e-3)
    with pytest.raises(ValueError, match="permutation"):
        model(input_ids=source, decoder_input_ids=target, decoder_sublayer_order=("ffn", "ffn", "self_attn"))


def test_per_row_plan_is_a_shortest_common_supersequence_of_the_orders():
    """Each row runs its sub-layers in its own order, each once; the steps are a shortest common supersequence
    (IOT's default 4 decoder orders: 5 calls per block instead of 8 stage by stage; all 6 orders: 7)."""
    import itertools

    from flexformers.configuration.configuration_iot import DECODER_ORDER_CODES
    from flexformers.modeling.sublayer_order import shortest_common_schedule

    def contains(schedule, order):
        remaining = iter(schedule)
        return all(name in remaining for name in order)

    default = [DECODER_ORDER_CODES[code] for code in (1, 2, 4, 6)]
    every = list(DECODER_ORDER_CODES.values())
    for orders, length in ((default, 5), (every, 7), (default[:1], 3), (default[:2], 4)):
        schedule = shortest_common_schedule(orders)
        assert len(schedule) == length and all(contains(schedule, order) for order in orders)
        names = sorted(set(orders[0]))
        shorter = itertools.product(names, repeat=length - 1)
        assert not any(all(contains(candidate, order) for order in orders) for candidate in shorter)
    per_row = PerRowSublayerOrder(torch.tensor([0, 0, 1, 2, 3, 3, 1]), default)
    applied = {row: [] for row in range(7)}
    for step in per_row.stage_plan:
        for name, rows in step:
            chosen = range(7) if rows is None else (range(7)[rows] if isinstance(rows, slice) else rows.tolist())
            for row in chosen:
                applied[row].append(name)
    assert len(per_row.stage_plan) == 5
    assert all(tuple(applied[row]) == default[int(per_row.order_index[row])] for row in range(7))


@pytest.mark.parametrize("cache_kind", ["preallocated", "dynamic"])
def test_per_row_orders_equal_each_row_alone_full_and_incremental(cache_kind):
    """Row blocks write into the `PreallocatedKVLayer`'s own buffer (the default cache) or into a per-step copy of
    the past (a plain `DynamicCache`); both equal the full forward."""
    model = tiny_model()
    source, target = batch()
    per_row = PerRowSublayerOrder(torch.tensor([1, 0, 2]), ORDERS)
    encoder_per_row = PerRowSublayerOrder(torch.tensor([1, 1, 0]), [("self_attn", "ffn"), ("ffn", "self_attn")])
    with torch.no_grad():
        together = model(
            input_ids=source, decoder_input_ids=target, decoder_sublayer_order=per_row,
            encoder_sublayer_order=encoder_per_row,
        ).logits
        for row in range(3):
            alone = model(
                input_ids=source[row : row + 1],
                decoder_input_ids=target[row : row + 1],
                decoder_sublayer_order=ORDERS[int(per_row.order_index[row])],
                encoder_sublayer_order=encoder_per_row.orders[int(encoder_per_row.order_index[row])],
            ).logits
            torch.testing.assert_close(together[row : row + 1], alone, atol=1e-5, rtol=0)
        if cache_kind == "dynamic":
            cache = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
        else:
            cache = new_decoder_cache(model.config)
        incremental = incremental_logits(model, source, target, cache=cache, decoder_sublayer_order=per_row)
        full = model(input_ids=source, decoder_input_ids=target, decoder_sublayer_order=per_row).logits
    expected_layer = DynamicLayer if cache_kind == "dynamic" else PreallocatedKVLayer
    assert all(type(layer) is expected_layer for layer in cache.self_attention_cache.layers)
    assert cache.get_seq_length() == target.shape[1]
    torch.testing.assert_close(incremental, full, atol=1e-5, rtol=0)


def test_step_kv_collector_refuses_a_partial_write():
    model = tiny_model()
    source, target = batch()
    out = model(input_ids=source, decoder_input_ids=target[:, :1], use_cache=True)
    collector = StepKVCollector(output_cache(out).self_attention_cache, 0, 3)
    keys = torch.zeros(1, 4, 1, 8)
    collector.add(torch.tensor([0]), keys, keys)
    with pytest.raises(RuntimeError, match="every row"):
        collector.flush()


def _cache_after_steps_and_a_copy(model, steps: int):
    """The model's decoding cache after `steps` target tokens, and an independent `DynamicCache` copy of it."""
    source, target = batch()
    cache = output_cache(model(input_ids=source, decoder_input_ids=target[:, :steps], use_cache=True))
    reference_cache = type(cache)(DynamicCache(), DynamicCache())
    for idx, layer in enumerate(cache.self_attention_cache.layers):
        reference_cache.self_attention_cache.update(layer.keys.clone(), layer.values.clone(), idx)
    return cache, reference_cache


def test_row_subset_attention_with_collector_equals_full_batch_step():
    """The Depth-Adaptive / IOT primitive: attending for two row subsets with deferred cache writes gives the
    same outputs and the same cache as one full-batch step."""
    model = tiny_model()
    with torch.no_grad():
        cache, reference_cache = _cache_after_steps_and_a_copy(model, 1)
        attention = model.model.decoder.layers[0].self_attn
        x = torch.randn(3, 1, 32)
        expected, _ = attention(x, past_key_values=reference_cache)
        collector = StepKVCollector(cache.self_attention_cache, 0, 3)
        rows_a, rows_b = torch.tensor([2, 0]), torch.tensor([1])
        out_a, _ = attention(x[rows_a], past_key_values=cache, rows=rows_a, kv_collector=collector)
        out_b, _ = attention(x[rows_b], past_key_values=cache, rows=rows_b, kv_collector=collector)
        collector.flush()
    torch.testing.assert_close(out_a, expected[rows_a], atol=1e-6, rtol=0)
    torch.testing.assert_close(out_b, expected[rows_b], atol=1e-6, rtol=0)
    torch.testing.assert_close(
        cache.self_attention_cache.layers[0].keys, reference_cache.self_attention_cache.layers[0].keys
    )


def test_collector_writes_an_all_rows_stage_in_place_into_the_preallocated_cache():
    """A stage that every row runs (`rows=None`, e.g. IOT's shared self-attention slot) attends over a view of the
    cache's own buffer — no concatenated copy of the past — and leaves the same cache and outputs as a plain step."""
    model = tiny_model()
    with torch.no_grad():
        cache, reference_cache = _cache_after_steps_and_a_copy(model, 2)
        layer = cache.self_attention_cache.layers[0]
        assert isinstance(layer, PreallocatedKVLayer)
        attention = model.model.decoder.layers[0].self_attn
        x = torch.randn(3, 1, 32)
        expected, _ = attention(x, past_key_values=reference_cache)
        collector = StepKVCollector(cache.self_attention_cache, 0, 3)
        keys, values = attention.project_key_value(x)
        full_keys, _, past_length = collector.extend(None, keys, values)
        assert past_length == 2 and full_keys.data_ptr() == layer._key_buffer.data_ptr()
        collector = StepKVCollector(cache.self_attention_cache, 0, 3)
        out, _ = attention(x, past_key_values=cache, kv_collector=collector)
        collector.flush()
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(layer.keys, reference_cache.self_attention_cache.layers[0].keys)
    assert layer.get_seq_length() == 3


def test_whole_groups_recognises_all_beams_of_some_sentences():
    from flexformers.modeling.kv_caches import whole_groups

    assert torch.equal(whole_groups(torch.tensor([3, 4, 5, 9, 10, 11]), 3), torch.tensor([1, 3]))
    assert whole_groups(torch.tensor([3, 4, 5, 9, 10]), 3) is None  # a partial sentence
    assert whole_groups(torch.tensor([4, 5, 6]), 3) is None  # straddles two sentences
    assert whole_groups(torch.tensor([5, 4, 3]), 3) is None  # beams out of order
    assert whole_groups(torch.tensor([], dtype=torch.long), 3) is None
    rows = torch.tensor([0, 1, 2])
    assert torch.equal(whole_groups(rows, 3), torch.tensor([0])) and whole_groups(rows, 2) is None
    rows[0] = 2  # the remembered answer follows in-place changes of the same tensor
    assert whole_groups(rows, 3) is None


def test_decoder_pieces_compose_to_forward():
    """`embed` → `run_layer`… → `finalize` is the decoder's forward (the Depth-Adaptive seam)."""
    model = tiny_model(decoder_normalize_before=True)
    source, target = batch()
    with torch.no_grad():
        encoder_out = model.model.encoder(input_ids=source).last_hidden_state
        decoder = model.model.decoder
        hidden = decoder.embed(target)
        from flexformers.modeling.modeling_flexformer import padding_mask

        cross_mask = padding_mask(source.ne(PAD).long(), hidden.dtype)
        for idx in range(len(decoder.layers)):
            hidden, _, _ = decoder.run_layer(
                idx, hidden, encoder_hidden_states=encoder_out, encoder_attention_mask=cross_mask
            )
        manual = model.lm_head(decoder.finalize(hidden))
        reference = model(input_ids=source, decoder_input_ids=target).logits
    torch.testing.assert_close(manual, reference, atol=1e-6, rtol=0)


def test_layerdrop_only_while_training():
    model = tiny_model(decoder_layerdrop=0.5, encoder_layerdrop=0.5)
    source, target = batch()
    with torch.no_grad():
        a = model(input_ids=source, decoder_input_ids=target).logits
        b = model(input_ids=source, decoder_input_ids=target).logits
    assert torch.equal(a, b)
    model.train()
    torch.manual_seed(0)
    outputs = {model(input_ids=source, decoder_input_ids=target).logits.sum().item() for _ in range(8)}
    assert len(outputs) > 1


def test_source_grouped_cache_equals_per_row_cross_attention(tmp_path):
    """Beam search's copies of a source share one set of cross-attention keys/values (SourceGroupedCache);
    logits and attention weights equal the standard per-row cache, and reordering beams leaves them valid."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    from flexformers.modeling.kv_caches import SourceGroupedCache

    tiny_model().save_pretrained(tmp_path)
    model = FlexformerForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager").eval()
    source, target = batch()
    group = 2
    source = source.repeat_interleave(group, dim=0)
    target = target.repeat_interleave(group, dim=0)
    caches = {
        "standard": EncoderDecoderCache(DynamicCache(), DynamicCache()),
        "grouped": SourceGroupedCache(DynamicCache(), DynamicCache(), group_size=group),
    }
    outputs = {}
    with torch.no_grad():
        for name, cache in caches.items():
            step_logits, cross = [], []
            encoder = None
            for t in range(3):
                out = model(
                    input_ids=source if encoder is None else None,
                    encoder_outputs=encoder,
                    attention_mask=source.ne(PAD).long(),
                    decoder_input_ids=target[:, t : t + 1],
                    past_key_values=cache,
                    use_cache=True,
                    output_attentions=True,
                )
                encoder = (out.encoder_last_hidden_state,)
                step_logits.append(out.logits)
                cross.append(out.cross_attentions[0])
                cache.reorder_cache(torch.tensor([1, 0, 2, 3, 5, 4]))
            outputs[name] = (torch.cat(step_logits, 1), torch.cat(cross, 2))
    assert caches["grouped"].cross_attention_cache.layers[0].keys.shape[0] == source.shape[0] // group
    torch.testing.assert_close(outputs["grouped"][0], outputs["standard"][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(outputs["grouped"][1], outputs["standard"][1], atol=1e-6, rtol=0)


def test_grouped_beam_queries_take_the_same_values_with_products_or_sdpa():
    """On CPU the folded beam queries of a SourceGroupedCache use the two batched products instead of SDPA; both
    give the same beam search."""
    from flexformers.modeling.modeling_flexformer import FlexformerAttention

    model = tiny_model()
    source, _ = batch()
    options = dict(num_beams=3, max_new_tokens=5, min_new_tokens=5, return_dict_in_generate=True, output_scores=True)
    results = {}
    try:
        for products in (True, False):
            FlexformerAttention.grouped_queries_use_products = products
            with torch.no_grad():
                results[products] = model.generate(source, **options)
    finally:
        FlexformerAttention.grouped_queries_use_products = True
    assert torch.equal(results[True].sequences, results[False].sequences)
    for with_products, with_sdpa in zip(results[True].scores, results[False].scores):
        torch.testing.assert_close(with_products, with_sdpa, atol=1e-5, rtol=1e-5)


def test_generate_infers_the_source_padding_mask():
    """Without an explicit attention_mask, a padded sentence gets exactly the scores it gets alone."""
    model = tiny_model()
    source, _ = batch()
    options = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)
    together = model.generate(source, **options)
    length = int(source[-1].ne(PAD).sum())
    alone = model.generate(source[-1:, :length], **options)
    assert torch.equal(together.sequences[-1:], alone.sequences)
    for step_together, step_alone in zip(together.scores, alone.scores):
        torch.testing.assert_close(step_together[-1:], step_alone, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------- prepacked weights


@pytest.fixture
def always_prepack(monkeypatch):
    """Take the prepacked oneDNN path for every inference linear (tiny weights never pay on their own)."""
    import flexformers.modeling.cpu_kernels as backbone

    if not backbone._prepacking_possible():
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setattr(backbone, "PREPACK_INFERENCE_WEIGHTS", True)
    monkeypatch.setattr(backbone, "_prepacking_pays", lambda rows, weight: True)
    return backbone


def test_prepacked_inference_equals_plain_linear(always_prepack):
    """Forward logits and greedy/beam generation are those of F.linear; the packed copies live outside the
    model (state dict unchanged, deepcopy works) and gradients never take the packed path."""
    import copy

    model = tiny_model()
    source, target = batch()
    with torch.no_grad():
        packed_logits = model(input_ids=source, decoder_input_ids=target).logits
        packed_greedy = model.generate(source, max_new_tokens=6, min_new_tokens=6)
        packed_beam = model.generate(source, max_new_tokens=6, num_beams=3)
    assert len(always_prepack._PACKED_WEIGHTS) > 0
    always_prepack.PREPACK_INFERENCE_WEIGHTS = False
    with torch.no_grad():
        plain_logits = model(input_ids=source, decoder_input_ids=target).logits
        assert torch.equal(model.generate(source, max_new_tokens=6, min_new_tokens=6), packed_greedy)
        assert torch.equal(model.generate(source, max_new_tokens=6, num_beams=3), packed_beam)
    torch.testing.assert_close(packed_logits, plain_logits, atol=1e-5, rtol=1e-5)
    assert not any("pack" in key for key in model.state_dict())
    copy.deepcopy(model)
    always_prepack.PREPACK_INFERENCE_WEIGHTS = True
    model.train()
    loss = model(input_ids=source, labels=target).loss
    loss.backward()
    assert model.model.decoder.layers[0].self_attn.q_proj.weight.grad is not None


@pytest.mark.parametrize("optimizer", [
    lambda parameters: torch.optim.SGD(parameters, lr=0.5),
    # the Trainer's default (adamw_torch_fused): writes the weights without bumping their version counters
    lambda parameters: torch.optim.AdamW(parameters, lr=0.05, fused=True),
    lambda parameters: torch.optim.AdamW(parameters, lr=0.05, foreach=True),
], ids=["sgd", "adamw-fused", "adamw-foreach"])
def test_prepacked_weights_follow_in_place_updates(always_prepack, optimizer):
    """An optimizer step changes the weights in place: the next inference call repacks them — also after a fused
    optimizer's step, which leaves the version counters alone (so evaluations during training see the new weights)."""
    model = tiny_model()
    source, target = batch()
    with torch.no_grad():
        model(input_ids=source, decoder_input_ids=target)  # packs
    model.train()
    model(input_ids=source, labels=target).loss.backward()
    optimizer(model.parameters()).step()
    model.eval()
    with torch.no_grad():
        packed = model(input_ids=source, decoder_input_ids=target).logits
        always_prepack.PREPACK_INFERENCE_WEIGHTS = False
        plain = model(input_ids=source, decoder_input_ids=target).logits
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)


def test_weights_version_changes_with_every_kind_of_in_place_update():
    """The key of the copies made from weights (packed products, Depth-Adaptive's fused K/V): a fused optimizer step
    leaves the version counter as it was, so the key also counts optimizer steps."""
    from flexformers.modeling.cpu_kernels import weights_version

    weight = torch.nn.Parameter(torch.randn(4, 4))
    weight.grad = torch.randn(4, 4)
    before = weights_version(weight)
    version = weight._version
    torch.optim.AdamW([weight], lr=0.1, fused=True).step()
    assert weight._version == version  # what makes the version counter alone insufficient
    assert weights_version(weight) != before
    after_step = weights_version(weight)
    with torch.no_grad():
        weight.mul_(2)
    assert weights_version(weight) != after_step


def test_self_attention_projections_run_as_one_packed_product(always_prepack):
    """q, k, v of a decoding step come from one packed product over the three weights side by side: equal to the
    three separate products, repacked after an in-place update of any one weight or bias, and not used for a
    projection with a hook or its own `forward` (an adapter's or offloader's forward must run)."""
    attention = tiny_model().model.decoder.layers[0].self_attn
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    hidden = torch.randn(4, 1, attention.embed_dim)

    def separate():
        return [torch.nn.functional.linear(hidden, p.weight, p.bias) for p in projections]

    with torch.no_grad():
        fused = always_prepack.fused_linears(attention, hidden, projections)
        assert always_prepack._PACKED_WEIGHTS[attention][1] is not None  # the fused path ran
        for got, expected in zip(fused, separate()):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        attention.k_proj.weight.add_(0.5)
        attention.v_proj.bias.add_(1.0)
        for got, expected in zip(always_prepack.fused_linears(attention, hidden, projections), separate()):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        calls = []
        handle = attention.v_proj.register_forward_hook(lambda module, args, output: calls.append(1))
        always_prepack.fused_linears(attention, hidden, projections)
        handle.remove()
        plain_forward = attention.k_proj.forward
        attention.k_proj.forward = lambda x: calls.append(2) or plain_forward(x)  # as accelerate's hooks do
        always_prepack.fused_linears(attention, hidden, projections)
    assert calls == [1, 2]


def test_a_weight_onednn_cannot_pack_falls_back_to_plain_products(always_prepack, monkeypatch):
    def refuse(weight, rows):
        raise RuntimeError("unsupported layout")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    model = tiny_model()
    source, target = batch()
    with torch.no_grad():
        fallback = model(input_ids=source, decoder_input_ids=target).logits
        always_prepack.PREPACK_INFERENCE_WEIGHTS = False
        plain = model(input_ids=source, decoder_input_ids=target).logits
    assert torch.equal(fallback, plain)


# ---- boundaries and seams the mutation run found untested ----------------------------------------------------------


def test_learned_positions_cover_exactly_max_positions_tokens():
    """fairseq's learned table has `max_positions + padding_idx + 1` rows (its checkpoints' shape): a sentence of
    exactly `max_positions` tokens, at once or one step at a time, gets the rows after the padding row; one token
    more is a clear error. The sinusoidal table grows past its initial size with the same values."""
    from flexformers.modeling.positional_embeddings import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding

    torch.manual_seed(0)
    learned = LearnedPositionalEmbedding(max_positions=5, embedding_dim=4, padding_idx=PAD)
    assert learned.weight.shape == (5 + PAD + 1, 4)
    tokens = torch.full((1, 5), 7)
    torch.testing.assert_close(learned(tokens)[0], learned.weight[PAD + 1 : PAD + 6], rtol=0, atol=0)
    torch.testing.assert_close(learned(tokens[:, :1], past_length=4)[0], learned.weight[PAD + 5 :], rtol=0, atol=0)
    with pytest.raises(ValueError, match="length 6 exceeds the 5 learned positions"):
        learned(torch.full((1, 6), 7))
    with pytest.raises(ValueError, match="length 6 exceeds the 5 learned positions"):
        learned(tokens[:, :1], past_length=5)
    sinusoidal = SinusoidalPositionalEmbedding(6, PAD, init_size=5)
    table = sinusoidal_table(5 + PAD + 2, 6, PAD)
    torch.testing.assert_close(sinusoidal(torch.full((1, 5), 7))[0], table[PAD + 1 : PAD + 6], rtol=0, atol=0)
    torch.testing.assert_close(sinusoidal(tokens[:, :1], past_length=5)[0], table[PAD + 6 :], rtol=0, atol=0)


@pytest.mark.parametrize("side", ["source", "target"])
def test_a_sentence_of_exactly_max_positions_tokens_runs_with_learned_positions(side):
    model = tiny_model(
        encoder_learned_pos=True, decoder_learned_pos=True, max_source_positions=7, max_target_positions=6
    )
    source, target = batch(src_len=7, tgt_len=6)
    with torch.no_grad():
        assert model(input_ids=source, decoder_input_ids=target).logits.shape == (3, 6, 60)
        longer = {"source": {"input_ids": torch.cat([source, source[:, :1]], dim=1), "decoder_input_ids": target},
                  "target": {"input_ids": source, "decoder_input_ids": torch.cat([target, target[:, :1]], dim=1)}}
        field = "max_source_positions" if side == "source" else "max_target_positions"
        with pytest.raises(ValueError, match=field):
            model(**longer[side])


@pytest.mark.parametrize("mean_resizing", [True, False])
@pytest.mark.parametrize("vocabulary", ["shared", "separate target"])
def test_resizing_honours_mean_resizing_for_the_decoder_table_and_projection(vocabulary, mean_resizing):
    """Transformers' `mean_resizing` (the default): added rows of the decoder table and of the (untied) output
    projection start at the mean of the old rows, so the new words do not shift the output distribution;
    `mean_resizing=False` draws them from the model's own initialisation instead."""
    model = tiny_model(target_vocab_size=50 if vocabulary == "separate target" else None)
    table, projection = model.get_decoder().embed_tokens, model.get_output_embeddings()
    old_table, old_projection = table.weight.detach().clone(), projection.weight.detach().clone()
    old_size = old_table.shape[0]
    new_size = old_size + 6
    if vocabulary == "shared":
        model.resize_token_embeddings(new_size, **({} if mean_resizing else {"mean_resizing": False}))
    else:
        model.resize_decoder_token_embeddings(new_size, **({} if mean_resizing else {"mean_resizing": False}))
    assert projection.weight.shape[0] == model.get_decoder().embed_tokens.weight.shape[0] == new_size
    for resized, old in ((model.get_decoder().embed_tokens.weight, old_table), (projection.weight, old_projection)):
        torch.testing.assert_close(resized[:old_size], old, rtol=0, atol=0)
        added = resized[old_size:].detach()
        at_mean = torch.allclose(added, old.mean(0).expand_as(added), atol=1e-3, rtol=0)
        assert at_mean == mean_resizing


def test_collector_hands_its_step_buffer_to_a_dynamic_layer_without_another_copy():
    """Row blocks of a step over a plain `DynamicCache` write into one buffer holding past + new: `flush` makes that
    buffer the layer's keys/values (no second concatenation of the past), and the cache equals a plain step's."""
    model = tiny_model()
    with torch.no_grad():
        _, dynamic = _cache_after_steps_and_a_copy(model, 2)
        layer = dynamic.self_attention_cache.layers[0]
        assert type(layer) is DynamicLayer and layer.get_seq_length() == 2
        reference = DynamicCache()
        reference.update(layer.keys.clone(), layer.values.clone(), 0)
        attention = model.model.decoder.layers[0].self_attn
        keys, values = attention.project_key_value(torch.randn(3, 1, 32))
        collector = StepKVCollector(dynamic.self_attention_cache, 0, 3)
        full_keys, full_values, past_length = collector.extend(slice(0, 2), keys[:2], values[:2])
        collector.extend(slice(2, 3), keys[2:], values[2:])
        collector.flush()
    reference.update(keys, values, 0)
    assert past_length == 2
    assert layer.keys.data_ptr() == full_keys.data_ptr() and layer.values.data_ptr() == full_values.data_ptr()
    assert torch.equal(layer.keys, reference.layers[0].keys) and torch.equal(layer.values, reference.layers[0].values)


def test_masked_plan_gives_the_row_plans_outputs_and_attention_weights():
    """The plan `torch.export` gets (every step on every row, kept in the rows whose next sub-layer it is, by a
    boolean row mask) gives the eager row plan's logits and, row by row, the attention weights of the sub-layer each
    row ran — not another row's, not zeros."""
    model = tiny_model()
    source, target = batch()

    def orders():
        return (PerRowSublayerOrder(torch.tensor([1, 0, 2]), ORDERS),
                PerRowSublayerOrder(torch.tensor([1, 1, 0]), [("self_attn", "ffn"), ("ffn", "self_attn")]))

    outputs = []
    for masked in (False, True):
        decoder_order, encoder_order = orders()
        if masked:
            for order in (decoder_order, encoder_order):
                order._plan = order._masked_plan()
                assert any(isinstance(rows, torch.Tensor) and rows.dtype == torch.bool
                           for step in order.stage_plan for _, rows in step)
        with torch.no_grad():
            outputs.append(model(
                input_ids=source, decoder_input_ids=target, decoder_sublayer_order=decoder_order,
                encoder_sublayer_order=encoder_order, output_attentions=True,
            ))
    rows_plan, masked_plan = outputs
    torch.testing.assert_close(masked_plan.logits, rows_plan.logits, atol=1e-5, rtol=0)
    for name in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        for expected, got in zip(getattr(rows_plan, name), getattr(masked_plan, name), strict=True):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
            torch.testing.assert_close(got.sum(-1), torch.ones_like(got.sum(-1)), atol=1e-5, rtol=0)


def test_packed_products_are_on_by_default_where_onednn_packs_and_multiplies(monkeypatch):
    """The CPU fast path's condition is this torch build's oneDNN packing a weight and multiplying by it: where it
    does, prepacking is possible and on by default, and a decoding step's product over a 512×512 weight takes the
    packed path (same values as `F.linear`); without oneDNN it is off."""
    import flexformers.modeling.cpu_kernels as kernels

    torch.manual_seed(0)
    layer, inputs = torch.nn.Linear(512, 512), torch.randn(4, 512)
    with torch.no_grad():
        plain = torch.nn.functional.linear(inputs, layer.weight, layer.bias)
        try:
            packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight, 4)
            by_onednn = torch.ops.mkldnn._linear_pointwise(inputs, packed_weight, layer.bias, "none", [], "")
        except (AttributeError, RuntimeError):
            by_onednn = None
    if not torch.backends.mkldnn.is_available() or by_onednn is None:
        pytest.skip("this torch build cannot pack a linear weight with oneDNN")
    torch.testing.assert_close(by_onednn, plain, atol=1e-5, rtol=1e-5)
    assert kernels._prepacking_possible() and kernels.PREPACK_INFERENCE_WEIGHTS
    with torch.no_grad():
        torch.testing.assert_close(kernels.linear(layer, inputs, layer.weight, layer.bias), plain, atol=1e-5, rtol=1e-5)
    assert kernels._PACKED_WEIGHTS[layer][1] is not None  # the packed path ran
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not kernels._prepacking_possible()


def test_resizing_pads_the_target_vocabulary_to_the_multiple_asked_for():
    """`pad_to_multiple_of` reaches every target-side table: the decoder table, the output projection and the config
    (a shared vocabulary through `resize_token_embeddings`, a separate one through `resize_decoder_token_embeddings`)."""
    shared = tiny_model()
    shared.resize_token_embeddings(61, pad_to_multiple_of=8, mean_resizing=False)
    separate = tiny_model(target_vocab_size=50)
    separate.resize_decoder_token_embeddings(53, pad_to_multiple_of=8, mean_resizing=False)
    for model, size_field, padded in ((shared, "vocab_size", 64), (separate, "target_vocab_size", 56)):
        assert model.get_decoder().embed_tokens.weight.shape[0] == padded
        assert model.get_output_embeddings().weight.shape[0] == padded
        assert getattr(model.config, size_field) == padded
    assert separate.get_encoder().embed_tokens.weight.shape[0] == 60


def test_a_model_built_under_a_device_context_has_every_weight_on_that_device():
    """Transformers builds a model under `with torch.device("meta")` while it loads, and users build under
    `with torch.device("cuda")`: every parameter and buffer must follow the context (the merge projections are
    allocated without their own random draws, which must not pin them to the CPU)."""
    with torch.device("meta"):
        model = FlexformerForConditionalGeneration(FlexformerConfig(**tiny_config_kwargs()))
    elsewhere = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()]
                 if tensor.device.type != "meta"]
    assert not elsewhere
