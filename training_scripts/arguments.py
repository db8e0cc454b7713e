"""Command-line argument dataclasses shared by ``flexformers-train`` and ``flexformers-decode``."""

from __future__ import annotations

import ast
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

DATA_ARGS_FILE = "flexformers_data_args.json"
#: The data files whose SHA-256 is saved with a run (under this key of ``DATA_ARGS_FILE``).
DATA_FILE_FIELDS = ("train_file", "validation_file", "test_file")
DATA_FILE_HASHES_KEY = "data_file_sha256"


@dataclass
class ModelArguments:
    model_type: str = field(
        default="flexformer",
        metadata={"help": "Model type: a module in training_scripts/methods (flexformer, iot, mat, indigo, depth_adaptive)."},
    )
    preset: str | None = field(
        default=None,
        metadata={
            "help": "Architecture preset (FlexformerConfig.from_preset), e.g. transformer_iwslt_de_en. Default: "
            "transformer_codegen_small, or the architecture of --model_name_or_path when that is given."
        },
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "Config fields to override, 'key=value,key=value' (e.g. 'dropout=0.1,encoder_layers=2')."},
    )
    label_smoothing: float = field(
        default=0.1, metadata={"help": "Label smoothing computed inside the model (config.label_smoothing)."}
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Initialise from this trained model directory instead of from scratch."}
    )
    allow_missing_weights: bool = field(
        default=False,
        metadata={"help": "With --model_name_or_path: initialise even when weights are missing from it (they start "
                          "from their random initialisation) or unused; by default such a checkpoint is refused."},
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Use the tokenizer saved in this directory instead of training a BPE."}
    )
    vocab_size: int = field(default=10000, metadata={"help": "BPE vocabulary size (source size when not joint)."})
    target_vocab_size: int | None = field(
        default=None, metadata={"help": "Target BPE vocabulary size with --joint_vocab false (default: vocab_size)."}
    )
    joint_vocab: bool = field(default=True, metadata={"help": "One BPE for source and target (shared embeddings)."})
    bpe_min_frequency: int = field(default=2, metadata={"help": "Minimum pair frequency for a BPE merge."})
    max_train_minutes: float | None = field(
        default=None, metadata={"help": "Stop training (and save) after this many minutes of wall time."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start a new run in an --output_dir that holds another run's files (checkpoints, model, "
            "tokenizer): they are moved aside into <output_dir>/_replaced-<time>/, not deleted. Without it such a "
            "folder is refused (continue the run there with --resume_from_checkpoint latest)."
        },
    )
    permutation_of_source: bool | None = field(
        default=None,
        metadata={"help": "Generate validation/test outputs as permutations of the source words (word-order "
                          "recovery: the task's definition of an answer). Default: on for --task word_order with a "
                          "left-to-right model, off otherwise."},
    )
    retain_cpu_memory: bool = field(
        default=True,
        metadata={
            "help": "Training on the CPU (glibc Linux): keep freed memory in the process heap instead of returning "
            "it to the kernel, so steps stop page-faulting their tensors in anew (≈ 10%% faster steps at IWSLT "
            "size on 2 cores, a few %% more resident memory). Changes the whole process's allocator."
        },
    )

    def __post_init__(self):
        import math

        minutes = self.max_train_minutes
        if minutes is not None and not (math.isfinite(minutes) and minutes > 0):
            raise ValueError(f"--max_train_minutes must be a positive number of minutes, got {minutes:g}")


