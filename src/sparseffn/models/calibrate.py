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

Batches are input_ids tensors or tokenizer outputs (mappings with `input_ids` and, optionally,
`attention_mask`): padded positions (mask 0) are run through the model with the mask and left out of
every statistic. A mapping may also hold `calibration_mask` [B, T]: positions with 0 there are attended
to as usual but left out of every statistic (for example a prompt, to fit the generated positions).
Layers: SparseMLP and HFSparseMLP fit one θ [H]; SparseExperts fit one θ_e [H] per expert on the tokens
routed to it (an expert that saw no token keeps θ_e = 0), and their statistics count token-expert
pairs.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from sparseffn.models.config import SparsityConfig
from sparseffn.models.sparsify import CONFIG_KEY, named_sparse_layers, sync_config
from sparseffn.nn import SparseExperts, SparseMLP

BISECTION_STEPS = 64
SORT_CHUNK = 256  # units sorted at a time


class _Stop(Exception):
    """Raised by a capture hook to end the forward pass at the layer being calibrated."""


def _check_batches(batches) -> list[dict]:
    """[{"input_ids": [B, T], "attention_mask": [B, T] or None, "stat_mask": [B, T] bool or None}] from
    tensors or tokenizer outputs (stat_mask: the positions the statistics count)."""
    if isinstance(batches, (torch.Tensor, Mapping)):
        batches = [batches]
    try:
        batches = list(batches)
    except TypeError:
        raise TypeError(
            f"batches must be an iterable of input_ids tensors [B, T] or tokenizer outputs, got {type(batches).__name__}"
        ) from None
    if not batches:
        raise ValueError("batches is empty: calibration needs at least one batch of input_ids")
    checked = []
    for i, batch in enumerate(batches):
        mask = counted = None
        if isinstance(batch, Mapping):
            if "input_ids" not in batch:
                raise ValueError(f"batches[{i}] is a mapping without 'input_ids' (keys: {sorted(batch)})")
            ids, mask, counted = batch["input_ids"], batch.get("attention_mask"), batch.get("calibration_mask")
        else:
            ids = batch
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"batches[{i}] must be a torch.Tensor of input_ids, got {type(ids).__name__}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"batches[{i}] must hold integer token ids, got {ids.dtype}")
        if ids.dim() != 2 or ids.numel() == 0:
            raise ValueError(f"batches[{i}] must be a non-empty [B, T] tensor, got shape {tuple(ids.shape)}")
        for key, value in (("attention_mask", mask), ("calibration_mask", counted)):
            if value is not None and (not isinstance(value, torch.Tensor) or value.shape != ids.shape):
                raise ValueError(f"batches[{i}]['{key}'] must be a tensor of input_ids' shape "
                                 f"{tuple(ids.shape)}, got {getattr(value, 'shape', type(value).__name__)}")
        if mask is not None and not bool(mask.bool().any()):
            raise ValueError(f"batches[{i}]['attention_mask'] masks every token")
        stat = None if mask is None else mask.bool()
        if counted is not None:
            stat = counted.bool() if stat is None else counted.bool() & stat.to(counted.device)
            if not bool(stat.any()):
                raise ValueError(f"batches[{i}]['calibration_mask'] (with the attention mask) leaves no token to count")
        checked.append({"input_ids": ids, "attention_mask": mask, "stat_mask": stat})
    return checked


def _model_device(model: nn.Module) -> torch.device:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        return embeddings.weight.device
    return next(model.parameters()).device


def _run(model: nn.Module, batches: list[dict], device: torch.device, current: list) -> None:
    """Run the model on each batch; `current[0]` holds the batch's flattened mask of counted tokens meanwhile."""
    for batch in batches:
        ids, mask, stat = batch["input_ids"], batch["attention_mask"], batch["stat_mask"]
        current[:] = [None if stat is None else stat.reshape(-1).to(device)]
        kwargs = {"input_ids": ids.to(device), "use_cache": False}
        if mask is not None:
            kwargs["attention_mask"] = mask.to(device)
        try:
            model(**kwargs)
        except _Stop:
            pass


def _rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """x's counted tokens [N, D] (not padded, not left out by a calibration mask; x is [B, T, D] or [B * T, D])."""
    x = x.detach().reshape(-1, x.shape[-1])
    if mask is None:
        return x
    if mask.numel() != x.shape[0]:
        raise RuntimeError(f"a sparse layer saw {x.shape[0]} tokens for an attention mask of {mask.numel()}")
    return x[mask]


def _capture(model, layer, batches, device) -> list[torch.Tensor]:
    """Per group of the layer (one, or one per expert): the pre-activations g [N, H] on the batches,
    in fp32, padded tokens left out; the forward stops at the layer."""
    captured: list = []
    current: list = [None]
    experts = isinstance(layer, SparseExperts)

    def hook(module, args):
        if experts:
            captured.append((_rows(args[0], current[0]), _rows(args[1], current[0])))
        else:
            captured.append(_rows(args[0], current[0]))
        raise _Stop

    handle = layer.register_forward_pre_hook(hook)
    try:
        _run(model, batches, device, current)
    finally:
        handle.remove()
    if len(captured) != len(batches):
        raise RuntimeError(f"the layer ran on {len(captured)} of {len(batches)} batches: is it part of model's forward?")
    if not experts:
        return [_pre_activation(layer, torch.cat(captured))]
    x, index = torch.cat([c[0] for c in captured]), torch.cat([c[1] for c in captured])
    groups = []
    for e in range(layer.num_experts):
        rows = (index == e).any(-1)
        xe = x[rows]
        groups.append(layer.pre_activation(xe.to(layer.weight_dtype), e).float())
    return groups


