"""The decoder's key/value caches: what incremental decoding keeps between steps, and how it is written.

- `PreallocatedKVLayer` / `SpareBuffers`: a self-attention layer that appends into a growing buffer and reorders
  beams into a shared spare pair, instead of `DynamicLayer`'s copy per step;
- `StepKVCollector`: one layer's new keys/values gathered from row subsets computed separately in one step
  (IOT's per-row orders, Depth-Adaptive's early exits), written with one full-batch update;
- `SourceGroupedCache`: cross-attention keys/values stored once per source sentence rather than per beam;
- `new_decoder_cache`, `static_cache_capacity`: the cache a decoder starts with, and what a static one holds.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.utils.weak
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    EncoderDecoderCache,
)


class PreallocatedKVLayer(DynamicLayer):
    """A self-attention `DynamicLayer` that appends each step's keys/values into a preallocated buffer.

    `DynamicLayer.update` concatenates (copies) the whole past at every decoding step and beam search's
    `reorder_cache` allocates a reordered copy; on CPU those fresh multi-megabyte tensors cost more than the step's
    attention itself. Here the buffer `[batch, heads, capacity, head_dim]` grows by doubling, a step writes only
    its new positions, and beams are reordered into a spare buffer pair of the same shape that is then swapped in.
    The layers of one cache share their spare pair (`SpareBuffers`). `keys` / `values` are views of the filled
    part, so everything that reads a `DynamicLayer` reads this one.
    """

    min_capacity = 32

    def __init__(self, spares: SpareBuffers | None = None, **kwargs):
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._spares = spares if spares is not None else SpareBuffers()
        self._length = 0
        self._placeholder: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        super().__init__(**kwargs)

    @property
    def keys(self) -> torch.Tensor | None:
        if self._key_buffer is None:
            return self._placeholder[0]
        return self._key_buffer[:, :, : self._length]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._adopt(tensor, is_key=True)

    @property
    def values(self) -> torch.Tensor | None:
        if self._value_buffer is None:
            return self._placeholder[1]
        return self._value_buffer[:, :, : self._length]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._adopt(tensor, is_key=False)

    def _adopt(self, tensor: torch.Tensor | None, is_key: bool) -> None:
        """Keys/values assigned from outside (`DynamicLayer`'s `batch_select_indices`, `offload`, `reset`, …)
        become the new buffer, exactly full."""
        if tensor is None or tensor.dim() != 4:  # None, or DynamicLayer's empty `torch.tensor([])` placeholder
            if is_key:
                self._key_buffer, self._placeholder = None, (tensor, self._placeholder[1])
            else:
                self._value_buffer, self._placeholder = None, (self._placeholder[0], tensor)
            if self._key_buffer is None and self._value_buffer is None:
                self._length = 0
            return
        if is_key:
            self._key_buffer = tensor
        else:
            self._value_buffer = tensor
        self._length = tensor.shape[2]

    @staticmethod
    def _buffer_like(states: torch.Tensor, batch_size: int, capacity: int) -> torch.Tensor:
        return states.new_empty((batch_size, states.shape[1], capacity, states.shape[3]))

    def _grow(self, needed: int) -> None:
        old_keys, old_values = self._key_buffer, self._value_buffer
        capacity = max(needed, 2 * old_keys.shape[2], self.min_capacity)
        self._key_buffer = self._buffer_like(old_keys, old_keys.shape[0], capacity)
        self._value_buffer = self._buffer_like(old_values, old_values.shape[0], capacity)
        self._key_buffer[:, :, : self._length] = old_keys[:, :, : self._length]
        self._value_buffer[:, :, : self._length] = old_values[:, :, : self._length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values, past_length = self.reserve(key_states.shape[0], key_states, value_states)
        keys[:, :, past_length:] = key_states
        values[:, :, past_length:] = value_states
        self.commit(key_states.shape[2])
        return keys, values

    def reserve(self, batch_size: int, key_like: torch.Tensor, value_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for `key_like.shape[2]` new positions of all `batch_size` rows (`update` writes them at once,
        `StepKVCollector.extend` block by block); returns views `[batch, heads, past + new, head_dim]` and the past
        length. `commit` adds the new positions to the cache once every row has been written."""
        new = key_like.shape[2]
        if not self.is_initialized:
            self.lazy_initialization(key_like, value_like)
        if self._key_buffer is None:
            capacity = max(new, self.min_capacity)
            self._key_buffer = self._buffer_like(key_like, batch_size, capacity)
            self._value_buffer = self._buffer_like(value_like, batch_size, capacity)
            self._length = 0
        elif self._length + new > self._key_buffer.shape[2]:
            self._grow(self._length + new)
        end = self._length + new
        return self._key_buffer[:, :, :end], self._value_buffer[:, :, :end], self._length

    def commit(self, new: int) -> None:
        self._length += new

    def get_seq_length(self) -> int:
        if self._key_buffer is None:
            return super().get_seq_length()
        return self._length  # without building the `keys` view (asked several times per decoding step)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"`crop` takes a negative number of tokens to remove, got {tokens_to_remove}")
        if self._key_buffer is not None:
            self._length = max(self._length + tokens_to_remove, 0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self._key_buffer is None or self._length == 0:
            return
        self._key_buffer, self._value_buffer = self._spares.reorder(
            self._key_buffer, self._value_buffer, beam_idx.to(self._key_buffer.device), self._length
        )


class SpareBuffers:
    """The spare key/value buffer pair that the `PreallocatedKVLayer`s of one cache reorder beams into, one after
    the other: a layer takes the pair, reorders into it and leaves its old pair for the next layer. A cache of L
    layers then holds L + 1 buffer pairs instead of 2L — on CPU each fresh pair is page-faulted in at its first
    write (beam 5 at batch 32, `transformer_iwslt_de_en`: 67k page faults per `generate` with a spare per layer).
    A pair of another shape, dtype or device than the asking layer's is not used (a fresh one is made). InDIGO's
    SAO search reorders its pointer cache (keys and word part) through one too."""

    __slots__ = ("_pair",)

    def __init__(self):
        self._pair: tuple[torch.Tensor, torch.Tensor] | None = None

    def take(self, keys_like: torch.Tensor, values_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pair, self._pair = self._pair, None
        if pair is not None and all(
            spare.shape == like.shape and spare.dtype == like.dtype and spare.device == like.device
            for spare, like in zip(pair, (keys_like, values_like))
        ):
            return pair
        return torch.empty_like(keys_like), torch.empty_like(values_like)

    def give(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._pair = (keys, values)

    def reorder(
        self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Beam selection on a buffer pair filled up to `length` along dim 2: row i of the result is old row
        `index[i]`. Gathered into the spare pair (only the filled part), which is returned; the old pair becomes
        the spare."""
        spare_keys, spare_values = self.take(keys, values)
        filled = slice(0, length)
        torch.index_select(keys[:, :, filled], 0, index, out=spare_keys[:, :, filled])
        torch.index_select(values[:, :, filled], 0, index, out=spare_values[:, :, filled])
        self.give(keys, values)
        return spare_keys, spare_values


def use_preallocated_layers(cache: DynamicCache) -> DynamicCache:
    """Swap a fresh `DynamicCache`'s empty plain layers (and the class it replicates for layers added later) for
    `PreallocatedKVLayer`s; layers that already hold states, or are of another kind, are left alone."""
    spares = SpareBuffers()
    cache.layers = [
        PreallocatedKVLayer(spares) if type(layer) is DynamicLayer and not layer.is_initialized else layer
        for layer in cache.layers
    ]
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = partial(PreallocatedKVLayer, spares)
    return cache

def index_rows(tensor: torch.Tensor | None, rows: torch.Tensor | slice | None) -> torch.Tensor | None:
    """The batch rows `rows` of `tensor`: a LongTensor of rows (a copy) or a `slice` of contiguous rows (a view)."""
    if tensor is None or rows is None or tensor.shape[0] == 1:
        return tensor
    if isinstance(rows, slice):
        return tensor[rows]
    return tensor.index_select(0, rows)



class StepKVCollector:
    """Collects one decoder layer's new self-attention keys/values when the rows of a batch are computed in
    several subsets during one forward (IOT per-row orders, Depth-Adaptive early exits), then writes them to the
    cache with one full-batch `update` — so the cache stays the standard `DynamicCache` every other tool expects.
    With a `PreallocatedKVLayer`, blocks of contiguous rows (`extend` with a `slice`) write into the layer's own
    buffer instead, and `flush` only commits the new positions.
    """

    def __init__(self, cache: Cache, layer_idx: int, batch_size: int):
        self.cache = cache
        self.layer_idx = layer_idx
        self.batch_size = batch_size
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._rows_written = 0
        # (keys, values, past_length): this step's [batch, heads, past + q, d] buffers once `extend` used them
        self._extended: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._reserved_in: PreallocatedKVLayer | None = None  # the cache layer whose buffer `_extended` views

    def past(self, rows: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        layers = getattr(self.cache, "layers", [])
        if self.layer_idx >= len(layers) or not layers[self.layer_idx].is_initialized:
            return None, None
        layer = layers[self.layer_idx]
        if layer.keys is None or layer.keys.numel() == 0:
            return None, None
        if rows is None:
            return layer.keys, layer.values
        return index_rows(layer.keys, rows), index_rows(layer.values, rows)

    def add(self, rows: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self._extended is not None:  # `extend` already holds this step's buffers: write there
            full_keys, full_values, past_length = self._extended
            index = slice(None) if rows is None else rows
            full_keys[index, :, past_length:] = keys
            full_values[index, :, past_length:] = values
            self._rows_written += keys.shape[0]
            return
        if rows is None:
            self.keys, self.values = keys, values
            self._rows_written = self.batch_size
            return
        if self.keys is None:
            shape = (self.batch_size, *keys.shape[1:])
            self.keys = keys.new_zeros(shape)
            self.values = values.new_zeros(shape)
        if isinstance(rows, slice):  # a contiguous block of rows: write in place into this step's own buffer
            self.keys[rows] = keys
            self.values[rows] = values
        else:
            self.keys = self.keys.index_copy(0, rows, keys)
            self.values = self.values.index_copy(0, rows, values)
        self._rows_written += keys.shape[0]

    def extend(
        self, rows: torch.Tensor | slice | None, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`add` the new keys/values of `rows`, and return what those rows attend over (past + new) with the past
        length. For a contiguous block of rows (a `slice`) every block writes its new positions in place into one
        `[batch, heads, past + q, d]` buffer per layer and step and attends over a view of it: the
        `PreallocatedKVLayer`'s own buffer (no copy; `flush` commits), else a copy of the past that `flush` hands to
        the cache as is — one copy of the past per step, as the plain path."""
        if rows is None and keys.shape[0] == self.batch_size:
            # all rows at once (an IOT stage every order shares): the whole batch is one contiguous block, so it
            # writes in place too instead of concatenating a copy of the past
            rows = slice(0, self.batch_size)
        if not isinstance(rows, slice):
            self.add(rows, keys, values)
            if self._extended is not None:
                full_keys, full_values, past_length = self._extended
                index = slice(None) if rows is None else rows
                return full_keys[index], full_values[index], past_length
            past_keys, past_values = self.past(rows)
            if past_keys is None:
                return keys, values, 0
            return (
                torch.cat([past_keys, keys], dim=2), torch.cat([past_values, values], dim=2), past_keys.shape[2]
            )
        if self._extended is None:
            layers = getattr(self.cache, "layers", [])
            layer = layers[self.layer_idx] if self.layer_idx < len(layers) else None
            if isinstance(layer, PreallocatedKVLayer) and (
                layer._key_buffer is None or layer._key_buffer.shape[0] == self.batch_size
            ):
                # the row blocks write straight into the cache's own buffer: no copy of the past at all
                full_keys, full_values, past_length = layer.reserve(self.batch_size, keys, values)
                self._reserved_in = layer
            else:
                past_keys, past_values = self.past(None)
                past_length = 0 if past_keys is None else past_keys.shape[2]
                shape = (self.batch_size, keys.shape[1], past_length + keys.shape[2], keys.shape[3])
                # every position gets written (the past here, the new ones by the row blocks: `flush` checks it)
                full_keys, full_values = keys.new_empty(shape), values.new_empty(shape)
                if past_length:
                    full_keys[:, :, :past_length] = past_keys
                    full_values[:, :, :past_length] = past_values
            if self.keys is not None:  # rows written by `add` before: move them into the buffer
                full_keys[:, :, past_length:] = self.keys
                full_values[:, :, past_length:] = self.values
                self.keys = self.values = None
            self._extended = (full_keys, full_values, past_length)
        full_keys, full_values, past_length = self._extended
        full_keys[rows, :, past_length:] = keys
        full_values[rows, :, past_length:] = values
        self._rows_written += keys.shape[0]
        return full_keys[rows], full_values[rows], past_length

    def flush(self) -> None:
        if self._extended is not None:
            if self._rows_written != self.batch_size:
                raise RuntimeError(
                    f"layer {self.layer_idx}: new keys/values were written for {self._rows_written} of "
                    f"{self.batch_size} rows; every row must be written once per step to keep the cache consistent"
                )
            full_keys, full_values, past_length = self._extended
            layers = getattr(self.cache, "layers", [])
            layer = layers[self.layer_idx] if self.layer_idx < len(layers) else None
            if self._reserved_in is not None:
                self._reserved_in.commit(full_keys.shape[2] - past_length)
                self._reserved_in = None
            elif past_length and type(layer) is DynamicLayer:
                layer.keys, layer.values = full_keys, full_values  # the buffer already holds past + new
            else:
                self.cache.update(full_keys[:, :, past_length:], full_values[:, :, past_length:], self.layer_idx)
            self._extended = None
            self._rows_written = 0
            return
        if self.keys is None:
            return
        if self._rows_written != self.batch_size:
            raise RuntimeError(
                f"layer {self.layer_idx}: new keys/values were written for {self._rows_written} of "
                f"{self.batch_size} rows; every row must be written once per step to keep the cache consistent"
            )
        self.cache.update(self.keys, self.values, self.layer_idx)
        self.keys = self.values = None
        self._rows_written = 0


def self_attention_cache_of(past_key_values: Cache | None) -> Cache | None:
    """The self-attention part of a decoder cache (the cache itself when it is not an `EncoderDecoderCache`)."""
    if isinstance(past_key_values, EncoderDecoderCache):
        return past_key_values.self_attention_cache
    return past_key_values


def static_cache_capacity(past_key_values: Cache | None) -> int | None:
    """The capacity of a static self-attention cache (`generate(cache_implementation="static")`), or None for a
    cache that returns just its filled part. A static layer's keys are its whole preallocated buffer and its length
    is a device tensor: the decoder masks the slots not written yet and never reads the length on the host, so a
    decoding step is one graph for `torch.compile` (CUDA graphs on a GPU)."""
    cache = self_attention_cache_of(past_key_values)
    if cache is None or not getattr(cache, "layers", None):
        return None
    capacity = cache.layers[0].get_max_length()
    return capacity if capacity > 0 else None


class SourceGroupedCache(EncoderDecoderCache):
    """An `EncoderDecoderCache` whose cross-attention keys/values are stored once per source sentence instead of
    once per beam (or per returned sample).

    `generate()` repeats every source `group_size` times (`max(num_beams, num_return_sequences)`); the copies are
    identical, so the cross-attention folds a group's queries into the query axis of one sentence's keys. Beam
    search only moves hypotheses within their own sentence, so `reorder_cache` leaves the cross-attention part
    alone — the standard cache would copy `group_size ×` the encoder keys/values of every layer at every step.
    """

    def __init__(self, self_attention_cache: Cache, cross_attention_cache: Cache, group_size: int = 1):
        super().__init__(self_attention_cache, cross_attention_cache)
        self.group_size = group_size

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.self_attention_cache.reorder_cache(beam_idx)

    def _ungroup(self) -> None:
        if self.group_size == 1:
            return
        for layer in self.cross_attention_cache.layers:
            if layer.is_initialized and layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys.repeat_interleave(self.group_size, dim=0)
                layer.values = layer.values.repeat_interleave(self.group_size, dim=0)
        self.group_size = 1

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._ungroup()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._ungroup()
        super().batch_select_indices(indices)


def new_decoder_cache(config, group_size: int = 1) -> EncoderDecoderCache:
    """The cache a decoder starts incremental decoding with: preallocated self-attention layers
    (`PreallocatedKVLayer`), a plain `DynamicCache` for the cross-attention keys/values (written once).

    `group_size > 1`: the rows are `group_size` consecutive copies of each source sentence (beams) that are only
    ever reordered within their sentence — a `SourceGroupedCache` then keeps one cross-attention copy per sentence.
    """
    self_attention = use_preallocated_layers(DynamicCache(config=config))
    if group_size > 1:
        return SourceGroupedCache(self_attention, DynamicCache(config=config), group_size)
    return EncoderDecoderCache(self_attention, DynamicCache(config=config))


# `whole_groups` answers per row-subset tensor, remembered while the tensor lives: a generation reuses the same
# subsets at every step, and the check needs a host sync.
_WHOLE_GROUPS_CACHE: "torch.utils.weak.WeakIdKeyDictionary" = torch.utils.weak.WeakIdKeyDictionary()


def whole_groups(rows: torch.Tensor, group: int) -> torch.Tensor | None:
    """The group indices if `rows` (a LongTensor of batch rows) is a sequence of whole, ordered groups of `group`
    consecutive rows — all beams of some sentences, as IOT's per-order row subsets are in beam search — else None."""
    # inference tensors keep no version counter; the row subsets the model builds are never changed in place
    key = (group, None if rows.is_inference() else rows._version)
    known = _WHOLE_GROUPS_CACHE.get(rows)
    if known is not None and known[0] == key:
        return known[1]
    sentences = None
    if rows.dim() == 1 and rows.numel() and rows.numel() % group == 0:
        blocks = rows.view(-1, group)
        firsts = blocks[:, 0]
        offsets = torch.arange(group, device=rows.device)
        if bool(((blocks - firsts[:, None]) == offsets).all() and (firsts % group == 0).all()):
            sentences = torch.div(firsts, group, rounding_mode="floor")
    _WHOLE_GROUPS_CACHE[rows] = (key, sentences)
    return sentences


def fold_groups(tensor: torch.Tensor, group: int) -> torch.Tensor:
    """[B·g, H, q, d] → [B, H, g·q, d]: the g copies of a sentence become extra query positions."""
    batch, heads, q_len, dim = tensor.shape
    return tensor.view(batch // group, group, heads, q_len, dim).transpose(1, 2).reshape(
        batch // group, heads, group * q_len, dim
    )
