"""Compile specs of kernels/decode_mlp.py and kernels/decode_dense_mlp.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

import dataclasses

import torch

from sparseffn.kernels._runtime import HOPPER, TL_DTYPES
from sparseffn.kernels.configs.decode_mlp import default_config, down_rows, fit_shared_memory
from sparseffn.kernels.decode_dense_mlp import _dense_down_kernel
from sparseffn.kernels.decode_mlp import ACTS, PADDED_TOKENS, _decode_down_kernel, _decode_gate_up_kernel, down_block

ENGINE_TOKENS = (1, 16)  # padded token counts of the decode engine's fused variants checked here
D = 2048  # the model width the specs are built for (the 2b model's)


def compile_specs(arch: tuple[int, int] = (9, 0), with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) of the variants the launchers use on a GPU of
    capability `arch`: bf16/fp16, gated or not, threshold on/off, every padded M with its default
    config; and the decode engine's (norm fused into K1, residual into the down kernels, dense
    relu / silu K1 and the down kernels over every unit, with the dense config) at 1 and 16 tokens; at
    one token config.stream (the streamed K1, the engine's also in one step of the whole row, and the
    streamed row products of the dense down pass in Hugging Face's layout), and from
    16 padded tokens config.compact_up, the public op's and the engine's; the engine's folded K1 at one
    token (fold_into, gated and not); on Hopper the engine's bf16 kernels also with config.pdl, and its
    streamed K1 with pdl and config.prefetch."""
    specs = []

    def add(fn, signature, constexprs, warps, stages):
        if "PDL" in fn.arg_names:
            constexprs.setdefault("PDL", False)
        if "PREFETCH" in fn.arg_names:
            constexprs.setdefault("PREFETCH", False)
        for name in constexprs:
            signature.setdefault(name, "constexpr")
        spec = (fn, signature, constexprs)
        specs.append(spec + (({"num_warps": warps, "num_stages": stages},) if with_options else ()))
        options = specs[-1][3:]
        engine = constexprs.get("NORM") or constexprs.get("RESIDUAL")
        # config.pdl (Hopper on): the engine's bf16 kernels (norm fused into K1, residual into K2)
        if arch >= HOPPER and "PDL" in fn.arg_names and engine and "bf16" in signature.get("x_ptr", signature["h_ptr"]):
            specs.append((fn, signature, dict(constexprs, PDL=True)) + options)
            if "PREFETCH" in fn.arg_names and constexprs.get("STREAM") and constexprs["M_PAD"] == 1:  # config.prefetch
                specs.append((fn, signature, dict(constexprs, PDL=True, PREFETCH=True)) + options)

    for dtype in (torch.bfloat16, torch.float16):
        ty = TL_DTYPES[dtype]
        for mp in PADDED_TOKENS:
            cfg, dense_cfg = default_config(mp, arch), default_config(mp, arch, dense=True)
            variants = [(True, False, "sparse", False), (True, True, "sparse", False), (False, True, "sparse", False)]
            if mp in ENGINE_TOKENS:
                variants += [(True, True, "sparse", True), (True, True, "relu", True), (True, False, "silu", True)]
            variants = [v + (False, False, False) for v in variants]
            if mp == 1:  # config.stream: the public op's (no norm) and the engine's; the engine's folded K1
                variants += [(True, True, "sparse", False, True, False, False),
                             (True, True, "sparse", True, True, False, False),
                             (True, True, "relu", True, True, False, False),
                             (True, False, "silu", True, True, False, False),
                             (True, True, "sparse", True, True, False, True),
                             (False, True, "sparse", True, True, False, True)]
            if mp >= 16:  # compact_up: the public op's and the engine's
                variants += [(True, False, "sparse", False, False, True, False),
                             (True, True, "sparse", True, False, True, False)]
            for gated, has_threshold, act, norm, stream, compact, fold in variants:
                if mp not in (1, 64) and not (gated and not has_threshold) and not norm:
                    continue
                sig = {"x_ptr": f"*{ty}", "norm_ptr": f"*{ty}" if norm else "constexpr", "first_ptr": f"*{ty}",
                       "up_ptr": f"*{ty}", "threshold_ptr": "*fp32" if has_threshold else "constexpr",
                       "h_ptr": "constexpr" if fold else f"*{ty}", "flags_ptr": "constexpr" if fold else "*i32",
                       "count_ptr": "constexpr" if fold else "*i32", "down_t_ptr": f"*{ty}" if fold else "constexpr",
                       "fold_ptr": "*fp32" if fold else "constexpr", "M": "i32", "D": "i32",
                       "H": "i32", "n_counts": "i32", "eps": "fp32", "stride_xm": "i32", "stride_fh": "i32",
                       "stride_uh": "i32", "stride_hm": "i32", "stride_hh": "i32", "stride_dh": "i32"}
                k1 = default_config(mp, arch, dense=act != "sparse", norm=norm)
                k1 = fit_shared_memory(dataclasses.replace(k1, stream=stream, compact_up=compact), mp, arch)
                cx = {"GATED": gated, "HAS_THRESHOLD": has_threshold, "ACT": ACTS[act], "NORM": norm, "M_PAD": mp,
                      "BLOCK_H": k1.block_h, "BLOCK_K": k1.block_k, "STREAM": stream, "ONE_STEP": D <= k1.block_k,
                      "FOLD": fold, "COMPACT_UP": compact, "UP_K": min(k1.up_k, D), "UP_STAGES": k1.up_stages,
                      "DOT_IN_FP32": False}
                for name, absent in (("threshold_ptr", not has_threshold), ("norm_ptr", not norm), ("h_ptr", fold),
                                     ("flags_ptr", fold), ("count_ptr", fold), ("down_t_ptr", not fold),
                                     ("fold_ptr", not fold)):
                    if absent:
                        cx[name] = None
                add(_decode_gate_up_kernel, sig, cx, k1.gate_warps, k1.gate_stages)
                if stream and norm and not fold and k1.block_k < D:  # the engine's K1 in one step: the whole row
                    add(_decode_gate_up_kernel, sig, dict(cx, BLOCK_K=D, ONE_STEP=True), k1.gate_warps, k1.gate_stages)
            # (residual, config): the public op's; the engine's sparse and dense (every unit) down kernels
            downs = [(False, cfg, False)]  # (residual, config, every unit)
            if mp in ENGINE_TOKENS:
                downs += [(True, cfg, False), (True, dense_cfg, True)]
            for residual, k2, all_units in downs:
                sig = {"h_ptr": f"*{ty}", "flags_ptr": "*i32", "list_ptr": "*i32", "down_t_ptr": f"*{ty}",
                       "y_ptr": f"*{ty}", "res_ptr": f"*{ty}" if residual else "constexpr", "part_ptr": "*fp32",
                       "count_ptr": "*i32", "M": "i32", "D": "i32", "H": "i32", "stride_dh": "i32", "stride_ym": "i32",
                       "stride_rm": "i32"}
                cx = {"M_PAD": mp, "ROWS": down_rows(mp), "SPLIT": k2.split, "BLOCK_S": k2.block_s,
                      "BLOCK_D": down_block(k2, D, 132), "PREFIX": k2.prefix, "ALL_UNITS": all_units,
                      "RESIDUAL": residual, "DOT_IN_FP32": False}
                if not residual:
                    cx["res_ptr"] = None
                add(_decode_down_kernel, sig, cx, k2.down_warps, k2.down_stages)
            if mp in ENGINE_TOKENS:
                sig = {"h_ptr": f"*{ty}", "down_ptr": f"*{ty}", "res_ptr": f"*{ty}", "y_ptr": f"*{ty}", "M": "i32",
                       "D": "i32", "H": "i32", "stride_hm": "i32", "stride_dd": "i32", "stride_rm": "i32",
                       "stride_ym": "i32"}
                engine_cfg = default_config(mp, arch, dense=True, norm=True)  # the engine's: norm fused into K1
                cx = {"M_PAD": mp, "BLOCK_D": engine_cfg.block_h if mp < 16 else 16, "BLOCK_K": engine_cfg.block_k,
                      "STREAM": engine_cfg.stream, "ONE_STEP": False, "RESIDUAL": True, "DOT_IN_FP32": False}
                add(_dense_down_kernel, sig, cx, engine_cfg.gate_warps, engine_cfg.gate_stages)
    return specs
