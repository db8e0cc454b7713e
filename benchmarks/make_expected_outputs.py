"""(Re)write tests/data/expected_outputs.json: numbers that depend on every part of each model type's forward.

For each model type (flexformer, iot, mat, indigo, depth_adaptive; the baseline also pre-norm) a tiny model is
built from a fixed seed and run, in eval mode, on a fixed batch; the loss, a slice and the sum / absolute sum of the
logits, the greedy `generate()` tokens and the method's own outputs are stored, plus the loss and parameter norm
around one SGD step in training mode. `tests/test_reference_maths.py` recomputes them with `expected_outputs` below and compares.

The stored numbers are a record of what the maths gives: regenerate them only when a change is meant to change
them (`--overwrite`), and say why in the commit.

    python benchmarks/make_expected_outputs.py [--output PATH] [--overwrite]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "tests" / "data" / "expected_outputs.json"
# Every model type, plus the baseline as a pre-norm model with shared embeddings (its final LayerNorms and the tied
# output layer are not in the post-norm defaults).
MODEL_TYPES = ("flexformer", "flexformer_pre_norm", "iot", "mat", "indigo", "depth_adaptive")
SEED = 0
TRAINING_SEED = 1234
LEARNING_RATE = 0.1
MAX_NEW_TOKENS = 4

# A right-padded source row and labels with ignored (-100) positions: masks, positions and the loss's ignore_index
# all enter the numbers.
SOURCE = [[5, 6, 7, 8, 9, 2], [10, 11, 12, 2, 1, 1]]
LABELS = [[20, 21, 22, 23, 2], [30, 31, 2, -100, -100]]


def tiny_kwargs(**overrides) -> dict:
    """The test suite's tiny backbone (tests/conftest.py), dropout 0, label smoothing 0.1 (so the smoothing term
    is part of the stored loss and of the training step's gradient)."""
    kwargs = {
        "vocab_size": 60, "encoder_embed_dim": 32, "decoder_embed_dim": 32, "encoder_ffn_embed_dim": 64,
        "decoder_ffn_embed_dim": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "dropout": 0.0, "max_source_positions": 64, "max_target_positions": 64,
        "label_smoothing": 0.1,
    }
    kwargs.update(overrides)
    return kwargs


def build_model(model_type: str, attn_implementation: str = "sdpa"):
    """The seeded tiny model of `model_type` (an entry of MODEL_TYPES; training mode, as constructed), with the given
    attention function."""
    import flexformers  # noqa: F401  (registers the model types)
    from flexformers.configuration import (
        DepthAdaptiveConfig,
        FlexformerConfig,
        InDIGOConfig,
        IOTConfig,
        MATConfig,
    )
    from flexformers.modeling import (
        DepthAdaptiveForConditionalGeneration,
        FlexformerForConditionalGeneration,
        InDIGOForConditionalGeneration,
        IOTForConditionalGeneration,
        MATForConditionalGeneration,
    )

    classes = {
        "flexformer": (FlexformerConfig, FlexformerForConditionalGeneration, {}),
        "flexformer_pre_norm": (
            FlexformerConfig,
            FlexformerForConditionalGeneration,
            {"encoder_normalize_before": True, "decoder_normalize_before": True, "share_all_embeddings": True},
        ),
        # both encoder orders, so the encoder's order predictor is exercised too
        "iot": (IOTConfig, IOTForConditionalGeneration, {"encoder_orders": [1, 2]}),
        "mat": (MATConfig, MATForConditionalGeneration, {}),
        "indigo": (InDIGOConfig, InDIGOForConditionalGeneration, {}),
        # the geometric halting with its exit loss: halting probabilities are part of the output
        "depth_adaptive": (
            DepthAdaptiveConfig,
            DepthAdaptiveForConditionalGeneration,
            {"halting_mechanism": "token_geometric", "exit_loss_alpha": 0.1},
        ),
    }
    config_class, model_class, overrides = classes[model_type]
    torch.manual_seed(SEED)
    model = model_class(config_class(**tiny_kwargs(**overrides)))
    model.set_attn_implementation(attn_implementation)
    return model


def _numbers(tensor: torch.Tensor | None) -> list | None:
    """The values of `tensor` as a flat list (None stays None: e.g. MAT's eval-mode merge, the plain average)."""
    return None if tensor is None else tensor.detach().double().flatten().tolist()


