"""Compile specs of kernels/convert.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

import itertools

from sparseffn.kernels._runtime import TL_DTYPES
from sparseffn.kernels.convert import _BLOCK, _WARPS, _convert_kernel


def compile_specs(with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) for fp32 sources to both output dtypes and
    each dtype to itself, plain and transposed."""
    specs = []
    pairs = [("fp32", ty) for ty in TL_DTYPES.values()] + [(ty, ty) for ty in TL_DTYPES.values()]
    for (src, dst), transpose in itertools.product(pairs, (False, True)):
        constexprs = {"TRANSPOSE": transpose, "BLOCK_R": _BLOCK, "BLOCK_C": _BLOCK}
        signature = {"src_ptr": f"*{src}", "dst_ptr": f"*{dst}", "R": "i32", "C": "i32", "stride_src": "i32",
                     **{k: "constexpr" for k in constexprs}}
        spec = (_convert_kernel, signature, constexprs)
        specs.append(spec + ({"num_warps": _WARPS},) if with_options else spec)
    return specs
