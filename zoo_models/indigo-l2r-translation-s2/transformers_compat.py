"""What differs between the Transformers releases flexformers supports (5.23 up to the next major), in one place.

Transformers 5.24 renamed the generation cache from `past_key_values` to `cache`: `generate()` passes it to
`forward` as `cache=`, keeps it in `model_kwargs["cache"]`, reads it back from the output's `cache` field, and the
standard output classes declare a `cache` field (with `past_key_values` as a deprecated alias that logs a warning).
5.23 uses `past_key_values` for all of these. Inside, the models call the cache `past_key_values`; the code at their
public boundary (model `forward`s, output objects, `generate()` hooks) goes through this module, so no other file
knows which release is running. From 5.24 on, `past_key_values=` is the deprecated spelling: Transformers' own models
(BART's `forward`s) warn with `deprecate_kwarg`, and so do ours; on 5.23 it is the real name and nothing warns. Code
inside the package passes the cache to a public `forward` as `cache=`, which every release takes.

Gradient checkpointing: 5.24 checkpoints a `GradientCheckpointingLayer` only while autograd records the call; 5.23
also checkpoints a call made under `torch.no_grad()` in training mode, and then passes the layer
`past_key_values=None` (`CheckpointOnlyWithGradients` gives every release 5.24's behaviour).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers.modeling_outputs import Seq2SeqLMOutput
from transformers.utils.deprecation import deprecate_kwarg

#: The name the running Transformers gives the cache: `forward` argument, `model_kwargs` key, output field.
CACHE_NAME: str = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"
#: The spelling of the new releases, accepted by every model `forward` whatever the release.
NEW_CACHE_ARGUMENT = "cache"
#: The release Transformers' own models name for removing `past_key_values=` (BART's `deprecate_kwarg`s, 5.24).
OLD_CACHE_ARGUMENT_REMOVAL = "5.40.0"


def cache_field(cache: Any) -> dict[str, Any]:
    """`{name: cache}` for building an output object: `Seq2SeqLMOutput(logits=..., **cache_field(cache))`."""
    return {CACHE_NAME: cache}


def output_cache(outputs: Mapping[str, Any] | None) -> Any:
    """The cache an output object (model output or `generate()` output) carries, or None."""
    if outputs is None or not isinstance(outputs, Mapping):
        return None
    return outputs.get(CACHE_NAME)


def generation_cache(model_kwargs: Mapping[str, Any]) -> Any:
    """The cache `generate()` keeps in its `model_kwargs` (None before one is built)."""
    return model_kwargs.get(CACHE_NAME)


def set_generation_cache(model_kwargs: dict[str, Any], cache: Any) -> None:
    """Replace the cache `generate()` will pass to the model's `forward`."""
    model_kwargs[CACHE_NAME] = cache


def pass_cache_as_past_key_values(args: tuple, kwargs: dict, past_index: int) -> dict:
    """`kwargs` with a `cache=` argument moved to `past_key_values` (the name the forwards take), refusing a cache
    also given as `past_key_values`, by keyword or by position (``past_index``: its place in the signature, `self` at 0)."""
    cache = kwargs.pop(NEW_CACHE_ARGUMENT, None)
    if cache is not None:
        if kwargs.get("past_key_values") is not None or len(args) >= past_index:
            raise ValueError("Pass the cache once: as `cache` or as `past_key_values`, not both.")
        kwargs["past_key_values"] = cache
    return kwargs


def refuse_both_cache_names(kwargs: dict) -> None:
    """Both names given is refused before `deprecate_kwarg` would keep `cache` and drop the other with a warning:
    two different caches passed is a mistake to name, not one to guess at."""
    if kwargs.get(NEW_CACHE_ARGUMENT) is not None and kwargs.get("past_key_values") is not None:
        raise ValueError("Pass the cache once: as `cache` or as `past_key_values`, not both.")


#: What `generate()` passes beside the inputs that these models derive themselves: positions come from the cache and
#: the padding (fairseq's numbering), so the passed ones are set aside.
GENERATION_POSITION_ARGUMENTS = ("cache_position", "position_ids", "decoder_position_ids")


def drop_generation_position_arguments(kwargs: dict) -> None:
    """Remove :data:`GENERATION_POSITION_ARGUMENTS` from a forward's ``kwargs``."""
    for key in GENERATION_POSITION_ARGUMENTS:
        kwargs.pop(key, None)


def accepts_cache_argument(forward: Callable) -> Callable:
    """Decorator for a public `forward(self, ..., past_key_values=None, ...)`: it also takes the cache as `cache=`
    (what `generate()` passes from Transformers 5.24 on, and what users of those releases write). Giving both names
    is an error. The wrapper's signature lists `cache` as a keyword-only argument, so Transformers' introspection of
    `forward` (argument validation in `generate()`) sees it.

    Where the running release calls the cache `cache` (5.24 on), `past_key_values=` still works but warns exactly as
    BART's `forward`s do: Transformers' own `deprecate_kwarg` (a `FutureWarning` naming `Class.forward`). On 5.23 it
    is the release's own name and does not warn."""
    signature = inspect.signature(forward)
    parameters = list(signature.parameters.values())
    if "past_key_values" not in signature.parameters:
        raise TypeError(f"{forward.__qualname__} has no `past_key_values` argument to alias")
    if NEW_CACHE_ARGUMENT not in signature.parameters:
        alias = inspect.Parameter(NEW_CACHE_ARGUMENT, inspect.Parameter.KEYWORD_ONLY, default=None)
        var_keyword = [p for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD]
        parameters = [p for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD] + [alias] + var_keyword
    past_index = list(signature.parameters).index("past_key_values")

    @functools.wraps(forward)
    def forward_taking_either_cache_name(self, *args, **kwargs):
        return forward(self, *args, **pass_cache_as_past_key_values(args, kwargs, past_index))

    forward_taking_either_cache_name.__signature__ = signature.replace(parameters=parameters)
    if CACHE_NAME != NEW_CACHE_ARGUMENT:
        return forward_taking_either_cache_name
    renaming = deprecate_kwarg("past_key_values", OLD_CACHE_ARGUMENT_REMOVAL, new_name=NEW_CACHE_ARGUMENT)(
        forward_taking_either_cache_name
    )

    @functools.wraps(forward_taking_either_cache_name)
    def forward_warning_of_the_old_cache_name(self, *args, **kwargs):
        refuse_both_cache_names(kwargs)
        return renaming(self, *args, **kwargs)

    return forward_warning_of_the_old_cache_name


class CheckpointOnlyWithGradients:
    """Mixin for a `GradientCheckpointingLayer`: its `gradient_checkpointing` flag (what Transformers sets and reads)
    holds only while autograd records the call, so a block run under `torch.no_grad()` in training mode — InDIGO's
    order search with its cache, inside a training step — runs as is, cache included, on 5.23 as on 5.24 (there is
    no backward pass to recompute it for)."""

    _gradient_checkpointing: bool = False

    @property
    def gradient_checkpointing(self) -> bool:
        return self._gradient_checkpointing and torch.is_grad_enabled()

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enabled: bool) -> None:
        self._gradient_checkpointing = enabled
