"""Depth-Adaptive Transformer: config validation and the paper's equations against hand-computed values."""

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from flexformers.configuration.configuration_depth_adaptive import DepthAdaptiveConfig
from flexformers.modeling import depth_adaptive_equations
from flexformers.modeling.depth_adaptive_cache import CopiedStateCache
from flexformers.modeling.depth_adaptive_equations import (
    aligned_decoding_loss,
    exit_loss,
    exit_loss_weights,
    geometric_exit_log_probs,
    gradient_scaling_factors,
    mean_encoder_output,
    rbf_kernel,
    scale_gradient,
    sequence_correctness_oracle,
    sequence_halting_log_probs,
    sequence_likelihood_oracle,
    smooth_over_time,
    token_correctness_oracle,
    token_likelihood_oracle,
    token_multinomial_log_probs,
)
from flexformers.modeling.depth_adaptive_flops import (
    DecoderFlopsShape,
    average_exit,
    average_flops_per_token,
    block_flops,
    exit_prediction_flops,
    sequence_flops,
    skipped_block_flops,
)
from flexformers.modeling.modeling_depth_adaptive import DepthAdaptiveForConditionalGeneration

# ---------------------------------------------------------------------------------------------------------------- config


def test_config_defaults_and_round_trip(tmp_path):
    config = DepthAdaptiveConfig(decoder_layers=3, exit_thresholds=[0.2, 1])
    assert config.model_type == "depth_adaptive"
    assert config.num_exits == 3
    assert config.exit_thresholds == [0.2, 1.0]
    assert config.default_exit_strategy == "full"
    assert DepthAdaptiveConfig(decoder_layers=3, halting_mechanism="token_geometric").default_exit_strategy == "halting"
    assert DepthAdaptiveConfig(decoder_layers=4).default_exit_thresholds == [0.5, 0.5, 0.5]
    config.save_pretrained(tmp_path)
    loaded = DepthAdaptiveConfig.from_pretrained(tmp_path)
    assert loaded.exit_thresholds == [0.2, 1.0] and loaded.decoder_layers == 3


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"exit_classifiers": "tied"}, "exit_classifiers"),
        ({"training_mode": "random"}, "training_mode"),
        ({"exit_loss_weighting": "n2"}, "exit_loss_weighting"),
        ({"halting_mechanism": "act"}, "halting_mechanism"),
        ({"oracle": "bleu"}, "oracle"),
        ({"exit_strategy": "sometimes"}, "exit_strategy"),
        ({"mixed_num_samples": 0}, "mixed_num_samples"),
        ({"gradient_scaling": 0.0}, "gradient_scaling"),
        ({"gradient_scaling": 0.5, "training_mode": "mixed"}, "gradient_scaling"),
        ({"oracle_lambda": -0.1}, "oracle_lambda"),
        ({"oracle_sigma": float("nan")}, "oracle_sigma"),
        ({"exit_loss_alpha": 1.0}, "exit_loss_alpha"),
        ({"exit_loss_alpha": 1.0, "halting_mechanism": "sequence", "training_mode": "mixed"}, "exit_loss_alpha"),
        ({"exit_strategy": "halting"}, "exit_strategy"),
        ({"fixed_exit": 0}, "fixed_exit"),
        ({"fixed_exit": 4}, "fixed_exit"),
        ({"exit_strategy": "fixed"}, "fixed_exit"),
        ({"exit_thresholds": [0.5]}, "exit_thresholds"),
        ({"exit_thresholds": [0.5, 1.5]}, "exit_thresholds"),
        ({"decoder_layerdrop": 0.1}, "decoder_layerdrop"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        DepthAdaptiveConfig(decoder_layers=3, **overrides)


# ---------------------------------------------------------------------------------------- Eq. 4 and Appendix A scaling


def test_exit_loss_weights_match_table_2_schemes():
    torch.testing.assert_close(exit_loss_weights("uniform", 4), torch.full((4,), 0.25, dtype=torch.float64))
    torch.testing.assert_close(exit_loss_weights("inv_n", 2), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64))
    torch.testing.assert_close(exit_loss_weights("n", 3), torch.tensor([1 / 6, 2 / 6, 3 / 6], dtype=torch.float64))
    sqrt = torch.tensor([1.0, math.sqrt(2)], dtype=torch.float64)
    torch.testing.assert_close(exit_loss_weights("sqrt_n", 2), sqrt / sqrt.sum())
    inv_sqrt = 1 / sqrt
    torch.testing.assert_close(exit_loss_weights("inv_sqrt_n", 2), inv_sqrt / inv_sqrt.sum())
    with pytest.raises(ValueError, match="exit_loss_weighting"):
        exit_loss_weights("cubic", 2)


