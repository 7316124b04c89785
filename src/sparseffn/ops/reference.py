"""Eager fp32 truth for every sparse MLP op. Kernels and fast paths are tested against these.

MLP in Hugging Face layouts (gate/up [H, D], down [D, H]):

    gated:      y = down( relu(x gate^T - θ) * (x up^T) )
    non-gated:  y = down( relu(x up^T - θ) )            (gate_weight=None)

L1 penalty of one layer (docs/design.md): mean over tokens of the per-token sum of |h| over the H units.
"""

from __future__ import annotations

import torch

from sparseffn.format import TwELL
from sparseffn.ops.checks import check_mlp_inputs, check_tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def mlp_activation_reference(
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    threshold: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, h) in fp32, both [..., H]: p = relu(first projection - θ), h = p * (x up^T) or h = p."""
    ct = _compute_dtype(x.dtype)
    xf = x.to(ct)
    first = xf @ (gate_weight if gate_weight is not None else up_weight).to(ct).t()
    if threshold is not None:
        first = first - (threshold.to(ct) if isinstance(threshold, torch.Tensor) else threshold)
    p = torch.relu(first)
    h = p * (xf @ up_weight.to(ct).t()) if gate_weight is not None else p
    return p, h


def sparse_mlp_reference(
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    threshold: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """The MLP computed in fp32 (fp64 for fp64 inputs), returned in x's dtype."""
    check_mlp_inputs(x, gate_weight, up_weight, down_weight, threshold)
    _, h = mlp_activation_reference(x, gate_weight, up_weight, threshold)
    return (h @ down_weight.to(h.dtype).t()).to(x.dtype)


def l1_penalty(h: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of sum_j |h_j| for h [..., H]; an fp32 scalar (fp64 for fp64 input).

    Differentiable; 0 over zero tokens (a batch without tokens adds no penalty).
    """
    check_tensor(h, "h")
    if h.dim() < 1:
        raise ValueError("h must have shape [..., H], got a 0-D tensor")
    per_token = h.to(_compute_dtype(h.dtype)).abs().sum(-1)
    return per_token.mean() if per_token.numel() else per_token.sum()


def twell_up_down_reference(
    x: torch.Tensor,
    packed: TwELL,
    up_weight: torch.Tensor | None,
    down_weight: torch.Tensor,
) -> torch.Tensor:
    """Second half of the MLP from a TwELL-packed first activation, the way the kernels do it.

    For each ordinary row and each valid slot (unit j, value p_j): u_j = x·up[j], h_j = p_j u_j
    (or h_j = p_j when up_weight is None), y += h_j · down[:, j]. Overflow rows take the dense
    path on `packed.overflow_values`. fp32 throughout; returns [M, D] in x's dtype.
    """
    if not isinstance(packed, TwELL):
        raise TypeError(f"packed must be a TwELL, got {type(packed).__name__}")
    check_tensor(x, "x", dims=2)
    if packed.shape[0] != x.shape[0]:
        raise ValueError(f"packed has {packed.shape[0]} rows but x has {x.shape[0]}")
    ct = _compute_dtype(x.dtype)
    xf, down_t = x.to(ct), down_weight.to(ct).t()  # down_t [H, D]: row j = down[:, j]
    y = torch.zeros(x.shape[0], x.shape[1], dtype=ct, device=x.device)
    ordinary = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    ordinary[packed.overflow_rows] = False
    row, t, k = (packed.valid_slots() & ordinary[:, None, None]).nonzero(as_tuple=True)
    unit = t * packed.tile + packed.columns[row, t, k].long()
    h = packed.values[row, t, k].to(ct)
    if up_weight is not None:
        h = h * (xf[row] * up_weight.to(ct)[unit]).sum(-1)
    y.index_add_(0, row, h[:, None] * down_t[unit])
    rows = packed.overflow_rows
    h_dense = packed.overflow_values.to(ct)
    if up_weight is not None:
        h_dense = h_dense * (xf[rows] @ up_weight.to(ct).t())
    y[rows] = h_dense @ down_t
    return y.to(x.dtype)
