"""Corpus TER through sacrebleu, as a local ``evaluate`` metric (offline)."""

import datasets
import evaluate
import sacrebleu

_DESCRIPTION = "Corpus-level translation edit rate (sacrebleu.TER; lower is better), with its signature."
_KWARGS_DESCRIPTION = """
Args:
    predictions: list of hypothesis strings.
    references: list of reference strings, or list of lists (same count each).
    normalized, no_punct, asian_support, case_sensitive: sacrebleu.TER options.
Returns:
    score (0-100+), num_edits, ref_length, signature.
"""


def _as_reference_streams(references):
    rows = [[r] if isinstance(r, str) else list(r) for r in references]
    counts = {len(r) for r in rows}
    if len(counts) > 1:
        raise ValueError(f"every prediction needs the same number of references, got {sorted(counts)}")
    return [list(stream) for stream in zip(*rows)]


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Ter(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Snover et al., 2006. A Study of Translation Edit Rate with Targeted Human Annotation.",
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features(
                    {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
                ),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
            reference_urls=["https://github.com/mjpost/sacrebleu"],
        )

    def _compute(self, predictions, references, normalized=False, no_punct=False, asian_support=False, case_sensitive=False):
        metric = sacrebleu.TER(normalized=normalized, no_punct=no_punct, asian_support=asian_support, case_sensitive=case_sensitive)
        result = metric.corpus_score(list(predictions), _as_reference_streams(references))
        return {
            "score": result.score,
            "num_edits": result.num_edits,
            "ref_length": result.ref_length,
            "signature": str(metric.get_signature()),
        }
