"""Local evaluate metric modules (offline) against sacrebleu's own numbers, and PoV."""

import os

import pytest
import sacrebleu

from flexformers.training_scripts.metrics_utils import LOCAL_METRICS, compute_generation_metrics, load_metric

HYPOTHESES = ["The cat sat on the mat.", "Das ist ein kleines Haus", "def f(x):\n    return x + 1", ""]
REFERENCES = ["The cat is on the mat.", "Das Haus ist klein", "def f(y):\n    return y + 1", "nothing"]
SECOND_REFERENCES = ["A cat sat on the mat.", "Es ist ein kleines Haus", "def f(x):\n    return 1 + x", "none"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_bleu_chrf_ter_equal_sacrebleu():
    bleu = load_metric("bleu").compute(predictions=HYPOTHESES, references=REFERENCES)
    assert bleu["score"] == pytest.approx(sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES]).score, abs=1e-9)
    assert bleu["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    chrf = load_metric("chrf").compute(predictions=HYPOTHESES, references=REFERENCES)
    assert chrf["score"] == pytest.approx(sacrebleu.corpus_chrf(HYPOTHESES, [REFERENCES]).score, abs=1e-9)
    ter = load_metric("ter").compute(predictions=HYPOTHESES, references=REFERENCES)
    assert ter["score"] == pytest.approx(sacrebleu.corpus_ter(HYPOTHESES, [REFERENCES]).score, abs=1e-9)


def test_multiple_references_and_options():
    multi = [[a, b] for a, b in zip(REFERENCES, SECOND_REFERENCES)]
    bleu = load_metric("bleu").compute(predictions=HYPOTHESES, references=multi, tokenize="intl", lowercase=True)
    expected = sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES, SECOND_REFERENCES], tokenize="intl", lowercase=True)
    assert bleu["score"] == pytest.approx(expected.score, abs=1e-9) and bleu["signature"].startswith("nrefs:2")
    chrf_pp = load_metric("chrf").compute(predictions=HYPOTHESES, references=multi, word_order=2)
    assert chrf_pp["score"] == pytest.approx(
        sacrebleu.corpus_chrf(HYPOTHESES, [REFERENCES, SECOND_REFERENCES], word_order=2).score, abs=1e-9
    )
    with pytest.raises(ValueError, match="same number of references"):
        load_metric("bleu").compute(predictions=HYPOTHESES[:2], references=[["a"], ["b", "c"]])


def test_pov_parses_without_executing(tmp_path):
    marker = tmp_path / "ran"
    predictions = [
        "def f(x):\n    return x",
        f"open({str(marker)!r}, 'w')",
        "def f(:\n    pass",
        "",
        "x = '\\d'",
    ]
    result = load_metric("python_pov").compute(predictions=predictions)
    assert result == {"pov": 60.0, "num_valid": 3, "num_total": 5}
    assert not marker.exists()


def test_compute_generation_metrics_bundle():
    scores = compute_generation_metrics(HYPOTHESES, REFERENCES, is_code=True)
    assert scores["bleu"] == pytest.approx(sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES]).score)
    assert scores["pov"] == pytest.approx(25.0)  # only the function parses; prose and empty output do not
    assert "pov" not in compute_generation_metrics(HYPOTHESES, REFERENCES, is_code=False)
    with pytest.raises(ValueError, match="4 predictions but 3 references"):
        compute_generation_metrics(HYPOTHESES, REFERENCES[:3])
    with pytest.raises(ValueError, match="Unknown local metric"):
        load_metric("rouge")


def test_modules_are_shipped_for_every_metric():
    from flexformers.training_scripts.metrics_utils import METRICS_DIR

    for name in LOCAL_METRICS:
        assert os.path.isfile(METRICS_DIR / name / f"{name}.py")


def test_copying_the_input_scores_what_sacrebleu_says():
    """The trivial baseline every evaluation prints: the sources themselves scored as outputs, on the same
    examples and metrics; the gain is signed so that positive means better than copying (TER flipped)."""
    from flexformers.training_scripts.metrics_utils import copy_baseline_metrics, gain_over_copy

    sources = ["sat cat The on mat. the", "ist klein Haus Das", "Open file the", "words of bag a"]
    references = ["The cat sat on the mat.", "Das Haus ist klein", "Open the file", "a bag of words"]
    copy = copy_baseline_metrics(sources, references)
    assert copy["bleu"] == pytest.approx(sacrebleu.corpus_bleu(sources, [references]).score, abs=1e-9)
    assert copy["chrf"] == pytest.approx(sacrebleu.corpus_chrf(sources, [references]).score, abs=1e-9)
    assert copy["ter"] == pytest.approx(sacrebleu.corpus_ter(sources, [references]).score, abs=1e-9)
    assert 0 < copy["bleu"] < 20 and copy["chrf"] > 40  # shuffled words: every character, few of the n-grams
    model = compute_generation_metrics(references[:3] + ["a words bag"], references)
    gains = gain_over_copy(model, copy)
    assert gains["bleu"] == pytest.approx(round(model["bleu"] - copy["bleu"], 2))
    assert gains["ter"] == pytest.approx(round(copy["ter"] - model["ter"], 2)) and gains["ter"] > 0
    assert set(gains) == {"bleu", "chrf", "ter"}
