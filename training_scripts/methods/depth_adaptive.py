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
import math

from transformers import Seq2SeqTrainer

from flexformers.configuration.configuration_depth_adaptive import DepthAdaptiveConfig
from flexformers.modeling.modeling_depth_adaptive import DepthAdaptiveForConditionalGeneration
from flexformers.training_scripts.model_registry import MethodSpec, load_initial_checkpoint

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


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


class DepthAdaptiveSeq2SeqTrainer(Seq2SeqTrainer):
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

        handle = _unwrap(self.model).register_forward_hook(collect)
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


SPEC = MethodSpec(
    model_type="depth_adaptive",
    config_class=DepthAdaptiveConfig,
    model_class=DepthAdaptiveForConditionalGeneration,
    arguments_class=DepthAdaptiveArguments,
    build_model=build_depth_adaptive_model,
    trainer_class=DepthAdaptiveSeq2SeqTrainer,
    update_config=apply_depth_adaptive_flags,
    description="Depth-Adaptive Transformer: per-block classifiers, halting mechanisms, early-exit decoding "
    "(Elbayad et al., 2020)",
)
