"""Fused up + down projection of the sparse MLP, reading the gate activation packed in TwELL.

Per ordinary (non-overflow) row m of x [M, D], over its valid slots (t, k) (`k < counts[m, t]`,
unit j = t * tile + columns[m, t, k], p_j = values[m, t, k]):

    gated:      u_j = x[m] · up_weight[j]      h_j = p_j · u_j      y[m] = Σ_j h_j · down_weight[:, j]
    non-gated:  h_j = p_j                                           y[m] = Σ_j h_j · down_weight[:, j]

Products, u, h and the sum are fp32; y is rounded to x's dtype once, at the store. Overflow rows
(some `counts[m, t] > slots`, docs/format.md) are skipped: their rows of `out` are left to the dense
backup. Unspecified slots (`k >= counts[m, t]`) are never read.

Layouts: x, out [M, D] bf16 / fp16, unit stride along D (any row stride); values [M, n_tiles, slots]
x's dtype, columns (int16, tile-local) and counts [M, n_tiles] (int32, true counts) contiguous, as
in docs/format.md; up_weight [H, D] (gated only) and down_t [H, D] = down_proj.weight^T (row j = the
down column of unit j), x's dtype, unit stride along D, any row stride: an active unit costs two
contiguous D-element reads (a down weight stored transposed, as SparseMLP stores it, is read as is).

Grid (cdiv(M, BLOCK_M), cdiv(D, BLOCK_D)): a program owns a few tokens and one slice of y. Per token
it scans the counts, gathers BLOCK_N valid slots at once into a register list (unit, p), then loads
the weight rows of BLOCK_U units together and accumulates; only the ~nnz valid slots are visited,
never the n_tiles·slots mostly empty ones. With BLOCK_D >= D (the default up to D = 8192) x[m] and
y[m] stay in registers and each weight element is read once per (token, active unit). Rows with
many active units are split over programs (kernels/row_split.py); few-token calls use short pieces.
Design and its measurements: docs/design.md ("Inference"), docs/kernel-notes.md.

Constraints: M >= 1 (M = 0 returns the empty output), any D >= 1, any H, 1 <= slots <= tile <= 32768,
n_tiles = cdiv(H, tile). Offsets that can pass 2**31 (token rows, slot indices, weight rows) are
int64.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import cdiv, check_matrix, next_power_of_2, num_sms
from sparseffn.kernels.configs.twell_up_down import UpDownConfig, default_config
from sparseffn.kernels.launch import Launcher
from sparseffn.kernels.row_split import check_row_list, gather_pieces, launch_args, listed_row, prepare_launch, splits

__all__ = ["twell_up_down"]

_INTERPRETER_SMS = 2  # "SMs" of the CPU interpreter, for persistent grids


@triton.jit
def _load_counts(counts_row, t0, n_tiles, valid, BLOCK_T: tl.constexpr, EVICT: tl.constexpr):
    """[BLOCK_T] int32 counts of tiles t0 .. t0 + BLOCK_T - 1 of one row; 0 past n_tiles or when
    not `valid`."""
    tiles = t0 + tl.arange(0, BLOCK_T)
    return tl.load(counts_row + tiles, mask=(tiles < n_tiles) & valid, other=0,
                   eviction_policy="evict_first" if EVICT else "")


@triton.jit
def _load_rows(weight_ptr, pairs, i, pred, offs_d, mask_d, down_ptr, stride_dh, stride_wh,
               GATED: tl.constexpr, ALIGNED: tl.constexpr, ONE_D_BLOCK: tl.constexpr,
               EVEN_D: tl.constexpr, PREDICATED: tl.constexpr, BLOCK_U: tl.constexpr,
               BLOCK_N: tl.constexpr, EVICT: tl.constexpr):
    """(unit [BLOCK_U] int32, p [BLOCK_U] fp32, up rows [BLOCK_U, BLOCK_D], down rows
    [BLOCK_U, BLOCK_D]) of the chunk at indices i (< BLOCK_N) of the register list `pairs`.

    The chunk's (unit, p) come from one tl.gather (through shared memory, no global memory
    access; with BLOCK_N == BLOCK_U the list is the chunk). The down rows are issued first (they
    do not depend on u). Without a whole-D up load (non-gated, or D split over programs) `up` is
    `down` (unused). PREDICATED: load only if the scalar `pred` holds (the tiles are undefined
    otherwise). Every unit is a valid row (dead lanes repeat a live unit with p = 0), so only D
    is masked, and only if not EVEN_D."""
    if BLOCK_N == BLOCK_U:
        got = pairs
    else:
        got = tl.gather(pairs, i, 0)
    unit = (got >> 32).to(tl.int32)
    p = (got & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    up_row = weight_ptr + unit.to(tl.int64) * stride_wh  # [BLOCK_U] up row starts
    down_row = down_ptr + unit.to(tl.int64) * stride_dh  # [BLOCK_U]
    if ALIGNED:
        up_row = tl.multiple_of(up_row, 16)
        down_row = tl.multiple_of(down_row, 16)
    down_ptrs = down_row[:, None] + offs_d[None, :]  # [BLOCK_U, BLOCK_D]
    up_ptrs = up_row[:, None] + offs_d[None, :]
    # weights are re-read by every token that uses the unit: ask L2 to keep them
    policy: tl.constexpr = "evict_last" if EVICT else ""
    if PREDICATED:
        if EVEN_D:
            w_mask = tl.full(down_ptrs.shape, 1, tl.int1) & pred
        else:
            w_mask = mask_d[None, :] & pred
        down = tl.load(down_ptrs, mask=w_mask, eviction_policy=policy)
        if GATED and ONE_D_BLOCK:
            up = tl.load(up_ptrs, mask=w_mask, eviction_policy=policy)
        else:
            up = down
    elif EVEN_D:
        down = tl.load(down_ptrs, eviction_policy=policy)
        if GATED and ONE_D_BLOCK:
            up = tl.load(up_ptrs, eviction_policy=policy)
        else:
            up = down
    else:
        down = tl.load(down_ptrs, mask=mask_d[None, :], other=0.0, eviction_policy=policy)
        if GATED and ONE_D_BLOCK:
            up = tl.load(up_ptrs, mask=mask_d[None, :], other=0.0, eviction_policy=policy)
        else:
            up = down
    return unit, p, up, down


@triton.jit
def _accumulate(acc, xv, x_row, up, down, unit, p, weight_ptr, D, stride_wh,
                GATED: tl.constexpr, ALIGNED: tl.constexpr, ONE_D_BLOCK: tl.constexpr,
                BLOCK_D: tl.constexpr, EVICT: tl.constexpr):
    """acc [BLOCK_D] fp32 + Σ_u h_u · down[u], h = p · (x · up_u) (gated) or p."""
    if GATED:
        if ONE_D_BLOCK:
            u = tl.sum(up.to(tl.float32) * xv[None, :], 1)  # [BLOCK_U] fp32
        else:
            # D split over programs: every program forms the whole u from all D blocks
            up_row = weight_ptr + unit.to(tl.int64) * stride_wh
            if ALIGNED:
                up_row = tl.multiple_of(up_row, 16)
            u = tl.zeros(p.shape, dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                offs_k = d0 + tl.arange(0, BLOCK_D)
                mask_k = offs_k < D
                if ALIGNED:
                    mask_k = tl.max_constancy(mask_k, 8)
                xk = tl.load(x_row + offs_k, mask=mask_k, other=0.0)
                up_k = tl.load(up_row[:, None] + offs_k[None, :], mask=mask_k[None, :], other=0.0,
                               eviction_policy="evict_last" if EVICT else "")
                u += tl.sum(up_k.to(tl.float32) * xk.to(tl.float32)[None, :], 1)
        h = p * u  # [BLOCK_U] fp32
    else:
        h = p
    return acc + tl.sum(h[:, None] * down.to(tl.float32), 0)


@triton.jit
def _accumulate_batch(acc, xv, x_row, pairs, n, weight_ptr, offs_d, mask_d, D, stride_wh,
                      down_ptr, stride_dh,
                      GATED: tl.constexpr, ALIGNED: tl.constexpr, ONE_D_BLOCK: tl.constexpr,
                      EVEN_D: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr,
                      EVICT: tl.constexpr):
    """acc + the contributions of the first n (1 <= n <= BLOCK_N) entries of the register list
    pairs [BLOCK_N] (entries n.. repeat a live unit with p = 0), BLOCK_U units per chunk."""
    lanes = tl.arange(0, BLOCK_U)
    if PREFETCH:
        # register double buffering: chunk c + 1's weight rows are issued before chunk c is reduced
        unit, p, up, down = _load_rows(weight_ptr, pairs, lanes, True, offs_d, mask_d, down_ptr, stride_dh,
                                       stride_wh, GATED, ALIGNED, ONE_D_BLOCK, EVEN_D, False,
                                       BLOCK_U, BLOCK_N, EVICT)
        for c0 in range(0, n, BLOCK_U):
            c1 = c0 + BLOCK_U
            # past the batch: any in-range index, the loads are predicated off
            unit_next, p_next, up_next, down_next = _load_rows(
                weight_ptr, pairs, (c1 % BLOCK_N) + lanes, c1 < n, offs_d, mask_d, down_ptr, stride_dh,
                stride_wh, GATED, ALIGNED, ONE_D_BLOCK, EVEN_D, True, BLOCK_U, BLOCK_N, EVICT)
            acc = _accumulate(acc, xv, x_row, up, down, unit, p, weight_ptr, D, stride_wh,
                              GATED, ALIGNED, ONE_D_BLOCK, BLOCK_D, EVICT)
            unit, p, up, down = unit_next, p_next, up_next, down_next
    else:
        for c0 in range(0, n, BLOCK_U):
            unit, p, up, down = _load_rows(weight_ptr, pairs, c0 + lanes, True, offs_d, mask_d,
                                           down_ptr, stride_dh, stride_wh, GATED, ALIGNED, ONE_D_BLOCK,
                                           EVEN_D, False, BLOCK_U, BLOCK_N, EVICT)
            acc = _accumulate(acc, xv, x_row, up, down, unit, p, weight_ptr, D, stride_wh,
                              GATED, ALIGNED, ONE_D_BLOCK, BLOCK_D, EVICT)
    return acc


@triton.jit
def _batch_slots(columns_ptr, values_ptr, counts_row, cnt0, m64, b, nnz, ok,
                 n_tiles, slots,
                 BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, EVICT: tl.constexpr):
    """(tile t [BLOCK_N] int32, column, value) of the valid slots b .. b + BLOCK_N - 1 of row m
    (nnz valid slots, first counts segment cnt0), as issued loads: nothing here waits for them.
    Every count of an ordinary row is <= slots, so all counted slots are valid; lanes past nnz
    repeat the last valid slot (`_pairs` zeroes their p). Nothing is read unless `ok`.

    Compact index i -> (tile t, slot k) from the counts alone, no memory traffic unless
    n_tiles > BLOCK_T: t = #{tiles whose inclusive end <= i}, k = i - (valid slots before t)."""
    ok = ok & (nnz > 0)
    ic = tl.minimum(b + tl.arange(0, BLOCK_N), nnz - 1)  # [BLOCK_N] compact valid-slot indices
    before = tl.cumsum(cnt0, 0)[None, :] <= ic[:, None]  # [BLOCK_N, BLOCK_T] tiles ending <= ic
    t = tl.sum(before.to(tl.int32), 1)
    k = ic - tl.sum(tl.where(before, cnt0[None, :], 0), 1)
    base = tl.sum(cnt0, 0)
    for t0 in range(BLOCK_T, n_tiles, BLOCK_T):  # further counts segments (n_tiles > BLOCK_T)
        tiles = t0 + tl.arange(0, BLOCK_T)
        cnt = tl.load(counts_row + tiles, mask=(tiles < n_tiles) & ok, other=0,
                      eviction_policy="evict_first" if EVICT else "")
        before = (base + tl.cumsum(cnt, 0))[None, :] <= ic[:, None]
        t += tl.sum(before.to(tl.int32), 1)
        k -= tl.sum(tl.where(before, cnt[None, :], 0), 1)
        base += tl.sum(cnt, 0)
    slot = (m64 * n_tiles + t) * slots + k  # [BLOCK_N] int64 flat slot
    stream: tl.constexpr = "evict_first" if EVICT else ""
    col = tl.load(columns_ptr + slot, mask=ok, other=0, eviction_policy=stream)
    val = tl.load(values_ptr + slot, mask=ok, other=0.0, eviction_policy=stream)
    return t, col, val


