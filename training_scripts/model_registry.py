"""How a model type plugs into the training and decoding scripts.

The contract
============
Each model type ``<model_type>`` (the config's ``model_type``, e.g. ``"flexformer"``, ``"iot"``) has one
``MethodSpec``. The package's own methods define it as ``SPEC`` in ``training_scripts/methods/<model_type>.py``; a
method defined anywhere else plugs in without touching the package, either by :func:`register_method` in the
process that runs the tools (``train.main(argv)``, a notebook, a test) or, for a package of its own, by an entry
point in the group ``flexformers.methods`` (``<model_type> = "my_package.my_module:SPEC"``)::

    SPEC = MethodSpec(
        model_type="iot",
        config_class=IOTConfig,                       # has from_preset(name, **overrides)
        model_class=IOTForConditionalGeneration,      # a PreTrainedModel with generate()
        arguments_class=IOTArguments,                 # optional dataclass of extra CLI flags
        build_model=build_iot_model,                  # optional hooks, see below
        data_collator=make_iot_collator,
        callbacks=make_iot_callbacks,
        trainer_class=IOTSeq2SeqTrainer,             # optional FlexformersSeq2SeqTrainer subclass
        figures=iot_figures,                          # optional: what the method does at inference
    )

``flexformers-train --model_type iot ...`` calls :func:`get_method_spec`, which imports that module lazily
(so a method that is slow to import or broken never affects the others) and returns ``SPEC``. The model's config
and model classes must be registered with ``AutoConfig`` / ``AutoModelForSeq2SeqLM`` (the tools load trained models
through them).

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
   drop-rate schedule) and ``trainer_class = spec.trainer_class or FlexformersSeq2SeqTrainer``; a method's own
   trainer subclasses :class:`~flexformers.training_scripts.trainer.FlexformersSeq2SeqTrainer`.

What the other tools ask a spec (each optional, with the plain Transformer's answer as default):

- ``decodes_left_to_right`` (True): prefix constraints such as ``--permutation_of_source`` apply to its decoding.
- ``decoder_tokens_beyond_target`` (0): how many more tokens the method's decoder reads than the tokenized target
  holds (InDIGO: 1, its start pair ``<s> </s>`` in place of the target's ``</s>``); the check that
  ``--max_target_length`` fits the decoder's position table counts them.
- ``figures(model, source_tokenizer, target_tokenizer, sources, limit) -> dict``: what the method does at inference
  on the first ``limit`` sources (IOT's order usage, the exits of Depth-Adaptive), in the quickstart's and the zoo's
  reports.
- ``zoo_analysis(recipe, output_dir, test_sources, smoke, test_hypotheses) -> dict``: the zoo's further figures of a
  trained recipe (IOT's case verification, Depth-Adaptive's threshold sweep), merged into its ``figures``.
- ``zoo_report(results, spread, plots_dir) -> (lines, plots)``: the method's own sections of ``docs/ZOO.md`` and
  its plots (``[(title, path)]``), from the finished results of every type.
- ``zoo_figures_text(figures) -> list[str]``: the zoo table's cell of the method's figures (default: each as
  ``name: value``), leaving out the tables its ``zoo_report`` renders.
- ``zoo_start_flags(initial_dir) -> list[str]``: the ``flexformers-train`` flags of a recipe that starts from another
  recipe's model (``init_from``), when the method builds its own architecture from it (MAT's proximal
  initialisation); the recipe's preset then applies too. Default: ``--model_name_or_path initial_dir``.
- ``missing_requirement(flags) -> str | None``: why a recipe with these flags cannot train on this machine (an
  optional dependency not installed), else None.
- ``model_card_template``: the path of the Jinja template of its exported model card, extending ``_base.md`` as the
  package's ``hub_cards/<model_type>.md`` do (default: that file, or for a method outside the package a generic
  card from its ``description``).
- ``is_baseline`` (False): the plain Transformer, which the zoo reads every method against.
- ``compares_own_starts`` (False): the method's ``zoo_report`` reads its recipes trained on from another model
  itself, so the zoo's common section of those leaves them out (InDIGO's orders against its L2R run).

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
import functools
import importlib
import importlib.util
import logging
import os
import pkgutil
import re
import sys
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
    name: str = ""
    decodes_left_to_right: bool = True
    decoder_tokens_beyond_target: int = 0
    is_baseline: bool = False
    compares_own_starts: bool = False
    figures: Callable[..., dict] | None = None
    zoo_analysis: Callable[..., dict] | None = None
    zoo_report: Callable[..., tuple] | None = None
    zoo_figures_text: Callable[[dict], list[str]] | None = None
    zoo_start_flags: Callable[[str], list[str]] | None = None
    missing_requirement: Callable[..., str | None] | None = None
    model_card_template: str | os.PathLike | None = None

    def __post_init__(self):
        if not _MODEL_TYPE_PATTERN.match(self.model_type):
            raise ValueError(f"MethodSpec.model_type must match {_MODEL_TYPE_PATTERN.pattern}, got {self.model_type!r}")
        if self.arguments_class is not None and not dataclasses.is_dataclass(self.arguments_class):
            raise ValueError(
                f"MethodSpec.arguments_class for {self.model_type!r} must be a dataclass "
                f"(HfArgumentParser parses it), got {self.arguments_class!r}"
            )
        if (not isinstance(self.decoder_tokens_beyond_target, int) or isinstance(self.decoder_tokens_beyond_target, bool)
                or self.decoder_tokens_beyond_target < 0):
            raise ValueError(f"MethodSpec.decoder_tokens_beyond_target for {self.model_type!r} must be a count of "
                             f"tokens (an int >= 0), got {self.decoder_tokens_beyond_target!r}")
        if not self.name:
            object.__setattr__(self, "name", self.model_type)  # frozen: the display name defaults to the type
        for hook_name in ("build_model", "data_collator", "callbacks", "update_config", "figures", "zoo_analysis",
                          "zoo_report", "zoo_figures_text", "zoo_start_flags", "missing_requirement"):
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


#: Methods registered in this process by :func:`register_method`.
_REGISTERED: dict[str, MethodSpec] = {}
ENTRY_POINT_GROUP = "flexformers.methods"


def register_method(spec: MethodSpec) -> MethodSpec:
    """Make ``spec``'s model type known to every tool run in this process (``flexformers-train``, ``-decode``,
    ``-quickstart``, ``-zoo``, ``-export``), as the package's own methods are. Registering a type that the package
    or an entry point already defines is a ``ValueError``; registering the same type again replaces the process's
    earlier registration (a notebook cell run twice)."""
    if not isinstance(spec, MethodSpec):
        raise ValueError(f"register_method needs a MethodSpec, got {spec!r}")
    if spec.model_type not in _REGISTERED and spec.model_type in available_model_types():
        raise ValueError(f"model type {spec.model_type!r} is already defined (by flexformers or an installed "
                         "package's entry point); choose another model_type")
    _REGISTERED[spec.model_type] = spec
    return spec


def unregister_method(model_type: str) -> None:
    """Forget a type that :func:`register_method` registered (nothing for any other type)."""
    _REGISTERED.pop(model_type, None)


def _entry_points() -> dict:
    return _entry_points_on(tuple(sys.path))


@functools.lru_cache(maxsize=8)
def _entry_points_on(search_path: tuple[str, ...]) -> dict:
    # scanning the installed distributions takes tens of milliseconds and the report asks for specs many times; the
    # installed set changes only with the search path (a test prepends one)
    from importlib.metadata import entry_points

    return {entry.name: entry for entry in entry_points(group=ENTRY_POINT_GROUP)}


def _is_own_method(model_type: str) -> bool:
    """Whether the package has a ``training_scripts/methods/<model_type>`` module (imported or not)."""
    name = f"flexformers.training_scripts.methods.{model_type}"
    return name in sys.modules or importlib.util.find_spec(name) is not None


def available_model_types() -> list[str]:
    """Every known model type: the package's ``training_scripts/methods`` modules, installed packages' entry points
    (group ``flexformers.methods``) and this process's :func:`register_method` calls. Nothing is imported."""
    from flexformers.training_scripts import methods

    own = {info.name for info in pkgutil.iter_modules(methods.__path__) if not info.name.startswith("_")}
    return sorted(own | set(_entry_points()) | set(_REGISTERED))


