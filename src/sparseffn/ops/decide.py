"""Which path a sparse-MLP call takes: the rules of auto mode, as a pure function of the call's facts.
`decide` is the only place a path is chosen; `ops.sparse_mlp.choose_mode` gathers the facts of a call
(and a layer's measured activity, as data) and asks it, and every caller obeys the answer.

Paths: "dense" (three torch GEMMs) or "sparse" (Triton kernels; which ones follows from the call:
the training kernels for calls with gradients or the L1 penalty, the decode kernels for inference
calls of up to DECODE_MAX_TOKENS tokens, TwELL inference above that).

Auto mode takes the sparse path only where it was measured faster (`benchmarks/results/h200/`):
  - a GPU whose kernels were run and timed (VALIDATED_CAPABILITIES: the H200); elsewhere the kernels
    compile and `mode="sparse"` runs them, but auto mode stays dense and says why;
  - D >= AUTO_MIN_D (narrower MLPs make each gathered unit a short read whose latency is not hidden,
    and their dense GEMMs are cheap);
  - enough tokens: training >= AUTO_MIN_TOKENS_TRAIN, TwELL inference >= AUTO_MIN_TOKENS; decode
    calls (<= DECODE_MAX_TOKENS) when captured in a CUDA graph or compiled (eager, the decode path's
    host work per call exceeds dense torch's) and the transposed down weight is at hand without a copy;
  - and activations sparse enough: the expected active units per token must lie under the break-even
    of the path (`density_limit`); for decode calls, the expected union of the call's tokens' active
    units (`expected_union`: the batch's tokens together) under a fraction of H (`decode_union_limit`).
    Without an estimate the functional op assumes sparse activations; a layer passes its measured
    activity (nn/activity.py), and runs dense until it is measured, or while it is held (`Activity.hold`:
    its kernels still compiling in a background warm-up): `wait`, the first rule of auto mode.
Hysteresis: `previous`, the path this kind of call (`call_kind`) took last time, keeps a layer that runs
dense there until its estimate falls under HYSTERESIS x the limit, so it does not flip between paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparseffn.kernels._runtime import MIN_CAPABILITY, VALIDATED_CAPABILITIES, cdiv
from sparseffn.ops.overflow_rows import gemm_capacity

MODES = ("auto", "sparse", "dense")
KERNEL_DTYPES = (torch.bfloat16, torch.float16)

AUTO_MIN_TOKENS = 4096  # TwELL inference (the sparse path's host launch work exceeds its GPU time below)
AUTO_MIN_TOKENS_TRAIN = 16384  # the training kernels (break-even between 8192 and 16384 tokens)
DECODE_MAX_TOKENS = 64  # inference calls of at most this many tokens take the decode kernels
AUTO_MIN_D = 2048
# Break-even active units per token, as min(count, fraction of H) (small-H models break even at
# lower counts): TwELL inference lost at 110 per token on both measured shapes (break-even ~69 at
# D=2048/H=5632, ~83 at D=4096/H=14336).
PREFILL_MAX_NNZ = (64.0, 0.01)
# The training step at D=2048/H=5632, M=16384 (mlp_train_density.csv): 2.05x at 29 active units per
# token; without a heavy tail (no overflow rows) 1.28x at 55, 0.73x at 110, 0.53x at 160
# (~0.063 ms per unit per token against dense's 5.6 ms: break-even ~70, less the overflow GEMMs).
TRAIN_MAX_NNZ = (56.0, 0.01)
# Overflow rows of the training kernels (a TwELL tile over `slots` active units) run densely, up to
# gemm_capacity(M) of them as GEMMs (ops/overflow_rows.py), which cost the same with or without an
# overflow row (~0.3 ms and ~60 launches a step at M = 16384), against ~3.6 ms for the 81 rows of the
# synthetic tail at 55 units per token through the Triton backup alone. That tail (0.5% of the
# tokens at 12x the mean) overflows 32 slots of 256 from ~30 units per token (none at 29, 81 rows at
# 55): the GEMMs run where the expected count passes this fraction of the TwELL capacity (29.3 of
# 704 slots at H = 5632). Without an estimate (mode="sparse" with no expected_nnz) they do not run:
# the first GEMM version cost 2.81 -> 4.91 ms at 29, eagerly (host launch work).
OVERFLOW_GEMM_MIN_FILL = 1 / 24
# Decode calls pay while the union of the tokens' active units (`expected_union`: what the decode
# kernels read of the up and down matrices) stays under a fraction of H, per the kernels' padded token
# rows (kernels/decode_mlp.py: 1-2 tokens CUDA-core products, 3-16 one 16-row tile, 17-64 32/64 rows):
# (up to this many tokens, fraction). Isolated calls (decode_mlp.csv, c6ee0f0, D=2048/H=5632 unless
# noted, CUDA graphs, L2 flushed): 4-16 tokens 1.54-1.60x at unions of 2-8% and 1.32x at 26%; 64
# tokens 1.18x at 12% (D=4096), 1.02x at 26%, 1.04x at 35% (D=4096), 0.79x at 65%. In the whole
# captured step the kernels pay less than isolated: the SparseLM2B-shaped fixture (~106 units per token,
# docs/checkpoints.md) lost at 16 tokens (0.94x of dense) with layers at unions of 25-30%, where the
# isolated call won 1.32x, while the calibrated 2b (29 per token, 8% at 16 tokens) gained 1.15x. So the
# limits sit under the whole-step losses: 20% up to 16 tokens, 13% beyond (64 tokens won 1.18x at 12%
# isolated; the 64-row kernels cost more per call than the 16-row ones).
DECODE_MAX_UNION = ((2, 0.30), (16, 0.20), (DECODE_MAX_TOKENS, 0.13))
HYSTERESIS = 0.8


@dataclass(frozen=True)
class ModeDecision:
    mode: str  # "sparse" or "dense"
    reason: str
    # auto mode: the kind of call (`call_kind`) whose last path a layer records for the hysteresis;
    # None for a requested mode. Bookkeeping, not part of the explanation (not compared or shown).
    kind: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class CallFacts:
    """What the decision looks at: no data, no pointers (so it traces under torch.compile)."""

    device_type: str  # "cuda", or "cpu" (kernels interpreted when `interpreted`)
    capability: tuple[int, int]  # of the CUDA device
    dtype: torch.dtype
    d: int
    h: int
    tokens: int
    training: bool  # gradients or the L1 penalty: the training kernels
    interpreted: bool = False  # TRITON_INTERPRET=1 on a CPU tensor
    down_t_ready: bool = False  # down^T [H, D] at hand without a copy (decode kernels)
    traced: bool = False  # captured in a CUDA graph or traced by torch.compile: no host work per call


def call_kind(training: bool, tokens: int) -> str:
    """"training", "decode" (inference, at most DECODE_MAX_TOKENS tokens) or "prefill": the kinds of call
    auto mode keeps apart (each has its own break-even, and a layer its own last path per kind)."""
    return "training" if training else ("decode" if tokens <= DECODE_MAX_TOKENS else "prefill")


def expected_union(nnz: float, tokens: int, h: int) -> float:
    """Expected number of units at least one of `tokens` tokens activates, each activating `nnz` of the
    `h` units as if independently: H (1 - (1 - n/H)^T). Correlated units (the same units firing across
    tokens) make the true union smaller; tokens of very unequal counts make it larger."""
    if h <= 0 or tokens <= 0:
        return 0.0
    p = min(max(nnz / h, 0.0), 1.0)
    return h * (1.0 - (1.0 - p) ** tokens)


def decode_union_limit(tokens: int) -> float:
    """The largest union of active units, as a fraction of H, at which a decode call of `tokens` tokens
    (1 <= tokens <= DECODE_MAX_TOKENS) takes the decode kernels (DECODE_MAX_UNION)."""
    return next(f for most, f in DECODE_MAX_UNION if max(tokens, 1) <= most)


def train_break_even(h: int) -> float:
    """Active units per token under which a training call of an H-unit layer takes the sparse kernels
    (TRAIN_MAX_NNZ), before hysteresis."""
    count, fraction = TRAIN_MAX_NNZ
    return min(count, fraction * h)


def density_limit(facts: CallFacts) -> float:
    """Auto mode's break-even active units per token for this kind of call (for decode calls: the
    count per token at which the expected union of the call's tokens reaches `decode_union_limit`)."""
    if facts.training:
        return train_break_even(facts.h)
    if facts.tokens <= DECODE_MAX_TOKENS:
        tokens = max(facts.tokens, 1)
        return facts.h * (1.0 - (1.0 - decode_union_limit(tokens)) ** (1.0 / tokens))  # expected_union's inverse
    count, fraction = PREFILL_MAX_NNZ
    return min(count, fraction * facts.h)


