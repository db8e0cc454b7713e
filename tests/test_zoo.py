"""flexformers-zoo: the recipe file, resuming, the results and docs/ZOO.md."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flexformers.training_scripts import zoo, zoo_recipes, zoo_runner, zoo_statistics
from flexformers.training_scripts.methods import indigo as indigo_method
from flexformers.training_scripts.methods import iot as iot_method

RECIPE_HEADER = """
defaults: {updates: 3, eval_every: 2}
tasks:
  word_order:
    data: [--task, word_order, --word_order_base, gettext]
    vocab_size: 1000
    max_source_length: 48
    max_target_length: 48
    batch_size: 4
    learning_rate: 3.0e-3
    warmup_steps: 1
"""


TRANSLATION_TASK = """  translation:
    data: [--task, translation, --target_lang, de]
    vocab_size: 1000
    max_source_length: 48
    max_target_length: 64
    batch_size: 4
    learning_rate: 3.0e-3
    warmup_steps: 1
"""


def write_recipes(tmp_path: Path, recipes: str, header: str = RECIPE_HEADER) -> Path:
    path = tmp_path / "recipes.yaml"
    path.write_text(header + "recipes:\n" + recipes)
    return path


def test_the_shipped_recipes_are_valid_and_cover_every_claim():
    recipes = zoo_recipes.load_recipes()
    names = [recipe.name for recipe in recipes]
    assert len(names) == len(set(names))
    claims = {recipe.claim for recipe in recipes}
    assert {"baseline", "iot", "mat", "depth-adaptive", "indigo"} <= claims
    baselines = [r for r in recipes if r.claim == "baseline"]
    for task in ("translation", "word_order"):
        assert len({r.seed for r in baselines if r.task == task}) >= 3  # the seed spread
    by_name = {recipe.name: recipe for recipe in recipes}
    for recipe in recipes:
        if recipe.init_from:
            assert names.index(recipe.init_from) < names.index(recipe.name)
    assert by_name["mat-proximal-translation-s1"].init_from == "baseline-translation-half"
    # MAT with proximal init trains as many updates in all as the baseline it is compared with
    assert (by_name["baseline-translation-half"].updates + by_name["mat-proximal-translation-s1"].updates
            == by_name["baseline-translation-s1"].updates)
    assert by_name["indigo-sao-word-order"].init_from == "indigo-l2r-word-order"


def test_syn_recipes_name_the_spacy_pipeline_they_parse_with(tmp_path):
    path = write_recipes(tmp_path, """  - {name: syn, task: word_order, model_type: indigo, flags: [--order, syn]}
  - {name: syn-own, task: word_order, model_type: indigo, flags: [--order, syn, --spacy_model, en_core_web_md]}
  - {name: l2r, task: word_order, model_type: indigo, flags: [--order, l2r]}
  - {name: base, task: word_order, model_type: flexformer}
""")
    assert [indigo_method.syn_spacy_pipeline(recipe.flags) for recipe in zoo_recipes.load_recipes(path)] == [
        "en_core_web_sm", "en_core_web_md", None, None]
    shipped = {recipe.name: recipe for recipe in zoo_recipes.load_recipes()}
    assert indigo_method.syn_spacy_pipeline(shipped["indigo-syn-word-order"].flags) == "en_core_web_sm"
    assert [name for name, recipe in shipped.items() if indigo_method.syn_spacy_pipeline(recipe.flags)] == [
        "indigo-syn-word-order"]


def test_without_spacy_run_all_skips_the_syn_recipes_and_naming_one_is_a_clear_error(tmp_path, monkeypatch, capsys):
    path = write_recipes(tmp_path, """  - {name: base, task: word_order, model_type: flexformer}
  - {name: syn, task: word_order, model_type: indigo, flags: [--order, syn]}
