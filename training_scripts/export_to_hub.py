"""``flexformers-export``: turn a trained flexformers checkpoint directory into a Hub-ready folder.

The folder loads where flexformers is *not* installed::

    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)

It holds ``config.json`` (with ``auto_map`` for ``AutoConfig``, ``AutoModel`` and ``AutoModelForSeq2SeqLM``),
``model.safetensors``, ``generation_config.json`` (the method's decoding settings, overlaid with the beam size
and length penalty the reported evaluation used), the tokenizer files, the model's source code as a *flat* set
of files that import each other relatively, and a ``README.md`` model card rendered from ``hub_cards/`` with a
``model-index`` filled from the checkpoint's ``eval_results.json`` (written by ``flexformers-decode``).

Why the code has to be flattened: Transformers copies a remote model file and the files it imports with
``from .name import ...`` into one package. The project's modeling files import their configuration as
``from flexformers.configuration.configuration_<x> import ...`` (the installed package), which does not exist on
a user's machine. :func:`collect_remote_code` follows the relative and project-absolute imports of the model and
configuration files with :mod:`ast`, copies every file it reaches and rewrites
``from flexformers.configuration.X import`` / ``from flexformers.modeling.X import`` (and the namespace-less
``from configuration.X import`` form) to ``from .X import``; any other import that is not the standard library,
``torch`` or ``transformers`` is an error, because it would fail on the user's side.

The export is atomic: everything is written into a temporary directory next to the output and renamed into
place only after the folder has been checked, so a failure (not a flexformers checkpoint, a corrupt
``config.json``, truncated weights, ...) leaves nothing behind.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Top-level packages whose modules are copied into the flat folder (the remote code).
PROJECT_CODE_PACKAGES: tuple[str, ...] = ("modeling", "configuration")
#: The installed package those folders live under (``flexformers.modeling``, ``flexformers.configuration``).
PROJECT_NAMESPACE = "flexformers"
#: Third-party top-level modules remote code may import: torch, transformers and huggingface_hub, a hard
#: dependency of transformers (its configs use ``huggingface_hub.dataclasses.strict`` like ours).
REMOTE_CODE_THIRD_PARTY: frozenset[str] = frozenset({"torch", "transformers", "huggingface_hub"})
#: Where the card templates live (``hub_cards/<model_type>.md``, extending ``hub_cards/_base.md``).
DEFAULT_CARDS_DIR = Path(__file__).resolve().parent.parent / "hub_cards"
EVAL_RESULTS_FILE = "eval_results.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
#: Metrics ``flexformers-decode`` writes and how the card names them (others are shown under their key).
METRIC_NAMES = {"bleu": "BLEU", "chrf": "chrF", "ter": "TER", "pov": "PoV (% of outputs that parse as Python)"}
#: The sacrebleu signature field of ``eval_results.json`` for each metric (``<field>_signature``).
SIGNATURE_FIELDS = {"bleu": "sacrebleu", "chrf": "chrf", "ter": "ter"}
#: The pipeline's ``--task`` values as Hub task types (model-index) and human-readable names.
TASK_TYPES = {"translation": "translation"}
TASK_NAMES = {
    "translation": "Translation",
    "codegen": "Code generation (docstring to Python)",
    "code2doc": "Code documentation (Python to docstring)",
    "word_order": "Word order recovery",
    "files": "Sequence to sequence (parallel files)",
    "hub": "Sequence to sequence (Hub dataset)",
}
#: Generation settings the card does not list (Transformers' bookkeeping, not decoding choices).
CARD_HIDDEN_GENERATION = frozenset(
    {"transformers_version", "_from_model_config", "output_attentions", "output_hidden_states", "use_cache"}
)
#: Optimisation settings the card lists from the checkpoint's ``training_args.bin``.
CARD_TRAINING_ARGUMENTS = (
    "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "optim", "adam_beta1", "adam_beta2",
    "adam_epsilon", "weight_decay", "max_grad_norm", "per_device_train_batch_size", "gradient_accumulation_steps",
    "num_train_epochs", "max_steps", "seed", "bf16",
)
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


class ExportError(ValueError):
    """The checkpoint or the code cannot be exported; the message names the file (and line) at fault."""


# ---------------------------------------------------------------------------------------------------------
# Remote code: collect the model's source files and rewrite their imports into a flat, relative-only set
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ImportEdge:
    """One import of a project file found in a source file: what it points to, and whether to rewrite it."""

    target: Path
    node: ast.ImportFrom
    rewrite_from: str | None  # the absolute (dotted) package to replace by "." (None: already relative)


def _allowed_top_level_modules() -> frozenset[str]:
    return frozenset(sys.stdlib_module_names) | REMOTE_CODE_THIRD_PARTY | {"__future__"}


def _where(path: Path, node: ast.AST) -> str:
    return f"{path}:{getattr(node, 'lineno', '?')}"


def _project_imports(path: Path, tree: ast.AST, source_root: Path, packages: Sequence[str]) -> list[_ImportEdge]:
    """The imports of one file that point at project files; raises :class:`ExportError` for any import the
    flat remote folder cannot satisfy (third-party packages, package-level or multi-level relative imports)."""
    allowed = _allowed_top_level_modules()
    package_dir = path.parent
    edges: list[_ImportEdge] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in packages or top == PROJECT_NAMESPACE:
                    raise ExportError(
                        f"{_where(path, node)}: `import {alias.name}` cannot be flattened for remote code; "
                        f"write `from {alias.name.rsplit('.', 1)[0]}.<module> import <Name>` instead"
                    )
                if top not in allowed:
                    raise ExportError(
                        f"{_where(path, node)}: remote code may import only the standard library, torch, transformers, "
                        f"huggingface_hub and the project's own {'/'.join(packages)} files, found `import {alias.name}`"
                    )
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                module = node.module or ""
                parts = module.split(".")
                namespace = parts[:1] if parts[0] == PROJECT_NAMESPACE and len(parts) > 1 and parts[1] in packages else []
                top = parts[len(namespace)]
                if top in packages:
                    parts = parts[len(namespace):]
                    if len(parts) != 2:
                        raise ExportError(
                            f"{_where(path, node)}: `from {module} import ...` cannot be flattened for remote code; "
                            f"import from a module file, e.g. `from {top}.{top}_<name> import <Name>`"
                        )
                    target = source_root / parts[0] / f"{parts[1]}.py"
                    if not target.is_file():
                        raise ExportError(f"{_where(path, node)}: `from {module} import ...` but {target} does not exist")
                    edges.append(_ImportEdge(target=target, node=node, rewrite_from=".".join(namespace + parts[:1])))
                elif parts[0] == PROJECT_NAMESPACE:
                    raise ExportError(
                        f"{_where(path, node)}: `from {module} import ...` cannot be flattened for remote code; import "
                        f"from a module file, e.g. `from {PROJECT_NAMESPACE}.configuration.configuration_<name> import <Name>`"
                    )
                elif top not in allowed:
                    raise ExportError(
                        f"{_where(path, node)}: remote code may import only the standard library, torch, transformers, "
                        f"huggingface_hub and the project's own {'/'.join(packages)} files, found `from {module} import ...`"
                    )
            elif node.level == 1:
                if not node.module:
                    names = ", ".join(alias.name for alias in node.names)
                    raise ExportError(
                        f"{_where(path, node)}: `from . import {names}` is not followed by Transformers' remote-code "
                        f"loader (the module would not be copied); write `from .<module> import <Name>` instead"
                    )
                if "." in node.module:
                    raise ExportError(
                        f"{_where(path, node)}: `from .{node.module} import ...` imports a sub-package; remote code "
                        f"must be a flat set of files"
                    )
                target = package_dir / f"{node.module}.py"
                if not target.is_file():
                    raise ExportError(f"{_where(path, node)}: `from .{node.module} import ...` but {target} does not exist")
                edges.append(_ImportEdge(target=target, node=node, rewrite_from=None))
            else:
                raise ExportError(
                    f"{_where(path, node)}: `from {'.' * node.level}{node.module or ''} import ...` reaches outside "
                    f"its package; remote code must be a flat set of files"
                )
    return edges


def _rewrite_absolute_imports(source: str, edges: Iterable[_ImportEdge]) -> str:
    """Replace ``from <package>.X`` by ``from .X`` in the span of each import node, leaving everything else (the
    imported names, parentheses, comments, formatting) byte-for-byte unchanged."""
    lines = source.encode("utf-8").splitlines(keepends=True)
    line_starts = [0]
    for line in lines:
        line_starts.append(line_starts[-1] + len(line))
    data = source.encode("utf-8")
    spans = []
    for edge in edges:
        if edge.rewrite_from is None:
            continue
        node = edge.node
        # ast column offsets count UTF-8 bytes, hence the byte-level edit.
        start = line_starts[node.lineno - 1] + node.col_offset
        end = line_starts[node.end_lineno - 1] + node.end_col_offset
        spans.append((start, end, edge.rewrite_from))
    for start, end, package in sorted(spans, reverse=True):
        segment = data[start:end].decode("utf-8")
        dotted = r"\s*\.\s*".join(re.escape(part) for part in package.split("."))
        rewritten, count = re.subn(rf"^from\s+{dotted}\s*\.\s*", "from .", segment, count=1)
        if count != 1:
            raise ExportError(f"cannot rewrite import {segment!r}")
        data = data[:start] + rewritten.encode("utf-8") + data[end:]
    return data.decode("utf-8")


def collect_remote_code(
    root_files: Sequence[str | os.PathLike],
    source_root: str | os.PathLike | None = None,
    packages: Sequence[str] = PROJECT_CODE_PACKAGES,
) -> dict[str, str]:
    """The flat remote-code file set of ``root_files`` (a model file and its configuration file).

    Follows ``from .X import`` (same package) and ``from <package>.X import`` (another project package) imports
    transitively, anywhere in a file (also inside functions), and returns ``{file name: source}`` with the
    absolute project imports rewritten to ``from .X import``. Files are keyed by bare file name: two reachable
    files with the same name in different packages are an error, as is any import the flat folder cannot
    satisfy (see :func:`_project_imports`). ``source_root`` is the directory holding the packages (default: the
    parent of the first root file's package).
    """
    roots = [Path(path).resolve() for path in root_files]
    if not roots:
        raise ExportError("collect_remote_code needs at least one root file")
    root_dir = Path(source_root).resolve() if source_root is not None else roots[0].parent.parent
    for path in roots:
        if not path.is_file():
            raise ExportError(f"remote code file {path} does not exist")
        if path.parent.parent != root_dir or path.parent.name not in packages:
            raise ExportError(f"remote code file {path} is not in one of the packages {list(packages)} under {root_dir}")

    collected: dict[str, str] = {}
    origin: dict[str, Path] = {}
    pending = list(roots)
    while pending:
        path = pending.pop(0)
        name = path.name
        if name in origin:
            if origin[name] != path:
                raise ExportError(
                    f"file names must be unique across {'/'.join(packages)} for remote code: {origin[name]} and {path}"
                )
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source, filename=str(path))
        except (OSError, UnicodeDecodeError, SyntaxError) as error:
            raise ExportError(f"cannot read remote code file {path}: {error}") from error
        edges = _project_imports(path, tree, root_dir, packages)
        origin[name] = path
        collected[name] = _rewrite_absolute_imports(source, edges)
        pending.extend(edge.target.resolve() for edge in edges)
    return collected


def check_flat_remote_code(folder: str | os.PathLike, entry_files: Sequence[str]) -> None:
    """Check a flat folder the way Transformers' remote-code loader will read it.

    Uses :mod:`transformers.dynamic_module_utils` itself: every file the loader will copy for each entry file
    (its recursive ``from .X import``) must exist, and every absolute import it will require must be the
    standard library, torch or transformers. Raises :class:`ExportError` otherwise.
    """
    from transformers.dynamic_module_utils import get_imports, get_relative_imports

    folder = Path(folder)
    allowed = _allowed_top_level_modules()
    for entry in entry_files:
        pending, seen = [entry.removesuffix(".py")], set()
        while pending:
            name = pending.pop()
            if name in seen:
                continue
            seen.add(name)
            path = folder / f"{name}.py"
            if not path.is_file():
                raise ExportError(
                    f"{entry}: Transformers' loader would copy {name}.py, which is not in the folder "
                    f"(a `from .{name} import` at the start of a line, possibly inside a docstring)"
                )
            foreign = sorted(set(get_imports(str(path))) - allowed)
            if foreign:
                raise ExportError(
                    f"{path.name}: Transformers' loader would require {foreign}, which a user with only "
                    f"torch and transformers does not have"
                )
            # The same regular expressions Transformers uses to decide which files to copy.
            pending.extend(get_relative_imports(str(path)))


# ---------------------------------------------------------------------------------------------------------
# Checkpoint reading and validation
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RemoteClasses:
    """The classes behind one model type and the files of their source code."""

    config_class: type
    model_class: type
    base_model_class: type

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
        import flexformers.modeling  # noqa: F401  (registers every model type with the Auto classes)
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        base_model_class = MODEL_MAPPING[spec.config_class]
    except (ImportError, KeyError):
        pass
    return RemoteClasses(spec.config_class, spec.model_class, base_model_class)


def _read_json(path: Path, what: str) -> Any:
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
    config = _read_json(config_path, "config")
    if not isinstance(config, dict):
        raise ExportError(f"{config_path} must hold a JSON object, found {type(config).__name__}")
    if "model_type" not in config:
        raise ExportError(f"{config_path} has no 'model_type'; it is not a flexformers checkpoint")
    return config


def check_weights_file(checkpoint: Path) -> None:
    """Fail clearly on missing, sharded-but-incomplete, or truncated/corrupt safetensors weights."""
    from safetensors import safe_open

    single = checkpoint / WEIGHTS_FILE
    index = checkpoint / WEIGHTS_INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = _read_json(index, "weights index").get("weight_map")
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
        size = path.stat().st_size
        try:
            with safe_open(str(path), framework="pt") as handle:
                names = list(handle.keys())
                for name in names:
                    handle.get_slice(name)  # touches every tensor's header entry
        except Exception as error:  # safetensors raises its own SafetensorError for malformed files
            raise ExportError(f"{path} is corrupt or truncated ({size} bytes): {error}") from error
        if _safetensors_data_end(path) != size:
            raise ExportError(
                f"{path} is truncated or has trailing bytes: its header describes "
                f"{_safetensors_data_end(path)} bytes, the file has {size}"
            )


def _safetensors_data_end(path: Path) -> int:
    """Size a well-formed safetensors file must have according to its own header."""
    with open(path, "rb") as handle:
        header_length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_length))
    data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    return 8 + header_length + data_end


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
    results = _read_json(path, "evaluation results")
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
    for field in ("task", "dataset", "split"):
        if not isinstance(results[field], str) or not results[field]:
            raise ExportError(f"{path}: {field!r} must be a non-empty string, found {results[field]!r}")
    metrics = results["metrics"]
    if not isinstance(metrics, dict) or not metrics:
        raise ExportError(f"{path}: 'metrics' must be a non-empty object of metric name -> number")
    for name, value in metrics.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ExportError(f"{path}: metric {name!r} must be a finite number, found {value!r}")
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
        state = _read_json(state_path, "trainer state")
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
            results = _read_json(path, "training results")
            if isinstance(results, dict):
                for key in ("train_runtime", "train_samples", "train_loss"):
                    if key in results and key not in summary:
                        summary[key] = results[key]
    return summary


# ---------------------------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------------------------

#: Config fields shown in the card's hyper-parameter table when the config has them.
CARD_CONFIG_FIELDS = (
    "encoder_layers",
    "decoder_layers",
    "encoder_embed_dim",
    "decoder_embed_dim",
    "encoder_ffn_embed_dim",
    "decoder_ffn_embed_dim",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_normalize_before",
    "decoder_normalize_before",
    "share_all_embeddings",
    "share_decoder_input_output_embed",
    "dropout",
    "attention_dropout",
    "activation_dropout",
    "label_smoothing",
    "vocab_size",
    "target_vocab_size",
)


#: Baseline fields a method sets to change the architecture (the backbone's seams).
_SEAM_FIELDS = (
    "encoder_use_positions", "decoder_use_positions", "encoder_attention_branches", "decoder_attention_branches",
    "encoder_ffn_branches", "decoder_ffn_branches",
)
_CONFIG_BOOKKEEPING = frozenset(
    {"auto_map", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path"}
)


def method_specific_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config fields that make this model its method: the fields the baseline config does not have, and the
    backbone's seam switches where they differ from the baseline."""
    from flexformers.configuration.configuration_flexformer import FlexformerConfig

    baseline = FlexformerConfig().to_dict()
    fields = {}
    for key, value in config.items():
        if key in _CONFIG_BOOKKEEPING:
            continue
        if key not in baseline or (key in _SEAM_FIELDS and value != baseline[key]):
            fields[key] = value
    return fields


def build_card_data(
    model_name: str,
    eval_results: dict[str, Any] | None,
    *,
    language: Sequence[str] | None = None,
    license: str | None = None,
    model_type: str,
    datasets: Sequence[str] | None = None,
):
    """``ModelCardData`` with one ``EvalResult`` per metric of ``eval_results`` (the card's ``model-index``)."""
    from huggingface_hub import EvalResult, ModelCardData

    results = []
    if eval_results is not None:
        signatures = {name: eval_results.get(f"{field}_signature") for name, field in SIGNATURE_FIELDS.items()}
        for key, value in eval_results["metrics"].items():
            results.append(
                EvalResult(
                    task_type=TASK_TYPES.get(eval_results["task"], "text2text-generation"),
                    task_name=TASK_NAMES.get(eval_results["task"], eval_results["task"]),
                    dataset_type=eval_results["dataset"],
                    dataset_name=eval_results["dataset"],
                    dataset_split=eval_results["split"],
                    metric_type=key,
                    metric_name=METRIC_NAMES.get(key, key),
                    metric_value=round(float(value), 4),
                    metric_config=signatures.get(key) or None,
                )
            )
    return ModelCardData(
        model_name=model_name,
        eval_results=results or None,
        language=list(language) if language else None,
        license=license,
        library_name="transformers",
        pipeline_tag=TASK_TYPES.get(eval_results["task"], "text2text-generation") if eval_results else None,
        tags=["flexformers", model_type, "seq2seq", "custom_code"],
        datasets=list(datasets) if datasets else None,
        metrics=sorted(eval_results["metrics"]) if eval_results else None,
    )


def render_model_card(
    *,
    model_type: str,
    model_id: str,
    config: dict[str, Any],
    generation_config: dict[str, Any],
    eval_results: dict[str, Any] | None,
    training: dict[str, Any],
    num_parameters: int | None,
    auto_map: dict[str, str],
    source_tokenizer_subfolder: str | None = None,
    training_arguments: dict[str, Any] | None = None,
    samples: Sequence[dict[str, str]] = (),
    method_config: dict[str, Any] | None = None,
    language: Sequence[str] | None = None,
    license: str | None = None,
    datasets: Sequence[str] | None = None,
    cards_dir: str | os.PathLike = DEFAULT_CARDS_DIR,
) -> str:
    """Render ``hub_cards/<model_type>.md`` and check that the result parses as a model card with a valid
    ``model-index`` (``ModelCard(..., ignore_metadata_errors=False)``). Pure: takes plain dicts."""
    import jinja2
    from huggingface_hub import ModelCard

    cards_dir = Path(cards_dir)
    template_name = f"{model_type}.md"
    if not (cards_dir / template_name).is_file():
        raise ExportError(f"no model card template {cards_dir / template_name} for model type {model_type!r}")
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(cards_dir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    card_data = build_card_data(
        model_id.split("/")[-1],
        eval_results,
        language=language,
        license=license,
        model_type=model_type,
        datasets=datasets,  # Hub dataset ids only; the pipeline's corpus names are not
    )
    default_generation = _default_generation_dict()
    content = environment.get_template(template_name).render(
        card_data=card_data.to_yaml(),
        model_id=model_id,
        model_type=model_type,
        config=config,
        hyperparameters={key: config[key] for key in CARD_CONFIG_FIELDS if config.get(key) is not None},
        generation={key: value for key, value in generation_config.items() if key not in CARD_HIDDEN_GENERATION},
        method_generation={
            key: value
            for key, value in generation_config.items()
            if key not in default_generation and key not in ("transformers_version", "_from_model_config")
        },
        eval=eval_results,
        task_name=TASK_NAMES.get(eval_results["task"], eval_results["task"]) if eval_results else None,
        training_arguments=training_arguments or {},
        method_config=method_config or {},
        samples=list(samples),
        example_input=samples[0]["source"] if samples else None,
        datasets=list(datasets or []),
        metric_names=METRIC_NAMES,
        training=training,
        num_parameters=num_parameters,
        auto_map=auto_map,
        source_tokenizer_subfolder=source_tokenizer_subfolder,
    )
    try:
        card = ModelCard(content, ignore_metadata_errors=False)
    except Exception as error:
        raise ExportError(f"the rendered card of {model_type!r} is not a valid model card: {error}") from error
    return str(card)


def _default_generation_dict() -> dict[str, Any]:
    from transformers import GenerationConfig

    return GenerationConfig().to_dict()


# ---------------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ExportOptions:
    """Everything :func:`export_checkpoint` takes besides the two paths."""

    hub_model_id: str | None = None
    language: Sequence[str] | None = None
    license: str | None = None
    datasets: Sequence[str] | None = None
    generation_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    require_eval_results: bool = True
    overwrite: bool = False
    cards_dir: Path = DEFAULT_CARDS_DIR


def parse_overrides(text: str | None) -> dict[str, Any]:
    """``"num_beams=5,exit_thresholds=[0.9,0.8],name=x"`` (commas inside brackets belong to the value) or a JSON
    object -> a typed dict (JSON literals where they parse, else strings)."""
    overrides: dict[str, Any] = {}
    if not text or not text.strip():
        return overrides
    if text.lstrip().startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as error:
            raise ExportError(f"--generation_overrides is not a valid JSON object: {error}") from error
        if not isinstance(parsed, dict):
            raise ExportError("--generation_overrides must be key=value pairs or a JSON object")
        return parsed
    items, depth, current = [], 0, ""
    for character in text:
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(character, 0)
        if character == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += character
    items.append(current)
    for item in items:
        if not item.strip():
            continue
        if "=" not in item:
            raise ExportError(f"--generation_overrides item {item!r} is not key=value")
        key, value = (part.strip() for part in item.split("=", 1))
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def _load_checkpoint(checkpoint: Path, classes: RemoteClasses):
    """Load config, model (every weight accounted for) and tokenizer, turning every failure into a clear error."""
    from flexformers.training_scripts.tokenizer import load_tokenizers

    try:
        config = classes.config_class.from_pretrained(str(checkpoint))
    except (ValueError, TypeError, KeyError) as error:
        raise ExportError(f"{checkpoint / 'config.json'} is not a valid {classes.config_class.__name__}: {error}") from error
    check_weights_file(checkpoint)
    try:
        model, loading_info = classes.model_class.from_pretrained(
            str(checkpoint), config=config, output_loading_info=True
        )
    except Exception as error:
        raise ExportError(f"cannot load the weights of {checkpoint} into {classes.model_class.__name__}: {error}") from error
    problems = {key: value for key, value in loading_info.items() if value and key != "error_msgs"}
    if problems or loading_info.get("error_msgs"):
        raise ExportError(f"the weights in {checkpoint} do not match {classes.model_class.__name__}: {loading_info}")
    model.eval()
    try:
        source_tokenizer, target_tokenizer = load_tokenizers(checkpoint)
    except Exception as error:
        raise ExportError(f"{checkpoint} has no loadable tokenizer (tokenizer.json, tokenizer_config.json): {error}") from error
    return config, model, source_tokenizer, target_tokenizer


def _check_tokenizer_is_standard(folder: Path) -> None:
    """The saved tokenizer must be a class Transformers ships (a user has no flexformers tokenizer class)."""
    import transformers

    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        raise ExportError("the tokenizer did not save a tokenizer_config.json")
    tokenizer_class = _read_json(config_path, "tokenizer config").get("tokenizer_class")
    if tokenizer_class and not hasattr(transformers, tokenizer_class):
        raise ExportError(
            f"the tokenizer class {tokenizer_class!r} is not part of transformers; AutoTokenizer cannot load it "
            f"without flexformers"
        )


#: ``generate()`` parameters that are inputs or Transformers' own machinery, never a method's decoding setting.
_GENERATE_MACHINERY = frozenset({
    "self", "inputs", "input_ids", "attention_mask", "generation_config", "logits_processor", "stopping_criteria",
    "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model", "streamer", "negative_prompt_ids",
    "negative_prompt_attention_mask", "custom_generate", "use_model_defaults", "kwargs",
})


def method_decoding_settings(model) -> dict[str, Any]:
    """The method's own decoding options that the checkpoint's config sets: keyword parameters of the model's
    ``generate()`` that are also config attributes with a value (e.g. Depth-Adaptive's ``exit_strategy`` /
    ``exit_thresholds``). They go into ``generation_config.json`` so the folder documents how it decodes."""
    parameters = inspect.signature(type(model).generate).parameters
    settings = {}
    for name, parameter in parameters.items():
        if name in _GENERATE_MACHINERY or parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
            continue
        value = getattr(model.config, name, None)
        if value is None:
            continue
        try:
            json.dumps(value)
        except TypeError:
            continue
        settings[name] = list(value) if isinstance(value, tuple) else value
    return settings


def build_generation_config(model, eval_results: dict[str, Any] | None, overrides: dict[str, Any]):
    """The model's generation config (the checkpoint's ``generation_config.json``, with the method's decoding
    fields), overlaid with the beam size / length penalty of the reported evaluation, then ``overrides``."""
    import copy

    generation_config = copy.deepcopy(model.generation_config)
    updates: dict[str, Any] = dict(method_decoding_settings(model))
    if eval_results is not None:
        if eval_results.get("num_beams") is not None:
            updates["num_beams"] = eval_results["num_beams"]
        if eval_results.get("max_new_tokens") is not None:
            updates["max_new_tokens"] = eval_results["max_new_tokens"]
        # Length penalty and early stopping only act in beam search (flexformers-decode stops beams early, like
        # fairseq); Transformers refuses to save either next to greedy decoding.
        if updates.get("num_beams", generation_config.num_beams) > 1:
            updates["early_stopping"] = True
            if eval_results.get("length_penalty") is not None:
                updates["length_penalty"] = eval_results["length_penalty"]
    updates.update(overrides)
    try:
        unused = generation_config.update(**updates)
        # Keys GenerationConfig does not declare are kept as attributes (methods' own decoding options).
        for key, value in unused.items():
            setattr(generation_config, key, value)
        # A standalone generation config: Transformers must not re-derive it from config.json at generate() time.
        generation_config._from_model_config = False
        generation_config.validate(strict=True)
    except (ValueError, TypeError) as error:
        raise ExportError(f"invalid generation settings {updates}: {error}") from error
    return generation_config


def export_checkpoint(checkpoint: str | os.PathLike, output_dir: str | os.PathLike, options: ExportOptions | None = None) -> Path:
    """Write the Hub-ready folder of ``checkpoint`` to ``output_dir`` atomically; returns ``output_dir``."""
    options = options or ExportOptions()
    checkpoint = Path(checkpoint).resolve()
    output_dir = Path(output_dir).resolve()
    if output_dir == checkpoint:
        raise ExportError("the output directory must differ from the checkpoint directory")
    if output_dir.exists() and not options.overwrite:
        raise ExportError(f"{output_dir} already exists; pass --overwrite to replace it")

    raw_config = read_checkpoint_config(checkpoint)
    classes = resolve_model_type(str(raw_config["model_type"]))
    eval_results = read_eval_results(checkpoint)
    if eval_results is None and options.require_eval_results:
        raise ExportError(
            f"{checkpoint} has no {EVAL_RESULTS_FILE}; run flexformers-decode on it first (the card reports its "
            f"evaluation), or pass --allow_missing_eval_results"
        )
    config, model, source_tokenizer, target_tokenizer = _load_checkpoint(checkpoint, classes)
    remote_code = collect_remote_code(classes.root_files())
    auto_map = classes.auto_map()
    generation_config = build_generation_config(model, eval_results, options.generation_overrides)

    from flexformers.training_scripts.tokenizer import SOURCE_TOKENIZER_SUBDIR, save_tokenizers

    created_parents = [parent for parent in output_dir.parents if not parent.exists()]
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.export-", dir=output_dir.parent))
    try:
        staging.chmod(0o777 & ~_current_umask())  # mkdtemp creates 0700; the folder is meant to be shared
        model.generation_config = generation_config
        model.save_pretrained(str(staging), safe_serialization=True)
        config_path = staging / "config.json"
        saved_config = _read_json(config_path, "config")
        saved_config["auto_map"] = auto_map
        config_path.write_text(json.dumps(saved_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        generation_config.save_pretrained(str(staging))
        save_tokenizers(staging, source_tokenizer, target_tokenizer)
        _check_tokenizer_is_standard(staging)
        if source_tokenizer is not target_tokenizer:
            _check_tokenizer_is_standard(staging / SOURCE_TOKENIZER_SUBDIR)
        for name, source in remote_code.items():
            if (staging / name).exists():
                raise ExportError(f"remote code file {name} clashes with a file the checkpoint writes")
            (staging / name).write_text(source, encoding="utf-8")
        check_flat_remote_code(staging, sorted({entry.split(".")[0] + ".py" for entry in auto_map.values()}))
        card = render_model_card(
            model_type=classes.config_class.model_type,
            model_id=options.hub_model_id or output_dir.name,
            config=saved_config,
            generation_config=generation_config.to_diff_dict(),
            eval_results=eval_results,
            training=read_training_summary(checkpoint),
            num_parameters=model.num_parameters(),
            source_tokenizer_subfolder=SOURCE_TOKENIZER_SUBDIR if source_tokenizer is not target_tokenizer else None,
            training_arguments=read_training_arguments(checkpoint),
            method_config=method_specific_config(saved_config),
            samples=read_generation_samples(checkpoint, eval_results["split"]) if eval_results else [],
            auto_map=auto_map,
            language=options.language,
            license=options.license,
            datasets=options.datasets,
            cards_dir=options.cards_dir,
        )
        (staging / "README.md").write_text(card, encoding="utf-8")
        for path in staging.rglob("*"):  # some writers (safetensors) create 0600 files
            path.chmod((0o777 if path.is_dir() else 0o666) & ~_current_umask())
        _replace_directory(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in created_parents:  # innermost first; only the directories this call created
            try:
                parent.rmdir()
            except OSError:
                break
        raise
    return output_dir


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _replace_directory(staging: Path, output_dir: Path) -> None:
    """Move ``staging`` to ``output_dir``; an existing ``output_dir`` is removed only once the new one is in place."""
    if not output_dir.exists():
        os.replace(staging, output_dir)
        return
    retired = output_dir.with_name(f".{output_dir.name}.old-{os.getpid()}")
    os.replace(output_dir, retired)
    try:
        os.replace(staging, output_dir)
    except BaseException:
        os.replace(retired, output_dir)
        raise
    shutil.rmtree(retired, ignore_errors=True)


def push_folder_to_hub(folder: str | os.PathLike, repo_id: str, *, private: bool = False, token: str | None = None,
                       commit_message: str = "Upload flexformers model") -> str:
    """Create (or reuse) the Hub model repository ``repo_id`` and upload ``folder``; returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(folder), commit_message=commit_message)
    return str(getattr(commit, "commit_url", commit))


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def build_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexformers-export",
        description="Turn a trained flexformers checkpoint directory into a Hub-ready folder (remote code, weights, "
        "tokenizer, generation config, model card) and optionally upload it.",
    )
    parser.add_argument("checkpoint", help="checkpoint directory written by flexformers-train (with eval_results.json)")
    parser.add_argument("output_dir", help="folder to create (fails if it exists, unless --overwrite)")
    parser.add_argument("--hub_model_id", help="Hub repository id, e.g. user/iot-iwslt14-de-en (card and upload)")
    parser.add_argument("--push_to_hub", action="store_true", help="upload the folder with huggingface_hub")
    parser.add_argument("--private", action="store_true", help="create the Hub repository as private")
    parser.add_argument("--language", nargs="*", help="ISO codes of the languages, e.g. de en")
    parser.add_argument("--license", help="license identifier for the card, e.g. mit")
    parser.add_argument("--dataset", nargs="*", dest="datasets", help="Hub ids of the training datasets (card metadata)")
    parser.add_argument(
        "--generation_overrides",
        help="comma-separated key=value decoding settings written into generation_config.json",
    )
    parser.add_argument(
        "--allow_missing_eval_results",
        action="store_true",
        help=f"export without {EVAL_RESULTS_FILE} (the card then has no model-index)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    parser.add_argument("--cards_dir", default=str(DEFAULT_CARDS_DIR), help="directory of the card templates")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_argument_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.push_to_hub and not args.hub_model_id:
        print("flexformers-export: --push_to_hub needs --hub_model_id", file=sys.stderr)
        return 2
    try:
        options = ExportOptions(
            hub_model_id=args.hub_model_id,
            language=args.language,
            license=args.license,
            datasets=args.datasets,
            generation_overrides=parse_overrides(args.generation_overrides),
            require_eval_results=not args.allow_missing_eval_results,
            overwrite=args.overwrite,
            cards_dir=Path(args.cards_dir),
        )
        folder = export_checkpoint(args.checkpoint, args.output_dir, options)
    except ExportError as error:
        print(f"flexformers-export: {error}", file=sys.stderr)
        return 1
    print(f"exported {args.checkpoint} -> {folder}")
    if args.push_to_hub:
        url = push_folder_to_hub(folder, args.hub_model_id, private=args.private)
        print(f"uploaded to {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
