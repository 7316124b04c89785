"""Weights prefetched into L2 by a launch that leaves the memory bandwidth idle (Hopper on).

At one token the decode step's attention and sparse down pass are chains of dependent round trips that
read little; the launches after them (o_proj, the gate, the next layer's q/k/v) are reads of 8-25 MB
each, latency-bound too. A launch given a prefetch list asks for those bytes into L2 while it runs
(`cp.async.bulk.prefetch.L2`, fire and forget: no register, no wait), so the reads after it hit L2.

The list: `l2_ranges(*tensors)`, an int64 tensor [R, 2] of (address, bytes) on the device, built once
(a CUDA graph replays it). A kernel taking one has an `l2_ptr` argument (None: no list) and the
constexprs of `l2_options`; it calls `prefetch_l2` once, where its own reads no longer need the
bandwidth. A prefetch changes no result: it only moves bytes into the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import HOPPER, capability, interpreting

L2_CAPABILITY = HOPPER  # cp.async.bulk is sm_90 on
MAX_RANGES = 4
CHUNK = tl.constexpr(4096)  # bytes one lane asks for per instruction


def l2_ranges(*tensors: torch.Tensor) -> torch.Tensor:
    """[R, 2] int64 (address, bytes) of each tensor's storage span, on their device: start rounded up
    and end down to 16 bytes (the bulk prefetch's granule). Contiguous tensors on one CUDA device."""
    if not 1 <= len(tensors) <= MAX_RANGES:
        raise ValueError(f"l2_ranges takes 1 to {MAX_RANGES} tensors, got {len(tensors)}")
    device = tensors[0].device
    rows = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.device != device:
            raise ValueError(f"l2_ranges: tensor {i} must be a contiguous tensor on {device}")
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        start = -(-start // 16) * 16
        end = end // 16 * 16
        rows.append((start, max(0, end - start)))
    return torch.tensor(rows, dtype=torch.int64, device=device)


def check_l2(l2: object, device: torch.device) -> None:
    """l2 is None or an `l2_ranges` list on `device`, a GPU that has the instruction."""
    if l2 is None:
        return
    if not isinstance(l2, torch.Tensor) or l2.dtype != torch.int64 or l2.dim() != 2 or l2.shape[1] != 2 \
            or not 1 <= l2.shape[0] <= MAX_RANGES or not l2.is_contiguous():
        raise ValueError(f"l2_prefetch must be None or an int64 tensor [R, 2] (l2_ranges), 1 <= R <= {MAX_RANGES}, "
                         f"got {getattr(l2, 'shape', type(l2).__name__)}")
    if l2.device != device:
        raise ValueError(f"l2_prefetch must be on {device}, got {l2.device}")
    if device.type != "cuda" or interpreting() or capability(device) < L2_CAPABILITY:
        raise ValueError("l2_prefetch needs a CUDA GPU of compute capability 9.0 or later (Hopper's "
                         "cp.async.bulk.prefetch), not the interpreter")


def l2_options(l2: torch.Tensor | None, num_warps: int) -> dict:
    """The constexprs of a kernel taking `l2` (checked): L2_RANGES (0: none) and L2_LANES (one lane a thread)."""
    return {"L2_RANGES": 0 if l2 is None else l2.shape[0], "L2_LANES": 32 * num_warps}


@triton.jit
def _bulk_prefetch(address, nbytes, on):
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [address, nbytes, on], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_l2(l2_ptr, program, programs, L2_RANGES: tl.constexpr, L2_LANES: tl.constexpr):
    """This program's share of the list's bytes into L2: CHUNK-byte pieces dealt round-robin over the
    launch's programs (every SM's copy engine takes part), L2_LANES a program at a time."""
    lane = tl.arange(0, L2_LANES).to(tl.int64)
    step = programs.to(tl.int64) * L2_LANES * CHUNK
    first = (lane * programs + program) * CHUNK  # [L2_LANES] byte offsets of the first pieces
    for r in tl.static_range(L2_RANGES):
        base = tl.load(l2_ptr + 2 * r)
        nbytes = tl.load(l2_ptr + 2 * r + 1)
        for start in range(0, nbytes, step):
            off = start + first
            size = tl.minimum(nbytes - off, CHUNK)
            _bulk_prefetch(base + off, size.to(tl.int32), (off < nbytes).to(tl.int32))
