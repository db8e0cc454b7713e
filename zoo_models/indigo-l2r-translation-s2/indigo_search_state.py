"""State that InDIGO keeps while it decodes or searches orders: the per-hypothesis insertion state of generation,
the reference pointer keys of the SAO search (Sec. 4.2), and the search replayed as CUDA graphs on a GPU."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from .indigo_insertion import (
    LEFT,
    RIGHT,
    absolute_positions_from_relative,
    insertion_relative_position,
)
from .kv_caches import SpareBuffers


class InsertionState:
    """Per-hypothesis state of insertion decoding, grown in place: tokens (generation order), R (Eq. 5), the
    pointer keys of every word (its final hidden state projected by C and D, Eq. 9 — append-only like the cache)
    and the trace. ``reorder`` follows beam search's selection together with the KV cache."""

    def __init__(self, batch: int, capacity: int, dim: int, device, dtype, bos: int, eos: int, pad: int):
        self.length = 2
        self.tokens = torch.full((batch, capacity), pad, dtype=torch.long, device=device)
        self.tokens[:, 0], self.tokens[:, 1] = bos, eos
        self.relations = torch.zeros(batch, capacity, capacity, dtype=torch.int8, device=device)
        self.relations[:, 0, 1], self.relations[:, 1, 0] = LEFT, RIGHT
        self.left_keys = torch.zeros(batch, capacity, dim, device=device, dtype=dtype)
        self.right_keys = torch.zeros(batch, capacity, dim, device=device, dtype=dtype)
        self.anchors = torch.full((batch, capacity), -1, dtype=torch.long, device=device)
        self.sides = torch.zeros(batch, capacity, dtype=torch.long, device=device)

    def current_relations(self) -> torch.Tensor:
        return self.relations[:, : self.length, : self.length]

    def positions(self) -> torch.Tensor:
        """Eq. 4 on the current partial sequence."""
        return absolute_positions_from_relative(self.current_relations())

    def store_keys(self, left: torch.Tensor, right: torch.Tensor) -> None:
        count = left.shape[1]
        self.left_keys[:, self.length - count : self.length] = left
        self.right_keys[:, self.length - count : self.length] = right

    def insert(self, tokens: torch.Tensor, anchors: torch.Tensor, sides: torch.Tensor) -> torch.Tensor:
        """Append one word per hypothesis next to ``anchors`` (Eq. 6, then Eq. 5); returns its relation row
        ``[b, 1, n+1]`` (the query row the decoder needs for the new token)."""
        n = self.length
        new_row = insertion_relative_position(self.current_relations(), anchors, sides)
        self.relations[:, n, :n] = new_row
        self.relations[:, :n, n] = -new_row
        self.tokens[:, n] = tokens
        self.anchors[:, n] = anchors
        self.sides[:, n] = sides
        self.length = n + 1
        return self.relations[:, n : n + 1, : n + 1]

    def reorder(self, index: torch.Tensor) -> None:
        for name in ("tokens", "relations", "left_keys", "right_keys", "anchors", "sides"):
            setattr(self, name, getattr(self, name).index_select(0, index))


class ReferencePointerCache:
    """The SAO search's pointer state (Eq. 9) for every hypothesis, split along Eq. 9's query ``h E + W[y]``.

    The search only ever points with the reference words ``y_m`` of a sentence, so the word part ``W[y_m]·k`` of a
    slot's logit is fixed once the key ``k`` exists: it is computed when the word is inserted (one product with the
    sentence's ``T`` reference embeddings, shared by its beams) and kept. A step then adds the state part
    ``(h E)·k`` — ``O(n·d)`` per hypothesis — to the kept ``[n, 2, T]`` word part, instead of scoring ``T`` full
    queries against ``n`` keys (``O(T·n·d)``).

    ``keys`` ``[rows, 2, capacity, d]`` (side 0: the left keys ``H C``, side 1: the right keys ``H D``) and
    ``word_logits`` ``[rows, 2, capacity, T]`` (fp32; the left slot of ``<s>`` and the right slot of ``</s>`` are
    ``-inf``, Eq. 9's mask), so the first ``n`` positions of both sides read as the module's slot layout
    ``[left of 0 .. n-1, right of 0 .. n-1]``. Rows are ``sentence * beams + beam``; :meth:`reorder` follows the
    beam selection.
    """

    def __init__(self, word_embeddings: torch.Tensor, beams: int, capacity: int, dtype: torch.dtype):
        batch, words, dim = word_embeddings.shape
        rows = batch * beams
        self.length = 0
        self._reference_embeddings = word_embeddings.to(dtype).transpose(1, 2)  # [batch, d, T]
        self.keys = torch.zeros(rows, 2, capacity, dim, dtype=dtype, device=word_embeddings.device)
        self.word_logits = torch.zeros(rows, 2, capacity, words, dtype=torch.float32, device=word_embeddings.device)
        self._spares = SpareBuffers()

    def append(self, left_keys: torch.Tensor, right_keys: torch.Tensor) -> None:
        """Store the keys of the words just inserted (``[rows, c, d]`` each) and their word part ``W[y_m]·k``."""
        start, count = self.length, left_keys.shape[1]
        end = start + count
        new_keys = torch.stack([left_keys, right_keys], dim=1).to(self.keys.dtype)  # [rows, 2, c, d]
        self.keys[:, :, start:end] = new_keys
        batch, dim, words = self._reference_embeddings.shape
        word_part = torch.bmm(new_keys.view(batch, -1, dim), self._reference_embeddings)  # [batch, beams·2·c, T]
        self.word_logits[:, :, start:end] = word_part.view(-1, 2, count, words)
        for side, position in ((0, 0), (1, 1)):  # left of <s>, right of </s>
            if start <= position < end:
                self.word_logits[:, side, position] = float("-inf")
        self.length = end

    def reorder(self, index: torch.Tensor) -> None:
        """Beam selection: row ``i`` becomes old row ``index[i]`` (the filled positions, into a spare pair)."""
        self.keys, self.word_logits = self._spares.reorder(self.keys, self.word_logits, index, self.length)

    def gap_log_probs(self, state_query: torch.Tensor, left_anchor: torch.Tensor, right_anchor: torch.Tensor):
        """Eq. 9 then Eq. 11 for every reference word m of every hypothesis: ``log(p(right of left_anchor[m]) +
        p(left of right_anchor[m]))`` under the query ``state_query + W[y_m]`` (``state_query`` = ``h E``
        ``[rows, d]``, anchors ``[rows, T]`` insertion indices) → ``[rows, T]``."""
        n = self.length
        rows = self.keys.shape[0]
        query = state_query.to(self.keys.dtype)[:, None, :, None].expand(-1, 2, -1, -1)  # [rows, 2, d, 1]
        state_part = torch.matmul(self.keys[:, :, :n], query).float()  # [rows, 2, n, 1]
        logits = (self.word_logits[:, :, :n] + state_part).view(rows, 2 * n, -1)  # slots × words: [rows, 2n, T]
        right_of_left = logits.gather(1, (left_anchor + n).unsqueeze(1))
        left_of_right = logits.gather(1, right_anchor.unsqueeze(1))
        return torch.logaddexp(right_of_left, left_of_right).squeeze(1) - logits.logsumexp(1)


