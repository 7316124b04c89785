"""Compile specs of kernels/decode_attn_proj.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

import dataclasses

import torch

from sparseffn.kernels._runtime import HOPPER, TL_DTYPES
from sparseffn.kernels.configs.decode_attention import projection_config
from sparseffn.kernels.decode_attn_proj import _decode_out_proj_kernel, _decode_qkv_rope_kernel
from sparseffn.kernels.decode_mlp import PADDED_TOKENS


def compile_specs(arch: tuple[int, int] = (9, 0), with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) of the variants the launchers use on a GPU of
    capability `arch`: bf16 / fp16, every padded token count with its default configs (q/k/v's and
    o_proj's), head dims 64 and 128, biases on and off, int64 and int32 positions, fp32 and 16-bit
    rotary tables, D in one step or several; at one token also the streamed loops (config.stream, q/k/v's
    in two steps and in one) and o_proj in one K step, and those two one-step forms in bf16 with a pending
    MLP output (PENDING, the engine's after a folded MLP); on Hopper the bf16 kernels at 1 and 16 tokens
    also with config.pdl, and the one-token streamed or one-step ones with pdl and config.prefetch."""
    specs = []

    def add(fn, signature, constexprs, config):
        constexprs.setdefault("PDL", False)
        constexprs.setdefault("PREFETCH", False)
        pending = constexprs.setdefault("PENDING", False)
        constexprs.pop("pending_ptr", None)  # a variant made from another's constexprs
        if not pending:
            constexprs["pending_ptr"] = None
        extra = {"pending_ptr": "*fp32" if pending else "constexpr", "stride_pm": "i32"}
        signature = {name: extra.get(name, signature.get(name, "constexpr")) for name in fn.arg_names}
        spec = (fn, signature, constexprs)
        specs.append(spec + (({"num_warps": config.num_warps, "num_stages": config.num_stages},)
                             if with_options else ()))
        if arch >= HOPPER and constexprs["M_PAD"] in (1, 16) and "bf16" in signature["w_ptr" if "w_ptr" in signature
                                                                                         else "wq_ptr"]:
            specs.append((fn, signature, dict(constexprs, PDL=True)) + specs[-1][3:])  # config.pdl
            early = constexprs["STREAM"] or (constexprs["ONE_STEP"] and fn is _decode_out_proj_kernel)
            if constexprs["M_PAD"] == 1 and early:  # config.prefetch
                specs.append((fn, signature, dict(constexprs, PDL=True, PREFETCH=True)) + specs[-1][3:])

    for dtype in (torch.bfloat16, torch.float16):
        ty = TL_DTYPES[dtype]
        for mp in PADDED_TOKENS:
            cfg, out_cfg = projection_config(mp, arch, qkv=True), projection_config(mp, arch, qkv=False)
            for head_dim, bias, pos_ty, table_ty in ((64, False, "i64", "fp32"), (128, True, "i32", ty)):
                sig = {"x_ptr": f"*{ty}", "norm_ptr": f"*{ty}", "wq_ptr": f"*{ty}", "wk_ptr": f"*{ty}",
                       "wv_ptr": f"*{ty}", "cos_ptr": f"*{table_ty}", "sin_ptr": f"*{table_ty}",
                       "pos_ptr": f"*{pos_ty}", "q_ptr": f"*{ty}", "k_cache_ptr": f"*{ty}", "v_cache_ptr": f"*{ty}",
                       "M": "i32", "D": "i32", "HQ": "i32", "HKV": "i32", "eps": "fp32"}
                for name in ("stride_xm", "stride_wq", "stride_wk", "stride_wv", "stride_cos", "stride_sin",
                             "stride_kb", "stride_kh", "stride_ks", "stride_vb", "stride_vh", "stride_vs"):
                    sig[name] = "i32"
                one_step = (mp <= 2) == (head_dim == 64)  # D = 2048 fits a step at 1-2 tokens; both forms compiled
                # (stream, block_k): the default; at one token streamed in two steps and in one (the whole row)
                for stream, block_k in ((False, cfg.block_k),) + (((True, 1024), (True, 2048)) if mp == 1 else ()):
                    qkv_cfg = dataclasses.replace(cfg, stream=stream, block_k=block_k)
                    cx = {"HEAD_DIM": head_dim, "HAS_BIAS": bias, "M_PAD": mp, "BLOCK_N": qkv_cfg.block_n,
                          "BLOCK_K": block_k, "ONE_STEP": block_k >= 2048 if stream else one_step, "STREAM": stream,
                          "DOT_IN_FP32": False}
                    for name in ("bq_ptr", "bk_ptr", "bv_ptr"):
                        if bias:
                            sig[name] = f"*{ty}"
                        else:
                            cx[name] = None
                    sig = {name: sig.get(name, "constexpr") for name in _decode_qkv_rope_kernel.arg_names}
                    add(_decode_qkv_rope_kernel, sig, cx, qkv_cfg)
                    if stream and block_k == 2048 and ty == "bf16":  # the engine's, after a folded MLP
                        add(_decode_qkv_rope_kernel, sig, dict(cx, PENDING=True), qkv_cfg)
            for bias in (False, True):
                sig = {"a_ptr": f"*{ty}", "w_ptr": f"*{ty}", "b_ptr": f"*{ty}" if bias else "constexpr",
                       "r_ptr": f"*{ty}", "y_ptr": f"*{ty}", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32",
                       "stride_w": "i32", "stride_rm": "i32", "stride_ym": "i32"}
                # (stream, block_k): the default, streamed at one token, and one K step at one token
                for stream, block_k in ((False, out_cfg.block_k),) + (((True, out_cfg.block_k), (False, 2048))
                                                                       if mp == 1 else ()):
                    o_cfg = dataclasses.replace(out_cfg, stream=stream, block_k=block_k)
                    cx = {"HAS_BIAS": bias, "M_PAD": mp, "BLOCK_N": o_cfg.block_n, "BLOCK_K": o_cfg.block_k,
                          "STREAM": stream, "ONE_STEP": block_k >= 2048, "DOT_IN_FP32": False}
                    if not bias:
                        cx["b_ptr"] = None
                    add(_decode_out_proj_kernel, dict(sig), cx, o_cfg)
                    if mp == 1 and not stream and block_k == 2048 and ty == "bf16":  # the engine's, after a fold
                        add(_decode_out_proj_kernel, dict(sig), dict(cx, PENDING=True), o_cfg)
    return specs
