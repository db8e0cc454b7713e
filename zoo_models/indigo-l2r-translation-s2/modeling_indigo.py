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

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput
from transformers.utils import can_return_tuple

from .configuration_indigo import InDIGOConfig

from .cpu_kernels import project, project_vocabulary
from .indigo_decoding import InDIGOGenerateOutput, InsertionDecoding
from .indigo_insertion import (
    build_insertion_batch,
    sao_order_weights,
)
from .indigo_order_search import SearchedAdaptiveOrder
from .modeling_flexformer import (
    BackboneComponents,
    FlexformerAttention,
    FlexformerForConditionalGeneration,
    FlexformerModel,
)
from .transformers_compat import accepts_cache_argument, cache_field, drop_generation_position_arguments, output_cache

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


# --------------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------------


INDIGO_COMPONENTS = BackboneComponents(decoder_self_attention=InDIGOSelfAttention)


def _under_either_name(value, kwargs: dict, name: str, earlier_name: str):
    """The value of the `forward` argument `name`, or of its earlier name `earlier_name` (popped from `kwargs`)."""
    earlier_value = kwargs.pop(earlier_name, None)
    if earlier_value is None:
        return value
    if value is not None:
        raise ValueError(f"InDIGO's forward got both {name} and {earlier_name} (its earlier name): pass {name} only")
    return earlier_value


class InDIGOModel(FlexformerModel):
    """Encoder + InDIGO decoder (relative-position self-attention; no absolute decoder positions unless the
    ``decoder_use_positions`` ablation adds insertion-step ones), no heads."""

    config_class = InDIGOConfig
    components = INDIGO_COMPONENTS


