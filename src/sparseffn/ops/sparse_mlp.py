"""`sparse_mlp`: the public functional entry of the sparse MLP, and its dispatch.

Semantics are those of `ops.reference.sparse_mlp_reference`, computed in the input dtype:

    y = down(relu(x gate^T - θ) * (x up^T))        or, with gate_weight=None,  y = down(relu(x up^T - θ))

The path is decided once per call, by `choose_mode` (the rules: ops/decide.py), and taken as decided:
the nn layers call `sparse_mlp_with_decision` with their measured activity as data and record the
decision it returns; nothing decides a second time. Paths:
- "sparse", inference, M <= DECODE_MAX_TOKENS: the decode kernels (kernels/decode_mlp.py: the gate
  matrix read once, up and down rows of active units only), custom op `sparseffn::decode_mlp`.
- "sparse", inference, larger M: TwELL (ops/twell_mlp.py), custom op `sparseffn::twell_mlp`. Exact for
  every input: rows whose tiles overflow are computed densely.
- "sparse", calls that need gradients or the L1 penalty (`return_l1=True`): the training kernels
  (ops/train_mlp.py), custom ops `sparseffn::sparse_mlp_train_fwd` / `_bwd` with autograd.
- "dense": three torch GEMMs in the input dtype.
The custom ops let torch.compile see one opaque node; eager calls skip their dispatch (ops/dispatch.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Protocol

import torch

from sparseffn.kernels._runtime import capability
from sparseffn.kernels.decode_mlp import decode_mlp, launch_decode_mlp
from sparseffn.ops.checks import check_sparse_mlp_args
from sparseffn.ops.decide import (DECODE_MAX_TOKENS, MODES, CallFacts, ModeDecision, call_kind, decide,
                                  overflow_gemm_rows)
from sparseffn.ops.dispatch import eager_call
from sparseffn.ops.train_mlp import sparse_mlp_train
from sparseffn.ops.twell_mlp import (SparseMLPWeights, dense_mlp, dense_mlp_inference, stored_transposed,
                                     threshold_vector, transposed_down, twell_mlp)

__all__ = ["MODES", "MeasuredActivity", "ModeDecision", "as_captured", "call_traced", "choose_mode", "sparse_mlp",
           "sparse_mlp_with_decision"]

_AS_CAPTURED = [0]  # depth of open as_captured() blocks (process-wide, like a CUDA graph capture)


@contextlib.contextmanager
def as_captured():
    """Calls inside run eagerly but take the paths they take under CUDA-graph capture (auto mode's
    decode kernels) and are not counted by the layers' activity. A warm-up step in this block before
    a capture loads those kernels: loading a GPU module while a stream captures invalidates the capture."""
    _AS_CAPTURED[0] += 1
    try:
        yield
    finally:
        _AS_CAPTURED[0] -= 1


def call_traced(x: torch.Tensor) -> bool:
    """Whether this call is traced by torch.compile, captured into a CUDA graph or in `as_captured()`."""
    # is_compiling first: under torch.compile the global is then never read (no guard on it)
    return torch.compiler.is_compiling() or bool(_AS_CAPTURED[0]) or (
        x.is_cuda and torch.cuda.is_current_stream_capturing())


class MeasuredActivity(Protocol):
    """What the decision reads of a layer's measured activity (nn/activity.py keeps it): data only."""

    nnz: float | None  # estimated active units per token; None until the first sample is read
    last: dict[str, str]  # kind of call (decide.call_kind) -> the path it took last time
    period: int  # a sample every `period` counted calls ...
    lag: int  # ... read `lag` calls later
    hold: str | None  # while set, why auto mode runs dense regardless (kernels still compiling in a warm-up)


def choose_mode(
    x: torch.Tensor,
    up_weight: torch.Tensor,
    *,
    mode: str = "auto",
    expected_nnz: float | None = None,
    needs_grad: bool = False,
    return_l1: bool = False,
    down_t_ready: bool = False,
    previous: str | None = None,
    activity: MeasuredActivity | None = None,
) -> ModeDecision:
    """Which path `sparse_mlp` takes for these arguments, and why (ops/decide.py has the rules).
    Raises if `mode="sparse"` cannot run.

    needs_grad / return_l1 select the training kernels; down_t_ready: the transposed down weight is
    at hand without a copy (prepared weights, or a down weight stored transposed), which auto mode
    needs for the decode kernels, which it takes under CUDA-graph capture or torch.compile; previous:
    the path this kind of call took last time (hysteresis). activity: a layer's measured activity
    (auto mode): its estimate stands in for expected_nnz when that is None (no estimate yet: dense,
    saying so), and its last path for this kind of call for previous, except while torch.compile
    traces: the path it records after each call would fail the guard on that read and recompile the
    caller after its first call, and a compiled decision cannot flip between calls anyway. Only shapes,
    dtypes, devices and these numbers are looked at, so the decision traces under torch.compile.
    """
    if mode == "dense":
        return _REQUESTED_DENSE
    d = x.shape[-1] if x.dim() else 0
    tokens = x.numel() // max(d, 1)
    training = needs_grad or return_l1
    wait = None
    compiling = torch.compiler.is_compiling()
    if activity is not None and mode == "auto":
        if not compiling:
            previous = activity.last.get(call_kind(training, tokens))
        if expected_nnz is None:
            expected_nnz = activity.nnz
            if expected_nnz is None:
                wait = (f"activity not measured yet (sampled every {activity.period} calls, "
                        f"read {activity.lag} calls later)")
        wait = activity.hold or wait
    traced = tokens <= DECODE_MAX_TOKENS and mode == "auto" and call_traced(x)
    # traced by torch.compile the decision is evaluated once, at trace time, into constants: the
    # memos (which dynamo would warn about and bypass) are skipped
    decision = _decision.__wrapped__ if compiling else _decision
    return decision(mode, d, tokens, x.dtype, x.device, _capability(x.device, compiling), up_weight.shape[0],
                    training, down_t_ready, traced, expected_nnz, previous, wait)


