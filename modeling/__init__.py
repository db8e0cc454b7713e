"""flexformers models. Importing this package registers every model type with the Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from configuration.configuration_flexformer import FlexformerConfig

from .modeling_flexformer import (
    BackboneComponents,
    FlexformerForConditionalGeneration,
    FlexformerModel,
    FlexformerPreTrainedModel,
    PerRowSublayerOrder,
)


def _register(config_class, base_model_class, seq2seq_class):
    """Register a model type with AutoConfig / AutoModel / AutoModelForSeq2SeqLM (idempotent)."""
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(config_class, base_model_class, exist_ok=True)
    AutoModelForSeq2SeqLM.register(config_class, seq2seq_class, exist_ok=True)


_register(FlexformerConfig, FlexformerModel, FlexformerForConditionalGeneration)

# Method registrations (one line each; keep this block sorted by method).
from .modeling_depth_adaptive import (  # noqa: E402
    DepthAdaptiveConfig,
    DepthAdaptiveForConditionalGeneration,
    DepthAdaptiveModel,
)

_register(DepthAdaptiveConfig, DepthAdaptiveModel, DepthAdaptiveForConditionalGeneration)
from .modeling_iot import IOTConfig, IOTForConditionalGeneration, IOTModel  # noqa: E402

_register(IOTConfig, IOTModel, IOTForConditionalGeneration)
from .modeling_mat import MATConfig, MATForConditionalGeneration, MATModel, register_mat_classifiers  # noqa: E402

_register(MATConfig, MATModel, MATForConditionalGeneration)
register_mat_classifiers()  # MAT's encoder-only classifiers (mat_roberta, mat_bert): AutoModelForSequenceClassification
from .modeling_indigo import InDIGOConfig, InDIGOForConditionalGeneration, InDIGOModel  # noqa: E402

_register(InDIGOConfig, InDIGOModel, InDIGOForConditionalGeneration)

__all__ = [
    "BackboneComponents",
    "DepthAdaptiveConfig",
    "DepthAdaptiveForConditionalGeneration",
    "DepthAdaptiveModel",
    "FlexformerConfig",
    "FlexformerForConditionalGeneration",
    "FlexformerModel",
    "FlexformerPreTrainedModel",
    "MATConfig",
    "MATForConditionalGeneration",
    "MATModel",
    "PerRowSublayerOrder",
]