def test_aligned_decoding_loss_is_the_weighted_average():
    losses = torch.tensor([2.0, 4.0, 6.0])
    assert aligned_decoding_loss(losses, exit_loss_weights("uniform", 3)).item() == pytest.approx(4.0)
    assert aligned_decoding_loss(losses, exit_loss_weights("n", 3)).item() == pytest.approx((2 + 8 + 18) / 6)


def test_scale_gradient_is_identity_forward_and_scales_backward():
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    y = scale_gradient(x, 0.3)
    torch.testing.assert_close(y, x.detach())
    (y * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.3, 0.6, 0.9]))


def test_gradient_scaling_factors_gamma_times_blocks_above():
    assert gradient_scaling_factors(0.5, 4) == [1.5, 1.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="gamma"):
        gradient_scaling_factors(0.0, 4)


# ---------------------------------------------------------------------------------------- halting distributions


def test_sequence_halting_distribution_eq8_uses_mean_of_non_pad_encoder_states():
    states = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    mean = mean_encoder_output(states, mask)
    torch.testing.assert_close(mean, torch.tensor([[2.0, 3.0]]))
    projection = nn.Linear(2, 3)
    with torch.no_grad():
        projection.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
        projection.bias.copy_(torch.tensor([0.0, 0.0, 1.0]))
    # logits (2, 3, 1) → softmax
    expected = torch.log_softmax(torch.tensor([[2.0, 3.0, 1.0]]), dim=-1)
    torch.testing.assert_close(sequence_halting_log_probs(mean, projection), expected)


def test_token_multinomial_distribution_eq11():
    projection = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        projection.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    log_q = token_multinomial_log_probs(torch.tensor([[[math.log(3.0), 5.0]]]), projection)
    torch.testing.assert_close(log_q.exp(), torch.tensor([[[0.75, 0.25]]]))


def test_geometric_like_distribution_eq13_by_hand():
    # χ¹ = sigmoid(0) = 0.5, χ² = sigmoid(log 3) = 0.75 → q = (0.5, 0.5·0.75, 0.5·0.25)
    log_q = geometric_exit_log_probs(torch.tensor([0.0, math.log(3.0)]))
    torch.testing.assert_close(log_q.exp(), torch.tensor([0.5, 0.375, 0.125]))
    random_logits = torch.randn(4, 7, 5)
    torch.testing.assert_close(geometric_exit_log_probs(random_logits).exp().sum(-1), torch.ones(4, 7))


# ---------------------------------------------------------------------------------------------------------- oracles

# LL^n_t for one sentence, T = 2 tokens, N = 3 exits.
TOKEN_LL = torch.tensor([[[-1.0, -0.5, -0.4], [-2.0, -1.0, -0.2]]])
FULL_MASK = torch.ones(1, 2, dtype=torch.bool)


def test_sequence_likelihood_oracle_eq9():
    # LL^n = (-3, -1.5, -0.6)
    assert sequence_likelihood_oracle(TOKEN_LL, FULL_MASK, 0.0).tolist() == [3]
    # − λn with λ = 1: (-4, -3.5, -3.6) → block 2
    assert sequence_likelihood_oracle(TOKEN_LL, FULL_MASK, 1.0).tolist() == [2]
    # padding is ignored: only t = 1 counts, (-1, -0.5, -0.4) − 0.2n = (-1.2, -0.9, -1.0) → block 2
    assert sequence_likelihood_oracle(TOKEN_LL, torch.tensor([[True, False]]), 0.2).tolist() == [2]


def test_sequence_correctness_oracle_eq10_prefers_the_lowest_block_on_ties():
    correct = torch.tensor([[[True, False, True], [False, True, True]]])  # C = (1, 1, 2)
    assert sequence_correctness_oracle(correct, FULL_MASK, 0.0).tolist() == [3]
    assert sequence_correctness_oracle(correct, FULL_MASK, 1.0).tolist() == [1]  # (0, -1, -1)
    assert sequence_correctness_oracle(correct, FULL_MASK, 0.5).tolist() == [1]  # (0.5, 0, 0.5): tie → lowest


def test_rbf_kernel_eq15():
    kernel = rbf_kernel(3, 2.0)
    assert kernel[0, 1].item() == pytest.approx(math.exp(-1 / 4))
    assert kernel[0, 2].item() == pytest.approx(math.exp(-4 / 4))
    assert kernel[1, 1].item() == 1.0
    torch.testing.assert_close(rbf_kernel(3, 0.0), torch.eye(3))


def test_smoothing_leaves_out_padding():
    scores = torch.tensor([[[1.0], [10.0], [100.0]]])
    smoothed = smooth_over_time(scores, torch.tensor([[True, True, False]]), 1.0)
    e = math.exp(-1.0)
    torch.testing.assert_close(smoothed[0, :, 0], torch.tensor([1 + 10 * e, e + 10, math.exp(-4) + 10 * e]))


