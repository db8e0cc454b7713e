"""The four methods' random paths by their distribution, their clamps and bounds at and beyond the bound, and the
config options no other test sets to a non-default value (issue 65: tests that catch wrong maths).

Every random test is seeded (deterministic) and compares frequencies with their stated probabilities within a
binomial tolerance of 4-5 standard deviations (or a chi-square bound), so a wrong rate, a missing rescaling or a
sampled range off by one fails, while the seeded draw itself never does.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

import flexformers.modeling  # noqa: F401  (registers the model types)
from flexformers.configuration.configuration_depth_adaptive import DepthAdaptiveConfig
from flexformers.configuration.configuration_indigo import InDIGOConfig
from flexformers.configuration.configuration_iot import IOTConfig
from flexformers.configuration.configuration_mat import MATConfig, MATRobertaConfig
from flexformers.modeling import iot_equations
from flexformers.modeling.depth_adaptive_decoder import _probability_logit
from flexformers.modeling.depth_adaptive_equations import geometric_exit_log_probs, mean_encoder_output
from flexformers.modeling.indigo_insertion import relative_positions_from_absolute
from flexformers.modeling.iot_equations import (
    clamp_order_probs,
    diversity_loss,
    gumbel_softmax_confidences,
    masked_mean,
    sample_gumbel,
    sentence_label_smoothed_losses,
    sharpness_loss,
)
from flexformers.modeling.modeling_depth_adaptive import DepthAdaptiveForConditionalGeneration
from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration
from flexformers.modeling.modeling_iot import IOTForConditionalGeneration
from flexformers.modeling.modeling_mat import (
    MATAttention,
    MATEncoderAttentionOutput,
    MATEncoderFeedForwardOutput,
    MATFeedForward,
    drop_head_keep_scales,
)
from flexformers.training_scripts.indigo_orders import order_random
from tests.conftest import tiny_config_kwargs


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: intra-op threads only add synchronisation on the shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def binomial_tolerance(p: float, draws: int, sigmas: float = 4.5) -> float:
    return sigmas * math.sqrt(p * (1 - p) / draws)


def assert_frequencies(counts: dict, expected: dict, draws: int) -> None:
    """Each outcome's frequency within a binomial tolerance of its probability, and a chi-square statistic below a
    bound its distribution exceeds with probability < 1e-4 (degrees of freedom k - 1 <= 8)."""
    chi_square = 0.0
    for outcome, probability in expected.items():
        frequency = counts.get(outcome, 0) / draws
        assert abs(frequency - probability) < binomial_tolerance(probability, draws), (outcome, frequency, probability)
        chi_square += (counts.get(outcome, 0) - draws * probability) ** 2 / (draws * probability)
    assert set(counts) <= set(expected), f"outcomes outside the support: {set(counts) - set(expected)}"
    assert chi_square < 33.0, chi_square  # chi2(8) upper 1e-4 quantile is 31.8; fewer dof have smaller quantiles


# ======================================================================================================== MAT

MAT_TINY = tiny_config_kwargs(encoder_ffn_embed_dim=48, decoder_ffn_embed_dim=48, share_all_embeddings=True)


def _randomised(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.2)
    return module


@pytest.mark.parametrize("merge", ["paper", "official"])
@pytest.mark.parametrize("kind", ["attention", "ffn"])
def test_drop_branch_merge_weights_drop_each_branch_independently_at_rho(kind, merge):
    """Eq. 5-8: every branch is dropped with probability ρ, independently, shared by the batch; a kept branch
    weighs 1/((1-ρ)N) (paper) or 1/((1-ρ)N²) (official), so the expected weight is the eval weight; all branches may
    drop at once (Sec. 3.2: the residual carries the input). The attention reads `drop_branch_rate`, the FFN
    `ffn_drop_branch_rate` — each ignores the other's."""
    rho, branches, draws = 0.3, 3, 4000
    if kind == "attention":
        config = MATConfig(**MAT_TINY, drop_branch_rate=rho, ffn_drop_branch_rate=0.0, branch_merge=merge)
        module = MATAttention(config, 32, 4, num_branches=branches)
        other = MATFeedForward(config, 32, 16, num_branches=branches).train()
    else:
        config = MATConfig(**MAT_TINY, drop_branch_rate=0.0, ffn_drop_branch_rate=rho, branch_merge=merge)
        module = MATFeedForward(config, 32, 16, num_branches=branches)
        other = MATAttention(config, 32, 4, num_branches=branches).train()
    scale = branches if merge == "paper" else branches**2
    module.train()
    torch.manual_seed(0)
    weights = torch.stack([module.branch_weights(2, "cpu", torch.float32) for _ in range(draws)])  # [draws, N]
    kept_weight = 1.0 / ((1.0 - rho) * scale)
    assert torch.all((weights == 0) | torch.isclose(weights, torch.tensor(kept_weight)))
    dropped = weights == 0
    for branch in range(branches):
        assert abs(dropped[:, branch].float().mean().item() - rho) < binomial_tolerance(rho, draws)
    both = (dropped[:, 0] & dropped[:, 1]).float().mean().item()
    assert abs(both - rho**2) < binomial_tolerance(rho**2, draws)  # independent draws per branch
    every = dropped.all(-1).float().mean().item()
    assert abs(every - rho**3) < binomial_tolerance(rho**3, draws)  # all may drop, no branch is forced kept
    assert abs(weights.mean().item() - 1.0 / scale) < 4.5 * weights.std().item() / math.sqrt(draws * branches)
    # eval: no drop; the paper's merge is the backbone's plain average (None), the official one 1/N²
    module.eval()
    eval_weights = module.branch_weights(2, "cpu", torch.float32)
    if merge == "paper":
        assert eval_weights is None
    else:
        assert torch.allclose(eval_weights, torch.full((branches,), 1.0 / branches**2))
    # the other sub-layer's rate is 0: in training it never drops a branch
    for _ in range(50):
        other_weights = other.branch_weights(2, "cpu", torch.float32)
        assert other_weights is None or torch.allclose(other_weights, torch.full((branches,), 1.0 / scale))