@triton.jit
def _pairs(t, col, val, b, nnz, tile, BLOCK_N: tl.constexpr):
    """[BLOCK_N] int64 register list (unit << 32 | bits of fp32 p) of a batch from `_batch_slots`;
    lanes past nnz keep their (real) unit with p = 0, so weight loads need no per-unit mask."""
    p = tl.where(b + tl.arange(0, BLOCK_N) < nnz, val.to(tl.float32), 0.0)
    unit = t * tile + col.to(tl.int32)  # [BLOCK_N] global unit j < H
    return (unit.to(tl.int64) << 32) | (p.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def _row_nnz(counts_row, cnt0, valid, n_tiles, BLOCK_T: tl.constexpr, EVICT: tl.constexpr):
    """(largest count, valid slots) of the row whose counts start at counts_row and whose first
    counts segment is cnt0."""
    worst = tl.max(cnt0, 0)
    nnz = tl.sum(cnt0, 0)
    for t0 in range(BLOCK_T, n_tiles, BLOCK_T):  # further counts segments (n_tiles > BLOCK_T)
        seg = _load_counts(counts_row, t0, n_tiles, valid, BLOCK_T, EVICT)  # [BLOCK_T] int32
        worst = tl.maximum(worst, tl.max(seg, 0))
        nnz += tl.sum(seg, 0)
    return worst, nnz


@triton.jit
def _piece_head(pid, counts_ptr, split_ids_ptr, split_state_ptr, split_cap, max_pieces, n_tiles,
                PIECE: tl.constexpr, BLOCK_T: tl.constexpr, EVICT: tl.constexpr):
    """(work, i, piece, m, counts row, first counts segment, nnz, first slot) of piece program pid
    (row_split.py); `work` says the list has the row and the row has slots in this piece."""
    listed, i, piece, m64 = listed_row(pid, split_ids_ptr, split_state_ptr, split_cap, max_pieces)
    counts_row = counts_ptr + m64 * n_tiles  # row 0 when not listed: read, never used
    cnt0 = _load_counts(counts_row, 0, n_tiles, listed, BLOCK_T, EVICT)
    nnz = _row_nnz(counts_row, cnt0, listed, n_tiles, BLOCK_T, EVICT)[1]
    b0 = piece * PIECE
    return listed & (b0 < nnz), i, piece, m64, counts_row, cnt0, nnz, b0


@triton.jit
def _row_head(columns_ptr, values_ptr, counts_ptr, split_flags_ptr, cnt0, m, valid, n_tiles, slots,
              SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, EVICT: tl.constexpr):
    """(ordinary, nnz, first batch (t, column, value) of `_batch_slots`) of row m whose first
    counts segment is cnt0, as issued loads. `ordinary` is False for overflow rows (out[m] is
    left to the dense backup path), for rows split over programs (SPLIT: their pieces write
    out[m]) and for rows that are not `valid` (not this program's: nothing of them is read)."""
    m64 = m.to(tl.int64)
    counts_row = counts_ptr + m64 * n_tiles
    worst, nnz = _row_nnz(counts_row, cnt0, valid, n_tiles, BLOCK_T, EVICT)
    ok = valid & (worst <= slots)
    if SPLIT:
        ok = ok & (tl.load(split_flags_ptr + m64, mask=valid, other=0) == 0)
    t, col, val = _batch_slots(columns_ptr, values_ptr, counts_row, cnt0, m64, 0, nnz, ok,
                               n_tiles, slots, BLOCK_N, BLOCK_T, EVICT)
    return ok, nnz, t, col, val


@triton.jit
def _split_piece(pid, x_ptr, values_ptr, columns_ptr, counts_ptr, weight_ptr, out_ptr,
                 split_ids_ptr, split_state_ptr, partials_ptr, split_cap, max_pieces,
                 D, n_tiles, tile, slots, stride_xm, stride_wh, stride_om, offs_d, mask_d, down_ptr, stride_dh,
                 GATED: tl.constexpr, ALIGNED: tl.constexpr, EVEN_D: tl.constexpr, PIECE: tl.constexpr,
                 BLOCK_U: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr, EVICT: tl.constexpr):
    """Piece program pid of the split rows (row_split.py): the piece's valid slots, its fp32 partial
    of y[m], and y[m] itself from the row's last piece to arrive, rounded once."""
    work, i, piece, m64, counts_row, cnt0, nnz, b0 = _piece_head(
        pid, counts_ptr, split_ids_ptr, split_state_ptr, split_cap, max_pieces, n_tiles, PIECE, BLOCK_T, EVICT)
    if work:
        x_row = x_ptr + m64 * stride_xm
        if ALIGNED:
            x_row = tl.multiple_of(x_row, 16)
        if GATED:
            xv = tl.load(x_row + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        else:
            xv = tl.zeros([BLOCK_D], dtype=tl.float32)  # unused
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for b in range(b0, tl.minimum(nnz, b0 + PIECE), BLOCK_N):
            t, col, val = _batch_slots(columns_ptr, values_ptr, counts_row, cnt0, m64, b, nnz, True,
                                       n_tiles, slots, BLOCK_N, BLOCK_T, EVICT)
            pairs = _pairs(t, col, val, b, nnz, tile, BLOCK_N)
            acc = _accumulate_batch(acc, xv, x_row, pairs, tl.minimum(nnz - b, BLOCK_N),
                                    weight_ptr, offs_d, mask_d, D, stride_wh, down_ptr, stride_dh,
                                    GATED, ALIGNED, True, EVEN_D, BLOCK_U, BLOCK_N,
                                    BLOCK_D, PREFETCH, EVICT)
        last, y, no_scalar = gather_pieces(partials_ptr, partials_ptr, i, piece, tl.cdiv(nnz, PIECE), max_pieces,
                                           acc, 0.0, offs_d, mask_d, D, split_state_ptr, False)
        if last:
            out_row = out_ptr + m64 * stride_om
            if ALIGNED:
                out_row = tl.multiple_of(out_row, 16)
            tl.store(out_row + offs_d, y.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _twell_up_down_kernel(
    x_ptr, values_ptr, columns_ptr, counts_ptr, weight_ptr, down_ptr, out_ptr,
    split_flags_ptr, split_ids_ptr, split_state_ptr, partials_ptr,
    M, D, n_tiles, tile, slots, split_cap, max_pieces,
    stride_xm, stride_wh, stride_dh, stride_om,
    GATED: tl.constexpr,          # u = x · up rows (weight_ptr) enters h (True), or h = p (False)
    ALIGNED: tl.constexpr,        # D % 8 == 0, 16-byte aligned bases and row strides
    ONE_D_BLOCK: tl.constexpr,    # BLOCK_D >= D: x[m] is loaded once per token, u needs no loop
    EVEN_D: tl.constexpr,         # D % BLOCK_D == 0: no mask along D
    BLOCK_M: tl.constexpr,        # tokens per program (consecutive; no reuse across them: docs/design.md)
    PERSISTENT: tl.constexpr,     # instead: program p takes rows p, p + grid, p + 2 grid, ...
    BLOCK_U: tl.constexpr,        # active units per chunk (weight rows loaded together)
    BLOCK_N: tl.constexpr,        # compact slots per batch (columns/values gathered together)
    BLOCK_D: tl.constexpr,        # y columns per program (power of two)
    BLOCK_T: tl.constexpr,        # tiles per counts segment (power of two)
    PREFETCH: tl.constexpr,       # double-buffer the chunk loop in registers
    LOOKAHEAD: tl.constexpr,      # the next token's columns/values load under this token's chunks
    EVICT: tl.constexpr,          # L2 hints: weights evict_last, streamed data evict_first
    SPLIT: tl.constexpr,          # the first split_cap * max_pieces programs run split-row pieces
    PIECE: tl.constexpr,          # valid slots per piece of a split row (a multiple of BLOCK_N)
    PIECE_ORDER: tl.constexpr,    # SPLIT, deterministic: long rows run whole also sum piece by piece
):
    """y = down(p ⊙ (x up^T)) for the ordinary rows (module docstring). Per token a row program
      1. scans the row's counts (BLOCK_T tiles at a time) and skips the row if any count > slots;
      2. gathers BLOCK_N valid slots at once: lane i finds its tile from the counts alone as
         `t = #{tiles with cumsum(counts) <= i}` and its slot as `k = i - Σ_{those tiles} counts`
         (a [BLOCK_N, BLOCK_T] compare, no memory traffic); the columns and values then load
         together into one register list of (unit << 32 | bits of fp32 p). Lanes past nnz repeat
         the last valid slot with p = 0, so the weight loads need no per-unit mask;
      3. per chunk of BLOCK_U units (one tl.gather from the list) issues the down rows and (gated)
         the up rows together, 2·BLOCK_U independent 16-byte-vectorized rows in flight; the up dot
         products reduce over D to u [BLOCK_U] fp32, then y += Σ_u (p·u) · down.
    With BLOCK_D < D the grid splits D: down rows are still read once, but each D-slice program
    re-reads the whole up rows to form u. Variants of the chunk loop (UpDownConfig: LOOKAHEAD,
    PREFETCH, EVICT, max_regs) overlap the latency chain columns -> weight rows. Triton's
    software-pipelined chunk loop (`tl.range(num_stages > 1)`, rows staged through shared memory)
    faulted on sm_90 (illegal memory access), so the chunk loop is a plain loop."""
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D] this program's slice of y
    mask_d = offs_d < D
    if ALIGNED:
        mask_d = tl.max_constancy(mask_d, 8)
    # the pieces of long rows come first, so they start in the first wave instead of finishing the
    # launch as one long chain each (split_cap = max_pieces = 0 without SPLIT: no piece programs)
    n_piece_programs = split_cap * max_pieces
    if tl.program_id(0) < n_piece_programs:
        if SPLIT:
            _split_piece(tl.program_id(0), x_ptr, values_ptr, columns_ptr, counts_ptr, weight_ptr, out_ptr,
                         split_ids_ptr, split_state_ptr, partials_ptr, split_cap, max_pieces,
                         D, n_tiles, tile, slots, stride_xm, stride_wh, stride_om, offs_d, mask_d,
                         down_ptr, stride_dh, GATED, ALIGNED, EVEN_D, PIECE, BLOCK_U, BLOCK_N, BLOCK_D, BLOCK_T,
                         PREFETCH, EVICT)
    else:
        _row_programs(tl.program_id(0) - n_piece_programs, tl.num_programs(0) - n_piece_programs,
                      x_ptr, values_ptr, columns_ptr, counts_ptr, weight_ptr, out_ptr, split_flags_ptr,
                      M, D, n_tiles, tile, slots, stride_xm, stride_wh, stride_om, offs_d, mask_d,
                      down_ptr, stride_dh, GATED, ALIGNED, ONE_D_BLOCK, EVEN_D, BLOCK_M, PERSISTENT, BLOCK_U,
                      BLOCK_N, BLOCK_D, BLOCK_T, PREFETCH, LOOKAHEAD, EVICT, SPLIT, PIECE, PIECE_ORDER)


_twell_up_down_launch = Launcher(_twell_up_down_kernel)


@triton.jit
def _row_batches(xv, x_row, t, col, val, b_lo, b_hi, nnz, columns_ptr, values_ptr, counts_row, cnt0, m64,
                 weight_ptr, offs_d, mask_d, D, n_tiles, tile, slots, stride_wh, down_ptr, stride_dh,
                 GATED: tl.constexpr, ALIGNED: tl.constexpr, ONE_D_BLOCK: tl.constexpr, EVEN_D: tl.constexpr,
                 BLOCK_U: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                 PREFETCH: tl.constexpr, EVICT: tl.constexpr):
    """fp32 [BLOCK_D] Σ from zero over the valid slots b_lo .. b_hi - 1 (batch starts, b_hi <= nnz) of
    row m, batch by batch as `_split_piece` runs a piece; (t, col, val) is the row's first batch
    (slots 0 ..), already issued by its head."""
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for b in range(b_lo, b_hi, BLOCK_N):  # more than one batch: rows with > BLOCK_N units
        if b > 0:
            t, col, val = _batch_slots(columns_ptr, values_ptr, counts_row, cnt0, m64, b,
                                       nnz, True, n_tiles, slots, BLOCK_N, BLOCK_T, EVICT)
        pairs = _pairs(t, col, val, b, nnz, tile, BLOCK_N)
        acc = _accumulate_batch(acc, xv, x_row, pairs, tl.minimum(nnz - b, BLOCK_N),
                                weight_ptr, offs_d, mask_d, D, stride_wh, down_ptr, stride_dh,
                                GATED, ALIGNED, ONE_D_BLOCK, EVEN_D, BLOCK_U, BLOCK_N,
                                BLOCK_D, PREFETCH, EVICT)
    return acc


@triton.jit
def _store_row(out_ptr, m64, stride_om, acc, offs_d, mask_d, ALIGNED: tl.constexpr, EVEN_D: tl.constexpr,
               stream: tl.constexpr):
    out_row = out_ptr + m64 * stride_om
    if ALIGNED:
        out_row = tl.multiple_of(out_row, 16)
    if EVEN_D:
        tl.store(out_row + offs_d, acc.to(out_ptr.dtype.element_ty), eviction_policy=stream)
    else:
        tl.store(out_row + offs_d, acc.to(out_ptr.dtype.element_ty), mask=mask_d, eviction_policy=stream)


@triton.jit
def _row_programs(pid_m, n_programs, x_ptr, values_ptr, columns_ptr, counts_ptr, weight_ptr, out_ptr,
                  split_flags_ptr, M, D, n_tiles, tile, slots, stride_xm, stride_wh, stride_om, offs_d, mask_d,
                  down_ptr, stride_dh, GATED: tl.constexpr, ALIGNED: tl.constexpr, ONE_D_BLOCK: tl.constexpr,
                  EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, PERSISTENT: tl.constexpr,
                  BLOCK_U: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_T: tl.constexpr, PREFETCH: tl.constexpr, LOOKAHEAD: tl.constexpr,
                  EVICT: tl.constexpr, SPLIT: tl.constexpr, PIECE: tl.constexpr, PIECE_ORDER: tl.constexpr):
    """Row program pid_m of n_programs: its rows (BLOCK_M consecutive ones, or every n_programs-th
    when PERSISTENT), one after the other."""
    stream: tl.constexpr = "evict_first" if EVICT else ""
    if PERSISTENT:
        # rows pid_m, pid_m + grid, pid_m + 2 grid, ...: every program gets ~M / grid rows
        m_first = pid_m
        m_step = n_programs
        n_rows = tl.cdiv(M - pid_m, m_step)
    else:
        m_first = pid_m * BLOCK_M
        m_step = 1
        n_rows = tl.minimum(M - m_first, BLOCK_M)
    # [BLOCK_T] first counts segment of the next row to start; rows that are not this program's
    # load nothing
    cnt_head = _load_counts(counts_ptr + m_first.to(tl.int64) * n_tiles, 0, n_tiles, n_rows > 0,
                            BLOCK_T, EVICT)
    if LOOKAHEAD:
        # the head of the next row (counts scan, columns/values of its first batch: issued, not
        # waited for) runs one row early: cnt_head and the *_head values belong to the next row,
        # cnt_next to the one after
        ok_head, nnz_head, t_head, col_head, val_head = _row_head(
            columns_ptr, values_ptr, counts_ptr, split_flags_ptr, cnt_head, m_first, n_rows > 0, n_tiles,
            slots, SPLIT, BLOCK_N, BLOCK_T, EVICT)
        cnt_next = _load_counts(counts_ptr + (m_first + m_step).to(tl.int64) * n_tiles, 0,
                                n_tiles, n_rows > 1, BLOCK_T, EVICT)
    for r in range(n_rows):
        m = m_first + r * m_step
        m64 = m.to(tl.int64)
        counts_row = counts_ptr + m64 * n_tiles
        cnt0 = cnt_head  # [BLOCK_T] first counts segment of row m
        if LOOKAHEAD:
            ok, nnz, t, col, val = ok_head, nnz_head, t_head, col_head, val_head
        else:
            # the next row's first counts segment is in flight while this row runs
            cnt_head = _load_counts(counts_row + m_step * n_tiles, 0, n_tiles, r + 1 < n_rows,
                                    BLOCK_T, EVICT)
            ok, nnz, t, col, val = _row_head(columns_ptr, values_ptr, counts_ptr, split_flags_ptr, cnt0, m,
                                             True, n_tiles, slots, SPLIT, BLOCK_N, BLOCK_T, EVICT)
        x_row = x_ptr + m64 * stride_xm
        if ALIGNED:
            x_row = tl.multiple_of(x_row, 16)
        if GATED and ONE_D_BLOCK:
            # [BLOCK_D] token row, reused by every chunk of the row; issued before the next row's
            # head so that both latencies overlap
            if EVEN_D:
                x = tl.load(x_row + offs_d, mask=ok, other=0.0, eviction_policy=stream)
            else:
                x = tl.load(x_row + offs_d, mask=mask_d & ok, other=0.0, eviction_policy=stream)
        else:
            x = tl.zeros([BLOCK_D], dtype=tl.float32)  # unused
        if LOOKAHEAD:
            ok_head, nnz_head, t_head, col_head, val_head = _row_head(
                columns_ptr, values_ptr, counts_ptr, split_flags_ptr, cnt_next, m + m_step, r + 1 < n_rows,
                n_tiles, slots, SPLIT, BLOCK_N, BLOCK_T, EVICT)
            cnt_head = cnt_next
            cnt_next = _load_counts(counts_row + 2 * m_step * n_tiles, 0, n_tiles, r + 2 < n_rows,
                                    BLOCK_T, EVICT)
        if ok:
            xv = x.to(tl.float32)  # [BLOCK_D] fp32
            if PIECE_ORDER:
                # deterministic mode: a long row the split list had no room for adds its pieces' sums
                # in piece order, as a listed row does (row_split.py, "Bits"), so y[m] does not
                # depend on which long rows the list took
                acc = tl.zeros([BLOCK_D], dtype=tl.float32)
                for p0 in range(0, nnz, PIECE):
                    acc += _row_batches(xv, x_row, t, col, val, p0, tl.minimum(nnz, p0 + PIECE), nnz,
                                        columns_ptr, values_ptr, counts_row, cnt0, m64, weight_ptr, offs_d,
                                        mask_d, D, n_tiles, tile, slots, stride_wh, down_ptr, stride_dh, GATED, ALIGNED,
                                        ONE_D_BLOCK, EVEN_D, BLOCK_U, BLOCK_N, BLOCK_D, BLOCK_T, PREFETCH, EVICT)
            else:
                acc = _row_batches(xv, x_row, t, col, val, 0, nnz, nnz, columns_ptr, values_ptr, counts_row,
                                   cnt0, m64, weight_ptr, offs_d, mask_d, D, n_tiles, tile, slots, stride_wh,
                                   down_ptr, stride_dh, GATED, ALIGNED, ONE_D_BLOCK, EVEN_D, BLOCK_U, BLOCK_N, BLOCK_D,
                                   BLOCK_T, PREFETCH, EVICT)
            _store_row(out_ptr, m64, stride_om, acc, offs_d, mask_d, ALIGNED, EVEN_D, stream)


def _check_tensor(t: object, name: str, shape: tuple[int, ...], dtype: torch.dtype | tuple,
                  device: torch.device | None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like x, got {t.device}")
    return t


@functools.lru_cache(maxsize=None)  # one dict per variant, built once (UpDownConfig is frozen)
def _constexprs(config: UpDownConfig, d: int, n_tiles: int, slots: int, *, gated: bool,
                aligned: bool, deterministic: bool = False) -> dict[str, object]:
    """The kernel's meta-parameters for a launch; they depend on the config, D, n_tiles and slots,
    never on M itself (the default config has three M buckets: at most three variants per shape)."""
    return dict(
        GATED=gated,
        ALIGNED=aligned,
        ONE_D_BLOCK=config.block_d >= d,
        EVEN_D=d % config.block_d == 0,
        BLOCK_M=1 if config.persistent else config.block_m,
        PERSISTENT=config.persistent > 0,
        BLOCK_U=config.block_u,
        # no batch needs more lanes than a row can have valid slots
        BLOCK_N=max(config.block_u, min(config.block_n, next_power_of_2(n_tiles * slots))),
        BLOCK_D=config.block_d,
        BLOCK_T=min(next_power_of_2(n_tiles), config.max_block_t),
        PREFETCH=config.prefetch,
        LOOKAHEAD=config.lookahead and (config.block_m > 1 or config.persistent > 0),
        EVICT=config.evict,
        SPLIT=splits(config.split_slots, d, config.block_d, n_tiles, slots),
        PIECE=config.split_slots,
        PIECE_ORDER=deterministic and splits(config.split_slots, d, config.block_d, n_tiles, slots),
    )


def twell_up_down(
    x: torch.Tensor,
    values: torch.Tensor,
    columns: torch.Tensor,
    counts: torch.Tensor,
    up_weight: torch.Tensor | None,
    down_t: torch.Tensor,
    *,
    tile: int,
    out: torch.Tensor | None = None,
    overflow_out: torch.Tensor | None = None,
    overflow_list: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: UpDownConfig | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """y [M, D] = down(p ⊙ up(x)) (or down(p) when up_weight is None) for the ordinary rows of a
    TwELL-packed p. up_weight [H, D] (up_proj.weight) and down_t [H, D] (down_proj.weight^T, row j
    = the down column of unit j): x's dtype and device, unit stride along D, any row stride (two
    views of one interleaved [H, 2, D] tensor put a unit's rows side by side).

    Rows with some count > slots are not written: pass `out` to pre-fill them (or fill them
    afterwards); with `out=None` they hold whatever torch.empty left there. Which rows those are
    (for the dense backup): overflow_out, None or a uint8 / bool [M] tensor that receives a flag per
    row; overflow_list, None or (ids int32 [M], count int32 [1] zeroed by the caller) that receives
    their ids in ids[0:count] in no particular order (what `dense_rows_mlp(row_list=)` takes).
    `config` overrides the launch heuristic (`default_config(D, M)`). deterministic: the same bits on
    every run also when more long rows than the split list holds run whole (kernels/row_split.py,
    "Bits"). Returns `out` (or the new tensor).
    """
    m, d = check_matrix(x, "x")
    if not isinstance(tile, int) or isinstance(tile, bool) or not 1 <= tile <= 32768:
        raise ValueError(f"tile must be an int in [1, 32768], got {tile!r}")
    h, _ = check_matrix(down_t, "down_t", "[H, D]")
    for name, w in (("up_weight", up_weight), ("down_t", down_t)):
        if w is None:
            continue
        _check_tensor(w, name, (h, d), x.dtype, x.device)
        if d > 1 and w.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along D, got strides {list(w.stride())}")
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() != 3:
        raise ValueError(f"values must have shape [M, n_tiles, slots], got {list(values.shape)}")
    n_tiles, slots = values.shape[1], values.shape[2]
    if n_tiles != cdiv(h, tile):
        raise ValueError(f"values must have n_tiles = cdiv(H={h}, tile={tile}) = {cdiv(h, tile)}"
                         f" tiles, got {n_tiles}")
    if not 1 <= slots <= tile:
        raise ValueError(f"values must have 1 <= slots <= tile = {tile}, got slots = {slots}")
    _check_tensor(values, "values", (m, n_tiles, slots), x.dtype, x.device)
    _check_tensor(columns, "columns", (m, n_tiles, slots), torch.int16, x.device)
    _check_tensor(counts, "counts", (m, n_tiles), torch.int32, x.device)
    for name, t in (("values", values), ("columns", columns), ("counts", counts)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (TwELL layout)")
    if out is None:
        out = torch.empty(m, d, dtype=x.dtype, device=x.device)
    else:
        _check_tensor(out, "out", (m, d), x.dtype, x.device)
        if d > 1 and out.stride(1) != 1:
            raise ValueError(f"out must have unit stride along D, got strides {list(out.stride())}")
    if overflow_out is not None:
        _check_tensor(overflow_out, "overflow_out", (m,), (torch.uint8, torch.bool), x.device)
        if not overflow_out.is_contiguous():
            raise ValueError("overflow_out must be contiguous")
    if overflow_list is not None:
        check_row_list(overflow_list, "overflow_list", m, x.device)
    if config is None:
        config = default_config(d, m)
    elif not isinstance(config, UpDownConfig):
        raise TypeError(f"config must be an UpDownConfig or None, got {type(config).__name__}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    return launch_up_down(x, values, columns, counts, up_weight, down_t, tile=tile, out=out,
                          overflow_out=overflow_out, overflow_list=overflow_list, config=config,
                          deterministic=deterministic)


def launch_up_down(
    x: torch.Tensor,
    values: torch.Tensor,
    columns: torch.Tensor,
    counts: torch.Tensor,
    up_weight: torch.Tensor | None,
    down_t: torch.Tensor,
    *,
    tile: int,
    out: torch.Tensor,
    overflow_out: torch.Tensor | None,
    overflow_list: tuple[torch.Tensor, torch.Tensor] | None,
    config: UpDownConfig,
    deterministic: bool,
) -> torch.Tensor:
    """`twell_up_down` on arguments that meet its contract, unchecked: for callers that built them
    (ops/twell_mlp.py: the TwELL from `gate_twell`, out and the list allocated there). The checks
    of every argument cost more host time than the launch on slow hosts. Returns out."""
    m, d = x.shape
    n_tiles, slots = values.shape[1], values.shape[2]
    if m == 0:
        return out
    rows = prepare_launch(counts, slots, piece=config.split_slots, cap=config.split_cap,
                          max_block_t=config.max_block_t, d=d, block_d=config.block_d, overflow_out=overflow_out,
                          overflow_list=overflow_list)
    if d == 0:
        return out
    if d > 1 and x.stride(1) != 1:
        x = x.contiguous()  # the kernel reads 16-byte vectors along D

    up = up_weight if up_weight is not None else down_t  # non-gated: no up rows are read
    elem = x.element_size()
    aligned = (  # what the kernel's multiple_of / max_constancy hints claim
        d % 8 == 0
        and config.block_d >= 8
        and all(t.data_ptr() % 16 == 0 for t in (x, up, down_t, out))
        and (x.stride(0) * elem) % 16 == 0
        and (up.stride(0) * elem) % 16 == 0
        and (down_t.stride(0) * elem) % 16 == 0
        and (out.stride(0) * elem) % 16 == 0
    )
    if config.persistent:
        sms = (num_sms(x.device) if x.is_cuda
               else _INTERPRETER_SMS)
        row_programs = min(m, config.persistent * sms)
    else:
        row_programs = cdiv(m, config.block_m)
    (*split_ptrs, cap, max_pieces), piece_programs = launch_args(rows, d)
    grid = (piece_programs + row_programs, cdiv(d, config.block_d))
    _twell_up_down_launch[grid](
        x, values, columns, counts, up, down_t, out, *split_ptrs,
        m, d, n_tiles, tile, slots, cap, max_pieces,
        x.stride(0), up.stride(0), down_t.stride(0), out.stride(0),
        **_constexprs(config, d, n_tiles, slots, gated=up_weight is not None, aligned=aligned,
                      deterministic=deterministic),
        num_warps=config.num_warps,
        maxnreg=config.max_regs,
    )
    return out
