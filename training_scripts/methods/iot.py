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

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from transformers import TrainerCallback
from transformers.modeling_utils import unwrap_model

from flexformers.configuration.configuration_iot import IOTConfig
from flexformers.modeling.modeling_iot import IOTForConditionalGeneration
from flexformers.training_scripts.model_registry import MethodSpec
from flexformers.training_scripts.trainer import FlexformersSeq2SeqTrainer


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


class GumbelTemperatureCallback(TrainerCallback):
    """Sets ``model.set_gumbel_step(global_step)`` before every optimisation step (the temperature schedule)."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and hasattr(unwrap_model(model), "set_gumbel_step"):
            unwrap_model(model).set_gumbel_step(state.global_step)


class IOTSeq2SeqTrainer(FlexformersSeq2SeqTrainer):
    """``Seq2SeqTrainer`` whose training log lines carry the model's order statistics (``iot/...`` keys)."""

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        model = unwrap_model(self.model)
        if "loss" in logs and hasattr(model, "pop_order_statistics"):
            logs.update(model.pop_order_statistics())
        super().log(logs, start_time)


def make_iot_callbacks(method_args) -> list:
    return [GumbelTemperatureCallback()]


def iot_figures(model, batch, target_tokenizer, generate_kwargs) -> dict:
    """The share of sentences for which the predictor chooses each decoder order (paper codes)."""
    _, decoder_codes = model.predict_orders(batch["input_ids"], batch["attention_mask"])
    usage = Counter(decoder_codes.tolist())
    return {"decoder order usage (paper code: share)": {code: round(count / len(decoder_codes), 3)
                                                       for code, count in sorted(usage.items())}}


#: The key of IOT's case verification (the paper's Sec. 5.2, Fig. 2) among a result's method figures.
IOT_CASE_VERIFICATION = "case verification (Fig. 2)"


def case_verification_lines(result: dict) -> list[str]:
    """The paper's Fig. 2 as a table (Sec. 5.2): rows are the test sentences grouped by the decoder order the
    predictor picks, columns the order each group is decoded with; the best of a row is in bold."""
    table = result["figures"][IOT_CASE_VERIFICATION]
    codes = [str(code) for code in table["orders"]]
    overall = table["overall"]
    lines = ["", f"### IOT: `{result['recipe']['name']}`, subsets by predicted order decoded with every order "
                 "(the paper's Fig. 2)", "",
             f"Test split, beam {result['test']['num_beams']}, {table['metric'].upper()}. Where the predictor "
             "chooses well, each subset scores best with its own order (the diagonal).", "",
             "| subset (predicted order) | sentences | " + " | ".join(f"order {code}" for code in codes) + " |",
             "|---|---|" + "---|" * len(codes)]
    for subset, row in table["scores"].items():
        best = max(row.values())
        cells = " | ".join(f"**{row[code]:.2f}**" if row[code] == best else f"{row[code]:.2f}" for code in codes)
        lines.append(f"| set {subset} | {table['subsets'][subset]:,} | {cells} |")
    sentences = sum(table["subsets"].values())
    lines.append(f"| all | {sentences:,} | " + " | ".join(f"{overall[code]:.2f}" for code in codes) + " |")
    best = max(codes, key=lambda code: overall[code])
    lines += ["", f"Each sentence decoded with its own predicted order (IOT's inference): {overall['predicted']:.2f}; "
                  f"every sentence with the best single order ({best}): {overall[best]:.2f}."]
    return lines


def iot_zoo_analysis(recipe, output_dir, test_sources, smoke, test_hypotheses) -> dict:
    """The paper's case verification (Sec. 5.2, Fig. 2) of a trained zoo recipe with several decoder orders: the
    test split by predicted decoder order, each subset decoded with every order. ``test_hypotheses`` (the zoo's test
    decoding) stand for IOT's own choice, so the split is not decoded again for it."""
    from flexformers.training_scripts import iot_order_analysis

    if len(json.loads((output_dir / "config.json").read_text())["decoder_orders"]) <= 1:
        return {}
    table = iot_order_analysis.run(iot_order_analysis.OrderAnalysisArguments(
        model_name_or_path=str(output_dir), split="test", num_beams=1 if smoke else recipe.test_beams,
        batch_size=64, **({"max_samples": 4, "max_new_tokens": 8} if smoke else {})),
        predicted_hypotheses=test_hypotheses)
    # as stored (the order codes become string keys), so a fresh result and a read record render alike
    return {IOT_CASE_VERIFICATION: json.loads(json.dumps(
        {key: table[key] for key in ("metric", "orders", "subsets", "scores", "overall")}))}


def iot_zoo_figures_text(figures: dict) -> list[str]:
    """The zoo table's figures cell: the plain figures, then the case verification's predicted order against the
    best single order."""
    from flexformers.training_scripts.zoo_report import plain_figure_parts

    parts = plain_figure_parts(figures, leave_out=(IOT_CASE_VERIFICATION,))
    case_verification = figures.get(IOT_CASE_VERIFICATION)
    if case_verification:
        overall = case_verification["overall"]
        best = max(case_verification["orders"], key=lambda code: overall[str(code)])
        parts.append(f"each sentence with its predicted order {overall['predicted']:.2f}, the best single order "
                     f"({best}) {overall[str(best)]:.2f}")
    return parts


def iot_zoo_report(results: list[dict], spread: list[dict], plots_dir: Path) -> tuple[list, list]:
    """ZOO.md's case-verification section of every IOT result that has one, and its order-usage and
    case-verification plots."""
    import matplotlib.pyplot as plt

    lines, plots = [], []
    iot = [r for r in results if r["recipe"]["model_type"] == SPEC.model_type]
    for result in iot:
        if IOT_CASE_VERIFICATION in result["figures"]:
            lines += case_verification_lines(result)
    for result in iot:
        usage = next((value for name, value in result["figures"].items() if "order usage" in name), None)
        if not usage:
            continue
        figure, axis = plt.subplots(figsize=(5, 3.5))
        axis.bar([str(code) for code in usage], list(usage.values()), color="tab:green")
        axis.set_xlabel("decoder order (paper code)")
        axis.set_ylabel("share of test sentences")
        axis.set_title(f"IOT order usage ({result['recipe']['name']})", fontsize=9)
        figure.tight_layout()
        path = plots_dir / f"iot_usage_{result['recipe']['name']}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        plots.append(("IOT order usage", path))
        if IOT_CASE_VERIFICATION in result["figures"]:
            from flexformers.training_scripts.iot_order_analysis import plot_table

            stored = result["figures"][IOT_CASE_VERIFICATION]
            table = {**stored, "subsets": {int(code): size for code, size in stored["subsets"].items()},
                     "scores": {int(subset): {int(code): score for code, score in row.items()}
                                for subset, row in stored["scores"].items()}}
            path = plots_dir / f"iot_case_verification_{result['recipe']['name']}.png"
            plot_table(table, path)
            plots.append(("IOT: subsets by predicted order, decoded with every order (Fig. 2)", path))
    return lines, plots


SPEC = MethodSpec(
    model_type="iot",
    config_class=IOTConfig,
    model_class=IOTForConditionalGeneration,
    arguments_class=IOTArguments,
    callbacks=make_iot_callbacks,
    trainer_class=IOTSeq2SeqTrainer,
    update_config=update_iot_config,
    name="IOT",
    figures=iot_figures,
    zoo_analysis=iot_zoo_analysis,
    zoo_figures_text=iot_zoo_figures_text,
    zoo_report=iot_zoo_report,
    description="IOT: instance-wise sub-layer reordering with Gumbel-softmax order predictors (Zhu et al., 2021)",
)
