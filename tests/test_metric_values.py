"""Metric VALUES, not keys: every score the package reports is checked against sacrebleu computed here, directly, on
small handmade corpora where the hypotheses, the sources (the copy-the-input baseline) and the references all
differ, so a score computed on the wrong texts, with swapped arguments or a dropped option cannot pass."""

import json
import types

import numpy as np
import pytest
import sacrebleu

from flexformers.training_scripts import decode
from flexformers.training_scripts.metrics_utils import (
    compute_generation_metrics,
    copy_baseline_metrics,
    gain_over_copy,
    load_metric,
)

# three pairs where the model's hypotheses, the sources it read and the references are three different texts: the
# hypotheses are close to the references, the sources (copying the input) much less so
SOURCES = ["the mat sat on a cat .", "dogs and cats were running , fast .", "green ideas sleep furiously tonight ."]
REFERENCES = ["the cat sat on the mat .", "the dogs were running fast .", "colourless green ideas sleep furiously ."]
HYPOTHESES = ["the cat sat on a mat .", "the dogs were running .", "colourless green ideas sleep ."]


def bleu(hypotheses, references, **options):
    return sacrebleu.BLEU(**options).corpus_score(hypotheses, [references]).score


def chrf(hypotheses, references, **options):
    return sacrebleu.CHRF(**options).corpus_score(hypotheses, [references]).score


def ter(hypotheses, references, **options):
    return sacrebleu.TER(**options).corpus_score(hypotheses, [references]).score


def signature(metric_class, hypotheses, references, **options):
    """sacrebleu's signature of ``metric_class(**options)`` once it has scored (it names the reference count)."""
    metric = metric_class(**options)
    metric.corpus_score(hypotheses, [references])
    return str(metric.get_signature())


def test_the_handmade_corpus_tells_hypotheses_sources_and_references_apart():
    """The premise of every test below: each text set scores differently, in both argument orders."""
    assert bleu(HYPOTHESES, REFERENCES) > bleu(SOURCES, REFERENCES) + 10
    assert bleu(HYPOTHESES, REFERENCES) != pytest.approx(bleu(REFERENCES, HYPOTHESES), abs=0.01)
    assert bleu(SOURCES, REFERENCES) != pytest.approx(bleu(REFERENCES, SOURCES), abs=0.01)
    assert chrf(HYPOTHESES, REFERENCES) != pytest.approx(chrf(SOURCES, REFERENCES), abs=0.01)
    assert ter(HYPOTHESES, REFERENCES) != pytest.approx(ter(SOURCES, REFERENCES), abs=0.01)
    assert ter(HYPOTHESES, REFERENCES) != pytest.approx(ter(REFERENCES, HYPOTHESES), abs=0.01)


# ------------------------------------------------------------------------------------------- local metric modules
def test_bleu_module_equals_sacrebleu_with_every_statistic():
    result = load_metric("bleu").compute(predictions=HYPOTHESES, references=REFERENCES)
    expected = sacrebleu.BLEU().corpus_score(HYPOTHESES, [REFERENCES])
    assert result["score"] == pytest.approx(expected.score, abs=1e-9)
    assert result["counts"] == expected.counts and result["totals"] == expected.totals
    assert result["precisions"] == pytest.approx(expected.precisions)
    assert result["bp"] == pytest.approx(expected.bp)
    assert (result["sys_len"], result["ref_len"]) == (expected.sys_len, expected.ref_len) != (
        expected.ref_len, expected.sys_len)
    assert result["signature"] == signature(sacrebleu.BLEU, HYPOTHESES, REFERENCES)


def test_bleu_module_perfect_match_is_100_and_total_miss_is_0():
    bleu_metric = load_metric("bleu")
    assert bleu_metric.compute(predictions=REFERENCES, references=REFERENCES)["score"] == pytest.approx(100.0)
    miss = bleu_metric.compute(predictions=["alpha beta gamma delta", "epsilon zeta eta theta"],
                               references=["one two three four", "five six seven eight"])
    assert miss["score"] == 0.0


