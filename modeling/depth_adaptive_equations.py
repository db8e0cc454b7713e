"""The Depth-Adaptive Transformer's equations (Elbayad, Gu, Grave & Auli, ICLR 2020), one function each.

Exit losses (Eq. 4, 7), gradient scaling of the exits, the halting mechanisms' distributions (Eq. 8, 14-16) and their
oracles (Eq. 9-13, 17). Exits are 1-based like the paper (n ∈ 1..N); per-exit tensors put the exit on the last
dimension.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def exit_loss_weights(weighting: str, num_exits: int) -> torch.Tensor:
    """ω_n / Σ_n' ω_n' of Eq. 4 for the weighting schemes of Appendix A (Table 2): ``"uniform"`` (ω_n = 1), ``"n"``,
    ``"sqrt_n"`` (√n), ``"inv_sqrt_n"`` (1/√n), ``"inv_n"`` (1/n). Returns a float64 tensor ``[N]`` summing to 1."""
    if num_exits < 1:
        raise ValueError(f"num_exits must be >= 1, got {num_exits}")
    n = torch.arange(1, num_exits + 1, dtype=torch.float64)
    schemes = {
        "uniform": torch.ones_like(n),
        "n": n,
        "sqrt_n": n.sqrt(),
        "inv_sqrt_n": n.rsqrt(),
        "inv_n": n.reciprocal(),
    }
    if weighting not in schemes:
        raise ValueError(f"exit_loss_weighting must be one of {tuple(schemes)}, got {weighting!r}")
    weights = schemes[weighting]
    return weights / weights.sum()


def aligned_decoding_loss(per_exit_losses: torch.Tensor, normalized_weights: torch.Tensor) -> torch.Tensor:
    """Eq. 4: L_dec = −(1/Σω) Σ_n ω_n LL^n, given ``per_exit_losses[n-1] = −LL^n`` (already summed over tokens, and
    label-smoothed when the config asks for it) and the normalised weights of :func:`exit_loss_weights`."""
    if per_exit_losses.shape != normalized_weights.shape:
        raise ValueError(
            f"per_exit_losses {tuple(per_exit_losses.shape)} and weights {tuple(normalized_weights.shape)} differ"
        )
    return (normalized_weights.to(per_exit_losses.dtype) * per_exit_losses).sum()


def scale_gradient(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """SCALE_GRADIENT of Appendix A, Algorithm 1 (lines 7–8): ``γ·x + (1 − γ)·stop_gradient(x)`` — the identity in
    the forward pass, a factor γ on the gradient in the backward pass."""
    if gamma == 1.0:
        return x
    return gamma * x + (1.0 - gamma) * x.detach()


def gradient_scaling_factors(gamma: float, num_exits: int) -> list[float]:
    """γ_n = γ·(N − n) of Appendix A (the ratio γ : 1 of block n's own supervision to the N − n blocks above it).

    The formula gives γ_N = 0 for the top block, which has no block above to balance against and would lose its own
    gradient (and make line 5's 1/γ_N infinite); we use γ_N = 1 (no scaling) there — a deviation the paper's text
    implies but does not state."""
    if not (gamma > 0 and math.isfinite(gamma)):
        raise ValueError(f"gradient_scaling gamma must be a positive number, got {gamma!r}")
    return [gamma * (num_exits - n) for n in range(1, num_exits)] + [1.0]


def mean_encoder_output(
    encoder_hidden_states: torch.Tensor, encoder_attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """s̄ = (1/|x|) Σ_t s_t of Eq. 8, averaging only the non-padding source positions. ``[b, S, d] → [b, d]``."""
    if encoder_attention_mask is None:
        return encoder_hidden_states.mean(dim=1)
    mask = encoder_attention_mask.to(encoder_hidden_states.dtype).unsqueeze(-1)
    return (encoder_hidden_states * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)


def sequence_halting_log_probs(mean_encoder_states: torch.Tensor, halting_projection: nn.Linear) -> torch.Tensor:
    """Eq. 8: log q(n|x) = log softmax(W_h s̄ + b_h) ∈ R^N (sequence-specific depth), computed in float32."""
    return torch.log_softmax(halting_projection(mean_encoder_states).float(), dim=-1)


def token_multinomial_log_probs(first_block_states: torch.Tensor, halting_projection: nn.Linear) -> torch.Tensor:
    """Eq. 11: log q_t(n|x, y_<t) = log softmax(W_h h¹_t + b_h) (token-specific multinomial), in float32."""
    return torch.log_softmax(halting_projection(first_block_states).float(), dim=-1)


def geometric_halting_logits(block_state: torch.Tensor, halting_weight: nn.Linear, block_bias: torch.Tensor):
    """The logit of Eq. 12, z^n_t = w_hᵀ h^n_t + b_n, so that χ^n_t = sigmoid(z^n_t): one vector w_h shared by all
    blocks (``halting_weight``, no bias) and one bias b_n per block below the last. ``[..., d] → [...]`` float32."""
    return (halting_weight(block_state).squeeze(-1) + block_bias).float()


def geometric_exit_log_probs(halting_logits: torch.Tensor) -> torch.Tensor:
    """Eq. 13, the geometric-like exit distribution, from the N−1 halting logits z^n (χ^n = sigmoid(z^n), Eq. 12):
    q(n) = χ^n Π_{n'<n} (1 − χ^{n'}) for n < N and q(N) = Π_{n'<N} (1 − χ^{n'}). Computed in log space
    (log χ = logsigmoid(z), log(1 − χ) = logsigmoid(−z)). ``[..., N−1] → [..., N]`` float32."""
    halting_logits = halting_logits.float()
    log_continue = torch.nn.functional.logsigmoid(-halting_logits)
    continued_before = torch.cumsum(log_continue, dim=-1) - log_continue  # Σ_{n'<n} log(1 − χ^{n'})
    log_exit_below_top = torch.nn.functional.logsigmoid(halting_logits) + continued_before
    log_exit_top = log_continue.sum(dim=-1, keepdim=True)
    return torch.cat([log_exit_below_top, log_exit_top], dim=-1)


def _argmax_with_depth_penalty(scores: torch.Tensor, lam: float) -> torch.Tensor:
    """δ(argmax_n score_n − λn) as a 1-based exit; ties go to the lowest block (``torch.argmax`` keeps the first)."""
    depth = torch.arange(1, scores.shape[-1] + 1, device=scores.device, dtype=scores.dtype)
    return torch.argmax(scores - lam * depth, dim=-1) + 1


def sequence_likelihood_oracle(
    token_log_likelihoods: torch.Tensor, target_mask: torch.Tensor, lam: float = 0.0
) -> torch.Tensor:
    """Eq. 9: q*(x, y) = δ(argmax_n LL^n − λn) with LL^n = Σ_t log p(y_t|h^n_{t−1}).
    ``token_log_likelihoods`` is ``[b, T, N]`` (LL^n_t), ``target_mask`` ``[b, T]``; returns exits ``[b]`` in 1..N."""
    mask = target_mask.to(token_log_likelihoods.dtype).unsqueeze(-1)
    sequence_ll = (token_log_likelihoods * mask).sum(dim=1)
    return _argmax_with_depth_penalty(sequence_ll, lam)


def sequence_correctness_oracle(token_correct: torch.Tensor, target_mask: torch.Tensor, lam: float = 0.0) -> torch.Tensor:
    """Eq. 10: C^n = #{t | y_t = argmax_y p(y|h^n_{t−1})}, q*(x, y) = δ(argmax_n C^n − λn).
    ``token_correct`` is ``[b, T, N]`` (bool); returns exits ``[b]`` in 1..N."""
    counts = (token_correct & target_mask.bool().unsqueeze(-1)).sum(dim=1).to(torch.float64)
    return _argmax_with_depth_penalty(counts, lam)


def rbf_kernel(length: int, sigma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """κ(t, t') = exp(−|t − t'|² / σ²) of Eq. 15 as a ``[T, T]`` matrix; σ = 0 is the limit σ → 0 (the identity:
    only the current token counts)."""
    if sigma < 0:
        raise ValueError(f"oracle_sigma must be >= 0, got {sigma!r}")
    positions = torch.arange(length, device=device, dtype=torch.float64)
    if sigma == 0:
        return torch.eye(length, device=device, dtype=dtype)
    distance = positions[:, None] - positions[None, :]
    return torch.exp(-(distance**2) / (sigma**2)).to(dtype)


def smooth_over_time(per_token_scores: torch.Tensor, target_mask: torch.Tensor, sigma: float) -> torch.Tensor:
    """Σ_{t'=1}^{|y|} κ(t, t') v_{t'} of Eq. 15/16 for ``[b, T, N]`` scores; padding positions t' are left out."""
    kernel = rbf_kernel(per_token_scores.shape[1], sigma, per_token_scores.device, per_token_scores.dtype)
    masked = per_token_scores * target_mask.to(per_token_scores.dtype).unsqueeze(-1)
    return torch.einsum("ts,bsn->btn", kernel, masked)


def token_likelihood_oracle(
    token_log_likelihoods: torch.Tensor, target_mask: torch.Tensor, sigma: float = 0.0, lam: float = 0.0
) -> torch.Tensor:
    """Eq. 14/15, LL(σ, λ): q*_t = δ(argmax_n LL̃^n_t − λn) with LL̃^n_t = Σ_t' κ(t, t') LL^n_t' (σ = 0: Eq. 14).
    ``[b, T, N] → [b, T]`` exits in 1..N (values at padding positions are meaningless)."""
    smoothed = smooth_over_time(token_log_likelihoods.double(), target_mask, sigma)
    return _argmax_with_depth_penalty(smoothed, lam)


def token_correctness_oracle(
    token_correct: torch.Tensor, target_mask: torch.Tensor, sigma: float = 0.0, lam: float = 0.0
) -> torch.Tensor:
    """Eq. 16/17: C^n_t = [y_t = argmax_y p(y|h^n_{t−1})], C̃^n_t = Σ_t' κ(t, t') C^n_t',
    q*_t = δ(argmax_n C̃^n_t − λn). ``[b, T, N] → [b, T]`` exits in 1..N."""
    smoothed = smooth_over_time(token_correct.double(), target_mask, sigma)
    return _argmax_with_depth_penalty(smoothed, lam)


def exit_loss(exit_log_probs: torch.Tensor, oracle_exits: torch.Tensor, mask: torch.Tensor | None = None):
    """Eq. 6: L_exit = Σ_t H(q*_t, q_t) = −Σ_t log q_t(n*_t) for the Dirac oracles of Eq. 9–17.
    ``exit_log_probs`` ``[..., N]``, ``oracle_exits`` ``[...]`` (1-based), ``mask`` ``[...]`` (positions to count)."""
    chosen = exit_log_probs.gather(-1, (oracle_exits.long() - 1).unsqueeze(-1)).squeeze(-1)
    if mask is not None:
        chosen = chosen * mask.to(chosen.dtype)
    return -chosen.sum()
