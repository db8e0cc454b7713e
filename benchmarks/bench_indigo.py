"""InDIGO speed, side by side with the baseline Transformer of the same size (the paper's Table 6).

`transformer_iwslt_de_en` dims (6+6 blocks, d=512, FFN 1024, 4 heads), joint vocabulary 10152, batch 32 × 30
source and target tokens, random weights:

- greedy decoding, forced to exactly 30 insertions / tokens (`min_new_tokens` blocks `<eod>` / `</s>`):
  ms per sentence, InDIGO (incremental: KV cache + append-only R, pointer keys cached) vs the baseline;
- one training step (forward, loss, backward, AdamW): InDIGO with the L2R order, with SAO (B=8; Eq. 12 over all
  8 found orders, and over the best one), and the SAO search alone; ratios to the L2R step.

Timings are interleaved and the median of `--repeats` is reported. Run under the exclusive CPU lock:

    flock -x /tmp/flexformers-cpu.lock python benchmarks/bench_indigo.py [--repeats 3] [--precision fp32 bf16]
    python benchmarks/bench_indigo.py --device cuda      # on a GPU (timed calls end synchronised)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexformers.configuration.configuration_flexformer import FlexformerConfig  # noqa: E402
from flexformers.configuration.configuration_indigo import InDIGOConfig  # noqa: E402
from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration  # noqa: E402
from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration  # noqa: E402
from flexformers.training_scripts.indigo_orders import InDIGODataCollator  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import autocast, describe_device, interleaved  # noqa: E402

VOCAB = 10152


def make_batch(batch: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(5, VOCAB, (batch, length), generator=generator)
    source[:, -1] = 2
    target = torch.randint(5, VOCAB, (batch, length), generator=generator)
    target[:, -1] = 2
    return source, target


def paper_configs() -> tuple[FlexformerConfig, InDIGOConfig]:
    """The baseline and InDIGO at `transformer_iwslt_de_en` size, vocabulary 10152, label smoothing 0.1."""
    common = dict(vocab_size=VOCAB, label_smoothing=0.1)
    return (FlexformerConfig.from_preset("transformer_iwslt_de_en", **common),
            InDIGOConfig.from_preset("transformer_iwslt_de_en", **common))


def insertion_batches(source: torch.Tensor, target: torch.Tensor) -> tuple[dict, dict]:
    """InDIGO's collated L2R batch and its SAO batch (references for the search) of the same pairs."""
    features = [{"input_ids": s.tolist(), "labels": t.tolist()} for s, t in zip(source, target)]
    return tuple(InDIGODataCollator(order=order, pad_to_multiple_of=None)(features) for order in ("l2r", "sao"))


def greedy_fn(model, source, length):
    model = model.eval()
    mask = source.ne(1).long()

    def run():
        with torch.inference_mode():
            out = model.generate(source, attention_mask=mask, num_beams=1, do_sample=False,
                                 max_new_tokens=length, min_new_tokens=length)
        # baseline: </s> + 30 tokens; InDIGO: <s> + 30 words + </s>
        assert out.shape[1] in (length + 1, length + 2), out.shape

    return run


def train_fn(model, batch: dict, precision: str):
    # fused=True is what Seq2SeqTrainer uses by default (`optim="adamw_torch_fused"` on torch >= 2.8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    device = next(model.parameters()).device

    def run():
        model.train()
        with autocast(device, precision == "bf16"):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return run


def search_fn(model, batch: dict, beams: int, precision: str):
    device = next(model.parameters()).device

    def run():
        model.train()
        with torch.no_grad(), autocast(device, precision == "bf16"):
            mask = batch["attention_mask"]
            encoder = model.model.encoder(batch["input_ids"], attention_mask=mask).last_hidden_state
            model.search_adaptive_orders(encoder, mask, batch["target_ids"], batch["target_lengths"], beam_size=beams)

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=30)
    parser.add_argument("--sao-beam", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--sao-cuda-graphs", action="store_true",
                        help="also the SAO rows with the search replayed as CUDA graphs (a GPU only)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    print(describe_device(device, args.threads), flush=True)
    baseline_config, indigo_config = paper_configs()
    source, target = make_batch(args.batch, args.length)
    l2r_batch, sao_batch = insertion_batches(source, target)
    l2r_batch, sao_batch = ({k: v.to(device) for k, v in b.items()} for b in (l2r_batch, sao_batch))
    source, target = source.to(device), target.to(device)
    results = {"batch": args.batch, "length": args.length, "threads": args.threads, "sao_beam": args.sao_beam,
               "device": describe_device(device, args.threads)}
    for precision in args.precision:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        baseline = FlexformerForConditionalGeneration(baseline_config).to(device)
        indigo = InDIGOForConditionalGeneration(indigo_config).to(device)
        row = {
            "params_baseline": sum(p.numel() for p in baseline.parameters()),
            "params_indigo": sum(p.numel() for p in indigo.parameters()),
        }
        decode = interleaved(
            {
                "baseline": greedy_fn(baseline.to(dtype), source, args.length),
                "indigo": greedy_fn(indigo.to(dtype), source, args.length),
            },
            args.repeats,
        )
        row["greedy_ms_per_sentence"] = {k: 1000 * v / args.batch for k, v in decode.items()}
        row["greedy_ratio"] = decode["indigo"] / decode["baseline"]
        if not args.skip_train:
            baseline, indigo = baseline.float(), indigo.float()
            sao_all = InDIGOForConditionalGeneration(indigo_config).to(device)
            sao_all.use_searched_orders, sao_all.sao_beam_size = True, args.sao_beam
            sao_best = InDIGOForConditionalGeneration(indigo_config).to(device)
            sao_best.use_searched_orders, sao_best.sao_beam_size, sao_best.sao_train_orders = True, args.sao_beam, 1
            baseline_batch = {"input_ids": source, "labels": target}
            tasks = {
                "baseline": train_fn(baseline, baseline_batch, precision),
                "indigo_l2r": train_fn(indigo, l2r_batch, precision),
                f"sao_b{args.sao_beam}_eq12_all_orders": train_fn(sao_all, sao_batch, precision),
                f"sao_b{args.sao_beam}_best_order": train_fn(sao_best, sao_batch, precision),
                f"sao_b{args.sao_beam}_search_only": search_fn(sao_all, sao_batch, args.sao_beam, precision),
            }
            if args.sao_cuda_graphs:
                graphed_all = InDIGOForConditionalGeneration(indigo_config).to(device)
                graphed_best = InDIGOForConditionalGeneration(indigo_config).to(device)
                for model, keep in ((graphed_all, None), (graphed_best, 1)):
                    model.use_searched_orders, model.sao_beam_size, model.sao_train_orders = True, args.sao_beam, keep
                    model.sao_search_cuda_graphs = True
                tasks |= {
                    f"sao_b{args.sao_beam}_eq12_all_orders_cuda_graphs": train_fn(graphed_all, sao_batch, precision),
                    f"sao_b{args.sao_beam}_best_order_cuda_graphs": train_fn(graphed_best, sao_batch, precision),
                    f"sao_b{args.sao_beam}_search_only_cuda_graphs": search_fn(
                        graphed_all, sao_batch, args.sao_beam, precision
                    ),
                }
            # with graphs: the first call of a shape runs eagerly, the second captures — both before the timing
            train = interleaved(tasks, args.repeats, warmup=2 if args.sao_cuda_graphs else 1)
            row["train_step_s"] = train
            row["train_ratio_to_l2r"] = {k: v / train["indigo_l2r"] for k, v in train.items()}
        results[precision] = row
        print(json.dumps({precision: row}, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