def test_multi_branch_ffn_drop_branch_output_keeps_the_eval_expectation():
    """Eq. 8 on N_f = 2 FFN branches: the training output over many draws averages to the eval output (inverted
    scaling 1/(1-ρ)); both branches are dropped (output exactly 0) with probability ρ²."""
    config = MATConfig(**MAT_TINY, drop_branch_rate=0.0, ffn_drop_branch_rate=0.4, encoder_ffn_branches=2)
    ffn = _randomised(MATFeedForward(config, 32, 16, num_branches=2), seed=5)
    x = torch.randn(2, 3, 32)
    draws = 2000
    with torch.no_grad():
        expected = ffn.eval()(x)
        ffn.train()
        torch.manual_seed(6)
        outputs = torch.stack([ffn(x) for _ in range(draws)])
    standard_error = outputs.std(0) / math.sqrt(draws)
    assert ((outputs.mean(0) - expected).abs() <= 5 * standard_error + 1e-6).all()
    zero_output = (outputs.flatten(1).abs().amax(-1) == 0).float().mean().item()
    assert abs(zero_output - 0.16) < binomial_tolerance(0.16, draws)  # both dropped: ρ², no branch forced kept


def test_drop_head_drops_each_head_at_its_rate_with_inverted_scaling():
    """Eq. 9: every head of every branch is dropped with probability ρ, kept ones scaled by 1/(1-ρ); the attention
    reads `drop_head_rate` from the config and is off in eval."""
    rho, draws = 0.25, 4000
    torch.manual_seed(1)
    scales = torch.stack([drop_head_keep_scales(2, 4, rho, training=True) for _ in range(draws)])
    assert torch.all((scales == 0) | torch.isclose(scales, torch.tensor(1 / (1 - rho))))
    for head in range(8):
        assert abs((scales[:, head] == 0).float().mean().item() - rho) < binomial_tolerance(rho, draws)
    config = MATConfig(**MAT_TINY, drop_branch_rate=0.0, drop_head_rate=rho)
    attention = MATAttention(config, 32, 4, num_branches=2).train()
    torch.manual_seed(2)
    heads = torch.stack([attention.head_weights(2, "cpu", torch.float32) for _ in range(draws)])
    assert abs((heads == 0).float().mean().item() - rho) < binomial_tolerance(rho, draws * 8)
    assert attention.eval().head_weights(2, "cpu", torch.float32) is None


def _roberta_config(**overrides) -> MATRobertaConfig:
    return MATRobertaConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **overrides,
    )


def test_encoder_classifier_attention_output_official_merge_and_drop_branch_outcomes():
    """MAT's GLUE encoder: `branch_merge="official"` merges the branches with 1/N² (not 1/N), and in training each
    of the two branches is dropped with probability ρ, the kept ones scaled by 1/(1-ρ): the four outcomes
    {both, first, second, none} come with probabilities (1-ρ)², ρ(1-ρ), ρ(1-ρ), ρ²."""
    rho = 0.5
    module = _randomised(MATEncoderAttentionOutput(_roberta_config(drop_branch_rate=rho, branch_merge="official")))
    hidden = torch.randn(2, 3, 64)  # two branches of width 32
    residual = torch.randn(2, 3, 32)
    blocks = [hidden[..., b * 32 : (b + 1) * 32] @ module.dense.weight[:, b * 32 : (b + 1) * 32].T
              + module.dense_branch_bias[b] for b in range(2)]

    def expected(weights):
        return module.LayerNorm(residual + weights[0] * blocks[0] + weights[1] * blocks[1])

    with torch.no_grad():
        module.eval()
        torch.testing.assert_close(module(hidden, residual), expected([0.25, 0.25]), atol=1e-5, rtol=1e-5)
        kept = 1 / (1 - rho) / 4
        outcomes = {"both": expected([kept, kept]), "first": expected([kept, 0.0]), "second": expected([0.0, kept]),
                    "none": expected([0.0, 0.0])}
        module.train()
        torch.manual_seed(3)
        counts, draws = Counter(), 1200
        for _ in range(draws):
            output = module(hidden, residual)
            matches = [name for name, value in outcomes.items() if torch.allclose(output, value, atol=1e-5)]
            assert len(matches) == 1, "each draw is exactly one drop-branch outcome"
            counts[matches[0]] += 1
    assert_frequencies(counts, {"both": 0.25, "first": 0.25, "second": 0.25, "none": 0.25}, draws)


