"""Decoding constrained to a permutation of the source's words (word-order recovery)."""

from __future__ import annotations

import pytest
import torch

from flexformers.training_scripts.permutation_decoding import (
    SourceWordPermutationLogitsProcessor,
    uses_permutation_of_source,
)
from flexformers.training_scripts.tokenizer import train_bpe_tokenizer
from tests.test_conformance import tiny_model

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
    processor = SourceWordPermutationLogitsProcessor(SOURCES, tokenizer, eos_token_id=2)
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
    processor = SourceWordPermutationLogitsProcessor(["open not"], tokenizer, eos_token_id=2)
    ids = lambda text: tuple(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    assert processor.allowed_tokens(0, ()) == {ids("open")[0], ids("not")[0]}
    after_open = ids("open")
    assert processor.allowed_tokens(0, after_open) == {ids(" not")[0]}
    assert processor.allowed_tokens(0, after_open + ids(" not")) == {2}
    assert processor.allowed_tokens(0, after_open + ids(" open")) is None  # not a reading of the source


def test_greedy_and_beam_generation_output_permutations(tokenizer):
    """Through ``generate()`` of an untrained model: greedy and beam outputs are permutations of the words."""
    model = tiny_model("flexformer", vocab_size=len(tokenizer))
    batch = tokenizer(SOURCES, return_tensors="pt", padding=True)
    for num_beams in (1, 3):
        processor = SourceWordPermutationLogitsProcessor(SOURCES, tokenizer, eos_token_id=2)
        with torch.no_grad():
            output = model.generate(**batch, num_beams=num_beams, max_new_tokens=40, logits_processor=[processor])
        for source, row in zip(SOURCES, output.tolist()):
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
        SourceWordPermutationLogitsProcessor(["a b", "  "], None, eos_token_id=2)


def test_rows_must_match_the_sources(tokenizer):
    processor = SourceWordPermutationLogitsProcessor(SOURCES, tokenizer, eos_token_id=2)
    with pytest.raises(ValueError, match="4 hypotheses for 3 sources"):
        processor(torch.full((4, 1), 2), torch.zeros(4, len(tokenizer)))


def test_trainer_evaluation_decodes_under_the_constraint(tokenizer, tmp_path):
    """``flexformers-train``'s validation during training generates as ``flexformers-decode`` does on the test set:
    the sources are read back from the batch and every generated output is a permutation of its source."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from flexformers.training_scripts.permutation_decoding import with_permutation_constrained_evaluation

    model = tiny_model("flexformer", vocab_size=len(tokenizer))
    trainer_class = with_permutation_constrained_evaluation(Seq2SeqTrainer, tokenizer)
    arguments = Seq2SeqTrainingArguments(output_dir=str(tmp_path), predict_with_generate=True, report_to=[],
                                         generation_max_length=40)
    trainer = trainer_class(model=model, args=arguments, processing_class=tokenizer)
    batch = dict(tokenizer(SOURCES, return_tensors="pt", padding=True))
    batch["labels"] = tokenizer([" ".join(sorted(s.split())) for s in SOURCES], return_tensors="pt",
                                padding=True)["input_ids"]
    trainer._gen_kwargs = {"max_length": 40, "num_beams": 2}
    _, generated, _ = trainer.prediction_step(model, batch, prediction_loss_only=False)
    for source, row in zip(SOURCES, generated.tolist()):
        assert sorted(_decode_output(tokenizer, row[1:]).split()) == sorted(source.split())