class InDIGOForConditionalGeneration(InsertionDecoding, SearchedAdaptiveOrder, FlexformerForConditionalGeneration):
    """Transformer-InDIGO (Sec. 4): the flexformers backbone with relative-position decoder self-attention and no
    absolute decoder positions (``decoder_use_positions=True`` adds insertion-step ones, an ablation), word prediction (Eq. 8) then pointer prediction (Eq. 9), the word + position loss
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
        self.word_query_proj = nn.Linear(dim, dim, bias=False) if config.word_query_projection else None  # F
        self.pointer_query_proj = nn.Linear(dim, dim, bias=False)  # E
        self.pointer_left_proj = nn.Linear(dim, dim, bias=False)  # C
        self.pointer_right_proj = nn.Linear(dim, dim, bias=False)  # D
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
            hidden_states = project(self.word_query_proj, hidden_states)
        return project_vocabulary(self.lm_head, hidden_states)

    def pointer_keys(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 9's left and right keys ``H C`` and ``H D``."""
        return project(self.pointer_left_proj, hidden_states), project(self.pointer_right_proj, hidden_states)

    def pointer_query(self, hidden_states: torch.Tensor, word_ids: torch.Tensor) -> torch.Tensor:
        """Eq. 9's query ``h E + W[y]`` (W: the decoder's token embedding, unscaled)."""
        return project(self.pointer_query_proj, hidden_states) + self.get_decoder().embed_tokens(word_ids)

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
    def _decoder_outputs(self, decoder_input_ids, relative_positions, encoder_hidden_states, attention_mask,
                         past_key_values=None, use_cache=False, inputs_embeds=None, **outputs_wanted):
        """The decoder over insertion-order inputs (ids, or their unscaled embeddings) with their relative positions;
        `outputs_wanted`: `output_attentions` / `output_hidden_states`."""
        return self.model.decoder(
            input_ids=decoder_input_ids,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=attention_mask,
            cache=past_key_values,
            use_cache=use_cache,
            relative_positions=relative_positions,
            **outputs_wanted,
        )

    def _decoder_states(self, decoder_input_ids, relative_positions, encoder_hidden_states, attention_mask,
                        past_key_values=None, use_cache=False):
        outputs = self._decoder_outputs(
            decoder_input_ids, relative_positions, encoder_hidden_states, attention_mask, past_key_values, use_cache
        )
        return outputs.last_hidden_state, output_cache(outputs)

    def _encode(self, input_ids, attention_mask, encoder_outputs=None, inputs_embeds=None, **outputs_wanted):
        if encoder_outputs is None:
            encoder_outputs = self.model.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **outputs_wanted
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        return encoder_outputs

    def insertion_losses(
        self,
        hidden_states: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        insertion_targets: torch.Tensor,
        pointer_targets: torch.Tensor,
        epsilon: float,
        return_logits: bool = False,
    ):
        """Summed word loss (Eq. 8 targets, label-smoothed with ε) and position loss ``-log(p_kl + p_kr)`` (Eq. 11)
        over all insertions, per sequence: returns ``(word_loss [b], word_nll [b], position_nll [b], logits,
        pointer_log_probs)``."""
        batch, length, _ = hidden_states.shape
        logits = self.word_logits(hidden_states)
        log_probs = logits.float().log_softmax(-1)
        word_mask = insertion_targets.ne(-100)
        safe_labels = insertion_targets.masked_fill(~word_mask, 0)
        word_nll = -log_probs.gather(-1, safe_labels[..., None]).squeeze(-1).masked_fill(~word_mask, 0.0)
        word_loss = word_nll.sum(-1)
        if epsilon > 0:
            eps_i = epsilon / (log_probs.shape[-1] - 1)
            smooth = -log_probs.sum(-1).masked_fill(~word_mask, 0.0).sum(-1)
            word_loss = (1.0 - epsilon - eps_i) * word_loss + eps_i * smooth
        # Pointer over [left keys | right keys] of all L positions; a query at i sees words 0..i (causal).
        pointer_mask = pointer_targets[..., 0].ne(-100)
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
        safe_pointer = pointer_targets.masked_fill(~pointer_mask[..., None], 0)
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

    @can_return_tuple
    @accepts_cache_argument
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        relative_positions: torch.Tensor | None = None,
        insertion_targets: torch.LongTensor | None = None,
        pointer_targets: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        target_ids: torch.LongTensor | None = None,
        target_lengths: torch.LongTensor | None = None,
        encoder_outputs=None,
        past_key_values=None,
        use_cache: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        return_dict: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs,
    ) -> InDIGOSeq2SeqOutput | tuple:
        """Teacher-forced InDIGO.

        - With ``decoder_input_ids`` (or ``decoder_inputs_embeds``) + ``relative_positions`` (+ ``insertion_targets``
          and ``pointer_targets`` for the loss), from :func:`build_insertion_batch` / the collator: the given order.
        - With only ``labels`` (reading order, ending in ``</s>``, -100 padding): the L2R order. ``labels`` with
          ``decoder_input_ids`` that are the labels shifted right (what ``DataCollatorForSeq2Seq`` adds for any
          model) is the same; other decoder inputs with ``labels`` but no ``insertion_targets`` are refused.
        - With ``target_ids``/``target_lengths`` and ``model.use_searched_orders``: SAO (Sec. 4.2) — beam search over
          permutations (``model.sao_beam_size``), then the loss averaged over the found orders (Eq. 12).
        The loss is (word loss + position loss) / number of target tokens (``num_items_in_batch`` when given).
        Attention weights and hidden states are those of the insertion-order decoder inputs.

        ``labels`` is the only argument named for labels: Transformers' ``Trainer`` takes every ``forward`` argument
        whose name contains "label" for a label each evaluation batch must hold, so the insertion targets (derived
        from the labels) are ``insertion_targets`` / ``pointer_targets``; their earlier names ``insertion_labels`` /
        ``pointer_labels`` are still taken.
        """
        drop_generation_position_arguments(kwargs)
        insertion_targets = _under_either_name(insertion_targets, kwargs, "insertion_targets", "insertion_labels")
        pointer_targets = _under_either_name(pointer_targets, kwargs, "pointer_targets", "pointer_labels")
        if kwargs:
            raise ValueError(f"InDIGOForConditionalGeneration.forward got unexpected arguments {sorted(kwargs)}")
        config = self.config
        outputs_wanted = {
            "output_attentions": config.output_attentions if output_attentions is None else output_attentions,
            "output_hidden_states": config.output_hidden_states if output_hidden_states is None else output_hidden_states,
        }
        if attention_mask is None and input_ids is not None:
            attention_mask = input_ids.ne(config.pad_token_id).long()
        encoder_outputs = self._encode(input_ids, attention_mask, encoder_outputs, inputs_embeds, **outputs_wanted)
        encoder_states = encoder_outputs.last_hidden_state
        searching = target_ids is not None and self.use_searched_orders
        has_decoder_inputs = decoder_input_ids is not None or decoder_inputs_embeds is not None
        if labels is not None and insertion_targets is None and has_decoder_inputs and not searching:
            self._check_labels_alone(labels, decoder_input_ids, relative_positions)
            decoder_input_ids = None

        searched_orders = searched_scores = None
        order_weights = None
        if searching:
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
            insertion_targets, pointer_targets = batch["insertion_targets"], batch["pointer_targets"]
            encoder_states = encoder_states.repeat_interleave(keep, 0)
            attention_mask = attention_mask.repeat_interleave(keep, 0)
        elif decoder_input_ids is None and decoder_inputs_embeds is None:
            if target_ids is None and labels is None:
                raise ValueError("InDIGO's forward needs decoder_input_ids + relative_positions, labels or target_ids")
            batch = self.insertion_batch_from_labels(labels, target_ids, target_lengths)
            decoder_input_ids = batch["decoder_input_ids"]
            relative_positions = batch["relative_positions"]
            insertion_targets, pointer_targets = batch["insertion_targets"], batch["pointer_targets"]
        if relative_positions is None:
            raise ValueError("InDIGO's forward needs relative_positions with decoder_input_ids (see build_insertion_batch)")

        decoder_outputs = self._decoder_outputs(
            decoder_input_ids, relative_positions, encoder_states, attention_mask,
            past_key_values=past_key_values, use_cache=bool(use_cache) and insertion_targets is None,
            inputs_embeds=decoder_inputs_embeds, **outputs_wanted,
        )
        hidden_states, cache = decoder_outputs.last_hidden_state, output_cache(decoder_outputs)
        loss = word_part = position_part = logits = pointer_log_probs = None
        if insertion_targets is not None:
            if pointer_targets is None:
                raise ValueError("insertion_targets need pointer_targets (see build_insertion_batch)")
            word_loss, _, position_nll, logits, pointer_log_probs = self.insertion_losses(
                hidden_states, decoder_input_ids, insertion_targets, pointer_targets, self.config.label_smoothing,
                return_logits=not self.training,
            )
            weights = order_weights if order_weights is not None else torch.ones_like(word_loss)
            if num_items_in_batch is None:
                denominator = insertion_targets.ne(-100).float().sum(-1).mul(weights).sum().clamp(min=1)
            else:
                denominator = num_items_in_batch
            if isinstance(denominator, torch.Tensor):
                denominator = denominator.to(word_loss.device)
            word_part = (word_loss * weights).sum() / denominator
            position_part = (position_nll * weights).sum() / denominator
            loss = word_part + position_part
        else:
            logits = self.word_logits(hidden_states)
        output = InDIGOSeq2SeqOutput(
            loss=loss,
            logits=logits,
            pointer_logits=pointer_log_probs,
            word_loss=word_part,
            position_loss=position_part,
            **cache_field(cache),
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
            searched_orders=searched_orders,
            searched_scores=searched_scores,
        )
        return output

    def insertion_batch_from_labels(
        self, labels: torch.Tensor | None, target_ids: torch.Tensor | None = None, target_lengths=None
    ) -> dict[str, torch.Tensor]:
        """The left-to-right insertion batch (:func:`build_insertion_batch`: ``decoder_input_ids``,
        ``relative_positions``, ``insertion_targets``, ``pointer_targets``, ``decoder_attention_mask``) of reading-order
        ``labels`` (``w_1 .. w_n </s>``, -100 or pad padding), or of ``target_ids`` / ``target_lengths``."""
        if target_ids is None:
            target_ids, target_lengths = self._targets_from_labels(labels)
        orders = torch.arange(target_ids.shape[1], device=target_ids.device).expand_as(target_ids).contiguous()
        # left to right is a permutation by construction: no check (a host sync, and a graph break when compiled)
        return build_insertion_batch(target_ids, target_lengths, orders, check_orders=False, **self._special_ids())

    def _check_labels_alone(self, labels, decoder_input_ids, relative_positions) -> None:
        """``labels`` with ``decoder_input_ids`` but no insertion labels: train on the labels alone when the decoder
        inputs are the labels shifted right (a standard sequence-to-sequence batch), else refuse, naming what
        InDIGO needs."""
        if (
            relative_positions is None
            and decoder_input_ids is not None
            and decoder_input_ids.shape == labels.shape
            and torch.equal(decoder_input_ids, self.prepare_decoder_input_ids_from_labels(labels))
        ):
            return
        raise ValueError(
            "InDIGO's forward got labels with decoder inputs of their own but no insertion_targets: InDIGO trains on "
            "insertions. Pass labels alone (reading order; their left-to-right insertion batch is built, as it is "
            "when decoder_input_ids are the labels shifted right, e.g. from DataCollatorForSeq2Seq), or a whole "
            "insertion batch: decoder_input_ids, relative_positions, insertion_targets and pointer_targets "
            "(build_insertion_batch, or the InDIGO collator of flexformers-train), or target_ids and target_lengths "
            "for searched orders."
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
        """Reading-order labels (``w_1 .. w_n </s>``, -100/pad padding) → words ``[b, T]`` and lengths ``[b]``.

        Eager, ``T`` is the longest target; inside ``torch.compile`` it is the labels' width (trimming needs the
        longest length on the host: a data-dependent shape, one graph break). The extra columns are padding after
        every word, which no word attends to (insertions are causal) and no loss counts: the loss is the same."""
        pad, eos = self.config.pad_token_id, self.config.eos_token_id
        is_word = labels.ne(-100) & labels.ne(pad) & labels.ne(eos)
        lengths = is_word.sum(-1)
        order = torch.sort((~is_word).long(), dim=-1, stable=True).indices
        words = labels.gather(1, order).masked_fill(
            torch.arange(labels.shape[1], device=labels.device)[None] >= lengths[:, None], pad
        )
        if torch.compiler.is_compiling():
            return words, lengths
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
            hidden_states, batch["decoder_input_ids"], batch["insertion_targets"], batch["pointer_targets"], 0.0
        )
        return -(word_nll + position_nll)


__all__ = [
    "InDIGOForConditionalGeneration",
    "InDIGOGenerateOutput",
    "InDIGOModel",
    "InDIGOSelfAttention",
    "InDIGOSeq2SeqOutput",
]