@pytest.mark.parametrize("ffn_rate, expected_drop", [(0.4, 0.4), (0.0, 0.0), (None, 0.2)])
def test_encoder_classifier_ffn_drop_branch_follows_ffn_drop_branch_rate(ffn_rate, expected_drop):
    """Eq. 7 on the encoder's FFN: dropped with probability `ffn_drop_branch_rate` (None = `drop_branch_rate`),
    kept output scaled by 1/(1-ρ); 0 disables it even when `drop_branch_rate` > 0."""
    config = _roberta_config(drop_branch_rate=0.2, ffn_drop_branch_rate=ffn_rate)
    module = _randomised(MATEncoderFeedForwardOutput(config))
    hidden, residual = torch.randn(2, 3, 64), torch.randn(2, 3, 32)
    with torch.no_grad():
        dense = module.dense(hidden)
        dropped = module.LayerNorm(residual)
        kept = module.LayerNorm(residual + dense / (1 - expected_drop))
        module.train()
        torch.manual_seed(4)
        draws, drops = 1000, 0
        for _ in range(draws):
            output = module(hidden, residual)
            is_dropped = torch.allclose(output, dropped, atol=1e-5)
            assert is_dropped or torch.allclose(output, kept, atol=1e-5)
            drops += is_dropped
    if expected_drop == 0.0:
        assert drops == 0
    else:
        assert abs(drops / draws - expected_drop) < binomial_tolerance(expected_drop, draws)


# ======================================================================================================== IOT


def test_gumbel_softmax_argmax_follows_the_clamped_probabilities():
    """Eq. 1 (Gumbel-max): the sampled order argmax_k(log clamp(π)_k + g_k) is drawn with probability
    clamp(π)_k / Σ clamp(π) — the clamp lifts a 0.02 order to 0.05 (not renormalised), for any τ."""
    probabilities = torch.tensor([0.9, 0.08, 0.02])
    draws = 20000
    logits = probabilities.log().expand(draws, -1)
    for clamp, support in ((0.05, torch.tensor([0.9, 0.08, 0.05])), (0.0, probabilities)):
        generator = torch.Generator().manual_seed(5)
        confidences, probs = gumbel_softmax_confidences(logits, 3.0, clamp, generator=generator)
        assert torch.allclose(probs[0], probabilities, atol=1e-6)
        counts = Counter(confidences.argmax(-1).tolist())
        expected = support / support.sum()
        assert_frequencies(counts, {k: expected[k].item() for k in range(3)}, draws)
    noise = sample_gumbel((50, 3), "cpu", torch.Generator().manual_seed(6))
    cold, _ = gumbel_softmax_confidences(logits[:50], 0.5, 0.05, gumbel_noise=noise)
    hot, _ = gumbel_softmax_confidences(logits[:50], 20.0, 0.05, gumbel_noise=noise)
    assert torch.equal(cold.argmax(-1), hot.argmax(-1))  # τ changes the softness, not the sampled order
    assert (hot.amax(-1) < cold.amax(-1)).all()  # hotter is closer to uniform


def test_sample_gumbel_keeps_uniform_draws_off_zero_and_one(monkeypatch):
    """g = −log(−log U) with U clamped to [tiny, 1 − eps]: finite at U = 0 and U = 1, exact in between."""
    tiny, eps = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).eps
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.tensor([0.0, 1.0, 0.5]))
    noise = sample_gumbel((3,), "cpu")
    bounds = torch.tensor([tiny, 1.0 - eps, 0.5])
    assert torch.equal(noise, -torch.log(-torch.log(bounds)))
    assert torch.isfinite(noise).all()
    assert noise[2].item() == pytest.approx(-math.log(math.log(2.0)), abs=1e-6)


