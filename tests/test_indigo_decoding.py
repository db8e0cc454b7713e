"""InDIGO's insertion decoding against independent computations: `compute_transition_scores` and `position_scores`
against the word and gap (Eq. 11) log-probabilities of a teacher-forced forward of the decoded insertion sequence,
summing to `sequences_scores` (greedy and beam search, Sec. 4.3); beam search's per-step outputs when it ends early;
the per-call decoder hidden states; the options and arguments `generate()` refuses (or, from a training batch, sets
aside); the search state on the device it is given; the SAO pointer cache's beam reorder; the CUDA-graph cache's
autocast."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation import LogitsProcessor, LogitsProcessorList

import flexformers.modeling  # noqa: F401  (registers the model types)
from flexformers.modeling.indigo_decoding import LEFT_TO_RIGHT_ONLY_OPTIONS, check_insertion_generation_config
from flexformers.modeling.indigo_insertion import (
    absolute_positions_from_relative,
    gap_log_probs,
    max_insertion_steps,
    reading_order_from_positions,
)
from flexformers.modeling.indigo_search_state import CapturedSearches, InsertionState, ReferencePointerCache
from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration
from flexformers.training_scripts.indigo_orders import InDIGODataCollator
from tests.test_indigo import tiny_config

SOURCE = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 11, 2, 1], [12, 2, 1, 1, 1]])


def tiny_model(seed: int) -> InDIGOForConditionalGeneration:
    torch.manual_seed(seed)
    return InDIGOForConditionalGeneration(tiny_config()).eval()


@pytest.fixture(scope="module")
def model() -> InDIGOForConditionalGeneration:
    """Greedy decoding of SOURCE ends sentence 1 after one word (then <eod>) and runs the others to the step limit;
    beam search (3 beams) of seed 0 ends sentence 0 after two words."""
    return tiny_model(0)


@pytest.fixture(scope="module")
def early_ending_model() -> InDIGOForConditionalGeneration:
    return tiny_model(11)


def teacher_forced_log_probs(model, source_row, insertion_ids, relations):
    """Per step of one decoded hypothesis, from ONE teacher-forced forward over its insertion sequence (not the
    incremental decoding): the log-probability of the word it inserted — then of the <eod> that ended it, if it
    ended — and of the gap the word went into (Eq. 9 slots summed per gap, Eq. 11)."""
    config = model.config
    n = int(insertion_ids.ne(config.pad_token_id).sum())
    tokens, relations = insertion_ids[None, :n], relations[:n, :n][None]
    mask = source_row[None].ne(config.pad_token_id).long()
    with torch.no_grad():
        encoder = model.model.encoder(source_row[None], attention_mask=mask).last_hidden_state
        hidden = model._decoder_outputs(tokens, relations, encoder, mask).last_hidden_state
        word_log_probs = model._decoding_word_logits(hidden[0]).log_softmax(-1)  # row t predicts step t - 1
        words, gaps = [], []
        for step in range(n - 2):
            query_index, token = step + 1, tokens[:, step + 2]
            words.append(float(word_log_probs[query_index, token]))
            query = model.pointer_query(hidden[:, query_index], token)[:, None]
            left, right = model.pointer_keys(hidden[:, : query_index + 1])
            slots = model.slot_log_probs(query, left, right)[:, 0]
            before = absolute_positions_from_relative(relations[0, : query_index + 1, : query_index + 1])
            after = absolute_positions_from_relative(relations[0, : query_index + 2, : query_index + 2])
            gap = int(after[query_index + 1]) - 1  # gap g: right of the word at reading position g
            gaps.append(float(gap_log_probs(slots, reading_order_from_positions(before)[None])[0, gap]))
        eod = float(word_log_probs[n - 1, config.eod_token_id])
    return words, gaps, eod


def test_greedy_transition_scores_are_the_teacher_forced_word_log_probabilities(early_ending_model):
    """HF's recipe for built-in models: with `normalize_logits=True`, each greedy step's transition score is the
    log-probability of the word it chose — here checked against a teacher-forced forward of the decoded insertion
    sequence — then the <eod> of a row that ended (and 0 after it); with `position_scores` (the gaps, Eq. 11) they
    add up to `sequences_scores`."""
    model, steps = early_ending_model, 6
    output = model.generate(SOURCE, max_new_tokens=steps, return_dict_in_generate=True, output_scores=True)
    transition = model.compute_transition_scores(output.insertion_ids, output.scores, normalize_logits=True)
    assert transition.shape == (3, len(output.scores)) == (3, steps)
    word_counts = output.insertion_ids.ne(model.config.pad_token_id).sum(-1) - 2
    assert word_counts.tolist() == [steps, 1, steps]  # sentence 1 ended after one word
    for row in range(3):
        words, gaps, eod = teacher_forced_log_probs(
            model, SOURCE[row], output.insertion_ids[row], output.relative_positions[row]
        )
        count = len(words)
        expected_words = torch.zeros(steps)
        expected_gaps = torch.zeros(steps)
        expected_words[:count], expected_gaps[:count] = torch.tensor(words), torch.tensor(gaps)
        if count < steps:
            expected_words[count] = eod
        torch.testing.assert_close(transition[row], expected_words, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(output.position_scores[row], expected_gaps, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(output.sequences_scores[row], expected_words.sum() + expected_gaps.sum(),
                                   atol=1e-4, rtol=1e-4)


def test_beam_transition_scores_add_up_to_the_model_log_likelihood(model):
    """Beam search: the transition scores along `beam_indices` plus `position_scores` are each returned hypothesis's
    log-likelihood under a teacher-forced forward (words, gaps, then its <eod> if it ended), and that sum over
    length ** length_penalty is `sequences_scores`."""
    length_penalty = 2.0
    output = model.generate(SOURCE, max_new_tokens=6, num_beams=3, length_penalty=length_penalty,
                            return_dict_in_generate=True, output_scores=True)
    transition = model.compute_transition_scores(output.insertion_ids, output.scores, output.beam_indices)
    assert transition.shape == output.beam_indices.shape == (3, len(output.scores))
    lengths = output.beam_indices.ge(0).sum(-1)
    assert lengths.tolist() == [3, 6, 6]  # sentence 0: two words, then <eod>
    step_scores = transition + output.position_scores
    torch.testing.assert_close(step_scores.sum(-1) / lengths.float() ** length_penalty, output.sequences_scores,
                               atol=1e-4, rtol=1e-4)
    for row in range(3):
        words, gaps, eod = teacher_forced_log_probs(
            model, SOURCE[row], output.insertion_ids[row], output.relative_positions[row]
        )
        ended = int(lengths[row]) > len(words)
        expected = torch.tensor(words + [eod] * ended) + torch.tensor(gaps + [0.0] * ended)
        torch.testing.assert_close(step_scores[row, : int(lengths[row])], expected, atol=1e-4, rtol=1e-4)
        assert not step_scores[row, int(lengths[row]):].any()  # nothing after the end


class EndAfter(LogitsProcessor):
    """Only <eod> once the insertion sequence holds `words` words: every hypothesis ends there."""

    def __init__(self, words: int, eod: int):
        self.words, self.eod = words, eod

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - 2 >= self.words:
            forced = torch.full_like(scores, float("-inf"))
            forced[:, self.eod] = 0.0
            return forced
        return scores


def test_a_beam_search_that_ends_early_reports_its_steps_only(model):
    """A search that ends before `max_new_tokens` gives one beam index and one position score per step it ran, as
    many as `scores`, and each hypothesis ends with the <eod> step."""
    processors = LogitsProcessorList([EndAfter(2, model.config.eod_token_id)])
    output = model.generate(SOURCE, max_new_tokens=8, num_beams=3, num_return_sequences=2, logits_processor=processors,
                            return_dict_in_generate=True, output_scores=True, length_penalty=1.0)
    assert len(output.scores) == 3  # two words, then <eod>
    assert output.beam_indices.shape == output.position_scores.shape == (6, 3)
    assert output.beam_indices.ge(0).all()
    sentence = torch.arange(3).repeat_interleave(2)
    assert torch.equal(output.beam_indices // 3, sentence[:, None].expand(-1, 3))  # rows of the hypothesis's sentence
    # the first word has one gap (certain), the second two; <eod> has no gap
    assert output.position_scores[:, 0].abs().max() < 1e-6 and (output.position_scores[:, 1] < 0).all()
    assert not output.position_scores[:, 2].any()
    transition = model.compute_transition_scores(output.insertion_ids, output.scores, output.beam_indices)
    torch.testing.assert_close((transition + output.position_scores).sum(-1) / 3, output.sequences_scores,
                               atol=1e-4, rtol=1e-4)


def test_compute_transition_scores_refuses_what_is_not_insertion_ids(model):
    """Anything but a batch of insertion sequences (2-D, `<s> </s>` first) is refused with a message naming
    `insertion_ids`: one row, a batch without `</s>`, the reading-order `sequences`."""
    output = model.generate(SOURCE, max_new_tokens=3, return_dict_in_generate=True, output_scores=True)
    wrong = [output.insertion_ids[0], output.insertion_ids[:, :1], output.insertion_ids[:, :0], output.sequences]
    for sequences in wrong:
        with pytest.raises(ValueError, match="insertion_ids"):
            model.compute_transition_scores(sequences, output.scores)


def test_decoder_hidden_states_of_every_call_equal_a_full_forward(model):
    """`output_hidden_states`: `decoder_hidden_states` per decoder call (the start <s> </s>, then each inserted word),
    per block; concatenated over the calls they are the hidden states of a teacher-forced forward of the whole
    insertion sequence."""
    output = model.generate(SOURCE[:1], max_new_tokens=3, return_dict_in_generate=True, output_hidden_states=True)
    calls = output.decoder_hidden_states
    assert isinstance(calls, tuple) and len(calls) == 1 + 3  # <s> </s>, then one call per word but the last
    tokens, relations = output.insertion_ids[:, :4], output.relative_positions[:, :4, :4]
    mask = SOURCE[:1].ne(model.config.pad_token_id).long()
    with torch.no_grad():
        encoder = model.model.encoder(SOURCE[:1], attention_mask=mask).last_hidden_state
        full = model._decoder_outputs(tokens, relations, encoder, mask, output_hidden_states=True).hidden_states
    assert len(full) == len(calls[0]) == model.config.decoder_layers + 1
    for block, expected in enumerate(full):
        incremental = torch.cat([call[block] for call in calls[:3]], 1)
        torch.testing.assert_close(incremental, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [name for name, (neutral, _) in LEFT_TO_RIGHT_ONLY_OPTIONS.items()
                                  if any(value is not None for value in neutral)])
def test_an_option_is_refused_unless_it_has_one_of_its_neutral_values(model, name):
    """An option that some non-None values leave off (`num_beam_groups=1`, `guidance_scale=1.0`, `low_memory=False`,
    ...) takes those, and any other value is refused by name."""
    neutral, _ = LEFT_TO_RIGHT_ONLY_OPTIONS[name]
    for value in neutral:
        config = GenerationConfig()
        setattr(config, name, value)
        check_insertion_generation_config(config, model.config)
    other = {bool: True, int: 3, float: 0.5}[type(next(value for value in neutral if value is not None))]
    config = GenerationConfig()
    setattr(config, name, other)
    with pytest.raises(ValueError, match=f"{name}={other!r} cannot be used"):
        check_insertion_generation_config(config, model.config)


@pytest.mark.parametrize("order", ["l2r", "sao"])
def test_generate_sets_aside_every_key_of_a_training_batch(model, order):
    """Seq2SeqTrainer's evaluation passes the whole collated batch to `generate()`: the insertion batch's targets,
    and the SAO batch's `target_ids` / `target_lengths`, are set aside — the output is the source's alone."""
    batch = InDIGODataCollator(order=order)(
        [{"input_ids": [5, 6, 2], "labels": [12, 13, 14, 2]}, {"input_ids": [7, 2], "labels": [15, 2]}]
    )
    alone = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=3)
    assert torch.equal(model.generate(**batch, max_new_tokens=3), alone)


def test_assistant_model_is_refused_with_the_reason(model):
    with pytest.raises(ValueError, match="assistant_model cannot be used: assisted decoding verifies left-to-right"):
        model.generate(SOURCE, max_new_tokens=3, assistant_model=model)


def test_search_state_lives_on_the_device_it_is_given():
    """Every tensor of the insertion state and of the SAO pointer cache is made on the given device (here "meta",
    which needs no accelerator): a CUDA search never mixes in a CPU tensor."""
    state = InsertionState(2, 6, 8, torch.device("meta"), torch.float32, bos=0, eos=2, pad=1)
    tensors = {name: value for name, value in vars(state).items() if isinstance(value, torch.Tensor)}
    assert set(tensors) == {"tokens", "relations", "left_keys", "right_keys", "anchors", "sides"}
    assert all(tensor.is_meta for tensor in tensors.values()), {n: t.device for n, t in tensors.items()}
    cache = ReferencePointerCache(torch.zeros(2, 5, 8, device="meta"), beams=3, capacity=6, dtype=torch.float32)
    assert cache.keys.is_meta and cache.word_logits.is_meta


def test_pointer_cache_beam_reorder_copies_only_the_filled_positions():
    """Beam selection gathers the positions filled so far into the spare buffer pair and nothing beyond (the
    rest is written by later appends before it is read)."""
    generator = torch.Generator().manual_seed(0)
    cache = ReferencePointerCache(torch.randn(1, 4, 3, generator=generator), beams=2, capacity=5, dtype=torch.float32)
    cache.append(torch.randn(2, 2, 3, generator=generator), torch.randn(2, 2, 3, generator=generator))
    unfilled = slice(cache.length, None)
    cache.keys[:, :, unfilled], cache.word_logits[:, :, unfilled] = 7.0, 7.0
    swap = torch.tensor([1, 0])
    expected_keys, expected_words = cache.keys[swap, :, :2].clone(), cache.word_logits[swap, :, :2].clone()
    cache.reorder(swap)  # into a fresh spare pair; the pair marked 7 becomes the spare
    cache.keys[:, :, unfilled], cache.word_logits[:, :, unfilled] = -3.0, -3.0
    cache.reorder(torch.tensor([0, 1]))  # back into the pair marked 7
    assert torch.equal(cache.keys[:, :, :2], expected_keys) and torch.equal(cache.word_logits[:, :, :2], expected_words)
    assert cache.keys[:, :, unfilled].eq(7.0).all() and cache.word_logits[:, :, unfilled].eq(7.0).all()


def test_captured_searches_run_under_the_autocast_of_their_key(monkeypatch):
    """A captured search (its capture and every replay) runs under the CUDA autocast its key records — enabled or
    not, and its dtype — with the weight-cast cache off. The capture is faked (no GPU here) and autocast recorded."""
    entered = []

    def recording_autocast(device_type, dtype=None, enabled=True, cache_enabled=None):
        resolved = torch.get_autocast_dtype(device_type) if dtype is None else dtype
        return contextlib.nullcontext(entered.append((device_type, resolved, enabled, cache_enabled)))

    def fake_capture(search, inputs):
        static_outputs = search(*inputs)
        return type("Graph", (), {"replay": staticmethod(lambda: None)})(), inputs, static_outputs

    monkeypatch.setattr(torch, "autocast", recording_autocast)
    monkeypatch.setattr(CapturedSearches, "_capture", staticmethod(fake_capture))
    graphs = CapturedSearches()
    double = lambda x: (2 * x,)
    for autocast in ((True, torch.bfloat16), (False, torch.float16)):
        key = ((torch.Size([3]),), autocast, False, (), ())
        for _ in range(3):  # eager, captured, replayed
            graphs.run(key, double, (torch.ones(3),))
        assert entered[-2:] == [("cuda", autocast[1], autocast[0], False)] * 2
    assert len(entered) == 4  # the eager first call of a shape runs as called


# Round 2 mutation survivors (issue 65)


class EodBias(LogitsProcessor):
    """Adds `bias` to <eod>'s score: hypotheses end early and often, so the beams fill with finished ones."""

    def __init__(self, bias: float, eod: int):
        self.bias, self.eod = bias, eod

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.eod] += self.bias
        return scores


