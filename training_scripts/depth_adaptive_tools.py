"""Depth-Adaptive Transformer tools (``flexformers-depth-adaptive``): evaluation with average exit (AE) and FLOPs,
threshold search with the speed/accuracy Pareto front (the paper's Fig. 3), and per-token exit pictures
(Fig. 6/7).

    # BLEU, AE and FLOPs per token (Appendix B) of one exit strategy, and BLEU at every fixed exit;
    # merged into eval_results.json under "depth_adaptive"
    flexformers-depth-adaptive evaluate --model_name_or_path runs/da-2 --split test --exit_strategy halting \\
        --all_fixed_exits

    # Sec. 3.2: τ ~ U(0, 1)^{N-1}, decode the dev set with each, keep the best BLEU per AE bucket
    flexformers-depth-adaptive threshold-search --model_name_or_path runs/da-2 --exit_strategy confidence \\
        --num_samples 200 --output_dir runs/da-2/thresholds

    # tokens with their exits and probabilities (Fig. 6/7)
    flexformers-depth-adaptive exit-picture --model_name_or_path runs/da-2 --split test --num_examples 3

The corpus options default to the ones the model was trained with (like ``flexformers-decode``).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flexformers.modeling.depth_adaptive_flops import DecoderFlopsShape, average_flops_per_token

logger = logging.getLogger("flexformers.depth_adaptive")
TOOL = "flexformers-depth-adaptive"
EVAL_RESULTS_FILE = "eval_results.json"


# ----------------------------------------------------------------------------------------------------------------------
# Decoding with exits
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class ExitDecodeResult:
    hypotheses: list[str]
    exits: list[list[int]]  # per hypothesis, the exit of every generated token (including </s>)
    source_lengths: list[int]
    token_ids: list[list[int]]
    token_probabilities: list[list[float]] | None
    seconds: float

    @property
    def average_exit(self) -> float:
        tokens = [e for exits in self.exits for e in exits]
        return sum(tokens) / max(len(tokens), 1)


def flops_mechanism(model, exit_strategy: str) -> str:
    """The Appendix B cost model that matches an exit strategy."""
    if exit_strategy == "halting":
        return model.config.halting_mechanism
    return exit_strategy


@torch.inference_mode()
def decode_with_exits(
    model, source_tokenizer, target_tokenizer, sources: list[str], *, exit_strategy: str, fixed_exit=None,
    exit_thresholds=None, num_beams: int = 1, length_penalty: float = 1.0, max_new_tokens: int = 64,
    batch_size: int = 32, with_probabilities: bool = False,
) -> ExitDecodeResult:
    """Generate for ``sources`` (input order kept, batches sorted by length) and collect every token's exit."""
    from flexformers.training_scripts.decode import encode_in_length_batches

    encoded, batches = encode_in_length_batches(model, source_tokenizer, sources, batch_size)
    hypotheses: list = [None] * len(sources)
    exits: list = [None] * len(sources)
    token_ids: list = [None] * len(sources)
    probabilities: list | None = [None] * len(sources) if with_probabilities else None
    special = set(target_tokenizer.all_special_ids)
    device = next(model.parameters()).device
    seconds = 0.0
    for batch in batches:
        padded = source_tokenizer.pad({"input_ids": [encoded[i] for i in batch]}, return_tensors="pt")
        began = time.perf_counter()
        output = model.generate(
            input_ids=padded["input_ids"].to(device),
            attention_mask=padded["attention_mask"].to(device),
            num_beams=num_beams,
            length_penalty=length_penalty,
            max_new_tokens=max_new_tokens,
            max_length=None,  # the saved generation config's max_length (Trainer writes 20) would only warn
            early_stopping=num_beams > 1,
            exit_strategy=exit_strategy,
            fixed_exit=fixed_exit,
            exit_thresholds=exit_thresholds,
            return_exits=True,
            return_dict_in_generate=with_probabilities,
            output_scores=with_probabilities,
        )
        seconds += time.perf_counter() - began
        step_probabilities = None
        if with_probabilities:
            step_probabilities = torch.stack([torch.softmax(s.float(), -1) for s in output.scores], dim=1)
        for row, index in enumerate(batch):
            generated = output.sequences[row, 1:].tolist()
            row_exits = output.exits[row].tolist()
            kept = [k for k, e in enumerate(row_exits) if e > 0]
            exits[index] = [row_exits[k] for k in kept]
            token_ids[index] = [generated[k] for k in kept]
            if with_probabilities:
                probabilities[index] = [float(step_probabilities[row, k, generated[k]]) for k in kept]
            hypotheses[index] = target_tokenizer.decode(
                [t for t in generated if t not in special], skip_special_tokens=True
            )
    return ExitDecodeResult(
        hypotheses=hypotheses,
        exits=exits,
        source_lengths=[len(ids) for ids in encoded],
        token_ids=token_ids,
        token_probabilities=probabilities,
        seconds=seconds,
    )


