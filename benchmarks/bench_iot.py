"""IOT speed, side by side with the baseline of the same size (flexformers' own Transformer).

`transformer_iwslt_de_en` dims (6+6 blocks, d=512, FFN 1024, 4 heads), joint vocabulary 10152, batch 32 × 30
source and target tokens, as `bench_backbone.py`:

- train: forward + loss + backward + AdamW step, for IOT N = 2, 3, 4 (the paper's order sets, M = 1), with the
  N decoder paths batched into one decoder pass (default) and, for comparison, as N sequential passes
  (`batch_order_paths=False`, the official code's way) → step time ratio to the baseline;
- generation on a *mixed-order* batch: IOT N = 4 with the 32 sentences spread evenly over the 4 decoder orders
  (sentence i takes order i mod 4: the predictor's choice is overridden so the mix is exact), greedy and beam 5,
  exactly 30 new tokens → sentences/s and ratio to the baseline.

Measurements are interleaved (baseline, IOT, baseline, IOT, …) and the median is reported.

    flock -x /tmp/flexformers-cpu.lock python benchmarks/bench_iot.py [--repeats 5] [--precision fp32 bf16]
    python benchmarks/bench_iot.py --device cuda      # on a GPU (timed calls end synchronised)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexformers.configuration.configuration_flexformer import FlexformerConfig  # noqa: E402
from flexformers.configuration.configuration_iot import PAPER_DECODER_ORDERS, IOTConfig  # noqa: E402
from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration  # noqa: E402
from flexformers.modeling.modeling_iot import IOTForConditionalGeneration  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import autocast, describe_device, interleaved  # noqa: E402

VOCAB, BATCH, LENGTH = 10152, 32, 30


def build_baseline(dtype, preset):
    config = FlexformerConfig.from_preset(preset, vocab_size=VOCAB, label_smoothing=0.1)
    return FlexformerForConditionalGeneration(config).to(dtype)


def build_iot(dtype, preset, num_orders, batch_paths=True):
    config = IOTConfig.from_preset(
        preset, vocab_size=VOCAB, label_smoothing=0.1, decoder_orders=PAPER_DECODER_ORDERS[num_orders],
        batch_order_paths=batch_paths,
    )
    return IOTForConditionalGeneration(config).to(dtype)


def make_batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(5, VOCAB, (BATCH, LENGTH), generator=generator)
    source[:, -1] = 2
    target = torch.randint(5, VOCAB, (BATCH, LENGTH), generator=generator)
    target[:, -1] = 2
    return source, target


class TrainStep:
    def __init__(self, model, precision, device):
        self.model, self.precision, self.device = model.to(device).train(), precision, device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.source, self.labels = (t.to(device) for t in make_batch())

    def __call__(self):
        with autocast(self.device, self.precision == "bf16"):
            loss = self.model(input_ids=self.source, labels=self.labels).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def force_even_order_mix(model: IOTForConditionalGeneration, num_orders: int):
    """Make sentence i take decoder order i mod N (the predictor still runs; only its argmax is replaced)."""
    original = model.encode_with_orders

    def encode_with_orders(input_ids, attention_mask=None, **kwargs):
        outputs = original(input_ids, attention_mask, **kwargs)
        if kwargs.get("decoder_order") is None:
            outputs["decoder_order_index"] = torch.arange(input_ids.shape[0], device=input_ids.device) % num_orders
        return outputs

    model.encode_with_orders = encode_with_orders


def generate_fn(model, num_beams, check_mix=None, device="cpu"):
    source = make_batch(1)[0].to(device)
    model = model.eval()

    def run():
        with torch.inference_mode():
            out = model.generate(
                source, attention_mask=source.ne(1).long(), num_beams=num_beams, max_new_tokens=LENGTH,
                min_new_tokens=LENGTH, do_sample=False, early_stopping=False, length_penalty=1.0,
            )
        assert out.shape[1] == LENGTH + 1, out.shape
        if check_mix is not None:
            assert sorted(set(model.last_order_codes["decoder"].tolist())) == check_mix

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--preset", default="transformer_iwslt_de_en")
    parser.add_argument("--orders", nargs="+", type=int, default=[2, 3, 4], help="N values for the train rows")
    parser.add_argument("--sequential_orders", nargs="*", type=int, default=None,
                        help="N values that also get the one-pass-per-path row (default: all of --orders)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["train", "sequential", "generate"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    print(describe_device(device, args.threads), flush=True)
    results = {"preset": args.preset, "batch": BATCH, "length": LENGTH, "threads": args.threads, "rows": [],
               "device": describe_device(device, args.threads)}
    for precision in args.precision:
        dtype = torch.float32
        if "train" not in args.skip:
            steps = {"baseline": TrainStep(build_baseline(dtype, args.preset), precision, device)}
            for n in args.orders:
                steps[f"iot_n{n}"] = TrainStep(build_iot(dtype, args.preset, n), precision, device)
                if "sequential" not in args.skip and (args.sequential_orders is None or n in args.sequential_orders):
                    steps[f"iot_n{n}_sequential"] = TrainStep(build_iot(dtype, args.preset, n, False), precision, device)
            times = interleaved(steps, args.repeats)
            for name, seconds in times.items():
                row = {
                    "precision": precision, "task": "train", "model": name, "step_s": round(seconds, 4),
                    "target_tok_s": round(BATCH * LENGTH / seconds, 1),
                    "ratio": round(seconds / times["baseline"], 3),
                }
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
            del steps
        if "generate" not in args.skip:
            gen_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            baseline = build_baseline(gen_dtype, args.preset).to(device).eval()
            iot = build_iot(gen_dtype, args.preset, 4).to(device).eval()
            force_even_order_mix(iot, 4)
            for beams in (1, 5):
                times = interleaved(
                    {
                        "baseline": generate_fn(baseline, beams, device=device),
                        "iot_n4_mixed": generate_fn(iot, beams, check_mix=[1, 2, 4, 6], device=device),
                    },
                    args.repeats,
                )
                for name, seconds in times.items():
                    row = {
                        "precision": precision, "task": "greedy" if beams == 1 else f"beam{beams}", "model": name,
                        "batch_s": round(seconds, 4), "sent_s": round(BATCH / seconds, 2),
                        "ratio": round(seconds / times["baseline"], 3),
                    }
                    results["rows"].append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