def test_bleu_module_empty_hypotheses_are_scored_as_sacrebleu_scores_them():
    hypotheses = ["", HYPOTHESES[1], ""]
    result = load_metric("bleu").compute(predictions=hypotheses, references=REFERENCES)
    assert result["score"] == pytest.approx(bleu(hypotheses, REFERENCES), abs=1e-9)
    assert result["score"] < bleu(HYPOTHESES, REFERENCES)  # the empty lines cost the brevity penalty
    assert load_metric("bleu").compute(predictions=["", ""], references=REFERENCES[:2])["score"] == 0.0


# a corpus where case, punctuation attached to words and characters matter
CASED_HYPOTHESES = ["The Cat sat, on the mat.", "Dogs were running", "Sleep furiously tonight"]
CASED_REFERENCES = ["the cat sat on the mat .", "the dogs were running fast .", "ideas sleep furiously ."]
# one where no 4-gram matches (smoothing decides the score) and one where only Unicode punctuation differs
NO_4GRAM = (["the cat sat on", "a dog ran off"], ["the cat is on the mat", "a dog ran far away"])
UNICODE_PUNCTUATION = (["hello\u2014world \u00abquoted\u00bb"], ["hello \u2014 world \u00ab quoted \u00bb"])


@pytest.mark.parametrize("options, corpus", [
    ({"tokenize": "none"}, (CASED_HYPOTHESES, CASED_REFERENCES)),
    ({"tokenize": "char"}, (CASED_HYPOTHESES, CASED_REFERENCES)),
    ({"tokenize": "intl"}, UNICODE_PUNCTUATION),
    ({"lowercase": True}, (CASED_HYPOTHESES, CASED_REFERENCES)),
    ({"smooth_method": "none"}, NO_4GRAM),
    ({"smooth_method": "floor"}, NO_4GRAM),
    ({"smooth_method": "floor", "smooth_value": 0.3}, NO_4GRAM),
    ({"smooth_method": "add-k", "smooth_value": 2}, NO_4GRAM),
])
def test_bleu_module_options_reach_sacrebleu(options, corpus):
    """Each option changes the score on its corpus (so dropping it shows) and the module matches sacrebleu."""
    hypotheses, references = corpus
    result = load_metric("bleu").compute(predictions=hypotheses, references=references, **options)
    assert result["score"] == pytest.approx(bleu(hypotheses, references, **options), abs=1e-9)
    assert result["score"] != pytest.approx(bleu(hypotheses, references), abs=0.01)
    if "smooth_value" in options:
        method_default = bleu(hypotheses, references, smooth_method=options["smooth_method"])
        assert result["score"] != pytest.approx(method_default, abs=0.01)
    assert result["signature"] == signature(sacrebleu.BLEU, hypotheses, references, **options)


def test_bleu_module_several_references_per_hypothesis():
    """evaluate gives one list of references per hypothesis; sacrebleu wants one stream per reference position."""
    references = [[REFERENCES[0], "a cat sat on a mat ."],
                  [REFERENCES[1], "dogs were running , fast ."],
                  [REFERENCES[2], "green ideas sleep ."]]
    streams = [[row[0] for row in references], [row[1] for row in references]]
    result = load_metric("bleu").compute(predictions=HYPOTHESES, references=references)
    assert result["score"] == pytest.approx(sacrebleu.corpus_bleu(HYPOTHESES, streams).score, abs=1e-9)
    assert result["score"] > bleu(HYPOTHESES, REFERENCES)  # the second references matter
    # rows taken as streams would pair hypothesis 1 with references of hypotheses 2 and 3
    assert result["score"] != pytest.approx(sacrebleu.corpus_bleu(HYPOTHESES, references[:2]).score, abs=0.01)
    with pytest.raises(ValueError, match="same number of references"):
        load_metric("bleu").compute(predictions=HYPOTHESES[:2], references=[["a"], ["b", "c"]])


def test_chrf_module_equals_sacrebleu():
    result = load_metric("chrf").compute(predictions=HYPOTHESES, references=REFERENCES)
    assert result["score"] == pytest.approx(chrf(HYPOTHESES, REFERENCES), abs=1e-9)
    assert result["signature"] == signature(sacrebleu.CHRF, HYPOTHESES, REFERENCES)
    assert load_metric("chrf").compute(predictions=REFERENCES, references=REFERENCES)["score"] == pytest.approx(100.0)
    assert load_metric("chrf").compute(predictions=["xyz", "qqq"], references=["abc", "def"])["score"] == 0.0


