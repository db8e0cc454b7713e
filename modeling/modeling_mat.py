"""MAT: the Multi-branch Attentive Transformer (Fan, Xie, Xia, Wu, Qin, Li, Liu 2020).

Every attention layer is the average of N_a independent multi-head attentions ("branches"), merged as
``Q + (1/N_a) Σ_i attn_M(Q, K, V; θ_i)`` (Eq. 4), regularised by drop-branch (Eq. 5-8) or drop-head (Eq. 9-10)
and trained from a proximal initialisation (Sec. 3.3): a trained single-branch baseline cloned into every branch.

Speed: the branches are never a Python loop. The backbone's :class:`FlexformerAttention` with ``num_branches=B``
projects q/k/v with one ``Linear(d, B*d)`` each (branch b = rows ``b*d:(b+1)*d``), runs *one* attention call over
B·M heads and merges with one GEMM (:func:`merge_branches`); MAT only overrides the merge-weight hooks
(``branch_weights`` for drop-branch, ``head_weights`` for drop-head). Branch weights stay addressable per branch
(row/column blocks), which is what proximal initialisation writes.

Models:

- :class:`MATForConditionalGeneration` (model type ``mat``): the encoder-decoder, with
  :meth:`MATForConditionalGeneration.from_baseline` for proximal initialisation from a flexformer checkpoint.
- :class:`MATRobertaForSequenceClassification` / :class:`MATBertForSequenceClassification` (model types
  ``mat_roberta`` / ``mat_bert``): the encoder-only classifier of the paper's GLUE experiment (Sec. 6), built by
  subclassing the Transformers RoBERTa/BERT self-attention (only its projection widths change) and replacing the
  attention output / FFN output modules with multi-branch ones; ``from_encoder`` initialises it proximally from a
  local ``RobertaModel`` / ``BertModel`` checkpoint directory.
"""

from __future__ import annotations

import json
import os

import torch
from torch import Tensor, nn
from transformers.models.bert.modeling_bert import (
    BertForSequenceClassification,
    BertModel,
    BertSelfAttention,
)
from transformers.models.roberta.modeling_roberta import (
    RobertaForSequenceClassification,
    RobertaModel,
    RobertaOutput,
    RobertaSelfAttention,
    RobertaSelfOutput,
)

from flexformers.configuration.configuration_mat import (
    MAT_BRANCH_FIELDS,
    MAT_SHAPE_FIELDS,
    MATBertConfig,
    MATConfig,
    MATRobertaConfig,
)

from .branch_merge import merge_branches, merge_projection, upgrade_merge_bias_on_load
from .modeling_flexformer import (
    BackboneComponents,
    FlexformerAttention,
    FlexformerFeedForward,
    FlexformerForConditionalGeneration,
    FlexformerModel,
    _init_branch_biases,
)

# ---------------------------------------------------------------------------------------------------------------
# The paper's equations
# ---------------------------------------------------------------------------------------------------------------


