"""Depth-Adaptive Transformer (model type ``depth_adaptive``) in the common training script.

The paper's two-stage schedule (Sec. 4.1) is two runs of ``flexformers-train``:

1. aligned training of the N classifiers without exit prediction (α = 0)::

       flexformers-train --model_type depth_adaptive --preset depth_adaptive_codegen_small --output_dir runs/da-1

2. continue from that checkpoint with a halting mechanism and α > 0 (the new halting parameters start from their
   initialisation; every other weight and the architecture come from the checkpoint)::

       flexformers-train --model_type depth_adaptive --model_name_or_path runs/da-1 \\
           --da_halting_mechanism token_geometric --da_oracle correctness --da_oracle_lambda 0.1 \\
           --da_exit_loss_alpha 0.1 --output_dir runs/da-2

Every ``--da_*`` flag sets the :class:`DepthAdaptiveConfig` field of the same name (see its docstring);
``--da_exit_thresholds 0.5,0.4,...`` takes N−1 comma-separated values. The trainer logs the decoding loss (Eq. 4/5)
and the exit loss (Eq. 6) next to the total (Eq. 7).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from transformers.modeling_utils import unwrap_model

from flexformers.configuration.configuration_depth_adaptive import DepthAdaptiveConfig
from flexformers.modeling.modeling_depth_adaptive import DepthAdaptiveForConditionalGeneration
from flexformers.training_scripts.model_registry import MethodSpec, load_initial_checkpoint
from flexformers.training_scripts.trainer import FlexformersSeq2SeqTrainer
from flexformers.training_scripts.zoo_statistics import is_baseline_result, same_seed_first

# flag → config field; every flag defaults to None = keep the config's (or the stage-one checkpoint's) value.
FLAG_FIELDS = {
    "da_exit_classifiers": "exit_classifiers",
    "da_training_mode": "training_mode",
    "da_mixed_num_samples": "mixed_num_samples",
    "da_exit_loss_weighting": "exit_loss_weighting",
    "da_gradient_scaling": "gradient_scaling",
    "da_halting_mechanism": "halting_mechanism",
    "da_oracle": "oracle",
    "da_oracle_lambda": "oracle_lambda",
    "da_oracle_sigma": "oracle_sigma",
    "da_exit_loss_alpha": "exit_loss_alpha",
    "da_exit_strategy": "exit_strategy",
    "da_fixed_exit": "fixed_exit",
    "da_exit_thresholds": "exit_thresholds",
}


@dataclasses.dataclass
class DepthAdaptiveArguments:
    da_exit_classifiers: str | None = dataclasses.field(
        default=None, metadata={"help": "'independent' (one W_n per block) or 'shared' output classifiers (Eq. 3)."}
    )
    da_training_mode: str | None = dataclasses.field(
        default=None, metadata={"help": "'aligned' (Eq. 4, the paper's choice) or 'mixed' (Eq. 5)."}
    )
    da_mixed_num_samples: int | None = dataclasses.field(default=None, metadata={"help": "M of Eq. 5."})
    da_exit_loss_weighting: str | None = dataclasses.field(
        default=None, metadata={"help": "omega_n of Eq. 4: uniform, n, sqrt_n, inv_sqrt_n, inv_n (Appendix A)."}
    )
    da_gradient_scaling: float | None = dataclasses.field(
        default=None, metadata={"help": "gamma of Appendix A (Algorithm 1); unset = no scaling."}
    )
    da_halting_mechanism: str | None = dataclasses.field(
        default=None, metadata={"help": "none, sequence (Eq. 8), token_multinomial (Eq. 11), token_geometric (Eq. 12-13)."}
    )
    da_oracle: str | None = dataclasses.field(
        default=None, metadata={"help": "likelihood (Eq. 9/14-15) or correctness (Eq. 10/16-17)."}
    )
    da_oracle_lambda: float | None = dataclasses.field(default=None, metadata={"help": "lambda: penalty per block."})
    da_oracle_sigma: float | None = dataclasses.field(default=None, metadata={"help": "sigma: RBF kernel width."})
    da_exit_loss_alpha: float | None = dataclasses.field(
        default=None, metadata={"help": "alpha of Eq. 7 (0 for the first stage, > 0 for the second)."}
    )
    da_exit_strategy: str | None = dataclasses.field(
        default=None, metadata={"help": "Decoding exits: full, fixed, confidence or halting."}
    )
    da_fixed_exit: int | None = dataclasses.field(default=None, metadata={"help": "Exit of --da_exit_strategy fixed."})
    da_exit_thresholds: str | None = dataclasses.field(
        default=None, metadata={"help": "tau_1..tau_{N-1}, comma-separated (confidence / geometric-like)."}
    )


def parse_thresholds(text: str) -> list[float]:
    try:
        return [float(item) for item in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--da_exit_thresholds must be comma-separated numbers, got {text!r}") from None


def apply_depth_adaptive_flags(config: DepthAdaptiveConfig, method_args) -> DepthAdaptiveConfig:
    """Copy the ``--da_*`` flags that were given onto the config and re-validate it."""
    if method_args is None:
        return config
    for flag, field in FLAG_FIELDS.items():
        value = getattr(method_args, flag)
        if value is None:
            continue
        if flag == "da_exit_thresholds":
            value = parse_thresholds(value)
        setattr(config, field, value)
    config.validate_fields()
    return config


def build_depth_adaptive_model(model_args, method_args, config: DepthAdaptiveConfig, tokenizer):
    """A fresh model, or the continuation of a checkpoint (the two-stage schedule): the checkpoint's config with the
    ``--da_*`` flags applied, so a stage-one model gains its halting mechanism (newly initialised) in stage two."""
    checkpoint = getattr(model_args, "model_name_or_path", None)
    if not checkpoint:
        return DepthAdaptiveForConditionalGeneration(config)
    stage_config = apply_depth_adaptive_flags(DepthAdaptiveConfig.from_pretrained(checkpoint), method_args)
    stage_config.label_smoothing = config.label_smoothing
    # the weights the flags add (halting) start from their initialisation; any other missing weight is refused
    return load_initial_checkpoint(DepthAdaptiveForConditionalGeneration, model_args, stage_config)


class DepthAdaptiveSeq2SeqTrainer(FlexformersSeq2SeqTrainer):
    """``Seq2SeqTrainer`` whose training logs carry L_dec (Eq. 4/5) and L_exit (Eq. 6) besides the total (Eq. 7)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._depth_adaptive_sums: dict[str, float] = {}
        self._depth_adaptive_count = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training:
            for name in ("decoding_loss", "exit_loss"):
                value = getattr(outputs, name, None) if not isinstance(outputs, dict) else outputs.get(name)
                if value is not None:
                    self._depth_adaptive_sums[name] = self._depth_adaptive_sums.get(name, 0.0) + float(value.detach())
            self._depth_adaptive_count += 1
        return (loss, outputs) if return_outputs else loss

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """Trainer's loop, plus the cross-entropy of the returned logits (``logits_loss``, label-smoothed like a
        baseline's ``eval_loss``; ``logits_nll_loss`` and its perplexity): ``eval_loss`` is the training objective
        (Eq. 7: all exits and the halting loss), which no baseline's loss compares with."""
        sums: dict[str, float] = {}
        batches = [0]

        def collect(module, args, output):
            values = {name: getattr(output, name, None) for name in ("logits_loss", "logits_nll_loss")}
            if values["logits_loss"] is None:  # generate()'s own forward calls carry no labels
                return
            for name, value in values.items():
                sums[name] = sums.get(name, 0.0) + float(value)
            batches[0] += 1

        handle = unwrap_model(self.model).register_forward_hook(collect)
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        finally:
            handle.remove()
        if batches[0]:
            for name, total in sums.items():
                output.metrics[f"{metric_key_prefix}_{name}"] = round(total / batches[0], 4)
            output.metrics[f"{metric_key_prefix}_logits_perplexity"] = round(
                math.exp(min(sums["logits_nll_loss"] / batches[0], 50.0)), 4
            )
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._depth_adaptive_count:
            for name, total in self._depth_adaptive_sums.items():
                logs[f"depth_adaptive/{name}"] = round(total / self._depth_adaptive_count, 4)
            self._depth_adaptive_sums, self._depth_adaptive_count = {}, 0
        super().log(logs, start_time)


