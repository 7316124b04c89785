"""Dense MLP on a device-chosen subset of rows, without host synchronisation (the dense backup).

For x [M, D] and row flags f [M] on the device, every flagged row m gets, in fp32,

    gated:      h = relu(x[m] gate^T - θ) * (x[m] up^T)       non-gated:  h = relu(x[m] up^T - θ)
    out[m] = Σ_j h_j · down_weight_t[j]  (rounded to x's dtype once)    row_l1[m] = Σ_j |h_j|  (optional)

Unflagged rows keep their bytes in `out` and `row_l1`. This is the exact path for the overflow rows
of the TwELL MLP (ops/twell_mlp.py, ops/train_mlp.py). The number R of flagged rows never leaves
the device, so a call can be captured in a CUDA graph:
  1. `_compact_rows_kernel` (one program) lists the flagged rows and R, unless the caller passes the
     list `row_split.classify_rows` already built (any order: a row's result does not depend on it);
  2. `_dense_rows_mlp_kernel` runs a persistent grid (<= #SMs programs, fixed at launch) that reads R
     and loops over the cdiv(R, BLOCK_R) x cdiv(D, BLOCK_DY) tiles that exist (none when R = 0).
A tile is "swap AB": units (or the D slice) are the tensor-core M dimension, the few tokens N. Each
y-slice tile recomputes its rows' g and u (the price of not holding all of D in registers), and the
slice-0 tile alone writes row_l1 (one writer per element: no atomics, deterministic). h stays fp32
through the down GEMM as two terms of x's dtype, h = hi + lo (fp16: scaled per token by a power of
two first), so its rounding error sits far below one output rounding (docs/design.md, "Dense backup").

Layouts: x, out [M, D] bf16 / fp16, any row stride; row_flags [M] bool or integer, any stride;
gate_weight, up_weight, down_weight_t [H, D] = down_proj.weight^T in x's dtype, unit stride along D,
any row stride (views of the interleaved up/down weight work as they are); threshold [H] fp32 or
None; row_l1 [M] fp32 or None. On CUDA only the 16-byte-aligned path runs (D % 8 == 0; see the
launcher). Any M, D, H >= 0 (M < 2**31); row and unit offsets are int64. Compiled variants depend
on dtype, gated, threshold, row_l1 and the config (a function of D), never on M.
Interpreter (TRITON_INTERPRET=1): dot operands are cast to fp32 (its low-precision tl.dot is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import DTYPES, cdiv, check_capability, interpreting, mma, num_sms
from sparseffn.kernels.configs.dense_rows_mlp import DenseRowsConfig, default_config
from sparseffn.kernels.launch import Launcher
from sparseffn.kernels.row_split import check_row_list

__all__ = ["compact_rows", "dense_rows_mlp"]

_FLAG_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_COMPACT_BLOCK = 2048  # flags per step of the one-program scan
_COMPACT_WARPS = 8
_INTERPRETER_PROGRAMS = 3  # "SMs" under the interpreter: few, so each program loops over tiles


# ----------------------------------------------------------------------------------------------------
# kernels


@triton.jit(do_not_specialize=["M"])
def _compact_rows_kernel(flags_ptr, ids_ptr, count_ptr, M, stride_f, BLOCK: tl.constexpr):
    """ids[0:R] = ascending ids of the rows with flags != 0, count[0] = R. One program."""
    offs = tl.arange(0, BLOCK)  # [BLOCK]
    total = tl.full([], 0, tl.int32)  # flagged rows seen so far
    for m0 in range(0, M, BLOCK):
        rows = m0 + offs  # [BLOCK] int32 (M < 2**31)
        f = tl.load(flags_ptr + rows.to(tl.int64) * stride_f, mask=rows < M, other=0)
        keep = (f != 0).to(tl.int32)  # [BLOCK] 0/1
        slot = total + tl.cumsum(keep, 0) - keep  # [BLOCK] exclusive prefix: compacted position
        tl.store(ids_ptr + slot, rows, mask=keep != 0)
        total += tl.sum(keep, 0)
    tl.store(count_ptr, total)


_compact_rows_launch = Launcher(_compact_rows_kernel)


@triton.jit
def _mlp_tile(
    pid_r, pid_d, count,
    x_ptr, ids_ptr, first_ptr, up_ptr, down_ptr, threshold_ptr, out_ptr, row_l1_ptr,
    D, H, stride_xm, stride_fh, stride_uh, stride_dh, stride_om, stride_l1,
    GATED: tl.constexpr, HAS_THRESHOLD: tl.constexpr, WRITE_L1: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DY: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """out[rows, slice] for the compacted entries [pid_r * BLOCK_R, +BLOCK_R) and y slice pid_d
    (and row_l1[rows] when WRITE_L1 and pid_d == 0):

        rows = ids[pid_r * BLOCK_R : +BLOCK_R]                          (masked past count)
        for each chunk of BLOCK_H units:
            g^T, u^T = gate[chunk] @ x[rows]^T, up[chunk] @ x[rows]^T    [BLOCK_H, BLOCK_R] fp32
            h^T = relu(g^T - θ) * u^T                                    [BLOCK_H, BLOCK_R] fp32
            y^T += down_weight_t[chunk, slice]^T @ (hi + lo)             [BLOCK_DY, BLOCK_R] fp32
        out[rows, slice] = y (rounded once);  row_l1[rows] = Σ |h| (slice 0 only)

    With ALIGNED the loads are stated 16-byte aligned (tl.multiple_of) for vector loads through
    the cp.async pipeline; otherwise element loads."""
    low = down_ptr.dtype.element_ty
    SCALE_H: tl.constexpr = low == tl.float16  # fp16 needs per-token scaling of h (docstring)

    entries = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] compacted positions
    row_ok = entries < count
    rows = tl.load(ids_ptr + entries, mask=row_ok, other=0).to(tl.int64)  # [BLOCK_R] token ids
    x_rows = x_ptr + rows * stride_xm  # [BLOCK_R] row starts
    if ALIGNED:
        x_rows = tl.multiple_of(x_rows, 16)
    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    offs_d = pid_d * BLOCK_DY + tl.arange(0, BLOCK_DY)  # [BLOCK_DY] this tile's y columns
    d_ok = offs_d < D
    if ALIGNED:
        d_ok = tl.max_constancy(d_ok, 8)

    acc = tl.zeros((BLOCK_DY, BLOCK_R), dtype=tl.float32)  # [BLOCK_DY, BLOCK_R] fp32 y^T
    if WRITE_L1:
        l1 = tl.zeros((BLOCK_R,), dtype=tl.float32)  # [BLOCK_R] fp32 Σ|h| per token
    for h0 in range(0, H, BLOCK_H):
        units = h0 + offs_h  # [BLOCK_H]
        h_ok = units < H
        units64 = units.to(tl.int64)
        f_rows = first_ptr + units64 * stride_fh  # [BLOCK_H] weight row starts
        d_rows = down_ptr + units64 * stride_dh
        if GATED:
            u_rows = up_ptr + units64 * stride_uh
        if ALIGNED:
            f_rows = tl.multiple_of(f_rows, 16)
            d_rows = tl.multiple_of(d_rows, 16)
            if GATED:
                u_rows = tl.multiple_of(u_rows, 16)
        # [BLOCK_H, BLOCK_DY] down^T rows of the chunk, issued first: in flight during the K-loop
        down = tl.load(d_rows[:, None] + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)

        # ---- g^T, u^T = W[chunk] @ x[rows]^T ------------------------------------------------------
        g = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)  # [BLOCK_H, BLOCK_R] fp32 g^T
        u = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)  # [BLOCK_H, BLOCK_R] fp32 u^T
        for k0 in range(0, D, BLOCK_K):
            k = k0 + offs_k  # [BLOCK_K]
            k_ok = k < D
            if ALIGNED:
                k_ok = tl.max_constancy(k_ok, 8)
            xt = tl.load(x_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                         other=0.0)  # [BLOCK_R, BLOCK_K]
            w_mask = h_ok[:, None] & k_ok[None, :]
            wf = tl.load(f_rows[:, None] + k[None, :], mask=w_mask, other=0.0)  # [BLOCK_H, BLOCK_K]
            g = mma(wf, tl.trans(xt), g, DOT_IN_FP32)
            if GATED:
                wu = tl.load(u_rows[:, None] + k[None, :], mask=w_mask, other=0.0)  # [BLOCK_H, BLOCK_K]
                u = mma(wu, tl.trans(xt), u, DOT_IN_FP32)

        # ---- h^T = relu(g^T - θ) (* u^T), fp32; NaN stays NaN ---------------------------------------
        if HAS_THRESHOLD:
            theta = tl.load(threshold_ptr + units, mask=h_ok, other=0.0)  # [BLOCK_H] fp32
            g = g - theta[:, None]
        h = tl.where(g <= 0.0, 0.0, g)  # [BLOCK_H, BLOCK_R] fp32
        if GATED:
            h = h * u
        if WRITE_L1:
            l1 += tl.sum(tl.abs(h), axis=0)  # padded units have h = 0 (zero weights, θ = 0)

        # ---- y^T += down[chunk, slice]^T @ h^T, h as hi + lo in x's dtype -------------------------
        down_t = tl.trans(down)  # [BLOCK_DY, BLOCK_H]
        if SCALE_H:
            # per token (column), a power of two bringing max|h| into [1, 2): exact scaling
            h_max = tl.max(tl.abs(h), axis=0)  # [BLOCK_R]
            bits = h_max.to(tl.int32, bitcast=True) & 0x7F800000
            normal = (bits > 0) & (bits < 0x7F000000)  # 0, subnormal, huge, inf, NaN: no scale
            scale = tl.where(normal, bits.to(tl.float32, bitcast=True), 1.0)  # [BLOCK_R] 2^e
            inv = tl.where(normal, (0x7F000000 - bits).to(tl.float32, bitcast=True), 1.0)  # 2^-e exactly
            h = h * inv[None, :]
        hi = h.to(low)  # [BLOCK_H, BLOCK_R]
        lo = (h - hi.to(tl.float32)).to(low)  # [BLOCK_H, BLOCK_R] the rounding error of hi
        if SCALE_H:
            part = tl.zeros((BLOCK_DY, BLOCK_R), dtype=tl.float32)  # [BLOCK_DY, BLOCK_R] scaled y^T
            part = mma(down_t, hi, part, DOT_IN_FP32)
            part = mma(down_t, lo, part, DOT_IN_FP32)
            acc += part * scale[None, :]
        else:
            acc = mma(down_t, hi, acc, DOT_IN_FP32)
            acc = mma(down_t, lo, acc, DOT_IN_FP32)

    out_rows = out_ptr + rows * stride_om  # [BLOCK_R]
    if ALIGNED:
        out_rows = tl.multiple_of(out_rows, 16)
    tl.store(out_rows[None, :] + offs_d[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=d_ok[:, None] & row_ok[None, :])
    if WRITE_L1:
        # every slice tile computed the same sums; slice 0 is their one writer
        tl.store(row_l1_ptr + rows * stride_l1, l1, mask=row_ok & (pid_d == 0))


@triton.jit
def _dense_rows_mlp_kernel(
    x_ptr,  # [M, D], unit stride along D
    ids_ptr,  # [M] int32: compacted flagged row ids, valid below count
    count_ptr,  # [1] int32: number of flagged rows
    first_ptr,  # [H, D] gate weight (gated) or up weight (non-gated)
    up_ptr,  # [H, D] up weight (gated), None otherwise
    down_ptr,  # [H, D] down_weight^T
    threshold_ptr,  # [H] fp32, None when not HAS_THRESHOLD
    out_ptr,  # [M, D], unit stride along D
    row_l1_ptr,  # [M] fp32, None when not WRITE_L1
    D,
    H,
    stride_xm,  # row strides (all tensors have unit stride along D)
    stride_fh,
    stride_uh,
    stride_dh,
    stride_om,
    stride_l1,  # row_l1's stride (elements)
    GATED: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    WRITE_L1: tl.constexpr,  # also row_l1[m] = Σ_j |h_j| (slice-0 tiles store it)
    ALIGNED: tl.constexpr,  # D % 8 == 0, 16-byte aligned bases and row strides: 16-byte vectors
    BLOCK_R: tl.constexpr,  # tokens per tile (the MMA N dimension, >= 8 on the GPU)
    BLOCK_H: tl.constexpr,  # units per chunk (MMA M of g^T, K of the down GEMM)
    BLOCK_K: tl.constexpr,  # D step of the g, u K-loop
    BLOCK_DY: tl.constexpr,  # y columns per tile (MMA M of the down GEMM)
    DOT_IN_FP32: tl.constexpr,  # interpreter: its low-precision tl.dot is wrong
):
    # Persistent: the launch grid is fixed (<= #SMs, graph-capturable); the number of tiles is
    # known only here, from the device count. With no flagged row every program loads one int32
    # and leaves.
    n_d = tl.cdiv(D, BLOCK_DY)
    count = tl.load(count_ptr)
    n_tiles = tl.cdiv(count, BLOCK_R) * n_d
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        # the n_d slices of a row block are consecutive tiles: run side by side, they share the
        # gate/up weight reads through L2
        _mlp_tile(tile // n_d, tile % n_d, count,
                  x_ptr, ids_ptr, first_ptr, up_ptr, down_ptr, threshold_ptr, out_ptr, row_l1_ptr,
                  D, H, stride_xm, stride_fh, stride_uh, stride_dh, stride_om, stride_l1,
                  GATED, HAS_THRESHOLD, WRITE_L1, ALIGNED, BLOCK_R, BLOCK_H, BLOCK_K, BLOCK_DY, DOT_IN_FP32)


_dense_rows_mlp_launch = Launcher(_dense_rows_mlp_kernel)


# ----------------------------------------------------------------------------------------------------
# launcher


def _check_weight(t: object, name: str, h: int | None, x: torch.Tensor) -> torch.Tensor:
    d = x.shape[1]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2 or t.shape[1] != d or (h is not None and t.shape[0] != h):
        want = f"[{'H' if h is None else h}, {d}]"
        raise ValueError(f"{name} must have shape {want} (H, D = x.shape[1]), got {list(t.shape)}")
    if t.dtype != x.dtype:
        raise TypeError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    if d > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along D (any row stride), got strides {list(t.stride())}")
    return t


def check_rows_and_weights(x, row_flags, gate_weight, up_weight, down_weight_t, threshold,
                           row_list=None) -> tuple[int, int, int]:
    """(M, D, H) after the checks every dense-rows launcher shares (x, row flags or list, weights, θ)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must have shape [M, D], got {list(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be torch.bfloat16 or torch.float16, got {x.dtype}")
    if not x.is_cuda and not interpreting():
        raise ValueError(f"x must be a CUDA tensor (CPU tensors run only under TRITON_INTERPRET=1), got {x.device}")
    check_capability(x.device)
    m, d = x.shape
    if m >= 2**31:
        raise ValueError(f"x must have fewer than 2**31 rows, got {m}")
    if row_list is not None:
        if row_flags is not None:
            raise ValueError("row_flags must be None when row_list gives the rows")
        check_row_list(row_list, "row_list", m, x.device)
    else:
        if not isinstance(row_flags, torch.Tensor):
            raise TypeError(f"row_flags must be a torch.Tensor, got {type(row_flags).__name__}")
        if tuple(row_flags.shape) != (m,):
            raise ValueError(f"row_flags must have shape [M] = [{m}], got {list(row_flags.shape)}")
        if row_flags.dtype not in _FLAG_DTYPES:
            raise TypeError(f"row_flags must be bool or an integer dtype, got {row_flags.dtype}")
        if row_flags.device != x.device:
            raise ValueError(f"row_flags must be on x's device {x.device}, got {row_flags.device}")
    _check_weight(up_weight, "up_weight", None, x)
    h = up_weight.shape[0]
    if gate_weight is not None:
        _check_weight(gate_weight, "gate_weight", h, x)
    _check_weight(down_weight_t, "down_weight_t", h, x)
    if threshold is not None:
        if not isinstance(threshold, torch.Tensor):
            raise TypeError(f"threshold must be None or a torch.Tensor, got {type(threshold).__name__}")
        if threshold.dtype != torch.float32:
            raise TypeError(f"threshold must be torch.float32, got {threshold.dtype}")
        if tuple(threshold.shape) != (h,):
            raise ValueError(f"threshold must have shape [H] = [{h}], got {list(threshold.shape)}")
        if threshold.device != x.device:
            raise ValueError(f"threshold must be on x's device {x.device}, got {threshold.device}")
    return m, d, h


def _check_inputs(x, row_flags, gate_weight, up_weight, down_weight_t, threshold, out, row_l1, config, row_list):
    m, d, h = check_rows_and_weights(x, row_flags, gate_weight, up_weight, down_weight_t, threshold, row_list)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != (m, d):
        raise ValueError(f"out must have shape [M, D] = [{m}, {d}], got {list(out.shape)}")
    if out.dtype != x.dtype:
        raise TypeError(f"out must have x's dtype {x.dtype}, got {out.dtype}")
    if out.device != x.device:
        raise ValueError(f"out must be on x's device {x.device}, got {out.device}")
    if d > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have unit stride along D, got strides {list(out.stride())}")
    if out.numel() and x.numel() and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ValueError("out must not share memory with x (other programs still read x while out is written)")
    if row_l1 is not None:
        if not isinstance(row_l1, torch.Tensor):
            raise TypeError(f"row_l1 must be None or a torch.Tensor, got {type(row_l1).__name__}")
        if row_l1.dtype != torch.float32:
            raise TypeError(f"row_l1 must be torch.float32, got {row_l1.dtype}")
        if tuple(row_l1.shape) != (m,):
            raise ValueError(f"row_l1 must have shape [M] = [{m}], got {list(row_l1.shape)}")
        if row_l1.device != x.device:
            raise ValueError(f"row_l1 must be on x's device {x.device}, got {row_l1.device}")
    if config is not None and not isinstance(config, DenseRowsConfig):
        raise TypeError(f"config must be None or a DenseRowsConfig, got {type(config).__name__}")


def dense_rows_mlp(
    x: torch.Tensor,
    row_flags: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight_t: torch.Tensor,
    threshold: torch.Tensor | None,
    out: torch.Tensor,
    *,
    row_l1: torch.Tensor | None = None,
    config: DenseRowsConfig | None = None,
    row_list: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """out[m] = MLP(x[m]) for every row with row_flags[m] != 0, with no host synchronisation.

    x [M, D] bf16/fp16; row_flags [M] bool/int on x's device, or None with row_list = (ids int32 [M],
    count int32 [1]) naming the rows ids[0:count] in any order, each once (what `classify_rows`
    writes; the launch then skips its own scan of the flags); gate_weight [H, D] or None
    (non-gated: h = relu(x up^T - θ)); up_weight [H, D]; down_weight_t [H, D] (down_proj.weight^T;
    weights need unit stride along D, any row stride, e.g. two views of an interleaved [H, 2, D] tensor);
    threshold fp32 [H] or None; out [M, D] in x's dtype, written in the flagged rows only.
    row_l1: None, or fp32 [M] (any stride) that gets Σ_j |h_j| (fp32) in the flagged rows only.
    g, u, h and y are fp32, y is rounded once. `config` overrides `default_config(D)`. Returns out.
    """
    _check_inputs(x, row_flags, gate_weight, up_weight, down_weight_t, threshold, out, row_l1, config, row_list)
    return launch_dense_rows(x, row_flags, gate_weight, up_weight, down_weight_t, threshold, out, row_l1=row_l1,
                             config=config, row_list=row_list)


def launch_dense_rows(
    x: torch.Tensor,
    row_flags: torch.Tensor | None,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight_t: torch.Tensor,
    threshold: torch.Tensor | None,
    out: torch.Tensor,
    *,
    row_l1: torch.Tensor | None = None,
    config: DenseRowsConfig | None = None,
    row_list: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`dense_rows_mlp` on arguments that meet its contract, unchecked: for the sparse MLP ops, whose
    kernels before it checked x and the weights and which allocate out, row_l1 and the row list.
    On slow hosts the checks cost more host time than the launch (usually of no flagged row)."""
    m, d = x.shape
    h = up_weight.shape[0]
    cuda = x.is_cuda
    if config is None:
        config = default_config(d, cuda=cuda)
    if m == 0:
        return out
    if d == 0:
        if row_l1 is not None:  # no MLP tile runs; h = relu(0 - θ) * 0 (gated) or relu(-θ)
            if gate_weight is None and threshold is not None:
                l1 = torch.relu(-threshold).sum()
            else:
                l1 = torch.zeros((), dtype=torch.float32, device=x.device)
            row_l1.copy_(torch.where(_flagged(row_flags, row_list, m), l1, row_l1))
        return out
    if threshold is not None:
        threshold = threshold.contiguous()

    if row_list is not None:
        ids, count = row_list
    else:
        ids, count = compact_rows(row_flags)

    if d > 1 and x.stride(1) != 1:
        x = x.contiguous()  # the kernel reads rows of x with unit stride (a copy, no sync)
    gated = gate_weight is not None
    first = gate_weight if gated else up_weight
    aligned = d % 8 == 0 and all(_aligned_rows(t) for t in (x, first, up_weight, down_weight_t, out))
    result = out
    if cuda and not aligned:
        # The generic (unaligned) path computed wrong rows on the H200 (strided x / out cases of
        # tests/kernels/test_dense_rows_mlp.py) while the interpreter agreed with the reference;
        # until that is understood, CUDA runs only the aligned path: misaligned x / out go through
        # aligned copies (no sync), unaligned weights or D % 8 != 0 are refused.
        if not cuda_supported(d, first, up_weight, down_weight_t):
            raise NotImplementedError(
                "dense_rows_mlp on CUDA needs D % 8 == 0 and 16-byte aligned weight rows "
                f"(got D = {d}); the unaligned kernel path is disabled on GPUs"
            )
        x = x if _aligned_rows(x) else x.clone(memory_format=torch.contiguous_format)
        out = out if _aligned_rows(out) else out.clone(memory_format=torch.contiguous_format)
        aligned = True
    worst = cdiv(m, config.block_r) * cdiv(d, config.block_dy)  # tiles if all flagged
    if cuda:
        programs = num_sms(x.device)
    else:
        programs = _INTERPRETER_PROGRAMS
    grid = (min(worst, programs * config.programs_per_sm),)
    _dense_rows_mlp_launch[grid](
        x, ids, count, first, up_weight if gated else None, down_weight_t, threshold, out, row_l1,
        d, h,
        x.stride(0), first.stride(0), up_weight.stride(0), down_weight_t.stride(0), out.stride(0),
        row_l1.stride(0) if row_l1 is not None else 0,
        GATED=gated,
        HAS_THRESHOLD=threshold is not None,
        WRITE_L1=row_l1 is not None,
        ALIGNED=aligned,
        BLOCK_R=config.block_r,
        BLOCK_H=config.block_h,
        BLOCK_K=config.block_k,
        BLOCK_DY=config.block_dy,
        DOT_IN_FP32=interpreting(),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if out is not result:
        result.copy_(out)
    return result


def compact_rows(row_flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [M], count int32 [1]): the ascending ids of the rows with row_flags != 0 in
    ids[0:count], by one program's scan of the flags (no host synchronisation)."""
    m = row_flags.shape[0]
    if row_flags.dtype == torch.bool:
        row_flags = row_flags.view(torch.uint8)  # same bytes; Triton loads them as integers
    ids = torch.empty(m, dtype=torch.int32, device=row_flags.device)
    count = torch.empty(1, dtype=torch.int32, device=row_flags.device)
    _compact_rows_launch[(1,)](row_flags, ids, count, m, row_flags.stride(0),
                               BLOCK=_COMPACT_BLOCK, num_warps=_COMPACT_WARPS)
    return ids, count


def _flagged(row_flags: torch.Tensor | None, row_list: tuple[torch.Tensor, torch.Tensor] | None,
             m: int) -> torch.Tensor:
    """bool [M]: the rows the call computes (from the flags, or from the list)."""
    if row_list is None:
        return row_flags != 0
    ids, count = row_list
    # entries past count point at a spare last element (no host sync to cut the list)
    places = torch.where(torch.arange(m, device=ids.device) < count, ids.long(), m)
    return torch.zeros(m + 1, dtype=torch.bool, device=ids.device).index_fill_(0, places, True)[:m]


def _aligned_rows(t: torch.Tensor) -> bool:
    """16-byte aligned base and row stride: what the kernel's multiple_of / max_constancy hints claim."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def cuda_supported(d: int, *weights: torch.Tensor) -> bool:
    """Whether the kernel runs on CUDA for hidden size d with these [H, D] weight views."""
    return d % 8 == 0 and all(_aligned_rows(w) for w in weights)
