"""Sparse MLP inference through TwELL: gate GEMM packing TwELL -> fused up/down -> dense backup.

    p  = relu(x first^T - θ)              kernels/gate_twell.py: tensor-core GEMM, packs TwELL in its epilogue
    y  = down(p ⊙ (x up^T))  (or down(p))  kernels/twell_up_down.py: only the active units, fp32
    y[overflow rows] = dense MLP           kernels/dense_rows_mlp.py: rows with a tile over capacity, exact

`first` is the gate weight (gated) or the up weight (non-gated). The interleaved up/down weight the
fused kernel reads is built once by `SparseMLPWeights.prepare` and reused across calls.

Nothing here synchronises with the host: the overflow rows are found and compacted on the device and
the dense backup kernel loops over however many there are (usually none), so the whole call can be
captured in a CUDA graph and the CPU never waits for the GPU. The one exception: on a GPU with
D % 8 != 0 (or unaligned weight rows) the backup kernel is disabled and the overflow rows go
through torch GEMMs after one host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparseffn.kernels.dense_rows_mlp import cuda_supported, launch_dense_rows
from sparseffn.kernels.gate_twell import gate_twell
from sparseffn.kernels.row_split import new_row_list
from sparseffn.kernels.twell_up_down import default_config, launch_up_down, prepare_up_down_weight

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, eq=False)
class SparseMLPWeights:
    """One MLP's weights in Hugging Face layouts plus the interleaved [H, 2|1, D] up/down copy."""

    gate_weight: torch.Tensor | None
    up_weight: torch.Tensor
    down_weight: torch.Tensor
    up_down: torch.Tensor

    @classmethod
    def prepare(
        cls, gate_weight: torch.Tensor | None, up_weight: torch.Tensor, down_weight: torch.Tensor
    ) -> "SparseMLPWeights":
        """Build the fused kernel's weight layout (one copy of up and down; do it once per module)."""
        up_down = prepare_up_down_weight(up_weight if gate_weight is not None else None, down_weight)
        return cls(gate_weight, up_weight, down_weight, up_down)

    @property
    def first_weight(self) -> torch.Tensor:
        return self.gate_weight if self.gate_weight is not None else self.up_weight

    def matches(self, gate_weight: torch.Tensor | None, up_weight: torch.Tensor, down_weight: torch.Tensor) -> bool:
        """Whether these prepared weights were built from exactly these tensors."""
        return self.gate_weight is gate_weight and self.up_weight is up_weight and self.down_weight is down_weight


def threshold_vector(threshold: torch.Tensor | float | None, h: int, device: torch.device) -> torch.Tensor | None:
    """The per-unit fp32 [H] threshold the gate kernel reads (None stays None)."""
    if threshold is None:
        return None
    if isinstance(threshold, torch.Tensor):
        return threshold.to(device=device, dtype=torch.float32).expand(h).contiguous()
    return torch.full((h,), float(threshold), dtype=torch.float32, device=device)


def dense_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    threshold: torch.Tensor | float | None,
    *,
    return_l1: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The MLP with three torch GEMMs in x's dtype (the eager path and the dense backup).

    Differentiable through torch autograd. With return_l1, also the layer's L1 penalty (docs/design.md):
    the mean over tokens of Σ_j |h_j|, summed in fp32 (fp64 for fp64 inputs) from h in x's dtype.
    """
    first = F.linear(x, gate_weight if gate_weight is not None else up_weight)
    if threshold is not None:
        first = first - (threshold.to(first.dtype) if isinstance(threshold, torch.Tensor) else threshold)
    h = torch.relu(first)
    if gate_weight is not None:
        h = h * F.linear(x, up_weight)
    y = F.linear(h, down_weight)
    if not return_l1:
        return y
    sum_dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    return y, h.abs().sum(-1, dtype=sum_dtype).mean()


def dense_mlp_inference(
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    threshold: torch.Tensor | float | None,
) -> torch.Tensor:
    """`dense_mlp` for calls that build no autograd graph: the same GEMMs and roundings, with the
    threshold, the relu and the product applied in place to the first GEMM's output. Two fewer
    allocations: auto mode's dense route at few tokens is bound by host launch work."""
    h = F.linear(x, gate_weight if gate_weight is not None else up_weight)
    if threshold is not None:
        h.sub_(threshold.to(h.dtype) if isinstance(threshold, torch.Tensor) else threshold)
    h.relu_()
    if gate_weight is not None:
        h.mul_(F.linear(x, up_weight))
    return F.linear(h, down_weight)


