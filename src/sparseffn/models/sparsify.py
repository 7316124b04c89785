"""Turn a Hugging Face causal LM's MLPs into `SparseMLP`s in place, and back.

An MLP is any submodule with `nn.Linear` attributes `gate_proj`, `up_proj` and `down_proj` (Llama,
Qwen2, Mistral and their relatives: `model.model.layers[i].mlp`). Replacement happens on the
instance only (no class is patched), sharing the weight Parameters. The model's config records the
change (`hidden_act = "relu"`, `sparseffn = SparsityConfig.to_dict()`), so `save_pretrained` writes a
config.json that `load_pretrained` turns back into the same sparse model.
"""

from __future__ import annotations

import torch
from torch import nn

from sparseffn.models.config import SparsityConfig
from sparseffn.nn import SparseMLP

CONFIG_KEY = "sparseffn"  # attribute of model.config (and key of config.json) holding SparsityConfig.to_dict()
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a Hugging Face model), got {type(model).__name__}")
    return model


def _is_dense_mlp(module: nn.Module) -> bool:
    return not isinstance(module, SparseMLP) and all(isinstance(getattr(module, n, None), nn.Linear) for n in _PROJECTIONS)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _configs(model: nn.Module) -> list:
    """model.config and, for composite models, its distinct text config (both get hidden_act)."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    configs = [config]
    if hasattr(config, "get_text_config"):
        text = config.get_text_config()
        if text is not config:
            configs.append(text)
    return configs


def named_sparse_mlps(model: nn.Module) -> list[tuple[str, SparseMLP]]:
    """(qualified name, module) of every SparseMLP in the model, in layer order."""
    return [(name, m) for name, m in _check_model(model).named_modules() if isinstance(m, SparseMLP)]


def sparse_mlps(model: nn.Module) -> list[SparseMLP]:
    """Every SparseMLP in the model, in layer order (empty if the model is not sparsified)."""
    return [m for _, m in named_sparse_mlps(model)]


def sparsify_(model: nn.Module, config: SparsityConfig = SparsityConfig()) -> nn.Module:
    """Replace every Hugging Face gated MLP of `model` by `SparseMLP.from_dense`, in place; returns model.

    Each SparseMLP gets `config.mode`, `config.expected_nnz` and θ = `config.threshold` (if set). The
    model computes ReLU gates from then on: `model.config.hidden_act` becomes "relu" and
    `model.config.sparseffn` records `config.to_dict()`. Raises ValueError when there is no MLP to
    replace (none found, or the model is already sparsified).
    """
    _check_model(model)
    if not isinstance(config, SparsityConfig):
        raise TypeError(f"config must be a SparsityConfig, got {type(config).__name__}")
    dense = [(name, m) for name, m in model.named_modules() if _is_dense_mlp(m)]
    if not dense:
        if sparse_mlps(model):
            raise ValueError("model is already sparsified (it holds SparseMLP modules and no dense MLP)")
        raise ValueError(
            f"no MLP found in {type(model).__name__}: sparsify_ replaces modules with nn.Linear "
            f"gate_proj, up_proj and down_proj (Llama, Qwen2, Mistral MLPs)"
        )
    for name, mlp in dense:
        sparse = SparseMLP.from_dense(mlp, mode=config.mode)
        sparse.expected_nnz = config.expected_nnz
        if config.threshold is not None:
            sparse.set_threshold_(config.threshold)
        _replace(model, name, sparse)
    for cfg in _configs(model):
        if hasattr(cfg, "hidden_act"):
            cfg.hidden_act = "relu"
    if (cfg := getattr(model, "config", None)) is not None:
        setattr(cfg, CONFIG_KEY, config.to_dict())
    return model


def sparsity_config(model: nn.Module) -> SparsityConfig | None:
    """The SparsityConfig recorded on `model.config` by `sparsify_`, or None."""
    data = getattr(getattr(_check_model(model), "config", None), CONFIG_KEY, None)
    return None if data is None else SparsityConfig.from_dict(data)


def _dense_module(sparse: SparseMLP, config) -> nn.Module:
    """The Hugging Face MLP class `sparse` replaced (ReLU, sharing the Linear modules), else a DenseMLP."""
    cls = sparse._dense_class
    if cls is None or config is None or sparse.gate_proj is None:
        return sparse.to_dense("relu")
    try:
        with torch.device("meta"):  # the class's own Linear modules are replaced at once: allocate nothing
            dense = cls(config)
    except TypeError:  # a class that needs more than the config: the plain equivalent instead
        return sparse.to_dense("relu")
    dense.gate_proj, dense.up_proj, dense.down_proj = sparse.gate_proj, sparse.up_proj, sparse.down_proj
    for attr in ("hidden_size", "intermediate_size"):
        if hasattr(dense, attr):
            setattr(dense, attr, getattr(sparse, attr))
    dense.act_fn = nn.ReLU()  # what ACT2FN["relu"] is; the config says relu as well
    return dense


def unsparsify_(model: nn.Module) -> nn.Module:
    """Undo `sparsify_` in place: every SparseMLP becomes a plain Hugging Face MLP with ReLU; returns model.

    The new MLPs are instances of the class each SparseMLP replaced (sharing its weights), or
    `sparseffn.nn.DenseMLP` (same state-dict keys, same function) for a SparseMLP built by hand or
    whose class cannot be built from the config alone; `model.config.hidden_act` stays "relu" and
    `model.config.sparseffn` is removed. Non-zero thresholds are refused (ValueError): a Hugging Face
    MLP has no threshold, and folding -θ into a gate bias would not survive save_pretrained /
    from_pretrained with `mlp_bias=False`. Drop them first (`set_threshold_(None)` on each layer) if
    a plain ReLU model is what you want; that changes the function.
    """
    named = named_sparse_mlps(model)
    if not named:
        raise ValueError(f"model ({type(model).__name__}) has no SparseMLP: nothing to unsparsify")
    thresholded = [name for name, m in named if m.has_threshold]
    if thresholded:
        raise ValueError(
            f"{len(thresholded)} layer(s) have non-zero thresholds (first: {thresholded[0]}), which a plain "
            f"Hugging Face MLP cannot hold; drop them with set_threshold_(None) on each layer first, or keep the "
            f"model sparse"
        )
    configs = _configs(model)
    text_config = configs[-1] if configs else None
    for name, sparse in named:
        _replace(model, name, _dense_module(sparse, text_config))
    if configs and hasattr(configs[0], CONFIG_KEY):
        delattr(configs[0], CONFIG_KEY)
    return model


def set_track_l1(model: nn.Module, enabled: bool) -> nn.Module:
    """Set `track_l1` on every SparseMLP (switch it off for inference: the L1 forces the dense path)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    for m in sparse_mlps(model):
        m.track_l1 = enabled
        if not enabled:
            m.last_l1 = None
    return model


def collect_l1(model: nn.Module) -> torch.Tensor:
    """Mean over layers of each SparseMLP's `last_l1` from the latest forward: the auxiliary loss.

    Differentiable (`loss = ce + λ · collect_l1(model)`); an fp32 scalar on the first layer's device.
    Raises RuntimeError if a layer has no `last_l1` (no forward yet, or `track_l1` is off).
    """
    named = named_sparse_mlps(model)
    if not named:
        raise ValueError(f"model ({type(model).__name__}) has no SparseMLP: sparsify_ it first")
    missing = [name for name, m in named if m.last_l1 is None]
    if missing:
        raise RuntimeError(
            f"{len(missing)} of {len(named)} SparseMLP layer(s) have no last_l1 (first: {missing[0]}): run a "
            f"forward pass with track_l1=True on every layer before collect_l1"
        )
    device = named[0][1].last_l1.device
    return torch.stack([m.last_l1.to(device) for _, m in named]).mean()
