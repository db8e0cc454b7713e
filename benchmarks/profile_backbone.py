"""Where a step's time goes, ours vs FSMT, on any device: operator counts and self times from torch.profiler.

Same models and shapes as `bench_backbone.py` (IWSLT dims, vocab 10152, batch 32 × 30). For each system and task
(train step, greedy, beam 5) `--repeats` warmed-up calls are timed and one more is profiled; printed: wall seconds, operator calls, CUDA kernel
launches (on a GPU) and the operators with the most self CPU time.

    python benchmarks/profile_backbone.py [--device cuda] [--top 15] [--tasks train greedy beam5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_backbone import TrainStep, build_fsmt, build_ours, generate_fn  # noqa: E402
from timing import synchronize, timed  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls before the profiled one (median)")
    parser.add_argument("--tasks", nargs="+", default=["train", "greedy", "beam5"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    models = {"ours": build_ours(torch.float32).to(device), "fsmt": build_fsmt(torch.float32).to(device)}
    for task in args.tasks:
        for name, model in models.items():
            if task == "train":
                fn = TrainStep(model, name, "fp32", device)
            else:
                fn = generate_fn(model, 1 if task == "greedy" else 5, "no-eos", device)
            fn(), fn()
            walls = [timed(fn) for _ in range(args.repeats)]
            wall = statistics.median(walls)
            with profile(activities=activities) as prof:
                fn()
                synchronize()
            events = prof.key_averages()
            ops = sum(e.count for e in events if e.key.startswith("aten::"))
            launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
            # kernels only: an operator's self device time repeats the time of the kernels it launched
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            gpu = sum(e.self_device_time_total for e in kernels) / 1e6 if device.type == "cuda" else float("nan")
            print(f"\n### {task} / {name}: wall {wall * 1000:.1f} ms (median of {args.repeats}; "
                  f"{', '.join(f'{w * 1000:.0f}' for w in walls)}), aten calls {ops}, kernel launches {launches}, "
                  f"GPU busy {gpu * 1000:.1f} ms", flush=True)
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=45))
            if task == "train":
                model.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
