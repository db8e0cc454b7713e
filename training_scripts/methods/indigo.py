"""InDIGO (model type ``indigo``) in the common training script.

    flexformers-train --model_type indigo --preset transformer_iwslt_de_en --task word_order \\
        --order l2r --indigo_encoder_positions false --output_dir runs/indigo-l2r
    flexformers-train --model_type indigo --task word_order --order sao --sao_bootstrap_steps 6000 ...
    flexformers-train --model_type indigo --order sao --model_name_or_path runs/indigo-l2r ...   # bootstrapped

- :class:`InDIGOArguments`: the generation order used for training (Table 1's pre-defined orders or ``sao``), the
  SAO search settings (Sec. 4.2) and the encoder-position switch for word order recovery.
- :class:`SAOBootstrapCallback`: trains with L2R for ``--sao_bootstrap_steps`` optimisation steps, then with
  searched orders (the paper bootstraps from a model pre-trained 6,000 steps in L2R).
- :class:`InDIGOSeq2SeqTrainer`: computes the CF/RF frequency cutoff from the training targets and logs the
  word and position losses separately.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from transformers import TrainerCallback

from flexformers.configuration.configuration_indigo import InDIGOConfig
from flexformers.modeling.indigo_insertion import SAO_ORDER_WEIGHTINGS, START_PAIR_LENGTH
from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration
from flexformers.training_scripts.indigo_orders import (
    ALL_ORDERS,
    InDIGODataCollator,
    common_token_ids_by_frequency,
    load_spacy_pipeline,
)
from flexformers.training_scripts.model_registry import MethodSpec, load_initial_checkpoint
from flexformers.training_scripts.trainer import FlexformersSeq2SeqTrainer
from flexformers.training_scripts.zoo_statistics import baseline_spread, flag_value, same_seed_first, seed_group


@dataclass
class InDIGOArguments:
    order: str = field(
        default="l2r",
        metadata={"help": f"Training generation order: one of {', '.join(ALL_ORDERS)} (Table 1; 'sao' = searched adaptive order, Sec. 4.2)."},
    )
    sao_beam_size: int = field(default=8, metadata={"help": "SAO: beam width B of the permutation search (paper: 8)."})
    sao_bootstrap_steps: int = field(
        default=0,
        metadata={"help": "SAO: optimisation steps trained with L2R before searching orders (paper: 6000; 0 = search "
                  "from the first step, e.g. when --model_name_or_path is an L2R-trained InDIGO)."},
    )
    sao_search_dropout: bool = field(
        default=True, metadata={"help": "SAO: keep dropout on during the search (the paper's noise)."}
    )
    sao_cuda_graphs: bool = field(
        default=False,
        metadata={"help": "SAO: on a GPU, replay the search as CUDA graphs, one per batch shape (H100, batch 32: the "
                  "SAO step 7.3x -> 2.6x an L2R step); a shape is captured at its second batch, so it pays when "
                  "batches come in few shapes."},
    )
    sao_train_orders: int | None = field(
        default=None,
        metadata={"help": "SAO: train on the best k of the B found orders (default: all B, Eq. 12)."},
    )
    sao_order_weighting: str = field(
        default="uniform",
        metadata={"help": "SAO: 'uniform' over the found orders (Eq. 12) or 'posterior' (q proportional to p(y_pi|x) on the beam)."},
    )
    indigo_encoder_positions: bool | None = field(
        default=None,
        metadata={"help": "Absolute positions in the encoder; false for word order recovery (a bag of words)."},
    )
    spacy_model: str = field(default="en_core_web_sm", metadata={"help": "spaCy pipeline of the 'syn' order."})
    order_seed: int = field(default=0, metadata={"help": "Seed of the 'rnd' order's permutations."})

    def __post_init__(self):
        if self.order not in ALL_ORDERS:
            raise ValueError(f"--order must be one of {', '.join(ALL_ORDERS)}, got {self.order!r}")
        if self.sao_beam_size < 1:
            raise ValueError(f"--sao_beam_size must be >= 1, got {self.sao_beam_size}")
        if self.sao_bootstrap_steps < 0:
            raise ValueError(f"--sao_bootstrap_steps must be >= 0, got {self.sao_bootstrap_steps}")
        if self.sao_order_weighting not in SAO_ORDER_WEIGHTINGS:
            raise ValueError(f"--sao_order_weighting must be one of {SAO_ORDER_WEIGHTINGS}, got {self.sao_order_weighting!r}")
        if self.sao_train_orders is not None and not 1 <= self.sao_train_orders <= self.sao_beam_size:
            raise ValueError(f"--sao_train_orders must be in [1, --sao_beam_size], got {self.sao_train_orders}")


def update_indigo_config(config: InDIGOConfig, method_args: InDIGOArguments | None) -> InDIGOConfig:
    if method_args is not None and method_args.indigo_encoder_positions is not None:
        config.encoder_use_positions = method_args.indigo_encoder_positions
        if not config.encoder_use_positions:
            config.encoder_learned_pos = False
        config.validate_fields()
    return config


def build_indigo_model(model_args, method_args, config, tokenizer):
    """A fresh model, or ``--model_name_or_path`` (e.g. an L2R-trained InDIGO to bootstrap SAO from), with the SAO
    settings attached."""
    checkpoint = getattr(model_args, "model_name_or_path", None)
    model = (load_initial_checkpoint(InDIGOForConditionalGeneration, model_args, config) if checkpoint
             else InDIGOForConditionalGeneration(config))
    if method_args is not None:
        model.sao_beam_size = method_args.sao_beam_size
        model.sao_search_dropout = method_args.sao_search_dropout
        model.sao_search_cuda_graphs = method_args.sao_cuda_graphs
        model.sao_train_orders = method_args.sao_train_orders
        model.sao_order_weighting = method_args.sao_order_weighting
        model.use_searched_orders = method_args.order == "sao" and method_args.sao_bootstrap_steps == 0
    return model


def make_indigo_collator(tokenizer, model, method_args):
    method_args = method_args or InDIGOArguments()
    config = model.config
    return InDIGODataCollator(
        order=method_args.order,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        eod_token_id=config.eod_token_id,
        # CF/RF: the cutoff is computed from the training targets by InDIGOSeq2SeqTrainer.
        common_token_ids=set() if method_args.order in ("cf", "rf") else None,
        tokenizer=tokenizer,
        spacy_nlp=load_spacy_pipeline(method_args.spacy_model) if method_args.order == "syn" else None,
        seed=method_args.order_seed,
    )


class SAOBootstrapCallback(TrainerCallback):
    """Switch the model from the L2R order to searched orders after ``bootstrap_steps`` optimisation steps."""

    def __init__(self, bootstrap_steps: int):
        self.bootstrap_steps = bootstrap_steps

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            model.use_searched_orders = state.global_step >= self.bootstrap_steps


def make_indigo_callbacks(method_args) -> list:
    if method_args is not None and method_args.order == "sao":
        return [SAOBootstrapCallback(method_args.sao_bootstrap_steps)]
    return []


class InDIGOSeq2SeqTrainer(FlexformersSeq2SeqTrainer):
    """Seq2SeqTrainer that fills the CF/RF frequency cutoff from the training targets (Sec. 5.1: common and rare
    halves of about equal size) and logs the word and position losses (Eq. 10) next to the total."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        collator = self.data_collator
        if isinstance(collator, InDIGODataCollator) and collator.order in ("cf", "rf") and not collator.common_token_ids:
            if self.train_dataset is None:
                raise ValueError("--order cf/rf needs a training set to compute the frequency cutoff")
            special = {collator.bos_token_id, collator.eos_token_id, collator.eod_token_id, collator.pad_token_id}
            collator.common_token_ids = common_token_ids_by_frequency(self.train_dataset["labels"], exclude=special)
        self._indigo_loss_sums = {"word_loss": 0.0, "position_loss": 0.0, "count": 0}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training and getattr(outputs, "word_loss", None) is not None:
            self._indigo_loss_sums["word_loss"] += float(outputs.word_loss.detach())
            self._indigo_loss_sums["position_loss"] += float(outputs.position_loss.detach())
            self._indigo_loss_sums["count"] += 1
        return (loss, outputs) if return_outputs else loss

    def log(self, logs, *args, **kwargs):
        count = self._indigo_loss_sums["count"]
        if count and "loss" in logs:
            logs["word_loss"] = round(self._indigo_loss_sums["word_loss"] / count, 4)
            logs["position_loss"] = round(self._indigo_loss_sums["position_loss"] / count, 4)
            self._indigo_loss_sums = {"word_loss": 0.0, "position_loss": 0.0, "count": 0}
        super().log(logs, *args, **kwargs)


