"""The Depth-Adaptive Transformer's ``generate()`` (Appendix B, Algorithm 2): every option of
``GenerationMixin.generate`` with each token exiting at the block its exit strategy chooses, the blocks above fed
the copied state through a ``CopiedStateCache``; and the per-token exits of finished hypotheses."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutput

from .depth_adaptive_cache import CopiedStateCache
from .depth_adaptive_outputs import DepthAdaptiveGenerateOutput
from .transformers_compat import output_cache


class EarlyExitGeneration:
    """``generate()`` and ``compute_token_exits`` of ``DepthAdaptiveForConditionalGeneration``."""

    def generate(
        self,
        inputs=None,
        generation_config=None,
        exit_strategy: str | None = None,
        fixed_exit: int | None = None,
        exit_thresholds: Sequence[float] | None = None,
        return_exits: bool = False,
        **kwargs,
    ):
        """``GenerationMixin.generate`` (every ``GenerationConfig`` option but a static cache) with early exits.

        ``exit_strategy`` / ``fixed_exit`` / ``exit_thresholds`` choose the exits for this call (also read from
        attributes of the same names on ``generation_config``, or on the model's own ``generation_config`` when none
        is passed; default: the model config). With
        ``return_exits=True`` the per-token exits come back as ``exits`` ``[rows, len − 1]`` (exit of
        ``sequences[:, 1:]``, 0 after the hypothesis ended): added to the ``GenerateOutput`` with
        ``return_dict_in_generate=True``, else a :class:`DepthAdaptiveGenerateOutput`. They are recomputed with
        the layer-wise pass over the final hypotheses, which takes the same decisions as the incremental steps.
        """
        kwargs.pop("labels", None)  # Seq2SeqTrainer passes the whole batch
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if kwargs.get("attention_mask") is None and isinstance(input_ids, torch.Tensor) and not input_ids.is_floating_point():
            # Transformers v5 infers no attention mask for encoder-decoder models: without it the cross-attention
            # would attend to the source padding of a batch (fairseq masks it).
            kwargs["attention_mask"] = input_ids.ne(self.config.pad_token_id).long()
        # Exit settings: this call's arguments, else the passed generation config, else the model's own
        # `generation_config` (e.g. saved in generation_config.json), else the model config.
        source = generation_config if generation_config is not None else getattr(self, "generation_config", None)
        if source is not None:
            exit_strategy = exit_strategy or getattr(source, "exit_strategy", None)
            fixed_exit = fixed_exit if fixed_exit is not None else getattr(source, "fixed_exit", None)
            if exit_thresholds is None:
                exit_thresholds = getattr(source, "exit_thresholds", None)
        settings = self.resolve_exit_settings(exit_strategy, fixed_exit, exit_thresholds)
        previous = self._generation_exit_settings
        self._generation_exit_settings = settings
        try:
            output = super().generate(inputs, generation_config, **kwargs)
            returned_cache = None if isinstance(output, torch.Tensor) else output_cache(output)
            if returned_cache is not None:
                self.model.decoder.complete_copied_states(returned_cache)
                if isinstance(returned_cache.self_attention_cache, CopiedStateCache):
                    returned_cache.self_attention_cache.defer_copied_states = False
            if not return_exits:
                return output
            sequences = output if isinstance(output, torch.Tensor) else output.sequences
            exits = self.compute_token_exits(
                sequences,
                input_ids=input_ids,
                attention_mask=kwargs.get("attention_mask"),
                encoder_outputs=kwargs.get("encoder_outputs"),
                inputs_embeds=kwargs.get("inputs_embeds"),
            )
        finally:
            self._generation_exit_settings = previous
        if isinstance(output, torch.Tensor):
            return DepthAdaptiveGenerateOutput(sequences=output, exits=exits)
        output["exits"] = exits
        return output

    def _generation_self_attention_cache(self, cache: DynamicCache):
        """A deferring :class:`CopiedStateCache` for the decoder self-attention of ``generate()`` (the backbone's seam;
        a cache the caller passed is never replaced)."""
        if not self.defer_copied_states:
            return super()._generation_self_attention_cache(cache)
        return CopiedStateCache(config=self.config, defer_copied_states=True)

    @torch.no_grad()
    def compute_token_exits(
        self,
        sequences: torch.LongTensor,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_outputs=None,
        exit_strategy: str | None = None,
        fixed_exit: int | None = None,
        exit_thresholds: Sequence[float] | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.LongTensor:
        """The exit (1..N) at which each token of ``sequences[:, 1:]`` is emitted under the exit strategy, from one
        layer-wise pass over the hypotheses (teacher forcing on ``sequences[:, :-1]``); 0 after the first ``</s>``.
        ``sequences`` may hold k hypotheses per source row (beam search, ``num_return_sequences``)."""
        if input_ids is None and encoder_outputs is None and inputs_embeds is None:
            raise ValueError("compute_token_exits needs input_ids, inputs_embeds or encoder_outputs")
        if attention_mask is None and input_ids is not None:
            attention_mask = input_ids.ne(self.config.pad_token_id).long()
        if encoder_outputs is None:
            encoder_outputs = self.model.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds
            )
        encoder_states = encoder_outputs[0]
        sources = encoder_states.shape[0]
        if sequences.shape[0] % sources != 0:
            raise ValueError(f"{sequences.shape[0]} sequences for {sources} sources: not a whole number per source")
        per_source = sequences.shape[0] // sources
        if per_source > 1:
            encoder_states = encoder_states.repeat_interleave(per_source, dim=0)
            attention_mask = attention_mask.repeat_interleave(per_source, dim=0) if attention_mask is not None else None
        if sequences.shape[1] < 2:
            return sequences.new_zeros(sequences.shape[0], 0)
        output = self(
            attention_mask=attention_mask,
            encoder_outputs=BaseModelOutput(last_hidden_state=encoder_states),
            decoder_input_ids=sequences[:, :-1],
            use_cache=False,
            exit_strategy=exit_strategy,
            fixed_exit=fixed_exit,
            exit_thresholds=exit_thresholds,
        )
        targets = sequences[:, 1:]
        eos = self.generation_config.eos_token_id if self.generation_config.eos_token_id is not None else self.config.eos_token_id
        eos_ids = torch.tensor(eos if isinstance(eos, (list, tuple)) else [eos], device=targets.device)
        is_eos = torch.isin(targets, eos_ids).long()
        ended_before = (torch.cumsum(is_eos, dim=1) - is_eos) > 0
        return output.exits.masked_fill(ended_before, 0)
