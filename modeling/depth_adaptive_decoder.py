"""The Depth-Adaptive Transformer's decoder (Elbayad et al., ICLR 2020): the exit decision after each block and the
two early-exit loops — all positions block after block (training, recomputation) and one incremental decoding step
with row subsets (Appendix B, Algorithm 2) — built from the backbone decoder's pieces. The model, its classifiers,
losses and halting mechanisms are in `modeling_depth_adaptive.py`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .cpu_kernels import weights_version
from .depth_adaptive_cache import CopiedStateCache, deferring_copied_states
from .depth_adaptive_equations import scale_gradient
from .kv_caches import StepKVCollector
from .modeling_flexformer import FlexformerDecoder


def _probability_logit(threshold: float) -> float:
    """log(τ / (1 − τ)) with the limits ±inf: χ > τ ⟺ z > logit(τ), so the decision skips the sigmoid."""
    if threshold <= 0.0:
        return -math.inf
    if threshold >= 1.0:
        return math.inf
    return math.log(threshold) - math.log1p(-threshold)


@dataclass(frozen=True)
class ExitSettings:
    """How a forward/generate call chooses exits (see :class:`DepthAdaptiveConfig`, "Decoding")."""

    strategy: str
    fixed_exit: int | None
    thresholds: tuple[float, ...]


class ExitDecider:
    """The exit decision after block n < N for the rows still computing (Sec. 3; Appendix B, Algorithm 2).

    ``decide(block, states, rows)`` takes the block's output states ``[b', T', d]`` of the batch rows ``rows``
    (``None`` = every row, in order) and returns ``(exit_mask [b', T'] | None, logits | None)``; ``None`` means no
    state can exit here (no check needed). Confidence thresholding returns the classifier logits it computed so the
    caller does not compute them again.
    """

    def __init__(
        self,
        settings: ExitSettings,
        num_exits: int,
        classify=None,
        halting: nn.Module | None = None,
        halting_mechanism: str = "none",
        sequence_exits: torch.Tensor | None = None,
    ):
        self.strategy = settings.strategy
        self.fixed_exit = settings.fixed_exit
        self.num_exits = num_exits
        self.classify = classify
        self.halting = halting
        self.halting_mechanism = halting_mechanism
        self.log_thresholds = [math.log(t) if t > 0 else -math.inf for t in settings.thresholds]
        self.logit_thresholds = [_probability_logit(t) for t in settings.thresholds]
        self.planned_exits = sequence_exits  # [b] (sequence-specific) or set after block 1 (token multinomial)

    def _rows(self, planned: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        return planned if rows is None else planned.index_select(0, rows)

    def decide(self, block: int, states: torch.Tensor, rows: torch.Tensor | None):
        if block >= self.num_exits or self.strategy == "full":
            return None, None
        if self.strategy == "fixed":
            # True: every state still computing exits here (no mask to build)
            return (True if block == self.fixed_exit else None), None
        if self.strategy == "confidence":
            # max_y p(y|h^n_t) > τ_n  ⟺  max logit − logsumexp > log τ_n
            logits = self.classify(block, states)
            scores = logits.float()
            confidence = scores.amax(-1) - torch.logsumexp(scores, dim=-1)
            return confidence > self.log_thresholds[block - 1], logits
        # the trained halting mechanism
        if self.halting_mechanism == "token_geometric":
            return self.halting.halting_logits(block, states) > self.logit_thresholds[block - 1], None
        if self.halting_mechanism == "token_multinomial" and block == 1:
            # Eq. 11: argmax_n q_t(n) is chosen after the first block (every row is still computing there).
            self.planned_exits = torch.argmax(self.halting(states), dim=-1) + 1
            return self.planned_exits == 1, None
        if self.halting_mechanism == "token_multinomial":
            return self._rows(self.planned_exits, rows) == block, None
        if self.halting_mechanism == "sequence":
            planned = self._rows(self.planned_exits, rows)
            return (planned == block).unsqueeze(-1).expand(states.shape[:2]), None
        raise ValueError(f"exit strategy 'halting' needs a halting mechanism, got {self.halting_mechanism!r}")


# ----------------------------------------------------------------------------------------------------------------------
# Decoder with early exits
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class BlockOutputs:
    """What ``output_hidden_states`` / ``output_attentions`` collect from an early-exit pass, for the whole batch:
    the embedded input and every block's output states (the last one through ``finalize``), every block's self- and
    cross-attention weights ``[b, heads, queries, keys]``. Above its exit a position carries its copied state
    (Sec. 2.2.2) and zero weights: the block did not run for it (or ran on the copied state only to write its own
    keys/values of it). ``None`` = not collected."""

    hidden_states: list[torch.Tensor] | None = None
    self_attentions: list[torch.Tensor] | None = None
    cross_attentions: list[torch.Tensor] | None = None

    @classmethod
    def wanted(cls, output_hidden_states: bool, output_attentions: bool) -> BlockOutputs | None:
        if not (output_hidden_states or output_attentions):
            return None
        return cls(*(([] if wanted else None) for wanted in (output_hidden_states, output_attentions, output_attentions)))

    @property
    def attentions(self) -> bool:
        return self.self_attentions is not None

    def add(self, states, self_weights=None, cross_weights=None, ran: torch.Tensor | None = None) -> None:
        """One block: the states of every row, the weights of the positions ``ran`` (``[b, T]``; None = all)."""
        if self.hidden_states is not None:
            self.hidden_states.append(states)
        if self.attentions:
            for collected, weights in ((self.self_attentions, self_weights), (self.cross_attentions, cross_weights)):
                collected.append(weights if ran is None else weights.masked_fill(~ran[:, None, :, None], 0.0))

    def add_rows(self, states, self_weights, cross_weights, rows: torch.Tensor | None) -> None:
        """One block of an incremental step that ran for the batch rows ``rows`` only (weights of those rows)."""
        if rows is not None and self.attentions:
            self_weights, cross_weights = (
                weights.new_zeros((states.shape[0], *weights.shape[1:])).index_copy(0, rows, weights)
                for weights in (self_weights, cross_weights)
            )
        self.add(states, self_weights, cross_weights)

    def skip(self, states: torch.Tensor, blocks: int) -> None:
        """``blocks`` blocks at the top that no row ran: the copied states, zero weights."""
        for _ in range(blocks):
            if self.attentions:
                self.add(states, torch.zeros_like(self.self_attentions[-1]), torch.zeros_like(self.cross_attentions[-1]))
            else:
                self.add(states)

    def finish(self, finalize) -> None:
        if self.hidden_states:
            self.hidden_states[-1] = finalize(self.hidden_states[-1])


class DepthAdaptiveDecoder(FlexformerDecoder):
    """The backbone decoder (``forward`` is the plain full-depth decoder) plus the two early-exit loops built from
    the backbone's ``embed`` / ``run_layer`` / ``finalize`` pieces:

    - :meth:`forward_layerwise` — all positions in parallel, block after block: aligned training (every block's
      states), mixed training / recomputation with a given exit sequence, and decisions made on the fly. A state that
      has exited is *copied* to the blocks above (Sec. 2.2.2), whose self-attention keys/values are then their own
      projections of the copied state (Sec. 2.2.1).
    - :meth:`early_exit_step` — one incremental decoding step (Appendix B, Algorithm 2) where the blocks above a
      row's exit run only for the rows still computing (``rows`` subsets of the batch) and a skipped block only
      projects the copied state to its keys/values; each layer's cache gets one full-batch write per step.
    """

    # Early-exit steps run a block on the whole batch (dropping the exited rows' outputs) while at least this
    # fraction of the rows is still computing, and on the row subset below it.
    dense_step_fraction: float = 0.5

    def __init__(self, config, embed_tokens, components):
        super().__init__(config, embed_tokens, components)
        self._fused_key_value = None
        self._fused_key_value_signature = None

    def run_block(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        layer_kwargs: dict,
        past_key_values=None,
        rows: torch.Tensor | None = None,
        kv_collector: StepKVCollector | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Block ``layer_idx`` for all rows, or for the batch rows ``rows`` with the new self-attention keys/values
        deferred to ``kv_collector`` (the cache is written once per layer and step, by the collector). Returns the
        block's output states and, with ``output_attentions``, its self- and cross-attention weights (of those rows)."""
        if rows is None and kv_collector is None:
            return self.run_layer(
                layer_idx, hidden_states, past_key_values=past_key_values, output_attentions=output_attentions,
                **layer_kwargs,
            )
        layer = self.layers[layer_idx]
        hidden_states, self_weights = layer.self_attention_sublayer(
            hidden_states,
            attention_mask=layer_kwargs.get("attention_mask"),
            past_key_values=past_key_values,
            rows=rows,
            kv_collector=kv_collector,
            output_attentions=output_attentions,
        )
        hidden_states, cross_weights = layer.cross_attention_sublayer(
            hidden_states,
            encoder_hidden_states=layer_kwargs["encoder_hidden_states"],
            encoder_attention_mask=layer_kwargs.get("encoder_attention_mask"),
            past_key_values=past_key_values,
            rows=rows,
            output_attentions=output_attentions,
        )
        hidden_states, _ = layer.feed_forward_sublayer(hidden_states)
        return hidden_states, self_weights, cross_weights

    def _fused_key_value_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All blocks' self-attention K/V projections as one ``[d, N·2D]`` matrix (and bias), rebuilt whenever a
        weight changes, so the copied state's keys/values for every skipped block take a single matmul."""
        projections = [(layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in self.layers]
        signature = tuple(
            (*weights_version(tensor), tensor.dtype)
            for pair in projections
            for projection in pair
            for tensor in (projection.weight, projection.bias)
        )
        if signature != self._fused_key_value_signature:
            with torch.no_grad():
                weight = torch.cat([torch.cat([k.weight, v.weight], 0) for k, v in projections], 0).t().contiguous()
                bias = torch.cat([torch.cat([k.bias, v.bias], 0) for k, v in projections], 0)
            self._fused_key_value = (weight, bias)
            self._fused_key_value_signature = signature
        return self._fused_key_value

    def copied_key_values(
        self, first_layer: int, states: torch.Tensor, num_layers: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys/values ``[b', heads, q, head_dim]`` of the copied ``states`` for ``num_layers`` blocks from
        ``first_layer`` (0-based; default: up to the top): each block's *own* projections of the copied state
        (Sec. 2.2.1; FS = 4 d_d² in Appendix B), all blocks in one matmul at inference. Pre-norm blocks normalise the
        state with their self-attention LayerNorm first, exactly as the block would."""
        last_layer = len(self.layers) if num_layers is None else first_layer + num_layers
        layers = self.layers[first_layer:last_layer]
        if len(layers) == 0:
            return []
        attention = layers[0].self_attn
        rows, length = states.shape[:2]
        width = attention.total_heads * attention.head_dim
        if not torch.is_grad_enabled() and not self.config.decoder_normalize_before:
            weight, bias = self._fused_key_value_weights()
            start, stop = first_layer * 2 * width, last_layer * 2 * width
            projected = torch.addmm(bias[start:stop], states.reshape(rows * length, -1), weight[:, start:stop])
            # [rows·q, L·2·D] → [L, 2, rows, heads, q, head_dim]: one view and one permute for every block
            projected = projected.view(rows, length, len(layers), 2, attention.total_heads, attention.head_dim)
            projected = projected.permute(2, 3, 0, 4, 1, 5)
            return [tuple(per_layer.unbind(0)) for per_layer in projected.unbind(0)]
        result = []
        for layer in layers:
            inputs = layer.self_attn_layer_norm(states) if layer.normalize_before else states
            result.append(layer.self_attn.project_key_value(inputs))
        return result

    def catch_up_copied_states(self, self_attention_cache, layer_idx: int, position: int) -> None:
        """Give block ``layer_idx`` its own key/value projections (Sec. 2.2.1) of the copied states of every position
        before ``position`` at which no row reached it (recorded in a :class:`CopiedStateCache`), one matmul for
        all of them — just before a token needs the block."""
        missing = self_attention_cache.missing_copied_states(layer_idx, position)
        if missing is not None:
            (keys, values), = self.copied_key_values(layer_idx, missing, num_layers=1)
            self_attention_cache.update(keys, values, layer_idx)

    def complete_copied_states(self, past_key_values) -> None:
        """Catch every block up to the cache's full length (the cache is then what eager projection would have
        written); a no-op for any other cache."""
        self_cache = getattr(past_key_values, "self_attention_cache", None)
        if not isinstance(self_cache, CopiedStateCache):
            return
        length = self_cache.get_seq_length()
        with torch.no_grad():
            for layer_idx in range(len(self.layers)):
                self.catch_up_copied_states(self_cache, layer_idx, length)

    def forward_layerwise(
        self,
        hidden_states: torch.Tensor,
        layer_kwargs: dict,
        past_key_values=None,
        token_exits: torch.Tensor | None = None,
        decider: ExitDecider | None = None,
        keep_states: bool = False,
        gradient_scales: Sequence[float] | None = None,
        record: BlockOutputs | None = None,
        check_exits: bool = True,
    ):
        """Run the N blocks over all positions. Returns ``(states, exit_states, exits)``:

        - ``states``: every block's output h¹ … h^N (with copied states where a position has exited) when
          ``keep_states``, else ``[]``;
        - ``exit_states``: each position's state at its exit (the last computed state, copied upwards);
        - ``exits``: ``[b, T]`` exits in 1..N — ``token_exits`` when given (Eq. 5's sampled exit sequence, or any
          fixed sequence), else decided by ``decider`` after each block (N when it never fires).

        ``gradient_scales`` (γ_1 … γ_N) applies line 5 of Algorithm 1 (Appendix A) between blocks; the caller scales
        the classifier outputs (line 4). ``record`` collects the hidden states / attention weights.
        ``check_exits=False`` skips checking that ``token_exits`` lie in 1..N (a host sync, and a graph break when
        compiled) for exits that do by construction (Eq. 5's samples).
        """
        num_layers = len(self.layers)
        batch, length = hidden_states.shape[:2]
        if token_exits is not None:
            if token_exits.shape != (batch, length):
                raise ValueError(f"token_exits must have shape {(batch, length)}, got {tuple(token_exits.shape)}")
            if check_exits and (bool((token_exits < 1).any()) or bool((token_exits > num_layers).any())):
                raise ValueError(f"token_exits must be exits in 1..{num_layers}")
            exits = token_exits.long()
        else:
            exits = torch.full((batch, length), num_layers, dtype=torch.long, device=hidden_states.device)
        done = None if decider is None or token_exits is not None else torch.zeros_like(exits, dtype=torch.bool)
        states = []
        if record is not None and record.hidden_states is not None:
            record.hidden_states.append(hidden_states)
        for idx in range(num_layers):
            block = idx + 1
            output, self_weights, cross_weights = self.run_block(
                idx, hidden_states, layer_kwargs, past_key_values, output_attentions=record is not None and record.attentions
            )
            ran = None  # the positions this block runs for (None: all)
            if token_exits is not None:
                ran = exits >= block
                output = torch.where(ran.unsqueeze(-1), output, hidden_states)
            elif done is not None and block > 1:
                ran = ~done
                output = torch.where(done.unsqueeze(-1), hidden_states, output)
            if record is not None:
                record.add(output, self_weights, cross_weights, ran)
            if keep_states:
                states.append(output)
            if done is not None and block < num_layers:
                exit_mask, _ = decider.decide(block, output, None)
                if exit_mask is True:
                    exit_mask = torch.ones_like(done)
                if exit_mask is not None:
                    newly = exit_mask & ~done
                    exits = exits.masked_fill(newly, block)
                    done = done | newly
            hidden_states = output
            if gradient_scales is not None and block < num_layers:
                hidden_states = scale_gradient(output, 1.0 / gradient_scales[idx + 1])
        if record is not None:
            record.finish(self.finalize)
        return states, hidden_states, exits

    def _store_copied_states(self, self_cache, first_layer: int, position: int, copied: torch.Tensor, deferring: bool):
        """Every row exited below block ``first_layer + 1`` at this step: record the copied states for a later catch-up
        (``deferring``), else write the blocks' keys/values of them now (one matmul for all blocks)."""
        if deferring:
            self_cache.record_copied_states(position, copied)
            return
        for offset, (keys, values) in enumerate(self.copied_key_values(first_layer, copied)):
            self_cache.update(keys, values, first_layer + offset)

    def early_exit_step(
        self, hidden_states: torch.Tensor, layer_kwargs: dict, past_key_values, decider, classify,
        record: BlockOutputs | None = None,
    ):
        """One incremental decoding step with early exits (Appendix B, Algorithm 2) for a batch of single tokens
        ``[b, 1, d]`` (embedded). Returns ``(logits [b, 1, V], exits [b])``; ``record`` collects the hidden states /
        attention weights.

        After each block n < N the decider picks the rows that exit. An exited row's state is copied upwards and
        every block above gets its own key/value projections of it, so each layer's cache receives one full-batch
        write per step. The blocks above run for the remaining rows only:

        - *sparse*: with few rows left (fewer than ``dense_step_fraction`` of the batch), the block runs on those
          rows (row subsets against their own cache rows), and the copied rows' keys/values are one projection;
        - *dense*: with many rows left, gathering rows costs more than it saves, so the block runs on the whole
          batch with the copied states as the exited rows' inputs — which writes exactly the copied states' K/V for
          them — and their outputs are dropped;
        - once every row has exited, the blocks above only need the copied states' keys/values: with a deferring
          :class:`CopiedStateCache` (``generate()``) the step records the copied states and each block projects them
          when a later token next runs it (never, with a fixed exit); otherwise one matmul for all blocks now.
        """
        num_layers = len(self.layers)
        batch = hidden_states.shape[0]
        self_cache = past_key_values.self_attention_cache
        deferring = deferring_copied_states(self_cache)
        position = self_cache.get_seq_length() if deferring else 0  # this step's position
        exits = torch.full((batch,), num_layers, dtype=torch.long, device=hidden_states.device)
        active_rows = None  # None: every row, in batch order
        exited_rows = None  # rows that have exited, in batch order
        copied = None  # [b, 1, d]: each exited row's copied state
        finished: list[tuple] = []  # (rows, logits) of the rows that have exited
        weights_wanted = record is not None and record.attentions
        if record is not None and record.hidden_states is not None:
            record.hidden_states.append(hidden_states)
        for idx in range(num_layers):
            block = idx + 1
            if active_rows is not None and active_rows.numel() == 0:
                # Every row has exited: the blocks above only need the copied states' keys/values.
                self._store_copied_states(self_cache, idx, position, copied, deferring)
                if record is not None:
                    record.skip(copied, num_layers - idx)
                break
            if deferring:
                self.catch_up_copied_states(self_cache, idx, position)
            if exited_rows is None:
                hidden_states, self_weights, cross_weights = self.run_block(
                    idx, hidden_states, layer_kwargs, past_key_values, output_attentions=weights_wanted
                )
            elif active_rows.numel() >= self.dense_step_fraction * batch:
                inputs = copied.index_copy(0, active_rows, hidden_states)
                hidden_states, self_weights, cross_weights = self.run_block(
                    idx, inputs, layer_kwargs, past_key_values, output_attentions=weights_wanted
                )
                hidden_states = hidden_states.index_select(0, active_rows)
                if weights_wanted:  # the exited rows ran only to write the copied states' keys/values
                    self_weights, cross_weights = self_weights[active_rows], cross_weights[active_rows]
            else:
                collector = StepKVCollector(self_cache, idx, batch)
                hidden_states, self_weights, cross_weights = self.run_block(
                    idx, hidden_states, layer_kwargs, past_key_values, rows=active_rows, kv_collector=collector,
                    output_attentions=weights_wanted,
                )
                (keys, values), = self.copied_key_values(idx, copied.index_select(0, exited_rows), num_layers=1)
                collector.add(exited_rows, keys, values)
                collector.flush()
            if record is not None:
                states = hidden_states if exited_rows is None else copied.index_copy(0, active_rows, hidden_states)
                record.add_rows(states, self_weights, cross_weights, active_rows)
            if block == num_layers:
                break
            exit_mask, exit_logits = decider.decide(block, hidden_states, active_rows)
            if exit_mask is None:
                continue
            if exit_mask is True:
                leaving = hidden_states.shape[0]
            else:
                exit_mask = exit_mask[:, 0]
                leaving = int(exit_mask.sum())
                if leaving == 0:
                    continue
            if leaving == batch:  # every row leaves at this block
                exits.fill_(block)
                finished.append((None, exit_logits if exit_logits is not None else classify(block, hidden_states)))
                self._store_copied_states(self_cache, idx + 1, position, hidden_states, deferring)
                if record is not None:
                    record.skip(hidden_states, num_layers - block)
                    record.finish(self.finalize)
                return finished[0][1], exits
            rows_now = active_rows if active_rows is not None else torch.arange(batch, device=exits.device)
            if leaving == hidden_states.shape[0]:
                leaving_rows, leaving_states, leaving_logits = rows_now, hidden_states, exit_logits
                active_rows = rows_now[:0]
            else:
                leaving_rows = rows_now[exit_mask]
                leaving_states = hidden_states[exit_mask]
                leaving_logits = exit_logits[exit_mask] if exit_logits is not None else None
                active_rows, hidden_states = rows_now[~exit_mask], hidden_states[~exit_mask]
            exits.index_fill_(0, leaving_rows, block)
            if copied is None:
                copied = leaving_states if leaving_rows.numel() == batch else leaving_states.new_zeros(
                    batch, *leaving_states.shape[1:]
                ).index_copy(0, leaving_rows, leaving_states)
                exited_rows = leaving_rows
            else:
                copied = copied.index_copy(0, leaving_rows, leaving_states)
                exited_rows = torch.sort(torch.cat([exited_rows, leaving_rows])).values
            finished.append(
                (leaving_rows, leaving_logits if leaving_logits is not None else classify(block, leaving_states))
            )
        if record is not None:
            record.finish(self.finalize)
        if active_rows is None:
            return classify(num_layers, hidden_states), exits
        if active_rows.numel() > 0:
            finished.append((active_rows, classify(num_layers, hidden_states)))
        if len(finished) == 1:
            return finished[0][1], exits  # one group holding every row, in batch order
        vocab = finished[0][1].shape[-1]
        logits = finished[0][1].new_empty(batch, 1, vocab)
        for rows, group_logits in finished:
            logits.index_copy_(0, rows, group_logits)
        return logits, exits
