"""Launch configs of the gate + TwELL packing kernel (kernels/gate_twell.py): the config type, the
default per shape and GPU generation (fitted to its shared memory), and the few-token GEMM's config.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from sparseffn.kernels._runtime import HOPPER, cdiv, shared_memory_limit


@dataclass(frozen=True)
class GateTwellConfig:
    """Launch configuration (BLOCK_N is always the TwELL tile).

    programs_per_sm sizes the persistent grid (#SMs x programs_per_sm): 2 lets one program's
    epilogue overlap another's main loop when registers and shared memory allow two per SM (e.g.
    tile 256 with block_m 64 and 4 warps). scan_epilogue selects the tl.cumsum reference epilogue
    (it needs the tile in shared memory: at tile 256 and 8 warps more than an H200 SM has).
    asm_stores=False uses tl.store on the GPU too (the interpreter always does).
    """

    block_m: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 1
    scan_epilogue: bool = False
    asm_stores: bool = True


@functools.lru_cache(maxsize=None)  # frozen configs, built and checked once per shape
def default_config(d: int, h: int, dtype: torch.dtype, tile: int, *, cuda: bool,
                   arch: tuple[int, int] = HOPPER) -> GateTwellConfig:
    """Deterministic config from (D, H, dtype, tile, GPU generation), never M (M must add no
    compiled variants).

    Hopper: BLOCK_M 128, BLOCK_K 64; 8 warps (two wgmma warpgroups, 64 rows each) for tiles 256
    and 128, whose fp32 accumulator is then 128 / 64 registers per thread; 3 stages at tile 256
    (144 KiB of shared memory), 4 below; never more stages than k-steps. Other generations take the
    same shape with fewer stages, then 64-row blocks, until the pipeline buffers fit their shared
    memory (`_runtime.shared_memory_limit`). bf16 and fp16 cost the same and H does not change the
    choice. Interpreter: big blocks, since each block operation is one numpy call.
    """
    del dtype, h
    if not cuda:
        return GateTwellConfig(block_m=64, block_k=64, group_m=2, num_warps=4, num_stages=1)
    k_tiles = max(1, -(-d // 64))
    hopper = GateTwellConfig(block_m=128, block_k=64, group_m=8, num_warps=8 if tile >= 128 else 4,
                             num_stages=min(3 if tile == 256 else 4, max(2, k_tiles)))
    return fit_shared_memory(hopper, tile, arch)


def fit_shared_memory(config: GateTwellConfig, tile: int, arch: tuple[int, int]) -> GateTwellConfig:
    """`config` with fewer pipeline stages (down to 2), then 64-row blocks, until its buffers fit the
    shared memory of a GPU of capability `arch`, with 8 KiB to spare for the epilogue and compiler."""
    budget = shared_memory_limit(arch) - 8 * 1024

    def need(c):
        return c.num_stages * (c.block_m + tile) * c.block_k * 2

    while config.num_stages > 2 and need(config) > budget:
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    if need(config) > budget and config.block_m > 64:
        config = dataclasses.replace(config, block_m=64)
    return config


def few_tokens_config(d: int, m: int) -> GateTwellConfig:
    """Config of the dense-output GEMM of few-token calls: BLOCK_M 16 (M <= 16) or 64, BLOCK_K 256 /
    128, one program per N-block, never more stages than k-steps."""
    block_m, block_k, stages = (16, 256, 3) if m <= 16 else (64, 128, 4)
    return _few_tokens_config(block_m, block_k, min(stages, max(1, cdiv(d, block_k))))


@functools.lru_cache(maxsize=None)
def _few_tokens_config(block_m: int, block_k: int, stages: int) -> GateTwellConfig:
    return GateTwellConfig(block_m=block_m, block_k=block_k, group_m=1, num_warps=4, num_stages=stages)
