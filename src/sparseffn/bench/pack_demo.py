"""Pack a realistic synthetic MLP activation into TwELL and Hybrid, and check the sparse MLP is exact.

What `sparseffn demo` runs until the training pipeline exists: it shows the sizes of the packed
forms against the dense activation, the rows that overflow into the dense backup, and verifies that
the MLP computed from the packed activation equals the dense MLP (fp32 reference) under the
flash-attention rule: error ≤ 2 × (dense torch's own error in the same dtype) + a rounding floor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.format import Hybrid, TwELL
from sparseffn.format._common import bitwise_equal, canonical_zeros
from sparseffn.ops.reference import mlp_activation_reference, sparse_mlp_reference, twell_up_down_reference
from sparseffn.ops.sparse_mlp import sparse_mlp


@dataclass(frozen=True)
class PackDemoConfig:
    tokens: int = 1024
    d_model: int = 512
    hidden: int = 2048
    mean_nnz: float = 29.0
    tile: int = 256
    slots: int = 32
    width: int = 128
    dtype: str = "bfloat16"
    seed: int = 0


@dataclass(frozen=True)
class PackDemoResult:
    lines: list[str]
    ok: bool


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def run_pack_demo(cfg: PackDemoConfig) -> PackDemoResult:
    dtype = getattr(torch, cfg.dtype)
    mlp = synthetic_mlp(cfg.tokens, cfg.d_model, cfg.hidden, cfg.mean_nnz, dtype=dtype, seed=cfg.seed)
    p, _ = mlp_activation_reference(mlp.x, mlp.gate_weight, mlp.up_weight)
    p = p.to(dtype)  # the gate activation as the kernels hold it
    twell = TwELL.from_dense(p, tile=cfg.tile, slots=cfg.slots)
    twell.validate()
    hybrid = Hybrid.from_dense(p, width=cfg.width)
    hybrid.validate()
    nnz = twell.nnz_per_row().double()
    dense_bytes = p.numel() * p.element_size()
    sparse_part = twell.values.nbytes + twell.columns.nbytes + twell.counts.nbytes
    backup = twell.overflow_rows.nbytes + twell.overflow_values.nbytes

    y_ref32 = sparse_mlp_reference(mlp.x.float(), mlp.gate_weight.float(), mlp.up_weight.float(),
                                   mlp.down_weight.float())
    y_twell = twell_up_down_reference(mlp.x, twell, mlp.up_weight, mlp.down_weight)
    y_dense = sparse_mlp(mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    err_twell, err_dense = _rel_err(y_twell, y_ref32), _rel_err(y_dense, y_ref32)
    floor = torch.finfo(dtype).eps / 2  # one rounding of the output in the activation dtype
    exact_twell = bitwise_equal(twell.to_dense(), canonical_zeros(p))
    exact_hybrid = bitwise_equal(hybrid.to_dense(), canonical_zeros(p))
    ok = exact_twell and exact_hybrid and err_twell <= 2 * err_dense + floor and bool(y_ref32.isfinite().all())

    m, h = p.shape
    lines = [
        f"synthetic gated MLP: M={m} tokens, D={cfg.d_model}, H={h}, {cfg.dtype}, target mean nnz {cfg.mean_nnz:g}",
        f"  non-zeros per token: mean {nnz.mean():.1f}, max {nnz.max():.0f} "
        f"({100 * (1 - nnz.mean() / h):.2f}% zeros); heavy tokens: {mlp.heavy_rows.numel()}",
        f"TwELL tile={cfg.tile} slots={cfg.slots}:",
        f"  dense activation      {dense_bytes / 1e6:9.3f} MB",
        f"  slots+counts          {sparse_part / 1e6:9.3f} MB ({100 * sparse_part / dense_bytes:.1f}% of dense)",
        f"  dense backup          {backup / 1e6:9.3f} MB for {twell.overflow_rows.numel()} overflow rows "
        f"({100 * twell.overflow_rows.numel() / max(m, 1):.2f}% of rows)",
        f"  round trip bit-exact  {exact_twell}",
        f"Hybrid width={cfg.width}: {hybrid.nbytes / 1e6:.3f} MB, {hybrid.tail_rows.numel()} dense tail rows, "
        f"round trip bit-exact {exact_hybrid}",
        "MLP output vs fp32 reference (relative error):",
        f"  sparse, from TwELL           {err_twell:.2e}",
        f"  dense torch, {cfg.dtype:<15} {err_dense:.2e}",
        f"  bound: 2 x dense + ulp/2     {2 * err_dense + floor:.2e}",
        "OK: the sparse MLP equals the dense one" if ok else "FAILED: sparse and dense MLP disagree",
    ]
    return PackDemoResult(lines, bool(ok))
