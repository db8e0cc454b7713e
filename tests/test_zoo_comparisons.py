"""The zoo's registered comparisons: the file's ``comparisons:`` and the registered rule's verdicts in ZOO.md."""

from __future__ import annotations

import pytest

from flexformers.training_scripts import zoo_comparisons, zoo_recipes, zoo_statistics
from tests.test_zoo import write_recipes

FLAT = [{"update": u, "bleu": b} for u, b in ((600, 30.0), (800, 30.2), (900, 30.1), (1000, 30.2))]
RISING = [{"update": u, "bleu": b} for u, b in ((600, 20.0), (800, 22.0), (1000, 24.0))]


def _seed(group: str, seed: int, bleu: float, flat: bool = True, unconstrained: float | None = None) -> dict:
    test = {"metrics": {"bleu": bleu}}
    if unconstrained is not None:
        test = {**test, "output_constraint": "permutation", "unconstrained": {"metrics": {"bleu": unconstrained}}}
    return {"recipe": {"name": f"{group}-s{seed}", "seed": seed}, "test": test,
            "validation_curve": FLAT if flat else RISING}


def _seeds(group: str, scores, flat=True) -> list[dict]:
    return [_seed(group, seed, bleu, flat) for seed, bleu in enumerate(scores, start=1)]


def test_a_difference_beyond_twice_the_larger_sd_with_three_flat_seeds_each_is_a_verdict():
    baseline = _seeds("base", [40.0, 40.5, 41.0])  # sd 0.5
    better = zoo_statistics.registered_verdict(_seeds("m", [42.2, 42.4, 42.6]), baseline)  # +1.9 > 2 × 0.5
    assert better["difference"] == 1.9 and better["threshold"] == 1.0 and better["verdict"].startswith("**better**")
    worse = zoo_statistics.registered_verdict(baseline, _seeds("m", [42.2, 42.4, 42.6]))
    assert worse["difference"] == -1.9 and worse["verdict"].startswith("**worse**")
    close = zoo_statistics.registered_verdict(_seeds("m", [41.0, 41.4, 41.8]), baseline)  # +0.9, sd 0.4 and 0.5
    assert close["threshold"] == 1.0 and close["verdict"].startswith("no difference shown")
    # the larger of the two sds sets the bar: a noisy method needs a larger difference
    noisy = zoo_statistics.registered_verdict(_seeds("m", [40.9, 42.4, 43.9]), baseline)  # +1.9, sd 1.5
    assert noisy["threshold"] == 3.0 and noisy["verdict"].startswith("no difference shown")


def test_no_verdict_with_fewer_than_three_seeds_or_a_curve_still_climbing():
    baseline = _seeds("base", [40.0, 40.5, 41.0])
    two = zoo_statistics.registered_verdict(_seeds("m", [45.0, 45.1]), baseline)
    assert two["difference"] == 4.55 and two["verdict"] == "no verdict: 2 and 3 seeds (needs 3 each)"
    climbing = _seeds("m", [45.0, 45.1, 45.2])
    climbing[2] = _seed("m", 3, 45.2, flat=False)
    assert zoo_statistics.registered_verdict(climbing, baseline)["verdict"] == "no verdict: flat in 2 of 3 and 3 of 3 seeds"
    assert zoo_statistics.registered_verdict([], baseline)["verdict"] == "waiting for runs"


def test_a_comparison_is_not_read_until_every_seed_of_its_task_baseline_is_flat():
    gate = _seeds("base", [40.0, 40.5, 41.0])
    arms = (_seeds("m", [45.0, 45.1, 45.2]), _seeds("n", [40.0, 40.1, 40.2]))
    assert zoo_statistics.registered_verdict(*arms, gate)["verdict"].startswith("**better**")
    gate[1] = _seed("base", 2, 40.5, flat=False)
    unread = zoo_statistics.registered_verdict(*arms, gate)
    assert unread["verdict"] == "not read: the task's baseline is flat in 2 of 3 seeds" and unread["difference"] == 5.0
    assert zoo_statistics.registered_verdict(*arms, [])["verdict"].startswith("not read")  # no baseline seed yet


