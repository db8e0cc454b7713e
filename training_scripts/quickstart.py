"""The README main job (``flexformers-quickstart``): train a small model on real data the machine has, evaluate it
beside the trivial baseline of copying the input, show samples and the learning curve.

On a fresh machine with no internet and no GPU, within ``--minutes`` of wall time in all (corpus, tokenizer,
training, evaluation and saving), this

1. builds the task's corpus (default: word-order recovery on the English UI strings of the machine's gettext
   catalogs, the InDIGO paper's task),
2. trains a BPE and a small model (``--model_type``: the baseline or any method) for what is left of the budget,
   evaluating a fixed validation subset every few hundred updates for the learning curve,
3. decodes the test set and prints BLEU / chrF / TER next to the scores of copying the input unchanged, with
   three samples (the first three test examples: the split's order is fixed by a hash of each example, so they are
   the same in every run and not picked by score),
4. saves ``learning_curve.png`` (training loss and validation BLEU per update, the copy baseline as a line) and a
   checkpoint (model, tokenizer, eval_results.json) that ``flexformers-decode`` and ``from_pretrained`` load.

``--smoke`` runs the same pipeline for a few steps (the test suite uses it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

from flexformers.training_scripts.model_registry import available_model_types


class ModelSize(NamedTuple):
    """A model size: the configuration preset, the overrides on top of it, and how the quickstart names it."""

    preset: str
    overrides: str
    description: str


# "tiny" (default): d=128, 2+2 blocks — about 8x fewer FLOPs per token than "paper" (transformer_codegen_small:
# d=256, 3+3 blocks, FFN 1024), so minutes on 2 CPU cores are many epochs. "iwslt": the papers' IWSLT models
# (transformer_iwslt_de_en: d=512, 6+6 blocks, FFN 1024), for a GPU.
MODEL_SIZES = {
    "tiny": ModelSize(
        "transformer_codegen_small",
        "encoder_embed_dim=128,decoder_embed_dim=128,encoder_ffn_embed_dim=512,decoder_ffn_embed_dim=512,"
        "encoder_layers=2,decoder_layers=2,encoder_attention_heads=4,decoder_attention_heads=4",
        "small (d=128, 2+2 blocks)"),
    "paper": ModelSize("transformer_codegen_small", "", "transformer_codegen_small (d=256, 3+3 blocks)"),
    "iwslt": ModelSize("transformer_iwslt_de_en", "", "transformer_iwslt_de_en (d=512, 6+6 blocks)"),
}
# Pre-norm blocks and dropout 0.1 leave the unigram stage within minutes on a small corpus; fairseq's IWSLT recipe
# (post-norm, dropout 0.3, 4000 warm-up steps) needs hours for the same (measured: 0.5 BLEU after 8 minutes).
FAST_RECIPE = "encoder_normalize_before=true,decoder_normalize_before=true,dropout=0.1"

#: Per task: the corpus flags of flexformers-train, the tokenizer, lengths and optimisation of the quickstart.
TASKS = {
    "word_order": {
        "what": "word-order recovery (shuffled English UI strings of the gettext catalogs -> the original order)",
        "data": ["--task", "word_order", "--word_order_base", "gettext"],
        "vocab_size": 8000,
        "max_source_length": 48,
        "max_target_length": 48,
        "batch_size": 64,
        "learning_rate": 3e-3,
        "warmup_steps": 300,
        "try_text": "file the Could open not",
    },
    "translation": {
        "what": "English -> German UI strings of the gettext catalogs",
        "data": ["--task", "translation", "--target_lang", "de"],
        "vocab_size": 8000,
        "max_source_length": 48,
        "max_target_length": 64,
        "batch_size": 64,
        "learning_rate": 3e-3,
        "warmup_steps": 300,
        "try_text": "Could not open the file",
    },
    "codegen": {
        "what": "docstring -> Python function, parsed from the standard library",
        "data": ["--task", "codegen"],
        "vocab_size": 4000,
        "max_source_length": 64,
        "max_target_length": 128,
        "batch_size": 32,
        "learning_rate": 1e-3,
        "warmup_steps": 200,
        "try_text": "Return the number of lines in the file.",
    },
}
#: Validation examples decoded (greedy) at every curve point: the same fixed subset each time.
CURVE_EVAL_SAMPLES = 300
#: Wall time kept back from training for the final decoding and saving, per 1,000 test examples.
DECODE_RESERVE_MINUTES_PER_1000 = 0.35
#: ... and for loading, the curve and the method's figures (measured: about 25 s after the decoding itself).
FINAL_RESERVE_MINUTES = 0.7


def process_start_monotonic() -> float:
    """When this process started, on the ``time.monotonic()`` clock (Linux: from ``/proc``, so the budget counts the
    interpreter's start and the imports of torch and Transformers too); elsewhere, now."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            seconds_since_boot = float(uptime.read().split()[0])
        return time.monotonic() - max(seconds_since_boot - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return time.monotonic()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexformers-quickstart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default=None,
                        help="where the checkpoint goes (default: runs/quickstart/<task>-<model_type>)")
    parser.add_argument("--task", choices=sorted(TASKS), default="word_order", help="(default: %(default)s)")
    parser.add_argument("--model_type", choices=available_model_types(), default="flexformer",
                        help="(default: %(default)s)")
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="wall time of the whole run: corpus, training, evaluation, saving (default: %(default)s)")
    parser.add_argument("--max_steps", type=int, default=None, help="stop after this many updates instead")
    parser.add_argument("--eval_samples", type=int, default=None,
                        help="test examples to decode (default: the whole test split)")
    parser.add_argument("--num_beams", type=int, default=4, help="beam size for the test evaluation (default: %(default)s)")
    parser.add_argument("--python_source_dirs", nargs="*", default=None, help="codegen: Python trees (default: stdlib)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    parser.add_argument("--size", choices=sorted(MODEL_SIZES), default="tiny",
                        help="tiny: d=128, 2+2 layers (default); paper: transformer_codegen_small, d=256, 3+3 layers; "
                             "iwslt: transformer_iwslt_de_en's 6+6 layers, d=512 (a GPU's)")
    parser.add_argument("--seed", type=int, default=42, help="(default: %(default)s)")
    parser.add_argument("--overwrite_output_dir", action="store_true",
                        help="start afresh in an --output_dir that holds another run's files: they are moved aside "
                             "into a subfolder, not deleted (without it such a folder is refused)")
    parser.add_argument("--smoke", action="store_true", help="a few steps and a few test examples (for tests)")
    return parser


