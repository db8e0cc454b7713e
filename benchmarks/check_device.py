"""Every model type computes the same on an accelerator as on the CPU (run before timing on a new device).

For the baseline, IOT, MAT, InDIGO and Depth-Adaptive models at their paper sizes (vocabulary 10152, random
weights), the same weights on the CPU and on ``--device``: the training loss and the gradients (relative error
‖Δ‖/‖ref‖), greedy and beam-4 generation (identical tokens), and each method's own machinery — IOT with its
sentences spread over all decoder orders, InDIGO's SAO order search (identical orders), Depth-Adaptive with fixed,
geometric-like and confidence exits (identical tokens and exits). fp32 without TF32, so only rounding differs;
prints one line per check and exits 1 if any fails.

    python benchmarks/check_device.py --device cuda
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexformers.configuration import (  # noqa: E402
    DepthAdaptiveConfig,
    FlexformerConfig,
    InDIGOConfig,
    IOTConfig,
    MATConfig,
)
from flexformers.configuration.configuration_iot import PAPER_DECODER_ORDERS  # noqa: E402
from flexformers.modeling import (  # noqa: E402
    DepthAdaptiveForConditionalGeneration,
    FlexformerForConditionalGeneration,
    InDIGOForConditionalGeneration,
    IOTForConditionalGeneration,
    MATForConditionalGeneration,
)
import flexformers.modeling.iot_equations as iot_equations  # noqa: E402
from flexformers.training_scripts.indigo_orders import InDIGODataCollator  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_iot import force_even_order_mix  # noqa: E402

VOCAB, BATCH, LENGTH, NEW_TOKENS = 10152, 4, 12, 10
FAILURES: list[str] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double().cpu()
    return float((value.double().cpu() - reference).norm() / reference.norm().clamp_min(1e-30))


def batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(5, VOCAB, (BATCH, LENGTH), generator=generator)
    source[:, -1] = 2
    source[0, -3:] = torch.tensor([2, 1, 1])  # one padded sentence
    target = torch.randint(5, VOCAB, (BATCH, LENGTH), generator=generator)
    target[:, -1] = 2
    return source, target


def on_both(model, device):
    return model.eval(), copy.deepcopy(model).to(device).eval()


def check_training(name, cpu_model, device_model, inputs: dict, device):
    """Loss and gradients in train mode with dropout off (the configs here use dropout 0)."""
    losses, grads = [], []
    for model, target_device in ((cpu_model, "cpu"), (device_model, device)):
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        loss = model(**{k: v.to(target_device) for k, v in inputs.items()}).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten().cpu() for p in model.parameters() if p.grad is not None]))
        model.eval()
    loss_error, grad_error = relative_error(losses[1], losses[0]), relative_error(grads[1], grads[0])
    report(f"{name}: training loss and gradients", loss_error < 1e-4 and grad_error < 1e-3,
           f"(loss rel. err {loss_error:.1e}, grad rel. err {grad_error:.1e})")


def check_generation(name, cpu_model, device_model, source, device, **settings):
    outputs = []
    for model, target_device in ((cpu_model, "cpu"), (device_model, device)):
        ids = source.to(target_device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=ids.ne(1).long(), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, **settings)
        outputs.append(torch.cat([out.sequences, out.exits], 1) if hasattr(out, "exits") else
                       out.sequences if hasattr(out, "sequences") else out)
    same = torch.equal(outputs[0].cpu(), outputs[1].cpu())
    report(f"{name}: generate {settings}", same, "" if same else f"\n{outputs[0]}\n{outputs[1].cpu()}")
    return outputs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    source, target = batch()
    common = dict(vocab_size=VOCAB, dropout=0.0, label_smoothing=0.1)

    torch.manual_seed(0)
    models = {
        "baseline": FlexformerForConditionalGeneration(FlexformerConfig.from_preset("transformer_iwslt_de_en", **common)),
        "mat": MATForConditionalGeneration(MATConfig.from_preset("mat_iwslt_de_en", drop_branch_rate=0.0, **common)),
        "iot": IOTForConditionalGeneration(IOTConfig.from_preset(
            "transformer_iwslt_de_en", decoder_orders=PAPER_DECODER_ORDERS[4], **common)),
    }
    # IOT's training draws Gumbel noise (Eq. 1, IOT) with the device's generator; draw it on the CPU for both runs
    # so that the two compute the same function.
    sample_gumbel = iot_equations.sample_gumbel
    iot_equations.sample_gumbel = lambda shape, device, generator=None: sample_gumbel(shape, "cpu", generator).to(device)
    for name, model in models.items():
        cpu_model, device_model = on_both(model, device)
        check_training(name, cpu_model, device_model, {"input_ids": source, "labels": target}, device)
        for beams in (1, 4):
            check_generation(name, cpu_model, device_model, source, device, num_beams=beams)
        if name == "iot":
            for model in (cpu_model, device_model):
                force_even_order_mix(model, 4)
            for beams in (1, 4):
                check_generation("iot (sentence i takes order i mod 4)", cpu_model, device_model, source, device,
                                 num_beams=beams)

    torch.manual_seed(0)
    indigo = InDIGOForConditionalGeneration(InDIGOConfig.from_preset("transformer_iwslt_de_en", **common))
    cpu_model, device_model = on_both(indigo, device)
    features = [{"input_ids": s.tolist(), "labels": t.tolist()} for s, t in zip(source, target)]
    l2r = InDIGODataCollator(order="l2r", pad_to_multiple_of=None)(features)
    check_training("indigo l2r", cpu_model, device_model, l2r, device)
    for beams in (1, 4):
        check_generation("indigo", cpu_model, device_model, source, device, num_beams=beams)
    sao = InDIGODataCollator(order="sao", pad_to_multiple_of=None)(features)
    orders = []
    for model, target_device in ((cpu_model, "cpu"), (device_model, device)):
        moved = {k: v.to(target_device) for k, v in sao.items()}
        with torch.no_grad():
            encoder = model.model.encoder(moved["input_ids"], attention_mask=moved["attention_mask"]).last_hidden_state
            found, scores = model.search_adaptive_orders(encoder, moved["attention_mask"], moved["target_ids"],
                                                         moved["target_lengths"], beam_size=8)
        orders.append((found.cpu(), scores.cpu()))
    finite = orders[0][1].isfinite()
    score_error = relative_error(orders[1][1][finite], orders[0][1][finite])
    report("indigo: SAO search (B=8) orders", torch.equal(orders[0][0], orders[1][0]) and score_error < 1e-4,
           f"(score rel. err {score_error:.1e})")

    torch.manual_seed(0)
    depth_adaptive = DepthAdaptiveForConditionalGeneration(DepthAdaptiveConfig.from_preset(
        "depth_adaptive_iwslt_de_en", halting_mechanism="token_geometric", **common))
    cpu_model, device_model = on_both(depth_adaptive, device)
    check_training("depth_adaptive", cpu_model, device_model, {"input_ids": source, "labels": target}, device)
    for beams in (1, 4):
        for settings in ({"exit_strategy": "full"}, {"exit_strategy": "fixed", "fixed_exit": 2},
                         {"exit_strategy": "halting", "exit_thresholds": [0.5] * 5},
                         {"exit_strategy": "confidence", "exit_thresholds": [2e-4] * 5}):
            outputs = check_generation("depth_adaptive", cpu_model, device_model, source, device, num_beams=beams,
                                       return_exits=True, return_dict_in_generate=True, **settings)
            del outputs

    print(f"\n{len(FAILURES)} failed" + (f": {FAILURES}" if FAILURES else ""))
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