class CapturedSearches:
    """The SAO search as CUDA graphs, one per input shape (``model.sao_search_cuda_graphs``).

    On a GPU the search is host dispatch: ~30 steps of ~1,000 small kernels each (≈ 0.35–0.4 s at batch 32 × 30,
    B = 8, paper size on an H100) for work the GPU finishes in a fraction of that. Its tensor shapes follow from the
    input shapes alone and it never reads a device value on the host, so the whole search is captured once per
    input shape into one graph and replayed: the inputs are copied into the graph's own buffers, the outputs cloned
    out. Replays read the parameters where they live (optimizer steps update them in place; the key holds their
    addresses, so moved or replaced parameters get a new graph) and draw fresh dropout noise (a graph advances the
    generator's offset). A shape's first call runs eagerly; its second runs the search twice more eagerly (warm-up)
    and captures it, so a shape seen once costs nothing extra; the ``max_graphs`` most recently used shapes keep
    their graphs, each with its own memory pool.
    """

    def __init__(self, max_graphs: int = 8, max_sightings: int = 256):
        self.max_graphs = max_graphs
        self.max_sightings = max_sightings
        self._graphs: "OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, tuple, tuple]]" = OrderedDict()
        self._sightings: "OrderedDict[tuple, None]" = OrderedDict()  # shapes run once, eagerly

    def __len__(self) -> int:
        return len(self._graphs)

    @staticmethod
    def key(model: nn.Module, inputs: tuple[torch.Tensor | None, ...], *settings) -> tuple:
        shapes = tuple(None if t is None else (t.shape, t.dtype, t.device) for t in inputs)
        autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        parameters = tuple(parameter.data_ptr() for parameter in model.parameters())
        return shapes, autocast, model.training, parameters, settings

    def run(self, key: tuple, search: Callable, inputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor, ...]:
        entry = self._graphs.get(key)
        if entry is None and key not in self._sightings:
            self._sightings[key] = None
            while len(self._sightings) > self.max_sightings:
                self._sightings.popitem(last=False)
            return search(*inputs)
        enabled, dtype = key[1]
        # Autocast's weight-cast cache must not hand casts made outside the graph to the capture (stale on replay).
        with torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False):
            if entry is None:
                self._sightings.pop(key)
                entry = self._capture(search, inputs)
                self._graphs[key] = entry
                while len(self._graphs) > self.max_graphs:
                    self._graphs.popitem(last=False)
            self._graphs.move_to_end(key)
            graph, static_inputs, static_outputs = entry
            for static, given in zip(static_inputs, inputs):
                if static is not None:
                    static.copy_(given)
            graph.replay()
            return tuple(output.clone() for output in static_outputs)

    @staticmethod
    def _capture(search: Callable, inputs: tuple[torch.Tensor | None, ...]):
        static_inputs = tuple(None if t is None else t.detach().clone() for t in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the main stream, as capture requires: lazy state, workspaces
            for _ in range(2):
                search(*static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_outputs = search(*static_inputs)
        return graph, static_inputs, static_outputs


# A model's captured searches, outside the module (never saved, copied or pickled with it).
_CAPTURED_SEARCHES: "weakref.WeakKeyDictionary[nn.Module, CapturedSearches]" = weakref.WeakKeyDictionary()
