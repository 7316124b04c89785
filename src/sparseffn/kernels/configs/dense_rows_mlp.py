"""Launch configs of the dense-rows MLP kernel (kernels/dense_rows_mlp.py): the config type and the
default per hidden size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from sparseffn.kernels._runtime import check_config_fields, next_power_of_2


@dataclass(frozen=True)
class DenseRowsConfig:
    """Launch parameters of `_dense_rows_mlp_kernel` (all powers of two).

    block_r tokens per tile (MMA N: >= 8 on the GPU), block_h units per chunk and block_dy y
    columns per tile (MMA M: >= 16, 64 per warpgroup for wgmma), block_k the D step (>= 16).
    The y accumulator is block_dy * block_r fp32 spread over num_warps * 32 threads.
    """

    block_r: int = 16
    block_h: int = 64
    block_k: int = 64
    block_dy: int = 256
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 1  # persistent grid: #SMs x this (the interpreter: 3 x this)

    def __post_init__(self) -> None:
        check_config_fields(
            self, positive=("block_r", "block_h", "block_k", "block_dy", "num_warps", "num_stages", "programs_per_sm"),
            powers_of_two=("block_r", "block_h", "block_k", "block_dy", "num_warps"),
            at_least=((("block_h", "block_k", "block_dy"), 16, "tl.dot"), (("block_r",), 8, "tl.dot")))


@functools.lru_cache(maxsize=None)  # frozen configs, built and checked once per shape
def default_config(d: int, *, cuda: bool) -> DenseRowsConfig:
    """Config from D only (never M: M adds no compiled variants).

    GPU, D % 8 == 0 (16-byte vector loads, cp.async pipeline): 16 tokens per tile, 64-unit
    chunks, BLOCK_K 64, y slices of up to 512 columns (n_d = 4 at D = 2048), 8 warps at 512 and 4
    below, 3 stages: no spills at D = 2048 (ptxas, sm_90a). Other D (element loads through
    registers): slices of up to 256, 8 warps, 2 stages, also without spills. Not tuned by a sweep.
    Interpreter: big blocks, since each block operation is one numpy call.
    """
    block_dy = min(max(next_power_of_2(max(d, 1)), 64), 512)
    if not cuda:
        return DenseRowsConfig(block_r=16, block_h=128, block_k=128, block_dy=min(block_dy, 128),
                               num_warps=4, num_stages=1)
    if d % 8:
        return DenseRowsConfig(block_r=16, block_h=64, block_k=64, block_dy=min(block_dy, 256),
                               num_warps=8, num_stages=2)
    return DenseRowsConfig(block_r=16, block_h=64, block_k=64, block_dy=block_dy,
                           num_warps=8 if block_dy >= 512 else 4, num_stages=3)
