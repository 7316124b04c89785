"""`load_pretrained`: a sparsified model saved with `save_pretrained`, back as the same sparse model.

The model is built by transformers' own `from_pretrained` (so its weight conversions, `device_map`,
`dtype`, offloading and attention choice all apply) from a subclass of the saved architecture that
sparsifies itself right after construction: the sparse layers (and their `threshold` buffers) exist
before the weights are loaded, so every tensor of the checkpoint has a place and every place gets a
tensor, or loading fails. The instance's class is then set back to the architecture's own. Which
modules are sparse and what the dense ones compute come from `config.sparseffn_layers`
(models/hf_config.py). Local directories only unless the caller passes `local_files_only=False`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from sparseffn.models.config import SparsityConfig
from sparseffn.models.hf_config import CONFIG_KEY, LAYERS_KEY, UNLOADABLE_ACT, activation_fields, set_activation_fields
from sparseffn.models.saved_files import check_model_dir
from sparseffn.models.sparsify import named_sparse_layers, sparsify_, sync_config


def _architecture(config):
    """The causal-LM class the checkpoint was saved from (config.architectures), else the Auto mapping's."""
    import transformers
    from transformers import AutoModelForCausalLM

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    return AutoModelForCausalLM._model_mapping[type(config)]


def _self_sparsifying(cls, sparsity: SparsityConfig, modules: list[str] | None):
    """A subclass of `cls` whose instances sparsify themselves at the end of __init__."""

    def __init__(self, config, *args, **kwargs):
        cls.__init__(self, config, *args, **kwargs)
        chosen = None if modules is None else set(modules)
        sparsify_(self, sparsity, filter_fn=None if chosen is None else (lambda module, fqn: fqn in chosen))

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})


def load_pretrained(path: str | os.PathLike, *, device: torch.device | str | None = None, **from_pretrained_kwargs):
    """The sparse model saved in directory `path` by `model.save_pretrained(path)` of a sparsified model.

    from_pretrained_kwargs: passed to transformers' `from_pretrained` (`dtype`, `device_map`,
    `attn_implementation`, `offload_folder`, ...); by default the saved dtype and the config's attention
    implementation. device: shorthand for `device_map={"": device}`. Returns the model in eval mode with
    the thresholds loaded exactly (fp32), or raises when the checkpoint lacks a tensor the sparse model
    needs or holds one it does not have.
    """
    from transformers import AutoConfig

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"path {str(path)!r} is not a directory with a config.json (load_pretrained reads local directories "
            f"written by save_pretrained; nothing is downloaded)"
        )
    check_model_dir(path)  # a cut or damaged file: one SavedFileError naming it, before transformers reads any
    kwargs = dict(from_pretrained_kwargs)
    dtype = kwargs.get("dtype")
    if dtype is not None and not (dtype == "auto" or (isinstance(dtype, torch.dtype) and dtype.is_floating_point)):
        raise TypeError(f"dtype must be a floating-point torch.dtype, 'auto' or None, got {dtype!r}")
    if device is not None:
        if "device_map" in kwargs:
            raise ValueError("pass device or device_map, not both")
        kwargs["device_map"] = {"": torch.device(device)}
    kwargs.setdefault("local_files_only", True)
    kwargs.setdefault("dtype", "auto")
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path, local_files_only=kwargs["local_files_only"])
    recorded = getattr(config, CONFIG_KEY, None)
    if recorded is None:
        raise ValueError(
            f"{path / 'config.json'} has no {CONFIG_KEY!r} entry: it was not saved from a sparsified model "
            f"(load it with transformers' from_pretrained, then sparsify_ it)"
        )
    sparsity = SparsityConfig.from_dict(recorded)
    meta = getattr(config, LAYERS_KEY, None) or {}
    # Build with the activation the dense MLPs had (the sparse ones replace theirs anyway).
    dense = meta.get("dense_activation") or {k: "relu" for k, v in activation_fields(config).items()
                                             if v == UNLOADABLE_ACT}
    set_activation_fields(config, dense)
    cls = _architecture(config)
    model, info = _self_sparsifying(cls, sparsity, meta.get("modules")).from_pretrained(
        path, config=config, output_loading_info=True, **kwargs)
    model.__class__ = cls
    problems = {k: sorted(info.get(k) or []) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        raise ValueError(f"{path} does not match the sparse model it describes: "
                         + "; ".join(f"{k}: {v[:8]}" for k, v in problems.items()))
    for name, module in named_sparse_layers(model):  # tensors were assigned without load_state_dict: refresh
        if module.threshold.device.type == "meta":
            raise NotImplementedError(
                f"{name}.threshold was offloaded (offload_buffers=True?); the sparse layers read their thresholds "
                f"in memory: load without offloading buffers")
        module.set_threshold_(module.threshold.clone())
    sync_config(model)
    return model.eval()
