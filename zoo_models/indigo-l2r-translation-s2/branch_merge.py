"""Parallel branches merged by a weighted sum in one product (the seam MAT extends: Eq. 4 and 6 of Fan et al.).

The merging projection is a plain `nn.Linear` (exact type), so `torch.ao.quantization.quantize_dynamic` swaps it
and PEFT adapts it under its usual name (`out_proj`, `fc2`, `dense`): `nn.Linear(in, out)` for one branch (every
model but MAT's multi-branch layers), `nn.Linear(B * in, out, bias=False)` for B > 1 (branch b owns columns
`b*in:(b+1)*in`), with the per-branch biases `[B, out]` a parameter of the merging module, `<name>_branch_bias`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import skip_init

from .cpu_kernels import project


def merge_projection(num_branches: int, in_features: int, out_features: int) -> tuple[nn.Linear, nn.Parameter | None]:
    """The output projection of `num_branches` parallel branches and its per-branch biases (None for one branch,
    whose bias is the projection's own)."""
    # Allocated without nn.Linear's own random draws (the model's `_init_weights` sets the values): a seeded model
    # draws the same numbers as before the merge became an `nn.Linear`. skip_init allocates on the CPU unless told,
    # so the default device is passed on: a model built under `with torch.device(...)` (meta while Transformers
    # loads, a GPU) keeps all its weights there.
    device = torch.get_default_device()
    if num_branches == 1:
        return skip_init(nn.Linear, in_features, out_features, device=device), None
    projection = skip_init(nn.Linear, num_branches * in_features, out_features, bias=False, device=device)
    projection.num_branches = num_branches  # for the initialisation: each branch's block on its own
    return projection, nn.Parameter(torch.empty(num_branches, out_features))


def merge_branches(
    projection: nn.Module,
    branch_biases: torch.Tensor | None,
    hidden_states: torch.Tensor,
    branch_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """`Σ_b w_b (x_b W_bᵀ + bias_b)` of the branch outputs `hidden_states [..., B, in]`, in one product: the
    weighted average of Eq. 4 and 6 (Eq. 8 for FFN branches) of Fan et al. when `w_b = keep_b / B`.

    `branch_weights` is `[B]` (shared by the batch) or `[batch, B]` (one weight per row); None means the plain
    average `w_b = 1/B`, which for B = 1 is exactly the projection (`nn.Linear`). `projection` is built by
    :func:`merge_projection` (any module with its forward: quantized or adapted, it runs its own); `branch_biases`
    are its per-branch biases (None for one branch).
    """
    num_branches = hidden_states.shape[-2]
    if branch_biases is None:  # one branch: w (x W + b)
        merged = project(projection, hidden_states.flatten(-2))
        if branch_weights is None:
            return merged
        if branch_weights.dim() == 1:
            return merged * branch_weights
        return merged * branch_weights.view(branch_weights.shape[0], *([1] * (merged.dim() - 1)))
    leading = hidden_states.shape[:-2]
    if branch_weights is None:
        branch_weights = hidden_states.new_full((num_branches,), 1.0 / num_branches)
    if branch_weights.dim() == 1:  # one weight per branch, shared by the batch
        scaled = hidden_states * branch_weights.view(num_branches, 1)
        bias = branch_weights @ branch_biases
    else:  # [batch, B]: one weight per row and branch
        expand = (branch_weights.shape[0],) + (1,) * (hidden_states.dim() - 3) + (num_branches, 1)
        scaled = hidden_states * branch_weights.view(expand)
        bias = (branch_weights @ branch_biases).view(branch_weights.shape[0], *([1] * (hidden_states.dim() - 3)), -1)
    return project(projection, scaled.reshape(*leading, -1)) + bias


def init_branched_linear(weight: torch.Tensor, num_branches: int, branch_dim: int, dim: int, gain: float):
    """xavier-uniform for each branch's block separately (fan-in/out of one branch, as fairseq initialises each
    of MAT's independent attentions)."""
    for branch in range(num_branches):
        block = weight.narrow(dim, branch * branch_dim, branch_dim)
        nn.init.xavier_uniform_(block, gain=gain)


# ---- checkpoints of the earlier layout -------------------------------------------------------------------------------
# Up to flexformers 0.1.0 the merge was one module whose bias was `[B, out]` for every B: `<name>.bias` of shape
# `[1, out]` (every single-branch projection) or `[B, out]` (MAT's multi-branch layers, now `<name>_branch_bias`).

#: The names of the merging projections (attention `out_proj`, feed-forward `fc2`, the MAT classifier's `dense`).
MERGE_PROJECTION_NAMES = ("out_proj", "fc2", "dense")


def upgrade_merge_bias_keys(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, bool]]:
    """Of a checkpoint's `{key: shape}`, the keys in the earlier merge layout: `{old key: (new key, squeeze)}` —
    a `[1, out]` bias stays under its key as `[out]`, a `[B, out]` one moves to `<name>_branch_bias`."""
    upgrades = {}
    for key, shape in shapes.items():
        module_path, _, leaf = key.rpartition(".")
        if leaf != "bias" or len(shape) != 2 or module_path.rpartition(".")[2] not in MERGE_PROJECTION_NAMES:
            continue
        upgrades[key] = (key, True) if shape[0] == 1 else (module_path + "_branch_bias", False)
    return upgrades


def upgrade_merge_biases(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` with the earlier layout's merge biases in the current one (a new dict; other tensors as they
    are)."""
    upgrades = upgrade_merge_bias_keys({key: tuple(tensor.shape) for key, tensor in state_dict.items()})
    if not upgrades:
        return state_dict
    upgraded = {}
    for key, tensor in state_dict.items():
        new_key, squeeze = upgrades.get(key, (key, False))
        upgraded[new_key] = tensor[0] if squeeze else tensor
    return upgraded


def upgrade_merge_bias_on_load(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """`load_state_dict` pre-hook of a merging module: a state dict of the earlier layout (Trainer's resume,
    `load_state_dict` of an old file) loads into the current one."""
    for name in MERGE_PROJECTION_NAMES:
        key = f"{prefix}{name}.bias"
        tensor = state_dict.get(key)
        if tensor is None or tensor.dim() != 2:
            continue
        if tensor.shape[0] == 1:
            state_dict[key] = tensor[0]
        else:
            state_dict[f"{prefix}{name}_branch_bias"] = state_dict.pop(key)


def old_layout_checkpoint_keys(folder: str) -> dict[str, tuple[str, bool]]:
    """The upgrades (:func:`upgrade_merge_bias_keys`) a local checkpoint folder's safetensors weights need; empty
    for a current checkpoint, a folder without safetensors files or anything that is not a local folder. Reads
    only the files' headers."""
    import glob
    import os

    from transformers.modeling_utils import safe_open  # safetensors, through the one import remote code may use

    if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
        return {}
    shapes = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as weights:
            for key in weights.keys():
                if key.endswith(".bias"):
                    shapes[key] = tuple(weights.get_slice(key).get_shape())
    return upgrade_merge_bias_keys(shapes)


def checkpoint_in_current_layout(folder: str, workspace: str) -> str:
    """A folder holding `folder`'s checkpoint with its weights in the current layout: `folder` itself when they are,
    else `workspace`, filled with links to `folder`'s files and upgraded copies of its weight files (the user's
    folder is never written)."""
    import glob
    import json
    import os

    from transformers.modeling_utils import safe_open, safe_save_file

    if not old_layout_checkpoint_keys(folder):
        return folder
    folder = os.path.abspath(folder)
    for name in os.listdir(folder):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            os.symlink(os.path.join(folder, name), os.path.join(workspace, name))
    weight_map = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as weights:
            upgraded = upgrade_merge_biases({key: weights.get_tensor(key) for key in weights.keys()})
        safe_save_file({k: v.contiguous() for k, v in upgraded.items()}, os.path.join(workspace, os.path.basename(path)),
                  metadata={"format": "pt"})
        weight_map.update({key: os.path.basename(path) for key in upgraded})
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            contents = json.load(handle)
        contents["weight_map"] = weight_map
        with open(os.path.join(workspace, "model.safetensors.index.json"), "w", encoding="utf-8") as handle:
            json.dump(contents, handle)
    return workspace
