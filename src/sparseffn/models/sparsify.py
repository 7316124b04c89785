"""Turn a Hugging Face causal LM's MLPs into sparse ReLU layers in place, and back.

Which modules are replaced, and by what, is models/layouts.py (Llama-style gated MLPs by SparseMLP,
Phi-3's fused and GPT-2 / GPT-NeoX / Falcon / Phi / Starcoder2's non-gated MLPs by HFSparseMLP, Mixtral /
Qwen2-MoE / Qwen3-MoE routed experts by SparseExperts). Replacement happens on the instance only (no
class is patched), sharing the weight Parameters; state-dict keys stay the Hugging Face ones (plus each
layer's `threshold`). The config records the change (models/hf_config.py): its activation fields say
what the model computes, `sparseffn` holds the SparsityConfig, `sparseffn_layers` what load_pretrained
needs to rebuild the same model. `replace_mlps_` puts new SparseMLPs of a structure the architecture's
MLP class lacks (non-gated, biases) in place of its MLPs: load_pretrained's way to a reference checkpoint's.
"""

from __future__ import annotations


import torch
from torch import nn

from sparseffn.models.config import SparsityConfig
from sparseffn.models.hf_config import (
    CONFIG_KEY,
    LAYERS_KEY,
    STRUCTURE_KEY,
    activation_fields,
    attach_save_hook,
    computed_activation,
    configs,
    detach_save_hook,
    hf_model,
    set_activation_fields,
)
from sparseffn.models.layouts import (GATED_NAMES, LAYOUTS, SPARSE_TYPES, base_linear, build_sparse, kind_of, looks_like_mlp,
                                      restore)
from sparseffn.nn import SparseMLP


def _check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a Hugging Face model), got {type(model).__name__}")
    return model


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _candidates(model: nn.Module) -> tuple[list[tuple[str, nn.Module, str]], list[tuple[str, nn.Module]]]:
    """([(name, module, kind)] of replaceable modules, [(name, module)] of unknown MLP-like ones),
    outermost first; nothing inside a sparse layer or a replaceable module is looked at."""
    found, unknown, skip = [], [], []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in skip):
            continue
        if isinstance(module, SPARSE_TYPES):
            skip.append(name)
            continue
        kind = kind_of(module)
        if kind is not None:
            found.append((name, module, kind))
            skip.append(name)
        elif looks_like_mlp(module) and not any(isinstance(c, SPARSE_TYPES) or kind_of(c) for c in module.modules()):
            unknown.append((name, module))
    return found, unknown


def _relative_name(model: nn.Module, module: nn.Module) -> str | None:
    inner = hf_model(model)
    if inner is None:
        return None
    return next((n for n, m in inner.named_modules() if m is module), None)


