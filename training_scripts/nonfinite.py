"""Stop ``flexformers-train`` at the first non-finite loss or gradient norm.

Trainer's ``logging_nan_inf_filter`` hides a NaN loss from the logs (it logs the running average instead) and the
optimizer then writes NaN into every weight: the run used to end "successfully" with an all-NaN model.
:class:`FiniteLossMixin` checks the loss after every forward pass (naming the model's loss terms) and the gradient
norm Trainer computes before every optimizer step, so training stops before a bad update reaches the weights; the
checkpoints already written stay the last good state.
"""

from __future__ import annotations

import math

import torch

from flexformers.training_scripts.checkpoints import last_good_checkpoint_note


class NonFiniteTrainingError(RuntimeError):
    """The training loss or gradient norm became NaN or infinite; the message names the step and the terms."""


def loss_terms(outputs) -> dict[str, float]:
    """The scalar loss tensors a model output carries (``loss`` and any ``*_loss`` such as IOT's
    ``diversity_loss``, Depth-Adaptive's ``exit_loss`` or InDIGO's ``position_loss``), as floats."""
    if outputs is None:
        return {}
    items = outputs.items() if hasattr(outputs, "items") else []
    return {
        name: float(value.detach().float())
        for name, value in items
        if name.endswith("loss") and isinstance(value, torch.Tensor) and value.numel() == 1
    }


def non_finite_error(step: int, what: str, output_dir: str, terms: dict[str, float] | None = None) -> NonFiniteTrainingError:
    """The error raised at optimisation step ``step`` (1-based, the update that was about to happen)."""
    message = f"step {step}: {what}"
    if terms:
        bad = [name for name, value in terms.items() if not math.isfinite(value)]
        shown = ", ".join(f"{name}={value:.6g}" for name, value in terms.items())
        culprits = [name for name in bad if name != "loss"]
        message += f" ({shown}" + (f"; non-finite term: {', '.join(culprits)}" if culprits else "") + ")"
    message += (
        f". Training stopped before this update reached the weights; {last_good_checkpoint_note(output_dir)}. "
        "Lower --learning_rate, clip gradients (--max_grad_norm 1.0) or check the config's coefficients."
    )
    return NonFiniteTrainingError(message)


class FiniteLossMixin:
    """Trainer mixin: a non-finite training loss or gradient norm raises :class:`NonFiniteTrainingError` naming
    the step (and, for the loss, the model's loss terms). Both values are ones Trainer computes and moves to the
    host every step anyway (for its NaN filter and its ``grad_norm`` log), so the checks cost nothing extra."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training and not bool(torch.isfinite(loss.detach()).all()):
            terms = loss_terms(outputs)
            terms.setdefault("loss", float(loss.detach().float().mean()))
            raise non_finite_error(self.state.global_step + 1, "the training loss is not finite", self.args.output_dir, terms)
        return (loss, outputs) if return_outputs else loss

    def _get_grad_norm(self, model, grad_norm=None):
        # Called once per optimizer step, just before it; a finite loss can still give an overflowing backward.
        # With --fp16 the loss scaler expects overflowing steps and skips them itself.
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if grad_norm is not None and not self.args.fp16:
            value = float(grad_norm)
            if not math.isfinite(value):
                raise non_finite_error(self.state.global_step + 1, f"the gradient norm is {value}", self.args.output_dir)
        return grad_norm


__all__ = ["FiniteLossMixin", "NonFiniteTrainingError", "loss_terms", "non_finite_error"]
