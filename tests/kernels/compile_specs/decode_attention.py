"""Compile specs of kernels/decode_attention.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

import torch

from sparseffn.kernels._runtime import HOPPER, TL_DTYPES
from sparseffn.kernels.configs.decode_attention import AttentionConfig, attention_config
from sparseffn.kernels.decode_attention import _decode_attention_kernel, group_rows


def compile_specs(arch: tuple[int, int] = (9, 0), with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) of the variants `launch_decode_attention`
    uses with its default config: bf16 / fp16, head dims 64 and 128, no GQA (one query row) and
    GQA groups of 4 and 32 (tl.dot rows), valid_from absent or given (int64, int32 positions),
    1, 2 and 16 splits (the combine's width); one split with the config of a pair per SM or more; on
    Hopper (`arch`) the bf16 ones also with config.pdl, and with pdl and config.prefetch (the engine's
    one-token config's warps)."""
    specs = []
    for dtype in (torch.bfloat16, torch.float16):
        ty = TL_DTYPES[dtype]
        for head_dim, group, pos_ty, with_from, splits_pad in ((64, 1, "i64", False, 16), (64, 4, "i64", True, 2),
                                                               (128, 1, "i32", True, 1), (128, 32, "i32", False, 16)):
            cfg = attention_config(132, 132) if splits_pad == 1 else AttentionConfig()
            sig = {"q_ptr": f"*{ty}", "k_ptr": f"*{ty}", "v_ptr": f"*{ty}", "pos_ptr": f"*{pos_ty}",
                   "from_ptr": f"*{pos_ty}" if with_from else "constexpr", "o_ptr": f"*{ty}", "part_ptr": "*fp32",
                   "stat_ptr": "*fp32", "count_ptr": "*i32", "HQ": "i32", "HKV": "i32", "SPLITS": "i32",
                   "scale_log2": "fp32"}
            for name in ("stride_qb", "stride_qh", "stride_kb", "stride_kh", "stride_ks", "stride_vb", "stride_vh",
                         "stride_vs"):
                sig[name] = "i32"
            cx = {"HEAD_DIM": head_dim, "GROUP": group, "G_PAD": group_rows(group, cfg.mma), "SPLITS_PAD": splits_pad,
                  "BLOCK_S": cfg.block_s,
                  "BLOCK_D": head_dim, "PDL": False, "PREFETCH": False, "DOT_IN_FP32": False}
            if not with_from:
                cx["from_ptr"] = None
            sig = {name: sig.get(name, "constexpr") for name in _decode_attention_kernel.arg_names}
            options = ({"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},) if with_options else ()
            specs.append((_decode_attention_kernel, sig, cx) + options)
            if arch >= HOPPER and dtype == torch.bfloat16:
                specs.append((_decode_attention_kernel, sig, dict(cx, PDL=True)) + options)
                engine = attention_config(32, 132, prefetch=True)  # the engine's at one token: fewer warps
                engine_options = (({"num_warps": engine.num_warps, "num_stages": engine.num_stages},) if with_options
                                  else ())
                specs.append((_decode_attention_kernel, sig, dict(cx, PDL=True, PREFETCH=True)) + engine_options)
    return specs
