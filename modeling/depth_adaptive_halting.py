"""The Depth-Adaptive Transformer's halting mechanisms (Sec. 3): from the encoder output or the decoder's block states
to a distribution over the N exits, which the exit loss (Eq. 6) trains towards an oracle."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flexformers.configuration.configuration_depth_adaptive import DepthAdaptiveConfig

from .depth_adaptive_equations import (
    geometric_exit_log_probs,
    geometric_halting_logits,
    mean_encoder_output,
    sequence_halting_log_probs,
    token_multinomial_log_probs,
)


class SequenceHalting(nn.Module):
    """Sequence-specific depth (Sec. 3.1, Eq. 8): a multinomial over the N exits from the mean encoder output,
    ``W_h ∈ R^{N×d_enc}`` and ``b_h`` (one linear layer, Sec. 4.1)."""

    def __init__(self, config: DepthAdaptiveConfig):
        super().__init__()
        self.projection = nn.Linear(config.encoder_embed_dim, config.decoder_layers)

    def forward(self, encoder_hidden_states: torch.Tensor, encoder_attention_mask: torch.Tensor | None = None):
        """log q(n|x), ``[b, N]``."""
        return sequence_halting_log_probs(
            mean_encoder_output(encoder_hidden_states, encoder_attention_mask), self.projection
        )


class TokenMultinomialHalting(nn.Module):
    """Token-specific multinomial (Sec. 3.2, Eq. 11) on the first block's state h¹_t: ``W_h ∈ R^{N×d}``, ``b_h``."""

    def __init__(self, config: DepthAdaptiveConfig):
        super().__init__()
        self.projection = nn.Linear(config.decoder_embed_dim, config.decoder_layers)

    def forward(self, first_block_states: torch.Tensor) -> torch.Tensor:
        """log q_t(n|x, y_<t), ``[..., N]``."""
        return token_multinomial_log_probs(first_block_states, self.projection)


class GeometricHalting(nn.Module):
    """Token-specific geometric-like halting (Sec. 3.2, Eq. 12–13): χ^n_t = sigmoid(w_hᵀ h^n_t + b_n) after every
    block n < N, with one weight vector ``w_h ∈ R^d`` shared by the blocks and one bias b_n per block."""

    def __init__(self, config: DepthAdaptiveConfig):
        super().__init__()
        self.weight = nn.Linear(config.decoder_embed_dim, 1, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.decoder_layers - 1))

    def halting_logits(self, block: int, states: torch.Tensor) -> torch.Tensor:
        """z^n_t (χ^n_t = sigmoid(z^n_t)) after block ``block`` ∈ 1..N−1, ``[..., d] → [...]``."""
        return geometric_halting_logits(states, self.weight, self.bias[block - 1])

    def forward(self, block_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """log q_t(n) of Eq. 13 from the states h¹ … h^{N−1} (each ``[..., d]``), ``[..., N]``."""
        logits = torch.stack([self.halting_logits(n, states) for n, states in enumerate(block_states, start=1)], -1)
        return geometric_exit_log_probs(logits)


HALTING_CLASSES = {
    "sequence": SequenceHalting,
    "token_multinomial": TokenMultinomialHalting,
    "token_geometric": GeometricHalting,
}