def test_early_stopping_true_false_and_never_end_the_beam_search_as_transformers_defines_them(early_ending_model):
    """Transformers' three `early_stopping` values: True ends a sentence once it has `num_beams` finished
    hypotheses; False also waits until its best live hypothesis (length-normalised) cannot beat the worst finished
    one; "never" never ends early, so it runs to `max_new_tokens` (live hypotheses never include an <eod>). Stopping
    later can only improve each returned rank. Without length normalisation (`length_penalty=0`) scores only fall as
    a hypothesis grows, so False's test is exact: it ends before "never" yet returns the same hypotheses."""
    model, steps = early_ending_model, 8

    processors = LogitsProcessorList([EodBias(1.0, model.config.eod_token_id)])

    def search(early_stopping, length_penalty):
        return model.generate(
            SOURCE, max_new_tokens=steps, num_beams=3, num_return_sequences=3, early_stopping=early_stopping,
            length_penalty=length_penalty, logits_processor=processors, return_dict_in_generate=True,
            output_scores=True,
        )

    for length_penalty in (0.0, 2.0):
        first, heuristic, never = (search(value, length_penalty) for value in (True, False, "never"))
        assert len(first.scores) < steps and len(never.scores) == steps
        assert len(first.scores) <= len(heuristic.scores) <= len(never.scores)
        assert (heuristic.sequences_scores >= first.sequences_scores).all()
        assert (never.sequences_scores >= heuristic.sequences_scores).all()
        if length_penalty == 0.0:
            assert len(first.scores) < len(heuristic.scores) < steps  # three different ends ...
            assert torch.equal(heuristic.insertion_ids, never.insertion_ids)  # ... the last two with the same result
            assert torch.equal(heuristic.sequences_scores, never.sequences_scores)
        else:  # a long hypothesis can win after a length-normalised stop: waiting finds better ones
            assert (never.sequences_scores > first.sequences_scores).any()


