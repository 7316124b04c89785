"""Exact sparse MLP for few tokens (decode, 1 <= M <= 64): read the gate matrix once, and of the up
and down matrices only the rows of units some token activates.

    K1 _decode_gate_up_kernel, grid (cdiv(H, BLOCK_H),): program b owns units j in [b·BLOCK_H, +BLOCK_H)
        g[m, j] = x[m] · first[j] in fp32; p = (g - θ_j) rounded to x's dtype, active iff not p <= 0
        active_j = any over m of active[m, j]; gated: h = relu(p) ⊙ (x up^T), the up rows of inactive
        units never read; non-gated: h = relu(p). Writes h_t [H, M_PAD] (x's dtype, rounded as the dense
        MLP rounds h; rows >= M unwritten), flags [H] int32 = active_j; program 0 zeroes K2's counters
    K2 _decode_down_kernel, grid (cdiv(D, BLOCK_D), SPLIT): program (c, s) owns columns
       [c·BLOCK_D, +BLOCK_D) and span s of the units, [s·cdiv(H, SPLIT), +cdiv(H, SPLIT))
        1. compacts the span's active units into a list (a prefix sum over the flags; every program
           of the span writes the same list, so no program waits for another);
        2. part_s = Σ over the list, BLOCK_S units at a time, h_t[j, :M] ⊗ down_t[j, cols], ascending j;
        3. SPLIT == 1: y[:, cols] = part_0. Else part_s goes to fp32 scratch and an atomic counter per
           column block; the span arriving last sums the parts in span order (deterministic) into y.
Fused variants (the decode engine's): NORM, x is Llama's RMSNorm of x (each K1 program computes its
rows' rstd, x being L2-resident); RESIDUAL, K2 writes x + y; ACT relu / silu, the dense MLP (every unit
read, K2 summing every unit of its span without flags or list; act(g) and u rounded as torch rounds
them); FOLD (one token, sparse): K1 alone, its programs with an active unit adding h_j · down_t[j] to an fp32
[1, D] sum by atomic adds. config.pdl (Hopper on): K1 and K2 launched as programmatic dependents (_runtime).
Why. At M <= 64 the MLP is bound by HBM bandwidth and latency: dense reads three [H, D] matrices, this
path the gate matrix plus two D-rows per active unit, once per call; no host sync (CUDA-graph capturable).

Layouts. x [M, D]; first (gate, or up when not gated), up, down_t = down_proj.weight^T: [H, D], unit
stride along D, any row stride; threshold fp32 [H] or None. M_PAD (1, 2, 16, 32 or 64) is M rounded
up: 1 and 2 use CUDA-core products, the others tl.dot on zero-padded rows (K2 pads 2 to 16 rows).
Interpreter and fp32 x: dot operands in fp32, IEEE (DOT_IN_FP32).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import (capability, cdiv, check_capability, check_few_tokens, interpreting, mma,
                                        next_power_of_2, num_sms, pdl_launch_dependents, pdl_options, pdl_wait)
from sparseffn.kernels.configs.decode_mlp import DecodeConfig, default_config, down_rows
from sparseffn.kernels.launch import Launcher

MAX_TOKENS = 64
PADDED_TOKENS = (1, 2, 16, 32, 64)  # the token counts the kernels are built for

__all__ = ["MAX_TOKENS", "decode_mlp", "launch_decode_mlp"]


@triton.jit
def _x_tile(x_rows, pending_rows, cols, mask, PENDING: tl.constexpr):
    """x[rows, cols] (x_rows: the rows' pointers), or with PENDING the layer input round(x + round(pending)):
    torch's residual add of an MLP output (fp32 sum `pending`, rounded to x's dtype) left for this kernel."""
    xv = tl.load(x_rows + cols, mask=mask, other=0.0)
    if PENDING:
        s = tl.load(pending_rows + cols, mask=mask, other=0.0).to(xv.dtype)
        xv = (xv.to(tl.float32) + s.to(tl.float32)).to(xv.dtype)
    return xv


@triton.jit
def _rows_rstd(x_ptr, pending_ptr, rows, row_in, D, stride_xm, stride_pm, eps, M_PAD: tl.constexpr,
               BLOCK_K: tl.constexpr, PENDING: tl.constexpr):
    """[M_PAD] fp32 1 / sqrt(mean_j x[rows, j]^2 + eps), the RMSNorm scale of each row (0 past M); x
    as `_x_tile` reads it."""
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [M_PAD, 1]
    p_rows = pending_ptr + rows.to(tl.int64)[:, None] * stride_pm if PENDING else None
    sq = tl.zeros((M_PAD, BLOCK_K), dtype=tl.float32)  # [M_PAD, BLOCK_K] partial sums of squares
    for k0 in range(0, D, BLOCK_K):
        k = k0 + offs_k
        mask = row_in[:, None] & (k < D)[None, :]
        xv = _x_tile(x_rows, p_rows, k[None, :], mask, PENDING).to(tl.float32)
        sq += xv * xv
    mean_sq = tl.sum(sq, axis=1) / D  # [M_PAD]
    return tl.math.div_rn(tl.full((M_PAD,), 1.0, tl.float32), tl.sqrt_rn(mean_sq + eps))


@triton.jit
def _normed(xv, norm_ptr, k, k_in, rstd):
    """Hugging Face's RMSNorm of an x tile: weight * (x * rstd rounded to x's dtype), rounded once;
    xv [R, BLOCK_K] (or [BLOCK_K] with rstd a scalar), rstd broadcastable to it."""
    return _normed_by(xv, tl.load(norm_ptr + k, mask=k_in, other=0.0), rstd)


@triton.jit
def _normed_by(xv, nw, rstd):
    """`_normed` with the norm weight's tile nw [BLOCK_K] loaded."""
    n = (xv.to(tl.float32) * rstd).to(xv.dtype)
    return (nw.to(tl.float32) * n.to(tl.float32)).to(xv.dtype)


