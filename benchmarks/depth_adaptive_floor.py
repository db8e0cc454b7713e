"""How fast could batched *adaptive* early exit be on this machine? A lower bound from measured costs.

`bench_depth_adaptive.py` measures decoder time; this script asks what the time would be if nothing but the
unavoidable weight products ran. It measures, on the paper's IWSLT decoder (d 256, FFN 1024, six untied
10152-way classifiers), the time of one decoder block's weight products (self-attention q/k/v/out,
cross-attention q/out, fc1, fc2: the parts whose weights every row must read) and of one exit classifier, at
1…160 rows. Then it decodes a batch of 32 sentences (30 tokens, greedy and beam 5) with the benchmark's calibrated
geometric-like halting and confidence thresholding, takes the exits of the final hypotheses, and prices each step
as if it ran only those products on exactly the rows that need them:

- blocks: block n on the rows whose exit is ≥ n (perfect subsetting, no gathers, no decisions, no attention);
- classifiers: geometric-like — one classifier call per distinct exit block, on the rows exiting there;
  confidence — classifier n on every row that reaches block n (it must look before deciding);

against full depth (6 blocks on all rows, one classifier). That ratio is a floor for any implementation of the same
exits on this hardware; it ignores attention, layer norms, halting decisions and copied-state projections.

    flock -x /tmp/flexformers-cpu.lock python benchmarks/depth_adaptive_floor.py [--threads 2]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_depth_adaptive as bench  # noqa: E402
from timing import fastest  # noqa: E402

#: Row counts the costs are measured at (linear interpolation between them): 32 sentences × up to 5 beams.
GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160)


def measure(fn) -> float:
    """Seconds per call: the fastest of 7 averages of 40 calls, after 10 warm-up calls."""
    return fastest(fn, repeats=7, calls=40, warmup=10)


def monotone(table: dict[int, float]) -> dict[int, float]:
    """More rows never cost less: where noise says otherwise, charge the fewer rows the cheaper time."""
    result, cheapest = {}, float("inf")
    for rows in sorted(table, reverse=True):
        cheapest = min(cheapest, table[rows])
        result[rows] = cheapest
    return result


@torch.inference_mode()
def cost_tables(model) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds of one block's weight products and of one exit classifier, at the row counts of `GRID`."""
    layer = model.model.decoder.layers[3]
    classifier = model.exit_classifiers[3]
    block, classify = {}, {}
    d = model.config.decoder_embed_dim
    for rows in GRID:
        x = torch.randn(rows, 1, d)
        merged = x.view(rows, 1, 1, d)  # the output projections take [.., branches, d]

        def block_products():
            attention, cross = layer.self_attn, layer.encoder_attn
            attention.q_proj(x), attention.k_proj(x), attention.v_proj(x), attention.out_proj(merged)
            cross.q_proj(x), cross.out_proj(merged)
            layer.ffn.fc2(layer.ffn.fc1(x).view(rows, 1, 1, -1))

        block[rows] = measure(block_products)
        classify[rows] = measure(lambda: classifier(x))
    return monotone(block), monotone(classify)


def priced(table: dict[int, float], rows: int) -> float:
    """Cost at `rows` rows (1…160), interpolated linearly between the measured row counts."""
    upper = next(r for r in GRID if r >= rows)
    lower = max((r for r in GRID if r <= rows), default=upper)
    if upper == lower:
        return table[upper]
    return table[lower] + (table[upper] - table[lower]) * (rows - lower) / (upper - lower)


def floor_ratio(exits: torch.Tensor, live_rows: int, mechanism: str, block: dict, classify: dict) -> float:
    """Σ over steps of the priced adaptive step ÷ the priced full-depth step, `exits` `[rows, steps]`."""
    scale = live_rows / exits.shape[0]  # beam search: the final hypotheses stand for all live rows
    adaptive = full = 0.0
    for step in range(exits.shape[1]):
        step_exits = exits[:, step]
        reached = [round(scale * int((step_exits >= n).sum())) for n in range(1, 7)]
        adaptive += sum(priced(block, rows) for rows in reached if rows)
        if mechanism == "confidence":
            adaptive += sum(priced(classify, rows) for rows in reached if rows)
        else:
            counts = collections.Counter(step_exits.tolist())
            adaptive += sum(priced(classify, max(1, round(scale * count))) for count in counts.values())
        full += 6 * priced(block, live_rows) + priced(classify, live_rows)
    return adaptive / full


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--exit_fraction", type=float, default=0.7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = bench.build_models(torch.float32)
    generator = torch.Generator().manual_seed(1)
    sources = torch.randint(4, bench.VOCAB, (32, 30), generator=generator)
    sources[:, -1] = 2
    thresholds = bench.calibrate(model, sources, args.exit_fraction)
    block, classify = cost_tables(model)
    shown = (1, 4, 8, 16, 32, 64, 160)
    print("rows:            " + "  ".join(f"{r:>5d}" for r in shown))
    print("block products:  " + "  ".join(f"{block[r] * 1e6:5.0f}" for r in shown) + "  µs")
    print("exit classifier: " + "  ".join(f"{classify[r] * 1e6:5.0f}" for r in shown) + "  µs")
    print("\n| mechanism | beam | AE | steps with a row at block 6 | floor × full depth |\n|---|---|---|---|---|")
    cases = (("geometric", {"exit_strategy": "halting", "exit_thresholds": [0.5] * 5}),
             ("confidence", {"exit_strategy": "confidence", "exit_thresholds": thresholds}))
    for beams in (1, 5):
        for name, settings in cases:
            with torch.inference_mode():
                out = model.generate(
                    sources, attention_mask=sources.ne(bench.PAD).long(), num_beams=beams, max_new_tokens=30,
                    min_new_tokens=30, early_stopping=False, do_sample=False, return_exits=True,
                    return_dict_in_generate=True, **settings,
                )
            exits = out.exits
            deepest = sum(int(exits[:, t].max()) == 6 for t in range(exits.shape[1]))
            ratio = floor_ratio(exits, 32 * beams, name, block, classify)
            print(f"| {name} | {beams} | {exits.float().mean():.2f} | {deepest}/{exits.shape[1]} | {ratio:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
