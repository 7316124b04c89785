"""Compile specs of kernels/decode_norm.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

from sparseffn.kernels._runtime import next_power_of_2
from sparseffn.kernels.decode_norm import _decode_norm_kernel, num_warps


def compile_specs(with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) for bf16 and fp16 rows, with and without the pending
    fp32 sum, at the 2b model's width (2048), 4096 and 8192."""
    specs = []
    for dtype in ("bf16", "fp16"):
        for d in (2048, 4096, 8192):
            for pending in (False, True):
                signature = {"x_ptr": f"*{dtype}", "pending_ptr": "*fp32" if pending else f"*{dtype}",
                             "norm_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "D": "i32", "stride_xm": "i32",
                             "stride_pm": "i32", "stride_om": "i32", "eps": "fp32"}
                constexprs = {"BLOCK_D": next_power_of_2(d), "PENDING": pending}
                signature.update({name: "constexpr" for name in constexprs})
                spec = (_decode_norm_kernel, signature, constexprs)
                specs.append(spec + ({"num_warps": num_warps(d)},) if with_options else spec)
    return specs