""")
    missing = "The SYN order needs spaCy with an English pipeline (test)"
    monkeypatch.setattr(indigo_method, "spacy_pipeline_missing", lambda name: missing)
    ran = []

    def fake_run(recipe, runs_dir, **kwargs):
        ran.append(recipe.name)
        return {"updates": 3, "test": {"metrics": {"bleu": 1.0}, "copy_baseline": {"bleu": 0.5}}}

    argv = ["--recipes", str(path), "--runs_dir", str(tmp_path / "runs")]
    with monkeypatch.context() as patch:
        patch.setattr(zoo, "run_recipe", fake_run)
        assert zoo.main([*argv, "run", "--all", "--smoke"]) == 0
    assert ran == ["base"]
    assert ("skipping the recipes that cannot train on this machine (syn): it parses its targets with spaCy "
            f"(InDIGO's SYN order): {missing}") in capsys.readouterr().out
    assert zoo.main([*argv, "run", "syn", "--smoke"]) == 1  # nothing is trained: the parser is checked first
    assert ("recipe 'syn' cannot train on this machine: it parses its targets with spaCy (InDIGO's SYN order): "
            f"{missing}") in capsys.readouterr().err
    assert zoo_runner.trained_updates(tmp_path / "runs" / "syn") == 0


@pytest.mark.parametrize(("recipes", "message"), [
    ("  - {task: word_order, model_type: flexformer}\n", "recipe 1 has no name"),
    ("  - {name: a, task: poetry, model_type: flexformer}\n", "recipe 'a': task 'poetry' is not under 'tasks:'"),
    ("  - {name: a, task: word_order, model_type: gpt}\n", "recipe 'a': model_type 'gpt' is not one of"),
    ("  - {name: a, task: word_order, model_type: flexformer, epochs: 3}\n", "recipe 'a': unknown field\\(s\\) epochs"),
    ("  - {name: a, task: word_order, model_type: flexformer, updates: -5}\n", "updates must be an integer >= 1"),
    ("  - {name: a, task: word_order, model_type: mat, init_from: b}\n", "init_from 'b' must name an earlier recipe"),
    ("  - {name: a, task: word_order, model_type: flexformer}\n  - {name: a, task: word_order, model_type: iot}\n",
     "recipe name 'a' appears twice"),
    ("  - {name: a, task: word_order, model_type: flexformer, size: huge}\n", "size must be one of"),
    ("  - {name: a, task: word_order, model_type: flexformer, lr_scheduler: cosine_annealing}\n",
     "recipe 'a': lr_scheduler must be one of .*cosine.*got 'cosine_annealing'"),
])
def test_malformed_recipes_are_named(tmp_path, recipes, message):
    with pytest.raises(ValueError, match=message):
        zoo_recipes.load_recipes(write_recipes(tmp_path, recipes))


def test_malformed_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        zoo_recipes.load_recipes(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("recipes: [unclosed\n")
    with pytest.raises(ValueError, match="bad.yaml is not valid YAML"):
        zoo_recipes.load_recipes(tmp_path / "bad.yaml")
    (tmp_path / "empty.yaml").write_text("tasks: {}\n")
    with pytest.raises(ValueError, match="needs a non-empty 'recipes:' list"):
        zoo_recipes.load_recipes(tmp_path / "empty.yaml")
    header = RECIPE_HEADER.replace("    warmup_steps: 1\n", "")
    with pytest.raises(ValueError, match="task 'word_order': missing warmup_steps"):
        zoo_recipes.load_recipes(write_recipes(tmp_path, "  - {name: a, task: word_order, model_type: flexformer}\n", header))


def test_the_command_line_names_bad_requests(tmp_path, capsys):
    path = write_recipes(tmp_path, "  - {name: a, task: word_order, model_type: flexformer}\n")
    assert zoo.main(["--recipes", str(path), "--runs_dir", str(tmp_path / "runs"), "run", "b"]) == 1
    assert "no recipe named b" in capsys.readouterr().err
    assert zoo.main(["--recipes", str(path), "--runs_dir", str(tmp_path / "runs"), "run"]) == 1
    assert "or pass --all" in capsys.readouterr().err
    assert zoo.main(["--recipes", str(path), "--runs_dir", str(tmp_path / "runs"), "list"]) == 0
    assert "not started" in capsys.readouterr().out


def test_last_fifth_gain_reads_the_flattening_criterion():
    rising = [{"update": u, "bleu": b} for u, b in [(1000, 10), (2000, 20), (3000, 25), (4000, 28), (5000, 30)]]
    assert zoo_statistics.last_fifth_gain(rising) == 2.0  # one point in each window: update 5000 against update 4000
    flat = [{"update": u, "bleu": b} for u, b in [(1000, 10), (2000, 20), (3000, 25), (4000, 30.0), (5000, 30.3)]]
    assert zoo_statistics.last_fifth_gain(flat) == pytest.approx(0.3)
    assert zoo_statistics.last_fifth_gain(flat[:1]) is None  # too few points to say
    assert zoo_statistics.last_fifth_gain([]) is None


def test_last_fifth_gain_fits_a_line_through_the_points_of_the_last_fifth():
    # baseline-translation-s1 under the cosine schedule (updates 19k-25k, 1,000 validation sentences): settled
    tail = [38.52, 38.91, 38.94, 39.04, 39.25, 39.16, 39.22]
    curve = [{"update": 1000 * (19 + i), "bleu": b} for i, b in enumerate(tail)]
    xs, ys = list(range(6)), tail[1:]  # the fifth is updates 20k-25k, its starting point included, 19k outside
    slope = sum((x - 2.5) * (y - sum(ys) / 6) for x, y in zip(xs, ys)) / sum((x - 2.5) ** 2 for x in xs)
    assert zoo_statistics.last_fifth_gain(curve) == pytest.approx(round(slope * 5, 2))
    assert zoo_statistics.last_fifth_gain(curve) < zoo_statistics.FLAT_CURVE_GAIN  # although the last point is 0.31 above the first
    # one noisy point moves a line through six points by far less than a difference of two points
    noisy = [dict(point) for point in curve]
    noisy[-1]["bleu"] += 1.0
    assert zoo_statistics.last_fifth_gain(noisy) - zoo_statistics.last_fifth_gain(curve) == pytest.approx(2.5 / 17.5 * 5, abs=0.01)
    # the first inverse-sqrt run of the same seed at 15k (300 sentences): still rising over its last fifth, which
    # the means of the last two fifths (-0.12) missed; it gained 2.3 test BLEU by 25k
    s1 = [4.04, 6.34, 11.93, 16.79, 18.36, 18.78, 19.68, 20.45, 21.35, 21.58, 22.78, 21.73, 20.73, 23.51, 21.49]
    early = [{"update": 1000 * (i + 1), "bleu": b} for i, b in enumerate(s1)]
    assert zoo_statistics.last_fifth_gain(early) > zoo_statistics.FLAT_CURVE_GAIN


def _result(name: str, task: str, claim: str, seed: int, bleu: float, chrf: float = 50.0) -> dict:
    return {"recipe": {"name": name, "task": task, "claim": claim, "seed": seed},
            "test": {"metrics": {"bleu": bleu, "chrf": chrf}}}


def test_seed_spread_groups_the_seeds_of_one_configuration_and_methods_are_read_against_it():
    results = [_result("baseline-translation-s1", "translation", "baseline", 1, 36.0, 56.0),
               _result("baseline-translation-s2", "translation", "baseline", 2, 37.0, 57.0),
               _result("baseline-translation-s3", "translation", "baseline", 3, 38.0, 55.0),
               _result("baseline-word-order-s1", "word_order", "baseline", 1, 60.0),
               _result("mat-proximal-translation-s1", "mat", "mat", 1, 39.0),
               _result("indigo-l2r-word-order", "word_order", "indigo", 1, 50.0)]
    results[4]["recipe"]["task"] = "translation"
    spread = zoo_statistics.seed_spread(results)
    assert [row["group"] for row in spread] == ["baseline-translation"]  # single seeds have no spread
    row = spread[0]
    assert row["seeds"] == [1, 2, 3]
    assert row["bleu"] == {"mean": 37.0, "sd": 1.0, "min": 36.0, "max": 38.0}
    assert row["chrf"]["mean"] == 56.0 and row["chrf"]["sd"] == 1.0
    compared = zoo_statistics.against_baseline(results, spread)
    # word order has one baseline seed: no spread to read InDIGO against yet
    assert [(r["recipe"], r["difference"], r["in_sd"]) for r in compared] == [("mat-proximal-translation-s1", 2.0, 2.0)]
    assert row["converged_seeds"] == 0  # these results have no curve
    assert zoo_statistics.seed_group("baseline-translation-s12") == "baseline-translation"
    assert zoo_statistics.seed_group("baseline-translation-half") == "baseline-translation-half"


def test_a_converged_baseline_has_a_flat_curve_and_scores_well_above_copying():
    flat = [{"update": u, "bleu": b} for u, b in ((600, 30.0), (800, 30.2), (900, 30.1), (1000, 30.3))]
    rising = [{"update": u, "bleu": b} for u, b in ((600, 20.0), (800, 22.0), (1000, 24.0))]
    result = {"test": {"gain_over_copy": {"bleu": 24.7}}, "validation_curve": flat}
    assert zoo_statistics.converged(result)
    assert not zoo_statistics.converged({**result, "validation_curve": rising})  # still climbing
    assert not zoo_statistics.converged({**result, "validation_curve": flat[-1:]})  # one point: no slope to read
    assert not zoo_statistics.converged({**result, "test": {"gain_over_copy": {"bleu": -2.8}}})  # flat, but below copying


def test_the_earlier_flatness_rule_is_the_last_fifths_mean_minus_the_fifth_befores():
    """The rule the zoo used until the least-squares one (window means), kept so the report can show both: one point
    that jumps at the end moves the window means by its share, the least-squares line by more."""
    curve = [{"update": u, "bleu": b} for u, b in ((500, 20.0), (650, 30.0), (750, 31.0), (850, 31.0), (1000, 33.0))]
    # fifth before: updates 650 and 750 (mean 30.5); last fifth: 850 and 1000 (mean 32.0)
    assert zoo_statistics.window_means_gain(curve) == 1.5
    # least squares through (850, 31) and (1000, 33) over the fifth (800 -> 1000): slope 2/150 per update, × 200
    assert zoo_statistics.last_fifth_gain(curve) == 2.67
    assert zoo_statistics.window_means_gain(curve[-1:]) is None  # no fifth before
    assert zoo_statistics.window_means_gain([]) is None
    result = {"test": {"gain_over_copy": {"bleu": 24.7}}, "validation_curve": curve}
    flat_today_only = [{"update": u, "bleu": b} for u, b in ((650, 28.0), (750, 29.0), (850, 31.0), (1000, 31.1))]
    assert zoo_statistics.converged({**result, "validation_curve": flat_today_only})
    assert not zoo_statistics.converged({**result, "validation_curve": flat_today_only},
                                        zoo_statistics.window_means_gain)  # 31.05 - 28.5 = 2.55


def test_training_argv_resumes_and_initialises(tmp_path):
    path = write_recipes(tmp_path, (
        "  - {name: base, task: word_order, model_type: flexformer, seed: 5}\n"
        "  - {name: mat, task: word_order, model_type: mat, init_from: base, overrides: drop_branch_rate=0.3}\n"
        "  - {name: sao, task: word_order, model_type: indigo, init_from: base, flags: [--order, sao]}\n"
    ))
    base, mat, sao = zoo_recipes.load_recipes(path)
    runs = tmp_path / "runs"
    argv = zoo_runner.training_argv(base, runs / "base", runs)
    assert argv[argv.index("--seed") + 1] == "5" and argv[argv.index("--max_steps") + 1] == "3"
    assert "--resume_from_checkpoint" not in argv
    mat_argv = zoo_runner.training_argv(mat, runs / "mat", runs)
    assert mat_argv[mat_argv.index("--baseline_checkpoint") + 1] == str(runs / "base")
    assert "drop_branch_rate=0.3" in mat_argv[mat_argv.index("--config_overrides") + 1]
    sao_argv = zoo_runner.training_argv(sao, runs / "sao", runs)
    assert sao_argv[sao_argv.index("--model_name_or_path") + 1] == str(runs / "base")
    assert "--preset" not in sao_argv and sao_argv[-2:] == ["--order", "sao"]

    # resumed, a run that started from another recipe is built from its own newest checkpoint, not from that recipe
    for name in ("mat", "sao"):
        checkpoint = runs / name / "checkpoint-2"
        checkpoint.mkdir(parents=True)
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 2, "max_steps": 3}))
        save_file({"weight": torch.zeros(1)}, str(checkpoint / "model.safetensors"))
        for state in ("optimizer.pt", "scheduler.pt"):  # a complete checkpoint resumes exactly
            torch.save({}, checkpoint / state)
    for recipe in (mat, sao):
        resumed = zoo_runner.training_argv(recipe, runs / recipe.name, runs)
        assert resumed[resumed.index("--model_name_or_path") + 1] == str(runs / recipe.name / "checkpoint-2")
        assert resumed[resumed.index("--resume_from_checkpoint") + 1] == "latest"
        assert not {"--preset", "--baseline_checkpoint", "--tokenizer_name_or_path"} & set(resumed)
    mat_argv = zoo_runner.training_argv(mat, runs / "mat", runs)
    assert mat_argv[mat_argv.index("--config_overrides") + 1] == "drop_branch_rate=0.3"  # the recipe's own only


@pytest.mark.slow
def test_smoke_runs_resume_and_render(tmp_path):
    """Two recipes in smoke mode: trained, decoded beside the copy baseline, exported; the second is proximally
    initialised from the first. A run cut off after its first checkpoint resumes from it; ZOO.md is rendered."""
    path = write_recipes(tmp_path, (
        "  - {name: base, task: word_order, model_type: flexformer, claim: baseline}\n"
        "  - {name: mat, task: word_order, model_type: mat, init_from: base, claim: mat}\n"
    ))
    runs = tmp_path / "runs"
    argv = ["--recipes", str(path), "--runs_dir", str(runs), "--records_dir", str(tmp_path / "records")]
    assert zoo.main([*argv, "run", "--all", "--smoke"]) == 0
    for name in ("base", "mat"):
        result = json.loads((runs / name / zoo_runner.RESULT_FILE).read_text())
        assert result["updates"] == zoo_recipes.SMOKE_UPDATES and result["smoke"]
        assert set(result["test"]["metrics"]) == set(result["test"]["copy_baseline"]) == {"bleu", "chrf", "ter"}
        assert result["test"]["output_constraint"] == "permutation of the source words"
        assert set(result["test"]["unconstrained"]["metrics"]) == {"bleu", "chrf", "ter"}  # InDIGO's reading
        assert (runs / "hub" / name / "README.md").is_file() and (runs / "hub" / name / "config.json").is_file()
    assert json.loads((runs / "mat" / "config.json").read_text())["model_type"] == "mat"

    # cut off: the result, the final model and the last checkpoint are gone, the first checkpoint is left
    base = runs / "base"
    (base / zoo_runner.RESULT_FILE).unlink()
    (base / "model.safetensors").unlink()
    (base / "trainer_state.json").unlink()
    shutil.rmtree(base / f"checkpoint-{zoo_recipes.SMOKE_UPDATES}")
    assert zoo_runner.trained_updates(base) == 2
    assert zoo.main([*argv, "run", "base", "--smoke"]) == 0
    progress = json.loads((base / zoo_runner.PROGRESS_FILE).read_text())["segments"]
    assert [(s["from_update"], s["to_update"]) for s in progress] == [(0, 3), (2, 3)]
    assert zoo.main([*argv, "run", "--all", "--smoke"]) == 0  # finished recipes are skipped

    docs = tmp_path / "docs" / "ZOO.md"
    assert zoo.main([*argv, "render", "--docs", str(docs)]) == 0
    text = docs.read_text()
    assert "| base | baseline |" in text and "| mat | mat |" in text
    assert (tmp_path / "docs" / "zoo" / "curves_word_order.png").is_file()

    # a run that started from another recipe resumes without that recipe's run folder (a GPU head start resumed on
    # another machine, where only the starting recipe's record is): its own checkpoint holds the start trained on
    mat = runs / "mat"
    for name in (zoo_runner.RESULT_FILE, "model.safetensors", "trainer_state.json"):
        (mat / name).unlink()
    shutil.rmtree(mat / f"checkpoint-{zoo_recipes.SMOKE_UPDATES}")
    shutil.rmtree(base)
    assert zoo.main([*argv, "run", "mat", "--smoke", "--no_export"]) == 0
    progress = json.loads((mat / zoo_runner.PROGRESS_FILE).read_text())["segments"]
    assert [(s["from_update"], s["to_update"]) for s in progress] == [(0, 3), (2, 3)]
    assert json.loads((mat / "config.json").read_text())["model_type"] == "mat"


@pytest.mark.slow
def test_a_deadline_stops_training_cleanly_and_the_next_run_resumes(tmp_path, monkeypatch):
    """`run --max_minutes`: training stops at the deadline with a checkpoint, the recipe is left unfinished (no
    evaluation, no result) with its segment recorded, and the next run resumes it to the end."""
    path = write_recipes(tmp_path, "  - {name: base, task: word_order, model_type: flexformer, claim: baseline}\n")
    (recipe,) = zoo_recipes.load_recipes(path)
    runs = tmp_path / "runs"

    class ZooClockBeforeTheDeadline:  # the zoo's own checks see time 0; training sees the real clock, long past 1.0
        @staticmethod
        def monotonic():
            return 0.0

    with monkeypatch.context() as patch:
        patch.setattr(zoo_runner, "time", ZooClockBeforeTheDeadline)
        assert zoo_runner.run_recipe(recipe, runs, smoke=True, export=False, deadline=1.0) is None
    base = runs / "base"
    assert zoo_runner.trained_updates(base) == 1 and (base / "checkpoint-1").is_dir()
    assert not (base / zoo_runner.RESULT_FILE).exists()
    assert zoo_runner.run_recipe(recipe, runs, smoke=True, export=False, deadline=0.0) is None  # past: nothing starts
    assert zoo.main(["--recipes", str(path), "--runs_dir", str(runs), "run", "base", "--smoke", "--no_export"]) == 0
    segments = json.loads((base / zoo_runner.PROGRESS_FILE).read_text())["segments"]
    assert [(s["from_update"], s["to_update"]) for s in segments] == [(0, 1), (1, zoo_recipes.SMOKE_UPDATES)]
    assert json.loads((base / zoo_runner.RESULT_FILE).read_text())["updates"] == zoo_recipes.SMOKE_UPDATES


def test_a_training_segment_is_rewritten_in_place_and_the_next_session_adds_its_own(tmp_path):
    first = zoo_runner.TrainingSegment(tmp_path, from_update=0)
    first.update(1000)
    first.update(2000)  # the next checkpoint of the same session
    second = zoo_runner.TrainingSegment(tmp_path, from_update=2000)  # a later session, resuming
    second.update(3000)
    segments = json.loads((tmp_path / zoo_runner.PROGRESS_FILE).read_text())["segments"]
    assert [(s["from_update"], s["to_update"]) for s in segments] == [(0, 2000), (2000, 3000)]
    assert not list(tmp_path.glob("*.partial"))


class SessionEnded(Exception):
    pass


@pytest.mark.slow
def test_a_run_cut_off_between_checkpoints_keeps_the_time_its_checkpoints_hold(tmp_path, monkeypatch):
    """A session that ends mid-run (the process dies after a checkpoint, with no chance to record anything) leaves
    its segment in the progress file up to that checkpoint: the finished run's record counts that session's wall
    time, and the next segment starts where the checkpoints end."""
    from transformers import TrainerCallback

    from flexformers.training_scripts import train

    path = write_recipes(tmp_path, "  - {name: base, task: word_order, model_type: flexformer, claim: baseline}\n")
    (recipe,) = zoo_recipes.load_recipes(path)
    runs = tmp_path / "runs"

    class SessionEndsAfterTheSecondCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise SessionEnded

    real_run = train.run

    def run_until_the_session_ends(*arguments, extra_callbacks=None):
        return real_run(*arguments, extra_callbacks=[*extra_callbacks, SessionEndsAfterTheSecondCheckpoint()])

    with monkeypatch.context() as patch:
        patch.setattr(train, "run", run_until_the_session_ends)
        with pytest.raises(SessionEnded):
            zoo_runner.run_recipe(recipe, runs, smoke=True, export=False)
    (segment,) = json.loads((runs / "base" / zoo_runner.PROGRESS_FILE).read_text())["segments"]
    assert (segment["from_update"], segment["to_update"]) == (0, 2) and segment["seconds"] > 0

    result = zoo_runner.run_recipe(recipe, runs, smoke=True, export=False)
    assert [(s["from_update"], s["to_update"]) for s in result["segments"]] == [(0, 2), (2, zoo_recipes.SMOKE_UPDATES)]
    assert result["training_seconds"] == pytest.approx(sum(s["seconds"] for s in result["segments"]), abs=0.1)
    assert result["sessions"] == 2


@pytest.mark.slow
def test_finished_recipes_are_recorded_for_later_sessions(tmp_path, capsys):
    """A finished recipe's result goes to the committed records folder; on a machine without its run folder (a later
    session) `run` counts it as finished, `list` says so, `render` reads the record, and a recipe initialised from
    it names the missing run folder."""
    path = write_recipes(tmp_path, (
        "  - {name: base, task: word_order, model_type: flexformer, claim: baseline}\n"
        "  - {name: mat, task: word_order, model_type: mat, init_from: base, claim: mat}\n"
    ))
    base, mat = zoo_recipes.load_recipes(path)
    records = tmp_path / "records"
    result = zoo_runner.run_recipe(base, tmp_path / "session1", smoke=True, export=False, records_dir=records)
    result = json.loads(json.dumps(result))  # as stored (tuples become lists)
    assert json.loads((records / "base.json").read_text()) == result

    later = tmp_path / "session2"
    assert zoo_runner.run_recipe(base, later, smoke=True, export=False, records_dir=records) == result
    assert not (later / "base").exists()  # not trained again
    argv = ["--recipes", str(path), "--runs_dir", str(later), "--records_dir", str(records)]
    assert zoo.main([*argv, "list"]) == 0
    assert "finished in another session" in capsys.readouterr().out
    with pytest.raises(ValueError, match="finished in another session .* whose run folder is not in"):
        zoo_runner.run_recipe(mat, later, smoke=True, export=False, records_dir=records)
    docs = tmp_path / "docs" / "ZOO.md"
    assert zoo.main([*argv, "render", "--docs", str(docs)]) == 0
    assert "| base | baseline |" in docs.read_text() and "`mat` (not started)" in docs.read_text()

    # evaluated again where its run folder is: its result is rewritten, its training kept
    first = tmp_path / "session1" / "base"
    session1 = ["--recipes", str(path), "--runs_dir", str(first.parent), "--records_dir", str(records)]
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    (first / zoo_runner.RESULT_FILE).write_text(json.dumps({**result, "figures": {"stale": 1}}))
    assert zoo.main([*session1, "reevaluate", "base", "--no_export"]) == 0
    assert "base: test BLEU" in capsys.readouterr().out
    again = json.loads((first / zoo_runner.RESULT_FILE).read_text())
    assert "stale" not in again["figures"] and again["test"] == result["test"]
    assert (again["training_seconds"], again["validation_curve"]) == (result["training_seconds"],
                                                                       result["validation_curve"])
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((records / "base.json").read_text()) == result  # a smoke run is not recorded
    assert zoo.main([*argv, "reevaluate", "base"]) == 1  # session 2 has only the record
    assert "no finished run in" in capsys.readouterr().err


def test_a_task_budget_applies_to_its_recipes_unless_one_sets_its_own(tmp_path):
    header = RECIPE_HEADER.replace("    warmup_steps: 1\n", "    warmup_steps: 1\n    updates: 7\n")
    path = write_recipes(tmp_path, ("  - {name: a, task: word_order, model_type: flexformer}\n"
                                    "  - {name: b, task: word_order, model_type: flexformer, updates: 2}\n"), header)
    a, b = zoo_recipes.load_recipes(path)
    assert (a.updates, b.updates) == (7, 2)
    assert zoo_recipes.load_recipes(write_recipes(tmp_path, "  - {name: a, task: word_order, model_type: flexformer}\n"))[0] \
        .updates == 3  # no task budget: the defaults'


@pytest.mark.slow
def test_a_finished_recipe_whose_budget_grew_trains_on_from_its_last_checkpoint(tmp_path, monkeypatch):
    path = write_recipes(tmp_path, "  - {name: base, task: word_order, model_type: flexformer, claim: baseline}\n")
    (recipe,) = zoo_recipes.load_recipes(path)
    runs, records = tmp_path / "runs", tmp_path / "records"
    first = zoo_runner.run_recipe(recipe, runs, smoke=True, export=False, records_dir=records)
    assert first["updates"] == zoo_recipes.SMOKE_UPDATES
    monkeypatch.setattr(zoo_recipes, "SMOKE_UPDATES", zoo_recipes.SMOKE_UPDATES + 2)  # the budget grows by two updates
    grown = dataclasses.replace(recipe, updates=zoo_recipes.SMOKE_UPDATES)
    assert zoo_runner.recipe_status(grown, runs, records) == f"{first['updates']}/{grown.updates} updates"
    assert zoo_runner.finished_results([grown], runs, records) == []  # not rendered as finished
    second = zoo_runner.run_recipe(grown, runs, smoke=True, export=False, records_dir=records)
    assert second["updates"] == zoo_recipes.SMOKE_UPDATES
    segments = json.loads((runs / "base" / zoo_runner.PROGRESS_FILE).read_text())["segments"]
    assert [(s["from_update"], s["to_update"]) for s in segments] == [(0, first["updates"]),
                                                                       (first["updates"], zoo_recipes.SMOKE_UPDATES)]
    # one curve, continued: the first run's points are kept
    assert [p["update"] for p in second["validation_curve"]] == [2, 3, 4, 5]
    assert json.loads((records / "base.json").read_text())["updates"] == zoo_recipes.SMOKE_UPDATES
    assert zoo_runner.recipe_status(grown, runs, records) == "finished"

    # a later machine without the run folder cannot train on from the recorded updates: it says what to do
    with pytest.raises(ValueError, match="budget grew from 5 to 7 updates, but the checkpoints .* copy its run"):
        zoo_runner.run_recipe(dataclasses.replace(recipe, updates=7), tmp_path / "elsewhere", smoke=False, export=False,
                       records_dir=records)


def test_a_task_schedule_reaches_the_training_command_unless_a_recipe_sets_its_own(tmp_path):
    header = RECIPE_HEADER.replace("    warmup_steps: 1\n", "    warmup_steps: 1\n    lr_scheduler: cosine\n")
    path = write_recipes(tmp_path, ("  - {name: a, task: word_order, model_type: flexformer}\n"
                                    "  - {name: b, task: word_order, model_type: flexformer, lr_scheduler: linear}\n"),
                         header)
    a, b = zoo_recipes.load_recipes(path)
    for recipe, schedule in ((a, "cosine"), (b, "linear")):
        argv = zoo_runner.training_argv(recipe, tmp_path / recipe.name, tmp_path)
        assert argv[argv.index("--lr_scheduler_type") + 1] == schedule
    (plain,) = zoo_recipes.load_recipes(write_recipes(tmp_path, "  - {name: a, task: word_order, model_type: flexformer}\n"))
    assert plain.lr_scheduler == "inverse_sqrt"  # neither the task nor the defaults name one
    translation = {r.name: r for r in zoo_recipes.load_recipes()}["baseline-translation-s1"]
    assert translation.lr_scheduler == "cosine"


def _recorded(recipe: zoo_recipes.ZooRecipe, trained: int, **changes) -> dict:
    """A result of ``recipe`` (changed by ``changes``) trained for ``trained`` updates, as a record stores it."""
    stored = json.loads(json.dumps(dataclasses.asdict(dataclasses.replace(recipe, **changes))))
    return {"recipe": stored, "updates": trained, "smoke": False}


def test_a_result_of_an_earlier_version_of_a_recipe_is_not_counted_as_its_result(tmp_path):
    header = RECIPE_HEADER.replace("    warmup_steps: 1\n", "    warmup_steps: 1\n    lr_scheduler: cosine\n")
    (recipe,) = zoo_recipes.load_recipes(write_recipes(
        tmp_path, "  - {name: base, task: word_order, model_type: flexformer, claim: baseline}\n", header))
    assert zoo_recipes.recipe_changes(_recorded(recipe, 3)["recipe"], recipe) == []
    assert zoo_recipes.recipe_changes(_recorded(recipe, 3, updates=9)["recipe"], recipe) == []  # a budget is not a change
    older = _recorded(recipe, 3)["recipe"]
    del older["lr_scheduler"]  # written before recipes had a schedule: it was inverse-sqrt's
    assert zoo_recipes.recipe_changes(older, recipe) == ["lr_scheduler"]
    retuned = _recorded(recipe, 3, task_settings={**recipe.task_settings, "learning_rate": 1e-3})["recipe"]
    assert zoo_recipes.recipe_changes(retuned, recipe) == ["task_settings.learning_rate"]

    runs, records = tmp_path / "runs", tmp_path / "records"
    records.mkdir()
    (records / "base.json").write_text(json.dumps({**_recorded(recipe, 3, eval_samples=7), "test": {}}))
    assert zoo_runner.recipe_status(recipe, runs, records).startswith("its result is of an earlier version of the recipe "
                                                               "(eval_samples differ)")
    assert zoo_runner.finished_results([recipe], runs, records) == []  # not rendered
    with pytest.raises(ValueError, match="'base' has changed since its result .*base.json was written "
                                         "\\(eval_samples differ\\).* Rename the recipe to keep both, or delete"):
        zoo_runner.run_recipe(recipe, runs, records_dir=records)
    assert not (runs / "base").exists()  # nothing trained


def test_a_schedule_that_depends_on_the_budget_does_not_train_on_when_the_budget_grows(tmp_path):
    header = RECIPE_HEADER.replace("    warmup_steps: 1\n", "    warmup_steps: 1\n    lr_scheduler: cosine\n")
    (recipe,) = zoo_recipes.load_recipes(write_recipes(
        tmp_path, "  - {name: base, task: word_order, model_type: flexformer, updates: 20}\n", header))
    runs, records = tmp_path / "runs", tmp_path / "records"
    records.mkdir()
    (records / "base.json").write_text(json.dumps(_recorded(recipe, 10, updates=10)))
    with pytest.raises(ValueError, match="budget changed from 10 to 20 updates, but its cosine learning rate depends "
                                         "on the budget"):
        zoo_runner.run_recipe(recipe, runs, records_dir=records)
    # nor does an unfinished run whose budget changed on the way: its checkpoint was trained towards 10 updates
    checkpoint = runs / "base" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 4, "max_steps": 10}))
    assert zoo_runner.planned_updates(runs / "base") == 10
    with pytest.raises(ValueError, match="budget changed from 10 to 20 updates"):
        zoo_runner.run_recipe(recipe, runs)


def test_the_run_state_is_read_from_its_furthest_trained_point(tmp_path):
    """A run that finished at 10 updates and trained on towards a grown budget of 30 keeps its final state of 10
    beside checkpoints of 20 and 9 (numbered, not sorted by name: checkpoint-9 is older than checkpoint-20)."""
    run = tmp_path / "run"
    assert zoo_runner.trained_updates(run) == 0 and zoo_runner.planned_updates(run) is None
    run.mkdir()
    (run / "trainer_state.json").write_text(json.dumps({"global_step": 10, "max_steps": 10}))
    assert (zoo_runner.trained_updates(run), zoo_runner.planned_updates(run)) == (10, 10)
    for step, planned in ((9, 10), (20, 30)):
        (run / f"checkpoint-{step}").mkdir()
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(
            json.dumps({"global_step": step, "max_steps": planned}))
    assert (zoo_runner.trained_updates(run), zoo_runner.planned_updates(run)) == (20, 30)


def test_a_run_trained_in_turn_on_several_machines_names_each_with_its_updates():
    """A GPU head start resumed on a CPU (benchmarks/zoo_gpu.sh HEAD_START_MINUTES): the record says both, in order;
    the segments of one machine, over several sessions, read as that machine alone."""
    gpu, cpu = "NVIDIA H100 80GB HBM3", "AMD EPYC, 2 CPU threads"
    segments = [{"from_update": 0, "to_update": 10934, "machine": gpu},
                {"from_update": 10934, "to_update": 16437, "machine": gpu},
                {"from_update": 16437, "to_update": 25000, "machine": cpu}]
    assert zoo_runner.machines_trained_on(segments) == f"{gpu} (16,437 updates), then {cpu} (8,563 updates)"
    assert zoo_runner.machines_trained_on(segments[:2]) == gpu


def test_gpu_recipes_train_with_tf32_on_a_gpu_and_are_refused_or_skipped_without_one(tmp_path, monkeypatch, capsys):
    word_order = RECIPE_HEADER[RECIPE_HEADER.index("  word_order:"):]
    header = RECIPE_HEADER + word_order.replace("  word_order:", "  word_order_gpu:") + "    gpu: true\n"
    path = write_recipes(tmp_path, ("  - {name: cpu, task: word_order, model_type: flexformer}\n"
                                    "  - {name: big, task: word_order_gpu, model_type: flexformer, size: iwslt}\n"),
                         header)
    cpu, big = zoo_recipes.load_recipes(path)
    assert "--tf32" not in zoo_runner.training_argv(cpu, tmp_path / "cpu", tmp_path)
    argv = zoo_runner.training_argv(big, tmp_path / "big", tmp_path)
    assert argv[argv.index("--tf32") + 1] == "true"
    assert argv[argv.index("--preset") + 1] == "transformer_iwslt_de_en"  # the papers' IWSLT blocks
    assert "--tf32" not in zoo_runner.training_argv(big, tmp_path / "big", tmp_path, smoke=True)  # smoke runs anywhere

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match="recipe 'big' trains on a CUDA GPU .* this machine has none"):
        zoo_runner.run_recipe(big, tmp_path / "runs", export=False)
    assert not (tmp_path / "runs" / "big" / "checkpoint-1").exists()
    assert zoo_runner.recipe_status(big, tmp_path / "runs") == "not started (trains on a CUDA GPU)"
    ran = []

    def run_recipe(recipe, *args, **kwargs):
        ran.append(recipe.name)
        return {"updates": 3, "test": {"metrics": {"bleu": 1.0}, "copy_baseline": {"bleu": 0.5}}}

    monkeypatch.setattr(zoo, "run_recipe", run_recipe)
    assert zoo.main(["--recipes", str(path), "--runs_dir", str(tmp_path / "runs"), "run", "--all"]) == 0
    assert ran == ["cpu"]  # --all leaves the GPU recipe out on this machine
    assert "skipping the recipes trained on a CUDA GPU (this machine has none): big" in capsys.readouterr().out


def test_max_minutes_must_be_positive(tmp_path, capsys):
    path = write_recipes(tmp_path, "  - {name: a, task: word_order, model_type: flexformer}\n")
    assert zoo.main(["--recipes", str(path), "--runs_dir", str(tmp_path / "runs"), "run", "a", "--max_minutes", "0"]) == 1
    assert "--max_minutes must be positive" in capsys.readouterr().err


def distinct_configurations(recipes: list) -> list:
    """The recipes that differ in more than their seed, name, budget and claim (a smoke run trains a few updates
    whatever the budget, so seeds and budgets of one configuration run alike there), each with the recipes it starts
    from (in file order)."""
    keys, seen, chosen = {}, set(), set()
    for recipe in recipes:
        fields = dataclasses.asdict(recipe)
        for name in ("name", "seed", "updates", "claim", "init_from"):
            fields.pop(name)
        key = json.dumps([fields, keys.get(recipe.init_from)], sort_keys=True, default=str)
        keys[recipe.name] = key
        if key not in seen:
            seen.add(key)
            chosen.add(recipe.name)
    by_name = {recipe.name: recipe for recipe in recipes}
    for name in list(chosen):
        while by_name[name].init_from:
            name = by_name[name].init_from
            chosen.add(name)
    return [recipe for recipe in recipes if recipe.name in chosen]


def test_distinct_configurations_keep_one_seed_and_the_recipes_they_start_from(tmp_path):
    path = write_recipes(tmp_path, """  - {name: base-s1, task: word_order, model_type: flexformer, seed: 1}
  - {name: base-s2, task: word_order, model_type: flexformer, seed: 2}
  - {name: base-long, task: word_order, model_type: flexformer, updates: 9}
  - {name: half-s2, task: word_order, model_type: flexformer, seed: 2, updates: 2}
  - {name: mat-s2, task: word_order, model_type: mat, seed: 2, init_from: half-s2}
  - {name: mat-wide, task: word_order, model_type: mat, overrides: encoder_embed_dim=64}
  - {name: mat-lr, task: word_order, model_type: mat, seed: 3, init_from: half-s2, flags: [--learning_rate, "1e-4"]}
