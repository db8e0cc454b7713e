"""Train any flexformers model type with ``Seq2SeqTrainer`` (``flexformers-train``).

    flexformers-train --model_type flexformer --preset transformer_iwslt_de_en --task translation \\
        --target_lang de --output_dir runs/gettext-de --num_train_epochs 20

Defaults follow the papers' fairseq recipe: Adam (0.9, 0.98), lr 5e-4, inverse-sqrt schedule with 4000 linear
warm-up steps (transformers' ``inverse_sqrt`` equals fairseq's with ``warmup_init_lr=0``), weight decay 1e-4,
label smoothing 0.1 inside the model, no gradient clipping, length-grouped batches; evaluation every epoch with
``predict_with_generate`` (BLEU, chrF, TER and, for code, PoV) and the best checkpoint by BLEU. Every default can
be overridden on the command line. Multi-process: ``torchrun --nproc_per_node=N -m flexformers.training_scripts.train ...`` or
``accelerate launch --config_file training_scripts/accelerate_configs/<cfg>.yaml -m flexformers.training_scripts.train ...``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import HfArgumentParser, Seq2SeqTrainingArguments, TrainerCallback, set_seed

from flexformers.configuration.configuration_flexformer import FlexformerConfig
from flexformers.training_scripts.arguments import (
    DataArguments,
    ModelArguments,
    check_config_override_names,
    describe_dataset,
    parse_config_overrides,
    train_file_change,
)
from flexformers.training_scripts.checkpoints import (
    claim_output_dir,
    claim_output_dir_for_evaluation,
    describe_write_error,
    lock_output_dir,
    resolve_resume_checkpoint,
    resumed_config_problem,
    unlock_output_dir,
    write_run_record,
)
from flexformers.training_scripts.cpu_heap import retain_freed_memory
from flexformers.training_scripts.data import load_corpus
from flexformers.training_scripts.metrics_utils import compute_generation_metrics, copy_baseline_metrics, gain_over_copy
from flexformers.training_scripts.model_registry import MethodSpec, get_method_spec
from flexformers.training_scripts.nonfinite import NonFiniteTrainingError
from flexformers.training_scripts.permutation_decoding import uses_permutation_of_source
from flexformers.training_scripts.tokenizer import (
    SOURCE_TOKENIZER_SUBDIR,
    build_tokenizers,
    load_tokenizers,
    save_tokenizers,
)
from flexformers.training_scripts.trainer import FlexformersSeq2SeqTrainer

logger = logging.getLogger("flexformers.train")

FAIRSEQ_TRAINING_DEFAULTS = dict(
    learning_rate=5e-4,
    adam_beta1=0.9,
    adam_beta2=0.98,
    adam_epsilon=1e-8,
    weight_decay=1e-4,
    lr_scheduler_type="inverse_sqrt",
    warmup_steps=4000,
    max_grad_norm=0.0,
    train_sampling_strategy="group_by_length",
    per_device_train_batch_size=32,
    per_device_eval_batch_size=32,
    predict_with_generate=True,
    generation_num_beams=1,
    # the evaluated sources reach compute_metrics, which scores copying them beside the model (same examples)
    include_for_metrics=["inputs"],
    eval_strategy="epoch",
    save_strategy="epoch",
    logging_strategy="steps",
    logging_steps=50,
    load_best_model_at_end=True,
    metric_for_best_model="bleu",
    greater_is_better=True,
    save_total_limit=3,
    output_dir="runs/flexformers",
    dataloader_pin_memory=torch.cuda.is_available(),
)


def _report_to_default() -> list[str]:
    return ["tensorboard"] if importlib.util.find_spec("tensorboard") is not None else ["none"]


def _flag_value(argv: list[str], name: str) -> str | None:
    for index, item in enumerate(argv):
        if item == f"--{name}" and index + 1 < len(argv):
            return argv[index + 1]
        if item.startswith(f"--{name}="):
            return item.split("=", 1)[1]
    return None


def _align_save_with_eval(argv: list[str]) -> list[str]:
    """Checkpoint when evaluating unless told otherwise: ``--eval_strategy steps --eval_steps 500`` alone then
    implies the same save schedule (keeping the best checkpoint needs both to match), and ``--eval_strategy no``
    turns off ``load_best_model_at_end``."""
    argv = list(argv)
    eval_strategy = _flag_value(argv, "eval_strategy")
    if eval_strategy is not None and _flag_value(argv, "save_strategy") is None:
        argv += ["--save_strategy", eval_strategy if eval_strategy != "no" else "steps"]
    eval_steps = _flag_value(argv, "eval_steps")
    if eval_steps is not None and _flag_value(argv, "save_steps") is None:
        argv += ["--save_steps", eval_steps]
    if "no" in (eval_strategy, _flag_value(argv, "save_strategy")) and _flag_value(argv, "load_best_model_at_end") is None:
        # keeping the best checkpoint needs both evaluations and checkpoints; without either there is none to keep
        argv += ["--load_best_model_at_end", "false"]
    return argv


def parse_arguments(argv: list[str] | None = None):
    """(spec, model_args, data_args, training_args, method_args). ``--model_type`` is read first so the method's
    own argument dataclass joins the parser (and its ``--help``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model_type", default=ModelArguments.model_type)
    known, _ = pre.parse_known_args(argv)
    spec = get_method_spec(known.model_type)
    classes = [ModelArguments, DataArguments, Seq2SeqTrainingArguments]
    if spec.arguments_class is not None:
        classes.append(spec.arguments_class)
    argv = _align_save_with_eval(argv)
    parser = HfArgumentParser(classes, description=__doc__.split("\n\n")[0])
    parser.set_defaults(**FAIRSEQ_TRAINING_DEFAULTS, report_to=_report_to_default())
    if len(argv) == 1 and argv[0].endswith(".json"):
        parsed = parser.parse_json_file(os.path.abspath(argv[0]))
    else:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    model_args, data_args, training_args = parsed[:3]
    method_args = parsed[3] if spec.arguments_class is not None else None
    if training_args.label_smoothing_factor:
        raise ValueError(
            "--label_smoothing_factor would make Seq2SeqTrainer discard the model's own loss; "
            "use --label_smoothing (applied inside the model) instead"
        )
    _resolve_phases(argv, model_args, training_args)
    if model_args.max_train_minutes and training_args.max_steps <= 0 and _flag_value(argv, "num_train_epochs") is None:
        # a time budget is the stopping rule: Trainer's default of 3 epochs would end a long budget early
        training_args.num_train_epochs = TIME_BUDGET_EPOCHS
    if training_args.fp16 and training_args.device.type == "cpu":
        # Accelerate's CPU autocast is bfloat16 only: --fp16 on the CPU would silently train in float32.
        raise ValueError(
            "--fp16 needs a GPU: on the CPU it would be ignored and training would run in float32. "
            "Drop it, or use --bf16 true (bfloat16 mixed precision works on the CPU)"
        )
    if training_args.fsdp and training_args.device.type == "cpu":
        # accelerate turns FSDP on only for accelerator devices: CPU processes would silently run DDP.
        raise ValueError(
            "--fsdp needs GPUs: on the CPU accelerate runs the processes with DDP instead, each holding the whole "
            "model. Drop --fsdp (torchrun --nproc_per_node=N ... --use_cpu true trains with DDP over gloo)"
        )
    return spec, model_args, data_args, training_args, method_args


PHASE_FLAGS = ("do_train", "do_eval", "do_predict")
#: The epoch limit under ``--max_train_minutes`` without ``--num_train_epochs``/``--max_steps``: never reached.
TIME_BUDGET_EPOCHS = 1_000_000


def _given_flags(argv: list[str]) -> set[str]:
    """The ``--do_*`` flags named on the command line (or as keys of a single JSON arguments file)."""
    if len(argv) == 1 and argv[0].endswith(".json"):
        try:
            return set(json.loads(Path(argv[0]).read_text())) & set(PHASE_FLAGS)
        except (OSError, ValueError, TypeError):
            return set()
    return {flag for flag in PHASE_FLAGS for item in argv if item == f"--{flag}" or item.startswith(f"--{flag}=")}


def _resolve_phases(argv: list[str], model_args: ModelArguments, training_args) -> None:
    """A training script trains: with no ``--do_*`` flag at all, train and then evaluate on the validation split.
    Explicit flags are kept as given; a combination that would train nothing and evaluate only an untrained model,
    or do nothing at all, is refused (it used to build the corpus, save no model and exit 0)."""
    if not _given_flags(argv):
        training_args.do_train = True
        training_args.do_eval = True
        return
    if training_args.do_train:
        return
    if not (training_args.do_eval or training_args.do_predict):
        raise ValueError(
            "nothing to do: --do_train, --do_eval and --do_predict are all off. Leave out every --do_* flag to "
            "train and then evaluate, or pass --do_train"
        )
    if not model_args.model_name_or_path:
        asked = " and ".join(f"--{flag}" for flag in ("do_eval", "do_predict") if getattr(training_args, flag))
        raise ValueError(
            f"{asked} without --do_train would only score an untrained, randomly initialised model: pass "
            "--do_train, or --model_name_or_path DIR to evaluate a trained model (or use flexformers-decode)"
        )


# --------------------------------------------------------------------------------------------------------------
# Building blocks (also used by tests and the quickstart)
# --------------------------------------------------------------------------------------------------------------
def resolve_tokenizers(model_args: ModelArguments, corpus, output_dir: str | None, resume_checkpoint: str | None):
    """Reuse a saved tokenizer (explicit path, the checkpoint being resumed, the output dir, or the initial model)
    or train a BPE on the training split."""
    for candidate in (model_args.tokenizer_name_or_path, resume_checkpoint, output_dir, model_args.model_name_or_path):
        if candidate and (Path(candidate) / "tokenizer.json").is_file():
            logger.info("Using the tokenizer saved in %s", candidate)
            return load_tokenizers(candidate)
    if model_args.tokenizer_name_or_path:
        raise ValueError(f"--tokenizer_name_or_path {model_args.tokenizer_name_or_path} has no tokenizer.json")
    logger.info("Training a byte-level BPE (%s, %d) on %d training pairs",
                "joint" if model_args.joint_vocab else "separate", model_args.vocab_size, len(corpus["train"]))
    return build_tokenizers(
        corpus["train"]["source"],
        corpus["train"]["target"],
        joint=model_args.joint_vocab,
        vocab_size=model_args.vocab_size,
        target_vocab_size=model_args.target_vocab_size,
        min_frequency=model_args.bpe_min_frequency,
    )


DEFAULT_PRESET = "transformer_codegen_small"


def checkpoint_config(spec: MethodSpec, checkpoint: str, overrides: dict):
    """The config saved with ``--model_name_or_path`` (its architecture), with ``overrides`` applied and validated.

    The checkpoint must hold a model of ``--model_type`` (or a plain ``flexformer`` Transformer, whose fields every
    method config extends); its vocabulary must be the tokenizer's."""
    config_file = Path(checkpoint) / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"--model_name_or_path {checkpoint} has no config.json: give a directory written by flexformers-train "
            "or save_pretrained"
        )
    try:
        saved = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_file} is not valid JSON ({error})") from error
    expected = spec.config_class.model_type
    if saved.get("model_type") not in (expected, FlexformerConfig.model_type):
        raise ValueError(
            f"--model_name_or_path {checkpoint} holds a {saved.get('model_type')!r} model, but --model_type is "
            f"{expected!r}"
        )
    for field in ("vocab_size", "target_vocab_size"):
        wanted = overrides.pop(field, None)
        held = saved.get(field)
        if wanted is not None and held is not None and held != wanted:
            raise ValueError(
                f"--model_name_or_path {checkpoint} has {field}={held} but the tokenizer has {wanted} tokens; "
                "train with the checkpoint's own tokenizer (it is picked up from the checkpoint directory unless "
                "--tokenizer_name_or_path names another)"
            )
    overrides.pop("share_all_embeddings", None)  # the checkpoint's own embedding layout
    config = spec.config_class.from_pretrained(checkpoint, **overrides)
    config.validate_fields()
    return config