@pytest.mark.parametrize("num_orders", [2, 4])
def test_order_prob_clamp_at_probabilities_zero_and_one(num_orders):
    """The clamp range [c, 1 − (K−1)c] reached exactly: π = (1, 0, …) becomes (1 − (K−1)c, c, …), so Eq. 1's log
    and Eq. 6 stay finite; c = 0 switches the clamp off (and the log of 0 is −inf)."""
    clamp = 0.05
    probs = torch.zeros(1, num_orders)
    probs[0, 0] = 1.0
    clamped = clamp_order_probs(probs, clamp)
    expected = torch.full((1, num_orders), clamp)
    expected[0, 0] = 1.0 - (num_orders - 1) * clamp
    assert torch.allclose(clamped, expected, atol=1e-7)
    assert torch.equal(clamp_order_probs(probs, 0.0), probs)
    logits = torch.full((1, num_orders), -60.0)
    logits[0, 0] = 60.0  # softmax is (1, 0, ...) in float32
    confidences, _ = gumbel_softmax_confidences(logits, 2.0, clamp, gumbel_noise=torch.zeros(1, num_orders))
    assert torch.allclose(confidences, torch.softmax(expected.log() / 2.0, -1), atol=1e-6)
    unclamped, _ = gumbel_softmax_confidences(logits, 2.0, 0.0, gumbel_noise=torch.zeros(1, num_orders))
    assert unclamped[0, 0].item() == pytest.approx(1.0, abs=1e-6)
    kl = -(expected.log().mean()) - math.log(num_orders)
    assert sharpness_loss(probs, clamp).item() == pytest.approx(-kl.item(), abs=1e-6)


def test_masked_means_of_an_all_padding_row_are_zero_not_nan():
    """The count clamp (min 1) of the masked means (IOT Eq. 1-2, Depth-Adaptive Eq. 8): a row with no token gives 0."""
    states = torch.randn(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    for mean in (masked_mean(states, mask), mean_encoder_output(states, mask)):
        assert torch.allclose(mean[0], states[0, :2].mean(0), atol=1e-6)
        assert torch.equal(mean[1], torch.zeros(4))


IOT_TINY = tiny_config_kwargs(share_all_embeddings=True)


def tiny_iot(seed=0, **overrides) -> IOTForConditionalGeneration:
    torch.manual_seed(seed)
    return IOTForConditionalGeneration(IOTConfig(**{**IOT_TINY, **overrides}))


def iot_batch(seed=0, size=4, src_len=7, tgt_len=5):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, 60, (size, src_len), generator=generator)
    input_ids[:, -1] = 2
    input_ids[1, 4:] = 1
    input_ids[1, 3] = 2
    labels = torch.randint(5, 60, (size, tgt_len), generator=generator)
    labels[:, -1] = 2
    labels[2, 3:] = -100
    return input_ids, input_ids.ne(1).long(), labels


def _no_gumbel_noise(monkeypatch):
    monkeypatch.setattr(iot_equations, "sample_gumbel", lambda shape, device, generator=None: torch.zeros(shape))


def test_encoder_and_decoder_temperatures_follow_their_own_schedules(monkeypatch):
    """τ_e and τ_d (Eq. 1, 2) start at `encoder_gumbel_temperature` / `decoder_gumbel_temperature`, decay by
    exp(−r·⌊step/f⌋·f) (`gumbel_temperature_decay_rate`, `gumbel_temperature_update_freq`) down to
    `gumbel_temperature_min`, and each divides its own predictor's scores."""
    model = tiny_iot(
        encoder_orders=[1, 2], decoder_orders=[1, 4], encoder_gumbel_temperature=7.0, decoder_gumbel_temperature=3.0,
        gumbel_temperature_min=2.5, gumbel_temperature_decay_rate=1e-3, gumbel_temperature_update_freq=100,
    )
    assert model.gumbel_temperatures() == (7.0, 3.0)
    model.set_gumbel_step(199)  # ⌊199/100⌋·100 = 100
    tau_e, tau_d = 7.0 * math.exp(-0.1), max(3.0 * math.exp(-0.1), 2.5)
    assert model.gumbel_temperatures() == pytest.approx((tau_e, tau_d))
    _no_gumbel_noise(monkeypatch)
    input_ids, mask, labels = iot_batch()
    model.train()
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
    clamp = model.config.order_prob_clamp
    expected_encoder = torch.softmax(clamp_order_probs(out.encoder_order_probs, clamp).log() / tau_e, -1)
    expected_decoder = torch.softmax(clamp_order_probs(out.decoder_order_probs, clamp).log() / tau_d, -1)
    torch.testing.assert_close(out.encoder_confidences, expected_encoder, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.decoder_confidences, expected_decoder, atol=1e-5, rtol=1e-5)
    model.set_gumbel_step(10**5)
    assert model.gumbel_temperatures() == (2.5, 2.5)  # both at the floor


