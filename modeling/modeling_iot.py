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
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.generation.utils import (
    GenerateBeamEncoderDecoderOutput,
)
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
)
from transformers.utils import can_return_tuple

from flexformers.configuration.configuration_iot import IOTConfig

from .cpu_kernels import project_vocabulary
from .generation_hooks import check_generate_arguments
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
from .iot_order_statistics import IOTOrderStatistics
from .iot_outputs import (
    IOTEncoderOutput,
    IOTGenerateBeamEncoderDecoderOutput,
    IOTGenerateEncoderDecoderOutput,
    IOTSeq2SeqLMOutput,
)
from .modeling_flexformer import (
    BackboneComponents,
    FlexformerAttention,
    FlexformerDecoderLayer,
    FlexformerForConditionalGeneration,
    FlexformerModel,
)
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


class IOTCrossAttention(FlexformerAttention):
    """The decoder's encoder-attention, able to serve the M·N stacked order paths of IOT training from the M
    encoder outputs: the keys/values of the encoder states, projected once per block call (``IOTDecoderLayer``), are
    shared by every decoder-order path (row r of the stacked batch uses encoder row ``r mod (M·b)``), instead of N
    identical projections. Outside stacked training (``path_repeats == 1``) it is the backbone's attention."""

    def _cross_key_value(
        self, encoder_states, past_key_values, rows, path_repeats: int = 1, shared_key_value=None, **kwargs
    ):
        if path_repeats == 1 or past_key_values is not None:
            return super()._cross_key_value(encoder_states, past_key_values, rows)
        keys, values = shared_key_value if shared_key_value is not None else self.project_key_value(encoder_states)
        base = keys.shape[0]
        if rows is None:
            return keys.repeat(path_repeats, 1, 1, 1), values.repeat(path_repeats, 1, 1, 1)
        if isinstance(rows, slice):
            if rows.start // base == (rows.stop - 1) // base:  # inside one path block: a view
                start = rows.start % base
                return keys[start : start + rows.stop - rows.start], values[start : start + rows.stop - rows.start]
            rows = torch.arange(rows.start, rows.stop, device=keys.device)
        source_rows = rows % base
        return keys.index_select(0, source_rows), values.index_select(0, source_rows)


class IOTDecoderLayer(FlexformerDecoderLayer):
    """The backbone's decoder block. In stacked training (``path_repeats`` = N > 1 decoder-order paths stacked along
    the batch, all reading the same M·b encoder states) it projects the encoder states to the cross-attention's
    keys/values once per call, for every sub-layer call of the block (``IOTCrossAttention``). The projection and
    ``path_repeats`` are the call's own: a checkpointed block recomputes exactly them in the backward pass."""

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, **kwargs):
        if kwargs.get("path_repeats", 1) > 1 and isinstance(self.encoder_attn, IOTCrossAttention):
            kwargs["shared_key_value"] = self.encoder_attn.project_key_value(encoder_hidden_states)
        return super().forward(hidden_states, attention_mask, encoder_hidden_states, **kwargs)


IOT_COMPONENTS = BackboneComponents(cross_attention=IOTCrossAttention, decoder_layer=IOTDecoderLayer)


class IOTModel(FlexformerModel):
    """The IOT encoder-decoder without LM head (``AutoModel``); the order predictors live on
    :class:`IOTForConditionalGeneration`."""

    config_class = IOTConfig
    components = IOT_COMPONENTS
    # FSDP / device_map units: IOT's decoder blocks are IOTDecoderLayer (accelerate looks the classes up by name,
    # and a model's list is the union of its own and its sub-models')
    _no_split_modules = ["FlexformerEncoderLayer", "IOTDecoderLayer"]


_PER_BLOCK_FIELDS = ("hidden_states", "attentions", "cross_attentions")


def _cat_rows(per_part: list[tuple | None], stack: bool = False) -> tuple | None:
    """Per-block tensors of several parts (row blocks, or with ``stack`` alternatives along a new dimension 1) → one
    tuple of per-block tensors; None when the parts have none."""
    if per_part[0] is None:
        return None
    return tuple(torch.stack(block, dim=1) if stack else torch.cat(block, dim=0) for block in zip(*per_part))


