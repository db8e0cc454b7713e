"""Corpus BLEU through sacrebleu, as a local ``evaluate`` metric (offline)."""

import datasets
import evaluate
import sacrebleu

_DESCRIPTION = "Corpus-level BLEU (sacrebleu.BLEU), with its reproducibility signature."
_KWARGS_DESCRIPTION = """
Args:
    predictions: list of hypothesis strings.
    references: list of reference strings, or list of lists (several references per hypothesis, same count each).
    tokenize: sacrebleu tokenizer ('13a' default, 'none', 'intl', 'char', ...).
    lowercase: lowercase before scoring.
    smooth_method / smooth_value: sacrebleu smoothing ('exp' default).
Returns:
    score (0-100), counts, totals, precisions, bp, sys_len, ref_len, signature.
"""


def _as_reference_streams(references):
    """sacrebleu wants one stream per reference position; evaluate gives one list per hypothesis."""
    rows = [[r] if isinstance(r, str) else list(r) for r in references]
    counts = {len(r) for r in rows}
    if len(counts) > 1:
        raise ValueError(f"every prediction needs the same number of references, got {sorted(counts)}")
    return [list(stream) for stream in zip(*rows)]


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Bleu(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Post, 2018. A Call for Clarity in Reporting BLEU Scores.",
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features(
                    {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
                ),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
            reference_urls=["https://github.com/mjpost/sacrebleu"],
        )

    def _compute(self, predictions, references, tokenize="13a", lowercase=False, smooth_method="exp", smooth_value=None):
        metric = sacrebleu.BLEU(tokenize=tokenize, lowercase=lowercase, smooth_method=smooth_method, smooth_value=smooth_value)
        result = metric.corpus_score(list(predictions), _as_reference_streams(references))
        return {
            "score": result.score,
            "counts": result.counts,
            "totals": result.totals,
            "precisions": result.precisions,
            "bp": result.bp,
            "sys_len": result.sys_len,
            "ref_len": result.ref_len,
            "signature": str(metric.get_signature()),
        }