def test_token_likelihood_oracle_eq14_and_eq15():
    # σ = 0 (Eq. 14): per token, t1 (-1, -.5, -.4) → 3; t2 (-2, -1, -.2) → 3; with λ = 0.2: t1 → 2, t2 → 3
    assert token_likelihood_oracle(TOKEN_LL, FULL_MASK, 0.0, 0.0).tolist() == [[3, 3]]
    assert token_likelihood_oracle(TOKEN_LL, FULL_MASK, 0.0, 0.2).tolist() == [[2, 3]]
    # σ = 1 (Eq. 15): LL̃_1 = LL_1 + e^-1 LL_2 = (-1.7358, -0.8679, -0.4736); − 0.2n → (-1.936, -1.268, -1.074) → 3
    # LL̃_2 = e^-1 LL_1 + LL_2 = (-2.3679, -1.1839, -0.3472); − 0.2n → (-2.568, -1.584, -0.947) → 3
    assert token_likelihood_oracle(TOKEN_LL, FULL_MASK, 1.0, 0.2).tolist() == [[3, 3]]
    # λ = 0.5: LL̃_1 − 0.5n = (-2.236, -1.868, -1.974) → 2
    assert token_likelihood_oracle(TOKEN_LL, FULL_MASK, 1.0, 0.5).tolist()[0][0] == 2


def test_token_correctness_oracle_eq16_eq17():
    # T = 3, N = 2: block 1 right at t = 1 only; block 2 right at t = 2, 3.
    correct = torch.tensor([[[True, False], [False, True], [False, True]]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert token_correctness_oracle(correct, mask, 0.0, 0.0).tolist() == [[1, 2, 2]]
    # σ = 1: C̃_1 = (1, e^-1 + e^-4) = (1, 0.386) → 1; C̃_2 = (e^-1, 1 + e^-1) → 2
    assert token_correctness_oracle(correct, mask, 1.0, 0.0).tolist() == [[1, 2, 2]]
    # σ = 1, λ = 0.7: C̃_2 − 0.7n = (0.368 − 0.7, 1.368 − 1.4) = (-0.332, -0.032) → 2
    assert token_correctness_oracle(correct, mask, 1.0, 0.7).tolist()[0][1] == 2
    # λ = 1.1: (0.368 − 1.1, 1.368 − 2.2) = (-0.732, -0.832) → 1
    assert token_correctness_oracle(correct, mask, 1.0, 1.1).tolist()[0][1] == 1


def test_exit_loss_eq6_is_the_cross_entropy_to_the_dirac_oracle():
    log_q = torch.log(torch.tensor([[[0.5, 0.375, 0.125], [0.2, 0.3, 0.5]]]))
    oracle = torch.tensor([[2, 3]])
    assert exit_loss(log_q, oracle).item() == pytest.approx(-math.log(0.375) - math.log(0.5))
    assert exit_loss(log_q, oracle, torch.tensor([[True, False]])).item() == pytest.approx(-math.log(0.375))


# ---------------------------------------------------------------------------------------------- Appendix B FLOPs

SHAPE = DecoderFlopsShape(decoder_embed_dim=4, encoder_embed_dim=8, ffn_dim=16, vocab_size=10, num_blocks=3)


def test_block_flops_by_hand():
    # 12·4² + 4·16·4 + 4·t·4 + 4·5·4 = 192 + 256 + 16t + 80; first call adds 4·5·4·8 = 640
    assert block_flops(SHAPE, source_length=5, t=1, first_call=False) == 192 + 256 + 16 + 80
    assert block_flops(SHAPE, source_length=5, t=2, first_call=True) == 192 + 256 + 32 + 80 + 640
    assert skipped_block_flops(SHAPE) == 64


def test_exit_prediction_flops_by_mechanism():
    assert exit_prediction_flops(SHAPE, "sequence", 1, 2) == 2 * 3 * 4
    assert exit_prediction_flops(SHAPE, "sequence", 2, 2) == 0
    assert exit_prediction_flops(SHAPE, "token_multinomial", 5, 1) == 2 * 3 * 4
    assert exit_prediction_flops(SHAPE, "token_geometric", 5, 2) == 2 * 4 * 2
    assert exit_prediction_flops(SHAPE, "confidence", 5, 2) == 2 * 2 * 10 * 4
    assert exit_prediction_flops(SHAPE, "fixed", 5, 2) == 0
    with pytest.raises(ValueError, match="mechanism"):
        exit_prediction_flops(SHAPE, "oracle", 1, 1)


def test_sequence_flops_baseline_and_adaptive_by_hand():
    # Baseline, 2 tokens, all 3 blocks: t=1: 3·(1168 + 16) + 80; t=2: 3·(528 + 32) + 80
    assert sequence_flops(SHAPE, [3, 3], 5, "full") == 3 * 1184 + 80 + 3 * 560 + 80
    # Geometric-like exits (1, 2): t=1: FC(first) 1184 + 2·FS 128 + FP 8 + 80;
    # t=2: block 1 560 + block 2 first call 1200 + FS 64 + FP 16 + 80
    assert sequence_flops(SHAPE, [1, 2], 5, "token_geometric") == (1184 + 128 + 8 + 80) + (560 + 1200 + 64 + 16 + 80)
    # Confidence: FP = 2 q V d replaces the final projection
    assert sequence_flops(SHAPE, [1, 2], 5, "confidence") == (1184 + 128 + 80) + (560 + 1200 + 64 + 160)
    assert average_flops_per_token(SHAPE, [[1, 2], [3]], [5, 5], "token_geometric") == pytest.approx(
        ((1184 + 128 + 8 + 80) + (560 + 1200 + 64 + 16 + 80) + (3 * 1184 + 2 * 4 * 3 + 80)) / 3
    )
    assert average_exit([[1, 2], [3]]) == 2.0
    with pytest.raises(ValueError, match="outside"):
        sequence_flops(SHAPE, [4], 5, "full")


# ------------------------------------------------------------------ issue 65: behaviour the mutation run found untested

TINY_DEPTH_ADAPTIVE = {
    "vocab_size": 40,
    "encoder_embed_dim": 8,
    "decoder_embed_dim": 8,
    "encoder_ffn_embed_dim": 16,
    "decoder_ffn_embed_dim": 16,
    "encoder_layers": 1,
    "decoder_layers": 3,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "dropout": 0.0,
    "max_source_positions": 16,
    "max_target_positions": 16,
}


def tiny_depth_adaptive(**overrides) -> DepthAdaptiveForConditionalGeneration:
    torch.manual_seed(0)
    return DepthAdaptiveForConditionalGeneration(DepthAdaptiveConfig(**{**TINY_DEPTH_ADAPTIVE, **overrides})).eval()


def test_mean_encoder_output_keeps_the_states_dtype_whatever_the_mask_dtype():
    # A float32 attention mask with a bfloat16 model: s̄ must stay bfloat16 so W_h (bfloat16) can take it (Eq. 8).
    states = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]], dtype=torch.bfloat16)
    mean = mean_encoder_output(states, torch.tensor([[1.0, 1.0, 0.0]]))
    assert mean.dtype == torch.bfloat16
    torch.testing.assert_close(mean, torch.tensor([[2.0, 3.0]], dtype=torch.bfloat16))
    projection = nn.Linear(2, 3).to(torch.bfloat16)
    log_q = sequence_halting_log_probs(mean, projection)
    torch.testing.assert_close(log_q.exp().sum(-1), torch.ones(1))


