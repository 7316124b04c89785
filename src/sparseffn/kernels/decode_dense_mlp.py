"""Dense MLP for few tokens with the residual stream fused in, for a down weight in Hugging Face's
[D, H] layout: y = x + down(act(norm(x) gate^T) ⊙ (norm(x) up^T)), two launches.

    K1 decode_mlp._decode_gate_up_kernel (dense: ACT relu / silu, NORM), h [M, H] in x's dtype,
       rounded as torch rounds the dense MLP (act(g) and u in x's dtype, then their product)
    K2 _dense_down_kernel, grid (cdiv(D, BLOCK_D),): program c owns output columns [c·BLOCK_D, +BLOCK_D),
       each one row of down [D, H], y[:, cols] = x[:, cols] + round(h · down[cols]^T) (fp32 products over
       all of H, rounded once, then the residual added and rounded again, as torch's `x + mlp(x)`)

Why. At one token a dense MLP is three reads of [H, D] matrices, each a cuBLAS GEMV launch plus the
norm, activation, product and residual launches around them: here two launches read the same bytes.
K2 is decode_mlp's K1 product (`_rows_dot`: CUDA-core products below 16 tokens, tl.dot from 16),
with the output columns as its units; it reuses K1's config (block_h columns, block_k steps; 16
columns from 16 tokens on).
A down weight stored transposed ([H, D] contiguous, SparseMLP's) goes to decode_mlp's K2 instead,
which then sums every unit (K1 flags them all).
Layouts. x [M, D], 1 <= M <= 64, unit stride along D; gate/up [H, D] and down [D, H] unit stride
along their last dim; norm weight [D]; threshold fp32 [H] or None (relu only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import capability, cdiv, interpreting
from sparseffn.kernels.configs.decode_mlp import default_config
from sparseffn.kernels.decode_mlp import _plus_residual, _rows_dot, fitted, launch_gate_up, m_pad
from sparseffn.kernels.launch import Launcher

__all__ = ["launch_dense_mlp_rows_down"]


@triton.jit(do_not_specialize=["M"])
def _dense_down_kernel(
    h_ptr,  # [M, H] x's dtype
    down_ptr,  # [D, H]
    res_ptr,  # [M, D] added to y (RESIDUAL), else None
    y_ptr,  # [M, D] out
    M,
    D,
    H,
    stride_hm,
    stride_dd,
    stride_rm,
    stride_ym,
    M_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RESIDUAL: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    col_in = cols < D
    rows = tl.arange(0, M_PAD)  # [M_PAD]
    row_in = rows < M
    acc = _rows_dot(h_ptr, down_ptr, cols, col_in, rows, row_in, M, H, stride_hm, stride_dd,
                    M_PAD, BLOCK_D, BLOCK_K, DOT_IN_FP32)  # [M_PAD, BLOCK_D] fp32
    out = row_in[:, None] & col_in[None, :]
    y = _plus_residual(acc, res_ptr, rows, cols, stride_rm, out, RESIDUAL, y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], y, mask=out)


_down_launch = Launcher(_dense_down_kernel)


def launch_dense_mlp_rows_down(x, first_weight, up_weight, down_weight, threshold, *, act, norm_weight=None,
                               eps=0.0, residual=False, config=None) -> torch.Tensor:
    """[M, D]: (x +) down(act(first(norm(x)) - θ) ⊙ up(norm(x))) with down_weight [D, H] (module
    docstring); arguments unchecked, as decode_mlp.launch_decode_mlp's. act: "relu" or "silu"."""
    m, d = x.shape
    h = first_weight.shape[0]
    y = torch.empty((m, d), dtype=x.dtype, device=x.device)
    if d == 0:
        return y
    if h == 0:
        return y.copy_(x) if residual else y.zero_()
    mp = m_pad(m)
    config = config or default_config(mp, capability(x.device), dense=True)
    hidden = torch.empty((m, h), dtype=x.dtype, device=x.device)
    flags = torch.empty(h, dtype=torch.int32, device=x.device)  # K1 writes them; nothing reads them here
    launch_gate_up(x, norm_weight, eps, first_weight, up_weight, threshold, hidden, h, 1, flags, flags, 0,
                   fitted(config, d), act)
    config = fitted(config, h)  # K2 reduces over H
    block_d = config.block_h if mp < 16 else 16  # tl.dot's least: D / 16 programs (K1's 64 would leave SMs idle)
    _down_launch[(cdiv(d, block_d),)](
        hidden, down_weight, x if residual else None, y, m, d, h, hidden.stride(0), down_weight.stride(0),
        x.stride(0), y.stride(0),
        M_PAD=mp, BLOCK_D=block_d, BLOCK_K=config.block_k, RESIDUAL=residual,
        DOT_IN_FP32=interpreting() or x.dtype == torch.float32, num_warps=config.gate_warps,
        num_stages=config.gate_stages,
    )
    return y