def training_argv(args, recipe: dict, train_minutes: float | None) -> list[str]:
    """The flexformers-train command line of the quickstart."""
    size = MODEL_SIZES[args.size]
    overrides = ",".join(filter(None, [size.overrides, FAST_RECIPE]))
    eval_every = 25 if args.smoke else 300
    argv = [
        "--model_type", args.model_type,
        "--preset", size.preset,
        "--config_overrides", overrides,
        "--vocab_size", str(1000 if args.smoke else recipe["vocab_size"]),
        *recipe["data"],
        "--max_source_length", str(recipe["max_source_length"]),
        "--max_target_length", str(recipe["max_target_length"]),
        "--per_device_train_batch_size", str(recipe["batch_size"]),
        "--per_device_eval_batch_size", "100",
        "--learning_rate", str(recipe["learning_rate"]),
        "--warmup_steps", str(10 if args.smoke else recipe["warmup_steps"]),
        "--output_dir", args.output_dir,
        "--do_train",
        "--eval_strategy", "steps",
        "--eval_steps", str(eval_every),
        "--max_eval_samples", str(12 if args.smoke else CURVE_EVAL_SAMPLES),
        "--save_strategy", "no",
        "--load_best_model_at_end", "false",
        "--logging_steps", "5" if args.smoke else "50",
        "--report_to", "none",
        "--disable_tqdm", "false",
        "--seed", str(args.seed),
    ]
    if args.python_source_dirs:
        argv += ["--python_source_dirs", *args.python_source_dirs]
    if args.overwrite_output_dir:
        argv += ["--overwrite_output_dir", "true"]
    if args.max_steps:
        argv += ["--max_steps", str(args.max_steps)]
    else:
        argv += ["--max_train_minutes", f"{train_minutes:.2f}"]
    return argv


