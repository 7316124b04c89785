"""Launch configs of the rotary-embedding kernel (kernels/rope.py): the config type and the default
per head layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from sparseffn.kernels._runtime import next_power_of_2


@dataclass(frozen=True)
class RopeConfig:
    """Launch configuration: tokens per program, heads per step for q and for k, num_warps."""

    block_s: int
    block_hq: int
    block_hk: int
    num_warps: int = 4


@functools.lru_cache(maxsize=None)  # frozen configs, built and checked once per shape
def default_config(hq: int, hk: int, d: int, *, cuda: bool) -> RopeConfig:
    """From (Hq, Hk, d) only (B and S add no compiled variants).

    A step's tile is [block_s, block_h, d/2] per half; all heads in one step up to 4096 elements of
    a half, and as many tokens as keep q's tile near 2048 elements (Llama 2B, 32 heads of 64: two
    tokens, one step of [2, 32, 32] per half and tensor; 8 heads of 128: four tokens). sm_90
    (ptxas): 72 registers, 16-byte loads and stores, no spills. Interpreter: up to 16 tokens a
    program.
    """
    block_half = next_power_of_2(max(d // 2, 1))
    cap = max(1, 4096 // block_half)
    block_hq = min(next_power_of_2(hq), cap)
    block_hk = min(next_power_of_2(hk), cap)
    target = 8192 if not cuda else 2048
    block_s = max(1, min(16, target // (block_hq * block_half)))
    num_warps = 4 if block_s * block_hq * block_half <= 2048 else 8
    return RopeConfig(block_s=block_s, block_hq=block_hq, block_hk=block_hk, num_warps=num_warps)
