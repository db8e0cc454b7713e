"""How a model type plugs into the training and decoding scripts.

The contract
============
Each model type ``<model_type>`` (the config's ``model_type``, e.g. ``"flexformer"``, ``"iot"``) has a module
``training_scripts/methods/<model_type>.py`` that defines one module-level object::

    SPEC = MethodSpec(
        model_type="iot",
        config_class=IOTConfig,                       # has from_preset(name, **overrides)
        model_class=IOTForConditionalGeneration,      # a PreTrainedModel with generate()
        arguments_class=IOTArguments,                 # optional dataclass of extra CLI flags
        build_model=build_iot_model,                  # optional hooks, see below
        data_collator=make_iot_collator,
        callbacks=make_iot_callbacks,
        trainer_class=None,                           # optional Seq2SeqTrainer subclass
    )

``flexformers-train --model_type iot ...`` calls :func:`get_method_spec`, which imports that module lazily
(so a method that is slow to import or broken never affects the others) and returns ``SPEC``.

What the train script does with it, in order:

1. Parses its own dataclasses plus ``spec.arguments_class`` (if any) with ``HfArgumentParser``; the method's
   flags appear in ``--help`` only for its model type. Field names must not clash with the shared argument
   dataclasses of ``flexformers.training_scripts.train`` (``ModelArguments``, ``DataArguments``, ``Seq2SeqTrainingArguments``).
   The parsed instance is passed as ``method_args`` to every hook (``None`` when there is no arguments class).
2. Builds the tokenizer and the config: ``spec.config_class.from_preset(preset, **overrides)`` where the
   overrides are ``--config_overrides "key=value,..."`` plus the vocabulary size and special token ids taken
   from the tokenizer. Then ``spec.update_config(config, method_args)`` if given (returns the config).
3. ``model = spec.build_model(model_args, method_args, config, tokenizer)``; the default
   (:func:`default_build_model`) is ``model_class.from_pretrained(model_args.model_name_or_path)`` when a
   checkpoint is given (refused when a weight is missing or left over: load through
   :func:`load_initial_checkpoint` in a hook too), else ``model_class(config)``. Use the hook e.g. for proximal
   initialisation from a baseline checkpoint (MAT).
4. ``collator = spec.data_collator(tokenizer, model, method_args)``; the default is
   :func:`default_data_collator` (``DataCollatorForSeq2Seq``: ``input_ids``, ``attention_mask``, ``labels``
   padded with -100, ``decoder_input_ids`` built by the model's ``prepare_decoder_input_ids_from_labels`` when
   it has one). Features reaching the collator are ``{"input_ids": [...], "labels": [...]}`` (token ids, both
   ending with ``</s>``=2; no ``<s>`` prefix). A custom collator must keep ``labels`` in the batch
   (``predict_with_generate`` and the metrics use them) and may add any extra tensors the model's
   ``forward`` accepts.
5. ``callbacks = spec.callbacks(method_args)`` (a list of ``TrainerCallback``; e.g. a temperature or
   drop-rate schedule) and ``trainer_class = spec.trainer_class or Seq2SeqTrainer``; a custom trainer class
   must accept the same constructor arguments as ``Seq2SeqTrainer``.

The model computes its own loss from ``labels`` (label smoothing via ``config.label_smoothing``; Trainer's
``label_smoothing_factor`` stays 0) and must accept ``num_items_in_batch`` for exact gradient accumulation.
Evaluation calls ``model.generate(input_ids, attention_mask, num_beams=..., length_penalty=...,
max_new_tokens=...)`` and expects a LongTensor of token ids back (a method that decodes differently
overrides ``generate``).

Special token ids every pipeline tokenizer uses: ``<s>``=0, ``<pad>``=1, ``</s>``=2, ``<unk>``=3,
``<eod>``=4 (InDIGO's end-of-decoding); the decoder starts from ``</s>``.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import pkgutil
import re
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_MODEL_TYPE_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """Everything the train/decode scripts need to know about one model type (see the module docstring)."""

    model_type: str
    config_class: type
    model_class: type
    arguments_class: type | None = None
    build_model: Callable[..., Any] | None = None
    data_collator: Callable[..., Any] | None = None
    callbacks: Callable[..., list] | None = None
    trainer_class: type | None = None
    update_config: Callable[..., Any] | None = None
    description: str = ""

    def __post_init__(self):
        if not _MODEL_TYPE_PATTERN.match(self.model_type):
            raise ValueError(f"MethodSpec.model_type must match {_MODEL_TYPE_PATTERN.pattern}, got {self.model_type!r}")
        if self.arguments_class is not None and not dataclasses.is_dataclass(self.arguments_class):
            raise ValueError(
                f"MethodSpec.arguments_class for {self.model_type!r} must be a dataclass "
                f"(HfArgumentParser parses it), got {self.arguments_class!r}"
            )
        for hook_name in ("build_model", "data_collator", "callbacks", "update_config"):
            hook = getattr(self, hook_name)
            if hook is not None and not callable(hook):
                raise ValueError(f"MethodSpec.{hook_name} for {self.model_type!r} must be callable, got {hook!r}")

    def make_model(self, model_args, method_args, config, tokenizer):
        """The model for training: the method's ``build_model`` hook or :func:`default_build_model`."""
        if self.build_model is None:
            return default_build_model(model_args, method_args, config, tokenizer, model_class=self.model_class)
        return self.build_model(model_args, method_args, config, tokenizer)

    def make_data_collator(self, tokenizer, model, method_args):
        """The method's ``data_collator`` hook or :func:`default_data_collator`."""
        if self.data_collator is None:
            return default_data_collator(tokenizer, model, method_args)
        return self.data_collator(tokenizer, model, method_args)

    def make_callbacks(self, method_args) -> list:
        """The method's Trainer callbacks (empty list when it has none)."""
        return list(self.callbacks(method_args)) if self.callbacks is not None else []

    def make_config(self, config, method_args):
        """Apply the method's ``update_config`` hook, if any."""
        if self.update_config is None:
            return config
        updated = self.update_config(config, method_args)
        return config if updated is None else updated


