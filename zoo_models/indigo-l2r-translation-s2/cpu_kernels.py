"""CPU speed kernels of the backbone: fast dropout masks and oneDNN-prepacked inference products.

None of these changes what the model computes (same arithmetic up to summation order); each makes a CPU hot path
cheaper. Off the CPU, with gradients, under autocast or inside `torch.compile`, every function here falls back to
the plain PyTorch operation it replaces.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

_KEEP_MASK_RESOLUTION = 1 << 15


def scaled_keep_mask(like: torch.Tensor, keep: float) -> torch.Tensor:
    """Inverted-dropout multiplier shaped like `like`: 1/keep with probability `keep`, else 0 (CPU).

    Each 32-bit draw of the CPU generator gives two independent 15-bit uniforms (the two halves of a non-negative
    int32), so a mask costs half the draws of `torch.rand` (32×30×512: 1.9 → 1.1 ms; `bernoulli_` 6.3 ms) — dropout
    runs 30+ times per training step of a 6+6 model. The keep probability is `keep` rounded to a multiple of 2⁻¹⁵
    (|error| ≤ 1.6e-5; `torch.rand`'s float32 is 2⁻²⁴) and the kept values are scaled by exactly 1/keep, as
    `F.dropout` does.
    """
    count = like.numel()
    halves = torch.empty((count + 1) // 2, dtype=torch.int32, device=like.device).random_().view(torch.int16)
    if count % 2:
        halves = halves[:count]
    threshold = round(keep * _KEEP_MASK_RESOLUTION)
    keep_mask = halves.bitwise_and_(_KEEP_MASK_RESOLUTION - 1).lt_(threshold)
    return keep_mask.view(like.shape).to(like.dtype).div_(keep)


def dropout(hidden_states: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout, `F.dropout`'s semantics (zero with probability p, scale the rest by 1/(1−p)).

    On CPU the mask comes from `scaled_keep_mask` (half the generator draws of `torch.rand`, ~3× faster than
    `bernoulli_`); elsewhere, and inside `torch.compile`, `F.dropout` is used as is: the compiler does not trace
    `random_` into an int32 buffer viewed as int16 (one graph break per dropout), and it fuses `F.dropout`'s mask
    into the neighbouring elementwise operations itself.
    """
    if not training or p == 0.0:
        return hidden_states
    if hidden_states.device.type != "cpu" or p >= 1.0 or torch.compiler.is_compiling():
        return F.dropout(hidden_states, p=p, training=True)
    return hidden_states * scaled_keep_mask(hidden_states, 1.0 - p)


# Packed copies of linear weights for inference, keyed by the owning module (outside the module, so state dicts,
# deepcopy and pickling never see them) and rebuilt whenever the weight changes (new storage or in-place update).
_PACKED_WEIGHTS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()

# Copies made from weights are keyed by (storage, version counter); fused optimizers (`AdamW(fused=True)`, the
# Trainer's default `adamw_torch_fused`) write parameters in place without bumping the version counter, so the key
# also holds the number of optimizer steps taken in this process — else a generation inside a training run (the
# Trainer's evaluations) would use the weights of the first evaluation.
_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def weights_version(tensor: torch.Tensor) -> tuple:
    """What changes whenever ``tensor``'s values may have: its storage, its version counter and the optimizer steps
    taken in this process (the key of every copy made from weights)."""
    return tensor.data_ptr(), tensor._version, _optimizer_steps, tensor.shape


def _prepacking_possible() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


PREPACK_INFERENCE_WEIGHTS: bool = _prepacking_possible()


_LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default if PREPACK_INFERENCE_WEIGHTS else None


_FLOAT32 = torch.float32


def _prepacking_pays(rows: int, weight: torch.Tensor) -> bool:
    """Where the packed oneDNN product beat `F.linear` (2 AVX2 cores, time ratio packed/plain, medians of
    interleaved runs): vocabulary-sized outputs up to a few hundred rows (d 512, V 10152: 0.32 at 1 row, 0.48–0.58
    at 32, 0.83 at 128, 0.91 at 256, 0.99–1.05 at 960); d ≥ 512 weights at a decoding step's few rows (512×512,
    512×1024, 1024×512: 0.43–0.73 at 4 rows, 0.61–0.93 at 32, 0.81–0.99 at 48, 0.87–1.03 at 64, 1.1–1.3 at 960,
    but up to 1.43 at a single row); small d = 256 weights never (1.1–1.4)."""
    out_features, in_features = weight.shape
    if out_features >= 4096:
        return rows <= 512
    return 2 <= rows <= 48 and out_features * in_features >= 512 * 512


def _packed_rows(inputs: torch.Tensor, weight: torch.Tensor, biases: Sequence[torch.Tensor | None]) -> int:
    """The rows of `inputs` if their product with `weight` should take the packed oneDNN path, else 0: no gradients
    needed, CPU, fp32, not autocast, a weight with a version counter (to notice in-place updates by) and a shape
    where packing pays (`_prepacking_pays`). Runs ~50 times per decoding step, so the checks are ordered to leave
    early and cost ~2 µs in all."""
    if not PREPACK_INFERENCE_WEIGHTS or torch.compiler.is_compiling() or (  # compiled: the compiler lays weights out
        torch.is_grad_enabled()
        and (
            inputs.requires_grad
            or weight.requires_grad
            or any(bias is not None and bias.requires_grad for bias in biases)
        )
    ):
        return 0
    if (
        not inputs.is_cpu
        or inputs.dtype is not _FLOAT32  # dtypes are singletons
        or weight.dtype is not _FLOAT32
        or weight.is_inference()
        or torch.is_autocast_enabled("cpu")
    ):
        return 0
    rows = inputs.numel() // inputs.shape[-1] if inputs.shape[-1] else 0
    return rows if rows and _prepacking_pays(rows, weight) else 0


def linear(owner: nn.Module, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, except without gradients on CPU in fp32: then through oneDNN with the weight packed once (per
    weight version) into its blocked layout — what `torch.compile`'s CPU freezing does for inference — where that
    pays (`_prepacking_pays`). Decoding multiplies a few rows by the same weights at every step, and an unpacked
    GEMM re-packs the weight each call: measured on 2 AVX2 cores, [32, 512]×[512, 512] 0.18 → 0.14 ms,
    [32, 1024]×[1024, 512] 0.35 → 0.27 ms, the [32, 512]×[512, 10152] vocabulary projection 6.0 → 2.9 ms. Same
    arithmetic up to summation order (≈1e-6 relative). Set `flexformers.modeling.cpu_kernels.PREPACK_INFERENCE_WEIGHTS = False`
    to turn it off."""
    rows = _packed_rows(inputs, weight, (bias,))
    if rows:
        key = weights_version(weight)
        entry = _PACKED_WEIGHTS.get(owner)
        if entry is None or entry[0] != key:
            entry = (key, _pack(weight.detach(), rows))
            _PACKED_WEIGHTS[owner] = entry
        if entry[1] is not None:
            return _LINEAR_POINTWISE(inputs, entry[1], bias, "none", [], "")
    return F.linear(inputs, weight, bias)


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    except RuntimeError:  # a layout or build oneDNN does not take: plain products for this weight version
        return None


def fused_linears(owner: nn.Module, inputs: torch.Tensor, projections: Sequence[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """`tuple(p(inputs) for p in projections)`; where :func:`linear` would pack (a decoding step's few rows), the
    projections' weights are packed side by side and run as one product, then split — a wider product keeps both
    cores busier than three narrow ones: self-attention's q, k, v at [32, 512]×[512, 3·512] 0.45 ms against
    3 × 0.165 ms (greedy generation −2%). The packed copy, keyed by `owner`, follows every weight's and bias's
    version. Only projections :func:`packable` are fused; any other module (PEFT's LoRA layer, a dynamically
    quantized linear, accelerate's offload hooks) runs its own forward."""
    if not all(packable(projection) for projection in projections):  # checked first: others may lack `.weight`
        return tuple(project(projection, inputs) for projection in projections)
    biases = [projection.bias for projection in projections]
    rows = _packed_rows(inputs, projections[0].weight, biases)
    if rows and (all(bias is None for bias in biases) or all(bias is not None for bias in biases)):
        tensors = [projection.weight for projection in projections] + [bias for bias in biases if bias is not None]
        key = tuple(weights_version(tensor) for tensor in tensors)
        entry = _PACKED_WEIGHTS.get(owner)
        if entry is None or entry[0] != key:
            with torch.no_grad():
                weight = torch.cat([projection.weight for projection in projections])
                bias = torch.cat(biases) if biases[0] is not None else None
            entry = (key, _pack(weight, rows), bias)
            _PACKED_WEIGHTS[owner] = entry
        if entry[1] is not None:
            fused = _LINEAR_POINTWISE(inputs, entry[1], entry[2], "none", [], "")
            return fused.split([projection.out_features for projection in projections], dim=-1)
    return tuple(project(projection, inputs) for projection in projections)


def packable(module: nn.Module) -> bool:
    """Whether a projection may take the packed products of this module: a plain `nn.Linear` (exact type) without
    hooks or a per-module `forward`. Every other module runs its own forward — a dynamically quantized linear
    (`torch.ao.quantization.quantize_dynamic` swaps exactly-typed `nn.Linear`s, so the projections are plain ones),
    PEFT's LoRA layer, accelerate's offload hook (it replaces `forward` per module)."""
    return (
        type(module) is nn.Linear
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and "forward" not in module.__dict__
    )


def project(module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """`module(inputs)` for a projection; a :func:`packable` one goes through :func:`linear` (the packed oneDNN
    product where that pays). Every projection of the backbone is called through here, so the projections stay plain
    `nn.Linear`s that quantizers and adapters recognise, and the speed lever lives at the call sites."""
    if packable(module):
        return linear(module, inputs, module.weight, module.bias)
    return module(inputs)


#: Up to this many rows, the vocabulary projection takes `(W · hᵀ)ᵀ` where packing is unavailable.
TRANSPOSED_PRODUCT_MAX_ROWS = 64


def project_vocabulary(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The output layer d → V (`lm_head`, and Depth-Adaptive's exit classifiers) applied to `hidden_states`.

    A :func:`packable` projection without gradients on CPU goes through the prepacked oneDNN path of :func:`linear`
    (d 512, V 10152, 32 rows: 6.0 → 2.9 ms). Where that is unavailable, a few rows take `(W · hᵀ)ᵀ`: CPU BLAS runs
    the product with the long vocabulary axis first faster there (32 rows 5.6 → 4.0 ms, transpose back to contiguous
    included); from ~128 rows on, and whenever gradients flow, `F.linear` is as fast or faster. Any other module
    (quantized, adapted, hooked) runs its own forward.
    """
    if not packable(module):
        return module(hidden_states)
    rows = hidden_states.numel() // module.in_features
    if (
        PREPACK_INFERENCE_WEIGHTS
        or rows > TRANSPOSED_PRODUCT_MAX_ROWS
        or hidden_states.device.type != "cpu"
        or (torch.is_grad_enabled() and (hidden_states.requires_grad or module.weight.requires_grad))
    ):
        return linear(module, hidden_states, module.weight, module.bias)
    logits = (module.weight @ hidden_states.reshape(rows, module.in_features).t()).t().contiguous()
    if module.bias is not None:
        logits = logits + module.bias
    return logits.view(*hidden_states.shape[:-1], module.out_features)
