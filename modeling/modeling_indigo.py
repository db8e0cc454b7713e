"""InDIGO: insertion-based decoding with inferred generation order (Gu, Liu & Cho, TACL 2019).

A Transformer whose decoder generates a sequence by insertions. Every step predicts a word (Eq. 8) and then
where to insert it (a pointer over the left/right slots of the words generated so far, Eq. 9). The decoder has no
absolute positions: its self-attention sees the ternary relative position of every pair of words (Eq. 3, 7),
and because these relations never change once created (Eq. 5), earlier hidden states and the KV cache are
reused at every step exactly as in a left-to-right Transformer.

Conventions used throughout this file
-------------------------------------
* An *insertion sequence* lists tokens in generation order: index 0 is ``<s>`` (left boundary), index 1 is
  ``</s>`` (right boundary), index ``n >= 2`` the ``(n-1)``-th generated word; ``<eod>`` ends decoding (Eq. 2)
  and is never an input.
* ``relative_positions[..., i, j]`` is ``r_{i,j}`` of Eq. 3: ``-1`` if word i is left of word j, ``+1`` if it
  is right of it, ``0`` on the diagonal (int8 in memory).
* Pointer slots over ``n`` words are laid out ``[left of word 0 .. left of word n-1, right of word 0 .. right of
  word n-1]`` — index ``k`` of Eq. 9. The left slot of ``<s>`` and the right slot of ``</s>`` are masked.
* A *gap* ``g`` (``1 <= g <= n-1``) is the place between the words at reading positions ``g-1`` and ``g``; it
  has two equivalent slots (right of the one, left of the other) whose probabilities add up (Eq. 11).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers.generation import GenerationConfig, LogitsProcessorList
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput
from transformers.utils import ModelOutput

from flexformers.configuration.configuration_indigo import InDIGOConfig

from .cpu_kernels import PrepackedLinear
from .generation_hooks import check_generate_arguments
from .indigo_insertion import (
    LEFT,
    RIGHT,
    absolute_positions_from_relative,
    build_insertion_batch,
    gap_log_probs,
    reading_order_from_positions,
    relative_positions_from_absolute,
    sao_order_weights,
)
from .indigo_search_state import (
    _CAPTURED_SEARCHES,
    CapturedSearches,
    InsertionState,
    ReferencePointerCache,
)
from .kv_caches import SourceGroupedCache, new_decoder_cache
from .modeling_flexformer import (
    BackboneComponents,
    FlexformerAttention,
    FlexformerForConditionalGeneration,
    FlexformerModel,
)
from .transformers_compat import accepts_cache_argument, cache_field, output_cache

# --------------------------------------------------------------------------------------------------------------------
# Relative-position self-attention (Eq. 7)
# --------------------------------------------------------------------------------------------------------------------


class InDIGOSelfAttention(FlexformerAttention):
    """Decoder self-attention with the ternary relative-position key bias of Eq. 7.

    ``e_{i,j} = u_i Q (u_j K + A[r_{i,j} + 1])ᵀ / √d``: the extra term is the query dotted with one of three
    learned vectors (``relation_embedding``, A ∈ R^{3×d}, split over heads like the keys), chosen by the relation
    of i to j. Computed as the author's code does: project each head's query onto the three vectors (3 logits) and
    gather by ``r + 1`` — no ``[q, k, d]`` tensor is built. Needs the keyword argument ``relative_positions``
    (``[b, q, k]`` rows of R for the current queries), which the decoder forwards to every layer.
    """

    def __init__(self, config, embed_dim, num_heads, **kwargs):
        super().__init__(config, embed_dim, num_heads, **kwargs)
        self.relation_embedding = nn.Embedding(3, embed_dim)

    def relative_position_bias(self, query_states, rows=None, relative_positions=None, **kwargs):
        """Eq. 7's ``u_i Q A[r_{i,j}+1]ᵀ / √d`` as an additive ``[b, heads, q, k]`` logit bias."""
        if relative_positions is None:
            raise ValueError("InDIGO's decoder self-attention needs relative_positions ([batch, queries, keys])")
        if rows is not None and relative_positions.shape[0] != 1:
            relative_positions = relative_positions.index_select(0, rows)
        batch, heads, q_len, head_dim = query_states.shape
        relation_keys = self.relation_embedding.weight.view(3, self.total_heads, self.head_dim).to(query_states.dtype)
        relation_logits = torch.einsum("bhqd,rhd->bhqr", query_states * self.scaling, relation_keys)
        index = (relative_positions[:, -q_len:, :].long() + 1).unsqueeze(1).expand(batch, heads, q_len, -1)
        return relation_logits.gather(-1, index)


