"""Stop ``flexformers-train`` at the first non-finite loss or gradient.

Trainer's ``logging_nan_inf_filter`` hides a NaN loss from the logs (it logs the running average instead) and the
optimizer then writes NaN into every weight: the run used to end "successfully" with an all-NaN model. Here the
loss is checked after every forward pass (:class:`FiniteLossMixin`, which can name the model's loss terms) and
the gradient norm before every optimizer step (:class:`FiniteGradientCallback`), so training stops before a bad
update reaches the weights; the checkpoints already written stay the last good state.
"""

from __future__ import annotations

import math

import torch
from transformers import TrainerCallback

from flexformers.training_scripts.checkpoints import find_latest_complete_checkpoint


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


def _last_good_checkpoint(output_dir: str) -> str:
    checkpoint, _ = find_latest_complete_checkpoint(output_dir)
    if checkpoint is None:
        return "no checkpoint had been written yet"
    return f"the last good checkpoint is {checkpoint} (--resume_from_checkpoint latest continues from it)"


def non_finite_error(step: int, what: str, output_dir: str, terms: dict[str, float] | None = None) -> NonFiniteTrainingError:
    """The error raised at optimisation step ``step`` (1-based, the update that was about to happen)."""
    message = f"step {step}: {what}"
    if terms:
        bad = [name for name, value in terms.items() if not math.isfinite(value)]
        shown = ", ".join(f"{name}={value:.6g}" for name, value in terms.items())
        culprits = [name for name in bad if name != "loss"]
        message += f" ({shown}" + (f"; non-finite term: {', '.join(culprits)}" if culprits else "") + ")"
    message += (
        f". Training stopped before this update reached the weights; {_last_good_checkpoint(output_dir)}. "
        "Lower --learning_rate, clip gradients (--max_grad_norm 1.0) or check the config's coefficients."
    )
    return NonFiniteTrainingError(message)


class FiniteLossMixin:
    """Trainer mixin: a non-finite training loss raises :class:`NonFiniteTrainingError` naming the step and the
    model's loss terms. (Trainer already moves the loss to the host every step for its NaN filter, so the check
    adds no synchronisation of its own.)"""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training and not bool(torch.isfinite(loss.detach()).all()):
            terms = loss_terms(outputs)
            terms.setdefault("loss", float(loss.detach().float().mean()))
            raise non_finite_error(self.state.global_step + 1, "the training loss is not finite", self.args.output_dir, terms)
        return (loss, outputs) if return_outputs else loss


class FiniteGradientCallback(TrainerCallback):
    """Before every optimizer step: stop when the gradient norm is NaN or infinite (a finite loss can still give
    one, e.g. through an overflowing backward). Skipped with ``--fp16``, whose loss scaler expects overflowing steps
    and skips them itself."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is None or args.fp16:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        norm = float(torch.nn.utils.get_total_norm(grads))
        if not math.isfinite(norm):
            raise non_finite_error(state.global_step + 1, f"the gradient norm is {norm}", args.output_dir)


__all__ = ["FiniteGradientCallback", "FiniteLossMixin", "NonFiniteTrainingError", "loss_terms", "non_finite_error"]
