"""The project's ``Seq2SeqTrainer``: what ``flexformers-train`` adds to Transformers' trainer, in one class that every
method's trainer subclasses (``MethodSpec.trainer_class``).

:class:`FlexformersSeq2SeqTrainer` is ``Seq2SeqTrainer`` plus:

- checkpoints written atomically, with the run's own files beside them
  (:class:`~flexformers.training_scripts.checkpoints.AtomicCheckpointMixin`);
- generation configs saved without the global defaults that evaluation fills in
  (:class:`~flexformers.training_scripts.generation_defaults.GenerationDefaultsFreeSavesMixin`);
- training stopped at the first non-finite loss or gradient norm, naming the model's loss terms
  (:class:`~flexformers.training_scripts.nonfinite.FiniteLossMixin`);
- with ``permutation_source_tokenizer``, validation by generation decoded under
  :class:`~flexformers.training_scripts.permutation_decoding.SourceWordPermutation` (word-order recovery), so the
  scores during training are measured as ``flexformers-decode`` measures the test split.

Its constructor takes ``Seq2SeqTrainer``'s arguments plus ``permutation_source_tokenizer``.
"""

from __future__ import annotations

from transformers import Seq2SeqTrainer

from flexformers.training_scripts.checkpoints import AtomicCheckpointMixin
from flexformers.training_scripts.generation_defaults import GenerationDefaultsFreeSavesMixin
from flexformers.training_scripts.nonfinite import FiniteLossMixin
from flexformers.training_scripts.permutation_decoding import SourceWordPermutation


class FlexformersSeq2SeqTrainer(FiniteLossMixin, GenerationDefaultsFreeSavesMixin, AtomicCheckpointMixin, Seq2SeqTrainer):
    """``Seq2SeqTrainer`` with atomic checkpoints, default-free generation configs, a stop at the first non-finite
    loss or gradient, and (optionally) permutation-constrained validation; see the module docstring."""

    def __init__(self, *args, permutation_source_tokenizer=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.permutation_source_tokenizer = permutation_source_tokenizer

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        if self.permutation_source_tokenizer is not None and self.args.predict_with_generate and not prediction_loss_only:
            # the batch's sources are read back from its input_ids
            gen_kwargs = dict(gen_kwargs or getattr(self, "_gen_kwargs", {}))
            sources = self.permutation_source_tokenizer.batch_decode(inputs["input_ids"], skip_special_tokens=True)
            gen_kwargs["prefix_allowed_tokens_fn"] = SourceWordPermutation(
                sources, self.processing_class, eos_token_id=model.config.eos_token_id)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)


__all__ = ["FlexformersSeq2SeqTrainer"]
