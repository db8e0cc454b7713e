"""Configurations of the flexformers backbone and methods."""

from .configuration_depth_adaptive import DepthAdaptiveConfig
from .configuration_flexformer import PRESETS, FlexformerConfig
from .configuration_indigo import InDIGOConfig
from .configuration_iot import IOTConfig
from .configuration_mat import MATConfig

__all__ = ["DepthAdaptiveConfig", "FlexformerConfig", "InDIGOConfig", "IOTConfig", "MATConfig", "PRESETS"]
