"""Token-major kernels of the sparse MLP training path on a TwELL-packed first activation.

Per ordinary (non-overflow) row m of x [M, D], over its valid slots (t, k) (`k < counts[m, t]`,
unit j = t * tile + columns[m, t, k], p_j = values[m, t, k] > 0, so the ReLU masks are 1):

  forward     gated: u_j = x[m] · up_weight[j], h_j = p_j u_j;  non-gated: h_j = p_j
              y[m] = Σ_j h_j · down_weight_t[j]                 row_l1[m] = Σ_j |h_j|
  backward    dh_j = dy[m] · down_weight_t[j] + l1_grad[0] · sign(h_j)   (l1_grad = ∂L/∂l1 / M, on device)
              gated: du_j = dh_j p_j, dg_j = dh_j u_j, dx[m] = Σ_j du_j up_weight[j] + dg_j gate_weight[j]
              non-gated: df_j = dh_j (stored in dg), dx[m] = Σ_j df_j up_weight[j]

Everything is fp32 until y and dx are rounded once at the store. Per-slot results (u forward; du, dg
backward) are stored fp32 at the slot's own position of a [M, n_tiles, slots] tensor, which
unit_grads.py regroups by unit for the weight gradients. Overflow rows (some count > slots) are
skipped entirely: the dense-rows kernels own them. Unspecified slots are never read.

Layouts: x, dy, out, dx_out [M, D] bf16 / fp16, unit stride along D; values / columns / counts as in
docs/format.md; gate_weight, up_weight, down_weight_t = down_proj.weight^T [H, D] in x's dtype, unit
stride along D; u / du / dg slots [M, n_tiles, slots] fp32; row_l1_out [M] and l1_grad [1] fp32.

The program structure is twell_up_down.py's (tokens per program, batch slot gather from the counts,
chunks of unit rows issued together, long rows split by row_split.py). Why a separate kernel: the
weights change every optimizer step, so the inference kernel's interleaved [H, 2, D] copy would cost
a read and a write of both matrices per layer and step; these kernels read the [H, D] matrices
through separate pointers (the same bytes per active unit) and carry each unit's slot position.
With BLOCK_D < D each D-slice program re-reads whole rows to form u or dh over all of D.

Constraints: M >= 0, any D >= 1, any H, 1 <= slots <= tile <= 32768, n_tiles = cdiv(H, tile); offsets
that can pass 2**31 are int64; compiled variants depend on (dtype, D, n_tiles, slots, config), not M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import cdiv, check_matrix, next_power_of_2
from sparseffn.kernels.configs.twell_train import TwellTrainConfig, default_backward_config, default_forward_config
from sparseffn.kernels.launch import Launcher
from sparseffn.kernels.row_split import check_row_list, gather_pieces, launch_args, prepare_launch, splits
from sparseffn.kernels.twell_up_down import _load_counts, _piece_head, _row_nnz

__all__ = ["twell_train_backward", "twell_train_forward"]


# ----------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _slot_batch(columns_ptr, values_ptr, counts_row, cnt0, row_slot0, b, nnz, n_tiles, tile, slots,
                BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, EVICT: tl.constexpr):
    """Register lists of the valid slots b .. b + BLOCK_N - 1 of an ordinary row (nnz >= 1 valid
    slots, first counts segment cnt0, flat slot base row_slot0 = m * n_tiles * slots):
    (row-local slot t * slots + k [BLOCK_N] int32, pairs [BLOCK_N] int64 = unit << 32 | bits of
    fp32 p). Lanes past nnz repeat the last valid slot with p = 0.

    Compact index i -> (tile t, slot k) from the counts alone: t = #{tiles whose inclusive end
    <= i}, k = i - (valid slots before t); every count of an ordinary row is <= slots."""
    ic = tl.minimum(b + tl.arange(0, BLOCK_N), nnz - 1)  # [BLOCK_N] compact valid-slot indices
    before = tl.cumsum(cnt0, 0)[None, :] <= ic[:, None]  # [BLOCK_N, BLOCK_T] tiles ending <= ic
    t = tl.sum(before.to(tl.int32), 1)  # [BLOCK_N] int32
    k = ic - tl.sum(tl.where(before, cnt0[None, :], 0), 1)  # [BLOCK_N] int32
    base = tl.sum(cnt0, 0)
    for t0 in range(BLOCK_T, n_tiles, BLOCK_T):  # further counts segments (n_tiles > BLOCK_T)
        cnt = _load_counts(counts_row, t0, n_tiles, True, BLOCK_T, EVICT)  # [BLOCK_T] int32
        before = (base + tl.cumsum(cnt, 0))[None, :] <= ic[:, None]  # [BLOCK_N, BLOCK_T]
        t += tl.sum(before.to(tl.int32), 1)
        k -= tl.sum(tl.where(before, cnt[None, :], 0), 1)
        base += tl.sum(cnt, 0)
    local = t * slots + k  # [BLOCK_N] int32 row-local slot (< n_tiles * slots)
    stream: tl.constexpr = "evict_first" if EVICT else ""
    col = tl.load(columns_ptr + row_slot0 + local, eviction_policy=stream)  # [BLOCK_N] int16
    val = tl.load(values_ptr + row_slot0 + local, eviction_policy=stream)  # [BLOCK_N] x dtype
    p = tl.where(b + tl.arange(0, BLOCK_N) < nnz, val.to(tl.float32), 0.0)  # [BLOCK_N] fp32
    unit = t * tile + col.to(tl.int32)  # [BLOCK_N] global unit j < H
    pairs = (unit.to(tl.int64) << 32) | (p.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
    return local, pairs


@triton.jit
def _chunk(pairs, local, idx, BLOCK_U: tl.constexpr, BLOCK_N: tl.constexpr):
    """(unit [BLOCK_U] int32, p [BLOCK_U] fp32, row-local slot [BLOCK_U] int32) at indices idx of
    the batch lists (tl.gather: registers / shared memory, no global memory access)."""
    if BLOCK_N == BLOCK_U:
        got = pairs
        loc = local
    else:
        got = tl.gather(pairs, idx, 0)
        loc = tl.gather(local, idx, 0)
    unit = (got >> 32).to(tl.int32)
    p = (got & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    return unit, p, loc


@triton.jit
def _unit_rows(w_ptr, unit, stride_wh, offs_d, mask_d,
               ALIGNED: tl.constexpr, EVEN_D: tl.constexpr, EVICT: tl.constexpr):
    """[BLOCK_U, BLOCK_D] rows `unit` of an [H, D] weight at columns offs_d (every unit is a real
    row: dead lanes repeat a live unit)."""
    row = w_ptr + unit.to(tl.int64) * stride_wh  # [BLOCK_U] row starts
    if ALIGNED:
        row = tl.multiple_of(row, 16)
    ptrs = row[:, None] + offs_d[None, :]  # [BLOCK_U, BLOCK_D]
    policy: tl.constexpr = "evict_last" if EVICT else ""
    if EVEN_D:
        w = tl.load(ptrs, eviction_policy=policy)
    else:
        w = tl.load(ptrs, mask=mask_d[None, :], other=0.0, eviction_policy=policy)
    return w


@triton.jit
def _unit_dots(w_ptr, unit, stride_wh, v_row, D,
               ALIGNED: tl.constexpr, BLOCK_D: tl.constexpr, EVICT: tl.constexpr):
    """[BLOCK_U] fp32 dot products w[unit] · v over all of D (D split over programs: every
    program forms the whole dot from all D blocks)."""
    row = w_ptr + unit.to(tl.int64) * stride_wh  # [BLOCK_U] row starts
    if ALIGNED:
        row = tl.multiple_of(row, 16)
    acc = tl.zeros(unit.shape, dtype=tl.float32)  # [BLOCK_U] fp32
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        mask = offs < D
        if ALIGNED:
            mask = tl.max_constancy(mask, 8)
        v = tl.load(v_row + offs, mask=mask, other=0.0)  # [BLOCK_D]
        w = tl.load(row[:, None] + offs[None, :], mask=mask[None, :], other=0.0,
                    eviction_policy="evict_last" if EVICT else "")  # [BLOCK_U, BLOCK_D]
        acc += tl.sum(w.to(tl.float32) * v.to(tl.float32)[None, :], 1)
    return acc


@triton.jit
def _load_token_row(row_ptr, offs_d, mask_d, EVEN_D: tl.constexpr, EVICT: tl.constexpr):
    """[BLOCK_D] fp32 slice of a token row (x or dy)."""
    stream: tl.constexpr = "evict_first" if EVICT else ""
    if EVEN_D:
        v = tl.load(row_ptr + offs_d, eviction_policy=stream)
    else:
        v = tl.load(row_ptr + offs_d, mask=mask_d, other=0.0, eviction_policy=stream)
    return v.to(tl.float32)


@triton.jit
def _store_token_row(row_ptr, acc, offs_d, mask_d, EVEN_D: tl.constexpr, EVICT: tl.constexpr):
    stream: tl.constexpr = "evict_first" if EVICT else ""
    if EVEN_D:
        tl.store(row_ptr + offs_d, acc.to(row_ptr.dtype.element_ty), eviction_policy=stream)
    else:
        tl.store(row_ptr + offs_d, acc.to(row_ptr.dtype.element_ty), mask=mask_d,
                 eviction_policy=stream)


@triton.jit
def _forward_slots(x_row, xv, values_ptr, columns_ptr, counts_row, cnt0, row_slot0, b_lo, b_hi, nnz,
                   up_ptr, down_ptr, u_ptr, D, n_tiles, tile, slots, stride_uh, stride_dh, offs_d, mask_d, store_u,
                   GATED: tl.constexpr, ALIGNED: tl.constexpr, ONE_D_BLOCK: tl.constexpr, EVEN_D: tl.constexpr,
                   BLOCK_U: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                   EVICT: tl.constexpr):
    """(fp32 [BLOCK_D] slice of Σ_j h_j · down[j], fp32 Σ_j |h_j|) over the valid slots b_lo ..
    b_hi - 1 (batch starts, b_hi <= nnz) of an ordinary row; stores u of those slots (gated) where
    store_u."""
    lanes = tl.arange(0, BLOCK_U)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    l1 = tl.zeros([BLOCK_U], dtype=tl.float32)  # [BLOCK_U] fp32 partial Σ|h|
    for b in range(b_lo, b_hi, BLOCK_N):
        local, pairs = _slot_batch(columns_ptr, values_ptr, counts_row, cnt0, row_slot0, b,
                                   nnz, n_tiles, tile, slots, BLOCK_N, BLOCK_T, EVICT)
        for c0 in range(0, tl.minimum(b_hi - b, BLOCK_N), BLOCK_U):
            idx = c0 + lanes
            live = b + idx < b_hi  # [BLOCK_U] lanes holding a slot of their own
            unit, p, loc = _chunk(pairs, local, idx, BLOCK_U, BLOCK_N)
            p = tl.where(live, p, 0.0)
            # [BLOCK_U, BLOCK_D] down rows, issued first (they do not depend on u)
            down = _unit_rows(down_ptr, unit, stride_dh, offs_d, mask_d, ALIGNED, EVEN_D, EVICT)
            if GATED:
                if ONE_D_BLOCK:
                    up = _unit_rows(up_ptr, unit, stride_uh, offs_d, mask_d, ALIGNED,
                                    EVEN_D, EVICT)  # [BLOCK_U, BLOCK_D]
                    u = tl.sum(up.to(tl.float32) * xv[None, :], 1)  # [BLOCK_U] fp32
                else:
                    u = _unit_dots(up_ptr, unit, stride_uh, x_row, D, ALIGNED, BLOCK_D, EVICT)
                tl.store(u_ptr + row_slot0 + loc, u, mask=live & store_u)
                h = tl.where(live, p * u, 0.0)  # [BLOCK_U] fp32
            else:
                h = p  # dead lanes have p = 0
            acc += tl.sum(h[:, None] * down.to(tl.float32), 0)
            l1 += tl.abs(h)
    return acc, tl.sum(l1, 0)


@triton.jit
def _backward_slots(dy_row, dyv, values_ptr, columns_ptr, counts_row, cnt0, row_slot0, b_lo, b_hi, nnz,
                    u_ptr, gate_ptr, up_ptr, down_ptr, du_ptr, dg_ptr, l1_grad, D, n_tiles, tile, slots,
                    stride_gh, stride_uh, stride_dh, offs_d, mask_d, store_slots,
                    GATED: tl.constexpr, ALIGNED: tl.constexpr, ONE_D_BLOCK: tl.constexpr, EVEN_D: tl.constexpr,
                    BLOCK_U: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                    EVICT: tl.constexpr):
    """fp32 [BLOCK_D] slice of Σ_j du_j · up[j] + dg_j · gate[j] (non-gated: Σ_j df_j · up[j]) over
    the valid slots b_lo .. b_hi - 1 of an ordinary row; stores du, dg of those slots where
    store_slots."""
    lanes = tl.arange(0, BLOCK_U)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for b in range(b_lo, b_hi, BLOCK_N):
        local, pairs = _slot_batch(columns_ptr, values_ptr, counts_row, cnt0, row_slot0, b,
                                   nnz, n_tiles, tile, slots, BLOCK_N, BLOCK_T, EVICT)
        for c0 in range(0, tl.minimum(b_hi - b, BLOCK_N), BLOCK_U):
            idx = c0 + lanes
            live = b + idx < b_hi  # [BLOCK_U] lanes holding a slot of their own
            unit, p, loc = _chunk(pairs, local, idx, BLOCK_U, BLOCK_N)
            if GATED:
                u = tl.load(u_ptr + row_slot0 + loc, mask=live, other=0.0)  # [BLOCK_U] fp32
            # [BLOCK_U, BLOCK_D] rows of this slice; the down rows only when they give dh
            if ONE_D_BLOCK:
                down = _unit_rows(down_ptr, unit, stride_dh, offs_d, mask_d, ALIGNED, EVEN_D, EVICT)
            up = _unit_rows(up_ptr, unit, stride_uh, offs_d, mask_d, ALIGNED, EVEN_D, EVICT)
            if GATED:
                gate = _unit_rows(gate_ptr, unit, stride_gh, offs_d, mask_d, ALIGNED, EVEN_D, EVICT)
            if ONE_D_BLOCK:
                dh = tl.sum(down.to(tl.float32) * dyv[None, :], 1)  # [BLOCK_U] fp32
            else:
                dh = _unit_dots(down_ptr, unit, stride_dh, dy_row, D, ALIGNED, BLOCK_D, EVICT)
            if GATED:
                h = p * u
            else:
                h = p
            sign = tl.where(h > 0, 1.0, tl.where(h < 0, -1.0, 0.0))  # torch.sign
            dh = dh + l1_grad * sign
            if GATED:
                du = tl.where(live, dh * p, 0.0)  # [BLOCK_U] fp32
                dg = tl.where(live, dh * u, 0.0)  # [BLOCK_U] fp32
                acc += tl.sum(du[:, None] * up.to(tl.float32) + dg[:, None] * gate.to(tl.float32), 0)
                tl.store(du_ptr + row_slot0 + loc, du, mask=live & store_slots)
            else:
                dg = tl.where(live, dh, 0.0)  # [BLOCK_U] fp32 d(first projection)
                acc += tl.sum(dg[:, None] * up.to(tl.float32), 0)
            tl.store(dg_ptr + row_slot0 + loc, dg, mask=live & store_slots)
    return acc


@triton.jit
def _token_row(row_ptr, m64, stride, offs_d, mask_d, LOAD: tl.constexpr, ALIGNED: tl.constexpr,
               EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr, EVICT: tl.constexpr):
    """(pointer to token row m, its fp32 [BLOCK_D] slice when LOAD, else zeros)."""
    row = row_ptr + m64 * stride
    if ALIGNED:
        row = tl.multiple_of(row, 16)
    if LOAD:
        v = _load_token_row(row, offs_d, mask_d, EVEN_D, EVICT)
    else:
        v = tl.zeros([BLOCK_D], dtype=tl.float32)  # unused
    return row, v


@triton.jit
def _d_slice(D, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr):
    """(columns [BLOCK_D] of this program's D slice, their mask, whether it is the first slice)."""
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    if ALIGNED:
        mask_d = tl.max_constancy(mask_d, 8)
    return offs_d, mask_d, tl.program_id(1) == 0


@triton.jit
def _ordinary_row(counts_ptr, split_flags_ptr, m64, n_tiles, slots, SPLIT: tl.constexpr, BLOCK_T: tl.constexpr,
              EVICT: tl.constexpr):
    """(ordinary, counts row, first counts segment, nnz) of row m. Not ordinary: a tile over capacity
    (the dense-rows path owns the row) or, with SPLIT, a listed row (its pieces write it)."""
    counts_row = counts_ptr + m64 * n_tiles
    cnt0 = _load_counts(counts_row, 0, n_tiles, True, BLOCK_T, EVICT)  # [BLOCK_T] int32
    worst, nnz = _row_nnz(counts_row, cnt0, True, n_tiles, BLOCK_T, EVICT)
    ordinary = worst <= slots
    if SPLIT:
        ordinary = ordinary & (tl.load(split_flags_ptr + m64) == 0)
    return ordinary, counts_row, cnt0, nnz


@triton.jit(do_not_specialize=["M"])
def _twell_train_forward_kernel(
    x_ptr, values_ptr, columns_ptr, counts_ptr, up_ptr, down_ptr, out_ptr, u_ptr, l1_ptr,
    split_flags_ptr, split_ids_ptr, split_state_ptr, partials_ptr, l1_partials_ptr,
    M, D, n_tiles, tile, slots, split_cap, max_pieces,
    stride_xm, stride_uh, stride_dh, stride_om,
    GATED: tl.constexpr,          # h = p * (x · up) (True) or h = p (False: up_ptr, u_ptr unused)
    ALIGNED: tl.constexpr,        # D % 8 == 0, 16-byte aligned bases and row strides
    ONE_D_BLOCK: tl.constexpr,    # BLOCK_D >= D: x[m] is loaded once per token, u needs no loop
    EVEN_D: tl.constexpr,         # D % BLOCK_D == 0: no mask along D
    BLOCK_M: tl.constexpr,        # tokens per program (consecutive)
    BLOCK_U: tl.constexpr,        # active units per chunk (weight rows loaded together)
    BLOCK_N: tl.constexpr,        # compact slots per batch (columns/values gathered together)
    BLOCK_D: tl.constexpr,        # y columns per program (power of two)
    BLOCK_T: tl.constexpr,        # tiles per counts segment (power of two)
    EVICT: tl.constexpr,          # L2 hints: weights evict_last, streamed data evict_first
    SPLIT: tl.constexpr,          # the first split_cap * max_pieces programs run split-row pieces
    PIECE: tl.constexpr,          # valid slots per piece of a split row (a multiple of BLOCK_N)
    PIECE_ORDER: tl.constexpr,    # SPLIT, deterministic: long rows run whole also sum piece by piece
):
    pid = tl.program_id(0)
    offs_d, mask_d, first_slice = _d_slice(D, BLOCK_D, ALIGNED)  # first_slice stores u and row_l1
    n_piece_programs = split_cap * max_pieces  # 0 without SPLIT (the launcher passes zeros)
    if pid < n_piece_programs:
        if SPLIT:  # a piece of a long row (row_split.py); SPLIT implies ONE_D_BLOCK
            work, i, piece, m64, counts_row, cnt0, nnz, b0 = _piece_head(
                pid, counts_ptr, split_ids_ptr, split_state_ptr, split_cap, max_pieces, n_tiles, PIECE, BLOCK_T, EVICT)
            if work:
                x_row, xv = _token_row(x_ptr, m64, stride_xm, offs_d, mask_d, GATED, ALIGNED, EVEN_D, BLOCK_D,
                                       EVICT)
                acc, l1 = _forward_slots(x_row, xv, values_ptr, columns_ptr, counts_row, cnt0,
                                         m64 * n_tiles * slots, b0, tl.minimum(nnz, b0 + PIECE), nnz, up_ptr,
                                         down_ptr, u_ptr, D, n_tiles, tile, slots, stride_uh, stride_dh, offs_d,
                                         mask_d, True, GATED, ALIGNED, True, EVEN_D, BLOCK_U, BLOCK_N, BLOCK_D,
                                         BLOCK_T, EVICT)
                last, y, row_l1 = gather_pieces(partials_ptr, l1_partials_ptr, i, piece, tl.cdiv(nnz, PIECE),
                                                max_pieces, acc, l1, offs_d, mask_d, D, split_state_ptr, True)
                if last:
                    _store_token_row(out_ptr + m64 * stride_om, y, offs_d, mask_d, EVEN_D, EVICT)
                    tl.store(l1_ptr + m64, row_l1)
    else:
        m_first = (pid - n_piece_programs) * BLOCK_M
        for r in range(0, tl.minimum(M - m_first, BLOCK_M)):
            m64 = (m_first + r).to(tl.int64)
            ordinary, counts_row, cnt0, nnz = _ordinary_row(counts_ptr, split_flags_ptr, m64, n_tiles, slots, SPLIT,
                                                        BLOCK_T, EVICT)
            if ordinary:
                x_row, xv = _token_row(x_ptr, m64, stride_xm, offs_d, mask_d, GATED and ONE_D_BLOCK, ALIGNED,
                                       EVEN_D, BLOCK_D, EVICT)
                if PIECE_ORDER:
                    # deterministic mode: a long row the split list had no room for adds its pieces' sums in
                    # piece order, as a listed row does (row_split.py, "Bits")
                    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
                    l1 = tl.full([], 0.0, tl.float32)
                    for p0 in range(0, nnz, PIECE):
                        piece_acc, piece_l1 = _forward_slots(
                            x_row, xv, values_ptr, columns_ptr, counts_row, cnt0, m64 * n_tiles * slots, p0,
                            tl.minimum(nnz, p0 + PIECE), nnz, up_ptr, down_ptr, u_ptr, D, n_tiles, tile, slots,
                            stride_uh, stride_dh, offs_d, mask_d, first_slice, GATED, ALIGNED, True, EVEN_D,
                            BLOCK_U, BLOCK_N, BLOCK_D, BLOCK_T, EVICT)
                        acc += piece_acc
                        l1 += piece_l1
                else:
                    acc, l1 = _forward_slots(x_row, xv, values_ptr, columns_ptr, counts_row, cnt0,
                                             m64 * n_tiles * slots, 0, nnz, nnz, up_ptr, down_ptr, u_ptr, D, n_tiles,
                                             tile, slots, stride_uh, stride_dh, offs_d, mask_d, first_slice, GATED,
                                             ALIGNED, ONE_D_BLOCK, EVEN_D, BLOCK_U, BLOCK_N, BLOCK_D, BLOCK_T, EVICT)
                _store_token_row(out_ptr + m64 * stride_om, acc, offs_d, mask_d, EVEN_D, EVICT)
                tl.store(l1_ptr + m64, l1, mask=first_slice)


_twell_train_forward_launch = Launcher(_twell_train_forward_kernel)


@triton.jit(do_not_specialize=["M"])
def _twell_train_backward_kernel(
    dy_ptr, values_ptr, columns_ptr, counts_ptr, u_ptr, gate_ptr, up_ptr, down_ptr, l1_grad_ptr,
    dx_ptr, du_ptr, dg_ptr,
    split_flags_ptr, split_ids_ptr, split_state_ptr, partials_ptr,
    M, D, n_tiles, tile, slots, split_cap, max_pieces,
    stride_dym, stride_gh, stride_uh, stride_dh, stride_dxm,
    GATED: tl.constexpr,          # True: du, dg from u (gate_ptr, u_ptr, du_ptr used); False: dg = dh
    ALIGNED: tl.constexpr,        # D % 8 == 0, 16-byte aligned bases and row strides
    ONE_D_BLOCK: tl.constexpr,    # BLOCK_D >= D: dy[m] is loaded once per token, dh needs no loop
    EVEN_D: tl.constexpr,         # D % BLOCK_D == 0: no mask along D
    BLOCK_M: tl.constexpr,        # tokens per program (consecutive)
    BLOCK_U: tl.constexpr,        # active units per chunk (weight rows loaded together)
    BLOCK_N: tl.constexpr,        # compact slots per batch
    BLOCK_D: tl.constexpr,        # dx columns per program (power of two)
    BLOCK_T: tl.constexpr,        # tiles per counts segment (power of two)
    EVICT: tl.constexpr,          # L2 hints: weights evict_last, streamed data evict_first
    SPLIT: tl.constexpr,          # the first split_cap * max_pieces programs run split-row pieces
    PIECE: tl.constexpr,          # valid slots per piece of a split row (a multiple of BLOCK_N)
    PIECE_ORDER: tl.constexpr,    # SPLIT, deterministic: long rows run whole also sum piece by piece
):
    pid = tl.program_id(0)
    offs_d, mask_d, first_slice = _d_slice(D, BLOCK_D, ALIGNED)  # first_slice stores du / dg
    l1_grad = tl.load(l1_grad_ptr)  # fp32 scalar: d(loss)/d(row L1) for every row
    n_piece_programs = split_cap * max_pieces  # 0 without SPLIT (the launcher passes zeros)
    if pid < n_piece_programs:
        if SPLIT:  # a piece of a long row (row_split.py); SPLIT implies ONE_D_BLOCK
            work, i, piece, m64, counts_row, cnt0, nnz, b0 = _piece_head(
                pid, counts_ptr, split_ids_ptr, split_state_ptr, split_cap, max_pieces, n_tiles, PIECE, BLOCK_T, EVICT)
            if work:
                dy_row, dyv = _token_row(dy_ptr, m64, stride_dym, offs_d, mask_d, True, ALIGNED, EVEN_D, BLOCK_D,
                                         EVICT)
                acc = _backward_slots(dy_row, dyv, values_ptr, columns_ptr, counts_row, cnt0,
                                      m64 * n_tiles * slots, b0, tl.minimum(nnz, b0 + PIECE), nnz, u_ptr,
                                      gate_ptr, up_ptr, down_ptr, du_ptr, dg_ptr, l1_grad, D, n_tiles, tile, slots,
                                      stride_gh, stride_uh, stride_dh, offs_d, mask_d, True, GATED, ALIGNED, True,
                                      EVEN_D, BLOCK_U, BLOCK_N, BLOCK_D, BLOCK_T, EVICT)
                last, dx, no_scalar = gather_pieces(partials_ptr, partials_ptr, i, piece, tl.cdiv(nnz, PIECE),
                                                    max_pieces, acc, 0.0, offs_d, mask_d, D, split_state_ptr, False)
                if last:
                    _store_token_row(dx_ptr + m64 * stride_dxm, dx, offs_d, mask_d, EVEN_D, EVICT)
    else:
        m_first = (pid - n_piece_programs) * BLOCK_M
        for r in range(0, tl.minimum(M - m_first, BLOCK_M)):
            m64 = (m_first + r).to(tl.int64)
            ordinary, counts_row, cnt0, nnz = _ordinary_row(counts_ptr, split_flags_ptr, m64, n_tiles, slots, SPLIT,
                                                        BLOCK_T, EVICT)
            if ordinary:
                dy_row, dyv = _token_row(dy_ptr, m64, stride_dym, offs_d, mask_d, ONE_D_BLOCK, ALIGNED, EVEN_D,
                                         BLOCK_D, EVICT)
                if PIECE_ORDER:  # deterministic mode: piece by piece, as in the forward
                    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
                    for p0 in range(0, nnz, PIECE):
                        acc += _backward_slots(
                            dy_row, dyv, values_ptr, columns_ptr, counts_row, cnt0, m64 * n_tiles * slots, p0,
                            tl.minimum(nnz, p0 + PIECE), nnz, u_ptr, gate_ptr, up_ptr, down_ptr, du_ptr, dg_ptr,
                            l1_grad, D, n_tiles, tile, slots, stride_gh, stride_uh, stride_dh, offs_d, mask_d,
                            first_slice, GATED, ALIGNED, True, EVEN_D, BLOCK_U, BLOCK_N, BLOCK_D, BLOCK_T, EVICT)
                else:
                    acc = _backward_slots(dy_row, dyv, values_ptr, columns_ptr, counts_row, cnt0,
                                          m64 * n_tiles * slots, 0, nnz, nnz, u_ptr, gate_ptr, up_ptr, down_ptr,
                                          du_ptr, dg_ptr, l1_grad, D, n_tiles, tile, slots, stride_gh, stride_uh,
                                          stride_dh, offs_d, mask_d, first_slice, GATED, ALIGNED, ONE_D_BLOCK, EVEN_D,
                                          BLOCK_U, BLOCK_N, BLOCK_D, BLOCK_T, EVICT)
                _store_token_row(dx_ptr + m64 * stride_dxm, acc, offs_d, mask_d, EVEN_D, EVICT)


_twell_train_backward_launch = Launcher(_twell_train_backward_kernel)


# ----------------------------------------------------------------------------------------------------
# launchers


def _constexprs(config: TwellTrainConfig, d: int, n_tiles: int, slots: int, *, gated: bool,
                aligned: bool, deterministic: bool = False) -> dict[str, object]:
    """The kernels' meta-parameters for a launch; they depend on D, n_tiles and slots, never on
    M (so the number of compiled variants stays put when only M changes)."""
    return dict(
        GATED=gated,
        ALIGNED=aligned,
        ONE_D_BLOCK=config.block_d >= d,
        EVEN_D=d % config.block_d == 0,
        BLOCK_M=config.block_m,
        BLOCK_U=config.block_u,
        # no batch needs more lanes than a row can have valid slots
        BLOCK_N=max(config.block_u, min(config.block_n, next_power_of_2(n_tiles * slots))),
        BLOCK_D=config.block_d,
        BLOCK_T=min(next_power_of_2(n_tiles), config.max_block_t),
        EVICT=config.evict,
        SPLIT=splits(config.split_slots, d, config.block_d, n_tiles, slots),
        PIECE=config.split_slots,
        PIECE_ORDER=deterministic and splits(config.split_slots, d, config.block_d, n_tiles, slots),
    )


def _split(config: TwellTrainConfig, counts: torch.Tensor, d: int, slots: int, overflow_out=None, overflow_list=None):
    return prepare_launch(counts, slots, piece=config.split_slots, cap=config.split_cap,
                          max_block_t=config.max_block_t, d=d, block_d=config.block_d, overflow_out=overflow_out,
                          overflow_list=overflow_list)


def _check(t: object, name: str, shape: tuple[int, ...], dtype: torch.dtype,
           device: torch.device, *, contiguous: bool = False, unit_stride: bool = False) -> torch.Tensor:
    """Raise TypeError / ValueError naming `name` unless t is a tensor of that shape, dtype and
    device (and contiguous / of unit stride along its last dimension when asked)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if unit_stride and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dimension, got strides "
                         f"{list(t.stride())}")
    return t


def _check_packed(values, columns, counts, m: int, dtype: torch.dtype, device: torch.device,
                  tile: object) -> tuple[int, int, int]:
    """(tile, n_tiles, slots) of the TwELL fields after checking them against M rows of dtype."""
    if not isinstance(tile, int) or isinstance(tile, bool) or not 1 <= tile <= 32768:
        raise ValueError(f"tile must be an int in [1, 32768], got {tile!r}")
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() != 3:
        raise ValueError(f"values must have shape [M, n_tiles, slots], got {list(values.shape)}")
    n_tiles, slots = values.shape[1], values.shape[2]
    if not 1 <= slots <= tile:
        raise ValueError(f"values must have 1 <= slots <= tile = {tile}, got slots = {slots}")
    _check(values, "values", (m, n_tiles, slots), dtype, device, contiguous=True)
    _check(columns, "columns", (m, n_tiles, slots), torch.int16, device, contiguous=True)
    _check(counts, "counts", (m, n_tiles), torch.int32, device, contiguous=True)
    return tile, n_tiles, slots


def _check_weight(w: object, name: str, n_tiles: int, tile: int, d: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, int]:
    """(w, H) for an [H, D] weight whose H has cdiv(H, tile) = n_tiles."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2 or w.shape[1] != d:
        raise ValueError(f"{name} must have shape [H, D] with D = {d}, got {list(w.shape)}")
    h = w.shape[0]
    if cdiv(h, tile) != n_tiles:
        raise ValueError(f"{name} has H = {h} rows, but values has n_tiles = {n_tiles} tiles of "
                         f"{tile}: expected cdiv(H, tile) == n_tiles")
    _check(w, name, (h, d), dtype, device, unit_stride=True)
    return w, h


def _check_config(config: object, default: TwellTrainConfig) -> TwellTrainConfig:
    if config is None:
        return default
    if not isinstance(config, TwellTrainConfig):
        raise TypeError(f"config must be a TwellTrainConfig or None, got {type(config).__name__}")
    return config


def _check_gated(gated: object) -> bool:
    if not isinstance(gated, bool):
        raise TypeError(f"gated must be a bool, got {gated!r}")
    return gated


def _aligned(d: int, block_d: int, rows: list[torch.Tensor]) -> bool:
    """What the kernels' multiple_of / max_constancy hints claim: D % 8 == 0 and 16-byte aligned
    bases and row strides of every [*, D] operand."""
    return (d % 8 == 0 and block_d >= 8
            and all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
                    for t in rows))


