"""Launch configs of the decode attention kernels (kernels/decode_attn_proj.py, kernels/decode_attention.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from sparseffn.kernels._runtime import (HOPPER, check_config_fields, next_power_of_2, pdl_by_default,
                                        shared_memory_limit)


@dataclass(frozen=True)
class ProjectionConfig:
    """A decode projection's launch: block_n output units per program (the q/k/v kernel takes them as
    block_n / 2 rotary pairs), block_k columns of D per step, num_warps, num_stages; stream (one token
    only): the streamed loop of decode_mlp._streamed_dot (the next step's tiles loaded while the current
    one is reduced); pdl: launched as a programmatic dependent (Hopper on; _runtime.pdl_options); prefetch
    (one token, with pdl, streamed or in one K step): the first weight tile loaded before the wait."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    stream: bool = False
    pdl: bool = False
    prefetch: bool = False

    def __post_init__(self) -> None:
        check_config_fields(self, positive=("block_n", "block_k", "num_warps", "num_stages"),
                            powers_of_two=("block_n", "block_k", "num_warps"),
                            at_least=((("block_n",), 2, "rotary pairs"), (("block_k",), 16, "tl.dot")),
                            flags=("stream", "pdl", "prefetch"))


@dataclass(frozen=True)
class AttentionConfig:
    """Split-KV attention: block_s cache slots per step, splits of each sequence's valid slots per
    (sequence, key/value head) (None: enough programs to fill the GPU, at most max_splits); pdl: launched
    as a programmatic dependent (Hopper on; _runtime.pdl_options); prefetch: positions, valid_from and
    each program's first block of older slots (before positions[b]) read before the PDL wait, so they are
    in flight while the launch before still runs. Only for callers where no kernel still running writes
    positions, valid_from or those slots (the decode engine: positions come from the step's first op,
    older slots from earlier steps); off in the public op's defaults. mma: the products by tl.dot on query
    rows padded to 16 even where one query head reads a key/value head (GQA groups always take it), so the
    cache tiles stream through shared memory, pipelined num_stages deep (a load feeding no tl.dot is not)."""

    block_s: int = 64
    num_warps: int = 4
    num_stages: int = 2
    splits: int | None = None
    max_splits: int = 16
    pdl: bool = False
    prefetch: bool = False
    mma: bool = False

    def __post_init__(self) -> None:
        check_config_fields(self, positive=("block_s", "num_warps", "num_stages", "max_splits"),
                            powers_of_two=("block_s", "num_warps"), at_least=((("block_s",), 16, "tl.dot"),),
                            flags=("pdl", "prefetch", "mma"))
        if self.splits is not None and (isinstance(self.splits, bool) or not isinstance(self.splits, int)
                                        or self.splits < 1):
            raise ValueError(f"AttentionConfig.splits must be None or a positive int, got {self.splits!r}")


@functools.lru_cache(maxsize=None)
def projection_config(m_padded: int, arch: tuple[int, int] = HOPPER, qkv: bool = True,
                      k: int = 2048) -> ProjectionConfig:
    """The q/k/v kernel's config (qkv) or o_proj's, for a reduction of length k (D for q/k/v, Hq·d for
    o_proj). One or two tokens: two units per program and whole-row steps (decode_linear's CUDA-core
    shape: many small programs keep rows in flight, the loop is not pipelined); at one token q/k/v four
    units streamed and o_proj two, each in one step of the whole row where k fits 2048 columns (else
    steps of 1024), with prefetch (the first tile, so the whole row where it fits, read before the PDL
    wait while the launch before still runs; it paid in the engine's step sweep). 16 to
    64 padded tokens: tl.dot tiles of 16 units, so a 2048-unit o_proj still has a program per SM
    (each streams its rows through a 4-stage pipeline, enough bytes in flight for its SM's share of
    the bandwidth); q/k/v (6144 units) in 32-unit tiles: 256-column steps in 3 stages at 16 tokens,
    128-column steps in 4 at 32 and 64 (measured at 64: 2.3x faster than 16-unit tiles). Pipelined
    within the target's shared memory. From the captured engine step's sweep on the H200
    (decode_engine_sweep.csv). pdl: _runtime.pdl_by_default."""
    pdl = pdl_by_default(m_padded)
    if m_padded == 1 and qkv:
        return ProjectionConfig(block_n=4, block_k=max(16, next_power_of_2(k)) if k <= 2048 else 1024,
                                stream=True, pdl=pdl, prefetch=pdl)
    if m_padded == 1 and k <= 2048:
        return ProjectionConfig(block_n=2, block_k=max(16, next_power_of_2(k)), pdl=pdl, prefetch=pdl)
    if m_padded <= 2:
        return ProjectionConfig(block_n=2, block_k=1024 if m_padded == 1 else 2048, pdl=pdl)
    if not qkv:
        block_n, block_k, stages = 16, 256, 4
    else:
        block_n, block_k, stages = (32, 256, 3) if m_padded == 16 else (32, 128, 4)
    stage = (block_n + m_padded) * block_k * 2  # 16-bit tiles of one pipeline stage
    stages = max(1, min(stages, (shared_memory_limit(arch) - 8 * 1024) // stage))
    return ProjectionConfig(block_n=block_n, block_k=block_k, num_warps=4, num_stages=stages)


def attention_config(programs: int, sms: int, prefetch: bool = False) -> AttentionConfig:
    """The split-KV attention's default config for `programs` (sequence, key/value head) pairs on a
    GPU of `sms` SMs: with a pair per SM or more, one split of 128-slot steps (no combine; at batch 16
    on the 2b model 1.4x faster than two splits of 64) with mma (pipelined cache tiles: 12% faster there,
    H100); fewer pairs, AttentionConfig() (about 4 programs per SM; mma slower there), launched with pdl
    (as the one-token kernels around it), and with `prefetch` (the
    caller meets AttentionConfig.prefetch's contract) reading before the wait, at 2 warps (each faster
    in the engine's 2b step at batch 1; prefetch slower without pdl, at batch 16: docs/decode_engine.md)."""
    if programs >= sms:
        return AttentionConfig(splits=1, block_s=128, mma=True)
    return AttentionConfig(pdl=True, prefetch=True, num_warps=2) if prefetch else AttentionConfig(pdl=True)
