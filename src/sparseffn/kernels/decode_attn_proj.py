"""The projections around decode attention, each one launch that reads its weights once per call.

    K_qkv _decode_qkv_rope_kernel, grid (cdiv(Hq·d/2, P) + 2·cdiv(Hkv·d/2, P),), P = BLOCK_N / 2:
        program p owns P rotary pairs (i, i + d/2) of one of q, k, v (q's blocks first, then k's, v's);
        pair g is head g // (d/2), dim i = g % (d/2), weight rows head·d + i and head·d + i + d/2.
        n[m] = round(round(x[m] · rstd[m]) · norm_weight) (Llama's RMSNorm; each program recomputes
        rstd from x, which is L2-resident), y = n · w^T (+ bias) in fp32, rounded (as nn.Linear),
        q and k rotated at positions[m] in fp32 and rounded once; q -> q_out [M, Hq·d], k and v ->
        k_cache / v_cache [m, head, positions[m], :].
    K_o   _decode_out_proj_kernel, grid (cdiv(N, BLOCK_N),): y = residual + round(attn · wo^T (+ bo)),
        rounded (as o_proj then the residual add in Hugging Face's layer), products by
        decode_mlp._rows_normed_dot (no norm). One token with config.stream: both kernels' products by
        decode_mlp._streamed_dot (the same norm roundings), the next step's tiles loaded a step ahead.
        config.pdl (Hopper on): both launched as programmatic dependents (_runtime); with config.prefetch
        at one token (streamed, or o_proj in one K step) the first weight tile is loaded before the wait.
    PENDING: x (K_qkv) and the residual (K_o) are round(x + round(pending)), pending the fp32 output of the
        MLP before (decode_mlp's folded K1 leaves it unadded); K_o then zeroes its columns of it.

Why. At decode (M <= 64 tokens, one per sequence) a projection is a read of its matrix: time is the weight
bytes over the bandwidth plus one launch, so each step's norm, bias, RoPE, cache write and residual add ride
along in the projection's launch instead of costing their own. Each weight byte is read once per call.

Layouts. x [M, D], attn [M, K], residual / y [M, N]: unit stride along the last dim, any row stride;
weights [N, D] unit stride along D, any row stride; cos / sin tables [S, d] any float dtype, unit
stride along d; positions [M] int32 / int64; caches [B, H, S_max, d] unit stride along d. M_PAD is
decode_mlp.m_pad(M): 1 and 2 use CUDA-core products (each weight tile loaded once, multiplied by the
tokens), 16 / 32 / 64 tl.dot on zero-padded tokens with the units as the MMA's M dimension (as in
decode_mlp). _normed_rows_dot normalizes each x tile between its load and the product (Llama rounds
x·rstd and its product with the norm weight before the projection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import (capability, cdiv, interpreting, mma, pdl_launch_dependents, pdl_options,
                                        pdl_wait)
from sparseffn.kernels.configs.decode_attention import ProjectionConfig, projection_config
from sparseffn.kernels.decode_mlp import _rows_normed_dot, _streamed_dot, _weight_tile, _x_tile, m_pad
from sparseffn.kernels.launch import Launcher

__all__ = ["launch_decode_out_proj", "launch_decode_qkv_rope"]


@triton.jit
def _rstd(sum_sq, D, eps):
    """[M_PAD] fp32 1 / sqrt(mean(x²) + eps) from the rows' sums of squares, correctly rounded (as
    the project's RMSNorm kernel)."""
    return tl.math.div_rn(tl.full(sum_sq.shape, 1.0, tl.float32), tl.sqrt_rn(sum_sq / D + eps))


