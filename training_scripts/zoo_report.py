"""The zoo's report, ``docs/ZOO.md``: every finished recipe's row, the seed spreads, the methods against their
baseline and against the baseline trained on alike, the learning curves, and each method's own sections and plots
(``MethodSpec.zoo_report``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from flexformers.training_scripts.model_registry import available_model_types, get_method_spec
from flexformers.training_scripts.zoo_comparisons import RegisteredComparison, comparison_lines
from flexformers.training_scripts.zoo_recipes import ZooRecipe
from flexformers.training_scripts.zoo_runner import finished_results, recipe_status
from flexformers.training_scripts.zoo_statistics import (
    FLAT_CURVE_GAIN,
    FLATNESS_RULE_CHANGE,
    LEARNED_OVER_COPY,
    against_baseline,
    is_baseline_result,
    last_fifth_gain,
    peak_learning_rate,
    seed_spread,
    window_means_gain,
)


def plain_figure_parts(figures: dict, leave_out: tuple[str, ...] = ()) -> list[str]:
    """``name: value`` of each figure but those left out (the tables a method's own section renders)."""
    return [f"{name}: {value}" for name, value in figures.items() if name not in leave_out]


def figure_text(result: dict) -> str:
    """The table's "method figures" cell of a result: the method's figures (``MethodSpec.zoo_figures_text``, else
    each as ``name: value``), then what the test split shows beyond BLEU (parsing code, the unconstrained decoding,
    the pairs within the training lengths)."""
    model_type = (result.get("recipe") or {}).get("model_type")
    summarise = None if model_type is None else get_method_spec(model_type).zoo_figures_text
    parts = (plain_figure_parts if summarise is None else summarise)(result["figures"])
    pov = result["test"]["metrics"].get("pov")
    if pov is not None:
        # code's own figure (the issue's "PoV for code"): BLEU rewards code-shaped text that does not parse
        parts.insert(0, f"outputs that parse as Python (PoV): {pov:.2f}% (copying the docstring: "
                        f"{result['test']['copy_baseline']['pov']:.2f}%)")
    unconstrained = result["test"].get("unconstrained")
    if unconstrained:
        parts.append(f"test BLEU decoded without the {result['test']['output_constraint']} constraint: "
                     f"{unconstrained['metrics']['bleu']:.2f}")
    within_lengths = result["test"].get("within_training_lengths")
    if within_lengths:
        parts.append(f"test BLEU on the {within_lengths['num_examples']:,} pairs within the training lengths (the "
                     f"other {result['test']['beyond_training_lengths']:,} are longer; training drops such pairs): "
                     f"{within_lengths['metrics']['bleu']:.2f} (copying {within_lengths['copy_baseline']['bleu']:.2f})")
    return "; ".join(parts).replace("|", "/")


def baseline_trained_on_alike(result: dict, results: list[dict]) -> dict | None:
    """The control of a method trained on from another recipe's model (MAT from its proximal initialisation): the
    baseline model type trained on from the same model for the same updates at the same peak rate."""
    recipe = result["recipe"]
    return next((other for other in results if other is not result
                 and is_baseline_result(other)
                 and other["recipe"].get("init_from") == recipe["init_from"]
                 and other["updates"] == result["updates"]
                 and peak_learning_rate(other["recipe"]) == peak_learning_rate(recipe)), None)


def trained_on_lines(results: list[dict]) -> list[str]:
    """ZOO.md's table of the methods trained on from a baseline's model, each beside its control: the second phase
    re-warms the learning rate and adds updates that the method's own structure is not credited with."""
    # a method that reads its own trained-on recipes (InDIGO's orders against its L2R run) has its own section
    started = [r for r in results if r["recipe"].get("init_from") and not is_baseline_result(r)
               and not get_method_spec(r["recipe"]["model_type"]).compares_own_starts]
    if not started:
        return []
    by_name = {r["recipe"]["name"]: r for r in results}
    lines = ["", "### Methods trained on from a baseline's model, against the baseline trained on alike", "",
             "The control is the baseline trained on from the same model for the same updates at the same peak "
             "learning rate: the difference is what the method adds, not what its second phase does.", "",
             "| recipe | starting model (its test BLEU) | updates (peak rate) | test BLEU | control | control BLEU | "
             "− control |",
             "|---|---|---|---|---|---|---|"]
    for result in started:
        recipe, bleu = result["recipe"], result["test"]["metrics"]["bleu"]
        initial = by_name.get(recipe["init_from"])
        start = recipe["init_from"] + ("" if initial is None else f" ({initial['test']['metrics']['bleu']:.2f})")
        control = baseline_trained_on_alike(result, results)
        control_bleu = None if control is None else control["test"]["metrics"]["bleu"]
        rate = peak_learning_rate(recipe)
        lines.append(f"| {recipe['name']} | {start} | {result['updates']:,}{'' if rate is None else f' ({rate:g})'} | "
                     f"{bleu:.2f} | {'not trained' if control is None else control['recipe']['name']} | "
                     f"{'—' if control is None else f'{control_bleu:.2f}'} | "
                     f"{'—' if control is None else f'{bleu - control_bleu:+.2f}'} |")
    return lines


def render(recipes: list[ZooRecipe], runs_dir: Path, docs_path: Path, records_dir: Path | None = None,
           comparisons: Sequence[RegisteredComparison] = ()) -> Path:
    """Write ``docs_path`` (the zoo's table and plots, from every finished recipe: its run folder, or else its
    record; each registered comparison's verdict) and its plots beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = finished_results(recipes, runs_dir, records_dir)
    plots_dir = docs_path.parent / "zoo"
    plots_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "# The zoo: trained models and the papers' claims",
        "",
        "Written by `flexformers-zoo render` from the finished recipes of `training_scripts/zoo_recipes.yaml`",
        "(`flexformers-zoo run --all` trains them, resuming across sessions; each finished recipe's full result,",
        "curve included, is recorded in `docs/zoo/results/<recipe>.json`). Scores are on the whole test split,",
        "beside copying the input on the same examples. A curve has flattened when its last fifth of updates gains",
        f"< {FLAT_CURVE_GAIN} validation BLEU: the rise of a least-squares line through its points in that fifth",
        "(every point weighs in, so no single greedy evaluation decides). Its points are greedy BLEU on a fixed",
        "validation subset of the pairs within the training lengths (training drops longer ones; so does the curve).",
        f"**This rule changed after runs it judges**: until {FLATNESS_RULE_CHANGE} a curve's gain was the mean of its",
        "points in the last fifth minus the mean of those in the fifth before, and the change that replaced it also",
        "recorded two baseline seeds which that rule, at the time they finished, did not count as flat. Both are shown:",
        "\"last-fifth gain\" and the flat counts follow today's rule, \"earlier rule\" is the window-means gain.",
        "",
        ("| recipe | claim | seed | params | updates (learning rate) | wall time | machine | test BLEU | chrF | TER |"
         " copy BLEU / chrF | BLEU over copy | last-fifth gain | earlier rule | method figures |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        recipe, test = result["recipe"], result["test"]
        metrics, copy = test["metrics"], test["copy_baseline"]
        gain = last_fifth_gain(result["validation_curve"])  # from the curve, so every row follows today's criterion
        earlier_gain = window_means_gain(result["validation_curve"])
        lines.append(
            f"| {recipe['name']} | {recipe['claim']} | {recipe['seed']} | {result['parameters']:,} | "
            f"{result['updates']:,} ({recipe.get('lr_scheduler', 'inverse_sqrt')}"
            f"{'' if peak_learning_rate(recipe) is None else f', {peak_learning_rate(recipe):g}'}) | "
            f"{result['training_seconds'] / 60:.0f} min ({result['sessions']} run(s)) | "
            f"{result['machine']} | {metrics['bleu']:.2f} | {metrics['chrf']:.2f} | {metrics['ter']:.2f} | "
            f"{copy['bleu']:.2f} / {copy['chrf']:.2f} | {test['gain_over_copy']['bleu']:+.2f} | "
            f"{'—' if gain is None else gain} | {'—' if earlier_gain is None else earlier_gain} | "
            f"{figure_text(result)} |"
        )
    spread = seed_spread(results)
    if spread:
        lines += ["", "### Seed spread", "",
                  "Test scores over the seeds of each configuration (sample standard deviation): a difference between "
                  "two configurations smaller than about two of these is not a difference.", "",
                  "| configuration | task | seeds | test BLEU mean ± sd | min – max | chrF mean ± sd | "
                  f"seeds converged (flat, ≥ +{LEARNED_OVER_COPY:g} over copy; by the earlier rule) |",
                  "|---|---|---|---|---|---|---|"]
        for row in spread:
            bleu, chrf = row["bleu"], row["chrf"]
            lines.append(f"| {row['group']} | {row['task']} | {', '.join(map(str, row['seeds']))} | "
                         f"{bleu['mean']:.2f} ± {bleu['sd']:.2f} | {bleu['min']:.2f} – {bleu['max']:.2f} | "
                         f"{chrf['mean']:.2f} ± {chrf['sd']:.2f} | {row['converged_seeds']} of {len(row['seeds'])} "
                         f"({row['converged_seeds_earlier_rule']}) |")
    compared = against_baseline(results, spread)
    if compared:
        lines += ["", "### Against the baseline's seeds", "",
                  "A row whose baseline seeds have not all converged compares how fast two models start, not what "
                  "a paper claims: read nothing from it. The baseline is decoded as the method is: InDIGO inserts "
                  "tokens anywhere and is not constrained to a permutation of the input on word order (its paper "
                  "does not restrict it either), so it is read against the baseline decoded without that "
                  "constraint (\"unconstrained\").", "",
                  "| recipe | claim | test BLEU | baseline mean ± sd (seeds) | difference | in baseline sd | "
                  "baseline converged |",
                  "|---|---|---|---|---|---|---|"]
        for row in compared:
            baseline = row["baseline"]
            in_sd = "—" if row["in_sd"] is None else f"{row['in_sd']:+.1f}"
            scores = row["baseline_bleu"]
            decoded = " unconstrained" if row["baseline_decoding"] == "unconstrained" else ""
            lines.append(f"| {row['recipe']} | {row['claim']} | {row['bleu']:.2f} | {scores['mean']:.2f} ± "
                         f"{scores['sd']:.2f} ({len(baseline['seeds'])}{decoded}) | {row['difference']:+.2f} | "
                         f"{in_sd} | {baseline['converged_seeds']} of {len(baseline['seeds'])} seeds "
                         f"({baseline['converged_seeds_earlier_rule']} by the earlier rule) |")
    lines += comparison_lines(list(comparisons), results)
    lines += trained_on_lines(results)
    method_plots = []
    for model_type in available_model_types():  # each method's own sections and plots, from every result
        report = get_method_spec(model_type).zoo_report
        if report is not None:
            method_lines, plots_of_method = report(results, spread, plots_dir)
            lines += method_lines
            method_plots += plots_of_method
    if not results:
        lines += ["", "No recipe has finished yet: the table fills in as `flexformers-zoo run --all` completes them."]
    finished = {result["recipe"]["name"] for result in results}
    pending = [f"`{recipe.name}` ({recipe_status(recipe, runs_dir, records_dir)})" for recipe in recipes
               if recipe.name not in finished]
    if pending:
        lines += ["", "Not finished yet: " + ", ".join(pending) + "."]
    superseded = sorted(path.parent for path in (plots_dir / "superseded").glob("*/README.md"))
    if superseded:
        lines += ["", "Results of earlier versions of these recipes, and why they changed: " + ", ".join(
            f"[{folder.name}]({folder.relative_to(docs_path.parent).as_posix()}/README.md)" for folder in superseded)
            + "."]
    plots = []
    for task in sorted({result["recipe"]["task"] for result in results if result["validation_curve"]}):
        figure, axis = plt.subplots(figsize=(7.5, 4.2))
        copy_line = None
        for result in (r for r in results if r["recipe"]["task"] == task):
            curve = result["validation_curve"]
            if curve:
                constraint = result["test"].get("output_constraint")
                # a run trained on from another recipe's model is drawn after that model's updates
                initial = next((r for r in results if r["recipe"]["name"] == result["recipe"].get("init_from")), None)
                offset = 0 if initial is None else initial["updates"]
                axis.plot([offset + p["update"] for p in curve], [p["bleu"] for p in curve], marker=".",
                          label=result["recipe"]["name"] + (f" (outputs: {constraint})" if constraint else ""))
                copy_line = curve[-1].get("copy_bleu") or copy_line
        if copy_line is not None:
            axis.axhline(copy_line, color="black", linestyle="--", label=f"copying the input ({copy_line:.1f})")
        axis.set_xlabel("update")
        axis.set_ylabel("validation BLEU (greedy, fixed subset)")
        axis.set_title(f"learning curves: {task}")
        axis.legend(fontsize=7)
        figure.tight_layout()
        path = plots_dir / f"curves_{task}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        plots.append((f"Learning curves, {task}", path))
    plots += method_plots
    for title, path in plots:
        lines += ["", f"### {title}", "", f"![{title}]({path.relative_to(docs_path.parent).as_posix()})"]
    docs_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return docs_path
