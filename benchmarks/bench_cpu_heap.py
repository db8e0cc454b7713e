"""CPU training steps with glibc's default heap against `flexformers.training_scripts.cpu_heap.retain_freed_memory()`.

`flexformers-train` keeps freed memory in the heap when it trains on the CPU (`--retain_cpu_memory`, default on).
This script measures what that buys: the training step (forward, loss, backward, fused AdamW, as Seq2SeqTrainer
runs it) of the baseline and of InDIGO with the L2R order at `transformer_iwslt_de_en` size (vocabulary 10152,
batch 32 × 30, 2 threads), each in a fresh process per heap setting — the setting is process-wide — alternating
the processes over `--rounds` rounds. Per process: the median of steps 2..`--steps` and their minor page faults.

    flock -x /tmp/flexformers-cpu.lock python benchmarks/bench_cpu_heap.py [--rounds 2] [--json F]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("baseline", "indigo_l2r")
HEAPS = ("default", "retain")


def worker(model_name: str, heap: str, steps: int, threads: int) -> dict:
    """Train `steps` steps in this process; the per-step seconds and minor page faults."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from flexformers.training_scripts.cpu_heap import retain_freed_memory

    applied = retain_freed_memory() if heap == "retain" else False
    import torch

    import bench_indigo as bench
    from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration
    from flexformers.modeling.modeling_indigo import InDIGOForConditionalGeneration

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    source, target = bench.make_batch(32, 30)
    baseline_config, indigo_config = bench.paper_configs()
    if model_name == "baseline":
        model = FlexformerForConditionalGeneration(baseline_config)
        batch = {"input_ids": source, "labels": target}
    else:
        model = InDIGOForConditionalGeneration(indigo_config)
        batch = bench.insertion_batches(source, target)[0]
    step = bench.train_fn(model, batch, "fp32")
    seconds, faults = [], []
    for _ in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {
        "applied": applied,
        "step_s": statistics.median(seconds[1:]),
        "faults_per_step": statistics.median(faults[1:]),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "HEAP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps, args.threads)))
        return
    runs = {model: {heap: [] for heap in HEAPS} for model in MODELS}
    for _ in range(args.rounds):
        for model in MODELS:
            for heap in HEAPS:
                command = [sys.executable, __file__, "--worker", model, heap, "--steps", str(args.steps),
                           "--threads", str(args.threads)]
                output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                runs[model][heap].append(json.loads(output.strip().splitlines()[-1]))
    results = {"threads": args.threads, "rounds": args.rounds, "steps": args.steps, "runs": runs, "summary": {}}
    for model in MODELS:
        step = {heap: statistics.median(run["step_s"] for run in runs[model][heap]) for heap in HEAPS}
        results["summary"][model] = {
            "step_s": step,
            "retain_over_default": step["retain"] / step["default"],
            "faults_per_step": {heap: statistics.median(r["faults_per_step"] for r in runs[model][heap]) for heap in HEAPS},
            "peak_rss_mib": {heap: max(r["peak_rss_mib"] for r in runs[model][heap]) for heap in HEAPS},
        }
    print(json.dumps(results["summary"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
