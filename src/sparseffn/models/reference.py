"""The reference implementation's checkpoint format (`*_sparse_relu`): read without its code, written back.

A checkpoint saved by the paper's reference code (the released SparseLM0.5B / 1B / 1.5B / 2B) holds

    config.json  model_type "<base>_sparse_relu" (base "llama" or "qwen2"), architectures
                 ["Sparse<Base>ForCausalLM"], an auto_map into the reference's own Python module (never
                 imported here), the base config's fields and the extra fields of REFERENCE_FIELDS
    weights      safetensors (one file, or shards with model.safetensors.index.json) under the base
                 model's Hugging Face names. Every decoder layer's MLP is
                   gated (sparsity_gated_mlp):  mlp.gate_proj, mlp.up_proj, mlp.down_proj   relu(gate(x)) * up(x)
                   non-gated:                   mlp.up_proj, mlp.down_proj                  relu(up(x))
                 nn.Linear weights [out, in], with biases when mlp_bias; H = sparsity_new_intermediate_size,
                 or intermediate_size when that is null. The MLP is ReLU whatever hidden_act says.

`import_config` turns such a config into the base architecture's config (H, hidden_act "relu") plus what
`load_pretrained` needs to build the model with SparseMLPs (`ReferenceLayout`) and keeps the original
config under REFERENCE_KEY, so a project-format save of the imported model can still be exported back
exactly. `check_tensors` compares the checkpoint's tensors with the model's before anything is loaded.
`export_reference` writes a sparse model in this format.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

SUFFIX = "_sparse_relu"
ARCHITECTURES = {"llama": "SparseLlamaForCausalLM", "qwen2": "SparseQwen2ForCausalLM"}
CONFIG_CLASSES = {"llama": "SparseLlamaConfig", "qwen2": "SparseQwen2Config"}
AUTO_MAP_MODULE = "sparse_models"  # the reference module's file name, as its save_pretrained records it
# The extra fields of the reference's config classes, with their defaults (mlp_bias only when the base
# config has none of its own).
REFERENCE_FIELDS = {
    "sparsity_train_batch_size": 1,
    "sparsity_per_device_train_batch_size": 1,
    "sparsity_max_seq_len": 2048,
    "sparsity_tokens_until_dead": None,
    "sparsity_l1_coeff": 3e-4,
    "sparsity_start_warmup_step": None,
    "sparsity_end_warmup_step": None,
    "sparsity_new_intermediate_size": None,
    "sparsity_gated_mlp": True,
    "sparsity_reinitialize": False,
    "sparsity_do_track": True,
    "sparsity_mlp_execution_logic": "training",
    "sparsity_baseline_run": False,
    "sparsity_use_hybrid_kernel": False,
    "sparsity_l0_cutoff": -1,
    "sparsity_l0_cutoff_period": 20,
}
REFERENCE_KEY = "sparseffn_reference"  # project config attribute: the reference config.json the model came from
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "tokenizer.model", "chat_template.jinja")
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class ReferenceLayout:
    """What the checkpoint's MLPs are: base architecture, gated or not, biases, intermediate size H."""

    base: str
    gated: bool
    bias: bool
    intermediate_size: int


def is_reference(config: dict) -> bool:
    """Whether a config.json dict was saved by the reference code."""
    return isinstance(config.get("model_type"), str) and config["model_type"].endswith(SUFFIX)


def reference_layout(config: dict, source: str = "config.json") -> ReferenceLayout:
    """The ReferenceLayout of a reference config.json dict; ValueError / NotImplementedError naming the
    field when the checkpoint is one this reader cannot rebuild exactly."""
    base = config["model_type"][: -len(SUFFIX)]
    if base not in ARCHITECTURES:
        raise NotImplementedError(f"{source}: model_type {config['model_type']!r}: the reference format exists for "
                                  f"bases {sorted(ARCHITECTURES)}, got base {base!r}")
    fields = {**REFERENCE_FIELDS, **config}
    if fields["sparsity_use_hybrid_kernel"] and fields["sparsity_gated_mlp"]:
        raise NotImplementedError(
            f"{source}: sparsity_use_hybrid_kernel is true: the reference stores down_proj.weight transposed "
            f"([H, D]) in such checkpoints; reading that layout is not supported (save it with the flag off)")
    size = fields["sparsity_new_intermediate_size"]
    size = config.get("intermediate_size") if size is None else size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{source}: sparsity_new_intermediate_size / intermediate_size must be a positive int, "
                         f"got {size!r}")
    for name in ("sparsity_gated_mlp", "mlp_bias"):
        if not isinstance(fields.get(name, False), bool):
            raise ValueError(f"{source}: {name} must be true or false, got {fields[name]!r}")
    return ReferenceLayout(base, bool(fields["sparsity_gated_mlp"]), bool(fields.get("mlp_bias", False)), int(size))


