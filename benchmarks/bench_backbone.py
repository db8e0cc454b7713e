"""Baseline speed, side by side: flexformers vs HF FSMT (the Transformers port of fairseq) vs fairseq itself.

All at `transformer_iwslt_de_en` dims (6+6 blocks, d=512, FFN 1024, 4 heads), joint vocabulary 10152, shared
embeddings, batch 32 × 30 source and target tokens:

- train: forward + label-smoothed loss (ε=0.1) + backward + AdamW step → target tokens/s (the HF models use the
  fused AdamW that Seq2SeqTrainer uses by default; fairseq its usual per-parameter Adam update);
- greedy / beam-5: `generate()` forced to exactly 30 new tokens (`--force`: by default without an EOS id, so no
  logits processor runs; `min-new-tokens` for the processors' cost) → sentences/s;
- `--static-cache`: also both HF models generating with `cache_implementation="static"` (rows `ours_static`,
  `fsmt_static`), with which `generate()` compiles the decoding step on a GPU (`torch.compile`, mode
  "reduce-overhead": CUDA graphs); on a CPU it runs the static cache uncompiled.

Measurements are interleaved (ours, FSMT, fairseq, ours, FSMT, fairseq, …) and the median is reported, so all
see the same machine state. fairseq runs in its own virtual environment (`--fairseq-python`, see NOTES.md) as a
server process (`benchmarks/fairseq_peer.py --serve`) that runs one repetition per request, with the same shapes
and thread count (bf16: one separate fairseq run after ours and FSMT's).

    python benchmarks/bench_backbone.py [--repeats 5] [--precision fp32 bf16] [--fairseq-python /path/python]
                                        [--device cuda] [--batch 32] [--schedule interleaved|blocked]
                                        [--static-cache]

On a GPU (`--device cuda`) every timed call ends with a device synchronisation; fairseq runs on the same GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import FSMTConfig, FSMTForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexformers.configuration import FlexformerConfig  # noqa: E402
from flexformers.modeling import FlexformerForConditionalGeneration  # noqa: E402
from flexformers.modeling.losses import label_smoothed_nll_loss  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import autocast, describe_device, interleaved  # noqa: E402

VOCAB, BATCH, LENGTH = 10152, 32, 30


def build_ours(dtype):
    config = FlexformerConfig.from_preset("transformer_iwslt_de_en", vocab_size=VOCAB, label_smoothing=0.1)
    return FlexformerForConditionalGeneration(config).to(dtype)


def build_fsmt(dtype):
    config = FSMTConfig(
        langs=["de", "en"], src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, d_model=512, encoder_layers=6,
        decoder_layers=6, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=1024,
        decoder_ffn_dim=1024, dropout=0.3, tie_word_embeddings=True, max_position_embeddings=1024,
        scale_embedding=True,
    )
    model = FSMTForConditionalGeneration(config).to(dtype)
    # v5 registers FSMT's sinusoidal tables as parameters: freeze them so the optimizer does not update them.
    for name, param in model.named_parameters():
        if "embed_positions" in name:
            param.requires_grad_(False)
    return model


def count_trainable(model):
    return sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())


def make_batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(4, VOCAB, (BATCH, LENGTH), generator=generator)
    source[:, -1] = 2
    target = torch.randint(4, VOCAB, (BATCH, LENGTH), generator=generator)
    target[:, -1] = 2
    return source, target


class TrainStep:
    def __init__(self, model, kind, precision, device):
        self.model, self.kind, self.precision, self.device = model.train(), kind, precision, device
        # fused=True is what Seq2SeqTrainer uses by default (`optim="adamw_torch_fused"` on torch >= 2.8).
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
        self.source, self.labels = (t.to(device) for t in make_batch())

    def __call__(self):
        with autocast(self.device, self.precision == "bf16"):
            if self.kind == "ours":
                loss = self.model(input_ids=self.source, labels=self.labels).loss
            else:
                start = torch.full((BATCH, 1), 2, device=self.labels.device)
                decoder_input = torch.cat([start, self.labels[:, :-1]], dim=1)
                logits = self.model(input_ids=self.source, decoder_input_ids=decoder_input).logits
                loss, _ = label_smoothed_nll_loss(logits, self.labels, 0.1)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


# How the HF models are held to exactly LENGTH new tokens. "no-eos": generate without an end-of-sentence id, so
# nothing stops early and no logits processor runs. "min-new-tokens": `min_new_tokens`, whose two processors
# (MinLength, MinNewTokensLength) each clone the [rows, V] scores and mask EOS with `torch.where` at every step —
# ≈ 14 ms of a ≈ 80 ms beam-5 step here, a cost of the forcing, not of the model; fairseq forces its length with
# an in-place `lprobs[:, eos] = -inf` (`min_len`).
FORCING = {"no-eos": {"eos_token_id": None}, "min-new-tokens": {"min_new_tokens": LENGTH}}


def generate_fn(model, num_beams, forcing="no-eos", device="cpu", cache_implementation=None):
    source = make_batch(1)[0].to(device)
    model = model.eval()
    cache = {"cache_implementation": cache_implementation} if cache_implementation else {}

    def run():
        with torch.inference_mode():
            out = model.generate(
                source, attention_mask=source.ne(1).long(), num_beams=num_beams, max_new_tokens=LENGTH,
                do_sample=False, early_stopping=False, length_penalty=1.0, **FORCING[forcing], **cache,
            )
        assert out.shape[1] == LENGTH + 1, out.shape

    return run


class FairseqServer:
    """fairseq in its own venv (`fairseq_peer.py --serve`), driven one repetition at a time so its repetitions
    interleave with ours and FSMT's; each task returns the seconds fairseq measured for it."""

    def __init__(self, python: str, threads: int, device: str = "cpu", batch: int = BATCH):
        peer = Path(__file__).with_name("fairseq_peer.py")
        env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", OMP_NUM_THREADS=str(threads))
        self.process = subprocess.Popen(
            [python, str(peer), "--serve", "--threads", str(threads), "--device", device, "--batch", str(batch)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        for line in self.process.stdout:
            if line.strip() == "ready":
                return
        raise RuntimeError(f"the fairseq peer exited before it was ready (exit code {self.process.wait()})")

    def task(self, name: str):
        def run() -> float:
            self.process.stdin.write(name + "\n")
            self.process.stdin.flush()
            return float(self.process.stdout.readline())

        return run

    def close(self):
        self.process.stdin.write("quit\n")
        self.process.stdin.close()
        self.process.wait()


def run_fairseq(python: str, precision: str, repeats: int, threads: int, device: str = "cpu",
                batch: int = BATCH) -> dict | None:
    peer = Path(__file__).with_name("fairseq_peer.py")
    env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", OMP_NUM_THREADS=str(threads))
    result = subprocess.run(
        [python, str(peer), "--precision", precision, "--repeats", str(repeats), "--threads", str(threads),
         "--device", device, "--batch", str(batch)],
        capture_output=True, text=True, env=env,
    )
    if result.returncode != 0:
        print(f"fairseq peer failed:\n{result.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    global BATCH  # --batch
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--fairseq-python", default=os.environ.get("FAIRSEQ_PYTHON"))
    parser.add_argument("--force", choices=sorted(FORCING), default="no-eos",
                        help="how the HF models are held to exactly 30 new tokens (see FORCING)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--batch", type=int, default=BATCH, help="sentences per batch (the issue's setting: 32)")
    parser.add_argument("--schedule", choices=["interleaved", "blocked"], default="interleaved",
                        help="blocked: all repetitions of one system, then the next (fairseq as a separate run)")
    parser.add_argument("--static-cache", action="store_true",
                        help="also time both HF models generating with a static cache (compiled on a GPU)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    BATCH = args.batch
    blocked = args.schedule == "blocked"
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    print(describe_device(device, args.threads), flush=True)

    results = {"device": describe_device(device, args.threads)}
    for precision in args.precision:
        # Training runs fp32 weights (+ autocast for bf16); inference casts the weights (NOTES: autocast re-casts
        # every decoding step).
        ours, fsmt = build_ours(torch.float32).to(device), build_fsmt(torch.float32).to(device)
        print(f"parameters: ours {count_trainable(ours):,}  FSMT {count_trainable(fsmt):,}", flush=True)
        # fp32: fairseq's repetitions interleave with ours and FSMT's (a server process); bf16: one separate run.
        interleave_fairseq = args.fairseq_python and precision == "fp32" and not blocked
        server = FairseqServer(args.fairseq_python, args.threads, args.device, BATCH) if interleave_fairseq else None
        peers = {"fairseq": server} if server is not None else {}
        train = interleaved(
            {"ours": TrainStep(ours, "ours", precision, device), "fsmt": TrainStep(fsmt, "fsmt", precision, device)}
            | {name: peer.task("train") for name, peer in peers.items()},
            args.repeats, blocked=blocked,
        )
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        ours, fsmt = ours.to(dtype), fsmt.to(dtype)
        def generators(num_beams, task):
            systems = {"ours": ours, "fsmt": fsmt}
            functions = {name: generate_fn(model, num_beams, args.force, device) for name, model in systems.items()}
            if args.static_cache:
                functions |= {
                    f"{name}_static": generate_fn(model, num_beams, args.force, device, "static")
                    for name, model in systems.items()
                }
            return functions | {name: peer.task(task) for name, peer in peers.items()}

        greedy = interleaved(generators(1, "greedy"), args.repeats, blocked=blocked)
        beam = interleaved(generators(5, "beam5"), args.repeats, blocked=blocked)
        if server is not None:
            server.close()
        rows = {
            system: {
                "train_tok_s": BATCH * LENGTH / train[system] if system in train else None,
                "greedy_sent_s": BATCH / greedy[system],
                "beam5_sent_s": BATCH / beam[system],
            }
            for system in greedy
        }
        if args.fairseq_python and server is None:
            peer = run_fairseq(args.fairseq_python, precision, args.repeats, args.threads, args.device, BATCH)
            if peer is not None:
                rows["fairseq"] = peer
        results[precision] = rows
        print(f"\n[{precision}] {describe_device(device, args.threads)}, batch {BATCH} x {LENGTH}")
        print(f"{'system':11s} {'train tok/s':>12s} {'greedy sent/s':>14s} {'beam-5 sent/s':>14s}")
        for system, row in rows.items():
            train_column = f"{row['train_tok_s']:12.0f}" if row["train_tok_s"] is not None else f"{'-':>12s}"
            print(f"{system:11s} {train_column} {row['greedy_sent_s']:14.1f} {row['beam5_sent_s']:14.2f}")
        for ours_row in [name for name in rows if name.startswith("ours")]:
            ratios = []
            for key, value in rows[ours_row].items():
                peer_values = [row[key] for name, row in rows.items() if not name.startswith("ours") and row[key]]
                if value is not None and peer_values:
                    ratios.append(f"{key} {value / max(peer_values):.2f}x")
            print(f"{ours_row} / best peer: " + "  ".join(ratios), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
