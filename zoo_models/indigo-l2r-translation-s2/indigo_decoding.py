"""InDIGO's insertion decoding (Gu, Liu & Cho, TACL 2019; Algorithm 1, Sec. 4.3): greedy decoding, sampling and the
two-step beam search, each step inserting one word where the pointer puts it, and the output in reading order.
`InDIGOForConditionalGeneration` (`modeling_indigo.py`) inherits it as its `generate()`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.generation import GenerationConfig, LogitsProcessorList, MaxTimeCriteria, StoppingCriteriaList
from transformers.utils import ModelOutput

from .generation_hooks import check_generate_arguments
from .indigo_insertion import (
    LEFT,
    RIGHT,
    START_PAIR_LENGTH,
    absolute_positions_from_relative,
    gap_log_probs,
    max_insertion_steps,
    reading_order_from_positions,
)
from .indigo_search_state import InsertionState
from .kv_caches import new_decoder_cache
from .transformers_compat import output_cache


@dataclass
class InDIGOGenerateOutput(ModelOutput):
    """``generate(..., return_dict_in_generate=True)``.

    ``sequences`` are in reading order (``<s> w_1 .. w_n </s>`` then padding); ``insertion_ids`` the same tokens in
    generation order (``<s> </s>`` first, no ``<eod>``); ``insertion_trace`` per sequence a list of steps
    ``(token_id, anchor, side, position)``: the word, the insertion index of the word it went next to, ``"left"`` /
    ``"right"`` and its absolute position right after the insertion.

    With ``output_attentions`` / ``output_hidden_states``, laid out as Transformers' generation outputs:
    ``encoder_attentions`` / ``encoder_hidden_states`` per encoder block, and per decoder call (the start ``<s> </s>``,
    then one per inserted word) ``decoder_attentions`` / ``cross_attentions`` — a tuple per block of
    ``[rows, heads, new words, keys]`` — and ``decoder_hidden_states`` (the embeddings, then each block:
    ``[rows, new words, d]``); rows are sentences × beams (or × returned sequences), in that step's beam order.

    Per decoding step (one insertion, or the ``<eod>`` that ends a hypothesis), laid out as Transformers' outputs:
    ``scores`` (``output_scores``) the processed word scores the word was chosen from, ``[rows, V]`` (beam search:
    log-probabilities); ``logits`` (``output_logits``) the word logits before the processors (``<s>``, ``</s>`` and
    ``<pad>`` masked: never inserted); ``beam_indices`` (beam search) ``[sequences, steps]``, the row of each step's
    ``scores`` the returned hypothesis descends from (-1 after its end); ``position_scores`` ``[sequences, steps]``
    the log-probability of the gap each word was inserted at (Eq. 11; 0 for ``<eod>`` and after the end). A step's
    score is word + position: :meth:`InsertionDecoding.compute_transition_scores` of ``insertion_ids`` gives the
    word part.
    """

    sequences: torch.LongTensor | None = None
    sequences_scores: torch.Tensor | None = None
    scores: tuple | None = None
    logits: tuple | None = None
    beam_indices: torch.LongTensor | None = None
    position_scores: torch.Tensor | None = None
    insertion_ids: torch.LongTensor | None = None
    relative_positions: torch.Tensor | None = None
    insertion_trace: list | None = None
    encoder_attentions: tuple | None = None
    encoder_hidden_states: tuple | None = None
    decoder_attentions: tuple | None = None
    cross_attentions: tuple | None = None
    decoder_hidden_states: tuple | None = None


@dataclass
class DecoderSteps:
    """The attention weights / hidden states of every decoder call of one ``generate()`` (None: not collected)."""

    attentions: list | None
    cross_attentions: list | None
    hidden_states: list | None

    @classmethod
    def wanted(cls, generation_config: GenerationConfig) -> DecoderSteps | None:
        attentions, hidden = bool(generation_config.output_attentions), bool(generation_config.output_hidden_states)
        if not generation_config.return_dict_in_generate or not (attentions or hidden):
            return None
        return cls([] if attentions else None, [] if attentions else None, [] if hidden else None)

    def add(self, outputs) -> None:
        for collected, values in (
            (self.attentions, outputs.attentions),
            (self.cross_attentions, outputs.cross_attentions),
            (self.hidden_states, outputs.hidden_states),
        ):
            if collected is not None:
                collected.append(values)

    def output_fields(self) -> dict[str, tuple | None]:
        return {
            "decoder_attentions": None if self.attentions is None else tuple(self.attentions),
            "cross_attentions": None if self.cross_attentions is None else tuple(self.cross_attentions),
            "decoder_hidden_states": None if self.hidden_states is None else tuple(self.hidden_states),
        }


#: GenerationConfig options that only make sense for left-to-right decoding, each with the values that leave it off
#: and why insertion decoding refuses it (a `ValueError` naming it: never silently ignored).
LEFT_TO_RIGHT_ONLY_OPTIONS = {
    "force_words_ids": ((None,), "constrained beam search forces words into a left-to-right prefix"),
    "constraints": ((None,), "constrained beam search forces words into a left-to-right prefix"),
    "num_beam_groups": ((None, 1), "group (diverse) beam search is not implemented for insertion decoding"),
    "diversity_penalty": ((None, 0.0), "group (diverse) beam search is not implemented for insertion decoding"),
    "penalty_alpha": ((None,), "contrastive search is not implemented for insertion decoding"),
    "dola_layers": ((None,), "DoLa contrasts the layers of a left-to-right step"),
    "low_memory": ((None, False), "there is no sequential low-memory beam search for insertion decoding"),
    "guidance_scale": ((None, 1, 1.0), "classifier-free guidance needs an unconditional left-to-right pass"),
    "prompt_lookup_num_tokens": ((None,), "assisted decoding verifies left-to-right drafts"),
    "assistant_early_exit": ((None,), "assisted decoding verifies left-to-right drafts"),
    "use_mtp": ((None, False), "multi-token prediction drafts left-to-right tokens"),
    "stop_strings": ((None,), "stop strings are matched at the end of left-to-right text; pass stopping_criteria"),
    "token_healing": ((None, False), "token healing rewrites the end of a left-to-right prompt"),
    "forced_bos_token_id": ((None,), "the first inserted word need not be the sentence's first word"),
    "forced_eos_token_id": ((None,), "</s> always closes the sentence and <eod> ends decoding"),
}


def check_insertion_generation_config(generation_config: GenerationConfig, config) -> None:
    """A `ValueError` naming each option of `generation_config` that insertion decoding cannot honour."""
    for name, (neutral, why) in LEFT_TO_RIGHT_ONLY_OPTIONS.items():
        value = getattr(generation_config, name, None)
        if not any(value is off or (off is not None and value == off) for off in neutral):
            raise ValueError(f"InDIGO generate(): {name}={value!r} cannot be used: {why}")
    eos = generation_config.eos_token_id
    if isinstance(eos, torch.Tensor):
        eos_ids = eos.flatten().tolist()
    else:
        eos_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    if any(token not in (None, config.eos_token_id, config.eod_token_id) for token in eos_ids):
        raise ValueError(
            f"InDIGO generate(): eos_token_id={eos!r} cannot be used: insertion decoding ends a hypothesis with <eod> "
            f"(eod_token_id={config.eod_token_id}) and closes every sentence with </s> (eos_token_id="
            f"{config.eos_token_id}); leave it out"
        )


class InsertionDecoding:
    """Algorithm 1 as `generate()`, for a model with InDIGO's heads (`word_logits`, `pointer_query`, `pointer_keys`,
    `slot_log_probs`), encoder (`_encode`) and decoder step (`_decoder_states`)."""

    def _decoding_word_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Eq. 8 logits for decoding; ``<s>``, ``</s>`` and ``<pad>`` are never inserted (training never predicts
        them), so they are masked."""
        logits = self.word_logits(last_hidden).float()
        config = self.config
        logits[:, [config.bos_token_id, config.eos_token_id, config.pad_token_id]] = float("-inf")
        return logits

    def _decode_step(
        self, tokens, relation_rows, encoder_states, encoder_mask, cache, state: InsertionState,
        steps: DecoderSteps | None = None,
    ):
        if steps is None:
            hidden, cache = self._decoder_states(tokens, relation_rows, encoder_states, encoder_mask, cache, True)
        else:
            outputs = self._decoder_outputs(
                tokens, relation_rows, encoder_states, encoder_mask, cache, True,
                output_attentions=steps.attentions is not None, output_hidden_states=steps.hidden_states is not None,
            )
            steps.add(outputs)
            hidden, cache = outputs.last_hidden_state, output_cache(outputs)
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
        training_batch = ("labels", "insertion_targets", "pointer_targets", "insertion_labels", "pointer_labels",
                          "relative_positions", "target_ids", "target_lengths", "num_items_in_batch")
        is_training_batch = any(kwargs.get(key) is not None for key in training_batch)
        for key in ("decoder_input_ids", "decoder_attention_mask"):
            if kwargs.get(key) is not None and not is_training_batch:
                # (a training batch's teacher-forced decoder inputs are set aside, as Seq2SeqTrainer's evaluation does)
                raise ValueError(
                    f"InDIGO generate(): {key} cannot be used: insertion decoding starts from <s> </s> and has no "
                    "left-to-right prefix to continue; leave it out"
                )
        for key in (*training_batch, "decoder_input_ids", "decoder_attention_mask"):
            kwargs.pop(key, None)
        if kwargs.pop("synced_gpus", None):
            raise ValueError(
                "InDIGO generate(): synced_gpus=True cannot be used: insertion decoding does not keep the ranks of a "
                "sharded (ZeRO-3 / FSDP) model stepping together; decode on each rank with a whole model"
            )
        if kwargs.pop("assistant_model", None) is not None:
            raise ValueError(
                "InDIGO generate(): assistant_model cannot be used: assisted decoding verifies left-to-right drafts"
            )
        encoder_outputs = kwargs.pop("encoder_outputs", None)
        inputs_embeds = kwargs.pop("inputs_embeds", None)
        generation_config, model_kwargs = self._prepare_generation_config(generation_config, **kwargs)
        unknown = sorted(
            key for key, value in model_kwargs.items()
            if value is not None and key not in ("use_cache", "output_attentions", "output_hidden_states")
        )
        if unknown:
            raise ValueError(f"InDIGO generate() got unexpected arguments {unknown}")
        check_insertion_generation_config(generation_config, self.config)
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"InDIGO generate() keeps its own insertion-decoding state (pointer keys, relative positions that "
                f"change as words are inserted); cache_implementation={generation_config.cache_implementation!r} "
                "is not supported"
            )
        if input_ids is None and encoder_outputs is None and inputs_embeds is None:
            raise ValueError("generate() needs input_ids (or inputs_embeds, or encoder_outputs)")
        if attention_mask is None and input_ids is not None:
            attention_mask = input_ids.ne(self.config.pad_token_id).long()
        return generation_config, encoder_outputs, attention_mask, inputs_embeds

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        return_insertion_trace: bool = False,
        stopping_criteria: StoppingCriteriaList | None = None,
        prefix_allowed_tokens_fn=None,
        streamer=None,
        **kwargs,
    ):
        """Algorithm 1 with greedy decoding, sampling (``do_sample``) or the two-step beam search of Sec. 4.3
        (``num_beams > 1``: top-B words per hypothesis, then every position for each, keep the best B; scores
        normalised by ``length ** length_penalty``).

        Honours ``max_new_tokens`` (insertions, ``<eod>`` included; default ``max_length`` less the start pair),
        ``num_beams``, ``num_return_sequences``, ``do_sample``/``temperature``/``top_k``/``top_p`` and other logits
        processors (applied to the word distribution; ``<eod>`` plays the EOS role for e.g. ``min_new_tokens``),
        ``length_penalty``, ``early_stopping``, ``output_scores``, ``output_logits``, ``output_attentions``,
        ``output_hidden_states`` and ``return_dict_in_generate``; ``inputs_embeds`` may replace ``input_ids``.
        ``stopping_criteria`` (and ``max_time``) see the insertion sequence (``<s> </s>`` then the words in
        generation order) after every insertion and end the rows they flag; ``prefix_allowed_tokens_fn`` sees the
        same sequence; a ``streamer`` (greedy and sampling) receives ``<s> </s>``, then each step's inserted word
        (``<eod>`` when a row ends, ``<pad>`` after), in generation order. Left-to-right-only options
        (``LEFT_TO_RIGHT_ONLY_OPTIONS``, ``assistant_model``, ``synced_gpus``, ``decoder_input_ids``) are refused
        by name. Returns the sequences in reading order (``<s> … </s>``, padded), or an
        :class:`InDIGOGenerateOutput`; with ``return_insertion_trace=True`` the output is always the dataclass with
        ``insertion_trace`` filled in.
        """
        check_generate_arguments(self, input_ids, generation_config, kwargs)
        start = kwargs.get("decoder_start_token_id")
        if start is not None and not (isinstance(start, int) and start == self.config.bos_token_id):
            # insertion decoding reads <s> </s> first, whatever a left-to-right model would start from: never ignored
            raise ValueError(
                f"InDIGO generate(): decoder_start_token_id={start!r} cannot be used: insertion decoding always starts "
                f"from <s> </s> (bos_token_id={self.config.bos_token_id}, eos_token_id={self.config.eos_token_id}); "
                "leave it out"
            )
        generation_config, encoder_outputs, attention_mask, inputs_embeds = self._prepare_generation(
            input_ids, attention_mask, generation_config, kwargs
        )
        config = self.config
        generation_config.eos_token_id = config.eod_token_id
        generation_config.forced_eos_token_id = None
        generation_config.forced_bos_token_id = None
        if generation_config.max_new_tokens is not None:
            max_steps = generation_config.max_new_tokens
        else:
            max_steps = max(generation_config.max_length - START_PAIR_LENGTH, 1)
        max_steps = min(max_steps, max_insertion_steps(config))
        num_beams = generation_config.num_beams or 1
        num_return = generation_config.num_return_sequences or 1
        if num_beams > 1 and generation_config.do_sample:
            raise ValueError("InDIGO generate(): beam sampling (num_beams > 1 with do_sample=True) is not implemented")
        if num_return > num_beams and not generation_config.do_sample:
            raise ValueError(
                f"num_return_sequences={num_return} needs do_sample=True or num_beams >= {num_return} (got {num_beams})"
            )
        if streamer is not None and num_beams > 1:
            raise ValueError("InDIGO generate(): streamer cannot be used with beam search (num_beams > 1), as in "
                             "Transformers: the beams' words are not final until the search ends")
        criteria = StoppingCriteriaList()
        if generation_config.max_time is not None:
            criteria.append(MaxTimeCriteria(generation_config.max_time))
        criteria.extend(stopping_criteria or [])
        steps = DecoderSteps.wanted(generation_config)
        encoder_outputs = self._encode(
            input_ids, attention_mask, encoder_outputs, inputs_embeds,
            output_attentions=steps is not None and steps.attentions is not None,
            output_hidden_states=steps is not None and steps.hidden_states is not None,
        )
        encoder_states = encoder_outputs.last_hidden_state
        self._prepare_special_tokens(generation_config, True, device=encoder_states.device)
        processors = self._get_logits_processor(
            generation_config=generation_config,
            input_ids_seq_length=2,
            encoder_input_ids=input_ids,
            logits_processor=logits_processor,
            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
            device=encoder_states.device,
        )
        with_trace = return_insertion_trace or bool(generation_config.return_dict_in_generate)
        if num_beams > 1:
            result = self._beam_search(encoder_states, attention_mask, generation_config, processors, max_steps,
                                       with_trace, steps, criteria)
        else:
            if num_return > 1:
                encoder_states = encoder_states.repeat_interleave(num_return, 0)
                attention_mask = attention_mask.repeat_interleave(num_return, 0) if attention_mask is not None else None
            result = self._greedy_or_sample(encoder_states, attention_mask, generation_config, processors, max_steps,
                                            with_trace, steps, criteria, streamer)
        if steps is not None:
            fields = {
                "encoder_attentions": encoder_outputs.attentions,
                "encoder_hidden_states": encoder_outputs.hidden_states,
                **steps.output_fields(),
            }
            for name, value in fields.items():
                if value is not None:
                    result[name] = value
        if return_insertion_trace or generation_config.return_dict_in_generate:
            return result
        return result.sequences

    def _new_state(self, rows, max_steps, encoder_states) -> InsertionState:
        config = self.config
        return InsertionState(
            rows, max_steps + 2, config.decoder_embed_dim, encoder_states.device, encoder_states.dtype,
            config.bos_token_id, config.eos_token_id, config.pad_token_id,
        )

    def _start(self, state, encoder_states, encoder_mask, steps: DecoderSteps | None = None):
        cache = new_decoder_cache(self.config)
        last, cache = self._decode_step(
            state.tokens[:, :2], state.current_relations(), encoder_states, encoder_mask, cache, state, steps
        )
        return last, cache

    def _greedy_or_sample(
        self, encoder_states, encoder_mask, generation_config, processors, max_steps, with_trace, steps=None,
        criteria=None, streamer=None,
    ):
        config = self.config
        rows = encoder_states.shape[0]
        device = encoder_states.device
        state = self._new_state(rows, max_steps, encoder_states)
        last, cache = self._start(state, encoder_states, encoder_mask, steps)
        if streamer is not None:
            streamer.put(state.tokens[:, :2].cpu())
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        lengths = torch.full((rows,), 2, dtype=torch.long, device=device)
        total_log_prob = torch.zeros(rows, device=device)
        step_scores, step_logits, position_scores = [], [], []
        for _ in range(max_steps):
            logits = self._decoding_word_logits(last)
            if generation_config.output_logits:
                step_logits.append(logits)
            scores = processors(state.tokens[:, : state.length], logits)
            if generation_config.output_scores:
                step_scores.append(scores)
            if generation_config.do_sample:
                words = torch.multinomial(scores.softmax(-1), 1).squeeze(1)
            else:
                words = scores.argmax(-1)
            words = words.masked_fill(finished, config.pad_token_id)
            if streamer is not None:
                streamer.put(words.cpu())
            if with_trace:  # sequences_scores are only returned with the dict output
                word_log_prob = scores.log_softmax(-1).gather(1, words[:, None]).squeeze(1)
                total_log_prob += torch.where(finished, 0.0, word_log_prob)
            finished = finished | words.eq(config.eod_token_id)
            if bool(finished.all()):
                position_scores.append(torch.zeros(rows, device=device))
                break
            gaps, reading = self._position_log_probs(self.pointer_query(last, words)[:, None, :], state)
            gaps = gaps[:, 0]
            if generation_config.do_sample:
                gap = torch.multinomial(gaps.exp().clamp(min=0), 1).squeeze(1)
            else:
                gap = gaps.argmax(-1)
            gap_log_prob = torch.where(finished, 0.0, gaps.gather(1, gap[:, None]).squeeze(1))
            position_scores.append(gap_log_prob)
            if with_trace:
                total_log_prob += gap_log_prob
            anchors = reading.gather(1, gap[:, None]).squeeze(1)
            sides = torch.full_like(anchors, RIGHT)
            tokens = torch.where(finished, config.pad_token_id, words)
            lengths += (~finished).long()
            relation_row = state.insert(tokens, anchors, sides)
            if criteria:  # Transformers' rule: a criterion ends the rows it flags once their new token is in
                finished = finished | criteria(state.tokens[:, : state.length], scores).to(device)
                if bool(finished.all()):
                    break
            last, cache = self._decode_step(
                tokens[:, None], relation_row, encoder_states, encoder_mask, cache, state, steps
            )
        if streamer is not None:
            streamer.end()
        result = self._finalize(state.tokens, state.relations, state.anchors, state.sides, lengths, total_log_prob,
                                tuple(step_scores) if step_scores else None, with_trace)
        result.logits = tuple(step_logits) if step_logits else None
        result.position_scores = torch.stack(position_scores, 1) if position_scores else None
        return result

    def _beam_search(
        self, encoder_states, encoder_mask, generation_config, processors, max_steps, with_trace, steps=None,
        criteria=None,
    ):
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
        last, cache = self._start(state, encoder_states, encoder_mask, steps)
        beam_scores = torch.full((batch, beams), float("-inf"), device=device)
        beam_scores[:, 0] = 0.0
        beam_scores = beam_scores.view(-1)
        finished: list[list[tuple]] = [[] for _ in range(batch)]
        done = [False] * batch
        offsets = torch.arange(batch, device=device).repeat_interleave(beams) * beams
        dim = last.shape[-1]
        # Per live hypothesis and step: the row of that step's scores it descends from, and its gap's log-probability
        beam_history = torch.full((rows, max_steps), -1, dtype=torch.long, device=device)
        position_history = torch.zeros(rows, max_steps, device=device)
        step_scores, step_logits = [], []
        step = -1

        def snapshot(row: int, score: float, generated: int, last_origin: int | None = None) -> tuple:
            """(length-normalised score, raw score, tokens, relations, anchors, sides, beam indices, position
            scores) of one hypothesis; `last_origin`: the row its <eod> was chosen from this step."""
            n = state.length
            history = beam_history[row].clone()
            if last_origin is not None:
                history[step] = last_origin
            return (score / generated**length_penalty, score, state.tokens[row, :n].clone(),
                    state.relations[row, :n, :n].clone(), state.anchors[row, :n].clone(), state.sides[row, :n].clone(),
                    history, position_history[row].clone())

        for step in range(max_steps):
            logits = self._decoding_word_logits(last)
            if generation_config.output_logits:
                step_logits.append(logits)
            word_log_probs = processors(state.tokens[:, : state.length], logits.log_softmax(-1)).log_softmax(-1)
            if generation_config.output_scores:
                step_scores.append(word_log_probs)
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
                finished[sentence].append(
                    snapshot(row, float(eod_scores[sentence, flat]), state.length - 1, last_origin=row)
                )
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
            gap_log_probs = gaps[origin, word_slot].gather(1, gap).squeeze(1)
            beam_scores = top_scores.view(-1).masked_fill(
                torch.tensor(done, device=device).repeat_interleave(beams), float("-inf")
            )
            beam_history, position_history = beam_history[origin], position_history[origin]
            beam_history[:, step] = origin
            position_history[:, step] = gap_log_probs
            cache.reorder_cache(origin)
            state.reorder(origin)
            relation_row = state.insert(words, anchors, torch.full_like(anchors, RIGHT))
            if criteria:  # a flagged hypothesis ends here, as one that ran out of steps (Transformers' rule)
                stopped = criteria(state.tokens[:, : state.length], word_log_probs).to(device)
                for row in torch.nonzero(stopped & torch.isfinite(beam_scores)).flatten().tolist():
                    finished[row // beams].append(snapshot(row, float(beam_scores[row]), state.length - 2))
                beam_scores = beam_scores.masked_fill(stopped, float("-inf"))
                alive = torch.isfinite(beam_scores.view(batch, beams)).any(1).tolist()  # one host sync, not one a row
                for sentence in range(batch):
                    if not done[sentence] and not alive[sentence]:
                        finished[sentence].sort(key=lambda item: -item[0])
                        done[sentence] = True
                if all(done):
                    break
            last, cache = self._decode_step(
                words[:, None], relation_row, encoder_states, encoder_mask, cache, state, steps
            )
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
        for index, (_, _, hyp_tokens, hyp_relations, hyp_anchors, hyp_sides, _, _) in enumerate(selected):
            n = len(hyp_tokens)
            tokens[index, :n], relations[index, :n, :n] = hyp_tokens, hyp_relations
            anchors[index, :n], sides[index, :n], lengths[index] = hyp_anchors, hyp_sides, n
        scores = torch.tensor([item[0] for item in selected], device=device)
        result = self._finalize(tokens, relations, anchors, sides, lengths, scores,
                                tuple(step_scores) if step_scores else None, with_trace)
        steps_run = step + 1
        result.logits = tuple(step_logits) if step_logits else None
        result.beam_indices = torch.stack([item[6][:steps_run] for item in selected])
        result.position_scores = torch.stack([item[7][:steps_run] for item in selected])
        return result

    def compute_transition_scores(
        self, sequences: torch.Tensor, scores: tuple, beam_indices: torch.Tensor | None = None,
        normalize_logits: bool = False,
    ) -> torch.Tensor:
        """Transformers' ``compute_transition_scores`` for insertion decoding: ``[sequences, steps]``, the score (in
        ``scores``) of the word each step chose — each inserted word, then the ``<eod>`` that ended the hypothesis;
        0 after its end. ``sequences`` must be the output's ``insertion_ids`` (generation order), not its reading-order
        ``sequences``; ``beam_indices`` as returned by beam search. The whole step's log-probability adds the
        output's ``position_scores`` (the gap's, Eq. 11): with ``normalize_logits=True`` in greedy decoding, and
        as given in beam search, their sum is ``sequences_scores`` (times ``length ** length_penalty`` for beams).
        Without ``beam_indices``, a row with fewer words than steps reads its next step as ``<eod>`` (a row that a
        stopping criterion ended has none)."""
        config = self.config
        if (
            sequences.dim() != 2
            or sequences.shape[1] < 2
            or not (sequences[:, 0].eq(config.bos_token_id).all() and sequences[:, 1].eq(config.eos_token_id).all())
        ):
            raise ValueError(
                "InDIGO compute_transition_scores(): pass the generate output's insertion_ids (generation order: <s> "
                "</s>, then the words as they were inserted), not its sequences (reading order, where a step's word "
                "has no fixed place)"
            )
        steps, rows = len(scores), sequences.shape[0]
        words = sequences[:, 2:]
        word_counts = words.ne(config.pad_token_id).sum(-1)
        if beam_indices is None:
            beam_indices = torch.arange(scores[0].shape[0], device=sequences.device)[:, None].expand(-1, steps)
            step_counts = torch.clamp(word_counts + 1, max=steps)
        else:
            beam_indices = beam_indices[:, :steps]
            step_counts = beam_indices.ge(0).sum(-1)
        tokens = torch.full((rows, steps), config.eod_token_id, dtype=torch.long, device=sequences.device)
        width = min(words.shape[1], steps)
        tokens[:, :width] = torch.where(
            torch.arange(width, device=sequences.device)[None] < word_counts[:, None], words[:, :width],
            config.eod_token_id,
        )
        stacked = torch.stack(scores, 1).float()  # [rows of scores, steps, V]
        if normalize_logits:
            stacked = stacked.log_softmax(-1)
        in_hypothesis = torch.arange(steps, device=sequences.device)[None] < step_counts[:, None]
        step_index = torch.arange(steps, device=sequences.device)[None].expand(rows, -1)
        chosen = stacked[beam_indices.clamp(min=0), step_index, tokens]
        return chosen.masked_fill(~in_hypothesis, 0.0)

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
