"""The zoo's recipes (``zoo_recipes.yaml``): what each trained model is, read and checked, and its budget.

A recipe names a task (data, lengths, batch, learning rate), a model type, a seed, a budget in updates, a size and
any overrides or flags; :func:`load_recipes` refuses a malformed file with one line naming the recipe and field.
:func:`recipe_changes` tells a result of an earlier version of a recipe from one of the recipe as it is now.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import yaml

from flexformers.training_scripts.model_registry import get_method_spec

DEFAULT_RECIPES = Path(__file__).with_name("zoo_recipes.yaml")
SMOKE_UPDATES = 3
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

    def missing_requirement(self) -> str | None:
        """Why this recipe cannot train on this machine (its method's ``missing_requirement``: an optional
        dependency not installed, such as spaCy for InDIGO's SYN order), or None."""
        check = get_method_spec(self.model_type).missing_requirement
        return None if check is None else check(self.flags)


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


def check_same_recipe(recorded: dict, recipe: ZooRecipe, where: Path, output_dir: Path) -> None:
    changed = recipe_changes(recorded["recipe"], recipe)
    if changed:
        raise ValueError(f"recipe {recipe.name!r} has changed since its result {where} was written "
                         f"({', '.join(changed)} differ): that result is another recipe's. Rename the recipe to keep "
                         f"both, or delete {where} and move {output_dir} away to train it again")


def check_budget_change(recipe: ZooRecipe, planned: int, target: int, output_dir: Path) -> None:
    """A run of a schedule that depends on its budget (cosine, linear) cannot go on to another budget than the one
    it was planned for: its learning rate so far followed that one."""
    if planned != target and recipe.lr_scheduler not in BUDGET_FREE_SCHEDULES:
        raise ValueError(f"recipe {recipe.name!r}: its budget changed from {planned} to {target} updates, but its "
                         f"{recipe.lr_scheduler} learning rate depends on the budget, so training on would not be "
                         f"the run of {target} updates; move {output_dir} (and its record) away to train it again")


def budget(recipe: ZooRecipe, smoke: bool = False) -> int:
    """The updates a recipe trains for: its budget, or :data:`SMOKE_UPDATES` in smoke mode."""
    return SMOKE_UPDATES if smoke else recipe.updates
