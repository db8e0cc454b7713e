"""The Depth-Adaptive Transformer's training objective: every exit trained on aligned states (Eq. 4) or on sampled
exit sequences with copied states (Eq. 5), plus α times the halting mechanism's exit loss against its oracle (Eq. 6,
7 and 9–17)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .depth_adaptive_decoder import BlockOutputs
from .depth_adaptive_equations import (
    aligned_decoding_loss,
    exit_loss,
    exit_loss_weights,
    gradient_scaling_factors,
    scale_gradient,
    sequence_correctness_oracle,
    sequence_likelihood_oracle,
    token_correctness_oracle,
    token_likelihood_oracle,
)
from .losses import label_smoothed_nll_loss


class ExitTraining:
    """The training objective of ``DepthAdaptiveForConditionalGeneration`` (its forward with ``labels`` and no exit
    strategy): the output fields of Eq. 4 or 5 plus α·Eq. 6."""

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