def build_config(spec: MethodSpec, model_args: ModelArguments, source_tokenizer, target_tokenizer, method_args=None):
    """``spec.config_class.from_preset(preset, **overrides)`` with the tokenizer's vocabulary and special ids; with
    ``--model_name_or_path`` and no ``--preset``, the checkpoint's own config with the same overrides."""
    overrides = parse_config_overrides(model_args.config_overrides)
    check_config_override_names(spec.config_class, overrides)
    overrides.setdefault("label_smoothing", model_args.label_smoothing)
    overrides["vocab_size"] = len(source_tokenizer)
    if source_tokenizer is not target_tokenizer:
        overrides["target_vocab_size"] = len(target_tokenizer)
        overrides["share_all_embeddings"] = False
    else:
        overrides.pop("target_vocab_size", None)
    overrides.update(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    if hasattr(spec.config_class, "unk_token_id") or "unk_token_id" in getattr(spec.config_class, "__dataclass_fields__", {}):
        overrides["unk_token_id"] = 3
    if model_args.model_name_or_path and model_args.preset is None:
        config = checkpoint_config(spec, model_args.model_name_or_path, overrides)
    else:
        config = spec.config_class.from_preset(model_args.preset or DEFAULT_PRESET, **overrides)
    return spec.make_config(config, method_args)


def tokenize_corpus(corpus, source_tokenizer, target_tokenizer, data_args: DataArguments, filter_long: bool = True):
    """input_ids / attention_mask / labels / length for every split. Training and validation pairs longer than the
    caps (``--max_source_length`` / ``--max_target_length`` tokens) are dropped; test pairs never are (one prediction
    per test pair, in the test file's order): over-long ones are cut to the caps, with a warning saying how many
    (``--do_predict`` scores the hypotheses against the whole references)."""

    def encode(batch, cut=False):
        source_cut = dict(truncation=True, max_length=data_args.max_source_length) if cut else {}
        target_cut = dict(truncation=True, max_length=data_args.max_target_length) if cut else {}
        sources = source_tokenizer(batch["source"], add_special_tokens=True, **source_cut)["input_ids"]
        targets = target_tokenizer(batch["target"], add_special_tokens=True, **target_cut)["input_ids"]
        return {
            "input_ids": sources,
            "attention_mask": [[1] * len(ids) for ids in sources],
            "labels": targets,
            "length": [len(ids) for ids in sources],
        }

    columns = corpus["train"].column_names
    tokenized = corpus.map(
        encode, batched=True, remove_columns=columns, num_proc=data_args.preprocessing_num_workers,
        desc="Tokenizing",
    )
    if filter_long:
        test = tokenized["test"]
        tokenized = type(tokenized)({split: ds for split, ds in tokenized.items() if split != "test"})
        before = {split: len(ds) for split, ds in tokenized.items()}
        tokenized = tokenized.filter(
            lambda row: len(row["input_ids"]) <= data_args.max_source_length
            and len(row["labels"]) <= data_args.max_target_length,
            num_proc=data_args.preprocessing_num_workers,
            desc="Dropping over-long pairs",
        )
        dropped = {split: before[split] - len(ds) for split, ds in tokenized.items()}
        if any(dropped.values()):
            logger.info("Dropped pairs over %d source / %d target tokens: %s",
                        data_args.max_source_length, data_args.max_target_length, dropped)
        long_sources = sum(len(ids) > data_args.max_source_length for ids in test["input_ids"])
        long_references = sum(len(ids) > data_args.max_target_length for ids in test["labels"])
        if long_sources:
            logger.warning("%d of the %d test sources are longer than --max_source_length %d tokens: the model reads "
                           "their first %d tokens (test pairs are kept, one prediction each)", long_sources,
                           len(test), data_args.max_source_length, data_args.max_source_length)
        if long_references:
            logger.warning("%d of the %d test references are longer than --max_target_length %d tokens: they are "
                           "scored whole; the test loss sees their first %d tokens", long_references, len(test),
                           data_args.max_target_length, data_args.max_target_length)
        if long_sources or long_references:
            test = corpus["test"].map(encode, batched=True, fn_kwargs={"cut": True}, remove_columns=columns,
                                      num_proc=data_args.preprocessing_num_workers, desc="Cutting long test pairs")
        tokenized["test"] = test
    return tokenized


def _padded(rows: list[list[int]], padding: int = -100) -> np.ndarray:
    """Rows of token ids as one array, padded on the right with ``padding`` (as the Trainer pads labels)."""
    width = max((len(row) for row in rows), default=0)
    return np.array([list(row) + [padding] * (width - len(row)) for row in rows], dtype=np.int64)


def _limit(dataset, count):
    return dataset if count is None or count >= len(dataset) else dataset.select(range(count))


def make_compute_metrics(target_tokenizer, is_code: bool, source_tokenizer=None):
    """``compute_metrics`` for ``predict_with_generate``: BLEU/chrF/TER (+PoV) on detokenised texts and, when the
    sources are passed (``include_for_metrics=["inputs"]``, the default here), the same metrics for copying each
    source unchanged (``copy_bleu``, …) and the model's gain over it (``bleu_over_copy``, …) on the same examples."""
    pad_id = target_tokenizer.pad_token_id
    source_tokenizer = source_tokenizer or target_tokenizer

    def compute_metrics(eval_prediction):
        predictions, labels = eval_prediction.predictions, eval_prediction.label_ids
        if isinstance(predictions, tuple):
            predictions = predictions[0]
        predictions = np.where(predictions < 0, pad_id, predictions)
        labels = np.where(labels < 0, pad_id, labels)
        hypotheses = target_tokenizer.batch_decode(predictions, skip_special_tokens=True)
        references = target_tokenizer.batch_decode(labels, skip_special_tokens=True)
        scores = compute_generation_metrics(hypotheses, references, is_code=is_code)
        logger.info("sacrebleu signature: %s", scores["sacrebleu_signature"])
        result = {k: round(v, 4) for k, v in scores.items() if isinstance(v, float)}
        result["gen_len"] = float(np.mean([np.count_nonzero(row != pad_id) for row in predictions]))
        if eval_prediction.inputs is not None:
            inputs = np.where(eval_prediction.inputs < 0, source_tokenizer.pad_token_id, eval_prediction.inputs)
            sources = source_tokenizer.batch_decode(inputs, skip_special_tokens=True)
            copy = {k: round(v, 4) for k, v in copy_baseline_metrics(sources, references, is_code).items()
                    if isinstance(v, float)}
            result.update({f"copy_{name}": value for name, value in copy.items()})
            result.update({f"{name}_over_copy": value for name, value in gain_over_copy(result, copy).items()})
        return result

    return compute_metrics


class CheckpointReportCallback(TrainerCallback):
    """Calls ``report(updates)`` on the main process after each checkpoint is saved, so that a caller's own
    bookkeeping (the zoo's progress file) holds what the checkpoints hold even when the process dies between two of
    them (a session ends mid-run)."""

    def __init__(self, report):
        self.report = report

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.report(state.global_step)


class MaxTimeCallback(TrainerCallback):
    """Stop (and save) once ``max_minutes`` of training wall time have passed — or at ``deadline`` (a
    ``time.monotonic()`` value), for a caller whose budget also counts what ran before training; all ranks stop at
    the same step."""

    def __init__(self, max_minutes: float | None = None, deadline: float | None = None):
        if (max_minutes is None) == (deadline is None):
            raise ValueError("MaxTimeCallback needs exactly one of max_minutes and deadline")
        self.max_seconds = None if max_minutes is None else 60.0 * max_minutes
        self.deadline = deadline
        self.start = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.monotonic()
        if self.deadline is not None:
            self.max_seconds = max(self.deadline - self.start, 0.0)

    def on_step_end(self, args, state, control, **kwargs):
        expired = torch.tensor([float(time.monotonic() - self.start >= self.max_seconds)])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Ranks see slightly different clocks; one stopping alone would hang the others' all-reduce.
            torch.distributed.all_reduce(expired, op=torch.distributed.ReduceOp.MAX)
        if expired.item() > 0:
            logger.info("Reached --max_train_minutes at step %d; stopping", state.global_step)
            control.should_training_stop = True
            control.should_save = True
        return control


class TimeBudgetProgressCallback(TrainerCallback):
    """With ``--max_train_minutes``: a progress bar over the time budget (not over a step count that will never be
    reached), showing the update count and the latest training loss."""

    def __init__(self, max_minutes: float):
        self.max_seconds = 60.0 * max_minutes
        self.bar = None
        self.start = None
        self.last_loss = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.start = time.monotonic()
            self.bar = tqdm(total=round(self.max_seconds), unit="s", desc="training",
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s{postfix}")

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.n = min(round(time.monotonic() - self.start), self.bar.total)
            postfix = f"update {state.global_step}" + (f", loss {self.last_loss:.3f}" if self.last_loss is not None else "")
            self.bar.set_postfix_str(postfix, refresh=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.last_loss = float(logs["loss"])

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class SidecarFiles:
    """Make every checkpoint directory self-contained for ``flexformers-decode``: the data arguments (task,
    corpus) and, with separate vocabularies, the source tokenizer. Called with the checkpoint's staging directory
    (:class:`~flexformers.training_scripts.checkpoints.AtomicCheckpointMixin`), so they are there when it
    appears."""

    def __init__(self, data_args: DataArguments, source_tokenizer=None):
        self.data_args = data_args
        self.source_tokenizer = source_tokenizer

    def __call__(self, checkpoint: str) -> None:
        self.data_args.save(checkpoint)
        if self.source_tokenizer is not None:
            self.source_tokenizer.save_pretrained(str(Path(checkpoint) / SOURCE_TOKENIZER_SUBDIR))


def find_resume_checkpoint(training_args) -> str | None:
    """``--resume_from_checkpoint PATH`` (checked to be complete) or ``--resume_from_checkpoint latest`` (the newest
    complete checkpoint in output_dir; incomplete ones, e.g. from a crash mid-save, are passed over and logged)."""
    return resolve_resume_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)


def start_run_in_output_dir(model_args: ModelArguments, training_args) -> tuple[str | None, str | None]:
    """(this run's id, the checkpoint to resume) -- (``None``, ...) when not training.

    The first process locks ``--output_dir`` for the run's duration (a second training into it is refused; a folder
    that cannot be written is named here, before any work); a training run then claims the folder
    (:func:`~flexformers.training_scripts.checkpoints.claim_output_dir`: another run's files there need
    ``--resume_from_checkpoint latest`` or ``--overwrite_output_dir``)."""
    if training_args.process_index == 0:
        lock_output_dir(training_args.output_dir)
    try:
        if not training_args.do_train:
            if training_args.should_save:
                claim_output_dir_for_evaluation(training_args.output_dir, model_args.model_name_or_path,
                                                model_args.overwrite_output_dir)
            return None, find_resume_checkpoint(training_args)
        with training_args.main_process_first(desc="claiming the output folder"):
            return claim_output_dir(
                training_args.output_dir, training_args.resume_from_checkpoint,
                overwrite=model_args.overwrite_output_dir, is_main=training_args.should_save,
                save_only_model=training_args.save_only_model,
            )
    except BaseException:
        unlock_output_dir(training_args.output_dir)
        raise


def check_config_fits_run(config, data_args: DataArguments, training_args, resume_checkpoint: str | None,
                          decoder_tokens_beyond_target: int = 0) -> None:
    """Refuse (``ValueError``) a model whose position tables are shorter than the lengths it is trained and
    evaluated on, or a resume whose checkpoint holds another model type or architecture than ``config``.
    ``decoder_tokens_beyond_target``: the method's :class:`MethodSpec` field of that name (the decoder reads that
    many more tokens than the tokenized target holds)."""
    decoder_length = data_args.max_target_length + decoder_tokens_beyond_target
    target_length = max(decoder_length, training_args.generation_max_length or 0)
    for side, length, flag in (("source", data_args.max_source_length, "--max_source_length"),
                               ("target", target_length, "--max_target_length")):
        positions = getattr(config, f"max_{side}_positions", None)
        uses_positions = getattr(config, f"{'encoder' if side == 'source' else 'decoder'}_use_positions", True)
        if positions is not None and uses_positions and length > positions:
            named = f"{flag} {length}"
            if side == "target" and decoder_tokens_beyond_target and length == decoder_length:
                named = (f"{flag} {data_args.max_target_length} plus the {decoder_tokens_beyond_target} decoder "
                         f"token(s) the method adds ({length})")
            raise ValueError(
                f"{named} exceeds the model's max_{side}_positions {positions}: longer sequences would run "
                f"past its position table; lower {flag} or raise max_{side}_positions with --config_overrides"
            )
    if resume_checkpoint is not None:
        problem = resumed_config_problem(resume_checkpoint, config)
        if problem is not None:
            raise ValueError(problem)


def method_trainer_class(spec: MethodSpec) -> type:
    """The method's trainer: its own ``trainer_class`` (a :class:`FlexformersSeq2SeqTrainer` subclass, refused by
    name otherwise: the run's checkpoints, saves and loss checks live there) or :class:`FlexformersSeq2SeqTrainer`."""
    if spec.trainer_class is None:
        return FlexformersSeq2SeqTrainer
    if not (isinstance(spec.trainer_class, type) and issubclass(spec.trainer_class, FlexformersSeq2SeqTrainer)):
        raise ValueError(f"the {spec.model_type} method's trainer_class {spec.trainer_class!r} must subclass "
                         "flexformers.training_scripts.trainer.FlexformersSeq2SeqTrainer")
    return spec.trainer_class


# --------------------------------------------------------------------------------------------------------------
def run(spec, model_args, data_args, training_args, method_args, extra_callbacks: list | None = None) -> dict:
    """Train / evaluate / predict as requested; returns the metrics of each phase. ``extra_callbacks`` are
    added to the method's callbacks (for programmatic use)."""
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO if training_args.should_log else logging.WARNING
    )
    transformers.utils.logging.set_verbosity_warning()
    trainer_class = method_trainer_class(spec)  # refused before any work when it is not the project's trainer
    set_seed(training_args.seed)
    if model_args.retain_cpu_memory and training_args.do_train and training_args.device.type == "cpu":
        retain_freed_memory()
    if training_args.generation_max_length is None:
        training_args.generation_max_length = data_args.max_target_length
    run_id, resume_checkpoint = start_run_in_output_dir(model_args, training_args)
    if resume_checkpoint is not None:
        data_change = train_file_change(DataArguments.load(resume_checkpoint), data_args)
        if data_change is not None:
            logger.warning(data_change)

    with training_args.main_process_first(desc="building the corpus"):
        corpus = load_corpus(data_args)
    logger.info("Corpus %s: %s", describe_dataset(data_args), {k: len(v) for k, v in corpus.items()})

    with training_args.main_process_first(desc="tokenizer"):
        # The main process never takes output_dir's tokenizer (another run's, trained on other data: a resumed run
        # takes its checkpoint's); the others load the one it has just saved there for this run.
        source_tokenizer, target_tokenizer = resolve_tokenizers(
            model_args, corpus, None if training_args.should_save else training_args.output_dir, resume_checkpoint)
        if training_args.should_save:
            save_tokenizers(training_args.output_dir, source_tokenizer, target_tokenizer)
            data_args.save(training_args.output_dir)
    logger.info("Vocabulary: %d source / %d target tokens", len(source_tokenizer), len(target_tokenizer))

    config = build_config(spec, model_args, source_tokenizer, target_tokenizer, method_args)
    check_config_fits_run(config, data_args, training_args, resume_checkpoint, spec.decoder_tokens_beyond_target)
    model = spec.make_model(model_args, method_args, config, target_tokenizer)
    logger.info("%s with %s parameters", type(model).__name__, f"{sum(p.numel() for p in model.parameters()):,}")

    with training_args.main_process_first(desc="tokenizing"):
        tokenized = tokenize_corpus(corpus, source_tokenizer, target_tokenizer, data_args)
    if training_args.do_train and len(tokenized["train"]) == 0:
        raise ValueError(
            f"No training pairs left: all {len(corpus['train'])} are longer than --max_source_length "
            f"{data_args.max_source_length} / --max_target_length {data_args.max_target_length} tokens"
        )
    train_dataset = _limit(tokenized["train"], data_args.max_train_samples)
    eval_dataset = _limit(tokenized["validation"], data_args.max_eval_samples)
    test_dataset = _limit(tokenized["test"], data_args.max_predict_samples)

    callbacks = spec.make_callbacks(method_args) + list(extra_callbacks or [])
    if model_args.max_train_minutes and not any(isinstance(callback, MaxTimeCallback) for callback in callbacks):
        # a caller's own deadline (the quickstart's, which counts the corpus and tokenizer too) takes precedence
        callbacks.append(MaxTimeCallback(model_args.max_train_minutes))
    if model_args.max_train_minutes and not training_args.disable_tqdm:
        callbacks.append(TimeBudgetProgressCallback(model_args.max_train_minutes))
    permutation = uses_permutation_of_source(model_args.permutation_of_source, data_args.task, config.model_type)
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if (training_args.do_eval or training_args.eval_strategy != "no") else None,
        processing_class=target_tokenizer,
        data_collator=spec.make_data_collator(source_tokenizer, model, method_args),
        compute_metrics=(
            make_compute_metrics(target_tokenizer, data_args.is_code, source_tokenizer)
            if training_args.predict_with_generate else None
        ),
        callbacks=callbacks,
        permutation_source_tokenizer=source_tokenizer if permutation else None,
    )

    trainer.checkpoint_file_writers = [
        SidecarFiles(data_args, source_tokenizer if source_tokenizer is not target_tokenizer else None)
    ]
    if run_id:
        trainer.run_id = run_id
        trainer.checkpoint_file_writers.append(
            functools.partial(write_run_record, run_id=run_id, save_only_model=training_args.save_only_model))
    if model_args.max_train_minutes and not training_args.disable_tqdm:
        from transformers.trainer_callback import ProgressCallback

        trainer.remove_callback(ProgressCallback)  # a step-count bar towards an unreachable max_steps misleads
    results: dict = {}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=resume_checkpoint)
        trainer.save_model()
        if trainer.is_world_process_zero():
            save_tokenizers(training_args.output_dir, source_tokenizer, target_tokenizer)
            data_args.save(training_args.output_dir)
        metrics = dict(train_result.metrics, train_samples=len(train_dataset))
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results["train"] = metrics
    if training_args.do_eval:
        metrics = trainer.evaluate(metric_key_prefix="eval")
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        # "validation_results.json", not Trainer's default "eval_results.json": that name is flexformers-decode's
        # test-set report (read by flexformers-export), which a later --do_eval run would otherwise overwrite.
        trainer.save_metrics("validation", metrics)
        if training_args.do_train:
            trainer.save_state()  # the final model's validation scores belong in the saved history (learning curves)
        results["eval"] = metrics
    if training_args.do_predict:
        # The labels of over-long test pairs are cut (tokenize_corpus): score against the whole references instead.
        compute_metrics, trainer.compute_metrics = trainer.compute_metrics, None
        try:
            prediction = trainer.predict(test_dataset, metric_key_prefix="test")
        finally:
            trainer.compute_metrics = compute_metrics
        test_pairs = corpus["test"].select(range(len(test_dataset)))
        metrics = dict(prediction.metrics, test_samples=len(test_dataset))
        if compute_metrics is not None:
            inputs = "inputs" in (training_args.include_for_metrics or [])
            scores = compute_metrics(transformers.EvalPrediction(
                predictions=prediction.predictions,
                label_ids=_padded(target_tokenizer(list(test_pairs["target"]), add_special_tokens=True)["input_ids"]),
                inputs=_padded(test_dataset["input_ids"]) if inputs else None,
            ))
            metrics.update({f"test_{name}": value for name, value in scores.items()})
        trainer.log_metrics("test", metrics)
        trainer.save_metrics("test", metrics)
        results["test"] = metrics
        if trainer.is_world_process_zero() and training_args.predict_with_generate:
            ids = np.where(prediction.predictions < 0, target_tokenizer.pad_token_id, prediction.predictions)
            texts = target_tokenizer.batch_decode(ids, skip_special_tokens=True)
            path = Path(training_args.output_dir) / "test_generations.jsonl"
            with open(path, "w", encoding="utf-8") as handle:
                # one line per test pair, in the test split's order: index and origin (file:line) line them up
                for index, (pair, text) in enumerate(zip(test_pairs, texts)):
                    row = {"index": index, "origin": pair["origin"], "source": pair["source"],
                           "reference": pair["target"], "hypothesis": text}
                    handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    unlock_output_dir(training_args.output_dir)
    return results


def run_from_argv(argv: list[str] | None = None) -> dict:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run; returns the results dict."""
    return run(*parse_arguments(argv))


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: 0 on success; bad input or a diverged run prints one line naming the problem
    (no traceback) and returns 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        run_from_argv(argv)
    except (ValueError, NonFiniteTrainingError) as error:
        print(f"flexformers-train: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        # disk full, read-only or forbidden while writing: one line; any other OSError keeps its traceback
        output_dir = _flag_value(argv, "output_dir") or FAIRSEQ_TRAINING_DEFAULTS["output_dir"]
        message = describe_write_error(error, output_dir)
        if message is None:
            raise
        print(f"flexformers-train: error: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