def import_config(config: dict, source: str = "config.json"):
    """(base transformers config, ReferenceLayout, SparsityConfig) of a reference config.json dict.

    The base config has H as its intermediate_size, hidden_act "relu" and mlp_bias as the checkpoint's,
    and holds the original dict under REFERENCE_KEY. λ (l1_coeff) is the reference's sparsity_l1_coeff
    (same penalty: mean over layers of the per-token sum of |h|, averaged over tokens).
    """
    from transformers import CONFIG_MAPPING

    from sparseffn.models.config import SparsityConfig

    layout = reference_layout(config, source)
    fields = {k: v for k, v in config.items() if k not in REFERENCE_FIELDS
              and k not in ("model_type", "architectures", "auto_map", "transformers_version")}
    fields.update(intermediate_size=layout.intermediate_size, hidden_act="relu", mlp_bias=layout.bias)
    base = CONFIG_MAPPING[layout.base].from_dict(fields)
    base.architectures = [CONFIG_MAPPING[layout.base].__name__.replace("Config", "ForCausalLM")]
    setattr(base, REFERENCE_KEY, copy.deepcopy(config))
    l1 = {**REFERENCE_FIELDS, **config}["sparsity_l1_coeff"]
    return base, layout, SparsityConfig(l1_coeff=float(l1))


# ----------------------------------------------------------------------------- tensors on disk

def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (the index's shards, or model.safetensors)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{index}: not a safetensors index with a weight_map ({err})") from None
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    raise FileNotFoundError(f"{folder}: no {WEIGHTS_FILE} or {INDEX_FILE} (the reference format is saved as safetensors)")


def tensor_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, dtype)} of every tensor in the safetensors files, read from their headers."""
    from safetensors import safe_open

    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: a weight file the checkpoint's index names is missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    found[name] = (tuple(piece.get_shape()), piece.get_dtype())
        except (OSError, RuntimeError, ValueError) as err:  # safetensors' errors on a damaged file
            raise ValueError(f"{path}: not a readable safetensors file ({' '.join(str(err).split())})") from None
    return found


def check_tensors(folder: Path, expected: dict[str, tuple[int, ...]], files: list[Path] | None = None) -> None:
    """Raise a one-line ValueError naming the first tensor the checkpoint lacks, holds in excess or holds
    with another shape than `expected` ({name: shape}); floating-point tensors only."""
    found = tensor_shapes(files if files is not None else weight_files(folder))
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ValueError(f"{folder}: tensor {missing[0]} is missing from the checkpoint"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ValueError(f"{folder}: tensor {extra[0]} is in the checkpoint but not in the model it describes"
                         + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    for name in sorted(expected):
        shape, dtype = found[name]
        if tuple(shape) != tuple(expected[name]):
            raise ValueError(f"{folder}: tensor {name} has shape {list(shape)}, the config implies "
                             f"{list(expected[name])}")
        if dtype not in ("BF16", "F16", "F32", "F64"):
            raise ValueError(f"{folder}: tensor {name} has dtype {dtype}, expected a floating-point dtype")


def expected_tensors(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the tensors a reference checkpoint of `model` holds: its state dict without the
    thresholds and without tied copies."""
    from sparseffn.models.sparsify import named_sparse_layers

    state = model.state_dict()
    skip = {f"{name}.threshold" for name, _ in named_sparse_layers(model)}
    tied = getattr(model, "_tied_weights_keys", None) or {}
    if getattr(model.config, "tie_word_embeddings", False):
        skip |= set(tied) if isinstance(tied, dict) else set(tied)
    return {name: tuple(t.shape) for name, t in state.items() if name not in skip}


