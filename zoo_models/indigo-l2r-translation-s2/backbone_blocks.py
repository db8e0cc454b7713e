"""The backbone's blocks: fairseq's encoder and decoder layers with each sub-layer (self-attention, encoder-attention,
feed-forward) a method with its own residual, dropout and LayerNorm, run in the order given as data — one order, or
one per batch row (`PerRowSublayerOrder`, the seam IOT extends; `sublayer_order.py` plans the schedule). Every block
is a `GradientCheckpointingLayer`. `modeling_flexformer.py` builds its stacks from them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .configuration_flexformer import FlexformerConfig

from .cpu_kernels import dropout
from .kv_caches import StepKVCollector, index_rows, self_attention_cache_of
from .sublayer_order import DECODER_SUBLAYERS, ENCODER_SUBLAYERS, PerRowSublayerOrder, check_order
from .transformers_compat import CheckpointOnlyWithGradients


def _place_rows(weights: dict, name: str, rows, row_weights: torch.Tensor | None, batch: int) -> None:
    """Put one sub-layer's attention weights of a row subset into the whole batch's `weights[name]` (every row runs
    each sub-layer once, whatever its order)."""
    if row_weights is None:
        return
    if name not in weights:
        weights[name] = row_weights.new_zeros((batch, *row_weights.shape[1:]))
    if isinstance(rows, slice):
        weights[name][rows] = row_weights
    else:
        weights[name].index_copy_(0, rows, row_weights)


def _mask_rows(weights: dict, name: str, row_mask: torch.Tensor, row_weights: torch.Tensor | None) -> None:
    """`_place_rows` for a boolean row mask: the masked rows of `row_weights` (computed for the whole batch) go into
    `weights[name]`."""
    if row_weights is None:
        return
    previous = weights.get(name)
    keep = row_mask.view(-1, *([1] * (row_weights.dim() - 1)))
    weights[name] = torch.where(keep, row_weights, row_weights.new_zeros(()) if previous is None else previous)


class _ReorderableLayer(CheckpointOnlyWithGradients, GradientCheckpointingLayer):
    """Shared machinery of encoder and decoder blocks: each sub-layer is a method with its own residual,
    dropout and LayerNorm, and `forward` runs them in the order it is given."""

    default_order: tuple[str, ...] = ()

    def _sublayer(self, name: str) -> Callable:
        raise NotImplementedError

    def _residual(self, layer_norm: nn.LayerNorm, hidden_states: torch.Tensor, compute: Callable):
        residual = hidden_states
        if self.normalize_before:
            hidden_states = layer_norm(hidden_states)
        hidden_states, weights = compute(hidden_states)
        hidden_states = dropout(hidden_states, self.dropout, self.training)
        hidden_states = residual + hidden_states
        if not self.normalize_before:
            hidden_states = layer_norm(hidden_states)
        return hidden_states, weights

    def _run_order(self, hidden_states, sublayer_order, past_key_values, **kwargs):
        """Run the sub-layers; returns (hidden_states, {name: attention weights})."""
        weights = {}
        if not isinstance(sublayer_order, PerRowSublayerOrder):
            order = self.default_order if sublayer_order is None else tuple(sublayer_order)
            check_order(order, self.default_order)
            for name in order:
                hidden_states, weights[name] = self._sublayer(name)(
                    hidden_states, past_key_values=past_key_values, **kwargs
                )
            return hidden_states, weights
        # Different orders per row: stage by stage, each sub-layer once for the rows that need it; the new
        # self-attention keys/values are collected and written to the cache once.
        for order in sublayer_order.orders:
            check_order(order, self.default_order)
        collector = None
        self_cache = self_attention_cache_of(past_key_values)
        if self_cache is not None and "self_attn" in self.default_order and self.self_attn.layer_idx is not None:
            collector = StepKVCollector(self_cache, self.self_attn.layer_idx, hidden_states.shape[0])
        batch = hidden_states.shape[0]
        for stage in sublayer_order.stage_plan:
            if (
                len(stage) > 1
                and all(isinstance(rows, slice) for _, rows in stage)
                and sum(rows.stop - rows.start for _, rows in stage) == batch
            ):
                # The stage's blocks partition the batch: compute each on a view, concatenate once.
                pieces = []
                for name, rows in sorted(stage, key=lambda entry: entry[1].start):
                    updated, stage_weights = self._sublayer(name)(
                        hidden_states[rows], past_key_values=past_key_values, rows=rows, kv_collector=collector,
                        **kwargs,
                    )
                    _place_rows(weights, name, rows, stage_weights, batch)
                    pieces.append(updated)
                hidden_states = torch.cat(pieces, dim=0)
                continue
            for name, rows in stage:
                compute = self._sublayer(name)
                if rows is None:
                    hidden_states, weights[name] = compute(
                        hidden_states, past_key_values=past_key_values, kv_collector=collector, **kwargs
                    )
                elif isinstance(rows, torch.Tensor) and rows.dtype == torch.bool:
                    # a row mask (the plan `torch.export` gets): every row computes, the masked rows keep the result
                    updated, stage_weights = compute(hidden_states, past_key_values=past_key_values, **kwargs)
                    hidden_states = torch.where(rows[:, None, None], updated, hidden_states)
                    _mask_rows(weights, name, rows, stage_weights)
                else:
                    updated, stage_weights = compute(
                        index_rows(hidden_states, rows),
                        past_key_values=past_key_values,
                        rows=rows,
                        kv_collector=collector,
                        **kwargs,
                    )
                    _place_rows(weights, name, rows, stage_weights, batch)
                    if isinstance(rows, slice):
                        hidden_states = torch.cat(
                            [hidden_states[: rows.start], updated, hidden_states[rows.stop :]], dim=0
                        )
                    else:
                        hidden_states = hidden_states.index_copy(0, rows, updated)
        if collector is not None:
            collector.flush()
        return hidden_states, weights


class FlexformerEncoderLayer(_ReorderableLayer):
    default_order = ENCODER_SUBLAYERS

    def __init__(self, config: FlexformerConfig, layer_idx: int, components):
        super().__init__()
        dim = config.encoder_embed_dim
        self.normalize_before = config.encoder_normalize_before
        self.dropout = config.dropout
        self.self_attn = components.encoder_self_attention(
            config, dim, config.encoder_attention_heads, num_branches=config.encoder_attention_branches,
            layer_idx=layer_idx,
        )
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.ffn = components.feed_forward(config, dim, config.encoder_ffn_embed_dim, config.encoder_ffn_branches)
        self.final_layer_norm = nn.LayerNorm(dim)

    def self_attention_sublayer(self, hidden_states, attention_mask=None, rows=None, output_attentions=False, **kw):
        return self._residual(
            self.self_attn_layer_norm,
            hidden_states,
            lambda x: self.self_attn(x, attention_mask=attention_mask, rows=rows, output_attentions=output_attentions),
        )

    def feed_forward_sublayer(self, hidden_states, **kw):
        return self._residual(self.final_layer_norm, hidden_states, lambda x: (self.ffn(x), None))

    def _sublayer(self, name):
        return {"self_attn": self.self_attention_sublayer, "ffn": self.feed_forward_sublayer}[name]

    def forward(self, hidden_states, attention_mask=None, sublayer_order=None, output_attentions=False):
        hidden_states, weights = self._run_order(
            hidden_states, sublayer_order, None, attention_mask=attention_mask, output_attentions=output_attentions
        )
        return hidden_states, weights.get("self_attn")


class FlexformerDecoderLayer(_ReorderableLayer):
    default_order = DECODER_SUBLAYERS

    def __init__(self, config: FlexformerConfig, layer_idx: int, components):
        super().__init__()
        dim = config.decoder_embed_dim
        self.normalize_before = config.decoder_normalize_before
        self.dropout = config.dropout
        self.self_attn = components.decoder_self_attention(
            config, dim, config.decoder_attention_heads, num_branches=config.decoder_attention_branches,
            is_causal=True, layer_idx=layer_idx,
        )
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.encoder_attn = components.cross_attention(
            config, dim, config.decoder_attention_heads, kdim=config.encoder_embed_dim,
            num_branches=config.decoder_attention_branches, is_cross_attention=True, layer_idx=layer_idx,
        )
        self.encoder_attn_layer_norm = nn.LayerNorm(dim)
        self.ffn = components.feed_forward(config, dim, config.decoder_ffn_embed_dim, config.decoder_ffn_branches)
        self.final_layer_norm = nn.LayerNorm(dim)

    def self_attention_sublayer(
        self, hidden_states, attention_mask=None, past_key_values=None, rows=None, kv_collector=None,
        output_attentions=False, attention_kwargs=None, **kw,
    ):
        return self._residual(
            self.self_attn_layer_norm,
            hidden_states,
            lambda x: self.self_attn(
                x, attention_mask=attention_mask, past_key_values=past_key_values, rows=rows,
                kv_collector=kv_collector, output_attentions=output_attentions, **(attention_kwargs or {}),
            ),
        )

    def cross_attention_sublayer(
        self, hidden_states, encoder_hidden_states=None, encoder_attention_mask=None, past_key_values=None,
        rows=None, output_attentions=False, attention_kwargs=None, **kw,
    ):
        if encoder_hidden_states is None:
            raise ValueError("the decoder's encoder-attention sub-layer needs encoder_hidden_states")
        return self._residual(
            self.encoder_attn_layer_norm,
            hidden_states,
            lambda x: self.encoder_attn(
                x, key_value_states=encoder_hidden_states, attention_mask=encoder_attention_mask,
                past_key_values=past_key_values, rows=rows, output_attentions=output_attentions,
                **(attention_kwargs or {}),
            ),
        )

    def feed_forward_sublayer(self, hidden_states, **kw):
        return self._residual(self.final_layer_norm, hidden_states, lambda x: (self.ffn(x), None))

    def _sublayer(self, name):
        return {
            "self_attn": self.self_attention_sublayer,
            "encoder_attn": self.cross_attention_sublayer,
            "ffn": self.feed_forward_sublayer,
        }[name]

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        past_key_values=None,
        sublayer_order=None,
        output_attentions=False,
        **attention_kwargs,
    ):
        """`attention_kwargs` go to both attentions: the self-attention's `relative_position_bias` seam (InDIGO's
        relations) and the cross-attention's `_cross_key_value` (IOT's stacked order paths). They are arguments of
        the call, so a checkpointed block's recomputation in the backward pass sees the same ones."""
        hidden_states, weights = self._run_order(
            hidden_states,
            sublayer_order,
            past_key_values,
            attention_mask=attention_mask,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            output_attentions=output_attentions,
            attention_kwargs=attention_kwargs,
        )
        return hidden_states, weights.get("self_attn"), weights.get("encoder_attn")