def score(model, result: ExitDecodeResult, references: list[str], exit_strategy: str, is_code: bool) -> dict:
    """BLEU (and chrF/TER) of the hypotheses, AE and FLOPs per token (Appendix B)."""
    from flexformers.training_scripts.metrics_utils import compute_generation_metrics

    metrics = compute_generation_metrics(result.hypotheses, references, is_code=is_code)
    shape = DecoderFlopsShape.from_config(model.config)
    return {
        "bleu": round(metrics["bleu"], 2),
        "chrf": round(metrics["chrf"], 2),
        "average_exit": round(result.average_exit, 4),
        "flops_per_token": round(
            average_flops_per_token(shape, result.exits, result.source_lengths, flops_mechanism(model, exit_strategy))
        ),
        "decode_seconds": round(result.seconds, 3),
        "sacrebleu_signature": metrics["sacrebleu_signature"],
    }


def load_split(model_dir: str, split: str, max_samples: int | None, overrides: dict):
    from flexformers.training_scripts.arguments import DataArguments
    from flexformers.training_scripts.data import load_corpus

    data_args = DataArguments.load(model_dir)
    if data_args is None:
        raise ValueError(f"{model_dir} has no saved corpus arguments (was it written by flexformers-train?)")
    for key, value in overrides.items():
        setattr(data_args, key, value)
    corpus = load_corpus(data_args)
    if split not in corpus:
        raise ValueError(f"split {split!r} not in the corpus (have {sorted(corpus)})")
    data = corpus[split]
    if max_samples is not None:
        data = data.select(range(min(max_samples, len(data))))
    return list(data["source"]), list(data["target"]), data_args


# ----------------------------------------------------------------------------------------------------------------------
# Threshold search and the Pareto front (Sec. 3.2, Fig. 3)
# ----------------------------------------------------------------------------------------------------------------------


def sample_thresholds(num_samples: int, num_exits: int, seed: int) -> list[list[float]]:
    """τ ~ U(0, 1)^{N−1} (Sec. 3.2), ``num_samples`` draws."""
    generator = random.Random(seed)
    return [[generator.random() for _ in range(num_exits - 1)] for _ in range(num_samples)]


def best_per_cost_bucket(rows: list[dict], cost_key: str = "average_exit", bucket_width: float = 0.25) -> list[dict]:
    """"τ with the highest BLEU in each cost segment" (Sec. 3.2): cost buckets of ``bucket_width``."""
    best: dict[int, dict] = {}
    for row in rows:
        bucket = int(math.floor(row[cost_key] / bucket_width))
        if bucket not in best or row["bleu"] > best[bucket]["bleu"]:
            best[bucket] = row
    return [best[b] for b in sorted(best)]


def pareto_front(rows: list[dict], cost_key: str = "average_exit") -> list[dict]:
    """The non-dominated points (lower cost, higher BLEU), by increasing cost."""
    front, best_bleu = [], -math.inf
    for row in sorted(rows, key=lambda r: (r[cost_key], -r["bleu"])):
        if row["bleu"] > best_bleu:
            front.append(row)
            best_bleu = row["bleu"]
    return front


def cheapest_reaching(front: list[dict], reference_bleu: float, cost_key: str = "average_exit") -> dict:
    """The thresholds of the front that match the full-depth model at the lowest cost ("matches the accuracy of
    the N=6 baseline with AE 2.5", Sec. 4.4): the cheapest point whose BLEU reaches ``reference_bleu``, else, where
    none does, the front's most accurate point."""
    if not front:
        raise ValueError("the threshold search found no thresholds")
    reaching = [row for row in front if row["bleu"] >= reference_bleu]
    if reaching:
        return min(reaching, key=lambda row: row[cost_key])
    return max(front, key=lambda row: row["bleu"])


