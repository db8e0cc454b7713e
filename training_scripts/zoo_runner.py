"""Running the zoo's recipes: train (resuming across sessions), evaluate on the test split, analyse, export.

A recipe is trained by ``flexformers-train`` for its budget in updates, saving a checkpoint at every curve point so
that a run cut off (a session ends, the machine restarts) goes on from there. Each session's wall time and updates
are written to the run's ``zoo_progress.json`` at every checkpoint, so a run cut off still counts the time its
checkpoints hold. A finished recipe is decoded on the whole test split (BLEU / chrF / TER with the sacrebleu
signature, beside copying the input), analysed by its method (``MethodSpec.figures`` and ``zoo_analysis``) and
exported as a Hub folder whose card carries the same numbers; its ``zoo_result.json`` is what the report reads, and
a copy goes to the committed records folder.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

from flexformers.training_scripts.model_registry import get_method_spec
from flexformers.training_scripts.zoo_recipes import (
    ZooRecipe,
    budget,
    check_budget_change,
    check_same_recipe,
    recipe_changes,
)
from flexformers.training_scripts.zoo_statistics import last_fifth_gain, validation_curve

RESULT_FILE = "zoo_result.json"
PROGRESS_FILE = "zoo_progress.json"
DEFAULT_RECORDS_DIR = "docs/zoo/results"
#: A test split with more than this share of pairs beyond the training lengths is also scored without them.
BEYOND_TRAINING_LENGTHS_SHARE = 0.05


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def training_argv(recipe: ZooRecipe, output_dir: Path, runs_dir: Path, smoke: bool = False) -> list[str]:
    """The ``flexformers-train`` command line of a recipe (resuming when ``output_dir`` holds a checkpoint)."""
    from flexformers.training_scripts.quickstart import FAST_RECIPE, MODEL_SIZES

    task = recipe.task_settings
    updates = budget(recipe, smoke)
    eval_every = 2 if smoke else recipe.eval_every
    argv = [
        "--model_type", recipe.model_type,
        *task["data"],
        "--max_source_length", str(task["max_source_length"]),
        "--max_target_length", str(task["max_target_length"]),
        "--per_device_train_batch_size", str(4 if smoke else task["batch_size"]),
        "--per_device_eval_batch_size", "100",
        "--learning_rate", str(task["learning_rate"]),
        "--lr_scheduler_type", recipe.lr_scheduler,
        "--warmup_steps", str(1 if smoke else task["warmup_steps"]),
        "--max_steps", str(updates),
        "--output_dir", str(output_dir),
        "--do_train",
        "--eval_strategy", "steps",
        "--eval_steps", str(eval_every),
        "--save_strategy", "steps",
        "--save_steps", str(eval_every),
        "--save_total_limit", "2",
        "--load_best_model_at_end", "false",
        "--max_eval_samples", str(4 if smoke else recipe.eval_samples),
        "--logging_steps", "1" if smoke else "100",
        "--report_to", "none",
        "--seed", str(recipe.seed),
    ]
    if smoke:
        argv += ["--max_train_samples", "16", "--disable_tqdm", "true"]
    elif recipe.trains_on_gpu:
        argv += ["--tf32", "true"]
    initial = runs_dir / recipe.init_from if recipe.init_from else None
    resumed = resume_checkpoint(output_dir)
    start_flags = get_method_spec(recipe.model_type).zoo_start_flags
    if initial is not None and resumed is not None:
        # its own checkpoint is that start trained on (architecture, tokenizer, weights), so a run resumed on another
        # machine (a GPU head start) does not need the starting recipe's run folder there
        argv += ["--model_name_or_path", resumed]
    elif initial is not None and start_flags is not None:  # the method builds its own architecture from that start
        argv += start_flags(str(initial))
    elif initial is not None:
        argv += ["--model_name_or_path", str(initial)]
    size = MODEL_SIZES[recipe.size]
    overrides = ",".join(filter(None, [size.overrides, FAST_RECIPE, recipe.overrides]))
    if initial is None or (start_flags is not None and resumed is None):
        argv += ["--preset", size.preset, "--config_overrides", overrides,
                 "--vocab_size", str(1000 if smoke else task["vocab_size"])]
    elif recipe.overrides:
        argv += ["--config_overrides", recipe.overrides]
    if resumed is not None:
        argv += ["--resume_from_checkpoint", "latest"]
    return [*argv, *recipe.flags]


def machine_description() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}"
    return f"{_cpu_model() or platform.processor() or platform.machine()}, {torch.get_num_threads()} CPU threads"


def _cpu_model() -> str | None:
    """The CPU's model name (Linux), e.g. "AMD EPYC 7B13"; None where /proc/cpuinfo does not say."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _newest_trainer_state(output_dir: Path) -> dict | None:
    """The trainer state of the furthest-trained point of the run in ``output_dir``: its final
    ``trainer_state.json`` or its newest checkpoint's, whichever has more updates (a run that finished and then
    trained on towards a grown budget keeps its older final state beside newer checkpoints). None before any."""
    checkpoints = [path for path in output_dir.glob("checkpoint-*/trainer_state.json")
                   if path.parent.name[len("checkpoint-"):].isdigit()]
    newest_checkpoint = max(checkpoints, key=lambda path: int(path.parent.name[len("checkpoint-"):]), default=None)
    states = [json.loads(path.read_text()) for path in (output_dir / "trainer_state.json", newest_checkpoint)
              if path is not None and path.is_file()]
    return max(states, key=lambda state: state.get("global_step", 0), default=None)


