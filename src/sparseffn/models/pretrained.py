"""`load_pretrained`: a sparsified model saved with `save_pretrained`, back as the same sparse model.

`save_pretrained` of a sparsified model writes config.json (with `hidden_act: "relu"` and the
`sparseffn` SparsityConfig) and safetensors holding the Hugging Face weights plus each layer's
`mlp.threshold`. Loading rebuilds the architecture from the config (weight initialization skipped),
sparsifies it with the recorded SparsityConfig and loads every tensor strictly: the result computes
the same outputs bit for bit. Local directories only: nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from sparseffn.models.config import SparsityConfig
from sparseffn.models.sparsify import CONFIG_KEY, sparsify_

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _weight_files(path: Path) -> list[Path]:
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    if (path / INDEX_FILE).is_file():
        index = json.loads((path / INDEX_FILE).read_text())
        return [path / name for name in sorted(set(index["weight_map"].values()))]
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {path}: load_pretrained reads the safetensors that save_pretrained writes"
    )


def _read_state_dict(files: list[Path], device: torch.device | None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file, device=str(device) if device is not None else "cpu"))
    return state


def _saved_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    for key, tensor in state.items():
        if tensor.is_floating_point() and not key.endswith(".threshold"):
            return tensor.dtype
    return torch.float32


def _no_init_weights():
    """transformers' own context that skips random initialization (weights are loaded right after)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # a transformers without it: initialize, then overwrite
        return contextlib.nullcontext()
    return no_init_weights()


def load_pretrained(
    path: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    attn_implementation: str = "sdpa",
):
    """The sparse model saved in directory `path` by `model.save_pretrained(path)` of a sparsified model.

    device: where to build it (None: CPU). dtype: the weights' dtype (None: the saved one; thresholds
    stay fp32). attn_implementation: passed to transformers ("sdpa", as in build_model). Tied
    embeddings are re-tied. Returns the model in eval mode, like from_pretrained.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"path {str(path)!r} is not a directory with a config.json (load_pretrained reads local directories "
            f"written by save_pretrained; nothing is downloaded)"
        )
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    device = torch.device(device) if device is not None else None
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    recorded = getattr(config, CONFIG_KEY, None)
    if recorded is None:
        raise ValueError(
            f"{path / 'config.json'} has no {CONFIG_KEY!r} entry: it was not saved from a sparsified model "
            f"(load it with transformers' from_pretrained, then sparsify_ it)"
        )
    sparsity = SparsityConfig.from_dict(recorded)
    state = _read_state_dict(_weight_files(path), device)
    dtype = dtype or _saved_dtype(state)
    with _no_init_weights(), device if device is not None else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.tie_weights()
    sparsify_(model, sparsity)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"{path} holds tensors the model does not have: {sorted(unexpected)[:8]}")
    # Tied parameters are saved once: a missing key is fine only if it shares its tensor with a loaded one.
    params = model.state_dict(keep_vars=True)
    loaded = {id(params[key]) for key in state if key in params}
    untied = sorted(key for key in missing if id(params[key]) not in loaded)
    if untied:
        raise ValueError(f"{path} lacks tensors the model needs: {untied[:8]}")
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    if device is not None:
        model.to(device)
    return model.eval()
