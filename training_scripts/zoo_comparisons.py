"""The zoo's registered comparisons (``comparisons:`` in ``zoo_recipes.yaml``): which configurations are read against
which, fixed before their runs, and the ZOO.md section that states each one's verdict by the registered rule
(:func:`~flexformers.training_scripts.zoo_statistics.registered_verdict`), whatever the runs show."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import yaml

from flexformers.training_scripts.zoo_recipes import DEFAULT_RECIPES, ZooRecipe
from flexformers.training_scripts.zoo_statistics import (
    FLAT_CURVE_GAIN,
    VERDICT_MIN_SEEDS,
    VERDICT_SD_MULTIPLE,
    registered_verdict,
    seed_group,
)

COMPARISON_FIELDS = {"question", "configuration", "against", "registered", "read_only_if_flat"}
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclasses.dataclass(frozen=True)
class RegisteredComparison:
    """``configuration`` read against ``against`` (each a recipe name without its ``-sN`` seed suffix: all its seeds),
    registered on ``registered`` (a date, before the runs); not read at all until every seed of each group in
    ``read_only_if_flat`` (the task's baseline) has a flat curve."""

    question: str
    configuration: str
    against: str
    registered: str
    read_only_if_flat: tuple[str, ...] = ()


def load_comparisons(recipes: list[ZooRecipe], path: str | os.PathLike = DEFAULT_RECIPES) -> list[RegisteredComparison]:
    """The registered comparisons of a recipe file (none when it has no ``comparisons:``); a ``ValueError`` naming
    the comparison and field for anything malformed, or a group that no recipe of the file belongs to."""
    path = Path(path)
    document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    entries = document.get("comparisons") or []
    if not isinstance(entries, list):
        raise ValueError(f"{path}: 'comparisons:' must be a list")
    groups = {seed_group(recipe.name) for recipe in recipes}
    comparisons = []
    for index, entry in enumerate(entries, start=1):
        where = f"{path}: comparison {index}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is not a mapping")
        unknown = set(entry) - COMPARISON_FIELDS
        missing = COMPARISON_FIELDS - {"read_only_if_flat"} - set(entry)
        if unknown or missing:
            raise ValueError(f"{where}: " + "; ".join(filter(None, [
                missing and f"missing {', '.join(sorted(missing))}",
                unknown and f"unknown field(s) {', '.join(sorted(unknown))}"])))
        if not _DATE.match(str(entry["registered"])):
            raise ValueError(f"{where}: registered must be a date YYYY-MM-DD, got {entry['registered']!r}")
        gate = entry.get("read_only_if_flat") or []
        gate = [gate] if isinstance(gate, str) else list(gate)
        for field, group in [("configuration", entry["configuration"]), ("against", entry["against"]),
                             *(("read_only_if_flat", name) for name in gate)]:
            if group not in groups:
                raise ValueError(f"{where}: {field} {group!r} is no recipe's name (without its -sN seed suffix)")
        if entry["configuration"] == entry["against"]:
            raise ValueError(f"{where}: a configuration is read against another, not against itself")
        comparisons.append(RegisteredComparison(
            question=str(entry["question"]), configuration=entry["configuration"], against=entry["against"],
            registered=str(entry["registered"]), read_only_if_flat=tuple(gate)))
    return comparisons


def _side_text(side: dict) -> str:
    if not side["seeds"]:
        return "no seed finished"
    seeds = ("seed " if len(side["seeds"]) == 1 else "seeds ") + ", ".join(map(str, side["seeds"]))
    spread = f" ± {side['sd']:.2f}" if side["sd"] is not None else ""
    return f"{side['mean']:.2f}{spread} ({seeds}; flat {side['flat']} of {len(side['seeds'])})"


def comparison_lines(comparisons: list[RegisteredComparison], results: list[dict]) -> list[str]:
    """ZOO.md's "Registered comparisons" section: each comparison's two sides over their finished seeds and its
    verdict by the registered rule."""
    if not comparisons:
        return []
    by_group: dict[str, list[dict]] = {}
    for result in results:
        by_group.setdefault(seed_group(result["recipe"]["name"]), []).append(result)
    lines = ["", "### Registered comparisons", "",
             "Each comparison was fixed in `zoo_recipes.yaml` before its runs (the date), with the rule that reads it "
             "(docs/ZOO_NOTEBOOK.md): a configuration is *better* or *worse* than another only when both have "
             f"≥ {VERDICT_MIN_SEEDS} seeds, every seed of both has a flat curve (last-fifth gain < "
             f"{FLAT_CURVE_GAIN}), and their test-BLEU means differ by more than {VERDICT_SD_MULTIPLE:g} × the larger "
             "of their two standard deviations; otherwise no verdict is drawn, and with the task's baseline not "
             "flat in every seed the row is not read at all. Scores: test BLEU, mean ± sample sd over the finished "
             "seeds.", "",
             "| question (registered) | configuration | read against | difference | verdict |",
             "|---|---|---|---|---|"]
    for comparison in comparisons:
        gate = [result for group in comparison.read_only_if_flat for result in by_group.get(group, [])]
        verdict = registered_verdict(by_group.get(comparison.configuration, []), by_group.get(comparison.against, []),
                                     gate if comparison.read_only_if_flat else None)
        difference = "—" if verdict["difference"] is None else f"{verdict['difference']:+.2f}"
        lines.append(
            f"| {comparison.question} ({comparison.registered}) | `{comparison.configuration}`: "
            f"{_side_text(verdict['configuration'])} | `{comparison.against}`: {_side_text(verdict['against'])} | "
            f"{difference} | {verdict['verdict']} |")
    return lines
