"""IOT's model outputs: the encoder output with each sentence's orders, the training output with the predictors'
signals (Eq. 3, 5, 6), and ``generate()``'s outputs with the order codes chosen for each input."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateBeamEncoderDecoderOutput, GenerateEncoderDecoderOutput
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput


@dataclass
class IOTEncoderOutput(BaseModelOutput):
    """The encoder output plus the orders chosen per sentence (candidate indices into ``config.*_orders``).

    Generation keeps it in ``model_kwargs``; ``generate()`` expands its tensors for beams / returned sequences,
    so ``decoder_order_index`` always has one entry per decoder row.
    """

    encoder_order_index: torch.LongTensor | None = None
    decoder_order_index: torch.LongTensor | None = None
    encoder_order_probs: torch.FloatTensor | None = None
    decoder_order_probs: torch.FloatTensor | None = None


@dataclass
class IOTSeq2SeqLMOutput(Seq2SeqLMOutput):
    """``Seq2SeqLMOutput`` plus IOT's training signals.

    path_losses (`[M, N]`): per-target-token label-smoothed loss of every encoder×decoder order path (detached;
        in eval mode only the chosen path of each sentence is run, and this is `None`).
    encoder_order_probs (`[b, M]`) / decoder_order_probs (`[b, M, N]` in training, `[b, N]` in eval): the
        predictor distributions π (None without a predictor).
    encoder_confidences (`[b, M]`) / decoder_confidences (`[b, M, N]`): the Gumbel-softmax weights γ, λ of Eq. 3.
    diversity_loss / sharpness_loss: L_D (Eq. 5) and L_S (Eq. 6), summed over the encoder and decoder predictors.
    encoder_order_index / decoder_order_index (`[b]`): the argmax order of each sentence (Eq. 4), as candidate
        indices; `model.config.decoder_orders[i]` is the paper's code. `logits` are those of this path.
    """

    path_losses: torch.FloatTensor | None = None
    encoder_order_probs: torch.FloatTensor | None = None
    decoder_order_probs: torch.FloatTensor | None = None
    encoder_confidences: torch.FloatTensor | None = None
    decoder_confidences: torch.FloatTensor | None = None
    diversity_loss: torch.FloatTensor | None = None
    sharpness_loss: torch.FloatTensor | None = None
    encoder_order_index: torch.LongTensor | None = None
    decoder_order_index: torch.LongTensor | None = None


@dataclass
class IOTGenerateEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """Greedy/sampling output plus the order codes (paper numbering) chosen for each input sentence."""

    encoder_order_codes: torch.LongTensor | None = None
    decoder_order_codes: torch.LongTensor | None = None


@dataclass
class IOTGenerateBeamEncoderDecoderOutput(GenerateBeamEncoderDecoderOutput):
    """Beam-search output plus the order codes (paper numbering) chosen for each input sentence."""

    encoder_order_codes: torch.LongTensor | None = None
    decoder_order_codes: torch.LongTensor | None = None