def test_generate_attentions_of_every_call_are_a_full_forwards_rows(model):
    """`output_attentions` alone: `decoder_attentions` and `cross_attentions` per decoder call (<s> </s>, then each
    inserted word), per block, are the rows of a teacher-forced forward's self- and cross-attention weights over the
    whole insertion sequence (keys: the words inserted so far); no hidden states are collected."""
    output = model.generate(SOURCE[:1], max_new_tokens=3, return_dict_in_generate=True, output_attentions=True)
    assert output.decoder_hidden_states is None
    calls_self, calls_cross = output.decoder_attentions, output.cross_attentions
    assert len(calls_self) == len(calls_cross) == 1 + 3  # <s> </s>, then one call per word
    n = int(output.insertion_ids.ne(model.config.pad_token_id).sum())
    assert n == 2 + 3
    tokens, relations = output.insertion_ids[:, :n], output.relative_positions[:, :n, :n]
    with torch.no_grad():  # the public teacher-forced forward over the whole insertion sequence
        full = model(input_ids=SOURCE[:1], decoder_input_ids=tokens, relative_positions=relations,
                     output_attentions=True)
    layers = model.config.decoder_layers
    assert len(full.decoder_attentions) == len(calls_self[0]) == len(calls_cross[0]) == layers
    for block in range(layers):
        for call in range(len(calls_self)):
            rows = slice(0, 2) if call == 0 else slice(call + 1, call + 2)
            keys = rows.stop
            torch.testing.assert_close(calls_self[call][block], full.decoder_attentions[block][:, :, rows, :keys],
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(calls_cross[call][block], full.cross_attentions[block][:, :, rows],
                                       atol=1e-5, rtol=1e-5)


def test_sao_order_weights_default_is_eq_12_uniform_over_the_found_orders():
    """Without a weighting, `sao_order_weights` is the paper's Eq. 12: `q(π|x, y) = 1/B` over the orders found for the
    sentence (1, 2 or 3 here), 0 on a missing (-inf) beam, whatever the scores — not their posterior."""
    from flexformers.modeling.indigo_insertion import sao_order_weights

    inf = float("inf")
    scores = torch.tensor([[-0.5, -inf, -inf], [-1.0, -7.0, -inf], [-3.0, -1.0, -2.0]])
    expected = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    torch.testing.assert_close(sao_order_weights(scores), expected)
    assert not torch.allclose(sao_order_weights(scores, "posterior"), expected)


def test_sao_search_default_beam_is_eight_orders(model):
    """`search_adaptive_orders` without `beam_size` keeps B = 8 orders per sentence (the model's `sao_beam_size`):
    the same orders and scores as `beam_size=8`, 8 distinct permutations of each 4-word reference (24 exist)."""
    targets = torch.tensor([[12, 13, 14, 15], [16, 17, 18, 2]])
    lengths = torch.tensor([4, 4])
    mask = SOURCE[:2].ne(model.config.pad_token_id)
    with torch.no_grad():
        encoder = model.model.encoder(SOURCE[:2], attention_mask=mask).last_hidden_state
        orders, scores = model.search_adaptive_orders(encoder, mask, targets, lengths)
        explicit = model.search_adaptive_orders(encoder, mask, targets, lengths, beam_size=8)
    assert model.sao_beam_size == 8 and orders.shape == (2, 8, 4) and torch.isfinite(scores).all()
    assert torch.equal(orders, explicit[0]) and torch.equal(scores, explicit[1])
    for sentence in range(2):
        assert len({tuple(order) for order in orders[sentence].tolist()}) == 8
        assert all(sorted(order) == [0, 1, 2, 3] for order in orders[sentence].tolist())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: CUDA graphs exist only there")
def test_sao_search_replayed_as_a_cuda_graph_finds_what_the_eager_search_finds():
    """`sao_search_cuda_graphs` on a GPU: a shape's first call runs eagerly, the second captures the search, later
    ones replay it on their own inputs (copied into the graph's buffers); every call finds the eager search's orders
    and scores for its inputs."""
    from flexformers.modeling.indigo_search_state import _CAPTURED_SEARCHES

    device = torch.device("cuda")
    model = tiny_model(0).to(device)
    model.sao_search_dropout = False
    source = SOURCE[:2].to(device)
    mask = source.ne(model.config.pad_token_id)
    lengths = torch.tensor([4, 3], device=device)
    references = [torch.tensor([[12, 13, 14, 15], [16, 17, 2, 1]], device=device),
                  torch.tensor([[20, 21, 22, 23], [24, 25, 26, 1]], device=device)]
    with torch.no_grad():
        encoder = model.model.encoder(source, attention_mask=mask).last_hidden_state
        for call, targets in enumerate([references[0], references[0], references[1], references[0]]):
            model.sao_search_cuda_graphs = False
            eager = model.search_adaptive_orders(encoder, mask, targets, lengths, beam_size=3)
            model.sao_search_cuda_graphs = True
            graphed = model.search_adaptive_orders(encoder, mask, targets, lengths, beam_size=3)
            assert torch.equal(graphed[0], eager[0]), call
            torch.testing.assert_close(graphed[1], eager[1], atol=1e-4, rtol=1e-4)
    assert len(_CAPTURED_SEARCHES[model]) == 1


# ---- issue 65, round 3: the held-out sample's (seed 2) survivors ----

TRAINING_BATCH_KEYS = ("labels", "insertion_targets", "pointer_targets", "insertion_labels", "pointer_labels",
                       "relative_positions", "target_ids", "target_lengths", "num_items_in_batch")


@pytest.mark.parametrize("key", TRAINING_BATCH_KEYS)
def test_generate_sets_aside_each_training_batch_key_even_alone(model, key):
    """Any one key of a training batch marks the call as an evaluation step's: it and the teacher-forced decoder
    inputs are set aside, whatever else the batch holds."""
    alone = model.generate(SOURCE, max_new_tokens=3)
    filler = torch.zeros(SOURCE.shape[0], 4, dtype=torch.long)
    with_key = model.generate(SOURCE, max_new_tokens=3, decoder_input_ids=filler,
                              decoder_attention_mask=torch.ones_like(filler), **{key: filler})
    assert torch.equal(with_key, alone)


@pytest.mark.parametrize("key", ["decoder_input_ids", "decoder_attention_mask"])
def test_a_left_to_right_prefix_is_refused_outside_a_training_batch(model, key):
    with pytest.raises(ValueError, match=f"InDIGO generate\\(\\): {key} cannot be used: insertion decoding"):
        model.generate(SOURCE, max_new_tokens=3, **{key: torch.ones(SOURCE.shape[0], 2, dtype=torch.long)})


@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_stopping_criterion_ends_insertion_decoding_for_every_sentence(model, num_beams):
    """A criterion that flags every hypothesis once `<s> </s>` has two words inserted: greedy and beam search both
    end there, every sentence with its best hypothesis of that length."""
    from transformers.generation import StoppingCriteria, StoppingCriteriaList

    class StopAtFourTokens(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 4, dtype=torch.bool)

    output = model.generate(SOURCE, max_new_tokens=8, num_beams=num_beams, return_dict_in_generate=True,
                            output_scores=True, stopping_criteria=StoppingCriteriaList([StopAtFourTokens()]))
    assert output.sequences.shape == (SOURCE.shape[0], 4)
    assert output.insertion_ids.shape[1] == 4


# ---------------------------------------------- round 4 (docs/MUTATION.md): what seed 3's survivors showed untested


def test_the_streamer_first_receives_exactly_the_start_pair(model):
    """Insertion decoding starts from `<s> </s>`: the streamer's first put is that pair for every row, nothing more,
    then one inserted word per row and step."""
    from tests.test_generate_options import RecordingStreamer

    streamer = RecordingStreamer()
    with torch.no_grad():
        model.generate(SOURCE, max_new_tokens=3, streamer=streamer)
    config = model.config
    assert torch.equal(streamer.puts[0], torch.tensor([[config.bos_token_id, config.eos_token_id]] * SOURCE.shape[0]))
    assert all(put.shape == (SOURCE.shape[0],) for put in streamer.puts[1:]) and streamer.ended


def test_the_pointer_cache_keeps_its_keys_in_the_dtype_it_is_given():
    """The SAO search's pointer keys are kept in the search's dtype (a float64 or bfloat16 search keeps its
    precision); the word logits are float32 whatever it is."""
    for dtype in (torch.float64, torch.bfloat16):
        cache = ReferencePointerCache(torch.zeros(2, 5, 8), beams=3, capacity=6, dtype=dtype)
        assert cache.keys.dtype == dtype and cache.word_logits.dtype == torch.float32


def test_early_stopping_false_ends_when_transformers_heuristic_says_so(early_ending_model):
    """`early_stopping=False` compares the best live hypothesis, normalised by its length in words (the same
    count as a finished one's: the words placed plus the one being chosen), with the worst finished one. Stored
    expected outputs of the seeded tiny model: how many steps the search runs, and the scores it returns."""
    model = early_ending_model
    processors = LogitsProcessorList([EodBias(1.0, model.config.eod_token_id)])
    expected = {  # length_penalty -> (steps, last sentence's three returned scores)
        0.5: (5, [-3.2829, -5.0600, -5.1071]),
        1.0: (5, [-2.3213, -2.5153, -2.5300]),
    }
    for length_penalty, (steps, scores) in expected.items():
        with torch.no_grad():
            output = model.generate(
                SOURCE, max_new_tokens=8, num_beams=3, num_return_sequences=3, early_stopping=False,
                length_penalty=length_penalty, logits_processor=processors, return_dict_in_generate=True,
                output_scores=True,
            )
        assert len(output.scores) == steps
        torch.testing.assert_close(output.sequences_scores[-3:], torch.tensor(scores), atol=1e-4, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: a CPU run cannot tell devices apart")
@pytest.mark.parametrize("num_beams", [1, 3])
def test_insertion_decoding_and_its_transition_scores_on_a_gpu_match_the_cpu(num_beams):
    """Greedy and beam insertion decoding on a CUDA model, and `compute_transition_scores` of its outputs, build
    every index on the model's device and return what the CPU returns (issue 65: `_beam_search`'s and
    `compute_transition_scores`' device arguments, which the CPU suite cannot see)."""
    results = []
    for device in ("cpu", "cuda"):
        model = tiny_model(7).to(device).eval()
        with torch.no_grad():
            output = model.generate(SOURCE.to(device), max_new_tokens=6, num_beams=num_beams,
                                    return_dict_in_generate=True, output_scores=True)
        beam_indices = output.beam_indices if num_beams > 1 else None
        transition = model.compute_transition_scores(output.insertion_ids, output.scores, beam_indices,
                                                     normalize_logits=num_beams == 1)
        assert transition.device.type == device
        results.append((output.sequences.cpu(), transition.cpu()))
    (cpu_sequences, cpu_transition), (gpu_sequences, gpu_transition) = results
    assert torch.equal(gpu_sequences, cpu_sequences)
    torch.testing.assert_close(gpu_transition, cpu_transition, atol=1e-4, rtol=1e-4)


# ------------------------------------------- learned insertion-step positions: a decode and a run fit their table


class NeverEndDecoding(LogitsProcessor):
    """Forbids `<eod>`, so a decode runs every step it is allowed."""

    def __call__(self, input_ids, scores):
        return scores.index_fill(-1, torch.tensor([tiny_config().eod_token_id]), float("-inf"))


@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_decode_with_learned_step_positions_stops_at_the_last_step_its_table_holds(num_beams):
    """After k steps the decoder has read the start pair and k words: with learned insertion-step positions (the
    ablation) and 6 of them, 4 steps fit and a 5th would read 7 positions. Asked for 20, the decode runs 4 and never
    raises."""
    torch.manual_seed(0)
    model = InDIGOForConditionalGeneration(tiny_config(decoder_use_positions=True, decoder_learned_pos=True,
                                                       max_target_positions=6)).eval()
    assert max_insertion_steps(model.config) == 4
    output = model.generate(SOURCE, max_new_tokens=20, num_beams=num_beams,
                            logits_processor=LogitsProcessorList([NeverEndDecoding()]))
    assert output.shape[1] == 2 + 4
    with pytest.raises(ValueError, match="exceeds the 6 learned positions"):
        model._decoder_states(torch.ones(1, 7, dtype=torch.long), torch.zeros(1, 7, 7, dtype=torch.int8),
                              model.model.encoder(SOURCE[:1]).last_hidden_state, None)
    # the paper's decoder has no position table: the words alone are bounded by it
    assert max_insertion_steps(tiny_config(max_target_positions=6)) == 6


@pytest.mark.parametrize("max_target_length, refused", [(5, False), (6, True)])
def test_the_training_length_check_counts_the_start_pair_of_insertion_decoding(max_target_length, refused):
    """A tokenized target of n tokens (its `</s>` last) is read by InDIGO's decoder as `<s> </s>` and n - 1 words:
    one token more, which its MethodSpec declares, so a run whose targets would overrun learned insertion-step
    positions is refused before training, naming the extra token."""
    from types import SimpleNamespace

    from flexformers.training_scripts.arguments import DataArguments
    from flexformers.training_scripts.methods.indigo import SPEC
    from flexformers.training_scripts.train import check_config_fits_run

    config = tiny_config(decoder_use_positions=True, decoder_learned_pos=True, max_target_positions=6)
    data_args = DataArguments(max_source_length=8, max_target_length=max_target_length)
    arguments = (config, data_args, SimpleNamespace(generation_max_length=None), None, SPEC.decoder_tokens_beyond_target)
    if refused:
        with pytest.raises(ValueError, match=r"--max_target_length 6 plus the 1 decoder token\(s\) the method adds \(7\) "
                                             r"exceeds the model's max_target_positions 6"):
            check_config_fits_run(*arguments)
    else:
        check_config_fits_run(*arguments)
    # the paper's decoder has no absolute positions, so nothing to overrun
    check_config_fits_run(tiny_config(max_target_positions=6), *arguments[1:])
