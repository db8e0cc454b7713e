"""Configuration of the flexformers backbone: fairseq's Transformer, field for field."""

from __future__ import annotations

import math
import sys

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

ACTIVATION_FUNCTIONS = ("relu", "gelu", "gelu_new", "silu", "swish", "tanh")

# fairseq's named architectures (fairseq/models/transformer/transformer_legacy.py) plus the code-generation
# model of the IOT and MAT papers. Values not listed keep the FlexformerConfig defaults, which are fairseq's
# `base_architecture`.
PRESETS: dict[str, dict] = {
    "transformer_iwslt_de_en": {
        "encoder_embed_dim": 512,
        "encoder_ffn_embed_dim": 1024,
        "encoder_attention_heads": 4,
        "encoder_layers": 6,
        "decoder_embed_dim": 512,
        "decoder_ffn_embed_dim": 1024,
        "decoder_attention_heads": 4,
        "decoder_layers": 6,
        "dropout": 0.3,
        "share_all_embeddings": True,
    },
    "transformer_wmt_en_de": {
        "encoder_embed_dim": 512,
        "encoder_ffn_embed_dim": 2048,
        "encoder_attention_heads": 8,
        "encoder_layers": 6,
        "decoder_embed_dim": 512,
        "decoder_ffn_embed_dim": 2048,
        "decoder_attention_heads": 8,
        "decoder_layers": 6,
        "dropout": 0.1,
        "share_all_embeddings": True,
    },
    "transformer_vaswani_wmt_en_de_big": {
        "encoder_embed_dim": 1024,
        "encoder_ffn_embed_dim": 4096,
        "encoder_attention_heads": 16,
        "encoder_layers": 6,
        "decoder_embed_dim": 1024,
        "decoder_ffn_embed_dim": 4096,
        "decoder_attention_heads": 16,
        "decoder_layers": 6,
        "dropout": 0.3,
        "share_all_embeddings": True,
    },
    # IOT (Sec. 4, code generation) and MAT (Sec. 4.3): 3 encoder + 3 decoder blocks, d=256, FFN 1024.
    "transformer_codegen_small": {
        "encoder_embed_dim": 256,
        "encoder_ffn_embed_dim": 1024,
        "encoder_attention_heads": 4,
        "encoder_layers": 3,
        "decoder_embed_dim": 256,
        "decoder_ffn_embed_dim": 1024,
        "decoder_attention_heads": 4,
        "decoder_layers": 3,
        "dropout": 0.3,
        "share_all_embeddings": True,
    },
}


