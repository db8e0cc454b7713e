"""MAT: multi-branch attention, drop-branch / drop-head, proximal initialisation, encoder-only classifier."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    BertConfig,
    BertModel,
    RobertaConfig,
    RobertaModel,
)

import flexformers.modeling  # noqa: F401  (registers the Auto classes)
from flexformers.configuration.configuration_flexformer import FlexformerConfig
from flexformers.configuration.configuration_mat import MAT_PRESETS, MATConfig, MATRobertaConfig, mat_parameter_count
from flexformers.modeling.modeling_flexformer import (
    FlexformerAttention,
    FlexformerFeedForward,
    FlexformerForConditionalGeneration,
)
from flexformers.modeling.modeling_mat import (
    MATAttention,
    MATBertForSequenceClassification,
    MATFeedForward,
    MATForConditionalGeneration,
    MATRobertaForSequenceClassification,
    clone_into_branches,
    drop_branch_keep_scales,
    drop_head_keep_scales,
    multi_branch_merge_weights,
)

TINY = dict(
    vocab_size=60,
    encoder_embed_dim=32,
    decoder_embed_dim=32,
    encoder_ffn_embed_dim=48,
    decoder_ffn_embed_dim=48,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    dropout=0.0,
    share_all_embeddings=True,
    max_source_positions=64,
    max_target_positions=64,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models here are tiny: intra-op threads only add synchronisation, which costs milliseconds per op when
    the shared CPU is oversubscribed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _perturb_biases(model: torch.nn.Module) -> None:
    """Random non-zero biases and LayerNorm affines, so equality tests are not helped by zero initialisation."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))


def _init_standalone(module: torch.nn.Module) -> torch.nn.Module:
    """Modules built outside a PreTrainedModel are not initialised by `_init_weights`: give every parameter
    moderate random values (a merge starts as `torch.empty`)."""
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.2)
    return module


@pytest.fixture(scope="module")
def baseline_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = FlexformerForConditionalGeneration(FlexformerConfig(**TINY))
    _perturb_biases(model)
    path = tmp_path_factory.mktemp("baseline")
    model.save_pretrained(path)
    return path


@pytest.fixture
def batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, TINY["vocab_size"], (3, 9), generator=generator)
    input_ids[2, 6:] = 1
    input_ids[:2, -1] = 2
    input_ids[2, 5] = 2
    labels = torch.randint(5, TINY["vocab_size"], (3, 7), generator=generator)
    labels[:, -1] = 2
    labels[1, 5:] = -100
    return {"input_ids": input_ids, "attention_mask": input_ids.ne(1).long(), "labels": labels}


# ---- configuration ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"drop_branch_rate": 1.0},
        {"drop_branch_rate": -0.1},
        {"drop_head_rate": 1.5},
        {"ffn_drop_branch_rate": 1.0},
        {"encoder_attention_branches": 0},
        {"decoder_attention_branches": -1},
        {"decoder_ffn_branches": 0},
        {"branch_merge": "mean"},
    ],
)
def test_invalid_config_raises_value_error_naming_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        MATConfig(**TINY, **bad)


def test_config_round_trip_and_presets(tmp_path):
    config = MATConfig(**TINY, drop_branch_rate=0.3, ffn_drop_branch_rate=0.0, branch_merge="official")
    config.save_pretrained(tmp_path)
    loaded = MATConfig.from_pretrained(tmp_path)
    assert (loaded.drop_branch_rate, loaded.effective_ffn_drop_branch_rate, loaded.branch_merge) == (0.3, 0.0, "official")
    preset = MATConfig.from_preset("mat_iwslt_de_en", vocab_size=10152)
    assert (preset.encoder_attention_branches, preset.encoder_embed_dim, preset.encoder_ffn_embed_dim) == (2, 256, 2048)
    assert set(MAT_PRESETS) >= {"mat_iwslt_de_en", "mat_codegen"}
    with pytest.raises(ValueError, match="preset"):
        MATConfig.from_preset("no_such_preset")