def plot_trade_off(rows, front, fixed_rows, path: Path, title: str) -> None:
    """BLEU vs AE like the paper's Fig. 3: every sampled τ, the Pareto front, and the fixed exits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    axis.scatter([r["average_exit"] for r in rows], [r["bleu"] for r in rows], s=8, color="0.7", label="sampled τ")
    axis.plot([r["average_exit"] for r in front], [r["bleu"] for r in front], "o-", color="tab:red",
              label="best per AE (Pareto front)")
    if fixed_rows:
        axis.plot([r["average_exit"] for r in fixed_rows], [r["bleu"] for r in fixed_rows], "s--", color="tab:blue",
                  label="aligned, fixed exit n")
    axis.set_xlabel("average exit (AE)")
    axis.set_ylabel("BLEU")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=150)
    plt.close(figure)


def write_table(rows: list[dict], path: Path) -> None:
    keys = ["average_exit", "bleu", "flops_per_token", "thresholds", "chrf", "decode_seconds"]
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "thresholds": " ".join(f"{t:.3f}" for t in row.get("thresholds") or [])})


# ----------------------------------------------------------------------------------------------------------------------
# Exit pictures (Fig. 6/7)
# ----------------------------------------------------------------------------------------------------------------------


def plot_exits(tokens: list[str], exits: list[int], probabilities: list[float], num_exits: int, path: Path,
               title: str) -> None:
    """Each output token with its exit (black bars) and model probability (gray line), like Fig. 6/7."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = max(6.0, 0.35 * len(tokens))
    figure, axis = plt.subplots(figsize=(width, 3.2))
    positions = list(range(len(tokens)))
    axis.bar(positions, exits, color="black", width=0.6)
    axis.set_ylim(0, num_exits + 0.5)
    axis.set_ylabel("exit")
    axis.set_xticks(positions)
    axis.set_xticklabels(tokens, rotation=60, ha="right", fontsize=8)
    twin = axis.twinx()
    twin.plot(positions, probabilities, "o-", color="0.6")
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("p(token)", color="0.45")
    axis.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=150)
    plt.close(figure)


# ----------------------------------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------------------------------


def _parse_thresholds(text: str | None):
    if text is None:
        return None
    return [float(item) for item in text.replace(",", " ").split()]


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model_name_or_path", required=True, help="Directory written by flexformers-train.")
    parser.add_argument("--split", default="validation", help="train, validation or test.")
    parser.add_argument("--max_samples", type=int, default=None, help="Use the first N examples of the split.")
    parser.add_argument("--num_beams", type=int, default=1)
    parser.add_argument("--length_penalty", type=float, default=1.0)
    parser.add_argument("--max_new_tokens", type=int, default=None, help="Default: the training max_target_length.")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--exit_strategy", default=None, help="full, fixed, confidence or halting (default: config).")
    parser.add_argument("--fixed_exit", type=int, default=None)
    parser.add_argument("--exit_thresholds", default=None, help="N-1 comma-separated thresholds.")
    parser.add_argument("--bf16", action="store_true", help="Cast the weights to bfloat16.")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available).")
    parser.add_argument("--seed", type=int, default=0)


def _load(args):
    from flexformers.modeling.modeling_depth_adaptive import DepthAdaptiveForConditionalGeneration
    from flexformers.training_scripts.decode import load_method_model, resolve_device

    model, source_tokenizer, target_tokenizer = load_method_model(
        args.model_name_or_path, DepthAdaptiveForConditionalGeneration, TOOL, "a Depth-Adaptive",
        resolve_device(args.device), args.bf16)
    sources, references, data_args = load_split(args.model_name_or_path, args.split, args.max_samples, {})
    max_new_tokens = args.max_new_tokens or data_args.max_target_length
    return model, source_tokenizer, target_tokenizer, sources, references, data_args, max_new_tokens


