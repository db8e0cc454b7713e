"""flexformers-zoo's report: each method's rows read against their references, its figures and plots in docs/ZOO.md."""

from __future__ import annotations

import json

from flexformers.training_scripts import zoo_recipes, zoo_report, zoo_runner, zoo_statistics
from flexformers.training_scripts.methods import depth_adaptive as depth_adaptive_method
from flexformers.training_scripts.methods import indigo as indigo_method
from flexformers.training_scripts.methods import iot as iot_method
from tests.test_zoo import RECIPE_HEADER, TRANSLATION_TASK, _recorded, _result, write_recipes


def _rendered_result(recipe: zoo_recipes.ZooRecipe, bleu: float, figures: dict, parameters: int) -> dict:
    scores = {"bleu": bleu, "chrf": 50.0, "ter": 40.0}
    return {**_recorded(recipe, recipe.updates), "parameters": parameters, "training_seconds": 60.0, "sessions": 1,
            "machine": "test", "validation_curve": [], "figures": figures,
            "test": {"metrics": scores, "copy_baseline": {"bleu": 17.0, "chrf": 30.0}, "num_beams": 4,
                     "gain_over_copy": {"bleu": bleu - 17.0}}}


def test_iot_case_verification_is_rendered_as_the_papers_figure_2(tmp_path):
    """ZOO.md shows each IOT recipe's test sentences grouped by predicted order and decoded with every order, the
    best of each group in bold, beside IOT's own decoding and the best single order; the main table names both."""
    path = write_recipes(tmp_path, "  - {name: iot, task: word_order, model_type: iot, claim: iot}\n")
    (recipe,) = zoo_recipes.load_recipes(path)
    figures = {"decoder order usage (paper code: share)": {"1": 0.6, "2": 0.4},
               iot_method.IOT_CASE_VERIFICATION: {
                   "metric": "bleu", "orders": [1, 2], "subsets": {"1": 6, "2": 4},
                   "scores": {"1": {"1": 60.5, "2": 59.7}, "2": {"1": 37.2, "2": 37.3}},
                   "overall": {"1": 50.9, "2": 50.5, "predicted": 50.8}}}
    records = tmp_path / "records"
    records.mkdir()
    (records / "iot.json").write_text(json.dumps(_rendered_result(recipe, 50.8, figures, 2_000_000)))
    docs = tmp_path / "ZOO.md"
    zoo_report.render([recipe], tmp_path / "runs", docs, records)
    text = docs.read_text()
    assert "| subset (predicted order) | sentences | order 1 | order 2 |" in text
    assert "| set 1 | 6 | **60.50** | 59.70 |" in text and "| set 2 | 4 | 37.20 | **37.30** |" in text
    assert "| all | 10 | 50.90 | 50.50 |" in text
    assert ("Each sentence decoded with its own predicted order (IOT's inference): 50.80; every sentence with the "
            "best single order (1): 50.90.") in text
    assert "each sentence with its predicted order 50.80, the best single order (1) 50.90" in text
    assert (tmp_path / "zoo" / "iot_case_verification_iot.png").stat().st_size > 0


def test_code_rows_show_the_share_of_outputs_that_parse_beside_copying_the_docstring(tmp_path):
    """A code recipe's row carries PoV, the model's and copying the docstring's, which BLEU alone does not show."""
    path = write_recipes(tmp_path, "  - {name: code, task: word_order, model_type: flexformer, claim: baseline}\n")
    (recipe,) = zoo_recipes.load_recipes(path)
    result = _rendered_result(recipe, 20.0, {}, 2_000_000)
    result["test"]["metrics"]["pov"] = 91.23
    result["test"]["copy_baseline"]["pov"] = 0.84
    records = tmp_path / "records"
    records.mkdir()
    (records / "code.json").write_text(json.dumps(result))
    docs = tmp_path / "ZOO.md"
    zoo_report.render([recipe], tmp_path / "runs", docs, records)
    row = next(line for line in docs.read_text().splitlines() if line.startswith("| code |"))
    assert row.endswith("| outputs that parse as Python (PoV): 91.23% (copying the docstring: 0.84%) |")


