"""The Depth-Adaptive Transformer (Elbayad, Gu, Grave & Auli, "Depth-Adaptive Transformer", ICLR 2020).

An output classifier C_n after every decoder block (Eq. 3) lets the decoder emit a token after any block n ∈ 1..N.
Training optimises all exits on aligned states (Eq. 4) or on sampled exit sequences with copied states (Eq. 5),
optionally with a halting mechanism supervised by an oracle (Eq. 6–17). Decoding (Appendix B, Algorithm 2) exits
each token at the block a halting mechanism or a confidence threshold chooses; the blocks above get the *copied*
state and their own key/value projections of it, so later tokens attend to a consistent cache.

No public implementation of the paper exists; this one follows the paper, and says so where it has to fill a gap.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import can_return_tuple

from flexformers.configuration.configuration_depth_adaptive import (
    EXIT_STRATEGIES,
    DepthAdaptiveConfig,
    validate_exit_thresholds,
)

from .cpu_kernels import project_vocabulary
from .depth_adaptive_decoder import BlockOutputs, DepthAdaptiveDecoder, ExitDecider, ExitSettings
from .depth_adaptive_generation import EarlyExitGeneration
from .depth_adaptive_halting import HALTING_CLASSES, GeometricHalting, SequenceHalting, TokenMultinomialHalting
from .depth_adaptive_outputs import DepthAdaptiveGenerateOutput, DepthAdaptiveSeq2SeqLMOutput
from .depth_adaptive_training import ExitTraining
from .kv_caches import new_decoder_cache
from .losses import label_smoothed_nll_loss
from .modeling_flexformer import (
    BackboneComponents,
    FlexformerForConditionalGeneration,
    FlexformerModel,
    padding_mask,
)
from .transformers_compat import accepts_cache_argument, cache_field, drop_generation_position_arguments

# ----------------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------------

DEPTH_ADAPTIVE_COMPONENTS = BackboneComponents(decoder=DepthAdaptiveDecoder)


class DepthAdaptiveModel(FlexformerModel):
    """The Depth-Adaptive encoder-decoder without output classifiers (``AutoModel``); its decoder is a
    :class:`DepthAdaptiveDecoder`, whose plain ``forward`` runs all N blocks."""

    config_class = DepthAdaptiveConfig
    components = DEPTH_ADAPTIVE_COMPONENTS


class DepthAdaptiveForConditionalGeneration(ExitTraining, EarlyExitGeneration, FlexformerForConditionalGeneration):
    """Depth-Adaptive Transformer (model type ``depth_adaptive``).

    - Classifiers (Eq. 3): C_N is ``lm_head``; C_1 … C_{N−1} are ``exit_classifiers`` (independent) or ``lm_head``
      itself (``exit_classifiers="shared"``). Every classifier reads the block's state through the decoder's
      ``finalize`` (the final LayerNorm of a pre-norm stack; identity for post-norm, the paper's setting).
    - ``forward`` with ``labels``: aligned (Eq. 4, weights ω_n, gradient scaling of Appendix A) or mixed (Eq. 5)
      training loss, plus α·L_exit (Eq. 6/7) when ``exit_loss_alpha > 0``. In eval mode the loss is always the
      aligned one (mixed sampling would make it random).
    - ``forward`` without ``labels``: each position exits according to the exit strategy (``exit_strategy``,
      ``fixed_exit``, ``exit_thresholds`` arguments, else the values ``generate()`` set, else the config); a single
      new token with a cache takes the row-subset early-exit step (Algorithm 2), everything else the layer-wise
      pass. ``token_exits=[b, T]`` forces an exit sequence (recomputation with copied states, Eq. 5).
    - ``generate()`` is Transformers' own loop (greedy, beam search, sampling, every ``GenerationConfig`` option)
      over that forward; ``return_exits=True`` adds the per-token exits.
    """

    _can_compile_fullgraph = False
    static_cache_unsupported_reason = (
        "early exits copy the exiting state into the skipped blocks' caches (CopiedStateCache) and stop per token "
        "on the host, which a cache holding exactly the past supports"
    )

    config_class = DepthAdaptiveConfig
    base_model_class = DepthAdaptiveModel
    components = DEPTH_ADAPTIVE_COMPONENTS
    # generate() projects the copied states of skipped blocks only when a later token runs the block
    # (CopiedStateCache); False projects them at every step, as Algorithm 2 is written (same keys/values).
    defer_copied_states: bool = True

    def __init__(self, config: DepthAdaptiveConfig):
        super().__init__(config)
        num_exits = config.decoder_layers
        if config.exit_classifiers == "independent":
            self.exit_classifiers = nn.ModuleList(
                [
                    nn.Linear(config.decoder_embed_dim, config.decoder_vocab_size, bias=False)
                    for _ in range(num_exits - 1)
                ]
            )
        else:
            self.exit_classifiers = None
        halting_class = HALTING_CLASSES.get(config.halting_mechanism)
        self.halting = halting_class(config) if halting_class is not None else None
        self._generation_exit_settings: ExitSettings | None = None
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        if isinstance(module, GeometricHalting):
            if not getattr(module.bias, "_is_hf_initialized", False):
                nn.init.zeros_(module.bias)
            return
        super()._init_weights(module)

    # -- classifiers --------------------------------------------------------------------------------------------

    @property
    def num_exits(self) -> int:
        return self.config.decoder_layers

    def exit_classifier(self, block: int) -> nn.Module:
        """C_n (Eq. 3) for ``block`` n ∈ 1..N."""
        if not 1 <= block <= self.num_exits:
            raise ValueError(f"exit block must be in 1..{self.num_exits}, got {block}")
        if block == self.num_exits or self.exit_classifiers is None:
            return self.lm_head
        return self.exit_classifiers[block - 1]

    def classify(self, block: int, states: torch.Tensor) -> torch.Tensor:
        """Logits W_n h^n_t of Eq. 3."""
        return project_vocabulary(self.exit_classifier(block), self.model.decoder.finalize(states))

    def vocabulary_projections(self) -> list[nn.Module]:
        """C_1 … C_N (Eq. 3), each once: `resize_token_embeddings` resizes them all."""
        return super().vocabulary_projections() + list(self.exit_classifiers or [])

    def classify_by_exit(self, states: torch.Tensor, exits: torch.Tensor) -> torch.Tensor:
        """Logits of each position's own exit classifier: ``states [b, T, d]``, ``exits [b, T]`` → ``[b, T, V]``."""
        if self.exit_classifiers is None:
            return project_vocabulary(self.lm_head, self.model.decoder.finalize(states))
        if torch.compiler.is_exporting():
            return self._classify_by_exit_masked(states, exits)
        present = torch.unique(exits).tolist()
        if len(present) == 1:
            return self.classify(int(present[0]), states)
        flat_states = states.reshape(-1, states.shape[-1])
        flat_exits = exits.reshape(-1)
        logits = flat_states.new_empty(flat_states.shape[0], self.config.decoder_vocab_size)
        for block in present:
            positions = torch.nonzero(flat_exits == block).squeeze(-1)
            logits = logits.index_copy(0, positions, self.classify(int(block), flat_states.index_select(0, positions)))
        return logits.view(*exits.shape, -1)

    def _classify_by_exit_masked(self, states: torch.Tensor, exits: torch.Tensor) -> torch.Tensor:
        """``classify_by_exit`` with tensor operations only, for ``torch.export``: the grouping above reads the exits
        on the host (data-dependent control flow an exported graph cannot hold), so here every classifier runs on
        every position and each position keeps its own exit's logits (N classifier calls instead of one per exit
        present)."""
        logits = self.classify(self.num_exits, states)
        for block in range(1, self.num_exits):
            logits = torch.where((exits == block).unsqueeze(-1), self.classify(block, states), logits)
        return logits

    # -- exit settings --------------------------------------------------------------------------------------------

    def resolve_exit_settings(self, exit_strategy=None, fixed_exit=None, exit_thresholds=None) -> ExitSettings:
        """Explicit arguments, else the settings of the running ``generate()`` call, else the config."""
        base = self._generation_exit_settings
        config = self.config
        strategy = exit_strategy or (base.strategy if base is not None else config.default_exit_strategy)
        if strategy not in EXIT_STRATEGIES:
            raise ValueError(f"exit_strategy must be one of {EXIT_STRATEGIES}, got {strategy!r}")
        if fixed_exit is None:
            fixed_exit = base.fixed_exit if base is not None else config.fixed_exit
        if exit_thresholds is None:
            thresholds = base.thresholds if base is not None else tuple(config.default_exit_thresholds)
        else:
            thresholds = tuple(validate_exit_thresholds(exit_thresholds, self.num_exits))
        if strategy == "fixed":
            if fixed_exit is None or isinstance(fixed_exit, bool) or not 1 <= int(fixed_exit) <= self.num_exits:
                raise ValueError(f"exit_strategy='fixed' needs fixed_exit in 1..{self.num_exits}, got {fixed_exit!r}")
            fixed_exit = int(fixed_exit)
        if strategy == "halting" and self.halting is None:
            raise ValueError("exit_strategy='halting' needs a model with a halting_mechanism (config.halting_mechanism)")
        return ExitSettings(strategy=strategy, fixed_exit=fixed_exit, thresholds=thresholds)

    def make_exit_decider(self, settings: ExitSettings, encoder_hidden_states, encoder_attention_mask) -> ExitDecider:
        sequence_exits = None
        if settings.strategy == "halting" and self.config.halting_mechanism == "sequence":
            # Eq. 8 at inference: the most probable exit, for every token of the sentence.
            sequence_exits = torch.argmax(self.halting(encoder_hidden_states, encoder_attention_mask), dim=-1) + 1
        return ExitDecider(
            settings,
            self.num_exits,
            classify=self.classify,
            halting=self.halting,
            halting_mechanism=self.config.halting_mechanism,
            sequence_exits=sequence_exits,
        )

    # -- forward --------------------------------------------------------------------------------------------------

    @can_return_tuple
    @accepts_cache_argument
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        token_exits: torch.LongTensor | None = None,
        exit_strategy: str | None = None,
        fixed_exit: int | None = None,
        exit_thresholds: Sequence[float] | None = None,
        return_exit_logits: bool = False,
        **kwargs,
    ) -> DepthAdaptiveSeq2SeqLMOutput | tuple:
        """See the class docstring. `output_hidden_states` / `output_attentions` return the blocks the pass runs
        (see `BlockOutputs`): above a position's exit, its copied state and zero attention weights."""
        drop_generation_position_arguments(kwargs)
        if kwargs:
            raise TypeError(f"DepthAdaptiveForConditionalGeneration.forward got unexpected arguments {sorted(kwargs)}")
        config = self.config
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        if attention_mask is None and input_ids is not None:
            attention_mask = input_ids.ne(config.pad_token_id).long()
        if encoder_outputs is None:
            encoder_outputs = self.model.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                output_attentions=output_attentions, output_hidden_states=output_hidden_states,
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        encoder_states = encoder_outputs.last_hidden_state
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        use_cache = use_cache if use_cache is not None else config.use_cache
        if use_cache and past_key_values is None:
            past_key_values = new_decoder_cache(config)
        if not use_cache:
            past_key_values = None
        decoder = self.model.decoder
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        hidden_states = decoder.embed(
            decoder_input_ids, past_length, decoder_inputs_embeds, attention_mask=decoder_attention_mask
        )
        batch, length = hidden_states.shape[:2]
        layer_kwargs = {
            "attention_mask": decoder.self_attention_mask(
                batch, length, past_length, decoder_attention_mask, hidden_states.dtype, hidden_states.device
            ),
            "encoder_hidden_states": encoder_states,
            "encoder_attention_mask": padding_mask(attention_mask, hidden_states.dtype),
        }
        # The decoder's outputs are collected by `BlockOutputs`, not by Transformers' `capture_outputs` hooks (the
        # encoder's are): above a position's exit the pass reports its copied state and zero weights, which no block
        # returns, and an early-exit step runs the upper blocks' sub-layers on row subsets only.
        record = BlockOutputs.wanted(output_hidden_states, output_attentions)
        if labels is not None and token_exits is None:
            fields = self._training_forward(
                hidden_states, layer_kwargs, labels, encoder_states, attention_mask, num_items_in_batch,
                return_exit_logits, record,
            )
        else:
            settings = self.resolve_exit_settings(exit_strategy, fixed_exit, exit_thresholds)
            if token_exits is None and past_key_values is not None and length == 1:
                decider = self.make_exit_decider(settings, encoder_states, attention_mask)
                logits, exits = decoder.early_exit_step(
                    hidden_states, layer_kwargs, past_key_values, decider, self.classify, record
                )
                exits = exits.unsqueeze(-1)
            else:
                decoder.complete_copied_states(past_key_values)  # the layer-wise pass writes every block's cache
                decider = None if token_exits is not None else self.make_exit_decider(settings, encoder_states, attention_mask)
                _, exit_states, exits = decoder.forward_layerwise(
                    hidden_states, layer_kwargs, past_key_values, token_exits=token_exits, decider=decider,
                    record=record,
                )
                kept_exits = exits
                if logits_to_keep:
                    exit_states, kept_exits = exit_states[:, -logits_to_keep:], exits[:, -logits_to_keep:]
                logits = self.classify_by_exit(exit_states, kept_exits)
            fields = {"logits": logits, "exits": exits}
            if labels is not None:
                loss, nll = label_smoothed_nll_loss(
                    logits, labels, config.label_smoothing, num_items_in_batch=num_items_in_batch
                )
                fields.update(loss=loss, decoding_loss=loss, logits_loss=loss.detach(), logits_nll_loss=nll)
        record = record or BlockOutputs()
        output = DepthAdaptiveSeq2SeqLMOutput(
            **fields,
            **cache_field(past_key_values if use_cache else None),
            decoder_hidden_states=None if record.hidden_states is None else tuple(record.hidden_states),
            decoder_attentions=None if record.self_attentions is None else tuple(record.self_attentions),
            cross_attentions=None if record.cross_attentions is None else tuple(record.cross_attentions),
            encoder_last_hidden_state=encoder_states,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )
        return output

__all__ = [
    "DepthAdaptiveConfig",
    "DepthAdaptiveDecoder",
    "DepthAdaptiveForConditionalGeneration",
    "DepthAdaptiveGenerateOutput",
    "DepthAdaptiveModel",
    "DepthAdaptiveSeq2SeqLMOutput",
    "ExitDecider",
    "ExitSettings",
    "GeometricHalting",
    "SequenceHalting",
    "TokenMultinomialHalting",
]
