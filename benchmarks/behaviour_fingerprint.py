"""A fingerprint of what training and decoding produce for every model type: run it on two checkouts to show that
a change (a refactor) left every number as it was, bit for bit.

    python benchmarks/behaviour_fingerprint.py --output /tmp/before.json          # with the old checkout installed
    python benchmarks/behaviour_fingerprint.py --output /tmp/after.json --compare /tmp/before.json

For each model type: ``flexformers-train`` for 6 updates on a tiny codegen corpus (seed 7, dropout on, an
evaluation by generation at update 6), then ``flexformers-decode`` of 6 test sentences with beam 2. The fingerprint
holds the SHA-256 of every trained weight (in name order), every logged loss and evaluation score, and the decoded
hypotheses. ``--compare`` prints each difference and exits 1 if there is one. Nothing is timed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

MODEL_TYPES = ("flexformer", "iot", "mat", "indigo", "depth_adaptive")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = [str(STDLIB / name) for name in ("_collections_abc.py", "genericpath.py", "posixpath.py", "textwrap.py",
                                           "json/decoder.py", "json/encoder.py", "abc.py", "string.py")]
TINY = ("encoder_embed_dim=32,decoder_embed_dim=32,encoder_ffn_embed_dim=64,decoder_ffn_embed_dim=64,"
        "encoder_layers=1,decoder_layers=2,encoder_attention_heads=2,decoder_attention_heads=2,dropout=0.1")


def training_argv(model_type: str, output_dir: Path) -> list[str]:
    return [
        "--model_type", model_type, "--preset", "transformer_codegen_small", "--config_overrides", TINY,
        "--python_source_dirs", *SOURCES, "--vocab_size", "300", "--max_source_length", "96",
        "--max_target_length", "96", "--output_dir", str(output_dir), "--do_train", "--max_steps", "6",
        "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--warmup_steps", "2",
        "--eval_strategy", "steps", "--eval_steps", "6", "--max_eval_samples", "4", "--logging_steps", "1",
        "--report_to", "none", "--disable_tqdm", "true", "--seed", "7", "--use_cpu", "true",
    ]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint(model_type: str, workdir: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    from flexformers.training_scripts import decode, train

    run = workdir / model_type
    train.run_from_argv(training_argv(model_type, run))
    weights = load_file(run / "model.safetensors")
    state = json.loads((run / "trainer_state.json").read_text())
    logged = [{key: value for key, value in entry.items() if "runtime" not in key and "per_second" not in key}
              for entry in state["log_history"]]
    output = workdir / f"{model_type}.txt"
    decode.run_from_argv(["--model_name_or_path", str(run), "--split", "test", "--max_samples", "6", "--num_beams", "2",
                          "--max_new_tokens", "24", "--output_file", str(output), "--num_samples_to_print", "0",
                          "--write_eval_results", "false"])
    return {
        "weights": {name: digest(tensor.contiguous().view(torch.uint8).numpy().tobytes())
                    for name, tensor in sorted(weights.items())},
        "log_history": logged,
        "hypotheses": digest(output.read_bytes()),
    }


def differences(before: dict, after: dict, where: str = "") -> list[str]:
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in sorted(set(before) | set(after), key=str):
            if key not in before or key not in after:
                found.append(f"{where}/{key}: only in {'after' if key not in before else 'before'}")
            else:
                found += differences(before[key], after[key], f"{where}/{key}")
        return found
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [line for index, (a, b) in enumerate(zip(before, after)) for line in differences(a, b, f"{where}[{index}]")]
    return [] if before == after else [f"{where}: {before!r} -> {after!r}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, type=Path, help="where the fingerprint goes (JSON; not replaced)")
    parser.add_argument("--compare", type=Path, default=None, help="an earlier fingerprint to compare with")
    parser.add_argument("--model_types", nargs="*", default=list(MODEL_TYPES))
    args = parser.parse_args(argv)
    if args.output.exists():
        print(f"behaviour_fingerprint: error: {args.output} exists; choose another --output", file=sys.stderr)
        return 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as workdir:
        result = {model_type: fingerprint(model_type, Path(workdir)) for model_type in args.model_types}
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")
    if args.compare is None:
        return 0
    found = differences(json.loads(args.compare.read_text()), result)
    for line in found:
        print(line)
    print(f"{len(found)} difference(s) from {args.compare} over {', '.join(args.model_types)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
