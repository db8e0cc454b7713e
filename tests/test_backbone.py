"""The baseline model: fairseq semantics, Transformers conventions, and the seams the methods extend."""

import math

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSeq2SeqLM,
)
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
)

import flexformers  # noqa: F401  (registers the model types)
from flexformers.configuration import PRESETS, FlexformerConfig
from flexformers.modeling.cpu_kernels import (
    dropout,
    scaled_keep_mask,
)
from flexformers.modeling.kv_caches import (
    StepKVCollector,
)
from flexformers.modeling.losses import label_smoothed_nll_loss, token_loss_terms
from flexformers.modeling.modeling_flexformer import (
    FlexformerForConditionalGeneration,
    FlexformerModel,
)
from flexformers.modeling.positional_embeddings import (
    make_positions,
    sinusoidal_table,
)
from flexformers.modeling.sublayer_order import PerRowSublayerOrder
from flexformers.modeling.transformers_compat import output_cache
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


ORDERS = [("self_attn", "encoder_attn", "ffn"), ("ffn", "self_attn", "encoder_attn"), ("encoder_attn", "ffn", "self_attn")]


def _cache_after_steps_and_a_copy(model, steps: int):
    """The model's decoding cache after `steps` target tokens, and an independent `DynamicCache` copy of it."""
    source, target = batch()
    cache = output_cache(model(input_ids=source, decoder_input_ids=target[:, :steps], use_cache=True))
    reference_cache = type(cache)(DynamicCache(), DynamicCache())
    for idx, layer in enumerate(cache.self_attention_cache.layers):
        reference_cache.self_attention_cache.update(layer.keys.clone(), layer.values.clone(), idx)
    return cache, reference_cache


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


def test_the_model_type_check_reads_the_config_with_the_callers_loading_options(tmp_path, monkeypatch):
    """`from_pretrained` checks the checkpoint's model type from its config with the caller's own loading options: a
    caller who asked for local files only, a revision, a subfolder or a cache folder gets the check done that way
    too (it is not sent to the network, nor to another folder)."""
    from transformers import PreTrainedConfig

    tiny_model().save_pretrained(tmp_path / "checkpoint" / "sub")
    original = PreTrainedConfig.get_config_dict.__func__
    seen = []

    def recording(cls, path, **kwargs):
        seen.append(dict(kwargs))
        return original(cls, path, **kwargs)

    monkeypatch.setattr(PreTrainedConfig, "get_config_dict", classmethod(recording))
    options = dict(local_files_only=True, revision="main", subfolder="sub", cache_dir=str(tmp_path / "cache"))
    FlexformerForConditionalGeneration.from_pretrained(tmp_path / "checkpoint", **options)
    assert seen and {key: seen[0].get(key) for key in options} == options


def test_label_smoothed_loss_of_a_single_kept_token_is_that_tokens_loss():
    """Averaged over the kept tokens: one kept token is divided by one (the count is clamped only to avoid 0 / 0
    for a batch of padding)."""
    torch.manual_seed(1)
    logits = torch.randn(1, 3, 7)
    labels = torch.tensor([[4, -100, -100]])
    loss, nll = label_smoothed_nll_loss(logits, labels, 0.0)
    expected = -torch.log_softmax(logits[0, 0], -1)[4]
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6) and nll.item() == pytest.approx(expected.item(), rel=1e-6)
    empty_loss, _ = label_smoothed_nll_loss(logits, torch.full((1, 3), -100), 0.1)
    assert empty_loss.item() == 0.0


def test_token_loss_terms_stay_finite_for_rows_of_far_apart_scales():
    """Each row is normalised by its own maximum: a row whose logits lie thousands below another's still gets its
    exact log-softmax terms (one maximum for the whole batch would underflow it to log 0)."""
    torch.manual_seed(2)
    logits = torch.randn(2, 9, dtype=torch.float64)
    logits[0] += 3000.0
    logits[1] -= 3000.0
    labels = torch.tensor([3, 5])
    loss, nll = label_smoothed_nll_loss(logits, labels, 0.0)
    expected = torch.nn.functional.cross_entropy(logits, labels)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(expected.item(), rel=1e-9)
    assert nll.item() == pytest.approx(expected.item(), rel=1e-9)


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
    old_source_table = model.get_input_embeddings().weight.detach().clone()
    old_size = old_table.shape[0]
    new_size = old_size + 6
    if vocabulary == "shared":
        model.resize_token_embeddings(new_size, **({} if mean_resizing else {"mean_resizing": False}))
    else:
        model.resize_decoder_token_embeddings(new_size, **({} if mean_resizing else {"mean_resizing": False}))
    assert projection.weight.shape[0] == model.get_decoder().embed_tokens.weight.shape[0] == new_size
    resized_tables = [(model.get_decoder().embed_tokens.weight, old_table), (projection.weight, old_projection)]
    if vocabulary == "shared":  # the source table is resized first, by its own call
        resized_tables.append((model.get_input_embeddings().weight, old_source_table))
    for resized, old in resized_tables:
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
