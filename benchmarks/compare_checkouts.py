"""Two checkouts of flexformers side by side on the CPU: greedy decoding and a training step of the
`transformer_iwslt_de_en` baseline, in alternating processes (one per checkout per round, so both see the same
machine state), each the median of `--calls` timed calls after a warm-up; prints every process and the medians.

    git worktree add /tmp/before <commit>          # or any copy of an earlier checkout
    python benchmarks/compare_checkouts.py /tmp/before . --rounds 7 --calls 9

Greedy: batch 32 × 30 source tokens, exactly 30 new tokens. Training: forward, label-smoothed loss, backward and a
fused AdamW step on batch 32 × 30. Each process imports the code of its checkout (run from its root)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ONE_PROCESS = r"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
torch.set_num_threads({threads})
from flexformers import FlexformerConfig, FlexformerForConditionalGeneration
torch.manual_seed(0)
model = FlexformerForConditionalGeneration(FlexformerConfig.from_preset("transformer_iwslt_de_en", vocab_size=10152))
source = torch.randint(5, 10152, (32, 30)); source[:, -1] = 2
target = torch.randint(5, 10152, (32, 30))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

def greedy():
    model.eval()
    with torch.no_grad():
        model.generate(source, max_new_tokens=30, min_new_tokens=30, num_beams=1)

def train_step():
    model.train()
    model(input_ids=source, labels=target).loss.backward()
    optimizer.step()
    optimizer.zero_grad()

medians = {{}}
for name, run in (("greedy", greedy), ("train", train_step)):
    run()
    times = []
    for _ in range({calls}):
        start = time.perf_counter(); run(); times.append(time.perf_counter() - start)
    medians[name] = statistics.median(times)
print(json.dumps(medians))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkouts", nargs=2, help="the two checkout roots: before, after")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    code = ONE_PROCESS.format(threads=args.threads, calls=args.calls)
    results = {checkout: [] for checkout in args.checkouts}
    for round_index in range(args.rounds):
        order = args.checkouts if round_index % 2 == 0 else args.checkouts[::-1]
        for checkout in order:
            output = subprocess.run([sys.executable, "-c", code], cwd=Path(checkout).resolve(), check=True,
                                    capture_output=True, text=True).stdout
            results[checkout].append(json.loads(output.strip().splitlines()[-1]))
            print(checkout, results[checkout][-1], flush=True)
    for checkout, runs in results.items():
        print(checkout, {name: round(statistics.median(run[name] for run in runs), 3) for name in ("greedy", "train")})


if __name__ == "__main__":
    main()
