"""Loading the repository's local ``evaluate`` metric modules and computing the generation metrics.

``evaluate.load("sacrebleu")`` needs the Hub; the modules under ``<repo>/metrics/`` (BLEU, chrF, TER through
sacrebleu, and PoV for Python) load offline. Metric texts may span several lines (code): sacrebleu treats
newlines as whitespace, so scores are computed on the texts as they are.
"""

from __future__ import annotations

import functools
from pathlib import Path

import evaluate

METRICS_DIR = Path(__file__).resolve().parent.parent / "metrics"
LOCAL_METRICS = ("bleu", "chrf", "ter", "python_pov")
CODE_TASKS = ("codegen",)


@functools.lru_cache(maxsize=None)
def load_metric(name: str) -> evaluate.EvaluationModule:
    """One of :data:`LOCAL_METRICS`, loaded from its directory under ``metrics/`` (no network)."""
    if name not in LOCAL_METRICS:
        raise ValueError(f"Unknown local metric {name!r}; available: {', '.join(LOCAL_METRICS)}")
    path = METRICS_DIR / name
    if not (path / f"{name}.py").is_file():
        raise ValueError(f"Local metric module {path}/{name}.py is missing (is the package installed with -e?)")
    return evaluate.load(str(path))


def compute_generation_metrics(predictions: list[str], references: list[str], is_code: bool = False) -> dict:
    """``{"bleu", "chrf", "ter"[, "pov"]}`` (0-100) plus ``"sacrebleu_signature"`` (the BLEU signature) and the
    chrF/TER signatures."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    if not predictions:
        raise ValueError("no predictions to score")
    bleu = load_metric("bleu").compute(predictions=predictions, references=references)
    chrf = load_metric("chrf").compute(predictions=predictions, references=references)
    ter = load_metric("ter").compute(predictions=predictions, references=references)
    metrics = {"bleu": bleu["score"], "chrf": chrf["score"], "ter": ter["score"]}
    if is_code:
        metrics["pov"] = load_metric("python_pov").compute(predictions=predictions)["pov"]
    metrics["sacrebleu_signature"] = bleu["signature"]
    metrics["chrf_signature"] = chrf["signature"]
    metrics["ter_signature"] = ter["signature"]
    return metrics


#: Metrics where lower is better (the difference to the copy baseline is reported with the same sign convention:
#: positive = the model is better).
LOWER_IS_BETTER = frozenset({"ter"})


def copy_baseline_metrics(sources: list[str], references: list[str], is_code: bool = False) -> dict:
    """The scores of the trivial system that outputs its input unchanged (the shuffled sentence for word order, the
    English for translation, the docstring for code), on the same examples and with the same metrics as
    :func:`compute_generation_metrics`. A model scoring near it has learned nothing measurable."""
    return compute_generation_metrics(list(sources), references, is_code=is_code)


def gain_over_copy(metrics: dict, copy_metrics: dict) -> dict:
    """``{metric: model − copy}`` for the shared numeric metrics, signed so that positive means the model is better
    (``copy − model`` for TER)."""
    gains = {}
    for name, value in metrics.items():
        if isinstance(value, (int, float)) and isinstance(copy_metrics.get(name), (int, float)):
            gain = copy_metrics[name] - value if name in LOWER_IS_BETTER else value - copy_metrics[name]
            gains[name] = round(gain, 2)
    return gains
