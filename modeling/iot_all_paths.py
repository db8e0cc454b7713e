"""IOT training over every encoder×decoder order path (Eq. 1–3, 5–7) in one stacked decoder pass.

The M encoder orders run one encoder pass each; the M·N paths then share *one* decoder pass, the batch repeated
path-major along the batch dimension with a ``PerRowSublayerOrder`` choosing each row block's sub-layer order. The
N decoder-order paths read the same M·b encoder states, so the decoder's cross-attention projects their keys and
values once per block (``IOTCrossAttention`` / ``IOTDecoderLayer``) instead of once per path.
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

from .cpu_kernels import project_vocabulary
from .iot_equations import (
    diversity_loss,
    gumbel_softmax_confidences,
    iot_total_loss,
    sentence_label_smoothed_losses,
    sharpness_loss,
    weighted_path_loss,
)
from .iot_outputs import IOTSeq2SeqLMOutput
from .modeling_flexformer import FlexformerAttention, FlexformerDecoderLayer
from .sublayer_order import PerRowSublayerOrder


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


_PER_BLOCK_FIELDS = ("hidden_states", "attentions", "cross_attentions")


def _cat_rows(per_part: list[tuple | None], stack: bool = False) -> tuple | None:
    """Per-block tensors of several parts (row blocks, or with ``stack`` alternatives along a new dimension 1) → one
    tuple of per-block tensors; None when the parts have none."""
    if per_part[0] is None:
        return None
    return tuple(torch.stack(block, dim=1) if stack else torch.cat(block, dim=0) for block in zip(*per_part))


class AllOrderPathsTraining:
    """The training forward of ``IOTForConditionalGeneration`` (``self.training`` with ``labels``): the loss of
    Eq. 7 over all M×N order paths, with the chosen path's logits, attentions and hidden states."""

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