def test_depth_adaptive_is_rendered_against_its_full_depth_reference(tmp_path):
    """ZOO.md reads a Depth-Adaptive recipe's test exits against the same blocks trained without exits, with the
    validation sweep its thresholds were chosen on; the plot keeps the two splits apart."""
    path = write_recipes(tmp_path, (
        "  - {name: da, task: word_order, model_type: depth_adaptive, claim: depth-adaptive}\n"
        "  - {name: four-blocks, task: word_order, model_type: flexformer, claim: depth-adaptive}\n"))
    adaptive, reference = zoo_recipes.load_recipes(path)
    fixed = {str(n): {"bleu": b, "average_exit": float(n), "flops_per_token": 1e6 * n}
             for n, b in ((1, 30.0), (2, 33.0))}
    figures = {"depth_adaptive": {
        "confidence": {"bleu": 32.5, "chrf": 51.0, "average_exit": 1.4, "flops_per_token": 2.5e6,
                       "thresholds": [0.61], "chosen_on": "validation, first 500 sentences: the cheapest"},
        "fixed_exits": fixed, "validation_examples": 500,
        "validation_fixed_exits": {"1": {"bleu": 20.0, "average_exit": 1.0, "flops_per_token": 1e6},
                                   "2": {"bleu": 22.0, "average_exit": 2.0, "flops_per_token": 2e6}},
        "validation_pareto_front": [{"bleu": 21.0, "average_exit": 1.2, "flops_per_token": 2e6, "thresholds": [0.4]},
                                    {"bleu": 22.1, "average_exit": 1.4, "flops_per_token": 2.5e6,
                                     "thresholds": [0.61]}]}}
    records = tmp_path / "records"
    records.mkdir()
    (records / "da.json").write_text(json.dumps(_rendered_result(adaptive, 32.5, figures, 3_000_000)))
    docs = tmp_path / "ZOO.md"
    zoo_report.render([adaptive, reference], tmp_path / "runs", docs, records)
    text = docs.read_text()
    assert "its full-depth reference without exits has not finished yet" in text
    assert "| fixed exit 2 | 33.00 | — | 2.00 | 2.00 M |" in text

    (records / "four-blocks.json").write_text(json.dumps(_rendered_result(reference, 34.0, {}, 2_000_000)))
    zoo_report.render([adaptive, reference], tmp_path / "runs", docs, records)
    text = docs.read_text()
    assert "reference: `four-blocks`, the same blocks without exits, test BLEU 34.00 (2,000,000 parameters)" in text
    assert "| fixed exit 1 | 30.00 | -4.00 | 1.00 | 1.00 M |" in text
    assert "| confidence exits, τ = (0.61) | 32.50 | -1.50 | 1.40 | 2.50 M |" in text
    assert ("How the thresholds were chosen: validation, first 500 sentences: the cheapest. On those sentences the "
            "full depth scores 22.00; the sweep's Pareto front (2 points): 21.00 at AE 1.20, 22.10 at AE 1.40.") in text
    assert (tmp_path / "zoo" / "depth_adaptive_da.png").stat().st_size > 0


