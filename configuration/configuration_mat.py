"""Configurations of MAT, the Multi-branch Attentive Transformer (Fan et al., 2020).

``MATConfig`` (model type ``mat``) is the encoder-decoder of the paper's translation / code-generation
experiments: a :class:`FlexformerConfig` whose attention layers have ``N_a`` branches
(``encoder_attention_branches`` / ``decoder_attention_branches``, both 2 by default), optionally multi-branch
FFNs (``encoder_ffn_branches`` / ``decoder_ffn_branches`` = ``N_f``, Sec. 7.1), plus the MAT regularisers:
drop-branch (``drop_branch_rate`` = ρ, Eq. 5-8), drop-head (``drop_head_rate``, Eq. 9-10) and the branch
merge mode (``branch_merge``: ``"paper"`` = 1/N as in Eq. 4/6, ``"official"`` = 1/N², the double average of
the HA-Transformer code).

``MATRobertaConfig`` / ``MATBertConfig`` are the encoder-only classifiers of the paper's GLUE experiment
(Sec. 6): a RoBERTa / BERT whose self-attention layers have ``num_attention_branches`` branches.

:func:`mat_parameter_count` is fairseq's parameter arithmetic for a (MAT) Transformer; it reproduces the
model sizes of the paper's Table 1 (e.g. 2/256/1024 → 18.4M with the 10152-token joint vocabulary).
"""

from __future__ import annotations

import dataclasses

from huggingface_hub.dataclasses import strict
from transformers.models.bert.configuration_bert import BertConfig
from transformers.models.roberta.configuration_roberta import RobertaConfig

from .configuration_flexformer import PRESETS, FlexformerConfig, check_number, validate_finite_floats

BRANCH_MERGE_MODES = ("paper", "official")

MAT_BRANCH_FIELDS = (
    "encoder_attention_branches",
    "decoder_attention_branches",
    "encoder_ffn_branches",
    "decoder_ffn_branches",
)

# Shapes a proximal initialisation cannot change: the MAT model must have the baseline's d, d_h, depth, heads
# and vocabulary (Sec. 3.3, step 2 duplicates the trained layers as they are).
MAT_SHAPE_FIELDS = (
    "vocab_size",
    "target_vocab_size",
    "encoder_embed_dim",
    "decoder_embed_dim",
    "encoder_ffn_embed_dim",
    "decoder_ffn_embed_dim",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "share_all_embeddings",
    "share_decoder_input_output_embed",
    "encoder_learned_pos",
    "decoder_learned_pos",
    "encoder_normalize_before",
    "decoder_normalize_before",
    "layernorm_embedding",
    "max_source_positions",
    "max_target_positions",
)


def _mat_architecture(base: str, branches: int, embed_dim: int, ffn_dim: int, rate: float) -> tuple[str, dict]:
    fields = {
        "encoder_attention_branches": branches,
        "decoder_attention_branches": branches,
        "encoder_embed_dim": embed_dim,
        "decoder_embed_dim": embed_dim,
        "encoder_ffn_embed_dim": ffn_dim,
        "decoder_ffn_embed_dim": ffn_dim,
        "drop_branch_rate": rate,
    }
    return base, fields


# The paper's MAT architectures N_a/d/d_h on top of a backbone preset (heads, depth, dropout, sharing).
MAT_PRESETS: dict[str, tuple[str, dict]] = {
    # Table 3's recommended IWSLT model, 24.7M parameters with the 10152-token joint vocabulary, rho = 0.2.
    "mat_iwslt_de_en": _mat_architecture("transformer_iwslt_de_en", 2, 256, 2048, 0.2),
    # Table 1's best model (README of the official code), 29.4M parameters, rho = 0.3.
    "mat_iwslt_de_en_3_256_2048": _mat_architecture("transformer_iwslt_de_en", 3, 256, 2048, 0.3),
    # Sec. 5 code generation: N_a = 4, d = 256, d_h = 1024, 3 + 3 blocks, rho = 0.1 (Table 8's best).
    "mat_codegen": _mat_architecture("transformer_codegen_small", 4, 256, 1024, 0.1),
}


def validate_rate(name: str, value, owner: str = "MATConfig") -> None:
    """A drop rate ρ must be a number in [0, 1): Eq. 5 divides by 1 - ρ."""
    check_number(owner, name, value, minimum=0, maximum=1, include_maximum=False,
                 why="kept branches/heads are scaled by 1/(1-rho), Eq. 5/9")