def depth_adaptive_figures(model, batch, target_tokenizer, generate_kwargs) -> dict:
    """The average exit with confidence thresholds, and how many outputs that changes against the full depth."""
    # the test decoding runs the full depth; here each token leaves at the first block whose classifier is confident
    # enough (the paper's confidence thresholds, 0.5 unless configured), greedy on both sides
    full = model.generate(**batch, **generate_kwargs, num_beams=1, exit_strategy="full")
    adaptive = model.generate(**batch, **generate_kwargs, num_beams=1, exit_strategy="confidence", return_exits=True)
    emitted = adaptive.exits[adaptive.exits > 0].float()
    texts = [target_tokenizer.batch_decode(ids, skip_special_tokens=True) for ids in (full, adaptive.sequences)]
    same = [a == b for a, b in zip(*texts)]
    blocks = model.config.decoder_layers
    return {f"confidence exit (thresholds {model.config.default_exit_thresholds}), average exit of {blocks} "
            f"blocks": round(emitted.mean().item(), 2),
            "confidence exit, outputs equal to the full depth's (greedy)": round(sum(same) / len(same), 3)}


#: Depth-Adaptive's threshold sweep: sampled threshold vectors and validation sentences (the paper: 10k vectors on
#: the whole validation set; 40 decodes of 500 sentences at beam 4 take about 8 minutes on two cores).
DEPTH_ADAPTIVE_SWEEP = (40, 500)


