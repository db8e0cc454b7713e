"""IOT: Instance-wise Ordered Transformer (Zhu et al., "IOT: Instance-wise Layer Reordering for Transformer
Structures", ICLR 2021) on the flexformers backbone.

Every block of the encoder (decoder) runs its sub-layers in one of M (N) candidate orders with shared weights;
a bias-free linear predictor chooses the order per sentence. Training weights the loss of every encoder×decoder
order path by Gumbel-softmax confidences (Eq. 1–3) plus two auxiliary losses (Eq. 5–7); inference takes the
argmax order per sentence (Eq. 4) and decodes a batch whose sentences chose different orders in one pass through
the backbone's ``PerRowSublayerOrder`` seam.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import can_return_tuple

from flexformers.configuration.configuration_iot import IOTConfig

from .iot_all_paths import AllOrderPathsTraining, IOTCrossAttention, IOTDecoderLayer
from .iot_equations import (
    clamp_order_probs,
    contiguous_order_arrangement,
    diversity_loss,
    gumbel_softmax_confidences,
    gumbel_temperature_at,
    iot_total_loss,
    order_predictor_logits,
    sentence_label_smoothed_losses,
    sharpness_loss,
    weighted_path_loss,
)
from .iot_generation import OrderSortedGeneration
from .iot_order_statistics import IOTOrderStatistics
from .iot_outputs import (
    IOTEncoderOutput,
    IOTGenerateBeamEncoderDecoderOutput,
    IOTGenerateEncoderDecoderOutput,
    IOTSeq2SeqLMOutput,
)
from .modeling_flexformer import BackboneComponents, FlexformerForConditionalGeneration, FlexformerModel
from .sublayer_order import PerRowSublayerOrder
from .transformers_compat import accepts_cache_argument, drop_generation_position_arguments

# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------


class IOTOrderPredictor(nn.Module):
    """IOT's light predictor: one bias-free ``[num_orders, d]`` matrix on a masked mean (Eq. 1 / Eq. 2), with
    dropout on its logits (as the official code). Initialised N(0, d^-0.5) in ``_init_weights``."""

    def __init__(self, num_orders: int, embed_dim: int, dropout: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_orders, embed_dim))
        self.dropout = dropout

    def forward(self, states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        logits = order_predictor_logits(states, attention_mask, self.weight)
        return F.dropout(logits, p=self.dropout, training=self.training)


class GumbelTemperatures(nn.Module):
    """(τ_e, τ_d), the Gumbel-softmax temperatures of Eq. 1 / Eq. 2 at the current optimisation step, in a
    non-persistent buffer ``values`` that ``IOTForConditionalGeneration._init_weights`` fills from the schedule.

    The training forward reads them as tensors: a compiled training step takes them as inputs, where a Python number
    (or the step it comes from) would be specialised on and recompile the step at every new optimisation step. As a
    buffer they follow the model's device and are materialised when Transformers builds the model on the meta
    device (``from_pretrained``); a submodule of their own is re-initialised even where Transformers marks the
    top-level model as initialised (FSDP's low-memory loading)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("values", torch.ones(2), persistent=False)


IOT_COMPONENTS = BackboneComponents(cross_attention=IOTCrossAttention, decoder_layer=IOTDecoderLayer)


class IOTModel(FlexformerModel):
    """The IOT encoder-decoder without LM head (``AutoModel``); the order predictors live on
    :class:`IOTForConditionalGeneration`."""

    config_class = IOTConfig
    components = IOT_COMPONENTS
    # FSDP / device_map units: IOT's decoder blocks are IOTDecoderLayer (accelerate looks the classes up by name,
    # and a model's list is the union of its own and its sub-models')
    _no_split_modules = ["FlexformerEncoderLayer", "IOTDecoderLayer"]


class IOTForConditionalGeneration(AllOrderPathsTraining, OrderSortedGeneration, FlexformerForConditionalGeneration):
    """IOT (model type ``iot``): the backbone with per-sentence sub-layer orders and order predictors.

    - ``forward`` in training mode with ``labels`` runs every encoder order once and *all* N decoder orders in one
      decoder pass (the M·N copies of the batch stacked along the batch dimension, one ``PerRowSublayerOrder``),
      and returns the loss of Eq. 7 with the per-path losses, predictor distributions and confidences.
    - In eval mode (and during generation) each sentence takes its argmax orders (Eq. 4); a batch mixing orders
      runs through the backbone once with a ``PerRowSublayerOrder``.
    - ``generate()`` predicts the orders, sorts the batch so sentences sharing an order are contiguous, decodes
      (every ``GenerationConfig`` option works but a static cache), and restores the input order.
      ``encoder_order=`` / ``decoder_order=`` (paper codes) force one order for the whole batch (Fig. 2 analysis).
    """

    _can_compile_fullgraph = False
    _no_split_modules = IOTModel._no_split_modules
    static_cache_unsupported_reason = (
        "sentences decoding in different sub-layer orders write the self-attention cache row block by row block "
        "(StepKVCollector), which extends a cache holding exactly the past"
    )

    config_class = IOTConfig
    base_model_class = IOTModel

    def __init__(self, config: IOTConfig):
        super().__init__(config)
        dropout = config.dropout if config.predictor_dropout is None else config.predictor_dropout
        use = config.uses_predictor
        self.encoder_order_predictor = (
            IOTOrderPredictor(config.num_encoder_orders, config.encoder_embed_dim, dropout)
            if use and config.num_encoder_orders > 1
            else None
        )
        self.decoder_order_predictor = (
            IOTOrderPredictor(config.num_decoder_orders, config.encoder_embed_dim, dropout)
            if use and config.num_decoder_orders > 1
            else None
        )
        self.gumbel_temperature = GumbelTemperatures()
        self._written_gumbel_temperatures: tuple[float, float] | None = None
        self.gumbel_step = 0
        # Row layout for mixed orders: candidates sharing a sub-layer at a stage are neighbours (see the function).
        self.decoder_row_arrangement = contiguous_order_arrangement(config.decoder_sublayer_orders)
        self._order_statistics = IOTOrderStatistics(
            config, self.encoder_order_predictor is not None, self.decoder_order_predictor is not None)
        self._decoder_order_cache: tuple | None = None
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        if isinstance(module, IOTOrderPredictor):
            if not getattr(module.weight, "_is_hf_initialized", False):
                nn.init.normal_(module.weight, mean=0.0, std=module.weight.shape[1] ** -0.5)
            return
        if isinstance(module, GumbelTemperatures):
            temperatures = self.gumbel_temperatures()
            module.values.copy_(torch.tensor(temperatures))
            self._written_gumbel_temperatures = temperatures
            return
        super()._init_weights(module)

    # -- temperatures ------------------------------------------------------------------------------------------

    def set_gumbel_step(self, step: int) -> None:
        """Set the optimisation step the Gumbel temperature schedule is evaluated at (the training callback)."""
        self.gumbel_step = int(step)

    @property
    def gumbel_step(self) -> int:
        return self._gumbel_step

    @gumbel_step.setter
    def gumbel_step(self, step: int) -> None:
        self._gumbel_step = int(step)
        temperatures = self.gumbel_temperatures()
        # Written only when the schedule moves: a copy from the host into a buffer on an accelerator every step
        # would wait for the step before it.
        if temperatures != self._written_gumbel_temperatures:
            self.gumbel_temperature.values.copy_(torch.tensor(temperatures))
            self._written_gumbel_temperatures = temperatures

    def gumbel_temperatures(self) -> tuple[float, float]:
        """(τ_e, τ_d) at the current step (see ``gumbel_temperature_at``)."""
        c = self.config
        schedule = (c.gumbel_temperature_min, c.gumbel_temperature_decay_rate, c.gumbel_temperature_update_freq)
        return (
            gumbel_temperature_at(self.gumbel_step, c.encoder_gumbel_temperature, *schedule),
            gumbel_temperature_at(self.gumbel_step, c.decoder_gumbel_temperature, *schedule),
        )

    # -- order selection (Eq. 4) -------------------------------------------------------------------------------

    def _fixed_index(self, candidates: list[int], forced: int | None, fallback: int | None, name: str) -> int | None:
        code = forced if forced is not None else fallback
        if code is None:
            return 0 if len(candidates) == 1 else None
        if code not in candidates:
            raise ValueError(f"{name}={code} is not one of this model's candidates {candidates}")
        return candidates.index(code)

    def _sublayer_order(self, order_index: torch.Tensor, orders: list[tuple[str, ...]], fixed: int | None):
        if fixed is not None:
            return orders[fixed]
        return PerRowSublayerOrder(order_index, orders)

    def encode_with_orders(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None = None,
        encoder_order: int | None = None,
        decoder_order: int | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        inputs_embeds: torch.Tensor | None = None,
    ) -> IOTEncoderOutput:
        """Choose each sentence's encoder order (Eq. 4 on Eq. 1's logits), run the encoder once, then choose the
        decoder order (Eq. 4 on Eq. 2's logits). ``encoder_order`` / ``decoder_order`` (paper codes) force one
        order for every sentence. Instead of ``input_ids``, ``inputs_embeds`` (their unscaled token embeddings, what
        Eq. 1's predictor reads) with ``attention_mask`` marking the padding."""
        config = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("IOT's encoder takes exactly one of input_ids and inputs_embeds")
        source = input_ids if input_ids is not None else inputs_embeds
        if attention_mask is None:
            attention_mask = (
                input_ids.ne(config.pad_token_id).long() if input_ids is not None
                else source.new_ones(source.shape[:2], dtype=torch.long)
            )
        batch = source.shape[0]
        device = source.device
        encoder = self.get_encoder()
        fixed_encoder = self._fixed_index(
            config.encoder_orders, encoder_order, None if config.uses_predictor else config.inference_encoder_order,
            "encoder_order",
        )
        encoder_probs = None
        if fixed_encoder is None:
            if self.encoder_order_predictor is None:
                fixed_encoder = 0
            else:
                token_embeddings = encoder.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
                logits = self.encoder_order_predictor(token_embeddings, attention_mask)
                encoder_probs = torch.softmax(logits, dim=-1)
                encoder_index = logits.argmax(dim=-1)
        if fixed_encoder is not None:
            encoder_index = torch.full((batch,), fixed_encoder, dtype=torch.long, device=device)
        encoder_outputs = encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            sublayer_order=self._sublayer_order(encoder_index, config.encoder_sublayer_orders, fixed_encoder),
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        fixed_decoder = self._fixed_index(
            config.decoder_orders, decoder_order, None if config.uses_predictor else config.inference_decoder_order,
            "decoder_order",
        )
        decoder_probs = None
        if fixed_decoder is None:
            if self.decoder_order_predictor is None:
                fixed_decoder = 0
            else:
                logits = self.decoder_order_predictor(encoder_outputs.last_hidden_state, attention_mask)
                decoder_probs = torch.softmax(logits, dim=-1)
                decoder_index = logits.argmax(dim=-1)
        if fixed_decoder is not None:
            decoder_index = torch.full((batch,), fixed_decoder, dtype=torch.long, device=device)
        return IOTEncoderOutput(
            last_hidden_state=encoder_outputs.last_hidden_state,
            hidden_states=encoder_outputs.hidden_states,
            attentions=encoder_outputs.attentions,
            encoder_order_index=encoder_index,
            decoder_order_index=decoder_index,
            encoder_order_probs=encoder_probs,
            decoder_order_probs=decoder_probs,
        )

    @torch.no_grad()
    def predict_orders(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.LongTensor, torch.LongTensor]:
        """The (encoder, decoder) order codes (paper numbering) each sentence takes at inference (Eq. 4)."""
        outputs = self.encode_with_orders(input_ids, attention_mask)
        return self.order_codes(outputs.encoder_order_index, outputs.decoder_order_index)

    def order_codes(self, encoder_index: torch.Tensor, decoder_index: torch.Tensor):
        """Candidate indices → paper codes."""
        encoder_codes = torch.tensor(self.config.encoder_orders, device=encoder_index.device)
        decoder_codes = torch.tensor(self.config.decoder_orders, device=decoder_index.device)
        return encoder_codes[encoder_index], decoder_codes[decoder_index]

    def decoder_sublayer_order_for(self, decoder_order_index: torch.Tensor):
        """The decoder's ``sublayer_order`` for these rows, built once and reused while the same index tensor comes
        back (every step of one ``generate()`` call), so the per-row grouping is not recomputed per step."""
        orders = self.config.decoder_sublayer_orders
        if torch.compiler.is_exporting():
            # no host sync on the orders in an exported graph: the per-row plan masks rows instead (`_masked_plan`)
            return PerRowSublayerOrder(decoder_order_index, orders) if len(orders) > 1 else orders[0]
        cached = self._decoder_order_cache
        if cached is not None and cached[0] is decoder_order_index:
            return cached[1]
        first = decoder_order_index[:1]
        # one host sync per batch (not per step): a batch that agrees on one order runs the plain path
        if len(orders) == 1 or bool((decoder_order_index == first).all()):
            sublayer_order = orders[int(first.item()) if decoder_order_index.numel() else 0]
        else:
            sublayer_order = PerRowSublayerOrder(decoder_order_index, orders)
        self._decoder_order_cache = (decoder_order_index, sublayer_order)
        return sublayer_order

    # -- forward -----------------------------------------------------------------------------------------------

    @can_return_tuple
    @accepts_cache_argument
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> IOTSeq2SeqLMOutput | tuple:
        """Training (``self.training`` and ``labels``): all M×N order paths, loss of Eq. 7. Otherwise: each
        sentence's argmax orders (Eq. 4); ``labels`` then give the label-smoothed loss of those paths."""
        drop_generation_position_arguments(kwargs)
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        if self.training and labels is not None and encoder_outputs is None and past_key_values is None:
            if input_ids is None and inputs_embeds is None:
                raise ValueError("IOT training needs input_ids or inputs_embeds (the encoder predictor reads the "
                                 "token embeddings)")
            output = self._forward_all_paths(
                input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, labels, num_items_in_batch,
                inputs_embeds, decoder_inputs_embeds, output_attentions, output_hidden_states,
            )
            return output
        if labels is not None:
            use_cache = False
        if encoder_outputs is None:
            if input_ids is None and inputs_embeds is None:
                raise ValueError("pass input_ids or inputs_embeds (IOT chooses orders from the token embeddings) "
                                 "or encoder_outputs")
            encoder_outputs = self.encode_with_orders(
                input_ids, attention_mask, output_attentions=output_attentions,
                output_hidden_states=output_hidden_states, inputs_embeds=inputs_embeds,
            )
        elif not isinstance(encoder_outputs, IOTEncoderOutput) or encoder_outputs.decoder_order_index is None:
            encoder_outputs = self._with_decoder_orders(encoder_outputs, attention_mask, input_ids)
        sublayer_order = self.decoder_sublayer_order_for(encoder_outputs.decoder_order_index)
        if isinstance(sublayer_order, PerRowSublayerOrder) and torch.compiler.is_exporting():
            if past_key_values is not None or (use_cache if use_cache is not None else self.config.use_cache):
                raise ValueError(
                    "IOT exports its forward without the cache: pass use_cache=False to torch.export (rows choosing "
                    "different orders run some sub-layers twice in the exported graph, so a cache would be written "
                    "twice)"
                )
        if attention_mask is None and input_ids is not None:
            attention_mask = input_ids.ne(self.config.pad_token_id).long()
        outputs = self.model(
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=past_key_values,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            decoder_sublayer_order=sublayer_order,
            **kwargs,
        )
        output = self.language_model_output(
            outputs,
            labels,
            num_items_in_batch,
            logits_to_keep,
            output_class=IOTSeq2SeqLMOutput,
            encoder_order_probs=encoder_outputs.encoder_order_probs,
            decoder_order_probs=encoder_outputs.decoder_order_probs,
            encoder_order_index=encoder_outputs.encoder_order_index,
            decoder_order_index=encoder_outputs.decoder_order_index,
        )
        return output

    def _with_decoder_orders(self, encoder_outputs, attention_mask, input_ids) -> IOTEncoderOutput:
        """Encoder outputs computed elsewhere (plain ``BaseModelOutput`` or tuple): add Eq. 4's decoder orders."""
        if not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        states = encoder_outputs.last_hidden_state
        if attention_mask is None and input_ids is not None:
            attention_mask = input_ids.ne(self.config.pad_token_id).long()
        fixed = self._fixed_index(
            self.config.decoder_orders, None,
            None if self.config.uses_predictor else self.config.inference_decoder_order, "decoder_order",
        )
        probs = None
        if fixed is None and self.decoder_order_predictor is not None:
            logits = self.decoder_order_predictor(states, attention_mask)
            probs = torch.softmax(logits, dim=-1)
            index = logits.argmax(dim=-1)
        else:
            index = torch.full((states.shape[0],), fixed or 0, dtype=torch.long, device=states.device)
        return IOTEncoderOutput(
            last_hidden_state=states,
            hidden_states=encoder_outputs.hidden_states,
            attentions=encoder_outputs.attentions,
            encoder_order_index=getattr(encoder_outputs, "encoder_order_index", None),
            decoder_order_index=index,
            decoder_order_probs=probs,
        )

    def pop_order_statistics(self) -> dict[str, float]:
        """Order statistics accumulated by training forwards since the last call, as flat ``iot/...`` floats (see
        :meth:`IOTOrderStatistics.pop`). Resets the accumulators."""
        return self._order_statistics.pop()


__all__ = [
    "IOTConfig",
    "IOTEncoderOutput",
    "IOTForConditionalGeneration",
    "IOTGenerateBeamEncoderDecoderOutput",
    "IOTGenerateEncoderDecoderOutput",
    "IOTModel",
    "IOTOrderPredictor",
    "IOTSeq2SeqLMOutput",
    "clamp_order_probs",
    "diversity_loss",
    "gumbel_softmax_confidences",
    "gumbel_temperature_at",
    "iot_total_loss",
    "order_predictor_logits",
    "sentence_label_smoothed_losses",
    "sharpness_loss",
    "weighted_path_loss",
]
