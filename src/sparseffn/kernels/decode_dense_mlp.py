"""Dense MLP for few tokens with the residual stream fused in, for a down weight in Hugging Face's
[D, H] layout: y = x + down(act(norm(x) gate^T) ⊙ (norm(x) up^T)), two launches.

    K1 decode_mlp._decode_gate_up_kernel (dense: ACT relu / silu, NORM), h [M, H] in x's dtype,
       rounded as torch rounds the dense MLP (act(g) and u in x's dtype, then their product)
    K2 _dense_down_kernel, grid (cdiv(D, BLOCK_D),): program c owns output columns [c·BLOCK_D, +BLOCK_D),
       each one row of down [D, H], y[:, cols] = x[:, cols] + round(h · down[cols]^T) (fp32 products over
       all of H, rounded once, then the residual added and rounded again, as torch's `x + mlp(x)`)

Why. At one token a dense MLP is three reads of [H, D] matrices, each a cuBLAS GEMV launch plus the
norm, activation, product and residual launches around them: here two launches read the same bytes.
K2 is decode_mlp's K1 product (`_rows_normed_dot` without the norm: CUDA-core products below 16
tokens, tl.dot from 16), with the output columns as its units; it reuses K1's config (block_h
columns, block_k steps, 16 columns from 16 tokens on; at one token config.stream's loop, and with
config.pdl and config.prefetch its first down tile read before the PDL wait, as K1's first gate tile).
A down weight stored transposed ([H, D] contiguous, SparseMLP's) goes to decode_mlp's K2 instead,
which then sums every unit.
Layouts. x [M, D], 1 <= M <= 64, unit stride along D; gate/up [H, D] and down [D, H] unit stride
along their last dim; norm weight [D]; threshold fp32 [H] or None (relu only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import (capability, cdiv, interpreting, pdl_launch_dependents, pdl_options,
                                        pdl_wait)
from sparseffn.kernels.configs.decode_mlp import default_config
from sparseffn.kernels.decode_mlp import (_plus_residual, _rows_normed_dot, _streamed_dot, _weight_tile, fitted,
                                          launch_gate_up, m_pad)
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
    STREAM: tl.constexpr,  # one token: _streamed_dot's loop
    ONE_STEP: tl.constexpr,  # H <= BLOCK_K (with STREAM: the whole row in one tile)
    PREFETCH: tl.constexpr,  # with PDL and STREAM: the first down tile loaded before pdl_wait
    RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent: nothing but weights read before pdl_wait
    DOT_IN_FP32: tl.constexpr,
):
    EARLY: tl.constexpr = PREFETCH and PDL and STREAM and M_PAD == 1
    pdl_launch_dependents(PDL)
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    col_in = cols < D
    if EARLY:  # weights: no launch writes them
        w0 = _weight_tile(down_ptr, cols, col_in, H, stride_dd, BLOCK_K)
    pdl_wait(PDL)
    rows = tl.arange(0, M_PAD)  # [M_PAD]
    row_in = rows < M
    if EARLY:
        acc, _ = _streamed_dot(w0, h_ptr, None, down_ptr, cols, col_in, H, stride_dd, None, 0.0, 0.0, False, False,
                               BLOCK_D, BLOCK_K, ONE_STEP, False)  # [1, BLOCK_D] fp32
    else:
        acc = _rows_normed_dot(h_ptr, down_ptr, cols, col_in, rows, row_in, M, H, stride_hm, stride_dd, None, None,
                               M_PAD, BLOCK_D, BLOCK_K, False, STREAM, ONE_STEP, DOT_IN_FP32)  # [M_PAD, BLOCK_D] fp32
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
    config = config or default_config(mp, capability(x.device), dense=True, norm=norm_weight is not None)
    hidden = torch.empty((m, h), dtype=x.dtype, device=x.device)
    flags = torch.empty(h, dtype=torch.int32, device=x.device)  # K1 writes them; nothing reads them here
    launch_gate_up(x, norm_weight, eps, first_weight, up_weight, threshold, hidden, h, 1, flags, flags, 0,
                   fitted(config, d), act)
    config = fitted(config, h)  # K2 reduces over H
    block_d = config.block_h if mp < 16 else 16  # tl.dot's least: D / 16 programs (K1's 64 would leave SMs idle)
    _down_launch[(cdiv(d, block_d),)](
        hidden, down_weight, x if residual else None, y, m, d, h, hidden.stride(0), down_weight.stride(0),
        x.stride(0), y.stride(0),
        M_PAD=mp, BLOCK_D=block_d, BLOCK_K=config.block_k, STREAM=config.stream, ONE_STEP=h <= config.block_k,
        PREFETCH=config.prefetch, RESIDUAL=residual, DOT_IN_FP32=interpreting() or x.dtype == torch.float32,
        num_warps=config.gate_warps, num_stages=config.gate_stages, **pdl_options(config.pdl, x.device),
    )
    return y
