"""How every sparse layer calls the op: whether to compute the L1 penalty, and the call of
`ops.sparse_mlp` with the layer's state as data. The path is not decided here: the op decides once
(ops/decide.py, through `choose_mode`) from what the layer passes, and the layer records the answer.

    l1_wanted(layer, weights)        track_l1 None: in training mode, or when gradients flow to the
                                     weights; True / False: always / never
    run_sparse_mlp(layer, x, ...)    the op's result; passes `mode`, `expected_nnz` and `activity`
                                     (nn/activity.py) down, records the decision in auto mode
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
from sparseffn.ops.decide import MODES
from sparseffn.ops.sparse_mlp import call_traced, sparse_mlp_with_decision


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


def run_sparse_mlp(layer, x: torch.Tensor, gate_weight: torch.Tensor | None, up_weight: torch.Tensor,
                   down_weight: torch.Tensor, threshold: torch.Tensor | None, track: bool,
                   active: Callable[[], torch.Tensor]):
    """`ops.sparse_mlp`'s result for the layer's call: its `mode`, `expected_nnz` and measured activity go
    down as data, the op decides once and runs, and the decision comes back to be recorded (auto mode:
    `last_decision`, and outside torch.compile tracing the activity's last path of this kind of call). A counted call polls its activity
    first and may take a sample after (`count_call`; `active()` as there). x and the weights are already
    in the dtype to run (autocast is off inside the op)."""
    mode, activity = layer.mode, layer.activity
    auto = mode == "auto"
    is_counted = auto and counted(x)
    if is_counted and layer.expected_nnz is None:
        activity.poll()
    with torch.autocast(x.device.type, enabled=False):
        out, decision = sparse_mlp_with_decision(x, gate_weight, up_weight, down_weight, threshold, return_l1=track,
                                                 mode=mode, expected_nnz=layer.expected_nnz,
                                                 activity=activity if auto else None)
    if auto:
        if not torch.compiler.is_compiling():  # traced, the write would guard on the dict and recompile
            activity.last[decision.kind] = decision.mode  # (compiled decisions skip the hysteresis)
        layer.__dict__["last_decision"] = decision
    if is_counted:  # after the op: its checks ran on x
        count_call(layer, x, active)
    return out


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