# ---- parameter counts (Table 1 and Table 11) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "branches, embed_dim, ffn_dim, ffn_branches, millions",
    [
        (1, 512, 1024, 1, 36.7),
        (1, 256, 1024, 1, 13.7),
        (1, 256, 2048, 1, 20.0),
        (1, 256, 3072, 1, 26.3),
        (2, 256, 1024, 1, 18.4),
        (2, 256, 2048, 1, 24.7),
        (3, 256, 1024, 1, 23.1),
        (3, 256, 2048, 1, 29.4),
        (4, 256, 1024, 1, 27.9),
        (4, 256, 2048, 1, 34.2),
        (1, 256, 1024, 2, 20.0),
        (2, 256, 512, 4, 24.7),
    ],
)
def test_parameter_arithmetic_matches_paper_tables(branches, embed_dim, ffn_dim, ffn_branches, millions):
    count = mat_parameter_count(
        vocab_size=10152, embed_dim=embed_dim, ffn_dim=ffn_dim, attention_branches=branches, ffn_branches=ffn_branches
    )
    assert round(count / 1e6, 1) == millions


@pytest.mark.parametrize("branches, ffn_dim, ffn_branches", [(2, 1024, 1), (2, 2048, 1), (3, 512, 2)])
def test_model_parameter_count_equals_arithmetic(branches, ffn_dim, ffn_branches):
    overrides = dict(
        encoder_embed_dim=256, decoder_embed_dim=256, encoder_ffn_embed_dim=ffn_dim, decoder_ffn_embed_dim=ffn_dim,
        encoder_attention_branches=branches, decoder_attention_branches=branches,
        encoder_ffn_branches=ffn_branches, decoder_ffn_branches=ffn_branches,
    )
    config = MATConfig.from_preset("transformer_iwslt_de_en", vocab_size=10152, **overrides)
    with torch.device("meta"):
        model = MATForConditionalGeneration(config)
    expected = mat_parameter_count(
        vocab_size=10152, embed_dim=256, ffn_dim=ffn_dim, attention_branches=branches, ffn_branches=ffn_branches
    )
    assert model.num_parameters() == expected


# ---- the equations -----------------------------------------------------------------------------------------------


def test_drop_branch_keeps_the_expected_value():
    torch.manual_seed(1234)
    rate, branches, draws = 0.3, 3, 20000
    scales = torch.stack([drop_branch_keep_scales(branches, rate, training=True) for _ in range(draws)])
    assert torch.unique(scales).tolist() == pytest.approx([0.0, 1 / 0.7])
    # E[I{U >= rho} / (1 - rho)] = 1; std of one factor = sqrt(rho / (1 - rho))
    tolerance = 4 * math.sqrt(rate / (1 - rate)) / math.sqrt(draws * branches)
    assert abs(scales.mean().item() - 1.0) < tolerance
    all_dropped = (scales.sum(-1) == 0).float().mean().item()
    assert abs(all_dropped - rate**branches) < 4 * math.sqrt(rate**branches / draws)  # all may drop (Sec. 3.2)
    assert torch.equal(drop_branch_keep_scales(branches, rate, training=False), torch.ones(branches))
    assert torch.equal(drop_branch_keep_scales(branches, 0.0, training=True), torch.ones(branches))


def test_drop_head_is_independent_per_head_and_off_in_eval():
    torch.manual_seed(7)
    scales = torch.stack([drop_head_keep_scales(2, 4, 0.5, training=True) for _ in range(4000)])
    assert scales.shape == (4000, 8)
    assert abs(scales.mean().item() - 1.0) < 0.05
    correlation = torch.corrcoef(scales.T)
    assert correlation.fill_diagonal_(0).abs().max() < 0.08
    assert drop_head_keep_scales(2, 4, 0.5, training=False) is None


def test_merge_weights_paper_and_official():
    keep = torch.tensor([1.0, 0.0, 2.0])
    assert torch.allclose(multi_branch_merge_weights(keep, "paper"), keep / 3)
    assert torch.allclose(multi_branch_merge_weights(keep, "official"), keep / 9)
    with pytest.raises(ValueError, match="branch_merge"):
        multi_branch_merge_weights(keep, "sum")


def test_clone_into_branches_layouts():
    weight = torch.randn(4, 4)
    assert torch.equal(clone_into_branches(torch.empty(12, 4), weight, "q")[8:12], weight)
    assert torch.equal(clone_into_branches(torch.empty(4, 8), weight, "out")[:, 4:], weight)
    bias = torch.randn(1, 4)
    assert torch.equal(clone_into_branches(torch.empty(3, 4), bias, "bias")[2], bias[0])
    with pytest.raises(ValueError, match="Cannot clone"):
        clone_into_branches(torch.empty(6, 5), weight, "bad")


# ---- fused branches vs a per-branch reference ------------------------------------------------------------------


