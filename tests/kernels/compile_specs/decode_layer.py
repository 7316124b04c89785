"""Compile specs of kernels/decode_layer.py for tests/kernels/gpu_compile.py."""

from __future__ import annotations

import torch

from sparseffn.kernels._runtime import HOPPER, TL_DTYPES
from sparseffn.kernels.configs.decode_layer import layer_config
from sparseffn.kernels.decode_attention import group_rows
from sparseffn.kernels.decode_layer import _decode_layer_kernel
from sparseffn.kernels.decode_mlp import ACTS, down_block

D, HEAD_DIM, HQ = 2048, 64, 32  # the 2b model's attention
POINTERS = ("x_ptr", "attn_norm_ptr", "wq_ptr", "wk_ptr", "wv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_cache_ptr",
            "v_cache_ptr", "o_ptr", "wo_ptr", "mlp_norm_ptr", "first_ptr", "up_ptr", "h_ptr", "down_t_ptr",
            "next_wq_ptr", "next_wk_ptr", "next_wv_ptr")
BIASES = ("bq_ptr", "bk_ptr", "bv_ptr", "bo_ptr")
SCRATCH = {"part_ptr": "*fp32", "stat_ptr": "*fp32", "down_part_ptr": "*fp32", "attn_count_ptr": "*i32",
           "flags_ptr": "*i32", "list_ptr": "*i32", "down_count_ptr": "*i32", "sync_ptr": "*i32", "pos_ptr": "*i64",
           "attn_eps": "fp32", "mlp_eps": "fp32", "scale_log2": "fp32"}


def spec(dtype, act: str, threshold: bool, bias: bool, group: int, arch: tuple[int, int], pdl: bool):
    """(signature, constexprs) of one launch_decode_layer variant with the default config at `arch`."""
    cfg = layer_config(arch, dense=act != "sparse")
    ty = TL_DTYPES[dtype]
    sig, cx = {}, {}
    for name in _decode_layer_kernel.arg_names:
        if name in POINTERS or (bias and name in BIASES):
            sig[name] = f"*{ty}"
        elif name in SCRATCH:
            sig[name] = SCRATCH[name]
        elif name == "threshold_ptr" and threshold:
            sig[name] = "*fp32"
        elif name in BIASES or name == "threshold_ptr":
            sig[name], cx[name] = "constexpr", None
        elif name.isupper() and name not in ("D", "HQ", "HKV", "SPLITS", "H"):
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    cx.update(HEAD_DIM=HEAD_DIM, HAS_QKV_BIAS=bias, HAS_O_BIAS=bias, QKV_BLOCK_N=cfg.qkv.block_n,
              QKV_BLOCK_K=cfg.qkv.block_k, QKV_ONE_STEP=D <= cfg.qkv.block_k, QKV_STREAM=cfg.qkv.stream, GROUP=group,
              G_PAD=group_rows(group), SPLITS_PAD=16, BLOCK_S=cfg.attention.block_s, HEAD_BLOCK=HEAD_DIM,
              O_BLOCK_N=cfg.out.block_n, O_BLOCK_K=cfg.out.block_k, O_ONE_STEP=HQ * HEAD_DIM <= cfg.out.block_k,
              O_STREAM=cfg.out.stream, GATED=True, HAS_THRESHOLD=threshold, ACT=ACTS[act], BLOCK_H=cfg.mlp.block_h,
              BLOCK_K=cfg.mlp.block_k, MLP_STREAM=cfg.mlp.stream, SPLIT=cfg.mlp.split, DOWN_BLOCK_S=cfg.mlp.block_s,
              DOWN_BLOCK_D=down_block(cfg.mlp, D, 132), PREFIX=cfg.mlp.prefix, SYNC=True, PREFETCH=cfg.prefetch,
              THREADS=32 * cfg.num_warps, PDL=pdl, DOT_IN_FP32=False)
    return sig, cx, {"num_warps": cfg.num_warps, "num_stages": 1}


def compile_specs(arch: tuple[int, int] = (9, 0), with_options: bool = False):
    """(jit_function, signature, constexprs[, options]) of the layer kernel as the fused engine launches it
    at one token: sparse with a threshold, dense relu and silu, with and without biases, no GQA and groups
    of 4 (tl.dot attention rows), bf16 / fp16; on Hopper (`arch`) the sparse bf16 one with config.pdl."""
    variants = [(torch.bfloat16, "sparse", True, False, 1), (torch.bfloat16, "relu", False, False, 1),
                (torch.bfloat16, "silu", False, True, 4), (torch.float16, "sparse", True, True, 4)]
    specs = []
    for i, (dtype, act, threshold, bias, group) in enumerate(variants):
        for pdl in (False, True) if arch >= HOPPER and i == 0 else (False,):
            sig, cx, options = spec(dtype, act, threshold, bias, group, arch, pdl)
            specs.append((_decode_layer_kernel, sig, cx) + ((options,) if with_options else ()))
    return specs
