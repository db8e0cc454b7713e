"""flexformers models. Importing this package registers every model type with the Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from flexformers.configuration.configuration_flexformer import FlexformerConfig

from .modeling_flexformer import (
    BackboneComponents,
    FlexformerForConditionalGeneration,
    FlexformerModel,
    FlexformerPreTrainedModel,
)
from .sublayer_order import PerRowSublayerOrder


def _register(config_class, base_model_class, seq2seq_class):
    """Register a model type with AutoConfig / AutoModel / AutoModelForSeq2SeqLM (idempotent)."""
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(config_class, base_model_class, exist_ok=True)
    AutoModelForSeq2SeqLM.register(config_class, seq2seq_class, exist_ok=True)


_register(FlexformerConfig, FlexformerModel, FlexformerForConditionalGeneration)

# Method registrations, one per model type.
from flexformers.configuration import (  # noqa: E402
    DepthAdaptiveConfig,
    InDIGOConfig,
    IOTConfig,
    MATConfig,
)

from .modeling_depth_adaptive import (  # noqa: E402
    DepthAdaptiveForConditionalGeneration,
    DepthAdaptiveModel,
)
from .modeling_indigo import InDIGOForConditionalGeneration, InDIGOModel  # noqa: E402
from .modeling_iot import IOTForConditionalGeneration, IOTModel  # noqa: E402
from .modeling_mat import (  # noqa: E402
    MATBertForSequenceClassification,
    MATForConditionalGeneration,
    MATModel,
    MATRobertaForSequenceClassification,
    register_mat_classifiers,
)

_register(DepthAdaptiveConfig, DepthAdaptiveModel, DepthAdaptiveForConditionalGeneration)
_register(InDIGOConfig, InDIGOModel, InDIGOForConditionalGeneration)
_register(IOTConfig, IOTModel, IOTForConditionalGeneration)
_register(MATConfig, MATModel, MATForConditionalGeneration)
register_mat_classifiers()  # MAT's encoder-only classifiers (mat_roberta, mat_bert): AutoModelForSequenceClassification

__all__ = [
    "BackboneComponents",
    "DepthAdaptiveForConditionalGeneration",
    "DepthAdaptiveModel",
    "FlexformerForConditionalGeneration",
    "FlexformerModel",
    "FlexformerPreTrainedModel",
    "InDIGOForConditionalGeneration",
    "InDIGOModel",
    "IOTForConditionalGeneration",
    "IOTModel",
    "MATBertForSequenceClassification",
    "MATForConditionalGeneration",
    "MATModel",
    "MATRobertaForSequenceClassification",
    "PerRowSublayerOrder",
]
