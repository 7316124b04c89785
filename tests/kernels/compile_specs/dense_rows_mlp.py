"""Compile specs of kernels/dense_rows_mlp.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

from sparseffn.kernels._runtime import TL_DTYPES
from sparseffn.kernels.configs.dense_rows_mlp import default_config
from sparseffn.kernels.dense_rows_mlp import (_COMPACT_BLOCK, _COMPACT_WARPS, _compact_rows_kernel,
                                              _dense_rows_mlp_kernel)


def compile_specs(with_options: bool = False):
    """(jit_function, signature, constexprs) for what the launcher runs on a Hopper GPU: the
    compaction scan, and the MLP kernel for bf16/fp16 x gated/non-gated x threshold on/off at the
    default configs of D = 2048 (aligned: 16-byte vectors; BLOCK_DY 512, 8 warps), D = 72
    (aligned, BLOCK_DY 128, 4 warps) and D = 100 (unaligned, generic loads; BLOCK_DY 128, 8 warps),
    without row_l1, plus the row_l1 variants (the training forward) at D = 2048.

    with_options=True appends each variant's compile options (num_warps, num_stages) as a 4th
    element; gpu_compile.py compiles with Triton's defaults (4 warps, 3 stages) instead.
    """
    specs = []

    def add(fn, signature, constexprs, options):
        for name in constexprs:
            signature.setdefault(name, "constexpr")
        spec = (fn, signature, constexprs)
        specs.append(spec + (options,) if with_options else spec)

    for flag_ty in ("u8", "i32"):
        add(_compact_rows_kernel,
            {"flags_ptr": f"*{flag_ty}", "ids_ptr": "*i32", "count_ptr": "*i32", "M": "i32", "stride_f": "i32"},
            {"BLOCK": _COMPACT_BLOCK}, {"num_warps": _COMPACT_WARPS})

    # (D, ALIGNED): the paper's D and a small one with 16-byte vectors, an odd D on the generic path
    variants = [(d, aligned, False) for d, aligned in ((2048, True), (72, True), (100, False))]
    variants.append((2048, True, True))
    for d, aligned, write_l1 in variants:
        cfg = default_config(d, cuda=True)
        for dtype, ty in TL_DTYPES.items():
            for gated in (True, False):
                for has_threshold in (False, True):
                    signature = {
                        "x_ptr": f"*{ty}", "ids_ptr": "*i32", "count_ptr": "*i32", "first_ptr": f"*{ty}",
                        "up_ptr": f"*{ty}" if gated else "constexpr", "down_ptr": f"*{ty}",
                        "threshold_ptr": "*fp32" if has_threshold else "constexpr", "out_ptr": f"*{ty}",
                        "row_l1_ptr": "*fp32" if write_l1 else "constexpr",
                        "D": "i32", "H": "i32", "stride_xm": "i32", "stride_fh": "i32", "stride_uh": "i32",
                        "stride_dh": "i32", "stride_om": "i32", "stride_l1": "i32",
                    }
                    constexprs = {
                        "GATED": gated, "HAS_THRESHOLD": has_threshold, "WRITE_L1": write_l1, "ALIGNED": aligned,
                        "BLOCK_R": cfg.block_r, "BLOCK_H": cfg.block_h, "BLOCK_K": cfg.block_k,
                        "BLOCK_DY": cfg.block_dy, "DOT_IN_FP32": False,
                    }
                    if not gated:
                        constexprs["up_ptr"] = None
                    if not has_threshold:
                        constexprs["threshold_ptr"] = None
                    if not write_l1:
                        constexprs["row_l1_ptr"] = None
                    add(_dense_rows_mlp_kernel, signature, constexprs,
                        {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    return specs