# --------------------------------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class InDIGOSeq2SeqOutput(Seq2SeqLMOutput):
    """Teacher-forced InDIGO forward: ``loss`` = word + position loss (Eq. 10, 11) per target token; the standard
    sequence-to-sequence fields (the cache under the running Transformers' name), then InDIGO's own."""

    pointer_logits: torch.Tensor | None = None
    word_loss: torch.Tensor | None = None
    position_loss: torch.Tensor | None = None
    searched_orders: torch.Tensor | None = None
    searched_scores: torch.Tensor | None = None


@dataclass
class InDIGOGenerateOutput(ModelOutput):
    """``generate(..., return_dict_in_generate=True)``.

    ``sequences`` are in reading order (``<s> w_1 .. w_n </s>`` then padding); ``insertion_ids`` the same tokens in
    generation order (``<s> </s>`` first, no ``<eod>``); ``insertion_trace`` per sequence a list of steps
    ``(token_id, anchor, side, position)``: the word, the insertion index of the word it went next to, ``"left"`` /
    ``"right"`` and its absolute position right after the insertion.
    """

    sequences: torch.LongTensor | None = None
    sequences_scores: torch.Tensor | None = None
    scores: tuple | None = None
    insertion_ids: torch.LongTensor | None = None
    relative_positions: torch.Tensor | None = None
    insertion_trace: list | None = None


# --------------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------------


INDIGO_COMPONENTS = BackboneComponents(decoder_self_attention=InDIGOSelfAttention)


class InDIGOModel(FlexformerModel):
    """Encoder + InDIGO decoder (relative-position self-attention, no absolute decoder positions), no heads."""

    config_class = InDIGOConfig
    components = INDIGO_COMPONENTS


