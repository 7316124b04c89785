"""Gate GEMM + ReLU + TwELL packing in one kernel: the packing is the GEMM's epilogue.

For x [M, D], W [H, D] (the gate weight, or up when non-gated) and θ [H] (fp32, or None = 0):

    acc = x @ W^T (fp32, tensor cores)     p = (acc - θ).to(x.dtype)   (rounded once)
    p[m, j] is active iff not p <= 0 (positive, or NaN: a NaN input reaches the output as in torch)

Output, the sparse part of a TwELL activation (docs/format.md), n_tiles = ceil(H / tile):
    values [M, n_tiles, slots] x.dtype, columns (int16, tile-local) same shape, counts [M, n_tiles]
    int32 (TRUE counts, may exceed slots). Slots k < min(count, slots) hold distinct active entries
    in unspecified order; a row with a count > slots is an overflow row the caller recomputes densely.

The TwELL tile is the GEMM's N-tile, so each program packs its own [BLOCK_M, tile] output tile
straight from the accumulator registers (`_epilogue`), with no global synchronisation.
Grid: persistent on CUDA (#SMs x programs_per_sm programs over grouped tiles, the tile and k loops
flattened; TMA descriptors from sm_90 on when the tensors allow, masked pointer loads otherwise),
else one program per tile. Calls of 1 <= M <= FEW_TOKENS on a GPU write the dense relu output with
32-column N-blocks, then `_pack_twell_kernel` packs it. Below sm_90 (no TMA, no PTX bf16 compare)
the same kernel runs its portable path (NATIVE_BF16=False) with configs sized to the shared memory.

Constraints: x 2-D [M, D] bf16/fp16, any strides, M, D >= 0; W [H, D] same dtype and device, unit
stride along D; tile in 32, 64, 128, 256; 1 <= slots <= tile. Compiled variants do not depend on M.
Interpreter (TRITON_INTERPRET=1): dot operands are cast to fp32 (DOT_IN_FP32).

ptxas pitfalls (each serializes every wgmma of the main loop): a `tl.dot`-based prefix sum in the
epilogue (C7515) and lane-dependent selects feeding the slot arithmetic (C7514). Check the ptxas
output for "Potential Performance Loss" after changing the epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from sparseffn.kernels._runtime import DTYPES, HOPPER, capability, cdiv, check_capability, interpreting, num_sms
from sparseffn.kernels.configs.gate_twell import GateTwellConfig, default_config, few_tokens_config
from sparseffn.kernels.launch import Launcher

SUPPORTED_TILES = (32, 64, 128, 256)
MODES = ("pack", "counts", "dense")
_MODE_ID = {"pack": 0, "counts": 1, "dense": 2}


# ----------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M consecutive row blocks sweep all N-tiles before moving on."""
    tiles_per_group = GROUP_M * num_pid_n
    group_id = tile_id // tiles_per_group
    first_m = group_id * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    in_group = tile_id - group_id * tiles_per_group
    pid_m = first_m + in_group % group_rows
    pid_n = in_group // group_rows
    return pid_m, pid_n