def depth_adaptive_reference(result: dict, results: list[dict]) -> dict | None:
    """The full-depth model without exits that a Depth-Adaptive recipe is read against: a finished baseline recipe
    of the same task, size and blocks trained from scratch (one output classifier), of the same seed when that one is
    finished, since the seeds draw different initializations and batches. The blocks are the recorded architectures
    where both results have one: a recipe trained on from another's model (the halting stage) names no overrides of
    its own, its blocks come from the checkpoint."""
    recipe = result["recipe"]

    def same_blocks(other: dict) -> bool:
        if result.get("architecture") and other.get("architecture"):
            return other["architecture"] == result["architecture"]
        return (other["recipe"].get("overrides") or "") == (recipe.get("overrides") or "")

    candidates = [other for other in results if other["recipe"]["task"] == recipe["task"]
                  and is_baseline_result(other) and not other["recipe"].get("init_from")
                  and other["recipe"].get("size") == recipe.get("size") and same_blocks(other)]
    return (same_seed_first(candidates, result) or [None])[0]


def depth_adaptive_lines(result: dict, reference: dict | None) -> list[str]:
    """ZOO.md's table of a Depth-Adaptive recipe: the test split at every fixed exit and at its confidence
    thresholds, each beside the full-depth reference, with the FLOPs per output token of Appendix B."""
    figures, name = result["figures"]["depth_adaptive"], result["recipe"]["name"]
    reference_bleu = None if reference is None else reference["test"]["metrics"]["bleu"]
    if reference is None:
        about = "its full-depth reference without exits has not finished yet"
    else:
        about = (f"reference: `{reference['recipe']['name']}`, the same blocks without exits, test BLEU "
                 f"{reference_bleu:.2f} ({reference['parameters']:,} parameters)")
    lines = ["", f"### Depth-Adaptive: `{name}` against its full depth", "",
             f"Test split, beam {result['test']['num_beams']}; {about}. FLOPs per output token as in the paper's "
             "Appendix B (confidence exits pay for the output classifier at every block they pass).", "",
             "| decoding | test BLEU | − reference | average exit | FLOPs per token |", "|---|---|---|---|---|"]

    def row(label: str, scores: dict) -> str:
        difference = "—" if reference_bleu is None else f"{scores['bleu'] - reference_bleu:+.2f}"
        return (f"| {label} | {scores['bleu']:.2f} | {difference} | {scores['average_exit']:.2f} | "
                f"{scores['flops_per_token'] / 1e6:.2f} M |")

    for block, scores in sorted(figures["fixed_exits"].items(), key=lambda item: int(item[0])):
        lines.append(row(f"fixed exit {block}", scores))
    confidence = figures["confidence"]
    thresholds = ", ".join(f"{t:.2f}" for t in confidence.get("thresholds") or [])
    lines.append(row(f"confidence exits, τ = ({thresholds})", confidence))
    if "halting" in figures:
        lines.append(row(f"halting exits ({figures['halting']['mechanism']}, trained)", figures["halting"]))
    if "validation_fixed_exits" in figures:
        full = figures["validation_fixed_exits"][str(len(figures["fixed_exits"]))]
        lines += ["", f"How the thresholds were chosen: {confidence['chosen_on']}. On those sentences the full depth "
                      f"scores {full['bleu']:.2f}; the sweep's Pareto front ({len(figures['validation_pareto_front'])} "
                      "points): " + ", ".join(f"{p['bleu']:.2f} at AE {p['average_exit']:.2f}"
                                              for p in figures["validation_pareto_front"]) + "."]
    return lines