def _single_branch_copy(fused, branch: int, cls, *args, **kwargs):
    """Branch `branch` of a fused multi-branch module as an independent one-branch backbone module."""
    single = cls(*args, **kwargs).eval()
    with torch.no_grad():
        for name, parameter in single.named_parameters():
            if name in ("out_proj.bias", "fc2.bias"):  # the fused merge's per-branch biases
                parameter.copy_(dict(fused.named_parameters())[name.replace(".bias", "_branch_bias")][branch])
                continue
            source = dict(fused.named_parameters())[name]
            if name.endswith("out_proj.weight") or name.endswith("fc2.weight") or name in ("out_proj.weight", "fc2.weight"):
                parameter.copy_(source[:, branch * parameter.shape[1] : (branch + 1) * parameter.shape[1]])
            else:
                rows = parameter.shape[0]
                parameter.copy_(source[branch * rows : (branch + 1) * rows])
    return single


@pytest.mark.parametrize("merge", ["paper", "official"])
def test_fused_attention_equals_per_branch_loop(merge):
    torch.manual_seed(3)
    config = MATConfig(**TINY, drop_branch_rate=0.0, branch_merge=merge)
    branches = 3
    fused = _init_standalone(MATAttention(config, 32, 4, num_branches=branches, is_cross_attention=True).eval())
    query, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    mask = torch.zeros(2, 1, 5, 7)
    mask[1, ..., 5:] = float("-inf")
    with torch.no_grad():
        fused_out, _ = fused(query, key_value_states=memory, attention_mask=mask)
        scale = 1 / branches if merge == "paper" else 1 / branches**2
        reference = sum(
            scale
            * _single_branch_copy(fused, b, FlexformerAttention, config, 32, 4, is_cross_attention=True)(
                query, key_value_states=memory, attention_mask=mask
            )[0]
            for b in range(branches)
        )
    torch.testing.assert_close(fused_out, reference, atol=1e-5, rtol=1e-5)


def test_fused_feed_forward_equals_per_branch_loop():
    torch.manual_seed(4)
    config = MATConfig(**TINY, drop_branch_rate=0.0)
    fused = _init_standalone(MATFeedForward(config, 32, 16, num_branches=4).eval())
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        reference = sum(_single_branch_copy(fused, b, FlexformerFeedForward, config, 32, 16)(x) for b in range(4)) / 4
        torch.testing.assert_close(fused(x), reference, atol=1e-5, rtol=1e-5)


def test_drop_head_matches_per_head_reference():
    config = MATConfig(**TINY, drop_branch_rate=0.0, drop_head_rate=0.5)
    torch.manual_seed(5)
    attention = _init_standalone(MATAttention(config, 32, 4, num_branches=2).train())
    x = torch.randn(2, 5, 32)
    torch.manual_seed(99)
    heads = drop_head_keep_scales(2, 4, 0.5, training=True)
    torch.manual_seed(99)
    output, _ = attention(x)
    assert heads is not None and 0 < heads.count_nonzero() < 8, "seed chosen so some heads drop"
    reference_module = FlexformerAttention(config, 32, 4, num_branches=2).eval()
    reference_module.load_state_dict(attention.state_dict())
    reference_module.head_weights = lambda batch_size, device, dtype: heads.expand(batch_size, -1)
    torch.testing.assert_close(output, reference_module(x)[0], atol=1e-6, rtol=1e-6)
    reference_module.head_weights = lambda batch_size, device, dtype: None
    torch.testing.assert_close(attention.eval()(x)[0], reference_module(x)[0])  # drop-head is off in eval


def test_attention_drop_branch_statistics_and_eval():
    torch.manual_seed(6)
    config = MATConfig(**TINY, drop_branch_rate=0.5)
    attention = _init_standalone(MATAttention(config, 32, 4, num_branches=2))
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        expected = attention.eval()(x)[0]
        assert torch.equal(expected, attention(x)[0]), "eval is deterministic"
        attention.train()
        draws = 800
        outputs = torch.stack([attention(x)[0] for _ in range(draws)])
    all_dropped = (outputs.flatten(1).abs().amax(-1) == 0).float().mean().item()
    assert abs(all_dropped - 0.25) < 4 * math.sqrt(0.25 * 0.75 / draws)  # both dropped: the sub-layer adds nothing
    # E[output] = eval output (inverted scaling); 5 standard errors per element
    standard_error = outputs.std(0) / math.sqrt(draws)
    assert ((outputs.mean(0) - expected).abs() <= 5 * standard_error + 1e-6).all()


