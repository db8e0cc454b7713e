"""IOT case verification (the paper's Section 5.2, Fig. 2): split a split of the corpus by the decoder order the
predictor picks for each sentence, decode every subset with *every* decoder order, and print/plot the BLEU table.

If the predictor makes sensible choices, each subset scores best on the order predicted for it (the diagonal).

    flexformers-iot-orders --model_name_or_path runs/iot --split validation --num_beams 5 \\
        --plot runs/iot/order_analysis.png

The corpus options default to the ones the model was trained with (``flexformers_data_args.json``).
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

from flexformers.training_scripts.arguments import DataArguments, describe_dataset
from flexformers.training_scripts.data import SPLITS, load_corpus
from flexformers.training_scripts.decode import generate_texts, load_method_model, resolve_device, run_tool
from flexformers.training_scripts.metrics_utils import compute_generation_metrics

logger = logging.getLogger("flexformers.iot_orders")
TOOL = "flexformers-iot-orders"


@dataclass
class OrderAnalysisArguments:
    model_name_or_path: str = field(metadata={"help": "Directory of a trained IOT model (written by flexformers-train)."})
    split: str = field(default="validation", metadata={"help": "train, validation or test."})
    max_samples: int | None = field(default=None, metadata={"help": "Use only the first N examples of the split."})
    num_beams: int = field(default=5, metadata={"help": "Beam size (the paper: 5)."})
    length_penalty: float = field(default=1.0)
    max_new_tokens: int | None = field(default=None, metadata={"help": "Default: the training --max_target_length."})
    batch_size: int = field(default=32)
    metric: str = field(default="bleu", metadata={"help": "Score in the table: bleu, chrf, ter (or pov for code)."})
    plot: str | None = field(default=None, metadata={"help": "Save the grouped bar chart here (default: in the model dir)."})
    json_output: str | None = field(default=None, metadata={"help": "Save the table as JSON here (default: model dir)."})
    device: str | None = field(default=None)

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"--split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if self.metric not in ("bleu", "chrf", "ter", "pov"):
            raise ValueError(f"--metric must be bleu, chrf, ter or pov, got {self.metric!r}")


class _ForcedDecoderOrder:
    """A view of an IOT model whose ``generate`` decodes every sentence with one decoder order."""

    def __init__(self, model, code: int | None):
        self.model, self.code, self.config = model, code, model.config

    def parameters(self):
        return self.model.parameters()

    def generate(self, **kwargs):
        return self.model.generate(decoder_order=self.code, **kwargs)


@torch.inference_mode()
def predicted_decoder_orders(model, source_tokenizer, sources: list[str], batch_size: int) -> list[int]:
    """The decoder order code (paper numbering) the predictor picks for each source (Eq. 4)."""
    device = next(model.parameters()).device
    max_source = getattr(model.config, "max_source_positions", 1024)
    codes: list[int] = []
    for start in range(0, len(sources), batch_size):
        encoded = source_tokenizer(
            sources[start : start + batch_size], truncation=True, max_length=max_source, padding=True,
            return_tensors="pt",
        )
        _, decoder_codes = model.predict_orders(encoded["input_ids"].to(device), encoded["attention_mask"].to(device))
        codes.extend(decoder_codes.tolist())
    return codes


def order_table(
    model, source_tokenizer, target_tokenizer, sources, references, *, is_code=False, metric="bleu", num_beams=5,
    length_penalty=1.0, max_new_tokens=128, batch_size=32, predicted_hypotheses: list[str] | None = None,
) -> dict:
    """``{"orders", "predicted", "subsets": {code: size}, "scores": {subset: {order: score}}, "overall": {...}}``.

    Subset ``c`` holds the sentences whose predicted decoder order is ``c``; ``scores[c][o]`` is the corpus score of
    that subset decoded with order ``o``; ``overall[o]`` the whole split with ``o``; ``overall["predicted"]`` the
    whole split with each sentence's own predicted order (IOT's inference).

    ``predicted_hypotheses``: the model's own decoding of ``sources`` (each with its predicted order), made with the
    same generation settings, e.g. by the evaluation just before; it stands for that decode instead of repeating it.
    """
    codes = list(model.config.decoder_orders)
    predicted = predicted_decoder_orders(model, source_tokenizer, sources, batch_size)
    generation = dict(num_beams=num_beams, length_penalty=length_penalty, max_new_tokens=max_new_tokens,
                      batch_size=batch_size)
    hypotheses = {}
    if predicted_hypotheses is not None:
        if len(predicted_hypotheses) != len(sources):
            raise ValueError(f"predicted_hypotheses has {len(predicted_hypotheses)} lines for {len(sources)} sources; "
                             "it must be the decoding of exactly these sources")
        hypotheses[None] = list(predicted_hypotheses)
    for code in codes + ([None] if predicted_hypotheses is None else []):
        logger.info("decoding %d sentences with decoder order %s", len(sources), code or "predicted")
        hypotheses[code], _ = generate_texts(
            _ForcedDecoderOrder(model, code), source_tokenizer, target_tokenizer, sources, **generation
        )

    def score(indices, code):
        result = compute_generation_metrics(
            [hypotheses[code][i] for i in indices], [references[i] for i in indices], is_code=is_code
        )
        return round(result[metric], 2)

    everything = list(range(len(sources)))
    table = {
        "metric": metric,
        "orders": codes,
        "predicted": predicted,
        "subsets": {code: predicted.count(code) for code in codes},
        "scores": {},
        "overall": {code: score(everything, code) for code in codes},
    }
    table["overall"]["predicted"] = score(everything, None)
    for subset in codes:
        indices = [i for i, code in enumerate(predicted) if code == subset]
        if indices:
            table["scores"][subset] = {code: score(indices, code) for code in codes}
    return table


def format_table(table: dict) -> str:
    """The Fig. 2 numbers as text: one row per predicted subset, one column per decoding order, best marked *."""
    codes = table["orders"]
    higher_is_better = table["metric"] != "ter"
    header = f"{'subset (predicted order)':<26}{'size':>6}" + "".join(f"{'order ' + str(c):>11}" for c in codes)
    lines = [header, "-" * len(header)]
    for subset, row in table["scores"].items():
        best = (max if higher_is_better else min)(row.values())
        cells = "".join(f"{(f'{row[c]:.2f}' + ('*' if row[c] == best else ' ')):>11}" for c in codes)
        lines.append(f"{'set ' + str(subset):<26}{table['subsets'][subset]:>6}{cells}")
    overall = table["overall"]
    lines.append("-" * len(header))
    lines.append(f"{'all':<26}{len(table['predicted']):>6}" + "".join(f"{overall[c]:>10.2f} " for c in codes))
    lines.append(f"all, each sentence with its predicted order (IOT): {overall['predicted']:.2f}")
    return "\n".join(lines)


def plot_table(table: dict, path: str | Path) -> None:
    """Grouped bars as the paper's Fig. 2: x = subset by predicted order, one bar per decoding order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codes = table["orders"]
    subsets = list(table["scores"])
    width = 0.8 / len(codes)
    figure, axis = plt.subplots(figsize=(1.8 + 1.6 * len(subsets), 3.4))
    for j, code in enumerate(codes):
        positions = [i + (j - (len(codes) - 1) / 2) * width for i in range(len(subsets))]
        axis.bar(positions, [table["scores"][s][code] for s in subsets], width, label=f"decoder order {code}")
    axis.set_xticks(range(len(subsets)))
    axis.set_xticklabels([f"set {s}\n(n={table['subsets'][s]})" for s in subsets])
    values = [v for row in table["scores"].values() for v in row.values()]
    if values:
        spread = max(values) - min(values)
        axis.set_ylim(max(0.0, min(values) - spread - 1.0), max(values) + spread * 0.5 + 1.0)
    axis.set_ylabel(table["metric"].upper())
    axis.set_title("Subsets by predicted decoder order, decoded with every order")
    axis.legend(fontsize=8, ncol=min(3, len(codes)))
    figure.tight_layout()
    figure.savefig(path, dpi=150)
    plt.close(figure)


