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