@pytest.mark.parametrize("options", [
    {"word_order": 2},
    {"char_order": 3},
    {"beta": 1},
    {"lowercase": True},
    {"whitespace": True},
])
def test_chrf_module_options_reach_sacrebleu(options):
    hypotheses, references = CASED_HYPOTHESES, CASED_REFERENCES
    result = load_metric("chrf").compute(predictions=hypotheses, references=references, **options)
    assert result["score"] == pytest.approx(chrf(hypotheses, references, **options), abs=1e-9)
    assert result["score"] != pytest.approx(chrf(hypotheses, references), abs=0.01)
    assert result["signature"] == signature(sacrebleu.CHRF, hypotheses, references, **options)


def test_chrf_module_several_references_and_empty_hypotheses():
    references = [[REFERENCES[0], "a cat sat on a mat ."], [REFERENCES[1], "dogs were running , fast ."],
                  [REFERENCES[2], "green ideas sleep ."]]
    streams = [[row[0] for row in references], [row[1] for row in references]]
    hypotheses = [HYPOTHESES[0], "", HYPOTHESES[2]]
    result = load_metric("chrf").compute(predictions=hypotheses, references=references)
    assert result["score"] == pytest.approx(sacrebleu.corpus_chrf(hypotheses, streams).score, abs=1e-9)
    assert result["score"] != pytest.approx(sacrebleu.corpus_chrf(hypotheses, [streams[0]]).score, abs=0.01)


def test_ter_module_equals_sacrebleu():
    result = load_metric("ter").compute(predictions=HYPOTHESES, references=REFERENCES)
    expected = sacrebleu.TER().corpus_score(HYPOTHESES, [REFERENCES])
    assert result["score"] == pytest.approx(expected.score, abs=1e-9)
    assert (result["num_edits"], result["ref_length"]) == (expected.num_edits, pytest.approx(expected.ref_length))
    assert result["signature"] == signature(sacrebleu.TER, HYPOTHESES, REFERENCES)
    assert load_metric("ter").compute(predictions=REFERENCES, references=REFERENCES)["score"] == 0.0
    # every word substituted: one edit per reference word
    miss = load_metric("ter").compute(predictions=["w x y z"], references=["a b c d"])
    assert miss["score"] == pytest.approx(100.0) and miss["num_edits"] == 4


@pytest.mark.parametrize("options", [
    {"case_sensitive": True},
    {"no_punct": True},
    {"normalized": True},
    {"asian_support": True, "case_sensitive": True},
])
def test_ter_module_options_reach_sacrebleu(options):
    hypotheses = ["The Cat sat, on the mat.", "Dogs were running", "Sleep furiously tonight 猫が座った"]
    references = ["the cat sat on the mat .", "the dogs were running fast .", "ideas sleep furiously . 猫が座る"]
    result = load_metric("ter").compute(predictions=hypotheses, references=references, **options)
    assert result["score"] == pytest.approx(ter(hypotheses, references, **options), abs=1e-9)
    assert result["score"] != pytest.approx(ter(hypotheses, references), abs=0.01)
    assert result["signature"] == signature(sacrebleu.TER, hypotheses, references, **options)


def test_ter_module_several_references_and_empty_hypotheses():
    references = [[REFERENCES[0], "a cat sat on a mat ."], [REFERENCES[1], "dogs were running , fast ."],
                  [REFERENCES[2], "green ideas sleep ."]]
    streams = [[row[0] for row in references], [row[1] for row in references]]
    hypotheses = [HYPOTHESES[0], HYPOTHESES[1], ""]
    result = load_metric("ter").compute(predictions=hypotheses, references=references)
    assert result["score"] == pytest.approx(sacrebleu.corpus_ter(hypotheses, streams).score, abs=1e-9)
    assert result["score"] != pytest.approx(sacrebleu.corpus_ter(hypotheses, [streams[0]]).score, abs=0.01)


def test_python_pov_counts_the_outputs_that_parse():
    predictions = [
        "def f(a, b):\n    return a + b",  # valid
        "def f(:\n    return",  # syntax error
        "",  # empty: invalid
        "   \n\t",  # blank: invalid
        "x = '\\d'",  # an invalid escape is a warning, still valid
        "return x",  # 'return' outside a function is a compile error, not a parse error: valid
        "print('unclosed",  # invalid
        "if x:\npass",  # indentation error: invalid
    ]
    result = load_metric("python_pov").compute(predictions=predictions)
    assert (result["num_valid"], result["num_total"]) == (3, 8)
    assert result["pov"] == pytest.approx(100.0 * 3 / 8)
    assert load_metric("python_pov").compute(predictions=["x = 1", "y = 2"])["pov"] == 100.0
    assert load_metric("python_pov").compute(predictions=["def (", ""])["pov"] == 0.0


