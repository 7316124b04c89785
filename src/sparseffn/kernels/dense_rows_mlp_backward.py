"""Backward of the dense MLP on a device-chosen subset of rows (the training path's dense backup).

Each flagged row m (f [M] on the device) with dy[m] and l1_grad = ∂L/∂l1 / M (fp32 [1], read on the device):

    dh_j = dy[m] · down_weight_t[j] + l1_grad · sign(h_j)
    gated:      du_j = dh_j p_j   dg_j = dh_j u_j [g_j - θ_j > 0]   dx[m] = Σ_j du_j up[j] + dg_j gate[j]
                grad_gate[j] += dg_j x[m]   grad_up[j] += du_j x[m]   grad_down_t[j] += h_j dy[m]
    non-gated:  df_j = dh_j [g_j - θ_j > 0]   dx[m] = Σ_j df_j up[j]
                grad_up[j] += df_j x[m]   grad_down_t[j] += p_j dy[m]          (all fp32)

relu' is 0 at 0 and keeps NaN, as in torch; sign(0) = 0. dx is written for flagged rows only (rounded
once); their weight terms are ADDED to fp32 [H, D] accumulators that already hold the ordinary rows'
(kernels/unit_grads.py). "first" is the weight under the relu (gate when gated, up otherwise).

Two kernels, persistent grids fixed at launch (graph-capturable), reading the flagged-row list of
kernels/dense_rows_mlp.py and looping over the tiles that exist (none when R = 0):
  1. `_dense_rows_mlp_backward_dx_kernel`: tiles (block of rows, dx slice); recomputes g, u and
     e = dy · down_weight_t on tensor cores, then dx^T[slice] += first^T d_first^T + up^T d_up^T;
  2. `_dense_rows_mlp_backward_dw_kernel`: tiles (chunk of units, group of D slices); each owns its
     accumulator tiles and walks the row blocks in order (read-add-write through global memory).
One writing program per output element, fixed order, no float atomics: deterministic. fp32 MMA
operands are split into hi + lo terms of x's dtype, as in the forward. Costs several times a dense
backward of the same rows (docs/design.md, "Dense backup"); overflow rows are rare.

Layouts: x, dy, dx_out [M, D] bf16 / fp16, any row stride; gate_weight, up_weight, down_weight_t
[H, D] in x's dtype, unit stride along D; threshold [H] fp32 or None; l1_grad [1] fp32 or None;
grad_*_acc [H, D] fp32. CUDA runs only the 16-byte-aligned path (the forward's unaligned path
computed wrong rows on the H200): misaligned x / dy / dx_out are copied, D % 8 != 0 and misaligned
weights refused. Any M, D, H >= 0 (M < 2**31); offsets int64; compiled variants never depend on M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import cdiv, interpreting, mma, num_sms
from sparseffn.kernels.configs.dense_rows_mlp_backward import DenseRowsBackwardConfig, default_backward_config
from sparseffn.kernels.dense_rows_mlp import (_INTERPRETER_PROGRAMS, _aligned_rows, check_rows_and_weights,
                                              compact_rows, cuda_supported)
from sparseffn.kernels.launch import Launcher

__all__ = ["dense_rows_mlp_backward"]


# ----------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _pow2_scale(vmax):
    """(2^e, 2^-e) with 2^e <= vmax < 2^(e+1), both exact; (1, 1) where vmax is 0, subnormal, too
    large for 2^-e to be normal, inf or NaN."""
    bits = vmax.to(tl.int32, bitcast=True) & 0x7F800000
    normal = (bits > 0) & (bits < 0x7F000000)
    scale = tl.where(normal, bits.to(tl.float32, bitcast=True), 1.0)
    inv = tl.where(normal, (0x7F000000 - bits).to(tl.float32, bitcast=True), 1.0)
    return scale, inv


@triton.jit
def _hi_lo(v, LOW: tl.constexpr):
    """v (fp32) = hi + lo (+ ~2^-16 relative), both in the 16-bit dtype LOW."""
    hi = v.to(LOW)
    lo = (v - hi.to(tl.float32)).to(LOW)
    return hi, lo


@triton.jit
def _chunk_grads(
    x_rows, dy_rows, row_ok, units,
    first_ptr, up_ptr, down_ptr, threshold_ptr, l1_grad,
    D, H, stride_fh, stride_uh, stride_dh,
    GATED: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_L1: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """(d_first^T, d_up^T, h^T), each [BLOCK_H, BLOCK_R] fp32, for the units `units` [BLOCK_H] and
    the gathered rows (x_rows, dy_rows: [BLOCK_R] row starts). Rows with row_ok False and units
    past H give exact zeros (d_up^T is d_first^T when not GATED)."""
    h_ok = units < H
    units64 = units.to(tl.int64)
    f_rows = first_ptr + units64 * stride_fh  # [BLOCK_H] weight row starts
    d_rows = down_ptr + units64 * stride_dh
    if GATED:
        u_rows = up_ptr + units64 * stride_uh
    if ALIGNED:
        f_rows = tl.multiple_of(f_rows, 16)
        d_rows = tl.multiple_of(d_rows, 16)
        if GATED:
            u_rows = tl.multiple_of(u_rows, 16)
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]

    # ---- g^T, u^T = W[chunk] @ x[rows]^T,  e^T = down_weight_t[chunk] @ dy[rows]^T -----------------
    g = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)  # [BLOCK_H, BLOCK_R] fp32 g^T
    u = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)  # [BLOCK_H, BLOCK_R] fp32 u^T
    e = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)  # [BLOCK_H, BLOCK_R] fp32 (dy Wd)^T
    for k0 in range(0, D, BLOCK_K):
        k = k0 + offs_k  # [BLOCK_K]
        k_ok = k < D
        if ALIGNED:
            k_ok = tl.max_constancy(k_ok, 8)
        r_mask = row_ok[:, None] & k_ok[None, :]
        xt = tl.load(x_rows[:, None] + k[None, :], mask=r_mask, other=0.0)  # [BLOCK_R, BLOCK_K]
        dyt = tl.load(dy_rows[:, None] + k[None, :], mask=r_mask, other=0.0)  # [BLOCK_R, BLOCK_K]
        w_mask = h_ok[:, None] & k_ok[None, :]
        wf = tl.load(f_rows[:, None] + k[None, :], mask=w_mask, other=0.0)  # [BLOCK_H, BLOCK_K]
        wd = tl.load(d_rows[:, None] + k[None, :], mask=w_mask, other=0.0)  # [BLOCK_H, BLOCK_K]
        g = mma(wf, tl.trans(xt), g, DOT_IN_FP32)
        e = mma(wd, tl.trans(dyt), e, DOT_IN_FP32)
        if GATED:
            wu = tl.load(u_rows[:, None] + k[None, :], mask=w_mask, other=0.0)  # [BLOCK_H, BLOCK_K]
            u = mma(wu, tl.trans(xt), u, DOT_IN_FP32)

    # ---- h, dh, d_first, d_up (fp32) --------------------------------------------------------------
    if HAS_THRESHOLD:
        theta = tl.load(threshold_ptr + units, mask=h_ok, other=0.0)  # [BLOCK_H] fp32
        g = g - theta[:, None]
    off = g <= 0.0  # [BLOCK_H, BLOCK_R] relu's flat side (derivative 0 at exactly 0; NaN passes)
    p = tl.where(off, 0.0, g)  # [BLOCK_H, BLOCK_R] fp32
    if GATED:
        h = p * u
    else:
        h = p
    dh = e  # [BLOCK_H, BLOCK_R] fp32
    if HAS_L1:
        # l1_grad · sign(h) without multiplying: sign(0) = 0 stays 0 for any l1_grad
        dh += tl.where(h > 0.0, l1_grad, tl.where(h < 0.0, -l1_grad, 0.0))
    valid = row_ok[None, :]  # rows past R: exact zeros whatever l1_grad holds
    if GATED:
        d_first = tl.where(off | ~valid, 0.0, dh * u)
        d_up = tl.where(valid, dh * p, 0.0)
    else:
        d_first = tl.where(off | ~valid, 0.0, dh)
        d_up = d_first
    h = tl.where(valid, h, 0.0)
    return d_first, d_up, h


@triton.jit
def _dx_tile(
    pid_r, pid_d, count,
    x_ptr, dy_ptr, ids_ptr, first_ptr, up_ptr, down_ptr, threshold_ptr, l1_grad, dx_ptr,
    D, H, stride_xm, stride_ym, stride_fh, stride_uh, stride_dh, stride_om,
    GATED: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_L1: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DX: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """dx[rows, slice] for the compacted entries [pid_r * BLOCK_R, +BLOCK_R) and dx slice pid_d.

    "Swap AB": units / the D slice are the MMA M dimension, the few tokens N.
        for each chunk of BLOCK_H units:
            g^T, u^T = first[chunk] @ x[rows]^T, up[chunk] @ x[rows]^T     [BLOCK_H, BLOCK_R] fp32
            e^T = down_weight_t[chunk] @ dy[rows]^T                         [BLOCK_H, BLOCK_R] fp32
            d_first^T, d_up^T from g, u, e, θ, l1_grad                      [BLOCK_H, BLOCK_R] fp32
            dx^T[slice] += first[chunk, slice]^T @ d_first^T + up[chunk, slice]^T @ d_up^T
        dx[rows, slice] = dx (rounded once)
    fp16: one power-of-two scale per token (column of d^T: the MMA's K is the units), shared by
    d_first and d_up."""
    low = first_ptr.dtype.element_ty
    SCALE: tl.constexpr = low == tl.float16  # fp16 needs a per-token scale (module docstring)

    entries = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] compacted positions
    row_ok = entries < count
    rows = tl.load(ids_ptr + entries, mask=row_ok, other=0).to(tl.int64)  # [BLOCK_R] token ids
    x_rows = x_ptr + rows * stride_xm  # [BLOCK_R] row starts
    dy_rows = dy_ptr + rows * stride_ym
    if ALIGNED:
        x_rows = tl.multiple_of(x_rows, 16)
        dy_rows = tl.multiple_of(dy_rows, 16)
    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = pid_d * BLOCK_DX + tl.arange(0, BLOCK_DX)  # [BLOCK_DX] this tile's dx columns
    d_ok = offs_d < D
    if ALIGNED:
        d_ok = tl.max_constancy(d_ok, 8)

    acc = tl.zeros((BLOCK_DX, BLOCK_R), dtype=tl.float32)  # [BLOCK_DX, BLOCK_R] fp32 dx^T
    for h0 in range(0, H, BLOCK_H):
        units = h0 + offs_h  # [BLOCK_H]
        h_ok = units < H
        units64 = units.to(tl.int64)
        f_rows = first_ptr + units64 * stride_fh  # [BLOCK_H]
        if GATED:
            u_rows = up_ptr + units64 * stride_uh
        if ALIGNED:
            f_rows = tl.multiple_of(f_rows, 16)
            if GATED:
                u_rows = tl.multiple_of(u_rows, 16)
        s_mask = h_ok[:, None] & d_ok[None, :]
        # [BLOCK_H, BLOCK_DX] weight slices of the dx GEMM, issued first: in flight during the K-loop
        wf = tl.load(f_rows[:, None] + offs_d[None, :], mask=s_mask, other=0.0)
        if GATED:
            wu = tl.load(u_rows[:, None] + offs_d[None, :], mask=s_mask, other=0.0)

        d_first, d_up, _ = _chunk_grads(
            x_rows, dy_rows, row_ok, units, first_ptr, up_ptr, down_ptr, threshold_ptr, l1_grad,
            D, H, stride_fh, stride_uh, stride_dh,
            GATED, HAS_THRESHOLD, HAS_L1, ALIGNED, BLOCK_R, BLOCK_H, BLOCK_K, DOT_IN_FP32)

        # ---- dx^T += first[chunk, slice]^T @ d_first^T (+ up[chunk, slice]^T @ d_up^T), hi + lo ----
        if SCALE:
            # per token (column), one power of two for d_first and d_up: exact scaling
            v_max = tl.max(tl.abs(d_first), axis=0)  # [BLOCK_R]
            if GATED:
                v_max = tl.maximum(v_max, tl.max(tl.abs(d_up), axis=0))
            scale, inv = _pow2_scale(v_max)  # [BLOCK_R] 2^e, 2^-e
            d_first = d_first * inv[None, :]
            if GATED:
                d_up = d_up * inv[None, :]
        f_hi, f_lo = _hi_lo(d_first, low)  # [BLOCK_H, BLOCK_R] x's dtype
        wf_t = tl.trans(wf)  # [BLOCK_DX, BLOCK_H]
        if SCALE:
            part = tl.zeros((BLOCK_DX, BLOCK_R), dtype=tl.float32)  # [BLOCK_DX, BLOCK_R] scaled dx^T
        else:
            part = acc
        part = mma(wf_t, f_hi, part, DOT_IN_FP32)
        part = mma(wf_t, f_lo, part, DOT_IN_FP32)
        if GATED:
            u_hi, u_lo = _hi_lo(d_up, low)  # [BLOCK_H, BLOCK_R]
            wu_t = tl.trans(wu)  # [BLOCK_DX, BLOCK_H]
            part = mma(wu_t, u_hi, part, DOT_IN_FP32)
            part = mma(wu_t, u_lo, part, DOT_IN_FP32)
        if SCALE:
            acc += part * scale[None, :]
        else:
            acc = part

    dx_rows = dx_ptr + rows * stride_om  # [BLOCK_R]
    if ALIGNED:
        dx_rows = tl.multiple_of(dx_rows, 16)
    tl.store(dx_rows[None, :] + offs_d[:, None], acc.to(dx_ptr.dtype.element_ty),
             mask=d_ok[:, None] & row_ok[None, :])


@triton.jit
def _dense_rows_mlp_backward_dx_kernel(
    x_ptr,  # [M, D], unit stride along D
    dy_ptr,  # [M, D], unit stride along D
    ids_ptr,  # [M] int32: compacted flagged row ids, valid below count
    count_ptr,  # [1] int32: number of flagged rows R
    first_ptr,  # [H, D] gate weight (gated) or up weight (non-gated)
    up_ptr,  # [H, D] up weight (gated), None otherwise
    down_ptr,  # [H, D] down_weight^T
    threshold_ptr,  # [H] fp32, None when not HAS_THRESHOLD
    l1_grad_ptr,  # [1] fp32, None when not HAS_L1
    dx_ptr,  # [M, D], unit stride along D
    D,
    H,
    stride_xm,  # row strides (all [., D] tensors have unit stride along D)
    stride_ym,
    stride_fh,
    stride_uh,
    stride_dh,
    stride_om,
    GATED: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    HAS_L1: tl.constexpr,
    ALIGNED: tl.constexpr,  # D % 8 == 0, 16-byte aligned bases and row strides: 16-byte vectors
    BLOCK_R: tl.constexpr,  # tokens per tile (MMA N, >= 8 on the GPU)
    BLOCK_H: tl.constexpr,  # units per chunk (MMA M of the recompute, K of the dx GEMM)
    BLOCK_K: tl.constexpr,  # D step of the recompute K-loop
    BLOCK_DX: tl.constexpr,  # dx columns per tile (MMA M of the dx GEMM)
    DOT_IN_FP32: tl.constexpr,  # interpreter: its low-precision tl.dot is wrong
):
    # Persistent: the grid is fixed at launch; the tiles that exist are known only here, from R.
    n_d = tl.cdiv(D, BLOCK_DX)
    count = tl.load(count_ptr)
    if HAS_L1:
        l1_grad = tl.load(l1_grad_ptr)  # fp32 scalar
    else:
        l1_grad = 0.0
    n_tiles = tl.cdiv(count, BLOCK_R) * n_d
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        _dx_tile(tile // n_d, tile % n_d, count,
                 x_ptr, dy_ptr, ids_ptr, first_ptr, up_ptr, down_ptr, threshold_ptr, l1_grad, dx_ptr,
                 D, H, stride_xm, stride_ym, stride_fh, stride_uh, stride_dh, stride_om,
                 GATED, HAS_THRESHOLD, HAS_L1, ALIGNED, BLOCK_R, BLOCK_H, BLOCK_K, BLOCK_DX, DOT_IN_FP32)


_dense_rows_mlp_backward_dx_launch = Launcher(_dense_rows_mlp_backward_dx_kernel)


@triton.jit
def _accumulate(
    g_rows, h_ok, a_rows, row_ok, v, s_lo, s_hi, D,
    ALIGNED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DW: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    """grad[units, slices s_lo..s_hi) += v^T @ a[rows, slice], as grad^T += a^T @ v ("swap AB" again:
    the D slice is the MMA M dimension, the units N, the rows K). v^T [BLOCK_H, BLOCK_R] fp32 (d_first,
    d_up or h), a = x or dy (row starts a_rows [BLOCK_R]), g_rows [BLOCK_H] the fp32 accumulator's
    row starts. Each [BLOCK_DW, BLOCK_H] accumulator tile is read, added to and written back: this
    program owns it."""
    low = a_rows.dtype.element_ty
    SCALE: tl.constexpr = low == tl.float16  # fp16 needs a per-unit scale (module docstring)
    if SCALE:
        scale, inv = _pow2_scale(tl.max(tl.abs(v), axis=1))  # [BLOCK_H] 2^e, 2^-e per unit
        v = v * inv[:, None]
    hi, lo = _hi_lo(tl.trans(v), low)  # [BLOCK_R, BLOCK_H] x's dtype: the MMA B operand
    offs_dw = tl.arange(0, BLOCK_DW)  # [BLOCK_DW]
    for s in range(s_lo, s_hi):
        offs_d = s * BLOCK_DW + offs_dw  # [BLOCK_DW]
        d_ok = offs_d < D
        if ALIGNED:
            d_ok = tl.max_constancy(d_ok, 8)
        a_t = tl.load(a_rows[None, :] + offs_d[:, None], mask=d_ok[:, None] & row_ok[None, :],
                      other=0.0)  # [BLOCK_DW, BLOCK_R]
        ptrs = g_rows[None, :] + offs_d[:, None]  # [BLOCK_DW, BLOCK_H]
        g_mask = d_ok[:, None] & h_ok[None, :]
        acc = tl.load(ptrs, mask=g_mask, other=0.0)  # [BLOCK_DW, BLOCK_H] fp32 accumulator^T
        if SCALE:
            part = tl.zeros((BLOCK_DW, BLOCK_H), dtype=tl.float32)  # [BLOCK_DW, BLOCK_H] scaled term
            part = mma(a_t, hi, part, DOT_IN_FP32)
            part = mma(a_t, lo, part, DOT_IN_FP32)
            acc += part * scale[None, :]
        else:
            acc = mma(a_t, hi, acc, DOT_IN_FP32)
            acc = mma(a_t, lo, acc, DOT_IN_FP32)
        tl.store(ptrs, acc, mask=g_mask)


@triton.jit
def _dw_tile(
    pid_h, pid_g, count, slices_per_tile,
    x_ptr, dy_ptr, ids_ptr, first_ptr, up_ptr, down_ptr, threshold_ptr, l1_grad,
    grad_first_ptr, grad_up_ptr, grad_down_ptr,
    D, H, stride_xm, stride_ym, stride_fh, stride_uh, stride_dh, stride_gf, stride_gu, stride_gd,
    GATED: tl.constexpr, HAS_THRESHOLD: tl.constexpr, HAS_L1: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DW: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """grad[chunk pid_h, D group pid_g] += the terms of all R flagged rows, row blocks in order.

        for each block of BLOCK_R compacted rows:
            d_first^T, d_up^T, h^T for (chunk, rows)                      [BLOCK_H, BLOCK_R] fp32
            for (acc, a, v) in (grad_down_t, dy, h), (grad_first, x, d_first), (grad_up, x, d_up):
                for each slice of the group:
                    acc[chunk, slice]^T += a[rows, slice]^T @ v            [BLOCK_DW, BLOCK_H] fp32
    "Swap AB": the D slice is the MMA M dimension, the units N, the rows K. One matrix at a time
    keeps fewer operands live. The accumulator tiles go through global memory once per row block
    (registers could hold only a narrow D slice of three accumulators, and each slice would then
    recompute g, u, e); a CTA barrier separates one block's stores from the next block's loads of
    the same tiles. fp16: one power-of-two scale per unit and matrix (row of d^T: K is the rows)."""
    units = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    h_ok = units < H
    units64 = units.to(tl.int64)
    gf_rows = grad_first_ptr + units64 * stride_gf  # [BLOCK_H] accumulator row starts
    gd_rows = grad_down_ptr + units64 * stride_gd
    if GATED:
        gu_rows = grad_up_ptr + units64 * stride_gu
    if ALIGNED:
        gf_rows = tl.multiple_of(gf_rows, 16)
        gd_rows = tl.multiple_of(gd_rows, 16)
        if GATED:
            gu_rows = tl.multiple_of(gu_rows, 16)
    s_lo = pid_g * slices_per_tile
    s_hi = tl.minimum(s_lo + slices_per_tile, tl.cdiv(D, BLOCK_DW))
    offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R]

    for r0 in range(0, count, BLOCK_R):
        # the previous row block's accumulator stores (by any thread of this CTA) land before
        # this block's loads of the same tiles
        tl.debug_barrier()
        entries = r0 + offs_r  # [BLOCK_R] compacted positions
        row_ok = entries < count
        rows = tl.load(ids_ptr + entries, mask=row_ok, other=0).to(tl.int64)  # [BLOCK_R] token ids
        x_rows = x_ptr + rows * stride_xm  # [BLOCK_R] row starts
        dy_rows = dy_ptr + rows * stride_ym
        if ALIGNED:
            x_rows = tl.multiple_of(x_rows, 16)
            dy_rows = tl.multiple_of(dy_rows, 16)

        d_first, d_up, h = _chunk_grads(
            x_rows, dy_rows, row_ok, units, first_ptr, up_ptr, down_ptr, threshold_ptr, l1_grad,
            D, H, stride_fh, stride_uh, stride_dh,
            GATED, HAS_THRESHOLD, HAS_L1, ALIGNED, BLOCK_R, BLOCK_H, BLOCK_K, DOT_IN_FP32)
        # one matrix at a time over the group's slices: fewer live registers (x slices read twice
        # when gated, from L2)
        _accumulate(gd_rows, h_ok, dy_rows, row_ok, h, s_lo, s_hi, D, ALIGNED, BLOCK_H, BLOCK_DW, DOT_IN_FP32)
        _accumulate(gf_rows, h_ok, x_rows, row_ok, d_first, s_lo, s_hi, D, ALIGNED, BLOCK_H, BLOCK_DW, DOT_IN_FP32)
        if GATED:
            _accumulate(gu_rows, h_ok, x_rows, row_ok, d_up, s_lo, s_hi, D, ALIGNED, BLOCK_H, BLOCK_DW, DOT_IN_FP32)


@triton.jit(do_not_specialize=["slices_per_tile"])
def _dense_rows_mlp_backward_dw_kernel(
    x_ptr,  # [M, D], unit stride along D
    dy_ptr,  # [M, D], unit stride along D
    ids_ptr,  # [M] int32: compacted flagged row ids, valid below count
    count_ptr,  # [1] int32: number of flagged rows R
    first_ptr,  # [H, D] gate weight (gated) or up weight (non-gated)
    up_ptr,  # [H, D] up weight (gated), None otherwise
    down_ptr,  # [H, D] down_weight^T
    threshold_ptr,  # [H] fp32, None when not HAS_THRESHOLD
    l1_grad_ptr,  # [1] fp32, None when not HAS_L1
    grad_first_ptr,  # [H, D] fp32 accumulator of first's gradient (gate's, or up's when non-gated)
    grad_up_ptr,  # [H, D] fp32 accumulator of up's gradient (gated), None otherwise
    grad_down_ptr,  # [H, D] fp32 accumulator of down_weight_t's gradient
    D,
    H,
    slices_per_tile,  # BLOCK_DW slices per (chunk, D group) tile: n_groups = cdiv(n_slices, this)
    stride_xm,  # row strides (all [., D] tensors have unit stride along D)
    stride_ym,
    stride_fh,
    stride_uh,
    stride_dh,
    stride_gf,
    stride_gu,
    stride_gd,
    GATED: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    HAS_L1: tl.constexpr,
    ALIGNED: tl.constexpr,  # D % 8 == 0, 16-byte aligned bases and row strides: 16-byte vectors
    BLOCK_R: tl.constexpr,  # rows per step (MMA N of the recompute, K of the weight GEMMs; >= 16)
    BLOCK_H: tl.constexpr,  # units per tile (MMA M)
    BLOCK_K: tl.constexpr,  # D step of the recompute K-loop
    BLOCK_DW: tl.constexpr,  # accumulator columns per slice (MMA N of the weight GEMMs)
    DOT_IN_FP32: tl.constexpr,  # interpreter: its low-precision tl.dot is wrong
):
    # Persistent, like the dx kernel. No flagged row: no tile, the accumulators are not touched.
    n_groups = tl.cdiv(tl.cdiv(D, BLOCK_DW), slices_per_tile)
    count = tl.load(count_ptr)
    if HAS_L1:
        l1_grad = tl.load(l1_grad_ptr)  # fp32 scalar
    else:
        l1_grad = 0.0
    n_tiles = tl.where(count > 0, tl.cdiv(H, BLOCK_H) * n_groups, 0)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        # the D groups of a chunk are consecutive tiles: they share the chunk's weight reads via L2
        _dw_tile(tile // n_groups, tile % n_groups, count, slices_per_tile,
                 x_ptr, dy_ptr, ids_ptr, first_ptr, up_ptr, down_ptr, threshold_ptr, l1_grad,
                 grad_first_ptr, grad_up_ptr, grad_down_ptr,
                 D, H, stride_xm, stride_ym, stride_fh, stride_uh, stride_dh, stride_gf, stride_gu, stride_gd,
                 GATED, HAS_THRESHOLD, HAS_L1, ALIGNED, BLOCK_R, BLOCK_H, BLOCK_K, BLOCK_DW, DOT_IN_FP32)


_dense_rows_mlp_backward_dw_launch = Launcher(_dense_rows_mlp_backward_dw_kernel)


# ----------------------------------------------------------------------------------------------------
# launcher


def _check_acc(t: object, name: str, h: int, d: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be torch.float32, got {t.dtype}")
    if tuple(t.shape) != (h, d):
        raise ValueError(f"{name} must have shape [H, D] = [{h}, {d}], got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on x's device {device}, got {t.device}")
    if d > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along D (any row stride), got strides {list(t.stride())}")


def _check_inputs(x, dy, row_flags, gate_weight, up_weight, down_weight_t, threshold, l1_grad,
                  dx_out, grad_gate_acc, grad_up_acc, grad_down_t_acc, config):
    m, d, h = check_rows_and_weights(x, row_flags, gate_weight, up_weight, down_weight_t, threshold)
    for name, t in (("dy", dy), ("dx_out", dx_out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != (m, d):
            raise ValueError(f"{name} must have shape [M, D] = [{m}, {d}], got {list(t.shape)}")
        if t.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    if d > 1 and dx_out.stride(1) != 1:
        raise ValueError(f"dx_out must have unit stride along D, got strides {list(dx_out.stride())}")
    if l1_grad is not None:
        if not isinstance(l1_grad, torch.Tensor):
            raise TypeError(f"l1_grad must be None or a torch.Tensor, got {type(l1_grad).__name__}")
        if l1_grad.dtype != torch.float32:
            raise TypeError(f"l1_grad must be torch.float32, got {l1_grad.dtype}")
        if l1_grad.numel() != 1 or l1_grad.dim() > 1:
            raise ValueError(f"l1_grad must have shape [1] (or []), got {list(l1_grad.shape)}")
        if l1_grad.device != x.device:
            raise ValueError(f"l1_grad must be on x's device {x.device} (it is read on the device), "
                             f"got {l1_grad.device}")
    if gate_weight is None and grad_gate_acc is not None:
        raise ValueError("grad_gate_acc must be None when gate_weight is None (non-gated MLP)")
    if gate_weight is not None:
        _check_acc(grad_gate_acc, "grad_gate_acc", h, d, x.device)
    _check_acc(grad_up_acc, "grad_up_acc", h, d, x.device)
    _check_acc(grad_down_t_acc, "grad_down_t_acc", h, d, x.device)
    # written tensors must not share memory with anything the kernels read (or with each other);
    # each storage address is read once (untyped_storage() builds a Python object per call)
    named = {"x": x, "dy": dy, "gate_weight": gate_weight, "up_weight": up_weight, "down_weight_t": down_weight_t,
             "threshold": threshold, "l1_grad": l1_grad, "row_flags": row_flags, "dx_out": dx_out,
             "grad_gate_acc": grad_gate_acc, "grad_up_acc": grad_up_acc, "grad_down_t_acc": grad_down_t_acc}
    storage = {name: t.untyped_storage().data_ptr() for name, t in named.items() if t is not None and t.numel()}
    for wname in ("dx_out", "grad_gate_acc", "grad_up_acc", "grad_down_t_acc"):
        if wname not in storage:
            continue
        for oname, ptr in storage.items():
            if oname != wname and ptr == storage[wname]:
                raise ValueError(f"{wname} must not share memory with {oname} (the kernels read one while "
                                 "writing the other)")
    if config is not None and not isinstance(config, DenseRowsBackwardConfig):
        raise TypeError(f"config must be None or a DenseRowsBackwardConfig, got {type(config).__name__}")


def dense_rows_mlp_backward(
    x: torch.Tensor,
    dy: torch.Tensor,
    row_flags: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight_t: torch.Tensor,
    threshold: torch.Tensor | None,
    l1_grad: torch.Tensor | None,
    *,
    dx_out: torch.Tensor,
    grad_gate_acc: torch.Tensor | None,
    grad_up_acc: torch.Tensor,
    grad_down_t_acc: torch.Tensor,
    config: DenseRowsBackwardConfig | None = None,
) -> torch.Tensor:
    """Backward of `dense_rows_mlp` (+ the L1 term) for the rows with row_flags[m] != 0, no host sync.

    x, dy [M, D] bf16/fp16; row_flags [M] bool/int on x's device; gate_weight [H, D] or None
    (non-gated); up_weight, down_weight_t [H, D] (unit stride along D, any row stride); threshold
    fp32 [H] or None; l1_grad fp32 [1] on the device (∂L/∂l1 / M; None: no L1 term).
    dx_out [M, D] (x's dtype) gets dx in the flagged rows only (rounded once from fp32);
    grad_gate_acc (None when non-gated), grad_up_acc, grad_down_t_acc fp32 [H, D] get the flagged
    rows' terms added (+=; untouched when no row is flagged). Deterministic. `config` overrides
    `default_backward_config(D)`. Returns dx_out.
    """
    _check_inputs(x, dy, row_flags, gate_weight, up_weight, down_weight_t, threshold, l1_grad,
                  dx_out, grad_gate_acc, grad_up_acc, grad_down_t_acc, config)
    return launch_dense_rows_backward(x, dy, row_flags, gate_weight, up_weight, down_weight_t, threshold, l1_grad,
                                      dx_out=dx_out, grad_gate_acc=grad_gate_acc, grad_up_acc=grad_up_acc,
                                      grad_down_t_acc=grad_down_t_acc, config=config)


def launch_dense_rows_backward(
    x: torch.Tensor,
    dy: torch.Tensor,
    row_flags: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight_t: torch.Tensor,
    threshold: torch.Tensor | None,
    l1_grad: torch.Tensor | None,
    *,
    dx_out: torch.Tensor,
    grad_gate_acc: torch.Tensor | None,
    grad_up_acc: torch.Tensor,
    grad_down_t_acc: torch.Tensor,
    config: DenseRowsBackwardConfig | None = None,
    row_list: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`dense_rows_mlp_backward` on arguments that meet its contract, unchecked: for the training op,
    whose token-major backward launch checked x, dy and the weights and which allocates the flags,
    dx and the accumulators (on slow hosts the checks cost more host time than these launches,
    which usually find no flagged row). row_list (ids int32, count int32 [1], ascending ids below
    count) replaces the rows of row_flags when given."""
    m, d = x.shape
    h = up_weight.shape[0]
    cuda = x.is_cuda
    if config is None:
        config = default_backward_config(d, cuda=cuda)
    if m == 0 or d == 0:
        return dx_out  # no element of dx or of the [H, 0] accumulators exists
    if threshold is not None:
        threshold = threshold.contiguous()
    # ascending ids: the weight gradients add the rows in row order (deterministic)
    ids, count = row_list if row_list is not None else compact_rows(row_flags)

    if d > 1 and x.stride(1) != 1:
        x = x.contiguous()  # the kernels read rows with unit stride (a copy, no sync)
    if d > 1 and dy.stride(1) != 1:
        dy = dy.contiguous()
    gated = gate_weight is not None
    first = gate_weight if gated else up_weight
    grad_first = grad_gate_acc if gated else grad_up_acc
    weights = (first, up_weight, down_weight_t)
    accs = (grad_first, grad_up_acc, grad_down_t_acc) if gated else (grad_first, grad_down_t_acc)
    aligned = d % 8 == 0 and all(_aligned_rows(t) for t in (x, dy, dx_out) + weights + accs)
    result = dx_out
    if cuda and not aligned:
        # As in the forward: CUDA runs only the aligned path. Misaligned activations go through
        # aligned copies (no sync); weights and accumulators cannot be copied cheaply: refused.
        if not cuda_supported(d, *weights):
            raise NotImplementedError(
                "dense_rows_mlp_backward on CUDA needs D % 8 == 0 and 16-byte aligned weight rows "
                f"(got D = {d}); the unaligned kernel path is disabled on GPUs"
            )
        for name, t in (("grad_gate_acc", grad_gate_acc), ("grad_up_acc", grad_up_acc),
                        ("grad_down_t_acc", grad_down_t_acc)):
            if t is not None and not _aligned_rows(t):
                raise NotImplementedError(f"dense_rows_mlp_backward on CUDA needs {name} with a 16-byte aligned "
                                          f"base and row stride, got strides {list(t.stride())}")
        x = x if _aligned_rows(x) else x.clone(memory_format=torch.contiguous_format)
        dy = dy if _aligned_rows(dy) else dy.clone(memory_format=torch.contiguous_format)
        dx_out = dx_out if _aligned_rows(dx_out) else dx_out.clone(memory_format=torch.contiguous_format)
        aligned = True

    programs = (num_sms(x.device) if cuda else _INTERPRETER_PROGRAMS) * config.programs_per_sm
    common = dict(GATED=gated, HAS_THRESHOLD=threshold is not None, HAS_L1=l1_grad is not None, ALIGNED=aligned,
                  DOT_IN_FP32=interpreting())
    up = up_weight if gated else None

    # dx: tiles (row block, dx slice)
    worst = cdiv(m, config.block_r) * cdiv(d, config.block_dx)  # tiles if all flagged
    _dense_rows_mlp_backward_dx_launch[(min(worst, programs),)](
        x, dy, ids, count, first, up, down_weight_t, threshold, l1_grad, dx_out,
        d, h,
        x.stride(0), dy.stride(0), first.stride(0), up_weight.stride(0), down_weight_t.stride(0), dx_out.stride(0),
        BLOCK_R=config.block_r, BLOCK_H=config.block_h, BLOCK_K=config.block_k, BLOCK_DX=config.block_dx,
        num_warps=config.num_warps, num_stages=config.num_stages, **common,
    )

    # weight gradients: tiles (unit chunk, D group)
    n_chunks = cdiv(h, config.block_h_w)
    n_slices = cdiv(d, config.block_dw)
    if n_chunks:
        groups = config.d_groups or programs // n_chunks  # the most that fit in one wave
        groups = max(1, min(groups, n_slices))
        slices_per_tile = cdiv(n_slices, groups)
        tiles = n_chunks * cdiv(n_slices, slices_per_tile)
        _dense_rows_mlp_backward_dw_launch[(min(tiles, programs),)](
            x, dy, ids, count, first, up, down_weight_t, threshold, l1_grad,
            grad_first, grad_up_acc if gated else None, grad_down_t_acc,
            d, h, slices_per_tile,
            x.stride(0), dy.stride(0), first.stride(0), up_weight.stride(0), down_weight_t.stride(0),
            grad_first.stride(0), grad_up_acc.stride(0), grad_down_t_acc.stride(0),
            BLOCK_R=config.block_r_w, BLOCK_H=config.block_h_w, BLOCK_K=config.block_k_w, BLOCK_DW=config.block_dw,
            num_warps=config.num_warps_w, num_stages=config.num_stages_w, **common,
        )
    if dx_out is not result:
        result.copy_(dx_out)
    return result