def command_evaluate(args) -> dict:
    model, source_tok, target_tok, sources, references, data_args, max_new_tokens = _load(args)
    strategy = args.exit_strategy or model.config.default_exit_strategy
    common = dict(num_beams=args.num_beams, length_penalty=args.length_penalty, max_new_tokens=max_new_tokens,
                  batch_size=args.batch_size)
    result = decode_with_exits(model, source_tok, target_tok, sources, exit_strategy=strategy,
                               fixed_exit=args.fixed_exit, exit_thresholds=_parse_thresholds(args.exit_thresholds),
                               **common)
    report = {
        "split": args.split,
        "num_examples": len(sources),
        "num_beams": args.num_beams,
        "exit_strategy": strategy,
        "exit_thresholds": _parse_thresholds(args.exit_thresholds) or model.config.default_exit_thresholds,
        **score(model, result, references, strategy, data_args.is_code),
    }
    if args.all_fixed_exits:
        report["fixed_exits"] = {}
        for block in range(1, model.config.decoder_layers + 1):
            fixed = decode_with_exits(model, source_tok, target_tok, sources, exit_strategy="fixed", fixed_exit=block,
                                      **common)
            report["fixed_exits"][str(block)] = score(model, fixed, references, "fixed", data_args.is_code)
    print(json.dumps(report, indent=2))
    path = Path(args.model_name_or_path) / EVAL_RESULTS_FILE
    existing = json.loads(path.read_text()) if path.is_file() else {}
    existing["depth_adaptive"] = report
    path.write_text(json.dumps(existing, indent=2, ensure_ascii=False) + "\n")
    return report


def command_threshold_search(args) -> dict:
    model, source_tok, target_tok, sources, references, data_args, max_new_tokens = _load(args)
    strategy = args.exit_strategy or "confidence"
    if strategy == "halting" and model.config.halting_mechanism != "token_geometric":
        raise ValueError("--exit_strategy halting: the threshold search needs a geometric-like halting model")
    if strategy not in ("confidence", "halting"):
        raise ValueError("--exit_strategy must be confidence or halting (geometric-like) for a threshold search")
    output_dir = Path(args.output_dir or Path(args.model_name_or_path) / f"threshold_search_{strategy}")
    output_dir.mkdir(parents=True, exist_ok=True)
    common = dict(num_beams=args.num_beams, length_penalty=args.length_penalty, max_new_tokens=max_new_tokens,
                  batch_size=args.batch_size)
    num_exits = model.config.decoder_layers
    rows = []
    candidates = sample_thresholds(args.num_samples, num_exits, args.seed)
    if strategy == "halting":
        candidates.insert(0, [0.5] * (num_exits - 1))  # the paper's default χ > 0.5
    for index, thresholds in enumerate(candidates):
        result = decode_with_exits(model, source_tok, target_tok, sources, exit_strategy=strategy,
                                   exit_thresholds=thresholds, **common)
        row = {"thresholds": thresholds, **score(model, result, references, strategy, data_args.is_code)}
        rows.append(row)
        logger.info("τ %d/%d: AE %.2f BLEU %.2f", index + 1, len(candidates), row["average_exit"], row["bleu"])
    fixed_rows = []
    for block in range(1, num_exits + 1):
        fixed = decode_with_exits(model, source_tok, target_tok, sources, exit_strategy="fixed", fixed_exit=block,
                                  **common)
        fixed_rows.append({"fixed_exit": block, **score(model, fixed, references, "fixed", data_args.is_code)})
    buckets = best_per_cost_bucket(rows, bucket_width=args.bucket_width)
    front = pareto_front(rows)
    write_table(rows, output_dir / "all_thresholds.csv")
    write_table(front, output_dir / "pareto_front.csv")
    write_table(buckets, output_dir / "best_per_bucket.csv")
    plot_trade_off(rows, front, fixed_rows, output_dir / "trade_off.png",
                   f"{strategy} ({'geometric-like' if strategy == 'halting' else 'thresholding'}), {args.split}")
    summary = {"exit_strategy": strategy, "split": args.split, "num_examples": len(sources),
               "num_samples": len(rows), "pareto_front": front, "best_per_bucket": buckets, "fixed_exits": fixed_rows,
               "matching_full_depth": cheapest_reaching(front, fixed_rows[-1]["bleu"])}
    (output_dir / "threshold_search.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'AE':>6} {'BLEU':>6} {'GFLOPs/tok':>10}  thresholds")
    for row in front:
        print(f"{row['average_exit']:6.2f} {row['bleu']:6.2f} {row['flops_per_token'] / 1e9:10.4f}  "
              + " ".join(f"{t:.2f}" for t in row["thresholds"]))
    chosen = summary["matching_full_depth"]
    print(f"full depth: BLEU {fixed_rows[-1]['bleu']:.2f}; the cheapest thresholds reaching it (else the best): AE "
          f"{chosen['average_exit']:.2f}, BLEU {chosen['bleu']:.2f}, τ = "
          + " ".join(f"{t:.2f}" for t in chosen["thresholds"]))
    print(f"table, plot: {output_dir}")
    return summary