def plot_depth_adaptive(result: dict, reference: dict | None, path: Path) -> None:
    """BLEU vs average exit as in the paper's Fig. 3: the validation sweep (its Pareto front and fixed exits) on the
    left, the test split (fixed exits, the chosen thresholds, the full-depth reference) on the right: two panels,
    since the two splits score on different scales."""
    import matplotlib.pyplot as plt

    figures = result["figures"]["depth_adaptive"]
    figure, (validation, test) = plt.subplots(1, 2, figsize=(9, 3.8))

    def fixed_line(axis, rows: dict, label: str) -> None:
        ordered = sorted(rows.items(), key=lambda item: int(item[0]))
        axis.plot([r["average_exit"] for _, r in ordered], [r["bleu"] for _, r in ordered], marker="s", label=label)

    front = figures["validation_pareto_front"]
    validation.plot([r["average_exit"] for r in front], [r["bleu"] for r in front], marker="o", alpha=0.7,
                    label="threshold sweep, Pareto front")
    if "validation_fixed_exits" in figures:
        fixed_line(validation, figures["validation_fixed_exits"], "fixed exit")
    validation.set_title(f"validation ({figures.get('validation_examples', '')} sentences)", fontsize=9)
    fixed_line(test, figures["fixed_exits"], "fixed exit")
    test.plot([figures["confidence"]["average_exit"]], [figures["confidence"]["bleu"]], marker="*", markersize=13,
              linestyle="none", label="confidence, thresholds from validation")
    if "halting" in figures:
        test.plot([figures["halting"]["average_exit"]], [figures["halting"]["bleu"]], marker="P", markersize=11,
                  linestyle="none", label=f"halting ({figures['halting']['mechanism']})")
    if reference is not None:
        test.axhline(reference["test"]["metrics"]["bleu"], color="black", linestyle="--",
                     label=f"{reference['recipe']['name']} (no exits)")
    test.set_title("test", fontsize=9)
    for axis in (validation, test):
        axis.set_xlabel("average exit (decoder blocks)")
        axis.set_ylabel("BLEU")
        axis.legend(fontsize=7)
    figure.suptitle(f"Depth-Adaptive: BLEU vs average exit ({result['recipe']['name']})", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def depth_adaptive_zoo_analysis(recipe, output_dir, test_sources, smoke, test_hypotheses) -> dict:
    """The paper's protocol (Sec. 3.2, 4.4) on a trained zoo recipe: a threshold sweep on the validation split
    beside its fixed exits, then the test split at every fixed exit and at the cheapest swept thresholds that reach
    the validation BLEU of the full depth; a model trained with a halting mechanism (the second stage, Sec. 4.1) is
    also decoded on the test split with the exits its mechanism decides."""
    from flexformers.training_scripts import depth_adaptive_tools

    common = ["--model_name_or_path", str(output_dir), "--num_beams", "1" if smoke else str(recipe.test_beams),
              "--batch_size", "64"] + (["--max_samples", "4", "--max_new_tokens", "8"] if smoke else [])
    sweep = depth_adaptive_tools.run_from_argv([
        "threshold-search", *common, "--split", "validation", "--exit_strategy", "confidence",
        "--num_samples", "3" if smoke else str(DEPTH_ADAPTIVE_SWEEP[0]),
        *([] if smoke else ["--max_samples", str(DEPTH_ADAPTIVE_SWEEP[1])]),
        "--output_dir", str(output_dir / "threshold_search"),
    ])
    chosen = sweep["matching_full_depth"]
    evaluated = depth_adaptive_tools.run_from_argv([
        "evaluate", *common, "--split", "test", "--exit_strategy", "confidence", "--all_fixed_exits",
        "--exit_thresholds", ",".join(f"{threshold:.6f}" for threshold in chosen["thresholds"])])
    halting = {}
    mechanism = json.loads((Path(output_dir) / "config.json").read_text(encoding="utf-8")).get("halting_mechanism")
    if mechanism not in (None, "none"):  # a trained halting mechanism (the second stage) decides exits by itself
        decided = depth_adaptive_tools.run_from_argv(["evaluate", *common, "--split", "test", "--exit_strategy",
                                                      "halting"])
        halting = {"halting": {"mechanism": mechanism,
                               **{k: decided[k] for k in ("bleu", "chrf", "average_exit", "flops_per_token")}}}
    return {"depth_adaptive": {
        **halting,
        "confidence": {**{k: evaluated[k] for k in ("bleu", "chrf", "average_exit", "flops_per_token")},
                       "thresholds": evaluated["exit_thresholds"],
                       "chosen_on": f"validation, first {sweep['num_examples']} sentences: the cheapest swept "
                                    "thresholds reaching the full depth's BLEU (else the best)"},
        "fixed_exits": {block: {k: row[k] for k in ("bleu", "average_exit", "flops_per_token")}
                        for block, row in evaluated["fixed_exits"].items()},
        "validation_examples": sweep["num_examples"],
        "validation_fixed_exits": {str(row["fixed_exit"]): {k: row[k] for k in ("bleu", "average_exit",
                                                                                 "flops_per_token")}
                                   for row in sweep["fixed_exits"]},
        "validation_pareto_front": [{k: row[k] for k in ("bleu", "average_exit", "flops_per_token", "thresholds")}
                                    for row in sweep["pareto_front"]],
    }}


def depth_adaptive_zoo_figures_text(figures: dict) -> list[str]:
    """The zoo table's figures cell: the plain figures, then the confidence exit chosen on validation."""
    from flexformers.training_scripts.zoo_report import plain_figure_parts

    parts = plain_figure_parts(figures, leave_out=("depth_adaptive",))
    adaptive = figures.get("depth_adaptive")
    if adaptive:
        chosen = " (thresholds chosen on validation)" if "chosen_on" in adaptive["confidence"] else ""
        parts.append(f"confidence exit{chosen}: BLEU {adaptive['confidence']['bleu']:.2f} at average exit "
                     f"{adaptive['confidence']['average_exit']:.2f}")
        if "halting" in adaptive:
            parts.append(f"halting exit ({adaptive['halting']['mechanism']}): BLEU {adaptive['halting']['bleu']:.2f} "
                         f"at average exit {adaptive['halting']['average_exit']:.2f}")
    return parts


def depth_adaptive_zoo_report(results: list[dict], spread: list[dict], plots_dir: Path) -> tuple[list, list]:
    """ZOO.md's section and BLEU-vs-exit plot of every Depth-Adaptive result, each against its full-depth reference."""
    lines, plots = [], []
    for result in (r for r in results if "depth_adaptive" in r["figures"]):
        reference = depth_adaptive_reference(result, results)
        lines += depth_adaptive_lines(result, reference)
        path = plots_dir / f"depth_adaptive_{result['recipe']['name']}.png"
        plot_depth_adaptive(result, reference, path)
        plots.append((f"Depth-Adaptive: BLEU vs average exit, {result['recipe']['name']}", path))
    return lines, plots


SPEC = MethodSpec(
    model_type="depth_adaptive",
    config_class=DepthAdaptiveConfig,
    model_class=DepthAdaptiveForConditionalGeneration,
    arguments_class=DepthAdaptiveArguments,
    build_model=build_depth_adaptive_model,
    trainer_class=DepthAdaptiveSeq2SeqTrainer,
    update_config=apply_depth_adaptive_flags,
    name="Depth-Adaptive Transformer",
    figures=depth_adaptive_figures,
    zoo_analysis=depth_adaptive_zoo_analysis,
    zoo_figures_text=depth_adaptive_zoo_figures_text,
    zoo_report=depth_adaptive_zoo_report,
    description="Depth-Adaptive Transformer: per-block classifiers, halting mechanisms, early-exit decoding "
    "(Elbayad et al., 2020)",
)