def twell_train_forward(
    x: torch.Tensor,
    values: torch.Tensor,
    columns: torch.Tensor,
    counts: torch.Tensor,
    up_weight: torch.Tensor | None,
    down_weight_t: torch.Tensor,
    *,
    tile: int,
    gated: bool,
    out: torch.Tensor,
    u_out: torch.Tensor | None,
    row_l1_out: torch.Tensor,
    overflow_out: torch.Tensor | None = None,
    overflow_list: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: TwellTrainConfig | None = None,
    deterministic: bool = False,
) -> None:
    """Training forward of the ordinary rows of a TwELL-packed p: writes y into `out` [M, D],
    u (gated) into the valid slots of `u_out` [M, n_tiles, slots] fp32 and Σ_j |h_j| into
    `row_l1_out` [M] fp32. Rows with some count > slots are not written in any output; with
    `overflow_out` (bool / uint8 [M]) they are flagged there, with `overflow_list` (ids int32 [M],
    count int32 [1] zeroed by the caller) listed in ids[0:count] in no particular order.
    Non-gated: `up_weight` and `u_out` are unused and may be None. `config` overrides
    `default_forward_config(D)`. deterministic: the same bits on every run also when more long rows
    than the split list holds run whole (kernels/row_split.py, "Bits"). No host synchronisation."""
    gated = _check_gated(gated)
    m, d = check_matrix(x, "x")
    tile, n_tiles, slots = _check_packed(values, columns, counts, m, x.dtype, x.device, tile)
    down_weight_t, h = _check_weight(down_weight_t, "down_weight_t", n_tiles, tile, d, x.dtype,
                                     x.device)
    if gated:
        up_weight, _ = _check_weight(up_weight, "up_weight", n_tiles, tile, d, x.dtype, x.device)
        if tuple(up_weight.shape) != (h, d):
            raise ValueError(f"up_weight must have down_weight_t's shape {[h, d]}, got "
                             f"{list(up_weight.shape)}")
        _check(u_out, "u_out", (m, n_tiles, slots), torch.float32, x.device, contiguous=True)
    _check(out, "out", (m, d), x.dtype, x.device, unit_stride=True)
    _check(row_l1_out, "row_l1_out", (m,), torch.float32, x.device, contiguous=True)
    if overflow_out is not None:
        _check(overflow_out, "overflow_out", (m,), overflow_out.dtype, x.device, contiguous=True)
        if overflow_out.dtype not in (torch.bool, torch.uint8):
            raise TypeError(f"overflow_out must be torch.bool or torch.uint8, got {overflow_out.dtype}")
    if overflow_list is not None:
        check_row_list(overflow_list, "overflow_list", m, x.device)
    config = _check_config(config, default_forward_config(d))
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if m == 0:
        return
    if d > 1 and x.stride(1) != 1:
        x = x.contiguous()  # the kernel reads 16-byte vectors along D
    rows = [x, down_weight_t, out] + ([up_weight] if gated else [])
    aligned = _aligned(d, config.block_d, rows)
    rows_split = _split(config, counts, d, slots, overflow_out, overflow_list)
    (*split_ptrs, cap, max_pieces), piece_programs = launch_args(rows_split, d, scalars=True)
    grid = (piece_programs + cdiv(m, config.block_m), cdiv(d, config.block_d))
    _twell_train_forward_launch[grid](
        x, values, columns, counts, up_weight if gated else down_weight_t, down_weight_t, out,
        u_out if gated else row_l1_out, row_l1_out, *split_ptrs,
        m, d, n_tiles, tile, slots, cap, max_pieces,
        x.stride(0), up_weight.stride(0) if gated else 0, down_weight_t.stride(0), out.stride(0),
        **_constexprs(config, d, n_tiles, slots, gated=gated, aligned=aligned, deterministic=deterministic),
        num_warps=config.num_warps,
        maxnreg=config.max_regs,
    )