def drop_branch_keep_scales(
    num_branches: int,
    rate: float,
    *,
    training: bool,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Drop-branch factors ``I{U_i >= ρ} / (1 - ρ)`` with ``U_i ~ unif[0, 1]`` (Eq. 5 for attention branches,
    Eq. 7 for the FFN, Eq. 8 for FFN branches).

    One draw per branch per call, shared by the whole batch (as in the official code). All branches may be dropped
    at once: the sub-layer's residual then carries its input on (Sec. 3.2). The inverted-dropout scaling keeps the
    expected value; in eval, or with ρ = 0, every factor is 1 ("during inference, we must set ρ = 0").
    Returns ``[num_branches]``.
    """
    if not training or rate == 0.0:
        return torch.ones(num_branches, device=device, dtype=dtype)
    uniform = torch.rand(num_branches, device=device, generator=generator)
    return (uniform >= rate).to(dtype) / (1.0 - rate)


def drop_head_keep_scales(
    num_branches: int,
    num_heads: int,
    rate: float,
    *,
    training: bool,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
) -> Tensor | None:
    """Drop-head factors ``I{U_ij >= ρ} / (1 - ρ)`` for head j of branch i, every ``U_ij`` independent (Eq. 9,
    variant 2 of Sec. 7.2). Like drop-branch, one draw per head per call, shared by the batch.

    Returns ``[num_branches * num_heads]`` in the fused attention's head order (head j of branch i at
    ``i * num_heads + j``), or ``None`` when inactive (eval or ρ = 0) so the attention skips the multiply.
    """
    if not training or rate == 0.0:
        return None
    uniform = torch.rand(num_branches * num_heads, device=device, generator=generator)
    return (uniform >= rate).to(dtype) / (1.0 - rate)


def multi_branch_merge_weights(keep_scales: Tensor, merge: str = "paper") -> Tensor:
    """Weights of the branch average ``Q + (1/N) Σ_i β_i`` (Eq. 4 and 6; Eq. 8 for FFN branches; Eq. 10 merges the
    drop-head branches the same way).

    ``keep_scales`` are the drop-branch factors of Eq. 5/7/8 (all ones in eval), shape ``[N]``. ``merge="paper"``
    (default) is the paper's 1/N; ``merge="official"`` is the HA-Transformer code's double average, 1/N² of the
    summed branches (the two agree for N = 1).
    """
    num_branches = keep_scales.shape[-1]
    if merge == "paper":
        return keep_scales / num_branches
    if merge == "official":
        return keep_scales / (num_branches * num_branches)
    raise ValueError(f"branch_merge must be 'paper' or 'official', got {merge!r}")


def clone_into_branches(target: Tensor, source: Tensor, name: str) -> Tensor:
    """Proximal initialisation of one tensor (Sec. 3.3, step 2): the trained single-branch tensor duplicated into
    every branch of the multi-branch one, without noise.

    The branch axis is the one axis whose size is a multiple of the baseline's: q/k/v and ``fc1`` weights
    ``[d, d] → [B*d, d]`` (branch b = rows ``b*d:(b+1)*d``), merge weights ``[d, d] → [d, B*d]`` (branch b =
    columns), merge biases ``[d] → [B, d]`` (``<name>_branch_bias``). With the 1/N merge and ρ = 0 the cloned layer computes
    ``Σ_b (1/B)(x W + b) = x W + b``: exactly the baseline's function.
    """
    if target.shape == source.shape:
        return source.clone()
    if source.dim() == 1 and target.dim() == 2 and target.shape[1] == source.shape[0]:
        # a plain Linear bias [d] going into per-branch merge biases [B, d]
        return source.unsqueeze(0).repeat(target.shape[0], 1)
    differing = [axis for axis, (t, s) in enumerate(zip(target.shape, source.shape)) if t != s]
    if target.dim() != source.dim() or len(differing) != 1 or target.shape[differing[0]] % source.shape[differing[0]]:
        raise ValueError(
            f"Cannot clone baseline tensor {name!r} of shape {tuple(source.shape)} into the multi-branch tensor of "
            f"shape {tuple(target.shape)}: the shapes must differ by a whole number of branches along one axis"
        )
    repeats = [1] * target.dim()
    repeats[differing[0]] = target.shape[differing[0]] // source.shape[differing[0]]
    return source.repeat(*repeats)


def clone_state_dict_into_branches(target_model: nn.Module, source_state: dict[str, Tensor], what: str) -> dict:
    """The proximal-initialisation state dict of ``target_model``: every tensor taken from ``source_state`` (same
    name), multi-branch tensors cloned with :func:`clone_into_branches`. A missing name is a ``ValueError``."""
    new_state = {}
    for name, tensor in target_model.state_dict().items():
        if name not in source_state and name.endswith("_branch_bias"):  # from the baseline's merge bias
            name_in_source = name.removesuffix("_branch_bias") + ".bias"
            if name_in_source in source_state:
                new_state[name] = clone_into_branches(tensor, source_state[name_in_source].to(tensor.dtype), name)
                continue
        if name not in source_state:
            raise ValueError(f"{what} has no tensor {name!r}; it does not match the MAT architecture")
        new_state[name] = clone_into_branches(tensor, source_state[name].to(tensor.dtype), name)
    return new_state


# ---------------------------------------------------------------------------------------------------------------
# Encoder-decoder MAT on the flexformer backbone
# ---------------------------------------------------------------------------------------------------------------


def _merge_weights(module: nn.Module, device, dtype) -> Tensor | None:
    """A module's branch merge weights for this call (Eq. 4-8); ``None`` (the backbone's plain 1/B average, with
    its fast single-branch path) whenever that is what they would be: eval or ρ = 0, with the paper's merge."""
    if module.branch_merge == "paper" and (not module.training or module.drop_branch_rate == 0.0):
        return None
    keep = drop_branch_keep_scales(
        module.num_branches, module.drop_branch_rate, training=module.training, device=device, dtype=dtype
    )
    return multi_branch_merge_weights(keep, module.branch_merge)


