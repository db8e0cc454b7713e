"""Decode source sentences with a Hub folder exactly as a user of it would: ``AutoTokenizer`` and
``AutoModelForSeq2SeqLM`` from the folder, float32 weights, ``model.generate`` with the folder's own
``generation_config.json`` and nothing else.

This file imports only torch and Transformers, so the same routine decodes a shipped model's card slice in the
flexformers environment (``flexformers-zoo ship`` / ``verify``) and, run by its path, in a clean one holding only
torch, transformers, tokenizers and safetensors (``trust_remote_code=True``)::

    python slice_decoding.py FOLDER SOURCES.json [--trust_remote_code]   # prints {"hypotheses": [...]} as JSON
"""

from __future__ import annotations

import json
import sys

import torch

#: Sentences per ``generate`` call. Fixed, in input order: a batch's padding changes the numbers a little, so the
#: card's slice score is reproduced exactly only by the same batches.
SLICE_BATCH_SIZE = 25


def load_folder(folder: str, trust_remote_code: bool = False):
    """The tokenizer and the float32 model of a Hub folder (half-precision weights are stored, not computed in)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    # trust_remote_code for the tokenizer too: Transformers reads config.json first and would ask before its code
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=trust_remote_code, dtype=torch.float32)
    return tokenizer, model.eval()


@torch.inference_mode()
def decode_sources(tokenizer, model, sources: list[str], batch_size: int = SLICE_BATCH_SIZE) -> list[str]:
    """``sources`` decoded with the model's generation config, in order, ``batch_size`` at a time."""
    max_source = getattr(model.config, "max_source_positions", None)
    hypotheses = []
    for start in range(0, len(sources), batch_size):
        batch = tokenizer(sources[start:start + batch_size], return_tensors="pt", padding=True,
                          truncation=max_source is not None, max_length=max_source)
        output = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        sequences = output.sequences if hasattr(output, "sequences") else output
        hypotheses += tokenizer.batch_decode(sequences, skip_special_tokens=True)
    return [hypothesis.strip() for hypothesis in hypotheses]


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or (len(argv) == 3 and argv[2] != "--trust_remote_code"):
        print("usage: slice_decoding.py FOLDER SOURCES.json [--trust_remote_code]", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as file:
        sources = json.load(file)
    tokenizer, model = load_folder(argv[0], trust_remote_code=len(argv) == 3)
    print(json.dumps({"hypotheses": decode_sources(tokenizer, model, sources),
                      "model_module": type(model).__module__}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