# ---- whole models ----------------------------------------------------------------------------------------------


def test_single_branch_without_drop_equals_the_baseline(batch):
    torch.manual_seed(8)
    baseline = FlexformerForConditionalGeneration(FlexformerConfig(**TINY))
    _perturb_biases(baseline)
    config = MATConfig(**TINY, encoder_attention_branches=1, decoder_attention_branches=1, drop_branch_rate=0.0)
    mat = MATForConditionalGeneration(config)
    mat.load_state_dict(baseline.state_dict())
    for mode in ("train", "eval"):
        getattr(baseline, mode)()
        getattr(mat, mode)()
        expected, actual = baseline(**batch), mat(**batch)
        assert torch.equal(expected.logits, actual.logits)
        assert torch.equal(expected.loss, actual.loss)


@pytest.mark.parametrize("options", [dict(do_sample=False), dict(num_beams=3, num_return_sequences=2)])
def test_static_cache_generation_equals_default_cache(batch, options):
    """MAT's branches live inside the backbone's attention and FFN, so its decoding step runs on a static cache
    (and compiles) like the baseline's."""
    torch.manual_seed(8)
    mat = MATForConditionalGeneration(MATConfig(**TINY, drop_branch_rate=0.0)).eval()
    kwargs = dict(attention_mask=batch["attention_mask"], max_new_tokens=8, **options)
    default = mat.generate(batch["input_ids"], **kwargs)
    static = mat.generate(batch["input_ids"], cache_implementation="static", **kwargs)
    assert torch.equal(static, default)


def test_proximal_initialisation_equals_its_baseline(baseline_dir, batch):
    baseline = FlexformerForConditionalGeneration.from_pretrained(baseline_dir).eval()
    mat = MATForConditionalGeneration.from_baseline(
        baseline_dir, encoder_attention_branches=3, decoder_attention_branches=2, decoder_ffn_branches=2,
        drop_branch_rate=0.0,
    )
    d = TINY["encoder_embed_dim"]
    q_proj = mat.model.encoder.layers[1].self_attn.q_proj.weight
    base_q = baseline.model.encoder.layers[1].self_attn.q_proj.weight
    assert all(torch.equal(q_proj[b * d : (b + 1) * d], base_q) for b in range(3)), "each branch addressable"
    mat.train()  # rho = 0 and dropout = 0: training mode too computes the baseline's function
    with torch.no_grad():
        torch.testing.assert_close(mat(**batch).logits, baseline(**batch).logits, atol=1e-5, rtol=1e-5)
    mat.eval()
    generate = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=8)
    assert torch.equal(mat.generate(**generate), baseline.generate(**generate))
    assert torch.equal(mat.generate(**generate, num_beams=4), baseline.generate(**generate, num_beams=4))
    # the same from a model object, with drop-branch on: eval still equals the baseline
    mat_rho = MATForConditionalGeneration.from_baseline(baseline, drop_branch_rate=0.3).eval()
    with torch.no_grad():
        torch.testing.assert_close(mat_rho(**batch).logits, baseline(**batch).logits, atol=1e-5, rtol=1e-5)


def test_drop_branch_trains_and_round_trips(baseline_dir, batch, tmp_path):
    torch.manual_seed(9)
    mat = MATForConditionalGeneration.from_baseline(baseline_dir, drop_branch_rate=0.3, drop_head_rate=0.1)
    optimizer = torch.optim.Adam(mat.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        loss = mat(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(value) for value in losses)
    mat.eval()
    mat.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, MATForConditionalGeneration) and loaded.config.drop_head_rate == 0.1
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, mat(**batch).logits)


