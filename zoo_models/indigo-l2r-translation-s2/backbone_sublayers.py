"""The backbone's sub-layers: fairseq's multi-head attention and position-wise feed-forward network, each with
`num_branches` parallel branches computed fused (B = 1 is fairseq's layer; MAT's seam sets B > 1), and the
reference (eager) attention function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_flexformer import FlexformerConfig

from .branch_merge import merge_branches, merge_projection, upgrade_merge_bias_on_load
from .cpu_kernels import dropout, fused_linears, project
from .kv_caches import StepKVCollector, fold_groups, index_rows, self_attention_cache_of, whole_groups


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    is_causal: bool = False,
    position_bias: torch.Tensor | None = None,
    **kwargs,
):
    """Reference attention (returns the weights); same contract as Transformers' SDPA integration."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    elif is_causal and query.shape[2] > 1:
        q_len, k_len = query.shape[2], key.shape[2]
        future = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).triu(k_len - q_len + 1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


class FlexformerAttention(nn.Module):
    """fairseq's multi-head attention, generalised to `num_branches` parallel attentions (MAT) computed fused:
    q/k/v are `Linear(d, B*d)` (branch b = rows `b*d:(b+1)*d`), all `B*M` heads go through one attention call,
    and the branches are merged by `out_proj` (`merge_branches`). With B = 1 this is exactly fairseq's
    `MultiheadAttention` (same parameters, same function).
    """

    grouped_queries_use_products: bool = True

    def __init__(
        self,
        config: FlexformerConfig,
        embed_dim: int,
        num_heads: int,
        kdim: int | None = None,
        num_branches: int = 1,
        is_cross_attention: bool = False,
        is_causal: bool = False,
        layer_idx: int | None = None,
    ):
        super().__init__()
        self.config = config
        self.embed_dim = embed_dim
        self.kdim = kdim or embed_dim
        self.num_heads = num_heads
        self.num_branches = num_branches
        self.head_dim = embed_dim // num_heads
        self.total_heads = num_heads * num_branches
        self.scaling = self.head_dim**-0.5
        self.dropout = config.attention_dropout
        self.is_cross_attention = is_cross_attention
        self.is_causal = is_causal
        self.layer_idx = layer_idx
        # Plain `nn.Linear`s (quantizers and adapters match the exact type); the CPU speed-ups are at the call sites.
        self.q_proj = nn.Linear(embed_dim, num_branches * embed_dim)
        self.k_proj = nn.Linear(self.kdim, num_branches * embed_dim)
        self.v_proj = nn.Linear(self.kdim, num_branches * embed_dim)
        self.out_proj, self.out_proj_branch_bias = merge_projection(num_branches, embed_dim, embed_dim)
        self.register_load_state_dict_pre_hook(upgrade_merge_bias_on_load)

    # ---- seams ------------------------------------------------------------------------------------------------
    def relative_position_bias(self, query_states: torch.Tensor, rows: torch.Tensor | None = None, **kwargs):
        """Additive logit bias `[batch, heads, q, k]` (added to the scaled q·k logits), or None. InDIGO overrides it.

        `query_states` are the projected, *unscaled* queries `[batch, heads, q, head_dim]`; `rows` is the subset of
        batch rows being computed (None = all); `kwargs` are whatever the decoder was given as layer kwargs.
        """
        return None

    def branch_weights(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """Merge weights of the branches, `[B]` or `[batch, B]`; None = the average 1/B. MAT overrides it."""
        return None

    def head_weights(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """Multipliers `[batch, B*M]` (or `[B*M]`) on each head's output before the merge, or None (MAT drop-head)."""
        return None

    # ---- projections ------------------------------------------------------------------------------------------
    def _split_heads(self, projected: torch.Tensor) -> torch.Tensor:
        batch, length = projected.shape[:2]
        return projected.view(batch, length, self.total_heads, self.head_dim).transpose(1, 2)

    def project_key_value(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[batch, heads, length, head_dim]` of `states`, without attending."""
        return self._split_heads(project(self.k_proj, states)), self._split_heads(project(self.v_proj, states))

    def _cross_key_value(self, encoder_states, past_key_values, rows, **kwargs):
        """Cross-attention keys/values for the rows (all rows if `rows` is None). With a `SourceGroupedCache`
        whose group is > 1 and `rows` None, they come back per source sentence (`[batch / group, ...]`). `kwargs` are
        the decoder's layer kwargs of this call (IOT's stacked order paths read theirs here)."""
        if isinstance(past_key_values, EncoderDecoderCache):
            cross_cache = past_key_values.cross_attention_cache
            group = getattr(past_key_values, "group_size", 1)
            if past_key_values.is_updated.get(self.layer_idx):
                layer = cross_cache.layers[self.layer_idx]
                keys, values = layer.keys, layer.values
            else:
                # Encoder states are projected once (one copy per sentence when grouped) and reused at every step.
                keys, values = self.project_key_value(encoder_states[::group] if group > 1 else encoder_states)
                keys, values = cross_cache.update(keys, values, self.layer_idx)
                past_key_values.is_updated[self.layer_idx] = True
            if group > 1 and isinstance(rows, slice):
                if rows.start % group == 0 and rows.stop % group == 0:  # whole sentences: stay grouped (a view)
                    sentences = slice(rows.start // group, rows.stop // group)
                    return keys[sentences], values[sentences]
                rows = torch.arange(rows.start, rows.stop, device=keys.device)
            if group > 1 and rows is not None:
                sentences = whole_groups(rows, group)
                if sentences is not None:  # all beams of some sentences: one copy per sentence, queries folded
                    return keys.index_select(0, sentences), values.index_select(0, sentences)
                sentence_rows = torch.div(rows, group, rounding_mode="floor")
                return keys.index_select(0, sentence_rows), values.index_select(0, sentence_rows)
            return index_rows(keys, rows), index_rows(values, rows)
        return self.project_key_value(index_rows(encoder_states, rows))

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        rows: torch.Tensor | None = None,
        kv_collector: StepKVCollector | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend for `hidden_states` `[batch', q, d]`.

        `rows` (optional) says which rows of the full batch these are: the attention mask, the encoder states and
        the cache's past are indexed with it. With `kv_collector`, the new self-attention keys/values go to the
        collector (written to the cache once per layer and step) instead of straight into the cache.
        """
        batch, q_len, _ = hidden_states.shape
        past_length = 0
        if self.is_cross_attention:
            query = self._split_heads(project(self.q_proj, hidden_states))
            key, value = self._cross_key_value(key_value_states, past_key_values, rows, **kwargs)
        else:
            query, key, value = (
                self._split_heads(projected)
                for projected in fused_linears(self, hidden_states, (self.q_proj, self.k_proj, self.v_proj))
            )
            if kv_collector is not None:
                key, value, past_length = kv_collector.extend(rows, key, value)
            elif past_key_values is not None:
                self_cache = self_attention_cache_of(past_key_values)
                past_length = self_cache.get_seq_length(self.layer_idx)
                key, value = self_cache.update(key, value, self.layer_idx)
        attention_mask = index_rows(attention_mask, rows)
        group = 1
        if self.is_cross_attention and key.shape[0] != batch:  # keys per source sentence: fold its beams' queries
            group = batch // key.shape[0]
            query = fold_groups(query, group)
            if attention_mask is not None:
                attention_mask = attention_mask[::group]
        position_bias = self.relative_position_bias(query, rows=rows, **kwargs)
        # Read at every call, so `model.set_attn_implementation(...)` takes effect on a loaded model.
        implementation = self.config._attn_implementation
        # A single query over a `PreallocatedKVLayer` view (strided keys): CPU SDPA copies such keys to contiguous
        # memory first (1.45× the time at 160 rows × 15 positions), while the two batched products read them as is.
        single_query_on_strided_cache = (
            implementation == "sdpa" and q_len == 1 and key.device.type == "cpu" and not key.is_contiguous()
        )
        # A few folded beam queries per source sentence (SourceGroupedCache): CPU SDPA takes ~2× the two batched
        # products there (0.57 vs 0.30 ms at 32 sentences × 5 beams × 30 source positions, d 512).
        grouped_queries_on_cpu = self.grouped_queries_use_products and group > 1 and key.device.type == "cpu"
        attention_function: Callable = (
            eager_attention_forward
            if (output_attentions and implementation == "sdpa") or single_query_on_strided_cache or grouped_queries_on_cpu
            else ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        )
        output, weights = attention_function(
            self,
            query,
            key,
            value,
            attention_mask,
            scaling=self.scaling,
            dropout=self.dropout if self.training else 0.0,
            is_causal=self.is_causal and attention_mask is None and q_len > 1 and past_length == 0,
            position_bias=position_bias,
        )
        if group > 1:  # unfold: [B, g·q, H, d] → [B·g, q, H, d]
            output = output.reshape(batch, q_len, self.total_heads, self.head_dim)
            if weights is not None:
                weights = weights.view(batch // group, self.total_heads, group, q_len, -1).transpose(1, 2)
                weights = weights.reshape(batch, self.total_heads, q_len, -1)
        head_weights = self.head_weights(batch, output.device, output.dtype)
        if head_weights is not None:
            output = output * head_weights.view(-1, 1, self.total_heads, 1)
        output = output.reshape(batch, q_len, self.num_branches, self.embed_dim)
        output = merge_branches(
            self.out_proj, self.out_proj_branch_bias, output, self.branch_weights(batch, output.device, output.dtype)
        )
        return output, (weights if output_attentions else None)


class FlexformerFeedForward(nn.Module):
    """Position-wise feed-forward network with `num_branches` parallel branches (MAT's multi-branch FFN, Eq. 8)
    computed fused; B = 1 is fairseq's `fc1 → activation → dropout → fc2`."""

    def __init__(self, config: FlexformerConfig, embed_dim: int, ffn_dim: int, num_branches: int = 1):
        super().__init__()
        self.num_branches = num_branches
        self.ffn_dim = ffn_dim
        self.activation_fn = ACT2FN[config.activation_function]
        self.activation_dropout = config.activation_dropout
        self.fc1 = nn.Linear(embed_dim, num_branches * ffn_dim)
        self.fc2, self.fc2_branch_bias = merge_projection(num_branches, ffn_dim, embed_dim)
        self.register_load_state_dict_pre_hook(upgrade_merge_bias_on_load)

    def branch_weights(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """Merge weights `[B]` or `[batch, B]`; None = the average 1/B. MAT overrides it (drop-branch, Eq. 7)."""
        return None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        inner = self.activation_fn(project(self.fc1, hidden_states))
        inner = dropout(inner, self.activation_dropout, self.training)
        inner = inner.view(*hidden_states.shape[:-1], self.num_branches, self.ffn_dim)
        return merge_branches(
            self.fc2, self.fc2_branch_bias, inner, self.branch_weights(hidden_states.shape[0], inner.device, inner.dtype)
        )
