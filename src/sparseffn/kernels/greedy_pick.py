"""Greedy token pick and decode advance in one launch (ops/greedy_pick.py has the contract).

Grid (B, CHUNKS): program (b, c) reads logits[b, c·BLOCK_V : (c+1)·BLOCK_V] and writes its chunk's pick
to fp32 / int32 scratch [B, CHUNKS]: the first NaN's index and NaN if the chunk has one, else the maximum
and the first index holding it. Each then adds one to a counter (acquire-release); the last of the
B·CHUNKS programs reads every chunk's pick, reduces each row in column order (the first NaN, else the
first maximum: torch.argmax's rule), writes token b to out[b, position + 1] and ids[b], advances
position by one and leaves the counter zero for the next call. One launch replaces torch's argmax
reduction and the three small launches of the advance.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import cdiv, next_power_of_2
from sparseffn.kernels.launch import Launcher

BLOCK_V = 4096  # logits a program reads: 8 KB of bf16, 32 a thread at 4 warps
BLOCK_B = 16  # rows the last program reduces per step
NUM_WARPS = 4


@triton.jit
def _chunk_pick(vals, cols, valid, V):
    """Per row of [R, N] (value, index): (NaN, the first NaN's index) if the row's valid entries hold a NaN,
    else (their maximum, its first index)."""
    nan = (vals != vals) & valid
    first_nan = tl.min(tl.where(nan, cols, V), axis=1)
    best = tl.max(tl.where(valid & ~nan, vals, float("-inf")), axis=1)
    first_best = tl.min(tl.where(valid & (vals == best[:, None]), cols, V), axis=1)
    has_nan = first_nan < V
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, first_best)


@triton.jit
def _greedy_pick_kernel(logits_ptr, stride_lb, part_val_ptr, part_idx_ptr, count_ptr, out_ptr, stride_ob, ids_ptr,
                        position_ptr, B, V, CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
                        BLOCK_B: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    cols = c * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < V
    vals = tl.load(logits_ptr + b.to(tl.int64) * stride_lb + cols, mask=valid, other=float("-inf")).to(tl.float32)
    best, index = _chunk_pick(vals[None, :], cols[None, :], valid[None, :], V)  # [1]
    slot = b * CHUNKS + c + tl.arange(0, 1)
    tl.store(part_val_ptr + slot, best)
    tl.store(part_idx_ptr + slot, index)
    tl.debug_barrier()  # every thread's store is issued before the release below
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == B * CHUNKS - 1:
        position = tl.load(position_ptr)
        t = tl.arange(0, CHUNKS_PAD)
        for b0 in range(0, B, BLOCK_B):
            rows = b0 + tl.arange(0, BLOCK_B)
            inside = (rows[:, None] < B) & (t[None, :] < CHUNKS)  # [BLOCK_B, CHUNKS_PAD]
            at = rows[:, None] * CHUNKS + t[None, :]
            v = tl.load(part_val_ptr + at, mask=inside, other=float("-inf"), cache_modifier=".cg")
            i = tl.load(part_idx_ptr + at, mask=inside, other=V, cache_modifier=".cg")
            # chunk c's index lies in chunk c, so the first chunk's pick is the row's first index
            _, token = _chunk_pick(v, i, inside, V)  # [BLOCK_B]
            token = token.to(tl.int64)
            in_b = rows < B
            tl.store(out_ptr + rows.to(tl.int64) * stride_ob + position + 1, token, mask=in_b)
            tl.store(ids_ptr + rows, token, mask=in_b)
        tl.store(position_ptr, position + 1)
        tl.atomic_xchg(count_ptr, 0)  # left zero for the next call


_launch = Launcher(_greedy_pick_kernel)


def greedy_scratch(batch: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chunk values fp32, chunk indices int32, counter int32 zeroed) for `launch_greedy_pick` at [batch, vocab]."""
    chunks = cdiv(vocab, BLOCK_V)
    return (torch.empty(batch * chunks, dtype=torch.float32, device=device),
            torch.empty(batch * chunks, dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))


def launch_greedy_pick(logits: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, position: torch.Tensor,
                       scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """The kernel on arguments that meet ops.greedy_pick's contract, unchecked."""
    b, v = logits.shape
    chunks = cdiv(v, BLOCK_V)
    values, indices, counter = scratch
    _launch[(b, chunks)](logits, logits.stride(0), values, indices, counter, out, out.stride(0), ids, position, b, v,
                         CHUNKS=chunks, CHUNKS_PAD=next_power_of_2(chunks), BLOCK_V=BLOCK_V, BLOCK_B=BLOCK_B,
                         num_warps=NUM_WARPS)