def validate_branch_count(name: str, value) -> None:
    """A number of branches (N_a or N_f) must be an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (a number of branches), got {value!r}")


def validate_mat_regularisation(config) -> None:
    """The MAT fields shared by the seq2seq and the encoder-only configurations."""
    owner = type(config).__name__
    validate_rate("drop_branch_rate", config.drop_branch_rate, owner)
    if config.ffn_drop_branch_rate is not None:
        validate_rate("ffn_drop_branch_rate", config.ffn_drop_branch_rate, owner)
    validate_rate("drop_head_rate", config.drop_head_rate, owner)
    if config.branch_merge not in BRANCH_MERGE_MODES:
        raise ValueError(f"branch_merge must be one of {BRANCH_MERGE_MODES}, got {config.branch_merge!r}")


def validate_encoder_classifier_floats(config) -> None:
    """The float fields a RoBERTa / BERT config brings: finite, dropouts in [0, 1), positive epsilon."""
    validate_finite_floats(config)
    owner = type(config).__name__
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
        check_number(owner, name, getattr(config, name), minimum=0, maximum=1, include_maximum=False,
                     optional=True, why="a probability")
    check_number(owner, "layer_norm_eps", config.layer_norm_eps, minimum=0, include_minimum=False)
    check_number(owner, "initializer_range", config.initializer_range, minimum=0)


@strict(accept_kwargs=True)
class MATConfig(FlexformerConfig):
    r"""Configuration of :class:`MATForConditionalGeneration` (model type ``mat``).

    All :class:`FlexformerConfig` fields apply (fairseq names). MAT sets the backbone's branch switches and adds:

    - ``encoder_attention_branches`` / ``decoder_attention_branches`` (N_a, default 2): branches of every encoder
      self-attention, decoder self-attention and encoder-decoder attention (Eq. 4).
    - ``encoder_ffn_branches`` / ``decoder_ffn_branches`` (N_f, default 1): multi-branch FFN variant (Eq. 8).
    - ``drop_branch_rate`` (ρ, default 0.2, the paper's best for 2/256/2048 in Table 3): drop-branch on attention
      branches (Eq. 5-6), off in eval.
    - ``ffn_drop_branch_rate`` (default ``None`` = ρ): drop-branch on the FFN (Eq. 7-8); 0 disables it
      (the ablation at the end of Sec. 4.2).
    - ``drop_head_rate`` (default 0): drop-head (Eq. 9-10), every head of every branch dropped independently.
      The paper's variant 2 of Sec. 7.2 is ``drop_branch_rate=0, drop_head_rate=ρ``.
    - ``branch_merge``: ``"paper"`` (default) merges Q + (1/N) Σ branches (Eq. 4/6/8); ``"official"`` uses
      1/N², the HA-Transformer code's double average. Only ``"paper"`` makes a proximally initialised MAT compute
      exactly its baseline's function.
    """

    model_type = "mat"

    encoder_attention_branches: int = 2
    decoder_attention_branches: int = 2
    drop_branch_rate: float | int = 0.2
    ffn_drop_branch_rate: float | int | None = None
    drop_head_rate: float | int = 0.0
    branch_merge: str = "paper"

    def validate_fields(self) -> None:
        """The backbone's checks plus MAT's: branch counts >= 1, rates in [0, 1), a known merge mode."""
        for name in MAT_BRANCH_FIELDS:
            validate_branch_count(name, getattr(self, name))
        super().validate_fields()
        validate_mat_regularisation(self)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "MATConfig":
        """A backbone preset (``PRESETS``) or a MAT preset (``MAT_PRESETS``, the paper's architectures), then
        ``overrides``."""
        if name in MAT_PRESETS:
            base_name, mat_fields = MAT_PRESETS[name]
            return cls(**{**PRESETS[base_name], **mat_fields, **overrides})
        if name not in PRESETS:
            raise ValueError(f"preset: unknown architecture {name!r}; choose one of {sorted(PRESETS) + sorted(MAT_PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def effective_ffn_drop_branch_rate(self) -> float:
        """ρ of the FFN drop-branch (Eq. 7-8): ``ffn_drop_branch_rate``, or ``drop_branch_rate`` when unset."""
        return float(self.drop_branch_rate if self.ffn_drop_branch_rate is None else self.ffn_drop_branch_rate)


@dataclasses.dataclass(kw_only=True)
class MATEncoderClassifierFields:
    r"""MAT's fields on a RoBERTa / BERT encoder classifier (Sec. 6), the last base of its config so the strict
    dataclass takes them as its own: ``num_attention_branches`` (N_a, the paper uses 2 on GLUE), ``drop_branch_rate``
    (ρ, Table 10's best on MRPC is 0.3), ``ffn_drop_branch_rate`` (``None`` = ρ; Eq. 7 on the FFN sub-layer),
    ``drop_head_rate`` and ``branch_merge`` (see :class:`MATConfig`)."""

    num_attention_branches: int = 2
    drop_branch_rate: float | int = 0.3
    ffn_drop_branch_rate: float | int | None = None
    drop_head_rate: float | int = 0.0
    branch_merge: str = "paper"

    def validate_mat_fields(self) -> None:
        """The branch count, the classifier's own floats and MAT's rates and merge mode."""
        validate_branch_count("num_attention_branches", self.num_attention_branches)
        validate_encoder_classifier_floats(self)
        validate_mat_regularisation(self)

    @property
    def effective_ffn_drop_branch_rate(self) -> float:
        """ρ of the FFN drop-branch: ``ffn_drop_branch_rate``, or ``drop_branch_rate`` when unset."""
        return float(self.drop_branch_rate if self.ffn_drop_branch_rate is None else self.ffn_drop_branch_rate)


@strict(accept_kwargs=True)
class MATRobertaConfig(RobertaConfig, MATEncoderClassifierFields):
    r"""Configuration of :class:`MATRobertaForSequenceClassification` (model type ``mat_roberta``): a
    :class:`RobertaConfig` plus :class:`MATEncoderClassifierFields`."""

    model_type = "mat_roberta"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate_mat_fields()


@strict(accept_kwargs=True)
class MATBertConfig(BertConfig, MATEncoderClassifierFields):
    r"""Configuration of :class:`MATBertForSequenceClassification` (model type ``mat_bert``): a :class:`BertConfig`
    plus :class:`MATEncoderClassifierFields`."""

    model_type = "mat_bert"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate_mat_fields()


def attention_parameter_count(query_dim: int, key_value_dim: int, num_branches: int) -> int:
    """One (multi-branch) attention: per branch fairseq's q/k/v/out projections with biases (Eq. 2, 4)."""
    per_branch = (query_dim * query_dim + query_dim) * 2 + (key_value_dim * query_dim + query_dim) * 2
    return num_branches * per_branch


def feed_forward_parameter_count(embed_dim: int, ffn_dim: int, num_branches: int) -> int:
    """One (multi-branch) FFN: per branch W1, b1, W2, b2 (Eq. 3, 8)."""
    return num_branches * (embed_dim * ffn_dim + ffn_dim + ffn_dim * embed_dim + embed_dim)


def mat_parameter_count(
    *,
    vocab_size: int,
    embed_dim: int,
    ffn_dim: int,
    attention_branches: int = 1,
    ffn_branches: int = 1,
    encoder_layers: int = 6,
    decoder_layers: int = 6,
    share_all_embeddings: bool = True,
    share_decoder_input_output_embed: bool = True,
    target_vocab_size: int | None = None,
) -> int:
    """Parameters of a fairseq post-norm (MAT) Transformer with sinusoidal positions, as in the paper's Table 1.

    N_a/d/d_h = ``attention_branches``/``embed_dim``/``ffn_dim``; each attention branch and FFN branch has its
    own weights and biases, every sub-layer one LayerNorm. ``mat_parameter_count(vocab_size=10152,
    embed_dim=512, ffn_dim=1024)`` is 36,741,120 (fairseq's transformer_iwslt_de_en) and ``attention_branches=2,
    embed_dim=256, ffn_dim=1024`` gives 18,395,136 (Table 1: 18.4M).
    """
    for name, value in (("vocab_size", vocab_size), ("embed_dim", embed_dim), ("ffn_dim", ffn_dim)):
        validate_branch_count(name, value)
    validate_branch_count("attention_branches", attention_branches)
    validate_branch_count("ffn_branches", ffn_branches)
    target_vocab_size = vocab_size if target_vocab_size is None else target_vocab_size
    attention = attention_parameter_count(embed_dim, embed_dim, attention_branches)
    ffn = feed_forward_parameter_count(embed_dim, ffn_dim, ffn_branches)
    layer_norm = 2 * embed_dim
    encoder_layer = attention + ffn + 2 * layer_norm
    decoder_layer = 2 * attention + ffn + 3 * layer_norm
    embeddings = vocab_size * embed_dim
    if not share_all_embeddings:
        embeddings += target_vocab_size * embed_dim
    if not share_decoder_input_output_embed:
        embeddings += target_vocab_size * embed_dim
    return embeddings + encoder_layers * encoder_layer + decoder_layers * decoder_layer


__all__ = [
    "MATConfig",
    "MATRobertaConfig",
    "MATBertConfig",
    "mat_parameter_count",
    "attention_parameter_count",
    "feed_forward_parameter_count",
    "BRANCH_MERGE_MODES",
    "MAT_PRESETS",
]
