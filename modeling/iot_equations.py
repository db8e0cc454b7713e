"""IOT's equations (Zhu et al., "IOT: Instance-wise Layer Reordering for Transformer Structures", ICLR 2021), one
function each: the order predictors and their Gumbel-softmax confidences (Eq. 1-2), the weighted path loss (Eq. 3),
the auxiliary losses (Eq. 5-6), the total (Eq. 7), the temperature schedule, and the row layout of mixed orders.
The model is `modeling_iot.py`."""

from __future__ import annotations

import math

import torch

from .losses import token_loss_terms

# ---------------------------------------------------------------------------------------------------------------
# The paper's equations, one function each (all computed in fp32: they take logs of probabilities).
# ---------------------------------------------------------------------------------------------------------------


def masked_mean(states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over the non-padding positions of ``states`` ``[b, t, d]`` → ``[b, d]`` (fp32)."""
    states = states.float()
    if attention_mask is None:
        return states.mean(dim=1)
    mask = attention_mask.to(states.dtype).unsqueeze(-1)
    return (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def order_predictor_logits(
    states: torch.Tensor, attention_mask: torch.Tensor | None, predictor_weight: torch.Tensor
) -> torch.Tensor:
    """Eq. 1 / Eq. 2 (IOT): the predictor logits ``s W`` with ``s`` the masked mean of ``states``.

    ``states`` are the token embeddings for the encoder predictor (s_e, Eq. 1) and the encoder outputs for the
    decoder predictor (s_d, Eq. 2); ``predictor_weight`` is ``[K, d]`` (no bias). Returns fp32 ``[b, K]``; the
    predictor distribution is ``softmax`` of it.
    """
    return masked_mean(states, attention_mask) @ predictor_weight.float().t()


def clamp_order_probs(probs: torch.Tensor, clamp: float) -> torch.Tensor:
    """The probability clamp of IOT (Section 3.2, Appendix A.2: "we clamp the softmax output with value 0.05").

    Clamped to ``[clamp, 1 − (K−1)·clamp]`` for K candidates (the official code's range) and *not*
    renormalised. Gradients stop where a probability is clamped.
    """
    num_orders = probs.shape[-1]
    if clamp <= 0:
        return probs
    return probs.clamp(min=clamp, max=1.0 - (num_orders - 1) * clamp)


def sample_gumbel(shape, device, generator: torch.Generator | None = None) -> torch.Tensor:
    """``g = −log(−log U)``, ``U ~ Uniform(0, 1)`` (Eq. 1), in fp32; U kept away from 0 and 1."""
    tiny = torch.finfo(torch.float32).tiny
    uniform = torch.rand(shape, device=device, dtype=torch.float32, generator=generator)
    uniform = uniform.clamp(min=tiny, max=1.0 - torch.finfo(torch.float32).eps)
    return -torch.log(-torch.log(uniform))


def gumbel_softmax_confidences(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    clamp: float,
    gumbel_noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 1 / Eq. 2 (IOT): soft Gumbel-softmax confidences ``γ`` (or ``λ``) from predictor logits ``[..., K]``.

    ``γ_m = softmax((log clamp(π)_m + g_m) / τ)`` with ``π = softmax(logits)``. The paper writes ``log π``; the
    log is taken of the *clamped* probabilities as the paper's Appendix A.2 and the official code do, which keeps
    every order's confidence away from 0 early in training. Returns ``(confidences, probs)``, both fp32; ``probs``
    is the unclamped π (for Eq. 5/6 and for logging). ``gumbel_noise`` may be given (tests); otherwise it is
    sampled.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    if gumbel_noise is None:
        gumbel_noise = sample_gumbel(probs.shape, probs.device, generator)
    scores = (torch.log(clamp_order_probs(probs, clamp)) + gumbel_noise.float()) / temperature
    return torch.softmax(scores, dim=-1), probs


def weighted_path_loss(
    path_losses: torch.Tensor, encoder_confidences: torch.Tensor, decoder_confidences: torch.Tensor
) -> torch.Tensor:
    """Eq. 3 (IOT): ``L_C = Σ_m Σ_n γ_m λ_n L^{m,n}`` summed over the sentences of the batch.

    ``path_losses`` ``[b, M, N]`` are per-sentence losses of every encoder-order × decoder-order path;
    ``encoder_confidences`` ``[b, M]``; ``decoder_confidences`` ``[b, M, N]`` (λ is predicted from the encoder
    output of path m, so it may differ per m). Returns the batch sum (the caller normalises by the token count,
    like the baseline's loss).
    """
    weights = encoder_confidences.unsqueeze(-1) * decoder_confidences
    return (weights.to(path_losses.dtype) * path_losses).sum()


def diversity_loss(probs: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """Eq. 5 (IOT): ``L_D = KL(Q ‖ E_x[π_x]) = −(1/K) Σ_k log E_x[(π_x)_k] − log K`` (Q uniform).

    ``probs`` ``[b, K]`` are the predictor distributions of the batch (E_x = batch mean). With ``clamp`` the
    per-sentence probabilities are clamped first (the paper clamps π_x because the KL is unbounded); with
    ``None`` the batch mean is taken of the raw probabilities (the official code).
    """
    probs = probs.float()
    if clamp is not None:
        probs = clamp_order_probs(probs, clamp)
    num_orders = probs.shape[-1]
    return -torch.log(probs.mean(dim=0)).mean() - math.log(num_orders)


def sharpness_loss(probs: torch.Tensor, clamp: float) -> torch.Tensor:
    """Eq. 6 (IOT): ``L_S = −E_x[KL(Q ‖ π_x)] = −E_x[−(1/K) Σ_k log (π_x)_k − log K]`` on clamped ``π_x``.

    Minimising it pushes each sentence's distribution away from uniform (an unambiguous argmax); the clamp
    bounds the KL (Section 3.2). ``probs`` is ``[b, K]``.
    """
    log_probs = torch.log(clamp_order_probs(probs.float(), clamp))
    num_orders = probs.shape[-1]
    kl_to_uniform = -log_probs.mean(dim=-1) - math.log(num_orders)
    return -kl_to_uniform.mean()


def iot_total_loss(
    weighted_loss: torch.Tensor,
    diversity: torch.Tensor,
    sharpness: torch.Tensor,
    diversity_coef: float,
    sharpness_coef: float,
) -> torch.Tensor:
    """Eq. 7 (IOT): ``L = L_C + c1·L_D + c2·L_S`` (paper: c1 = 0.1, c2 = 0.01).

    ``weighted_loss`` is L_C already normalised per target token (the official criterion multiplies the
    auxiliary losses by the token count before normalising, i.e. the same thing).
    """
    return weighted_loss + diversity_coef * diversity + sharpness_coef * sharpness


def gumbel_temperature_at(step: int, tau_max: float, tau_min: float, decay_rate: float, update_freq: int) -> float:
    """The Gumbel-softmax temperature schedule: ``τ = max(τ_max · exp(−r · ⌊step/f⌋ · f), τ_min)``.

    The paper keeps τ constant (Eq. 1: "a constant temperature") and mentions decaying it as an alternative
    (Section 3.2); the official code uses this stepwise exponential decay, with r = 0 (constant τ = 20) in its
    README run.
    """
    clipped_step = (max(int(step), 0) // update_freq) * update_freq
    return max(tau_max * math.exp(-decay_rate * clipped_step), tau_min)


def sentence_label_smoothed_losses(
    logits: torch.Tensor, labels: torch.Tensor, epsilon: float, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sentence sums of the NLL and of the smoothing term ``−Σ_v log p_v`` (fp32), for Eq. 3.

    fairseq's label-smoothed loss (the backbone's ``label_smoothed_nll_loss``) is
    ``(1 − ε − ε_i)·nll + ε_i·smooth`` with ``ε_i = ε / (V − 1)``; IOT needs it per sentence so the confidences
    can weight each sentence's loss on each order path. Returns ``(nll, smooth)``, each ``[rows]``.
    """
    nll, smooth = token_loss_terms(logits, labels, ignore_index)
    nll = nll.sum(dim=-1)
    smooth = smooth.sum(dim=-1) if epsilon > 0 else torch.zeros_like(nll)
    return nll, smooth


def contiguous_order_arrangement(orders: list[tuple[str, ...]]) -> list[int]:
    """The sequence of candidate indices to lay the rows out in, so that candidates running the same sub-layer at
    the same stage are neighbours as often as possible (self-attention counts double: its contiguous rows let the
    backbone use views of the cache instead of copies). Brute force over N! ≤ 720 arrangements, once.

    E.g. the paper's N = 4 orders 1, 2, 4, 6 → 1, 4, 2, 6: FF at stage 1 (orders 2, 6), SA at stage 2 (4, 2) and
    FF at stage 3 (1, 4) are each one block of rows.
    """
    import itertools

    groups = []
    for stage in range(len(orders[0])):
        for name in sorted({order[stage] for order in orders}):
            members = frozenset(i for i, order in enumerate(orders) if order[stage] == name)
            if len(members) > 1:
                groups.append((members, 2 if name == "self_attn" else 1))
    best, best_score = list(range(len(orders))), -1
    for arrangement in itertools.permutations(range(len(orders))):
        position = {candidate: p for p, candidate in enumerate(arrangement)}
        score = sum(
            weight for members, weight in groups
            if max(position[c] for c in members) - min(position[c] for c in members) == len(members) - 1
        )
        if score > best_score:
            best, best_score = list(arrangement), score
    return best
