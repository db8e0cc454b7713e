"""The zoo's statistics: learning curves and when one has flattened, seed spreads, methods against their baseline.

The rules these implement are fixed before the runs they judge (``docs/ZOO.md`` states them): a curve has flattened
when the last fifth of its updates gains less than :data:`FLAT_CURVE_GAIN` validation BLEU; a baseline has learned
its task when it scores :data:`LEARNED_OVER_COPY` BLEU above copying the input; a difference between two
configurations is read in units of the baseline seeds' standard deviation.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from flexformers.training_scripts.model_registry import get_method_spec

#: Validation BLEU gained over the last fifth of a run's updates below which its curve counts as flattened.
FLAT_CURVE_GAIN = 0.5
#: Test BLEU over copying the input from which a baseline counts as having learned its task.
LEARNED_OVER_COPY = 15.0


def validation_curve(output_dir: Path) -> list[dict]:
    """(update, validation BLEU/chrF, copy BLEU) of every curve point in the run's history."""
    state = json.loads((output_dir / "trainer_state.json").read_text())
    # the last update is evaluated twice (its curve point and the end of training): one point per update
    points = {entry["step"]: {"update": entry["step"], "bleu": entry["eval_bleu"], "chrf": entry.get("eval_chrf"),
                              "copy_bleu": entry.get("eval_copy_bleu")}
              for entry in state["log_history"] if "eval_bleu" in entry}
    return list(points.values())


def last_fifth_gain(curve: list[dict]) -> float | None:
    """Validation BLEU gained over the last fifth of the updates, the zoo's flattening criterion (the zoo issue's
    "the last fifth of its updates gains < 0.5 BLEU"): the rise of a least-squares line through the curve points of
    the last fifth (from the point where it starts to the end) over that fifth. Below :data:`FLAT_CURVE_GAIN`, the
    curve has flattened.

    A line through every point of the fifth rather than its last point minus its first, so that no single greedy
    evaluation decides; and over the last fifth itself, as the criterion says, rather than the means of the last two
    fifths, which measure the rise from 70 % to 90 % of the run. No reading is reliable on a curve as noisy as the
    first inverse-sqrt runs' (300 sentences, neighbouring points 1.4 BLEU apart on a plateau): the zoo evaluates
    1,000 sentences, and a learning rate that decays to zero lets the model, hence the curve, settle at the end.
    None when the fifth holds fewer than two points."""
    if not curve:
        return None
    last_update = curve[-1]["update"]
    fifth_start = 0.8 * last_update
    points = [(point["update"], point["bleu"]) for point in curve if point["update"] >= fifth_start]
    if len(points) < 2:
        return None
    slope = statistics.linear_regression([update for update, _ in points], [bleu for _, bleu in points]).slope
    return round(slope * (last_update - fifth_start), 2)


#: The change that replaced :func:`window_means_gain` by :func:`last_fifth_gain` as the flattening rule; it recorded
#: two baseline seeds that the earlier rule had judged when they finished, so the report shows both rules.
FLATNESS_RULE_CHANGE = "3aff142 (2026-11-26)"


def window_means_gain(curve: list[dict]) -> float | None:
    """The zoo's flattening criterion until :data:`FLATNESS_RULE_CHANGE`: the mean of the curve points in the last
    fifth of the updates minus the mean of those in the fifth before (both windows' points equally weighted). Kept
    so that a table judged by today's :func:`last_fifth_gain` also shows what the rule of the runs' time said.
    None when either window holds no point."""
    if not curve:
        return None
    last_update = curve[-1]["update"]
    last = [point["bleu"] for point in curve if point["update"] > 0.8 * last_update]
    before = [point["bleu"] for point in curve if 0.6 * last_update < point["update"] <= 0.8 * last_update]
    if not last or not before:
        return None
    return round(statistics.mean(last) - statistics.mean(before), 2)


def seed_group(name: str) -> str:
    """A recipe's name without its seed suffix (``baseline-translation-s2`` -> ``baseline-translation``): the recipes
    that differ only by their seed."""
    return re.sub(r"-s\d+$", "", name)


