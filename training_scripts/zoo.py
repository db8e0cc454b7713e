"""The zoo (``flexformers-zoo``): the recipes of ``zoo_recipes.yaml`` in, trained models and ``docs/ZOO.md`` out.

    flexformers-zoo list                       # every recipe and how far it got
    flexformers-zoo run --all                  # train what is not finished (resuming), evaluate, export
    flexformers-zoo run --all --max_minutes 150  # ... stopping cleanly before a session's end; the next run goes on
    flexformers-zoo run baseline-translation-s1 iot-translation-s1
    flexformers-zoo reevaluate depth-adaptive-translation-s1  # a finished recipe's evaluation again, no training
    flexformers-zoo render                     # docs/ZOO.md: the table and the plots, from the finished runs
    flexformers-zoo run --all --smoke          # every recipe for a few updates (CI)

A recipe is trained by ``flexformers-train`` for its budget in updates, saving a checkpoint at every curve point so
that a run cut off (a session ends, the machine restarts) goes on from there: ``run --all`` skips finished recipes
and resumes the others. Each session's wall time and updates are written to the run's ``zoo_progress.json`` at every
checkpoint, so a run cut off still counts the time its checkpoints hold. A finished recipe is decoded on the whole
test split (BLEU / chrF / TER with the sacrebleu signature, beside copying the input), analysed by its method (IOT
order usage, Depth-Adaptive exits and a threshold sweep, InDIGO's insertion order) and exported as a Hub folder whose
card carries the same numbers; its ``zoo_result.json`` is what ``render`` reads.

A session's machine keeps only what is committed, so a finished recipe's result is also written to the records
folder (``docs/zoo/results/<recipe>.json``, committed with ``docs/ZOO.md``): ``run`` counts a recorded recipe as
finished and ``render`` reads the records of runs that are no longer on this machine. The weights are not in the
record (``*.safetensors`` is not committed): a recipe that initialises another (MAT's proximal initialisation,
InDIGO's SAO) needs its run folder on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import re
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

logger = logging.getLogger("flexformers.zoo")

DEFAULT_RECIPES = Path(__file__).with_name("zoo_recipes.yaml")
RESULT_FILE = "zoo_result.json"
PROGRESS_FILE = "zoo_progress.json"
DEFAULT_RECORDS_DIR = "docs/zoo/results"
SMOKE_UPDATES = 3
#: Validation BLEU gained over the last fifth of a run's updates below which its curve counts as flattened.
FLAT_CURVE_GAIN = 0.5
#: Test BLEU over copying the input from which a baseline counts as having learned its task.
LEARNED_OVER_COPY = 15.0
#: A test split with more than this share of pairs beyond the training lengths is also scored without them.
BEYOND_TRAINING_LENGTHS_SHARE = 0.05
#: Depth-Adaptive's threshold sweep: sampled threshold vectors and validation sentences (the paper: 10k vectors on
#: the whole validation set; 40 decodes of 500 sentences at beam 4 take about 8 minutes on two cores).
DEPTH_ADAPTIVE_SWEEP = (40, 500)
#: The key of IOT's case verification (the paper's Sec. 5.2, Fig. 2) among a result's method figures.
IOT_CASE_VERIFICATION = "case verification (Fig. 2)"
RECIPE_FIELDS = {"name", "task", "model_type", "seed", "updates", "size", "overrides", "flags", "init_from", "claim",
                 "eval_every", "eval_samples", "test_beams", "lr_scheduler"}
TASK_FIELDS = {"what", "data", "vocab_size", "max_source_length", "max_target_length", "batch_size", "learning_rate",
               "warmup_steps", "updates", "lr_scheduler", "gpu"}
#: Task fields that may be left out: a description, the budget in updates and learning-rate schedule of the task's
#: recipes (else the defaults'), and ``gpu: true`` for recipes trained on a CUDA GPU (TF32 matrix products).
OPTIONAL_TASK_FIELDS = {"what", "updates", "lr_scheduler", "gpu"}
#: Task fields that a recipe may set for itself (a recipe's own value wins over its task's).
TASK_FIELDS_OF_RECIPES = ("updates", "lr_scheduler")
#: Learning-rate schedules whose value at an update does not depend on the budget: a finished run of one of these
#: trains on when its budget grows (training on equals training for the larger budget from the start).
BUDGET_FREE_SCHEDULES = {"inverse_sqrt", "constant", "constant_with_warmup"}


@dataclasses.dataclass(frozen=True)
class ZooRecipe:
    """One trained model of the zoo (see ``zoo_recipes.yaml`` for the fields)."""

    name: str
    task: str
    model_type: str
    task_settings: dict
    seed: int = 1
    updates: int = 15000
    size: str = "tiny"
    overrides: str = ""
    flags: tuple[str, ...] = ()
    init_from: str | None = None
    claim: str = ""
    eval_every: int = 1000
    eval_samples: int = 300
    test_beams: int = 4
    lr_scheduler: str = "inverse_sqrt"

    @property
    def trains_on_gpu(self) -> bool:
        """Whether the recipe's task is trained on a CUDA GPU (``gpu: true``): a CPU does not run it, smoke aside."""
        return bool(self.task_settings.get("gpu"))

    @property
    def spacy_pipeline(self) -> str | None:
        """The spaCy pipeline the recipe parses its targets with (InDIGO's SYN order), or None when it needs none."""
        flags = {"flags": self.flags}
        if self.model_type != "indigo" or _flag_value(flags, "--order") != "syn":
            return None
        return _flag_value(flags, "--spacy_model") or "en_core_web_sm"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _spacy_pipeline_missing(name: str) -> str | None:
    """Why the spaCy pipeline ``name`` cannot parse here (spaCy or the pipeline is not installed), or None."""
    from flexformers.training_scripts.indigo_orders import load_spacy_pipeline

    try:
        load_spacy_pipeline(name)
    except ValueError as error:
        return str(error)
    return None


