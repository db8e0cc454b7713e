"""`flexformers-decode` with the model dynamically quantized to int8 — how the BLEU change of
`torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)` in docs/BENCHMARKS.md is measured.

    python benchmarks/decode_quantized.py --model_name_or_path RUN --split test --num_beams 4 \
        --output_file int8.txt --overwrite_output
    flexformers-decode --model_name_or_path RUN --split test --num_beams 4 --output_file float.txt

Takes every `flexformers-decode` option; the model is loaded as decode loads it, then quantized (every projection
is a plain `nn.Linear`, so all of them are swapped; the count is printed)."""

from __future__ import annotations

import sys

import torch
from torch import nn

from flexformers.training_scripts import decode

_load_model = decode.load_model


def load_quantized_model(*args, **kwargs):
    model, source_tokenizer, target_tokenizer = _load_model(*args, **kwargs)
    linears = sum(type(module) is nn.Linear for module in model.modules())
    model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    swapped = sum(isinstance(module, torch.ao.nn.quantized.dynamic.Linear) for module in model.modules())
    print(f"quantize_dynamic: {swapped} of {linears} nn.Linear projections swapped to int8", file=sys.stderr)
    return model, source_tokenizer, target_tokenizer


if __name__ == "__main__":
    decode.load_model = load_quantized_model
    sys.exit(decode.main())