@triton.jit
def _mma_nt(a, b, acc, DOT_IN_FP32: tl.constexpr):
    """acc + a @ b^T for a [BLOCK_M, BLOCK_K], b [BLOCK_N, BLOCK_K]; fp32 accumulation."""
    if DOT_IN_FP32:
        acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _halves(t):
    """[R, C] -> two [R, C/2] column halves. In the accumulator layout every column bit above bit 2
    is a register bit, so the split moves no data."""
    R: tl.constexpr = t.shape[0]
    C: tl.constexpr = t.shape[1]
    return tl.split(tl.permute(tl.reshape(t, (R, 2, C // 2)), (0, 2, 1)))


@triton.jit
def _quad_prefix(t):
    """Exclusive prefix sum and total of t [R, 4] along axis 1, for 0 <= t <= 85.

    The 4 columns are the 4 lanes of a quad. The counts are packed into the bytes of one int32 (a
    lane-shifted sum: two warp shuffles) and lane q sums the bytes below byte q with one multiply
    (partial sums stay below 256: no carries between bytes). Deliberately select-free: lane-dependent
    selects here made ptxas serialize the main loop's wgmma (warning C7514).
    """
    shift = tl.arange(0, 4)[None, :] * 8  # [1, 4]
    packed = tl.sum(t << shift, axis=1)  # [R] byte q = t[:, q]
    below = packed[:, None] & ((1 << shift) - 1)  # [R, 4] the bytes of lanes < q
    excl = ((below * 0x01010101) >> 24) & 0xFF
    return excl, tl.sum(t, axis=1)


@triton.jit
def _store_i32(ptrs, value, keep, ASM_STORES: tl.constexpr):
    """Predicated int32 store that keeps the operands' register layout (see _pack_lanes)."""
    if ASM_STORES:
        tl.inline_asm_elementwise(
            asm="""{
            .reg .pred pk;
            setp.ne.b32 pk, $1, 0;
            @pk st.global.b32 [$2], $3;
            mov.b32 $0, 0;
            }""",
            constraints="=r,r,l,r",
            args=[keep.to(tl.int32), ptrs.to(tl.int64), value],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.store(ptrs, value, mask=keep)


@triton.jit
def _pack_lanes(v, slot, limit, value_rows, column_rows, COL: tl.constexpr, ASM_STORES: tl.constexpr,
                NATIVE_BF16: tl.constexpr):
    """One accumulator register per row and lane: v [BLOCK_M, 4] holds tile column COL + 2q in
    lane q. Stores the active entries whose slot < limit; returns `slot` advanced past them."""
    cols = tl.broadcast_to((tl.arange(0, 4) * 2 + COL).to(tl.int16)[None, :], v.shape)
    value_ptrs = value_rows + slot  # [BLOCK_M, 4]
    column_ptrs = column_rows + slot
    if ASM_STORES:
        # Test, predicate and both scattered 2-byte stores in one asm block, in the accumulator
        # layout. tl.store would be re-laid out for coalescing (pointers, values and masks through
        # shared memory), and a plain `v > 0` is merged by LLVM with the counting pass into bit
        # masks that cost more to unpack per element than this compare.
        if v.dtype == tl.bfloat16:
            if NATIVE_BF16:  # sm_90 and later
                test: tl.constexpr = "setp.gtu.bf16 pa, $1, zero;"  # > 0 or NaN
            else:  # the bf16 bits as the high half of an fp32: the same value, compared as fp32
                test: tl.constexpr = "mov.b32 wide, {zero, $1}; setp.gtu.f32 pa, wide, 0f00000000;"
        else:
            test: tl.constexpr = "setp.gtu.f16 pa, $1, zero;"
        inc = tl.inline_asm_elementwise(
            asm="""{
            .reg .pred pa, pk;
            .reg .b16 zero;
            .reg .b32 wide;
            mov.b16 zero, 0;
            """
            + test
            + """
            setp.lt.and.s32 pk, $2, $3, pa;
            selp.u32 $0, 1, 0, pa;
            @pk st.global.b16 [$4], $1;
            @pk st.global.b16 [$5], $6;
            }""",
            constraints="=r,h,r,r,l,l,h",
            args=[
                v.to(tl.int16, bitcast=True),
                slot,
                limit,
                value_ptrs.to(tl.int64),
                column_ptrs.to(tl.int64),
                cols,
            ],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        active = ~(v <= 0)  # > 0 or NaN
        keep = active & (slot < limit)
        tl.store(value_ptrs, v, mask=keep)
        tl.store(column_ptrs, cols, mask=keep)
        inc = active.to(tl.int32)
    return slot + inc


@triton.jit
def _pack_columns(p, slot, limit, value_rows, column_rows, COL0: tl.constexpr, ASM_STORES: tl.constexpr,
                  NATIVE_BF16: tl.constexpr):
    """Store the active entries of p [BLOCK_M, W] (tile columns COL0 .. COL0 + W, W >= 8 a power
    of two).

    slot [BLOCK_M, 4] int32: next slot of each (row, quad lane); limit [BLOCK_M, 4]: the lane's
    slots end at min(slots, its own range), 0 for rows past M; value_rows / column_rows
    [BLOCK_M, 1]: slot 0 of each (row, tile). Halves the columns recursively down to 8 = 4 lanes x
    2 registers: a walk over each thread's own registers in ascending column order. Returns the
    advanced slot.
    """
    W: tl.constexpr = p.shape[1]
    if W > 8:
        lo, hi = _halves(p)
        slot = _pack_columns(lo, slot, limit, value_rows, column_rows, COL0, ASM_STORES, NATIVE_BF16)
        slot = _pack_columns(hi, slot, limit, value_rows, column_rows, COL0 + W // 2, ASM_STORES, NATIVE_BF16)
    else:
        even, odd = tl.split(tl.reshape(p, (p.shape[0], 4, 2)))  # [BLOCK_M, 4]: columns COL0 + 2q, + 1
        slot = _pack_lanes(even, slot, limit, value_rows, column_rows, COL0, ASM_STORES, NATIVE_BF16)
        slot = _pack_lanes(odd, slot, limit, value_rows, column_rows, COL0 + 1, ASM_STORES, NATIVE_BF16)
    return slot


@triton.jit
def _epilogue(p, rows, cols, pid_n, num_pid_n, values_ptr, columns_ptr, counts_ptr, M, H,
              SLOTS: tl.constexpr, MODE: tl.constexpr, SCAN_EPILOGUE: tl.constexpr, ASM_STORES: tl.constexpr,
              NATIVE_BF16: tl.constexpr):
    """Pack the [BLOCK_M, BLOCK_N] tile p (activation dtype, accumulator layout) of rows `rows`
    and N-tile pid_n. Rows past M can be active (θ < 0): every store is masked by row.

    On sm_90 the accumulator of a warp covers 16 rows; in a row, quad lane q (0..3) of the thread
    holds columns 8j + 2q + b (b = 0, 1) in registers. `tl.cumsum` and `tl.store` would move the
    tile through shared memory (more than an SM has at tile 256, 8 warps), so this never leaves the
    accumulator layout: (1) each thread counts its active entries per row; (2) the 4 counts of a
    quad are packed into the bytes of one int32 (two shuffles) and each lane takes the byte sum of
    the lanes before it as its first slot; (3) each thread walks its registers in ascending column
    order, storing each active entry at its lane's next slot while below min(slots, the lane's end).
    Slots come out in (quad lane, column) order, which TwELL allows; columns past H come last and
    are never stored. Test, predicate and stores are one inline-PTX block per element on the GPU.
    SCAN_EPILOGUE selects the plain tl.cumsum version (column order) as a reference."""
    BLOCK_M: tl.constexpr = p.shape[0]
    BLOCK_N: tl.constexpr = p.shape[1]
    # > 0 or NaN; columns past H hold 0, or NaN when x holds an inf: masked
    active = ~(p <= 0) & (cols < H)[None, :]  # [BLOCK_M, BLOCK_N]
    row_ok = rows < M  # [BLOCK_M]
    tile_index = rows.to(tl.int64) * num_pid_n + pid_n  # [BLOCK_M] flat (row, tile) index
    slot0 = tile_index * SLOTS  # [BLOCK_M] int64: slot 0 of (row, tile)
    if MODE == 2:
        dense_ptrs = values_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :]
        tl.store(dense_ptrs, tl.where(active, p, 0.0), mask=row_ok[:, None] & (cols[None, :] < H))
    elif MODE == 1:
        tl.store(counts_ptr + tile_index, tl.sum(active.to(tl.int32), axis=1), mask=row_ok)
    elif SCAN_EPILOGUE:
        flags = active.to(tl.int32)  # [BLOCK_M, BLOCK_N]
        tl.store(counts_ptr + tile_index, tl.sum(flags, axis=1), mask=row_ok)
        slot = tl.cumsum(flags, axis=1) - flags  # [BLOCK_M, BLOCK_N] exclusive: column order
        keep = (flags != 0) & (slot < tl.where(row_ok, SLOTS, 0)[:, None])
        local_cols = tl.broadcast_to(tl.arange(0, BLOCK_N).to(tl.int16)[None, :], (BLOCK_M, BLOCK_N))
        tl.store((values_ptr + slot0)[:, None] + slot, p, mask=keep)
        tl.store((columns_ptr + slot0)[:, None] + slot, local_cols, mask=keep)
    else:
        # register-resident epilogue, slots in (quad lane, column) order (module docstring)
        flags = tl.reshape(active.to(tl.int32), (BLOCK_M, BLOCK_N // 8, 4, 2))  # [BM, j, q, b]
        lane_counts = tl.sum(tl.sum(flags, axis=3), axis=1)  # [BLOCK_M, 4] <= BLOCK_N / 4
        slot, count = _quad_prefix(lane_counts)  # [BLOCK_M, 4] first slot per lane, [BLOCK_M]
        # the quad holds the count 4 times; lane 0 stores it, in this layout
        lane0 = (tl.arange(0, 4) == 0)[None, :] & row_ok[:, None]  # [BLOCK_M, 4]
        count_ptrs = (counts_ptr + tile_index)[:, None] + tl.zeros((1, 4), tl.int32)
        _store_i32(count_ptrs, tl.broadcast_to(count[:, None], (BLOCK_M, 4)), lane0, ASM_STORES)
        # Lane q owns slots [slot, slot + lane_counts) and walks its columns in ascending order, so
        # columns past H (counted in no lane) come last and stop at the lane's limit.
        limit = tl.minimum(tl.where(row_ok, SLOTS, 0)[:, None], slot + lane_counts)  # [BLOCK_M, 4]
        _pack_columns(p, slot, limit, (values_ptr + slot0)[:, None], (columns_ptr + slot0)[:, None], 0, ASM_STORES,
                      NATIVE_BF16)


@triton.jit(do_not_specialize=["M"])
def _gate_twell_kernel(
    x,  # x [M, D]: pointer, or TMA descriptor with block [BLOCK_M, BLOCK_K] when USE_TMA
    weight,  # W [H, D]: pointer, or TMA descriptor with block [BLOCK_N, BLOCK_K] when USE_TMA
    threshold_ptr,  # θ [H] fp32, or None when not HAS_THRESHOLD
    values_ptr,  # [M, n_tiles, SLOTS] x dtype; the dense [M, H] output when MODE == 2
    columns_ptr,  # [M, n_tiles, SLOTS] int16
    counts_ptr,  # [M, n_tiles] int32
    M,
    D,  # >= 1 (the launcher pads D = 0)
    H,
    stride_xm,
    stride_xk,
    stride_wn,
    SLOTS: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    MODE: tl.constexpr,  # 0 pack TwELL; diagnostics: 1 counts only, 2 dense relu output
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # = the TwELL tile
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr,
    FLATTEN: tl.constexpr,  # flatten the tile and k loops (persistent grid)
    SCAN_EPILOGUE: tl.constexpr,  # reference epilogue: tl.cumsum, slots in column order
    ASM_STORES: tl.constexpr,  # epilogue stores by inline PTX (GPU) instead of tl.store
    NATIVE_BF16: tl.constexpr,  # the PTX compares bf16 natively (sm_90+), else as fp32
    DOT_IN_FP32: tl.constexpr,  # interpreter: its low-precision tl.dot is wrong
):
    tl.assume(D > 0)  # one main loop, no zero-trip copy of the epilogue
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(H, BLOCK_N)  # = n_tiles
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(D, BLOCK_K)
    out_dtype = values_ptr.dtype.element_ty

    offs_bm = tl.arange(0, BLOCK_M)
    offs_bn = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rows = off_m + offs_bm  # [BLOCK_M]
        cols = off_n + offs_bn  # [BLOCK_N] global columns

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [BLOCK_M, BLOCK_N] fp32 accumulator
        if USE_TMA:
            # rows, columns and k past the ends are zero-filled by the TMA unit
            for ki in range(k_tiles):
                a = x.load([off_m, ki * BLOCK_K])  # [BLOCK_M, BLOCK_K]
                b = weight.load([off_n, ki * BLOCK_K])  # [BLOCK_N, BLOCK_K]
                acc = _mma_nt(a, b, acc, DOT_IN_FP32)
        else:
            x_ptrs = x + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
            w_ptrs = weight + cols.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
            row_in = rows[:, None] < M
            col_in = cols[:, None] < H
            for ki in range(k_tiles):
                k_in = offs_k[None, :] < D - ki * BLOCK_K
                a = tl.load(x_ptrs, mask=row_in & k_in, other=0.0)  # [BLOCK_M, BLOCK_K]
                b = tl.load(w_ptrs, mask=col_in & k_in, other=0.0)  # [BLOCK_N, BLOCK_K]
                acc = _mma_nt(a, b, acc, DOT_IN_FP32)
                x_ptrs += BLOCK_K * stride_xk
                w_ptrs += BLOCK_K

        # ---- epilogue ----------------------------------------------------------------------------
        if HAS_THRESHOLD:
            theta = tl.load(threshold_ptr + cols, mask=cols < H, other=0.0)  # [BLOCK_N] fp32
            acc = acc - theta[None, :]
        p = acc.to(out_dtype)  # [BLOCK_M, BLOCK_N] activation dtype
        _epilogue(p, rows, cols, pid_n, num_pid_n, values_ptr, columns_ptr, counts_ptr, M, H,
                  SLOTS, MODE, SCAN_EPILOGUE, ASM_STORES, NATIVE_BF16)


_gate_twell_launch = Launcher(_gate_twell_kernel)


@triton.jit
def _pack_twell_kernel(p_ptr, values_ptr, columns_ptr, counts_ptr, H, n_tiles, stride_pm,
                       SLOTS: tl.constexpr, TILE: tl.constexpr):
    """One (row, tile) of a dense activation p [M, H] (relu already applied, x's dtype) packed into
    TwELL: the active entries (> 0 or NaN) in column order, the true count. Program (m, t)."""
    m = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    offs = tl.arange(0, TILE)  # [TILE] tile-local columns
    cols = t * TILE + offs
    v = tl.load(p_ptr + m * stride_pm + cols, mask=cols < H, other=0.0)  # [TILE] x dtype
    flags = (~(v <= 0) & (cols < H)).to(tl.int32)  # [TILE]
    slot = tl.cumsum(flags, 0) - flags  # [TILE] exclusive: column order
    tile_index = m * n_tiles + t
    keep = (flags != 0) & (slot < SLOTS)
    tl.store(values_ptr + tile_index * SLOTS + slot, v, mask=keep)
    tl.store(columns_ptr + tile_index * SLOTS + slot, offs.to(tl.int16), mask=keep)
    tl.store(counts_ptr + tile_index, tl.sum(flags, 0))


_pack_twell_launch = Launcher(_pack_twell_kernel)


# ----------------------------------------------------------------------------------------------------
# launcher


# Few tokens (1 <= M <= FEW_TOKENS on a GPU): one program per (row block, tile) would leave most SMs
# idle, so the GEMM writes the dense relu output over 32-column N-blocks and a second kernel packs it
# (measurements: docs/kernel-notes.md). Inference calls this small take the decode
# kernels; this path serves explicit gate_twell calls and the training forward.
FEW_TOKENS = 64
_FEW_TOKENS_BLOCK_N = 32


def _tma_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """TMA descriptors need unit inner strides, 16-byte aligned bases and row strides."""
    es = x.element_size()
    return (
        x.stride(1) == 1
        and weight.stride(1) == 1
        and (x.stride(0) * es) % 16 == 0
        and (weight.stride(0) * es) % 16 == 0
        and x.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
    )


def _check_inputs(x, weight, threshold, tile, slots, mode, config):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, D], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be torch.bfloat16 or torch.float16, got {x.dtype}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [H, D] with D = x.shape[1] = {x.shape[1]}, got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")
    if weight.shape[1] > 1 and weight.stride(1) != 1:
        raise ValueError(f"weight must have unit stride along D (e.g. be contiguous), got strides {weight.stride()}")
    if not x.is_cuda and not interpreting():
        raise ValueError(f"x must be a CUDA tensor (CPU tensors run only under TRITON_INTERPRET=1), got {x.device}")
    check_capability(x.device)
    if threshold is not None:
        if not isinstance(threshold, torch.Tensor):
            raise TypeError(f"threshold must be None or a torch.Tensor, got {type(threshold).__name__}")
        if threshold.dtype != torch.float32:
            raise TypeError(f"threshold must be torch.float32, got {threshold.dtype}")
        if tuple(threshold.shape) != (weight.shape[0],):
            raise ValueError(f"threshold must have shape [H] = [{weight.shape[0]}], got {tuple(threshold.shape)}")
        if threshold.device != x.device:
            raise ValueError(f"threshold must be on x's device {x.device}, got {threshold.device}")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile not in SUPPORTED_TILES:
        raise NotImplementedError(f"tile must be one of {SUPPORTED_TILES} (the kernel's BLOCK_N), got {tile!r}")
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= tile:
        raise ValueError(f"slots must be an integer with 1 <= slots <= tile = {tile}, got {slots!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if config is not None and not isinstance(config, GateTwellConfig):
        raise TypeError(f"config must be None or a GateTwellConfig, got {type(config).__name__}")


def gate_twell(
    x: torch.Tensor,
    weight: torch.Tensor,
    threshold: torch.Tensor | None = None,
    *,
    tile: int = 256,
    slots: int = 32,
    persistent: bool | None = None,
    tma: bool | None = None,
    config: GateTwellConfig | None = None,
    mode: str = "pack",
    few_tokens: bool | None = None,
    arch: tuple[int, int] | None = None,
):
    """p = relu(x @ weight^T - threshold), packed into TwELL's (values, columns, counts).

    x [M, D] bf16/fp16 (any strides), weight [H, D] (unit stride along D), threshold fp32 [H] or
    None. Returns values [M, n_tiles, slots] (x.dtype), columns [M, n_tiles, slots] int16 and counts
    [M, n_tiles] int32, n_tiles = ceil(H / tile); the module docstring has the contract.

    persistent: None = on CUDA. tma: None = when persistent, on CUDA and the tensors allow it (True
    forces descriptors; the interpreter runs them too). config: None = default_config(...).
    mode: "pack"; "dense" returns the dense [M, H] relu output instead of the triple (the first
    step of few-token calls, and a diagnostic); "counts" (only counts is written) is a diagnostic.
    few_tokens: pack through the dense output (FEW_TOKENS above): None = for 1 <= M <= FEW_TOKENS on
    a GPU when mode, config, persistent and tma are left at their defaults. arch: the GPU generation
    whose code path and configs to use (None: the device's); an older one than the device runs that
    generation's portable path (no TMA, no native bf16 compare), which is how it is tested on Hopper.
    """
    _check_inputs(x, weight, threshold, tile, slots, mode, config)
    m = x.shape[0]
    if few_tokens is None:
        few_tokens = (x.is_cuda and 1 <= m <= FEW_TOKENS and mode == "pack" and config is None
                      and persistent is None and tma is None)
    elif few_tokens and (mode != "pack" or config is not None or persistent or tma):
        raise ValueError("few_tokens=True packs with its own launches: it takes mode='pack' and no config, "
                         "persistent or tma")
    if arch is not None and (not isinstance(arch, tuple) or len(arch) != 2 or arch > capability(x.device)):
        raise ValueError(f"arch must be None or a (major, minor) capability no newer than the device's "
                         f"{capability(x.device)}, got {arch!r}")
    if few_tokens and m:
        return _pack_few_tokens(x, weight, threshold, tile, slots, arch)
    return _launch(x, weight, threshold, tile, slots, persistent, tma, config, mode, arch)


def _launch(x, weight, threshold, tile, slots, persistent, tma, config, mode, arch=None):
    """The packing GEMM (or its diagnostic modes) on checked arguments: gate_twell's contract."""
    m, d = x.shape
    h = weight.shape[0]
    n_tiles = -(-h // tile)
    cuda = x.is_cuda
    if persistent is None:
        persistent = cuda
    if d == 0:  # empty reduction: acc = 0; one zero column keeps the kernel's loop non-empty
        x = x.new_zeros((m, 1))
        weight = weight.new_zeros((h, 1))
        d = 1
    cap = arch if arch is not None else capability(x.device)
    if tma is None:
        tma = persistent and cuda and cap >= HOPPER and _tma_ok(x, weight)
    elif tma and cuda and cap < HOPPER:
        raise ValueError(f"tma=True needs a GPU of compute capability 9.0 or later (TMA), this one is {cap[0]}.{cap[1]}")
    elif tma and not _tma_ok(x, weight):
        raise ValueError(
            "tma=True needs x and weight with unit stride along D and 16-byte aligned bases and row strides, "
            f"got strides {x.stride()} and {weight.stride()}"
        )
    if config is None:
        config = default_config(d, h, x.dtype, tile, cuda=cuda, arch=cap)
    if threshold is not None:
        threshold = threshold.contiguous()

    if mode == "dense":
        values = torch.empty((m, h), dtype=x.dtype, device=x.device)
    else:
        values = torch.empty((m, n_tiles, slots), dtype=x.dtype, device=x.device)
    columns = torch.empty((m, n_tiles, slots), dtype=torch.int16, device=x.device)
    counts = torch.empty((m, n_tiles), dtype=torch.int32, device=x.device)
    if m == 0 or n_tiles == 0:
        return values if mode == "dense" else (values, columns, counts)

    num_tiles = -(-m // config.block_m) * n_tiles
    if persistent:
        sms = num_sms(x.device) if cuda else 4
        grid = (min(num_tiles, sms * config.programs_per_sm),)
    else:
        grid = (num_tiles,)
    if tma:
        x_arg = TensorDescriptor(x, [m, d], [x.stride(0), 1], [config.block_m, config.block_k])
        w_arg = TensorDescriptor(weight, [h, d], [weight.stride(0), 1], [tile, config.block_k])
    else:
        x_arg, w_arg = x, weight
    interpret = interpreting()
    _gate_twell_launch[grid](
        x_arg,
        w_arg,
        threshold,
        values,
        columns,
        counts,
        m,
        d,
        h,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        SLOTS=slots,
        HAS_THRESHOLD=threshold is not None,
        MODE=_MODE_ID[mode],
        BLOCK_M=config.block_m,
        BLOCK_N=tile,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        USE_TMA=tma,
        FLATTEN=persistent,
        SCAN_EPILOGUE=config.scan_epilogue,
        ASM_STORES=config.asm_stores and not interpret,
        NATIVE_BF16=cap >= HOPPER,
        DOT_IN_FP32=interpret,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return values if mode == "dense" else (values, columns, counts)


def _pack_few_tokens(x, weight, threshold, tile, slots, arch):
    """gate_twell of a few-token call: the dense relu output in N-blocks of 32 columns, then one
    packing program per (row, tile). Same TwELL (slots in column order)."""
    m, d = x.shape
    h = weight.shape[0]
    n_tiles = cdiv(h, tile)
    # dense mode writes no slots (SLOTS only has to be a valid count for tile 32)
    p = _launch(x, weight, threshold, _FEW_TOKENS_BLOCK_N, _FEW_TOKENS_BLOCK_N, False, None,
                few_tokens_config(d, m), "dense", arch)
    values = torch.empty((m, n_tiles, slots), dtype=x.dtype, device=x.device)
    columns = torch.empty((m, n_tiles, slots), dtype=torch.int16, device=x.device)
    counts = torch.empty((m, n_tiles), dtype=torch.int32, device=x.device)
    if n_tiles:
        _pack_twell_launch[(m, n_tiles)](p, values, columns, counts, h, n_tiles, p.stride(0), SLOTS=slots, TILE=tile)
    return values, columns, counts
