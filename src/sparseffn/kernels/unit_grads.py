"""Unit-major (transposed) work of the sparse MLP backward: the weight gradients.

The weight gradients are sums over the tokens where a unit is active. Over the valid slots s =
(m, t, k) of the ordinary rows of a TwELL activation (unit j = t * tile + columns[m, t, k], p_s =
values[s]) and the per-slot fp32 results of twell_train.py (u_s forward, du_s and dg_s backward):

    gated:      grad_gate[j] = Σ_{s of j} dg_s x[m_s]    grad_up[j] = Σ_{s of j} du_s x[m_s]
                grad_down_t[j] = Σ_{s of j} (p_s u_s) dy[m_s]
    non-gated:  grad_up[j] = Σ_{s of j} dg_s x[m_s]      grad_down_t[j] = Σ_{s of j} p_s dy[m_s]

grad_down_t is [H, D] = (dL/d down_proj.weight)^T. The three fp32 [H, D] outputs are OVERWRITTEN,
every row (units without entries get 0); the dense-rows backward then adds the overflow rows' terms
and the caller rounds. Two steps, no host synchronisation (fixed-size buffers, counts on device):
  1. `slots_by_unit`: a CSR over units of the valid slots (offsets [H + 1], entries = token ids),
     the weight-gradient coefficients moved into entry order in the same pass, and the units'
     order hottest first. deterministic=True orders each unit's entries by token.
  2. `unit_weight_grads`: per unit and D slice, an fp32 sum over the unit's entries on CUDA cores,
     gathering x / dy rows; past `cap_entries` (256) a hot unit's entries spill in chunks to
     `_unit_spill_grads_kernel`, whose fp32 atomics add them (trained activity is skewed: one program
     per hot unit set the pace). Deterministic mode never spills.
Why CUDA cores and not tensor cores: the work is ~3 FMAs per gathered element, so the per-step
index work and the gathers set the pace (docs/design.md, "Training").

Layouts: columns [M, n_tiles, slots] int16 tile-local, counts [M, n_tiles] int32, both contiguous;
x, dy [M, D] bf16 / fp16 (one dtype), unit stride along D; values [M, n_tiles, slots] x's dtype and
u / du / dg slots [M, n_tiles, slots] fp32 (non-gated: dg only), contiguous; grad_*_out [H, D] fp32,
unit stride along D. Index dtype int32 when M * n_tiles * slots < 2**31, else int64.
Constraints: any M >= 0, D >= 1, H >= 1, 1 <= slots <= tile <= 32768, n_tiles = cdiv(H, tile).
Interpreter (TRITON_INTERPRET=1, CPU tensors): the same kernels (no tl.dot).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import DTYPES, cdiv, check_matrix, next_power_of_2, num_sms
from sparseffn.kernels.configs.unit_grads import UnitGradsConfig, default_unit_grads_config
from sparseffn.kernels.launch import Launcher
from sparseffn.kernels.twell_train import _check, _check_gated

__all__ = ["SlotCoefficients", "SlotsByUnit", "slots_by_unit", "unit_weight_grads"]

_MAX_DET_BLOCKS = 1024  # deterministic slots_by_unit: row blocks at most ([n_blocks, H] scratch)
_MIN_DET_ROWS = 16      # ... and rows per block at least
_SLOT_LANES = 2048      # [BLOCK_T, BLOCK_S] slots per step of the slot kernels
_SLOT_WARPS = 2        # one row per program, ~29 valid slots: small programs, more rows in flight per SM
_PREFIX_BLOCKS = 64    # [blocks, units] tile of _block_prefix_kernel: 64 x 32 int32, 128-byte rows
_PREFIX_UNITS = 32
_ORDER_UNITS = 16      # units per program of _unit_offsets_kernel ([16, 512] comparisons per step)
_ORDER_STEP = 512
# Up to this many units the offsets and the order come from _unit_offsets_kernel (H * H comparisons,
# one launch); above it from torch's cumsum + stable argsort, whose GPU time does not grow with H but
# which costs ~8 torch calls of host work per step (docs/kernel-notes.md).
_RANK_MAX_UNITS = 8192
_NO_CAP = 2**31 - 1  # the main kernel's cap when nothing spills (one value: no new specialization)
_SPILL_PROGRAMS_PER_SM = 4  # programs of the spill kernel per SM and D slice: each walks chunks in turn


# ----------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _row_worst(counts_row, n_tiles, BLOCK_T: tl.constexpr):
    """Largest count of a row (the row is ordinary iff it is <= slots)."""
    tiles = tl.arange(0, BLOCK_T)
    worst = tl.max(tl.load(counts_row + tiles, mask=tiles < n_tiles, other=0), 0)
    for t0 in range(BLOCK_T, n_tiles, BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        cnt = tl.load(counts_row + tiles, mask=tiles < n_tiles, other=0)  # [BLOCK_T] int32
        worst = tl.maximum(worst, tl.max(cnt, 0))
    return worst


@triton.jit
def _slot_block(columns_ptr, counts_row, m64, t0, k0, n_tiles, tile, slots,
                BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """(valid [BLOCK_T, BLOCK_S], flat slot index int64, unit int32) of tiles t0.., slots k0.. of
    an ordinary row; columns are read only where valid."""
    tiles = t0 + tl.arange(0, BLOCK_T)
    cnt = tl.load(counts_row + tiles, mask=tiles < n_tiles, other=0)  # [BLOCK_T] int32
    ks = k0 + tl.arange(0, BLOCK_S)
    valid = ks[None, :] < cnt[:, None]  # [BLOCK_T, BLOCK_S]; counts of ordinary rows are <= slots
    flat = (m64 * n_tiles + tiles[:, None]) * slots + ks[None, :]  # [BLOCK_T, BLOCK_S] int64
    col = tl.load(columns_ptr + flat, mask=valid, other=0)  # [BLOCK_T, BLOCK_S] int16
    unit = tiles[:, None] * tile + col.to(tl.int32)  # [BLOCK_T, BLOCK_S] int32
    return valid, flat, unit


@triton.jit(do_not_specialize=["M", "rows_per_block"])
def _unit_histogram_kernel(
    columns_ptr, counts_ptr, hist_ptr,
    M, H, n_tiles, tile, slots, rows_per_block,
    BLOCK_T: tl.constexpr,        # tiles per step (power of two)
    BLOCK_S: tl.constexpr,        # slots per step (power of two)
):
    """hist[m // rows_per_block, j] += number of valid slots of unit j in ordinary row m
    (program m)."""
    m = tl.program_id(0)
    m64 = m.to(tl.int64)
    counts_row = counts_ptr + m64 * n_tiles
    if _row_worst(counts_row, n_tiles, BLOCK_T) <= slots:
        hist_row = hist_ptr + (m // rows_per_block).to(tl.int64) * H
        for t0 in range(0, n_tiles, BLOCK_T):
            tiles = t0 + tl.arange(0, BLOCK_T)
            cnt = tl.load(counts_row + tiles, mask=tiles < n_tiles, other=0)  # [BLOCK_T] int32
            for k0 in range(0, tl.max(cnt, 0), BLOCK_S):
                valid, flat, unit = _slot_block(columns_ptr, counts_row, m64, t0, k0, n_tiles,
                                                tile, slots, BLOCK_T, BLOCK_S)
                tl.atomic_add(hist_row + unit, 1, mask=valid, sem="relaxed")


_unit_histogram_launch = Launcher(_unit_histogram_kernel)


@triton.jit(do_not_specialize=["n_blocks"])  # n_blocks == 1 (M <= 16) stays a runtime int
def _block_prefix_kernel(hist_ptr, n_blocks, H, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):
    """Per unit column j of hist [n_blocks + 1, H], in place: hist[b, j] = Σ_{b' < b} hist[b', j]
    for b < n_blocks (the block's first place among the unit's entries), and the unit's count
    Σ_b hist[b, j] into the spare row hist[n_blocks, j]."""
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] units
    live = cols < H
    carry = tl.zeros([BLOCK_H], dtype=hist_ptr.dtype.element_ty)
    for b0 in range(0, n_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        ptrs = hist_ptr + blocks.to(tl.int64)[:, None] * H + cols[None, :]  # [BLOCK_B, BLOCK_H]
        mask = (blocks < n_blocks)[:, None] & live[None, :]
        counts = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(counts, 0) - counts + carry[None, :], mask=mask)
        carry += tl.sum(counts, 0)
    tl.store(hist_ptr + n_blocks.to(tl.int64) * H + cols, carry, mask=live)


@triton.jit
def _unit_offsets_kernel(counts_ptr, offsets_ptr, order_ptr, H, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
    """Units j of program p (BLOCK_J of them): offsets[j + 1] = Σ_{k <= j} counts[k] (offsets[0] = 0)
    and order[rank_j] = j, rank_j = #{k: counts[k] > counts[j], or equal with k < j} (hottest
    first, ties by id: a stable descending sort), from one pass over all H counts. The comparisons
    add up elementwise in a [BLOCK_J, BLOCK_K] tile, reduced once at the end."""
    pid = tl.program_id(0)
    first = pid * BLOCK_J
    units = first + tl.arange(0, BLOCK_J)  # [BLOCK_J]
    live = units < H
    count = tl.load(counts_ptr + units, mask=live, other=0)
    ahead = tl.zeros([BLOCK_J, BLOCK_K], dtype=tl.int32)  # units ranked before each of ours
    before = tl.zeros([BLOCK_K], dtype=offsets_ptr.dtype.element_ty)  # counts of the units before `first`
    for k0 in range(0, H, BLOCK_K):
        others = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        other = tl.load(counts_ptr + others, mask=others < H, other=-1)  # -1: never ahead, adds nothing
        hotter = (other[None, :] > count[:, None]) | ((other[None, :] == count[:, None])
                                                      & (others[None, :] < units[:, None]))
        ahead += hotter.to(tl.int32)
        before += tl.where(others < first, other, 0)
    total_before = tl.sum(before, 0)
    tl.store(offsets_ptr + 1 + units, tl.cumsum(count, 0) + total_before, mask=live)
    tl.store(offsets_ptr, total_before, mask=pid == 0)  # 0: no program before the first
    tl.store(order_ptr + tl.sum(ahead, 1), units, mask=live)


_block_prefix_launch = Launcher(_block_prefix_kernel)
_unit_offsets_launch = Launcher(_unit_offsets_kernel)


@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _unit_scatter_kernel(
    columns_ptr, counts_ptr, offsets_ptr, cursor_ptr, entries_ptr,
    values_ptr, u_ptr, du_ptr, dg_ptr, dg_out_ptr, h_out_ptr, du_out_ptr,
    M, H, n_tiles, tile, slots, rows_per_program,
    SERIAL: tl.constexpr,         # True: program b owns cursor row b, rows in order (deterministic)
    COEFFICIENTS: tl.constexpr,   # 0: entries only; 1: + dg, h = p (non-gated); 2: + dg, h = p u, du
    BLOCK_T: tl.constexpr,        # tiles per step (power of two)
    BLOCK_S: tl.constexpr,        # slots per step (power of two)
):
    """entries[offsets[j] + place] = row m, for every valid slot (unit j) of the ordinary rows m =
    pid * rows_per_program ... SERIAL: place = cursor[pid, j]++ (the block's first place from
    _block_prefix_kernel), plain loads and stores of the program's own cursor row, one row after
    the other (a row holds each unit at most once; the barrier orders rows). Otherwise place =
    --cursor[j] on one shared row holding the counts (atomics: the unit's places counted down).
    COEFFICIENTS: the slot's weight-gradient coefficients, read token-major (contiguous), are
    written at the same entry position."""
    pid = tl.program_id(0)
    m_first = pid * rows_per_program
    if SERIAL:
        cursor_row = cursor_ptr + pid.to(tl.int64) * H
    else:
        cursor_row = cursor_ptr
    for r in range(0, tl.minimum(M - m_first, rows_per_program)):
        m64 = (m_first + r).to(tl.int64)
        counts_row = counts_ptr + m64 * n_tiles
        if _row_worst(counts_row, n_tiles, BLOCK_T) <= slots:
            for t0 in range(0, n_tiles, BLOCK_T):
                tiles = t0 + tl.arange(0, BLOCK_T)
                cnt = tl.load(counts_row + tiles, mask=tiles < n_tiles, other=0)  # [BLOCK_T]
                for k0 in range(0, tl.max(cnt, 0), BLOCK_S):
                    valid, flat, unit = _slot_block(columns_ptr, counts_row, m64, t0, k0, n_tiles,
                                                    tile, slots, BLOCK_T, BLOCK_S)
                    if SERIAL:
                        # .cg: the cursors live in L2, where the previous row's stores went
                        place = tl.load(cursor_row + unit, mask=valid, other=0, cache_modifier=".cg")
                        tl.store(cursor_row + unit, place + 1, mask=valid)
                    else:
                        place = tl.atomic_add(cursor_row + unit, -1, mask=valid, sem="relaxed") - 1
                    pos = tl.load(offsets_ptr + unit, mask=valid, other=0) + place
                    tl.store(entries_ptr + pos, tl.full(pos.shape, m64, entries_ptr.dtype.element_ty),
                             mask=valid)
                    if COEFFICIENTS > 0:
                        tl.store(dg_out_ptr + pos, tl.load(dg_ptr + flat, mask=valid), mask=valid)
                        p = tl.load(values_ptr + flat, mask=valid).to(tl.float32)
                        if COEFFICIENTS == 2:
                            tl.store(h_out_ptr + pos, p * tl.load(u_ptr + flat, mask=valid), mask=valid)
                            tl.store(du_out_ptr + pos, tl.load(du_ptr + flat, mask=valid), mask=valid)
                        else:
                            tl.store(h_out_ptr + pos, p, mask=valid)
        if SERIAL:
            tl.debug_barrier()  # this row's cursor stores before the next row's loads


_unit_scatter_launch = Launcher(_unit_scatter_kernel)


@triton.jit
def _entries_step(x_ptr, dy_ptr, dg_ptr, h_ptr, du_ptr, entries_ptr, e0, end, offs_d, mask_d, stride_xm, stride_dym,
                  acc_first, acc_up, acc_down, GATED: tl.constexpr, ALIGNED: tl.constexpr,
                  SHARED_ROWS: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_E: tl.constexpr):
    """The accumulators plus entries e0 .. min(e0 + BLOCK_E, end) of one unit in the D slice offs_d
    (`_unit_weight_grads_kernel` says what is gathered and summed)."""
    lanes = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    live = e0 + lanes < end  # [BLOCK_E]
    m = tl.load(entries_ptr + e0 + lanes, mask=live, other=0)  # [BLOCK_E] tokens
    if SHARED_ROWS:
        row = m.to(tl.int32) * stride_xm  # [BLOCK_E] int32
        x_rows = x_ptr + row
        dy_rows = dy_ptr + row
    else:
        x_rows = x_ptr + m.to(tl.int64) * stride_xm  # [BLOCK_E]
        dy_rows = dy_ptr + m.to(tl.int64) * stride_dym
    if ALIGNED:
        x_rows = tl.multiple_of(x_rows, 16)
        dy_rows = tl.multiple_of(dy_rows, 16)
    # [BLOCK_E, BLOCK_D] gathered token rows, fp32. EVEN_D: no mask at all; a dead lane (m = 0
    # from the masked entry load) gathers row 0, which its zero coefficients cancel
    if EVEN_D:
        xv = tl.load(x_rows[:, None] + offs_d[None, :]).to(tl.float32)
        dyv = tl.load(dy_rows[:, None] + offs_d[None, :]).to(tl.float32)
    else:
        rmask = live[:, None] & mask_d[None, :]  # [BLOCK_E, BLOCK_D]
        xv = tl.load(x_rows[:, None] + offs_d[None, :], mask=rmask, other=0.0).to(tl.float32)
        dyv = tl.load(dy_rows[:, None] + offs_d[None, :], mask=rmask, other=0.0).to(tl.float32)
    # [BLOCK_E] fp32 coefficients, stored in entry order: contiguous per unit
    dg = tl.load(dg_ptr + e0 + lanes, mask=live, other=0.0)
    h = tl.load(h_ptr + e0 + lanes, mask=live, other=0.0)
    acc_first += tl.sum(dg[:, None] * xv, 0)
    if GATED:
        du = tl.load(du_ptr + e0 + lanes, mask=live, other=0.0)
        acc_up += tl.sum(du[:, None] * xv, 0)
    acc_down += tl.sum(h[:, None] * dyv, 0)
    return acc_first, acc_up, acc_down


@triton.jit
def _unit_weight_grads_kernel(
    x_ptr, dy_ptr, dg_ptr, h_ptr, du_ptr, offsets_ptr, entries_ptr, order_ptr,
    grad_gate_ptr, grad_up_ptr, grad_down_ptr,
    D, H, n_groups, cap,
    stride_xm, stride_dym, stride_gg, stride_gu, stride_gd,
    GATED: tl.constexpr,          # three gradients from (dg, du, h = p u); False: two from (dg, h = p)
    ALIGNED: tl.constexpr,        # D % 8 == 0, 16-byte aligned bases and row strides of x, dy
    SHARED_ROWS: tl.constexpr,    # x and dy have one row stride and M * stride < 2**31: one int32
                                  # row offset per entry serves both gathers
    EVEN_D: tl.constexpr,         # D % BLOCK_D == 0: no mask along D on the gathers
    BLOCK_E: tl.constexpr,        # entries (token rows) per step
    BLOCK_D: tl.constexpr,        # gradient columns per program (the D slice)
    UNITS: tl.constexpr,          # units per program (snake over the hottest-first order)
):
    """Program (g, s): the units at sorted positions g, 2G-1-g, 2G+g, 4G-1-g, ... (G = n_groups: a
    snake over rounds of G, so every program gets one unit of each round) in D slice s, each unit's
    first `cap` entries (the rest, of the few hottest units, spill to `_unit_spill_grads_kernel`).

    Units run hottest first (most entries first, ties by id); the order must be exact (coarser
    orders measured slower: docs/kernel-notes.md). The program walks all its units'
    steps in ONE flat loop of Σ_j max(cdiv(n_j, BLOCK_E), 1) steps (a unit without entries takes one
    empty step that stores its zeros); the step -> (unit, first entry) map is a few reductions over
    the UNITS slots, so no work depends on data-dependent control flow. One step gathers BLOCK_E
    entries' rows X = x[m_e, slice], DY = dy[m_e, slice] ([BLOCK_E, BLOCK_D], 16-byte vectors when
    ALIGNED, converted to fp32) and their coefficients (contiguous, entry order), and adds
        acc_first [BLOCK_D] += Σ_e dg_e X[e]      (grad_gate gated; grad_up non-gated)
        acc_up    [BLOCK_D] += Σ_e du_e X[e]      (gated only)
        acc_down  [BLOCK_D] += Σ_e h_e DY[e]      (h = p u gated, p non-gated)
    The threads cover the slice (8 columns of 16 bytes each; 4 warps span 1024 columns), so the sum
    over a step's entries stays in each thread's registers: fp32 products and sums, no range limit
    of x's dtype on the coefficients. With EVEN_D the dead lanes of a unit's last step gather token
    0's rows unmasked against zero coefficients (bitwise the masked result for finite rows; a
    non-finite x[0] or dy[0] then reaches those units, as dense GEMMs spread it to every unit).
    D slices are the slow grid axis, so the x / dy slices tend to stay in L2 while a slice's units
    read them."""
    g = tl.program_id(0)
    pid_d = tl.program_id(1)

    # ---- the program's UNITS slots: unit, entry range, step range ------------------------------------
    slot = tl.arange(0, UNITS)  # [UNITS]
    pos = slot * n_groups + tl.where(slot % 2 == 0, g, n_groups - 1 - g)  # snake over rounds of G
    has = pos < H  # only the last round can run past H
    unit_of = tl.load(order_ptr + pos, mask=has, other=0).to(tl.int64)  # [UNITS] unit ids
    start_of = tl.load(offsets_ptr + unit_of, mask=has, other=0)  # [UNITS] index dtype
    end_of = tl.load(offsets_ptr + unit_of + 1, mask=has, other=0)
    end_of = start_of + tl.minimum(end_of - start_of, cap)  # entries past the cap: _unit_spill_grads_kernel
    # a unit without entries takes one empty step (it stores its zeros); absent slots take none
    n_steps = tl.where(has, tl.maximum(tl.cdiv(end_of - start_of, BLOCK_E), 1), 0)  # [UNITS]
    last_of = tl.cumsum(n_steps, 0)  # [UNITS] one past each slot's last step
    first_of = last_of - n_steps
    e0_base = start_of - first_of * BLOCK_E  # step i of slot k starts at entry e0_base[k] + i BLOCK_E
    total = tl.sum(n_steps, 0)

    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D] this program's slice of D
    mask_d = offs_d < D
    if ALIGNED:
        mask_d = tl.max_constancy(mask_d, 8)
    acc_first = tl.zeros([BLOCK_D], dtype=tl.float32)  # [BLOCK_D] fp32: Σ dg x
    acc_up = tl.zeros([BLOCK_D], dtype=tl.float32)     # [BLOCK_D] fp32: Σ du x (gated)
    acc_down = tl.zeros([BLOCK_D], dtype=tl.float32)   # [BLOCK_D] fp32: Σ h dy
    for i in range(0, total):
        at = (first_of <= i) & (i < last_of)  # [UNITS] one-hot: the slot step i belongs to
        j = tl.sum(tl.where(at, unit_of, 0), 0)  # int64 unit
        e0 = tl.sum(tl.where(at, e0_base, 0), 0) + i * BLOCK_E
        end = tl.sum(tl.where(at, end_of, 0), 0)
        unit_done = tl.sum(tl.where(at, last_of, 0), 0) == i + 1  # the unit's last step
        acc_first, acc_up, acc_down = _entries_step(
            x_ptr, dy_ptr, dg_ptr, h_ptr, du_ptr, entries_ptr, e0, end, offs_d, mask_d, stride_xm, stride_dym,
            acc_first, acc_up, acc_down, GATED, ALIGNED, SHARED_ROWS, EVEN_D, BLOCK_E)
        if unit_done:
            # [BLOCK_D] fp32 slices of row j
            if GATED:
                tl.store(grad_gate_ptr + j * stride_gg + offs_d, acc_first, mask=mask_d)
                tl.store(grad_up_ptr + j * stride_gu + offs_d, acc_up, mask=mask_d)
            else:
                tl.store(grad_up_ptr + j * stride_gu + offs_d, acc_first, mask=mask_d)
            tl.store(grad_down_ptr + j * stride_gd + offs_d, acc_down, mask=mask_d)
            acc_first = tl.zeros([BLOCK_D], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_D], dtype=tl.float32)
            acc_down = tl.zeros([BLOCK_D], dtype=tl.float32)


_unit_weight_grads_launch = Launcher(_unit_weight_grads_kernel)


@triton.jit
def _unit_spill_grads_kernel(
    x_ptr, dy_ptr, dg_ptr, h_ptr, du_ptr, offsets_ptr, entries_ptr, order_ptr, chunk_end_ptr,
    grad_gate_ptr, grad_up_ptr, grad_down_ptr,
    D, H, cap, n_programs,
    stride_xm, stride_dym, stride_gg, stride_gu, stride_gd,
    GATED: tl.constexpr, ALIGNED: tl.constexpr, SHARED_ROWS: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,          # entries per spilled chunk (a multiple of BLOCK_E)
    SEARCH_STEPS: tl.constexpr,   # ceil(log2(H)) + 1: halvings of the binary search over ranks
):
    """The entries past the first `cap` of the hottest units, after `_unit_weight_grads_kernel` has
    stored the first cap's sums: split into chunks of CHUNK entries, which programs (p, s) take in
    turn (p, p + P, ...; P = n_programs) in D slice s and ADD to the gradient rows (fp32 atomics, so
    the order of the chunks' additions varies from run to run: not used in deterministic mode).
    chunk_end [H] (int64, ranks in `order`, hottest first): the cumulative number of spilled chunks
    of ranks 0..r, so a chunk's rank is the first r with chunk_end[r] > chunk (a binary search) and
    the number of chunks is chunk_end[H - 1], read on the device: no host synchronisation."""
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_d = offs_d < D
    if ALIGNED:
        mask_d = tl.max_constancy(mask_d, 8)
    total = tl.load(chunk_end_ptr + H - 1)
    for c in range(pid, total, n_programs):
        lo = c * 0  # rank search in [lo, hi]: chunk_end is non-decreasing and chunk_end[H - 1] > c
        hi = lo + H - 1
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            right = tl.load(chunk_end_ptr + mid) <= c
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(right, hi, mid)
        j = tl.load(order_ptr + lo).to(tl.int64)
        start = tl.load(offsets_ptr + j)
        end = tl.load(offsets_ptr + j + 1)
        first_chunk = tl.load(chunk_end_ptr + lo) - (end - start - cap + CHUNK - 1) // CHUNK
        e_first = start + cap + (c - first_chunk) * CHUNK
        e_end = tl.minimum(end, e_first + CHUNK)
        acc_first = tl.zeros([BLOCK_D], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_D], dtype=tl.float32)
        acc_down = tl.zeros([BLOCK_D], dtype=tl.float32)
        for e0 in range(e_first, e_end, BLOCK_E):
            acc_first, acc_up, acc_down = _entries_step(
                x_ptr, dy_ptr, dg_ptr, h_ptr, du_ptr, entries_ptr, e0, e_end, offs_d, mask_d, stride_xm,
                stride_dym, acc_first, acc_up, acc_down, GATED, ALIGNED, SHARED_ROWS, EVEN_D, BLOCK_E)
        if GATED:
            tl.atomic_add(grad_gate_ptr + j * stride_gg + offs_d, acc_first, mask=mask_d, sem="relaxed")
            tl.atomic_add(grad_up_ptr + j * stride_gu + offs_d, acc_up, mask=mask_d, sem="relaxed")
        else:
            tl.atomic_add(grad_up_ptr + j * stride_gu + offs_d, acc_first, mask=mask_d, sem="relaxed")
        tl.atomic_add(grad_down_ptr + j * stride_gd + offs_d, acc_down, mask=mask_d, sem="relaxed")


_unit_spill_grads_launch = Launcher(_unit_spill_grads_kernel)


# ----------------------------------------------------------------------------------------------------
# slots_by_unit


def _slot_blocks(n_tiles: int, slots: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_S) of the slot kernels: all slots of a tile per step when they fit, as many
    tiles as fill _SLOT_LANES lanes."""
    block_s = min(next_power_of_2(slots), _SLOT_LANES)
    block_t = max(1, min(next_power_of_2(n_tiles), _SLOT_LANES // block_s))
    return block_t, block_s


def _index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < 2**31 else torch.int64


def _det_rows_per_block(m: int) -> int:
    """Rows per block of the deterministic counting sort (a function of M; not a constexpr)."""
    return max(_MIN_DET_ROWS, cdiv(m, _MAX_DET_BLOCKS))


class SlotCoefficients(NamedTuple):
    """Per-slot inputs of the weight gradients, token-major [M, n_tiles, slots] (twell_train.py):
    values (p, x's dtype) and dg_slots (fp32) always; u_slots and du_slots (fp32) when gated, None
    otherwise."""

    values: torch.Tensor
    dg_slots: torch.Tensor
    u_slots: torch.Tensor | None = None
    du_slots: torch.Tensor | None = None


class SlotsByUnit(NamedTuple):
    """The valid slots of the ordinary rows grouped by unit (`slots_by_unit`).

    offsets       [H + 1]             index dtype; offsets[H] = E, the number of entries (on device)
    entries       [capacity]          index dtype; tokens (rows), unit j's at offsets[j]:offsets[j+1]
    order         [H]                 int32; the units hottest first (the weight-gradient kernel's
                                      program order)
    coefficients  [n, capacity] fp32  entry order (None when not asked for): row 0 dg, row 1 h (p u
                                      gated, p non-gated), row 2 du (gated only)
    capacity = M * n_tiles * slots (E is unknown on the host); entries past E are unspecified."""

    offsets: torch.Tensor
    entries: torch.Tensor
    order: torch.Tensor
    coefficients: torch.Tensor | None = None


def _check_coefficients(c: object, m: int, n_tiles: int, slots: int, device: torch.device) -> int:
    """Number of coefficient rows (3 gated, 2 non-gated) after checking `c` (SlotCoefficients)."""
    if not isinstance(c, SlotCoefficients):
        raise TypeError(f"coefficients must be a SlotCoefficients or None, got {type(c).__name__}")
    shape = (m, n_tiles, slots)
    if not isinstance(c.values, torch.Tensor) or c.values.dtype not in DTYPES:
        raise TypeError(f"coefficients.values must be a bf16 or fp16 tensor, got {c.values!r:.80}")
    _check(c.values, "coefficients.values", shape, c.values.dtype, device, contiguous=True)
    _check(c.dg_slots, "coefficients.dg_slots", shape, torch.float32, device, contiguous=True)
    if (c.u_slots is None) != (c.du_slots is None):
        raise ValueError("coefficients.u_slots and du_slots must both be given (gated) or both be None")
    if c.u_slots is None:
        return 2
    _check(c.u_slots, "coefficients.u_slots", shape, torch.float32, device, contiguous=True)
    _check(c.du_slots, "coefficients.du_slots", shape, torch.float32, device, contiguous=True)
    return 3


def slots_by_unit(
    columns: torch.Tensor,
    counts: torch.Tensor,
    *,
    tile: int,
    h: int,
    slots: int,
    deterministic: bool,
    coefficients: SlotCoefficients | None = None,
) -> SlotsByUnit:
    """The valid slots of the ordinary rows of a TwELL activation grouped by unit (CSR: `SlotsByUnit`),
    and, when `coefficients` is given, the weight-gradient coefficients of each entry moved into
    entry order in the same pass (read token-major, contiguous, so the weight-gradient kernel reads
    them contiguously per unit rather than scattered over [M, n_tiles, slots] arrays larger than L2).
    All on columns' device, indices int32 (int64 when M * n_tiles * slots >= 2**31), no host sync.

    Launches: a histogram of the valid slots per unit (one program per row, integer atomics), the
    offsets and the hottest-first order (`_unit_offsets_kernel`: each unit's rank from comparisons
    with all H counts, up to _RANK_MAX_UNITS units; torch's cumsum and stable argsort above), and a
    scatter in which every valid slot takes its place among its unit's entries from a cursor:
      deterministic=False: one shared cursor row, the histogram itself counted down by atomics, so
        the order inside a unit is whatever order the atomics ran in;
      deterministic=True: a counting sort by blocks of consecutive rows (at most _MAX_DET_BLOCKS
        blocks of at least _MIN_DET_ROWS rows): a per-block histogram [n_blocks, H], a prefix over
        the blocks, then one program per block walks its rows in order with its own cursors. Each
        row holds a unit at most once, so a unit's entries come out in ascending token order
        whatever the scheduling. Cost: a [n_blocks, H] index scratch (<= 1024 * H * 4 bytes), its
        prefix and serial scatter programs; no sort of the [M * n_tiles * slots] slot array (a
        stable radix sort of it would move ~24x more keys than there are entries at 29 per token)."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    for name, value in (("tile", tile), ("h", h), ("slots", slots)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if tile > 32768 or slots > tile:
        raise ValueError(f"need 1 <= slots <= tile <= 32768, got slots = {slots}, tile = {tile}")
    if not isinstance(columns, torch.Tensor):
        raise TypeError(f"columns must be a torch.Tensor, got {type(columns).__name__}")
    if columns.dim() != 3:
        raise ValueError(f"columns must have shape [M, n_tiles, slots], got {list(columns.shape)}")
    m = columns.shape[0]
    n_tiles = cdiv(h, tile)
    dev = columns.device
    _check(columns, "columns", (m, n_tiles, slots), torch.int16, dev, contiguous=True)
    _check(counts, "counts", (m, n_tiles), torch.int32, dev, contiguous=True)
    if coefficients is not None:
        _check_coefficients(coefficients, m, n_tiles, slots, dev)
    return launch_slots_by_unit(columns, counts, tile=tile, h=h, slots=slots, deterministic=deterministic,
                                coefficients=coefficients)


def launch_slots_by_unit(
    columns: torch.Tensor,
    counts: torch.Tensor,
    *,
    tile: int,
    h: int,
    slots: int,
    deterministic: bool,
    coefficients: SlotCoefficients | None = None,
) -> SlotsByUnit:
    """`slots_by_unit` on arguments that meet its contract, unchecked: for the training op, which
    holds the TwELL of its forward and allocates the per-slot coefficients."""
    m = columns.shape[0]
    n_tiles = cdiv(h, tile)
    dev = columns.device
    n_coef = 0 if coefficients is None else (2 if coefficients.u_slots is None else 3)
    n = m * n_tiles * slots
    index = _index_dtype(n)
    offsets = torch.empty(h + 1, dtype=index, device=dev)
    entries = torch.empty(n, dtype=index, device=dev)
    coef = torch.empty(n_coef, n, dtype=torch.float32, device=dev) if n_coef else None
    rows_per_block = _det_rows_per_block(m) if deterministic else max(m, 1)
    n_blocks = max(cdiv(m, rows_per_block), 1)
    # [n_blocks, H] per-block counts, then the per-block cursors (deterministic: the units' counts
    # go to a spare last row) or the shared cursor row (counted down)
    hist = torch.zeros(n_blocks + deterministic, h, dtype=index, device=dev)
    block_t, block_s = _slot_blocks(n_tiles, slots)
    meta = dict(BLOCK_T=block_t, BLOCK_S=block_s, num_warps=_SLOT_WARPS)
    if m > 0:
        _unit_histogram_launch[(m,)](columns, counts, hist, m, h, n_tiles, tile, slots,
                                     rows_per_block, **meta)
    if deterministic:
        _block_prefix_launch[(cdiv(h, _PREFIX_UNITS),)](hist, n_blocks, h, BLOCK_B=_PREFIX_BLOCKS,
                                                        BLOCK_H=_PREFIX_UNITS, num_warps=4)
    unit_counts = hist[n_blocks] if deterministic else hist[0]
    if h <= _RANK_MAX_UNITS:
        order = torch.empty(h, dtype=torch.int32, device=dev)
        _unit_offsets_launch[(cdiv(h, _ORDER_UNITS),)](unit_counts, offsets, order, h, BLOCK_J=_ORDER_UNITS,
                                                        BLOCK_K=_ORDER_STEP, num_warps=4)
    else:  # the same offsets and order from torch (a device fill: no host copy under graph capture)
        offsets[:1].zero_()
        torch.cumsum(unit_counts, 0, dtype=index, out=offsets[1:])
        order = torch.argsort(unit_counts, descending=True, stable=True).to(torch.int32)
    if m == 0:
        return SlotsByUnit(offsets, entries, order, coef)
    if coef is None:
        moved = (hist,) * 7  # unused pointers
    else:  # (values, u, du, dg) -> (dg, h, du) rows; non-gated: dg stands in for the unused u, du
        c = coefficients
        gated = n_coef == 3
        moved = (c.values, c.u_slots if gated else c.dg_slots, c.du_slots if gated else c.dg_slots,
                 c.dg_slots, coef[0], coef[1], coef[2] if gated else coef[1])
    grid, rows_per_program = ((n_blocks,), rows_per_block) if deterministic else ((m,), 1)
    _unit_scatter_launch[grid](columns, counts, offsets, hist, entries, *moved, m, h, n_tiles, tile, slots,
                               rows_per_program, SERIAL=deterministic, COEFFICIENTS=max(n_coef - 1, 0),
                               **meta)
    return SlotsByUnit(offsets, entries, order, coef)


# ----------------------------------------------------------------------------------------------------
# unit_weight_grads


def _unit_grads_constexprs(config: UnitGradsConfig, d: int, *, gated: bool, aligned: bool,
                           shared_rows: bool) -> dict[str, object]:
    return dict(GATED=gated, ALIGNED=aligned, SHARED_ROWS=shared_rows, EVEN_D=d % config.block_d == 0,
                BLOCK_E=config.block_e, BLOCK_D=config.block_d, UNITS=config.units_per_program)


def _search_steps(h: int) -> int:
    """Halvings that narrow a range of h ranks to one, plus one."""
    return max(1, (h - 1).bit_length()) + 1


def _unit_grads_options(config: UnitGradsConfig) -> dict[str, object]:
    options: dict[str, object] = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    if config.max_regs is not None:
        options["maxnreg"] = config.max_regs
    return options


def unit_weight_grads(
    x: torch.Tensor,
    dy: torch.Tensor,
    by_unit: SlotsByUnit,
    *,
    n_tiles: int,
    slots: int,
    gated: bool,
    grad_gate_out: torch.Tensor | None,
    grad_up_out: torch.Tensor,
    grad_down_t_out: torch.Tensor,
    config: UnitGradsConfig | None = None,
    deterministic: bool = False,
) -> None:
    """Overwrite the fp32 [H, D] weight gradients from `slots_by_unit`'s result, built with the
    coefficients (the math: module docstring; the kernels: `_unit_weight_grads_kernel`, and
    `_unit_spill_grads_kernel` for the entries of hot units past `config.cap_entries`, whose fp32
    atomic additions vary the last bits from run to run unless `deterministic`). Non-gated:
    `grad_gate_out` must be None and grad_up_out receives the first weight's gradient. `config`
    overrides `default_unit_grads_config(D)`. No host synchronisation."""
    gated = _check_gated(gated)
    m, d = check_matrix(x, "x")
    dev = x.device
    for name, value in (("n_tiles", n_tiles), ("slots", slots)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    _check(dy, "dy", (m, d), x.dtype, dev, unit_stride=True)
    if not isinstance(by_unit, SlotsByUnit):
        raise TypeError(f"by_unit must be a SlotsByUnit (from slots_by_unit), got {type(by_unit).__name__}")
    offsets, entries, order, coef = by_unit
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"offsets must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dim() != 1 or offsets.shape[0] < 2:
        raise ValueError(f"offsets must have shape [H + 1] with H >= 1, got {list(offsets.shape)}")
    h = offsets.shape[0] - 1
    capacity = m * n_tiles * slots
    index = _index_dtype(capacity)
    _check(offsets, "offsets", (h + 1,), index, dev, contiguous=True)
    _check(entries, "entries", (capacity,), index, dev, contiguous=True)
    _check(order, "order", (h,), torch.int32, dev, contiguous=True)
    if coef is None:
        raise ValueError("by_unit.coefficients is None: build it with slots_by_unit(..., coefficients=...)")
    _check(coef, "coefficients", (3 if gated else 2, capacity), torch.float32, dev, contiguous=True)
    if not gated and grad_gate_out is not None:
        raise ValueError(f"grad_gate_out must be None when gated=False, got a {type(grad_gate_out).__name__}")
    grads = [("grad_up_out", grad_up_out), ("grad_down_t_out", grad_down_t_out)]
    if gated:
        grads.insert(0, ("grad_gate_out", grad_gate_out))
    for name, t in grads:
        _check(t, name, (h, d), torch.float32, dev, unit_stride=True)
    if config is not None and not isinstance(config, UnitGradsConfig):
        raise TypeError(f"config must be a UnitGradsConfig or None, got {type(config).__name__}")
    launch_unit_weight_grads(x, dy, by_unit, gated=gated, grad_gate_out=grad_gate_out, grad_up_out=grad_up_out,
                             grad_down_t_out=grad_down_t_out, config=config, deterministic=bool(deterministic))


def launch_unit_weight_grads(
    x: torch.Tensor,
    dy: torch.Tensor,
    by_unit: SlotsByUnit,
    *,
    gated: bool,
    grad_gate_out: torch.Tensor | None,
    grad_up_out: torch.Tensor,
    grad_down_t_out: torch.Tensor,
    config: UnitGradsConfig | None = None,
    deterministic: bool = False,
) -> None:
    """`unit_weight_grads` on arguments that meet its contract, unchecked: for the training op, which
    built by_unit and the gradient buffers and whose token-major backward launch checked x and dy."""
    m, d = x.shape
    offsets, entries, order, coef = by_unit
    h = offsets.shape[0] - 1
    grads = (grad_gate_out, grad_up_out, grad_down_t_out) if gated else (grad_up_out, grad_down_t_out)
    if config is None:
        config = default_unit_grads_config(d)
    if d > 1 and x.stride(1) != 1:
        x = x.contiguous()  # the kernel reads 16-byte vectors along D
    aligned = (d % 8 == 0 and config.block_d >= 8
               and all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
                       for t in (x, dy)))
    if m == 0:  # no token rows to gather (the kernel's dead lanes read row 0)
        for t in grads:
            t.zero_()
        return
    shared_rows = x.stride(0) == dy.stride(0) and m * x.stride(0) < 2**31
    n_groups = cdiv(h, config.units_per_program)
    slices = cdiv(d, config.block_d)
    # a unit has at most M entries (one per token): below the cap none spills
    spill = not deterministic and m > config.cap_entries
    cap = config.cap_entries if spill else _NO_CAP
    grad_first = grad_gate_out if gated else grad_up_out
    args = (x, dy, coef[0], coef[1], coef[2] if gated else coef[0], offsets, entries, order)
    strides = (x.stride(0), dy.stride(0), grad_first.stride(0), grad_up_out.stride(0), grad_down_t_out.stride(0))
    constexprs = _unit_grads_constexprs(config, d, gated=gated, aligned=aligned, shared_rows=shared_rows)
    _unit_weight_grads_launch[(n_groups, slices)](
        *args, grad_first, grad_up_out, grad_down_t_out, d, h, n_groups, cap, *strides,
        **constexprs, **_unit_grads_options(config),
    )
    if spill:
        # spilled chunks per rank (hottest first), cumulative: device tensors, no synchronisation
        n = (offsets[1:] - offsets[:-1])[order.long()]
        chunk_end = torch.cumsum(torch.div(n - cap + config.cap_entries - 1, config.cap_entries,
                                           rounding_mode="floor").clamp_min_(0), 0)
        programs = max(1, _SPILL_PROGRAMS_PER_SM * num_sms(x.device) // slices) if x.is_cuda else 4
        _unit_spill_grads_launch[(programs, slices)](
            *args, chunk_end, grad_first, grad_up_out, grad_down_t_out, d, h, cap, programs, *strides,
            **{k: v for k, v in constexprs.items() if k != "UNITS"}, CHUNK=config.cap_entries,
            SEARCH_STEPS=_search_steps(h), **_unit_grads_options(config),
        )