def load_recipes(path: str | os.PathLike = DEFAULT_RECIPES) -> list[ZooRecipe]:
    """The recipes of a recipe file; a ``ValueError`` naming the recipe and field for anything malformed."""
    from flexformers.training_scripts.model_registry import available_model_types
    from flexformers.training_scripts.quickstart import MODEL_SIZES

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"recipe file {path} does not exist")
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ValueError(f"{path} is not valid YAML: {error}") from error
    if not isinstance(document, dict) or not isinstance(document.get("recipes"), list) or not document["recipes"]:
        raise ValueError(f"{path} needs a non-empty 'recipes:' list")
    tasks = document.get("tasks") or {}
    for task, settings in tasks.items():
        missing = TASK_FIELDS - OPTIONAL_TASK_FIELDS - set(settings or {})
        unknown = set(settings or {}) - TASK_FIELDS
        if missing or unknown:
            raise ValueError(f"{path}: task {task!r}: " + "; ".join(
                filter(None, [missing and f"missing {', '.join(sorted(missing))}",
                              unknown and f"unknown field(s) {', '.join(sorted(unknown))}"])))
    defaults = document.get("defaults") or {}
    recipes: list[ZooRecipe] = []
    for index, entry in enumerate(document["recipes"], start=1):
        if not isinstance(entry, dict) or "name" not in entry:
            raise ValueError(f"{path}: recipe {index} has no name")
        name = entry["name"]
        of_task = {key: value for key, value in (tasks.get(entry.get("task", defaults.get("task"))) or {}).items()
                   if key in TASK_FIELDS_OF_RECIPES}
        fields = {**{k: v for k, v in defaults.items() if k in RECIPE_FIELDS}, **of_task, **entry}
        unknown = set(entry) - RECIPE_FIELDS
        if unknown:
            raise ValueError(f"{path}: recipe {name!r}: unknown field(s) {', '.join(sorted(unknown))}")
        for required in ("task", "model_type"):
            if required not in fields:
                raise ValueError(f"{path}: recipe {name!r} needs '{required}'")
        if fields["task"] not in tasks:
            raise ValueError(f"{path}: recipe {name!r}: task {fields['task']!r} is not under 'tasks:' "
                             f"({', '.join(tasks) or 'none'})")
        if fields["model_type"] not in available_model_types():
            raise ValueError(f"{path}: recipe {name!r}: model_type {fields['model_type']!r} is not one of "
                             f"{', '.join(available_model_types())}")
        if fields.get("size", "tiny") not in MODEL_SIZES:
            raise ValueError(f"{path}: recipe {name!r}: size must be one of {', '.join(MODEL_SIZES)}")
        if any(r.name == name for r in recipes):
            raise ValueError(f"{path}: recipe name {name!r} appears twice")
        if fields.get("init_from") and not any(r.name == fields["init_from"] for r in recipes):
            raise ValueError(f"{path}: recipe {name!r}: init_from {fields['init_from']!r} must name an earlier recipe")
        for number in ("seed", "updates", "eval_every", "eval_samples", "test_beams"):
            smallest = 0 if number == "seed" else 1
            if number in fields and (not isinstance(fields[number], int) or fields[number] < smallest):
                raise ValueError(f"{path}: recipe {name!r}: {number} must be an integer >= {smallest}, "
                                 f"got {fields[number]!r}")
        if "lr_scheduler" in fields and fields["lr_scheduler"] not in _schedule_names():
            raise ValueError(f"{path}: recipe {name!r}: lr_scheduler must be one of {', '.join(_schedule_names())}, "
                             f"got {fields['lr_scheduler']!r}")
        fields["flags"] = tuple(str(flag) for flag in fields.get("flags") or ())
        fields["overrides"] = fields.get("overrides") or ""
        recipes.append(ZooRecipe(task_settings=dict(tasks[fields["task"]]), **fields))
    return recipes


def _schedule_names() -> list[str]:
    from transformers.trainer_utils import SchedulerType

    return [schedule.value for schedule in SchedulerType]


def recipe_changes(recorded: dict, recipe: ZooRecipe) -> list[str]:
    """The fields in which a result's recipe (``recorded``, from its JSON) differs from ``recipe`` as the recipe
    file says today, other than the budget (a grown budget trains on): a result with any is another recipe's.
    A field missing from an older result counts as its default then (``lr_scheduler``: inverse-sqrt)."""
    current = json.loads(json.dumps(dataclasses.asdict(recipe)))
    defaults = {field.name: field.default for field in dataclasses.fields(ZooRecipe)
                if field.default is not dataclasses.MISSING}
    changed = []
    for field, value in current.items():
        if field in ("updates", "task_settings"):
            continue
        if recorded.get(field, defaults.get(field)) != value:
            changed.append(field)
    # the task's own budget and schedule reach a run through the recipe's fields, compared above
    settings = {key: value for key, value in current["task_settings"].items() if key not in TASK_FIELDS_OF_RECIPES}
    recorded_settings = recorded.get("task_settings") or {}
    changed += [f"task_settings.{key}" for key in sorted(set(settings) | set(recorded_settings))
                if key not in TASK_FIELDS_OF_RECIPES and key != "what"
                and settings.get(key) != recorded_settings.get(key)]
    return changed


def _check_same_recipe(recorded: dict, recipe: ZooRecipe, where: Path, output_dir: Path) -> None:
    changed = recipe_changes(recorded["recipe"], recipe)
    if changed:
        raise ValueError(f"recipe {recipe.name!r} has changed since its result {where} was written "
                         f"({', '.join(changed)} differ): that result is another recipe's. Rename the recipe to keep "
                         f"both, or delete {where} and move {output_dir} away to train it again")


def _check_budget_change(recipe: ZooRecipe, planned: int, target: int, output_dir: Path) -> None:
    """A run of a schedule that depends on its budget (cosine, linear) cannot go on to another budget than the one
    it was planned for: its learning rate so far followed that one."""
    if planned != target and recipe.lr_scheduler not in BUDGET_FREE_SCHEDULES:
        raise ValueError(f"recipe {recipe.name!r}: its budget changed from {planned} to {target} updates, but its "
                         f"{recipe.lr_scheduler} learning rate depends on the budget, so training on would not be "
                         f"the run of {target} updates; move {output_dir} (and its record) away to train it again")


# --------------------------------------------------------------------------------------------------------------
# Running one recipe
# --------------------------------------------------------------------------------------------------------------
def budget(recipe: ZooRecipe, smoke: bool = False) -> int:
    """The updates a recipe trains for: its budget, or :data:`SMOKE_UPDATES` in smoke mode."""
    return SMOKE_UPDATES if smoke else recipe.updates


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
    if initial is not None and resumed is not None:
        # its own checkpoint is that start trained on (architecture, tokenizer, weights), so a run resumed on another
        # machine (a GPU head start) does not need the starting recipe's run folder there
        argv += ["--model_name_or_path", resumed]
    elif initial is not None and recipe.model_type == "mat":
        argv += ["--baseline_checkpoint", str(initial), "--tokenizer_name_or_path", str(initial)]
    elif initial is not None:
        argv += ["--model_name_or_path", str(initial)]
    size = MODEL_SIZES[recipe.size]
    overrides = ",".join(filter(None, [size.overrides, FAST_RECIPE, recipe.overrides]))
    if initial is None or (recipe.model_type == "mat" and resumed is None):
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


