"""What persistent kernels share (one launch running several dependent phases, the one-token decode
layer): a barrier across every program of the grid, and asking L2 for a later phase's weights.

    grid_sync(count_ptr, target): every program adds one to *count_ptr once it has issued all its
    writes of the phase (release, GPU scope), then waits until the count reaches `target` (acquire);
    the i-th barrier of a launch of P programs waits for i·P. grid_exit(count_ptr, exit_ptr, P)
    after a launch's last barrier: the last program to leave resets both counters to zero, so the
    next launch starts from zero (every program has passed the last barrier by then).
    prefetch_l2(ptr, n_bytes, part, parts): part `part` of `parts` of the n_bytes from ptr asked into
    L2 (`prefetch.global.L2`, one per 128-byte line, spread over the program's threads); nothing waits
    for it, so a phase that does not use the bandwidth fully (attention, the down pass, a barrier)
    streams the next phase's weights meanwhile.

Contract. Every program of the grid must be resident at once (the launcher sizes the grid from the
kernel's occupancy: a program that cannot start would hang the others). Under the interpreter, which
runs programs one after another, a barrier would never open, and inline PTX does not run: kernels
there run their phases as separate launches (their SYNC constexpr off) and skip the prefetch.
"""

from __future__ import annotations

import triton
import triton.language as tl

LINE = 128  # bytes per prefetch


@triton.jit
def grid_sync(count_ptr, target):
    tl.debug_barrier()  # every thread's writes of the phase are issued before the release below
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def grid_exit(count_ptr, exit_ptr, programs):
    if tl.atomic_add(exit_ptr, 1, sem="acq_rel", scope="gpu") == programs - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(exit_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def prefetch_l2(ptr, n_bytes, part, parts, THREADS: tl.constexpr):
    lines = tl.cdiv(n_bytes, 128)
    share = tl.cdiv(lines, parts)
    first = part * share
    last = tl.minimum(first + share, lines)
    base = ptr.to(tl.pointer_type(tl.int8), bitcast=True)
    for l0 in range(first, last, THREADS):
        line = l0 + tl.arange(0, THREADS)
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                                  "=r,l,r", [base + line.to(tl.int64) * 128, (line < last).to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