def test_clamp_diversity_probs_false_takes_the_batch_mean_of_unclamped_probabilities():
    """`clamp_diversity_probs=False` (the official code): L_D (Eq. 5) of the raw π; True clamps π_x first. The
    sharpness (Eq. 6) is clamped either way."""
    input_ids, mask, labels = iot_batch()
    diversities = {}
    for clamp_first in (True, False):
        model = tiny_iot(decoder_orders=[1, 4, 6], clamp_diversity_probs=clamp_first)
        with torch.no_grad():
            model.decoder_order_predictor.weight.mul_(200.0)  # probabilities at the clamp bounds
        model.train()
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
        flat = out.decoder_order_probs.reshape(-1, 3)
        assert (flat < 0.05).any(), "the predictor must reach the clamp for the option to matter"
        diversities[clamp_first] = (out.diversity_loss.item(), diversity_loss(flat, 0.05).item(),
                                    diversity_loss(flat, None).item())
        assert out.sharpness_loss.item() == pytest.approx(sharpness_loss(flat, 0.05).item(), abs=1e-6)
    clamped_run, raw_run = diversities[True], diversities[False]
    assert clamped_run[0] == pytest.approx(clamped_run[1], abs=1e-6)
    assert raw_run[0] == pytest.approx(raw_run[2], abs=1e-6)
    assert abs(raw_run[2] - raw_run[1]) > 1e-3


@pytest.mark.parametrize("weight_smoothing", [True, False])
def test_weight_smoothing_loss_option_weights_the_right_terms(weight_smoothing):
    """Eq. 3 with label smoothing: `weight_smoothing_loss=True` (the paper) weights each path's whole smoothed loss
    by γ_m λ_n; False (the official code) weights only the NLL term and adds every path's smoothing term fully."""
    epsilon = 0.1
    model = tiny_iot(encoder_orders=[1, 2], decoder_orders=[1, 4], label_smoothing=epsilon,
                     weight_smoothing_loss=weight_smoothing, diversity_loss_coef=0.0, sharpness_loss_coef=0.0)
    input_ids, mask, labels = iot_batch()
    model.train()
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
    model.eval()
    nll = torch.zeros(input_ids.shape[0], 2, 2)
    smooth = torch.zeros_like(nll)
    with torch.no_grad():
        for m, encoder_code in enumerate([1, 2]):
            for n, decoder_code in enumerate([1, 4]):
                encoded = model.encode_with_orders(
                    input_ids, mask, encoder_order=encoder_code, decoder_order=decoder_code
                )
                logits = model(attention_mask=mask, encoder_outputs=encoded, labels=labels).logits
                nll[:, m, n], smooth[:, m, n] = sentence_label_smoothed_losses(logits, labels, epsilon)
    eps_i = epsilon / (60 - 1)
    weights = out.encoder_confidences.detach().unsqueeze(-1) * out.decoder_confidences.detach()
    tokens = labels.ne(-100).sum().item()
    if weight_smoothing:
        expected = (weights * ((1 - epsilon - eps_i) * nll + eps_i * smooth)).sum() / tokens
    else:
        expected = ((1 - epsilon - eps_i) * (weights * nll).sum() + eps_i * smooth.sum()) / tokens
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-4)


def test_inference_encoder_order_fixes_the_encoder_order_of_equal_mode():
    """`order_selection="equal"` has no predictor: `inference_encoder_order` is the encoder order every sentence
    takes at inference (here FF→SA), and the encoder output is that order's."""
    model = tiny_iot(order_selection="equal", encoder_orders=[1, 2], decoder_orders=[1, 4], inference_encoder_order=2)
    model.eval()
    input_ids, mask, _ = iot_batch()
    encoder_codes, decoder_codes = model.predict_orders(input_ids, mask)
    assert encoder_codes.tolist() == [2] * 4 and decoder_codes.tolist() == [1] * 4  # decoder default: first candidate
    with torch.no_grad():
        chosen = model.encode_with_orders(input_ids, mask).last_hidden_state
        forced_second = model.encode_with_orders(input_ids, mask, encoder_order=2).last_hidden_state
        forced_first = model.encode_with_orders(input_ids, mask, encoder_order=1).last_hidden_state
    assert torch.equal(chosen, forced_second)
    assert not torch.allclose(chosen, forced_first)


@pytest.mark.parametrize("predictor_dropout, expected_rate", [(0.0, 0.0), (0.5, 0.5), (None, 0.3)])
def test_predictor_dropout_applies_its_own_rate_to_the_predictor_logits(predictor_dropout, expected_rate):
    """`predictor_dropout` is the dropout on the predictor logits (None = the model's `dropout`): each logit is
    zeroed with that probability, kept ones scaled by 1/(1-p); 0 leaves them as in eval."""
    model = tiny_iot(decoder_orders=[1, 4, 6], dropout=0.3, predictor_dropout=predictor_dropout)
    predictor = model.decoder_order_predictor
    states = torch.randn(50, 6, 32)
    with torch.no_grad():
        reference = predictor.eval()(states, None)
        predictor.train()
        torch.manual_seed(7)
        draws = torch.stack([predictor(states, None) for _ in range(20)])  # [20, 50, 3]
    zeroed = draws == 0
    if expected_rate == 0.0:
        assert torch.equal(draws, reference.expand_as(draws))
        return
    total = zeroed.numel()
    assert abs(zeroed.float().mean().item() - expected_rate) < binomial_tolerance(expected_rate, total)
    scaled = reference.expand_as(draws) / (1 - expected_rate)
    assert torch.allclose(draws[~zeroed], scaled[~zeroed], atol=1e-5)


