"""The Depth-Adaptive Transformer's output classes: the forward's exits and losses, ``generate()``'s exits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import Seq2SeqLMOutput
from transformers.utils import ModelOutput


@dataclass
class DepthAdaptiveSeq2SeqLMOutput(Seq2SeqLMOutput):
    """``Seq2SeqLMOutput`` plus the Depth-Adaptive signals.

    exits (`[b, T]`): the exit (1..N) of every decoder position (the top block N in aligned training).
    decoding_loss: L_dec (Eq. 4 or Eq. 5); exit_loss: L_exit (Eq. 6, same normalisation as L_dec); `loss` is
        Eq. 7, L_dec + α·L_exit — the training objective, also in eval mode (where L_dec is the aligned Eq. 4, a
        weighted average over the N exits), so it is what `Trainer` reports as `eval_loss`.
    logits_loss / logits_nll_loss (detached): the label-smoothed cross-entropy of the returned `logits` (the
        criterion of the baseline's `loss`, same normalisation) and its negative log-likelihood part; exp of the
        latter is the perplexity of `logits`. In aligned mode (training, and every eval-mode forward with labels)
        `logits` are the top classifier's, so `logits_loss` is `per_exit_losses[-1]`; in mixed training they are
        those of the last sampled exit sequence; with `token_exits` or an exit strategy, `loss` is `logits_loss`.
    per_exit_losses (`[N]`, detached): each classifier's label-smoothed loss in aligned mode.
    exit_logits (tuple of N `[b, T, V]`): every classifier's logits (aligned mode, with `return_exit_logits=True`).
    oracle_exits (`[b]` or `[b, T]`) and exit_log_probs (`[b, N]` or `[b, T, N]`): the oracle q* and the halting
        distribution log q of the exit loss.
    """

    exits: torch.LongTensor | None = None
    decoding_loss: torch.FloatTensor | None = None
    exit_loss: torch.FloatTensor | None = None
    per_exit_losses: torch.FloatTensor | None = None
    exit_logits: tuple[torch.FloatTensor, ...] | None = None
    oracle_exits: torch.LongTensor | None = None
    exit_log_probs: torch.FloatTensor | None = None
    logits_loss: torch.FloatTensor | None = None
    logits_nll_loss: torch.FloatTensor | None = None


@dataclass
class DepthAdaptiveGenerateOutput(ModelOutput):
    """``generate(..., return_exits=True)`` without ``return_dict_in_generate``: the sequences and, for each
    generated token (``sequences[:, 1:]``), its exit in 1..N (0 after the end of the hypothesis)."""

    sequences: torch.LongTensor | None = None
    exits: torch.LongTensor | None = None