# ------------------------------------------------------------------------------------------------- metrics_utils
def test_generation_metrics_equal_sacrebleu_on_the_predictions():
    metrics = compute_generation_metrics(HYPOTHESES, REFERENCES)
    assert set(metrics) == {"bleu", "chrf", "ter", "sacrebleu_signature", "chrf_signature", "ter_signature"}
    assert metrics["bleu"] == pytest.approx(bleu(HYPOTHESES, REFERENCES), abs=1e-9)
    assert metrics["chrf"] == pytest.approx(chrf(HYPOTHESES, REFERENCES), abs=1e-9)
    assert metrics["ter"] == pytest.approx(ter(HYPOTHESES, REFERENCES), abs=1e-9)
    assert metrics["sacrebleu_signature"] == signature(sacrebleu.BLEU, HYPOTHESES, REFERENCES)
    assert metrics["chrf_signature"] == signature(sacrebleu.CHRF, HYPOTHESES, REFERENCES)
    assert metrics["ter_signature"] == signature(sacrebleu.TER, HYPOTHESES, REFERENCES)


def test_pov_is_computed_on_the_predictions_not_the_references():
    predictions = ["def f():\n    return 1", "x = (", "y = 2", "z = 3"]  # 3 of 4 parse
    references = ["def f(:", "x = 1", "y = 2", "z = ("]  # 2 of 4 parse
    metrics = compute_generation_metrics(predictions, references, is_code=True)
    assert metrics["pov"] == pytest.approx(75.0)
    assert metrics["bleu"] == pytest.approx(bleu(predictions, references), abs=1e-9)


def test_copy_baseline_scores_the_sources():
    copy = copy_baseline_metrics(SOURCES, REFERENCES)
    assert copy["bleu"] == pytest.approx(bleu(SOURCES, REFERENCES), abs=1e-9)
    assert copy["chrf"] == pytest.approx(chrf(SOURCES, REFERENCES), abs=1e-9)
    assert copy["ter"] == pytest.approx(ter(SOURCES, REFERENCES), abs=1e-9)
    code = copy_baseline_metrics(["Return one.", "x = 1"], ["def f():\n    return 1", "x = 1"], is_code=True)
    assert code["pov"] == pytest.approx(50.0)  # the docstring does not parse, the code does


def test_gain_over_copy_is_model_minus_copy_and_copy_minus_model_for_ter():
    gains = gain_over_copy({"bleu": 30.25, "chrf": 50.0, "ter": 40.5, "pov": 90.0, "sacrebleu_signature": "x"},
                           {"bleu": 10.0, "chrf": 55.5, "ter": 60.0, "pov": 100.0})
    assert gains == {"bleu": 20.25, "chrf": -5.5, "ter": 19.5, "pov": -10.0}


# ------------------------------------------------------------------------------------------------------- decode
def assert_scores_of(report, hypotheses, sources, references, is_code=False):
    """``report`` (decode's ``metrics`` / ``copy_baseline`` / ``gain_over_copy``) holds sacrebleu's values of
    ``hypotheses`` and of copying ``sources``, rounded to 2 decimals, and the gain between them."""
    expected = {"bleu": bleu(hypotheses, references), "chrf": chrf(hypotheses, references),
                "ter": ter(hypotheses, references)}
    copy = {"bleu": bleu(sources, references), "chrf": chrf(sources, references), "ter": ter(sources, references)}
    if is_code:
        pov = load_metric("python_pov")
        expected["pov"] = pov.compute(predictions=hypotheses)["pov"]
        copy["pov"] = pov.compute(predictions=sources)["pov"]
    assert report["metrics"] == {name: round(value, 2) for name, value in expected.items()}
    assert report["copy_baseline"] == {name: round(value, 2) for name, value in copy.items()}
    for name, value in expected.items():
        gain = copy[name] - value if name == "ter" else value - copy[name]
        assert report["gain_over_copy"][name] == pytest.approx(gain, abs=0.011), name
    assert set(report["gain_over_copy"]) == set(expected)