# ============================================================================================= Depth-Adaptive

DA_TINY = tiny_config_kwargs(decoder_embed_dim=16, decoder_ffn_embed_dim=32, decoder_layers=3,
                             encoder_attention_heads=2, decoder_attention_heads=2)


def tiny_depth_adaptive(seed=0, **overrides) -> DepthAdaptiveForConditionalGeneration:
    torch.manual_seed(seed)
    return DepthAdaptiveForConditionalGeneration(DepthAdaptiveConfig(**{**DA_TINY, **overrides})).eval()


def da_batch(seed=1, size=3, src_len=7, tgt_len=5):
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(4, 60, (size, src_len), generator=generator)
    source[1, 5:] = 1
    target = torch.randint(4, 60, (size, tgt_len), generator=generator)
    return source, target


def test_mixed_training_samples_exits_uniformly_and_averages_the_samples():
    """Eq. 5: each token's exit n_t ~ U{1..N}, M sequences per batch, loss = the mean of the M samples' losses
    (each the cross-entropy of the logits of its exits, copied states above them)."""
    model = tiny_depth_adaptive(training_mode="mixed", mixed_num_samples=1).train()
    source, target = da_batch()
    counts, calls = Counter(), 150
    torch.manual_seed(8)
    with torch.no_grad():
        for _ in range(calls):
            counts.update(model(input_ids=source, labels=target).exits.flatten().tolist())
    draws = calls * target.numel()
    assert_frequencies(counts, {1: 1 / 3, 2: 1 / 3, 3: 1 / 3}, draws)

    model.config.mixed_num_samples = 2
    torch.manual_seed(9)
    with torch.no_grad():
        loss = model(input_ids=source, labels=target).loss
    torch.manual_seed(9)
    samples = [torch.randint(1, 4, target.shape) for _ in range(2)]  # the model's two draws, replayed
    with torch.no_grad():
        per_sample = [model(input_ids=source, labels=target, token_exits=exits).loss for exits in samples]
    assert loss.item() == pytest.approx(((per_sample[0] + per_sample[1]) / 2).item(), rel=1e-5)


def test_probability_threshold_logits_at_the_bounds():
    """χ > τ ⟺ z > logit(τ): τ = 0 → −inf (always exit), τ = 1 → +inf (never), τ = 0.5 → 0 exactly."""
    assert _probability_logit(0.0) == -math.inf and _probability_logit(-0.1) == -math.inf
    assert _probability_logit(1.0) == math.inf and _probability_logit(1.5) == math.inf
    assert _probability_logit(0.5) == 0.0
    assert _probability_logit(0.8) == pytest.approx(math.log(4.0))


def test_geometric_exit_distribution_at_saturated_halting_probabilities():
    """Eq. 13 at χ = 1 and χ = 0 (logits ±100): all the mass on the first halting block / on the top block, no NaN."""
    log_q = geometric_exit_log_probs(torch.tensor([[100.0, 100.0], [-100.0, -100.0], [-100.0, 100.0]]))
    q = log_q.exp()
    assert torch.allclose(q, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]), atol=1e-6)
    assert not torch.isnan(log_q).any()


def _exits(model, source, target, **settings):
    decoder_input = torch.cat([torch.full((target.shape[0], 1), 2), target], dim=1)
    with torch.no_grad():
        return model(input_ids=source, decoder_input_ids=decoder_input, use_cache=False, **settings).exits


@pytest.mark.parametrize(
    "block_biases, thresholds, expected_exit",
    [
        ((0.0, 0.0), (0.5, 0.5), 3),  # χ = 0.5 exactly: not > 0.5, no early exit
        ((0.0, 0.0), (0.4999, 0.5), 1),  # just below χ: exit at the first block
        ((-50.0, -50.0), (0.0, 0.0), 1),  # τ = 0: every state exits (χ ≈ 0 > 0)
        ((50.0, 50.0), (1.0, 1.0), 3),  # τ = 1: no state exits (χ ≈ 1 is not > 1)
        ((-1.0, 1.0), (0.5, 0.5), 2),  # χ¹ = 0.27, χ² = 0.73
    ],
)
def test_geometric_halting_thresholds_at_and_beyond_the_boundary(block_biases, thresholds, expected_exit):
    """The geometric-like halting exits after block n < N when χ^n_t > τ_n (strictly), else goes on; with w_h = 0
    χ^n_t = sigmoid(b_n) for every token, so the exit of every token is known exactly."""
    model = tiny_depth_adaptive(halting_mechanism="token_geometric")
    with torch.no_grad():
        model.halting.weight.weight.zero_()
        model.halting.bias.copy_(torch.tensor(block_biases))
    source, target = da_batch()
    exits = _exits(model, source, target, exit_thresholds=list(thresholds))
    assert torch.equal(exits, torch.full_like(exits, expected_exit))