def test_a_trained_halting_mechanism_is_rendered_beside_the_confidence_exits(tmp_path):
    """A Depth-Adaptive recipe trained on with a halting mechanism (issue 63's second stage) names no overrides of
    its own: it is read against the reference with its recorded blocks (four), not the two-block baseline, and its
    halting exits get their own row, figure cell and plot point."""
    path = write_recipes(tmp_path, (
        "  - {name: da, task: word_order, model_type: depth_adaptive, overrides: decoder_layers=4, claim: depth-adaptive}\n"
        "  - {name: da-halting, task: word_order, model_type: depth_adaptive, init_from: da, claim: depth-adaptive}\n"
        "  - {name: two-blocks, task: word_order, model_type: flexformer, claim: baseline}\n"
        "  - {name: four-blocks, task: word_order, model_type: flexformer, overrides: decoder_layers=4, "
        "claim: depth-adaptive}\n"))
    _, halting_recipe, two_blocks, four_blocks = zoo_recipes.load_recipes(path)
    fixed = {str(n): {"bleu": 30.0 + n, "average_exit": float(n), "flops_per_token": 1e6 * n} for n in range(1, 5)}
    figures = {"depth_adaptive": {
        "confidence": {"bleu": 33.5, "chrf": 51.0, "average_exit": 2.4, "flops_per_token": 2.5e6, "thresholds": [0.6] * 3},
        "halting": {"mechanism": "token_geometric", "bleu": 33.9, "chrf": 52.0, "average_exit": 2.1,
                    "flops_per_token": 2.2e6},
        "fixed_exits": fixed, "validation_pareto_front": []}}
    four = {"encoder_layers": 2, "decoder_layers": 4}
    records = tmp_path / "records"
    records.mkdir()
    for recipe, bleu, recipe_figures, architecture in ((halting_recipe, 33.9, figures, four),
                                                       (two_blocks, 36.0, {}, {**four, "decoder_layers": 2}),
                                                       (four_blocks, 34.0, {}, four)):
        result = {**_rendered_result(recipe, bleu, recipe_figures, 2_000_000), "architecture": architecture}
        (records / f"{recipe.name}.json").write_text(json.dumps(result))
    docs = tmp_path / "ZOO.md"
    zoo_report.render([halting_recipe, two_blocks, four_blocks], tmp_path / "runs", docs, records)
    text = docs.read_text()
    assert "reference: `four-blocks`, the same blocks without exits, test BLEU 34.00" in text
    assert "| halting exits (token_geometric, trained) | 33.90 | -0.10 | 2.10 | 2.20 M |" in text
    assert "halting exit (token_geometric): BLEU 33.90 at average exit 2.10" in text
    assert (tmp_path / "zoo" / "depth_adaptive_da-halting.png").stat().st_size > 0


def test_depth_adaptive_seed_is_read_against_the_reference_of_its_own_seed():
    """With a second seed of both the Depth-Adaptive recipe and its full-depth reference, each seed's exits are read
    against the reference trained with the same seed; a seed whose own reference is missing takes another's."""
    def result(name: str, model_type: str, seed: int, bleu: float) -> dict:
        return {"recipe": {"name": name, "task": "translation", "claim": "depth-adaptive", "model_type": model_type,
                           "seed": seed}, "test": {"metrics": {"bleu": bleu}}}

    first, second = result("da-s1", "depth_adaptive", 1, 30.0), result("da-s2", "depth_adaptive", 2, 31.0)
    references = [result("four-blocks", "flexformer", 1, 34.0), result("four-blocks-s2", "flexformer", 2, 35.0)]
    results = [first, second, *references]
    assert depth_adaptive_method.depth_adaptive_reference(first, results) is references[0]
    assert depth_adaptive_method.depth_adaptive_reference(second, results) is references[1]
    assert depth_adaptive_method.depth_adaptive_reference(second, [first, second, references[0]]) is references[0]
    assert depth_adaptive_method.depth_adaptive_reference(second, [first, second]) is None
    # only the same blocks trained from scratch: not another size or width, nor a model trained on from another's
    wider = result("d256", "flexformer", 2, 46.0)
    wider["recipe"]["overrides"] = "encoder_embed_dim=256"
    continued = result("continued-s2", "flexformer", 2, 39.0)
    continued["recipe"]["init_from"] = "half-s2"
    iwslt = result("gpu-s2", "flexformer", 2, 14.0)
    iwslt["recipe"]["size"] = "iwslt"
    assert depth_adaptive_method.depth_adaptive_reference(second, [first, second, wider, continued, iwslt, references[0]]) \
        is references[0]


