"""Configurations of the flexformers backbone and methods."""

from .configuration_flexformer import PRESETS, FlexformerConfig

__all__ = ["FlexformerConfig", "PRESETS"]
