"""One decoder layer of a Llama-family model for one token (batch 1) in one persistent launch.

    _decode_layer_kernel, grid (P,): P programs, all resident at once (P = SMs x the programs that fit
    on an SM, from the compiled kernel's registers and shared memory). Five phases, each the work of
    one launch of the launch-by-launch step, its items dealt out round-robin (item i to program
    i mod P), a grid_sync between phases:
        1. norm + q/k/v + RoPE + cache write   decode_attn_proj._qkv_rope_block
        2. split-KV attention                  decode_attention._attention_item, Hkv x SPLITS items
        3. o_proj + residual                   decode_attn_proj._out_proj_block
        4. norm + gate (+ up on active units)  decode_mlp._gate_up_block (sparse, or dense relu / silu)
        5. down + residual                     decode_mlp._down_item, column blocks x spans
    The residual stream x [1, D] is updated in place: phase 3 writes x + attention, phase 5 x + MLP.
    Same item code, one-token configs and roundings as the launch-by-launch step: the same bits.
    config.pdl (Hopper on): launched as a programmatic dependent (_runtime), so the next layer's
    launch is processed while this one runs; nothing is read before the wait.

Why. At one token each of the step's launches reads a few MB in a few µs and pays a fixed cost of
about as much again (launch, ramp-up, the last wave's tail); a layer in one launch pays it once and
a barrier (one atomic per program) between phases instead.

Layouts: as the item functions' (x [1, D]; weights [N, D] unit stride along D; down_t = down^T [H, D];
caches [1, Hkv, S_max, d]); scratch (LayerScratch) is shared by every layer of a model (the layers run
one after another), its counters zero on entry and left zero. Under the interpreter, which runs
programs one after another, the phases are five launches (SYNC off; grid_sync's contract).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import (cdiv, interpreting, next_power_of_2, num_sms, pdl_launch_dependents,
                                        pdl_options, pdl_wait)
from sparseffn.kernels.configs.decode_layer import LayerConfig
from sparseffn.kernels.decode_attention import _attention_item, group_rows
from sparseffn.kernels.decode_attn_proj import _out_proj_block, _qkv_rope_block
from sparseffn.kernels.decode_mlp import ACTS, _down_item, _gate_up_block, down_block
from sparseffn.kernels.persistent import grid_exit, grid_sync, prefetch_l2
from sparseffn.kernels.launch import Launcher

__all__ = ["LayerScratch", "launch_decode_layer", "occupancy"]

PHASES = 5


@dataclass
class LayerScratch:
    """Per-model scratch of the persistent layer (module docstring): q and the attention output o
    [1, Hq·d], attention partials / stats / counters, h [H] and flags / list [H], the down kernel's
    span partials and counters, and the barrier's two counters."""

    q: torch.Tensor
    o: torch.Tensor
    parts: torch.Tensor
    stats: torch.Tensor
    attn_counts: torch.Tensor
    hidden: torch.Tensor
    flags: torch.Tensor
    units: torch.Tensor
    down_parts: torch.Tensor
    down_counts: torch.Tensor
    sync: torch.Tensor
    splits: int  # attention's splits per key/value head

    @classmethod
    def allocate(cls, d_model: int, hq: int, hkv: int, head_dim: int, h: int, splits: int, split: int,
                 col_blocks: int, dtype: torch.dtype, device: torch.device) -> "LayerScratch":
        f32, i32 = torch.float32, torch.int32
        g_pad, block_d = group_rows(hq // hkv), max(16, next_power_of_2(head_dim))
        return cls(q=torch.empty(hq * head_dim, dtype=dtype, device=device),
                   o=torch.empty(hq * head_dim, dtype=dtype, device=device),
                   parts=torch.empty(hkv * splits * g_pad * block_d, dtype=f32, device=device),
                   stats=torch.empty(hkv * splits * 2 * g_pad, dtype=f32, device=device),
                   attn_counts=torch.zeros(hkv, dtype=i32, device=device),
                   hidden=torch.empty(h, dtype=dtype, device=device),
                   flags=torch.empty(h, dtype=i32, device=device), units=torch.empty(h, dtype=i32, device=device),
                   down_parts=torch.empty(max(1, split) * d_model, dtype=f32, device=device),
                   down_counts=torch.zeros(col_blocks, dtype=i32, device=device),
                   sync=torch.zeros(2, dtype=i32, device=device), splits=splits)


@triton.jit(do_not_specialize=["SPLITS", "first_phase", "last_phase"])
def _decode_layer_kernel(
    x_ptr,  # [1, D] the residual stream, updated in place
    attn_norm_ptr, wq_ptr, wk_ptr, wv_ptr, bq_ptr, bk_ptr, bv_ptr, cos_ptr, sin_ptr, pos_ptr,
    q_ptr,  # [1, Hq·d] scratch
    k_cache_ptr, v_cache_ptr,
    o_ptr,  # [1, Hq·d] scratch: attention's output
    part_ptr, stat_ptr, attn_count_ptr,  # attention's split partials and arrival counters
    wo_ptr, bo_ptr,
    mlp_norm_ptr, first_ptr, up_ptr, threshold_ptr,
    h_ptr, flags_ptr, list_ptr,  # [H] scratch: h, active flags, the down kernel's unit lists
    down_t_ptr,
    down_part_ptr, down_count_ptr,  # the down kernel's span partials and arrival counters
    sync_ptr,  # [2] int32: grid_sync's counters
    next_wq_ptr, next_wk_ptr, next_wv_ptr,  # the next layer's q/k/v weights (PREFETCH), or None
    first_phase, last_phase,  # the phases this launch runs (all five with SYNC)
    D, HQ, HKV, SPLITS, H, n_col_blocks, n_counts, attn_eps, mlp_eps, scale_log2,
    stride_wq, stride_wk, stride_wv, stride_cos, stride_sin,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_wo, stride_fh, stride_uh, stride_dh,
    HEAD_DIM: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, HAS_O_BIAS: tl.constexpr,
    QKV_BLOCK_N: tl.constexpr, QKV_BLOCK_K: tl.constexpr, QKV_ONE_STEP: tl.constexpr, QKV_STREAM: tl.constexpr,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    O_BLOCK_N: tl.constexpr, O_BLOCK_K: tl.constexpr, O_ONE_STEP: tl.constexpr, O_STREAM: tl.constexpr,
    GATED: tl.constexpr, HAS_THRESHOLD: tl.constexpr, ACT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, MLP_STREAM: tl.constexpr,
    SPLIT: tl.constexpr, DOWN_BLOCK_S: tl.constexpr, DOWN_BLOCK_D: tl.constexpr, PREFIX: tl.constexpr,
    SYNC: tl.constexpr,  # one launch for every phase, grid_sync between them
    PREFETCH: tl.constexpr,  # ask L2 for the next phase's weights (persistent.prefetch_l2)
    THREADS: tl.constexpr,  # 32 · num_warps
    PDL: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    PAIRS: tl.constexpr = QKV_BLOCK_N // 2
    ESIZE: tl.constexpr = wq_ptr.dtype.element_ty.primitive_bitwidth // 8
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    qd = HQ * HEAD_DIM
    if first_phase <= 0:  # 1. norm + q/k/v + RoPE + cache write
        items = tl.cdiv(HQ * (HEAD_DIM // 2), PAIRS) + 2 * tl.cdiv(HKV * (HEAD_DIM // 2), PAIRS)
        for i in range(pid, items, programs):
            _qkv_rope_block(i, x_ptr, attn_norm_ptr, wq_ptr, wk_ptr, wv_ptr, bq_ptr, bk_ptr, bv_ptr, cos_ptr, sin_ptr,
                            pos_ptr, q_ptr, k_cache_ptr, v_cache_ptr, 1, D, HQ, HKV, attn_eps, D, stride_wq,
                            stride_wk, stride_wv, stride_cos, stride_sin, stride_kb, stride_kh, stride_ks, stride_vb,
                            stride_vh, stride_vs, HEAD_DIM, HAS_QKV_BIAS, 1, QKV_BLOCK_N, QKV_BLOCK_K,
                            QKV_ONE_STEP, QKV_STREAM, DOT_IN_FP32)
        if SYNC:
            grid_sync(sync_ptr, programs)
    if first_phase <= 1 and last_phase >= 1:  # 2. split-KV attention
        if PREFETCH:  # o_proj's weights stream into L2 while attention reads the cache
            prefetch_l2(wo_ptr, D * stride_wo * ESIZE, pid, programs, THREADS)
        for i in range(pid, HKV * SPLITS, programs):
            _attention_item(i // SPLITS, i % SPLITS, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, None, o_ptr, part_ptr,
                            stat_ptr, attn_count_ptr, HQ, HKV, SPLITS, scale_log2, qd, HEAD_DIM, stride_kb,
                            stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, HEAD_DIM, GROUP, G_PAD, SPLITS_PAD,
                            BLOCK_S, HEAD_BLOCK, DOT_IN_FP32)
        if SYNC:
            grid_sync(sync_ptr, 2 * programs)
    if first_phase <= 2 and last_phase >= 2:  # 3. o_proj + residual, in place
        if PREFETCH:  # and the gate's (or up's) during o_proj and the barrier
            prefetch_l2(first_ptr, H * stride_fh * ESIZE, pid, programs, THREADS)
        for i in range(pid, tl.cdiv(D, O_BLOCK_N), programs):
            _out_proj_block(i, o_ptr, wo_ptr, bo_ptr, x_ptr, x_ptr, 1, D, qd, qd, stride_wo, D, D, HAS_O_BIAS, 1,
                            O_BLOCK_N, O_BLOCK_K, O_STREAM, O_ONE_STEP, False, DOT_IN_FP32)
        if SYNC:
            grid_sync(sync_ptr, 3 * programs)
    if first_phase <= 3 and last_phase >= 3:  # 4. norm + gate (+ up)
        for i in range(pid, tl.cdiv(H, BLOCK_H), programs):
            _gate_up_block(i, x_ptr, mlp_norm_ptr, first_ptr, up_ptr, threshold_ptr, h_ptr, flags_ptr, down_count_ptr,
                           1, D, H, n_counts, mlp_eps, D, stride_fh, stride_uh, 1, 1, GATED,
                           HAS_THRESHOLD, ACT, True, 1, BLOCK_H, BLOCK_K, MLP_STREAM, False, 16, 1, DOT_IN_FP32)
        if SYNC:
            grid_sync(sync_ptr, 4 * programs)
    if last_phase >= 4:  # 5. down + residual, in place
        if PREFETCH and next_wq_ptr is not None:  # the next layer's q/k/v during the latency-bound down pass
            prefetch_l2(next_wq_ptr, HQ * HEAD_DIM * stride_wq * ESIZE, pid, programs, THREADS)
            prefetch_l2(next_wk_ptr, HKV * HEAD_DIM * stride_wk * ESIZE, pid, programs, THREADS)
            prefetch_l2(next_wv_ptr, HKV * HEAD_DIM * stride_wv * ESIZE, pid, programs, THREADS)
        for i in range(pid, n_col_blocks * SPLIT, programs):
            _down_item(i % n_col_blocks, i // n_col_blocks, h_ptr, flags_ptr, list_ptr, down_t_ptr, x_ptr, x_ptr,
                       down_part_ptr, down_count_ptr, 1, D, H, stride_dh, D, D, 1, 1, SPLIT, DOWN_BLOCK_S,
                       DOWN_BLOCK_D, PREFIX, True, DOT_IN_FP32)
    if SYNC:
        grid_exit(sync_ptr, sync_ptr + 1, programs)


_launch = Launcher(_decode_layer_kernel)


def occupancy(n_regs: int, shared: int, num_warps: int, shared_per_sm: int = 228 * 1024) -> int:
    """Programs of a kernel that fit on one SM at once (compute capability 8.0 to 12.0: 64K registers
    allocated per warp in 256-register units, 64 warps, 32 programs, 1 KB of shared memory reserved
    per program)."""
    per_warp = -(-max(1, n_regs) * 32 // 256) * 256
    by_regs = (65536 // per_warp) // num_warps
    by_shared = shared_per_sm // (shared + 1024)
    return max(0, min(by_regs, 64 // num_warps, 32, by_shared))


@functools.lru_cache(maxsize=64)
def _programs(key: tuple, sms: int, config: LayerConfig, fit: int) -> int:
    per_sm = min(fit, config.programs_per_sm or config.max_per_sm)
    if per_sm < 1 or (config.programs_per_sm is not None and config.programs_per_sm > fit):
        raise ValueError(f"LayerConfig.programs_per_sm {config.programs_per_sm} > the {fit} programs of the layer "
                         "kernel that fit on an SM (every program must be resident: grid_sync)")
    return sms * per_sm


def launch_decode_layer(x, attn_norm, attn_eps, wq, wk, wv, bq, bk, bv, cos_table, sin_table, positions, k_cache,
                        v_cache, scaling, wo, bo, mlp_norm, mlp_eps, first, up, down_t, threshold, scratch,
                        next_qkv=None, *, act: str, config: LayerConfig, programs: int | None = None) -> None:
    """One layer for one token, x [1, D] updated in place (module docstring); arguments as the
    launch-by-launch step's (models/decode_step.py), unchecked. act "sparse" (relu, only the active
    units' up / down rows), "relu" or "silu" (dense); up None: not gated; next_qkv: the next layer's
    (wq, wk, wv), asked into L2 during the down pass (config.prefetch), or None. programs: the grid (None:
    as many as are resident at once; under the interpreter 4, a launch per phase, or 1, one launch
    through its barriers)."""
    d_model = x.shape[1]
    head_dim = cos_table.shape[1]
    hq, hkv = wq.shape[0] // head_dim, wk.shape[0] // head_dim
    h = first.shape[0]
    splits = scratch.splits
    down_block_d = down_block(config.mlp, d_model, num_sms(x.device) if x.is_cuda else 4)
    col_blocks = cdiv(d_model, down_block_d)
    split = min(config.mlp.split, h)
    has_bias = bq is not None or bk is not None or bv is not None
    if has_bias:  # all three or none in the kernel: a missing one adds zeros
        bq, bk, bv = (b if b is not None else w.new_zeros(w.shape[0]) for b, w in ((bq, wq), (bk, wk), (bv, wv)))
    gated = up is not None
    up = up if gated else first
    sync = not interpreting() or programs == 1
    prefetch = config.prefetch and not interpreting()
    args = (x, attn_norm, wq, wk, wv, bq, bk, bv, cos_table, sin_table, positions, scratch.q, k_cache, v_cache,
            scratch.o, scratch.parts, scratch.stats, scratch.attn_counts, wo, bo, mlp_norm, first, up, threshold,
            scratch.hidden, scratch.flags, scratch.units, down_t, scratch.down_parts, scratch.down_counts,
            scratch.sync, *(next_qkv if next_qkv is not None and prefetch else (None, None, None)))
    sizes = (d_model, hq, hkv, splits, h, col_blocks, col_blocks if split > 1 else 0, float(attn_eps), float(mlp_eps),
             float(scaling) * math.log2(math.e), wq.stride(0), wk.stride(0), wv.stride(0), cos_table.stride(0),
             sin_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
             v_cache.stride(1), v_cache.stride(2), wo.stride(0), first.stride(0), up.stride(0), down_t.stride(0))
    meta = dict(HEAD_DIM=head_dim, HAS_QKV_BIAS=has_bias, HAS_O_BIAS=bo is not None,
                QKV_BLOCK_N=config.qkv.block_n, QKV_BLOCK_K=config.qkv.block_k,
                QKV_ONE_STEP=d_model <= config.qkv.block_k, QKV_STREAM=config.qkv.stream,
                GROUP=hq // hkv, G_PAD=group_rows(hq // hkv), SPLITS_PAD=next_power_of_2(splits),
                BLOCK_S=config.attention.block_s, HEAD_BLOCK=max(16, next_power_of_2(head_dim)),
                O_BLOCK_N=config.out.block_n, O_BLOCK_K=config.out.block_k,
                O_ONE_STEP=hq * head_dim <= config.out.block_k,
                O_STREAM=config.out.stream,
                GATED=gated, HAS_THRESHOLD=threshold is not None, ACT=ACTS[act], BLOCK_H=config.mlp.block_h,
                BLOCK_K=min(config.mlp.block_k, max(16, next_power_of_2(d_model))), MLP_STREAM=config.mlp.stream,
                SPLIT=split, DOWN_BLOCK_S=config.mlp.block_s, DOWN_BLOCK_D=down_block_d, PREFIX=config.mlp.prefix,
                SYNC=sync, PREFETCH=prefetch, THREADS=32 * config.num_warps,
                DOT_IN_FP32=interpreting() or x.dtype == torch.float32, num_warps=config.num_warps, num_stages=1)
    if not sync:  # the interpreter: a launch per phase
        for phase in range(PHASES):
            _decode_layer_kernel[(programs or 4,)](*args, phase, phase, *sizes, PDL=False, **meta)
        return
    meta.update(pdl_options(config.pdl, x.device))
    if programs is None:
        key = tuple(sorted((k, v) for k, v in meta.items()))
        programs = _programs(key, num_sms(x.device), config, _fit(key, args, sizes, meta))
    _launch[(programs,)](*args, 0, PHASES - 1, *sizes, **meta)


_FIT: dict[tuple, int] = {}


def _fit(key: tuple, args: tuple, sizes: tuple, meta: dict) -> int:
    """Programs of this variant that fit on an SM, from its compiled registers and shared memory."""
    if key not in _FIT:
        kernel = _decode_layer_kernel.warmup(*args, 0, PHASES - 1, *sizes, grid=(1,), **meta)
        kernel._init_handles()
        _FIT[key] = occupancy(kernel.n_regs, kernel.metadata.shared, meta["num_warps"])
    return _FIT[key]
