"""Command-line argument dataclasses shared by ``flexformers-train`` and ``flexformers-decode``."""

from __future__ import annotations

import ast
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

DATA_ARGS_FILE = "flexformers_data_args.json"


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

    def save(self, directory: str | os.PathLike) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / DATA_ARGS_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "DataArguments | None":
        path = Path(directory) / DATA_ARGS_FILE
        if not path.is_file():
            return None
        stored = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in stored.items() if k in known})


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
