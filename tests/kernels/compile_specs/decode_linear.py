"""Compile specs of kernels/decode_linear.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

import torch

from sparseffn.kernels._runtime import TL_DTYPES
from sparseffn.kernels.decode_linear import BLOCK_N, NUM_WARPS, _block_k, _decode_linear_kernel


def compile_specs(with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) of the variants `decode_linear` launches:
    bf16 / fp16, one or two tokens, D = 2048 (the block over D is a constexpr of D)."""
    specs = []
    for dtype in (torch.bfloat16, torch.float16):
        ty = TL_DTYPES[dtype]
        for m in (1, 2):
            sig = {"x_ptr": f"*{ty}", "w0_ptr": f"*{ty}", "w1_ptr": f"*{ty}", "w2_ptr": f"*{ty}", "y_ptr": f"*{ty}",
                   "M": "i32", "D": "i32", "N0": "i32", "N1": "i32", "N2": "i32", "stride_xm": "i32",
                   "stride_w0": "i32", "stride_w1": "i32", "stride_w2": "i32",
                   "M_PAD": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
            cx = {"M_PAD": m, "BLOCK_N": BLOCK_N, "BLOCK_K": _block_k(2048)}
            spec = (_decode_linear_kernel, sig, cx)
            specs.append(spec + (({"num_warps": NUM_WARPS, "num_stages": 1},) if with_options else ()))
    return specs