def test_score_hypotheses_scores_the_hypotheses_and_copies_the_sources():
    scores = decode.score_hypotheses(SOURCES, REFERENCES, HYPOTHESES, is_code=False)
    assert scores["num_examples"] == 3
    assert_scores_of(scores, HYPOTHESES, SOURCES, REFERENCES)
    assert scores["gain_over_copy"]["bleu"] > 10  # the corpus makes the copy baseline clearly worse
    assert scores["sacrebleu_signature"] == signature(sacrebleu.BLEU, HYPOTHESES, REFERENCES)


def test_score_hypotheses_for_code_reports_pov_of_each_side():
    sources = ["Return one.", "Add a and b.", "x = 3"]  # two docstrings do not parse, one does
    references = ["def one():\n    return 1", "def add(a, b):\n    return a + b", "x = 3"]
    hypotheses = ["def one():\n    return 1", "def add(a, b):\n    return a +", "x = 4"]
    scores = decode.score_hypotheses(sources, references, hypotheses, is_code=True)
    assert_scores_of(scores, hypotheses, sources, references, is_code=True)
    assert scores["metrics"]["pov"] == pytest.approx(66.67) and scores["copy_baseline"]["pov"] == pytest.approx(33.33)


class WordTokenizer:
    """A stand-in tokenizer: one id per whitespace-separated word (lengths are all decode reads of it)."""

    all_special_ids = ()

    def __call__(self, texts, **kwargs):
        return {"input_ids": [[hash(word) % 1000 for word in text.split()] for text in texts]}


def test_decode_run_reports_sacrebleu_of_the_written_hypotheses_and_of_copying_the_sources(tmp_path, monkeypatch,
                                                                                         capsys):
    """``flexformers-decode`` end to end with the model replaced by a lookup table: the reported scores, the copy
    baseline and the gain are sacrebleu's on the files decode wrote (hypotheses) and on the sources it read."""
    (tmp_path / "train.tsv").write_text("source\ttarget\na b\tc d\n", encoding="utf-8")
    pairs = "".join(f"{source}\t{reference}\n" for source, reference in zip(SOURCES, REFERENCES))
    (tmp_path / "test.tsv").write_text("source\ttarget\n" + pairs, encoding="utf-8")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    by_source = dict(zip(SOURCES, HYPOTHESES))
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="flexformer"))
    monkeypatch.setattr(decode, "load_model", lambda *args, **kwargs: (model, WordTokenizer(), WordTokenizer()))

    def generate_texts(model, source_tokenizer, target_tokenizer, sources, **kwargs):
        return [by_source[source] for source in sources], {"sentences": len(sources), "seconds": 1.0,
                                                           "sentences_per_second": 3.0, "tokens_per_second": 9.0}

    monkeypatch.setattr(decode, "generate_texts", generate_texts)
    results = decode.run_from_argv([
        "--model_name_or_path", str(model_dir), "--task", "files", "--train_file", str(tmp_path / "train.tsv"),
        "--test_file", str(tmp_path / "test.tsv"), "--split", "test", "--num_samples_to_print", "0",
        "--max_source_length", "6", "--max_target_length", "6",
    ])
    rows = [json.loads(line) for line in (model_dir / "generations.test.jsonl").read_text().splitlines()]
    written = (model_dir / "generations.test.txt").read_text().splitlines()
    assert written == [row["hypothesis"] for row in rows] == HYPOTHESES
    assert [row["source"] for row in rows] == SOURCES and [row["reference"] for row in rows] == REFERENCES
    assert_scores_of(results, written, [row["source"] for row in rows], [row["reference"] for row in rows])
    assert results["num_examples"] == 3
    # two of the pairs have a 7-word source or reference, beyond the 6 tokens training kept
    assert results["beyond_training_lengths"] == 2
    assert json.loads((model_dir / "eval_results.json").read_text()) == json.loads(json.dumps(results))
    printed = capsys.readouterr().out
    copy, gains = results["copy_baseline"], results["gain_over_copy"]
    assert (f"copying the input scores: BLEU {copy['bleu']:.2f}  chrF {copy['chrf']:.2f}  TER {copy['ter']:.2f}"
            in printed)
    assert f"model over copying:       BLEU {gains['bleu']:+.2f}" in printed

    # the pairs within the training lengths, scored again from the .jsonl (what the zoo reports beside the whole)
    from flexformers.training_scripts.arguments import DataArguments

    DataArguments(task="files", train_file=str(tmp_path / "train.tsv"), max_source_length=8,
                  max_target_length=6).save(model_dir)
    monkeypatch.setattr(decode, "load_tokenizers", lambda directory: (WordTokenizer(), WordTokenizer()))
    within = decode.score_within_training_lengths(model_dir / "generations.test.jsonl", model_dir)
    kept = [1, 2]  # pair 1's reference has 7 words
    assert within["num_examples"] == 2
    assert_scores_of(within, [HYPOTHESES[i] for i in kept], [SOURCES[i] for i in kept],
                     [REFERENCES[i] for i in kept])