def test_indigo_seed_is_read_against_the_l2r_run_of_its_own_seed():
    """A second seed of SAO is read against the L2R control trained on from the L2R model of its own seed, and a
    second seed of L2R from scratch against no other seed of itself; an order without a same-seed L2R takes another's."""
    def result(name: str, order: str, seed: int, init_from: str | None = None, updates: int = 25000) -> dict:
        return {"recipe": {"name": name, "task": "word_order", "model_type": "indigo", "seed": seed,
                           "flags": ["--order", order], "init_from": init_from}, "updates": updates}

    l2r, l2r_2 = result("l2r", "l2r", 1), result("l2r-s2", "l2r", 2)
    control, control_2 = result("on", "l2r", 1, "l2r", 5000), result("on-s2", "l2r", 2, "l2r-s2", 5000)
    sao, sao_2 = result("sao", "sao", 1, "l2r", 5000), result("sao-s2", "sao", 2, "l2r-s2", 5000)
    r2l_2 = result("r2l-s2", "r2l", 2)
    indigo = [l2r, control, sao, l2r_2, sao_2, control_2, r2l_2]
    assert indigo_method.l2r_reference(sao, indigo) is control
    assert indigo_method.l2r_reference(sao_2, indigo) is control_2
    assert indigo_method.l2r_reference(control_2, indigo) is l2r_2
    assert indigo_method.l2r_reference(r2l_2, indigo) is l2r_2
    assert indigo_method.l2r_reference(l2r_2, indigo) is None and indigo_method.l2r_reference(l2r, indigo) is None
    assert indigo_method.l2r_reference(r2l_2, [l2r, r2l_2]) is l2r


def test_insertion_decoding_is_read_against_the_baseline_decoded_without_its_constraint():
    """On word order the baseline's own score is decoded under the permutation constraint; InDIGO's is not (nor is
    it in its paper), so InDIGO is compared with the baseline's unconstrained decoding of the same test split."""
    results = [_result(f"baseline-word-order-s{seed}", "word_order", "baseline", seed, bleu)
               for seed, bleu in ((1, 68.0), (2, 70.0))]
    for result, unconstrained in zip(results, (60.0, 64.0)):
        result["test"]["output_constraint"] = "permutation of the source words"
        result["test"]["unconstrained"] = {"metrics": {"bleu": unconstrained}}
    results.append(_result("indigo-l2r-word-order", "word_order", "indigo", 1, 63.0))
    results[-1]["test"]["output_constraint"] = None
    spread = zoo_statistics.seed_spread(results)
    assert spread[0]["bleu"]["mean"] == 69.0
    assert spread[0]["unconstrained_bleu"] == {"mean": 62.0, "sd": round(2 * 2 ** 0.5, 2), "min": 60.0, "max": 64.0}
    [row] = zoo_statistics.against_baseline(results, spread)
    assert row["baseline_decoding"] == "unconstrained" and row["difference"] == 1.0
    # a method decoded under the same constraint as the baseline is read against its constrained score
    results[-1]["test"]["output_constraint"] = "permutation of the source words"
    [row] = zoo_statistics.against_baseline(results, zoo_statistics.seed_spread(results))
    assert row["baseline_decoding"] == "its own" and row["difference"] == -6.0


