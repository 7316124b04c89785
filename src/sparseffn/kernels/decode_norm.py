"""A decode step's last RMSNorm (the model's final norm before lm_head), with the last folded MLP's sum added.

    _decode_norm_kernel, grid (M,): program m reads row m of x whole (BLOCK_D >= D) and writes
        out[m] = weight * (x[m] * rstd rounded to x's dtype), rounded once (Hugging Face's RMSNorm, as every
        decode kernel's fused norm); with PENDING, x[m] stands for round(x[m] + round(pending[m])) (the fp32
        sum a folded sparse MLP left unadded, kernels/decode_mlp.py's FOLD) and the program zeroes
        pending[m] after reading it, as the o_proj launch does for the layers before.
Layouts: x [M, D] bf16 / fp16 (fp32 exactly) with unit stride along D; weight [D] in x's dtype; pending
fp32 [M, D] with unit stride along D; out [M, D] contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import next_power_of_2
from sparseffn.kernels.decode_attn_proj import _rstd
from sparseffn.kernels.decode_mlp import _normed, _x_tile
from sparseffn.kernels.launch import Launcher


def num_warps(d: int) -> int:
    """Warps a program of width d runs: ~8 columns a thread, at most 16 warps."""
    return min(16, max(1, next_power_of_2(d) // 256))


@triton.jit
def _decode_norm_kernel(x_ptr, pending_ptr, norm_ptr, out_ptr, D, stride_xm, stride_pm, stride_om, eps,
                        BLOCK_D: tl.constexpr, PENDING: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_in = cols < D
    p_row = pending_ptr + row * stride_pm if PENDING else None
    xv = _x_tile(x_ptr + row * stride_xm, p_row, cols, col_in, PENDING)
    xf = xv.to(tl.float32)
    rstd = _rstd(tl.sum(xf * xf, axis=0), D, eps)
    tl.store(out_ptr + row * stride_om + cols, _normed(xv, norm_ptr, cols, col_in, rstd), mask=col_in)
    if PENDING:
        tl.store(p_row + cols, tl.zeros((BLOCK_D,), tl.float32), mask=col_in)


_launch = Launcher(_decode_norm_kernel)


def launch_decode_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pending: torch.Tensor | None) -> torch.Tensor:
    """out [M, D] on arguments that meet ops.decode_block.decode_norm's contract, unchecked."""
    m, d = x.shape
    out = torch.empty((m, d), dtype=x.dtype, device=x.device)
    if m == 0 or d == 0:
        return out
    has_pending = pending is not None
    _launch[(m,)](x, pending if has_pending else x, weight, out, d, x.stride(0),
                  pending.stride(0) if has_pending else 0, out.stride(0), eps, BLOCK_D=next_power_of_2(d),
                  PENDING=has_pending, num_warps=num_warps(d))
    return out