# --------------------------------------------------------------------------- training's validation metrics (Trainer)
class VocabularyTokenizer:
    """A stand-in tokenizer over a fixed word list: id ``i`` is word ``i``; 0 is padding (special)."""

    pad_token_id = 0

    def __init__(self, texts):
        self.words = ["<pad>"] + sorted({word for text in texts for word in text.split()})

    def encode(self, text):
        return [self.words.index(word) for word in text.split()]

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(self.words[i] for i in row if i != self.pad_token_id) for row in rows]


def padded(rows, padding):
    width = max(len(row) for row in rows)
    return np.array([row + [padding] * (width - len(row)) for row in rows])


def test_trainer_compute_metrics_scores_the_predictions_and_copies_the_inputs():
    from transformers import EvalPrediction

    from flexformers.training_scripts import train

    tokenizer = VocabularyTokenizer(SOURCES + REFERENCES + HYPOTHESES)
    prediction = EvalPrediction(
        predictions=padded([tokenizer.encode(text) for text in HYPOTHESES], 0),
        label_ids=padded([tokenizer.encode(text) for text in REFERENCES], -100),  # the Trainer pads labels with -100
        inputs=padded([tokenizer.encode(text) for text in SOURCES], -100),
    )
    result = train.make_compute_metrics(tokenizer, is_code=False)(prediction)
    for name, score in (("bleu", bleu), ("chrf", chrf), ("ter", ter)):
        model, copy = score(HYPOTHESES, REFERENCES), score(SOURCES, REFERENCES)
        assert result[name] == pytest.approx(round(model, 4)), name
        assert result[f"copy_{name}"] == pytest.approx(round(copy, 4)), name
        assert result[f"{name}_over_copy"] == pytest.approx(copy - model if name == "ter" else model - copy,
                                                            abs=0.011), name
    assert result["gen_len"] == pytest.approx(np.mean([len(text.split()) for text in HYPOTHESES]))


# -------------------------------------------------------------------------------------------- method tools, cards
def test_depth_adaptive_score_is_sacrebleu_of_the_exit_decoding():
    from flexformers.training_scripts import depth_adaptive_tools

    result = depth_adaptive_tools.ExitDecodeResult(
        hypotheses=HYPOTHESES, exits=[[1, 2, 2], [2, 2], [1, 1, 2, 2]], source_lengths=[7, 8, 6],
        token_ids=[[], [], []], token_probabilities=None, seconds=0.5)
    config = types.SimpleNamespace(decoder_embed_dim=8, encoder_embed_dim=8, decoder_ffn_embed_dim=16,
                                   decoder_vocab_size=50, decoder_layers=2)
    scores = depth_adaptive_tools.score(types.SimpleNamespace(config=config), result, REFERENCES, "fixed", False)
    assert scores["bleu"] == round(bleu(HYPOTHESES, REFERENCES), 2)
    assert scores["chrf"] == round(chrf(HYPOTHESES, REFERENCES), 2)
    assert scores["average_exit"] == round(15 / 9, 4)
    assert scores["sacrebleu_signature"] == signature(sacrebleu.BLEU, HYPOTHESES, REFERENCES)