def named_sparse_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every sparse layer (SparseMLP, HFSparseMLP, SparseExperts), in order."""
    return [(name, m) for name, m in _check_model(model).named_modules() if isinstance(m, SPARSE_TYPES)]


def sparse_layers(model: nn.Module) -> list[nn.Module]:
    """Every sparse layer of the model (SparseMLP, HFSparseMLP, SparseExperts), in order."""
    return [m for _, m in named_sparse_layers(model)]


def named_sparse_mlps(model: nn.Module) -> list[tuple[str, SparseMLP]]:
    """(qualified name, module) of every SparseMLP in the model, in layer order."""
    return [(name, m) for name, m in _check_model(model).named_modules() if isinstance(m, SparseMLP)]


def sparse_mlps(model: nn.Module) -> list[SparseMLP]:
    """Every SparseMLP in the model, in layer order (empty if the model is not sparsified)."""
    return [m for _, m in named_sparse_mlps(model)]


def sync_config(model: nn.Module) -> str:
    """Set the activation fields to what the model computes now (models/hf_config.py); returns the value.

    Run by sparsify_, calibrate_thresholds, load_pretrained and before every save_pretrained; call it
    yourself after changing thresholds if you read the config in between.
    """
    layers = sparse_layers(_check_model(model))
    if not layers:
        return ""
    found, unknown = _candidates(model)
    value = computed_activation(model, layers, dense_left=bool(found or unknown))
    set_activation_fields(model, value)
    return value


def _no_mlp_message(model: nn.Module, unknown) -> str:
    known = (f"{'/'.join(GATED_NAMES)} (Llama-style), the MLP classes {sorted(LAYOUTS)} and MoE experts with "
             f"3-D gate_up_proj/down_proj Parameters")
    if unknown:
        detail = ", ".join(f"{n} ({type(m).__name__}: children {[c for c, _ in m.named_children()]})"
                           for n, m in unknown[:4])
        return (f"no MLP sparsify_ knows in {type(model).__name__}: it replaces {known}; these look like MLPs but "
                f"match none: {detail}")
    return f"no MLP found in {type(model).__name__}: sparsify_ replaces {known}"


def sparsify_(model: nn.Module, config: SparsityConfig = SparsityConfig(), filter_fn=None) -> nn.Module:
    """Replace the MLPs of `model` by sparse ReLU layers (models/layouts.py), in place; returns model.

    config: the SparsityConfig; each layer gets its mode, expected_nnz and θ = config.threshold (if
    set). filter_fn(module, fqn) -> bool: replace only the modules for which it returns True (fqn is
    the name in `model`); the others keep their activation, and the config then says so (a checkpoint
    that only sparseffn.load_pretrained can rebuild). `model` may be a PeftModel: projections wrapped by
    PEFT are kept, and their adapters apply (nn/projections.py).

    Raises ValueError when there is nothing to replace (with the layouts it knows, and the modules
    that look like MLPs but match none), or when MLP-like modules it does not know would stay dense
    without filter_fn having excluded them.
    """
    _check_model(model)
    if not isinstance(config, SparsityConfig):
        raise TypeError(f"config must be a SparsityConfig, got {type(config).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable(module, fqn) -> bool or None, got {type(filter_fn).__name__}")
    found, unknown = _candidates(model)
    chosen = [(n, m, k) for n, m, k in found if filter_fn is None or filter_fn(m, n)]
    if filter_fn is not None:
        unknown = [(n, m) for n, m in unknown if filter_fn(m, n)]
    if unknown:
        if not chosen:
            raise ValueError(_no_mlp_message(model, unknown))
        names = ", ".join(f"{n} ({type(m).__name__})" for n, m in unknown[:4])
        raise ValueError(
            f"{len(unknown)} module(s) look like MLPs that sparsify_ does not know: {names}; they would stay dense "
            f"with their own activation. Exclude them with filter_fn=lambda module, fqn: ... to sparsify the rest")
    if not chosen:
        if sparse_layers(model) and not found:
            raise ValueError("model is already sparsified (it holds sparse layers and no dense MLP)")
        if found:
            raise ValueError(f"filter_fn selected none of the {len(found)} MLP(s) (first: {found[0][0]})")
        raise ValueError(_no_mlp_message(model, unknown))
    _install(model, config, [(name, build_sparse(module, kind, config.mode)) for name, module, kind in chosen])
    return model


def _install(model: nn.Module, config: SparsityConfig, layers: list[tuple[str, nn.Module]],
             structure: dict | None = None) -> None:
    """Put each (name, sparse layer) in place, configured by `config`, and record it all in the model's
    config (models/hf_config.py); `structure` ({"gated", "bias"}) marks layers the architecture's own MLP
    class cannot hold."""
    cfgs = configs(model)
    if cfgs and getattr(cfgs[0], LAYERS_KEY, None) is None:
        setattr(cfgs[0], LAYERS_KEY, {"dense_activation": activation_fields(model), "modules": []})
    replaced = []
    for name, sparse in layers:
        sparse.expected_nnz = config.expected_nnz
        if config.threshold is not None:
            sparse.set_threshold_(config.threshold)
        _replace(model, name, sparse)
        replaced.append(_relative_name(model, sparse) or name)
    if cfgs:
        meta = getattr(cfgs[0], LAYERS_KEY)
        meta["modules"] = sorted(set(meta["modules"]) | set(replaced))
        if structure is not None:
            meta[STRUCTURE_KEY] = dict(structure)
        setattr(cfgs[0], CONFIG_KEY, config.to_dict())
    sync_config(model)
    attach_save_hook(model, sync_config)


def replace_mlps_(model: nn.Module, config: SparsityConfig, names: list[str], *, gated: bool, bias: bool) -> nn.Module:
    """Replace the gated MLPs `names` of `model` by new SparseMLPs of another structure (non-gated, or
    with biases the architecture's MLP class lacks), in place; returns model.

    The new layers' weights are left as constructed (for a loader to fill). The architecture's own
    class cannot build these MLPs, so the config records the structure (`sparseffn_layers["sparse_mlp"]`)
    and makes a plain `from_pretrained` of a save refuse (models/hf_config.py); `load_pretrained`
    rebuilds it. `unsparsify_` refuses such a model.
    """
    _check_model(model)
    layers = []
    for name in names:
        module = model.get_submodule(name)
        up = base_linear(getattr(module, "up_proj", None))
        if up is None:
            raise ValueError(f"{name} ({type(module).__name__}) has no nn.Linear up_proj to size a SparseMLP by")
        layers.append((name, SparseMLP(up.in_features, up.out_features, gated=gated, bias=bias, mode=config.mode,
                                       device=up.weight.device, dtype=up.weight.dtype)))
    _install(model, config, layers, {"gated": gated, "bias": bias})
    return model


def set_sparsity_config_(model: nn.Module, config: SparsityConfig) -> nn.Module:
    """Give an already sparsified model a new SparsityConfig, as `sparsify_` would have applied it: every
    sparse layer takes its mode and expected_nnz (and θ = config.threshold when that is set; otherwise the
    layers keep theirs), and the config records it (so a save says what the model was trained with)."""
    if not isinstance(config, SparsityConfig):
        raise TypeError(f"config must be a SparsityConfig, got {type(config).__name__}")
    layers = sparse_layers(_check_model(model))
    if not layers:
        raise ValueError(f"model ({type(model).__name__}) has no sparse layer: sparsify_ it instead")
    for layer in layers:
        layer.mode = config.mode
        layer.expected_nnz = config.expected_nnz
        if config.threshold is not None:
            layer.set_threshold_(config.threshold)
    cfgs = configs(model)
    if cfgs:
        setattr(cfgs[0], CONFIG_KEY, config.to_dict())
    sync_config(model)
    return model


def sparsity_config(model: nn.Module) -> SparsityConfig | None:
    """The SparsityConfig recorded on `model.config` by `sparsify_`, or None."""
    cfgs = configs(_check_model(model))
    data = getattr(cfgs[0], CONFIG_KEY, None) if cfgs else None
    return None if data is None else SparsityConfig.from_dict(data)


def _dense_module(sparse: SparseMLP) -> nn.Module:
    """The Hugging Face module `sparse` replaced (ReLU, current children), else a DenseMLP."""
    original = restore(sparse)
    return original if original is not None else sparse.to_dense("relu")


def unsparsify_(model: nn.Module) -> nn.Module:
    """Undo `sparsify_` in place: every sparse layer becomes the Hugging Face module it replaced, computing
    ReLU with the current weights (a SparseMLP built by hand becomes `sparseffn.nn.DenseMLP`); returns model.

    The activation fields become "relu"; `sparseffn` and `sparseffn_layers` leave the config. Refused
    (ValueError, nothing changed): non-zero thresholds (a Hugging Face MLP has none: drop them with
    `set_threshold_(None)` on each layer first, which changes the function), and a model that filter_fn
    left partly dense with another activation (no config field could name both functions).
    """
    named = named_sparse_layers(model)
    if not named:
        raise ValueError(f"model ({type(model).__name__}) has no SparseMLP: nothing to unsparsify")
    thresholded = [name for name, m in named if m.has_threshold]
    if thresholded:
        raise ValueError(
            f"{len(thresholded)} layer(s) have non-zero thresholds (first: {thresholded[0]}), which a plain "
            f"Hugging Face MLP cannot hold; drop them with set_threshold_(None) on each layer first, or keep the "
            f"model sparse"
        )
    found, unknown = _candidates(model)
    cfgs = configs(model)
    meta = getattr(cfgs[0], LAYERS_KEY, None) if cfgs else None
    if (meta or {}).get(STRUCTURE_KEY):
        raise ValueError(
            f"model's sparse MLPs ({meta[STRUCTURE_KEY]}) have a structure {type(hf_model(model) or model).__name__}'s "
            f"own MLP class cannot hold (a plain save would reload as a different model); keep the model sparse")
    dense = (meta or {}).get("dense_activation", {})
    if (found or unknown) and any(v != "relu" for v in dense.values()):
        raise ValueError(
            f"model was sparsified in part (first dense MLP: {(found or unknown)[0][0]}, activation {dense}); a plain "
            f"model with ReLU and non-ReLU MLPs has no config that says so. Keep it sparse, or sparsify_ the rest first"
        )
    for name, sparse in named:
        _replace(model, name, _dense_module(sparse))
    set_activation_fields(model, "relu")
    if cfgs:
        for key in (CONFIG_KEY, LAYERS_KEY):
            if hasattr(cfgs[0], key):
                delattr(cfgs[0], key)
    detach_save_hook(model)
    return model


def dispatch_report(model: nn.Module) -> list[dict]:
    """What auto mode decided for each sparse layer, from what it measured: one dict per layer with
    its name, mode, expected_nnz hint, measured active units per token (None before the first
    sample is read), samples taken, the last path per kind of call (training / decode / prefill)
    and the reason of its last decision."""
    report = []
    for name, layer in named_sparse_layers(model):
        activity = layer.activity
        decision = layer.last_decision
        report.append({"layer": name, "mode": layer.mode, "expected_nnz": layer.expected_nnz,
                       "nnz_estimate": activity.nnz, "samples": activity.samples, "paths": dict(activity.last),
                       "last_reason": None if decision is None else decision.reason})
    return report


def set_track_l1(model: nn.Module, enabled: bool | None) -> nn.Module:
    """Set `track_l1` on every sparse layer: True / False to always / never compute the L1 penalty,
    None (the default) to follow the layer's mode (training mode, or gradients flowing)."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be None or a bool, got {type(enabled).__name__}")
    for m in sparse_layers(model):
        m.track_l1 = enabled
        if enabled is False:
            m.last_l1 = None
    return model


def collect_l1(model: nn.Module) -> torch.Tensor:
    """Mean over sparse layers of each one's `last_l1` from the latest forward: the auxiliary loss.

    Differentiable (`loss = ce + λ · collect_l1(model)`); an fp32 scalar on the first layer's device.
    Raises RuntimeError if a layer has no `last_l1` (no forward yet, or `track_l1` is off).
    """
    named = named_sparse_layers(model)
    if not named:
        raise ValueError(f"model ({type(model).__name__}) has no SparseMLP: sparsify_ it first")
    missing = [name for name, m in named if m.last_l1 is None]
    if missing:
        raise RuntimeError(
            f"{len(missing)} of {len(named)} SparseMLP layer(s) have no last_l1 (first: {missing[0]}): run a "
            f"forward pass in training mode (or with track_l1=True) before collect_l1"
        )
    device = named[0][1].last_l1.device
    return torch.stack([m.last_l1.to(device) for _, m in named]).mean()
