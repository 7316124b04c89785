"""Realistic synthetic MLP activations for benchmarks and demos (docs/benchmarks.md, "Protocol").

Random x and weights, with the sparsity pattern of a trained ReLU + L1 model:

- input feature 0 is a constant 1 ("bias feature"); the first projection's weight on it is
  -t_j, so unit j fires when the rest of its pre-activation exceeds its threshold t_j;
- thresholds are jittered per unit (t_j = b + jitter * z_j), so some units fire far more than others;
- a small fraction of "heavy" tokens carry a smaller bias feature κ < 1, which lowers every
  threshold for them: they have ~`heavy_ratio` times the mean non-zeros (the heavy tail that makes
  fixed-capacity formats overflow);
- the base threshold b is found by bisection so the mean non-zeros per token hits `target_nnz`.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class SyntheticMLP:
    """Inputs and weights of one MLP call (HF layouts), plus how they were made."""

    x: torch.Tensor  # [M, D]
    gate_weight: torch.Tensor | None  # [H, D], None for a non-gated MLP
    up_weight: torch.Tensor  # [H, D]
    down_weight: torch.Tensor  # [D, H]
    heavy_rows: torch.Tensor  # int64 ids of the heavy tokens
    target_nnz: float
    calibrated_nnz: float  # mean non-zeros per token reached in fp32 by the bisection

    @property
    def first_weight(self) -> torch.Tensor:
        """The projection whose ReLU is sparse: gate when gated, up otherwise."""
        return self.gate_weight if self.gate_weight is not None else self.up_weight


def _heavy_bias(target_fraction: float, heavy_ratio: float) -> float:
    """κ such that a heavy token's thresholds κ·t fire ~heavy_ratio times more often (normal approx)."""
    if target_fraction >= 0.5:
        return 1.0
    base = float(torch.special.ndtri(torch.tensor(1.0 - target_fraction, dtype=torch.float64)))
    heavy = float(torch.special.ndtri(torch.tensor(1.0 - min(heavy_ratio * target_fraction, 0.5), dtype=torch.float64)))
    return max(heavy / base, 0.0)


def synthetic_mlp(
    m: int,
    d: int,
    h: int,
    target_nnz: float,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
    gated: bool = True,
    jitter: float = 0.25,
    heavy_fraction: float = 0.005,
    heavy_ratio: float = 12.0,
) -> SyntheticMLP:
    """Random MLP inputs whose ReLU activation has `target_nnz` mean non-zeros per token."""
    for name, value in (("m", m), ("d", d), ("h", h)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if d < 2:
        raise ValueError(f"d must be >= 2 (feature 0 carries the thresholds), got {d}")
    if not 0 < target_nnz <= h:
        raise ValueError(f"target_nnz must lie in (0, h={h}], got {target_nnz}")
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    x = randn(m, d)
    first = randn(h, d) / math.sqrt(d - 1)  # pre-activation minus threshold has unit variance
    z = randn(h)
    heavy_rows = torch.randperm(m, generator=gen, device=device)[: round(heavy_fraction * m)].sort().values
    bias = torch.ones(m, device=device)
    bias[heavy_rows] = _heavy_bias(target_nnz / h, heavy_ratio)
    x[:, 0] = bias
    rest = x[:, 1:] @ first[:, 1:].t()  # [M, H] fp32

    def mean_nnz(base: float) -> float:
        return float((rest > bias[:, None] * (base + jitter * z)).sum()) / m

    lo, hi = -10.0, 10.0  # mean_nnz decreases in base
    for _ in range(48):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mean_nnz(mid) > target_nnz else (lo, mid)
    base = 0.5 * (lo + hi)
    first[:, 0] = -(base + jitter * z)

    second = randn(h, d) / math.sqrt(d)
    down = randn(d, h) / math.sqrt(max(target_nnz, 1.0))
    cast = lambda t: t.to(dtype).contiguous()  # noqa: E731
    return SyntheticMLP(
        x=cast(x),
        gate_weight=cast(first) if gated else None,
        up_weight=cast(second) if gated else cast(first),
        down_weight=cast(down),
        heavy_rows=heavy_rows,
        target_nnz=float(target_nnz),
        calibrated_nnz=mean_nnz(base),
    )


def with_down_layout(mlp: SyntheticMLP, layout: str) -> SyntheticMLP:
    """`mlp` with its down weight stored as `layout` says: "transposed" (down_weight.t() contiguous, as
    `SparseMLP` stores it: the sparse kernels read it without a copy) or "hf" (contiguous [D, H])."""
    if layout not in ("transposed", "hf"):
        raise ValueError(f"down layout must be 'transposed' or 'hf', got {layout!r}")
    down = mlp.down_weight.t().contiguous().t() if layout == "transposed" else mlp.down_weight.contiguous()
    return dataclasses.replace(mlp, down_weight=down)