def converged(result: dict, gain_rule=None) -> bool:
    """Whether a run meets the zoo's bar for a baseline that methods are compared with: its validation curve has
    flattened (``gain_rule``, by default today's :func:`last_fifth_gain`, < :data:`FLAT_CURVE_GAIN`) and its test
    BLEU is :data:`LEARNED_OVER_COPY` or more above copying the input."""
    over_copy = (result["test"].get("gain_over_copy") or {}).get("bleu")
    return is_flat(result, gain_rule) and over_copy is not None and over_copy >= LEARNED_OVER_COPY


def is_flat(result: dict, gain_rule=None) -> bool:
    """Whether a run's validation curve has flattened: ``gain_rule`` (by default today's :func:`last_fifth_gain`)
    below :data:`FLAT_CURVE_GAIN`."""
    gain = (gain_rule or last_fifth_gain)(result.get("validation_curve") or [])
    return gain is not None and gain < FLAT_CURVE_GAIN


def seed_spread(results: list[dict]) -> list[dict]:
    """Test BLEU and chrF over the seeds of every configuration finished with two seeds or more: the spread that a
    difference between two configurations is read against (sample standard deviation)."""
    groups: dict[str, list[dict]] = {}
    for result in results:
        groups.setdefault(seed_group(result["recipe"]["name"]), []).append(result)
    spread = []
    for group, members in groups.items():
        if len(members) < 2:
            continue
        row = {"group": group, "task": members[0]["recipe"]["task"], "claim": members[0]["recipe"]["claim"],
               "seeds": sorted(member["recipe"]["seed"] for member in members),
               "converged_seeds": sum(converged(member) for member in members),
               "converged_seeds_earlier_rule": sum(converged(member, window_means_gain) for member in members)}
        for metric in ("bleu", "chrf"):
            row[metric] = spread_of([member["test"]["metrics"][metric] for member in members])
        if all("unconstrained" in member["test"] for member in members):
            row["unconstrained_bleu"] = spread_of([member["test"]["unconstrained"]["metrics"]["bleu"]
                                                 for member in members])
        spread.append(row)
    return spread


def baseline_spread(spread: list[dict], task: str) -> dict | None:
    """The seed spread of ``task``'s baseline (a row of :func:`seed_spread`), None before two seeds are finished."""
    return next((row for row in spread if row["task"] == task and row["claim"] == "baseline"), None)


def spread_of(values: list[float]) -> dict:
    return {"mean": round(statistics.mean(values), 2), "sd": round(statistics.stdev(values), 2),
            "min": min(values), "max": max(values)}


def against_baseline(results: list[dict], spread: list[dict]) -> list[dict]:
    """Every method's test BLEU minus the mean of its task's baseline seeds, in units of their standard deviation.

    The baseline is read as the method decodes: a method decoded without the output constraint that the baseline's
    own score uses (InDIGO on word order) is compared with the baseline's unconstrained decoding."""
    rows = []
    for result in results:
        recipe = result["recipe"]
        baseline = baseline_spread(spread, recipe["task"])
        if recipe["claim"] == "baseline" or baseline is None:
            continue
        scores = baseline["bleu"]
        if not result["test"].get("output_constraint") and "unconstrained_bleu" in baseline:
            scores = baseline["unconstrained_bleu"]
        difference = result["test"]["metrics"]["bleu"] - scores["mean"]
        rows.append({"recipe": recipe["name"], "claim": recipe["claim"], "bleu": result["test"]["metrics"]["bleu"],
                     "baseline": baseline, "baseline_bleu": scores,
                     "baseline_decoding": "unconstrained" if scores is not baseline["bleu"] else "its own",
                     "difference": round(difference, 2),
                     "in_sd": round(difference / scores["sd"], 1) if scores["sd"] else None})
    return rows


#: The registered rule (docs/ZOO_NOTEBOOK.md, "Registered before the runs: issue 63", fixed 2026-12-06): the seeds
#: each side needs before a difference is claimed, and the multiple of the larger standard deviation it must exceed.
VERDICT_MIN_SEEDS = 3
VERDICT_SD_MULTIPLE = 2.0


