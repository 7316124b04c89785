"""Sparse MLP inference through TwELL: gate GEMM packing TwELL -> fused up/down -> dense backup.

    p  = relu(x first^T - θ)              kernels/gate_twell.py: tensor-core GEMM, packs TwELL in its epilogue
    y  = down(p ⊙ (x up^T))  (or down(p))  kernels/twell_up_down.py: only the active units, fp32
    y[overflow rows] = dense MLP           kernels/dense_rows_mlp.py: rows with a tile over capacity, exact

`first` is the gate weight (gated) or the up weight (non-gated). The fused kernel reads the up rows
and the rows of down^T [H, D]; `SparseMLPWeights.prepare` gets the latter as a view when the down
weight is stored transposed (as `SparseMLP` stores it) and as one copy otherwise.

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

from sparseffn.kernels.convert import convert
from sparseffn.kernels.dense_rows_mlp import cuda_supported, launch_dense_rows
from sparseffn.kernels.gate_twell import gate_twell
from sparseffn.kernels.row_split import new_row_list
from sparseffn.kernels.twell_up_down import default_config, launch_up_down



@dataclass(frozen=True, eq=False)
class SparseMLPWeights:
    """One MLP's weights as the kernels read them: gate / up [H, D] and down [D, H] in Hugging Face
    layouts, plus down_t [H, D] = down_weight^T with unit stride along D (row j = unit j's down column)."""

    gate_weight: torch.Tensor | None
    up_weight: torch.Tensor
    down_weight: torch.Tensor
    down_t: torch.Tensor

    @classmethod
    def prepare(
        cls, gate_weight: torch.Tensor | None, up_weight: torch.Tensor, down_weight: torch.Tensor
    ) -> "SparseMLPWeights":
        """down_t is a view of down_weight when its storage is already transposed (`SparseMLP` keeps
        it so: no copy), else one transposed copy (build it once and reuse it).

        The four tensors are marked as static addresses for torch.compile: a compiled caller's CUDA
        graphs (mode="reduce-overhead") read them in place. Unmarked, every tensor that is not a
        module's parameter or buffer is copied into the graph's own input buffer before each replay
        (down_t, a plain tensor: 23 MB per layer and step at 2048 x 5632)."""
        weights = cls(gate_weight, up_weight, down_weight, transposed_down(down_weight))
        import torch._dynamo  # heavy to import: only here

        for t in (gate_weight, up_weight, down_weight, weights.down_t):
            if t is not None:  # unguarded: a moved tensor re-records the graph, no recompile
                torch._dynamo.mark_static_address(t, guard=False)
        return weights

    @property
    def first_weight(self) -> torch.Tensor:
        return self.gate_weight if self.gate_weight is not None else self.up_weight

    def matches(self, gate_weight: torch.Tensor | None, up_weight: torch.Tensor, down_weight: torch.Tensor) -> bool:
        """Whether these prepared weights were built from exactly these tensors."""
        return self.gate_weight is gate_weight and self.up_weight is up_weight and self.down_weight is down_weight


def stored_transposed(down_weight: torch.Tensor) -> bool:
    """Whether down_weight [D, H] is stored transposed (as SparseMLP stores it): its .t() has unit stride
    along D."""
    return down_weight.shape[0] <= 1 or down_weight.stride(0) == 1


def transposed_down(down_weight: torch.Tensor) -> torch.Tensor:
    """down_weight^T [H, D] with unit stride along D: a view of a transposed storage, else one copy."""
    if stored_transposed(down_weight):
        return down_weight.t()
    return convert(down_weight, down_weight.dtype, transpose=True)


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
    the mean over tokens of Σ_j |h_j|, summed in fp32 (fp64 for fp64 inputs) from h in x's dtype;
    0 over no tokens.
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
    per_token = h.abs().sum(-1, dtype=sum_dtype)
    return y, per_token.mean() if per_token.numel() else per_token.sum()


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


def _check_unit_rows(weights: SparseMLPWeights, h: int, d: int, x: torch.Tensor) -> None:
    """The up and transposed down weights of `SparseMLPWeights` (built by `prepare`, or by hand) and the
    first weight's unit count: what the up/down and dense-rows launches rely on without checking."""
    if weights.first_weight.shape[0] != h:
        raise ValueError(f"weights.gate_weight must have up_weight's {h} units, got "
                         f"{list(weights.first_weight.shape)}")
    down_t = weights.down_t
    if not isinstance(down_t, torch.Tensor):
        raise TypeError(f"weights.down_t must be a torch.Tensor, got {type(down_t).__name__}")
    if tuple(down_t.shape) != (h, d) or down_t.dtype != x.dtype or down_t.device != x.device:
        raise ValueError(f"weights.down_t must be a {x.dtype} tensor of shape {[h, d]} on {x.device} "
                         f"(SparseMLPWeights.prepare builds it), got {down_t.dtype} {list(down_t.shape)} "
                         f"on {down_t.device}")
    for name, w in (("weights.up_weight", weights.up_weight), ("weights.down_t", down_t)):
        if d > 1 and w.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along D (SparseMLPWeights.prepare builds down_t so), "
                             f"got strides {list(w.stride())}")


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
    # returned and what is allocated here, so only the up and down^T rows are left to check
    values, columns, counts = gate_twell(x, weights.first_weight, theta, tile=tile, slots=slots)
    m, d = x.shape
    _check_unit_rows(weights, h, d, x)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    y = torch.empty(m, d, dtype=x.dtype, device=x.device)
    overflow = new_row_list(m, x.device)  # the overflow rows, listed by the up/down launch's classification
    gated = weights.gate_weight is not None
    up, down_t = weights.up_weight, weights.down_t
    launch_up_down(x, values, columns, counts, up if gated else None, down_t, tile=tile, out=y, overflow_out=None,
                   overflow_list=overflow, config=default_config(d, m), deterministic=deterministic)
    if not x.is_cuda or cuda_supported(d, weights.first_weight, up, down_t):
        return launch_dense_rows(x, None, weights.gate_weight, up, down_t, theta, y, row_list=overflow)
    # D % 8 != 0 or unaligned weights on a GPU: the backup kernel refuses them; torch GEMMs on the
    # gathered rows instead, at the price of one host synchronisation (not graph-capturable).
    ids, count = overflow
    rows = ids[: int(count.item())].long()
    if rows.numel():
        y[rows] = dense_mlp(x[rows], weights.gate_weight, weights.up_weight, weights.down_weight, threshold)
    return y
