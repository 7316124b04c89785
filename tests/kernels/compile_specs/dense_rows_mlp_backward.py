"""Compile specs of kernels/dense_rows_mlp_backward.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

from sparseffn.kernels._runtime import TL_DTYPES
from sparseffn.kernels.configs.dense_rows_mlp_backward import default_backward_config
from sparseffn.kernels.dense_rows_mlp_backward import (_dense_rows_mlp_backward_dw_kernel,
                                                       _dense_rows_mlp_backward_dx_kernel)


def compile_specs(with_options: bool = False):
    """(jit_function, signature, constexprs) for what the launcher runs on a Hopper GPU, aligned
    (the only CUDA path): both kernels for bf16/fp16 x gated/non-gated x threshold on/off with
    l1_grad (what the training op passes) at the default config of D = 2048 (dx slices of 256),
    plus without l1_grad (threshold on), and at D = 64 (dx slices of 64; threshold and l1_grad on).
    The compaction scan is compiled by kernels/dense_rows_mlp.py's list.

    with_options=True appends each variant's compile options (num_warps, num_stages) as a 4th
    element; gpu_compile.py compiles with Triton's defaults (4 warps, 3 stages) instead.
    """
    specs = []

    def add(fn, signature, constexprs, options):
        for name in constexprs:
            signature.setdefault(name, "constexpr")
        spec = (fn, signature, constexprs)
        specs.append(spec + (options,) if with_options else spec)

    variants = [(2048, thr, True) for thr in (False, True)] + [(2048, True, False), (64, True, True)]
    for d, has_threshold, has_l1 in variants:
        cfg = default_backward_config(d, cuda=True)
        for dtype, ty in TL_DTYPES.items():
            for gated in (True, False):
                inputs = {
                    "x_ptr": f"*{ty}", "dy_ptr": f"*{ty}", "ids_ptr": "*i32", "count_ptr": "*i32",
                    "first_ptr": f"*{ty}", "up_ptr": f"*{ty}" if gated else "constexpr",
                    "down_ptr": f"*{ty}", "threshold_ptr": "*fp32" if has_threshold else "constexpr",
                    "l1_grad_ptr": "*fp32" if has_l1 else "constexpr",
                }
                flags = {"GATED": gated, "HAS_THRESHOLD": has_threshold, "HAS_L1": has_l1, "ALIGNED": True,
                         "DOT_IN_FP32": False}
                nones = {name: None for name, on in (("up_ptr", gated), ("threshold_ptr", has_threshold),
                                                     ("l1_grad_ptr", has_l1)) if not on}
                dx_sig = dict(inputs, dx_ptr=f"*{ty}", D="i32", H="i32", stride_xm="i32", stride_ym="i32",
                              stride_fh="i32", stride_uh="i32", stride_dh="i32", stride_om="i32")
                add(_dense_rows_mlp_backward_dx_kernel, dx_sig,
                    dict(flags, **nones, BLOCK_R=cfg.block_r, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k,
                         BLOCK_DX=cfg.block_dx),
                    {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
                dw_sig = dict(inputs, grad_first_ptr="*fp32",
                              grad_up_ptr="*fp32" if gated else "constexpr", grad_down_ptr="*fp32",
                              D="i32", H="i32", slices_per_tile="i32", stride_xm="i32", stride_ym="i32",
                              stride_fh="i32", stride_uh="i32", stride_dh="i32", stride_gf="i32",
                              stride_gu="i32", stride_gd="i32")
                dw_nones = dict(nones, **({} if gated else {"grad_up_ptr": None}))
                add(_dense_rows_mlp_backward_dw_kernel, dw_sig,
                    dict(flags, **dw_nones, BLOCK_R=cfg.block_r_w, BLOCK_H=cfg.block_h_w,
                         BLOCK_K=cfg.block_k_w, BLOCK_DW=cfg.block_dw),
                    {"num_warps": cfg.num_warps_w, "num_stages": cfg.num_stages_w})
    return specs