def resume_checkpoint(output_dir: Path) -> str | None:
    """The newest complete checkpoint of the run in ``output_dir``, which its next ``run`` resumes; None if none."""
    from flexformers.training_scripts.checkpoints import find_latest_complete_checkpoint

    return find_latest_complete_checkpoint(str(output_dir))[0] if output_dir.is_dir() else None


def trained_updates(output_dir: Path) -> int:
    """Updates trained so far by the run in ``output_dir`` (0 before its first checkpoint)."""
    state = _newest_trainer_state(output_dir)
    return 0 if state is None else state.get("global_step", 0)


def planned_updates(output_dir: Path) -> int | None:
    """The budget (``max_steps``) that the run in ``output_dir`` was last trained towards."""
    state = _newest_trainer_state(output_dir)
    return None if state is None else state.get("max_steps")


class TrainingSegment:
    """One session's stretch of training of the run in ``output_dir``, kept in its progress file (wall time, updates
    from and to, machine). ``update`` rewrites this segment in place, so calling it at every checkpoint leaves the
    file right for a session that ends mid-run: the next session's segment starts where the checkpoints end."""

    def __init__(self, output_dir: Path, from_update: int):
        self.path = output_dir / PROGRESS_FILE
        self.from_update = from_update
        self.started = time.monotonic()
        self.index: int | None = None

    def update(self, to_update: int) -> None:
        progress = json.loads(self.path.read_text()) if self.path.is_file() else {"segments": []}
        segment = {"ended": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "seconds": round(time.monotonic() - self.started, 1), "from_update": self.from_update,
                   "to_update": to_update, "machine": machine_description()}
        if self.index is None:
            progress["segments"].append(segment)
            self.index = len(progress["segments"]) - 1
        else:
            progress["segments"][self.index] = segment
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(progress, indent=2) + "\n")
        partial.replace(self.path)  # a kill while writing leaves the previous file whole


def machines_trained_on(segments: list[dict]) -> str:
    """The machine that trained a run; where several did in turn (a GPU head start resumed on a CPU,
    benchmarks/zoo_gpu.sh), each in order with its updates."""
    turns: list[list] = []
    for segment in segments:
        updates = segment["to_update"] - segment["from_update"]
        if turns and turns[-1][0] == segment["machine"]:
            turns[-1][1] += updates
        else:
            turns.append([segment["machine"], updates])
    if len(turns) == 1:
        return turns[0][0]
    return ", then ".join(f"{machine} ({updates:,} updates)" for machine, updates in turns)


def method_analysis(recipe: ZooRecipe, output_dir: Path, test_sources: list[str], smoke: bool,
                    test_hypotheses: list[str] | None = None) -> dict:
    """The method's own figures of a trained recipe: what it does at inference on the first test sources
    (``MethodSpec.figures``: IOT's order usage, MAT's branches, InDIGO's left-to-right share, Depth-Adaptive's exits)
    and its further analysis (``MethodSpec.zoo_analysis``: IOT's case verification, Depth-Adaptive's threshold sweep
    and test split at every exit). ``test_hypotheses``: the evaluation's decoding of the test split (same beams and
    lengths), which an analysis may reuse instead of decoding the split again."""
    from flexformers.training_scripts.quickstart import method_figures

    figures = method_figures(recipe.model_type, str(output_dir), test_sources, limit=8 if smoke else 500)
    analysis = get_method_spec(recipe.model_type).zoo_analysis
    if analysis is not None:
        figures.update(analysis(recipe, output_dir, test_sources, smoke, test_hypotheses))
    return figures


