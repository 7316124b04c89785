"""Launch configs of the decode kernels (kernels/decode_mlp.py): the config type and the table per
padded token count, fitted to a GPU generation's shared memory.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from sparseffn.kernels._runtime import HOPPER, check_config_fields, pdl_by_default, shared_memory_limit


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters. K1: block_h units per program, block_k columns per step, gate_warps /
    gate_stages, stream (one token only: the next weight tile loaded while the current one is reduced,
    decode_mlp._streamed_dot). K2: block_s list entries per step, block_d output columns per program
    (None: enough programs to fill the GPU), down_warps / down_stages, prefix flags per compaction step,
    split spans of the units per column block. compact_up (3+ tokens, sparse): K1's up pass over its
    active units gathered 16 at a time, up_k columns per step, up_stages deep (decode_mlp._compact_up).
    pdl: K1 and K2 launched as programmatic dependents (Hopper on; _runtime.pdl_options); prefetch (with
    pdl and stream): K1's first gate tile loaded before the wait."""

    block_h: int = 16
    block_k: int = 256
    gate_warps: int = 4
    gate_stages: int = 3
    block_s: int = 64
    block_d: int | None = None
    down_warps: int = 4
    down_stages: int = 3
    prefix: int = 4096  # flags per step of K2's compaction
    split: int = 1  # K2's programs per column block, each over one span of the units
    stream: bool = False  # one token: K1's loops keep the next weight tile in flight
    compact_up: bool = False  # 3+ tokens: K1's up pass on its active units only, gathered
    up_k: int = 1024
    up_stages: int = 2
    pdl: bool = False  # Hopper on: programmatic dependent launch (each kernel may start before the last ends)
    prefetch: bool = False  # with pdl and stream: K1's first weight tile loaded before the wait

    def __post_init__(self) -> None:
        check_config_fields(self, positive=("block_h", "block_k", "gate_warps", "gate_stages", "block_s",
                                            "down_warps", "down_stages", "prefix", "split", "up_k", "up_stages"),
                            powers_of_two=("block_h", "block_k", "gate_warps", "block_s", "down_warps", "prefix",
                                           "up_k"),
                            at_least=((("block_k", "block_s", "up_k"), 16, "tl.dot"),
                                      (("block_h",), 2, "a 2-D tile")),
                            flags=("stream", "compact_up", "pdl", "prefetch"))
        if self.block_d is not None and (isinstance(self.block_d, bool) or not isinstance(self.block_d, int)
                                         or self.block_d < 16 or self.block_d & (self.block_d - 1)):
            raise ValueError(f"DecodeConfig.block_d must be None or a power of two >= 16, got {self.block_d!r}")


def down_rows(m_padded: int) -> int:
    """K2's token rows: 1 (CUDA-core products), else at least 16 (tl.dot's minimum)."""
    return 1 if m_padded == 1 else max(16, m_padded)


@functools.lru_cache(maxsize=None)
def default_config(m_padded: int, arch: tuple[int, int] = HOPPER, dense: bool = False,
                   norm: bool = False) -> DecodeConfig:
    """The config per padded M, from the sweep on the H200 (benchmarks/results/h200/decode_sweep.csv,
    D=2048/H=5632, 29 active units per token) and the captured engine step's sweep
    (decode_engine_sweep.csv), with its pipeline stages cut to fit the shared memory of a GPU of
    capability `arch` (and 32-unit tiles from sm_100 on). One or two tokens: few units per program and
    long steps, since the CUDA-core loop is not software-pipelined (each step is one memory round trip;
    at one token the sparse gate read with the norm fused, `norm` (the engine's), does best in two
    steps, without the norm and the dense gate + up in one; the engine's K1, dense or sparse, streams
    its two steps with prefetch, the first tile read before the PDL wait); more tokens: tl.dot tiles,
    pipelined, and at 16 the engine's sparse K1 with compact_up. The down kernel splits the units into 4
    to 8 spans (more programs); dense (`dense`: every unit summed, act relu / silu): 8 spans (measured at
    16 and 64 tokens), 16 at one token (the engine's step sweep, H100 and H200). pdl: _runtime.pdl_by_default."""
    if m_padded == 1:
        pdl = pdl_by_default(m_padded)
        config = DecodeConfig(block_h=4, block_k=1024 if norm else 2048, gate_stages=1, block_s=128, block_d=64,
                              down_stages=1, prefix=2048, split=4, stream=norm, pdl=pdl, prefetch=norm and pdl)
    elif m_padded == 2:
        config = DecodeConfig(block_h=2, block_k=2048, gate_stages=1, block_s=64, block_d=64, down_stages=1,
                              prefix=2048, split=8)
    elif m_padded == 16:
        config = DecodeConfig(block_h=64, block_k=256, gate_stages=4, block_s=128, block_d=64, down_stages=2,
                              prefix=2048, split=4, compact_up=norm and not dense, up_k=256, up_stages=4)
    else:
        config = DecodeConfig(block_h=64, block_k=128, gate_stages=4, block_s=128, block_d=64, down_stages=4,
                              prefix=8192, split=4)
    if dense:
        config = dataclasses.replace(config, split=16 if m_padded == 1 else 8)
    if m_padded < 16:
        return config
    if arch >= (10, 0):  # Triton 3.6's TMEM layout pass fails on 64-unit tiles there (compile check)
        config = dataclasses.replace(config, block_h=32)
    return fit_shared_memory(config, m_padded, arch)


def fit_shared_memory(config: DecodeConfig, m_padded: int, arch: tuple[int, int] = HOPPER) -> DecodeConfig:
    """config with the pipeline stages of its tl.dot loops (3+ tokens: K1's gate and compact-up loops, K2's
    list loop) cut to fit the shared memory of a GPU of capability `arch`, and compact_up's step halved
    until one stage fits."""
    if m_padded < 16:
        return config
    limit = shared_memory_limit(arch) - 8 * 1024  # headroom for the compiler's own scratch
    gate_stage = (config.block_h + m_padded) * config.block_k * 2  # 16-bit tiles of one pipeline stage
    block_d = config.block_d or 256  # None: sized by down_block at launch, at most 256 columns here
    down_stage = (config.block_s * block_d + down_rows(m_padded) * config.block_s) * 2
    up_k = config.up_k
    while up_k > 16 and (16 + m_padded) * up_k * 2 > limit:  # 16 gathered units and the x tile
        up_k //= 2
    up_stage = (16 + m_padded) * up_k * 2
    return dataclasses.replace(config, gate_stages=max(1, min(config.gate_stages, limit // gate_stage)),
                               down_stages=max(1, min(config.down_stages, limit // down_stage)), up_k=up_k,
                               up_stages=max(1, min(config.up_stages, limit // up_stage)))