def learning_curve(output_dir: str | os.PathLike, task_name: str) -> Path:
    """``learning_curve.png``: training loss and validation BLEU per update (from ``trainer_state.json``), with the
    validation subset's copy-the-input BLEU as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    state = json.loads((Path(output_dir) / "trainer_state.json").read_text())
    history = state["log_history"]
    loss = [(entry["step"], entry["loss"]) for entry in history if "loss" in entry]
    bleu = [(entry["step"], entry["eval_bleu"]) for entry in history if "eval_bleu" in entry]
    copy = [entry["eval_copy_bleu"] for entry in history if "eval_copy_bleu" in entry]
    figure, loss_axis = plt.subplots(figsize=(7.5, 4.2))
    if loss:
        loss_axis.plot(*zip(*loss), color="tab:gray", label="training loss")
    loss_axis.set_xlabel("update")
    loss_axis.set_ylabel("training loss (label-smoothed)")
    bleu_axis = loss_axis.twinx()
    if bleu:
        bleu_axis.plot(*zip(*bleu), color="tab:blue", marker="o", label=f"validation BLEU ({CURVE_EVAL_SAMPLES} ex., greedy)")
    if copy:
        bleu_axis.axhline(copy[-1], color="tab:red", linestyle="--", label=f"copying the input: BLEU {copy[-1]:.1f}")
    bleu_axis.set_ylabel("BLEU")
    bleu_axis.set_ylim(bottom=0)
    handles = loss_axis.get_legend_handles_labels()[0] + bleu_axis.get_legend_handles_labels()[0]
    labels = loss_axis.get_legend_handles_labels()[1] + bleu_axis.get_legend_handles_labels()[1]
    bleu_axis.legend(handles, labels, loc="center right", fontsize=8)
    loss_axis.set_title(task_name, fontsize=10)
    figure.tight_layout()
    path = Path(output_dir) / "learning_curve.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def method_figures(model_type: str, output_dir: str, sources: list[str], limit: int = 200) -> dict:
    """What the method does at inference on the first ``limit`` test sources (its ``MethodSpec.figures``: IOT's
    decoder-order usage, Depth-Adaptive's average exit with confidence thresholds, InDIGO's share of left-to-right
    insertions, MAT's branches); empty for a method without figures (the baseline)."""
    import torch

    from flexformers.training_scripts.decode import load_model, resolve_device
    from flexformers.training_scripts.model_registry import get_method_spec

    spec = get_method_spec(model_type)
    if spec.figures is None:
        return {}
    model, source_tokenizer, target_tokenizer = load_model(output_dir, resolve_device(None))
    batch = source_tokenizer(sources[:limit], return_tensors="pt", padding=True).to(model.device)
    # max_length=None: the saved generation config's (Trainer writes 20) would only warn beside max_new_tokens
    with torch.no_grad():
        return spec.figures(model, batch, target_tokenizer, {"max_new_tokens": 64, "max_length": None})


def run_from_argv(argv: list[str] | None = None) -> dict:
    """Run the main job; returns {"train": train metrics, "eval": eval_results, "curve": path, "figures": {...}}."""
    args = build_parser().parse_args(argv)
    started = process_start_monotonic() if argv is None else time.monotonic()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from flexformers.training_scripts import decode, train
    from flexformers.training_scripts.arguments import DataArguments
    from flexformers.training_scripts.data import load_corpus

    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = TASKS[args.task]
    args.output_dir = args.output_dir or f"runs/quickstart/{args.task}-{args.model_type}"
    if args.smoke:
        args.max_steps = args.max_steps or 20
        args.eval_samples = min(args.eval_samples or 6, 6)
        args.num_beams = min(args.num_beams, 2)

    data_args = DataArguments(**_data_fields(recipe["data"], args.python_source_dirs))
    corpus = load_corpus(data_args)
    sizes = {split: len(dataset) for split, dataset in corpus.items()}
    print(f"[1/3] corpus: {recipe['what']}: {sizes}", flush=True)

    test_size = min(args.eval_samples or sizes["test"], sizes["test"])
    reserve = FINAL_RESERVE_MINUTES + DECODE_RESERVE_MINUTES_PER_1000 * test_size / 1000 * max(1.0, args.num_beams / 4)
    train_minutes = None
    if not args.max_steps:
        train_minutes = args.minutes - (time.monotonic() - started) / 60 - reserve
        if train_minutes < 0.5:
            raise ValueError(f"--minutes {args.minutes:g} leaves {train_minutes:.1f} minutes to train after building "
                             f"the corpus and keeping {reserve:.1f} for the evaluation; give it more")
    size = MODEL_SIZES[args.size].description
    limit = f"{args.max_steps} updates" if args.max_steps else f"{train_minutes:.1f} minutes"
    print(f"[2/3] training a {size} {args.model_type} model for {limit} on {torch.get_num_threads()} CPU thread(s) "
          f"(pre-norm, dropout 0.1, lr {recipe['learning_rate']:g}, warm-up {recipe['warmup_steps']}) ...", flush=True)
    deadline = started + 60 * (args.minutes - reserve)
    # the budget counts the corpus, the tokenizer and every evaluation, and keeps back the final decoding's share
    callbacks = [] if args.max_steps else [train.MaxTimeCallback(deadline=deadline)]
    train_results = train.run(*train.parse_arguments(training_argv(args, recipe, train_minutes)),
                              extra_callbacks=callbacks)

    print(f"[3/3] decoding {test_size} test examples (beam {args.num_beams}) ...", flush=True)
    results = decode.run_from_argv([
        "--model_name_or_path", args.output_dir,
        "--split", "test",
        "--max_samples", str(test_size),
        "--num_beams", str(args.num_beams),
        "--batch_size", "64",
        "--max_new_tokens", str(32 if args.smoke else recipe["max_target_length"]),
        "--num_samples_to_print", "3",
    ])
    curve = learning_curve(args.output_dir, f"{args.model_type} on {args.task}")
    figures = method_figures(args.model_type, args.output_dir, list(corpus["test"]["source"]),
                             limit=12 if args.smoke else 200)
    state = json.loads((Path(args.output_dir) / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    first = sum(losses[:3]) / max(len(losses[:3]), 1) if losses else float("nan")

    labels = {"bleu": "BLEU", "chrf": "chrF", "ter": "TER", "pov": "PoV"}
    print("\n" + "=" * 72)
    constraint = f"; outputs: {results['output_constraint']}" if results.get("output_constraint") else ""
    print(f"{args.model_type} on {args.task}, test set ({results['num_examples']} examples, beam {args.num_beams}"
          f"{constraint}):")
    print(f"  {'':18}" + "".join(f"{labels[name]:>9}" for name in results["metrics"]))
    print(f"  {'this model':18}" + "".join(f"{value:9.2f}" for value in results["metrics"].values()))
    print(f"  {'copying the input':18}" + "".join(f"{value:9.2f}" for value in results["copy_baseline"].values()))
    print(f"  {'model - copy':18}" + "".join(f"{value:+9.2f}" for value in results["gain_over_copy"].values())
          + "   (TER: copy - model)")
    exact = exact_matches(Path(args.output_dir) / "generations.test.jsonl")
    print(f"  exactly right: {exact['model']} of {exact['examples']} test outputs equal their reference "
          f"({100 * exact['model'] / max(exact['examples'], 1):.1f}%; copying the input: {exact['copy']})")
    for name, value in figures.items():
        print(f"  {name}: {value}")
    print(f"Trained {state['global_step']} updates ({state['epoch']:.1f} epochs; training loss {first:.2f} at the start, "
          f"{losses[-1] if losses else float('nan'):.2f} at the end); {(time.monotonic() - started) / 60:.1f} minutes in total.")
    print(f"Learning curve: {curve.resolve()}")
    print(f"Checkpoint: {Path(args.output_dir).resolve()}  (results in eval_results.json)")
    print(f"Try it:  flexformers-decode --model_name_or_path {args.output_dir} --text \"{recipe['try_text']}\"")
    return {"train": train_results["train"], "eval": results, "curve": str(curve), "figures": figures,
            "exact_matches": exact, "minutes": (time.monotonic() - started) / 60}


def exact_matches(generations_file: str | os.PathLike) -> dict:
    """How many hypotheses of ``flexformers-decode``'s ``generations.<split>.jsonl`` equal their reference exactly
    (whitespace-normalised), beside how many sources already do (copying the input)."""
    rows = [json.loads(line) for line in Path(generations_file).read_text(encoding="utf-8").splitlines() if line]
    return {"examples": len(rows),
            "model": sum(row["hypothesis"].split() == row["reference"].split() for row in rows),
            "copy": sum(row["source"].split() == row["reference"].split() for row in rows)}


def _data_fields(data_flags: list[str], python_source_dirs) -> dict:
    """DataArguments fields from the task's ``--flag value`` pairs."""
    fields = {data_flags[i].lstrip("-"): data_flags[i + 1] for i in range(0, len(data_flags), 2)}
    if python_source_dirs:
        fields["python_source_dirs"] = list(python_source_dirs)
    return fields


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: 0 on success; bad input (too few --minutes, an --output_dir holding another
    run's files, a damaged checkpoint) prints one line naming the problem, without a traceback, and returns 1."""
    from flexformers.training_scripts.decode import run_tool

    return run_tool("flexformers-quickstart", run_from_argv, argv)


if __name__ == "__main__":
    sys.exit(main())
