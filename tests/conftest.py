"""Shared test set-up: offline Hub, few threads, deterministic tiny configs."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def tiny_config_kwargs(**overrides):
    """A 2+2-block, d=32 backbone: fast on CPU, big enough to exercise every code path."""
    kwargs = dict(
        vocab_size=60,
        encoder_embed_dim=32,
        decoder_embed_dim=32,
        encoder_ffn_embed_dim=64,
        decoder_ffn_embed_dim=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        dropout=0.0,
        max_source_positions=64,
        max_target_positions=64,
    )
    kwargs.update(overrides)
    return kwargs


@pytest.fixture
def tiny_kwargs():
    return tiny_config_kwargs
