"""Splitting long rows of a TwELL activation over several programs (token-major kernels).

The token-major kernels (twell_up_down.py, twell_train.py) run a row as one serial chain of weight
row loads in one program, so the few rows of the heavy tail (~0.5% of the tokens at ~12x the mean
count) would finish each launch alone (docs/kernel-notes.md). A launch splits them:
1. `classify_rows` (one pass over counts [M, n_tiles]) finds each row's overflow (some count > slots:
   the dense backup's rows), as a flag per row and/or as a list (ids and count, in no particular
   order: the backup takes it as is). It also lists the ordinary rows with more than `piece` valid
   slots, at most `cap` of them (split_ids, the length in state[cap]; split_flags[m] says which rows
   were taken). Rows past the capacity stay whole: nothing is dropped.
2. In the kernel, the first cap * max_pieces programs each take piece `pid % max_pieces` (valid
   slots [piece · PIECE, piece · PIECE + PIECE)) of listed row `pid // max_pieces`, so the pieces
   start in the first wave beside the row programs, which skip the listed rows.
3. `gather_pieces`: a piece stores its fp32 partial (and an optional scalar, the training forward's
   Σ|h|) in its own slot of a [cap, max_pieces, D] buffer, then counts its arrival on the row's
   counter (state[i]); the last piece to arrive adds the partials in piece order (so the result does
   not depend on timing) and resets the counter to 0, leaving the list reusable.

Bits. A listed row sums its pieces' partials; a long row the list has no room for runs whole, as one
sequential sum; the two round differently in fp32. So past `cap` long rows in one call, which rows
are split follows the programs' arrival, and those rows' outputs (y, row L1, dx) can differ in their
last bits from run to run (each is still an fp32 sum rounded once). With `deterministic=True` (what
`torch.use_deterministic_algorithms(True)` selects in `sparse_mlp`) the kernels sum whole rows piece
by piece too, in piece order, so every row has the same bits whichever rows were listed. It is a
variant, not the default, because it costs a few percent (docs/benchmarks.md, "Deterministic mode").

Buffers (per launch, on the device): split_flags uint8 [M], split_ids int32 [cap], state int32
[cap + 1] (zeroed), partials fp32 [cap * max_pieces * D] (+ [cap * max_pieces] for a scalar), with
cap lowered where needed to keep the partials within PARTIALS_BUDGET_BYTES.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import cdiv, next_power_of_2
from sparseffn.kernels.launch import Launcher

__all__ = [
    "PARTIALS_BUDGET_BYTES",
    "RowSplit",
    "check_row_list",
    "classify_rows",
    "gather_pieces",
    "launch_args",
    "list_capacity",
    "listed_row",
    "new_row_list",
    "prepare_launch",
    "split_signature",
    "splits",
]

_CLASSIFY_ROWS = 64  # rows per program of _classify_rows_kernel
# The pieces' fp32 partials are sized for the longest possible row (n_tiles * slots valid slots), so
# a wide MLP would need a large buffer for a full list: 256 rows x 28 pieces x D = 8192 would be 235 MB
# per launch. The list's capacity shrinks to keep the buffer within this budget (the rows it leaves
# out run whole). The measured shapes stay under it at 256 rows: 12.6 MB at D = 2048 / H = 5632,
# 58.7 MB at D = 4096 / H = 14336.
PARTIALS_BUDGET_BYTES = 64 << 20
# the split list's pointers in Triton signatures (GPU compile specs); the kernels that take pieces
# also get partials_ptr
_LIST_POINTERS = {"split_flags_ptr": "*u8", "split_ids_ptr": "*i32", "split_state_ptr": "*i32"}


@triton.jit
def _classify_rows_kernel(counts_ptr, overflow_ptr, overflow_ids_ptr, overflow_count_ptr,
                          split_flags_ptr, split_ids_ptr, split_state_ptr,
                          M, n_tiles, slots, split_cap,
                          FLAGS: tl.constexpr, LIST: tl.constexpr, SPLIT: tl.constexpr, PIECE: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """Per row of counts [M, n_tiles], whether some count > slots (overflow): with FLAGS as
    overflow[m] (uint8), with LIST as an entry of overflow_ids (a place taken from the zeroed
    counter overflow_count, so the order follows the programs' arrival). With SPLIT, ordinary rows
    of more than PIECE valid slots take a place in the split list while it has room."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < M
    worst = tl.zeros([BLOCK_R], dtype=tl.int32)
    nnz = tl.zeros([BLOCK_R], dtype=tl.int32)
    for t0 in range(0, n_tiles, BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        cnt = tl.load(counts_ptr + rows.to(tl.int64)[:, None] * n_tiles + tiles[None, :],
                      mask=live[:, None] & (tiles < n_tiles)[None, :], other=0)
        worst = tl.maximum(worst, tl.max(cnt, 1))
        nnz += tl.sum(cnt, 1)
    over = worst > slots
    if FLAGS:
        tl.store(overflow_ptr + rows, over.to(tl.uint8), mask=live)
    if LIST:
        n_over = tl.sum(over.to(tl.int32), 0)
        if n_over > 0:  # usually none: no atomic on the shared counter
            first_over = tl.atomic_add(overflow_count_ptr, n_over)
            place_over = first_over + tl.cumsum(over.to(tl.int32), 0) - 1
            tl.store(overflow_ids_ptr + place_over, rows, mask=over)
    if SPLIT:
        long_row = live & ~over & (nnz > PIECE)
        rank = tl.cumsum(long_row.to(tl.int32), 0) - 1  # place among this block's long rows
        first = tl.atomic_add(split_state_ptr + split_cap, tl.sum(long_row.to(tl.int32), 0))
        place = first + rank
        taken = long_row & (place < split_cap)
        tl.store(split_ids_ptr + place, rows, mask=taken)
        tl.store(split_flags_ptr + rows, taken.to(tl.uint8), mask=live)


_classify_rows_launch = Launcher(_classify_rows_kernel)


@triton.jit
def listed_row(pid, split_ids_ptr, split_state_ptr, split_cap, max_pieces):
    """(listed, i, piece, m) of piece program pid: whether the list has a row i = pid // max_pieces,
    its number i, the piece number and the row m (int64; 0 when not listed)."""
    i = pid // max_pieces
    listed = i < tl.minimum(tl.load(split_state_ptr + split_cap), split_cap)
    m64 = tl.load(split_ids_ptr + i, mask=listed, other=0).to(tl.int64)
    return listed, i, pid % max_pieces, m64


@triton.jit
def gather_pieces(partials_ptr, scalars_ptr, i, piece, n_pieces, max_pieces, acc, scalar, offs_d, mask_d, D,
                  split_state_ptr, HAS_SCALAR: tl.constexpr):
    """(last, Σ acc, Σ scalar) over the n_pieces pieces of listed row i, the sums in piece order and
    valid only where `last` (this program is the row's last piece to arrive)."""
    row = i.to(tl.int64) * max_pieces
    # .cg: through L2 only, where the last piece's program reads them back
    tl.store(partials_ptr + (row + piece) * D + offs_d, acc, mask=mask_d, cache_modifier=".cg")
    if HAS_SCALAR:
        tl.store(scalars_ptr + row + piece, scalar, cache_modifier=".cg")
    tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
    arrived = tl.atomic_add(split_state_ptr + i, 1, sem="acq_rel")
    tl.debug_barrier()
    last = arrived == n_pieces - 1
    total = tl.zeros_like(acc)
    total_scalar = tl.full([], 0.0, tl.float32)
    if last:
        for q in range(0, n_pieces):
            total += tl.load(partials_ptr + (row + q) * D + offs_d, mask=mask_d, other=0.0, cache_modifier=".cg")
            if HAS_SCALAR:
                total_scalar += tl.load(scalars_ptr + row + q, cache_modifier=".cg")
        tl.store(split_state_ptr + i, 0)  # every piece has arrived: the counter is free again
    return last, total, total_scalar


@dataclass(frozen=True, eq=False)
class RowSplit:
    """The split list of one call and the kernel arguments that go with it."""

    flags: torch.Tensor  # uint8 [M]: 1 where the row is split (its row program skips it)
    ids: torch.Tensor  # int32 [cap]: the listed rows, in no particular order
    state: torch.Tensor  # int32 [cap + 1]: per-row arrival counters (0 between launches), list length
    cap: int
    max_pieces: int  # pieces of the longest possible ordinary row: cdiv(n_tiles * slots, piece)

    def partials(self, d: int, scalars: bool = False) -> torch.Tensor:
        """An fp32 buffer for the pieces' [D] partials (or, scalars=True, one scalar each)."""
        return torch.empty(self.cap * self.max_pieces * (1 if scalars else d), dtype=torch.float32,
                           device=self.ids.device)


def new_row_list(m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty overflow list for `classify_rows(overflow_list=)`: ids int32 [m], count int32 [1] = 0."""
    return torch.empty(m, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device)


def check_row_list(row_list: object, name: str, m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """row_list as (ids, count): a pair of contiguous int32 tensors on `device`, ids [m] and count [1]."""
    if not isinstance(row_list, tuple) or len(row_list) != 2:
        raise TypeError(f"{name} must be a pair (ids, count) of torch.Tensors, got {type(row_list).__name__}")
    ids, count = row_list
    for part, t, shape in (("ids", ids, (m,)), ("count", count, (1,))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} {part} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} {part} must be a contiguous int32 tensor of shape {list(shape)}, "
                             f"got {t.dtype} {list(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} {part} must be on {device}, got {t.device}")
    return row_list


def splits(piece: int, d: int, block_d: int, n_tiles: int, slots: int) -> bool:
    """Whether a launch splits rows: splitting on (piece > 0), whole rows of D per program, and an
    ordinary row can have more than `piece` valid slots."""
    return 0 < piece < n_tiles * slots and block_d >= d


def list_capacity(cap: int, m: int, d: int, max_pieces: int) -> int:
    """Rows the split list holds: at most cap and M, and few enough that the fp32 partials of
    max_pieces pieces of D each fit PARTIALS_BUDGET_BYTES (at least 1)."""
    return max(1, min(cap, m, PARTIALS_BUDGET_BYTES // (4 * max_pieces * max(d, 1))))


def classify_rows(counts: torch.Tensor, slots: int, *, piece: int, cap: int, max_block_t: int, d: int,
                  split: bool, overflow_out: torch.Tensor | None = None,
                  overflow_list: tuple[torch.Tensor, torch.Tensor] | None = None) -> RowSplit | None:
    """Launch `_classify_rows_kernel` over counts [M, n_tiles] int32 (on the kernels' device, M >= 1):
    overflow flags into overflow_out (uint8 / bool [M], when given), the overflow rows into
    overflow_list (when given: ids int32 [M] and count int32 [1], zeroed by the caller; the call
    adds the rows to ids[count:] in no particular order) and, when split, the list of at most
    `list_capacity(cap, M, d, ...)` rows of more than `piece` valid slots (d: the row width the
    pieces' partials hold). Returns the RowSplit, or None."""
    m, n_tiles = counts.shape
    overflow = overflow_out
    if overflow is not None and overflow.dtype == torch.bool:
        overflow = overflow.view(torch.uint8)  # same bytes
    over_ids, over_count = overflow_list if overflow_list is not None else (None, None)
    result = None
    flags = ids = state = None
    if split:
        max_pieces = cdiv(n_tiles * slots, piece)
        cap = list_capacity(cap, m, d, max_pieces)
        flags = torch.empty(m, dtype=torch.uint8, device=counts.device)
        ids = torch.empty(cap, dtype=torch.int32, device=counts.device)
        state = torch.zeros(cap + 1, dtype=torch.int32, device=counts.device)
        result = RowSplit(flags, ids, state, cap, max_pieces)
    _classify_rows_launch[(cdiv(m, _CLASSIFY_ROWS),)](
        counts, overflow, over_ids, over_count, flags, ids, state, m, n_tiles, slots, cap if split else 0,
        FLAGS=overflow is not None, LIST=overflow_list is not None, SPLIT=split, PIECE=piece, BLOCK_R=_CLASSIFY_ROWS,
        BLOCK_T=min(next_power_of_2(n_tiles), max_block_t), num_warps=4)
    return result


def prepare_launch(counts: torch.Tensor, slots: int, *, piece: int, cap: int, max_block_t: int, d: int, block_d: int,
                   overflow_out: torch.Tensor | None = None,
                   overflow_list: tuple[torch.Tensor, torch.Tensor] | None = None) -> RowSplit | None:
    """The split list of one launch over counts [M >= 1, n_tiles], or None when the launch does not
    split (`splits`). The rows are classified when it splits or when overflow_out / overflow_list ask
    for the overflow rows (a classification for those alone returns None)."""
    split = splits(piece, d, block_d, counts.shape[1], slots)
    if not split and overflow_out is None and overflow_list is None:
        return None
    return classify_rows(counts, slots, piece=piece, cap=cap, max_block_t=max_block_t, d=d, split=split,
                         overflow_out=overflow_out, overflow_list=overflow_list)


def launch_args(rows: RowSplit | None, d: int, *, scalars: bool = False) -> tuple[list, int]:
    """(the split arguments of a kernel launch: flags, ids, state, partials[, scalar partials], cap,
    max_pieces; the number of piece programs that go first in the grid). Without a list: None
    pointers and zeros."""
    if rows is None:
        return [None] * (5 if scalars else 4) + [0, 0], 0
    partials = [rows.partials(d)] + ([rows.partials(d, scalars=True)] if scalars else [])
    return [rows.flags, rows.ids, rows.state, *partials, rows.cap, rows.max_pieces], rows.cap * rows.max_pieces


def split_signature(split: bool) -> tuple[dict[str, str], dict[str, None]]:
    """(signature entries, constexpr None entries) of a split-aware kernel's split pointers, for the
    GPU compile specs: typed pointers when split, None constexprs otherwise."""
    args = {**_LIST_POINTERS, "partials_ptr": "*fp32"}
    return (args, {}) if split else ({k: "constexpr" for k in args}, dict.fromkeys(args))
