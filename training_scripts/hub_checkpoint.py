"""Reading and validating a trained checkpoint directory for export: its config and model type, weights file,
training arguments, evaluation results and generation samples — each failure names the file at fault."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
from pathlib import Path
from typing import Any

from flexformers.training_scripts.checkpoints import safetensors_problem
from flexformers.training_scripts.hub_remote_code import PROJECT_CODE_PACKAGES, ExportError

logger = logging.getLogger(__name__)

#: Optimisation settings the card lists from the checkpoint's ``training_args.bin``.
CARD_TRAINING_ARGUMENTS = (
    "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "optim", "adam_beta1", "adam_beta2",
    "adam_epsilon", "weight_decay", "max_grad_norm", "per_device_train_batch_size", "gradient_accumulation_steps",
    "num_train_epochs", "max_steps", "seed", "bf16",
)


EVAL_RESULTS_FILE = "eval_results.json"


WEIGHTS_FILE = "model.safetensors"


WEIGHTS_INDEX_FILE = "model.safetensors.index.json"


#: The sacrebleu signature field of ``eval_results.json`` for each metric (``<field>_signature``).
SIGNATURE_FIELDS = {"bleu": "sacrebleu", "chrf": "chrf", "ter": "ter"}


#: The classes a ``Seq2SeqTrainer``'s ``training_args.bin`` pickles; only these may be rebuilt when reading it
#: (``torch.load(weights_only=True)``), so a tampered file cannot run code.
_TRAINING_ARGS_GLOBALS = (
    "transformers.training_args_seq2seq.Seq2SeqTrainingArguments",
    "transformers.training_args.TrainingArguments",
    "transformers.trainer_utils.SchedulerType",
    "transformers.training_args.OptimizerNames",
    "transformers.trainer_utils.IntervalStrategy",
    "transformers.trainer_utils.SaveStrategy",
    "transformers.trainer_utils.HubStrategy",
    "transformers.trainer_utils.FSDPOption",
    "transformers.trainer_pt_utils.AcceleratorConfig",
    "accelerate.state.PartialState",
    "accelerate.utils.dataclasses.DistributedType",
)


@dataclasses.dataclass
class RemoteClasses:
    """The classes behind one model type and the files of their source code."""

    config_class: type
    model_class: type
    base_model_class: type
    card_template: Path | None = None
    description: str = ""

    def source_file(self, cls: type) -> Path:
        path = inspect.getsourcefile(cls)
        if path is None:
            raise ExportError(f"cannot locate the source file of {cls.__qualname__}")
        return Path(path).resolve()

    def auto_map(self) -> dict[str, str]:
        entries = {}
        for auto_name, cls in (
            ("AutoConfig", self.config_class),
            ("AutoModel", self.base_model_class),
            ("AutoModelForSeq2SeqLM", self.model_class),
        ):
            if cls.__qualname__ != cls.__name__:
                raise ExportError(f"{cls.__qualname__} must be a module-level class to be loaded as remote code")
            entries[auto_name] = f"{self.source_file(cls).stem}.{cls.__name__}"
        return entries

    @property
    def in_package(self) -> bool:
        """Whether all the classes are flexformers' own (their code ships as remote code); False for a method
        registered from outside the package, whose code is its own module's."""
        package_root = Path(__file__).resolve().parent.parent
        files = [self.source_file(cls) for cls in (self.model_class, self.config_class, self.base_model_class)]
        return all(path.parent.parent == package_root and path.parent.name in PROJECT_CODE_PACKAGES for path in files)

    @property
    def plugin_module(self) -> str:
        """The module that defines the config class (for a method outside the package: the import that registers
        its classes with Transformers' Auto classes)."""
        return self.config_class.__module__

    def root_files(self) -> list[Path]:
        files = []
        for cls in (self.model_class, self.config_class, self.base_model_class):
            path = self.source_file(cls)
            if path not in files:
                files.append(path)
        return files


