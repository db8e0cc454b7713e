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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput
from transformers.utils import ModelOutput, can_return_tuple

from flexformers.configuration.configuration_depth_adaptive import (
    EXIT_STRATEGIES,
    DepthAdaptiveConfig,
    validate_exit_thresholds,
)

from .cpu_kernels import project_vocabulary
from .depth_adaptive_cache import CopiedStateCache
from .depth_adaptive_decoder import BlockOutputs, DepthAdaptiveDecoder, ExitDecider, ExitSettings
from .depth_adaptive_equations import (
    aligned_decoding_loss,
    exit_loss,
    exit_loss_weights,
    geometric_exit_log_probs,
    geometric_halting_logits,
    gradient_scaling_factors,
    mean_encoder_output,
    scale_gradient,
    sequence_correctness_oracle,
    sequence_halting_log_probs,
    sequence_likelihood_oracle,
    token_correctness_oracle,
    token_likelihood_oracle,
    token_multinomial_log_probs,
)
from .kv_caches import new_decoder_cache
from .losses import label_smoothed_nll_loss
from .modeling_flexformer import (
    BackboneComponents,
    FlexformerForConditionalGeneration,
    FlexformerModel,
    padding_mask,
)
from .transformers_compat import accepts_cache_argument, cache_field, drop_generation_position_arguments, output_cache

# ----------------------------------------------------------------------------------------------------------------------
# Halting mechanisms (Sec. 3)
# ----------------------------------------------------------------------------------------------------------------------


class SequenceHalting(nn.Module):
    """Sequence-specific depth (Sec. 3.1, Eq. 8): a multinomial over the N exits from the mean encoder output,
    ``W_h ∈ R^{N×d_enc}`` and ``b_h`` (one linear layer, Sec. 4.1)."""

    def __init__(self, config: DepthAdaptiveConfig):
        super().__init__()
        self.projection = nn.Linear(config.encoder_embed_dim, config.decoder_layers)

    def forward(self, encoder_hidden_states: torch.Tensor, encoder_attention_mask: torch.Tensor | None = None):
        """log q(n|x), ``[b, N]``."""
        return sequence_halting_log_probs(
            mean_encoder_output(encoder_hidden_states, encoder_attention_mask), self.projection
        )


class TokenMultinomialHalting(nn.Module):
    """Token-specific multinomial (Sec. 3.2, Eq. 11) on the first block's state h¹_t: ``W_h ∈ R^{N×d}``, ``b_h``."""

    def __init__(self, config: DepthAdaptiveConfig):
        super().__init__()
        self.projection = nn.Linear(config.decoder_embed_dim, config.decoder_layers)

    def forward(self, first_block_states: torch.Tensor) -> torch.Tensor:
        """log q_t(n|x, y_<t), ``[..., N]``."""
        return token_multinomial_log_probs(first_block_states, self.projection)


