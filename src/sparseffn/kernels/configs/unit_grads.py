"""Launch configs of the unit-major weight-gradient kernel (kernels/unit_grads.py): the config type
and the default per hidden size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from sparseffn.kernels._runtime import check_config_fields, next_power_of_2


@dataclass(frozen=True)
class UnitGradsConfig:
    """Launch parameters of `_unit_weight_grads_kernel`. block_e, block_d, num_warps and
    units_per_program are powers of two; block_d >= 16 (two 16-byte vectors of bf16 / fp16)."""

    block_e: int = 8             # entries (gathered token rows) per step
    block_d: int = 1024          # gradient columns per program (the D slice)
    num_warps: int = 4
    num_stages: int = 1
    units_per_program: int = 4   # units per program (UNITS)
    max_regs: int | None = None  # register cap per thread (ptxas .maxnreg); None: no cap
    cap_entries: int = 256       # entries of a unit its own program sums; the rest spill in chunks of as many
                                 # (a multiple of block_e; deterministic mode never spills)

    def __post_init__(self) -> None:
        check_config_fields(self, positive=("block_e", "block_d", "num_warps", "num_stages", "units_per_program",
                                            "cap_entries"),
                            powers_of_two=("block_e", "block_d", "num_warps", "units_per_program"),
                            at_least=((("block_d",), 16, "two 16-byte vectors"),))
        if self.cap_entries % self.block_e:
            raise ValueError(f"cap_entries must be a multiple of block_e ({self.block_e}), got {self.cap_entries}")


@functools.lru_cache(maxsize=None)  # frozen configs, built and checked once per shape
def default_unit_grads_config(d: int) -> UnitGradsConfig:
    """From D only (M adds no compiled variant): 8 entries per step, a slice of up to 1024 columns
    and one warp per 256 of them (up to 4), so that each thread holds 8 columns of every entry of a
    step and the sums over entries stay in registers (warps left over for the entries would make
    the sums cross warps through shared memory on every step); 4 units per program, no pipelining
    stages; a unit's program sums its first 256 entries, the rest of a hot unit's spill (32 steps:
    a program's 4 units take at most 128). The sweep behind it: docs/kernel-notes.md."""
    block_d = min(1024, max(16, next_power_of_2(d)))
    return UnitGradsConfig(block_e=8, block_d=block_d, num_warps=min(4, max(1, block_d // 256)), num_stages=1,
                           units_per_program=4, max_regs=None, cap_entries=256)