def test_iot_order_table_scores_each_subset_with_each_order(monkeypatch):
    """Fig. 2's table: the score of subset ``c`` decoded with order ``o`` is sacrebleu's on exactly those pairs and
    that order's hypotheses."""
    from flexformers.training_scripts import iot_order_analysis

    sources = ["s1", "s2", "s3", "s4"]
    references = ["the cat sat on the mat .", "a dog ran far away .", "green ideas sleep .", "it rains today ."]
    by_order = {
        1: ["the cat sat on the mat .", "a dog ran .", "ideas sleep .", "it rains ."],
        2: ["the cat sat .", "a dog ran far away .", "green ideas sleep .", "today it rains ."],
        None: ["the cat sat on a mat .", "a dog ran far .", "green ideas sleep .", "it rains today ."],
    }
    predicted = [1, 2, 2, 1]
    monkeypatch.setattr(iot_order_analysis, "predicted_decoder_orders", lambda *args: predicted)
    monkeypatch.setattr(iot_order_analysis, "generate_texts",
                        lambda model, *args, **kwargs: (by_order[model.code], {}))
    model = types.SimpleNamespace(config=types.SimpleNamespace(decoder_orders=[1, 2]))
    table = iot_order_analysis.order_table(model, None, None, sources, references)
    assert table["overall"] == {order if order is not None else "predicted": round(bleu(texts, references), 2)
                                for order, texts in by_order.items()}
    for subset in (1, 2):
        indices = [i for i, code in enumerate(predicted) if code == subset]
        for order in (1, 2):
            expected = bleu([by_order[order][i] for i in indices], [references[i] for i in indices])
            assert table["scores"][subset][order] == round(expected, 2), (subset, order)
    assert table["subsets"] == {1: 2, 2: 2}


def test_quickstart_exact_matches_count_hypotheses_and_sources_against_references(tmp_path):
    from flexformers.training_scripts.quickstart import exact_matches

    rows = [
        {"source": "b a", "reference": "a b", "hypothesis": "a  b"},  # model right (whitespace aside), copy wrong
        {"source": "c d", "reference": "c d", "hypothesis": "d c"},  # copy right, model wrong
        {"source": "f e", "reference": "e f", "hypothesis": "e f"},  # model right
        {"source": "g h", "reference": "h g", "hypothesis": "g"},  # both wrong
    ]
    path = tmp_path / "generations.test.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert exact_matches(path) == {"examples": 4, "model": 2, "copy": 1}


def test_model_card_reports_each_metric_with_its_own_value_and_signature():
    from flexformers.training_scripts.hub_model_card import build_card_data

    scores = decode.score_hypotheses(SOURCES, REFERENCES, HYPOTHESES, is_code=False)
    eval_results = {"task": "translation", "dataset": "handmade", "split": "test", **scores}
    card = build_card_data("m", eval_results, model_type="flexformer")
    reported = {result.metric_type: (result.metric_value, result.metric_config) for result in card.eval_results}
    assert reported == {
        "bleu": (round(bleu(HYPOTHESES, REFERENCES), 2), scores["sacrebleu_signature"]),
        "chrf": (round(chrf(HYPOTHESES, REFERENCES), 2), scores["chrf_signature"]),
        "ter": (round(ter(HYPOTHESES, REFERENCES), 2), scores["ter_signature"]),
    }
    assert len({config for _, config in reported.values()}) == 3


def test_zoo_figure_text_reports_the_models_and_the_copys_own_numbers():
    """The zoo's row text: PoV of the model beside PoV of copying the docstring, and BLEU within the training lengths
    beside copying there, each the value decode computed for that side."""
    from flexformers.training_scripts import zoo_report

    code_sources = ["Return one.", "Add a and b.", "x = 3"]
    code_references = ["def one():\n    return 1", "def add(a, b):\n    return a + b", "x = 3"]
    code_hypotheses = ["def one():\n    return 1", "def add(a, b):\n    return a +", "x = 4"]
    test = decode.score_hypotheses(code_sources, code_references, code_hypotheses, is_code=True)
    within = decode.score_hypotheses(SOURCES[1:], REFERENCES[1:], HYPOTHESES[1:], is_code=False)
    result = {"figures": {}, "test": {**test, "output_constraint": None, "beyond_training_lengths": 1,
                                      "within_training_lengths": within}}
    text = zoo_report.figure_text(result)
    assert "PoV): 66.67% (copying the docstring: 33.33%)" in text
    assert (f"{bleu(HYPOTHESES[1:], REFERENCES[1:]):.2f} (copying {bleu(SOURCES[1:], REFERENCES[1:]):.2f})"
            in text)
