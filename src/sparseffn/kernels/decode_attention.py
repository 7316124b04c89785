"""Split-KV attention of one new token per sequence over its KV cache (flash-decoding), one launch.

    grid (B·Hkv, SPLITS): program (b·Hkv + g, s) owns key/value head g of sequence b and the GROUP =
    Hq / Hkv query heads reading it (GQA), and split s of the valid slots lo = valid_from[b] ..
    hi = positions[b]: slots [lo + s·C, min(hi + 1, lo + (s + 1)·C)), C = cdiv(hi + 1 - lo, SPLITS).
        online softmax over its slots, BLOCK_S at a time: scores q·k^T·scaling in fp32 (base 2),
        running max m and sum l, acc = Σ p v in fp32;
        SPLITS == 1: o = acc / l. Else (m, l, acc) go to fp32 scratch and an atomic counter per
        (b, g); the split arriving last combines all SPLITS partials in split order (deterministic
        whichever arrives last; one load of all (m, l), the partials' loads unrolled so they are in
        flight together), writes o and resets the counter to zero for the next call.
    config.pdl (Hopper on): launched as a programmatic dependent (_runtime); config.prefetch: positions,
    valid_from and the first block's slots before positions[b] are read before the wait (the caller's
    contract: no kernel still running writes them; the slot at positions[b] is read after it).

Why. Work scales with each sequence's length, not the cache's: a split's slots come from positions[b]
and valid_from[b] read on the device, so a 4096-slot cache at position 600 reads ~600 rows, and the
grid depends only on shapes (a CUDA graph replays it with new positions). Splitting a sequence's slots
over SPLITS programs gives the GPU enough programs at batch 1 (B·Hkv alone is a fraction of the SMs),
and the last-arriver combine keeps it one launch.

Layouts. q [B, Hq, d] unit stride along d; caches [B, Hkv, S_max, d] unit stride along d, any other
strides; positions / valid_from [B] int32 / int64; o [B, Hq·d] contiguous (o_proj's input), q's dtype;
scratch: partials [B·Hkv, SPLITS, G_PAD, BLOCK_D] fp32, stats [B·Hkv, SPLITS, 2, G_PAD] fp32, counters
[B·Hkv] int32, zero on entry and left zero. G_PAD is 1 when GROUP == 1 (CUDA-core products, one row)
and GROUP rounded up to a power of two >= 16 otherwise (tl.dot on zero-padded query rows; p is rounded
to the cache dtype for the p·v product, as flash attention does). A sequence with valid_from[b] >
positions[b] has no slot and gets NaN.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import (cdiv, interpreting, mma, next_power_of_2, num_sms, pdl_launch_dependents,
                                        pdl_options, pdl_wait)
from sparseffn.kernels.configs.decode_attention import AttentionConfig, attention_config
from sparseffn.kernels.launch import Launcher

__all__ = ["group_rows", "launch_decode_attention", "num_splits"]


@triton.jit
def _attend_block(q, k, v, j_in, m_i, l_i, acc, scale_log2, G_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
                  DOT_IN_FP32: tl.constexpr):
    """The online softmax's step over one block of slots (k, v [BLOCK_S, BLOCK_D], j_in its valid slots):
    (m_i, l_i, acc) updated."""
    if G_PAD == 1:  # [BLOCK_S, BLOCK_D] tiles, CUDA cores
        s = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1)[None, :]  # [1, BLOCK_S]
    else:
        s = mma(q, tl.trans(k), tl.zeros((G_PAD, BLOCK_S), tl.float32), DOT_IN_FP32)  # [G_PAD, BLOCK_S]
    s = tl.where(j_in[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every block has a valid slot
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [G_PAD, BLOCK_S]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if G_PAD == 1:
        acc += tl.sum(tl.trans(p) * v.to(tl.float32), axis=0)[None, :]
    else:
        acc = mma(p.to(v.dtype), v, acc, DOT_IN_FP32)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["SPLITS"])
def _decode_attention_kernel(
    q_ptr,  # [B, Hq, d]
    k_ptr,  # [B, Hkv, S_max, d]
    v_ptr,  # [B, Hkv, S_max, d]
    pos_ptr,  # [B] last valid slot
    from_ptr,  # [B] first valid slot, or None (0)
    o_ptr,  # [B, Hq·d] out
    part_ptr,  # [B·Hkv, SPLITS, G_PAD, BLOCK_D] fp32 scratch (SPLITS > 1)
    stat_ptr,  # [B·Hkv, SPLITS, 2, G_PAD] fp32 scratch: m, l
    count_ptr,  # [B·Hkv] int32, zero on entry, left zero
    HQ,
    HKV,
    SPLITS,
    scale_log2,  # scaling · log2(e)
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of two >= SPLITS
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent: nothing read or written before pdl_wait
    PREFETCH: tl.constexpr,  # positions and the first block's older slots read before pdl_wait (config.prefetch)
    DOT_IN_FP32: tl.constexpr,
):
    pdl_launch_dependents(PDL)
    if not PREFETCH:
        pdl_wait(PDL)
    bg = tl.program_id(0)
    split = tl.program_id(1)
    b = (bg // HKV).to(tl.int64)
    g = (bg % HKV).to(tl.int64)
    last = tl.load(pos_ptr + b).to(tl.int32)
    first = 0
    if from_ptr is not None:
        first = tl.load(from_ptr + b).to(tl.int32)
    chunk = tl.cdiv(last + 1 - first, SPLITS)
    start = first + split * chunk
    end = tl.minimum(last + 1, start + chunk)

    r = tl.arange(0, G_PAD)  # [G_PAD] query heads of the group
    r_in = r < GROUP
    heads = g * GROUP + r
    dcol = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_in = dcol < HEAD_DIM
    k_base = k_ptr + b * stride_kb + g * stride_kh
    v_base = v_ptr + b * stride_vb + g * stride_vh
    if PREFETCH:  # the first block's slots before `last`, written by earlier steps, in flight across the wait
        j = start + tl.arange(0, BLOCK_S)
        old = ((j < end) & (j < last))[:, None] & d_in[None, :]
        k_old = tl.load(k_base + j.to(tl.int64)[:, None] * stride_ks + dcol[None, :], mask=old, other=0.0)
        v_old = tl.load(v_base + j.to(tl.int64)[:, None] * stride_vs + dcol[None, :], mask=old, other=0.0)
        pdl_wait(PDL)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dcol[None, :],
                mask=r_in[:, None] & d_in[None, :], other=0.0)  # [G_PAD, BLOCK_D]
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, BLOCK_D), tl.float32)
    loop_from = start
    if PREFETCH:
        if start < end:  # the first block: its slot `last` (the q/k/v launch's write) read now
            j = start + tl.arange(0, BLOCK_S)
            j_in = j < end
            new = (j_in & (j >= last))[:, None] & d_in[None, :]
            k = tl.where(new, tl.load(k_base + j.to(tl.int64)[:, None] * stride_ks + dcol[None, :], mask=new,
                                      other=0.0), k_old)
            v = tl.where(new, tl.load(v_base + j.to(tl.int64)[:, None] * stride_vs + dcol[None, :], mask=new,
                                      other=0.0), v_old)
            m_i, l_i, acc = _attend_block(q, k, v, j_in, m_i, l_i, acc, scale_log2, G_PAD, BLOCK_S, DOT_IN_FP32)
        loop_from = start + BLOCK_S
    for j0 in range(loop_from, end, BLOCK_S):
        j = j0 + tl.arange(0, BLOCK_S)  # [BLOCK_S] slots
        j_in = j < end
        kv_mask = j_in[:, None] & d_in[None, :]
        k = tl.load(k_base + j.to(tl.int64)[:, None] * stride_ks + dcol[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + j.to(tl.int64)[:, None] * stride_vs + dcol[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_block(q, k, v, j_in, m_i, l_i, acc, scale_log2, G_PAD, BLOCK_S, DOT_IN_FP32)

    o_ptrs = o_ptr + b * HQ * HEAD_DIM + heads[:, None] * HEAD_DIM + dcol[None, :]  # [G_PAD, BLOCK_D]
    o_mask = r_in[:, None] & d_in[None, :]
    out_dtype = o_ptr.dtype.element_ty
    if SPLITS == 1:
        tl.store(o_ptrs, (acc / l_i[:, None]).to(out_dtype), mask=o_mask)
    else:
        slot = bg.to(tl.int64) * SPLITS
        parts = part_ptr + slot * G_PAD * BLOCK_D + r[:, None] * BLOCK_D + dcol[None, :]  # split 0's tile
        stats = stat_ptr + slot * 2 * G_PAD + r  # split 0's m; + G_PAD: its l
        tl.store(parts + split * G_PAD * BLOCK_D, acc)
        tl.store(stats + split * 2 * G_PAD, m_i)
        tl.store(stats + split * 2 * G_PAD + G_PAD, l_i)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        if tl.atomic_add(count_ptr + bg, 1, sem="acq_rel") == SPLITS - 1:
            # every split's (m, l) in one load, then the partials unrolled in split order: the loads
            # are independent, so they are in flight together (deterministic whichever split arrived last)
            t = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
            t_in = (t < SPLITS)[:, None]
            stats_t = stats[None, :] + t[:, None] * (2 * G_PAD)  # [SPLITS_PAD, G_PAD] each split's m
            m_t = tl.load(stats_t, mask=t_in, other=float("-inf"), cache_modifier=".cg")
            l_t = tl.load(stats_t + G_PAD, mask=t_in, other=0.0, cache_modifier=".cg")
            m_all = tl.max(m_t, axis=0)  # [G_PAD]
            w_t = tl.exp2(m_t - m_all[None, :])  # [SPLITS_PAD, G_PAD], 0 for an empty split
            l_all = tl.sum(w_t * l_t, axis=0)
            o = tl.zeros((G_PAD, BLOCK_D), tl.float32)
            for u in tl.static_range(SPLITS_PAD):
                w_u = tl.sum(tl.where(t[:, None] == u, w_t, 0.0), axis=0)  # [G_PAD] split u's weight
                o += w_u[:, None] * tl.load(parts + u * G_PAD * BLOCK_D, mask=(u < SPLITS) & o_mask, other=0.0,
                                            cache_modifier=".cg")
            tl.store(o_ptrs, (o / l_all[:, None]).to(out_dtype), mask=o_mask)
            tl.atomic_xchg(count_ptr + bg, 0)  # left zero for the next call


_launch = Launcher(_decode_attention_kernel)


def group_rows(group: int, mma: bool = False) -> int:
    """G_PAD: the query rows a program computes for a GQA group of `group` heads (mma: AttentionConfig.mma)."""
    return 1 if group == 1 and not mma else max(16, next_power_of_2(group))


def num_splits(config: AttentionConfig, programs: int, s_max: int, sms: int) -> int:
    """Splits per (sequence, key/value head): config.splits, or enough for about 4 programs per SM,
    at most config.max_splits and at most one per BLOCK_S slots of the cache."""
    if config.splits is not None:
        return config.splits
    return max(1, min(config.max_splits, cdiv(4 * sms, programs), cdiv(s_max, config.block_s)))


def launch_decode_attention(q, k_cache, v_cache, positions, scaling, valid_from=None, counters=None,
                            prefetch=False, *, config: AttentionConfig | None = None) -> torch.Tensor:
    """o [B, Hq·d] on arguments that meet ops.decode_attention's contract, unchecked. counters: int32
    zeros, at least B·Hkv of them (None: allocated here), left zero. prefetch: the caller meets
    AttentionConfig.prefetch's contract (the default config may then take it; a given config decides)."""
    b, hq, d = q.shape
    hkv, s_max = k_cache.shape[1], k_cache.shape[2]
    sms = num_sms(q.device) if q.is_cuda else 4
    config = config or attention_config(b * hkv, sms, prefetch)
    group = hq // hkv
    g_pad = group_rows(group, config.mma)
    block_d = max(16, next_power_of_2(d))
    splits = num_splits(config, b * hkv, s_max, sms)
    o = torch.empty((b, hq * d), dtype=q.dtype, device=q.device)
    if splits > 1:
        parts = torch.empty(b * hkv * splits * g_pad * block_d, dtype=torch.float32, device=q.device)
        stats = torch.empty(b * hkv * splits * 2 * g_pad, dtype=torch.float32, device=q.device)
        if counters is None:
            counters = torch.zeros(b * hkv, dtype=torch.int32, device=q.device)
    else:
        parts = stats = torch.empty(0, dtype=torch.float32, device=q.device)
        counters = torch.empty(0, dtype=torch.int32, device=q.device)
    _launch[(b * hkv, splits)](
        q, k_cache, v_cache, positions, valid_from, o, parts, stats, counters, hq, hkv, splits,
        float(scaling) * math.log2(math.e), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        HEAD_DIM=d, GROUP=group, G_PAD=g_pad, SPLITS_PAD=next_power_of_2(splits), BLOCK_S=config.block_s,
        BLOCK_D=block_d, PREFETCH=config.prefetch, DOT_IN_FP32=interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(config.pdl, q.device),
    )
    return o
