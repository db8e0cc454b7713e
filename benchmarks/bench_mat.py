"""MAT speed: MAT 2/256/2048 (24.7M) against the baseline 1/512/1024 (36.7M), and fused branches against a
naive per-branch loop.

    flock -x /tmp/flexformers-cpu.lock python benchmarks/bench_mat.py --threads 2 --output /work/runs/mat/bench.json

Setting (as the peer numbers in NOTES.md): transformer_iwslt_de_en depth/heads, joint vocabulary of 10152 tokens,
batch 32 × 30 source tokens, 30 target tokens. Measured per model and precision:

Repetitions are interleaved (one call of each model per round) and the median is reported.

- training step: forward + backward + Adam step in train mode (dropout, drop-branch ρ = 0.2), target tokens/s;
- greedy and beam-5 generation of exactly 30 new tokens (``min_new_tokens = max_new_tokens``, so models with
  different random weights decode the same number of steps), sentences/s.

fp32 rows run the fp32 model; bf16 rows train under ``torch.autocast`` and generate with the model cast to bf16
(autocast during decoding re-casts the weights at every step, see NOTES.md).

The naive reference ("loop") is MAT with every attention replaced by :class:`PerBranchLoopAttention`: N_a
independent one-branch backbone attentions run one after another (as the official code's list of
``MultiheadAttention`` modules) and averaged. It exists only here, as the reference for the fused layout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers.cache_utils import DynamicLayer  # noqa: E402

import flexformers.modeling  # noqa: E402,F401
from flexformers.configuration.configuration_flexformer import FlexformerConfig  # noqa: E402
from flexformers.configuration.configuration_mat import MATConfig  # noqa: E402
from flexformers.modeling.modeling_flexformer import FlexformerAttention, FlexformerForConditionalGeneration  # noqa: E402
from flexformers.modeling.transformers_compat import generation_cache  # noqa: E402
from flexformers.modeling.modeling_mat import (  # noqa: E402
    MATAttention,
    MATForConditionalGeneration,
    drop_branch_keep_scales,
    multi_branch_merge_weights,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import autocast, describe_device, interleaved  # noqa: E402

VOCAB = 10152


class PerBranchLoopAttention(nn.Module):
    """The naive multi-branch attention: one independent single-branch attention module per branch, run in a
    Python loop and merged with the same drop-branch weights (Eq. 4-6). Branch b of decoder layer l caches under
    layer index ``l + b * num_layers`` so every branch keeps its own keys/values."""

    def __init__(self, fused: MATAttention, layer_stride: int):
        super().__init__()
        self.num_branches = fused.num_branches
        self.drop_branch_rate = fused.drop_branch_rate
        self.branch_merge = fused.branch_merge
        self.branches = nn.ModuleList()
        d = fused.embed_dim
        for branch in range(fused.num_branches):
            layer_idx = None if fused.layer_idx is None else fused.layer_idx + branch * layer_stride
            single = FlexformerAttention(
                fused.config, d, fused.num_heads, kdim=fused.kdim, num_branches=1,
                is_cross_attention=fused.is_cross_attention, is_causal=fused.is_causal, layer_idx=layer_idx,
            )
            with torch.no_grad():
                for name in ("q_proj", "k_proj", "v_proj"):
                    getattr(single, name).weight.copy_(getattr(fused, name).weight[branch * d : (branch + 1) * d])
                    getattr(single, name).bias.copy_(getattr(fused, name).bias[branch * d : (branch + 1) * d])
                single.out_proj.weight.copy_(fused.out_proj.branch_weight(branch))
                single.out_proj.bias.copy_(fused.out_proj.bias[branch : branch + 1])
            self.branches.append(single)

    def forward(self, hidden_states, **kwargs):
        keep = drop_branch_keep_scales(
            self.num_branches, self.drop_branch_rate, training=self.training, device=hidden_states.device, dtype=hidden_states.dtype
        )
        weights = multi_branch_merge_weights(keep, self.branch_merge)
        output = None
        for branch, module in enumerate(self.branches):
            contribution = weights[branch] * module(hidden_states, **kwargs)[0]
            output = contribution if output is None else output + contribution
        return output, None


def to_per_branch_loop(model: MATForConditionalGeneration) -> MATForConditionalGeneration:
    stride = model.config.decoder_layers
    for layer in model.model.encoder.layers:
        layer.self_attn = PerBranchLoopAttention(layer.self_attn, stride)
    for layer in model.model.decoder.layers:
        layer.self_attn = PerBranchLoopAttention(layer.self_attn, stride)
        layer.encoder_attn = PerBranchLoopAttention(layer.encoder_attn, stride)
    # generate() builds the backbone's cache (SourceGroupedCache for beams) with one layer per decoder layer;
    # give it a layer per branch and decoder layer, so the loop keeps every other optimisation of the fused model
    total_layers = stride * model.config.decoder_attention_branches
    prepare_cache = model._prepare_cache_for_generation

    def prepare_cache_with_branch_layers(generation_config, model_kwargs, *args, **kwargs):
        prepare_cache(generation_config, model_kwargs, *args, **kwargs)
        cache = generation_cache(model_kwargs)
        for sub_cache in (cache.self_attention_cache, cache.cross_attention_cache):
            while len(sub_cache.layers) < total_layers:
                sub_cache.layers.append(DynamicLayer())

    model._prepare_cache_for_generation = prepare_cache_with_branch_layers
    return model


def build_models(drop_branch_rate: float) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    baseline = FlexformerForConditionalGeneration(FlexformerConfig.from_preset("transformer_iwslt_de_en", vocab_size=VOCAB))
    mat_config = MATConfig.from_preset("mat_iwslt_de_en", vocab_size=VOCAB, drop_branch_rate=drop_branch_rate)
    mat = MATForConditionalGeneration(mat_config)
    loop = MATForConditionalGeneration(mat_config)
    loop.load_state_dict(mat.state_dict())
    return {"baseline 1/512/1024": baseline, "MAT 2/256/2048 fused": mat, "MAT 2/256/2048 loop": to_per_branch_loop(loop)}


def make_batch(batch_size: int, source_length: int, target_length: int):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, VOCAB, (batch_size, source_length), generator=generator)
    input_ids[:, -1] = 2
    labels = torch.randint(5, VOCAB, (batch_size, target_length), generator=generator)
    labels[:, -1] = 2
    return input_ids, torch.ones_like(input_ids), labels


def training_step(model, batch, precision: str):
    input_ids, attention_mask, labels = batch
    model.float().train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98))

    def step():
        with autocast(input_ids.device, precision == "bf16"):
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def generation_call(model, batch, num_beams: int, new_tokens: int, cache_implementation: str | None = None):
    input_ids, attention_mask, _ = batch
    cache = {"cache_implementation": cache_implementation} if cache_implementation else {}

    def generate():
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids, attention_mask=attention_mask, num_beams=num_beams, do_sample=False,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, **cache,
            )

    return generate


def measure(
    models: dict, batch, precision: str, train_steps: int, repeats: int, new_tokens: int, static_cache: bool = False
) -> list[dict]:
    """Training step (target tokens/s), greedy and beam-5 generation (sentences/s) of every model; with
    `static_cache`, also greedy with a static cache (compiled by `generate()` on a GPU) for the fused models."""
    input_ids, _, labels = batch
    train = interleaved(
        {name: training_step(model, batch, precision) for name, model in models.items()}, warmup=2, repeats=train_steps
    )
    for model in models.values():
        model.eval().to(torch.bfloat16 if precision == "bf16" else torch.float32)
    greedy = interleaved(
        {name: generation_call(model, batch, 1, new_tokens) for name, model in models.items()}, warmup=1, repeats=repeats
    )
    beam = interleaved(
        {name: generation_call(model, batch, 5, new_tokens) for name, model in models.items()}, warmup=1, repeats=repeats
    )
    greedy_static = {}
    if static_cache:
        greedy_static = interleaved(
            {
                name: generation_call(model, batch, 1, new_tokens, "static")
                for name, model in models.items()
                if "loop" not in name  # the naive reference is not what anyone would compile
            },
            warmup=2, repeats=repeats,
        )
    for model in models.values():
        model.float()
    return [
        {
            "model": name,
            "precision": precision,
            "train_target_tokens_per_s": labels.numel() / train[name],
            "greedy_sentences_per_s": input_ids.shape[0] / greedy[name],
            "beam5_sentences_per_s": input_ids.shape[0] / beam[name],
        }
        | ({"greedy_static_sentences_per_s": input_ids.shape[0] / greedy_static[name]} if name in greedy_static else {})
        for name in models
    ]


def check_loop_matches_fused(models, batch) -> tuple[float, bool]:
    """Max |Δlogit| of a forward pass, and whether beam-5 search (8 tokens, 4 sentences) gives the same output."""
    fused, loop = models["MAT 2/256/2048 fused"].eval(), models["MAT 2/256/2048 loop"].eval()
    input_ids, attention_mask, labels = batch
    with torch.no_grad():
        a = fused(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits
        b = loop(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits
        generate = dict(input_ids=input_ids[:4], attention_mask=attention_mask[:4], num_beams=5, max_new_tokens=8)
        same_beams = torch.equal(fused.generate(**generate), loop.generate(**generate))
    return (a - b).abs().max().item(), same_beams


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--source_length", type=int, default=30)
    parser.add_argument("--target_length", type=int, default=30)
    parser.add_argument("--train_steps", type=int, default=8, help="timed training steps per model (median)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generate() calls per model (median)")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--drop_branch_rate", type=float, default=0.2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (timed calls end synchronised)")
    parser.add_argument("--static-cache", action="store_true",
                        help="also greedy with a static cache (generate() compiles the decoding step on a GPU)")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    models = {name: model.to(device) for name, model in build_models(args.drop_branch_rate).items()}
    batch = tuple(t.to(device) for t in make_batch(args.batch_size, args.source_length, args.target_length))
    max_difference, same_beams = check_loop_matches_fused(models, batch)
    results = {
        "setting": {
            "threads": args.threads, "batch_size": args.batch_size, "source_length": args.source_length,
            "target_length": args.target_length, "vocab_size": VOCAB, "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "drop_branch_rate": args.drop_branch_rate,
            "device": describe_device(device, args.threads),
        },
        "parameters": {name: model.num_parameters() for name, model in models.items()},
        "loop_vs_fused_max_abs_logit_difference": max_difference,
        "loop_vs_fused_same_beam5_output": same_beams,
        "rows": [],
    }
    print(f"parameters: {results['parameters']}; loop vs fused max |Δlogit| = {max_difference:.2e}, same beam-5 output: {same_beams}", flush=True)
    for precision in args.precisions:
        for row in measure(
            models, batch, precision, args.train_steps, args.repeats, args.target_length, args.static_cache
        ):
            results["rows"].append(row)
            print(json.dumps(row), flush=True)

    print("\n| precision | model | train tgt tok/s | greedy sent/s | beam-5 sent/s |\n|---|---|---|---|---|")
    for row in results["rows"]:
        print(
            f"| {row['precision']} | {row['model']} | {row['train_target_tokens_per_s']:.0f} | "
            f"{row['greedy_sentences_per_s']:.1f} | {row['beam5_sentences_per_s']:.1f} |"
        )
    print("\nTime ratios (lower is faster; goal MAT/baseline <= 0.9):")
    for precision in args.precisions:
        rows = {row["model"]: row for row in results["rows"] if row["precision"] == precision}
        base, fused, loop = rows["baseline 1/512/1024"], rows["MAT 2/256/2048 fused"], rows["MAT 2/256/2048 loop"]
        ratios = {}
        for key in ("train_target_tokens_per_s", "greedy_sentences_per_s", "beam5_sentences_per_s"):
            ratios[key] = {"mat_over_baseline": base[key] / fused[key], "fused_over_loop": loop[key] / fused[key]}
            print(f"  {precision} {key}: MAT/baseline time {ratios[key]['mat_over_baseline']:.2f}, fused/loop time {ratios[key]['fused_over_loop']:.2f}")
        if "greedy_static_sentences_per_s" in fused:
            key = "greedy_static_sentences_per_s"
            ratios[key] = {"mat_over_baseline": base[key] / fused[key]}
            print(f"  {precision} {key}: MAT/baseline time {ratios[key]['mat_over_baseline']:.2f}")
        results.setdefault("time_ratios", {})[precision] = ratios
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
