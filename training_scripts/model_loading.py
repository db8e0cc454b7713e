"""Loading a trained model so that every weight comes from the checkpoint, or the load is refused.

``PreTrainedModel.from_pretrained`` initialises a parameter the weights file lacks at random and only logs it, so
a ``model.safetensors`` missing a tensor decodes (or trains on) garbage with exit status 0. The project's loaders
(``flexformers-decode`` and the method tools, ``flexformers-export``, ``flexformers-train --model_name_or_path`` and
the methods' ``build_model`` hooks) go through :func:`load_pretrained_checked`, which refuses missing, unexpected and
mismatched weights with one line naming them, unless the caller allows them.

Tied weights: a tied model (shared embeddings, output projection tied to them) saves only one tensor of each tied
group, and Transformers leaves the others out of ``missing_keys``. It also leaves out a tied group none of whose
tensors is in the file, which is then silently random; :func:`weight_loading_problem` reads the names in the
weights file to catch exactly that case.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

#: How many tensor names a message lists before "and N more".
_NAMES_SHOWN = 5


class WeightsNotLoadedError(ValueError):
    """A checkpoint whose weights do not all load into the model (the message names them)."""


def checkpoint_tensor_names(checkpoint: str | os.PathLike) -> set[str] | None:
    """Names of the tensors in a local checkpoint's safetensors weights (single file or sharded index), read from
    the file headers only; ``None`` when that cannot be told (a Hub id, ``pytorch_model.bin``, an unreadable file)."""
    from safetensors import safe_open

    directory = Path(checkpoint)
    if not directory.is_dir():
        return None
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    try:
        if single.is_file():
            files = [single]
        elif index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
            files = [directory / name for name in sorted(set(weight_map.values()))]
        else:
            return None
        names: set[str] = set()
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                names.update(handle.keys())
        return names
    except (OSError, ValueError, RuntimeError, json.JSONDecodeError):
        return None


def _tied_groups(model) -> dict[str, set[str]]:
    """The parameter names that share one tensor (Transformers' ``all_tied_weights_keys``), by the name the tensor
    is saved under."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    groups: dict[str, set[str]] = {}
    for target, source in tied.items():
        groups.setdefault(source, {source}).add(target)
    return groups


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_NAMES_SHOWN])
    return shown + (f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else "")


def weight_loading_problem(
    model,
    loading_info: dict,
    checkpoint: str | os.PathLike,
    *,
    expected_missing: Collection[str] = (),
    expected_unexpected: Collection[str] = (),
) -> str | None:
    """One line naming the weights of ``checkpoint`` that did not load into ``model`` (left randomly initialised,
    present in the file but unused, or of another shape), or ``None`` when every weight is accounted for.

    ``loading_info`` is what ``from_pretrained(..., output_loading_info=True)`` returned; ``expected_missing`` /
    ``expected_unexpected`` are names a caller deliberately initialises anew or drops (a method changing the
    architecture on purpose)."""
    model_names = set(model.state_dict().keys())
    missing = set(loading_info.get("missing_keys") or ())
    file_names = checkpoint_tensor_names(checkpoint)
    if file_names is not None and file_names & model_names:
        for saved_name, group in _tied_groups(model).items():
            if group & file_names:
                missing -= group  # tied to a tensor that was loaded
            else:
                missing -= group
                missing.add(saved_name)  # no member in the file: the shared tensor is random
    missing -= set(expected_missing)
    unexpected = set(loading_info.get("unexpected_keys") or ()) - set(expected_unexpected)
    mismatched = {str(entry[0]) if isinstance(entry, (tuple, list)) else str(entry)
                  for entry in loading_info.get("mismatched_keys") or ()}
    errors = [str(message) for message in loading_info.get("error_msgs") or ()]
    parts = []
    if missing:
        parts.append(f"{len(missing)} weight(s) of {type(model).__name__} missing from the checkpoint (they would be "
                     f"randomly initialised): {_listing(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} weight(s) in the checkpoint that {type(model).__name__} does not have: "
                     f"{_listing(unexpected)}")
    if mismatched:
        parts.append(f"{len(mismatched)} weight(s) of another shape: {_listing(mismatched)}")
    if errors:
        parts.append("; ".join(message.splitlines()[0] for message in errors if message))
    if not parts:
        return None
    return f"{checkpoint}: " + "; ".join(parts)


def load_pretrained_checked(
    model_class,
    checkpoint: str | os.PathLike,
    *,
    allow_missing_weights: bool = False,
    allow_hint: str = "",
    expected_missing: Collection[str] = (),
    expected_unexpected: Collection[str] = (),
    **from_pretrained_kwargs,
):
    """``model_class.from_pretrained(checkpoint, **from_pretrained_kwargs)``, refused with a ``ValueError`` of one
    line (:class:`WeightsNotLoadedError`) when a weight is missing, unexpected or of another shape (see
    :func:`weight_loading_problem`).

    ``allow_missing_weights`` turns the refusal into a warning; ``allow_hint`` (e.g. ``"pass
    --allow_missing_weights to load it anyway"``) is appended to the refusal so the user knows how to choose that."""
    model, loading_info = model_class.from_pretrained(
        str(checkpoint), output_loading_info=True, **from_pretrained_kwargs
    )
    problem = weight_loading_problem(
        model, loading_info, checkpoint, expected_missing=expected_missing, expected_unexpected=expected_unexpected
    )
    if problem is not None:
        if not allow_missing_weights:
            raise WeightsNotLoadedError(f"{problem}; the checkpoint is incomplete or of another architecture"
                             + (f" ({allow_hint})" if allow_hint else ""))
        logger.warning("loading anyway, as asked: %s", problem)
    return model


def architecture_change(model_class, config, checkpoint: str | os.PathLike) -> tuple[set[str], set[str]]:
    """(weights a ``model_class(config)`` has that the model saved in ``checkpoint`` does not, weights the saved model
    has that this one does not), from the checkpoint's ``config.json`` and its model type's class: what a model
    built on purpose with another architecture than the checkpoint's (a method initialised from a plain
    ``flexformer`` checkpoint, Depth-Adaptive's second stage adding its halting mechanism) initialises anew or
    leaves unused. Empty sets when the checkpoint's architecture cannot be read (a Hub id, no config): every weight
    is then required. Both models are built on the ``meta`` device, at no memory or initialisation cost."""
    import torch

    from flexformers.training_scripts.model_registry import available_model_types, get_method_spec

    config_path = Path(checkpoint) / "config.json"
    try:
        saved_type = json.loads(config_path.read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return set(), set()
    if saved_type not in available_model_types():
        return set(), set()
    saved_spec = get_method_spec(saved_type)
    saved_config = saved_spec.config_class.from_pretrained(str(checkpoint))
    with torch.device("meta"):
        saved_names = set(saved_spec.model_class(saved_config).state_dict().keys())
        built_names = set(model_class(config).state_dict().keys())
    return built_names - saved_names, saved_names - built_names