class MATAttention(FlexformerAttention):
    """Multi-branch attention ``mAttn_{N_a,M}(Q, K, V; ρ)`` (Eq. 4-6), fused over N_a·M heads by the backbone.

    Overrides only the merge hooks: ``branch_weights`` returns the drop-branch factors times 1/N_a (Eq. 5-6), and
    ``head_weights`` the drop-head factors (Eq. 9-10). Used for encoder self-, decoder self- and encoder-decoder
    attention alike.
    """

    def __init__(self, config: MATConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.drop_branch_rate = float(config.drop_branch_rate)
        self.drop_head_rate = float(config.drop_head_rate)
        self.branch_merge = config.branch_merge

    def branch_weights(self, batch_size: int, device, dtype) -> Tensor | None:
        return _merge_weights(self, device, dtype)

    def head_weights(self, batch_size: int, device, dtype) -> Tensor | None:
        keep = drop_head_keep_scales(
            self.num_branches, self.num_heads, self.drop_head_rate, training=self.training, device=device, dtype=dtype
        )
        return keep  # [B*M], shared by the batch


class MATFeedForward(FlexformerFeedForward):
    """FFN with drop-branch: ``x + I{U >= ρ}/(1-ρ) FFN(x)`` (Eq. 7), or N_f branches ``x + (1/N_f) Σ_i
    FFN(x; ω_i) I{U_i >= ρ}/(1-ρ)`` (Eq. 8), fused in one ``fc1`` / one merge GEMM by the backbone."""

    def __init__(self, config: MATConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.drop_branch_rate = config.effective_ffn_drop_branch_rate
        self.branch_merge = config.branch_merge

    def branch_weights(self, batch_size: int, device, dtype) -> Tensor | None:
        return _merge_weights(self, device, dtype)


def _is_flexformer_baseline(config_values: dict) -> bool:
    """Whether a config (as a dict) describes the single-branch flexformer baseline."""
    return config_values.get("model_type") == "flexformer" and all(
        config_values.get(name, 1) == 1 for name in MAT_BRANCH_FIELDS
    )


MAT_COMPONENTS = BackboneComponents(
    encoder_self_attention=MATAttention,
    decoder_self_attention=MATAttention,
    cross_attention=MATAttention,
    feed_forward=MATFeedForward,
)


class MATModel(FlexformerModel):
    """MAT encoder + decoder (no LM head): the backbone built from :data:`MAT_COMPONENTS`."""

    config_class = MATConfig
    config: MATConfig
    components = MAT_COMPONENTS


class MATForConditionalGeneration(FlexformerForConditionalGeneration):
    """MAT encoder-decoder (model type ``mat``): the flexformer backbone with :class:`MATAttention` for every
    attention and :class:`MATFeedForward` for every FFN, the branch counts taken from :class:`MATConfig`."""

    config_class = MATConfig
    config: MATConfig
    base_model_class = MATModel
    components = MAT_COMPONENTS
    other_model_type_hints = {
        "flexformer": "to start a MAT model from this trained baseline (proximal initialisation, Sec. 3.3) use "
        "MATForConditionalGeneration.from_baseline(path)",
    }

    @classmethod
    def from_baseline(cls, baseline, **mat_overrides) -> MATForConditionalGeneration:
        """Proximal initialisation (Sec. 3.3): a MAT whose every attention branch (and FFN branch, for N_f > 1) is
        a copy of the trained baseline's layer; embeddings and LayerNorms are copied as they are.

        ``baseline`` is a directory saved by the baseline (``FlexformerForConditionalGeneration.save_pretrained``,
        model type ``flexformer``, one branch everywhere) or such a model. ``mat_overrides`` are
        :class:`MATConfig` fields (``encoder_attention_branches``, ``drop_branch_rate``, ``dropout``, ...); the
        shapes (d, d_h, layers, heads, vocabulary, ...) are the baseline's and cannot be overridden. With
        ``branch_merge="paper"`` the new model computes exactly the baseline's function when ρ = 0 (or in eval).
        """
        baseline_model = _load_flexformer_baseline(baseline)
        base_config = baseline_model.config.to_dict()
        for name in MAT_SHAPE_FIELDS:
            if name in mat_overrides and name in base_config and mat_overrides[name] != base_config[name]:
                raise ValueError(
                    f"from_baseline cannot change {name} (baseline {base_config[name]!r}, requested "
                    f"{mat_overrides[name]!r}): proximal initialisation clones the baseline's layers as they are"
                )
        for key in ("model_type", "architectures", "transformers_version", "auto_map", "_name_or_path", "dtype"):
            base_config.pop(key, None)
        mat_fields = {
            "encoder_attention_branches": MATConfig.encoder_attention_branches,
            "decoder_attention_branches": MATConfig.decoder_attention_branches,
        }
        config = MATConfig(**{**base_config, **mat_fields, **mat_overrides})
        model = cls(config)
        state = clone_state_dict_into_branches(model, baseline_model.state_dict(), "The baseline checkpoint")
        model.load_state_dict(state)
        if baseline_model.generation_config is not None:
            model.generation_config = baseline_model.generation_config
        return model


def _load_flexformer_baseline(baseline) -> FlexformerForConditionalGeneration:
    """The baseline model of a proximal initialisation, with a clear error for anything else."""
    if isinstance(baseline, nn.Module):
        if not isinstance(baseline, FlexformerForConditionalGeneration) or not _is_flexformer_baseline(
            baseline.config.to_dict()
        ):
            raise ValueError(
                f"from_baseline needs a single-branch flexformer baseline (model type 'flexformer'), got "
                f"{type(baseline).__name__} with model type {getattr(baseline.config, 'model_type', None)!r}"
            )
        return baseline
    path = os.fspath(baseline)
    config_path = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.isfile(config_path):
        raise ValueError(f"Baseline checkpoint {path!r} is not a directory with a config.json")
    try:
        with open(config_path, encoding="utf-8") as handle:
            config_dict = json.load(handle)
    except json.JSONDecodeError as error:
        raise ValueError(f"Baseline checkpoint {config_path!r} is not valid JSON: {error}") from error
    if not _is_flexformer_baseline(config_dict):
        raise ValueError(
            f"{path!r} is not a flexformer baseline checkpoint: its config.json has model_type "
            f"{config_dict.get('model_type')!r}"
            + (" with several branches" if config_dict.get("model_type") == "flexformer" else "")
            + "; proximal initialisation needs a directory saved by FlexformerForConditionalGeneration"
        )
    return FlexformerForConditionalGeneration.from_pretrained(path)


# ---------------------------------------------------------------------------------------------------------------
# Encoder-only MAT classifier (the paper's GLUE experiment on RoBERTa, Sec. 6)
# ---------------------------------------------------------------------------------------------------------------


def _widen_query_key_value(attention: nn.Module, num_branches: int) -> None:
    """N_a branches fused: query/key/value become ``Linear(d, N_a*d)`` (branch b = rows ``b*d:(b+1)*d``). The
    inherited RoBERTa/BERT forward infers the head count from the projection width (``view(..., -1, head_size)``),
    so it runs one attention call over N_a·M heads and returns ``[..., N_a*d]``, branch-major."""
    in_features = attention.query.in_features
    width = num_branches * attention.all_head_size
    attention.query = nn.Linear(in_features, width)
    attention.key = nn.Linear(in_features, width)
    attention.value = nn.Linear(in_features, width)


class MATRobertaSelfAttention(RobertaSelfAttention):
    """RoBERTa self-attention with ``config.num_attention_branches`` fused branches (Eq. 4); forward inherited."""

    def __init__(self, config, is_causal=False, layer_idx=None):
        super().__init__(config, is_causal=is_causal, layer_idx=layer_idx)
        _widen_query_key_value(self, config.num_attention_branches)


class MATBertSelfAttention(BertSelfAttention):
    """BERT self-attention with ``config.num_attention_branches`` fused branches (Eq. 4); forward inherited."""

    def __init__(self, config, is_causal=False, layer_idx=None):
        super().__init__(config, is_causal=is_causal, layer_idx=layer_idx)
        _widen_query_key_value(self, config.num_attention_branches)


class MATEncoderAttentionOutput(RobertaSelfOutput):
    """Replaces ``RobertaSelfOutput`` / ``BertSelfOutput``: ``LayerNorm(Q + dropout(Σ_b w_b (H_b W_b + c_b)))`` —
    each branch's own output projection, merged with the drop-branch weights (Eq. 5-6) in one GEMM, with optional
    drop-head factors on the heads (Eq. 9-10). Attribute names (``dense``, ``LayerNorm``, ``dropout``) match the
    Transformers modules, so proximal initialisation maps checkpoint names one to one."""

    def __init__(self, config):
        # The stock module's layers are built here instead (its `dense` would be a single-branch weight, drawn at
        # random and thrown away).
        nn.Module.__init__(self)
        self.num_branches = config.num_attention_branches
        self.num_heads = config.num_attention_heads
        self.drop_branch_rate = float(config.drop_branch_rate)
        self.drop_head_rate = float(config.drop_head_rate)
        self.branch_merge = config.branch_merge
        self.dense, self.dense_branch_bias = merge_projection(self.num_branches, config.hidden_size, config.hidden_size)
        if self.dense_branch_bias is not None:
            # Zeroed here, not only in `_init_weights`: inside the classifier this module sits under the encoder, a
            # PreTrainedModel of its own whose `_init_weights` Transformers applies to it and which does not know it.
            nn.init.zeros_(self.dense_branch_bias)
        self.register_load_state_dict_pre_hook(upgrade_merge_bias_on_load)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
        leading = hidden_states.shape[:-1]
        heads = drop_head_keep_scales(
            self.num_branches, self.num_heads, self.drop_head_rate, training=self.training,
            device=hidden_states.device, dtype=hidden_states.dtype,
        )
        if heads is not None:
            hidden_states = (hidden_states.view(*leading, heads.shape[0], -1) * heads[:, None]).flatten(-2)
        keep = drop_branch_keep_scales(
            self.num_branches, self.drop_branch_rate, training=self.training,
            device=hidden_states.device, dtype=hidden_states.dtype,
        )
        merged = merge_branches(
            self.dense, self.dense_branch_bias, hidden_states.view(*leading, self.num_branches, -1),
            multi_branch_merge_weights(keep, self.branch_merge),
        )
        return self.LayerNorm(self.dropout(merged) + input_tensor)


class MATEncoderFeedForwardOutput(RobertaOutput):
    """``RobertaOutput`` / ``BertOutput`` with drop-branch on the FFN: ``LayerNorm(x + I{U >= ρ}/(1-ρ) FFN(x))``
    (Eq. 7). Same parameters as the Transformers module."""

    def __init__(self, config):
        super().__init__(config)
        self.drop_branch_rate = config.effective_ffn_drop_branch_rate

    def forward(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
        hidden_states = self.dense(hidden_states)
        if self.training and self.drop_branch_rate > 0.0:
            keep = drop_branch_keep_scales(
                1, self.drop_branch_rate, training=True, device=hidden_states.device, dtype=hidden_states.dtype
            )
            hidden_states = hidden_states * keep
        hidden_states = self.dropout(hidden_states)
        return self.LayerNorm(hidden_states + input_tensor)


class _MATEncoderClassifierMixin:
    """Shared by the RoBERTa and BERT classifiers: swap the attention/FFN output modules after the Transformers
    constructor built the stock ones, initialise the new weights, and build from a baseline encoder checkpoint."""

    _self_attention_class: type
    _baseline_model_class: type
    _baseline_model_type: str

    def _make_multi_branch(self, config) -> None:
        for index, layer in enumerate(self.base_model.encoder.layer):
            layer.attention.self = self._self_attention_class(config, is_causal=config.is_decoder, layer_idx=index)
            layer.attention.output = MATEncoderAttentionOutput(config)
            layer.output = MATEncoderFeedForwardOutput(config)
        self.post_init()

    def initialize_weights(self):
        super().initialize_weights()
        # The encoder is a PreTrainedModel of its own: Transformers initialises the modules under it with the
        # encoder's `_init_weights`, which does not know the per-branch merge biases (a checkpoint without them
        # would leave `torch.empty` memory there).
        for module in self.base_model.modules():
            if isinstance(module, MATEncoderAttentionOutput):
                self._init_weights(module)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, MATEncoderAttentionOutput):
            # kept when loaded from a checkpoint; `dense` itself is a Linear: the encoder's own initialisation
            _init_branch_biases(module.dense_branch_bias)

    @classmethod
    def from_encoder(cls, encoder, **mat_overrides):
        """Proximal initialisation from a pretrained encoder (Sec. 3.3 applied to RoBERTa as in Sec. 6): each
        self-attention (q/k/v and output projection) is cloned into every branch; embeddings, FFNs, LayerNorms
        (and BERT's pooler) are copied; the classification head is freshly initialised.

        ``encoder`` is a local checkpoint directory of a ``RobertaModel`` (``BertModel`` for the BERT classifier)
        or such a model; ``mat_overrides`` are config fields (``num_labels``, ``num_attention_branches``,
        ``drop_branch_rate``, ...). With ``branch_merge="paper"`` and ρ = 0 (or in eval) the encoder computes
        exactly the baseline's hidden states.
        """
        base_model = _load_encoder_baseline(encoder, cls._baseline_model_class, cls._baseline_model_type)
        config_dict = base_model.config.to_dict()
        for key in ("model_type", "architectures", "transformers_version", "auto_map", "_name_or_path", "dtype"):
            config_dict.pop(key, None)
        if "num_labels" in mat_overrides or "id2label" in mat_overrides:
            # the new task's label set replaces whatever the pretrained encoder's config carried
            config_dict.pop("id2label", None)
            config_dict.pop("label2id", None)
        config = cls.config_class(**{**config_dict, **mat_overrides})
        model = cls(config)
        base_state = base_model.state_dict()
        target = model.base_model
        state = {}
        for name, tensor in target.state_dict().items():
            if name.endswith("_branch_bias"):  # the per-branch merge biases come from the encoder's merge bias
                base_name = name.removesuffix("_branch_bias") + ".bias"
                state[name] = clone_into_branches(tensor, base_state[base_name].to(tensor.dtype), name)
                continue
            if name not in base_state:
                # BERT's pooler is absent from a RobertaModel-style checkpoint saved without it: keep the fresh one
                state[name] = tensor
                continue
            state[name] = clone_into_branches(tensor, base_state[name].to(tensor.dtype), name)
        target.load_state_dict(state)
        return model


def _load_encoder_baseline(encoder, model_class: type, model_type: str):
    if isinstance(encoder, nn.Module):
        if not isinstance(encoder, model_class):
            raise ValueError(f"from_encoder needs a {model_class.__name__}, got {type(encoder).__name__}")
        return encoder
    path = os.fspath(encoder)
    config_path = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.isfile(config_path):
        raise ValueError(f"Encoder checkpoint {path!r} is not a directory with a config.json")
    with open(config_path, encoding="utf-8") as handle:
        found = json.load(handle).get("model_type")
    if found != model_type:
        raise ValueError(
            f"{path!r} is not a {model_type} checkpoint (its config.json has model_type {found!r}); "
            f"proximal initialisation needs a directory saved by {model_class.__name__}"
        )
    return model_class.from_pretrained(path)


class MATRobertaForSequenceClassification(_MATEncoderClassifierMixin, RobertaForSequenceClassification):
    """RoBERTa sequence classifier whose self-attention layers are multi-branch (model type ``mat_roberta``)."""

    config_class = MATRobertaConfig
    config: MATRobertaConfig
    _self_attention_class = MATRobertaSelfAttention
    _baseline_model_class = RobertaModel
    _baseline_model_type = "roberta"

    def __init__(self, config: MATRobertaConfig):
        super().__init__(config)
        self._make_multi_branch(config)


class MATBertForSequenceClassification(_MATEncoderClassifierMixin, BertForSequenceClassification):
    """BERT sequence classifier whose self-attention layers are multi-branch (model type ``mat_bert``)."""

    config_class = MATBertConfig
    config: MATBertConfig
    _self_attention_class = MATBertSelfAttention
    _baseline_model_class = BertModel
    _baseline_model_type = "bert"

    def __init__(self, config: MATBertConfig):
        super().__init__(config)
        self._make_multi_branch(config)


__all__ = [
    "MAT_COMPONENTS",
    "MATModel",
    "MATAttention",
    "MATFeedForward",
    "MATForConditionalGeneration",
    "MATRobertaForSequenceClassification",
    "MATBertForSequenceClassification",
    "drop_branch_keep_scales",
    "drop_head_keep_scales",
    "multi_branch_merge_weights",
    "clone_into_branches",
    "register_mat_classifiers",
]


def register_mat_classifiers() -> None:
    """Register the encoder-only classifiers with AutoConfig / AutoModelForSequenceClassification (idempotent)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    for config_class, model_class in (
        (MATRobertaConfig, MATRobertaForSequenceClassification),
        (MATBertConfig, MATBertForSequenceClassification),
    ):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModelForSequenceClassification.register(config_class, model_class, exist_ok=True)
