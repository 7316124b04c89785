"""The config of a sparsified model says what the model computes, so a reload is never silently different.

Every config field that names the MLP activation (`hidden_act`, Gemma2/3's `hidden_activation`,
GPT-2's `activation_function`, Falcon's `activation`) holds, at all times `sparseffn` writes it and
whenever the model is saved:

    "relu"           every MLP computes a plain ReLU: no threshold is set and no MLP was left dense with
                     another activation. Plain `from_pretrained` builds the same function.
    UNLOADABLE_ACT   some θ != 0 (Hugging Face MLPs have no threshold), `filter_fn` left MLPs dense with
                     their original activation (one field cannot name two functions), or the sparse MLPs
                     have a structure the architecture's MLP class cannot build (`replace_mlps_`: non-gated,
                     or biases it lacks; recorded as `sparseffn_layers["sparse_mlp"]`). transformers
                     cannot build that activation: plain `from_pretrained` raises a KeyError whose text
                     says to use `sparseffn.load_pretrained`, instead of loading a different model.

`config.sparseffn` holds the SparsityConfig; `config.sparseffn_layers` holds what load_pretrained needs
besides: the activation fields before sparsify_ (`dense_activation`) and the sparsified module names
(relative to the Hugging Face model). Saving re-checks the thresholds: `sparsify_` gives the model an
instance-level `save_pretrained` that syncs the fields first (a θ set with `set_threshold_` after
sparsify_ or calibrate_thresholds is seen there).
"""

from __future__ import annotations

import types

from torch import nn

ACT_FIELDS = ("hidden_act", "hidden_activation", "activation_function", "activation")
UNLOADABLE_ACT = "relu with sparseffn thresholds or mixed layers: load this checkpoint with sparseffn.load_pretrained"
CONFIG_KEY = "sparseffn"  # attribute of model.config (and key of config.json) holding SparsityConfig.to_dict()
LAYERS_KEY = "sparseffn_layers"
STRUCTURE_KEY = "sparse_mlp"  # in LAYERS_KEY: {"gated", "bias"} of sparse MLPs the architecture's MLP class cannot hold


def hf_model(model: nn.Module) -> nn.Module | None:
    """The transformers PreTrainedModel inside `model` (itself, or the model under a PeftModel)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def configs(model: nn.Module) -> list:
    """model.config and, for composite models, its distinct text config (`model` may be a config)."""
    if isinstance(model, nn.Module):
        inner = hf_model(model)
        config = getattr(inner if inner is not None else model, "config", None)
    else:
        config = model
    if config is None:
        return []
    found = [config]
    if hasattr(config, "get_text_config"):
        text = config.get_text_config()
        if text is not config:
            found.append(text)
    return found


def activation_fields(model: nn.Module) -> dict[str, str]:
    """{field: value} of the activation fields the model's config(s) hold (the text config's win)."""
    fields = {}
    for cfg in configs(model):
        for name in ACT_FIELDS:
            value = getattr(cfg, name, None)
            if isinstance(value, str):
                fields[name] = value
    return fields


def set_activation_fields(model: nn.Module, value: str | dict[str, str]) -> None:
    """Set every activation field present to `value` (one string, or a {field: value} dict)."""
    for cfg in configs(model):
        for name in ACT_FIELDS:
            if isinstance(getattr(cfg, name, None), str):
                new = value if isinstance(value, str) else value.get(name)
                if new is not None:
                    setattr(cfg, name, new)


def computed_activation(model: nn.Module, layers: list[nn.Module], dense_left: bool) -> str:
    """The value the activation fields must hold (module docstring)."""
    if any(m.has_threshold for m in layers):
        return UNLOADABLE_ACT
    meta = getattr(configs(model)[0], LAYERS_KEY, None) if configs(model) else None
    if (meta or {}).get(STRUCTURE_KEY):
        return UNLOADABLE_ACT
    dense = (meta or {}).get("dense_activation", {})
    if dense_left and any(v != "relu" for v in dense.values()):
        return UNLOADABLE_ACT
    return "relu"


def attach_save_hook(model: nn.Module, sync) -> None:
    """Give the Hugging Face model inside `model` a save_pretrained that runs `sync(model)` first."""
    inner = hf_model(model)
    if inner is None or "save_pretrained" in vars(inner):
        return

    def save_pretrained(self, *args, **kwargs):
        sync(self)
        return type(self).save_pretrained(self, *args, **kwargs)

    inner.save_pretrained = types.MethodType(save_pretrained, inner)


def detach_save_hook(model: nn.Module) -> None:
    inner = hf_model(model)
    if inner is not None and "save_pretrained" in vars(inner):
        del inner.save_pretrained
