"""Configuration of IOT, the Instance-wise Ordered Transformer (Zhu et al., ICLR 2021).

IOT keeps the backbone's weights and reorders the sub-layers *inside* every block per sentence: a light predictor
(one bias-free ``orders × d`` matrix) picks the order of the encoder blocks from the mean token embedding and the
order of the decoder blocks from the mean encoder output. The same order applies to every block of the stack.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from .configuration_flexformer import FlexformerConfig, check_number

# The paper's Table 11 codes (also Table 1). SA = self-attention, ED = encoder-decoder attention, FF = feed-forward.
DECODER_ORDER_CODES: dict[int, tuple[str, str, str]] = {
    1: ("self_attn", "encoder_attn", "ffn"),
    2: ("ffn", "self_attn", "encoder_attn"),
    3: ("encoder_attn", "ffn", "self_attn"),
    4: ("encoder_attn", "self_attn", "ffn"),
    5: ("self_attn", "ffn", "encoder_attn"),
    6: ("ffn", "encoder_attn", "self_attn"),
}
# Encoder blocks have two sub-layers, hence at most M = 2 orders (Section 4.4).
ENCODER_ORDER_CODES: dict[int, tuple[str, str]] = {
    1: ("self_attn", "ffn"),
    2: ("ffn", "self_attn"),
}
# The paper's default decoder candidates (Section 4.4, Appendix A.3: "IOT (N = 4) is order 1, 2, 4, 6").
PAPER_DECODER_ORDERS = {1: [1], 2: [4, 6], 3: [1, 4, 6], 4: [1, 2, 4, 6], 5: [1, 2, 4, 5, 6], 6: [1, 2, 3, 4, 5, 6]}

ORDER_SELECTION_MODES = ("predictor", "equal")


def _validate_order_codes(field_name: str, codes, valid: dict) -> list[int]:
    if isinstance(codes, (str, bytes)) or not hasattr(codes, "__iter__"):
        raise ValueError(f"IOTConfig.{field_name} must be a list of order codes, got {codes!r}")
    codes = list(codes)
    if not codes:
        raise ValueError(f"IOTConfig.{field_name} must name at least one order code; valid codes are {sorted(valid)}")
    if len(codes) > len(valid):
        raise ValueError(f"IOTConfig.{field_name} has {len(codes)} orders; at most {len(valid)} exist")
    if len(set(codes)) != len(codes):
        raise ValueError(f"IOTConfig.{field_name} has duplicate order codes: {codes}")
    for code in codes:
        if isinstance(code, bool) or not isinstance(code, int) or code not in valid:
            raise ValueError(
                f"IOTConfig.{field_name} has the invalid order code {code!r}; valid codes are {sorted(valid)} "
                f"({', '.join(f'{c}: ' + '→'.join(valid[c]) for c in sorted(valid))})"
            )
    return codes


@strict
class IOTConfig(FlexformerConfig):
    r"""IOT on top of the fairseq-faithful backbone (every :class:`FlexformerConfig` field applies).

    Orders:
        decoder_orders (`list[int]`, defaults to `[1, 2, 4, 6]`): the N decoder order candidates as the paper's
            Table 11 codes (1 SA→ED→FF, 2 FF→SA→ED, 3 ED→FF→SA, 4 ED→SA→FF, 5 SA→FF→ED, 6 FF→ED→SA); 1 ≤ N ≤ 6,
            no duplicates. The paper's default is N = 4 with orders 1, 2, 4, 6.
        encoder_orders (`list[int]`, defaults to `[1]`): the M encoder candidates (1 SA→FF, 2 FF→SA); M ≤ 2.
        order_selection (`str`, defaults to `"predictor"`): `"predictor"` is IOT (Gumbel-softmax confidences,
            Eq. 1–3, auxiliary losses Eq. 5–6, argmax order at inference Eq. 4). `"equal"` is the paper's
            "setting (1)" ablation (Appendix B.3): all M×N paths with fixed weight 1 each, no predictor, and
            one fixed order at inference (`inference_encoder_order`, `inference_decoder_order`).
        inference_encoder_order / inference_decoder_order (`int`, *optional*): the codes used at inference
            when there is no predictor (`order_selection="equal"`); default: the first candidate.

    Predictors (only built for a stack with more than one candidate and `order_selection="predictor"`, so the
    extra parameters are exactly M·d and N·d as in the paper's Table 8):
        predictor_dropout (`float`, *optional*): dropout on the predictor logits (the official code applies
            `dropout` there; the paper does not say). `None` = `dropout`.

    Gumbel-softmax temperature (Eq. 1, 2), schedule τ(step) = max(τ_max · exp(−r · ⌊step/f⌋·f), τ_min) as in the
    official code (whose README run keeps τ = 20 constant: r = 0):
        encoder_gumbel_temperature / decoder_gumbel_temperature (`float`, defaults to 20.0): τ_e, τ_d at step 0.
        gumbel_temperature_min (`float`, defaults to 2.0), gumbel_temperature_decay_rate (`float`, 0.0),
        gumbel_temperature_update_freq (`int`, 5000).

    Losses (Eq. 7: L = L_C + c1·L_D + c2·L_S):
        order_prob_clamp (`float`, defaults to 0.05): probabilities are clamped to
            [clamp, 1 − (K−1)·clamp] (K candidates), not renormalised, before the log in the Gumbel-softmax and
            in L_S (Section 3.2, Appendix A.2).
        diversity_loss_coef (`float`, defaults to 0.1): c1 of L_D (Eq. 5).
        sharpness_loss_coef (`float`, defaults to 0.01): c2 of L_S (Eq. 6).
        clamp_diversity_probs (`bool`, defaults to `True`): clamp π_x before the batch mean in L_D (the paper
            clamps π_x); `False` = the official code (unclamped batch mean).
        weight_smoothing_loss (`bool`, defaults to `True`): the confidences weight the whole label-smoothed
            loss of a path (the paper's Eq. 3); `False` = the official code, which weights the NLL term and
            sums the label-smoothing term of all paths unweighted.

    Speed:
        batch_order_paths (`bool`, defaults to `True`): in training, run the decoder once over all M·N order
            paths stacked along the batch dimension (one `PerRowSublayerOrder`); `False` runs one decoder pass per
            path (the official code's way; same result, kept for comparison).
    """

    model_type = "iot"

    decoder_orders: list[int] | None = None
    encoder_orders: list[int] | None = None
    order_selection: str = "predictor"
    inference_encoder_order: int | None = None
    inference_decoder_order: int | None = None
    predictor_dropout: float | int | None = None
    encoder_gumbel_temperature: float | int = 20.0
    decoder_gumbel_temperature: float | int = 20.0
    gumbel_temperature_min: float | int = 2.0
    gumbel_temperature_decay_rate: float | int = 0.0
    gumbel_temperature_update_freq: int = 5000
    order_prob_clamp: float | int = 0.05
    diversity_loss_coef: float | int = 0.1
    sharpness_loss_coef: float | int = 0.01
    clamp_diversity_probs: bool = True
    weight_smoothing_loss: bool = True
    batch_order_paths: bool = True

    def __post_init__(self, **kwargs):
        if self.decoder_orders is None:
            self.decoder_orders = list(PAPER_DECODER_ORDERS[4])
        if self.encoder_orders is None:
            self.encoder_orders = [1]
        super().__post_init__(**kwargs)

    def validate_fields(self) -> None:
        """The backbone's checks, then :meth:`validate_iot_fields`."""
        super().validate_fields()
        self.validate_iot_fields()

    def validate_iot_fields(self) -> None:
        """Raise a ``ValueError`` naming the field for any invalid IOT setting."""
        self.decoder_orders = _validate_order_codes("decoder_orders", self.decoder_orders, DECODER_ORDER_CODES)
        self.encoder_orders = _validate_order_codes("encoder_orders", self.encoder_orders, ENCODER_ORDER_CODES)
        if self.order_selection not in ORDER_SELECTION_MODES:
            raise ValueError(
                f"IOTConfig.order_selection must be one of {ORDER_SELECTION_MODES}, got {self.order_selection!r}"
            )
        for name, candidates in (
            ("inference_encoder_order", self.encoder_orders),
            ("inference_decoder_order", self.decoder_orders),
        ):
            value = getattr(self, name)
            if value is not None and value not in candidates:
                raise ValueError(f"IOTConfig.{name}={value!r} is not one of the candidates {candidates}")
        check_number("IOTConfig", "predictor_dropout", self.predictor_dropout, minimum=0, maximum=1,
                     include_maximum=False, optional=True, why="a probability")
        for name in ("encoder_gumbel_temperature", "decoder_gumbel_temperature", "gumbel_temperature_min"):
            check_number("IOTConfig", name, getattr(self, name), minimum=0, include_minimum=False)
        check_number("IOTConfig", "gumbel_temperature_decay_rate", self.gumbel_temperature_decay_rate, minimum=0)
        if self.gumbel_temperature_update_freq < 1:
            raise ValueError(
                f"IOTConfig.gumbel_temperature_update_freq must be >= 1, got {self.gumbel_temperature_update_freq!r}"
            )
        largest = max(len(self.decoder_orders), len(self.encoder_orders))
        check_number("IOTConfig", "order_prob_clamp", self.order_prob_clamp, minimum=0, maximum=1 / largest,
                     include_maximum=False,
                     why=f"below 1/{largest} for {largest} candidates, so the clamped probabilities stay a valid range")
        for name in ("diversity_loss_coef", "sharpness_loss_coef"):
            check_number("IOTConfig", name, getattr(self, name), minimum=0)

    @property
    def num_encoder_orders(self) -> int:
        return len(self.encoder_orders)

    @property
    def num_decoder_orders(self) -> int:
        return len(self.decoder_orders)

    @property
    def encoder_sublayer_orders(self) -> list[tuple[str, ...]]:
        """Sub-layer name sequences of the encoder candidates, in candidate order."""
        return [ENCODER_ORDER_CODES[code] for code in self.encoder_orders]

    @property
    def decoder_sublayer_orders(self) -> list[tuple[str, ...]]:
        """Sub-layer name sequences of the decoder candidates, in candidate order."""
        return [DECODER_ORDER_CODES[code] for code in self.decoder_orders]

    @property
    def uses_predictor(self) -> bool:
        return self.order_selection == "predictor"


__all__ = ["IOTConfig", "DECODER_ORDER_CODES", "ENCODER_ORDER_CODES", "PAPER_DECODER_ORDERS"]
