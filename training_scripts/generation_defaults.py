"""Keeping Transformers' global generation defaults out of saved ``generation_config.json`` files.

Seq2SeqTrainer's ``prediction_step`` writes every global default (``max_length: 20``, ``top_k: 50``, ...) into the
model's generation config, so each checkpoint saved after an evaluation would carry them, and
``generate(max_new_tokens=...)`` on it would warn that ``max_length`` is set too. ``generate()`` puts the same defaults
back into unset fields, so unsetting them changes no decoding.
"""

from __future__ import annotations


def unset_global_generation_defaults(generation_config) -> None:
    """Unset (``None``) every field of ``generation_config`` that holds Transformers' global default."""
    for name, default in generation_config._get_default_generation_params().items():
        if name in generation_config.__dict__ and getattr(generation_config, name) == default:
            setattr(generation_config, name, None)


class GenerationDefaultsFreeSavesMixin:
    """Trainer mixin: every save (checkpoints and ``save_model``) writes the generation config without the defaults
    that evaluation filled in."""

    def _save(self, output_dir=None, state_dict=None):
        generation_config = getattr(self.model, "generation_config", None)
        if generation_config is not None:
            unset_global_generation_defaults(generation_config)
        super()._save(output_dir, state_dict)
