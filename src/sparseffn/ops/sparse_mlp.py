"""`sparse_mlp`: the public functional entry of the sparse MLP.

Semantics are those of `ops.reference.sparse_mlp_reference`, computed in the input dtype. Until the
Triton kernels are dispatched here, every device runs the eager path below (three matmuls); the
kernels will slot in behind this same signature without changing results beyond rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparseffn.ops.checks import check_mlp_inputs


def sparse_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    threshold: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """y = down(relu(x gate^T - θ) * (x up^T)), or down(relu(x up^T - θ)) when gate_weight is None.

    x [..., D]; gate_weight, up_weight [H, D]; down_weight [D, H] (Hugging Face layouts);
    threshold None, a number, or a per-unit tensor [H]. Returns [..., D] in x's dtype.
    """
    check_mlp_inputs(x, gate_weight, up_weight, down_weight, threshold)
    first = F.linear(x, gate_weight if gate_weight is not None else up_weight)
    if threshold is not None:
        first = first - (threshold.to(first.dtype) if isinstance(threshold, torch.Tensor) else threshold)
    h = torch.relu(first)
    if gate_weight is not None:
        h = h * F.linear(x, up_weight)
    return F.linear(h, down_weight)
