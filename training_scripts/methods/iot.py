"""IOT (model type ``iot``) in the common training script.

``flexformers-train --model_type iot --preset transformer_codegen_small --iot_decoder_orders 1,4,6 ...``

- :class:`IOTArguments`: the IOT flags (order candidates, ablation mode, Gumbel temperature schedule, loss
  coefficients); anything left unset keeps the :class:`IOTConfig` default (the paper's settings).
- :class:`GumbelTemperatureCallback`: sets the model's Gumbel-softmax temperatures from the schedule at every
  optimisation step.
- :class:`IOTSeq2SeqTrainer`: adds the order statistics the model accumulated since the last log (argmax order
  usage, mean predictor probabilities, per-order losses, L_D, L_S, τ) to every training log line, so the logs (and
  TensorBoard) show whether the predictor collapses onto one order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Seq2SeqTrainer, TrainerCallback

from flexformers.configuration.configuration_iot import IOTConfig
from flexformers.modeling.modeling_iot import IOTForConditionalGeneration
from flexformers.training_scripts.model_registry import MethodSpec


def parse_order_codes(flag: str, text: str) -> list[int]:
    """``"1,4,6"``, ``"1 4 6"`` or ``"146"`` → ``[1, 4, 6]`` (a ``ValueError`` naming the flag otherwise)."""
    cleaned = text.replace(",", " ").split()
    if len(cleaned) == 1 and cleaned[0].isdigit() and len(cleaned[0]) > 1:
        cleaned = list(cleaned[0])
    try:
        return [int(token) for token in cleaned]
    except ValueError:
        raise ValueError(f"--{flag} must be order codes such as '1,2,4,6', got {text!r}") from None


@dataclass
class IOTArguments:
    iot_decoder_orders: str | None = field(
        default=None,
        metadata={"help": "Decoder order candidates, paper Table 11 codes (1 SA-ED-FF ... 6 FF-ED-SA), e.g. '1,2,4,6'."},
    )
    iot_encoder_orders: str | None = field(
        default=None, metadata={"help": "Encoder order candidates: '1' (SA-FF), '2' (FF-SA) or '1,2'."}
    )
    iot_order_selection: str | None = field(
        default=None,
        metadata={"help": "'predictor' (IOT) or 'equal' (ablation 'setting (1)': all orders, weight 1, no predictor)."},
    )
    iot_gumbel_temperature: float | None = field(
        default=None, metadata={"help": "Initial Gumbel-softmax temperature of both predictors (paper code: 20)."}
    )
    iot_gumbel_temperature_min: float | None = field(default=None, metadata={"help": "Temperature floor."})
    iot_gumbel_temperature_decay_rate: float | None = field(
        default=None, metadata={"help": "r in tau = max(tau0 * exp(-r * floor(step/f) * f), tau_min); 0 = constant."}
    )
    iot_gumbel_temperature_update_freq: int | None = field(default=None, metadata={"help": "f (steps)."})
    iot_diversity_loss_coef: float | None = field(default=None, metadata={"help": "c1 of L_D (Eq. 5); paper 0.1."})
    iot_sharpness_loss_coef: float | None = field(default=None, metadata={"help": "c2 of L_S (Eq. 6); paper 0.01."})
    iot_order_prob_clamp: float | None = field(default=None, metadata={"help": "Probability clamp; paper 0.05."})


def update_iot_config(config: IOTConfig, method_args: IOTArguments | None) -> IOTConfig:
    """Copy the IOT flags that were given onto the config and re-validate it."""
    if method_args is None:
        return config
    if method_args.iot_decoder_orders is not None:
        config.decoder_orders = parse_order_codes("iot_decoder_orders", method_args.iot_decoder_orders)
    if method_args.iot_encoder_orders is not None:
        config.encoder_orders = parse_order_codes("iot_encoder_orders", method_args.iot_encoder_orders)
    if method_args.iot_gumbel_temperature is not None:
        config.encoder_gumbel_temperature = method_args.iot_gumbel_temperature
        config.decoder_gumbel_temperature = method_args.iot_gumbel_temperature
    simple = {
        "iot_order_selection": "order_selection",
        "iot_gumbel_temperature_min": "gumbel_temperature_min",
        "iot_gumbel_temperature_decay_rate": "gumbel_temperature_decay_rate",
        "iot_gumbel_temperature_update_freq": "gumbel_temperature_update_freq",
        "iot_diversity_loss_coef": "diversity_loss_coef",
        "iot_sharpness_loss_coef": "sharpness_loss_coef",
        "iot_order_prob_clamp": "order_prob_clamp",
    }
    for flag, config_field in simple.items():
        value = getattr(method_args, flag)
        if value is not None:
            setattr(config, config_field, value)
    config.validate_fields()
    return config


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


class GumbelTemperatureCallback(TrainerCallback):
    """Sets ``model.set_gumbel_step(global_step)`` before every optimisation step (the temperature schedule)."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and hasattr(_unwrap(model), "set_gumbel_step"):
            _unwrap(model).set_gumbel_step(state.global_step)


class IOTSeq2SeqTrainer(Seq2SeqTrainer):
    """``Seq2SeqTrainer`` whose training log lines carry the model's order statistics (``iot/...`` keys)."""

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        model = _unwrap(self.model)
        if "loss" in logs and hasattr(model, "pop_order_statistics"):
            logs.update(model.pop_order_statistics())
        super().log(logs, start_time)


def make_iot_callbacks(method_args) -> list:
    return [GumbelTemperatureCallback()]


SPEC = MethodSpec(
    model_type="iot",
    config_class=IOTConfig,
    model_class=IOTForConditionalGeneration,
    arguments_class=IOTArguments,
    callbacks=make_iot_callbacks,
    trainer_class=IOTSeq2SeqTrainer,
    update_config=update_iot_config,
    description="IOT: instance-wise sub-layer reordering with Gumbel-softmax order predictors (Zhu et al., 2021)",
)
