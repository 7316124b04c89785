"""What every sparse layer decides per call, in one place: whether to compute the L1 penalty, and
(auto mode) which path to take from the layer's measured activity.

    l1_wanted(layer, weights)        track_l1 None: in training mode, or when gradients flow to the
                                     weights; True / False: always / never
    auto_decision(layer, x, ...)     (mode, expected_nnz, previous) for ops.sparse_mlp, decided from
                                     `layer.expected_nnz` or `layer.activity` (nn/activity.py), with the
                                     last decision of the same kind of call for hysteresis
    count_call(layer, x, active)     the end of a counted call: a device-side sample when one is due

A counted call is a forward call outside torch.compile tracing, CUDA-graph capture (or
ops.sparse_mlp.as_captured) and backward (activation-checkpoint recomputation), so the activity and
the decisions depend only on the sequence of calls. The layer holds `mode`, `expected_nnz`, `track_l1`,
`activity`, `last_decision`.
"""

from __future__ import annotations

from typing import Callable

import torch

from sparseffn.ops.checks import check_expected_nnz
from sparseffn.ops.decide import DECODE_MAX_TOKENS, MODES, ModeDecision
from sparseffn.ops.sparse_mlp import call_traced, choose_mode
from sparseffn.ops.twell_mlp import stored_transposed


def checked_attribute(name: str, value: object) -> object:
    """`value` for the layer attribute `name` after its check (mode, expected_nnz, track_l1); any other
    attribute passes through."""
    if name == "mode" and value not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {value!r}")
    if name == "expected_nnz" and value is not None:
        return check_expected_nnz(value)
    if name == "track_l1" and value is not None and not isinstance(value, bool):
        raise TypeError(f"track_l1 must be None or a bool, got {type(value).__name__}")
    return value


def l1_wanted(layer, weights) -> bool:
    """Whether this call computes the L1 penalty (module docstring)."""
    track = layer.track_l1
    if track is not None:
        return track
    return layer.training or (torch.is_grad_enabled() and any(w is not None and w.requires_grad for w in weights))


def counted(x: torch.Tensor) -> bool:
    """Whether a call takes part in the activity's bookkeeping: not traced, captured or recomputed."""
    return not (call_traced(x) or torch._C._current_graph_task_id() != -1)


def auto_decision(layer, x: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor, training: bool,
                  is_counted: bool) -> tuple[str, float | None, str | None]:
    """(mode, expected_nnz, previous) for sparse_mlp in auto mode, decided here from the layer's
    `expected_nnz` or measured activity, so that sparse_mlp does not decide again."""
    activity = layer.activity
    if is_counted and layer.expected_nnz is None:
        activity.poll()
    tokens = x.numel() // max(x.shape[-1], 1)
    kind = "training" if training else ("decode" if tokens <= DECODE_MAX_TOKENS else "prefill")
    previous = activity.last.get(kind)
    expected = layer.expected_nnz if layer.expected_nnz is not None else activity.nnz
    if expected is None:
        decision = ModeDecision("dense", f"activity not measured yet (sampled every {activity.period} calls, "
                                         f"read {activity.lag} calls later)")
    else:
        decision = choose_mode(x, up_weight, expected_nnz=expected, needs_grad=training,
                               down_t_ready=stored_transposed(down_weight), previous=previous)
    activity.last[kind] = decision.mode
    layer.__dict__["last_decision"] = decision
    return decision.mode, expected, previous


def count_call(layer, x: torch.Tensor, active: Callable[[], torch.Tensor]) -> None:
    """End of a counted auto-mode call: take a sample when one is due. `active()` returns the number of
    active (token, unit) pairs of the call as a device scalar (computed only when sampled)."""
    if layer.expected_nnz is not None:
        return
    activity = layer.activity
    tokens = x.numel() // max(x.shape[-1], 1)
    if tokens and activity.wants_sample():
        with torch.no_grad():
            activity.record(active(), tokens)
    activity.tick()


def dense_l1(h: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of Σ_j |h_j| in fp32 (fp64 for fp64 h), 0 over no tokens: the L1 penalty of
    the dense paths that call modules."""
    per_token = h.abs().sum(-1, dtype=torch.float64 if h.dtype == torch.float64 else torch.float32)
    return per_token.mean() if per_token.numel() else per_token.sum()
