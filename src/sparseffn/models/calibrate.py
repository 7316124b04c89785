"""`calibrate_thresholds`: per-unit thresholds that give every layer a target sparsity (docs/design.md, "Thresholds").

For each layer in order (a layer's θ changes the inputs of the later layers), on the sample batches:

1. capture the layer's inputs x (the model runs up to that layer and stops) and its gate
   pre-activations g = gate_proj(x) [N tokens, H units];
2. per unit, q_j = the quantile of its own g_{·j} above which it would fire on target/H of the tokens;
3. θ_j(t) = max(0, mix · q_j + (1 - mix) · t): the unit's own quantile mixed with one global level t.
   mix = 0 is one global threshold (units with large pre-activations fire far more often than
   others, dead units stay dead); mix = 1 makes every unit fire at the same rate (unrealistically
   uniform). The default 0.5 keeps a wide, heavy-tailed spread of per-unit firing rates;
4. bisection on t until the mean number of active units per token, Σ_j #{tokens: g_j > θ_j} / N,
   hits the target (counted exactly with one sorted copy of g and `searchsorted`, O(H log N) a step).

θ is rounded to the weights' dtype, so the dense path (which compares in that dtype) fires on exactly
g > θ. θ ≥ 0: a threshold only removes activations, so a layer whose plain ReLU already fires fewer
units than the target keeps θ = 0 and is reported as not reached (with a warning). After the last
layer, one more pass over the batches measures what the model really does (`activation_mask`); the
report holds those measured numbers.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import replace

import torch
from torch import nn

from sparseffn.models.config import SparsityConfig
from sparseffn.models.sparsify import CONFIG_KEY, named_sparse_mlps
from sparseffn.nn import SparseMLP

BISECTION_STEPS = 64
SORT_CHUNK = 256  # units sorted at a time


class _Stop(Exception):
    """Raised by a capture hook to end the forward pass at the layer being calibrated."""


def _check_batches(batches) -> list[torch.Tensor]:
    if isinstance(batches, torch.Tensor):
        batches = [batches]
    try:
        batches = list(batches)
    except TypeError:
        raise TypeError(f"batches must be an iterable of input_ids tensors [B, T], got {type(batches).__name__}") from None
    if not batches:
        raise ValueError("batches is empty: calibration needs at least one batch of input_ids")
    for i, ids in enumerate(batches):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"batches[{i}] must be a torch.Tensor of input_ids, got {type(ids).__name__}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"batches[{i}] must hold integer token ids, got {ids.dtype}")
        if ids.dim() != 2 or ids.numel() == 0:
            raise ValueError(f"batches[{i}] must be a non-empty [B, T] tensor, got shape {tuple(ids.shape)}")
    return batches


def _model_device(model: nn.Module) -> torch.device:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        return embeddings.weight.device
    return next(model.parameters()).device


def _run(model: nn.Module, batches: list[torch.Tensor], device: torch.device) -> None:
    for ids in batches:
        try:
            model(input_ids=ids.to(device), use_cache=False)
        except _Stop:
            pass


def _capture_inputs(model, mlp: SparseMLP, batches, device) -> torch.Tensor:
    """The inputs x [N, D] the model feeds `mlp` on the batches (the forward stops at `mlp`)."""
    captured: list[torch.Tensor] = []

    def hook(module, args):
        captured.append(args[0].detach().reshape(-1, args[0].shape[-1]))
        raise _Stop

    handle = mlp.register_forward_pre_hook(hook)
    try:
        _run(model, batches, device)
    finally:
        handle.remove()
    if len(captured) != len(batches):
        raise RuntimeError(f"the layer ran on {len(captured)} of {len(batches)} batches: is it part of model's forward?")
    return torch.cat(captured)


def _first_projection(mlp: SparseMLP, x: torch.Tensor) -> torch.Tensor:
    first = mlp.gate_proj if mlp.gate_proj is not None else mlp.up_proj
    if first.weight.dtype != x.dtype:
        x = x.to(first.weight.dtype)
    return first(x).float()


def _fit(g: torch.Tensor, target: float, mix: float, dtype: torch.dtype, tolerance: float):
    """θ [H] (fp32, rounded to dtype), the global level t, and the mean nnz it gives on g [N, H]."""
    n, h = g.shape
    sorted_g = torch.empty(h, n, dtype=g.dtype, device=g.device)  # [H, N] ascending, per unit
    for start in range(0, h, SORT_CHUNK):  # in chunks: sort's int64 indices would be 2x the size of g
        sorted_g[start : start + SORT_CHUNK] = g[:, start : start + SORT_CHUNK].t().sort(dim=1).values
    rank = min(max(math.ceil(n * (1.0 - target / h)) - 1, 0), n - 1)
    own = sorted_g[:, rank].double()  # [H] per-unit quantile q_j

    def theta_at(level: float) -> torch.Tensor:
        theta = (mix * own + (1.0 - mix) * level).clamp_min(0.0)
        return theta.to(dtype).float()

    def mean_nnz(theta: torch.Tensor) -> float:
        below = torch.searchsorted(sorted_g, theta[:, None], right=True)  # [H, 1] tokens with g <= θ_j
        return float((n - below).sum()) / n

    zero = torch.zeros(h, dtype=torch.float32, device=g.device)
    natural = mean_nnz(zero)
    if natural <= target:
        return zero, float("nan"), natural
    # t = lo: every θ_j <= 0 (natural > target); t = hi: every θ_j above every g (nnz = 0 <= target).
    lo = -mix * float(own.max()) / (1.0 - mix) - 1.0
    hi = (float(sorted_g[:, -1].max()) - mix * float(own.min())) / (1.0 - mix) + 1.0
    best = (natural, lo)
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        nnz = mean_nnz(theta_at(mid))
        if abs(nnz - target) < abs(best[0] - target):
            best = (nnz, mid)
        if abs(nnz - target) <= 0.1 * tolerance * target:
            break
        lo, hi = (mid, hi) if nnz > target else (lo, mid)
    nnz, level = best
    return theta_at(level), level, nnz


def _measure(model, mlps: list[SparseMLP], batches, device) -> list[dict]:
    """Per layer: mean and max active units per token and the fraction of units that never fired."""
    stats = [{"tokens": 0, "sum": 0.0, "max": 0, "fired": None} for _ in mlps]

    def make_hook(i):
        def hook(module, args):
            mask = module.activation_mask(args[0]).reshape(-1, module.intermediate_size)
            counts = mask.sum(-1)
            s = stats[i]
            s["tokens"] += counts.numel()
            s["sum"] += float(counts.sum())
            s["max"] = max(s["max"], int(counts.max()))
            fired = mask.any(0)
            s["fired"] = fired if s["fired"] is None else s["fired"] | fired

        return hook

    handles = [m.register_forward_pre_hook(make_hook(i)) for i, m in enumerate(mlps)]
    try:
        _run(model, batches, device)
    finally:
        for handle in handles:
            handle.remove()
    return [
        {"mean_nnz": s["sum"] / s["tokens"], "max_nnz": s["max"], "dead_fraction": 1.0 - float(s["fired"].float().mean())}
        for s in stats
    ]


def calibrate_thresholds(
    model: nn.Module,
    batches,
    target_nnz: float,
    *,
    tolerance: float = 0.05,
    mix: float = 0.5,
) -> list[dict]:
    """Set per-unit thresholds so each SparseMLP fires `target_nnz` units per token on average.

    model: a sparsified causal LM (`model(input_ids=..., use_cache=False)` must run it). batches:
    an iterable of input_ids tensors [B, T] (moved to the model's device; read once per layer, so
    it is materialized into a list). target_nnz: mean active units per token per layer, 0 < target < H.
    tolerance: relative error accepted on the measured mean (a warning names the layers outside it).
    mix: weight of each unit's own quantile against the global level, in [0, 1) (module docstring).

    Each layer's `expected_nnz` is set to target_nnz, and so is the `expected_nnz` of the recorded
    `model.config.sparseffn`. Returns, per layer in order: layer, name, target_nnz, mean_nnz and
    max_nnz (measured by running the calibrated model), calibration_nnz (the estimate while fitting),
    level, threshold_mean/std/min/max, zero_threshold_fraction, dead_fraction, reached.
    """
    named = named_sparse_mlps(model)
    if not named:
        raise ValueError(f"model ({type(model).__name__}) has no SparseMLP: sparsify_ it before calibrating")
    batches = _check_batches(batches)
    if not isinstance(target_nnz, numbers.Real) or isinstance(target_nnz, bool):
        raise TypeError(f"target_nnz must be a number, got {type(target_nnz).__name__}")
    smallest = min(m.intermediate_size for _, m in named)
    if not 0 < target_nnz < smallest:
        raise ValueError(f"target_nnz must be in (0, H) = (0, {smallest}), got {target_nnz}")
    for name, value in (("tolerance", tolerance), ("mix", mix)):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
    if not 0 <= mix < 1:
        raise ValueError(f"mix must be in [0, 1), got {mix}")
    target = float(target_nnz)
    device = _model_device(model)
    mlps = [m for _, m in named]
    was_training, tracked = model.training, [m.track_l1 for m in mlps]
    fits = []
    model.eval()
    try:
        for m in mlps:
            m.track_l1 = False
        with torch.no_grad():
            for _, mlp in named:
                g = _first_projection(mlp, _capture_inputs(model, mlp, batches, device))
                theta, level, estimate = _fit(g, target, mix, mlp.up_proj.weight.dtype, tolerance)
                del g
                mlp.set_threshold_(theta)
                mlp.expected_nnz = target
                fits.append((level, estimate))
            measured = _measure(model, mlps, batches, device)
    finally:
        for m, track in zip(mlps, tracked):
            m.track_l1 = track
            m.last_l1 = None
        model.train(was_training)

    config = getattr(model, "config", None)
    if config is not None and getattr(config, CONFIG_KEY, None) is not None:
        recorded = SparsityConfig.from_dict(getattr(config, CONFIG_KEY))
        setattr(config, CONFIG_KEY, replace(recorded, expected_nnz=target).to_dict())

    report = []
    for i, ((name, mlp), (level, estimate), stats) in enumerate(zip(named, fits, measured)):
        theta = mlp.threshold
        report.append(
            {
                "layer": i,
                "name": name,
                "target_nnz": target,
                "mean_nnz": stats["mean_nnz"],
                "max_nnz": stats["max_nnz"],
                "calibration_nnz": estimate,
                "level": level,
                "threshold_mean": float(theta.mean()),
                "threshold_std": float(theta.std()) if theta.numel() > 1 else 0.0,
                "threshold_min": float(theta.min()),
                "threshold_max": float(theta.max()),
                "zero_threshold_fraction": float((theta == 0).float().mean()),
                "dead_fraction": stats["dead_fraction"],
                "reached": abs(stats["mean_nnz"] - target) <= tolerance * target,
            }
        )
    missed = [r for r in report if not r["reached"]]
    if missed:
        detail = ", ".join(f"{r['name']}: {r['mean_nnz']:.1f}" for r in missed[:4])
        warnings.warn(
            f"calibrate_thresholds: {len(missed)} layer(s) outside {tolerance:.0%} of target_nnz={target:g} ({detail}); "
            f"a layer whose plain ReLU fires fewer units keeps θ = 0",
            stacklevel=2,
        )
    return report