def record_path(records_dir: Path | None, name: str) -> Path | None:
    """Where the committed record of recipe ``name`` goes (None: records are not kept, as in smoke runs)."""
    return None if records_dir is None else records_dir / f"{name}.json"


def run_recipe(recipe: ZooRecipe, runs_dir: Path, smoke: bool = False, export: bool = True,
               deadline: float | None = None, records_dir: Path | None = None) -> dict | None:
    """Train (or resume) one recipe, then evaluate, analyse and export it; returns its ``zoo_result.json``.

    With ``deadline`` (a ``time.monotonic()`` value), training stops there with a checkpoint saved and the recipe
    is left unfinished (returns None) for the next run to resume; nothing new starts after it. With
    ``records_dir``, a recipe recorded there (finished in an earlier session) is not run again, and a recipe that
    finishes is recorded there."""
    from flexformers.training_scripts import train

    output_dir = runs_dir / recipe.name
    result_path = output_dir / RESULT_FILE
    record = record_path(records_dir, recipe.name)
    target = budget(recipe, smoke)
    if result_path.is_file():
        result = json.loads(result_path.read_text())
        check_same_recipe(result, recipe, result_path, output_dir)
        if result["updates"] >= target:
            if record is not None and not record.is_file():
                write_result(record, result)
            return result
        # Its budget grew after it finished: it trains on from its last checkpoint, which is the run that the larger
        # budget would have been from the start where the learning rate does not depend on the budget.
        check_budget_change(recipe, result["updates"], target, output_dir)
        result_path.unlink()
    if record is not None and record.is_file():
        recorded = json.loads(record.read_text())
        check_same_recipe(recorded, recipe, record, output_dir)
        if recorded["updates"] >= target:
            return recorded
        check_budget_change(recipe, recorded["updates"], target, output_dir)
        if trained_updates(output_dir) < recorded["updates"]:
            raise ValueError(f"recipe {recipe.name!r}'s budget grew from {recorded['updates']} to {target} updates, "
                             f"but the checkpoints of its {recorded['updates']} recorded updates are not in "
                             f"{output_dir}: copy its run folder there to train on, or delete {record} to train it "
                             f"again from the start")
    output_dir.mkdir(parents=True, exist_ok=True)
    done = trained_updates(output_dir)
    planned = planned_updates(output_dir)
    if planned is not None and done < target:
        check_budget_change(recipe, planned, target, output_dir)
    if not (output_dir / "model.safetensors").is_file() or done < target:
        if (recipe.init_from and resume_checkpoint(output_dir) is None
                and not (runs_dir / recipe.init_from / RESULT_FILE).is_file()):
            recorded = record_path(records_dir, recipe.init_from)
            if recorded is not None and recorded.is_file():
                raise ValueError(f"recipe {recipe.name!r} starts from the trained model of {recipe.init_from!r}, which "
                                 f"finished in another session ({recorded}) but whose run folder is not in "
                                 f"{runs_dir}: copy that folder here, or delete the record to train it again")
            raise ValueError(f"recipe {recipe.name!r} starts from {recipe.init_from!r}, which is not finished: "
                             f"run that one first")
        if recipe.trains_on_gpu and not smoke and not cuda_available():
            raise ValueError(f"recipe {recipe.name!r} trains on a CUDA GPU (its task {recipe.task!r} sets gpu: true) "
                             f"and this machine has none: run it where one is (benchmarks/zoo_gpu.sh)")
        if (missing := recipe.missing_requirement()) is not None:
            raise ValueError(f"recipe {recipe.name!r} cannot train on this machine: {missing}")
        if deadline is not None and time.monotonic() >= deadline:
            return None
        segment = TrainingSegment(output_dir, done)
        callbacks = [train.CheckpointReportCallback(segment.update)]
        if deadline is not None:
            callbacks.append(train.MaxTimeCallback(deadline=deadline))
        train.run(*train.parse_arguments(training_argv(recipe, output_dir, runs_dir, smoke)),
                  extra_callbacks=callbacks)
        segment.update(trained_updates(output_dir))
        if trained_updates(output_dir) < target:
            return None
    if deadline is not None and time.monotonic() >= deadline:
        return None
    result = evaluate_trained(recipe, runs_dir, smoke, export)
    for path in (result_path, record):
        if path is not None:
            write_result(path, result)
    return result


