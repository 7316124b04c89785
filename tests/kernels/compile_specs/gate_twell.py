"""Compile specs of kernels/gate_twell.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

import torch

from sparseffn.kernels._runtime import HOPPER, TL_DTYPES
from sparseffn.kernels.configs.gate_twell import GateTwellConfig, default_config, few_tokens_config, fit_shared_memory
from sparseffn.kernels.gate_twell import _FEW_TOKENS_BLOCK_N, _MODE_ID, _gate_twell_kernel, _pack_twell_kernel


def compile_specs(arch: tuple[int, int] = HOPPER, with_options: bool = False):
    """(jit_function, signature, constexprs) for every variant gate_twell launches on a GPU of
    capability `arch`: bf16/fp16 x threshold on/off x {persistent (+ TMA from Hopper on), one tile
    per program with pointers} at the default tile-256 and tile-128 configs, the few-token dense
    output and packing kernels, plus tiles 64 and 32, a slots count that is not a power of two, the
    persistent pointer fallback, tl.store stores, the scan reference epilogue, a two-programs-per-SM
    config and the diagnostic modes (explicit configs shrunk to the arch's shared memory).

    with_options=True appends the compile options (num_warps, num_stages) of each variant's config
    as a 4th element.
    """
    specs = []

    def add(dtype, has_threshold, tile, slots, *, persistent, tma, mode="pack", config=None):
        cfg = fit_shared_memory(config, tile, arch) if config else default_config(2048, 5632, dtype, tile, cuda=True,
                                                                                  arch=arch)
        tma = tma and arch >= HOPPER
        ty = TL_DTYPES[dtype]
        if tma:
            x_ty = f"tensordesc<{ty}[{cfg.block_m}, {cfg.block_k}]>"
            w_ty = f"tensordesc<{ty}[{tile}, {cfg.block_k}]>"
        else:
            x_ty = w_ty = f"*{ty}"
        signature = {
            "x": x_ty,
            "weight": w_ty,
            "threshold_ptr": "*fp32" if has_threshold else "constexpr",
            "values_ptr": f"*{ty}",
            "columns_ptr": "*i16",
            "counts_ptr": "*i32",
            "M": "i32",
            "D": "i32",
            "H": "i32",
            "stride_xm": "i32",
            "stride_xk": "i32",
            "stride_wn": "i32",
        }
        constexprs = {
            "SLOTS": slots,
            "HAS_THRESHOLD": has_threshold,
            "MODE": _MODE_ID[mode],
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": tile,
            "BLOCK_K": cfg.block_k,
            "GROUP_M": cfg.group_m,
            "USE_TMA": tma,
            "FLATTEN": persistent,
            "SCAN_EPILOGUE": cfg.scan_epilogue,
            "ASM_STORES": cfg.asm_stores,
            "NATIVE_BF16": arch >= HOPPER,
            "DOT_IN_FP32": False,
        }
        if not has_threshold:
            constexprs["threshold_ptr"] = None
        for name in constexprs:
            signature.setdefault(name, "constexpr")
        spec = (_gate_twell_kernel, signature, constexprs)
        if with_options:
            spec += ({"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},)
        specs.append(spec)

    bf16, fp16 = torch.bfloat16, torch.float16
    for dtype in (bf16, fp16):
        for has_threshold in (False, True):
            for tile, slots in ((256, 32), (128, 16)):
                add(dtype, has_threshold, tile, slots, persistent=True, tma=True)
                add(dtype, has_threshold, tile, slots, persistent=False, tma=False)
    add(bf16, True, 64, 8, persistent=True, tma=True)
    add(fp16, False, 32, 4, persistent=True, tma=True)
    add(bf16, True, 256, 24, persistent=True, tma=True)  # slots not a power of two
    add(bf16, True, 256, 32, persistent=True, tma=False)  # persistent pointer fallback (strided x)
    add(bf16, True, 256, 32, persistent=True, tma=True, config=GateTwellConfig(128, 64, 8, 8, 3, asm_stores=False))
    add(bf16, True, 128, 16, persistent=True, tma=True, config=GateTwellConfig(128, 64, 8, 8, 3, scan_epilogue=True))
    add(bf16, True, 256, 32, persistent=True, tma=True, config=GateTwellConfig(64, 64, 8, 4, 2, programs_per_sm=2))
    for mode in ("counts", "dense"):
        add(bf16, True, 256, 32, persistent=True, tma=True, mode=mode)
    # few-token calls: the dense output in N-blocks of 32 (both row-block configs), then the packing
    for dtype in (bf16, fp16):
        for m, has_threshold in ((1, False), (64, True)):
            add(dtype, has_threshold, _FEW_TOKENS_BLOCK_N, _FEW_TOKENS_BLOCK_N, persistent=False, tma=False,
                mode="dense", config=few_tokens_config(2048, m))
        for tile, slots in ((256, 32), (64, 8)):
            ty = TL_DTYPES[dtype]
            signature = {"p_ptr": f"*{ty}", "values_ptr": f"*{ty}", "columns_ptr": "*i16", "counts_ptr": "*i32",
                         "H": "i32", "n_tiles": "i32", "stride_pm": "i32", "SLOTS": "constexpr", "TILE": "constexpr"}
            spec = (_pack_twell_kernel, signature, {"SLOTS": slots, "TILE": tile})
            specs.append(spec + (({"num_warps": 4, "num_stages": 3},) if with_options else ()))
    return specs
