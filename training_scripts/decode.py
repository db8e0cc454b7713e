"""Decode / evaluate a trained checkpoint (``flexformers-decode``).

Evaluate a split (hypotheses written next to the model, metrics and sacrebleu signature printed, throughput
measured, ``eval_results.json`` written into the checkpoint directory)::

    flexformers-decode --model_name_or_path runs/quickstart --split test --num_beams 5 --length_penalty 1.0

Quick look at a model on your own input (no metrics)::

    flexformers-decode --model_name_or_path runs/quickstart --text "Return the sum of a and b."
    echo "Return the sum of a and b." | flexformers-decode --model_name_or_path runs/quickstart --stdin

The corpus options (``--task`` etc.) default to the ones the model was trained with (saved by
``flexformers-train`` as ``flexformers_data_args.json``); any given on the command line override them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from transformers import HfArgumentParser

from flexformers.training_scripts.arguments import (
    DATA_ARGS_FILE,
    DATA_FILE_FIELDS,
    DataArguments,
    describe_dataset,
    hub_dataset_reference,
)
from flexformers.training_scripts.checkpoints import weights_problem
from flexformers.training_scripts.data import SPLITS, escape_line, load_corpus
from flexformers.training_scripts.metrics_utils import compute_generation_metrics, copy_baseline_metrics, gain_over_copy
from flexformers.training_scripts.model_registry import available_model_types, get_method_spec
from flexformers.training_scripts.permutation_decoding import (
    SourceWordPermutation,
    uses_permutation_of_source,
)
from flexformers.training_scripts.tokenizer import load_tokenizers

logger = logging.getLogger("flexformers.decode")
EVAL_RESULTS_FILE = "eval_results.json"


@dataclass
class DecodeArguments:
    model_name_or_path: str = field(metadata={"help": "Directory of a trained model (output_dir or a checkpoint-N)."})
    split: str = field(default="test", metadata={"help": "Split to decode and score: train, validation or test."})
    num_beams: int = field(default=5, metadata={"help": "Beam size (1 = greedy)."})
    length_penalty: float = field(default=1.0, metadata={"help": "Length penalty (fairseq --lenpen)."})
    max_new_tokens: int | None = field(
        default=None, metadata={"help": "Longest output in tokens (default: the training --max_target_length)."}
    )
    batch_size: int = field(default=32, metadata={"help": "Sentences per generate() call."})
    max_samples: int | None = field(default=None, metadata={"help": "Decode only the first N examples of the split."})
    text: list[str] | None = field(
        default=None, metadata={"help": "Translate these texts instead of a split: --text \"first\" \"second\" ..."}
    )
    stdin: bool = field(default=False, metadata={"help": "Translate lines read from standard input (no metrics)."})
    output_file: str | None = field(
        default=None, metadata={"help": "Hypotheses file, one per line, newlines escaped as \\n (default: in the model "
                                        "dir); the sources, references and hypotheses go to the .jsonl beside it."}
    )
    overwrite_output: bool = field(
        default=False,
        metadata={"help": "Replace an existing --output_file (and the .jsonl beside it); never a data file."},
    )
    num_samples_to_print: int = field(default=3, metadata={"help": "Show this many hypotheses next to references."})
    bf16: bool = field(default=False, metadata={"help": "Cast the weights to bfloat16 (faster on CPUs with AMX)."})
    allow_missing_weights: bool = field(
        default=False,
        metadata={"help": "Decode even when weights are missing from the checkpoint (left randomly initialised) or "
                          "unused by the model; by default such a checkpoint is refused."},
    )
    device: str | None = field(default=None, metadata={"help": "cpu, cuda, cuda:1 ... (default: cuda if available)."})
    within_training_lengths: bool = field(
        default=False,
        metadata={"help": "Score only pairs that fit the training --max_source_length/--max_target_length (in tokens)."},
    )
    write_eval_results: bool = field(default=True, metadata={"help": f"Write {EVAL_RESULTS_FILE} into the model dir."})
    seed: int = field(default=0, metadata={"help": "Seed (for models that sample during decoding)."})
    permutation_of_source: bool | None = field(
        default=None,
        metadata={"help": "Constrain each output to a permutation of its source's words (word-order recovery: the "
                          "task's definition of an answer). Default: on for --task word_order with a left-to-right "
                          "model, off otherwise."},
    )

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"--split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        for name in ("num_beams", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            # 0 used to fall back silently to the training length
            raise ValueError(f"--max_new_tokens must be at least 1, got {self.max_new_tokens} (leave it out for the "
                             "training --max_target_length)")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"--length_penalty must be a finite number, got {self.length_penalty}")
        for index, text in enumerate(self.text or [], start=1):
            if not text.strip():
                raise ValueError(f"--text: input {index} is empty; give the texts to decode")


def resolve_device(requested: str | None) -> str:
    """The device a command decodes on: the one asked for, else the GPU when there is one."""
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", bf16: bool = False,
               allow_missing_weights: bool = False,
               allow_hint: str = "pass --allow_missing_weights to decode with them anyway"):
    """(model, source tokenizer, target tokenizer) from a directory written by ``flexformers-train``.
    ``allow_hint`` ends the refusal of missing weights: how the calling tool loads them anyway (empty for a tool
    without that option).

    A damaged directory -- ``config.json`` that is not JSON or names no model type, truncated or zero-filled
    weights, weights missing from (or foreign to) the model unless ``allow_missing_weights``, a separate-vocabulary
    model without its source tokenizer, an unreadable tokenizer -- is a ``ValueError`` naming the file, not a
    library traceback nor a silently random weight."""
    from flexformers.training_scripts.model_loading import WeightsNotLoadedError, load_pretrained_checked

    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir} has no config.json; pass a directory written by flexformers-train")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_path} cannot be read ({error})") from error
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{config_path} is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}); "
            "the checkpoint is damaged"
        ) from error
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ValueError(f"{config_path} names no model_type; it was not written by flexformers-train")
    model_type = config["model_type"]
    if model_type not in available_model_types():
        raise ValueError(
            f"{config_path}: model_type {model_type!r} is not a flexformers model type "
            f"({', '.join(available_model_types())})"
        )
    problem = weights_problem(model_dir)
    if problem is not None:
        raise ValueError(f"{problem}; the checkpoint cannot be loaded")
    spec = get_method_spec(model_type)
    try:
        model = load_pretrained_checked(spec.model_class, model_dir, allow_missing_weights=allow_missing_weights,
                                        allow_hint=allow_hint)
    except WeightsNotLoadedError:
        raise
    except (OSError, RuntimeError, ValueError, TypeError) as error:
        raise ValueError(f"{model_dir}: the model cannot be loaded ({type(error).__name__}: {error})") from error
    model.to(device)
    if bf16:
        model.to(torch.bfloat16)
    model.eval()
    try:
        source_tokenizer, target_tokenizer = load_tokenizers(model_dir)
    except (OSError, RuntimeError, ValueError) as error:
        if isinstance(error, ValueError) and str(model_dir) in str(error):
            raise
        raise ValueError(f"{model_dir}: the tokenizer cannot be loaded ({error})") from error
    return model, source_tokenizer, target_tokenizer


def load_method_model(model_dir: str | Path, model_class: type, tool: str, method: str,
                      device: str | torch.device = "cpu", bf16: bool = False):
    """:func:`load_model` for a method's own tool (``flexformers-iot-orders`` ...): a checkpoint whose model is not
    a ``model_class`` is a one-line ``ValueError`` ("flexformers-iot-orders needs an IOT model; runs/x holds a
    'mat' model"), not a traceback from deep inside the tool. ``method`` names the model for people ("an IOT")."""
    model, source_tokenizer, target_tokenizer = load_model(model_dir, device, bf16, allow_hint="")
    if not isinstance(model, model_class):
        raise ValueError(f"{tool} needs {method} model; {model_dir} holds a {model.config.model_type!r} model")
    return model, source_tokenizer, target_tokenizer


def run_tool(tool: str, command, argv: list[str] | None = None) -> int:
    """A console entry point (decode's, the quickstart's, each method tool's): ``command(argv)``, then 0; bad input (another type's model, an invalid
    option, a damaged checkpoint) prints one line ``<tool>: error: ...`` on stderr, without a traceback, and
    returns 1."""
    try:
        command(argv)
    except ValueError as error:
        print(f"{tool}: error: {error}", file=sys.stderr)
        return 1
    return 0


def fits_training_lengths(split, source_tokenizer, target_tokenizer, data_args: DataArguments) -> list[bool]:
    """For each pair of ``split``: whether it is within ``--max_source_length`` / ``--max_target_length`` tokens, the
    pairs training keeps (:func:`training_scripts.train.tokenize_corpus` drops the others)."""
    sources = source_tokenizer(list(split["source"]))["input_ids"]
    targets = target_tokenizer(list(split["target"]))["input_ids"]
    return [len(source) <= data_args.max_source_length and len(target) <= data_args.max_target_length
            for source, target in zip(sources, targets)]


def score_hypotheses(sources: list[str], references: list[str], hypotheses: list[str], is_code: bool) -> dict:
    """BLEU / chrF / TER (and PoV for code) of ``hypotheses``, beside copying each source unchanged on the same
    pairs (what a model scores without learning anything), and the gain over that copy."""
    metric_names = ["bleu", "chrf", "ter"] + (["pov"] if is_code else [])
    scores = compute_generation_metrics(hypotheses, references, is_code=is_code)
    copy_scores = copy_baseline_metrics(sources, references, is_code=is_code)
    metrics = {name: round(scores[name], 2) for name in metric_names}
    copy = {name: round(copy_scores[name], 2) for name in metric_names}
    return {"num_examples": len(sources), "metrics": metrics, "copy_baseline": copy,
            "gain_over_copy": gain_over_copy(metrics, copy),
            **{key: scores[key] for key in ("sacrebleu_signature", "chrf_signature", "ter_signature")}}


def score_within_training_lengths(generations_file: str | Path, model_dir: str | Path) -> dict:
    """A decoding's hypotheses (the ``.jsonl`` beside ``--output_file``) scored again on the pairs within the
    training lengths of the model in ``model_dir``: what ``--within_training_lengths`` reports, without decoding
    those pairs a second time."""
    generations_file = Path(generations_file)
    rows = [json.loads(line) for line in generations_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{generations_file} holds no generations")
    data_args = DataArguments.load(model_dir)
    if data_args is None:
        raise ValueError(f"{model_dir} has no {DATA_ARGS_FILE}; pass a directory written by flexformers-train")
    source_tokenizer, target_tokenizer = load_tokenizers(Path(model_dir))
    pairs = {"source": [row["source"] for row in rows], "target": [row["reference"] for row in rows]}
    kept = [row for row, keep in zip(rows, fits_training_lengths(pairs, source_tokenizer, target_tokenizer, data_args))
            if keep]
    if not kept:
        raise ValueError(f"none of the {len(rows)} pairs in {generations_file} is within the training lengths")
    return score_hypotheses([row["source"] for row in kept], [row["reference"] for row in kept],
                            [row["hypothesis"] for row in kept], is_code=data_args.is_code)


def encode_in_length_batches(model, source_tokenizer, sources: list[str],
                             batch_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The token ids of ``sources``, cut to the model's ``max_source_positions`` (a warning names each input that
    was cut), and batches of indices into ``sources`` of similar lengths, longest first (less padding)."""
    max_source = getattr(model.config, "max_source_positions", 1024)
    encoded = source_tokenizer(sources, add_special_tokens=True)["input_ids"]
    too_long = [index for index, ids in enumerate(encoded) if len(ids) > max_source]
    for index in too_long[:3]:
        logger.warning("input %d has %d tokens; the model reads at most %d (max_source_positions): decoding its "
                       "first %d tokens only", index + 1, len(encoded[index]), max_source, max_source)
    if len(too_long) > 3:
        logger.warning("%d inputs in all were longer than %d tokens and were cut", len(too_long), max_source)
    if too_long:
        truncated = source_tokenizer([sources[i] for i in too_long], add_special_tokens=True, truncation=True,
                                     max_length=max_source)["input_ids"]
        for index, ids in zip(too_long, truncated):
            encoded[index] = ids
    order = sorted(range(len(sources)), key=lambda i: len(encoded[i]), reverse=True)
    return encoded, [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


@torch.inference_mode()
def generate_texts(
    model, source_tokenizer, target_tokenizer, sources: list[str], num_beams: int = 5, length_penalty: float = 1.0,
    max_new_tokens: int = 256, batch_size: int = 32, progress: bool = True, permutation_of_source: bool = False,
) -> tuple[list[str], dict]:
    """Hypotheses for ``sources`` (in input order) and throughput statistics of the ``generate`` calls.

    Sentences are batched by length (less padding); sources are truncated to the model's
    ``max_source_positions``, with a warning naming each input that was cut. With ``permutation_of_source``, each
    output is a permutation of its source's words (:mod:`~flexformers.training_scripts.permutation_decoding`)."""
    from tqdm.auto import tqdm

    encoded, batches = encode_in_length_batches(model, source_tokenizer, sources, batch_size)
    hypotheses: list[str | None] = [None] * len(sources)
    generated_tokens = 0
    seconds = 0.0
    device = next(model.parameters()).device
    for batch in tqdm(batches, desc="Decoding", disable=not progress):
        padded = source_tokenizer.pad({"input_ids": [encoded[i] for i in batch]}, return_tensors="pt")
        extra = {}
        if permutation_of_source:
            extra["prefix_allowed_tokens_fn"] = SourceWordPermutation(
                [sources[i] for i in batch], target_tokenizer, eos_token_id=model.config.eos_token_id)
        start = time.perf_counter()
        output = model.generate(
            input_ids=padded["input_ids"].to(device),
            attention_mask=padded["attention_mask"].to(device),
            num_beams=num_beams,
            length_penalty=length_penalty,
            max_new_tokens=max_new_tokens,
            max_length=None,  # the saved generation config's max_length (Trainer writes 20) would only warn
            early_stopping=True if num_beams > 1 else False,
            **extra,
        )
        seconds += time.perf_counter() - start
        sequences = output.sequences if hasattr(output, "sequences") else output
        special = set(target_tokenizer.all_special_ids)
        for row, index in enumerate(batch):
            ids = [t for t in sequences[row].tolist() if t not in special]
            generated_tokens += len(ids)
            hypotheses[index] = target_tokenizer.decode(ids, skip_special_tokens=True)
    stats = {
        "sentences": len(sources),
        "seconds": round(seconds, 3),
        "sentences_per_second": round(len(sources) / seconds, 2) if seconds else None,
        "tokens_per_second": round(generated_tokens / seconds, 1) if seconds else None,
        "generated_tokens": generated_tokens,
    }
    return hypotheses, stats


def read_stdin_lines(stream=None) -> tuple[list[str], list[int]]:
    """(the non-blank lines of standard input, the numbers of the lines skipped as not UTF-8).

    Bytes are decoded line by line so one bad line is reported (by number, on stderr) and the others are still
    decoded; a text stream (no ``.buffer``) is taken as already decoded."""
    stream = sys.stdin if stream is None else stream
    raw = getattr(stream, "buffer", None)
    lines, skipped = [], []
    for number, line in enumerate(raw if raw is not None else stream, start=1):
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as error:
                logger.warning("standard input, line %d: not valid UTF-8 (byte %d); skipped", number, error.start)
                skipped.append(number)
                continue
        line = line.rstrip("\r\n")
        if line.strip():
            lines.append(line)
    return lines, skipped


def _explicit_data_args(argv: list[str]) -> set[str]:
    names = {f.name for f in fields(DataArguments)}
    given = set()
    for item in argv:
        if item.startswith("--"):
            name = item[2:].split("=", 1)[0]
            if name in names:
                given.add(name)
    return given


def parse_arguments(argv: list[str] | None = None) -> tuple[DecodeArguments, DataArguments]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser([DecodeArguments, DataArguments], description=__doc__.split("\n\n")[0])
    decode_args, parsed_data_args = parser.parse_args_into_dataclasses(args=argv)
    saved = DataArguments.load(decode_args.model_name_or_path)
    if saved is None:
        return decode_args, parsed_data_args
    explicit = _explicit_data_args(argv)
    merged = {f.name: getattr(parsed_data_args if f.name in explicit else saved, f.name) for f in fields(DataArguments)}
    data_args = DataArguments(**merged)
    # a file named on this command line is the user's choice now; one taken from the run is checked against its hash
    data_args.saved_file_hashes = {name: digest for name, digest in saved.saved_file_hashes.items()
                                   if name not in explicit}
    return decode_args, data_args


def _directory_write_problem(directory: Path) -> str | None:
    """Why no file can be written into ``directory`` (or, while it does not exist, into the nearest existing folder
    above it, where it would be created), or ``None``. A file is really created (and removed at once): permission
    bits say nothing of a read-only mount, nor to root."""
    directory = directory.absolute()
    while not os.path.lexists(directory) and directory.parent != directory:
        directory = directory.parent
    if not directory.is_dir():
        return f"{directory} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        return error.strerror or str(error)
    return None


def check_output_files(decode_args: DecodeArguments, data_args: DataArguments, output_file: Path) -> None:
    """Refuse, before any decoding, to write where decode must not: over a data file of the run (never, even with
    ``--overwrite_output``), over an existing ``--output_file`` or the ``.jsonl`` beside it (without
    ``--overwrite_output``; the default ``generations.<split>.txt`` is decode's own and is replaced), into a folder
    that cannot be written (the hypotheses' or, with ``--write_eval_results``, the model's)."""
    if output_file.suffix == ".jsonl":
        raise ValueError(f"--output_file {output_file}: the hypotheses file cannot end in .jsonl (the sources, "
                         "references and hypotheses go to the .jsonl beside it); give e.g. "
                         f"{output_file.with_suffix('.txt')}")
    data_files = {os.path.realpath(getattr(data_args, name)): name
                  for name in DATA_FILE_FIELDS if getattr(data_args, name)}
    for path in (output_file, output_file.with_suffix(".jsonl")):
        if path.is_dir():
            raise ValueError(f"--output_file: {path} is a directory; give a file name")
        if os.path.realpath(path) in data_files:
            raise ValueError(f"decoding would write {path}, which is the training run's "
                             f"--{data_files[os.path.realpath(path)]}; choose another --output_file")
        if decode_args.output_file is not None and not decode_args.overwrite_output and os.path.lexists(path):
            raise ValueError(f"{path} exists and was not written by this decoding; pass --overwrite_output to replace "
                             "it, or choose another --output_file")
    model_dir = Path(decode_args.model_name_or_path)
    writes = {output_file.parent: ["the hypotheses"]}
    if decode_args.write_eval_results:
        writes.setdefault(model_dir, []).append(EVAL_RESULTS_FILE)
    for directory, what in writes.items():
        problem = _directory_write_problem(directory)
        if problem is not None:
            # every file that cannot be written needs its own way round, or following the advice fails again
            hint = " and ".join(remedy for needed, remedy in (
                ("the hypotheses" in what, "choose another --output_file"),
                (EVAL_RESULTS_FILE in what, "pass --write_eval_results false")) if needed)
            raise ValueError(f"{directory} cannot be written ({problem}): decoding writes {' and '.join(what)} there; "
                             f"{hint}")


def warn_about_changed_data_files(data_args: DataArguments) -> dict[str, str]:
    """``{field: path}`` of the run's data files whose content changed since training, logged as one warning (the
    scores are on the files as they are now). A run saved before paths were stored absolute has relative paths,
    read from the current directory: that is said too."""
    relative = [f"--{name} {getattr(data_args, name)}" for name in DATA_FILE_FIELDS
                if getattr(data_args, name) and not os.path.isabs(getattr(data_args, name))]
    if relative and not getattr(data_args, "saved_file_hashes", {}):
        logger.warning("%s holds relative paths (%s), read from the current directory %s", DATA_ARGS_FILE,
                       ", ".join(relative), os.getcwd())
    for name in getattr(data_args, "saved_file_hashes", {}):
        path = getattr(data_args, name)
        if path and not os.path.lexists(path):
            raise ValueError(f"the training run's --{name} {path} is gone; pass --train_file / --validation_file / "
                             "--test_file to score other files")
    changed = data_args.changed_data_files()
    if changed:
        logger.warning("data file(s) changed since training (SHA-256 differs from the one saved with the run): %s; "
                       "the scores are on the files as they are now",
                       ", ".join(f"--{name} {path}" for name, path in changed.items()))
    return changed


def run(decode_args: DecodeArguments, data_args: DataArguments) -> dict:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    torch.manual_seed(decode_args.seed)
    device = resolve_device(decode_args.device)
    model_dir = Path(decode_args.model_name_or_path)
    output_file = Path(decode_args.output_file or model_dir / f"generations.{decode_args.split}.txt")
    if not (decode_args.text or decode_args.stdin):
        check_output_files(decode_args, data_args, output_file)
    model, source_tokenizer, target_tokenizer = load_model(decode_args.model_name_or_path, device, decode_args.bf16,
                                                           decode_args.allow_missing_weights)
    max_new_tokens = decode_args.max_new_tokens or data_args.max_target_length
    permutation = uses_permutation_of_source(decode_args.permutation_of_source, data_args.task, model.config.model_type)
    generation = dict(num_beams=decode_args.num_beams, length_penalty=decode_args.length_penalty,
                      max_new_tokens=max_new_tokens, batch_size=decode_args.batch_size,
                      permutation_of_source=permutation)

    if decode_args.text or decode_args.stdin:
        sources = list(decode_args.text or [])
        skipped_lines = []
        if decode_args.stdin:
            lines, skipped_lines = read_stdin_lines()
            sources += lines
        if not sources:
            raise ValueError("no input text (empty --text and standard input)")
        hypotheses, stats = generate_texts(model, source_tokenizer, target_tokenizer, sources, progress=False, **generation)
        for source, hypothesis in zip(sources, hypotheses):
            print(f"SOURCE: {source}\nOUTPUT: {hypothesis}\n")
        return {"hypotheses": hypotheses, "throughput": stats, "skipped_lines": skipped_lines}

    data_files_changed = warn_about_changed_data_files(data_args)
    if (decode_args.split == "test" and data_args.task == "files" and data_args.validation_file
            and not data_args.test_file):
        logger.warning("no --test_file: the test split is --validation_file %s (which also picked the best checkpoint)",
                       data_args.validation_file)
    corpus = load_corpus(data_args)
    split = corpus[decode_args.split]
    indices = list(range(len(split)))  # each decoded pair's place in the split, written beside it
    if decode_args.within_training_lengths:
        fits = fits_training_lengths(split, source_tokenizer, target_tokenizer, data_args)
        indices = [index for index, keep in enumerate(fits) if keep]
        split = split.select(indices)
    if decode_args.max_samples is not None:
        split = split.select(range(min(decode_args.max_samples, len(split))))
        indices = indices[:len(split)]
    if len(split) == 0:
        raise ValueError(f"split {decode_args.split!r} of {describe_dataset(data_args)} is empty")
    sources, references = list(split["source"]), list(split["target"])
    hypotheses, stats = generate_texts(model, source_tokenizer, target_tokenizer, sources, **generation)
    scores = score_hypotheses(sources, references, hypotheses, is_code=data_args.is_code)

    output_file.parent.mkdir(parents=True, exist_ok=True)
    output_file.write_text("".join(escape_line(h) + "\n" for h in hypotheses), encoding="utf-8")
    with open(output_file.with_suffix(".jsonl"), "w", encoding="utf-8") as handle:
        for index, origin, source, reference, hypothesis in zip(indices, split["origin"], sources, references,
                                                                 hypotheses):
            row = {"index": index, "origin": origin, "source": source, "reference": reference, "hypothesis": hypothesis}
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")

    results = {
        "task": data_args.task,
        "dataset": describe_dataset(data_args),
        **hub_dataset_reference(data_args),  # the Hub id and config the card's model-index names
        "split": decode_args.split,
        # the run's data files whose content differs from the one it was trained with (these scores are on them now)
        "data_files_changed": data_files_changed,
        "num_examples": scores["num_examples"],
        "within_training_lengths": decode_args.within_training_lengths,
        # pairs the model never trained on (training drops them): a score on the whole split counts them too
        "beyond_training_lengths": 0 if decode_args.within_training_lengths else fits_training_lengths(
            split, source_tokenizer, target_tokenizer, data_args).count(False),
        "metrics": scores["metrics"],
        "copy_baseline": scores["copy_baseline"],
        "sacrebleu_signature": scores["sacrebleu_signature"],
        "chrf_signature": scores["chrf_signature"],
        "ter_signature": scores["ter_signature"],
        "num_beams": decode_args.num_beams,
        "length_penalty": decode_args.length_penalty,
        "max_new_tokens": max_new_tokens,
        "output_constraint": "permutation of the source words" if permutation else None,
        "throughput": dict(stats, device=str(device), dtype="bfloat16" if decode_args.bf16 else "float32",
                           batch_size=decode_args.batch_size),
    }
    results["gain_over_copy"] = scores["gain_over_copy"]
    print_report(results, sources, references, hypotheses, decode_args.num_samples_to_print, output_file)
    if decode_args.write_eval_results:
        (model_dir / EVAL_RESULTS_FILE).write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    return results


def print_report(results, sources, references, hypotheses, num_samples, output_file) -> None:
    for index in range(min(num_samples, len(sources))):
        print(f"--- sample {index + 1} " + "-" * 60)
        print(f"SOURCE:     {sources[index]}")
        print("REFERENCE:\n" + references[index])
        print("GENERATED:\n" + hypotheses[index])
    print("-" * 72)
    labels = {"bleu": "BLEU", "chrf": "chrF", "ter": "TER", "pov": "PoV"}
    metrics = "  ".join(f"{labels.get(name, name)} {value:.2f}" for name, value in results["metrics"].items())
    subset = " within the training lengths" if results.get("within_training_lengths") else ""
    if results.get("output_constraint"):
        subset += f", outputs constrained to a {results['output_constraint']}"
    print(f"{results['dataset']} [{results['split']}, {results['num_examples']} examples{subset}, beam {results['num_beams']}, "
          f"lenpen {results['length_penalty']}]: {metrics}")
    copy = "  ".join(f"{labels.get(name, name)} {value:.2f}" for name, value in results["copy_baseline"].items())
    gains = "  ".join(f"{labels.get(name, name)} {value:+.2f}" for name, value in results["gain_over_copy"].items())
    print(f"copying the input scores: {copy}")
    print(f"model over copying:       {gains}   (positive = better than copying; TER's sign flipped)")
    print(f"sacrebleu signature: {results['sacrebleu_signature']}")
    throughput = results["throughput"]
    print(f"throughput: {throughput['sentences_per_second']} sentences/s, {throughput['tokens_per_second']} tokens/s "
          f"({throughput['dtype']}, {throughput['device']}, batch {throughput['batch_size']})")
    print(f"hypotheses: {output_file}")


def run_from_argv(argv: list[str] | None = None) -> dict:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run; returns the results dict."""
    return run(*parse_arguments(argv))


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: 0 on success; bad input (a damaged checkpoint, an invalid option) prints one
    line naming the problem, without a traceback, and returns 1."""
    return run_tool("flexformers-decode", run_from_argv, argv)


if __name__ == "__main__":
    sys.exit(main())
