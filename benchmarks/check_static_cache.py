"""Does generating with a static cache give the same tokens as the default cache, in one compiled graph?

`generate(cache_implementation="static")` on a GPU compiles the decoding step (`torch.compile`, "reduce-overhead":
CUDA graphs). This runs the baseline at `transformer_iwslt_de_en` size (vocabulary 10152, batch 32 × 30, forced to
30 new tokens) with greedy and beam-5 search, once with the default cache and once with a static cache compiled
with `fullgraph=True` (a graph break is an error), and compares the tokens. On a CPU the step is compiled too
(`--backend eager` by default there: the graph capture is what is checked, not inductor's C++ code).

    python benchmarks/check_static_cache.py [--device cuda] [--backend inductor|eager] [--batch 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import CompileConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_backbone import LENGTH, build_ours, make_batch  # noqa: E402
from timing import describe_device, synchronize  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend (default: inductor on a GPU, eager on a CPU)")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    device = torch.device(args.device)
    backend = args.backend or ("inductor" if device.type == "cuda" else "eager")
    print(describe_device(device, torch.get_num_threads()), flush=True)
    torch.manual_seed(0)
    model = build_ours(torch.float32).to(device).eval()
    source = make_batch(1)[0][: args.batch].to(device)
    mode = "reduce-overhead" if backend == "inductor" else None  # what generate() uses on a GPU
    compile_config = CompileConfig(fullgraph=True, backend=backend, mode=mode)
    compile_config._compile_all_devices = True  # compile on a CPU too (generate() compiles only on accelerators)
    failures = 0
    for num_beams in (1, 5):
        outputs = {}
        for cache in ("dynamic", "static"):
            kwargs = {"cache_implementation": "static", "compile_config": compile_config} if cache == "static" else {}
            seconds = []
            for _ in range(3):  # the first static call compiles
                synchronize()
                start = time.perf_counter()
                with torch.inference_mode():
                    outputs[cache] = model.generate(
                        source, attention_mask=source.ne(1).long(), num_beams=num_beams, max_new_tokens=LENGTH,
                        do_sample=False, eos_token_id=None, **kwargs,
                    )
                synchronize()
                seconds.append(time.perf_counter() - start)
            print(f"beams {num_beams} {cache:7s}: calls {', '.join(f'{s * 1000:.0f}' for s in seconds)} ms", flush=True)
        same = torch.equal(outputs["dynamic"], outputs["static"])
        differing = (outputs["dynamic"] != outputs["static"]).any(dim=1).sum().item()
        print(f"beams {num_beams}: static tokens {'identical' if same else f'differ in {differing} sentences'}")
        failures += not same
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