def test_sequence_halting_ignores_padded_source_positions():
    # Eq. 8 averages over the |x| real source tokens: padding a sentence must not change its q(n|x).
    model = tiny_depth_adaptive(halting_mechanism="sequence")
    halting = next(module for module in model.modules() if type(module).__name__ == "SequenceHalting")
    torch.manual_seed(1)
    states = torch.randn(2, 5, 8)
    states[1, 3:] = 50.0  # padding states far from the real ones
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():
        padded = halting(states, mask)
        alone = halting(states[1:, :3])
        expected = torch.log_softmax(halting.projection(states[1, :3].mean(0)), dim=-1)
    torch.testing.assert_close(padded[1], alone[0])
    torch.testing.assert_close(padded[1], expected)


def test_token_oracles_default_to_the_unsmoothed_unpenalised_equations():
    # Without σ and λ, the token oracles are Eq. 14 / Eq. 16 (per-token argmax), the sequence ones Eq. 9 / Eq. 10.
    # t1 (-1, -2) → 1, t2 (-10, -1) → 2; smoothing with σ = 1 would move t1 to block 2 (-4.68, -2.37).
    token_ll = torch.tensor([[[-1.0, -2.0], [-10.0, -1.0]]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert token_likelihood_oracle(token_ll, mask).tolist() == [[1, 2]]
    assert token_likelihood_oracle(token_ll, mask, 1.0).tolist() == [[2, 2]]
    correct = torch.tensor([[[True, False], [False, True], [False, True]]])
    assert token_correctness_oracle(correct, torch.ones(1, 3, dtype=torch.bool)).tolist() == [[1, 2, 2]]
    # t1 right at both blocks (a tie: the shallower exit); σ = 1 would add its neighbours' block-2 hits → 2.
    tie = torch.tensor([[[True, True], [False, True], [False, True]]])
    assert token_correctness_oracle(tie, torch.ones(1, 3, dtype=torch.bool)).tolist() == [[1, 2, 2]]
    assert token_correctness_oracle(tie, torch.ones(1, 3, dtype=torch.bool), 1.0).tolist() == [[2, 2, 2]]
    # λ defaults to 0: LL^n = (-11, -3) → 2 even though λ = 10 would pick block 1.
    assert sequence_likelihood_oracle(token_ll, mask).tolist() == [2]
    assert sequence_correctness_oracle(correct, torch.ones(1, 3, dtype=torch.bool)).tolist() == [2]


def test_smoothing_kernel_is_built_on_the_scores_device(monkeypatch):
    # κ of Eq. 15 must be made where the scores are (an accelerator's scores with a host kernel fail, or copy every
    # call); "meta" stands in for a second device on a CPU-only machine.
    kernels = []

    def recording_rbf_kernel(*args, **kwargs):
        kernel = rbf_kernel(*args, **kwargs)
        kernels.append(kernel)
        return kernel

    monkeypatch.setattr(depth_adaptive_equations, "rbf_kernel", recording_rbf_kernel)
    scores = torch.zeros(2, 4, 3, device="meta")
    smoothed = smooth_over_time(scores, torch.ones(2, 4, dtype=torch.bool, device="meta"), 1.0)
    assert smoothed.device.type == "meta"
    assert [kernel.device.type for kernel in kernels] == ["meta"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_token_oracles_run_on_cuda():
    token_ll = torch.tensor([[[-1.0, -2.0], [-10.0, -1.0]]], device="cuda")
    mask = torch.ones(1, 2, dtype=torch.bool, device="cuda")
    assert token_likelihood_oracle(token_ll, mask, 1.0, 0.0).tolist() == [[2, 2]]


def test_masked_classify_by_exit_matches_the_grouped_path_in_eager_mode():
    # The torch.export path (every classifier on every position, keep each position's own) must give the same
    # logits as the eager grouping by exit, with each position scored by W_n of its exit n (Eq. 3).
    model = tiny_depth_adaptive()
    torch.manual_seed(2)
    states = torch.randn(2, 4, 8)
    exits = torch.tensor([[1, 2, 3, 1], [3, 3, 2, 1]])
    with torch.no_grad():
        masked = model._classify_by_exit_masked(states, exits)
        grouped = model.classify_by_exit(states, exits)
        for block in (1, 2, 3):
            own = model.classify(block, states)
            torch.testing.assert_close(masked[exits == block], own[exits == block])
    torch.testing.assert_close(masked, grouped)


def test_copied_state_cache_is_reusable_after_reset():
    cache = CopiedStateCache()
    cache.record_copied_states(0, torch.ones(2, 1, 4))
    cache.record_copied_states(1, torch.full((2, 1, 4), 2.0))
    cache.reset()
    with pytest.raises(RuntimeError, match="no copied states were recorded"):
        cache.missing_copied_states(0, 1)
    # a fresh generation with another batch size records and reads its own states only
    states = torch.arange(12.0).view(3, 1, 4)
    cache.record_copied_states(0, states)
    torch.testing.assert_close(cache.missing_copied_states(0, 1), states)
    with pytest.raises(RuntimeError, match="no copied states were recorded up to 2"):
        cache.missing_copied_states(0, 2)


# Round 2 mutation survivors (issue 65)


def test_flops_shape_of_a_model_config_reads_each_quantity_of_table_4():
    """d_d, d_e, d_f, V (the decoder's own vocabulary) and N each come from their own config field (all different
    here), so the FLOPs of Appendix B are those of the model's shape."""
    config = DepthAdaptiveConfig(**{**TINY_DEPTH_ADAPTIVE, "decoder_embed_dim": 12, "decoder_ffn_embed_dim": 20,
                                    "decoder_layers": 4, "target_vocab_size": 30})
    shape = DecoderFlopsShape.from_config(config)
    assert shape == DecoderFlopsShape(decoder_embed_dim=12, encoder_embed_dim=8, ffn_dim=20, vocab_size=30, num_blocks=4)
    # Baseline formula, one token (t = 1) through the 4 blocks, |x| = 3: 4 FC(x, 1) + 2 V d_d
    first_call = 12 * 12**2 + 4 * 20 * 12 + 4 * 1 * 12 + 4 * 3 * 12 + 4 * 3 * 12 * 8
    assert sequence_flops(shape, [4], 3, "full") == 4 * first_call + 2 * 30 * 12


def _reference_oracle(exit_logits, labels, oracle, mechanism, sigma, lam):
    """q* of Eq. 9/10 (sequence) or Eq. 14-17 (token), position by position in float64: LL^n_t or C^n_t, smoothed
    with κ(t, t') = exp(−(t − t')²/σ²) over the target tokens, then the lowest n maximising score − λn."""
    mask = labels.ne(-100)
    per_block = []
    for logits in exit_logits:
        logits = logits.double()
        if oracle == "likelihood":
            scores = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        else:
            scores = logits.argmax(-1).eq(labels).double()
        per_block.append(scores * mask)
    scores = torch.stack(per_block, -1)  # [b, T, N]
    if mechanism == "sequence":
        totals = scores.sum(1)  # [b, N]
    else:
        steps = torch.arange(labels.shape[1], dtype=torch.float64)
        kernel = torch.exp(-((steps[:, None] - steps[None, :]) ** 2) / sigma**2)
        totals = torch.einsum("ts,bsn->btn", kernel, scores)
    penalised = totals - lam * torch.arange(1, scores.shape[-1] + 1, dtype=torch.float64)
    best = penalised.max(-1, keepdim=True).values
    return (penalised >= best - 1e-9).double().argmax(-1) + 1  # the first block within rounding of the best


@pytest.mark.parametrize("mechanism", ["sequence", "token_multinomial", "token_geometric"])
def test_the_halting_loss_targets_the_oracle_the_config_names(mechanism):
    """The oracle exits the model trains its halting mechanism towards (Eq. 6) are those of the configured oracle,
    likelihood (Eq. 9, 14-15) or correctness (Eq. 10, 16-17), computed here from the classifiers' logits. Labels
    are chosen so that some classifiers are right at some positions and the two oracles disagree."""
    sigma, lam = 1.0, 0.05
    generator = torch.Generator().manual_seed(40)
    source = torch.randint(4, 40, (3, 6), generator=generator)
    labels = torch.randint(4, 40, (3, 5), generator=generator)
    labels[2, 3:] = -100
    probe = tiny_depth_adaptive(halting_mechanism=mechanism)
    with torch.no_grad():
        for t in range(labels.shape[1]):  # logits at t see labels before t only: fix label t to one classifier's argmax
            exit_logits = probe(input_ids=source, labels=labels, return_exit_logits=True).exit_logits
            for row in range(labels.shape[0]):
                if labels[row, t] != -100 and (row + t) % 3:
                    labels[row, t] = exit_logits[(row + t) % 3][row, t].argmax()
    oracle_exits = {}
    for oracle in ("likelihood", "correctness"):
        model = tiny_depth_adaptive(halting_mechanism=mechanism, oracle=oracle, oracle_sigma=sigma,
                                    oracle_lambda=lam, exit_loss_alpha=0.5)
        with torch.no_grad():
            output = model(input_ids=source, labels=labels, return_exit_logits=True)
        expected = _reference_oracle(output.exit_logits, labels, oracle, mechanism, sigma, lam)
        counted = labels.ne(-100) if mechanism != "sequence" else torch.ones(labels.shape[0], dtype=torch.bool)
        assert torch.equal(output.oracle_exits[counted], expected[counted]), oracle
        oracle_exits[oracle] = output.oracle_exits
    assert not torch.equal(oracle_exits["likelihood"], oracle_exits["correctness"]), "inputs must tell them apart"


@pytest.mark.parametrize("dense_step_fraction", [0.0, 2.0], ids=["dense", "sparse"])
def test_incremental_steps_report_the_blocks_states_and_weights_of_the_recomputation(dense_step_fraction):
    """`output_hidden_states` / `output_attentions` of one early-exit decoding step whose rows leave at different
    blocks: each block's states and self-/cross-attention weights of every row are those of the layer-wise pass
    with the same exits, and a row's weights are a distribution up to its exit and zero above it."""
    from tests.test_depth_adaptive import PAD, balance_exits, decoder_input_for, make_batch, make_model
    from flexformers.modeling.transformers_compat import output_cache

    model = make_model(seed=3, halting_mechanism="token_geometric")
    model.model.decoder.dense_step_fraction = dense_step_fraction
    source, target = make_batch()
    settings = balance_exits(model, source, target, {})
    attention_mask = source.ne(PAD).long()
    decoder_input = decoder_input_for(target)
    wanted = dict(output_hidden_states=True, output_attentions=True)
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(input_ids=source, attention_mask=attention_mask)
        cache, steps = None, []
        for t in range(decoder_input.shape[1]):
            step = model(encoder_outputs=encoder_outputs, attention_mask=attention_mask,
                         decoder_input_ids=decoder_input[:, t:t + 1], past_key_values=cache, use_cache=True,
                         **wanted, **settings)
            cache = output_cache(step)
            steps.append(step)
        exits = torch.cat([step.exits for step in steps], 1)
        full = model(encoder_outputs=encoder_outputs, attention_mask=attention_mask, decoder_input_ids=decoder_input,
                     token_exits=exits, use_cache=False, **wanted)
    num_blocks = model.config.decoder_layers
    assert any(step.exits.unique().numel() > 1 for step in steps), "a step must mix exits within the batch"
    for t, step in enumerate(steps):
        assert len(step.decoder_hidden_states) == num_blocks + 1 and len(step.decoder_attentions) == num_blocks
        for index, states in enumerate(step.decoder_hidden_states):
            torch.testing.assert_close(states[:, 0], full.decoder_hidden_states[index][:, t], atol=1e-5, rtol=1e-5)
        for block in range(1, num_blocks + 1):
            self_weights, cross_weights = step.decoder_attentions[block - 1], step.cross_attentions[block - 1]
            torch.testing.assert_close(self_weights[:, :, 0], full.decoder_attentions[block - 1][:, :, t, :t + 1],
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cross_weights[:, :, 0], full.cross_attentions[block - 1][:, :, t],
                                       atol=1e-5, rtol=1e-5)
            ran = step.exits[:, 0] >= block
            for weights in (self_weights, cross_weights):
                totals = weights[:, :, 0].sum(-1)  # [b, heads]
                torch.testing.assert_close(totals[ran], torch.ones_like(totals[ran]))
                assert not weights[~ran].any(), (t, block)


# ---- issue 65, round 3: the held-out sample's (seed 2) survivors ----


def test_average_flops_of_a_single_token_is_that_tokens_flops():
    """One hypothesis of one token (the smallest decoding there is) averages to its own FLOPs, as a longer one."""
    assert average_flops_per_token(SHAPE, [[2]], [5], "token_geometric") == sequence_flops(SHAPE, [2], 5,
                                                                                           "token_geometric")
    with pytest.raises(ValueError, match="at least one generated token"):
        average_flops_per_token(SHAPE, [[]], [5], "token_geometric")


def test_rbf_kernel_is_computed_in_double_precision_then_cast():
    """Eq. 15's κ in float64 matches the formula to double precision (a kernel built in float32 and cast up would
    be off by ~1e-8)."""
    sigma = 3.0
    kernel = rbf_kernel(6, sigma, dtype=torch.float64)
    expected = torch.tensor([[math.exp(-((i - j) ** 2) / sigma**2) for j in range(6)] for i in range(6)],
                            dtype=torch.float64)
    torch.testing.assert_close(kernel, expected, rtol=1e-13, atol=0)


def test_copied_state_cache_refuses_a_positive_crop():
    """`crop` takes the negative number of tokens to remove (Transformers' convention): +1 is refused, not read as
    "keep one token"."""
    cache = CopiedStateCache()
    cache.record_copied_states(0, torch.ones(2, 1, 4))
    for tokens in (1, 2):
        with pytest.raises(ValueError, match="negative number of tokens"):
            cache.crop(tokens)
    cache.crop(0)  # removes nothing


@pytest.mark.parametrize("normalize_before", [False, True])
def test_layerwise_hidden_states_end_with_the_decoders_final_layer_norm(normalize_before):
    """The block-by-block pass (what the exit losses run) returns the embeddings and every block's states, the last
    through the pre-norm decoder's final LayerNorm, exactly as the backbone's decoder returns them."""
    from flexformers.configuration.configuration_flexformer import FlexformerConfig
    from flexformers.modeling.modeling_depth_adaptive import DepthAdaptiveForConditionalGeneration
    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration

    sizes = dict(vocab_size=60, encoder_embed_dim=16, decoder_embed_dim=16, encoder_ffn_embed_dim=32,
                 decoder_ffn_embed_dim=32, encoder_layers=1, decoder_layers=3, encoder_attention_heads=2,
                 decoder_attention_heads=2, dropout=0.0, decoder_normalize_before=normalize_before)
    torch.manual_seed(0)
    model = DepthAdaptiveForConditionalGeneration(DepthAdaptiveConfig(**sizes)).eval()
    baseline = FlexformerForConditionalGeneration(FlexformerConfig(**sizes)).eval()
    baseline.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("exit_classifiers.")})
    generator = torch.Generator().manual_seed(4)
    source = torch.randint(4, 60, (2, 6), generator=generator)
    target = torch.randint(4, 60, (2, 5), generator=generator)
    with torch.no_grad():
        ours = model(input_ids=source, labels=target, output_hidden_states=True)
        theirs = baseline(input_ids=source, labels=target, output_hidden_states=True)
    assert len(ours.decoder_hidden_states) == len(theirs.decoder_hidden_states) == 4
    for index, (mine, reference) in enumerate(zip(ours.decoder_hidden_states, theirs.decoder_hidden_states)):
        torch.testing.assert_close(mine, reference, msg=f"decoder hidden state {index}")


# ---------------------------------------------- round 4 (docs/MUTATION.md): what seed 3's survivors showed untested


def test_geometric_halting_gives_each_block_its_own_bias_eq12_13():
    """χ^n_t = sigmoid(w_hᵀ h^n_t + b_n) with b_n the bias of block n (1-based, Eq. 12), then q_t(n) of Eq. 13 —
    computed by hand with a different bias per block, so a shifted block index cannot pass."""
    model = tiny_depth_adaptive(halting_mechanism="token_geometric", decoder_layers=4)
    halting = model.halting
    with torch.no_grad():
        halting.bias.copy_(torch.tensor([-1.0, 0.5, 2.0]))
    generator = torch.Generator().manual_seed(0)
    states = [torch.randn(2, 3, 8, generator=generator) for _ in range(3)]  # h¹, h², h³
    chi = [torch.sigmoid(halting.weight(h).squeeze(-1) + b) for h, b in zip(states, (-1.0, 0.5, 2.0))]
    expected = torch.stack(
        [chi[0], (1 - chi[0]) * chi[1], (1 - chi[0]) * (1 - chi[1]) * chi[2], (1 - chi[0]) * (1 - chi[1]) * (1 - chi[2])],
        -1,
    )
    with torch.no_grad():
        torch.testing.assert_close(halting(states).exp(), expected)


def test_token_halting_loss_reads_the_first_blocks_states_and_the_oracles_lambda():
    """Token-specific multinomial halting (Eq. 11) predicts from h¹_t, the first block's state; its target is
    LL(σ, λ) of Eq. 14-15 with the config's λ (a large λ pulls every token's oracle exit to block 1)."""
    generator = torch.Generator().manual_seed(0)
    states = [torch.randn(2, 4, 8, generator=generator) for _ in range(3)]
    exit_logits = [torch.randn(2, 4, 40, generator=generator) for _ in range(3)]
    labels = torch.randint(4, 40, (2, 4), generator=generator)
    labels[1, 3] = -100
    for lam in (0.0, 50.0):
        model = tiny_depth_adaptive(halting_mechanism="token_multinomial", oracle="likelihood", oracle_lambda=lam)
        with torch.no_grad():
            loss, oracle, log_q = model.halting_loss(states, exit_logits, labels, None, None)
            torch.testing.assert_close(log_q, model.halting(states[0]))
        scores = torch.stack([F.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
                              for logits in exit_logits], -1)
        assert torch.equal(oracle, token_likelihood_oracle(scores, labels.ne(-100), 0.0, lam))
        if lam:
            assert oracle[labels.ne(-100)].eq(1).all()
        else:
            assert oracle[labels.ne(-100)].gt(1).any()  # without λ some token prefers a deeper exit


def test_sequence_halting_flops_are_paid_once_at_the_first_token():
    """Appendix B: sequence-specific depth predicts once per sentence, FP = 2 N d_d at t = 1 and 0 after."""
    exits = [2, 2, 2]
    extra = sequence_flops(SHAPE, exits, 5, "sequence") - sequence_flops(SHAPE, exits, 5, "fixed")
    assert extra == 2 * SHAPE.num_blocks * SHAPE.decoder_embed_dim


def test_rbf_kernel_of_sigma_zero_is_made_on_the_given_device():
    """σ = 0 (the identity) is made on the device asked for, like σ > 0 ("meta" stands in for an accelerator)."""
    assert rbf_kernel(3, 0.0, device=torch.device("meta")).is_meta
    assert rbf_kernel(3, 1.0, device=torch.device("meta")).is_meta


def test_token_halting_loss_with_the_correctness_oracle_uses_the_oracles_lambda():
    """With the correctness oracle (Eq. 16-17) the token halting target also pays the config's λ per block: a token
    only the deepest classifier gets right exits there with λ = 0, and at block 1 with a large λ."""
    generator = torch.Generator().manual_seed(1)
    states = [torch.randn(2, 4, 8, generator=generator) for _ in range(3)]
    exit_logits = [torch.randn(2, 4, 40, generator=generator) for _ in range(3)]
    labels = torch.randint(4, 40, (2, 4), generator=generator)
    labels[0, 1] = exit_logits[2][0, 1].argmax()
    assert exit_logits[0][0, 1].argmax() != labels[0, 1] and exit_logits[1][0, 1].argmax() != labels[0, 1]
    exits = {}
    for lam in (0.0, 50.0):
        model = tiny_depth_adaptive(halting_mechanism="token_multinomial", oracle="correctness", oracle_lambda=lam)
        with torch.no_grad():
            exits[lam] = model.halting_loss(states, exit_logits, labels, None, None)[1]
    assert exits[0.0][0, 1] == 3 and exits[50.0][0, 1] == 1
