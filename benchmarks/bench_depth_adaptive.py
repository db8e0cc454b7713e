"""Depth-Adaptive early-exit decoding speed against full-depth decoding of the same model.

    flock -x /tmp/flexformers-cpu.lock python benchmarks/bench_depth_adaptive.py [--repeats 3] [--out FILE]
    python benchmarks/bench_depth_adaptive.py --device cuda   # on a GPU: each timer synchronises the device

The paper's IWSLT architecture (``depth_adaptive_iwslt_de_en``: d_enc 512, d_dec 256, FFN 1024, 4 heads, N = 6,
six untied classifiers over a 10152-token vocabulary), random weights. Every run decodes exactly ``--steps`` tokens
per hypothesis (``min_new_tokens = max_new_tokens``), so the strategies do the same number of steps whatever tokens
they pick. Rows:

- ``backbone``: the plain ``FlexformerForConditionalGeneration`` with the same weights (full depth);
- ``full``: the Depth-Adaptive model with every token exiting at block 6 (its early-exit loop, no exits);
- ``fixed 2``: every token exits at block 2 (AE = 2);
- ``fixed 2, eager copies``: the same, with the skipped blocks' copied-state keys/values projected at every step
  (``model.defer_copied_states = False``) instead of when a later token needs them (never, here);
- ``geometric``: the geometric-like halting (Eq. 12–13) with each block's bias set at the 30 % quantile of its
  halting logits on teacher-forced random targets, so tokens exit at mixed blocks with AE ≈ 2;
- ``confidence``: confidence thresholding with thresholds set the same way (it pays a 10152-way classifier after
  every block it passes).

Repetitions are interleaved (every case once per repetition) and the median is reported. *Decoder time* is the
wall time spent in the model's forward during ``generate`` (the decoder blocks, the
classifiers and the halting decisions; the encoder runs outside it); the ratio is against ``full``. The
*w/o output classifier* ratio subtracts the time spent in the classifiers (for confidence thresholding that also
removes its per-block exit checks): the 2·V·d output projection (V = 10152, d = 256) costs about three decoder
blocks of FLOPs and is paid once per token by every strategy. The
*generate* column is the whole ``generate`` call (encoder and Transformers' search loop included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexformers.modeling  # noqa: E402,F401
from flexformers.configuration.configuration_depth_adaptive import DepthAdaptiveConfig  # noqa: E402
from flexformers.configuration.configuration_flexformer import FlexformerConfig  # noqa: E402
from flexformers.modeling.modeling_depth_adaptive import DepthAdaptiveForConditionalGeneration  # noqa: E402
from flexformers.modeling.modeling_flexformer import FlexformerForConditionalGeneration, padding_mask  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import describe_device, synchronize  # noqa: E402

VOCAB = 10152
PAD = 1


class ForwardTimer:
    """Accumulates the wall time of ``model.forward`` calls (generate calls the model once per step)."""

    def __init__(self, model):
        self.seconds = 0.0
        original = model.forward

        def timed(*args, **kwargs):
            synchronize()
            start = time.perf_counter()
            output = original(*args, **kwargs)
            synchronize()
            self.seconds += time.perf_counter() - start
            return output

        model.forward = timed


class ExitCounter:
    """Counts the exits the early-exit steps take (AE over every row and step)."""

    def __init__(self, decoder):
        self.total = 0
        self.count = 0
        original = decoder.early_exit_step

        def counted(*args, **kwargs):
            logits, exits = original(*args, **kwargs)
            self.total += int(exits.sum())
            self.count += exits.numel()
            return logits, exits

        decoder.early_exit_step = counted

    @property
    def average_exit(self) -> float:
        return self.total / self.count if self.count else float("nan")


def build_models(dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    config = DepthAdaptiveConfig.from_preset(
        "depth_adaptive_iwslt_de_en", vocab_size=VOCAB, dropout=0.0, halting_mechanism="token_geometric"
    )
    model = DepthAdaptiveForConditionalGeneration(config).eval()
    baseline_config = FlexformerConfig.from_preset(
        "transformer_iwslt_de_en", vocab_size=VOCAB, decoder_embed_dim=256, share_all_embeddings=False, dropout=0.0
    )
    baseline = FlexformerForConditionalGeneration(baseline_config).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(("exit_classifiers.", "halting."))}
    baseline.load_state_dict(state)
    return model.to(dtype), baseline.to(dtype)


@torch.no_grad()
def calibrate(model, source, exit_fraction: float) -> list[float]:
    """Set the geometric-like biases so that ``exit_fraction`` of the states reaching each block exit there, and
    return confidence thresholds with the same property (quantiles on teacher-forced random targets)."""
    target = torch.randint(4, VOCAB, (source.shape[0], 30)).to(source.device)
    decoder = model.model.decoder
    encoder_states = model.get_encoder()(input_ids=source).last_hidden_state
    layer_kwargs = {
        "attention_mask": None,
        "encoder_hidden_states": encoder_states,
        "encoder_attention_mask": padding_mask(source.ne(PAD).long(), encoder_states.dtype),
    }
    decoder_input = torch.cat([torch.full((source.shape[0], 1), 2, device=source.device), target[:, :-1]], dim=1)
    states, _, _ = decoder.forward_layerwise(decoder.embed(decoder_input), layer_kwargs, keep_states=True)
    thresholds = []
    for block in range(1, model.num_exits):
        logits = model.halting.halting_logits(block, states[block - 1]).float().flatten()
        model.halting.bias[block - 1] -= torch.quantile(logits, 1 - exit_fraction).to(model.halting.bias.dtype)
        confidence = torch.softmax(model.classify(block, states[block - 1]).float(), -1).amax(-1).flatten()
        thresholds.append(float(torch.quantile(confidence, 1 - exit_fraction)))
    return thresholds


class ClassifierTimer:
    """Wall time spent in the output classifiers (forward hooks on ``lm_head`` and the exit classifiers)."""

    def __init__(self, model):
        self.seconds = 0.0
        self._start = 0.0
        modules = [model.lm_head] + list(getattr(model, "exit_classifiers", None) or [])
        self.handles = []
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(self._before))
            self.handles.append(module.register_forward_hook(self._after))

    def _before(self, module, inputs):
        synchronize()
        self._start = time.perf_counter()

    def _after(self, module, inputs, output):
        synchronize()
        self.seconds += time.perf_counter() - self._start

    def remove(self):
        for handle in self.handles:
            handle.remove()


def run_case(model, batches, beams: int, steps: int, settings: dict, counter: ExitCounter | None):
    """One pass over ``batches``: (decoder seconds, generate seconds, AE, classifier seconds)."""
    settings = dict(settings)
    if hasattr(model, "defer_copied_states"):
        model.defer_copied_states = settings.pop("defer_copied_states", True)
    timer = ForwardTimer(model)
    classifier_timer = ClassifierTimer(model)
    if counter is not None:
        counter.total = counter.count = 0
    generate_seconds = 0.0
    try:
        for source in batches:
            synchronize()
            start = time.perf_counter()
            model.generate(source, attention_mask=source.ne(PAD).long(), num_beams=beams, max_new_tokens=steps,
                           min_new_tokens=steps, early_stopping=False, do_sample=False, **settings)
            synchronize()
            generate_seconds += time.perf_counter() - start
    finally:
        del model.forward  # back to the class method
        classifier_timer.remove()
    average_exit = counter.average_exit if counter is not None else 6.0
    return timer.seconds, generate_seconds, average_exit, classifier_timer.seconds


def count_forward_ops(model, source, beams: int, steps: int, settings: dict) -> float:
    """Top-level ATen operator calls inside the model's forward per decoding step (load-independent: on a small
    model at small batch, time is mostly per-operator overhead)."""
    settings = dict(settings)
    if hasattr(model, "defer_copied_states"):
        model.defer_copied_states = settings.pop("defer_copied_states", True)
    original = model.forward

    def marked(*args, **kwargs):
        with torch.profiler.record_function("depth_adaptive_forward"):
            return original(*args, **kwargs)

    model.forward = marked
    try:
        with torch.profiler.profile() as profile:
            model.generate(source, attention_mask=source.ne(PAD).long(), num_beams=beams, max_new_tokens=steps,
                           min_new_tokens=steps, early_stopping=False, do_sample=False, **settings)
    finally:
        del model.forward
    count = 0
    for event in profile.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        if parent is not None and parent.name == "depth_adaptive_forward":
            count += 1
    return count / steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="Interleaved repetitions (median reported).")
    parser.add_argument("--steps", type=int, default=30, help="Decoded tokens per hypothesis.")
    parser.add_argument("--source_length", type=int, default=30)
    parser.add_argument("--sentences_batch1", type=int, default=4, help="Sentences decoded one at a time.")
    parser.add_argument("--batches_batch32", type=int, default=1, help="Batches of 32 sentences.")
    parser.add_argument("--exit_fraction", type=float, default=0.7)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", default=None, help="Write the results as JSON here.")
    parser.add_argument("--count_ops", action="store_true",
                        help="Instead of timing, count the ATen operators per decoding step of each case.")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    model, baseline = (m.to(device) for m in build_models(dtype))
    generator = torch.Generator().manual_seed(1)
    sources = torch.randint(4, VOCAB, (32 * args.batches_batch32, args.source_length), generator=generator)
    sources[:, -1] = 2
    sources = sources.to(device)
    thresholds = calibrate(model, sources[:32], args.exit_fraction)
    geometric_thresholds = [0.5] * (model.num_exits - 1)
    counter = ExitCounter(model.model.decoder)
    cases = [
        ("backbone", baseline, {}),
        ("full", model, {"exit_strategy": "full"}),
        ("fixed 2", model, {"exit_strategy": "fixed", "fixed_exit": 2}),
        ("fixed 2, eager copies", model, {"exit_strategy": "fixed", "fixed_exit": 2, "defer_copied_states": False}),
        ("geometric", model, {"exit_strategy": "halting", "exit_thresholds": geometric_thresholds}),
        ("confidence", model, {"exit_strategy": "confidence", "exit_thresholds": thresholds}),
    ]
    results = []
    if args.count_ops:
        print("| batch | beam | " + " | ".join(name for name, _, _ in cases) + " |")
        print("|---|---|" + "---|" * len(cases))
        for batch_size, beams in ((1, 1), (1, 5), (32, 1), (32, 5)):
            counts = {name: count_forward_ops(m, sources[:batch_size], beams, args.steps, settings)
                      for name, m, settings in cases}
            results.append({"batch": batch_size, "beams": beams, "ops_per_step": counts})
            print(f"| {batch_size} | {beams} | " + " | ".join(f"{c:.0f}" for c in counts.values()) + " |", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
        return results
    for batch_size, beams in ((1, 1), (1, 5), (32, 1), (32, 5)):
        if batch_size == 1:
            batches = [sources[i : i + 1] for i in range(args.sentences_batch1)]
        else:
            batches = [sources[i * 32 : (i + 1) * 32] for i in range(args.batches_batch32)]
        for name, case_model, settings in cases:  # warm-up
            run_case(case_model, batches[:1], beams, 4, settings, None)
        samples = {name: [] for name, _, _ in cases}
        for _ in range(args.repeats):
            for name, case_model, settings in cases:
                samples[name].append(
                    run_case(case_model, batches, beams, args.steps, settings, counter if case_model is model else None)
                )
        full_seconds = statistics.median(s[0] for s in samples["full"])
        full_blocks = statistics.median(s[0] - s[3] for s in samples["full"])
        rows = []
        for name, _, _ in cases:
            decoder_seconds = statistics.median(s[0] for s in samples[name])
            blocks_seconds = statistics.median(s[0] - s[3] for s in samples[name])
            rows.append({
                "batch": batch_size, "beams": beams, "strategy": name,
                "average_exit": round(statistics.mean(s[2] for s in samples[name]), 2),
                "decoder_seconds": round(decoder_seconds, 4),
                "generate_seconds": round(statistics.median(s[1] for s in samples[name]), 4),
                "decoder_ratio_vs_full": round(decoder_seconds / full_seconds, 3),
                "without_classifier_seconds": round(blocks_seconds, 4),
                "without_classifier_ratio_vs_full": round(blocks_seconds / full_blocks, 3),
            })
        results.extend(rows)
        print(json.dumps(rows), flush=True)
    print(f"\n{args.dtype}, {describe_device(device, args.threads)}, {args.steps} steps per hypothesis, source length "
          f"{args.source_length}, median of {args.repeats} interleaved repetitions")
    print("| batch | beam | strategy | AE | decoder s | × full depth | w/o output classifier: × full depth | generate s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in results:
        print(f"| {row['batch']} | {row['beams']} | {row['strategy']} | {row['average_exit']:.2f} | "
              f"{row['decoder_seconds']:.3f} | {row['decoder_ratio_vs_full']:.2f} | "
              f"{row['without_classifier_ratio_vs_full']:.2f} | {row['generate_seconds']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "device": describe_device(device, args.threads),
                                              "results": results}, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