def _pre_activation(layer, x: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, SparseMLP):
        first = layer.gate_proj if layer.gate_proj is not None else layer.up_proj
        if first.weight.dtype != x.dtype:
            x = x.to(first.weight.dtype)
        return first(x).float()
    return layer.pre_activation(x.to(layer.weight_dtype)).float()


def _weight_dtype(layer) -> torch.dtype:
    return layer.up_proj.weight.dtype if isinstance(layer, SparseMLP) else layer.weight_dtype


def _fit(g: torch.Tensor, target: float, mix: float, dtype: torch.dtype, tolerance: float):
    """θ [H] (fp32, rounded to dtype), the global level t, and the mean nnz it gives on g [N, H]."""
    n, h = g.shape
    if n == 0:  # an expert no calibration token was routed to
        return torch.zeros(h, dtype=torch.float32, device=g.device), float("nan"), 0.0
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


def _active(layer, args, mask) -> list[torch.Tensor]:
    """Bool activity [n, H] per group of the layer for one call (padded tokens left out)."""
    if not isinstance(layer, SparseExperts):
        return [layer.activation_mask(_rows(args[0], mask).to(_weight_dtype(layer)))]
    x, index = _rows(args[0], mask).to(layer.weight_dtype), _rows(args[1], mask)
    groups = []
    for e in range(layer.num_experts):
        g = layer.pre_activation(x[(index == e).any(-1)], e)
        if layer.has_threshold:
            g = g - layer.threshold[e].to(g.dtype)
        groups.append(torch.relu(g) != 0)
    return groups


def _measure(model, layers: list, batches, device) -> list[dict]:
    """Per layer: mean and max active units per token (per token-expert pair for experts) and the
    fraction of units that never fired."""
    stats = [{"tokens": 0, "sum": 0.0, "max": 0, "fired": None} for _ in layers]
    current: list = [None]

    def make_hook(i):
        def hook(module, args):
            groups = _active(module, args, current[0])
            s = stats[i]
            for mask in groups:
                counts = mask.sum(-1)
                s["tokens"] += counts.numel()
                s["sum"] += float(counts.sum())
                s["max"] = max(s["max"], int(counts.max()) if counts.numel() else 0)
            fired = torch.stack([m.any(0) for m in groups])
            s["fired"] = fired if s["fired"] is None else s["fired"] | fired

        return hook

    handles = [m.register_forward_pre_hook(make_hook(i)) for i, m in enumerate(layers)]
    try:
        with torch.no_grad():
            _run(model, batches, device, current)
    finally:
        for handle in handles:
            handle.remove()
    return [
        {"mean_nnz": s["sum"] / max(s["tokens"], 1), "max_nnz": s["max"],
         "dead_fraction": 1.0 - float(s["fired"].float().mean())}
        for s in stats
    ]


def measure_activity(model: nn.Module, batches) -> list[dict]:
    """Per sparse layer, in order: mean_nnz and max_nnz (active units per counted token, per
    token-expert pair for experts) and dead_fraction, on batches as `calibrate_thresholds` takes them
    (`attention_mask`, `calibration_mask`). Runs the model in eval mode under no_grad."""
    layers = [m for _, m in named_sparse_layers(model)]
    if not layers:
        raise ValueError(f"model ({type(model).__name__}) has no sparse layer")
    was_training = model.training
    model.eval()
    try:
        return _measure(model, layers, _check_batches(batches), _model_device(model))
    finally:
        model.train(was_training)


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
    an iterable of input_ids tensors [B, T] or tokenizer outputs with `input_ids`, `attention_mask`
    and `calibration_mask` (module docstring; moved to the model's device; padding is ignored; read
    once per layer, so it is materialized into a list). target_nnz: mean active units per token per
    layer, 0 < target < H.
    tolerance: relative error accepted on the measured mean (a warning names the layers outside it).
    mix: weight of each unit's own quantile against the global level, in [0, 1) (module docstring).

    Each layer's `expected_nnz` is set to target_nnz, and so is the `expected_nnz` of the recorded
    `model.config.sparseffn`. Returns, per layer in order: layer, name, target_nnz, mean_nnz and
    max_nnz (measured by running the calibrated model), calibration_nnz (the estimate while fitting),
    level, threshold_mean/std/min/max, zero_threshold_fraction, dead_fraction, reached.
    """
    named = named_sparse_layers(model)
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
            for _, layer in named:
                groups = _capture(model, layer, batches, device)
                fitted = [_fit(g, target, mix, _weight_dtype(layer), tolerance) for g in groups]
                sizes = [g.shape[0] for g in groups]
                del groups
                theta = torch.stack([f[0] for f in fitted]) if isinstance(layer, SparseExperts) else fitted[0][0]
                layer.set_threshold_(theta)
                layer.expected_nnz = target
                pairs = max(sum(sizes), 1)
                estimate = sum(f[2] * n for f, n in zip(fitted, sizes)) / pairs
                level = fitted[0][1] if len(fitted) == 1 else float("nan")
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

    sync_config(model)  # θ != 0: the activation fields now say only sparseffn can rebuild the model
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