@pytest.mark.parametrize("thresholds, expected_exit", [((0.0, 0.0), 1), ((1.0, 1.0), 3), ((1.0, 0.0), 2)])
def test_confidence_thresholds_at_zero_and_one(thresholds, expected_exit):
    """Confidence exits when max_y p(y|h^n) > τ_n: τ = 0 always exits, τ = 1 never does (no softmax reaches 1)."""
    model = tiny_depth_adaptive()
    source, target = da_batch()
    exits = _exits(model, source, target, exit_strategy="confidence", exit_thresholds=list(thresholds))
    assert torch.equal(exits, torch.full_like(exits, expected_exit))


@pytest.mark.parametrize("threshold_scale, expected_exit", [(1.0, 3), (0.999, 1)])
def test_confidence_threshold_exactly_at_the_confidence_does_not_exit(threshold_scale, expected_exit):
    """A uniform block-1 classifier (C_1 = 0) gives every token the confidence 1/V exactly: τ_1 = 1/V is not
    exceeded (strict >, no exit), a hair below it every token exits."""
    model = tiny_depth_adaptive()
    with torch.no_grad():
        for parameter in model.exit_classifier(1).parameters():
            parameter.zero_()
    source, target = da_batch()
    exits = _exits(model, source, target, exit_strategy="confidence", exit_thresholds=[threshold_scale / 60, 1.0])
    assert torch.equal(exits, torch.full_like(exits, expected_exit))


