"""fairseq's own numbers for `bench_backbone.py` (run with the python of a venv holding fairseq-fixed==0.12.3.1).

Same shapes as the flexformers side: transformer_iwslt_de_en, shared embeddings, joint dictionary of 10152,
batch 32 × 30; training = forward + fairseq's label-smoothed loss (ε=0.1) + backward + AdamW step; generation =
fairseq's SequenceGenerator with 30 decoder steps (29 forced tokens + forced </s>, the same number of decoder
forwards as `generate(max_new_tokens=30)`). Prints one JSON line.

With `--serve` (fp32) it builds everything once, prints `ready`, then runs one repetition per command read from
stdin (`train`, `greedy`, `beam5`) and prints its seconds — so `bench_backbone.py` can interleave fairseq's
repetitions with the other systems' in one run, as it does for flexformers and FSMT.
"""

from __future__ import annotations

import argparse
import json
import types

import torch
from fairseq import options
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.data import Dictionary
from fairseq.models.transformer import TransformerModel
from fairseq.sequence_generator import SequenceGenerator

# run as a script from benchmarks/, so the shared timing helper (torch only) is importable in fairseq's venv
from timing import interleaved, timed

VOCAB, BATCH, LENGTH = 10152, 32, 30


def main():
    global BATCH  # --batch
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--serve", action="store_true", help="one repetition per stdin command (fp32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (every timed call ends synchronised)")
    parser.add_argument("--batch", type=int, default=BATCH)
    cli = parser.parse_args()
    BATCH = cli.batch
    if cli.serve and cli.precision != "fp32":
        parser.error("--serve runs fp32 only")
    torch.set_num_threads(cli.threads)
    torch.manual_seed(0)

    dictionary = Dictionary()
    for i in range(VOCAB - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    assert len(dictionary) == VOCAB
    train_parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        train_parser,
        ["/nonexistent", "--task", "translation", "--arch", "transformer_iwslt_de_en", "--share-all-embeddings",
         "--dropout", "0.3", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"],
    )
    task = types.SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    device = torch.device(cli.device)
    model = TransformerModel.build_model(args, task).to(device)
    parameters = sum(p.numel() for p in model.parameters())

    generator = torch.Generator().manual_seed(0)
    source = torch.randint(4, VOCAB, (BATCH, LENGTH), generator=generator)
    source[:, -1] = dictionary.eos()
    target = torch.randint(4, VOCAB, (BATCH, LENGTH), generator=generator)
    target[:, -1] = dictionary.eos()
    previous = torch.cat([torch.full((BATCH, 1), dictionary.eos()), target[:, :-1]], dim=1)
    lengths = torch.full((BATCH,), LENGTH)
    source, target, previous, lengths = (t.to(device) for t in (source, target, previous, lengths))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step():
        model.train()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cli.precision == "bf16"):
            net_output = model(source, lengths, previous)
            log_probs = model.get_normalized_probs(net_output, log_probs=True).float()
            loss, _ = label_smoothed_nll_loss(
                log_probs.view(-1, VOCAB), target.view(-1), 0.1, ignore_index=dictionary.pad()
            )
        (loss / target.numel()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if cli.serve:
        serve(train_step, generate_runner(model, dictionary, source, lengths))
        return
    train_time = median_seconds(train_step, cli.repeats)
    if cli.precision == "bf16":
        model = model.to(torch.bfloat16)
    generate = generate_runner(model, dictionary, source, lengths)
    greedy_time = median_seconds(generate(1), cli.repeats)
    beam_time = median_seconds(generate(5), max(2, cli.repeats // 2))
    print(json.dumps({
        "train_tok_s": BATCH * LENGTH / train_time,
        "greedy_sent_s": BATCH / greedy_time,
        "beam5_sent_s": BATCH / beam_time,
        "parameters": parameters,
    }))


def generate_runner(model, dictionary, source, lengths):
    """`generate(beam)` → a function decoding the batch once with fairseq's SequenceGenerator (eval mode)."""
    sample = {"net_input": {"src_tokens": source, "src_lengths": lengths}}

    def generate(beam):
        sequence_generator = SequenceGenerator(
            [model], dictionary, beam_size=beam, max_len_a=0, max_len_b=LENGTH - 1, min_len=LENGTH - 1
        )

        def run():
            model.eval()
            with torch.inference_mode():
                hypotheses = sequence_generator.generate([model], sample)
            assert len(hypotheses[0][0]["tokens"]) == LENGTH

        return run

    return generate


def serve(train_step, generate):
    tasks = {"train": train_step, "greedy": generate(1), "beam5": generate(5)}
    for task in tasks.values():  # warm-up
        task()
    print("ready", flush=True)
    for line in iter(input_line, None):
        command = line.strip()
        if command == "quit":
            return
        print(f"{timed(tasks[command]):.6f}", flush=True)


def median_seconds(fn, repeats: int) -> float:
    """One warm-up call, then the median of `repeats` timed calls."""
    return interleaved({"fn": fn}, repeats)["fn"]


def input_line():
    try:
        return input()
    except EOFError:
        return None


if __name__ == "__main__":
    main()