def _reorder_rows(value, sentence_positions: torch.Tensor, batch_size: int):
    """Reorder every batch-major tensor in ``value`` (nested tuples, caches) whose leading dimension is a multiple
    of ``batch_size``: row block ``i`` (the rows of sentence ``i``) becomes block ``sentence_positions[i]``."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] % batch_size != 0:
            return value
        per_sentence = value.shape[0] // batch_size
        index = (sentence_positions[:, None] * per_sentence + torch.arange(per_sentence, device=value.device)).flatten()
        return value.index_select(0, index.to(value.device))
    if isinstance(value, tuple):
        return tuple(_reorder_rows(item, sentence_positions, batch_size) for item in value)
    if isinstance(value, list):
        return [_reorder_rows(item, sentence_positions, batch_size) for item in value]
    if isinstance(value, EncoderDecoderCache):
        # each part by its own row count: a beam search's SourceGroupedCache keeps one cross-attention row per
        # sentence, and its reorder_cache (which only ever moves beams within a sentence) leaves that part alone
        for part in (value.self_attention_cache, value.cross_attention_cache):
            _reorder_rows(part, sentence_positions, batch_size)
        return value
    if isinstance(value, Cache) and hasattr(value, "reorder_cache"):
        layers = getattr(value, "layers", [])
        if layers and getattr(layers[0], "keys", None) is not None and layers[0].keys.shape[0] % batch_size == 0:
            per_sentence = layers[0].keys.shape[0] // batch_size
            device = layers[0].keys.device
            index = (sentence_positions[:, None].to(device) * per_sentence + torch.arange(per_sentence, device=device))
            value.reorder_cache(index.flatten())
        return value
    return value


class IOTForConditionalGeneration(FlexformerForConditionalGeneration):
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

    def _forward_all_paths(
        self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, labels, num_items_in_batch,
        inputs_embeds=None, decoder_inputs_embeds=None, output_attentions=False, output_hidden_states=False,
    ) -> IOTSeq2SeqLMOutput:
        """Training over every encoder×decoder order path (Eq. 1–3, 5–7).

        The encoder runs once per encoder order. The decoder runs *once* for all M·N paths: the batch is repeated
        path-major (row ``(n·M + m)·b + i`` is sentence i on encoder order m and decoder order n), so each decoder
        order is a contiguous block of rows, and one ``PerRowSublayerOrder`` runs each sub-layer per stage for the
        rows that need it. Attention weights and hidden states are those of each sentence's chosen path.
        """
        config = self.config
        source = input_ids if input_ids is not None else inputs_embeds
        if attention_mask is None:
            attention_mask = (
                input_ids.ne(config.pad_token_id).long() if input_ids is not None
                else source.new_ones(source.shape[:2], dtype=torch.long)
            )
        batch = source.shape[0]
        device = source.device
        num_enc, num_dec = config.num_encoder_orders, config.num_decoder_orders
        tau_e, tau_d = self.gumbel_temperature.values
        clamp = config.order_prob_clamp
        encoder = self.get_encoder()
        outputs_wanted = {"output_attentions": output_attentions, "output_hidden_states": output_hidden_states}

        encoder_probs = None
        if self.encoder_order_predictor is not None:
            token_embeddings = encoder.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            logits = self.encoder_order_predictor(token_embeddings, attention_mask)
            encoder_conf, encoder_probs = gumbel_softmax_confidences(logits, tau_e, clamp)
        else:
            encoder_conf = torch.ones(batch, num_enc, device=device)

        encoder_outputs = [
            encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, sublayer_order=order,
                **outputs_wanted,
            )
            for order in config.encoder_sublayer_orders
        ]
        encoder_states = [outputs.last_hidden_state for outputs in encoder_outputs]

        decoder_probs = None
        if self.decoder_order_predictor is not None:
            confidences, probabilities = [], []
            for states in encoder_states:
                logits = self.decoder_order_predictor(states, attention_mask)
                conf, prob = gumbel_softmax_confidences(logits, tau_d, clamp)
                confidences.append(conf)
                probabilities.append(prob)
            decoder_conf = torch.stack(confidences, dim=1)  # [b, M, N]
            decoder_probs = torch.stack(probabilities, dim=1)
        else:
            decoder_conf = torch.ones(batch, num_enc, num_dec, device=device)

        paths = num_enc * num_dec
        decoder = self.get_decoder()
        # Row blocks are laid out decoder-order-major in `decoder_row_arrangement` (block j = candidate arrangement[j]).
        arrangement = self.decoder_row_arrangement
        position = torch.empty(num_dec, dtype=torch.long, device=device)
        position[torch.tensor(arrangement, device=device)] = torch.arange(num_dec, device=device)
        if config.batch_order_paths and paths > 1:
            stacked_states = torch.cat(encoder_states, dim=0) if num_enc > 1 else encoder_states[0]
            if num_dec > 1:
                # The layout is known here: the plan needs no host sync, so a compiled step stays one graph.
                decoder_order = PerRowSublayerOrder.from_row_blocks(
                    [(candidate, num_enc * batch) for candidate in arrangement], config.decoder_sublayer_orders, device
                )
            else:
                decoder_order = config.decoder_sublayer_orders[0]
            # The N decoder-order paths share the encoder states: their cross-attention keys/values are projected
            # once per block (IOTDecoderLayer / IOTCrossAttention with path_repeats = N), not once per path.
            path_repeats = num_dec
            if not all(isinstance(layer.encoder_attn, IOTCrossAttention) for layer in decoder.layers):
                stacked_states, path_repeats = stacked_states.repeat(num_dec, 1, 1), 1
            decoder_outputs = decoder(
                input_ids=None if decoder_input_ids is None else decoder_input_ids.repeat(paths, 1),
                inputs_embeds=None if decoder_inputs_embeds is None else decoder_inputs_embeds.repeat(paths, 1, 1),
                attention_mask=None if decoder_attention_mask is None else decoder_attention_mask.repeat(paths, 1),
                encoder_hidden_states=stacked_states,
                encoder_attention_mask=attention_mask.repeat(paths, 1),
                sublayer_order=decoder_order,
                path_repeats=path_repeats,
                **outputs_wanted,
            )
            logits = project_vocabulary(self.lm_head, decoder_outputs.last_hidden_state)  # [paths·b, t, V]
        else:  # one decoder pass per path, in the same path-major row layout
            per_path = [
                decoder(
                    input_ids=decoder_input_ids,
                    inputs_embeds=decoder_inputs_embeds,
                    attention_mask=decoder_attention_mask,
                    encoder_hidden_states=states,
                    encoder_attention_mask=attention_mask,
                    sublayer_order=decoder_order,
                    **outputs_wanted,
                )
                for decoder_order in [config.decoder_sublayer_orders[n] for n in arrangement]
                for states in encoder_states
            ]
            logits = torch.cat([project_vocabulary(self.lm_head, outputs.last_hidden_state) for outputs in per_path], dim=0)
            decoder_outputs = BaseModelOutputWithPastAndCrossAttentions(
                **{name: _cat_rows([getattr(outputs, name) for outputs in per_path]) for name in _PER_BLOCK_FIELDS}
            )
        nll, smooth = sentence_label_smoothed_losses(logits, labels.repeat(paths, 1), config.label_smoothing)
        # [paths·b] (arrangement-major) → [b, M, N] (candidate order)
        nll = nll.view(num_dec, num_enc, batch)[position].permute(2, 1, 0)
        smooth = smooth.view(num_dec, num_enc, batch)[position].permute(2, 1, 0)
        epsilon = config.label_smoothing
        eps_i = epsilon / (logits.shape[-1] - 1) if epsilon > 0 else 0.0
        path_losses = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
        if config.weight_smoothing_loss or epsilon == 0:
            weighted_sum = weighted_path_loss(path_losses, encoder_conf, decoder_conf)
        else:  # the official code: confidences weight the NLL; the smoothing term of every path counts fully
            weighted_sum = (1.0 - epsilon - eps_i) * weighted_path_loss(nll, encoder_conf, decoder_conf)
            weighted_sum = weighted_sum + eps_i * smooth.sum()
        local_tokens = labels.ne(-100).sum()
        denominator = num_items_in_batch if num_items_in_batch is not None else local_tokens.clamp(min=1)
        if isinstance(denominator, torch.Tensor):
            denominator = denominator.to(weighted_sum.device)

        diversity = weighted_sum.new_zeros(())
        sharpness = weighted_sum.new_zeros(())
        diversity_clamp = clamp if config.clamp_diversity_probs else None
        for probs in (encoder_probs, decoder_probs):
            if probs is not None:
                flat = probs.reshape(-1, probs.shape[-1])
                diversity = diversity + diversity_loss(flat, diversity_clamp)
                sharpness = sharpness + sharpness_loss(flat, clamp)
        # Eq. 7 per target token; the auxiliary terms count once per token of this batch (the official criterion
        # multiplies them by the token count before normalising), which keeps gradient accumulation exact.
        aux_scale = local_tokens.to(weighted_sum.dtype) / denominator
        loss = iot_total_loss(
            weighted_sum / denominator, diversity * aux_scale, sharpness * aux_scale,
            config.diversity_loss_coef, config.sharpness_loss_coef,
        )

        # The chosen (argmax) path of each sentence, for the returned logits and the usage statistics.
        if encoder_probs is not None:
            encoder_choice = encoder_probs.argmax(dim=-1)
        else:
            encoder_choice = torch.zeros(batch, dtype=torch.long, device=device)
        if decoder_probs is not None:
            decoder_choice_all = decoder_probs.argmax(dim=-1)  # [b, M]
            decoder_choice = decoder_choice_all.gather(1, encoder_choice[:, None]).squeeze(1)
        else:
            decoder_choice_all = torch.zeros(batch, num_enc, dtype=torch.long, device=device)
            decoder_choice = decoder_choice_all[:, 0]
        sentences = torch.arange(batch, device=device)
        rows = (position[decoder_choice] * num_enc + encoder_choice) * batch + sentences
        tokens_per_path = local_tokens.clamp(min=1).to(torch.float32)
        path_token_losses = (path_losses.detach().sum(dim=0) / tokens_per_path)  # [M, N]
        self._order_statistics.accumulate(
            path_token_losses, encoder_probs, decoder_probs, encoder_choice, decoder_choice_all,
            diversity.detach(), sharpness.detach(), tau_e, tau_d,
        )


        def chosen_encoder_order(per_order: list):  # [b, ...] per encoder order → each sentence's chosen order
            return per_order[0] if num_enc == 1 else torch.stack(per_order, 1)[sentences, encoder_choice]

        def per_block(values: tuple | None, choose) -> tuple | None:
            return None if values is None else tuple(choose(value) for value in values)

        def chosen_path(value: torch.Tensor) -> torch.Tensor:
            return value.index_select(0, rows)

        encoder_fields = {  # per block [b, M, ...] → each sentence's chosen encoder order
            name: per_block(
                _cat_rows([getattr(outputs, name) for outputs in encoder_outputs], stack=True),
                lambda stacked: stacked[sentences, encoder_choice],
            )
            for name in ("hidden_states", "attentions")
        }
        return IOTSeq2SeqLMOutput(
            loss=loss,
            logits=logits.index_select(0, rows),
            encoder_last_hidden_state=chosen_encoder_order(encoder_states),
            encoder_hidden_states=encoder_fields["hidden_states"],
            encoder_attentions=encoder_fields["attentions"],
            decoder_hidden_states=per_block(decoder_outputs.hidden_states, chosen_path),
            decoder_attentions=per_block(decoder_outputs.attentions, chosen_path),
            cross_attentions=per_block(decoder_outputs.cross_attentions, chosen_path),
            path_losses=path_token_losses,
            encoder_order_probs=encoder_probs,
            decoder_order_probs=decoder_probs,
            encoder_confidences=encoder_conf,
            decoder_confidences=decoder_conf,
            diversity_loss=diversity.detach(),
            sharpness_loss=sharpness.detach(),
            encoder_order_index=encoder_choice,
            decoder_order_index=decoder_choice,
        )

    def pop_order_statistics(self) -> dict[str, float]:
        """Order statistics accumulated by training forwards since the last call, as flat ``iot/...`` floats (see
        :meth:`IOTOrderStatistics.pop`). Resets the accumulators."""
        return self._order_statistics.pop()

    # -- generation --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, inputs=None, generation_config=None, encoder_order=None, decoder_order=None, **kwargs):
        """``GenerationMixin.generate`` with per-sentence orders (Eq. 4); every generation option works.

        The encoder runs here once (each sentence with its order), the batch is sorted so sentences sharing a
        decoder order are contiguous (the per-row sub-layer groups then are slices), decoding runs once for the
        whole mixed batch, and the outputs are put back in input order. ``encoder_order`` / ``decoder_order``
        (paper codes) force one order for all sentences. With ``return_dict_in_generate=True`` the output also
        has ``encoder_order_codes`` / ``decoder_order_codes`` (one per input sentence); they are kept in
        ``self.last_order_codes`` too. ``inputs_embeds`` may replace the ids (Eq. 1's predictor reads them).
        """
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        kwargs.pop("labels", None)  # Seq2SeqTrainer passes the whole batch
        check_generate_arguments(self, input_ids, generation_config, kwargs)  # before the encoder runs here
        if kwargs.get("encoder_outputs") is not None or (input_ids is None and kwargs.get("inputs_embeds") is None):
            return super().generate(input_ids, generation_config, **kwargs)
        inputs_embeds = kwargs.pop("inputs_embeds", None)
        attention_mask = kwargs.pop("attention_mask", None)
        encoder_outputs = self.encode_with_orders(
            input_ids, attention_mask, encoder_order=encoder_order, decoder_order=decoder_order,
            output_attentions=bool(kwargs.get("output_attentions", False)),
            output_hidden_states=bool(kwargs.get("output_hidden_states", False)),
            inputs_embeds=inputs_embeds,
        )
        if attention_mask is None:
            source = input_ids if input_ids is not None else inputs_embeds
            attention_mask = (
                input_ids.ne(self.config.pad_token_id).long() if input_ids is not None
                else source.new_ones(source.shape[:2], dtype=torch.long)
            )
        batch = attention_mask.shape[0]
        decoder_index = encoder_outputs.decoder_order_index
        encoder_codes, decoder_codes = self.order_codes(encoder_outputs.encoder_order_index, decoder_index)
        self.last_order_codes = {"encoder": encoder_codes, "decoder": decoder_codes}
        rank = torch.empty(len(self.decoder_row_arrangement), dtype=torch.long, device=decoder_index.device)
        rank[torch.tensor(self.decoder_row_arrangement, device=decoder_index.device)] = torch.arange(
            len(self.decoder_row_arrangement), device=decoder_index.device
        )
        order = torch.argsort(rank[decoder_index], stable=True)
        needs_sort = not bool(torch.equal(order, torch.arange(batch, device=order.device)))
        if needs_sort:
            input_ids = None if input_ids is None else input_ids.index_select(0, order)
            attention_mask = attention_mask.index_select(0, order)
            for key in list(encoder_outputs.keys()):
                encoder_outputs[key] = _reorder_rows(encoder_outputs[key], order, batch)
            for key in ("decoder_input_ids", "decoder_attention_mask"):
                if isinstance(kwargs.get(key), torch.Tensor) and kwargs[key].shape[0] == batch:
                    kwargs[key] = kwargs[key].index_select(0, order)
            allowed_tokens = kwargs.get("prefix_allowed_tokens_fn")
            if allowed_tokens is not None:
                # a per-sentence constraint is asked about the sentence's index in the caller's batch
                input_sentence = order.tolist()
                kwargs["prefix_allowed_tokens_fn"] = lambda batch_id, ids: allowed_tokens(input_sentence[batch_id], ids)
        try:
            output = super().generate(
                input_ids, generation_config, attention_mask=attention_mask, encoder_outputs=encoder_outputs, **kwargs
            )
        finally:
            self._decoder_order_cache = None
        # Positions of each input sentence in the sorted batch.
        positions = torch.empty_like(order)
        positions[order] = torch.arange(batch, device=order.device)
        if isinstance(output, torch.Tensor):
            return _reorder_rows(output, positions, batch) if needs_sort else output
        fields = {key: value for key, value in output.items()}
        if needs_sort:
            beam_indices = fields.pop("beam_indices", None)
            fields = {key: _reorder_rows(value, positions, batch) for key, value in fields.items()}
            if beam_indices is not None:
                resolved = generation_config if generation_config is not None else self.generation_config
                per_sentence = int(kwargs.get("num_beams", resolved.num_beams) or 1)
                beam_indices = _reorder_rows(beam_indices, positions, batch)
                # entries are rows of the (sorted) expanded batch: map their sentence part back to input order
                sentence, beam = beam_indices.div(per_sentence, rounding_mode="floor"), beam_indices % per_sentence
                remapped = order[sentence.clamp(min=0)] * per_sentence + beam
                fields["beam_indices"] = torch.where(beam_indices < 0, beam_indices, remapped)
        output_class = (
            IOTGenerateBeamEncoderDecoderOutput
            if isinstance(output, GenerateBeamEncoderDecoderOutput)
            else IOTGenerateEncoderDecoderOutput
        )
        return output_class(**fields, encoder_order_codes=encoder_codes, decoder_order_codes=decoder_codes)


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