def _summary(tensor: torch.Tensor) -> dict:
    """A slice, the sum and the absolute sum of a tensor's finite entries (masked logits are -inf), and how many
    there are: a wrong value anywhere moves the sums."""
    flat = tensor.detach().double().flatten()
    finite = flat[torch.isfinite(flat)]
    return {
        "slice": finite[:8].tolist(),
        "sum": finite.sum().item(),
        "abs_sum": finite.abs().sum().item(),
        "finite_count": finite.numel(),
    }


def _method_outputs(model_type: str, model, outputs) -> dict:
    if model_type == "iot":
        return {
            "encoder_order_probs": _numbers(outputs.encoder_order_probs),
            "decoder_order_probs": _numbers(outputs.decoder_order_probs),
        }
    if model_type == "mat":
        attention = model.model.encoder.layers[0].self_attn
        ffn = model.model.decoder.layers[0].ffn
        weights = {
            "eval_attention_branch_weights": _numbers(attention.branch_weights(2, torch.device("cpu"), torch.float32)),
            "eval_ffn_branch_weights": _numbers(ffn.branch_weights(2, torch.device("cpu"), torch.float32)),
        }
        model.train()
        torch.manual_seed(TRAINING_SEED)  # drop-branch draws
        for name, module in (("attention", attention), ("ffn", ffn)):
            weights[f"train_{name}_branch_weights"] = _numbers(module.branch_weights(2, torch.device("cpu"), torch.float32))
        model.eval()
        return weights
    if model_type == "indigo":
        return {
            "pointer_logits": _summary(outputs.pointer_logits),
            "word_loss": outputs.word_loss.item(),
            "position_loss": outputs.position_loss.item(),
        }
    if model_type == "depth_adaptive":
        return {
            "per_exit_losses": _numbers(outputs.per_exit_losses),
            "exit_logits": [_summary(logits) for logits in outputs.exit_logits],
            "exit_log_probs": _summary(outputs.exit_log_probs),
            "exit_loss": outputs.exit_loss.item(),
        }
    return {}


def _forward_kwargs(model_type: str) -> dict:
    return {"return_exit_logits": True} if model_type == "depth_adaptive" else {}


def expected_outputs(model_type: str, attn_implementation: str = "sdpa") -> dict:
    """The numbers stored for `model_type` (see the module docstring), computed now."""
    source = torch.tensor(SOURCE)
    labels = torch.tensor(LABELS)
    model = build_model(model_type, attn_implementation).eval()
    with torch.no_grad():
        outputs = model(input_ids=source, labels=labels, **_forward_kwargs(model_type))
        record = {
            "loss": outputs.loss.item(),
            "logits": _summary(outputs.logits),
            "method": _method_outputs(model_type, model, outputs),
            "generated": model.generate(
                input_ids=source, max_new_tokens=MAX_NEW_TOKENS, num_beams=1, do_sample=False
            ).tolist(),
        }
    # One training step: training mode (the methods' own sampling seeded right before), SGD.
    # The update's norm is stored as well as the parameters': a small error in the gradient hardly moves the latter.
    model.train()
    before = [parameter.detach().double().clone() for parameter in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    torch.manual_seed(TRAINING_SEED)
    loss = model(input_ids=source, labels=labels).loss
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = [parameter.detach().double() for parameter in model.parameters()]
        norm = torch.sqrt(sum(parameter.pow(2).sum() for parameter in after))
        update_norm = torch.sqrt(sum((new - old).pow(2).sum() for new, old in zip(after, before)))
    record["train_step"] = {
        "loss": loss.item(),
        "parameter_norm_after": norm.item(),
        "update_norm": update_norm.item(),
    }
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing file (the stored numbers are meant to change)"
    )
    args = parser.parse_args(argv)
    if args.output.exists() and not args.overwrite:
        print(
            f"make_expected_outputs: error: {args.output} exists; pass --overwrite to replace the stored numbers "
            "(only when a change is meant to change them)",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(1)
    import transformers

    data = {
        "_about": {
            "written_by": "benchmarks/make_expected_outputs.py",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "source": SOURCE,
            "labels": LABELS,
        }
    }
    for model_type in MODEL_TYPES:
        data[model_type] = expected_outputs(model_type)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