class InDIGOForConditionalGeneration(FlexformerForConditionalGeneration):
    """Transformer-InDIGO (Sec. 4): the flexformers backbone with relative-position decoder self-attention and no
    absolute decoder positions, word prediction (Eq. 8) then pointer prediction (Eq. 9), the word + position loss
    (Eq. 10, 11) for pre-defined orders and for searched adaptive orders (SAO, Eq. 12), and insertion decoding
    (Algorithm 1: greedy, sampling, the two-step beam search of Sec. 4.3) in ``generate()``.
    """

    _can_compile_fullgraph = False  # insertion decoding runs its own loop (`generate`), not a static-cache step

    config_class = InDIGOConfig
    base_model_class = InDIGOModel
    components = INDIGO_COMPONENTS

    def __init__(self, config: InDIGOConfig):
        super().__init__(config)
        dim = config.decoder_embed_dim
        self.word_query_proj = PrepackedLinear(dim, dim, bias=False) if config.word_query_projection else None  # F
        self.pointer_query_proj = PrepackedLinear(dim, dim, bias=False)  # E
        self.pointer_left_proj = PrepackedLinear(dim, dim, bias=False)  # C
        self.pointer_right_proj = PrepackedLinear(dim, dim, bias=False)  # D
        # Training-time switches set by the training method (not saved): searched orders instead of the
        # collator's pre-defined ones (after bootstrapping), SAO beam width, dropout during the search,
        # how many of the found orders to train on (None = all B, Eq. 12) and how to weight them (see
        # sao_order_weights).
        self.use_searched_orders = False
        self.sao_beam_size = 8
        self.sao_search_dropout = True
        self.sao_train_orders: int | None = None
        self.sao_order_weighting = "uniform"
        self.sao_search_cuda_graphs = False  # replay the search as CUDA graphs on a GPU (CapturedSearches)
        self.post_init()

    # ---- prediction heads ------------------------------------------------------------------------------------
    def word_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Eq. 8: ``softmax((h F) Wᵀ)`` logits."""
        if self.word_query_proj is not None:
            hidden_states = self.word_query_proj(hidden_states)
        return self.lm_head(hidden_states)

    def pointer_keys(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 9's left and right keys ``H C`` and ``H D``."""
        return self.pointer_left_proj(hidden_states), self.pointer_right_proj(hidden_states)

    def pointer_query(self, hidden_states: torch.Tensor, word_ids: torch.Tensor) -> torch.Tensor:
        """Eq. 9's query ``h E + W[y]`` (W: the decoder's token embedding, unscaled)."""
        return self.pointer_query_proj(hidden_states) + self.get_decoder().embed_tokens(word_ids)

    def slot_log_probs(self, query: torch.Tensor, left_keys: torch.Tensor, right_keys: torch.Tensor) -> torch.Tensor:
        """Eq. 9 over all ``2n`` slots of ``n`` words in incremental decoding; query ``[b, c, d]``, keys ``[b, n, d]``
        → ``[b, c, 2n]`` log-probabilities with left of ``<s>`` and right of ``</s>`` masked."""
        logits = torch.cat([query @ left_keys.transpose(1, 2), query @ right_keys.transpose(1, 2)], dim=-1)
        return self._normalised_slots(logits)

    @staticmethod
    def _normalised_slots(logits: torch.Tensor) -> torch.Tensor:
        """Log-softmax over the ``2n`` slots with left of ``<s>`` (slot 0) and right of ``</s>`` (slot n+1) masked."""
        n = logits.shape[-1] // 2
        logits = logits.float()
        logits[..., 0] = float("-inf")
        logits[..., n + 1] = float("-inf")
        return logits.log_softmax(-1)

    # ---- teacher-forced forward -------------------------------------------------------------------------------
    def _decoder_states(self, decoder_input_ids, relative_positions, encoder_hidden_states, attention_mask,
                        past_key_values=None, use_cache=False):
        outputs = self.model.decoder(
            input_ids=decoder_input_ids,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=attention_mask,
            past_key_values=past_key_values,
            use_cache=use_cache,
            relative_positions=relative_positions,
        )
        return outputs.last_hidden_state, output_cache(outputs)

    def _encode(self, input_ids, attention_mask, encoder_outputs=None):
        if encoder_outputs is None:
            encoder_outputs = self.model.encoder(input_ids=input_ids, attention_mask=attention_mask)
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(last_hidden_state=encoder_outputs[0])
        return encoder_outputs

    def insertion_losses(
        self,
        hidden_states: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        insertion_labels: torch.Tensor,
        pointer_labels: torch.Tensor,
        epsilon: float,
        return_logits: bool = False,
    ):
        """Summed word loss (Eq. 8 targets, label-smoothed with ε) and position loss ``-log(p_kl + p_kr)`` (Eq. 11)
        over all insertions, per sequence: returns ``(word_loss [b], word_nll [b], position_nll [b], logits,
        pointer_log_probs)``."""
        batch, length, _ = hidden_states.shape
        logits = self.word_logits(hidden_states)
        log_probs = logits.float().log_softmax(-1)
        word_mask = insertion_labels.ne(-100)
        safe_labels = insertion_labels.masked_fill(~word_mask, 0)
        word_nll = -log_probs.gather(-1, safe_labels[..., None]).squeeze(-1).masked_fill(~word_mask, 0.0)
        word_loss = word_nll.sum(-1)
        if epsilon > 0:
            eps_i = epsilon / (log_probs.shape[-1] - 1)
            smooth = -log_probs.sum(-1).masked_fill(~word_mask, 0.0).sum(-1)
            word_loss = (1.0 - epsilon - eps_i) * word_loss + eps_i * smooth
        # Pointer over [left keys | right keys] of all L positions; a query at i sees words 0..i (causal).
        pointer_mask = pointer_labels[..., 0].ne(-100)
        query = self.pointer_query(hidden_states, safe_labels)
        left_keys, right_keys = self.pointer_keys(hidden_states)
        pointer_logits = torch.cat([query @ left_keys.transpose(1, 2), query @ right_keys.transpose(1, 2)], -1).float()
        index = torch.arange(length, device=hidden_states.device)
        visible = index[None, :] <= index[:, None]
        visible_left = visible & (index[None, :] != 0)
        visible_right = visible & (index[None, :] != 1)
        allowed = torch.cat([visible_left, visible_right], dim=-1)
        pointer_logits = pointer_logits.masked_fill(~allowed[None], float("-inf"))
        pointer_log_probs = pointer_logits.log_softmax(-1).masked_fill(~pointer_mask[..., None], 0.0)
        safe_pointer = pointer_labels.masked_fill(~pointer_mask[..., None], 0)
        right_of_left = pointer_log_probs.gather(-1, (safe_pointer[..., :1] + length))
        left_of_right = pointer_log_probs.gather(-1, safe_pointer[..., 1:])
        position_nll = -torch.logaddexp(right_of_left, left_of_right).squeeze(-1).masked_fill(~pointer_mask, 0.0)
        return (
            word_loss,
            word_nll.sum(-1),
            position_nll.sum(-1),
            logits if return_logits else None,
            pointer_log_probs if return_logits else None,
        )

    @accepts_cache_argument
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        relative_positions: torch.Tensor | None = None,
        insertion_labels: torch.LongTensor | None = None,
        pointer_labels: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        target_ids: torch.LongTensor | None = None,
        target_lengths: torch.LongTensor | None = None,
        encoder_outputs=None,
        past_key_values=None,
        use_cache: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> InDIGOSeq2SeqOutput:
        """Teacher-forced InDIGO.

        - With ``decoder_input_ids`` + ``relative_positions`` (+ ``insertion_labels`` and ``pointer_labels`` for the
          loss), from :func:`build_insertion_batch` / the collator: the given order.
        - With only ``labels`` (reading order, ending in ``</s>``, -100 padding): the L2R order.
        - With ``target_ids``/``target_lengths`` and ``model.use_searched_orders``: SAO (Sec. 4.2) — beam search over
          permutations (``model.sao_beam_size``), then the loss averaged over the found orders (Eq. 12).
        The loss is (word loss + position loss) / number of target tokens (``num_items_in_batch`` when given).
        """
        for key in ("cache_position", "position_ids", "decoder_position_ids", "output_attentions",
                    "output_hidden_states"):
            kwargs.pop(key, None)
        if kwargs:
            raise ValueError(f"InDIGOForConditionalGeneration.forward got unexpected arguments {sorted(kwargs)}")
        if attention_mask is None and input_ids is not None:
            attention_mask = input_ids.ne(self.config.pad_token_id).long()
        encoder_outputs = self._encode(input_ids, attention_mask, encoder_outputs)
        encoder_states = encoder_outputs.last_hidden_state

        searched_orders = searched_scores = None
        order_weights = None
        if target_ids is not None and self.use_searched_orders:
            searched_orders, searched_scores = self.search_adaptive_orders(
                encoder_states, attention_mask, target_ids, target_lengths, beam_size=self.sao_beam_size
            )
            beams = searched_orders.shape[1]
            keep = beams if self.sao_train_orders is None else min(self.sao_train_orders, beams)
            orders = searched_orders[:, :keep].reshape(-1, target_ids.shape[1])
            order_weights = sao_order_weights(searched_scores[:, :keep], self.sao_order_weighting).reshape(-1)
            batch = build_insertion_batch(
                target_ids.repeat_interleave(keep, 0), target_lengths.repeat_interleave(keep, 0), orders,
                **self._special_ids(),
            )
            decoder_input_ids = batch["decoder_input_ids"]
            relative_positions = batch["relative_positions"]
            insertion_labels, pointer_labels = batch["insertion_labels"], batch["pointer_labels"]
            encoder_states = encoder_states.repeat_interleave(keep, 0)
            attention_mask = attention_mask.repeat_interleave(keep, 0)
        elif decoder_input_ids is None:
            if target_ids is None and labels is None:
                raise ValueError("InDIGO's forward needs decoder_input_ids + relative_positions, labels or target_ids")
            if target_ids is None:
                target_ids, target_lengths = self._targets_from_labels(labels)
            orders = torch.arange(target_ids.shape[1], device=target_ids.device).expand_as(target_ids).contiguous()
            batch = build_insertion_batch(target_ids, target_lengths, orders, **self._special_ids())
            decoder_input_ids = batch["decoder_input_ids"]
            relative_positions = batch["relative_positions"]
            insertion_labels, pointer_labels = batch["insertion_labels"], batch["pointer_labels"]
        if relative_positions is None:
            raise ValueError("InDIGO's forward needs relative_positions with decoder_input_ids (see build_insertion_batch)")

        hidden_states, cache = self._decoder_states(
            decoder_input_ids, relative_positions, encoder_states, attention_mask,
            past_key_values=past_key_values, use_cache=bool(use_cache) and insertion_labels is None,
        )
        loss = word_part = position_part = logits = pointer_log_probs = None
        if insertion_labels is not None:
            if pointer_labels is None:
                raise ValueError("insertion_labels need pointer_labels (see build_insertion_batch)")
            word_loss, _, position_nll, logits, pointer_log_probs = self.insertion_losses(
                hidden_states, decoder_input_ids, insertion_labels, pointer_labels, self.config.label_smoothing,
                return_logits=not self.training,
            )
            weights = order_weights if order_weights is not None else torch.ones_like(word_loss)
            if num_items_in_batch is None:
                denominator = insertion_labels.ne(-100).float().sum(-1).mul(weights).sum().clamp(min=1)
            else:
                denominator = num_items_in_batch
            if isinstance(denominator, torch.Tensor):
                denominator = denominator.to(word_loss.device)
            word_part = (word_loss * weights).sum() / denominator
            position_part = (position_nll * weights).sum() / denominator
            loss = word_part + position_part
        else:
            logits = self.word_logits(hidden_states)
        return InDIGOSeq2SeqOutput(
            loss=loss,
            logits=logits,
            pointer_logits=pointer_log_probs,
            word_loss=word_part,
            position_loss=position_part,
            **cache_field(cache),
            decoder_hidden_states=(hidden_states,),
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            searched_orders=searched_orders,
            searched_scores=searched_scores,
        )

    def _special_ids(self) -> dict[str, int]:
        config = self.config
        return {
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id,
            "eod_token_id": config.eod_token_id,
            "pad_token_id": config.pad_token_id,
        }

    def _targets_from_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reading-order labels (``w_1 .. w_n </s>``, -100/pad padding) → words ``[b, T]`` and lengths ``[b]``."""
        pad, eos = self.config.pad_token_id, self.config.eos_token_id
        is_word = labels.ne(-100) & labels.ne(pad) & labels.ne(eos)
        lengths = is_word.sum(-1)
        order = torch.sort((~is_word).long(), dim=-1, stable=True).indices
        words = labels.gather(1, order).masked_fill(
            torch.arange(labels.shape[1], device=labels.device)[None] >= lengths[:, None], pad
        )
        width = max(int(lengths.max()), 1) if labels.numel() else 1
        return words[:, :width], lengths

    @torch.no_grad()
    def sequence_log_likelihood(self, input_ids, attention_mask, target_ids, target_lengths, orders) -> torch.Tensor:
        """``log p_θ(y_π | x)`` (Eq. 2: word log-probs incl. ``<eod>`` + position log-probs of Eq. 11) for each
        row's order, teacher-forced (no label smoothing). ``orders`` ``[b, T]``."""
        encoder_states = self._encode(input_ids, attention_mask).last_hidden_state
        batch = build_insertion_batch(target_ids, target_lengths, orders, **self._special_ids())
        hidden_states, _ = self._decoder_states(
            batch["decoder_input_ids"], batch["relative_positions"], encoder_states, attention_mask
        )
        _, word_nll, position_nll, _, _ = self.insertion_losses(
            hidden_states, batch["decoder_input_ids"], batch["insertion_labels"], batch["pointer_labels"], 0.0
        )
        return -(word_nll + position_nll)

    # ---- Searched Adaptive Order (Sec. 4.2) ------------------------------------------------------------------
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
            position = pointer.gap_log_probs(self.pointer_query_proj(last), left_neighbor, right_neighbor)  # [rows, T]
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

    # ---- Insertion decoding (Algorithm 1, Sec. 4.3) ------------------------------------------------------------
    def _decoding_word_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Eq. 8 logits for decoding; ``<s>``, ``</s>`` and ``<pad>`` are never inserted (training never predicts
        them), so they are masked."""
        logits = self.word_logits(last_hidden).float()
        config = self.config
        logits[:, [config.bos_token_id, config.eos_token_id, config.pad_token_id]] = float("-inf")
        return logits

    def _decode_step(self, tokens, relation_rows, encoder_states, encoder_mask, cache, state: InsertionState):
        hidden, cache = self._decoder_states(tokens, relation_rows, encoder_states, encoder_mask, cache, True)
        left, right = self.pointer_keys(hidden)
        state.store_keys(left, right)
        return hidden[:, -1], cache

    def _position_log_probs(self, query, state: InsertionState):
        """Log-probabilities of inserting at each gap (``[b, c, n-1]``, Eq. 11) and, per gap, the slot (anchor,
        side) that realises it: right of the word at reading position g-1."""
        n = state.length
        slot = self.slot_log_probs(query, state.left_keys[:, :n], state.right_keys[:, :n])
        reading = reading_order_from_positions(state.positions())
        reading_c = reading[:, None, :].expand(-1, slot.shape[1], -1)
        if self.config.pointer_decision == "position":
            gaps = gap_log_probs(slot, reading_c)
        else:
            # Algorithm 1 verbatim: the best single slot decides; score the gap by that slot's probability.
            gaps = torch.maximum(
                slot[..., n:].gather(-1, reading_c[..., :-1]), slot[..., :n].gather(-1, reading_c[..., 1:])
            )
        return gaps, reading

    def _prepare_generation(self, input_ids, attention_mask, generation_config, kwargs):
        for key in ("labels", "insertion_labels", "pointer_labels", "relative_positions", "decoder_input_ids",
                    "decoder_attention_mask", "target_ids", "target_lengths", "synced_gpus", "streamer",
                    "num_items_in_batch"):
            kwargs.pop(key, None)
        encoder_outputs = kwargs.pop("encoder_outputs", None)
        generation_config, model_kwargs = self._prepare_generation_config(generation_config, **kwargs)
        unknown = sorted(k for k in model_kwargs if k not in ("use_cache", "output_attentions", "output_hidden_states"))
        if unknown:
            raise ValueError(f"InDIGO generate() got unexpected arguments {unknown}")
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"InDIGO generate() keeps its own insertion-decoding state (pointer keys, relative positions that "
                f"change as words are inserted); cache_implementation={generation_config.cache_implementation!r} "
                "is not supported"
            )
        if input_ids is None and encoder_outputs is None:
            raise ValueError("generate() needs input_ids (or encoder_outputs)")
        if attention_mask is None and input_ids is not None:
            attention_mask = input_ids.ne(self.config.pad_token_id).long()
        return generation_config, encoder_outputs, attention_mask

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        return_insertion_trace: bool = False,
        **kwargs,
    ):
        """Algorithm 1 with greedy decoding, sampling (``do_sample``) or the two-step beam search of Sec. 4.3
        (``num_beams > 1``: top-B words per hypothesis, then every position for each, keep the best B; scores
        normalised by ``length ** length_penalty``).

        Honours ``max_new_tokens`` (insertions, ``<eod>`` included; default ``max_length - 2``),
        ``num_beams``, ``num_return_sequences``, ``do_sample``/``temperature``/``top_k``/``top_p`` and other logits
        processors (applied to the word distribution; ``<eod>`` plays the EOS role for e.g. ``min_new_tokens``),
        ``length_penalty``, ``early_stopping``, ``output_scores`` and ``return_dict_in_generate``. Returns the
        sequences in reading order (``<s> … </s>``, padded), or an :class:`InDIGOGenerateOutput`; with
        ``return_insertion_trace=True`` the output is always the dataclass with ``insertion_trace`` filled in.
        """
        check_generate_arguments(self, input_ids, generation_config, kwargs)
        generation_config, encoder_outputs, attention_mask = self._prepare_generation(
            input_ids, attention_mask, generation_config, kwargs
        )
        config = self.config
        generation_config.eos_token_id = config.eod_token_id
        generation_config.forced_eos_token_id = None
        generation_config.forced_bos_token_id = None
        if generation_config.max_new_tokens is not None:
            max_steps = generation_config.max_new_tokens
        else:
            max_steps = max(generation_config.max_length - 2, 1)
        max_steps = min(max_steps, config.max_target_positions)
        num_beams = generation_config.num_beams or 1
        num_return = generation_config.num_return_sequences or 1
        if num_beams > 1 and generation_config.do_sample:
            raise ValueError("InDIGO generate(): beam sampling (num_beams > 1 with do_sample=True) is not implemented")
        if num_return > num_beams and not generation_config.do_sample:
            raise ValueError(
                f"num_return_sequences={num_return} needs do_sample=True or num_beams >= {num_return} (got {num_beams})"
            )
        encoder_states = self._encode(input_ids, attention_mask, encoder_outputs).last_hidden_state
        self._prepare_special_tokens(generation_config, True, device=encoder_states.device)
        processors = self._get_logits_processor(
            generation_config=generation_config,
            input_ids_seq_length=2,
            encoder_input_ids=input_ids,
            logits_processor=logits_processor,
            device=encoder_states.device,
        )
        with_trace = return_insertion_trace or bool(generation_config.return_dict_in_generate)
        if num_beams > 1:
            result = self._beam_search(encoder_states, attention_mask, generation_config, processors, max_steps,
                                       with_trace)
        else:
            if num_return > 1:
                encoder_states = encoder_states.repeat_interleave(num_return, 0)
                attention_mask = attention_mask.repeat_interleave(num_return, 0) if attention_mask is not None else None
            result = self._greedy_or_sample(encoder_states, attention_mask, generation_config, processors, max_steps,
                                            with_trace)
        if return_insertion_trace or generation_config.return_dict_in_generate:
            return result
        return result.sequences

    def _new_state(self, rows, max_steps, encoder_states) -> InsertionState:
        config = self.config
        return InsertionState(
            rows, max_steps + 2, config.decoder_embed_dim, encoder_states.device, encoder_states.dtype,
            config.bos_token_id, config.eos_token_id, config.pad_token_id,
        )

    def _start(self, state, encoder_states, encoder_mask):
        cache = new_decoder_cache(self.config)
        last, cache = self._decode_step(
            state.tokens[:, :2], state.current_relations(), encoder_states, encoder_mask, cache, state
        )
        return last, cache

    def _greedy_or_sample(self, encoder_states, encoder_mask, generation_config, processors, max_steps, with_trace):
        config = self.config
        rows = encoder_states.shape[0]
        device = encoder_states.device
        state = self._new_state(rows, max_steps, encoder_states)
        last, cache = self._start(state, encoder_states, encoder_mask)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        lengths = torch.full((rows,), 2, dtype=torch.long, device=device)
        total_log_prob = torch.zeros(rows, device=device)
        step_scores = []
        for _ in range(max_steps):
            logits = self._decoding_word_logits(last)
            scores = processors(state.tokens[:, : state.length], logits)
            if generation_config.output_scores:
                step_scores.append(scores)
            if generation_config.do_sample:
                words = torch.multinomial(scores.softmax(-1), 1).squeeze(1)
            else:
                words = scores.argmax(-1)
            words = words.masked_fill(finished, config.pad_token_id)
            if with_trace:  # sequences_scores are only returned with the dict output
                word_log_prob = scores.log_softmax(-1).gather(1, words[:, None]).squeeze(1)
                total_log_prob += torch.where(finished, 0.0, word_log_prob)
            finished = finished | words.eq(config.eod_token_id)
            if bool(finished.all()):
                break
            gaps, reading = self._position_log_probs(self.pointer_query(last, words)[:, None, :], state)
            gaps = gaps[:, 0]
            if generation_config.do_sample:
                gap = torch.multinomial(gaps.exp().clamp(min=0), 1).squeeze(1)
            else:
                gap = gaps.argmax(-1)
            if with_trace:
                total_log_prob += torch.where(finished, 0.0, gaps.gather(1, gap[:, None]).squeeze(1))
            anchors = reading.gather(1, gap[:, None]).squeeze(1)
            sides = torch.full_like(anchors, RIGHT)
            tokens = torch.where(finished, config.pad_token_id, words)
            lengths += (~finished).long()
            relation_row = state.insert(tokens, anchors, sides)
            last, cache = self._decode_step(tokens[:, None], relation_row, encoder_states, encoder_mask, cache, state)
        return self._finalize(state.tokens, state.relations, state.anchors, state.sides, lengths, total_log_prob,
                              tuple(step_scores) if step_scores else None, with_trace)

    def _beam_search(self, encoder_states, encoder_mask, generation_config, processors, max_steps, with_trace):
        config = self.config
        batch = encoder_states.shape[0]
        beams = generation_config.num_beams
        rows = batch * beams
        device = encoder_states.device
        length_penalty = generation_config.length_penalty if generation_config.length_penalty is not None else 1.0
        early_stopping = generation_config.early_stopping
        num_return = generation_config.num_return_sequences or 1
        encoder_states = encoder_states.repeat_interleave(beams, 0)
        encoder_mask = encoder_mask.repeat_interleave(beams, 0) if encoder_mask is not None else None
        state = self._new_state(rows, max_steps, encoder_states)
        last, cache = self._start(state, encoder_states, encoder_mask)
        beam_scores = torch.full((batch, beams), float("-inf"), device=device)
        beam_scores[:, 0] = 0.0
        beam_scores = beam_scores.view(-1)
        finished: list[list[tuple]] = [[] for _ in range(batch)]
        done = [False] * batch
        offsets = torch.arange(batch, device=device).repeat_interleave(beams) * beams
        dim = last.shape[-1]

        def snapshot(row: int, score: float, generated: int) -> tuple:
            """(length-normalised score, raw score, tokens, relations, anchors, sides) of one hypothesis."""
            n = state.length
            return (score / generated**length_penalty, score, state.tokens[row, :n].clone(),
                    state.relations[row, :n, :n].clone(), state.anchors[row, :n].clone(), state.sides[row, :n].clone())

        for _ in range(max_steps):
            logits = self._decoding_word_logits(last)
            word_log_probs = processors(state.tokens[:, : state.length], logits.log_softmax(-1)).log_softmax(-1)
            # Step 1 of the two-step search (Sec. 4.3): the best `beams` words of every hypothesis ...
            top_word_scores, top_words = word_log_probs.topk(beams, dim=-1)
            is_eod = top_words.eq(config.eod_token_id)
            # ... step 2: every position for each of them; keep the best `beams` (word, position) per sentence.
            query = self.pointer_query(last[:, None, :].expand(-1, beams, dim), top_words)
            gaps, reading = self._position_log_probs(query, state)  # [rows, beams, n-1]
            n_gaps = gaps.shape[-1]
            candidate = (beam_scores[:, None, None] + top_word_scores[..., None] + gaps).masked_fill(
                is_eod[..., None], float("-inf")
            )
            top_scores, top_index = candidate.view(batch, beams * beams * n_gaps).topk(beams, dim=-1)
            # An <eod> that would enter the beam ends its hypothesis (Algorithm 1's break).
            eod_scores = (beam_scores[:, None] + top_word_scores).masked_fill(~is_eod, float("-inf")).view(batch, -1)
            entering = torch.isfinite(eod_scores) & (eod_scores >= top_scores[:, -1:])
            for sentence, flat in torch.nonzero(entering).tolist():
                if done[sentence]:
                    continue
                row = sentence * beams + flat // beams
                finished[sentence].append(snapshot(row, float(eod_scores[sentence, flat]), state.length - 1))
            for sentence in range(batch):
                if done[sentence]:
                    continue
                finished[sentence].sort(key=lambda item: -item[0])
                del finished[sentence][beams:]
                if len(finished[sentence]) >= beams:
                    if early_stopping is True:
                        done[sentence] = True
                    elif early_stopping != "never":  # HF's heuristic: the best live hypothesis cannot win
                        best_live = float(top_scores[sentence, 0]) / (state.length - 1) ** length_penalty
                        done[sentence] = best_live <= finished[sentence][-1][0]
            if all(done):
                break
            origin = (top_index // (beams * n_gaps)).view(-1) + offsets
            word_slot = ((top_index // n_gaps) % beams).view(-1)
            gap = (top_index % n_gaps).view(-1, 1)
            words = top_words[origin, word_slot]
            anchors = reading[origin].gather(1, gap).squeeze(1)
            beam_scores = top_scores.view(-1).masked_fill(
                torch.tensor(done, device=device).repeat_interleave(beams), float("-inf")
            )
            cache.reorder_cache(origin)
            state.reorder(origin)
            relation_row = state.insert(words, anchors, torch.full_like(anchors, RIGHT))
            last, cache = self._decode_step(words[:, None], relation_row, encoder_states, encoder_mask, cache, state)
        selected = []
        for sentence in range(batch):
            pool = list(finished[sentence])
            if len(pool) < num_return:  # ran out of steps: complete with the live hypotheses
                for beam in range(beams):
                    row = sentence * beams + beam
                    if math.isfinite(float(beam_scores[row].detach())):
                        pool.append(snapshot(row, float(beam_scores[row]), state.length - 2))
                pool.sort(key=lambda item: -item[0])
            selected.extend(pool[:num_return])
        width = max(len(item[2]) for item in selected)
        count = len(selected)
        tokens = torch.full((count, width), config.pad_token_id, dtype=torch.long, device=device)
        relations = torch.zeros(count, width, width, dtype=torch.int8, device=device)
        anchors = torch.full((count, width), -1, dtype=torch.long, device=device)
        sides = torch.zeros(count, width, dtype=torch.long, device=device)
        lengths = torch.zeros(count, dtype=torch.long, device=device)
        for index, (_, _, hyp_tokens, hyp_relations, hyp_anchors, hyp_sides) in enumerate(selected):
            n = len(hyp_tokens)
            tokens[index, :n], relations[index, :n, :n] = hyp_tokens, hyp_relations
            anchors[index, :n], sides[index, :n], lengths[index] = hyp_anchors, hyp_sides, n
        scores = torch.tensor([item[0] for item in selected], device=device)
        return self._finalize(tokens, relations, anchors, sides, lengths, scores, None, with_trace)

    # ---- outputs --------------------------------------------------------------------------------------------
    def _finalize(self, tokens, relations, anchors, sides, lengths, scores, step_scores, with_trace):
        """Algorithm 1's last lines: absolute positions (Eq. 4) of the real words, reorder into reading order."""
        width = int(lengths.max())
        tokens, anchors, sides = tokens[:, :width], anchors[:, :width], sides[:, :width]
        relations = relations[:, :width, :width]
        index = torch.arange(width, device=tokens.device)
        valid = index[None, :] < lengths[:, None]
        relations = relations * (valid[:, :, None] & valid[:, None, :]).to(relations.dtype)
        positions = absolute_positions_from_relative(relations)
        reading = torch.where(valid, positions, width + index).argsort(-1)
        sequences = tokens.gather(1, reading).masked_fill(~valid, self.config.pad_token_id)
        insertion_ids = tokens.masked_fill(~valid, self.config.pad_token_id)
        traces = None
        if with_trace:
            traces = []
            for row in range(tokens.shape[0]):
                trace = []
                for step in range(2, int(lengths[row])):
                    position = absolute_positions_from_relative(relations[row, step, : step + 1])
                    trace.append((int(tokens[row, step]), int(anchors[row, step]),
                                  "left" if int(sides[row, step]) == LEFT else "right", int(position)))
                traces.append(trace)
        return InDIGOGenerateOutput(
            sequences=sequences,
            sequences_scores=scores,
            scores=step_scores,
            insertion_ids=insertion_ids,
            relative_positions=relations,
            insertion_trace=traces,
        )


__all__ = [
    "InDIGOForConditionalGeneration",
    "InDIGOGenerateOutput",
    "InDIGOModel",
    "InDIGOSelfAttention",
    "InDIGOSeq2SeqOutput",
]