def command_exit_picture(args) -> list[dict]:
    model, source_tok, target_tok, sources, references, data_args, max_new_tokens = _load(args)
    strategy = args.exit_strategy or model.config.default_exit_strategy
    chosen = list(range(min(args.num_examples, len(sources))))
    result = decode_with_exits(
        model, source_tok, target_tok, [sources[i] for i in chosen], exit_strategy=strategy,
        fixed_exit=args.fixed_exit, exit_thresholds=_parse_thresholds(args.exit_thresholds), num_beams=1,
        max_new_tokens=max_new_tokens, batch_size=args.batch_size, with_probabilities=True,
    )
    output_dir = Path(args.output_dir or Path(args.model_name_or_path) / "exit_pictures")
    output_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for position, index in enumerate(chosen):
        tokens = [target_tok.convert_ids_to_tokens(t) for t in result.token_ids[position]]
        tokens = [t.replace("Ġ", "▁").replace("Ċ", "⏎") for t in tokens]
        exits, probabilities = result.exits[position], result.token_probabilities[position]
        path = output_dir / f"exits_{index}.png"
        plot_exits(tokens, exits, probabilities, model.config.decoder_layers, path,
                   f"src: {sources[index][:90]}")
        records.append({"source": sources[index], "reference": references[index], "hypothesis": result.hypotheses[position],
                        "tokens": tokens, "exits": exits, "probabilities": [round(p, 3) for p in probabilities]})
        print(f"SOURCE: {sources[index]}")
        print("  ".join(f"{tok}|{e}|{p:.2f}" for tok, e, p in zip(tokens, exits, probabilities)))
    (output_dir / "exits.json").write_text(json.dumps(records, indent=2, ensure_ascii=False) + "\n")
    print(f"pictures: {output_dir}")
    return records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    evaluate = commands.add_parser("evaluate", help="BLEU, AE and FLOPs per token of an exit strategy")
    _common_arguments(evaluate)
    evaluate.add_argument("--all_fixed_exits", action="store_true", help="Also BLEU at every fixed exit 1..N.")
    search = commands.add_parser("threshold-search", help="Random threshold search, Pareto front table and plot")
    _common_arguments(search)
    search.add_argument("--num_samples", type=int, default=100, help="Sampled threshold vectors (paper: 10k).")
    search.add_argument("--bucket_width", type=float, default=0.25, help="AE bucket width for 'best per segment'.")
    search.add_argument("--output_dir", default=None)
    picture = commands.add_parser("exit-picture", help="Per-token exits and probabilities (Fig. 6/7)")
    _common_arguments(picture)
    picture.add_argument("--num_examples", type=int, default=3)
    picture.add_argument("--output_dir", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: 0 on success; bad input (e.g. another type's model) prints one line, returns 1."""
    from flexformers.training_scripts.decode import run_tool

    return run_tool(TOOL, run_from_argv, argv)


def run_from_argv(argv: list[str] | None = None):
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the command; returns its report."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    args = build_parser().parse_args(argv)
    torch.manual_seed(args.seed)
    if args.num_beams < 1 or args.batch_size < 1:
        raise ValueError("--num_beams and --batch_size must be positive")
    command = {"evaluate": command_evaluate, "threshold-search": command_threshold_search,
               "exit-picture": command_exit_picture}[args.command]
    return command(args)


if __name__ == "__main__":
    sys.exit(main())
