"""Corpus chrF / chrF++ through sacrebleu, as a local ``evaluate`` metric (offline)."""

import datasets
import evaluate
import sacrebleu

_DESCRIPTION = "Corpus-level chrF (sacrebleu.CHRF; word_order=2 gives chrF++), with its signature."
_KWARGS_DESCRIPTION = """
Args:
    predictions: list of hypothesis strings.
    references: list of reference strings, or list of lists (same count each).
    char_order (6), word_order (0), beta (2), lowercase (False), whitespace (False): sacrebleu.CHRF options.
Returns:
    score (0-100), char_order, word_order, beta, signature.
"""


def _as_reference_streams(references):
    rows = [[r] if isinstance(r, str) else list(r) for r in references]
    counts = {len(r) for r in rows}
    if len(counts) > 1:
        raise ValueError(f"every prediction needs the same number of references, got {sorted(counts)}")
    return [list(stream) for stream in zip(*rows)]


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Chrf(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Popovic, 2015. chrF: character n-gram F-score for automatic MT evaluation.",
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features(
                    {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
                ),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
            reference_urls=["https://github.com/mjpost/sacrebleu"],
        )

    def _compute(self, predictions, references, char_order=6, word_order=0, beta=2, lowercase=False, whitespace=False):
        metric = sacrebleu.CHRF(char_order=char_order, word_order=word_order, beta=beta, lowercase=lowercase, whitespace=whitespace)
        result = metric.corpus_score(list(predictions), _as_reference_streams(references))
        return {
            "score": result.score,
            "char_order": char_order,
            "word_order": word_order,
            "beta": beta,
            "signature": str(metric.get_signature()),
        }
