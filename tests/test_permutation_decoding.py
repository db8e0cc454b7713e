"""Decoding constrained to a permutation of the source's words (word-order recovery)."""

from __future__ import annotations

import pytest
import torch
from transformers import PrefixConstrainedLogitsProcessor

from flexformers.training_scripts.permutation_decoding import (
    SourceWordPermutation,
    uses_permutation_of_source,
)
from flexformers.training_scripts.tokenizer import train_bpe_tokenizer
from tests.test_conformance import LEFT_TO_RIGHT_TYPES, tiny_model

TEXTS = [
    "Could not open the file.",
    "Save the file as %s",
    "Free software: you can redistribute it.",
    "the files are open",
    "The system user `%s' already exists.",
] * 20
SOURCES = ["file. the Could open not", "as Save file %s the", "`%s' user The already system exists. the the"]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(TEXTS, vocab_size=300)


def _decode_output(tokenizer, row: list[int]) -> str:
    return tokenizer.decode(row[: row.index(2)] if 2 in row else row, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(25))
def test_any_scores_give_a_permutation_of_the_source_words(tokenizer, seed):
    """Greedy choice under random scores, two hypotheses per source: every output ends, and its words are exactly
    the source's words (repeated words as often as in the source), whatever the scores preferred."""
    processor = PrefixConstrainedLogitsProcessor(SourceWordPermutation(SOURCES, tokenizer, eos_token_id=2), num_beams=2)
    generator = torch.Generator().manual_seed(seed)
    rows = 2 * len(SOURCES)
    ids = torch.full((rows, 1), 2)
    finished = torch.zeros(rows, dtype=torch.bool)
    for _ in range(60):
        scores = processor(ids, torch.randn(rows, len(tokenizer), generator=generator))
        following = torch.where(finished, torch.tensor(1), scores.argmax(-1))
        ids = torch.cat([ids, following[:, None]], dim=1)
        finished |= following == 2
        if finished.all():
            break
    assert finished.all()
    for row in range(rows):
        text = _decode_output(tokenizer, ids[row, 1:].tolist())
        assert sorted(text.split()) == sorted(SOURCES[row // 2].split())


def test_allowed_tokens_follow_the_remaining_words(tokenizer):
    """First word: its word-initial form (no leading-space marker); later words: the running-text form; </s> only
    once every word is placed."""
    processor = SourceWordPermutation(["open not"], tokenizer, eos_token_id=2)

    def ids(text):
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

    assert processor.allowed_tokens(0, ()) == {ids("open")[0], ids("not")[0]}
    after_open = ids("open")
    assert processor.allowed_tokens(0, after_open) == {ids(" not")[0]}
    assert processor.allowed_tokens(0, after_open + ids(" not")) == {2}
    assert processor.allowed_tokens(0, after_open + ids(" open")) is None  # not a reading of the source


@pytest.mark.parametrize("model_type", LEFT_TO_RIGHT_TYPES)
def test_greedy_and_beam_generation_output_permutations(tokenizer, model_type):
    """Through ``generate()`` of each untrained left-to-right model: greedy and beam outputs are permutations of
    their own source's words."""
    model = tiny_model(model_type, vocab_size=len(tokenizer))
    batch = tokenizer(SOURCES, return_tensors="pt", padding=True)
    for num_beams in (1, 3):
        constraint = SourceWordPermutation(SOURCES, tokenizer, eos_token_id=2)
        with torch.no_grad():
            output = model.generate(**batch, num_beams=num_beams, max_new_tokens=40,
                                    prefix_allowed_tokens_fn=constraint)
        for source, row in zip(SOURCES, output.tolist()):
            assert sorted(_decode_output(tokenizer, row[1:]).split()) == sorted(source.split())


def test_iot_asks_about_each_sentence_in_the_callers_order(tokenizer):
    """IOT regroups a batch by predicted decoder order inside ``generate()``: the constraint is still asked about
    each hypothesis's sentence as the caller numbered it (else outputs would permute another source's words)."""
    sources = SOURCES * 3
    batch = tokenizer(sources, return_tensors="pt", padding=True)
    for seed in range(30):
        model = tiny_model("iot", seed=seed, vocab_size=len(tokenizer))
        with torch.no_grad():
            codes = model.predict_orders(batch["input_ids"], batch["attention_mask"])[1].tolist()
        if len(set(codes)) > 1:  # the sources repeat, so their orders interleave: generate() regroups the batch
            break
    else:
        pytest.fail("no seed gave an untrained IOT model decoder orders out of batch order")
    with torch.no_grad():
        output = model.generate(**batch, num_beams=2, max_new_tokens=40,
                                prefix_allowed_tokens_fn=SourceWordPermutation(sources, tokenizer, eos_token_id=2))
    for source, row in zip(sources, output.tolist()):
        assert sorted(_decode_output(tokenizer, row[1:]).split()) == sorted(source.split())


def test_defaults_and_bad_requests():
    assert uses_permutation_of_source(None, "word_order", "flexformer")
    assert not uses_permutation_of_source(None, "word_order", "indigo")  # insertions are not a left-to-right prefix
    assert not uses_permutation_of_source(None, "translation", "mat")
    assert not uses_permutation_of_source(False, "word_order", "iot")
    assert uses_permutation_of_source(True, "translation", "flexformer")
    with pytest.raises(ValueError, match="InDIGO"):
        uses_permutation_of_source(True, "word_order", "indigo")
    with pytest.raises(ValueError, match="source 2 has no words"):
        SourceWordPermutation(["a b", "  "], None, eos_token_id=2)


def test_sentences_must_match_the_sources(tokenizer):
    constraint = SourceWordPermutation(SOURCES, tokenizer, eos_token_id=2)
    with pytest.raises(ValueError, match="sentence 3 of the batch, but only 3 sources"):
        constraint(3, torch.tensor([2]))
    assert constraint(0, torch.tensor([2, 9, 2, 1])) == [2]  # an ended hypothesis only continues with </s>


def test_trainer_evaluation_decodes_under_the_constraint(tokenizer, tmp_path):
    """``flexformers-train``'s validation during training generates as ``flexformers-decode`` does on the test set:
    the sources are read back from the batch and every generated output is a permutation of its source."""
    from transformers import Seq2SeqTrainingArguments

    from flexformers.training_scripts.trainer import FlexformersSeq2SeqTrainer

    model = tiny_model("flexformer", vocab_size=len(tokenizer))
    arguments = Seq2SeqTrainingArguments(output_dir=str(tmp_path), predict_with_generate=True, report_to=[],
                                         generation_max_length=40)
    trainer = FlexformersSeq2SeqTrainer(model=model, args=arguments, processing_class=tokenizer,
                                        permutation_source_tokenizer=tokenizer)
    batch = dict(tokenizer(SOURCES, return_tensors="pt", padding=True))
    batch["labels"] = tokenizer([" ".join(sorted(s.split())) for s in SOURCES], return_tensors="pt",
                                padding=True)["input_ids"]
    trainer._gen_kwargs = {"max_length": 40, "num_beams": 2}
    _, generated, _ = trainer.prediction_step(model, batch, prediction_loss_only=False)
    for source, row in zip(SOURCES, generated.tolist()):
        assert sorted(_decode_output(tokenizer, row[1:]).split()) == sorted(source.split())