def write_safetensors(tensors: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int | None = None) -> list[Path]:
    """Write tensors as Hugging Face does: model.safetensors, or model-0000i-of-0000n.safetensors shards of at
    most max_shard_bytes each (a tensor larger than that gets a shard of its own) and the index."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous()
        size += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        path = folder / WEIGHTS_FILE
        save_file(shards[0], str(path), metadata={"format": "pt"})
        return [path]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        path = folder / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        weight_map.update({name: path.name for name in shard})
        paths.append(path)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_parameters": sum(t.numel() for t in tensors.values()), "total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return paths


def auto_map(base: str) -> dict[str, str]:
    return {"AutoConfig": f"{AUTO_MAP_MODULE}.{CONFIG_CLASSES[base]}",
            "AutoModelForCausalLM": f"{AUTO_MAP_MODULE}.{ARCHITECTURES[base]}"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def legacy_rope(fields: dict) -> dict:
    """A transformers-5 config dict with its RoPE settings as 4.x configs hold them (rope_theta, rope_scaling),
    which the reference's transformers reads."""
    fields = dict(fields)
    rope = fields.pop("rope_parameters", None)
    if isinstance(rope, dict):
        rope = dict(rope)
        fields["rope_theta"] = rope.pop("rope_theta", 10000.0)
        fields["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    return fields


# ----------------------------------------------------------------------------- export

def reference_config(model: torch.nn.Module) -> dict:
    """The reference config.json dict of a sparse model: the one it was imported from (REFERENCE_KEY), with
    the dtype of its weights, or one built from its own config."""
    from sparseffn.models.hf_config import CONFIG_KEY, LAYERS_KEY, STRUCTURE_KEY
    from sparseffn.models.sparsify import named_sparse_mlps, sparse_layers

    config = model.config
    layers = sparse_layers(model)
    mlps = named_sparse_mlps(model)
    if not mlps or len(mlps) != len(layers):
        raise ValueError("model must have SparseMLP layers only (the reference format holds Llama-style MLPs)")
    base = config.model_type
    if base not in ARCHITECTURES:
        raise NotImplementedError(f"the reference format exists for model types {sorted(ARCHITECTURES)}, "
                                  f"got {base!r}")
    layer_count = config.num_hidden_layers
    if len(mlps) != layer_count:
        raise ValueError(f"the reference format has a sparse MLP in every layer: {len(mlps)} of {layer_count} are")
    thresholded = [name for name, m in mlps if m.has_threshold]
    if thresholded:
        raise ValueError(f"{len(thresholded)} layer(s) have non-zero thresholds (first: {thresholded[0]}), which the "
                         f"reference format cannot hold (its MLP is a plain ReLU); drop them with set_threshold_(None)")
    def structure(m):
        return m.gate_proj is not None, m.up_proj.bias is not None, m.intermediate_size

    gated, bias, size = structure(mlps[0][1])
    for name, m in mlps:
        if structure(m) != (gated, bias, size):
            raise ValueError(f"{name}: every MLP must have the same structure in the reference format")
    dtype = mlps[0][1].up_proj.weight.dtype
    recorded = getattr(config, REFERENCE_KEY, None)
    if recorded is not None:
        out = copy.deepcopy(recorded)
        if "dtype" in out or "torch_dtype" not in out:
            out["dtype"] = dtype_name(dtype)
        if "torch_dtype" in out:
            out["torch_dtype"] = dtype_name(dtype)
    else:
        skip = {CONFIG_KEY, LAYERS_KEY, REFERENCE_KEY, "architectures", "model_type", "transformers_version",
                "dtype", "torch_dtype", "_name_or_path"}
        out = {k: v for k, v in legacy_rope(config.to_dict()).items() if k not in skip}
        out.update({name: value for name, value in REFERENCE_FIELDS.items()})
        l1 = getattr(config, CONFIG_KEY, {}).get("l1_coeff")
        if l1 is not None:
            out["sparsity_l1_coeff"] = l1
        out["torch_dtype"] = dtype_name(dtype)
        out["model_type"] = base + SUFFIX
        out["architectures"] = [ARCHITECTURES[base]]
        out["auto_map"] = auto_map(base)
    layout = reference_layout(out, "the exported config")
    if (layout.gated, layout.bias, layout.intermediate_size) != (gated, bias, size):
        meta = (getattr(config, LAYERS_KEY, None) or {}).get(STRUCTURE_KEY)
        raise ValueError(f"the model's MLPs (gated={gated}, bias={bias}, H={size}; recorded {meta}) differ from "
                         f"its reference config (gated={layout.gated}, bias={layout.bias}, H={layout.intermediate_size})")
    return out


def export_reference(model: torch.nn.Module, folder: str | os.PathLike, *, max_shard_size: int | None = None) -> Path:
    """Write `model` (sparse, with SparseMLPs in every layer and no thresholds) to `folder` in the reference
    format: config.json (module docstring), generation_config.json and safetensors weights under the
    same names as the reference's save_pretrained (max_shard_size: bytes per shard, None for one file).
    Returns the folder."""
    folder = Path(folder)
    config = reference_config(model)
    expected = expected_tensors(model)  # thresholds and tied copies left out
    state = model.state_dict()
    tensors = {name: state[name] for name in state if name in expected}
    write_safetensors(tensors, folder, max_shard_size)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {k: getattr(model.config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    generation = {k: v for k, v in generation.items() if v is not None}
    (folder / "generation_config.json").write_text(json.dumps({"_from_model_config": True, **generation},
                                                              indent=2, sort_keys=True) + "\n")
    return folder


def copy_tokenizer_files(source: str | os.PathLike, folder: str | os.PathLike) -> list[str]:
    """Copy the Hugging Face tokenizer files `source` has (TOKENIZER_FILES) into `folder`; returns their names."""
    import shutil

    copied = []
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(folder) / name)
            copied.append(name)
    return copied
