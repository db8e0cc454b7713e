"""The baseline: fairseq's Transformer (model type ``flexformer``) with the default hooks.

Use it as the template for a method module: define ``SPEC = MethodSpec(...)`` (see
:mod:`flexformers.training_scripts.model_registry`).
"""

from flexformers.configuration.configuration_flexformer import FlexformerConfig
from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration
from flexformers.training_scripts.model_registry import MethodSpec

SPEC = MethodSpec(
    model_type="flexformer",
    config_class=FlexformerConfig,
    model_class=FlexformerForConditionalGeneration,
    name="Transformer",
    is_baseline=True,
    description="fairseq Transformer baseline (post-norm, sinusoidal positions, label-smoothed loss in the model)",
)
