"""Transformers' output capture (`capture_outputs`, what BART's encoder and decoder use) for the backbone's stacks,
skipped on the decoding steps that record nothing."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from transformers.utils.output_capturing import _active_collector, capture_outputs


def _collection_under_way() -> bool:
    """Whether a `capture_outputs` collection is active. While compiling, Transformers' `CompileableContextVar`
    keeps the collector in a plain global (Dynamo cannot trace `ContextVar.get`), so that is read instead."""
    if torch.compiler.is_compiling():
        return _active_collector.global_var is not None
    return _active_collector.get() is not None


def _nothing_to_record(forward_kwargs: dict) -> bool:
    """Both output flags given as False and no collection under way (every decoding step: the models pass both flags
    resolved), so `capture_outputs`' look-ups of the config's defaults (~5 config reads, tens of µs a call on CPU) can
    be skipped."""
    return (
        forward_kwargs.get("output_attentions", True) is False
        and forward_kwargs.get("output_hidden_states", True) is False
        and not _collection_under_way()
    )


def records_block_outputs(forward: Callable) -> Callable:
    """Transformers' `capture_outputs` for a stack's `forward` (what BART's encoder and decoder use): the hidden
    states and attention weights named in the stack's `_can_record_outputs` are collected by forward hooks on its
    blocks (installed the first time they are asked for), and `return_dict=False` gives the tuple. Unlike a
    `PreTrainedModel`'s, a stack's `return_dict` defaults to True whatever `config.return_dict` says: the models
    read its fields by name."""
    recording = capture_outputs(forward)

    @functools.wraps(recording)
    def forward_returning_output_objects(self, *args, return_dict: bool = True, **kwargs):
        if _nothing_to_record(kwargs):
            output = forward(self, *args, **kwargs)
            return output if return_dict else output.to_tuple()
        return recording(self, *args, return_dict=return_dict, **kwargs)

    return forward_returning_output_objects