@triton.jit
def _weight_tile(w_ptr, units, unit_on, D, stride_wh, BLOCK_K: tl.constexpr):
    """[BLOCK_H, BLOCK_K] w[units, :BLOCK_K], 0 off unit_on and past D: `_streamed_dot`'s first tile."""
    k = tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + units.to(tl.int64)[:, None] * stride_wh + k[None, :],
                   mask=unit_on[:, None] & (k < D)[None, :], other=0.0)


@triton.jit
def _streamed_dot(w, x_ptr, pending_ptr, w_ptr, units, unit_on, D, stride_wh, norm_ptr, rstd, eps,
                  NORM: tl.constexpr, NEED_RSTD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                  ONE_STEP: tl.constexpr, PENDING: tl.constexpr):
    """One token: ([1, BLOCK_H] fp32 x · w[units]^T over all of D, rstd [1]), w the first tile
    (`_weight_tile`, loaded by the caller: before the PDL wait where it prefetches). Each step issues the
    next step's loads (weight, x and norm tiles) before it reduces its own, so its products wait on loads
    issued a step earlier and a weight tile stays in flight while the program computes; the products
    are summed per step (no [BLOCK_H, BLOCK_K] fp32 accumulator). NORM: x RMS-normalized with rstd,
    which NEED_RSTD computes here after the first weight tile's load is issued, so the pass over x
    (L2-resident) overlaps it. ONE_STEP (D <= BLOCK_K): w is the whole row, no next tile is loaded (nor
    held in registers); the same bits as the loop's one step. PENDING: x as `_x_tile` reads it."""
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + units.to(tl.int64)[:, None] * stride_wh  # [BLOCK_H, 1]
    x_row = x_ptr + tl.zeros((1, BLOCK_K), dtype=tl.int32)  # [1, BLOCK_K] the token's row
    p_row = pending_ptr + tl.zeros((1, BLOCK_K), dtype=tl.int32) if PENDING else None
    k_in = offs_k < D
    if NEED_RSTD:
        one = tl.arange(0, 1)
        rstd = _rows_rstd(x_ptr, pending_ptr, one, one < 1, D, 0, 0, eps, 1, BLOCK_K, PENDING)
    elif not NORM:
        rstd = tl.zeros((1,), dtype=tl.float32)  # unused; returned as a tensor
    xv = _x_tile(x_row, p_row, offs_k[None, :], k_in[None, :], PENDING)  # [1, BLOCK_K]
    nw = tl.load(norm_ptr + offs_k, mask=k_in, other=0.0) if NORM else None
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    if ONE_STEP:
        if NORM:
            xv = _normed_by(xv, nw, rstd[:, None])
        acc += tl.sum(w.to(tl.float32) * xv.to(tl.float32), axis=1)
    else:
        for k0 in range(0, D, BLOCK_K):
            k = k0 + BLOCK_K + offs_k  # the next step's columns; past D on the last step: masked, no traffic
            k_in = k < D
            w_next = tl.load(w_rows + k[None, :], mask=unit_on[:, None] & k_in[None, :], other=0.0)
            x_next = _x_tile(x_row, p_row, k[None, :], k_in[None, :], PENDING)
            if NORM:
                nw_next = tl.load(norm_ptr + k, mask=k_in, other=0.0)
                xv = _normed_by(xv, nw, rstd[:, None])
                nw = nw_next
            acc += tl.sum(w.to(tl.float32) * xv.to(tl.float32), axis=1)
            w = w_next
            xv = x_next
    return acc[None, :], rstd