def twell_train_backward(
    dy: torch.Tensor,
    values: torch.Tensor,
    columns: torch.Tensor,
    counts: torch.Tensor,
    u_slots: torch.Tensor | None,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight_t: torch.Tensor,
    l1_grad: torch.Tensor,
    *,
    tile: int,
    gated: bool,
    dx_out: torch.Tensor,
    du_out: torch.Tensor | None,
    dg_out: torch.Tensor,
    config: TwellTrainConfig | None = None,
    deterministic: bool = False,
) -> None:
    """Token-major backward of the ordinary rows of a TwELL-packed p: writes dx into `dx_out`
    [M, D] (dy's dtype) and, at the valid slots of [M, n_tiles, slots] fp32 tensors, du into
    `du_out` and dg into `dg_out` (gated), or d(first projection) into `dg_out` (non-gated;
    `u_slots`, `gate_weight`, `du_out` must then be None). `u_slots` is the forward's `u_out`;
    `up_weight` is the first weight when non-gated. `l1_grad` is a 1-element fp32 tensor on the
    device. Rows with some count > slots are not written. `config` overrides
    `default_backward_config(D)`; deterministic as in `twell_train_forward`. No host
    synchronisation. The layer input x is not needed: u comes from `u_slots`, and dx needs only dy
    and the weights."""
    gated = _check_gated(gated)
    m, d = check_matrix(dy, "dy")
    dev = dy.device
    tile, n_tiles, slots = _check_packed(values, columns, counts, m, dy.dtype, dev, tile)
    down_weight_t, h = _check_weight(down_weight_t, "down_weight_t", n_tiles, tile, d, dy.dtype, dev)
    _check(up_weight, "up_weight", (h, d), dy.dtype, dev, unit_stride=True)
    if gated:
        _check(gate_weight, "gate_weight", (h, d), dy.dtype, dev, unit_stride=True)
        _check(u_slots, "u_slots", (m, n_tiles, slots), torch.float32, dev, contiguous=True)
        _check(du_out, "du_out", (m, n_tiles, slots), torch.float32, dev, contiguous=True)
    else:
        for name, t in (("gate_weight", gate_weight), ("u_slots", u_slots), ("du_out", du_out)):
            if t is not None:
                raise ValueError(f"{name} must be None when gated=False, got a "
                                 f"{type(t).__name__}")
    _check(dg_out, "dg_out", (m, n_tiles, slots), torch.float32, dev, contiguous=True)
    _check(l1_grad, "l1_grad", (1,), torch.float32, dev)
    _check(dx_out, "dx_out", (m, d), dy.dtype, dev, unit_stride=True)
    config = _check_config(config, default_backward_config(d))
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if m == 0:
        return
    if d > 1 and dy.stride(1) != 1:
        dy = dy.contiguous()  # the kernel reads 16-byte vectors along D
    rows = [dy, up_weight, down_weight_t, dx_out] + ([gate_weight] if gated else [])
    aligned = _aligned(d, config.block_d, rows)
    (*split_ptrs, cap, max_pieces), piece_programs = launch_args(_split(config, counts, d, slots), d)
    grid = (piece_programs + cdiv(m, config.block_m), cdiv(d, config.block_d))
    _twell_train_backward_launch[grid](
        dy, values, columns, counts, u_slots if gated else dg_out,
        gate_weight if gated else up_weight, up_weight, down_weight_t, l1_grad,
        dx_out, du_out if gated else dg_out, dg_out, *split_ptrs,
        m, d, n_tiles, tile, slots, cap, max_pieces,
        dy.stride(0), gate_weight.stride(0) if gated else 0, up_weight.stride(0),
        down_weight_t.stride(0), dx_out.stride(0),
        **_constexprs(config, d, n_tiles, slots, gated=gated, aligned=aligned, deterministic=deterministic),
        num_warps=config.num_warps,
        maxnreg=config.max_regs,
    )
