"""InDIGO's Searched Adaptive Order (SAO, Sec. 4.2): a beam search over the permutations of each reference for the
generation orders that maximise Eq. 2, which the model then trains on (Eq. 14 weighs them).

All ``batch × beam`` hypotheses advance together, one cached decoder call per step; on a GPU the whole search can be
replayed as a captured CUDA graph (``CapturedSearches``).
"""

from __future__ import annotations

import torch

from .cpu_kernels import project
from .indigo_insertion import relative_positions_from_absolute
from .indigo_search_state import _CAPTURED_SEARCHES, CapturedSearches, ReferencePointerCache
from .kv_caches import SourceGroupedCache, new_decoder_cache


class SearchedAdaptiveOrder:
    """SAO for ``InDIGOForConditionalGeneration``: the search itself, on the model's decoder, word and pointer heads."""

    @torch.no_grad()
    def search_adaptive_orders(
        self,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        target_ids: torch.Tensor,
        target_lengths: torch.Tensor,
        beam_size: int = 8,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """SAO: beam search over the permutations of each reference for the orders maximising Eq. 2.

        All ``batch × beam`` hypotheses advance together, one cached decoder call per step. At each step every
        remaining reference word m of every hypothesis is scored by ``log p(y_m) + log(p_left + p_right)`` of its
        (unique) correct gap (Eq. 9's word part kept per key: :class:`ReferencePointerCache`), and the best
        ``beam_size`` continuations per sentence are kept; ``<eod>`` is scored once all words are placed. Dropout
        stays as the model's mode has it when ``self.sao_search_dropout`` (the paper's noise, Sec. 4.2), else the
        search runs in eval mode.

        Returns ``orders`` ``[b, beam, T]`` (reading indices in generation order; beams sorted by score) and
        ``scores`` ``[b, beam]`` = log-likelihood of each order; ``-inf`` marks a beam for which fewer distinct
        orders than ``beam_size`` exist (it repeats the best order).
        """
        if beam_size < 1:
            raise ValueError(f"sao beam_size must be >= 1, got {beam_size}")
        was_training = self.training
        if not self.sao_search_dropout:
            self.eval()
        try:
            target_lengths = target_lengths.to(target_ids.device)
            inputs = (encoder_hidden_states, attention_mask, target_ids, target_lengths)
            if self._search_as_cuda_graph(encoder_hidden_states):
                graphs = _CAPTURED_SEARCHES.setdefault(self, CapturedSearches())
                key = graphs.key(self, inputs, beam_size)
                return graphs.run(key, lambda *args: self._search_adaptive_orders(*args, beam_size), inputs)
            return self._search_adaptive_orders(*inputs, beam_size)
        finally:
            self.train(was_training)

    def _search_as_cuda_graph(self, encoder_hidden_states: torch.Tensor) -> bool:
        return (
            self.sao_search_cuda_graphs
            and encoder_hidden_states.is_cuda
            and not torch.cuda.is_current_stream_capturing()
            and not torch.compiler.is_compiling()
        )

    def _reference_word_log_probs(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 8's log-probabilities of the reference words ``targets`` ``[rows, T]`` and of ``<eod>`` at ``hidden``
        ``[rows, d]`` — the only words the SAO search scores. No ``[rows, V]`` log-softmax: the logits are shifted,
        gathered and exponentiated in place, so the step allocates one vocabulary-sized tensor instead of two.
        Same values as ``log_softmax`` gathered, up to rounding."""
        logits = self.word_logits(hidden).float()  # a fresh tensor: ours to overwrite
        logits.sub_(logits.amax(-1, keepdim=True))
        words = logits.gather(1, targets)
        eod = logits[:, self.config.eod_token_id].clone()
        normaliser = logits.exp_().sum(-1).log_()
        return words - normaliser[:, None], eod - normaliser

    def _search_adaptive_orders(self, encoder_hidden_states, attention_mask, target_ids, target_lengths, beam_size):
        config = self.config
        batch, max_len = target_ids.shape
        device = target_ids.device
        beams = beam_size
        rows = batch * beams
        encoder_states = encoder_hidden_states.repeat_interleave(beams, 0)
        encoder_mask = attention_mask.repeat_interleave(beams, 0) if attention_mask is not None else None
        targets = target_ids.repeat_interleave(beams, 0)
        lengths = target_lengths.repeat_interleave(beams, 0).to(device)
        steps = torch.arange(max_len, device=device)
        in_target = steps[None, :] < lengths[:, None]
        placed = ~in_target.clone()  # padding counts as placed: never a candidate
        # Reference positions 0..T+1 (0 = <s>, m+1 = word m, len+1 = </s>) → insertion index, -1 if not placed.
        ref_width = max_len + 2
        ref_index = torch.full((rows, ref_width), -1, dtype=torch.long, device=device)
        ref_index[:, 0] = 0
        ref_index.scatter_(1, (lengths + 1)[:, None], 1)
        ref_of_insertion = torch.zeros(rows, max_len + 2, dtype=torch.long, device=device)
        ref_of_insertion[:, 1] = lengths + 1
        orders = torch.zeros(rows, max_len, dtype=torch.long, device=device)
        scores = torch.full((rows,), float("-inf"), device=device)
        scores[::beams] = 0.0
        finished_scores = torch.zeros(rows, device=device)
        valid_beam = torch.ones(rows, dtype=torch.bool, device=device)

        # <s> </s> are the same for the B beams of a sentence (and only the first beam is alive before step 0):
        # decode them once per sentence, then give every beam those cache rows. Beams move within their sentence
        # only, so the cross-attention keys/values stay one copy per sentence (SourceGroupedCache).
        first = new_decoder_cache(config)
        start = torch.full((batch, 2), config.bos_token_id, dtype=torch.long, device=device)  # no host copy
        start[:, 1] = config.eos_token_id
        start_relations = relative_positions_from_absolute(ref_of_insertion[::beams, :2])
        hidden, first = self._decoder_states(start, start_relations, encoder_hidden_states, attention_mask, first, True)
        first.self_attention_cache.batch_repeat_interleave(beams)
        cache = SourceGroupedCache(first.self_attention_cache, first.cross_attention_cache, beams)
        # Eq. 9's word part W[y] of every candidate's pointer query: the references are fixed, so it is scored
        # once per key (ReferencePointerCache)
        pointer = ReferencePointerCache(self.get_decoder().embed_tokens(target_ids), beams, max_len + 2, hidden.dtype)
        pointer.append(*(keys.repeat_interleave(beams, 0) for keys in self.pointer_keys(hidden)))
        last = hidden[:, -1].repeat_interleave(beams, 0)
        batch_offsets = torch.arange(batch, device=device).repeat_interleave(beams) * beams
        ref_positions = torch.arange(ref_width, device=device)

        for step in range(max_len + 1):
            candidate_word, eod_log_prob = self._reference_word_log_probs(last, targets)  # [rows, T], [rows]
            # Sentences whose words are all placed just now: add log p(<eod>) (Eq. 2) once.
            completing = lengths == step
            finished_scores = torch.where(completing, scores + eod_log_prob, finished_scores)
            if step == max_len:
                break
            active = lengths > step
            n = step + 2
            # Correct gap of word m: right of its nearest placed left neighbour / left of the nearest right one.
            is_placed_ref = ref_index >= 0
            left_ref = torch.where(is_placed_ref, ref_positions, -1).cummax(-1).values[:, :-2]  # for ref m+1 → [:, m]
            right_ref = torch.where(is_placed_ref, ref_positions, ref_width).flip(-1).cummin(-1).values.flip(-1)[:, 2:]
            left_ref = left_ref.clamp(min=0)
            right_ref = right_ref.clamp(max=ref_width - 1)
            left_neighbor = ref_index.gather(1, left_ref).clamp(min=0)
            right_neighbor = ref_index.gather(1, right_ref).clamp(min=0)
            position = pointer.gap_log_probs(project(self.pointer_query_proj, last), left_neighbor, right_neighbor)  # [rows, T]
            candidate = scores[:, None] + candidate_word + position
            candidate = candidate.masked_fill(placed, float("-inf"))
            flat = candidate.view(batch, beams * max_len)
            top_scores, top_index = flat.topk(beams, dim=-1)  # [batch, beams]
            # Sentences with fewer continuations than beams: repeat the best one, flagged invalid.
            invalid = ~torch.isfinite(top_scores)
            top_index = torch.where(invalid, top_index[:, :1], top_index)
            origin = (top_index // max_len).reshape(-1) + batch_offsets
            chosen = (top_index % max_len).reshape(-1)
            new_scores = top_scores.reshape(-1)
            # Finished sentences keep their beams untouched and feed a padding token.
            origin = torch.where(active, origin, torch.arange(rows, device=device))
            new_scores = torch.where(active, new_scores, scores)
            cache.reorder_cache(origin)
            placed, ref_index, ref_of_insertion, orders = (
                placed[origin], ref_index[origin], ref_of_insertion[origin], orders[origin]
            )
            pointer.reorder(origin)
            finished_scores = finished_scores[origin]
            valid_beam = valid_beam[origin] & torch.where(active, ~invalid.reshape(-1), True)
            scores = new_scores
            placed = placed.clone()
            placed[torch.arange(rows, device=device), chosen] |= active
            orders[:, step] = torch.where(active, chosen, orders[:, step])
            ref_of_insertion[:, n] = torch.where(active, chosen + 1, lengths + 2 + step)
            chosen_ref = (chosen + 1)[:, None]
            ref_index.scatter_(1, chosen_ref, torch.where(active[:, None], n, ref_index.gather(1, chosen_ref)))
            tokens = torch.where(active, targets.gather(1, chosen[:, None]).squeeze(1), config.pad_token_id)
            new_relations = relative_positions_from_absolute(ref_of_insertion[:, : n + 1])[:, n : n + 1]
            hidden, cache = self._decoder_states(tokens[:, None], new_relations, encoder_states, encoder_mask, cache, True)
            pointer.append(*self.pointer_keys(hidden))
            last = hidden[:, -1]

        final = finished_scores.masked_fill(~valid_beam, float("-inf")).view(batch, beams)
        ranking = final.argsort(dim=-1, descending=True)
        orders = orders.view(batch, beams, max_len).gather(1, ranking[..., None].expand(-1, -1, max_len))
        return orders, final.gather(1, ranking)