@triton.jit
def _rows_dot(x_ptr, w_ptr, units, unit_on, rows, row_in, M, D, stride_xm, stride_wh,
              M_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """`_rows_normed_dot` without the norm."""
    return _rows_normed_dot(x_ptr, w_ptr, units, unit_on, rows, row_in, M, D, stride_xm, stride_wh, None, None,
                            M_PAD, BLOCK_H, BLOCK_K, False, False, False, DOT_IN_FP32)


@triton.jit
def _rows_normed_dot(x_ptr, w_ptr, units, unit_on, rows, row_in, M, D, stride_xm, stride_wh, norm_ptr, rstd,
                     M_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                     STREAM: tl.constexpr, ONE_STEP: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """[M_PAD, BLOCK_H] fp32: x[rows] · w[units]^T over all of D; rows of w with unit_on false are
    masked off (no memory traffic). NORM: x is first RMS-normalized (`_normed`, rstd [M_PAD] per row).
    M_PAD < 16: CUDA-core products, each weight tile loaded once and multiplied by the tokens one after
    the other. M_PAD >= 16: the MMA computes the transposed product, units as its M dimension (as fast
    on sm_90, and sm_100's compiler fails on the other form at 64 tokens). STREAM at one token:
    `_streamed_dot`'s loop (ONE_STEP: D <= BLOCK_K)."""
    if STREAM and M_PAD == 1:
        acc, rstd = _streamed_dot(_weight_tile(w_ptr, units, unit_on, D, stride_wh, BLOCK_K), x_ptr, None, w_ptr,
                                  units, unit_on, D, stride_wh, norm_ptr, rstd, 0.0, NORM, False, BLOCK_H, BLOCK_K,
                                  ONE_STEP, False)
        return acc
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + units.to(tl.int64)[:, None] * stride_wh  # [BLOCK_H, 1]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [M_PAD, 1]
    if M_PAD == 1:
        acc2 = tl.zeros((BLOCK_H, BLOCK_K), dtype=tl.float32)  # [BLOCK_H, BLOCK_K] products, summed once
    elif M_PAD < 16:
        acc = tl.zeros((M_PAD, BLOCK_H), dtype=tl.float32)
    else:
        acc_t = tl.zeros((BLOCK_H, M_PAD), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + offs_k
        k_in = k < D
        w = tl.load(w_rows + k[None, :], mask=unit_on[:, None] & k_in[None, :], other=0.0)  # [BLOCK_H, BLOCK_K]
        if M_PAD == 1:
            xv = tl.load(x_rows + k[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0)  # [1, BLOCK_K]
            if NORM:
                xv = _normed(xv, norm_ptr, k, k_in, rstd[:, None])
            acc2 += w.to(tl.float32) * xv.to(tl.float32)
        elif M_PAD < 16:
            wf = w.to(tl.float32)
            for m in tl.static_range(M_PAD):
                xm = tl.load(x_ptr + m * stride_xm + k, mask=k_in & (m < M), other=0.0)  # [BLOCK_K]
                if NORM:
                    xm = _normed(xm, norm_ptr, k, k_in, tl.sum(tl.where(rows == m, rstd, 0.0), axis=0))
                part = tl.sum(wf * xm.to(tl.float32)[None, :], axis=1)  # [BLOCK_H]
                acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
        else:
            xv = tl.load(x_rows + k[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0)  # [M_PAD, BLOCK_K]
            if NORM:
                xv = _normed(xv, norm_ptr, k, k_in, rstd[:, None])
            acc_t = mma(w, tl.trans(xv), acc_t, DOT_IN_FP32)
    if M_PAD == 1:
        acc = tl.sum(acc2, axis=1)[None, :]
    elif M_PAD >= 16:
        acc = tl.trans(acc_t)
    return acc


@triton.jit
def _fold_down(w, h, down_t_ptr, fold_ptr, units, on, D, stride_dh, BLOCK_K: tl.constexpr):
    """K1's folded tail at one token: fold[0, :] += Σ over the block's units of h_j · down_t[j, :] in fp32,
    h [1, BLOCK_H] rounded to x's dtype first (as K2 reads h_t), by relaxed atomic adds; w the first down
    tile [BLOCK_H, BLOCK_K] (loaded by the caller while the up product runs), rows off `on` not read."""
    hq = tl.sum(h, axis=0).to(down_t_ptr.dtype.element_ty).to(tl.float32)  # [BLOCK_H]
    offs_k = tl.arange(0, BLOCK_K)
    d_rows = down_t_ptr + units.to(tl.int64)[:, None] * stride_dh  # [BLOCK_H, 1]
    for k0 in range(0, D, BLOCK_K):
        k = k0 + BLOCK_K + offs_k  # the next step's columns; past D on the last step: masked, no traffic
        w_next = tl.load(d_rows + k[None, :], mask=on[:, None] & (k < D)[None, :], other=0.0)
        cols = k0 + offs_k
        part = tl.sum(hq[:, None] * w.to(tl.float32), axis=0)  # [BLOCK_K]
        tl.atomic_add(fold_ptr + cols, part, mask=cols < D, sem="relaxed")
        w = w_next


@triton.jit
def _compact_up(x_ptr, up_ptr, h_ptr, units, active, rows, row_in, D, stride_xm, stride_uh, stride_hm, stride_hh,
                norm_ptr, rstd, M_PAD: tl.constexpr, UP_K: tl.constexpr, UP_STAGES: tl.constexpr,
                NORM: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """K1's up pass over the block's active units only (3+ tokens, config.compact_up), after relu(p) is
    stored to h_t for every unit: the active units gathered 16 at a time (slot = rank among the block's
    active units), u = x up^T over D in UP_K-column steps (UP_STAGES-deep pipeline; a 16-row tile lets the
    step be long), and h_t[unit] = relu(p) ⊙ u rounded once, as the masked pass rounds it."""
    G: tl.constexpr = 16  # gathered units per group, tl.dot's least M
    n_active = tl.sum(active, axis=0)
    slot = tl.cumsum(active, axis=0) - active  # [BLOCK_H] rank among the block's active units
    g_rows = tl.arange(0, G)
    offs_k = tl.arange(0, UP_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [M_PAD, 1]
    for g0 in range(0, n_active, G):
        pick = (slot[None, :] == (g0 + g_rows)[:, None]) & (active != 0)[None, :]  # [G, BLOCK_H] one-hot
        units_g = tl.sum(tl.where(pick, units[None, :], 0), axis=1)  # [G] the group's units
        valid = (g0 + g_rows) < n_active  # [G]
        w_rows = up_ptr + units_g.to(tl.int64)[:, None] * stride_uh  # [G, 1]
        acc_t = tl.zeros((G, M_PAD), dtype=tl.float32)  # [G, M_PAD] u^T
        for k0 in tl.range(0, D, UP_K, num_stages=UP_STAGES):
            k = k0 + offs_k
            k_in = k < D
            w = tl.load(w_rows + k[None, :], mask=valid[:, None] & k_in[None, :], other=0.0)  # [G, UP_K]
            xv = tl.load(x_rows + k[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0)  # [M_PAD, UP_K]
            if NORM:
                xv = _normed(xv, norm_ptr, k, k_in, rstd[:, None])
            acc_t = mma(w, tl.trans(xv), acc_t, DOT_IN_FP32)
        h_ptrs = h_ptr + units_g.to(tl.int64)[:, None] * stride_hh + rows[None, :] * stride_hm  # [G, M_PAD]
        h_in = valid[:, None] & row_in[None, :]
        hv = tl.load(h_ptrs, mask=h_in, other=0.0)  # relu(p), stored by this program before the barrier
        tl.store(h_ptrs, (hv.to(tl.float32) * acc_t).to(h_ptr.dtype.element_ty), mask=h_in)


@triton.jit(do_not_specialize=["M"])
def _decode_gate_up_kernel(
    x_ptr,  # [M, D]
    norm_ptr,  # [D] RMSNorm weight applied to x first (NORM), else None
    first_ptr,  # [H, D] gate (gated) or up (non-gated)
    up_ptr,  # [H, D] up (gated), else unused
    threshold_ptr,  # [H] fp32, or None when not HAS_THRESHOLD
    h_ptr,  # out, x's dtype: h_t [H, M_PAD] (stride_hm 1, stride_hh M_PAD) or h [M, H] (H, 1)
    flags_ptr,  # [H] int32 out
    count_ptr,  # [n_counts] int32 out: zeros (K2's arrival counters)
    down_t_ptr,  # [H, D] (FOLD), else None
    fold_ptr,  # [1, D] fp32 (FOLD): the MLP's output added into it, else None
    M,
    D,
    H,
    n_counts,
    eps,
    stride_xm,
    stride_fh,
    stride_uh,
    stride_hm,
    stride_hh,
    stride_dh,
    GATED: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    ACT: tl.constexpr,  # 0: sparse relu (up rows of inactive units never read); 1: dense relu; 2: dense silu
    NORM: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STREAM: tl.constexpr,  # one token: _streamed_dot's loop
    ONE_STEP: tl.constexpr,  # D <= BLOCK_K (with STREAM: the whole row in one tile, no next tile)
    FOLD: tl.constexpr,  # one token, sparse: the down product too (_fold_down), nothing written to h_t or flags
    COMPACT_UP: tl.constexpr,  # 3+ tokens, sparse, gated: the up pass over the active units gathered (_compact_up)
    UP_K: tl.constexpr,
    UP_STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,  # with PDL and STREAM at one token: the first gate tile loaded before pdl_wait
    PDL: tl.constexpr,  # launched as a programmatic dependent: nothing but weights read before pdl_wait
    DOT_IN_FP32: tl.constexpr,
):
    COMPACT: tl.constexpr = COMPACT_UP and GATED and ACT == 0 and M_PAD >= 16  # _compact_up reads the up rows
    EARLY: tl.constexpr = PREFETCH and PDL and STREAM and M_PAD == 1
    pdl_launch_dependents(PDL)
    units = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    unit_in = units < H
    if EARLY:  # weights: no launch writes them
        w0 = _weight_tile(first_ptr, units, unit_in, D, stride_fh, BLOCK_K)
    pdl_wait(PDL)
    rows = tl.arange(0, M_PAD)  # [M_PAD]
    row_in = rows < M
    out_dtype = x_ptr.dtype.element_ty  # h's

    if not FOLD and tl.program_id(0) == 0:
        for c0 in range(0, n_counts, 1024):
            c = c0 + tl.arange(0, 1024)
            tl.store(count_ptr + c, tl.zeros((1024,), tl.int32), mask=c < n_counts)
    rstd = tl.zeros((M_PAD,), dtype=tl.float32)
    if STREAM and M_PAD == 1:  # the norm's pass behind the first gate tile's load
        if not EARLY:
            w0 = _weight_tile(first_ptr, units, unit_in, D, stride_fh, BLOCK_K)
        acc, rstd = _streamed_dot(w0, x_ptr, None, first_ptr, units, unit_in, D, stride_fh, norm_ptr, rstd, eps,
                                  NORM, NORM, BLOCK_H, BLOCK_K, ONE_STEP, False)
    else:
        if NORM:  # every program normalizes the few rows of x itself (an L2-resident re-read)
            rstd = _rows_rstd(x_ptr, None, rows, row_in, D, stride_xm, 0, eps, M_PAD, BLOCK_K, False)
        acc = _rows_normed_dot(x_ptr, first_ptr, units, unit_in, rows, row_in, M, D, stride_xm, stride_fh, norm_ptr,
                               rstd, M_PAD, BLOCK_H, BLOCK_K, NORM, False, False, DOT_IN_FP32)  # [M_PAD, BLOCK_H] fp32
    if ACT == 0:
        if HAS_THRESHOLD:
            theta = tl.load(threshold_ptr + units, mask=unit_in, other=0.0)  # [BLOCK_H] fp32
            acc = acc - theta[None, :]
        p = acc.to(out_dtype)  # [M_PAD, BLOCK_H] rounded once, as the prefill kernels
        on = ~(p <= 0) & row_in[:, None] & unit_in[None, :]  # [M_PAD, BLOCK_H] > 0 or NaN
        active = tl.max(on.to(tl.int32), axis=0)  # [BLOCK_H] 1 if any token
        h = tl.where(on, p, 0.0).to(tl.float32)  # relu(p), NaN kept
        if FOLD:  # the host takes it only at one token
            if tl.max(active, axis=0) != 0:  # a block with no active unit reads no up or down row
                unit_on = active != 0
                w_down = _weight_tile(down_t_ptr, units, unit_on, D, stride_dh, BLOCK_K)  # in flight during the up pass
                if GATED:
                    h = h * _rows_normed_dot(x_ptr, up_ptr, units, unit_on, rows, row_in, M, D, stride_xm, stride_uh,
                                             norm_ptr, rstd, M_PAD, BLOCK_H, BLOCK_K, NORM, STREAM, ONE_STEP,
                                             DOT_IN_FP32)  # [1, BLOCK_H]
                _fold_down(w_down, h, down_t_ptr, fold_ptr, units, unit_on, D, stride_dh, BLOCK_K)
        elif GATED and not COMPACT:  # else _compact_up reads the up rows
            if tl.max(active, axis=0) != 0:  # a block with no active unit reads no up row
                u = _rows_normed_dot(x_ptr, up_ptr, units, active != 0, rows, row_in, M, D, stride_xm, stride_uh,
                                     norm_ptr, rstd, M_PAD, BLOCK_H, BLOCK_K, NORM, STREAM, ONE_STEP,
                                     DOT_IN_FP32)  # [M_PAD, BLOCK_H] fp32, 0 off `active`
                h = h * u
    else:  # dense, rounded as the torch MLP rounds: act(g) and u in x's dtype, then their product
        g = acc.to(out_dtype)  # [M_PAD, BLOCK_H]
        if HAS_THRESHOLD:
            theta = tl.load(threshold_ptr + units, mask=unit_in, other=0.0).to(out_dtype)  # [BLOCK_H]
            g = (g.to(tl.float32) - theta.to(tl.float32)[None, :]).to(out_dtype)
        gf = g.to(tl.float32)
        if ACT == 1:
            h = tl.where(gf < 0, 0.0, gf).to(out_dtype).to(tl.float32)  # relu, NaN kept
        else:
            h = (gf / (1.0 + tl.exp(-gf))).to(out_dtype).to(tl.float32)  # silu
        if GATED:
            u = _rows_normed_dot(x_ptr, up_ptr, units, unit_in, rows, row_in, M, D, stride_xm, stride_uh, norm_ptr,
                                 rstd, M_PAD, BLOCK_H, BLOCK_K, NORM, STREAM, ONE_STEP,
                                 DOT_IN_FP32)  # [M_PAD, BLOCK_H] fp32
            h = h * u.to(out_dtype).to(tl.float32)
        active = unit_in.to(tl.int32)  # K2 then reads every unit
    if not FOLD:
        h_ptrs = h_ptr + units.to(tl.int64)[None, :] * stride_hh + rows[:, None] * stride_hm  # [M_PAD, BLOCK_H]
        tl.store(h_ptrs, h.to(out_dtype), mask=row_in[:, None] & unit_in[None, :])
        tl.store(flags_ptr + units, active, mask=unit_in)
    if COMPACT:
        tl.debug_barrier()  # the h_t rows this program stored are what _compact_up reads back
        _compact_up(x_ptr, up_ptr, h_ptr, units, active, rows, row_in, D, stride_xm, stride_uh, stride_hm,
                    stride_hh, norm_ptr, rstd, M_PAD, UP_K, UP_STAGES, NORM, DOT_IN_FP32)


@triton.jit
def _plus_residual(acc, res_ptr, rows, cols, stride_rm, out, RESIDUAL: tl.constexpr, dtype: tl.constexpr):
    """acc [R, BLOCK_D] fp32 rounded to dtype; RESIDUAL: plus res[rows, cols], rounded again (torch's
    `residual + mlp(x)` in dtype)."""
    y = acc.to(dtype)
    if RESIDUAL:
        r = tl.load(res_ptr + rows.to(tl.int64)[:, None] * stride_rm + cols[None, :], mask=out, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
    return y


@triton.jit(do_not_specialize=["M"])
def _decode_down_kernel(
    h_ptr,  # [H, M_PAD] x's dtype (h_t)
    flags_ptr,  # [H] int32 (not read with ALL_UNITS)
    list_ptr,  # [H] int32 scratch: the active units of each span, ascending
    down_t_ptr,  # [H, D]
    y_ptr,  # [M, D] out, x's dtype
    res_ptr,  # [M, D] added to y (RESIDUAL; may be y itself), else None
    part_ptr,  # [SPLIT, M, D] fp32 scratch: each span's partial sum (SPLIT > 1)
    count_ptr,  # [cdiv(D, BLOCK_D)] int32, zero on entry: spans done per column block (SPLIT > 1)
    M,
    D,
    H,
    stride_dh,
    stride_ym,
    stride_rm,
    M_PAD: tl.constexpr,
    ROWS: tl.constexpr,  # 1 (CUDA-core products) or M_PAD padded to >= 16 (tl.dot)
    SPLIT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PREFIX: tl.constexpr,  # flags per step of the compaction
    ALL_UNITS: tl.constexpr,  # the dense MLP: every unit of the span, no flags read, no list
    RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent: nothing read or written before pdl_wait
    DOT_IN_FP32: tl.constexpr,
):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    c_block = tl.program_id(0)
    span = tl.cdiv(H, SPLIT)
    lo = tl.program_id(1) * span
    hi = tl.minimum(H, lo + span)
    if ALL_UNITS:
        n_active = hi - lo
    else:
        # 1. the span's active units, compacted in ascending order (the same list in every program of the span)
        n_active = tl.sum(tl.zeros((1,), tl.int32), axis=0)
        for u0 in range(lo, hi, PREFIX):
            u = u0 + tl.arange(0, PREFIX)  # [PREFIX]
            f = tl.load(flags_ptr + u, mask=u < hi, other=0)  # [PREFIX] int32
            tl.store(list_ptr + lo + n_active + tl.cumsum(f, 0) - f, u, mask=f != 0)
            n_active += tl.sum(f, axis=0)
        tl.debug_barrier()  # the list this program stored is what it reads below
    # 2. the span's part of y[:, cols], ascending units, BLOCK_S at a time
    cols = c_block * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    col_in = cols < D
    rows = tl.arange(0, ROWS)  # [ROWS]
    row_in = rows < M
    if ROWS == 1:
        acc2 = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)  # [BLOCK_S, BLOCK_D] products, summed once
    else:
        acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)  # [ROWS, BLOCK_D] fp32
    for s0 in range(0, n_active, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)  # [BLOCK_S]
        valid = s < n_active
        if ALL_UNITS:
            units = (lo + s).to(tl.int64)
        else:
            units = tl.load(list_ptr + lo + s, mask=valid, other=0).to(tl.int64)  # [BLOCK_S]
        w = tl.load(down_t_ptr + units[:, None] * stride_dh + cols[None, :],
                    mask=valid[:, None] & col_in[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
        if ROWS == 1:
            hv = tl.load(h_ptr + units, mask=valid, other=0.0)  # [BLOCK_S]
            acc2 += hv.to(tl.float32)[:, None] * w.to(tl.float32)
        else:
            hv = tl.load(h_ptr + units[None, :] * M_PAD + rows[:, None],
                         mask=row_in[:, None] & valid[None, :], other=0.0)  # [ROWS, BLOCK_S]
            acc = mma(hv, w, acc, DOT_IN_FP32)
    if ROWS == 1:
        acc = tl.sum(acc2, axis=0)[None, :]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    out = row_in[:, None] & col_in[None, :]
    if SPLIT == 1:
        tl.store(y_ptrs, _plus_residual(acc, res_ptr, rows, cols, stride_rm, out, RESIDUAL, y_ptr.dtype.element_ty),
                 mask=out)
    else:
        # 3. the span's partial to scratch; the last span to finish this column block sums all spans
        # in span order (deterministic whichever arrives last) and writes y
        parts = part_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :]  # span 0's [ROWS, BLOCK_D]
        tl.store(parts + tl.program_id(1).to(tl.int64) * M * D, acc, mask=out)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        if tl.atomic_add(count_ptr + c_block, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
            for t in range(SPLIT):
                total += tl.load(parts + t * M * D, mask=out, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, _plus_residual(total, res_ptr, rows, cols, stride_rm, out, RESIDUAL,
                                            y_ptr.dtype.element_ty), mask=out)


_gate_up_launch = Launcher(_decode_gate_up_kernel)
_down_launch = Launcher(_decode_down_kernel)


@functools.lru_cache(maxsize=256)
def fitted(config: DecodeConfig, k: int) -> DecodeConfig:
    """config with its K steps no wider than the reduction length k needs (a 2048-wide step over a
    64-wide row only masks; the interpreter pays for every masked element)."""
    return dataclasses.replace(config, block_k=min(config.block_k, max(16, next_power_of_2(k))))


def m_pad(m: int) -> int:
    """The kernels' padded token count: 1, 2, or the smallest of 16 / 32 / 64 holding m (from 3 tokens
    on, tl.dot on padded rows beats the CUDA-core products)."""
    return m if m <= 2 else max(16, 1 << (m - 1).bit_length())


def down_block(config: DecodeConfig, d: int, sms: int) -> int:
    """K2's output columns per program: config.block_d, or the widest power of two (>= 16) that still
    gives at least half the SMs a program."""
    if config.block_d is not None:
        return config.block_d
    return max(16, 1 << max(0, (2 * d // sms).bit_length() - 1))


def decode_mlp(
    x: torch.Tensor,
    first_weight: torch.Tensor,
    up_weight: torch.Tensor | None,
    down_t: torch.Tensor,
    threshold: torch.Tensor | None = None,
    *,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """y [M, D] = down(relu(x first^T - θ) ⊙ (x up^T)) (up_weight=None: down(relu(x first^T - θ))),
    for x [M, D] with 1 <= M <= MAX_TOKENS. first_weight / up_weight: [H, D]; down_t: [H, D], the
    transposed down_proj.weight; all in x's dtype (bf16 / fp16) and device, unit stride along D;
    threshold fp32 [H] or None. The module docstring has the contract."""
    m, d = check_few_tokens(x, MAX_TOKENS)
    h = first_weight.shape[0]
    named = {"first_weight": first_weight, "down_t": down_t}
    if up_weight is not None:
        named["up_weight"] = up_weight
    for name, w in named.items():
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
        if tuple(w.shape) != (h, d):
            raise ValueError(f"{name} must be [H, D] = [{h}, {d}], got {list(w.shape)}")
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"{name} must be {x.dtype} on {x.device} like x, got {w.dtype} on {w.device}")
        if d > 1 and w.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along D, got strides {w.stride()}")
    if d > 1 and x.stride(1) != 1:
        raise ValueError(f"x must have unit stride along D, got strides {x.stride()}")
    if threshold is not None and (not isinstance(threshold, torch.Tensor) or threshold.dtype != torch.float32
                                  or tuple(threshold.shape) != (h,) or threshold.device != x.device):
        raise ValueError(f"threshold must be None or an fp32 tensor [H] = [{h}] on {x.device}")
    if not x.is_cuda and not interpreting():
        raise ValueError(f"x must be a CUDA tensor (CPU tensors run only under TRITON_INTERPRET=1), got {x.device}")
    check_capability(x.device)
    if config is not None and not isinstance(config, DecodeConfig):
        raise TypeError(f"config must be None or a DecodeConfig, got {type(config).__name__}")
    return launch_decode_mlp(x, first_weight, up_weight, down_t, threshold, config=config)


def launch_decode_mlp(x, first_weight, up_weight, down_t, threshold, *, config=None, norm_weight=None, eps=0.0,
                      residual=False, act="sparse", fold_into=None) -> torch.Tensor:
    """`decode_mlp` on arguments that meet its contract, unchecked. Fused variants (the decode engine's):
    norm_weight: x goes through RMSNorm(norm_weight, eps) first, in K1; residual: returns x + the MLP's
    output (added in K2's write); act "relu" / "silu": the dense MLP, every unit read and rounded as
    torch rounds it (K2 then sums every unit). fold_into (one token, sparse; fp32 [1, D]): K1 alone,
    the MLP's output added into it unrounded (atomic adds, in no fixed order) and fold_into returned.
    fp32 x and weights run exactly (tl.dot in IEEE fp32)."""
    m, d = x.shape
    h = first_weight.shape[0]
    if fold_into is not None and (m != 1 or act != "sparse"):
        raise ValueError(f"fold_into is for the sparse MLP at one token, got {m} tokens and act {act!r}")
    if fold_into is None:
        y = torch.empty((m, d), dtype=x.dtype, device=x.device)
        if d == 0:
            return y
        if h == 0:
            return y.copy_(x) if residual else y.zero_()
    elif d == 0 or h == 0:
        return fold_into
    mp = m_pad(m)
    if config is None:
        config = default_config(mp, capability(x.device), dense=act != "sparse", norm=norm_weight is not None)
    elif mp >= 16 and config.block_h < 16:
        raise ValueError(f"config.block_h must be >= 16 for {m} tokens (tl.dot), got {config.block_h}")
    config = fitted(config, d)
    if fold_into is not None:
        launch_gate_up(x, norm_weight, eps, first_weight, up_weight, threshold, None, 1, 1, None, None, 0, config,
                       act, down_t=down_t, fold_into=fold_into)
        return fold_into
    hidden = torch.empty((h, mp), dtype=x.dtype, device=x.device)  # h_t
    scratch, n_counts = down_scratch(config, d, h, x.device)
    launch_gate_up(x, norm_weight, eps, first_weight, up_weight, threshold, hidden, 1, mp, scratch[:h],
                   scratch[2 * h:], n_counts, config, act)
    launch_down(hidden, scratch, down_t, y, x if residual else None, config, act)
    return y


def down_grid(config: DecodeConfig, d: int, h: int, device: torch.device) -> tuple[int, int, int]:
    """K2's (columns per program, column blocks, spans) for width d and h units on `device`."""
    block_d = down_block(config, d, num_sms(device) if device.type == "cuda" else 4)
    return block_d, cdiv(d, block_d), min(config.split, h)


def down_scratch(config: DecodeConfig, d: int, h: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """K2's int32 scratch (flags [H], list [H], counters [column blocks]) and how many counters K1 zeroes
    (none with one span)."""
    _, col_blocks, split = down_grid(config, d, h, device)
    return torch.empty(2 * h + col_blocks, dtype=torch.int32, device=device), col_blocks if split > 1 else 0


def launch_down(hidden, scratch, down_t, y, residual, config, act) -> None:
    """K2 into y [M, D] from K1's h_t `hidden` [H, M_PAD] and `down_scratch`'s scratch (counters zeroed
    by K1); residual [M, D] added, or None; config fitted (`launch_decode_mlp`)."""
    m, d = y.shape
    h, mp = hidden.shape
    block_d, col_blocks, split = down_grid(config, d, h, y.device)
    parts = torch.empty((split, m, d) if split > 1 else (0,), dtype=torch.float32, device=y.device)
    _down_launch[(col_blocks, split)](
        hidden, scratch[:h], scratch[h:2 * h], down_t, y, residual, parts, scratch[2 * h:], m, d, h, down_t.stride(0),
        y.stride(0), 0 if residual is None else residual.stride(0),
        M_PAD=mp, ROWS=down_rows(mp), SPLIT=split, BLOCK_S=config.block_s, BLOCK_D=block_d, PREFIX=config.prefix,
        ALL_UNITS=act != "sparse", RESIDUAL=residual is not None,
        DOT_IN_FP32=interpreting() or y.dtype == torch.float32, num_warps=config.down_warps,
        num_stages=config.down_stages, **pdl_options(config.pdl, y.device),
    )


ACTS = {"sparse": 0, "relu": 1, "silu": 2}  # K1's ACT: sparse relu, or the dense MLP with this activation


def launch_gate_up(x, norm_weight, eps, first_weight, up_weight, threshold, hidden, stride_hm, stride_hh, flags,
                   counts, n_counts, config, act, down_t=None, fold_into=None) -> None:
    """K1 into `hidden` (h_t [H, M_PAD]: strides 1, M_PAD; or h [M, H]: H, 1), `flags` [H] and zeroed
    `counts` [n_counts]; or, fold_into given (with down_t), the MLP's output added into it (the folded
    K1: hidden, flags and counts unused). Arguments as `launch_decode_mlp`'s."""
    m, d = x.shape
    if config.stream and m != 1:
        raise ValueError(f"config.stream is a one-token field, got {m} tokens")
    if config.prefetch and not config.stream:
        raise ValueError("config.prefetch loads the first tile of the streamed one-token loop: it needs "
                         "config.stream")
    if config.compact_up and m_pad(m) < 16:
        raise ValueError(f"config.compact_up is for 3 or more tokens (tl.dot rows), got {m}")
    h = first_weight.shape[0]
    gated = up_weight is not None
    up = up_weight if gated else first_weight
    _gate_up_launch[(cdiv(h, config.block_h),)](
        x, norm_weight, first_weight, up, threshold, hidden, flags, counts, down_t, fold_into, m, d, h, n_counts,
        float(eps), x.stride(0), first_weight.stride(0), up.stride(0), stride_hm, stride_hh,
        0 if down_t is None else down_t.stride(0),
        GATED=gated, HAS_THRESHOLD=threshold is not None, ACT=ACTS[act], NORM=norm_weight is not None,
        M_PAD=m_pad(m), BLOCK_H=config.block_h, BLOCK_K=config.block_k, STREAM=config.stream,
        ONE_STEP=d <= config.block_k, FOLD=fold_into is not None,
        COMPACT_UP=config.compact_up and act == "sparse", UP_K=min(config.up_k, max(16, next_power_of_2(d))),
        UP_STAGES=config.up_stages, PREFETCH=config.prefetch, DOT_IN_FP32=interpreting() or x.dtype == torch.float32,
        num_warps=config.gate_warps, num_stages=config.gate_stages, **pdl_options(config.pdl, x.device),
    )