def test_confidence_threshold_just_above_and_below_a_tokens_confidence():
    """A token exits at block 1 exactly when its block-1 confidence is above τ_1 (strict)."""
    model = tiny_depth_adaptive(seed=2)
    source, target = da_batch()
    decoder_input = torch.cat([torch.full((3, 1), 2), target], dim=1)
    with torch.no_grad():
        aligned = model(input_ids=source, decoder_input_ids=decoder_input, labels=torch.cat([target, target[:, :1]], 1),
                        return_exit_logits=True)
    confidence = torch.softmax(aligned.exit_logits[0].float(), -1).amax(-1)  # [b, T]
    threshold = confidence.flatten().sort().values[confidence.numel() // 2].item()
    exits = _exits(model, source, target, exit_strategy="confidence", exit_thresholds=[threshold, 1.0])
    margin = 1e-6
    clear = (confidence - threshold).abs() > margin
    assert torch.equal((exits == 1)[clear], (confidence > threshold)[clear])
    assert ((exits == 1) | (exits == 3)).all()  # τ_2 = 1: nobody exits at block 2


# ======================================================================================================== InDIGO


def test_random_order_is_a_uniform_permutation():
    """RND (Table 1): every permutation of a 3-word target is equally likely (seeded, 6 outcomes)."""
    rng = random.Random(10)
    draws = 6000
    counts = Counter(tuple(order_random(3, rng)) for _ in range(draws))
    assert len(counts) == 6
    assert_frequencies(counts, {order: 1 / 6 for order in counts}, draws)


def test_relative_positions_clip_every_distance_to_its_sign():
    """Eq. 3: r_{i,j} ∈ {-1, 0, 1} whatever the distance — words 1 and 100 apart relate the same way — so Eq. 7's
    relation bias of a far word equals that of a neighbour."""
    positions = torch.tensor([0, 1, 100, -50])
    relations = relative_positions_from_absolute(positions)
    assert relations.dtype == torch.int8
    expected = torch.tensor([[0, -1, -1, 1], [1, 0, -1, 1], [1, 1, 0, 1], [-1, -1, -1, 0]], dtype=torch.int8)
    assert torch.equal(relations, expected)
    torch.manual_seed(11)
    model = InDIGOForConditionalGeneration(InDIGOConfig(**tiny_config_kwargs(vocab_size=40))).eval()
    attention = model.get_decoder().layers[0].self_attn
    query = torch.randn(1, attention.total_heads, 4, attention.head_dim)
    bias = attention.relative_position_bias(query, relative_positions=relations[None])
    assert torch.equal(bias[..., 0, 1], bias[..., 0, 2])  # 1 and 100 to the right: the same relation vector
    assert not torch.equal(bias[..., 0, 1], bias[..., 0, 3])  # left vs right differ


def _indigo(seed=12, **overrides) -> InDIGOForConditionalGeneration:
    torch.manual_seed(seed)
    return InDIGOForConditionalGeneration(InDIGOConfig(**tiny_config_kwargs(vocab_size=40, **overrides))).eval()


def test_word_query_projection_false_drops_matrix_f():
    """Eq. 8 with `word_query_projection=False`: the word logits are h Wᵀ (no F); True: (h F) Wᵀ."""
    hidden = torch.randn(2, 3, 32)
    plain = _indigo(word_query_projection=False)
    assert plain.word_query_proj is None
    with torch.no_grad():
        torch.testing.assert_close(plain.word_logits(hidden), hidden @ plain.lm_head.weight.T, atol=1e-5, rtol=1e-5)
        projected = _indigo(word_query_projection=True)
        expected = (hidden @ projected.word_query_proj.weight.T) @ projected.lm_head.weight.T
        torch.testing.assert_close(projected.word_logits(hidden), expected, atol=1e-5, rtol=1e-5)


def test_pointer_decision_scores_a_gap_by_its_two_slots_or_by_the_best_one(monkeypatch):
    """`pointer_decision="position"` scores a gap by p(right of the left word) + p(left of the right word) (Eq. 11),
    a distribution over the gaps; `"slot"` by the larger of the two (Algorithm 1). The first insertion has one gap:
    log-probability 0 with "position", the best of its two slots with "slot"."""
    model = _indigo()
    source = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 11, 2, 1]])
    recorded = {}
    original = type(model)._position_log_probs
    slots = []
    original_slots = type(model).slot_log_probs

    def spy_slots(self, *args):
        result = original_slots(self, *args)
        slots.append(result)
        return result

    def spy(self, query, state):
        gaps, reading = original(self, query, state)
        recorded.setdefault(self.config.pointer_decision, []).append((gaps[:, 0], slots[-1][:, 0], reading))
        return gaps, reading

    monkeypatch.setattr(type(model), "_position_log_probs", spy)
    monkeypatch.setattr(type(model), "slot_log_probs", spy_slots)
    for decision in ("position", "slot"):
        model.config.pointer_decision = decision
        with torch.no_grad():
            model.generate(source, max_new_tokens=4, min_new_tokens=4)
    first_position, first_slot = recorded["position"][0], recorded["slot"][0]
    assert torch.allclose(first_position[0], torch.zeros(2, 1), atol=1e-6)  # one gap: certain
    slot = first_slot[1]  # [rows, 2n] with n = 2: left of <s>, left of </s>, right of <s>, right of </s>
    assert torch.allclose(first_slot[0][:, 0], torch.maximum(slot[:, 2], slot[:, 1]), atol=1e-6)
    for gaps, _, _ in recorded["position"][1:]:
        assert torch.allclose(gaps.exp().sum(-1), torch.ones(2), atol=1e-5)  # Eq. 11 is a distribution over gaps
    assert len(recorded["slot"]) == len(recorded["position"]) == 4
    for slot_gaps, slot_probs, reading in recorded["slot"][1:]:
        n = reading.shape[-1]
        right = slot_probs[:, n:].gather(-1, reading[:, :-1])
        left = slot_probs[:, :n].gather(-1, reading[:, 1:])
        assert torch.allclose(slot_gaps, torch.maximum(left, right), atol=1e-6)


def test_sampled_first_word_follows_the_models_word_distribution():
    """Sampling decoding draws the first word from softmax of the (processed) word scores: over many identical
    rows, each word's frequency matches its probability."""
    model = _indigo(seed=13)
    bias_words = torch.zeros(40)
    bias_words[[5, 6, 7]] = torch.tensor([3.0, 2.0, 1.0])  # a few likely words, so their bins are well filled
    rows = 3000
    source = torch.tensor([[5, 6, 7, 8, 2]]).expand(rows, -1)
    original = model.word_logits
    model.word_logits = lambda hidden: original(hidden) + bias_words.to(hidden.dtype)
    torch.manual_seed(14)
    with torch.no_grad():
        out = model.generate(source, do_sample=True, max_new_tokens=1, return_dict_in_generate=True,
                             output_scores=True)
    assert torch.equal(out.scores[0], out.scores[0][:1].expand_as(out.scores[0]))  # identical rows
    probabilities = torch.softmax(out.scores[0][0].float(), -1)
    first_words = out.insertion_ids[:, 2]
    eod, pad = model.config.eod_token_id, model.config.pad_token_id
    first_words = first_words.masked_fill(first_words.eq(pad), eod).tolist()  # <eod> ends the row: nothing inserted
    counts = Counter(first_words)
    expected = {word: probabilities[word].item() for word in range(40) if probabilities[word] > 0}
    assert abs(sum(expected.values()) - 1.0) < 1e-5
    big = {word: p for word, p in expected.items() if p > 0.02}
    small_mass = sum(p for word, p in expected.items() if word not in big)
    grouped = Counter({word: counts.get(word, 0) for word in big})
    grouped["rest"] = sum(count for word, count in counts.items() if word not in big)
    assert_frequencies(grouped, {**big, "rest": small_mass}, rows)