def method_analysis(recipe: ZooRecipe, output_dir: Path, test_sources: list[str], smoke: bool,
                    test_hypotheses: list[str] | None = None) -> dict:
    """The method's own figures: IOT order usage and the paper's case verification (Sec. 5.2, Fig. 2: the test split
    by predicted decoder order, each subset decoded with every order), MAT branches, InDIGO's left-to-right share,
    and for Depth-Adaptive the paper's protocol (Sec. 3.2, 4.4): a threshold sweep on the validation split beside
    its fixed exits, then the test split at every fixed exit and at the cheapest swept thresholds that reach the
    validation BLEU of the full depth. ``test_hypotheses``: the evaluation's decoding of the test split (same beams
    and lengths), which the case verification uses as IOT's own choice instead of decoding the split again."""
    from flexformers.training_scripts import depth_adaptive_tools, iot_order_analysis
    from flexformers.training_scripts.quickstart import method_figures

    figures = method_figures(recipe.model_type, str(output_dir), test_sources, limit=8 if smoke else 500)
    if recipe.model_type == "iot" and len(json.loads((output_dir / "config.json").read_text())["decoder_orders"]) > 1:
        table = iot_order_analysis.run(iot_order_analysis.OrderAnalysisArguments(
            model_name_or_path=str(output_dir), split="test", num_beams=1 if smoke else recipe.test_beams,
            batch_size=64, **({"max_samples": 4, "max_new_tokens": 8} if smoke else {})),
            predicted_hypotheses=test_hypotheses)
        # as stored (the order codes become string keys), so a fresh result and a read record render alike
        figures[IOT_CASE_VERIFICATION] = json.loads(json.dumps(
            {key: table[key] for key in ("metric", "orders", "subsets", "scores", "overall")}))
    if recipe.model_type == "depth_adaptive":
        common = ["--model_name_or_path", str(output_dir), "--num_beams", "1" if smoke else str(recipe.test_beams),
                  "--batch_size", "64"] + (["--max_samples", "4", "--max_new_tokens", "8"] if smoke else [])
        sweep = depth_adaptive_tools.run_from_argv([
            "threshold-search", *common, "--split", "validation", "--exit_strategy", "confidence",
            "--num_samples", "3" if smoke else str(DEPTH_ADAPTIVE_SWEEP[0]),
            *([] if smoke else ["--max_samples", str(DEPTH_ADAPTIVE_SWEEP[1])]),
            "--output_dir", str(output_dir / "threshold_search"),
        ])
        chosen = sweep["matching_full_depth"]
        evaluated = depth_adaptive_tools.run_from_argv([
            "evaluate", *common, "--split", "test", "--exit_strategy", "confidence", "--all_fixed_exits",
            "--exit_thresholds", ",".join(f"{threshold:.6f}" for threshold in chosen["thresholds"])])
        figures["depth_adaptive"] = {
            "confidence": {**{k: evaluated[k] for k in ("bleu", "chrf", "average_exit", "flops_per_token")},
                           "thresholds": evaluated["exit_thresholds"],
                           "chosen_on": f"validation, first {sweep['num_examples']} sentences: the cheapest swept "
                                        "thresholds reaching the full depth's BLEU (else the best)"},
            "fixed_exits": {block: {k: row[k] for k in ("bleu", "average_exit", "flops_per_token")}
                            for block, row in evaluated["fixed_exits"].items()},
            "validation_examples": sweep["num_examples"],
            "validation_fixed_exits": {str(row["fixed_exit"]): {k: row[k] for k in ("bleu", "average_exit",
                                                                                     "flops_per_token")}
                                       for row in sweep["fixed_exits"]},
            "validation_pareto_front": [{k: row[k] for k in ("bleu", "average_exit", "flops_per_token", "thresholds")}
                                        for row in sweep["pareto_front"]],
        }
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
        _check_same_recipe(result, recipe, result_path, output_dir)
        if result["updates"] >= target:
            if record is not None and not record.is_file():
                _write_result(record, result)
            return result
        # Its budget grew after it finished: it trains on from its last checkpoint, which is the run that the larger
        # budget would have been from the start where the learning rate does not depend on the budget.
        _check_budget_change(recipe, result["updates"], target, output_dir)
        result_path.unlink()
    if record is not None and record.is_file():
        recorded = json.loads(record.read_text())
        _check_same_recipe(recorded, recipe, record, output_dir)
        if recorded["updates"] >= target:
            return recorded
        _check_budget_change(recipe, recorded["updates"], target, output_dir)
        if trained_updates(output_dir) < recorded["updates"]:
            raise ValueError(f"recipe {recipe.name!r}'s budget grew from {recorded['updates']} to {target} updates, "
                             f"but the checkpoints of its {recorded['updates']} recorded updates are not in "
                             f"{output_dir}: copy its run folder there to train on, or delete {record} to train it "
                             f"again from the start")
    output_dir.mkdir(parents=True, exist_ok=True)
    done = trained_updates(output_dir)
    planned = planned_updates(output_dir)
    if planned is not None and done < target:
        _check_budget_change(recipe, planned, target, output_dir)
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
        if recipe.trains_on_gpu and not smoke and not _cuda_available():
            raise ValueError(f"recipe {recipe.name!r} trains on a CUDA GPU (its task {recipe.task!r} sets gpu: true) "
                             f"and this machine has none: run it where one is (benchmarks/zoo_gpu.sh)")
        if recipe.spacy_pipeline and (missing := _spacy_pipeline_missing(recipe.spacy_pipeline)):
            raise ValueError(f"recipe {recipe.name!r} parses its targets with spaCy (InDIGO's SYN order): {missing}")
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
            _write_result(path, result)
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
    _check_same_recipe(previous, recipe, result_path, output_dir)
    if not _finished(previous, recipe):
        raise ValueError(f"recipe {recipe.name!r} is at {previous['updates']} of {recipe.updates} updates: "
                         f"`flexformers-zoo run {recipe.name}` trains it on and evaluates it")
    result = evaluate_trained(recipe, runs_dir, previous["smoke"], export)
    for path in (result_path, None if previous["smoke"] else record_path(records_dir, recipe.name)):
        if path is not None:
            _write_result(path, result)
    return result


