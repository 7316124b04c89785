"""`load_pretrained`: a sparsified model saved with `save_pretrained`, back as the same sparse model.

The model is built by transformers' own `from_pretrained` (so its weight conversions, `device_map`,
`dtype`, offloading and attention choice all apply) from a subclass of the saved architecture that
sparsifies itself right after construction: the sparse layers (and their `threshold` buffers) exist
before the weights are loaded, so every tensor of the checkpoint has a place and every place gets a
tensor, or loading fails. The instance's class is then set back to the architecture's own. Which
modules are sparse and what the dense ones compute come from `config.sparseffn_layers`
(models/hf_config.py). A checkpoint of the reference implementation (`*_sparse_relu`, models/reference.py)
is built the same way from its base architecture, with the MLP structure and size it holds; its tensors
are checked against the model (names, shapes) before anything is loaded. Local directories need nothing
online; a Hub id ("owner/name") goes through transformers' own download and cache.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import torch

from sparseffn.models.config import SparsityConfig
from sparseffn.models.hf_config import (CONFIG_KEY, LAYERS_KEY, STRUCTURE_KEY, UNLOADABLE_ACT, activation_fields,
                                        set_activation_fields)
from sparseffn.models.layouts import kind_of
from sparseffn.models.reference import (INDEX_FILE, WEIGHTS_FILE, check_tensors, expected_tensors, import_config,
                                        is_reference, weight_files)
from sparseffn.models.saved_files import check_model_dir
from sparseffn.models.sparsify import named_sparse_layers, replace_mlps_, sparsify_, sync_config


def _architecture(config):
    """The causal-LM class the checkpoint was saved from (config.architectures), else the Auto mapping's."""
    import transformers
    from transformers import AutoModelForCausalLM

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    return AutoModelForCausalLM._model_mapping[type(config)]


def _self_sparsifying(cls, sparsity: SparsityConfig, modules: list[str] | None, structure: dict | None = None,
                      keep_base_mlp: bool = False, thresholds_saved: bool = True):
    """A subclass of `cls` whose instances sparsify themselves at the end of __init__: `sparsify_` over the
    architecture's own MLPs, or, with `structure` ({"gated", "bias"}), new SparseMLPs of that structure
    (`replace_mlps_`) where the architecture's MLP class cannot hold it (always, unless keep_base_mlp).
    thresholds_saved=False: the checkpoint has no `threshold` buffers (the loader sets them)."""

    def __init__(self, config, *args, **kwargs):
        cls.__init__(self, config, *args, **kwargs)
        chosen = None if modules is None else set(modules)
        pick = None if chosen is None else (lambda module, fqn: fqn in chosen)
        if structure is None or (keep_base_mlp and _holds(self, structure)):
            sparsify_(self, sparsity, filter_fn=pick)
        else:
            names = [n for n, m in self.named_modules() if kind_of(m) == "gated" and (pick is None or pick(m, n))]
            replace_mlps_(self, sparsity, names, gated=structure["gated"], bias=structure["bias"])
        if not thresholds_saved:  # not expected from the checkpoint (made persistent again once loaded)
            for _, layer in named_sparse_layers(self):
                layer._non_persistent_buffers_set.add("threshold")

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})


def _holds(model, structure: dict) -> bool:
    """Whether the architecture's own gated MLPs have the structure (gated, with or without biases)."""
    mlps = [m for m in model.modules() if kind_of(m) == "gated"]
    return bool(mlps) and structure["gated"] and all((m.gate_proj.bias is not None) == structure["bias"] for m in mlps)


def _is_hub_id(text: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) is not None and ".." not in text


def _resolve(source: str | os.PathLike, local_files_only: bool | None) -> tuple[str, bool]:
    """(the path or Hub id to load, local_files_only): a local directory, else a Hub id."""
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"path {str(path)!r} is a directory without a config.json: not a saved model")
        return str(path), True if local_files_only is None else local_files_only
    if not path.exists() and _is_hub_id(str(source)):
        return str(source), False if local_files_only is None else local_files_only
    raise FileNotFoundError(
        f"path {str(path)!r} is not a directory with a config.json (load_pretrained reads a model directory, or a "
        f"Hub id 'owner/name')")


def _config_dict(source: str, local_files_only: bool) -> dict:
    from transformers.utils import cached_file

    if Path(source).is_dir():
        path = Path(source) / "config.json"
    else:
        try:
            path = Path(cached_file(source, "config.json", local_files_only=local_files_only))
        except OSError as err:
            raise OSError(f"{source!r} is not a local directory, and as a Hub id its config.json could not be had: "
                          f"{' '.join(str(err).split())}") from None
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a JSON config ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _reference_files(source: str, local_files_only: bool) -> tuple[Path, list[Path]]:
    """(folder, safetensors files) of a reference checkpoint, downloaded through transformers' cache for a Hub id."""
    from transformers.utils import cached_file

    if Path(source).is_dir():
        return Path(source), weight_files(Path(source))
    index = cached_file(source, INDEX_FILE, local_files_only=local_files_only,
                        _raise_exceptions_for_missing_entries=False)
    if index is None:
        return Path(source), [Path(cached_file(source, WEIGHTS_FILE, local_files_only=local_files_only))]
    names = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
    return Path(source), [Path(cached_file(source, n, local_files_only=local_files_only)) for n in names]


