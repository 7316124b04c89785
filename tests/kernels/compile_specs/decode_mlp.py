"""Compile specs of kernels/decode_mlp.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

import torch

from sparseffn.kernels._runtime import TL_DTYPES
from sparseffn.kernels.configs.decode_mlp import default_config, down_rows
from sparseffn.kernels.decode_mlp import PADDED_TOKENS, _decode_down_kernel, _decode_gate_up_kernel, down_block


def compile_specs(arch: tuple[int, int] = (9, 0), with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) of the variants decode_mlp launches on a GPU
    of capability `arch`: bf16/fp16, gated or not, threshold on/off, every padded M with its default
    config."""
    specs = []

    def add(fn, signature, constexprs, warps, stages):
        for name in constexprs:
            signature.setdefault(name, "constexpr")
        spec = (fn, signature, constexprs)
        specs.append(spec + (({"num_warps": warps, "num_stages": stages},) if with_options else ()))

    for dtype in (torch.bfloat16, torch.float16):
        ty = TL_DTYPES[dtype]
        for mp in PADDED_TOKENS:
            cfg = default_config(mp, arch)
            for gated, has_threshold in ((True, False), (True, True), (False, True)):
                if mp not in (1, 64) and not (gated and not has_threshold):
                    continue
                sig = {"x_ptr": f"*{ty}", "first_ptr": f"*{ty}", "up_ptr": f"*{ty}",
                       "threshold_ptr": "*fp32" if has_threshold else "constexpr", "h_ptr": f"*{ty}",
                       "flags_ptr": "*i32", "count_ptr": "*i32", "M": "i32", "D": "i32", "H": "i32",
                       "n_counts": "i32", "stride_xm": "i32", "stride_fh": "i32", "stride_uh": "i32"}
                cx = {"GATED": gated, "HAS_THRESHOLD": has_threshold, "M_PAD": mp, "BLOCK_H": cfg.block_h,
                      "BLOCK_K": cfg.block_k, "DOT_IN_FP32": False}
                if not has_threshold:
                    cx["threshold_ptr"] = None
                add(_decode_gate_up_kernel, sig, cx, cfg.gate_warps, cfg.gate_stages)
            sig = {"h_ptr": f"*{ty}", "flags_ptr": "*i32", "list_ptr": "*i32", "down_t_ptr": f"*{ty}",
                   "y_ptr": f"*{ty}", "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "D": "i32", "H": "i32",
                   "stride_dh": "i32", "stride_ym": "i32"}
            cx = {"M_PAD": mp, "ROWS": down_rows(mp), "SPLIT": cfg.split, "BLOCK_S": cfg.block_s,
                  "BLOCK_D": down_block(cfg, 2048, 132), "PREFIX": cfg.prefix, "DOT_IN_FP32": False}
            add(_decode_down_kernel, sig, cx, cfg.down_warps, cfg.down_stages)
    return specs