def test_indigo_orders_are_rendered_against_l2r_and_the_baseline(tmp_path):
    path = write_recipes(tmp_path, (
        "  - {name: base-s1, task: word_order, model_type: flexformer, seed: 1, claim: baseline}\n"
        "  - {name: base-s2, task: word_order, model_type: flexformer, seed: 2, claim: baseline}\n"
        "  - {name: l2r, task: word_order, model_type: indigo, flags: [--order, l2r], claim: indigo}\n"
        "  - {name: sao, task: word_order, model_type: indigo, flags: [--order, sao], init_from: l2r, claim: indigo}\n"
        "  - {name: l2r-on, task: word_order, model_type: indigo, flags: [--order, l2r], init_from: l2r, "
        "claim: indigo}\n"
        "  - {name: r2l, task: word_order, model_type: indigo, flags: [--order, r2l], claim: indigo}\n"
        "  - {name: l2r-translation, task: translation, model_type: indigo, flags: [--order, l2r], claim: indigo}\n"),
        header=RECIPE_HEADER + TRANSLATION_TASK)
    recipes = zoo_recipes.load_recipes(path)
    records = tmp_path / "records"
    records.mkdir()
    share = "insertions right of the previous word (left-to-right share)"
    for recipe, bleu, unconstrained in zip(recipes, (68.0, 70.0, 50.0, 52.5, 51.0, 49.0, 30.0),
                                           (60.0, 64.0) + (None,) * 5):
        result = _rendered_result(recipe, bleu, {} if unconstrained else {share: 0.9}, 1_000_000)
        if unconstrained is not None:
            result["test"]["output_constraint"] = "permutation of the source words"
            result["test"]["unconstrained"] = {"metrics": {"bleu": unconstrained}}
        (records / f"{recipe.name}.json").write_text(json.dumps(result))
    docs = tmp_path / "ZOO.md"
    zoo_report.render(recipes, tmp_path / "runs", docs, records)
    text = docs.read_text()
    assert "### InDIGO on word_order: generation orders against L2R" in text
    # SAO against L2R trained on from the same model for as long; L2R trained on and R2L against L2R from scratch
    assert "| l2r | l2r | 3 | 50.00 | 50.00 | 40.00 | — | — | 0.9 |" in text
    assert "| sao | sao | 3 after `l2r` | 52.50 | 50.00 | 40.00 | +1.50 | l2r-on | 0.9 |" in text
    assert "| l2r | l2r-on | 3 after `l2r` | 51.00 | 50.00 | 40.00 | +1.00 | l2r | 0.9 |" in text
    assert "| r2l | r2l | 3 | 49.00 | 50.00 | 40.00 | -1.00 | l2r | 0.9 |" in text
    assert ("test BLEU 69.00 ± 1.41 with outputs constrained to a permutation of the source words, and "
            "62.00 ± 2.83 without the constraint.") in text
    assert "| sao | indigo | 52.50 | 62.00 ± 2.83 (2 unconstrained) | -9.50 | -3.4 |" in text
    assert "test BLEU decoded without the permutation of the source words constraint: 60.00" in text
    # each task its own table and plot: a translation score is not drawn beside word order's copy line
    assert "### InDIGO on translation: generation orders against L2R" in text
    assert "| l2r | l2r-translation | 3 | 30.00 | 50.00 | 40.00 | — | — | 0.9 |" in text
    for task in ("word_order", "translation"):
        assert (tmp_path / "zoo" / f"indigo_orders_{task}.png").stat().st_size > 0
        assert f"(zoo/indigo_orders_{task}.png)" in text


def test_indigo_order_plot_draws_one_bar_per_order_with_its_seeds_together():
    def result(name: str, bleu: float) -> dict:
        return {"recipe": {"name": name}, "test": {"metrics": {"bleu": bleu}}}

    indigo = [result("indigo-l2r-word-order", 54.32), result("indigo-sao-word-order", 51.83),
              result("indigo-l2r-continued-word-order", 54.62), result("indigo-l2r-word-order-s2", 54.68),
              result("indigo-sao-word-order-s2", 51.64), result("indigo-l2r-continued-word-order-s2", 54.54)]
    assert indigo_method.indigo_order_bars(indigo, "word_order") == {
        "l2r": [54.32, 54.68], "sao": [51.83, 51.64], "l2r-continued": [54.62, 54.54]}


