"""Launch configs of the fused up + down kernel (kernels/twell_up_down.py): the config type, the
default per hidden size and token-count bucket, and the configs a sweep times (`benchmark_configs`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from sparseffn.kernels._runtime import check_config_fields, next_power_of_2


_MAX_BLOCK_D = 8192


@dataclass(frozen=True)
class UpDownConfig:
    """Launch parameters of `_twell_up_down_kernel`. Sizes are powers of two. The defaults are
    `default_config(2048)`."""

    block_m: int = 2        # tokens per program (consecutive)
    persistent: int = 0     # > 0: that many programs per SM, token rows dealt round-robin
    block_u: int = 4        # active units per chunk: 2 * block_u weight rows loaded together
    block_d: int = 2048     # y columns per program; >= D keeps x[m], y[m] in registers
    block_n: int = 64       # compact slots per batch, columns/values gathered at once (>= block_u)
    max_block_t: int = 256  # tiles per counts segment at most
    num_warps: int = 4
    prefetch: bool = False  # double-buffer the chunk loop in registers
    lookahead: bool = True  # several rows per program: the next row's columns/values load early
    evict: bool = True      # L2 hints: weights evict_last, x/values/columns/counts/out evict_first
    max_regs: int | None = 128  # register cap per thread (ptxas .maxnreg): more programs per SM
    split_slots: int = 128  # rows with more valid slots are split into pieces of this many; 0: off
    split_cap: int = 256    # rows split per call at most (the rest run whole; less for wide MLPs,
                            # row_split.PARTIALS_BUDGET_BYTES)

    def __post_init__(self) -> None:
        check_config_fields(self, positive=("block_m", "block_u", "block_d", "block_n", "max_block_t", "num_warps",
                                            "split_cap"),
                            powers_of_two=("block_u", "block_d", "block_n", "max_block_t", "num_warps"),
                            flags=("prefetch", "lookahead", "evict"))
        if (not isinstance(self.split_slots, int) or isinstance(self.split_slots, bool) or self.split_slots < 0
                or (self.split_slots and self.split_slots % self.block_n)):
            raise ValueError(f"UpDownConfig.split_slots must be 0 or a positive multiple of block_n = "
                             f"{self.block_n}, got {self.split_slots!r}")
        if (not isinstance(self.persistent, int) or isinstance(self.persistent, bool)
                or self.persistent < 0):
            raise ValueError(f"UpDownConfig.persistent must be an int >= 0, got "
                             f"{self.persistent!r}")
        if self.block_n < self.block_u:
            raise ValueError(f"UpDownConfig.block_n must be >= block_u = {self.block_u}, "
                             f"got {self.block_n}")


# Token-count buckets of the launch heuristic: (largest M, slots per piece = slots per batch). With few
# tokens the grid has few row programs, each a serial chain over its ~30 units, so rows are cut into
# short pieces that run side by side (the sweep behind these: docs/kernel-notes.md).
# Three buckets, so at most three compiled variants per shape.
_SMALL_M_PIECES = ((64, 16), (512, 32))


def default_config(d: int, m: int | None = None) -> UpDownConfig:
    """Heuristic config for hidden size d: the whole row of D in one program up to D = 8192,
    8 contiguous elements per thread along D, ~8K weight elements per [BLOCK_U, BLOCK_D] chunk
    (block_u 4 at D = 2048), batches of 64 compact slots, up to 4 warps, 2 tokens per program,
    the next token's head looked up early, L2 hints, rows of more than 128 valid slots split into
    pieces, and at D = 2048 (4 warps) registers capped at 128 (4 programs per SM). Other D keep
    the compiler's register count. Given m, calls of at most 512 tokens split rows into pieces of
    16 (m <= 64) or 32 slots, one token per program (_SMALL_M_PIECES); m=None is the large-M config.
    The sweep that chose it: docs/kernel-notes.md (the split kernel spills under a
    96-register cap)."""
    piece = next((p for max_m, p in _SMALL_M_PIECES if m is not None and m <= max_m), None)
    return _bucket_config(d, piece)


@functools.lru_cache(maxsize=None)  # frozen configs, built and checked once per (D, bucket)
def _bucket_config(d: int, piece: int | None) -> UpDownConfig:
    block_d = min(next_power_of_2(max(d, 1)), _MAX_BLOCK_D)
    num_warps = max(1, min(4, block_d // 512))
    block_u = max(1, min(8, 8192 // block_d))
    config = UpDownConfig(block_m=2, block_u=block_u, block_d=block_d, block_n=max(64, block_u),
                          num_warps=num_warps,
                          max_regs=128 if block_d == 2048 and num_warps == 4 else None)
    if piece is None:
        return config
    piece = max(piece, block_u)
    return dataclasses.replace(config, block_m=1, block_n=piece, split_slots=piece)


def benchmark_configs(d: int) -> list[UpDownConfig]:
    """Configs to time on the GPU for hidden size d (at most 16, distinct), the default first.

    Occupancy at d = 2048 (ptxas, sm_90a, bf16 gated): 4 warps hold a [block_u, 2048] chunk of
    up and down rows in 16 * block_u registers per thread; 65536 registers per SM give 3
    programs at 168 registers, 4 at 104-128, 5 at 96, 6 at 80 (2 warps: 6 at 168). Their times on
    the H200: docs/kernel-notes.md."""
    base = default_config(d)
    r = dataclasses.replace
    w2 = max(1, base.num_warps // 2)
    half = max(1, base.block_u // 2)
    configs = [
        base,
        r(base, split_slots=0),                # long rows whole: one chain each
        r(base, max_regs=96),                  # 5 programs per SM, but spills
        # the first kernel's structure: columns loaded per chunk, no lookahead, no L2 hints,
        # compiler's registers
        r(base, block_n=base.block_u, lookahead=False, evict=False, max_regs=None),
        r(base, max_regs=104),                 # 4 programs per SM
        r(base, max_regs=104, lookahead=False),
        r(base, max_regs=None),                # 168 registers, 3 programs
        # one change at a time from the default
        r(base, block_u=half),
        r(base, block_n=32),
        r(base, block_m=1),
        r(base, block_m=4),
        r(base, persistent=5),
        # 2 warps per program: fewer warps per cross-warp reduction, 6 programs at 168 registers
        r(base, num_warps=w2, max_regs=168),
        # register double buffering
        r(base, block_u=half, prefetch=True, max_regs=None),
        r(base, prefetch=True, max_regs=None),
        # 8 warps, 8 units per chunk
        r(base, block_u=base.block_u * 2, num_warps=base.num_warps * 2, max_regs=128),
    ]
    return list(dict.fromkeys(configs))
