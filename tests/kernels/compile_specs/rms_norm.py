"""Compile specs of kernels/rms_norm.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

import torch

from sparseffn.kernels._runtime import next_power_of_2
from sparseffn.kernels.configs.rms_norm import default_config
from sparseffn.kernels.rms_norm import (MAX_D, NORM_DTYPES, TL_NORM_DTYPES, _rms_norm_backward_kernel,
                                        _rms_norm_forward_kernel)


def compile_specs(with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) for both kernels: every (x, weight) dtype
    pair of bf16/fp16/fp32 at D = 2048 (dy and y in their promoted dtype), fp32 x and weight with bf16
    y and dy (autocast outputs), and bf16 with bf16 or fp32 weights at D = 96 (masked, 16 rows a
    program), 4096, 16384 and MAX_D."""
    specs = []

    def add(d, x_dtype, w_dtype, y_dtype=None):
        config = default_config(d, cuda=True)
        x_ty, w_ty = TL_NORM_DTYPES[x_dtype], TL_NORM_DTYPES[w_dtype]
        y_ty = TL_NORM_DTYPES[y_dtype or torch.promote_types(w_dtype, x_dtype)]
        constexprs = {"BLOCK_M": config.block_m, "BLOCK_D": next_power_of_2(d)}
        forward = {
            "x_ptr": f"*{x_ty}", "weight_ptr": f"*{w_ty}", "y_ptr": f"*{y_ty}", "rstd_ptr": "*fp32",
            "M": "i32", "D": "i32", "stride_xm": "i32", "stride_ym": "i32", "eps": "fp32",
        }
        backward = {
            "dy_ptr": f"*{y_ty}", "x_ptr": f"*{x_ty}", "weight_ptr": f"*{w_ty}", "rstd_ptr": "*fp32",
            "dx_ptr": f"*{x_ty}", "dw_partial_ptr": "*fp32",
            "M": "i32", "D": "i32", "stride_dym": "i32", "stride_xm": "i32", "stride_dxm": "i32",
        }
        for kernel, signature in ((_rms_norm_forward_kernel, forward), (_rms_norm_backward_kernel, backward)):
            signature = {**signature, **{k: "constexpr" for k in constexprs}}
            spec = (kernel, signature, constexprs)
            specs.append(spec + ({"num_warps": config.num_warps},) if with_options else spec)

    for x_dtype in NORM_DTYPES:
        for w_dtype in NORM_DTYPES:
            add(2048, x_dtype, w_dtype)
    add(2048, torch.float32, torch.float32, torch.bfloat16)
    for d in (96, 4096, 16384, MAX_D):
        add(d, torch.bfloat16, torch.bfloat16)
        add(d, torch.bfloat16, torch.float32)
    return specs
