"""fairseq's positional embeddings: sinusoidal (Vaswani et al., 2017, Sec. 3.5) or learned, numbered from
`padding_idx + 1` so that padding never shifts a sentence's positions."""

from __future__ import annotations

import math

import torch
from torch import nn

from .configuration_flexformer import FlexformerConfig


def make_positions(input_ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """fairseq's positions: non-padding tokens are numbered from `padding_idx + 1`; padding keeps `padding_idx`.

    Counting only non-padding tokens makes a left- or right-padded sentence get the same positions as alone.
    """
    mask = input_ids.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


def sinusoidal_table(num_embeddings: int, embedding_dim: int, padding_idx: int | None) -> torch.Tensor:
    """fairseq's sinusoidal table (sin half, then cos half; a zero row at `padding_idx`), from
    "Attention Is All You Need", Sec. 3.5, as laid out by fairseq's `SinusoidalPositionalEmbedding`."""
    half_dim = embedding_dim // 2
    scale = math.log(10000) / (half_dim - 1)
    frequencies = torch.exp(torch.arange(half_dim, dtype=torch.float) * -scale)
    angles = torch.arange(num_embeddings, dtype=torch.float).unsqueeze(1) * frequencies.unsqueeze(0)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if embedding_dim % 2 == 1:
        table = torch.cat([table, torch.zeros(num_embeddings, 1)], dim=1)
    if padding_idx is not None:
        table[padding_idx, :] = 0
    return table


def _positions_for(input_ids: torch.Tensor, padding_idx: int, past_length: int | torch.Tensor) -> torch.Tensor:
    """Positions of `input_ids` after `past_length` cached ones: `make_positions` for a fresh sequence; in
    incremental decoding the new tokens continue the cached prefix (fairseq's incremental_state path). A static
    cache's length is a device tensor: both are computed and selected on the device (no host branch to compile)."""
    if isinstance(past_length, int) and past_length == 0:
        return make_positions(input_ids, padding_idx)
    steps = torch.arange(input_ids.shape[1], device=input_ids.device) + past_length + padding_idx + 1
    steps = steps.unsqueeze(0).expand(input_ids.shape[0], -1)
    if isinstance(past_length, int):
        return steps
    return torch.where(past_length > 0, steps, make_positions(input_ids, padding_idx))


def _position_bound(past_length: int | torch.Tensor, new_tokens: int, max_length: int | None) -> int:
    """The number of positions a call reaches: past + new, or `max_length` (a static cache's capacity) when the
    past length is a device tensor that the host should not wait for."""
    if isinstance(past_length, int):
        return past_length + new_tokens
    if max_length is None:
        raise ValueError("a tensor past_length (static cache) needs max_length, the cache's capacity")
    return max_length


class SinusoidalPositionalEmbedding(nn.Module):
    """Fixed sinusoidal positions (not parameters), grown on demand like fairseq's."""

    def __init__(self, embedding_dim: int, padding_idx: int, init_size: int = 1024):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.init_size = init_size
        # A plain attribute, not a buffer: it is derived data, so it is neither saved nor loaded, and it is rebuilt
        # lazily on the right device (models are materialised from the meta device by `from_pretrained`).
        self._table: torch.Tensor | None = None

    def _table_for(self, max_position: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        table = self._table
        if table is None or table.shape[0] <= max_position or table.device != device or table.dtype != dtype:
            size = max(self.init_size, max_position + 1, 0 if table is None else table.shape[0])
            table = sinusoidal_table(size, self.embedding_dim, self.padding_idx).to(device=device, dtype=dtype)
            self._table = table
        return table

    def forward(
        self, input_ids: torch.Tensor, past_length: int | torch.Tensor = 0, dtype: torch.dtype = torch.float32,
        max_length: int | None = None,
    ):
        positions = _positions_for(input_ids, self.padding_idx, past_length)
        max_position = self.padding_idx + 1 + _position_bound(past_length, input_ids.shape[1], max_length)
        table = self._table_for(max_position, input_ids.device, dtype)
        return table[positions]


class LearnedPositionalEmbedding(nn.Embedding):
    """fairseq's learned positions: `max_positions + padding_idx + 1` rows, the padding row kept at zero."""

    def __init__(self, max_positions: int, embedding_dim: int, padding_idx: int):
        super().__init__(max_positions + padding_idx + 1, embedding_dim, padding_idx)
        self.max_positions = max_positions

    def forward(
        self, input_ids: torch.Tensor, past_length: int | torch.Tensor = 0, dtype: torch.dtype | None = None,
        max_length: int | None = None,
    ):
        positions = _positions_for(input_ids, self.padding_idx, past_length)
        length = _position_bound(past_length, input_ids.shape[1], max_length)
        if length > self.max_positions:
            raise ValueError(
                f"sequence of length {length} exceeds the {self.max_positions} learned positions "
                "(max_source_positions / max_target_positions)"
            )
        return super().forward(positions)


def build_positional_embedding(config: FlexformerConfig, side: str, embed_dim: int) -> nn.Module | None:
    if not getattr(config, f"{side}_use_positions"):
        return None
    max_positions = config.max_source_positions if side == "encoder" else config.max_target_positions
    if getattr(config, f"{side}_learned_pos"):
        return LearnedPositionalEmbedding(max_positions, embed_dim, config.pad_token_id)
    return SinusoidalPositionalEmbedding(embed_dim, config.pad_token_id, init_size=max_positions + config.pad_token_id + 1)