def test_wrong_checkpoints_are_rejected(baseline_dir, tmp_path):
    mat_dir = tmp_path / "mat"
    MATForConditionalGeneration(MATConfig(**TINY)).save_pretrained(mat_dir)
    with pytest.raises(ValueError, match="not a flexformer baseline checkpoint.*'mat'"):
        MATForConditionalGeneration.from_baseline(mat_dir)
    with pytest.raises(ValueError, match="not a directory with a config.json"):
        MATForConditionalGeneration.from_baseline(tmp_path / "missing")
    roberta_dir = tmp_path / "roberta"
    roberta_dir.mkdir()
    (roberta_dir / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    with pytest.raises(ValueError, match="not a flexformer baseline checkpoint.*'roberta'"):
        MATForConditionalGeneration.from_baseline(roberta_dir)
    with pytest.raises(ValueError, match="single-branch flexformer baseline"):
        MATForConditionalGeneration.from_baseline(MATForConditionalGeneration(MATConfig(**TINY)))
    with pytest.raises(ValueError, match="cannot change encoder_embed_dim"):
        MATForConditionalGeneration.from_baseline(baseline_dir, encoder_embed_dim=64)


def test_training_script_method_module(baseline_dir):
    from flexformers.training_scripts.methods.mat import MATArguments, build_mat_model
    from flexformers.training_scripts.model_registry import get_method_spec

    spec = get_method_spec("mat")
    assert spec.model_class is MATForConditionalGeneration and spec.config_class is MATConfig
    config = MATConfig(**TINY, encoder_attention_branches=3, drop_branch_rate=0.1)

    class ModelArguments:
        model_name_or_path = None

    model = build_mat_model(ModelArguments(), MATArguments(baseline_checkpoint=str(baseline_dir)), config, None)
    assert model.config.encoder_attention_branches == 3 and model.config.drop_branch_rate == 0.1
    assert model.model.encoder.layers[0].self_attn.q_proj.weight.shape[0] == 3 * TINY["encoder_embed_dim"]
    fresh = build_mat_model(ModelArguments(), MATArguments(), config, None)
    assert isinstance(fresh, MATForConditionalGeneration)


# ---- encoder-only classifier (GLUE experiment, Sec. 6) -----------------------------------------------------------

ENCODER = dict(
    vocab_size=80, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
    max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)


@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory):
    torch.manual_seed(10)
    model = RobertaModel(RobertaConfig(**ENCODER))
    _perturb_biases(model)
    path = tmp_path_factory.mktemp("roberta")
    model.save_pretrained(path)
    return path


def _encoder_batch():
    generator = torch.Generator().manual_seed(11)
    input_ids = torch.randint(3, ENCODER["vocab_size"], (3, 8), generator=generator)
    input_ids[:, 0] = 0
    input_ids[1, 6:] = 1
    return input_ids, input_ids.ne(1).long()


def test_roberta_classifier_proximal_init_equals_encoder(roberta_dir, tmp_path):
    base = RobertaModel.from_pretrained(roberta_dir).eval()
    model = MATRobertaForSequenceClassification.from_encoder(roberta_dir, num_labels=3, drop_branch_rate=0.3).eval()
    assert model.config.model_type == "mat_roberta" and model.config.num_labels == 3
    layer = model.roberta.encoder.layer[0].attention
    assert layer.self.query.weight.shape == (2 * 32, 32) and layer.output.dense.weight.shape == (32, 2 * 32)
    input_ids, mask = _encoder_batch()
    with torch.no_grad():
        torch.testing.assert_close(
            model.roberta(input_ids, attention_mask=mask).last_hidden_state,
            base(input_ids, attention_mask=mask).last_hidden_state, atol=1e-5, rtol=1e-5,
        )
    model.train()
    torch.manual_seed(12)
    output = model(input_ids, attention_mask=mask, labels=torch.tensor([0, 2, 1]))
    output.loss.backward()
    assert math.isfinite(output.loss.item()) and layer.self.query.weight.grad is not None
    model.eval().save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, MATRobertaForSequenceClassification)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids, attention_mask=mask).logits, model(input_ids, attention_mask=mask).logits)


def test_encoder_classifier_rejects_wrong_checkpoints(roberta_dir, tmp_path):
    with pytest.raises(ValueError, match="not a bert checkpoint"):
        MATBertForSequenceClassification.from_encoder(roberta_dir)
    with pytest.raises(ValueError, match="not a directory"):
        MATRobertaForSequenceClassification.from_encoder(tmp_path / "nothing")
    with pytest.raises(ValueError, match="num_attention_branches"):
        MATRobertaConfig(**ENCODER, num_attention_branches=0)


def test_bert_classifier_proximal_init_equals_encoder(tmp_path):
    torch.manual_seed(13)
    base = BertModel(BertConfig(**ENCODER))
    _perturb_biases(base)
    base.save_pretrained(tmp_path)
    base.eval()
    model = MATBertForSequenceClassification.from_encoder(tmp_path, num_attention_branches=3).eval()
    input_ids, mask = _encoder_batch()
    with torch.no_grad():
        expected = base(input_ids, attention_mask=mask)
        actual = model.bert(input_ids, attention_mask=mask)
    torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output, atol=1e-5, rtol=1e-5)