def indigo_figures(model, batch, target_tokenizer, generate_kwargs) -> dict:
    """The share of greedy insertions made right of the previously inserted word (left to right)."""
    # insertion index 0 is <s>, 1 is </s>, k + 2 the k-th generated word: a left-to-right step inserts the k-th word
    # right of word k - 1 (the first right of <s>)
    trace = model.generate(**batch, **generate_kwargs, return_insertion_trace=True).insertion_trace
    steps = [(k, step) for sentence in trace for k, step in enumerate(sentence)]
    left_to_right = sum(1 for k, (_, anchor, side, _) in steps if side == "right" and anchor == (k + 1 if k else 0))
    return {"insertions right of the previous word (left-to-right share)": round(left_to_right / max(len(steps), 1), 3)}


def indigo_order_bars(indigo: list[dict], task: str) -> dict[str, list[float]]:
    """The test BLEU of each InDIGO configuration on ``task``, its seeds together, keyed by the configuration's short
    name (``indigo-sao-word-order-s2`` -> ``sao``) in the order the recipes first appear: one bar per order, not
    one per seed."""
    bars: dict[str, list[float]] = {}
    for result in indigo:
        name = seed_group(result["recipe"]["name"]).removeprefix("indigo-").removesuffix(f"-{task.replace('_', '-')}")
        bars.setdefault(name, []).append(result["test"]["metrics"]["bleu"])
    return bars