def _check_up_down(weights: SparseMLPWeights, h: int, d: int, x: torch.Tensor) -> None:
    """The interleaved weight of `SparseMLPWeights` (built by `prepare`, or by hand) and the first
    weight's unit count: what the up/down and dense-rows launches rely on without checking."""
    if weights.first_weight.shape[0] != h:
        raise ValueError(f"weights.gate_weight must have up_weight's {h} units, got "
                         f"{list(weights.first_weight.shape)}")
    up_down = weights.up_down
    shape = (h, 1 if weights.gate_weight is None else 2, d)
    if not isinstance(up_down, torch.Tensor):
        raise TypeError(f"weights.up_down must be a torch.Tensor, got {type(up_down).__name__}")
    if up_down.shape != shape or up_down.dtype != x.dtype or up_down.device != x.device:
        raise ValueError(f"weights.up_down must be a {x.dtype} tensor of shape {list(shape)} on {x.device} "
                         f"(SparseMLPWeights.prepare builds it), got {up_down.dtype} {list(up_down.shape)} "
                         f"on {up_down.device}")
    if not up_down.is_contiguous():
        raise ValueError("weights.up_down must be contiguous (SparseMLPWeights.prepare builds it)")


def twell_mlp(
    x: torch.Tensor,
    weights: SparseMLPWeights,
    threshold: torch.Tensor | float | None = None,
    *,
    tile: int = 256,
    slots: int = 32,
    deterministic: bool = False,
) -> torch.Tensor:
    """Sparse MLP of x [M, D] (bf16/fp16, on the kernels' device) -> y [M, D], exact for every input.
    deterministic: the same bits on every run for any number of long rows (kernels/row_split.py)."""
    h = weights.up_weight.shape[0]
    theta = threshold_vector(threshold, h, x.device)
    # gate_twell checks x, the first weight, θ, tile and slots; the launches after it take what it
    # returned and what is allocated here, so only the interleaved weight is left to check
    values, columns, counts = gate_twell(x, weights.first_weight, theta, tile=tile, slots=slots)
    m, d = x.shape
    _check_up_down(weights, h, d, x)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    y = torch.empty(m, d, dtype=x.dtype, device=x.device)
    overflow = new_row_list(m, x.device)  # the overflow rows, listed by the up/down launch's classification
    launch_up_down(x, values, columns, counts, weights.up_down, tile=tile, out=y, overflow_out=None,
                   overflow_list=overflow, config=default_config(d, m), deterministic=deterministic)
    if weights.gate_weight is not None:  # up_down [H, 2, D] holds up and down^T
        up, down_t = weights.up_down[:, 0], weights.up_down[:, 1]
    else:  # up_down [H, 1, D] holds down^T
        up, down_t = weights.up_weight, weights.up_down[:, 0]
    if not x.is_cuda or cuda_supported(d, weights.first_weight, up, down_t):
        return launch_dense_rows(x, None, weights.gate_weight, up, down_t, theta, y, row_list=overflow)
    # D % 8 != 0 or unaligned weights on a GPU: the backup kernel refuses them; torch GEMMs on the
    # gathered rows instead, at the price of one host synchronisation (not graph-capturable).
    ids, count = overflow
    rows = ids[: int(count.item())].long()
    if rows.numel():
        y[rows] = dense_mlp(x[rows], weights.gate_weight, weights.up_weight, weights.down_weight, threshold)
    return y