class GeometricHalting(nn.Module):
    """Token-specific geometric-like halting (Sec. 3.2, Eq. 12–13): χ^n_t = sigmoid(w_hᵀ h^n_t + b_n) after every
    block n < N, with one weight vector ``w_h ∈ R^d`` shared by the blocks and one bias b_n per block."""

    def __init__(self, config: DepthAdaptiveConfig):
        super().__init__()
        self.weight = nn.Linear(config.decoder_embed_dim, 1, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.decoder_layers - 1))

    def halting_logits(self, block: int, states: torch.Tensor) -> torch.Tensor:
        """z^n_t (χ^n_t = sigmoid(z^n_t)) after block ``block`` ∈ 1..N−1, ``[..., d] → [...]``."""
        return geometric_halting_logits(states, self.weight, self.bias[block - 1])

    def forward(self, block_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """log q_t(n) of Eq. 13 from the states h¹ … h^{N−1} (each ``[..., d]``), ``[..., N]``."""
        logits = torch.stack([self.halting_logits(n, states) for n, states in enumerate(block_states, start=1)], -1)
        return geometric_exit_log_probs(logits)


HALTING_CLASSES = {
    "sequence": SequenceHalting,
    "token_multinomial": TokenMultinomialHalting,
    "token_geometric": GeometricHalting,
}


# ----------------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------------

DEPTH_ADAPTIVE_COMPONENTS = BackboneComponents(decoder=DepthAdaptiveDecoder)


@dataclass
class DepthAdaptiveSeq2SeqLMOutput(Seq2SeqLMOutput):
    """``Seq2SeqLMOutput`` plus the Depth-Adaptive signals.

    exits (`[b, T]`): the exit (1..N) of every decoder position (the top block N in aligned training).
    decoding_loss: L_dec (Eq. 4 or Eq. 5); exit_loss: L_exit (Eq. 6, same normalisation as L_dec); `loss` is
        Eq. 7, L_dec + α·L_exit — the training objective, also in eval mode (where L_dec is the aligned Eq. 4, a
        weighted average over the N exits), so it is what `Trainer` reports as `eval_loss`.
    logits_loss / logits_nll_loss (detached): the label-smoothed cross-entropy of the returned `logits` (the
        criterion of the baseline's `loss`, same normalisation) and its negative log-likelihood part; exp of the
        latter is the perplexity of `logits`. In aligned mode (training, and every eval-mode forward with labels)
        `logits` are the top classifier's, so `logits_loss` is `per_exit_losses[-1]`; in mixed training they are
        those of the last sampled exit sequence; with `token_exits` or an exit strategy, `loss` is `logits_loss`.
    per_exit_losses (`[N]`, detached): each classifier's label-smoothed loss in aligned mode.
    exit_logits (tuple of N `[b, T, V]`): every classifier's logits (aligned mode, with `return_exit_logits=True`).
    oracle_exits (`[b]` or `[b, T]`) and exit_log_probs (`[b, N]` or `[b, T, N]`): the oracle q* and the halting
        distribution log q of the exit loss.
    """

    exits: torch.LongTensor | None = None
    decoding_loss: torch.FloatTensor | None = None
    exit_loss: torch.FloatTensor | None = None
    per_exit_losses: torch.FloatTensor | None = None
    exit_logits: tuple[torch.FloatTensor, ...] | None = None
    oracle_exits: torch.LongTensor | None = None
    exit_log_probs: torch.FloatTensor | None = None
    logits_loss: torch.FloatTensor | None = None
    logits_nll_loss: torch.FloatTensor | None = None


@dataclass
class DepthAdaptiveGenerateOutput(ModelOutput):
    """``generate(..., return_exits=True)`` without ``return_dict_in_generate``: the sequences and, for each
    generated token (``sequences[:, 1:]``), its exit in 1..N (0 after the end of the hypothesis)."""

    sequences: torch.LongTensor | None = None
    exits: torch.LongTensor | None = None


class DepthAdaptiveModel(FlexformerModel):
    """The Depth-Adaptive encoder-decoder without output classifiers (``AutoModel``); its decoder is a
    :class:`DepthAdaptiveDecoder`, whose plain ``forward`` runs all N blocks."""

    config_class = DepthAdaptiveConfig
    components = DEPTH_ADAPTIVE_COMPONENTS


class DepthAdaptiveForConditionalGeneration(FlexformerForConditionalGeneration):
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

    def _token_denominator(self, labels, num_items_in_batch):
        if num_items_in_batch is not None:
            return num_items_in_batch
        return labels.ne(-100).sum().clamp(min=1)

    def _training_forward(
        self, hidden_states, layer_kwargs, labels, encoder_states, encoder_attention_mask, num_items_in_batch,
        return_exit_logits, record: BlockOutputs | None = None,
    ) -> dict:
        """The training objective (Eq. 4 or 5, plus α·Eq. 6): the fields of the output."""
        config = self.config
        decoder = self.model.decoder
        epsilon = config.label_smoothing
        if self.training and config.training_mode == "mixed":
            # Eq. 5: M exit sequences n_t ~ U{1..N}, copied states above each exit.
            losses = []
            for sample in range(config.mixed_num_samples):
                sampled = torch.randint(1, self.num_exits + 1, labels.shape, device=labels.device)
                last = sample == config.mixed_num_samples - 1  # the returned logits and recorded blocks are its
                _, exit_states, _ = decoder.forward_layerwise(
                    hidden_states, layer_kwargs, token_exits=sampled, record=record if last else None,
                    check_exits=False,
                )
                logits = self.classify_by_exit(exit_states, sampled)
                sample_loss, nll = label_smoothed_nll_loss(logits, labels, epsilon, num_items_in_batch=num_items_in_batch)
                losses.append(sample_loss)
            loss = torch.stack(losses).mean()
            return {
                "loss": loss, "logits": logits, "exits": sampled, "decoding_loss": loss,
                "logits_loss": losses[-1].detach(), "logits_nll_loss": nll,
            }
        # Eq. 4, aligned training (also the evaluation loss of every model).
        gammas = None
        if self.training and config.gradient_scaling is not None:
            gammas = gradient_scaling_factors(float(config.gradient_scaling), self.num_exits)
        states, _, _ = decoder.forward_layerwise(
            hidden_states, layer_kwargs, keep_states=True, gradient_scales=gammas, record=record
        )
        exit_logits, per_exit_losses = [], []
        for block, block_states in enumerate(states, start=1):
            logits = self.classify(block, block_states)
            if gammas is not None:
                logits = scale_gradient(logits, gammas[block - 1])  # Algorithm 1, line 4
            exit_logits.append(logits)
            exit_loss_term, nll = label_smoothed_nll_loss(logits, labels, epsilon, num_items_in_batch=num_items_in_batch)
            per_exit_losses.append(exit_loss_term)
        per_exit = torch.stack(per_exit_losses)
        decoding_loss = aligned_decoding_loss(
            per_exit, exit_loss_weights(config.exit_loss_weighting, self.num_exits).to(per_exit.device)
        )
        loss = decoding_loss
        exit_loss_value = oracle = log_q = None
        if self.halting is not None and config.exit_loss_alpha > 0:
            raw_exit_loss, oracle, log_q = self.halting_loss(
                states, exit_logits, labels, encoder_states, encoder_attention_mask
            )
            exit_loss_value = raw_exit_loss / self._token_denominator(labels, num_items_in_batch)
            loss = decoding_loss + config.exit_loss_alpha * exit_loss_value  # Eq. 7
        exits = torch.full(labels.shape, self.num_exits, dtype=torch.long, device=labels.device)
        return {
            "loss": loss,
            "logits": exit_logits[-1],
            "exits": exits,
            "decoding_loss": decoding_loss,
            "exit_loss": exit_loss_value,
            "per_exit_losses": per_exit.detach(),
            "exit_logits": tuple(exit_logits) if return_exit_logits else None,
            "oracle_exits": oracle,
            "exit_log_probs": log_q,
            "logits_loss": per_exit[-1].detach(),
            "logits_nll_loss": nll,
        }

    def halting_loss(self, states, exit_logits, labels, encoder_states, encoder_attention_mask):
        """Σ H(q*, q) of Eq. 6 (summed over sentences or target tokens) for the model's halting mechanism and oracle,
        from aligned states ``h¹ … h^N`` and the N classifiers' logits. Returns ``(loss, oracle exits, log q)``."""
        config = self.config
        target_mask = labels.ne(-100)
        safe_labels = labels.masked_fill(~target_mask, 0)
        with torch.no_grad():
            if config.oracle == "likelihood":
                scores = torch.stack(
                    [
                        F.log_softmax(logits.float(), dim=-1).gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
                        for logits in exit_logits
                    ],
                    dim=-1,
                )  # LL^n_t
            else:
                scores = torch.stack([logits.argmax(-1).eq(labels) for logits in exit_logits], dim=-1)  # C^n_t
        lam, sigma = float(config.oracle_lambda), float(config.oracle_sigma)
        if config.halting_mechanism == "sequence":
            oracle = (
                sequence_likelihood_oracle(scores, target_mask, lam)
                if config.oracle == "likelihood"
                else sequence_correctness_oracle(scores, target_mask, lam)
            )
            log_q = self.halting(encoder_states, encoder_attention_mask)
            return exit_loss(log_q, oracle), oracle, log_q
        oracle = (
            token_likelihood_oracle(scores, target_mask, sigma, lam)
            if config.oracle == "likelihood"
            else token_correctness_oracle(scores, target_mask, sigma, lam)
        )
        if config.halting_mechanism == "token_multinomial":
            log_q = self.halting(states[0])
        else:
            log_q = self.halting(states[: self.num_exits - 1])
        return exit_loss(log_q, oracle, target_mask), oracle, log_q

    # -- generation -----------------------------------------------------------------------------------------------

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