def get_method_spec(model_type: str) -> MethodSpec:
    """The ``MethodSpec`` of ``model_type``: registered in this process (:func:`register_method`), else the ``SPEC``
    of ``flexformers.training_scripts.methods.<model_type>`` (imported lazily), else an installed package's entry
    point in the group ``flexformers.methods``.

    Raises ``ValueError`` naming the available model types for an unknown type, and for a module that does not
    define a ``MethodSpec`` called ``SPEC`` (or one whose ``model_type`` disagrees with the file name).
    Import errors *inside* an existing method module propagate unchanged, so their traceback stays useful.
    """
    if not isinstance(model_type, str) or not _MODEL_TYPE_PATTERN.match(model_type):
        raise ValueError(
            f"--model_type {model_type!r} is not a valid model type name; available: {', '.join(available_model_types())}"
        )
    if model_type in _REGISTERED:
        return _REGISTERED[model_type]
    if not _is_own_method(model_type):
        entry = _entry_points().get(model_type)
        if entry is None:
            known = available_model_types()
            raise ValueError(f"Unknown --model_type {model_type!r}; available: {', '.join(known) or '(none)'}")
        spec = entry.load()
        if not isinstance(spec, MethodSpec) or spec.model_type != model_type:
            raise ValueError(f"the {ENTRY_POINT_GROUP} entry point {model_type!r} ({entry.value}) must name a "
                             f"MethodSpec whose model_type is {model_type!r}, found {spec!r}")
        return spec
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
