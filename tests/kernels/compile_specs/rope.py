"""Compile specs of kernels/rope.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

import torch

from sparseffn.kernels._runtime import next_power_of_2
from sparseffn.kernels.configs.rope import default_config
from sparseffn.kernels.rope import ROPE_DTYPES, TL_ROPE_DTYPES, _rope_kernel


def compile_specs(with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) for forward and backward at bf16, fp16 and
    fp32 q / k with cos / sin of the same dtype, bf16 q / k with fp32 cos / sin (autocast: fp32
    outputs, or bf16 ones when asked for; the backward takes their gradients to bf16), at Llama 2B
    heads (Hq 32, Hk 32 or 8, d 64),
    8 heads of 128 and an odd head dim (d 96, masked halves)."""
    specs = []
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32

    def add(hq, hk, d, x_dtype, cs_dtype, backward, out_dtype=None):
        config = default_config(hq, hk, d, cuda=True)
        out_dtype = out_dtype or torch.promote_types(x_dtype, cs_dtype)
        in_ty, out_ty = TL_ROPE_DTYPES[out_dtype if backward else x_dtype], TL_ROPE_DTYPES[x_dtype if backward else out_dtype]
        cs_ty = TL_ROPE_DTYPES[cs_dtype]
        signature = {
            "q_ptr": f"*{in_ty}", "k_ptr": f"*{in_ty}", "cos_ptr": f"*{cs_ty}", "sin_ptr": f"*{cs_ty}",
            "q_out_ptr": f"*{out_ty}", "k_out_ptr": f"*{out_ty}",
            "B": "i32", "S": "i32", "Hq": "i32", "Hk": "i32",
            **{name: "i32" for name in (
                "stride_qb", "stride_qh", "stride_qs", "stride_kb", "stride_kh", "stride_ks",
                "stride_qob", "stride_qoh", "stride_qos", "stride_kob", "stride_koh", "stride_kos",
                "stride_cb", "stride_cs", "stride_sb", "stride_ss")},
        }
        constexprs = {
            "HALF": d // 2,
            "BACKWARD": backward,
            "BLOCK_S": config.block_s,
            "BLOCK_HQ": config.block_hq,
            "BLOCK_HK": config.block_hk,
            "BLOCK_HALF": next_power_of_2(d // 2),
        }
        signature.update({name: "constexpr" for name in constexprs})
        spec = (_rope_kernel, signature, constexprs)
        specs.append(spec + ({"num_warps": config.num_warps},) if with_options else spec)

    for backward in (False, True):
        for dtype in ROPE_DTYPES:
            add(32, 32, 64, dtype, dtype, backward)
        add(32, 32, 64, bf16, fp32, backward)
        add(32, 32, 64, bf16, fp32, backward, bf16)
        add(32, 8, 64, bf16, bf16, backward)
        add(8, 8, 128, bf16, bf16, backward)
        add(12, 4, 96, fp16, fp16, backward)
    return specs