def _capability(device: torch.device, compiling: bool) -> tuple[int, int]:
    """The CUDA device's compute capability ((0, 0) off CUDA); traced, read without the launchers'
    memo (dynamo folds the device's properties into a constant)."""
    if device.type != "cuda":
        return (0, 0)
    return tuple(torch.cuda.get_device_capability(device)) if compiling else capability(device)


_REQUESTED_DENSE = ModeDecision("dense", "requested")


@functools.lru_cache(maxsize=4096)
def _decision(mode, d, tokens, dtype, device, cap, h, training, down_t_ready, traced, expected_nnz,
              previous, wait) -> ModeDecision:
    """`decide` memoized on what it looks at (a decode step asks the same question every call; the
    facts and rules cost more host time than the decode kernels' launches)."""
    facts = CallFacts(
        device_type=device.type,
        capability=cap,
        dtype=dtype, d=d, h=h, tokens=tokens, training=training,
        interpreted=device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1",
        down_t_ready=down_t_ready, traced=traced,
    )
    return decide(facts, mode, expected_nnz, previous, wait)


@torch.library.custom_op("sparseffn::twell_mlp", mutates_args=())
def _twell_mlp_op(
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    down_t: torch.Tensor,
    threshold: torch.Tensor | None,
    tile: int,
    slots: int,
    deterministic: bool,
) -> torch.Tensor:
    weights = SparseMLPWeights(gate_weight, up_weight, down_weight, down_t)
    return twell_mlp(x, weights, threshold, tile=tile, slots=slots, deterministic=deterministic)


@_twell_mlp_op.register_fake
def _(x, gate_weight, up_weight, down_weight, down_t, threshold, tile, slots, deterministic):
    return x.new_empty(x.shape)


@torch.library.custom_op("sparseffn::decode_mlp", mutates_args=())
def _decode_mlp_op(
    x: torch.Tensor,
    first_weight: torch.Tensor,
    up_weight: torch.Tensor | None,
    down_t: torch.Tensor,
    threshold: torch.Tensor | None,
) -> torch.Tensor:
    return decode_mlp(x, first_weight, up_weight, down_t, threshold)


@_decode_mlp_op.register_fake
def _(x, first_weight, up_weight, down_t, threshold):
    return x.new_empty(x.shape)