@strict
class FlexformerConfig(PreTrainedConfig):
    r"""
    Configuration of [`FlexformerForConditionalGeneration`]: fairseq's encoder-decoder Transformer with fairseq's
    field names and semantics (embedding scale √d, sinusoidal positions offset past the padding index, post-norm
    by default, label smoothing inside the model).

    Presets reproduce the papers' architectures: `FlexformerConfig.from_preset("transformer_iwslt_de_en",
    vocab_size=10152)` has exactly 36,741,120 parameters, as fairseq.

    The `*_use_positions` and `*_branches` fields are the seams the methods use (InDIGO drops absolute
    positions, MAT runs several attention/FFN branches); the baseline keeps them at `True` / `1`.
    """

    model_type = "flexformer"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "num_hidden_layers": "decoder_layers",
        "hidden_size": "decoder_embed_dim",
        "d_model": "decoder_embed_dim",
        "num_attention_heads": "decoder_attention_heads",
        "max_position_embeddings": "max_target_positions",
    }

    vocab_size: int = 10152
    target_vocab_size: int | None = None

    encoder_embed_dim: int = 512
    encoder_ffn_embed_dim: int = 2048
    encoder_layers: int = 6
    encoder_attention_heads: int = 8
    encoder_normalize_before: bool = False
    encoder_learned_pos: bool = False
    encoder_use_positions: bool = True
    encoder_layerdrop: float | int = 0.0
    encoder_attention_branches: int = 1
    encoder_ffn_branches: int = 1

    decoder_embed_dim: int = 512
    decoder_ffn_embed_dim: int = 2048
    decoder_layers: int = 6
    decoder_attention_heads: int = 8
    decoder_normalize_before: bool = False
    decoder_learned_pos: bool = False
    decoder_use_positions: bool = True
    decoder_layerdrop: float | int = 0.0
    decoder_attention_branches: int = 1
    decoder_ffn_branches: int = 1

    dropout: float | int = 0.1
    attention_dropout: float | int = 0.0
    activation_dropout: float | int = 0.0
    activation_function: str = "relu"
    max_source_positions: int = 1024
    max_target_positions: int = 1024
    share_all_embeddings: bool = False
    share_decoder_input_output_embed: bool = False
    no_scale_embedding: bool = False
    layernorm_embedding: bool = False
    label_smoothing: float | int = 0.0

    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    unk_token_id: int | None = 3
    decoder_start_token_id: int | None = 2
    is_encoder_decoder: bool = True
    use_cache: bool = True
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        # fairseq: sharing all embeddings implies sharing the decoder's input and output embeddings.
        if self.share_all_embeddings:
            self.share_decoder_input_output_embed = True
        self.tie_word_embeddings = bool(self.share_decoder_input_output_embed)
        super().__post_init__(**kwargs)
        # Validate here (not only in the `@strict` validators, which wrap errors in their own exception type) so
        # a bad value raises a plain `ValueError` naming the field.
        self.validate_fields()

    def validate_fields(self) -> None:
        """Raise a `ValueError` naming the first invalid field. Method configs extend this."""
        validate_flexformer_fields(self)

    @property
    def decoder_vocab_size(self) -> int:
        return self.vocab_size if self.target_vocab_size is None else self.target_vocab_size

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "FlexformerConfig":
        """Build the config of one of the papers' named architectures (`PRESETS`), then apply `overrides`."""
        if name not in PRESETS:
            raise ValueError(f"preset: unknown architecture {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def validate_architecture(self):
        """Part of `@strict` validation: every value a fairseq Transformer could not be built or trained with."""
        super().validate_architecture()
        self.validate_fields()


def _fail(field: str, value, requirement: str):
    raise ValueError(f"{field}={value!r} is invalid: {requirement}")


def check_number(
    owner: str,
    field: str,
    value,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    include_minimum: bool = True,
    include_maximum: bool = True,
    optional: bool = False,
    why: str = "",
) -> None:
    """The one range check of every config's float fields: ``value`` must be a finite real number (not a bool)
    within the given bounds, else a ``ValueError`` names ``owner.field``, the value and the allowed range.

    NaN compares false with everything, so an ad-hoc ``value < 0`` check lets it through; this checks finiteness
    first. ``optional`` accepts ``None``; ``why`` is appended to the message; an empty ``owner`` names the field
    alone."""
    if value is None and optional:
        return
    name = f"{owner}.{field}" if owner else field
    low = "" if minimum is None else f"{'>=' if include_minimum else '>'} {minimum:g}"
    high = "" if maximum is None else f"{'<=' if include_maximum else '<'} {maximum:g}"
    wanted = "a finite number" + (f" {low}" if low else "") + (" and" if low and high else "") + (f" {high}" if high else "")
    if optional:
        wanted += " (or None)"
    wanted += f" ({why})" if why else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is invalid: must be {wanted}")
    if minimum is not None and (value < minimum or (value == minimum and not include_minimum)):
        raise ValueError(f"{name}={value!r} is invalid: must be {wanted}")
    if maximum is not None and (value > maximum or (value == maximum and not include_maximum)):
        raise ValueError(f"{name}={value!r} is invalid: must be {wanted}")


def float_field_names(config) -> list[str]:
    """Names of the config's scalar fields annotated with ``float`` (lists of floats have their own validators)."""
    import dataclasses

    return [
        field.name
        for field in dataclasses.fields(config)
        if "float" in str(field.type) and "list" not in str(field.type)
    ]


def validate_finite_floats(config) -> None:
    """Every scalar float field of ``config`` -- including ones a subclass adds later -- must be a finite number
    (or ``None`` where the field allows it): a NaN or infinite coefficient trains an all-NaN model."""
    for name in float_field_names(config):
        value = getattr(config, name)
        if value is not None:
            check_number(type(config).__name__, name, value)


def _declared_field_types(config_class: type) -> dict:
    """{field: annotation} of the fields flexformers' own config classes declare (not the inherited
    ``PreTrainedConfig`` ones), annotations resolved in their defining modules; cached per class."""
    cached = config_class.__dict__.get("_flexformers_field_types")
    if cached is not None:
        return cached
    types = {}
    for klass in reversed(config_class.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, FlexformerConfig)):
            continue
        namespace = vars(sys.modules[klass.__module__])
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            try:
                types[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation
            except Exception:  # an annotation that cannot be resolved here is simply not type-checked
                types.pop(name, None)
    setattr(config_class, "_flexformers_field_types", types)
    return types


def validate_field_types(config: FlexformerConfig) -> None:
    """Each declared field holds a value of its annotated type (``encoder_layers='two'``, ``dropout='abc'`` or
    ``encoder_ffn_embed_dim=64.5`` would otherwise fail later with a bare ``TypeError`` deep in the model, or
    not at all); a ``ValueError`` names the field. Checked with huggingface_hub's strict-dataclass validator."""
    from huggingface_hub.dataclasses import type_validator

    for name, expected in _declared_field_types(type(config)).items():
        if "list" in str(expected):
            continue  # list fields (order codes, thresholds) have element-wise validators that also take tuples
        value = getattr(config, name, None)
        try:
            type_validator(name, value, expected)
        except TypeError:
            wanted = getattr(expected, "__name__", None) or str(expected).replace("typing.", "")
            raise ValueError(
                f"{type(config).__name__}.{name}={value!r} is invalid: must be of type {wanted}, got "
                f"{type(value).__name__}"
            ) from None


def validate_flexformer_fields(config: FlexformerConfig) -> None:
    """Raise a `ValueError` naming the first field whose value cannot describe a working model."""
    validate_field_types(config)
    validate_finite_floats(config)
    owner = type(config).__name__
    for field in ("vocab_size", "max_source_positions", "max_target_positions"):
        if getattr(config, field) < 1:
            _fail(field, getattr(config, field), "must be a positive integer")
    if config.target_vocab_size is not None and config.target_vocab_size < 1:
        _fail("target_vocab_size", config.target_vocab_size, "must be a positive integer or None")
    for side in ("encoder", "decoder"):
        dim = getattr(config, f"{side}_embed_dim")
        heads = getattr(config, f"{side}_attention_heads")
        for suffix in ("embed_dim", "ffn_embed_dim", "layers", "attention_heads", "attention_branches", "ffn_branches"):
            field = f"{side}_{suffix}"
            if getattr(config, field) < 1:
                _fail(field, getattr(config, field), "must be a positive integer")
        if dim % heads != 0:
            _fail(f"{side}_attention_heads", heads, f"must divide {side}_embed_dim={dim}")
        check_number(owner, f"{side}_layerdrop", getattr(config, f"{side}_layerdrop"), minimum=0, maximum=1,
                     include_maximum=False, why="a probability")
    for field in ("dropout", "attention_dropout", "activation_dropout", "label_smoothing"):
        check_number(owner, field, getattr(config, field), minimum=0, maximum=1, include_maximum=False,
                     why="a probability")
    if config.activation_function not in ACTIVATION_FUNCTIONS:
        _fail("activation_function", config.activation_function, f"must be one of {ACTIVATION_FUNCTIONS}")
    if config.share_all_embeddings:
        if config.encoder_embed_dim != config.decoder_embed_dim:
            _fail(
                "share_all_embeddings",
                True,
                f"needs encoder_embed_dim == decoder_embed_dim (got {config.encoder_embed_dim} and "
                f"{config.decoder_embed_dim})",
            )
        if config.target_vocab_size not in (None, config.vocab_size):
            _fail("share_all_embeddings", True, "needs one joint vocabulary (target_vocab_size None or == vocab_size)")
    if config.pad_token_id is None:
        _fail("pad_token_id", None, "fairseq positions and losses need a padding index")
    for field in ("pad_token_id", "decoder_start_token_id"):
        value = getattr(config, field)
        if value is not None and not 0 <= value < min(config.vocab_size, config.decoder_vocab_size):
            _fail(field, value, "must be an id inside the vocabulary")
    if config.encoder_learned_pos and not config.encoder_use_positions:
        _fail("encoder_learned_pos", True, "has no effect with encoder_use_positions=False; unset one of them")
    if config.decoder_learned_pos and not config.decoder_use_positions:
        _fail("decoder_learned_pos", True, "has no effect with decoder_use_positions=False; unset one of them")


__all__ = ["FlexformerConfig", "PRESETS", "check_number", "validate_finite_floats", "validate_flexformer_fields"]
