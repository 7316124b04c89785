"""A matrix copied into a new contiguous tensor of another (or the same) dtype, optionally transposed.

    convert(src, dtype)                 -> dst [R, C] = rnd(src)       (bf16 / fp16, contiguous)
    convert(src, dtype, transpose=True) -> dst [C, R] = rnd(src)^T

src is fp32, bf16 or fp16; rnd is round-to-nearest-even, as torch's `.to()` (exact when the dtypes
match); on the GPU the results are bitwise torch's. Uses: the training backward rounds its fp32
weight-gradient accumulators (the down projection's transposed) and both training passes take
down_proj.weight^T. Why a kernel: torch's transposing copy (`.t().contiguous()`) runs a
non-vectorised elementwise kernel, several times slower than a tiled copy (docs/kernel-notes.md). Each program moves a [BLOCK_R, BLOCK_C] tile: loads along C, stores along C
(transposed: along R; Triton stages the tile through shared memory so both sides stay coalesced).

Layouts: src [R, C], unit stride along C, any row stride; dst contiguous. Any R, C >= 0.
Interpreter (TRITON_INTERPRET=1, CPU tensors): its fp32 -> bf16 / fp16 cast truncates (one ulp off
torch's rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import DTYPES, cdiv
from sparseffn.kernels.launch import Launcher

__all__ = ["convert"]

_BLOCK = 64  # BLOCK_R = BLOCK_C: a 16 KB fp32 (8 KB bf16) tile per program
_WARPS = 4


@triton.jit
def _convert_kernel(
    src_ptr, dst_ptr, R, C, stride_src,
    TRANSPOSE: tl.constexpr,      # dst [C, R] = src^T; False: dst [R, C]
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    mask = (rows[:, None] < R) & (cols[None, :] < C)  # [BLOCK_R, BLOCK_C]
    r64 = rows.to(tl.int64)[:, None]
    c64 = cols.to(tl.int64)[None, :]
    v = tl.load(src_ptr + r64 * stride_src + c64, mask=mask).to(dst_ptr.dtype.element_ty)
    if TRANSPOSE:
        tl.store(dst_ptr + c64 * R + r64, v, mask=mask)
    else:
        tl.store(dst_ptr + r64 * C + c64, v, mask=mask)


_convert_launch = Launcher(_convert_kernel)


def convert(src: torch.Tensor, dtype: torch.dtype, *, transpose: bool = False) -> torch.Tensor:
    """A new contiguous tensor of `dtype` (bf16 / fp16): src [R, C] (fp32, bf16 or fp16) rounded to
    nearest even, [R, C] or, with transpose=True, [C, R]."""
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"src must be a torch.Tensor, got {type(src).__name__}")
    if src.dim() != 2 or src.dtype not in (torch.float32, *DTYPES):
        raise TypeError(f"src must be an fp32, bf16 or fp16 [R, C] tensor, got {src.dtype} {list(src.shape)}")
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be bf16 or fp16, got {dtype}")
    if not isinstance(transpose, bool):
        raise TypeError(f"transpose must be a bool, got {transpose!r}")
    r, c = src.shape
    if c > 1 and src.stride(1) != 1:
        src = src.contiguous()
    dst = torch.empty((c, r) if transpose else (r, c), dtype=dtype, device=src.device)
    if r and c:
        _convert_launch[(cdiv(r, _BLOCK), cdiv(c, _BLOCK))](
            src, dst, r, c, src.stride(0), TRANSPOSE=transpose, BLOCK_R=_BLOCK, BLOCK_C=_BLOCK,
            num_warps=_WARPS)
    return dst
