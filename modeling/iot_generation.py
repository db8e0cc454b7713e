"""IOT's ``generate()``: each sentence decodes in its own predicted orders (Eq. 4), the whole mixed batch at once.

The encoder runs once with every sentence in its encoder order; the batch is then sorted so that sentences sharing a
decoder order are contiguous (each sub-layer group of the per-row order becomes a slice), ``GenerationMixin.generate``
decodes the sorted batch, and every output (sequences, scores, beam indices, caches) goes back to the caller's order.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.generation.utils import GenerateBeamEncoderDecoderOutput

from .generation_hooks import check_generate_arguments
from .iot_outputs import IOTGenerateBeamEncoderDecoderOutput, IOTGenerateEncoderDecoderOutput


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


class OrderSortedGeneration:
    """``generate()`` of ``IOTForConditionalGeneration``: predicted orders, a batch sorted by decoder order, outputs
    restored to input order."""

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
