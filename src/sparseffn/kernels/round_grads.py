"""Rounding of an fp32 [R, C] weight-gradient accumulator to the weight's dtype, optionally transposed.

    round_rows(src)                 -> dst [R, C] = rnd(src)            (bf16 / fp16, contiguous)
    round_rows(src, transpose=True) -> dst [C, R] = rnd(src)^T

rnd is round-to-nearest-even, as torch's `.to()`; on the GPU the results are bitwise torch's. Why a
kernel: torch's dtype-converting copy runs a non-vectorised elementwise kernel; on the H200 it took
76 µs for an fp32 [5632, 2048] accumulator (69 MB moved: ~0.9 TB/s) and 88 µs for the transposed copy
(benchmarks/profile_train.py, M = 16384), three of them per training step. Here each program moves a
[BLOCK_R, BLOCK_C] tile: fp32 loads along C, stores along C (or, transposed, along R: Triton stages
the tile through shared memory so both sides stay coalesced).

Layouts: src [R, C] fp32, unit stride along C, any row stride; dst contiguous. Any R, C >= 0.
Interpreter (TRITON_INTERPRET=1, CPU tensors): its fp32 -> bf16 cast truncates (one ulp off torch).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import DTYPES, TL_DTYPES, cdiv

__all__ = ["round_rows", "sm90_compile_specs"]

_BLOCK = 64  # BLOCK_R = BLOCK_C: a 16 KB fp32 tile per program
_WARPS = 4


@triton.jit
def _round_rows_kernel(
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


def round_rows(src: torch.Tensor, dtype: torch.dtype, *, transpose: bool = False) -> torch.Tensor:
    """A new contiguous tensor of `dtype` (bf16 / fp16): src [R, C] fp32 rounded to nearest even,
    [R, C] or, with transpose=True, [C, R]."""
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"src must be a torch.Tensor, got {type(src).__name__}")
    if src.dim() != 2 or src.dtype != torch.float32:
        raise TypeError(f"src must be an fp32 [R, C] tensor, got {src.dtype} {list(src.shape)}")
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be bf16 or fp16, got {dtype}")
    if not isinstance(transpose, bool):
        raise TypeError(f"transpose must be a bool, got {transpose!r}")
    r, c = src.shape
    if c > 1 and src.stride(1) != 1:
        src = src.contiguous()
    dst = torch.empty((c, r) if transpose else (r, c), dtype=dtype, device=src.device)
    if r and c:
        _round_rows_kernel[(cdiv(r, _BLOCK), cdiv(c, _BLOCK))](
            src, dst, r, c, src.stride(0), TRANSPOSE=transpose, BLOCK_R=_BLOCK, BLOCK_C=_BLOCK,
            num_warps=_WARPS)
    return dst


def sm90_compile_specs(with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) for both output dtypes, plain and transposed."""
    specs = []
    for ty, transpose in itertools.product(TL_DTYPES.values(), (False, True)):
        constexprs = {"TRANSPOSE": transpose, "BLOCK_R": _BLOCK, "BLOCK_C": _BLOCK}
        signature = {"src_ptr": "*fp32", "dst_ptr": f"*{ty}", "R": "i32", "C": "i32", "stride_src": "i32",
                     **{k: "constexpr" for k in constexprs}}
        spec = (_round_rows_kernel, signature, constexprs)
        specs.append(spec + ({"num_warps": _WARPS},) if with_options else spec)
    return specs
