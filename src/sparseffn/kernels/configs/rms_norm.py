"""Launch configs of the RMSNorm kernels (kernels/rms_norm.py): the config type and the default per
hidden size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from sparseffn.kernels._runtime import next_power_of_2


@dataclass(frozen=True)
class RMSNormConfig:
    """Launch configuration. block_m: rows per program (per loop step in backward); num_warps;
    programs_per_sm: the backward grid is min(row blocks, SMs x programs_per_sm) (2 "SMs" on CPU)."""

    block_m: int
    num_warps: int
    programs_per_sm: int = 4


@functools.lru_cache(maxsize=None)  # frozen configs, built and checked once per shape
def default_config(d: int, *, cuda: bool) -> RMSNormConfig:
    """From D only (M must add no compiled variants).

    CUDA: tiles of about 4096 elements (D = 2048: 2 rows, D <= 256: 16 rows, D >= 4096: one row),
    16 fp32 elements per thread and tensor (8 warps at D = 2048; capped at 16 warps, so D = 16384
    holds 32), loaded as 16-byte vectors. sm_90 registers per thread (ptxas): forward 40 at
    D = 2048, backward 80 at D = 2048 and 128 without spills at D = 16384 (bf16); the backward
    spills past that. The backward grid keeps every program resident at once (16 warps per SM:
    2 programs of 8 warps at D = 2048), so no second wave leaves SMs idle at the end.
    Interpreter: big blocks (each block operation is one numpy call).
    """
    block_d = next_power_of_2(max(d, 1))
    if not cuda:
        return RMSNormConfig(block_m=max(1, min(64, 8192 // block_d)), num_warps=4)
    block_m = max(1, min(16, 4096 // block_d))
    num_warps = max(1, min(16, block_m * block_d // 512))
    return RMSNormConfig(block_m=block_m, num_warps=num_warps, programs_per_sm=max(1, 16 // num_warps))
