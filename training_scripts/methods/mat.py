"""MAT (model type ``mat``): multi-branch attention, drop-branch, proximal initialisation.

Extra flags (``--model_type mat``):

- ``--baseline_checkpoint DIR``: proximal initialisation (Sec. 3.3): clone a trained flexformer baseline saved in
  ``DIR`` into every branch, then train on (fresh optimizer, as in the official code). The MAT fields of the
  config (``--config_overrides "encoder_attention_branches=2,decoder_attention_branches=2,drop_branch_rate=0.2"``
  or a MAT preset) are applied on top of the baseline's architecture; the baseline's shapes win.

Presets: every backbone preset plus ``MAT_PRESETS`` (e.g. ``mat_iwslt_de_en`` = 2/256/2048, ρ = 0.2).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from flexformers.configuration.configuration_mat import MATConfig
from flexformers.modeling.modeling_mat import MATForConditionalGeneration
from flexformers.training_scripts.model_registry import ALLOW_MISSING_WEIGHTS_HINT, MethodSpec, load_initial_checkpoint

# Config fields a proximal initialisation takes from the training config (everything else is the baseline's).
PROXIMAL_INIT_FIELDS = (
    "encoder_attention_branches",
    "decoder_attention_branches",
    "encoder_ffn_branches",
    "decoder_ffn_branches",
    "drop_branch_rate",
    "ffn_drop_branch_rate",
    "drop_head_rate",
    "branch_merge",
    "dropout",
    "attention_dropout",
    "activation_dropout",
    "label_smoothing",
)


@dataclasses.dataclass
class MATArguments:
    baseline_checkpoint: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Proximal initialisation (MAT Sec. 3.3): directory of a trained flexformer baseline whose "
            "attention (and FFN, for N_f > 1) layers are cloned into every branch."
        },
    )


def load_baseline(baseline: str, model_args):
    """The flexformer baseline of a proximal initialisation with every weight loaded (a weight missing from its
    file would be cloned, randomly initialised, into every branch), unless ``--allow_missing_weights``. Anything
    but a flexformer checkpoint directory is passed on as given, for ``from_baseline`` to refuse by name."""
    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration
    from flexformers.training_scripts.model_loading import load_pretrained_checked

    try:
        model_type = json.loads((Path(baseline) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return baseline
    if model_type != FlexformerForConditionalGeneration.config_class.model_type:
        return baseline
    return load_pretrained_checked(
        FlexformerForConditionalGeneration, baseline,
        allow_missing_weights=bool(getattr(model_args, "allow_missing_weights", False)),
        allow_hint=ALLOW_MISSING_WEIGHTS_HINT,
    )


def build_mat_model(model_args, method_args, config: MATConfig, tokenizer) -> MATForConditionalGeneration:
    """Resume a MAT checkpoint, proximally initialise from a baseline, or start from scratch, in that order."""
    checkpoint = getattr(model_args, "model_name_or_path", None)
    baseline = getattr(method_args, "baseline_checkpoint", None) if method_args is not None else None
    if checkpoint and baseline:
        raise ValueError("Give either --model_name_or_path (a MAT checkpoint) or --baseline_checkpoint, not both")
    if checkpoint:
        return load_initial_checkpoint(MATForConditionalGeneration, model_args, config)
    if baseline:
        overrides = {name: getattr(config, name) for name in PROXIMAL_INIT_FIELDS}
        return MATForConditionalGeneration.from_baseline(load_baseline(baseline, model_args), **overrides)
    return MATForConditionalGeneration(config)


def mat_figures(model, batch, target_tokenizer, generate_kwargs) -> dict:
    """MAT's branches (its decoding is the baseline's)."""
    config = model.config
    return {"attention branches (encoder/decoder)": f"{config.encoder_attention_branches}/"
            f"{config.decoder_attention_branches}", "drop-branch rate": getattr(config, "drop_branch_rate", None)}


def mat_zoo_start_flags(initial_dir: str) -> list[str]:
    """A MAT recipe that starts from a baseline recipe's model is its proximal initialisation: the baseline's
    weights copied into every branch of an architecture the recipe's preset builds, with the baseline's tokenizer."""
    return ["--baseline_checkpoint", initial_dir, "--tokenizer_name_or_path", initial_dir]


SPEC = MethodSpec(
    model_type="mat",
    config_class=MATConfig,
    model_class=MATForConditionalGeneration,
    arguments_class=MATArguments,
    build_model=build_mat_model,
    name="MAT",
    figures=mat_figures,
    zoo_start_flags=mat_zoo_start_flags,
    description="Multi-branch Attentive Transformer (drop-branch, drop-head, proximal initialisation)",
)
