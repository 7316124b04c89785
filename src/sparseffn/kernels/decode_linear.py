"""Up to three bias-free linear layers of the same input, for one or two tokens, in one launch:
y = [x w0^T | x w1^T | x w2^T] (an attention's q, k and v projections at decode).

    grid (cdiv(N0, BLOCK_N) + cdiv(N1, BLOCK_N) + cdiv(N2, BLOCK_N),): program p owns BLOCK_N output
    units of one of the matrices (the first blocks w0's, then w1's, then w2's) and writes
    y[:, off + units], off = 0, N0 or N0 + N1; products in fp32 over all of D, rounded once to y's dtype.

Why. At one token a projection is a read of its matrix, bound by memory latency more than by
bandwidth: three cuBLAS GEMVs take nearly twice the time of one launch that reads all three matrices
(docs/benchmarks.md, "Whole-model decode").

Layouts. x [M, D] (M = 1 or 2), unit stride along D; w_i [N_i, D], unit stride along D, any row
stride; y [M, N0 + N1 + N2] contiguous, x's dtype (bf16 / fp16). The products are the decode MLP's
CUDA-core ones (`decode_mlp._rows_dot`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import cdiv, check_few_tokens, interpreting, next_power_of_2
from sparseffn.kernels.decode_mlp import _rows_dot
from sparseffn.kernels.launch import Launcher

MAX_TOKENS = 2
BLOCK_N = 2  # units per program: many small programs keep enough rows in flight at one or two tokens
MAX_BLOCK_K = 2048
NUM_WARPS = 4

__all__ = ["MAX_TOKENS", "decode_linear", "launch_decode_linear"]


@triton.jit(do_not_specialize=["M"])
def _decode_linear_kernel(
    x_ptr,  # [M, D]
    w0_ptr,  # [N0, D]
    w1_ptr,  # [N1, D]
    w2_ptr,  # [N2, D]
    y_ptr,  # [M, N0 + N1 + N2] out
    M,
    D,
    N0,
    N1,
    N2,
    stride_xm,
    stride_w0,
    stride_w1,
    stride_w2,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    blocks0 = tl.cdiv(N0, BLOCK_N)
    blocks01 = blocks0 + tl.cdiv(N1, BLOCK_N)
    w_ptr = w0_ptr
    stride_w = stride_w0
    n = N0
    off = 0
    block = pid
    if pid >= blocks01:
        w_ptr = w2_ptr
        stride_w = stride_w2
        n = N2
        off = N0 + N1
        block = pid - blocks01
    elif pid >= blocks0:
        w_ptr = w1_ptr
        stride_w = stride_w1
        n = N1
        off = N0
        block = pid - blocks0
    units = block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    unit_in = units < n
    rows = tl.arange(0, M_PAD)
    row_in = rows < M
    acc = _rows_dot(x_ptr, w_ptr, units, unit_in, rows, row_in, M, D, stride_xm, stride_w,
                    M_PAD, BLOCK_N, BLOCK_K, False)  # [M_PAD, BLOCK_N] fp32
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * (N0 + N1 + N2) + off + units[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_in[:, None] & unit_in[None, :])


_launch = Launcher(_decode_linear_kernel)


def _block_k(d: int) -> int:
    return max(16, min(MAX_BLOCK_K, next_power_of_2(d)))


def decode_linear(x: torch.Tensor, weights: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[x w^T for w in weights] concatenated along the last dim, y [M, ΣN_i], for x [M, D] with
    1 <= M <= MAX_TOKENS and 1 to 3 weights [N_i, D] in x's dtype (bf16 / fp16) and device, unit
    stride along D. Split y with `torch.split(y, [N_i, ...], dim=1)`."""
    m, d = check_few_tokens(x, MAX_TOKENS)
    if d > 1 and x.stride(1) != 1:
        raise ValueError(f"x must have unit stride along D, got strides {x.stride()}")
    if not isinstance(weights, (list, tuple)) or not 1 <= len(weights) <= 3:
        raise ValueError(f"weights must be a list of 1 to 3 tensors, got {type(weights).__name__}"
                         f"{'' if not isinstance(weights, (list, tuple)) else f' of {len(weights)}'}")
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != d:
            raise ValueError(f"weights[{i}] must be a tensor [N, D={d}], got {getattr(w, 'shape', type(w).__name__)}")
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"weights[{i}] must be {x.dtype} on {x.device} like x, got {w.dtype} on {w.device}")
        if d > 1 and w.stride(1) != 1:
            raise ValueError(f"weights[{i}] must have unit stride along D, got strides {w.stride()}")
    if not x.is_cuda and not interpreting():
        raise ValueError(f"x must be a CUDA tensor (CPU tensors run only under TRITON_INTERPRET=1), got {x.device}")
    return launch_decode_linear(x, weights)


def launch_decode_linear(x: torch.Tensor, weights) -> torch.Tensor:
    """`decode_linear` on arguments that meet its contract, unchecked."""
    m, d = x.shape
    ns = [w.shape[0] for w in weights]
    y = torch.empty((m, sum(ns)), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    if d == 0:
        return y.zero_()
    ws = list(weights) + [weights[0]] * (3 - len(weights))  # unused slots: N = 0, never read
    ns += [0] * (3 - len(ns))
    grid = (sum(cdiv(n, BLOCK_N) for n in ns),)
    _launch[grid](x, ws[0], ws[1], ws[2], y, m, d, ns[0], ns[1], ns[2], x.stride(0),
                  ws[0].stride(0), ws[1].stride(0), ws[2].stride(0),
                  M_PAD=m, BLOCK_N=BLOCK_N, BLOCK_K=_block_k(d), num_warps=NUM_WARPS, num_stages=1)
    return y