def test_a_baseline_constrained_to_permutations_is_read_unconstrained_against_a_method_that_is_not():
    baseline = [_seed("base", s, 69.0, unconstrained=u) for s, u in ((1, 56.0), (2, 56.1), (3, 56.2))]
    method = _seeds("indigo", [54.0, 54.1, 54.2])
    reading = zoo_statistics.registered_verdict(method, baseline)
    assert reading["against"]["mean"] == 56.1 and reading["difference"] == -2.0
    both = zoo_statistics.registered_verdict(baseline, baseline[::-1])  # both constrained: their own scores
    assert both["configuration"]["mean"] == 69.0


def _comparisons_file(tmp_path, comparisons: str):
    path = write_recipes(tmp_path, """  - {name: base-s1, task: word_order, model_type: flexformer, claim: baseline}
  - {name: base-s2, task: word_order, model_type: flexformer, seed: 2, claim: baseline}
  - {name: mat-s1, task: word_order, model_type: mat, claim: mat}
""")
    path.write_text(path.read_text() + "comparisons:\n" + comparisons)
    return zoo_recipes.load_recipes(path), path


def test_the_comparisons_of_a_recipe_file_name_seed_groups_of_its_recipes(tmp_path):
    recipes, path = _comparisons_file(
        tmp_path, "  - {question: q, configuration: mat, against: base, registered: 2026-12-07, read_only_if_flat: base}\n")
    (comparison,) = zoo_comparisons.load_comparisons(recipes, path)
    assert comparison == zoo_comparisons.RegisteredComparison("q", "mat", "base", "2026-12-07", ("base",))


@pytest.mark.parametrize("entry, message", [
    ("{question: q, configuration: mat, against: bass, registered: 2026-12-07}", "against 'bass' is no recipe's name"),
    ("{question: q, configuration: mat-s1, against: base, registered: 2026-12-07}", "configuration 'mat-s1' is no recipe"),
    ("{question: q, configuration: mat, against: base}", "missing registered"),
    ("{question: q, configuration: mat, against: base, registered: 2026-12-07, seeds: 3}", "unknown field(s) seeds"),
    ("{question: q, configuration: mat, against: base, registered: yesterday}", "registered must be a date"),
    ("{question: q, configuration: mat, against: mat, registered: 2026-12-07}", "not against itself"),
    ("{question: q, configuration: mat, against: base, registered: 2026-12-07, read_only_if_flat: [basis]}",
     "read_only_if_flat 'basis'"),
])
def test_a_malformed_comparison_is_named(tmp_path, entry, message):
    recipes, path = _comparisons_file(tmp_path, f"  - {entry}\n")
    with pytest.raises(ValueError, match="comparison 1") as error:
        zoo_comparisons.load_comparisons(recipes, path)
    assert message in str(error.value)


def test_the_shipped_comparisons_are_valid_and_zoo_md_states_each_verdict():
    recipes = zoo_recipes.load_recipes()
    comparisons = zoo_comparisons.load_comparisons(recipes)
    assert {c.configuration for c in comparisons} >= {"iot-tau1-translation", "iot-equal-translation",
                                                     "mat-matched-rho00-translation", "indigo-sao-paper-translation",
                                                     "indigo-l2r-step-positions-translation"}
    assert all(c.read_only_if_flat for c in comparisons)  # every registered reading waits for a flat baseline
    results = _seeds("baseline-translation", [40.0, 40.5, 41.0]) + _seeds("iot-tau1-translation", [42.2, 42.4, 42.6])
    lines = zoo_comparisons.comparison_lines(comparisons, results)
    assert "### Registered comparisons" in lines
    row = next(line for line in lines if line.startswith("| IOT (tau = 1) against the baseline"))
    assert "`iot-tau1-translation`: 42.40 ± 0.20 (seeds 1, 2, 3; flat 3 of 3)" in row and "**better**" in row
    waiting = next(line for line in lines if line.startswith("| IOT: tau = 1 against tau = 20"))
    assert "`iot-translation`: no seed finished" in waiting and waiting.endswith("| — | waiting for runs |")