def evaluated_hypotheses(output_dir: Path, test_sources: list[str]) -> list[str] | None:
    """The test evaluation's hypotheses (flexformers-decode's ``generations.test.jsonl``), or None when that file
    does not hold the decoding of the first sources of ``test_sources`` in their order."""
    path = output_dir / "generations.test.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows or [row["source"] for row in rows] != test_sources[: len(rows)]:
        return None
    return [row["hypothesis"] for row in rows]


def evaluate_trained(recipe: ZooRecipe, runs_dir: Path, smoke: bool = False, export: bool = True) -> dict:
    """The result of a recipe trained in ``runs_dir``: the test split decoded beside copying the input, the method's
    figures, its learning curve and training record, and (with ``export``) its Hub folder."""
    from flexformers.training_scripts import decode
    from flexformers.training_scripts.quickstart import learning_curve

    output_dir = runs_dir / recipe.name
    progress = json.loads((output_dir / PROGRESS_FILE).read_text())

    test_decoding = [
        "--model_name_or_path", str(output_dir), "--split", "test",
        "--num_beams", "1" if smoke else str(recipe.test_beams), "--batch_size", "64",
        *(["--max_samples", "4", "--max_new_tokens", "8"] if smoke else []),
    ]
    evaluation = decode.run_from_argv([*test_decoding, "--num_samples_to_print", "3"])
    unconstrained = None
    if evaluation["output_constraint"]:
        # InDIGO inserts anywhere and decodes without the constraint (as in its paper), so the baseline it is
        # compared with is decoded that way too, beside its constrained score
        unconstrained = decode.run_from_argv([
            *test_decoding, "--num_samples_to_print", "0", "--permutation_of_source", "false",
            "--write_eval_results", "false", "--output_file", str(output_dir / "generations.test.unconstrained.txt"),
            "--overwrite_output"])  # the zoo's own file: a re-evaluation replaces it
    within_lengths = None
    beyond = evaluation["beyond_training_lengths"]
    if BEYOND_TRAINING_LENGTHS_SHARE * evaluation["num_examples"] < beyond < evaluation["num_examples"]:
        # training drops the pairs longer than its caps, so the model never learned to write those; where they are a
        # large share of the split (code: a third), the row also scores the pairs it could have learned
        within_lengths = decode.score_within_training_lengths(output_dir / "generations.test.jsonl", output_dir)
    from flexformers.training_scripts.arguments import DataArguments
    from flexformers.training_scripts.data import load_corpus

    data_args = DataArguments.load(output_dir)
    test_sources = list(load_corpus(data_args)["test"]["source"])
    figures = method_analysis(recipe, output_dir, test_sources, smoke, evaluated_hypotheses(output_dir, test_sources))
    curve = validation_curve(output_dir)
    learning_curve(output_dir, f"{recipe.name}")
    state = json.loads((output_dir / "trainer_state.json").read_text())
    config = json.loads((output_dir / "config.json").read_text())
    from flexformers.training_scripts.decode import load_model

    model = load_model(output_dir)[0]
    result = {
        "recipe": dataclasses.asdict(recipe),
        "smoke": smoke,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "architecture": {key: config.get(key) for key in ("encoder_layers", "decoder_layers", "encoder_embed_dim",
                                                            "encoder_ffn_embed_dim", "encoder_normalize_before")},
        "updates": state["global_step"],
        "epochs": round(state.get("epoch") or 0.0, 2),
        "training_seconds": round(sum(segment["seconds"] for segment in progress["segments"]), 1),
        "sessions": len(progress["segments"]),
        "machine": machines_trained_on(progress["segments"]),
        "segments": progress["segments"],
        "test": {key: evaluation[key] for key in ("num_examples", "metrics", "copy_baseline", "gain_over_copy",
                                                  "sacrebleu_signature", "chrf_signature", "ter_signature",
                                                  "num_beams", "output_constraint", "beyond_training_lengths")},
        "validation_curve": curve,
        "last_fifth_gain": last_fifth_gain(curve),
        "figures": figures,
    }
    if unconstrained is not None:
        result["test"]["unconstrained"] = {key: unconstrained[key] for key in ("metrics", "gain_over_copy")}
    if within_lengths is not None:
        result["test"]["within_training_lengths"] = {
            key: within_lengths[key] for key in ("num_examples", "metrics", "copy_baseline", "gain_over_copy")}
    if export:
        hub_dir = runs_dir / "hub" / recipe.name
        export_hub_folder(output_dir, hub_dir)
        result["hub_folder"] = str(hub_dir)
    return result