def _write_result(path: Path, result: dict) -> None:
    """A recipe's result as JSON: its run folder's ``zoo_result.json`` or its committed record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------------------------------------------
# Status and rendering
# --------------------------------------------------------------------------------------------------------------
def _finished(result: dict, recipe: ZooRecipe) -> bool:
    """Whether a recipe's result is final: the result of this recipe (not of an earlier version of it) trained for
    as many updates as its budget (:data:`SMOKE_UPDATES` for a smoke run), which may have grown since it finished
    (the recipe then trains on)."""
    return result["updates"] >= budget(recipe, result["smoke"]) and not recipe_changes(result["recipe"], recipe)


def recipe_status(recipe: ZooRecipe, runs_dir: Path, records_dir: Path | None = None) -> str:
    output_dir = runs_dir / recipe.name
    result_path = output_dir / RESULT_FILE
    result = json.loads(result_path.read_text()) if result_path.is_file() else None
    if result is not None and _finished(result, recipe):
        return "finished"
    record = record_path(records_dir, recipe.name)
    recorded = json.loads(record.read_text()) if record is not None and record.is_file() else None
    for result in (result, recorded):
        changed = result and recipe_changes(result["recipe"], recipe)
        if changed:
            return f"its result is of an earlier version of the recipe ({', '.join(changed)} differ)"
    if recorded is not None and _finished(recorded, recipe):
        return "finished in another session (recorded; its weights are not on this machine)"
    updates = max(trained_updates(output_dir), recorded["updates"] if recorded else 0)
    if updates:
        return f"{updates}/{recipe.updates} updates"
    return "not started (trains on a CUDA GPU)" if recipe.trains_on_gpu else "not started"


def _results(recipes: list[ZooRecipe], runs_dir: Path, records_dir: Path | None = None) -> list[dict]:
    """The result of every finished recipe, from its run folder or else from its committed record (one of fewer
    updates than the recipe's budget now asks for is not finished)."""
    results = []
    for recipe in recipes:
        for path in (runs_dir / recipe.name / RESULT_FILE, record_path(records_dir, recipe.name)):
            if path is not None and path.is_file():
                result = json.loads(path.read_text())
                if _finished(result, recipe):
                    results.append(result)
                break
    return results


def seed_group(name: str) -> str:
    """A recipe's name without its seed suffix (``baseline-translation-s2`` -> ``baseline-translation``): the recipes
    that differ only by their seed."""
    return re.sub(r"-s\d+$", "", name)


def indigo_order_bars(indigo: list[dict], task: str) -> dict[str, list[float]]:
    """The test BLEU of each InDIGO configuration on ``task``, its seeds together, keyed by the configuration's short
    name (``indigo-sao-word-order-s2`` -> ``sao``) in the order the recipes first appear: one bar per order, not
    one per seed."""
    bars: dict[str, list[float]] = {}
    for result in indigo:
        name = seed_group(result["recipe"]["name"]).removeprefix("indigo-").removesuffix(f"-{task.replace('_', '-')}")
        bars.setdefault(name, []).append(result["test"]["metrics"]["bleu"])
    return bars


def converged(result: dict) -> bool:
    """Whether a run meets the zoo's bar for a baseline that methods are compared with: its validation curve has
    flattened (last-fifth gain < :data:`FLAT_CURVE_GAIN`) and its test BLEU is :data:`LEARNED_OVER_COPY` or more
    above copying the input."""
    gain = last_fifth_gain(result.get("validation_curve") or [])
    over_copy = (result["test"].get("gain_over_copy") or {}).get("bleu")
    return gain is not None and gain < FLAT_CURVE_GAIN and over_copy is not None and over_copy >= LEARNED_OVER_COPY


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
               "converged_seeds": sum(converged(member) for member in members)}
        for metric in ("bleu", "chrf"):
            row[metric] = _spread([member["test"]["metrics"][metric] for member in members])
        if all("unconstrained" in member["test"] for member in members):
            row["unconstrained_bleu"] = _spread([member["test"]["unconstrained"]["metrics"]["bleu"]
                                                 for member in members])
        spread.append(row)
    return spread


def baseline_spread(spread: list[dict], task: str) -> dict | None:
    """The seed spread of ``task``'s baseline (a row of :func:`seed_spread`), None before two seeds are finished."""
    return next((row for row in spread if row["task"] == task and row["claim"] == "baseline"), None)


def _spread(values: list[float]) -> dict:
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


def _figure_text(result: dict) -> str:
    figures = dict(result["figures"])
    adaptive = figures.pop("depth_adaptive", None)
    case_verification = figures.pop(IOT_CASE_VERIFICATION, None)
    parts = [f"{name}: {value}" for name, value in figures.items()]
    pov = result["test"]["metrics"].get("pov")
    if pov is not None:
        # code's own figure (the issue's "PoV for code"): BLEU rewards code-shaped text that does not parse
        parts.insert(0, f"outputs that parse as Python (PoV): {pov:.2f}% (copying the docstring: "
                        f"{result['test']['copy_baseline']['pov']:.2f}%)")
    if case_verification:
        overall = case_verification["overall"]
        best = max(case_verification["orders"], key=lambda code: overall[str(code)])
        parts.append(f"each sentence with its predicted order {overall['predicted']:.2f}, the best single order "
                     f"({best}) {overall[str(best)]:.2f}")
    unconstrained = result["test"].get("unconstrained")
    if unconstrained:
        parts.append(f"test BLEU decoded without the {result['test']['output_constraint']} constraint: "
                     f"{unconstrained['metrics']['bleu']:.2f}")
    within_lengths = result["test"].get("within_training_lengths")
    if within_lengths:
        parts.append(f"test BLEU on the {within_lengths['num_examples']:,} pairs within the training lengths (the "
                     f"other {result['test']['beyond_training_lengths']:,} are longer; training drops such pairs): "
                     f"{within_lengths['metrics']['bleu']:.2f} (copying {within_lengths['copy_baseline']['bleu']:.2f})")
    if adaptive:
        chosen = " (thresholds chosen on validation)" if "chosen_on" in adaptive["confidence"] else ""
        parts.append(f"confidence exit{chosen}: BLEU {adaptive['confidence']['bleu']:.2f} at average exit "
                     f"{adaptive['confidence']['average_exit']:.2f}")
    return "; ".join(parts).replace("|", "/")