def indigo_order_lines(results: list[dict], spread: list[dict]) -> list[str]:
    """ZOO.md's table of InDIGO's generation orders on each task, every one beside L2R (the claim: SAO >= L2R,
    Sec. 5) and the left-to-right baseline's seeds decoded with and without the output constraint."""
    lines = []
    for task in sorted({r["recipe"]["task"] for r in results if r["recipe"]["model_type"] == SPEC.model_type}):
        indigo = [r for r in results if r["recipe"]["model_type"] == SPEC.model_type and r["recipe"]["task"] == task]
        lines += ["", f"### InDIGO on {task}: generation orders against L2R", "",
                  f"Test split, beam {indigo[0]['test']['num_beams']}, outputs not constrained. Each order is read "
                  "against L2R trained from the same start for the same updates (a recipe trained on from another "
                  "model, as SAO from L2R, against L2R trained on from it alike), else against L2R from scratch. "
                  "The left-to-right share is over greedy insertions on 500 test sentences.", "",
                  "| training order | recipe | updates | test BLEU | chrF | TER | − L2R | that L2R run | "
                  "left-to-right share |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for result in indigo:
            recipe, metrics = result["recipe"], result["test"]["metrics"]
            reference = l2r_reference(result, indigo)
            difference = "—" if reference is None else \
                f"{metrics['bleu'] - reference['test']['metrics']['bleu']:+.2f}"
            start = f"{result['updates']:,}" + (f" after `{recipe['init_from']}`" if recipe.get("init_from") else "")
            share = next((value for name, value in result["figures"].items() if "left-to-right share" in name), "—")
            lines.append(f"| {training_order(result)} | {recipe['name']} | {start} | {metrics['bleu']:.2f} | "
                         f"{metrics['chrf']:.2f} | {metrics['ter']:.2f} | {difference} | "
                         f"{'—' if reference is None else reference['recipe']['name']} | {share} |")
        baseline = baseline_spread(spread, task)
        if baseline is not None:
            constraint = next((r["test"].get("output_constraint") for r in results
                               if seed_group(r["recipe"]["name"]) == baseline["group"]), None)
            scores = [f"{baseline['bleu']['mean']:.2f} ± {baseline['bleu']['sd']:.2f}"
                      + (f" with outputs constrained to a {constraint}" if constraint else "")]
            if "unconstrained_bleu" in baseline:
                scores.append(f"{baseline['unconstrained_bleu']['mean']:.2f} ± "
                              f"{baseline['unconstrained_bleu']['sd']:.2f} without the constraint")
            lines += ["", f"The left-to-right Transformer baseline (`{baseline['group']}`, {len(baseline['seeds'])} "
                          f"seeds, same width and depth, trained from scratch for the L2R run's updates): test BLEU "
                          f"{', and '.join(scores)}."]
    return lines


def l2r_reference(result: dict, indigo: list[dict]) -> dict | None:
    """The InDIGO L2R run that ``result`` is read against: trained from the same start (another recipe's model,
    or scratch) for the same updates when there is one, else from scratch; of the same seed when that one is
    finished, since seeds draw different initializations and batches (None for that run itself and its seeds)."""
    group = seed_group(result["recipe"]["name"])
    l2r = [r for r in indigo if training_order(r) == "l2r" and seed_group(r["recipe"]["name"]) != group]
    start = result["recipe"].get("init_from")
    same_start = [r for r in l2r if r["recipe"].get("init_from") == start and r["updates"] == result["updates"]]
    from_scratch = [r for r in l2r if not r["recipe"].get("init_from")]
    return (same_seed_first(same_start, result) or same_seed_first(from_scratch, result) or [None])[0]


def training_order(result: dict) -> str:
    return flag_value(result["recipe"], "--order") or "l2r"


def indigo_zoo_report(results: list[dict], spread: list[dict], plots_dir: Path) -> tuple[list, list]:
    """ZOO.md's section of InDIGO's generation orders on each task against L2R (the claim: SAO >= L2R), and a bar
    plot of the orders' test BLEU beside copying the input and the left-to-right baseline."""
    import matplotlib.pyplot as plt

    lines, plots = indigo_order_lines(results, spread), []
    for task in sorted({r["recipe"]["task"] for r in results if r["recipe"]["model_type"] == SPEC.model_type}):
        indigo = [r for r in results if r["recipe"]["model_type"] == SPEC.model_type and r["recipe"]["task"] == task]
        figure, axis = plt.subplots(figsize=(8, 4))
        bars = indigo_order_bars(indigo, task)
        means = [statistics.mean(seeds) for seeds in bars.values()]
        axis.bar(range(len(bars)), means, color="tab:blue")
        # the score goes under its bar's name: above or inside the bar, the seeds' dots and the lines cover it
        axis.set_xticks(range(len(bars)), [f"{order}\n{mean:.2f}" + (f"\n{len(seeds)} seeds" if len(seeds) > 1 else "")
                                           for order, mean, seeds in zip(bars, means, bars.values())])
        seeded = [(position, seeds) for position, seeds in enumerate(bars.values()) if len(seeds) > 1]
        if seeded:
            axis.scatter([position for position, seeds in seeded for _ in seeds],
                         [score for _, seeds in seeded for score in seeds], color="black", s=8, zorder=3,
                         label="each seed (bar: their mean)")
        scores = [score for seeds in bars.values() for score in seeds]
        axis.axhline(indigo[0]["test"]["copy_baseline"]["bleu"], color="black", linestyle="--",
                     label="copying the input")
        baseline = baseline_spread(spread, task)
        if baseline is not None:
            has_unconstrained = "unconstrained_bleu" in baseline
            axis.axhline(baseline["unconstrained_bleu" if has_unconstrained else "bleu"]["mean"], color="tab:green",
                         linestyle=":", label=f"left-to-right baseline{', unconstrained' if has_unconstrained else ''} "
                                              f"({len(baseline['seeds'])} seeds)")
        axis.set_ylabel("test BLEU")
        axis.set_title(f"InDIGO on {task}: generation orders (SAO vs L2R and the predefined orders)", fontsize=9)
        axis.tick_params(axis="x", labelsize=7)
        # headroom above the tallest bar or line, so the legend covers no bar
        axis.set_ylim(0, 1.3 * max(scores + [line.get_ydata()[0] for line in axis.get_lines()]))
        axis.legend(fontsize=7, loc="upper right")
        figure.tight_layout()
        path = plots_dir / f"indigo_orders_{task}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        plots.append((f"InDIGO on {task}: SAO vs L2R", path))
    return lines, plots


def syn_spacy_pipeline(flags) -> str | None:
    """The spaCy pipeline that training with these flags parses its targets with (the SYN order), or None."""
    recipe = {"flags": list(flags)}
    if flag_value(recipe, "--order") != "syn":
        return None
    return flag_value(recipe, "--spacy_model") or "en_core_web_sm"


@functools.lru_cache(maxsize=None)
def spacy_pipeline_missing(name: str) -> str | None:
    """Why the spaCy pipeline ``name`` cannot parse here (spaCy or the pipeline is not installed), or None; loaded
    once a process."""
    from flexformers.training_scripts.indigo_orders import load_spacy_pipeline

    try:
        load_spacy_pipeline(name)
    except ValueError as error:
        return str(error)
    return None


def indigo_missing_requirement(flags) -> str | None:
    """A SYN-order recipe needs spaCy and its English pipeline (the optional ``syn`` extra)."""
    pipeline = syn_spacy_pipeline(flags)
    missing = None if pipeline is None else spacy_pipeline_missing(pipeline)
    return None if missing is None else f"it parses its targets with spaCy (InDIGO's SYN order): {missing}"


SPEC = MethodSpec(
    model_type="indigo",
    config_class=InDIGOConfig,
    model_class=InDIGOForConditionalGeneration,
    arguments_class=InDIGOArguments,
    build_model=build_indigo_model,
    data_collator=make_indigo_collator,
    callbacks=make_indigo_callbacks,
    trainer_class=InDIGOSeq2SeqTrainer,
    update_config=update_indigo_config,
    name="InDIGO",
    decodes_left_to_right=False,
    decoder_tokens_beyond_target=START_PAIR_LENGTH - 1,
    compares_own_starts=True,
    figures=indigo_figures,
    missing_requirement=indigo_missing_requirement,
    zoo_report=indigo_zoo_report,
    description="InDIGO insertion Transformer (relative positions, pointer), pre-defined orders or SAO",
)