def sparse_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    threshold: torch.Tensor | float | None = None,
    *,
    return_l1: bool = False,
    mode: str = "auto",
    prepared: SparseMLPWeights | None = None,
    expected_nnz: float | None = None,
    previous: str | None = None,
    tile: int = 256,
    slots: int = 32,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = down(relu(x gate^T - θ) * (x up^T)), or down(relu(x up^T - θ)) when gate_weight is None.

    x [..., D]; gate_weight, up_weight [H, D]; down_weight [D, H] (Hugging Face layouts; a down
    weight stored transposed, `down_weight.t()` contiguous, is read without a copy); threshold None,
    a number, or a per-unit tensor [H]. Returns [..., D] in x's dtype. Differentiable with respect to
    x and the three weights (the threshold is a constant).

    return_l1: also return the layer's L1 penalty (docs/design.md), an fp32 scalar: the mean over
    tokens of Σ_j |h_j|, h = relu(x gate^T - θ) * (x up^T) (or relu(x up^T - θ)). Differentiable, so
    `loss = ce + coeff * l1` gets exactly that loss's gradient.

    mode: "auto" (see `choose_mode`), "sparse" (Triton kernels; raises NotImplementedError where
    they cannot run) or "dense". prepared: `SparseMLPWeights.prepare(gate, up, down)` built once and
    reused (it holds down^T; without it and without a transposed down weight the sparse path copies
    down^T on every call, and auto mode does not take the decode kernels; under a caller's
    torch.compile(mode="reduce-overhead") its tensors are read in place by the CUDA graphs, and a
    threshold tensor should be a module buffer, or it is copied before each replay). expected_nnz: the
    caller's estimate of active units per token, used by auto mode, with `previous` (the path this
    kind of call took last time) for its hysteresis, and by training calls in either mode to run
    their overflow rows as GEMMs or not (`decide.overflow_gemm_rows`). tile/slots: TwELL capacity.
    Under `torch.use_deterministic_algorithms(True)` outputs and gradients have the same bits on
    every run (by default the rows of over 128 active units past the 256th in one call may not:
    kernels/row_split.py, "Bits").
    """
    return sparse_mlp_with_decision(x, gate_weight, up_weight, down_weight, threshold, return_l1=return_l1,
                                    mode=mode, prepared=prepared, expected_nnz=expected_nnz, previous=previous,
                                    tile=tile, slots=slots)[0]


def sparse_mlp_with_decision(
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    threshold: torch.Tensor | float | None = None,
    *,
    return_l1: bool = False,
    mode: str = "auto",
    prepared: SparseMLPWeights | None = None,
    expected_nnz: float | None = None,
    previous: str | None = None,
    activity: MeasuredActivity | None = None,
    tile: int = 256,
    slots: int = 32,
) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], ModeDecision]:
    """(`sparse_mlp`'s result, the decision it followed): the entry of the nn layers, which pass their
    measured `activity` (see `choose_mode`) and record the decision. One decision per call."""
    check_sparse_mlp_args(x, gate_weight, up_weight, down_weight, threshold, return_l1=return_l1, prepared=prepared,
                          expected_nnz=expected_nnz, tile=tile, slots=slots)
    if isinstance(threshold, torch.Tensor) and threshold.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError("threshold requires grad: sparse_mlp treats the threshold as a constant "
                                  "(pass threshold.detach())")
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or up_weight.requires_grad or down_weight.requires_grad
        or (gate_weight is not None and gate_weight.requires_grad)
    )
    down_t_ready = prepared is not None or stored_transposed(down_weight)
    decision = choose_mode(x, up_weight, mode=mode, expected_nnz=expected_nnz, needs_grad=needs_grad,
                           return_l1=return_l1, down_t_ready=down_t_ready, previous=previous, activity=activity)
    estimate = activity.nnz if expected_nnz is None and activity is not None else expected_nnz
    return _run(decision.mode == "sparse", x, gate_weight, up_weight, down_weight, threshold, needs_grad, return_l1,
                prepared, tile, slots, estimate), decision


def _run(sparse, x, gate_weight, up_weight, down_weight, threshold, needs_grad, return_l1, prepared, tile, slots,
         expected_nnz):
    """The decided path (checked arguments)."""
    if x.numel() == 0 or up_weight.numel() == 0:  # M, D or H = 0: nothing for the kernels; the dense math is exact
        return dense_mlp(x, gate_weight, up_weight, down_weight, threshold, return_l1=return_l1)
    if not sparse:
        if needs_grad or return_l1:
            return dense_mlp(x, gate_weight, up_weight, down_weight, threshold, return_l1=return_l1)
        return dense_mlp_inference(x, gate_weight, up_weight, down_weight, threshold)
    x2d = x.reshape(-1, x.shape[-1])
    theta = threshold_vector(threshold, up_weight.shape[0], x.device)
    if needs_grad or return_l1:
        gemm_rows = overflow_gemm_rows(x2d.shape[0], up_weight.shape[0], expected_nnz, tile, slots)
        y, l1 = sparse_mlp_train(x2d.contiguous(), gate_weight, up_weight, down_weight, theta, tile=tile, slots=slots,
                                 gemm_rows=gemm_rows)
        return (y.view(x.shape), l1) if return_l1 else y.view(x.shape)
    down_t = prepared.down_t if prepared is not None else transposed_down(down_weight)
    eager = eager_call(x2d, gate_weight, up_weight, down_weight, theta)
    if 1 <= x2d.shape[0] <= DECODE_MAX_TOKENS:
        first = gate_weight if gate_weight is not None else up_weight
        up = up_weight if gate_weight is not None else None
        x2d = x2d if x2d.shape[-1] <= 1 or x2d.stride(-1) == 1 else x2d.contiguous()
        if eager and _unit_rows(first, up, down_t):  # the rest of decode_mlp's contract checked above
            y = launch_decode_mlp(x2d, first, up, down_t, theta)
        elif eager:
            y = decode_mlp(x2d, first, up, down_t, theta)  # names the weight without unit stride
        else:
            y = _decode_mlp_op(x2d, first, up, down_t, theta)
        return y.view(x.shape)
    deterministic = torch.are_deterministic_algorithms_enabled()
    if eager:  # the op's body, without its dispatch
        y = twell_mlp(x2d, SparseMLPWeights(gate_weight, up_weight, down_weight, down_t), theta, tile=tile,
                      slots=slots, deterministic=deterministic)
    else:
        y = _twell_mlp_op(x2d, gate_weight, up_weight, down_weight, down_t, theta, tile, slots, deterministic)
    return y.view(x.shape)


def _unit_rows(*weights: torch.Tensor | None) -> bool:
    """Whether every weight has unit stride along D (what the kernels read as rows)."""
    return all(w is None or w.shape[1] <= 1 or w.stride(1) == 1 for w in weights)