def test_a_method_trained_on_from_a_baseline_is_read_against_the_baseline_trained_on_alike(tmp_path):
    """MAT's second phase re-warms the learning rate and adds updates: ZOO.md reads it against the baseline trained on
    from the same model for the same updates at the same peak rate (not a different rate), and says when that
    control is missing; every row of the main table names its peak rate."""
    path = write_recipes(tmp_path, (
        "  - {name: half, task: word_order, model_type: flexformer, updates: 3, claim: mat-init}\n"
        "  - {name: mat-fast, task: word_order, model_type: mat, updates: 3, init_from: half, claim: mat}\n"
        "  - {name: mat-slow, task: word_order, model_type: mat, updates: 3, init_from: half, claim: mat, "
        "flags: [--learning_rate, '3e-4']}\n"
        "  - {name: half-on-slow, task: word_order, model_type: flexformer, updates: 3, init_from: half, "
        "claim: mat-init, flags: [--learning_rate, '3e-4']}\n"))
    recipes = zoo_recipes.load_recipes(path)
    records = tmp_path / "records"
    records.mkdir()
    for recipe, bleu in zip(recipes, (40.0, 39.0, 42.5, 41.0)):
        (records / f"{recipe.name}.json").write_text(json.dumps(_rendered_result(recipe, bleu, {}, 1_000)))
    docs = tmp_path / "ZOO.md"
    zoo_report.render(recipes, tmp_path / "runs", docs, records)
    text = docs.read_text()
    rate = recipes[0].task_settings["learning_rate"]
    assert "### Methods trained on from a baseline's model, against the baseline trained on alike" in text
    assert f"| mat-fast | half (40.00) | 3 ({rate:g}) | 39.00 | not trained | — | — |" in text
    assert "| mat-slow | half (40.00) | 3 (0.0003) | 42.50 | half-on-slow | 41.00 | +1.50 |" in text
    assert f"| half | mat-init | 1 | 1,000 | 3 ({recipes[0].lr_scheduler}, {rate:g}) |" in text
    assert f"| mat-slow | mat | 1 | 1,000 | 3 ({recipes[0].lr_scheduler}, 0.0003) |" in text
    assert not (tmp_path / "zoo" / "curves_word_order.png").exists()  # no run has a curve: no empty plot


def test_the_case_verification_reuses_the_evaluations_hypotheses_only_for_the_same_sentences(tmp_path):
    rows = [{"source": s, "reference": "r", "hypothesis": h} for s, h in (("a b", "x"), ("c d", "y"))]
    (tmp_path / "generations.test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert zoo_runner.evaluated_hypotheses(tmp_path, ["a b", "c d"]) == ["x", "y"]
    assert zoo_runner.evaluated_hypotheses(tmp_path, ["a b", "c d", "e f"]) == ["x", "y"]  # the smoke mode's first ones
    assert zoo_runner.evaluated_hypotheses(tmp_path, ["c d", "a b"]) is None
    assert zoo_runner.evaluated_hypotheses(tmp_path / "missing", ["a b"]) is None


def test_the_table_shows_the_flatness_of_both_rules_and_says_when_the_rule_changed(tmp_path):
    """A rule that changed after runs it judges is shown beside the new one: each row's gain by both, the seed
    spread's flat counts by both, and a sentence naming the change."""
    path = write_recipes(tmp_path, (
        "  - {name: base-s1, task: word_order, model_type: flexformer, claim: baseline, seed: 1}\n"
        "  - {name: base-s2, task: word_order, model_type: flexformer, claim: baseline, seed: 2}\n"))
    first, second = zoo_recipes.load_recipes(path)
    # flat by today's rule (the last fifth's line rises 0.13) but not by the window means (31.05 - 28.5 = 2.55)
    jumped = [{"update": u, "bleu": b} for u, b in ((650, 28.0), (750, 29.0), (850, 31.0), (1000, 31.1))]
    level = [{"update": u, "bleu": b} for u, b in ((650, 31.0), (750, 31.0), (850, 31.1), (1000, 31.1))]
    records = tmp_path / "records"
    records.mkdir()
    for recipe, curve in ((first, jumped), (second, level)):
        result = {**_rendered_result(recipe, 40.0, {}, 1_000), "validation_curve": curve}
        (records / f"{recipe.name}.json").write_text(json.dumps(result))
    docs = tmp_path / "ZOO.md"
    zoo_report.render([first, second], tmp_path / "runs", docs, records)
    text = docs.read_text()
    assert f"until {zoo_statistics.FLATNESS_RULE_CHANGE}" in text
    base_row = next(line for line in text.splitlines() if line.startswith("| base-s1 |"))
    assert base_row.split(" | ")[-3:-1] == ["0.13", "2.55"]  # today's gain, the earlier rule's
    spread_row = next(line for line in text.splitlines() if line.startswith("| base | word_order |"))
    assert spread_row.endswith("| 2 of 2 (1) |")