def _iot_case_verification_lines(result: dict) -> list[str]:
    """The paper's Fig. 2 as a table (Sec. 5.2): rows are the test sentences grouped by the decoder order the
    predictor picks, columns the order each group is decoded with; the best of a row is in bold."""
    table = result["figures"][IOT_CASE_VERIFICATION]
    codes = [str(code) for code in table["orders"]]
    overall = table["overall"]
    lines = ["", f"### IOT: `{result['recipe']['name']}`, subsets by predicted order decoded with every order "
                 "(the paper's Fig. 2)", "",
             f"Test split, beam {result['test']['num_beams']}, {table['metric'].upper()}. Where the predictor "
             "chooses well, each subset scores best with its own order (the diagonal).", "",
             "| subset (predicted order) | sentences | " + " | ".join(f"order {code}" for code in codes) + " |",
             "|---|---|" + "---|" * len(codes)]
    for subset, row in table["scores"].items():
        best = max(row.values())
        cells = " | ".join(f"**{row[code]:.2f}**" if row[code] == best else f"{row[code]:.2f}" for code in codes)
        lines.append(f"| set {subset} | {table['subsets'][subset]:,} | {cells} |")
    sentences = sum(table["subsets"].values())
    lines.append(f"| all | {sentences:,} | " + " | ".join(f"{overall[code]:.2f}" for code in codes) + " |")
    best = max(codes, key=lambda code: overall[code])
    lines += ["", f"Each sentence decoded with its own predicted order (IOT's inference): {overall['predicted']:.2f}; "
                  f"every sentence with the best single order ({best}): {overall[best]:.2f}."]
    return lines


def _same_seed_first(runs: list[dict], result: dict) -> list[dict]:
    """Those of ``runs`` trained with ``result``'s seed, else all of them: a run is read against a reference of its
    own seed while that one is finished, since the seeds draw different initializations and batches."""
    return [run for run in runs if run["recipe"].get("seed") == result["recipe"].get("seed")] or runs


def _depth_adaptive_reference(result: dict, results: list[dict]) -> dict | None:
    """The full-depth model without exits that a Depth-Adaptive recipe is read against: a finished baseline recipe
    of the same task, size and overrides trained from scratch (the same blocks, one output classifier), of the same
    seed when that one is finished, since the seeds draw different initializations and batches."""
    recipe = result["recipe"]
    candidates = [other for other in results if other["recipe"]["task"] == recipe["task"]
                  and other["recipe"]["model_type"] == "flexformer" and not other["recipe"].get("init_from")
                  and other["recipe"].get("size") == recipe.get("size")
                  and (other["recipe"].get("overrides") or "") == (recipe.get("overrides") or "")]
    return (_same_seed_first(candidates, result) or [None])[0]


def _depth_adaptive_lines(result: dict, reference: dict | None) -> list[str]:
    """ZOO.md's table of a Depth-Adaptive recipe: the test split at every fixed exit and at its confidence
    thresholds, each beside the full-depth reference, with the FLOPs per output token of Appendix B."""
    figures, name = result["figures"]["depth_adaptive"], result["recipe"]["name"]
    reference_bleu = None if reference is None else reference["test"]["metrics"]["bleu"]
    if reference is None:
        about = "its full-depth reference without exits has not finished yet"
    else:
        about = (f"reference: `{reference['recipe']['name']}`, the same blocks without exits, test BLEU "
                 f"{reference_bleu:.2f} ({reference['parameters']:,} parameters)")
    lines = ["", f"### Depth-Adaptive: `{name}` against its full depth", "",
             f"Test split, beam {result['test']['num_beams']}; {about}. FLOPs per output token as in the paper's "
             "Appendix B (confidence exits pay for the output classifier at every block they pass).", "",
             "| decoding | test BLEU | − reference | average exit | FLOPs per token |", "|---|---|---|---|---|"]

    def row(label: str, scores: dict) -> str:
        difference = "—" if reference_bleu is None else f"{scores['bleu'] - reference_bleu:+.2f}"
        return (f"| {label} | {scores['bleu']:.2f} | {difference} | {scores['average_exit']:.2f} | "
                f"{scores['flops_per_token'] / 1e6:.2f} M |")

    for block, scores in sorted(figures["fixed_exits"].items(), key=lambda item: int(item[0])):
        lines.append(row(f"fixed exit {block}", scores))
    confidence = figures["confidence"]
    thresholds = ", ".join(f"{t:.2f}" for t in confidence.get("thresholds") or [])
    lines.append(row(f"confidence exits, τ = ({thresholds})", confidence))
    if "validation_fixed_exits" in figures:
        full = figures["validation_fixed_exits"][str(len(figures["fixed_exits"]))]
        lines += ["", f"How the thresholds were chosen: {confidence['chosen_on']}. On those sentences the full depth "
                      f"scores {full['bleu']:.2f}; the sweep's Pareto front ({len(figures['validation_pareto_front'])} "
                      "points): " + ", ".join(f"{p['bleu']:.2f} at AE {p['average_exit']:.2f}"
                                              for p in figures["validation_pareto_front"]) + "."]
    return lines