def resolve_model_type(model_type: str) -> RemoteClasses:
    """Config/model classes of a registered flexformers model type (via ``training_scripts/methods``), and the
    class registered for ``AutoModel`` (the model class itself when the type registers none)."""
    from flexformers.training_scripts.model_registry import available_model_types, get_method_spec

    known = available_model_types()
    if model_type not in known:
        raise ExportError(
            f"model_type {model_type!r} is not a flexformers model type (known: {', '.join(known) or 'none'})"
        )
    spec = get_method_spec(model_type)
    base_model_class = spec.model_class
    try:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        import flexformers.modeling  # noqa: F401  (registers every model type with the Auto classes)

        base_model_class = MODEL_MAPPING[spec.config_class]
    except (ImportError, KeyError):
        pass
    template = None if spec.model_card_template is None else Path(spec.model_card_template)
    return RemoteClasses(spec.config_class, spec.model_class, base_model_class, template, spec.description)


def read_json_file(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ExportError(f"cannot read {what} {path}: {error}") from error
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ExportError(f"{path} is not valid JSON (line {error.lineno}, column {error.colno}): {error.msg}") from error


def read_checkpoint_config(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's ``config.json`` as a dict, after checking it is a flexformers checkpoint at all."""
    if not checkpoint.is_dir():
        raise ExportError(f"{checkpoint} is not a directory (expected a flexformers checkpoint directory)")
    config_path = checkpoint / "config.json"
    if not config_path.is_file():
        raise ExportError(f"{checkpoint} is not a flexformers checkpoint: it has no config.json")
    config = read_json_file(config_path, "config")
    if not isinstance(config, dict):
        raise ExportError(f"{config_path} must hold a JSON object, found {type(config).__name__}")
    if "model_type" not in config:
        raise ExportError(f"{config_path} has no 'model_type'; it is not a flexformers checkpoint")
    return config


def check_weights_file(checkpoint: Path) -> None:
    """Fail clearly on missing, sharded-but-incomplete, or truncated/corrupt safetensors weights."""
    single = checkpoint / WEIGHTS_FILE
    index = checkpoint / WEIGHTS_INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = read_json_file(index, "weights index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ExportError(f"{index} has no 'weight_map'")
        files = [checkpoint / name for name in sorted(set(weight_map.values()))]
    else:
        raise ExportError(
            f"{checkpoint} has no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX_FILE}); export needs safetensors weights"
        )
    for path in files:
        if not path.is_file():
            raise ExportError(f"weights file {path} is missing")
        problem = safetensors_problem(path)
        if problem is not None:
            raise ExportError(problem)


def read_training_arguments(checkpoint: Path) -> dict[str, Any]:
    """The optimisation settings of ``training_args.bin`` (Trainer pickles its arguments), read with
    ``torch.load(weights_only=True)`` allowing only the argument classes; ``{}`` when absent or unreadable."""
    import enum
    import importlib

    import torch

    path = checkpoint / "training_args.bin"
    if not path.is_file():
        return {}
    allowed = []
    for dotted in _TRAINING_ARGS_GLOBALS:
        module_name, _, name = dotted.rpartition(".")
        try:
            allowed.append(getattr(importlib.import_module(module_name), name))
        except (ImportError, AttributeError):
            continue
    try:
        with torch.serialization.safe_globals(allowed):
            arguments = torch.load(str(path), weights_only=True, map_location="cpu")
    except Exception as error:  # an unexpected class or a damaged file: the card just omits these settings
        logger.warning("not reading %s (%s); the card lists no optimisation settings", path, error)
        return {}
    settings = {}
    for name in CARD_TRAINING_ARGUMENTS:
        value = getattr(arguments, name, None)
        if isinstance(value, enum.Enum):
            value = value.value
        if value is None or (name == "max_steps" and value <= 0) or (name == "warmup_ratio" and not value):
            continue
        settings[name] = value
    if "max_steps" in settings:
        settings.pop("num_train_epochs", None)  # Trainer ignores the epoch count when max_steps is set
    return settings


def read_generation_samples(checkpoint: Path, split: str, count: int = 3) -> list[dict[str, str]]:
    """The first ``count`` (source, reference, hypothesis) rows ``flexformers-decode`` wrote for ``split``."""
    path = checkpoint / f"generations.{split}.jsonl"
    if not path.is_file():
        return []
    samples = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            if not isinstance(row, dict) or not all(isinstance(row.get(key), str) for key in ("source", "hypothesis")):
                break
            samples.append({key: row.get(key, "") for key in ("source", "reference", "hypothesis")})
            if len(samples) == count:
                break
    return samples


def read_eval_results(checkpoint: Path) -> dict[str, Any] | None:
    """``eval_results.json`` (see ``flexformers-decode``), validated; ``None`` when the file does not exist."""
    path = checkpoint / EVAL_RESULTS_FILE
    if not path.exists():
        return None
    results = read_json_file(path, "evaluation results")
    if not isinstance(results, dict):
        raise ExportError(f"{path} must hold a JSON object")
    missing = [field for field in ("task", "dataset", "split", "metrics") if field not in results]
    if missing:
        origin = (
            " (its eval_* keys look like Trainer.save_metrics output, e.g. from an older flexformers-train "
            "--do_eval, which wrote this file name; flexformers-train now writes validation_results.json)"
            if any(key.startswith("eval_") for key in results)
            else ""
        )
        raise ExportError(
            f"{path} lacks the field {missing[0]!r}: it is not flexformers-decode's evaluation{origin}; "
            f"run flexformers-decode --model_name_or_path {checkpoint} --split test to write it"
        )
    for field in ("task", "dataset", "split", "dataset_id", "dataset_config"):  # the last two only for Hub data
        if field in results and (not isinstance(results[field], str) or not results[field]):
            raise ExportError(f"{path}: {field!r} must be a non-empty string, found {results[field]!r}")
    metrics = results["metrics"]
    if not isinstance(metrics, dict) or not metrics:
        raise ExportError(f"{path}: 'metrics' must be a non-empty object of metric name -> number")
    for name, value in metrics.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ExportError(f"{path}: metric {name!r} must be a finite number, found {value!r}")
    for field in ("copy_baseline", "gain_over_copy"):  # optional: older eval_results.json files lack them
        if field not in results:
            continue
        if not isinstance(results[field], dict) or any(
            not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            for value in results[field].values()
        ):
            raise ExportError(f"{path}: {field!r} must be an object of metric name -> finite number")
    if "num_beams" in results and (not isinstance(results["num_beams"], int) or results["num_beams"] < 1):
        raise ExportError(f"{path}: 'num_beams' must be a positive integer, found {results['num_beams']!r}")
    if "length_penalty" in results and not isinstance(results["length_penalty"], (int, float)):
        raise ExportError(f"{path}: 'length_penalty' must be a number, found {results['length_penalty']!r}")
    return results


def read_training_summary(checkpoint: Path) -> dict[str, Any]:
    """What the card says about training: from ``trainer_state.json`` (the checkpoint's or, for an output
    directory, its latest ``checkpoint-*``'s) and ``train_results.json``/``all_results.json`` when present."""
    summary: dict[str, Any] = {}
    state_path = checkpoint / "trainer_state.json"
    if not state_path.is_file():
        candidates = sorted(
            checkpoint.glob("checkpoint-*/trainer_state.json"),
            key=lambda path: int(path.parent.name.split("-")[-1]) if path.parent.name.split("-")[-1].isdigit() else -1,
        )
        state_path = candidates[-1] if candidates else state_path
    if state_path.is_file():
        state = read_json_file(state_path, "trainer state")
        for key in ("global_step", "epoch", "max_steps", "num_train_epochs", "train_batch_size"):
            if state.get(key) is not None:
                summary[key] = state[key]
        losses = [entry for entry in state.get("log_history", []) if "loss" in entry]
        if losses:
            summary["final_train_loss"] = losses[-1]["loss"]
        evaluations = [entry for entry in state.get("log_history", []) if "eval_loss" in entry]
        if evaluations:
            summary["final_eval_loss"] = evaluations[-1]["eval_loss"]
    data_args_path = checkpoint / "flexformers_data_args.json"
    if data_args_path.is_file():
        from flexformers.training_scripts.arguments import DataArguments, describe_dataset

        try:
            summary["training_data"] = describe_dataset(DataArguments.load(checkpoint))
        except (ValueError, TypeError) as error:
            raise ExportError(f"{data_args_path} does not describe a corpus: {error}") from error
    for name in ("train_results.json", "all_results.json"):
        path = checkpoint / name
        if path.is_file():
            results = read_json_file(path, "training results")
            if isinstance(results, dict):
                for key in ("train_runtime", "train_samples", "train_loss"):
                    if key in results and key not in summary:
                        summary[key] = results[key]
    return summary
