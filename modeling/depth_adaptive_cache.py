"""The early-exit generation cache of the Depth-Adaptive Transformer: copied states projected when a later token
needs them (Appendix B, Algorithm 2)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from .kv_caches import use_preallocated_layers


class CopiedStateCache(DynamicCache):
    """The decoder self-attention cache of early-exit ``generate()``: preallocated layers, plus the *copied states*
    of the decoding steps at which every row exited below some block.

    Algorithm 2 (Appendix B) gives the blocks above an exit their own key/value projections of the copied state.
    When no row of a step reaches block n, nothing reads block n's keys/values for that position until a later
    token runs block n — so early-exit generation records the step's exit states here instead, and the decoder
    projects every missing position of a block at once (one matmul) just before the block next runs
    (:meth:`DepthAdaptiveDecoder.catch_up_copied_states`). With a fixed exit or a whole step that exits low, the
    skipped blocks then cost nothing at all. The keys/values are exactly those of the eager projection; the cache
    is completed before ``generate()`` hands it back (``defer_copied_states`` is only on inside ``generate``).

    Beam reordering, cropping and batch expansion/selection move the recorded states with the layers.
    """

    def __init__(self, config=None, defer_copied_states: bool = False, **kwargs):
        super().__init__(config=config, **kwargs)
        use_preallocated_layers(self)
        self.defer_copied_states = defer_copied_states
        self._copied_states: torch.Tensor | None = None  # [batch, capacity, d]; position p at [:, p]
        self._spare_copied_states: torch.Tensor | None = None
        self._recorded_until = 0  # positions < this may hold recorded states

    def _layer_length(self, layer_idx: int) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def record_copied_states(self, position: int, states: torch.Tensor) -> None:
        """Exit states ``[batch, 1, d]`` of decoding step ``position`` (each row's last computed state)."""
        buffer = self._copied_states
        if buffer is not None and buffer.shape[0] != states.shape[0]:
            start, stop = self._pending_window()
            if start < stop:
                raise RuntimeError(
                    f"copied states are pending for {buffer.shape[0]} rows but this step has {states.shape[0]} rows"
                )
            buffer = None
        if buffer is None or position >= buffer.shape[1]:
            capacity = max(position + 1, 2 * (buffer.shape[1] if buffer is not None else 0), 32)
            grown = states.new_empty(states.shape[0], capacity, states.shape[-1])
            if buffer is not None and self._recorded_until:
                grown[:, : self._recorded_until] = buffer[:, : self._recorded_until]
            buffer = self._copied_states = grown
        buffer[:, position] = states[:, 0]
        self._recorded_until = max(self._recorded_until, position + 1)

    def missing_copied_states(self, layer_idx: int, position: int) -> torch.Tensor | None:
        """``[batch, p, d]``: the recorded states of the positions before ``position`` whose keys/values layer
        ``layer_idx`` still lacks (every row skipped the block there), or ``None``."""
        start = self._layer_length(layer_idx)
        if start >= position:
            return None
        if self._copied_states is None or position > self._recorded_until:
            raise RuntimeError(
                f"decoder layer {layer_idx} holds {start} positions but no copied states were recorded up to {position}"
            )
        return self._copied_states[:, start:position]

    def _pending_window(self) -> tuple[int, int]:
        start = min((self._layer_length(idx) for idx in range(len(self.layers))), default=0)
        return start, self._recorded_until

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        start, stop = self._pending_window()
        if self._copied_states is not None and start < stop:
            # into a spare buffer that is then swapped in, as PreallocatedKVLayer does (no fresh tensor per step)
            buffer = self._copied_states
            if self._spare_copied_states is None or self._spare_copied_states.shape != buffer.shape:
                self._spare_copied_states = torch.empty_like(buffer)
            spare = self._spare_copied_states
            torch.index_select(buffer[:, start:stop], 0, beam_idx.to(buffer.device), out=spare[:, start:stop])
            self._copied_states, self._spare_copied_states = spare, buffer

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"`crop` takes a negative number of tokens to remove, got {tokens_to_remove}")
        new_length = max(self.get_seq_length() + tokens_to_remove, 0)
        for layer_idx in range(len(self.layers)):
            excess = self._layer_length(layer_idx) - new_length
            if excess > 0:
                self.layers[layer_idx].crop(-excess)
        self._recorded_until = min(self._recorded_until, new_length)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self._copied_states is not None:
            self._copied_states = self._copied_states.repeat_interleave(repeats, dim=0)
            self._spare_copied_states = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self._copied_states is not None:
            self._copied_states = self._copied_states[indices]
            self._spare_copied_states = None

    def reset(self) -> None:
        super().reset()
        self._copied_states = self._spare_copied_states = None
        self._recorded_until = 0


def deferring_copied_states(self_attention_cache) -> bool:
    return isinstance(self_attention_cache, CopiedStateCache) and self_attention_cache.defer_copied_states