def _indigo_lines(results: list[dict], spread: list[dict]) -> list[str]:
    """ZOO.md's table of InDIGO's generation orders on each task, every one beside L2R (the claim: SAO >= L2R,
    Sec. 5) and the left-to-right baseline's seeds decoded with and without the output constraint."""
    lines = []
    for task in sorted({r["recipe"]["task"] for r in results if r["recipe"]["model_type"] == "indigo"}):
        indigo = [r for r in results if r["recipe"]["model_type"] == "indigo" and r["recipe"]["task"] == task]
        lines += ["", f"### InDIGO on {task}: generation orders against L2R", "",
                  f"Test split, beam {indigo[0]['test']['num_beams']}, outputs not constrained. Each order is read "
                  "against L2R trained from the same start for the same updates (a recipe trained on from another "
                  "model, as SAO from L2R, against L2R trained on from it alike), else against L2R from scratch. "
                  "The left-to-right share is over greedy insertions on 500 test sentences.", "",
                  "| training order | recipe | updates | test BLEU | chrF | TER | − L2R | that L2R run | "
                  "left-to-right share |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for result in indigo:
            recipe, metrics = result["recipe"], result["test"]["metrics"]
            reference = _l2r_reference(result, indigo)
            difference = "—" if reference is None else \
                f"{metrics['bleu'] - reference['test']['metrics']['bleu']:+.2f}"
            start = f"{result['updates']:,}" + (f" after `{recipe['init_from']}`" if recipe.get("init_from") else "")
            share = next((value for name, value in result["figures"].items() if "left-to-right share" in name), "—")
            lines.append(f"| {_training_order(result)} | {recipe['name']} | {start} | {metrics['bleu']:.2f} | "
                         f"{metrics['chrf']:.2f} | {metrics['ter']:.2f} | {difference} | "
                         f"{'—' if reference is None else reference['recipe']['name']} | {share} |")
        baseline = baseline_spread(spread, task)
        if baseline is not None:
            constraint = next((r["test"].get("output_constraint") for r in results
                               if seed_group(r["recipe"]["name"]) == baseline["group"]), None)
            scores = [f"{baseline['bleu']['mean']:.2f} ± {baseline['bleu']['sd']:.2f}"
                      + (f" with outputs constrained to a {constraint}" if constraint else "")]
            if "unconstrained_bleu" in baseline:
                scores.append(f"{baseline['unconstrained_bleu']['mean']:.2f} ± "
                              f"{baseline['unconstrained_bleu']['sd']:.2f} without the constraint")
            lines += ["", f"The left-to-right Transformer baseline (`{baseline['group']}`, {len(baseline['seeds'])} "
                          f"seeds, same width and depth, trained from scratch for the L2R run's updates): test BLEU "
                          f"{', and '.join(scores)}."]
    return lines


def _l2r_reference(result: dict, indigo: list[dict]) -> dict | None:
    """The InDIGO L2R run that ``result`` is read against: trained from the same start (another recipe's model,
    or scratch) for the same updates when there is one, else from scratch; of the same seed when that one is
    finished, since seeds draw different initializations and batches (None for that run itself and its seeds)."""
    group = seed_group(result["recipe"]["name"])
    l2r = [r for r in indigo if _training_order(r) == "l2r" and seed_group(r["recipe"]["name"]) != group]
    start = result["recipe"].get("init_from")
    same_start = [r for r in l2r if r["recipe"].get("init_from") == start and r["updates"] == result["updates"]]
    from_scratch = [r for r in l2r if not r["recipe"].get("init_from")]
    return (_same_seed_first(same_start, result) or _same_seed_first(from_scratch, result) or [None])[0]


def _flag_value(recipe: dict, flag: str) -> str | None:
    """The value a recipe's own flags give ``flag`` (recipe flags come last and win), None where they do not set it."""
    flags = list(recipe.get("flags") or [])
    return flags[flags.index(flag) + 1] if flag in flags else None


def _peak_learning_rate(recipe: dict) -> float | None:
    """The recipe's peak learning rate: its own ``--learning_rate`` flag, else its task's."""
    if _flag_value(recipe, "--learning_rate") is not None:
        return float(_flag_value(recipe, "--learning_rate"))
    rate = (recipe.get("task_settings") or {}).get("learning_rate")
    return None if rate is None else float(rate)


def _baseline_trained_on_alike(result: dict, results: list[dict]) -> dict | None:
    """The control of a method trained on from another recipe's model (MAT from its proximal initialisation): the
    baseline model type trained on from the same model for the same updates at the same peak rate."""
    recipe = result["recipe"]
    return next((other for other in results if other is not result
                 and other["recipe"]["model_type"] == "flexformer"
                 and other["recipe"].get("init_from") == recipe["init_from"]
                 and other["updates"] == result["updates"]
                 and _peak_learning_rate(other["recipe"]) == _peak_learning_rate(recipe)), None)


def _trained_on_lines(results: list[dict]) -> list[str]:
    """ZOO.md's table of the methods trained on from a baseline's model, each beside its control: the second phase
    re-warms the learning rate and adds updates that the method's own structure is not credited with."""
    started = [r for r in results if r["recipe"].get("init_from") and r["recipe"]["model_type"] != "flexformer"
               and r["recipe"]["model_type"] != "indigo"]  # InDIGO's orders have their own section
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
        control = _baseline_trained_on_alike(result, results)
        control_bleu = None if control is None else control["test"]["metrics"]["bleu"]
        rate = _peak_learning_rate(recipe)
        lines.append(f"| {recipe['name']} | {start} | {result['updates']:,}{'' if rate is None else f' ({rate:g})'} | "
                     f"{bleu:.2f} | {'not trained' if control is None else control['recipe']['name']} | "
                     f"{'—' if control is None else f'{control_bleu:.2f}'} | "
                     f"{'—' if control is None else f'{bleu - control_bleu:+.2f}'} |")
    return lines


def _training_order(result: dict) -> str:
    return _flag_value(result["recipe"], "--order") or "l2r"


def _plot_depth_adaptive(result: dict, reference: dict | None, path: Path) -> None:
    """BLEU vs average exit as in the paper's Fig. 3: the validation sweep (its Pareto front and fixed exits) on the
    left, the test split (fixed exits, the chosen thresholds, the full-depth reference) on the right: two panels,
    since the two splits score on different scales."""
    import matplotlib.pyplot as plt

    figures = result["figures"]["depth_adaptive"]
    figure, (validation, test) = plt.subplots(1, 2, figsize=(9, 3.8))

    def fixed_line(axis, rows: dict, label: str) -> None:
        ordered = sorted(rows.items(), key=lambda item: int(item[0]))
        axis.plot([r["average_exit"] for _, r in ordered], [r["bleu"] for _, r in ordered], marker="s", label=label)

    front = figures["validation_pareto_front"]
    validation.plot([r["average_exit"] for r in front], [r["bleu"] for r in front], marker="o", alpha=0.7,
                    label="threshold sweep, Pareto front")
    if "validation_fixed_exits" in figures:
        fixed_line(validation, figures["validation_fixed_exits"], "fixed exit")
    validation.set_title(f"validation ({figures.get('validation_examples', '')} sentences)", fontsize=9)
    fixed_line(test, figures["fixed_exits"], "fixed exit")
    test.plot([figures["confidence"]["average_exit"]], [figures["confidence"]["bleu"]], marker="*", markersize=13,
              linestyle="none", label="confidence, thresholds from validation")
    if reference is not None:
        test.axhline(reference["test"]["metrics"]["bleu"], color="black", linestyle="--",
                     label=f"{reference['recipe']['name']} (no exits)")
    test.set_title("test", fontsize=9)
    for axis in (validation, test):
        axis.set_xlabel("average exit (decoder blocks)")
        axis.set_ylabel("BLEU")
        axis.legend(fontsize=7)
    figure.suptitle(f"Depth-Adaptive: BLEU vs average exit ({result['recipe']['name']})", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def render(recipes: list[ZooRecipe], runs_dir: Path, docs_path: Path, records_dir: Path | None = None) -> Path:
    """Write ``docs_path`` (the zoo's table and plots, from every finished recipe: its run folder, or else its
    record) and its plots beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = _results(recipes, runs_dir, records_dir)
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
        "",
        ("| recipe | claim | seed | params | updates (learning rate) | wall time | machine | test BLEU | chrF | TER |"
         " copy BLEU / chrF | BLEU over copy | last-fifth gain | method figures |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        recipe, test = result["recipe"], result["test"]
        metrics, copy = test["metrics"], test["copy_baseline"]
        gain = last_fifth_gain(result["validation_curve"])  # from the curve, so every row follows today's criterion
        lines.append(
            f"| {recipe['name']} | {recipe['claim']} | {recipe['seed']} | {result['parameters']:,} | "
            f"{result['updates']:,} ({recipe.get('lr_scheduler', 'inverse_sqrt')}"
            f"{'' if _peak_learning_rate(recipe) is None else f', {_peak_learning_rate(recipe):g}'}) | "
            f"{result['training_seconds'] / 60:.0f} min ({result['sessions']} run(s)) | "
            f"{result['machine']} | {metrics['bleu']:.2f} | {metrics['chrf']:.2f} | {metrics['ter']:.2f} | "
            f"{copy['bleu']:.2f} / {copy['chrf']:.2f} | {test['gain_over_copy']['bleu']:+.2f} | "
            f"{'—' if gain is None else gain} | {_figure_text(result)} |"
        )
    spread = seed_spread(results)
    if spread:
        lines += ["", "### Seed spread", "",
                  "Test scores over the seeds of each configuration (sample standard deviation): a difference between "
                  "two configurations smaller than about two of these is not a difference.", "",
                  "| configuration | task | seeds | test BLEU mean ± sd | min – max | chrF mean ± sd | "
                  f"seeds converged (flat, ≥ +{LEARNED_OVER_COPY:g} over copy) |",
                  "|---|---|---|---|---|---|---|"]
        for row in spread:
            bleu, chrf = row["bleu"], row["chrf"]
            lines.append(f"| {row['group']} | {row['task']} | {', '.join(map(str, row['seeds']))} | "
                         f"{bleu['mean']:.2f} ± {bleu['sd']:.2f} | {bleu['min']:.2f} – {bleu['max']:.2f} | "
                         f"{chrf['mean']:.2f} ± {chrf['sd']:.2f} | {row['converged_seeds']} of {len(row['seeds'])} |")
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
                         f"{in_sd} | {baseline['converged_seeds']} of {len(baseline['seeds'])} seeds |")
    for result in (r for r in results if "depth_adaptive" in r["figures"]):
        lines += _depth_adaptive_lines(result, _depth_adaptive_reference(result, results))
    for result in (r for r in results if IOT_CASE_VERIFICATION in r["figures"]):
        lines += _iot_case_verification_lines(result)
    lines += _trained_on_lines(results)
    lines += _indigo_lines(results, spread)
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
    for result in (r for r in results if "depth_adaptive" in r["figures"]):
        path = plots_dir / f"depth_adaptive_{result['recipe']['name']}.png"
        _plot_depth_adaptive(result, _depth_adaptive_reference(result, results), path)
        plots.append((f"Depth-Adaptive: BLEU vs average exit, {result['recipe']['name']}", path))
    for task in sorted({r["recipe"]["task"] for r in results if r["recipe"]["model_type"] == "indigo"}):
        indigo = [r for r in results if r["recipe"]["model_type"] == "indigo" and r["recipe"]["task"] == task]
        figure, axis = plt.subplots(figsize=(8, 4))
        bars = indigo_order_bars(indigo, task)
        means = [statistics.mean(seeds) for seeds in bars.values()]
        axis.bar(range(len(bars)), means, color="tab:blue")
        # the score goes under its bar's name: above or inside the bar, the seeds' dots and the lines cover it
        axis.set_xticks(range(len(bars)), [f"{order}\n{mean:.2f}" + (f"\n{len(seeds)} seeds" if len(seeds) > 1 else "")
                                           for order, mean, seeds in zip(bars, means, bars.values())])
        seeded = [(position, seeds) for position, seeds in enumerate(bars.values()) if len(seeds) > 1]
        if seeded:
            axis.scatter([position for position, seeds in seeded for _ in seeds],
                         [score for _, seeds in seeded for score in seeds], color="black", s=8, zorder=3,
                         label="each seed (bar: their mean)")
        scores = [score for seeds in bars.values() for score in seeds]
        axis.axhline(indigo[0]["test"]["copy_baseline"]["bleu"], color="black", linestyle="--",
                     label="copying the input")
        baseline = baseline_spread(spread, task)
        if baseline is not None:
            has_unconstrained = "unconstrained_bleu" in baseline
            axis.axhline(baseline["unconstrained_bleu" if has_unconstrained else "bleu"]["mean"], color="tab:green",
                         linestyle=":", label=f"left-to-right baseline{', unconstrained' if has_unconstrained else ''} "
                                              f"({len(baseline['seeds'])} seeds)")
        axis.set_ylabel("test BLEU")
        axis.set_title(f"InDIGO on {task}: generation orders (SAO vs L2R and the predefined orders)", fontsize=9)
        axis.tick_params(axis="x", labelsize=7)
        # headroom above the tallest bar or line, so the legend covers no bar
        axis.set_ylim(0, 1.3 * max(scores + [line.get_ydata()[0] for line in axis.get_lines()]))
        axis.legend(fontsize=7, loc="upper right")
        figure.tight_layout()
        path = plots_dir / f"indigo_orders_{task}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        plots.append((f"InDIGO on {task}: SAO vs L2R", path))
    iot = [r for r in results if r["recipe"]["model_type"] == "iot"]
    for result in iot:
        usage = next((value for name, value in result["figures"].items() if "order usage" in name), None)
        if not usage:
            continue
        figure, axis = plt.subplots(figsize=(5, 3.5))
        axis.bar([str(code) for code in usage], list(usage.values()), color="tab:green")
        axis.set_xlabel("decoder order (paper code)")
        axis.set_ylabel("share of test sentences")
        axis.set_title(f"IOT order usage ({result['recipe']['name']})", fontsize=9)
        figure.tight_layout()
        path = plots_dir / f"iot_usage_{result['recipe']['name']}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        plots.append(("IOT order usage", path))
        if IOT_CASE_VERIFICATION in result["figures"]:
            from flexformers.training_scripts.iot_order_analysis import plot_table

            stored = result["figures"][IOT_CASE_VERIFICATION]
            table = {**stored, "subsets": {int(code): size for code, size in stored["subsets"].items()},
                     "scores": {int(subset): {int(code): score for code, score in row.items()}
                                for subset, row in stored["scores"].items()}}
            path = plots_dir / f"iot_case_verification_{result['recipe']['name']}.png"
            plot_table(table, path)
            plots.append(("IOT: subsets by predicted order, decoded with every order (Fig. 2)", path))
    for title, path in plots:
        lines += ["", f"### {title}", "", f"![{title}]({path.relative_to(docs_path.parent).as_posix()})"]
    docs_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return docs_path


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexformers-zoo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default=str(DEFAULT_RECIPES), help="recipe file (default: the package's)")
    parser.add_argument("--runs_dir", default="runs/zoo", help="where runs go (default: %(default)s)")
    parser.add_argument("--records_dir", default=DEFAULT_RECORDS_DIR,
                        help="committed results of finished recipes, read by `run`, `list` and `render` "
                             "(default: %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every recipe and how far it got")
    run = commands.add_parser("run", help="train (resuming), evaluate and export recipes")
    run.add_argument("names", nargs="*", help="recipes to run (see `list`)")
    run.add_argument("--all", action="store_true", help="every recipe not finished, in file order")
    run.add_argument("--smoke", action="store_true", help=f"{SMOKE_UPDATES} updates per recipe on a tiny subset (CI)")
    run.add_argument("--no_export", action="store_true", help="skip the Hub folders")
    run.add_argument("--max_minutes", type=float, default=None,
                     help="stop training cleanly after this many minutes (a checkpoint is saved; the next `run` "
                          "resumes it); a recipe whose test evaluation has started still finishes it (a few minutes)")
    again = commands.add_parser("reevaluate", help="evaluate finished recipes again from their trained models "
                                                   "(after the evaluation or a method's analysis changed)")
    again.add_argument("names", nargs="+", help="finished recipes whose run folders are here (see `list`)")
    again.add_argument("--no_export", action="store_true", help="skip the Hub folders")
    render_parser = commands.add_parser("render", help="write docs/ZOO.md and its plots from the finished runs")
    render_parser.add_argument("--docs", default="docs/ZOO.md", help="(default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    try:
        recipes = load_recipes(args.recipes)
        runs_dir, records_dir = Path(args.runs_dir), Path(args.records_dir)
        if args.command == "list":
            for recipe in recipes:
                print(f"{recipe.name:36} {recipe.model_type:15} {recipe.task:12} "
                      f"{recipe_status(recipe, runs_dir, records_dir)}")
            return 0
        if args.command == "render":
            path = render(recipes, runs_dir, Path(args.docs), records_dir)
            print(f"wrote {path}")
            return 0
        known = {recipe.name: recipe for recipe in recipes}
        unknown = [name for name in args.names if name not in known]
        if unknown:
            raise ValueError(f"no recipe named {', '.join(unknown)} (see `flexformers-zoo list`)")
        if args.command == "reevaluate":
            for name in args.names:
                result = reevaluate(known[name], runs_dir, records_dir, export=not args.no_export)
                print(f"{name}: test BLEU {result['test']['metrics']['bleu']:.2f} (copying "
                      f"{result['test']['copy_baseline']['bleu']:.2f}), evaluated again", flush=True)
            return 0
        if bool(args.names) == args.all:
            raise ValueError("name the recipes to run, or pass --all (not both)")
        chosen = recipes if args.all else [known[name] for name in args.names]
        if args.all and not args.smoke:
            gpu_only = [recipe.name for recipe in chosen if recipe.trains_on_gpu]
            if gpu_only and not _cuda_available():
                print(f"skipping the recipes trained on a CUDA GPU (this machine has none): {', '.join(gpu_only)}",
                      flush=True)
                chosen = [recipe for recipe in chosen if recipe.name not in gpu_only]
        if args.all:
            # spaCy is an optional extra (`.[syn]`): without it the SYN recipes are left for a machine that has it
            records = None if args.smoke else records_dir
            to_parse = [recipe for recipe in chosen if recipe.spacy_pipeline
                        and not recipe_status(recipe, runs_dir, records).startswith("finished")]
            for pipeline in sorted({recipe.spacy_pipeline for recipe in to_parse}):
                missing = _spacy_pipeline_missing(pipeline)
                if missing:
                    skipped = [recipe.name for recipe in to_parse if recipe.spacy_pipeline == pipeline]
                    print(f"skipping the recipes that parse their targets with spaCy ({', '.join(skipped)}): "
                          f"{missing}", flush=True)
                    chosen = [recipe for recipe in chosen if recipe.name not in skipped]
        if args.max_minutes is not None and args.max_minutes <= 0:
            raise ValueError(f"--max_minutes must be positive, got {args.max_minutes:g}")
        deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes
        from tqdm.auto import tqdm

        for recipe in tqdm(chosen, desc="zoo recipes", unit="recipe"):
            result = run_recipe(recipe, runs_dir, smoke=args.smoke, export=not args.no_export, deadline=deadline,
                                records_dir=None if args.smoke else records_dir)
            if result is None:
                print(f"--max_minutes reached: {recipe.name} is at {trained_updates(runs_dir / recipe.name)} of "
                      f"{budget(recipe, args.smoke)} updates; `flexformers-zoo run` again "
                      f"resumes it", flush=True)
                break
            test = result["test"]
            print(f"{recipe.name}: test BLEU {test['metrics']['bleu']:.2f} "
                  f"(copying {test['copy_baseline']['bleu']:.2f}) after {result['updates']} updates", flush=True)
    except ValueError as error:
        print(f"flexformers-zoo: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