@triton.jit
def _normed_product(acc, w, xv, g, rstd, dtype, M_PAD: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """acc + the products of the w tile [BLOCK_N, BLOCK_K] with the normed x tile [M_PAD, BLOCK_K]:
    n = round(round(x · rstd) · g), Llama's rounding points."""
    n = (xv.to(tl.float32) * rstd[:, None]).to(dtype)
    n = (n.to(tl.float32) * g.to(tl.float32)[None, :]).to(dtype)  # [M_PAD, BLOCK_K] the norm's output
    if M_PAD < 16:
        acc += w.to(tl.float32)[None, :, :] * n.to(tl.float32)[:, None, :]  # [M_PAD, BLOCK_N, BLOCK_K]
    else:
        acc = mma(w, tl.trans(n), acc, DOT_IN_FP32)  # [BLOCK_N, M_PAD]
    return acc


@triton.jit
def _normed_rows_dot(x_ptr, pending_ptr, norm_ptr, w_ptr, units, unit_in, rows, row_in, D, eps, stride_xm, stride_pm,
                     stride_w, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     ONE_STEP: tl.constexpr, PENDING: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """[M_PAD, BLOCK_N] fp32: n[rows] · w[units]^T over all of D, n the RMS-normed x (module
    docstring). ONE_STEP (D <= BLOCK_K): the weight, x and norm tiles are loaded together and rstd
    comes from the x tile in registers, one memory round trip. Else a first pass over x (L2-resident)
    gives rstd, then the product loop normalizes each x tile. PENDING: x as decode_mlp._x_tile reads it."""
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + units.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [M_PAD, 1]
    p_rows = pending_ptr + rows.to(tl.int64)[:, None] * stride_pm if PENDING else None
    dtype = x_ptr.dtype.element_ty
    if M_PAD < 16:
        acc = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)  # products, summed once
    else:
        acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    if ONE_STEP:
        k_in = offs_k < D
        w = tl.load(w_rows + offs_k[None, :], mask=unit_in[:, None] & k_in[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        xv = _x_tile(x_rows, p_rows, offs_k[None, :], row_in[:, None] & k_in[None, :], PENDING)  # [M_PAD, BLOCK_K]
        g = tl.load(norm_ptr + offs_k, mask=k_in, other=0.0)  # [BLOCK_K]
        xf = xv.to(tl.float32)
        rstd = _rstd(tl.sum(xf * xf, axis=1), D, eps)  # [M_PAD]
        acc = _normed_product(acc, w, xv, g, rstd, dtype, M_PAD, DOT_IN_FP32)
    else:
        sq = tl.zeros((M_PAD,), dtype=tl.float32)
        for k0 in tl.range(0, D, BLOCK_K, loop_unroll_factor=4):  # unrolled: the x loads are in flight together
            k = k0 + offs_k
            xf = _x_tile(x_rows, p_rows, k[None, :], row_in[:, None] & (k < D)[None, :], PENDING).to(tl.float32)
            sq += tl.sum(xf * xf, axis=1)
        rstd = _rstd(sq, D, eps)
        for k0 in range(0, D, BLOCK_K):
            k = k0 + offs_k
            k_in = k < D
            w = tl.load(w_rows + k[None, :], mask=unit_in[:, None] & k_in[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            xv = _x_tile(x_rows, p_rows, k[None, :], row_in[:, None] & k_in[None, :], PENDING)  # [M_PAD, BLOCK_K]
            g = tl.load(norm_ptr + k, mask=k_in, other=0.0)  # [BLOCK_K]
            acc = _normed_product(acc, w, xv, g, rstd, dtype, M_PAD, DOT_IN_FP32)
    if M_PAD < 16:
        out = tl.sum(acc, axis=2)
    else:
        out = tl.trans(acc)
    return out


@triton.jit(do_not_specialize=["M"])
def _decode_qkv_rope_kernel(
    x_ptr,  # [M, D]
    pending_ptr,  # [M, D] fp32 (PENDING): the previous MLP's output, added to x before the norm; else None
    norm_ptr,  # [D]
    wq_ptr,  # [Hq·d, D]
    wk_ptr,  # [Hkv·d, D]
    wv_ptr,  # [Hkv·d, D]
    bq_ptr,  # [Hq·d] or None
    bk_ptr,
    bv_ptr,
    cos_ptr,  # [S, d]
    sin_ptr,  # [S, d]
    pos_ptr,  # [M] int32 / int64
    q_ptr,  # [M, Hq·d] out
    k_cache_ptr,  # [B, Hkv, S_max, d] written at [m, :, pos[m]]
    v_cache_ptr,
    M,
    D,
    HQ,
    HKV,
    eps,
    stride_xm,
    stride_pm,
    stride_wq,
    stride_wk,
    stride_wv,
    stride_cos,
    stride_sin,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    HEAD_DIM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PENDING: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_STEP: tl.constexpr,  # D <= BLOCK_K
    STREAM: tl.constexpr,  # one token: decode_mlp._streamed_dot's loop
    PREFETCH: tl.constexpr,  # with PDL and STREAM at one token: the first weight tile loaded before pdl_wait
    PDL: tl.constexpr,  # launched as a programmatic dependent: nothing but weights read before pdl_wait
    DOT_IN_FP32: tl.constexpr,
):
    EARLY: tl.constexpr = PREFETCH and PDL and STREAM and M_PAD == 1
    pdl_launch_dependents(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    PAIRS: tl.constexpr = BLOCK_N // 2
    pid = tl.program_id(0)
    blocks_q = tl.cdiv(HQ * HALF, PAIRS)
    blocks_kv = tl.cdiv(HKV * HALF, PAIRS)
    # which matrix: 0 q, 1 k, 2 v
    region = 0
    block = pid
    w_ptr = wq_ptr
    b_ptr = bq_ptr
    stride_w = stride_wq
    n_pairs = HQ * HALF
    if pid >= blocks_q + blocks_kv:
        region = 2
        block = pid - blocks_q - blocks_kv
        w_ptr = wv_ptr
        b_ptr = bv_ptr
        stride_w = stride_wv
        n_pairs = HKV * HALF
    elif pid >= blocks_q:
        region = 1
        block = pid - blocks_q
        w_ptr = wk_ptr
        b_ptr = bk_ptr
        stride_w = stride_wk
        n_pairs = HKV * HALF

    # units interleaved as (pair, half): unit 2p is pair p's dim i, unit 2p + 1 its dim i + d/2
    j = tl.arange(0, BLOCK_N)
    pair = block * PAIRS + j // 2  # [BLOCK_N]
    unit_in = pair < n_pairs
    units = (pair // HALF) * HEAD_DIM + pair % HALF + (j % 2) * HALF  # [BLOCK_N] weight rows
    if EARLY:  # weights: no launch writes them
        w0 = _weight_tile(w_ptr, units, unit_in, D, stride_w, BLOCK_K)
    pdl_wait(PDL)
    rows = tl.arange(0, M_PAD)  # [M_PAD] tokens
    row_in = rows < M
    # this program's pairs, and their rotary entries at each token's position: loaded first, so
    # their latency hides behind the weight stream
    p = block * PAIRS + tl.arange(0, PAIRS)  # [PAIRS]
    p_in = p < n_pairs
    head = (p // HALF).to(tl.int64)
    i = p % HALF
    pos = tl.load(pos_ptr + rows, mask=row_in, other=0).to(tl.int64)  # [M_PAD]
    mask = row_in[:, None] & p_in[None, :]  # [M_PAD, PAIRS]
    rope_mask = mask & (region < 2)
    cos_row = cos_ptr + pos[:, None] * stride_cos + i[None, :]  # [M_PAD, PAIRS]
    sin_row = sin_ptr + pos[:, None] * stride_sin + i[None, :]
    c1 = tl.load(cos_row, mask=rope_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + HALF, mask=rope_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row, mask=rope_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + HALF, mask=rope_mask, other=0.0).to(tl.float32)

    if STREAM and M_PAD == 1:  # the same roundings of the norm (decode_mlp._normed_by)
        if not EARLY:
            w0 = _weight_tile(w_ptr, units, unit_in, D, stride_w, BLOCK_K)
        acc, _ = _streamed_dot(w0, x_ptr, pending_ptr, w_ptr, units, unit_in, D, stride_w, norm_ptr,
                               tl.zeros((1,), tl.float32), eps, True, True, BLOCK_N, BLOCK_K, ONE_STEP,
                               PENDING)  # [1, BLOCK_N] fp32
    else:
        acc = _normed_rows_dot(x_ptr, pending_ptr, norm_ptr, w_ptr, units, unit_in, rows, row_in, D, eps, stride_xm,
                               stride_pm, stride_w, M_PAD, BLOCK_N, BLOCK_K, ONE_STEP, PENDING,
                               DOT_IN_FP32)  # [M_PAD, BLOCK_N] fp32
    if HAS_BIAS:
        acc += tl.load(b_ptr + units, mask=unit_in, other=0.0).to(tl.float32)[None, :]
    out_dtype = q_ptr.dtype.element_ty
    acc = acc.to(out_dtype).to(tl.float32)  # rounded as the projection's output
    lo, hi = tl.split(tl.reshape(acc, (M_PAD, PAIRS, 2)))  # [M_PAD, PAIRS] dims i and i + d/2
    if region < 2:  # RoPE, rotate_half layout: (lo, hi) -> (lo c_i - hi s_i, hi c_{i+d/2} + lo s_{i+d/2})
        lo, hi = lo * c1 - hi * s1, hi * c2 + lo * s2
    if region == 0:
        dst = q_ptr
        row_off = rows.to(tl.int64)[:, None] * (HQ * HEAD_DIM)  # [M_PAD, 1]
        col = head * HEAD_DIM + i  # [PAIRS]
    elif region == 1:
        dst = k_cache_ptr
        row_off = rows.to(tl.int64)[:, None] * stride_kb + pos[:, None] * stride_ks
        col = head * stride_kh + i
    else:
        dst = v_cache_ptr
        row_off = rows.to(tl.int64)[:, None] * stride_vb + pos[:, None] * stride_vs
        col = head * stride_vh + i
    ptrs = dst + row_off + col[None, :]  # [M_PAD, PAIRS]
    tl.store(ptrs, lo.to(out_dtype), mask=mask)
    tl.store(ptrs + HALF, hi.to(out_dtype), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _decode_out_proj_kernel(
    a_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] or None
    r_ptr,  # [M, N] residual
    pending_ptr,  # [M, N] fp32 (PENDING): the previous MLP's output, added to the residual first, then zeroed
    y_ptr,  # [M, N] out (may be the residual)
    M,
    N,
    K,
    stride_am,
    stride_w,
    stride_rm,
    stride_pm,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    PENDING: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STREAM: tl.constexpr,  # one token: decode_mlp._streamed_dot's loop
    ONE_STEP: tl.constexpr,  # K <= BLOCK_K
    PREFETCH: tl.constexpr,  # with PDL at one token, streamed or in one step: the first weight tile before pdl_wait
    PDL: tl.constexpr,  # launched as a programmatic dependent: only weights read before pdl_wait
    DOT_IN_FP32: tl.constexpr,
):
    EARLY: tl.constexpr = PREFETCH and PDL and M_PAD == 1 and (ONE_STEP or STREAM)
    pdl_launch_dependents(PDL)
    units = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    unit_in = units < N
    rows = tl.arange(0, M_PAD)
    row_in = rows < M
    if EARLY:  # weights: no launch writes them
        w = _weight_tile(w_ptr, units, unit_in, K, stride_w, BLOCK_K)  # [BLOCK_N, BLOCK_K]
    pdl_wait(PDL)
    if EARLY:  # streamed, or in one step: the products of _rows_normed_dot's one-token step, summed the same way
        acc, _ = _streamed_dot(w, a_ptr, None, w_ptr, units, unit_in, K, stride_w, None, tl.zeros((1,), tl.float32),
                               0.0, False, False, BLOCK_N, BLOCK_K, ONE_STEP, False)  # [1, BLOCK_N] fp32
    else:
        acc = _rows_normed_dot(a_ptr, w_ptr, units, unit_in, rows, row_in, M, K, stride_am, stride_w, None, None,
                               M_PAD, BLOCK_N, BLOCK_K, False, STREAM, ONE_STEP, DOT_IN_FP32)  # [M_PAD, BLOCK_N] fp32
    if HAS_BIAS:
        acc += tl.load(b_ptr + units, mask=unit_in, other=0.0).to(tl.float32)[None, :]
    dtype = y_ptr.dtype.element_ty
    mask = row_in[:, None] & unit_in[None, :]
    p_rows = pending_ptr + rows.to(tl.int64)[:, None] * stride_pm if PENDING else None  # [M_PAD, 1]
    r = _x_tile(r_ptr + rows.to(tl.int64)[:, None] * stride_rm, p_rows, units[None, :], mask, PENDING)
    if PENDING:  # consumed: zeros again for the MLP that adds into it next (the q/k/v launch read it before)
        tl.store(p_rows + units[None, :], tl.zeros((M_PAD, BLOCK_N), tl.float32), mask=mask)
    y = r.to(tl.float32) + acc.to(dtype).to(tl.float32)  # [M_PAD, BLOCK_N]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + units[None, :], y.to(dtype), mask=mask)


_qkv_launch = Launcher(_decode_qkv_rope_kernel)
_out_launch = Launcher(_decode_out_proj_kernel)


def _config(m: int, k: int, device: torch.device, config: ProjectionConfig | None,
            qkv: bool) -> tuple[int, ProjectionConfig]:
    mp = m_pad(m)
    config = config or projection_config(mp, capability(device), qkv, k)
    if mp >= 16 and config.block_n < 16:
        raise ValueError(f"config.block_n must be >= 16 for {m} tokens (tl.dot), got {config.block_n}")
    if (config.stream or config.prefetch) and m != 1:
        raise ValueError(f"config.stream and config.prefetch are one-token fields, got {m} tokens")
    return mp, config


def launch_decode_qkv_rope(hidden, norm_weight, eps, wq, wk, wv, bq, bk, bv, cos_table, sin_table, positions,
                           k_cache, v_cache, pending=None, *, config: ProjectionConfig | None = None) -> torch.Tensor:
    """q [M, Hq, d] (and k, v written into the caches) on arguments that meet ops.decode_qkv_rope's
    contract, unchecked."""
    m, d_model = hidden.shape
    head_dim = cos_table.shape[1]
    hq, hkv = wq.shape[0] // head_dim, wk.shape[0] // head_dim
    q = torch.empty((m, hq, head_dim), dtype=hidden.dtype, device=hidden.device)
    mp, config = _config(m, d_model, hidden.device, config, qkv=True)
    if config.prefetch and not config.stream:
        raise ValueError("config.prefetch loads the first tile of the streamed one-token loop: q/k/v needs "
                         "config.stream")
    pairs = config.block_n // 2
    half = head_dim // 2
    grid = (cdiv(hq * half, pairs) + 2 * cdiv(hkv * half, pairs),)
    has_bias = bq is not None or bk is not None or bv is not None
    if has_bias:  # all three or none in the kernel: a missing one adds zeros
        bq, bk, bv = (b if b is not None else w.new_zeros(w.shape[0]) for b, w in ((bq, wq), (bk, wk), (bv, wv)))
    _qkv_launch[grid](
        hidden, pending, norm_weight, wq, wk, wv, bq, bk, bv, cos_table, sin_table, positions, q, k_cache, v_cache,
        m, d_model, hq, hkv, eps, hidden.stride(0), 0 if pending is None else pending.stride(0), wq.stride(0),
        wk.stride(0), wv.stride(0),
        cos_table.stride(0), sin_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, HAS_BIAS=has_bias, PENDING=pending is not None, M_PAD=mp, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        ONE_STEP=d_model <= config.block_k, STREAM=config.stream, PREFETCH=config.prefetch,
        DOT_IN_FP32=interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(config.pdl, hidden.device),
    )
    return q


def launch_decode_out_proj(attn, wo, bo, residual, out=None, pending=None, *,
                           config: ProjectionConfig | None = None) -> torch.Tensor:
    """residual + attn wo^T (+ bo) into `out` (a new [M, N] tensor when None) on arguments that meet
    ops.decode_out_proj's contract, unchecked; pending (fp32 [M, N]) added to the residual first and
    zeroed."""
    m, k = attn.shape
    n = wo.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=attn.dtype, device=attn.device)
    mp, config = _config(m, k, attn.device, config, qkv=False)
    if config.prefetch and not (config.stream or k <= config.block_k):
        raise ValueError("config.prefetch loads o_proj's first weight tile: it needs config.stream or one K step "
                         f"(block_k >= {k}), got block_k {config.block_k}")
    _out_launch[(cdiv(n, config.block_n),)](
        attn, wo, bo, residual, pending, out, m, n, k, attn.stride(0), wo.stride(0), residual.stride(0),
        0 if pending is None else pending.stride(0), out.stride(0), HAS_BIAS=bo is not None,
        PENDING=pending is not None, M_PAD=mp, BLOCK_N=config.block_n, BLOCK_K=config.block_k, STREAM=config.stream,
        ONE_STEP=k <= config.block_k, PREFETCH=config.prefetch, DOT_IN_FP32=interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(config.pdl, attn.device),
    )
    return out