@dataclass
class DataArguments:
    task: str = field(
        default="codegen",
        metadata={
            "help": "codegen (docstring->code from Python sources), code2doc (the reverse), translation (gettext "
            "catalogs, en->target_lang), word_order (shuffled->original English), files (your TSV/CSV/JSONL), "
            "hub (datasets.load_dataset)."
        },
    )
    python_source_dirs: list[str] | None = field(
        default=None, metadata={"help": "Python source trees for codegen/code2doc (default: the standard library)."}
    )
    docstring: str = field(default="full", metadata={"help": "codegen source: 'full' docstring or 'summary'."})
    max_source_chars: int = field(default=1024, metadata={"help": "codegen: drop docstrings longer than this."})
    max_target_chars: int = field(default=2048, metadata={"help": "codegen: drop functions longer than this."})
    locale_dir: str = field(default="/usr/share/locale", metadata={"help": "translation: gettext locale directory."})
    source_lang: str = field(default="en", metadata={"help": "hub: source language key of a 'translation' column."})
    target_lang: str = field(default="de", metadata={"help": "translation / hub: target language."})
    word_order_base: str = field(default="codegen", metadata={"help": "word_order: English of 'codegen' or 'gettext'."})
    train_file: str | None = field(default=None, metadata={"help": "files: training TSV/CSV/JSONL."})
    validation_file: str | None = field(default=None, metadata={"help": "files: validation file (optional)."})
    test_file: str | None = field(default=None, metadata={"help": "files: test file (optional)."})
    file_format: str | None = field(default=None, metadata={"help": "files: tsv, csv or jsonl (default: extension)."})
    source_column: str = field(default="source", metadata={"help": "files/hub: source column (or 0-based number)."})
    target_column: str = field(default="target", metadata={"help": "files/hub: target column (or 0-based number)."})
    skip_bad_lines: bool = field(
        default=False, metadata={"help": "files: skip (and count) malformed lines instead of stopping with an error."}
    )
    dataset_name: str | None = field(default=None, metadata={"help": "hub: datasets.load_dataset name."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "hub: dataset configuration."})
    max_source_length: int = field(default=256, metadata={"help": "Drop training pairs whose source has more tokens."})
    max_target_length: int = field(default=256, metadata={"help": "Drop training pairs whose target has more tokens."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training pairs."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N validation pairs."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Use only the first N test pairs."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenisation."})

    def __post_init__(self):
        from flexformers.training_scripts.data import TASKS

        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.task == "files" and not self.train_file:
            raise ValueError("--task files needs --train_file")
        if self.task == "hub" and not self.dataset_name:
            raise ValueError("--task hub needs --dataset_name")
        for name in ("max_source_length", "max_target_length"):
            if getattr(self, name) < 2:
                raise ValueError(f"--{name} must be at least 2, got {getattr(self, name)}")

    @property
    def is_code(self) -> bool:
        """Whether the targets are Python code (PoV is reported)."""
        return self.task == "codegen"

    def with_absolute_paths(self) -> "DataArguments":
        """A copy whose file and directory paths are absolute (resolved against the current directory), so that
        the saved arguments name the same data wherever ``flexformers-decode`` runs later. A Hub dataset name is
        made absolute only when it is an existing local path."""
        changes = {name: os.path.abspath(getattr(self, name))
                   for name in (*DATA_FILE_FIELDS, "locale_dir") if getattr(self, name)}
        if self.python_source_dirs:
            changes["python_source_dirs"] = [os.path.abspath(d) for d in self.python_source_dirs]
        if self.dataset_name and os.path.exists(self.dataset_name):
            changes["dataset_name"] = os.path.abspath(self.dataset_name)
        copy = replace(self, **changes)
        copy.saved_file_hashes = getattr(self, "saved_file_hashes", {})
        return copy

    def data_file_hashes(self) -> dict[str, str | None]:
        """SHA-256 of each data file (``train_file`` / ``validation_file`` / ``test_file``; ``None`` where unset or
        unreadable), computed once per instance: checkpoints saved later record the files training read at the
        start, even if they are edited meanwhile."""
        if getattr(self, "_file_hashes", None) is None:
            self._file_hashes = {name: file_sha256(getattr(self, name)) for name in DATA_FILE_FIELDS}
        return self._file_hashes

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``flexformers_data_args.json`` into ``directory``: the arguments with absolute paths, and the
        SHA-256 of each data file (``data_file_sha256``), which decoding and resuming compare with the files then."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        stored = dict(asdict(self.with_absolute_paths()), **{DATA_FILE_HASHES_KEY: self.data_file_hashes()})
        (Path(directory) / DATA_ARGS_FILE).write_text(json.dumps(stored, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "DataArguments | None":
        """The arguments saved in ``directory`` (``None`` without the file); the saved data-file hashes (none in
        files written before they were recorded) are kept as ``saved_file_hashes``."""
        path = Path(directory) / DATA_ARGS_FILE
        if not path.is_file():
            return None
        stored = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        loaded = cls(**{k: v for k, v in stored.items() if k in known})
        loaded.saved_file_hashes = {name: digest for name, digest in (stored.get(DATA_FILE_HASHES_KEY) or {}).items()
                                    if name in DATA_FILE_FIELDS}
        return loaded

    def changed_data_files(self) -> dict[str, str]:
        """``{field: path}`` of the data files whose content differs from the hash saved with the run (files that
        are gone are left to the corpus loader, which names them)."""
        changed = {}
        for name, saved in getattr(self, "saved_file_hashes", {}).items():
            path = getattr(self, name, None)
            if saved and path and os.path.isfile(path) and file_sha256(path) != saved:
                changed[name] = path
        return changed


def split_top_level(text: str, separator: str = ",") -> list[str]:
    """``text`` split on ``separator`` outside brackets and quotes: ``"a=1,b=[1,2],c='x,y'"`` -> three items."""
    items, current, depth, quote = [], [], 0, None
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == separator and depth == 0:
            items.append("".join(current))
            current = []
            continue
        current.append(char)
    items.append("".join(current))
    return items


def parse_config_overrides(text: str | None) -> dict:
    """``"dropout=0.1,encoder_layers=2,decoder_orders=[1,2],activation_function=gelu"`` -> a dict with Python
    values (numbers, booleans, None, lists via ``ast.literal_eval``; anything else stays a string). Commas inside
    brackets or quotes belong to the value."""
    if not text:
        return {}
    overrides = {}
    for item in split_top_level(text):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"--config_overrides: expected key=value, got {item!r}")
        key, value = (part.strip() for part in item.split("=", 1))
        if not key.isidentifier():
            raise ValueError(f"--config_overrides: {key!r} is not a config field name")
        lowered = value.lower()
        if lowered in ("true", "false"):
            overrides[key] = lowered == "true"
        elif lowered in ("none", "null"):
            overrides[key] = None
        else:
            try:
                overrides[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                overrides[key] = value
    return overrides


def check_config_override_names(config_class: type, overrides: dict) -> None:
    """Refuse ``--config_overrides`` keys that are not fields of ``config_class`` (a misspelt key would otherwise
    land in config.json beside the real field and change nothing), suggesting the closest field name."""
    import dataclasses
    import difflib

    known = {f.name for f in dataclasses.fields(config_class)} | set(getattr(config_class, "attribute_map", {}))
    for key in overrides:
        if key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else f" (see {config_class.__name__}'s fields)"
        raise ValueError(f"--config_overrides: {key!r} is not a field of {config_class.__name__}{hint}")


def file_sha256(path: str | os.PathLike | None) -> str | None:
    """SHA-256 (hex) of a file's bytes, read in blocks; ``None`` for no path or a path that is not a readable file."""
    if not path or not os.path.isfile(path):
        return None
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def train_file_change(saved: DataArguments | None, current: DataArguments) -> str | None:
    """One line naming how ``current``'s ``--train_file`` differs from the one ``saved`` (a checkpoint's data
    arguments) was trained on -- another path, or the same path with other content -- else ``None``."""
    if saved is None or not (saved.train_file or current.train_file):
        return None
    before = os.path.abspath(saved.train_file) if saved.train_file else None
    now = os.path.abspath(current.train_file) if current.train_file else None
    if before != now:
        return (f"resuming with --train_file {now}, but the checkpoint was trained on --train_file {before}: "
                "training continues on other data")
    saved_hash = getattr(saved, "saved_file_hashes", {}).get("train_file")
    if saved_hash and current.data_file_hashes()["train_file"] not in (None, saved_hash):
        return (f"resuming with --train_file {now}, which has changed since the checkpoint was saved (its SHA-256 "
                "differs): training continues on other data")
    return None


def hub_dataset_reference(data_args: DataArguments) -> dict[str, str]:
    """``{"dataset_id": ..., "dataset_config": ...}`` of a ``--task hub`` run whose ``--dataset_name`` is a Hub
    dataset id (not a local folder), for the card's ``model-index``; empty for every other corpus."""
    if data_args.task != "hub" or not data_args.dataset_name or os.path.exists(data_args.dataset_name):
        return {}
    reference = {"dataset_id": data_args.dataset_name}
    if data_args.dataset_config_name:
        reference["dataset_config"] = data_args.dataset_config_name
    return reference


def describe_dataset(data_args: DataArguments) -> str:
    """A short human-readable name of the corpus, for eval_results.json and model cards."""
    if data_args.task in ("codegen", "code2doc"):
        dirs = data_args.python_source_dirs
        where = "python-stdlib" if not dirs else "python:" + "+".join(Path(d).name for d in dirs)
        return f"{where}-{'docstring-to-code' if data_args.task == 'codegen' else 'code-to-docstring'}"
    if data_args.task == "translation":
        return f"gettext-en-{data_args.target_lang}"
    if data_args.task == "word_order":
        return f"word-order-{data_args.word_order_base}"
    if data_args.task == "files":
        return Path(data_args.train_file).name
    return f"{data_args.dataset_name}" + (f"/{data_args.dataset_config_name}" if data_args.dataset_config_name else "")
