"""Launch configs of the dense-rows MLP backward kernels (kernels/dense_rows_mlp_backward.py): the
config type and the default per hidden size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from sparseffn.kernels._runtime import check_config_fields, next_power_of_2


@dataclass(frozen=True)
class DenseRowsBackwardConfig:
    """Launch parameters of the two backward kernels (block sizes: powers of two).

    dx kernel: block_r tokens per tile (MMA N: >= 8), block_h units per chunk and block_dx dx
    columns per tile (MMA M: >= 16, 64 per warpgroup for wgmma), block_k the recompute's D step.
    dw kernel: block_h_w units per tile (MMA M), block_r_w rows per step (MMA K of the weight
    GEMMs: >= 16), block_k_w the recompute's D step, block_dw accumulator columns per slice.
    d_groups: D groups per unit chunk in the dw kernel (its recompute factor); None lets the
    launcher pick floor(#programs / #chunks) (at least 1, at most the slices): the most tiles that
    still fit in one wave of the persistent grid.
    """

    block_r: int = 16
    block_h: int = 64
    block_k: int = 64
    block_dx: int = 256
    num_warps: int = 8
    num_stages: int = 3
    block_h_w: int = 64
    block_r_w: int = 32
    block_k_w: int = 32
    block_dw: int = 128
    num_warps_w: int = 8
    num_stages_w: int = 2
    d_groups: int | None = None
    programs_per_sm: int = 1  # persistent grids: #SMs x this (the interpreter: 3 x this)

    def __post_init__(self) -> None:
        if self.d_groups is not None:
            check_config_fields(self, positive=("d_groups",))
        check_config_fields(
            self,
            positive=("block_r", "block_h", "block_k", "block_dx", "num_warps", "num_stages", "block_h_w", "block_r_w",
                      "block_k_w", "block_dw", "num_warps_w", "num_stages_w", "programs_per_sm"),
            powers_of_two=("block_r", "block_h", "block_k", "block_dx", "num_warps", "block_h_w", "block_r_w",
                           "block_k_w", "block_dw", "num_warps_w"),
            at_least=((("block_h", "block_k", "block_dx", "block_h_w", "block_r_w", "block_k_w", "block_dw"), 16,
                       "tl.dot"), (("block_r",), 8, "tl.dot")))


@functools.lru_cache(maxsize=None)  # frozen configs, built and checked once per shape
def default_backward_config(d: int, *, cuda: bool) -> DenseRowsBackwardConfig:
    """Config from D only (never M or R: they add no compiled variants).

    GPU (D % 8 == 0; CUDA runs only the aligned path): dx kernel 16 tokens per tile, 64-unit
    chunks, BLOCK_K 64, dx slices of up to 256 columns (n_dx = 8 at D = 2048), 8 warps, 3 stages:
    115-186 registers, no spills (ptxas, sm_90a; 512-column slices spill when gated). dw kernel
    64 units x 128 columns per accumulator tile, 32 rows per step, BLOCK_K 32, 8 warps, 2 stages:
    214-254 registers, no spills (one CTA per SM, as the persistent grid assumes). Not tuned by a
    sweep. Interpreter: big blocks, since each block operation is one numpy call.
    """
    block_dx = min(max(next_power_of_2(max(d, 1)), 64), 256)
    if not cuda:
        return DenseRowsBackwardConfig(block_r=16, block_h=128, block_k=128, block_dx=min(block_dx, 128),
                                       num_warps=4, num_stages=1, block_h_w=128, block_r_w=64, block_k_w=128,
                                       block_dw=128, num_warps_w=4, num_stages_w=1)
    return DenseRowsBackwardConfig(block_dx=block_dx)