def export_hub_folder(output_dir: Path, hub_dir: Path) -> None:
    """Export a recipe's run to its Hub folder, replacing the zoo's previous export of it but nothing else (a
    folder there that ``flexformers-export`` did not make is refused with a ``ValueError`` naming it)."""
    from flexformers.training_scripts import export_to_hub

    try:
        export_to_hub.export_checkpoint(output_dir, hub_dir, export_to_hub.ExportOptions(overwrite=True))
    except export_to_hub.ExportError as error:
        raise ValueError(f"exporting {output_dir}: {error} (or pass --no_export)") from error


def reevaluate(recipe: ZooRecipe, runs_dir: Path, records_dir: Path | None, export: bool = True) -> dict:
    """Evaluate a finished recipe again from its trained model (after the evaluation or a method's analysis
    changed), keeping its training: its result and record are rewritten, its weights and curve are not touched."""
    output_dir = runs_dir / recipe.name
    result_path = output_dir / RESULT_FILE
    if not result_path.is_file() or not (output_dir / "model.safetensors").is_file():
        raise ValueError(f"recipe {recipe.name!r} has no finished run in {output_dir} to evaluate again "
                         f"(`flexformers-zoo run {recipe.name}` trains it)")
    previous = json.loads(result_path.read_text())
    check_same_recipe(previous, recipe, result_path, output_dir)
    if not is_finished(previous, recipe):
        raise ValueError(f"recipe {recipe.name!r} is at {previous['updates']} of {recipe.updates} updates: "
                         f"`flexformers-zoo run {recipe.name}` trains it on and evaluates it")
    result = evaluate_trained(recipe, runs_dir, previous["smoke"], export)
    for path in (result_path, None if previous["smoke"] else record_path(records_dir, recipe.name)):
        if path is not None:
            write_result(path, result)
    return result


def write_result(path: Path, result: dict) -> None:
    """A recipe's result as JSON: its run folder's ``zoo_result.json`` or its committed record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")


def is_finished(result: dict, recipe: ZooRecipe) -> bool:
    """Whether a recipe's result is final: the result of this recipe (not of an earlier version of it) trained for
    as many updates as its budget (:data:`SMOKE_UPDATES` for a smoke run), which may have grown since it finished
    (the recipe then trains on)."""
    return result["updates"] >= budget(recipe, result["smoke"]) and not recipe_changes(result["recipe"], recipe)


def recipe_status(recipe: ZooRecipe, runs_dir: Path, records_dir: Path | None = None) -> str:
    output_dir = runs_dir / recipe.name
    result_path = output_dir / RESULT_FILE
    result = json.loads(result_path.read_text()) if result_path.is_file() else None
    if result is not None and is_finished(result, recipe):
        return "finished"
    record = record_path(records_dir, recipe.name)
    recorded = json.loads(record.read_text()) if record is not None and record.is_file() else None
    for result in (result, recorded):
        changed = result and recipe_changes(result["recipe"], recipe)
        if changed:
            return f"its result is of an earlier version of the recipe ({', '.join(changed)} differ)"
    if recorded is not None and is_finished(recorded, recipe):
        return "finished in another session (recorded; its weights are not on this machine)"
    updates = max(trained_updates(output_dir), recorded["updates"] if recorded else 0)
    if updates:
        return f"{updates}/{recipe.updates} updates"
    return "not started (trains on a CUDA GPU)" if recipe.trains_on_gpu else "not started"


def finished_results(recipes: list[ZooRecipe], runs_dir: Path, records_dir: Path | None = None) -> list[dict]:
    """The result of every finished recipe, from its run folder or else from its committed record (one of fewer
    updates than the recipe's budget now asks for is not finished)."""
    results = []
    for recipe in recipes:
        for path in (runs_dir / recipe.name / RESULT_FILE, record_path(records_dir, recipe.name)):
            if path is not None and path.is_file():
                result = json.loads(path.read_text())
                if is_finished(result, recipe):
                    results.append(result)
                break
    return results
