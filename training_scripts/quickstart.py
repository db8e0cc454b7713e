"""The README main job (``flexformers-quickstart``): train a small baseline on real data, evaluate it, show samples.

On a fresh machine with no internet and no GPU this
1. builds the (docstring -> function source) corpus from the running Python's standard library (parsed with
   ``ast``, never executed),
2. trains a byte-level BPE and a small fairseq Transformer baseline (``transformer_codegen_small``: 3+3 layers,
   d=256, FFN 1024, the IOT/MAT papers' code-generation model) for a few minutes on CPU,
3. decodes test examples, prints BLEU / chrF / TER / PoV and a few generated functions next to their references,
4. leaves a checkpoint (model, tokenizer, eval_results.json) that ``flexformers-decode`` loads.

``--smoke`` runs the same pipeline for a few steps (the slow test uses it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

# Model sizes: "paper" is the IOT/MAT code-generation model as published; "tiny" (the default) is the same
# architecture at half the width and 2+2 layers -- about 8x fewer FLOPs per token, so a few minutes on 2 CPU cores
# are several epochs instead of a fraction of one.
MODEL_SIZES = {
    "tiny": "encoder_embed_dim=128,decoder_embed_dim=128,encoder_ffn_embed_dim=512,decoder_ffn_embed_dim=512,"
    "encoder_layers=2,decoder_layers=2,encoder_attention_heads=4,decoder_attention_heads=4,dropout=0.1",
    "paper": "dropout=0.1",
}
QUICKSTART_RECIPE = {
    # A few minutes of CPU: short pairs, a small vocabulary, faster warm-up than the papers' 4000 steps (which
    # alone would take longer than the whole run), light dropout.
    "preset": "transformer_codegen_small",
    "vocab_size": 4000,
    "max_source_length": 64,
    "max_target_length": 128,
    "per_device_train_batch_size": 32,
    "learning_rate": 1e-3,
    "warmup_steps": 200,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexformers-quickstart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="runs/quickstart", help="where the checkpoint goes (default: %(default)s)")
    parser.add_argument("--minutes", type=float, default=5.0, help="training wall time (default: %(default)s)")
    parser.add_argument("--max_steps", type=int, default=None, help="stop after this many updates instead")
    parser.add_argument("--eval_samples", type=int, default=100, help="test examples to decode (default: %(default)s)")
    parser.add_argument("--num_beams", type=int, default=5, help="beam size for the evaluation (default: %(default)s)")
    parser.add_argument("--python_source_dirs", nargs="*", default=None, help="Python trees (default: stdlib)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    parser.add_argument("--size", choices=sorted(MODEL_SIZES), default="tiny",
                        help="tiny: d=128, 2+2 layers (default); paper: transformer_codegen_small, d=256, 3+3 layers")
    parser.add_argument("--smoke", action="store_true", help="a few steps and a few test examples (for tests)")
    return parser


def run_from_argv(argv: list[str] | None = None) -> dict:
    """Run the main job; returns {"train": train metrics, "eval": eval_results}."""
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from flexformers.training_scripts import decode, train
    from flexformers.training_scripts.data import build_codegen_corpus

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.max_steps = args.max_steps or 20
        args.eval_samples = min(args.eval_samples, 6)
        args.num_beams = min(args.num_beams, 2)
    recipe = dict(QUICKSTART_RECIPE)
    if args.smoke:
        recipe.update(vocab_size=1000, warmup_steps=10)

    started = time.time()
    corpus = build_codegen_corpus(args.python_source_dirs)
    sizes = {split: len(dataset) for split, dataset in corpus.items()}
    print(f"[1/3] corpus: {sum(sizes.values())} (docstring -> function) pairs from "
          f"{'the Python standard library' if not args.python_source_dirs else ', '.join(args.python_source_dirs)} "
          f"{sizes}", flush=True)

    train_argv = [
        "--model_type", "flexformer",
        "--preset", recipe["preset"],
        "--config_overrides", MODEL_SIZES[args.size],
        "--vocab_size", str(recipe["vocab_size"]),
        "--task", "codegen",
        "--max_source_length", str(recipe["max_source_length"]),
        "--max_target_length", str(recipe["max_target_length"]),
        "--per_device_train_batch_size", str(recipe["per_device_train_batch_size"]),
        "--learning_rate", str(recipe["learning_rate"]),
        "--warmup_steps", str(recipe["warmup_steps"]),
        "--output_dir", args.output_dir,
        "--do_train",
        "--eval_strategy", "no",
        "--save_strategy", "no",
        "--logging_steps", "5" if args.smoke else "25",
        "--report_to", "none",
        "--disable_tqdm", "false",
    ]
    if args.python_source_dirs:
        train_argv += ["--python_source_dirs", *args.python_source_dirs]
    if args.max_steps:
        train_argv += ["--max_steps", str(args.max_steps)]
    else:
        train_argv += ["--num_train_epochs", "1000", "--max_train_minutes", str(args.minutes)]
    limit = f"{args.max_steps} steps" if args.max_steps else f"{args.minutes:g} minutes"
    size = "transformer_codegen_small" if args.size == "paper" else "small (d=128, 2+2 layers)"
    print(f"[2/3] training a {size} baseline for {limit} on {torch.get_num_threads()} CPU thread(s) ...", flush=True)
    train_results = train.run_from_argv(train_argv)
    print(f"      training done after {(time.time() - started) / 60:.1f} minutes", flush=True)

    print(f"[3/3] decoding {args.eval_samples} test examples (beam {args.num_beams}) ...", flush=True)
    results = decode.run_from_argv([
        "--model_name_or_path", args.output_dir,
        "--split", "test",
        "--max_samples", str(args.eval_samples),
        "--num_beams", str(args.num_beams),
        "--max_new_tokens", str(32 if args.smoke else recipe["max_target_length"]),
        "--num_samples_to_print", "3",
        "--within_training_lengths", "true",
    ])
    state = json.loads((Path(args.output_dir) / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    last_loss = f", last logged training loss {losses[-1]:.3f}" if losses else ""
    print(f"\nTrained {state['global_step']} updates ({state['epoch']:.1f} epochs{last_loss}); "
          f"{(time.time() - started) / 60:.1f} minutes in total.")
    print(f"Checkpoint: {Path(args.output_dir).resolve()}  (results in eval_results.json)")
    print(f"Try it:  flexformers-decode --model_name_or_path {args.output_dir} --num_beams 5 "
          f"--text \"Return the number of lines in the file.\"")
    return {"train": train_results["train"], "eval": results}


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    run_from_argv(argv)


if __name__ == "__main__":
    main()