def _blockers(facts: CallFacts) -> list[str]:
    """Why the sparse kernels cannot run this call at all (empty: they can)."""
    blockers = []
    if facts.device_type == "cuda":
        if facts.capability < MIN_CAPABILITY:
            major, minor = facts.capability
            blockers.append(f"compute capability {major}.{minor}: the kernels need "
                            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later (bf16 tensor cores)")
    elif not facts.interpreted:
        blockers.append(f"x is on {facts.device_type}: the Triton kernels need a CUDA device "
                        "(or TRITON_INTERPRET=1 on CPU)")
    if facts.dtype not in KERNEL_DTYPES:
        blockers.append(f"x is {facts.dtype}: the kernels take bf16 or fp16")
    if facts.training and facts.device_type == "cuda" and facts.d % 8:
        blockers.append(f"the training kernels need D % 8 == 0 on CUDA, got D = {facts.d}")
    return blockers


def decide(facts: CallFacts, mode: str = "auto", expected_nnz: float | None = None,
           previous: str | None = None, wait: str | None = None) -> ModeDecision:
    """The path for a call with these facts (module docstring). Raises NotImplementedError when
    mode="sparse" cannot run, ValueError for an unknown mode. `wait`: why auto mode must run dense for now
    (the layer's activity has no estimate yet, or its kernels are still compiling: it says so); None otherwise."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "dense":
        return ModeDecision("dense", "requested")
    if mode == "sparse":
        blockers = _blockers(facts)
        if blockers:
            raise NotImplementedError(f"mode='sparse' cannot run: {'; '.join(blockers)}")
        return ModeDecision("sparse", "requested")
    path, reason = _auto(facts, expected_nnz, previous, wait)
    return ModeDecision(path, reason, call_kind(facts.training, facts.tokens))


def _auto(facts: CallFacts, expected_nnz: float | None, previous: str | None,
          wait: str | None) -> tuple[str, str]:
    """(path, reason) of auto mode."""
    if wait is not None:
        return "dense", wait
    blockers = _blockers(facts)
    if blockers:
        return "dense", blockers[0]
    if facts.device_type != "cuda":
        return "dense", "auto mode never interprets kernels on CPU"
    if facts.capability not in VALIDATED_CAPABILITIES:
        major, minor = facts.capability
        return "dense", (f"compute capability {major}.{minor}: the kernels compile for it but were "
                         "measured only on 9.0 (H100/H200); mode='sparse' runs them")
    if facts.d < AUTO_MIN_D:
        return "dense", (f"D = {facts.d} < {AUTO_MIN_D}: too narrow for the sparse kernels to pay "
                         "(measured break-even near D = 1024)")
    if facts.training:
        if facts.tokens < AUTO_MIN_TOKENS_TRAIN:
            return "dense", (f"{facts.tokens} tokens < {AUTO_MIN_TOKENS_TRAIN}: too few for the training "
                             "kernels to pay (measured break-even between 8192 and 16384)")
        kind = "training"
    elif facts.tokens <= DECODE_MAX_TOKENS:
        if not facts.traced:
            return "dense", (f"{facts.tokens} tokens, eager: the decode path's host work per call "
                             "exceeds dense torch's (captured in a CUDA graph, it is the faster one)")
        if not facts.down_t_ready:
            return "dense", (f"{facts.tokens} tokens: the decode kernels read down^T, which this call "
                             "would copy (pass prepared weights, or use SparseMLP)")
        kind = "decode"
    elif facts.tokens < AUTO_MIN_TOKENS:
        return "dense", (f"{facts.tokens} tokens: between the decode kernels (<= {DECODE_MAX_TOKENS}) "
                         f"and TwELL inference (>= {AUTO_MIN_TOKENS}) dense torch is faster")
    else:
        kind = "TwELL inference"
    if expected_nnz is not None:
        limit = density_limit(facts)
        if previous == "dense":
            limit *= HYSTERESIS
        if expected_nnz > limit:
            union = ""
            if kind == "decode" and facts.tokens > 1:
                share = expected_union(expected_nnz, facts.tokens, facts.h) / max(facts.h, 1)
                union = f" (a union over {facts.tokens} tokens of ~{100 * share:.0f}% of H)"
            return "dense", (f"expected {expected_nnz:g} active units per token{union} > {limit:g}, the "
                             f"break-even of {kind}" + (" (hysteresis)" if previous == "dense" else ""))
    estimate = "" if expected_nnz is None else f", expected {expected_nnz:g} active units per token"
    return "sparse", f"{kind}: {facts.tokens} tokens{estimate}"


def overflow_gemm_rows(tokens: int, h: int, expected_nnz: float | None, tile: int, slots: int) -> int:
    """How many overflow rows of a training call run as GEMMs (the rest through the Triton dense
    backup): `gemm_capacity(tokens)` where the expected activity is high enough for rows to overflow
    (over OVERFLOW_GEMM_MIN_FILL of the TwELL capacity), else none (also without an estimate).
    Either way the result is exact."""
    if expected_nnz is None or expected_nnz <= OVERFLOW_GEMM_MIN_FILL * slots * cdiv(h, tile):
        return 0
    return gemm_capacity(tokens)
