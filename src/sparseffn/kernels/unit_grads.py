"""Unit-major (transposed) work of the sparse MLP backward: the weight gradients.

Math. The weight gradients are sums over tokens where a unit is active. For the valid slots of
the ordinary (non-overflow) rows of a TwELL activation (docs/format.md), slot s = (m, t, k) with
unit j = t * tile + columns[m, t, k], p_s = values[s], and the per-slot results of the token-major
kernels (twell_train.py: u_s from the forward, du_s, dg_s from the backward, all fp32):

    gated:      grad_gate[j]   = Σ_{s of j} dg_s · x[m_s]
                grad_up[j]     = Σ_{s of j} du_s · x[m_s]
                grad_down_t[j] = Σ_{s of j} (p_s u_s) · dy[m_s]          (h = p u, fp32)
    non-gated:  grad_up[j]     = Σ_{s of j} dg_s · x[m_s]     (dg holds d(first projection))
                grad_down_t[j] = Σ_{s of j} p_s · dy[m_s]

grad_down_t is [H, D] = (dL/d down_proj.weight)^T. Accumulation is fp32; the three outputs are fp32
[H, D] buffers that are OVERWRITTEN, every row (units without entries get 0); the dense-rows kernels
add the overflow rows' contributions into the same buffers afterwards and the caller casts.

Two steps, no host synchronisation anywhere (fixed-size buffers; counts stay on the device):

1. `slots_by_unit`: a CSR over units of the valid slots of ordinary rows.
       offsets  [H + 1]              index dtype; offsets[H] = number of entries E (on the device)
       entries  [M * n_tiles * slots] index dtype; entries[offsets[j]:offsets[j+1]] are the flat
                                     slot indices (m * n_tiles + t) * slots + k of unit j; entries
                                     past E are unspecified
   index dtype: int32 when M * n_tiles * slots < 2**31, else int64.
   fast (deterministic=False): a Triton histogram (one program per row, atomics into [H]) ->
       torch.cumsum -> a Triton scatter in which every valid slot takes its position from a
       per-unit atomic cursor. Each row is one program, so the order inside a unit is whatever
       order the atomics ran in. Cost ~ the valid slots (masked loads touch only their columns),
       two small launches and two cumsums over H.
   deterministic=True: a counting sort by row blocks. The rows are cut into n_blocks blocks of
       consecutive rows (at most _MAX_DET_BLOCKS blocks, at least _MIN_DET_ROWS rows each); the
       histogram is per block ([n_blocks, H], integer atomics: exact); a cumsum over the blocks
       turns it into each block's starting cursor per unit; then one program per block walks its
       rows in order with plain loads/stores of its own cursors and a barrier between rows. Each
       row holds a unit at most once, so within a unit the entries come out in ascending token
       order, which is ascending flat slot index: the result does not depend on scheduling. Cost
       over the fast path: a [n_blocks, H] index scratch (<= 1024 * H * 4 bytes: 23 MB at H =
       5632), a cumsum over it, and a scatter whose programs are serial over their rows (~1-2 µs
       of dependent load latency per row, so ~ rows_per_block µs: ~100 µs at M = 65536, untimed);
       no sort of the fixed-size [M * n_tiles * slots] slot array (a stable radix sort of that
       array, the obvious alternative, moves ~24x more keys than there are entries at the paper's
       sparsity).

2. `unit_weight_grads`: one program per (unit, BLOCK_D-wide slice of D). It walks its unit's
   entries BLOCK_E at a time (entry indices prefetched one block ahead), gathers the token rows
   x[m] and dy[m] ([BLOCK_E, BLOCK_D] tiles, 16-byte vectors when ALIGNED) and the per-slot scalars,
   and accumulates weighted rows in [BLOCK_E, BLOCK_D] fp32 registers, reduced over E once at the
   end. The bytes moved are the gathered rows (2 rows of BLOCK_D per entry and slice): the kernel
   is L2/HBM-gather bound.
   Balance: unit counts are skewed (hot units have thousands of entries, dead ones none), and a
   unit's sum is never split across programs (so the result is deterministic given the entry
   order, with no atomics and no scratch). Instead programs run hottest unit first (a stable
   device argsort of the H counts, longest-processing-time order), so the long programs start
   early and the short ones fill the tail. The D slice is the slow grid axis: all units of one
   slice run together, so the gathered x / dy slices (2 * M * BLOCK_D * 2 bytes: 32 MB at
   M = 65536, BLOCK_D = 128) stay in L2 while every unit of a token reads them.

Layouts:
    columns   [M, n_tiles, slots]  int16 tile-local, contiguous;  counts [M, n_tiles] int32, contiguous
    x, dy     [M, D]               bf16 / fp16 (one dtype), unit stride along D, any row stride
    values    [M, n_tiles, slots]  x's dtype, contiguous
    u_slots, du_slots, dg_slots
              [M, n_tiles, slots]  fp32, contiguous (gated: all three; non-gated: dg_slots only)
    grad_*_out [H, D]              fp32, unit stride along D (any row stride)

Constraints: any M >= 0, D >= 1, H >= 1, 1 <= slots <= tile <= 32768, n_tiles = cdiv(H, tile).
Entries are assumed to come from `slots_by_unit` on the same packed activation.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparseffn.kernels.twell_train import _check

__all__ = [
    "UnitGradsConfig",
    "default_unit_grads_config",
    "sm90_compile_specs",
    "slots_by_unit",
    "unit_weight_grads",
]

_DTYPES = (torch.bfloat16, torch.float16)
_TL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_MAX_DET_BLOCKS = 1024  # deterministic slots_by_unit: row blocks at most ([n_blocks, H] scratch)
_MIN_DET_ROWS = 16      # ... and rows per block at least
_SLOT_LANES = 2048      # [BLOCK_T, BLOCK_S] slots per step of the slot kernels
_SLOT_WARPS = 4


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


@triton.jit(do_not_specialize=["M", "rows_per_program"])
def _unit_scatter_kernel(
    columns_ptr, counts_ptr, cursor_ptr, entries_ptr,
    M, H, n_tiles, tile, slots, rows_per_program,
    SERIAL: tl.constexpr,         # True: program b owns cursor row b, rows in order (deterministic)
    BLOCK_T: tl.constexpr,        # tiles per step (power of two)
    BLOCK_S: tl.constexpr,        # slots per step (power of two)
):
    """entries[cursor[j]++] = flat slot index, for every valid slot (unit j) of the ordinary rows
    pid * rows_per_program ... SERIAL: the program's own cursor row, plain loads and stores, one
    row after the other (a row holds each unit at most once; the barrier orders rows). Otherwise
    one shared cursor row and atomics."""
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
                        pos = tl.load(cursor_row + unit, mask=valid, other=0, cache_modifier=".cg")
                        tl.store(cursor_row + unit, pos + 1, mask=valid)
                    else:
                        pos = tl.atomic_add(cursor_row + unit, 1, mask=valid, sem="relaxed")
                    tl.store(entries_ptr + pos, flat.to(entries_ptr.dtype.element_ty), mask=valid)
        if SERIAL:
            tl.debug_barrier()  # this row's cursor stores before the next row's loads


@triton.jit
def _store_slice(row_ptr, v, offs_d, mask_d, EVEN_D: tl.constexpr):
    if EVEN_D:
        tl.store(row_ptr + offs_d, v)
    else:
        tl.store(row_ptr + offs_d, v, mask=mask_d)


@triton.jit
def _unit_weight_grads_kernel(
    x_ptr, dy_ptr, values_ptr, u_ptr, du_ptr, dg_ptr, offsets_ptr, entries_ptr, order_ptr,
    grad_gate_ptr, grad_up_ptr, grad_down_ptr,
    D, row_slots,
    stride_xm, stride_dym, stride_gg, stride_gu, stride_gd,
    GATED: tl.constexpr,          # three gradients from (dg, du, p u); False: two from (dg, p)
    ALIGNED: tl.constexpr,        # D % 8 == 0, 16-byte aligned bases and row strides of x, dy
    EVEN_D: tl.constexpr,         # D % BLOCK_D == 0: no mask along D
    BLOCK_E: tl.constexpr,        # entries (token rows) per step
    BLOCK_D: tl.constexpr,        # gradient columns per program
):
    j = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)  # this program's unit (hottest first)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D] this program's slice of D
    mask_d = offs_d < D
    if ALIGNED:
        mask_d = tl.max_constancy(mask_d, 8)
    start = tl.load(offsets_ptr + j)
    end = tl.load(offsets_ptr + j + 1)
    lanes = tl.arange(0, BLOCK_E)
    acc_first = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)  # Σ dg x  (gate / first weight)
    acc_up = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)     # Σ du x  (gated only)
    acc_down = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)   # Σ h dy
    # [BLOCK_E] flat slot indices of the first step; each step prefetches the next step's
    flat_next = tl.load(entries_ptr + start + lanes, mask=start + lanes < end, other=0)
    for e0 in range(start, end, BLOCK_E):
        live = e0 + lanes < end  # [BLOCK_E]
        flat = flat_next
        flat_next = tl.load(entries_ptr + e0 + BLOCK_E + lanes, mask=e0 + BLOCK_E + lanes < end,
                            other=0)
        m = (flat // row_slots).to(tl.int64)  # [BLOCK_E] token of each entry
        if EVEN_D:
            rmask = live[:, None]  # [BLOCK_E, 1]
        else:
            rmask = live[:, None] & mask_d[None, :]  # [BLOCK_E, BLOCK_D]
        x_rows = x_ptr + m * stride_xm  # [BLOCK_E]
        dy_rows = dy_ptr + m * stride_dym
        if ALIGNED:
            x_rows = tl.multiple_of(x_rows, 16)
            dy_rows = tl.multiple_of(dy_rows, 16)
        # [BLOCK_E, BLOCK_D] gathered token rows (dead lanes load nothing and give 0)
        xv = tl.load(x_rows[:, None] + offs_d[None, :], mask=rmask, other=0.0).to(tl.float32)
        dyv = tl.load(dy_rows[:, None] + offs_d[None, :], mask=rmask, other=0.0).to(tl.float32)
        p = tl.load(values_ptr + flat, mask=live, other=0.0).to(tl.float32)  # [BLOCK_E] fp32
        dg = tl.load(dg_ptr + flat, mask=live, other=0.0)  # [BLOCK_E] fp32
        if GATED:
            u = tl.load(u_ptr + flat, mask=live, other=0.0)
            du = tl.load(du_ptr + flat, mask=live, other=0.0)
            acc_up += du[:, None] * xv
            h = p * u
        else:
            h = p
        acc_first += dg[:, None] * xv
        acc_down += h[:, None] * dyv
    # [BLOCK_D] fp32 slices of row j, reduced over the entries once
    if GATED:
        _store_slice(grad_gate_ptr + j * stride_gg, tl.sum(acc_first, 0), offs_d, mask_d, EVEN_D)
        _store_slice(grad_up_ptr + j * stride_gu, tl.sum(acc_up, 0), offs_d, mask_d, EVEN_D)
    else:
        _store_slice(grad_up_ptr + j * stride_gu, tl.sum(acc_first, 0), offs_d, mask_d, EVEN_D)
    _store_slice(grad_down_ptr + j * stride_gd, tl.sum(acc_down, 0), offs_d, mask_d, EVEN_D)


# ----------------------------------------------------------------------------------------------------
# slots_by_unit


def _slot_blocks(n_tiles: int, slots: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_S) of the slot kernels: all slots of a tile per step when they fit, as many
    tiles as fill _SLOT_LANES lanes."""
    block_s = min(triton.next_power_of_2(slots), _SLOT_LANES)
    block_t = max(1, min(triton.next_power_of_2(n_tiles), _SLOT_LANES // block_s))
    return block_t, block_s


def _index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < 2**31 else torch.int64


def _det_rows_per_block(m: int) -> int:
    """Rows per block of the deterministic counting sort (a function of M; not a constexpr)."""
    return max(_MIN_DET_ROWS, triton.cdiv(m, _MAX_DET_BLOCKS))


def slots_by_unit(
    columns: torch.Tensor,
    counts: torch.Tensor,
    *,
    tile: int,
    h: int,
    slots: int,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets [h + 1], entries [M * n_tiles * slots]): the valid slots of the ordinary rows of a
    TwELL activation grouped by unit (CSR, see the module docstring). deterministic=True orders
    each unit's entries by flat slot index (bitwise reproducible); False leaves the order to the
    atomics. Both on columns' device, int32 (int64 when M * n_tiles * slots >= 2**31); no host
    synchronisation."""
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
    n_tiles = triton.cdiv(h, tile)
    dev = columns.device
    _check(columns, "columns", (m, n_tiles, slots), torch.int16, dev, contiguous=True)
    _check(counts, "counts", (m, n_tiles), torch.int32, dev, contiguous=True)
    n = m * n_tiles * slots
    index = _index_dtype(n)
    offsets = torch.zeros(h + 1, dtype=index, device=dev)
    entries = torch.empty(n, dtype=index, device=dev)
    if m == 0:
        return offsets, entries
    rows_per_block = _det_rows_per_block(m) if deterministic else m
    n_blocks = triton.cdiv(m, rows_per_block)
    hist = torch.zeros(n_blocks, h, dtype=index, device=dev)  # [n_blocks, H] per-block counts
    block_t, block_s = _slot_blocks(n_tiles, slots)
    meta = dict(BLOCK_T=block_t, BLOCK_S=block_s, num_warps=_SLOT_WARPS)
    _unit_histogram_kernel[(m,)](columns, counts, hist, m, h, n_tiles, tile, slots,
                                 rows_per_block, **meta)
    torch.cumsum(hist.sum(0, dtype=index), 0, dtype=index, out=offsets[1:])
    if deterministic:
        # cursor[b, j] = offsets[j] + entries of unit j in the blocks before b
        cursor = torch.cumsum(hist, 0, dtype=index).sub_(hist).add_(offsets[:-1])
        grid, rows_per_program = (n_blocks,), rows_per_block
    else:
        cursor = offsets[:-1].clone()
        grid, rows_per_program = (m,), 1
    _unit_scatter_kernel[grid](columns, counts, cursor, entries, m, h, n_tiles, tile, slots,
                               rows_per_program, SERIAL=deterministic, **meta)
    return offsets, entries


# ----------------------------------------------------------------------------------------------------
# unit_weight_grads


@dataclass(frozen=True)
class UnitGradsConfig:
    """Launch parameters of `_unit_weight_grads_kernel`. Sizes are powers of two."""

    block_e: int = 32    # entries (gathered token rows) per step
    block_d: int = 128   # gradient columns per program (the D slice)
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_e", "block_d", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"UnitGradsConfig.{name} must be a positive int, got {value!r}")
            if value & (value - 1):
                raise ValueError(f"UnitGradsConfig.{name} must be a power of two, got {value}")


def default_unit_grads_config(d: int) -> UnitGradsConfig:
    """BLOCK_D 128 (16 threads x 8 elements of a row, and a gathered x + dy slice of 512 bytes per
    token: the slices of 65536 tokens fit in the H200's L2), 32 entries per step, 4 warps; smaller
    D uses one slice of next_power_of_2(D). D % 8 != 0 (no 16-byte vectors: one address register
    per element) takes 8 entries per step (ptxas, sm_90a: 32 spill to local memory). Not timed on
    a GPU yet; ptxas, sm_90a, bf16, D = 2048: 168 registers gated, 128 non-gated, no spills."""
    return UnitGradsConfig(block_e=32 if d % 8 == 0 else 8,
                           block_d=min(128, triton.next_power_of_2(max(d, 1))), num_warps=4)


def _unit_grads_constexprs(config: UnitGradsConfig, d: int, *, gated: bool,
                           aligned: bool) -> dict[str, object]:
    return dict(GATED=gated, ALIGNED=aligned, EVEN_D=d % config.block_d == 0,
                BLOCK_E=config.block_e, BLOCK_D=config.block_d)


def unit_weight_grads(
    x: torch.Tensor,
    dy: torch.Tensor,
    values: torch.Tensor,
    u_slots: torch.Tensor | None,
    du_slots: torch.Tensor | None,
    dg_slots: torch.Tensor,
    offsets: torch.Tensor,
    entries: torch.Tensor,
    *,
    n_tiles: int,
    slots: int,
    gated: bool,
    grad_gate_out: torch.Tensor | None,
    grad_up_out: torch.Tensor,
    grad_down_t_out: torch.Tensor,
    config: UnitGradsConfig | None = None,
) -> None:
    """Overwrite the fp32 [H, D] weight gradients from the unit-major CSR of `slots_by_unit` (see
    the module docstring for the math). Non-gated: `u_slots`, `du_slots` and `grad_gate_out` must
    be None; dg_slots holds d(first projection) and grad_up_out receives the first weight's
    gradient. `config` overrides `default_unit_grads_config(D)`. No host synchronisation."""
    if not isinstance(gated, bool):
        raise TypeError(f"gated must be a bool, got {gated!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must have shape [M, D], got {list(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be bf16 or fp16, got {x.dtype}")
    m, d = x.shape
    dev = x.device
    for name, value in (("n_tiles", n_tiles), ("slots", slots)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    _check(dy, "dy", (m, d), x.dtype, dev, unit_stride=True)
    _check(values, "values", (m, n_tiles, slots), x.dtype, dev, contiguous=True)
    _check(dg_slots, "dg_slots", (m, n_tiles, slots), torch.float32, dev, contiguous=True)
    if gated:
        _check(u_slots, "u_slots", (m, n_tiles, slots), torch.float32, dev, contiguous=True)
        _check(du_slots, "du_slots", (m, n_tiles, slots), torch.float32, dev, contiguous=True)
    else:
        for name, t in (("u_slots", u_slots), ("du_slots", du_slots),
                        ("grad_gate_out", grad_gate_out)):
            if t is not None:
                raise ValueError(f"{name} must be None when gated=False, got a {type(t).__name__}")
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"offsets must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dim() != 1 or offsets.shape[0] < 2:
        raise ValueError(f"offsets must have shape [H + 1] with H >= 1, got {list(offsets.shape)}")
    h = offsets.shape[0] - 1
    index = _index_dtype(m * n_tiles * slots)
    _check(offsets, "offsets", (h + 1,), index, dev, contiguous=True)
    _check(entries, "entries", (m * n_tiles * slots,), index, dev, contiguous=True)
    grads = [("grad_up_out", grad_up_out), ("grad_down_t_out", grad_down_t_out)]
    if gated:
        grads.insert(0, ("grad_gate_out", grad_gate_out))
    for name, t in grads:
        _check(t, name, (h, d), torch.float32, dev, unit_stride=True)
    if config is None:
        config = default_unit_grads_config(d)
    elif not isinstance(config, UnitGradsConfig):
        raise TypeError(f"config must be a UnitGradsConfig or None, got {type(config).__name__}")
    if d > 1 and x.stride(1) != 1:
        x = x.contiguous()  # the kernel reads 16-byte vectors along D
    aligned = (d % 8 == 0 and config.block_d >= 8
               and all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
                       for t in (x, dy)))
    # longest-processing-time order: the unit with the most entries first (stable: reproducible)
    order = torch.argsort(offsets[1:] - offsets[:-1], descending=True, stable=True)
    grid = (h, triton.cdiv(d, config.block_d))
    _unit_weight_grads_kernel[grid](
        x, dy, values, u_slots if gated else dg_slots, du_slots if gated else dg_slots, dg_slots,
        offsets, entries, order,
        grad_gate_out if gated else grad_up_out, grad_up_out, grad_down_t_out,
        d, n_tiles * slots,
        x.stride(0), dy.stride(0), (grad_gate_out if gated else grad_up_out).stride(0),
        grad_up_out.stride(0), grad_down_t_out.stride(0),
        **_unit_grads_constexprs(config, d, gated=gated, aligned=aligned),
        num_warps=config.num_warps,
    )


# ----------------------------------------------------------------------------------------------------
# sm_90a compile coverage (tests/kernels/sm90_compile.py)


def sm90_compile_specs(with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) for the slot histogram and both scatters
    (int32 and int64 indices; tile 256 / slots 32 and tile 64 / slots 4 blocks), and the weight-
    gradient kernel for bf16 / fp16, gated / non-gated, int32 / int64 entries, D = 2048 (aligned,
    BLOCK_D 128) and D = 100 (unaligned, masked along D)."""
    specs = []

    def add(fn, signature, constexprs, options):
        signature.update({k: "constexpr" for k in constexprs})
        spec = (fn, signature, constexprs)
        specs.append(spec + (options,) if with_options else spec)

    for ty, (n_tiles, slots) in itertools.product(("i32", "i64"), ((22, 32), (5, 4))):
        block_t, block_s = _slot_blocks(n_tiles, slots)
        common = {"columns_ptr": "*i16", "counts_ptr": "*i32"}
        sizes = {"M": "i32", "H": "i32", "n_tiles": "i32", "tile": "i32", "slots": "i32"}
        add(_unit_histogram_kernel,
            {**common, "hist_ptr": f"*{ty}", **sizes, "rows_per_block": "i32"},
            {"BLOCK_T": block_t, "BLOCK_S": block_s}, {"num_warps": _SLOT_WARPS})
        for serial in (False, True):
            add(_unit_scatter_kernel,
                {**common, "cursor_ptr": f"*{ty}", "entries_ptr": f"*{ty}", **sizes,
                 "rows_per_program": "i32"},
                {"SERIAL": serial, "BLOCK_T": block_t, "BLOCK_S": block_s},
                {"num_warps": _SLOT_WARPS})
    for ty, gated, (d, aligned), index in itertools.product(
            _TL_DTYPES.values(), (True, False), ((2048, True), (100, False)), ("i32", "i64")):
        config = default_unit_grads_config(d)
        signature = {
            "x_ptr": f"*{ty}", "dy_ptr": f"*{ty}", "values_ptr": f"*{ty}", "u_ptr": "*fp32",
            "du_ptr": "*fp32", "dg_ptr": "*fp32", "offsets_ptr": f"*{index}",
            "entries_ptr": f"*{index}", "order_ptr": "*i64",
            "grad_gate_ptr": "*fp32", "grad_up_ptr": "*fp32", "grad_down_ptr": "*fp32",
            "D": "i32", "row_slots": "i32",
            "stride_xm": "i32", "stride_dym": "i32", "stride_gg": "i32", "stride_gu": "i32",
            "stride_gd": "i32",
        }
        add(_unit_weight_grads_kernel, signature,
            _unit_grads_constexprs(config, d, gated=gated, aligned=aligned),
            {"num_warps": config.num_warps})
    return specs