def checkpoint_format(path: str | os.PathLike, *, local_files_only: bool | None = None) -> str:
    """What a model directory (or Hub id) holds: "sparseffn" (saved from a sparsified model), "reference" (a
    `*_sparse_relu` checkpoint of the reference implementation) or "dense" (any other Hugging Face model).
    Reads config.json only."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    source, local = _resolve(path, local_files_only)
    raw = _config_dict(source, local)
    if is_reference(raw):
        return "reference"
    return "sparseffn" if CONFIG_KEY in raw else "dense"


def load_pretrained(path: str | os.PathLike, *, device: torch.device | str | None = None, **from_pretrained_kwargs):
    """The sparse model in `path`: a directory written by `save_pretrained` of a sparsified model, a checkpoint
    of the paper's reference implementation (`*_sparse_relu`: the released SparseLM models), or the Hub id of one.

    from_pretrained_kwargs: passed to transformers' `from_pretrained` (`dtype`, `device_map`,
    `attn_implementation`, `offload_folder`, `local_files_only`, ...); by default the saved dtype and the
    config's attention implementation. device: shorthand for `device_map={"": device}`. Returns the model in
    eval mode with the thresholds loaded exactly (fp32; zero for a reference checkpoint: plain ReLU), or
    raises when the checkpoint lacks a tensor the sparse model needs, holds one it does not have, or holds
    one of another shape.
    """
    from transformers import AutoConfig

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    kwargs = dict(from_pretrained_kwargs)
    source, kwargs["local_files_only"] = _resolve(path, kwargs.get("local_files_only"))
    if Path(source).is_dir():
        check_model_dir(Path(source))  # a cut or damaged file: one SavedFileError naming it, before any is read
    dtype = kwargs.get("dtype")
    if dtype is not None and not (dtype == "auto" or (isinstance(dtype, torch.dtype) and dtype.is_floating_point)):
        raise TypeError(f"dtype must be a floating-point torch.dtype, 'auto' or None, got {dtype!r}")
    if device is not None:
        if "device_map" in kwargs:
            raise ValueError("pass device or device_map, not both")
        kwargs["device_map"] = {"": torch.device(device)}
    kwargs.setdefault("dtype", "auto")
    config = kwargs.pop("config", None)
    raw = _config_dict(source, kwargs["local_files_only"]) if config is None else {}
    if is_reference(raw):
        return _load_reference(source, raw, kwargs)
    config = config or AutoConfig.from_pretrained(source, local_files_only=kwargs["local_files_only"])
    recorded = getattr(config, CONFIG_KEY, None)
    if recorded is None:
        raise ValueError(
            f"{source}/config.json has no {CONFIG_KEY!r} entry: it was not saved from a sparsified model "
            f"(load it with transformers' from_pretrained, then sparsify_ it)"
        )
    sparsity = SparsityConfig.from_dict(recorded)
    meta = getattr(config, LAYERS_KEY, None) or {}
    # Build with the activation the dense MLPs had (the sparse ones replace theirs anyway).
    dense = meta.get("dense_activation") or {k: "relu" for k, v in activation_fields(config).items()
                                             if v == UNLOADABLE_ACT}
    set_activation_fields(config, dense)
    cls = _architecture(config)
    model, info = _self_sparsifying(cls, sparsity, meta.get("modules"), meta.get(STRUCTURE_KEY)).from_pretrained(
        source, config=config, output_loading_info=True, **kwargs)
    model.__class__ = cls
    _raise_on_problems(source, info)
    for name, module in named_sparse_layers(model):  # tensors were assigned without load_state_dict: refresh
        if module.threshold.device.type == "meta":
            raise NotImplementedError(
                f"{name}.threshold was offloaded (offload_buffers=True?); the sparse layers read their thresholds "
                f"in memory: load without offloading buffers")
        module.set_threshold_(module.threshold.clone())
    sync_config(model)
    return model.eval()


def _raise_on_problems(source: str, info: dict) -> None:
    problems = {k: sorted(info.get(k) or []) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        raise ValueError(f"{source} does not match the sparse model it describes: "
                         + "; ".join(f"{k}: {v[:8]}" for k, v in problems.items()))


def _load_reference(source: str, raw: dict, kwargs: dict):
    """load_pretrained of a reference checkpoint (models/reference.py): base architecture, SparseMLPs of the
    structure and size the checkpoint holds, every tensor checked by name and shape before loading, θ = 0."""
    config, layout, sparsity = import_config(raw, f"{source}/config.json")
    folder, files = _reference_files(source, kwargs["local_files_only"])
    cls = _architecture(config)
    built = _self_sparsifying(cls, sparsity, None, {"gated": layout.gated, "bias": layout.bias}, keep_base_mlp=True,
                              thresholds_saved=False)
    with torch.device("meta"):
        probe = built(copy.deepcopy(config))
    check_tensors(folder, expected_tensors(probe), files)
    del probe
    model, info = built.from_pretrained(source, config=config, output_loading_info=True, **kwargs)
    model.__class__ = cls
    _raise_on_problems(source, info)
    for name, module in named_sparse_layers(model):
        if module.threshold.device.type == "meta":
            raise NotImplementedError(f"{name}.threshold was offloaded (offload_buffers=True?); load without "
                                      f"offloading buffers")
        module._non_persistent_buffers_set.discard("threshold")
        module.set_threshold_(None)  # the reference's MLP is a plain ReLU
    sync_config(model)
    return model.eval()
