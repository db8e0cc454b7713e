"""PoV: the percentage of generated programs that parse as Python (IOT paper, code generation), offline.

Each prediction is only *parsed* with ``ast.parse`` -- never compiled to bytecode, imported or executed.
"""

import ast
import warnings

import datasets
import evaluate

_DESCRIPTION = "Percentage of valid code: predictions that parse into a Python abstract syntax tree."
_KWARGS_DESCRIPTION = """
Args:
    predictions: list of generated Python source strings.
    references: optional, ignored (accepted so the metric composes with reference-based ones).
Returns:
    pov (0-100), num_valid, num_total.
"""


def parses_as_python(source: str) -> bool:
    """Whether ``source`` parses (``ast.parse``; nothing is executed). Empty output counts as invalid."""
    if not source.strip():
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences etc. are warnings, not parse failures
            ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class PythonPov(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Zhu et al., 2021. IOT: Instance-wise Layer Reordering for Transformer Structures (PoV).",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
        )

    def _compute(self, predictions, references=None):
        valid = sum(parses_as_python(p) for p in predictions)
        total = len(predictions)
        return {"pov": 100.0 * valid / total if total else 0.0, "num_valid": valid, "num_total": total}