def _side(results: list[dict], unconstrained: bool) -> dict:
    """Test BLEU over one configuration's seeds; ``unconstrained``: the decoding without the output constraint (a
    baseline on word order read against a method that decodes without it, as :func:`against_baseline` reads it)."""
    scores = [(result["test"]["unconstrained"] if unconstrained and "unconstrained" in result["test"]
               else result["test"])["metrics"]["bleu"] for result in results]
    return {"seeds": sorted(result["recipe"]["seed"] for result in results), "scores": scores,
            "flat": sum(is_flat(result) for result in results),
            "mean": round(statistics.mean(scores), 2) if scores else None,
            "sd": round(statistics.stdev(scores), 2) if len(scores) > 1 else None}


def registered_verdict(configuration: list[dict], against: list[dict], gate: list[dict] | None = None) -> dict:
    """The registered rule's reading of ``configuration``'s seeds against ``against``'s (results of one seed group
    each): *better* / *worse* when both have :data:`VERDICT_MIN_SEEDS` seeds or more, every seed of both is flat, and
    the difference of their test-BLEU means exceeds :data:`VERDICT_SD_MULTIPLE` times the larger of their sample
    standard deviations; otherwise no verdict, saying why. ``gate`` (the task baseline's seeds, when the comparison
    names one): unless every one of them is flat, the comparison is not read at all. A side constrained to
    permutations of the input is read unconstrained when the other side is not constrained."""
    constrained = [any(result["test"].get("output_constraint") for result in side) for side in (configuration, against)]
    sides = [_side(side, unconstrained=constrained[i] and not constrained[1 - i])
             for i, side in enumerate((configuration, against))]
    a, b = sides
    difference = round(a["mean"] - b["mean"], 2) if a["scores"] and b["scores"] else None
    reading = {"configuration": a, "against": b, "difference": difference, "threshold": None}
    if gate is not None and (not gate or not all(is_flat(result) for result in gate)):
        flat = sum(is_flat(result) for result in gate)
        return {**reading, "verdict": f"not read: the task's baseline is flat in {flat} of {len(gate)} seeds"}
    if difference is None:
        return {**reading, "verdict": "waiting for runs"}
    seeds = (len(a["scores"]), len(b["scores"]))
    if min(seeds) < VERDICT_MIN_SEEDS:
        return {**reading, "verdict": f"no verdict: {seeds[0]} and {seeds[1]} seeds (needs {VERDICT_MIN_SEEDS} each)"}
    if a["flat"] < seeds[0] or b["flat"] < seeds[1]:
        return {**reading, "verdict": f"no verdict: flat in {a['flat']} of {seeds[0]} and {b['flat']} of {seeds[1]} seeds"}
    threshold = round(VERDICT_SD_MULTIPLE * max(a["sd"], b["sd"]), 2)
    reading["threshold"] = threshold
    if abs(difference) > threshold:
        word = "better" if difference > 0 else "worse"
        return {**reading, "verdict": f"**{word}** (|difference| > {threshold:.2f}, {VERDICT_SD_MULTIPLE:g} × the larger sd)"}
    return {**reading, "verdict": f"no difference shown (|difference| ≤ {threshold:.2f}, {VERDICT_SD_MULTIPLE:g} × the larger sd)"}


def same_seed_first(runs: list[dict], result: dict) -> list[dict]:
    """Those of ``runs`` trained with ``result``'s seed, else all of them: a run is read against a reference of its
    own seed while that one is finished, since the seeds draw different initializations and batches."""
    return [run for run in runs if run["recipe"].get("seed") == result["recipe"].get("seed")] or runs


def flag_value(recipe: dict, flag: str) -> str | None:
    """The value a recipe's own flags give ``flag`` (recipe flags come last and win), None where they do not set it."""
    flags = list(recipe.get("flags") or [])
    return flags[flags.index(flag) + 1] if flag in flags else None


def peak_learning_rate(recipe: dict) -> float | None:
    """The recipe's peak learning rate: its own ``--learning_rate`` flag, else its task's."""
    if flag_value(recipe, "--learning_rate") is not None:
        return float(flag_value(recipe, "--learning_rate"))
    rate = (recipe.get("task_settings") or {}).get("learning_rate")
    return None if rate is None else float(rate)


def is_baseline_result(result: dict) -> bool:
    """Whether a result is of the plain Transformer that the methods are read against (its spec's ``is_baseline``)."""
    return get_method_spec(result["recipe"]["model_type"]).is_baseline
