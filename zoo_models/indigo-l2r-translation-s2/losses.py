"""The sequence-to-sequence training loss: fairseq's label-smoothed negative log-likelihood."""

from __future__ import annotations

import torch


class _TokenLossTerms(torch.autograd.Function):
    """Per-token NLL `logsumexp(z) − z_y` and smoothing term `Σ_v −log p_v = V·logsumexp(z) − Σ_v z_v` of `[N, V]`
    float logits (zero at ignored tokens).

    The forward keeps `exp(z − max z)` (the one `[N, V]` temporary a logsumexp needs anyway) and the first backward
    turns it, in place, into the gradient `(g_nll + V·g_smooth)·softmax − g_nll·onehot − g_smooth`: no second
    exponential and no second `[N, V]` buffer (at 960 × 10152 each such fp32 buffer is 39 MB, above glibc's mmap
    threshold, so every fresh one is paid again in page faults). A second backward through the same graph
    (`retain_graph=True`) recomputes the softmax from the saved logits.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int):
        kept = labels.ne(ignore_index)
        safe_labels = labels.masked_fill(~kept, 0)
        row_max = logits.amax(dim=-1, keepdim=True)
        shifted_exp = torch.sub(logits, row_max).exp_()
        row_sum = shifted_exp.sum(dim=-1)
        log_normalizer = row_sum.log().add_(row_max.squeeze(1))
        nll = (log_normalizer - logits.gather(1, safe_labels.unsqueeze(1)).squeeze(1)) * kept
        smooth = (logits.shape[-1] * log_normalizer - logits.sum(-1)) * kept
        ctx.save_for_backward(logits, row_max, safe_labels, kept, row_sum)
        ctx.shifted_exp = shifted_exp  # not saved_tensors: the backward overwrites it
        return nll, smooth

    @staticmethod
    def backward(ctx, grad_nll: torch.Tensor, grad_smooth: torch.Tensor):
        logits, row_max, safe_labels, kept, row_sum = ctx.saved_tensors
        kept = kept.to(logits.dtype)
        grad_nll = grad_nll * kept
        grad_smooth = grad_smooth * kept
        softmax_scale = grad_nll + logits.shape[-1] * grad_smooth
        grad, ctx.shifted_exp = ctx.shifted_exp, None
        if grad is None:  # a second backward: the first one consumed the buffer
            grad = torch.sub(logits, row_max).exp_()
        grad.mul_((softmax_scale / row_sum).unsqueeze(1))  # softmax = exp(z − max) / Σ exp(z − max), scaled
        grad.sub_(grad_smooth.unsqueeze(1))
        grad.scatter_add_(1, safe_labels.unsqueeze(1), -grad_nll.unsqueeze(1))
        return grad, None, None


def token_loss_terms(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token `(nll, smooth)` of fairseq's label-smoothed loss, shaped like `labels`, zero at `ignore_index`:
    nll = −log p_y and smooth = Σ_v −log p_v, computed in float32 (float64 stays float64) by one fused autograd
    function — no `[N, V]` log-probabilities are materialised (`_TokenLossTerms`)."""
    vocab_size = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab_size)
    if flat_logits.dtype not in (torch.float32, torch.float64):
        flat_logits = flat_logits.float()
    nll, smooth = _TokenLossTerms.apply(flat_logits, labels.reshape(-1), ignore_index)
    return nll.view(labels.shape), smooth.view(labels.shape)


def label_smoothed_nll_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    epsilon: float,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fairseq 0.12's label-smoothed cross-entropy (`label_smoothed_cross_entropy`): with ε' = ε / (V - 1),
    loss = (1 - ε - ε') · NLL + ε' · Σ_v −log p_v, summed over non-ignored tokens.

    Both terms come from `token_loss_terms` (one logsumexp per row; the backward writes
    `softmax − (1−ε−ε')·onehot − ε'` into one buffer), which takes half the time of
    `F.cross_entropy(label_smoothing=…)` plus a separate NLL pass for logging on a `[960, 10152]` batch.

    Returns (loss, nll_loss), each divided by `num_items_in_batch` when given (Trainer's token count for the whole
    accumulated batch, which keeps gradient accumulation exact) and by the number of target tokens otherwise; the
    NLL carries no gradient (it is for logging). Computed in float32 so bf16 training keeps an accurate loss.
    """
    vocab_size = logits.shape[-1]
    flat_labels = labels.reshape(-1)
    token_nll, token_smooth = token_loss_terms(logits, flat_labels, ignore_index)
    spread = epsilon / (vocab_size - 1)
    loss = (1.0 - epsilon - spread) * token_nll.sum()
    if spread:
        loss = loss + spread * token_smooth.sum()
    nll = token_nll.detach().sum()
    denominator = num_items_in_batch if num_items_in_batch is not None else flat_labels.ne(ignore_index).sum().clamp(min=1)
    if isinstance(denominator, torch.Tensor):
        denominator = denominator.to(loss.device)
    return loss / denominator, nll / denominator