#: What a refusal of ``--model_name_or_path`` with missing weights tells the user to pass to load it anyway.
ALLOW_MISSING_WEIGHTS_HINT = "pass --allow_missing_weights to initialise from it anyway"


def load_initial_checkpoint(model_class, model_args, config):
    """``model_class.from_pretrained(model_args.model_name_or_path, config=config)`` for training, refused
    (``ValueError``, one line naming them) when a weight is missing, unexpected or of another shape, unless
    ``model_args.allow_missing_weights``. The weights that ``config`` adds to (or drops from) the checkpoint's own
    architecture are expected, and logged: a method initialised from a plain ``flexformer`` checkpoint, or
    Depth-Adaptive's second stage adding its halting mechanism. The methods' ``build_model`` hooks load through it."""
    from flexformers.training_scripts.model_loading import architecture_change, load_pretrained_checked

    checkpoint = model_args.model_name_or_path
    added, removed = architecture_change(model_class, config, checkpoint)
    if added or removed:
        logger.warning(
            "%s: %d weight(s) that this %s adds to the checkpoint's architecture start from their initialisation "
            "(%s); %d of the checkpoint's go unused", checkpoint, len(added), model_class.__name__,
            ", ".join(sorted(added)[:5]) + (" ..." if len(added) > 5 else ""), len(removed),
        )
    return load_pretrained_checked(
        model_class,
        checkpoint,
        config=config,
        allow_missing_weights=bool(getattr(model_args, "allow_missing_weights", False)),
        allow_hint=ALLOW_MISSING_WEIGHTS_HINT,
        expected_missing=added,
        expected_unexpected=removed,
    )


def default_build_model(model_args, method_args, config, tokenizer, model_class=None):
    """``from_pretrained`` when ``model_args.model_name_or_path`` is set (every weight must load, see
    :func:`load_initial_checkpoint`), else a freshly initialised model."""
    if model_class is None:
        raise ValueError("default_build_model needs model_class")
    checkpoint = getattr(model_args, "model_name_or_path", None)
    if checkpoint:
        return load_initial_checkpoint(model_class, model_args, config)
    return model_class(config)


def default_data_collator(tokenizer, model, method_args=None):
    """Dynamic padding for (input_ids, labels) features; labels padded with -100, pad to a multiple of 8."""
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100, pad_to_multiple_of=8)


def available_model_types() -> list[str]:
    """Model types that have a module in ``training_scripts/methods`` (not imported)."""
    from flexformers.training_scripts import methods

    return sorted(info.name for info in pkgutil.iter_modules(methods.__path__) if not info.name.startswith("_"))


def get_method_spec(model_type: str) -> MethodSpec:
    """Import ``flexformers.training_scripts.methods.<model_type>`` and return its ``SPEC``.

    Raises ``ValueError`` naming the available model types for an unknown type, and for a module that does not
    define a ``MethodSpec`` called ``SPEC`` (or one whose ``model_type`` disagrees with the file name).
    Import errors *inside* an existing method module propagate unchanged, so their traceback stays useful.
    """
    if not isinstance(model_type, str) or not _MODEL_TYPE_PATTERN.match(model_type):
        raise ValueError(
            f"--model_type {model_type!r} is not a valid model type name; available: {', '.join(available_model_types())}"
        )
    known = available_model_types()
    if model_type not in known:
        raise ValueError(f"Unknown --model_type {model_type!r}; available: {', '.join(known) or '(none)'}")
    module = importlib.import_module(f"flexformers.training_scripts.methods.{model_type}")
    spec = getattr(module, "SPEC", None)
    if not isinstance(spec, MethodSpec):
        raise ValueError(f"training_scripts/methods/{model_type}.py must define SPEC = MethodSpec(...), found {spec!r}")
    if spec.model_type != model_type:
        raise ValueError(
            f"training_scripts/methods/{model_type}.py defines SPEC.model_type={spec.model_type!r}; "
            f"it must equal the module name {model_type!r}"
        )
    return spec
