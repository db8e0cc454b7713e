"""Parallel branches merged by a weighted sum in one product (the seam MAT extends: Eq. 4 and 6 of Fan et al.)."""

from __future__ import annotations

import torch
from torch import nn

from .cpu_kernels import linear


class BranchMergeLinear(nn.Module):
    """Output projection of `num_branches` parallel branches merged by a weighted sum, in one GEMM.

    `weight` is `[out, B * in]` (branch b owns columns `b*in:(b+1)*in`), `bias` is `[B, out]` (one bias per
    branch). `forward(x[..., B, in], branch_weights)` returns `Σ_b w_b (x_b W_bᵀ + bias_b)`; `branch_weights=None`
    means the plain average `w_b = 1/B`, which for B = 1 is exactly `nn.Linear`.
    """

    def __init__(self, num_branches: int, in_features: int, out_features: int):
        super().__init__()
        self.num_branches = num_branches
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, num_branches * in_features))
        self.bias = nn.Parameter(torch.empty(num_branches, out_features))

    def branch_weight(self, branch: int) -> torch.Tensor:
        """The `[out, in]` weight of one branch (a view, for proximal initialisation)."""
        return self.weight[:, branch * self.in_features : (branch + 1) * self.in_features]

    def forward(self, hidden_states: torch.Tensor, branch_weights: torch.Tensor | None = None) -> torch.Tensor:
        if branch_weights is None and self.num_branches == 1:
            return linear(self, hidden_states.flatten(-2), self.weight, self.bias[0])
        leading = hidden_states.shape[:-2]
        if branch_weights is None:
            branch_weights = hidden_states.new_full((self.num_branches,), 1.0 / self.num_branches)
        if branch_weights.dim() == 1:  # one weight per branch, shared by the batch
            scaled = hidden_states * branch_weights.view(self.num_branches, 1)
            bias = branch_weights @ self.bias
        else:  # [batch, B]: one weight per row and branch
            expand = (branch_weights.shape[0],) + (1,) * (hidden_states.dim() - 3) + (self.num_branches, 1)
            scaled = hidden_states * branch_weights.view(expand)
            bias = (branch_weights @ self.bias).view(branch_weights.shape[0], *([1] * (hidden_states.dim() - 3)), -1)
        return linear(self, scaled.reshape(*leading, self.num_branches * self.in_features), self.weight, None) + bias


def init_branched_linear(weight: torch.Tensor, num_branches: int, branch_dim: int, dim: int, gain: float):
    """xavier-uniform for each branch's block separately (fan-in/out of one branch, as fairseq initialises each
    of MAT's independent attentions)."""
    for branch in range(num_branches):
        block = weight.narrow(dim, branch * branch_dim, branch_dim)
        nn.init.xavier_uniform_(block, gain=gain)
