"""Launch configs of the token-major training kernels (kernels/twell_train.py): the config type and
the forward and backward defaults per hidden size.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from sparseffn.kernels._runtime import check_config_fields, next_power_of_2


_MAX_BLOCK_D = 8192


@dataclass(frozen=True)
class TwellTrainConfig:
    """Launch parameters of the two token-major training kernels. Sizes are powers of two."""

    block_m: int = 2        # tokens per program (consecutive)
    block_u: int = 4        # active units per chunk: 2-3 weight rows each, loaded together
    block_d: int = 2048     # output columns per program; >= D keeps token rows in registers
    block_n: int = 64       # compact slots per batch, columns/values gathered at once (>= block_u)
    max_block_t: int = 256  # tiles per counts segment at most
    num_warps: int = 4
    evict: bool = True      # L2 hints: weights evict_last, streamed token data evict_first
    max_regs: int | None = None  # register cap per thread (ptxas .maxnreg)
    split_slots: int = 128  # rows with more valid slots are split into pieces of this many; 0: off
    split_cap: int = 256    # rows split per call at most (the rest run whole; less for wide MLPs,
                            # row_split.PARTIALS_BUDGET_BYTES)

    def __post_init__(self) -> None:
        check_config_fields(self, positive=("block_m", "block_u", "block_d", "block_n", "max_block_t", "num_warps",
                                            "split_cap"),
                            powers_of_two=("block_u", "block_d", "block_n", "max_block_t", "num_warps"),
                            flags=("evict",))
        if self.block_n < self.block_u:
            raise ValueError(f"TwellTrainConfig.block_n must be >= block_u = {self.block_u}, "
                             f"got {self.block_n}")
        if (not isinstance(self.split_slots, int) or isinstance(self.split_slots, bool) or self.split_slots < 0
                or (self.split_slots and self.split_slots % self.block_n)):
            raise ValueError(f"TwellTrainConfig.split_slots must be 0 or a positive multiple of block_n = "
                             f"{self.block_n}, got {self.split_slots!r}")


def _base_config(d: int, max_block_u: int) -> TwellTrainConfig:
    """The whole row of D in one program up to D = 8192, 8 contiguous elements per thread along D,
    up to 4 warps, ~8K elements per weight tile of a chunk (at most max_block_u units), batches of
    64 slots, 2 tokens per program: twell_up_down.default_config's structure. The inference
    kernel's tuned variants (lookahead, register prefetch, persistent grid) are not carried over."""
    block_d = min(next_power_of_2(max(d, 1)), _MAX_BLOCK_D)
    num_warps = max(1, min(4, block_d // 512))
    block_u = max(1, min(max_block_u, 8192 // block_d))
    return TwellTrainConfig(block_m=2, block_u=block_u, block_d=block_d, block_n=max(64, block_u),
                            num_warps=num_warps)


@functools.lru_cache(maxsize=None)  # frozen configs, built and checked once per shape
def default_forward_config(d: int) -> TwellTrainConfig:
    """Heuristic forward config for hidden size d (2 weight rows per unit when gated): block_u 4
    at D = 2048, up to 8 for small D. ptxas (sm_90a, bf16, D = 2048): 128 registers gated, 71
    non-gated, no spills; the deterministic variant (long rows summed piece by piece) took 168
    gated, 3 programs per SM instead of 4, and ran slower (docs/kernel-notes.md),
    so at D = 2048 the cap is 128 (no spills in either variant)."""
    base = _base_config(d, 8)
    if base.block_d == 2048 and base.num_warps == 4:
        return dataclasses.replace(base, max_regs=128)
    return base


@functools.lru_cache(maxsize=None)  # frozen configs, built and checked once per shape
def default_backward_config(d: int) -> TwellTrainConfig:
    """Heuristic backward config for hidden size d (3 weight rows per unit when gated, so 12 rows
    in flight per chunk at D = 2048): block_u 4 at most. ptxas (sm_90a, bf16, D = 2048): the
    kernel with split pieces takes 243 registers gated (2 programs per SM) left alone, so at
    D = 2048 it is capped at 168 (3 programs per SM, no spills: what it used before the pieces);
    128 non-gated."""
    base = _base_config(d, 4)
    if base.block_d == 2048 and base.num_warps == 4:
        return dataclasses.replace(base, max_regs=168)
    return base