""")
    chosen = [recipe.name for recipe in distinct_configurations(zoo_recipes.load_recipes(path))]
    assert chosen == ["base-s1", "half-s2", "mat-s2", "mat-wide", "mat-lr"]


@pytest.mark.slow
def test_every_shipped_recipe_configuration_runs_in_smoke_mode(tmp_path):
    """`flexformers-zoo run --smoke` on the committed recipe file, one recipe of each configuration (its other seeds
    and budgets train alike for a few updates): each trains a few updates (the initialised ones from their
    smoke-trained parents), is decoded beside the copy baseline, analysed and exported."""
    runs = tmp_path / "runs"
    argv = ["--runs_dir", str(runs), "--records_dir", str(tmp_path / "records")]
    # without the `syn` extra, the SYN recipes are left out (see the test above); with it, they run like the rest
    recipes = [recipe for recipe in distinct_configurations(zoo_recipes.load_recipes())
               if not recipe.missing_requirement()]
    assert zoo.main([*argv, "run", *(recipe.name for recipe in recipes), "--smoke"]) == 0
    assert not (tmp_path / "records").exists()  # smoke runs are not recorded
    for recipe in recipes:
        result = json.loads((runs / recipe.name / zoo_runner.RESULT_FILE).read_text())
        assert result["updates"] == zoo_recipes.SMOKE_UPDATES and result["recipe"]["model_type"] == recipe.model_type
        assert (runs / "hub" / recipe.name / "README.md").is_file()
    code = json.loads((runs / "baseline-codegen-s1" / zoo_runner.RESULT_FILE).read_text())["test"]
    assert set(code["metrics"]) == set(code["copy_baseline"]) == {"bleu", "chrf", "ter", "pov"}
    # the code split's pairs beyond the training lengths are scored apart, from the one decoding of the split
    if zoo_runner.BEYOND_TRAINING_LENGTHS_SHARE * code["num_examples"] < code["beyond_training_lengths"] < code["num_examples"]:
        assert code["within_training_lengths"]["num_examples"] == code["num_examples"] - code["beyond_training_lengths"]
    else:
        assert "within_training_lengths" not in code
    adaptive = json.loads((runs / "depth-adaptive-translation-s1" / zoo_runner.RESULT_FILE).read_text())["figures"]
    assert set(adaptive["depth_adaptive"]["fixed_exits"]) == {"1", "2", "3", "4"}
    assert set(adaptive["depth_adaptive"]["validation_fixed_exits"]) == {"1", "2", "3", "4"}
    assert len(adaptive["depth_adaptive"]["confidence"]["thresholds"]) == 3  # chosen on the validation sweep
    assert "halting" not in adaptive["depth_adaptive"]  # no halting mechanism trained
    halting = json.loads((runs / "depth-adaptive-halting-translation-s1" / zoo_runner.RESULT_FILE).read_text())
    assert halting["architecture"]["decoder_layers"] == 4  # the aligned model's blocks, trained on
    assert halting["figures"]["depth_adaptive"]["halting"]["mechanism"] == "token_geometric"
    iot = json.loads((runs / "iot-translation-s1" / zoo_runner.RESULT_FILE).read_text())["figures"]
    assert any("order usage" in name for name in iot)
    case_verification = iot[iot_method.IOT_CASE_VERIFICATION]  # the paper's Fig. 2 on the test split
    assert case_verification["orders"] == [1, 2, 3] and sum(case_verification["subsets"].values()) == 4
    assert set(case_verification["overall"]) == {"1", "2", "3", "predicted"}
    paper_orders = json.loads((runs / "iot-paper-orders-translation-s1" / zoo_runner.RESULT_FILE).read_text())["figures"]
    assert paper_orders[iot_method.IOT_CASE_VERIFICATION]["orders"] == [1, 4, 6]  # the paper's N = 3 set
    docs = tmp_path / "ZOO.md"
    assert zoo.main([*argv, "render", "--docs", str(docs)]) == 0
    assert all(f"| {recipe.name} |" in docs.read_text() for recipe in recipes)