def run(args: OrderAnalysisArguments, predicted_hypotheses: list[str] | None = None) -> dict:
    """The table for ``args``; ``predicted_hypotheses`` as in :func:`order_table` (the caller vouches that they were
    decoded from this split with ``args``' generation settings)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    device = resolve_device(args.device)
    from flexformers.modeling.modeling_iot import IOTForConditionalGeneration

    model, source_tokenizer, target_tokenizer = load_method_model(
        args.model_name_or_path, IOTForConditionalGeneration, TOOL, "an IOT", device)
    if model.config.num_decoder_orders < 2:
        raise ValueError(f"{args.model_name_or_path} has a single decoder order; there is nothing to compare")
    data_args = DataArguments.load(args.model_name_or_path)
    if data_args is None:
        raise ValueError(f"{args.model_name_or_path} has no saved corpus arguments (was it written by "
                         "flexformers-train?)")
    split = load_corpus(data_args)[args.split]
    if args.max_samples is not None:
        split = split.select(range(min(args.max_samples, len(split))))
    if len(split) == 0:
        raise ValueError(f"split {args.split!r} of {describe_dataset(data_args)} is empty")
    table = order_table(
        model, source_tokenizer, target_tokenizer, list(split["source"]), list(split["target"]),
        is_code=data_args.is_code, metric=args.metric, num_beams=args.num_beams, length_penalty=args.length_penalty,
        max_new_tokens=args.max_new_tokens or data_args.max_target_length, batch_size=args.batch_size,
        predicted_hypotheses=predicted_hypotheses,
    )
    print(format_table(table))
    model_dir = Path(args.model_name_or_path)
    plot_path = Path(args.plot or model_dir / f"iot_order_analysis.{args.split}.png")
    plot_table(table, plot_path)
    json_path = Path(args.json_output or model_dir / f"iot_order_analysis.{args.split}.json")
    json_path.write_text(json.dumps({k: v for k, v in table.items() if k != "predicted"}, indent=2) + "\n")
    print(f"plot: {plot_path}\ntable: {json_path}")
    return table


def run_from_argv(argv: list[str] | None = None) -> dict:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run; returns the table."""
    parser = HfArgumentParser(OrderAnalysisArguments, description=__doc__.split("\n\n")[0])
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    return run(args)


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: 0 on success; bad input (e.g. another type's model) prints one line, returns 1."""
    return run_tool(TOOL, run_from_argv, argv)


if __name__ == "__main__":
    sys.exit(main())
