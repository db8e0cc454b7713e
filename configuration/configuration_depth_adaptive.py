"""Configuration of the Depth-Adaptive Transformer (Elbayad, Gu, Grave & Auli, ICLR 2020).

The decoder gets an output classifier C_n after every block (Eq. 3) and can emit a token after any block; a halting
mechanism (Sec. 3) or a confidence threshold decides where. Exits are numbered like the paper: ``1 … N`` with
``N = decoder_layers``.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from .configuration_flexformer import PRESETS, FlexformerConfig, check_number

EXIT_CLASSIFIER_MODES = ("independent", "shared")
TRAINING_MODES = ("aligned", "mixed")
# ω_n of Eq. 4 / Appendix A, Table 2.
EXIT_LOSS_WEIGHTINGS = ("uniform", "n", "sqrt_n", "inv_sqrt_n", "inv_n")
HALTING_MECHANISMS = ("none", "sequence", "token_multinomial", "token_geometric")
ORACLES = ("likelihood", "correctness")
EXIT_STRATEGIES = ("full", "fixed", "confidence", "halting")

# The paper's architectures (Sec. 4.1). IWSLT'14 De-En: N = 6 blocks, FFN 1024, 4 heads, dropout 0.3,
# d_enc = 512, d_dec = 256, untied embeddings and 6 independent output classifiers. WMT'14 En-Fr: Transformer big
# with the encoder, decoder and all output classifiers tied. Plus a small 6-block model for CPU experiments on
# the code-generation corpus (d = 256 like the IOT/MAT code-generation model, six decoder blocks to exit from).
DEPTH_ADAPTIVE_PRESETS: dict[str, dict] = {
    "depth_adaptive_iwslt_de_en": {
        **PRESETS["transformer_iwslt_de_en"],
        "decoder_embed_dim": 256,
        "share_all_embeddings": False,
        "share_decoder_input_output_embed": False,
        "exit_classifiers": "independent",
    },
    "depth_adaptive_wmt_en_fr_big": {
        **PRESETS["transformer_vaswani_wmt_en_de_big"],
        "share_all_embeddings": True,
        "exit_classifiers": "shared",
    },
    "depth_adaptive_codegen_small": {
        **PRESETS["transformer_codegen_small"],
        "decoder_layers": 6,
        "share_all_embeddings": True,
        "exit_classifiers": "independent",
    },
}


def validate_exit_thresholds(thresholds, num_exits: int, field: str = "exit_thresholds") -> list[float]:
    """τ = (τ_1, …, τ_{N−1}) (Sec. 3.2): N−1 finite numbers in [0, 1]; returns them as floats."""
    if isinstance(thresholds, (str, bytes)) or not hasattr(thresholds, "__iter__"):
        raise ValueError(f"{field} must be a list of {num_exits - 1} thresholds in [0, 1], got {thresholds!r}")
    values = list(thresholds)
    if len(values) != num_exits - 1:
        raise ValueError(
            f"{field} must hold N-1 = {num_exits - 1} thresholds (one per block below the last), got {len(values)}: "
            f"{values!r}"
        )
    for index, value in enumerate(values):
        check_number("", f"{field}[{index}]", value, minimum=0, maximum=1)
    return [float(value) for value in values]


@strict
class DepthAdaptiveConfig(FlexformerConfig):
    r"""Depth-Adaptive Transformer on top of the fairseq-faithful backbone (every :class:`FlexformerConfig` field
    applies; the IWSLT setting of the paper is ``encoder_embed_dim=512, decoder_embed_dim=256,
    decoder_ffn_embed_dim=1024``, 4 heads, untied embeddings, 6 independent classifiers).

    Output classifiers (Eq. 3):
        exit_classifiers (`str`, defaults to `"independent"`): `"independent"` gives every block its own
            classifier W_n (C_N is the backbone's output projection, tied to the decoder embeddings when
            `share_decoder_input_output_embed`); `"shared"` uses one matrix for all N classifiers (the paper's
            WMT setting ties it to the embeddings as well).

    Training the classifiers (Sec. 2.2):
        training_mode (`str`, defaults to `"aligned"`): `"aligned"` optimises the N exits on aligned states
            (Eq. 4); `"mixed"` samples `mixed_num_samples` exit sequences n_t ~ U{1..N} per token and trains on
            copied states (Eq. 5).
        mixed_num_samples (`int`, defaults to 6): M of Eq. 5.
        exit_loss_weighting (`str`, defaults to `"uniform"`): ω_n of Eq. 4 — `"uniform"` (1), `"n"`, `"sqrt_n"`,
            `"inv_sqrt_n"`, `"inv_n"` (Appendix A, Table 2).
        gradient_scaling (`float`, *optional*): γ of Appendix A (Algorithm 1, γ_n = γ·(N−n)); `None` = no
            scaling (the paper's recommendation). Aligned training only.

    Halting (Sec. 3; trained with Eq. 6/7):
        halting_mechanism (`str`, defaults to `"none"`): `"sequence"` (multinomial on the mean encoder output,
            Eq. 8), `"token_multinomial"` (multinomial on h¹_t, Eq. 11), `"token_geometric"` (geometric-like,
            Eq. 12–13) or `"none"`.
        oracle (`str`, defaults to `"likelihood"`): `"likelihood"` (Eq. 9 / 14–15) or `"correctness"`
            (Eq. 10 / 16–17).
        oracle_lambda (`float`, defaults to 0.0): λ, the penalty per block that favours lower exits.
        oracle_sigma (`float`, defaults to 0.0): σ, the RBF kernel width of Eq. 15/16 for token-specific oracles;
            0 = the current token only (σ → 0).
        exit_loss_alpha (`float`, defaults to 0.0): α of Eq. 7. The paper's two-stage schedule trains with α = 0
            (aligned) first, then continues with α > 0.

    Decoding (Sec. 3, Appendix B Algorithm 2); every field can be overridden per `generate()` call:
        exit_strategy (`str`, *optional*): `"full"` (every token exits at block N), `"fixed"` (every token exits
            at `fixed_exit`), `"confidence"` (exit after block n < N when max_y p(y|h^n_t) > τ_n, Sec. 3.2) or
            `"halting"` (the trained halting mechanism). `None` = `"halting"` when a halting mechanism exists,
            else `"full"`.
        fixed_exit (`int`, *optional*): the exit n ∈ 1..N of `"fixed"`.
        exit_thresholds (`list[float]`, *optional*): τ_1 … τ_{N−1} for `"confidence"` and the geometric-like
            halting; default 0.5 each (the paper exits when χ^n_t > 0.5).
    """

    model_type = "depth_adaptive"

    exit_classifiers: str = "independent"
    training_mode: str = "aligned"
    mixed_num_samples: int = 6
    exit_loss_weighting: str = "uniform"
    gradient_scaling: float | int | None = None
    halting_mechanism: str = "none"
    oracle: str = "likelihood"
    oracle_lambda: float | int = 0.0
    oracle_sigma: float | int = 0.0
    exit_loss_alpha: float | int = 0.0
    exit_strategy: str | None = None
    fixed_exit: int | None = None
    exit_thresholds: list[float | int] | None = None

    def validate_fields(self) -> None:
        """The backbone's checks, then :meth:`validate_depth_adaptive_fields`."""
        super().validate_fields()
        self.validate_depth_adaptive_fields()

    def validate_depth_adaptive_fields(self) -> None:
        """Raise a ``ValueError`` naming the field for any invalid Depth-Adaptive setting."""
        for field, choices in (
            ("exit_classifiers", EXIT_CLASSIFIER_MODES),
            ("training_mode", TRAINING_MODES),
            ("exit_loss_weighting", EXIT_LOSS_WEIGHTINGS),
            ("halting_mechanism", HALTING_MECHANISMS),
            ("oracle", ORACLES),
        ):
            if getattr(self, field) not in choices:
                raise ValueError(f"DepthAdaptiveConfig.{field} must be one of {choices}, got {getattr(self, field)!r}")
        if self.exit_strategy is not None and self.exit_strategy not in EXIT_STRATEGIES:
            raise ValueError(
                f"DepthAdaptiveConfig.exit_strategy must be one of {EXIT_STRATEGIES} or None, got {self.exit_strategy!r}"
            )
        if self.decoder_layerdrop:
            raise ValueError(
                "DepthAdaptiveConfig.decoder_layerdrop must be 0: every block below an exit is computed (or its "
                f"state copied) by construction, got {self.decoder_layerdrop!r}"
            )
        if self.mixed_num_samples < 1:
            raise ValueError(f"DepthAdaptiveConfig.mixed_num_samples must be >= 1, got {self.mixed_num_samples!r}")
        check_number("DepthAdaptiveConfig", "gradient_scaling", self.gradient_scaling, minimum=0,
                     include_minimum=False, optional=True, why="γ of Appendix A")
        if self.gradient_scaling is not None and self.training_mode != "aligned":
            raise ValueError("DepthAdaptiveConfig.gradient_scaling applies to training_mode='aligned' only")
        for field in ("oracle_lambda", "oracle_sigma", "exit_loss_alpha"):
            check_number("DepthAdaptiveConfig", field, getattr(self, field), minimum=0)
        if self.exit_loss_alpha > 0:
            if self.halting_mechanism == "none":
                raise ValueError(
                    "DepthAdaptiveConfig.exit_loss_alpha > 0 needs a halting_mechanism to train "
                    f"(one of {HALTING_MECHANISMS[1:]})"
                )
            if self.training_mode != "aligned":
                raise ValueError(
                    "DepthAdaptiveConfig.exit_loss_alpha > 0 needs training_mode='aligned': the oracles (Eq. 9–17) "
                    "compare the likelihood of every exit on aligned states"
                )
        if self.halting_mechanism != "none" and self.decoder_layers < 2:
            raise ValueError(
                f"DepthAdaptiveConfig.halting_mechanism={self.halting_mechanism!r} needs decoder_layers >= 2: with "
                "one block there is no exit to choose"
            )
        if self.exit_strategy == "halting" and self.halting_mechanism == "none":
            raise ValueError("DepthAdaptiveConfig.exit_strategy='halting' needs a halting_mechanism other than 'none'")
        if self.fixed_exit is not None and (
            isinstance(self.fixed_exit, bool) or not 1 <= self.fixed_exit <= self.decoder_layers
        ):
            raise ValueError(
                f"DepthAdaptiveConfig.fixed_exit must be an exit in 1..{self.decoder_layers}, got {self.fixed_exit!r}"
            )
        if self.exit_strategy == "fixed" and self.fixed_exit is None:
            raise ValueError("DepthAdaptiveConfig.exit_strategy='fixed' needs fixed_exit")
        if self.exit_thresholds is not None:
            self.exit_thresholds = validate_exit_thresholds(
                self.exit_thresholds, self.decoder_layers, "DepthAdaptiveConfig.exit_thresholds"
            )

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "DepthAdaptiveConfig":
        """A backbone preset (``PRESETS``) or one of the paper's architectures (``DEPTH_ADAPTIVE_PRESETS``), then
        ``overrides``."""
        if name in DEPTH_ADAPTIVE_PRESETS:
            return cls(**{**DEPTH_ADAPTIVE_PRESETS[name], **overrides})
        if name not in PRESETS:
            raise ValueError(
                f"preset: unknown architecture {name!r}; choose one of {sorted(PRESETS) + sorted(DEPTH_ADAPTIVE_PRESETS)}"
            )
        return cls(**{**PRESETS[name], **overrides})

    @property
    def num_exits(self) -> int:
        """N, the number of decoder blocks and exits."""
        return self.decoder_layers

    @property
    def default_exit_strategy(self) -> str:
        if self.exit_strategy is not None:
            return self.exit_strategy
        return "halting" if self.halting_mechanism != "none" else "full"

    @property
    def default_exit_thresholds(self) -> list[float]:
        return list(self.exit_thresholds) if self.exit_thresholds is not None else [0.5] * (self.decoder_layers - 1)


__all__ = [
    "DEPTH_ADAPTIVE_PRESETS",
    "DepthAdaptiveConfig",
    "EXIT_CLASSIFIER_MODES",
    "EXIT_LOSS_WEIGHTINGS",
    "EXIT_STRATEGIES",
    "HALTING_MECHANISMS",
    "ORACLES",
    "TRAINING_MODES",
    "validate_exit_thresholds",
]
