"""Model configs by name and `build_model`: Llama-style causal LMs with ReLU gates (docs/design.md).

Every config: hidden_act "relu", tied input/output embeddings, RoPE θ = 1e5, heads of 64, no GQA
(key/value heads = heads), RMSNorm ε = 1e-5, context 2048. Sizes (parameters at the default vocab):

    name   hidden  intermediate  layers  heads  vocab   parameters
    tiny      128           352       4      2   8192       1.85M   (CPU tests and demos)
    20m       256           704      10      4  49152      20.6M
    100m      768          2112      10     12  49152     110.2M
    0.5b     2048          5632       8     32  49152     512.0M    the paper's shapes
    1b       2048          5632      18     32  49152     1.03B
    1.5b     2048          5632      28     32  49152     1.54B
    2b       2048          5632      38     32  49152     2.05B

Small models are dominated by the embedding: pass the tokenizer's `vocab_size`.
transformers is imported inside the functions, so `import sparseffn` stays light.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import numbers
from dataclasses import dataclass

import torch

from sparseffn.models.config import SparsityConfig
from sparseffn.models.sparsify import sparsify_

HEAD_DIM = 64
ROPE_THETA = 1e5
CONTEXT = 2048
PAPER_VOCAB = 49152


@dataclass(frozen=True)
class _Shape:
    hidden: int
    intermediate: int
    layers: int
    vocab: int = PAPER_VOCAB


_SHAPES = {
    "tiny": _Shape(128, 352, 4, vocab=8192),
    "20m": _Shape(256, 704, 10),
    "100m": _Shape(768, 2112, 10),
    "0.5b": _Shape(2048, 5632, 8),
    "1b": _Shape(2048, 5632, 18),
    "1.5b": _Shape(2048, 5632, 28),
    "2b": _Shape(2048, 5632, 38),
}
MODEL_NAMES: tuple[str, ...] = tuple(_SHAPES)


def _check_positive_int(value: object, name: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


# config fields that are sizes: an override of one must be a positive int (0 or -1 layers build no model)
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")


def _check_overrides(config_class, overrides: dict) -> None:
    known = {f.name for f in dataclasses.fields(config_class)} | {"rope_theta"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown {config_class.__name__} field(s) in overrides: {unknown}")
    for name in SIZE_FIELDS:
        if name in overrides:
            value = overrides[name]
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


def model_config(name: str, *, vocab_size: int | None = None, max_position_embeddings: int | None = None, **overrides):
    """The `transformers.LlamaConfig` of a named model (see the table above).

    vocab_size: the tokenizer's (None: the name's default, 49152 = the paper's, 8192 for tiny).
    max_position_embeddings: context length (None: 2048). overrides: any other LlamaConfig field
    (e.g. num_hidden_layers=2); `rope_theta=` is accepted as a shorthand for the RoPE base.
    """
    from transformers import LlamaConfig

    if name not in _SHAPES:
        raise ValueError(f"name must be one of {MODEL_NAMES}, got {name!r}")
    shape = _SHAPES[name]
    vocab = shape.vocab if vocab_size is None else _check_positive_int(vocab_size, "vocab_size")
    context = CONTEXT if max_position_embeddings is None else _check_positive_int(
        max_position_embeddings, "max_position_embeddings"
    )
    _check_overrides(LlamaConfig, overrides)
    fields = dict(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.hidden // HEAD_DIM,
        num_key_value_heads=shape.hidden // HEAD_DIM,
        head_dim=HEAD_DIM,
        hidden_act="relu",
        max_position_embeddings=context,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": float(overrides.pop("rope_theta", ROPE_THETA))},
    )
    if "num_attention_heads" in overrides and "num_key_value_heads" not in overrides:
        overrides["num_key_value_heads"] = overrides["num_attention_heads"]
    fields.update(overrides)
    return LlamaConfig(**fields)


def parameter_count(config) -> int:
    """Parameters of a Llama-style causal LM with this config, from the formula (nothing is built).

    Embedding (counted twice when not tied), per layer attention (q, k, v, o and their biases),
    the gated MLP (and biases), two RMSNorms, and the final norm.
    """
    d, i, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = (config.num_key_value_heads or config.num_attention_heads) * head_dim
    attention = d * q + 2 * d * kv + q * d + (q + 2 * kv + d if getattr(config, "attention_bias", False) else 0)
    mlp = 3 * d * i + (2 * i + d if getattr(config, "mlp_bias", False) else 0)
    embeddings = v * d * (1 if config.tie_word_embeddings else 2)
    return embeddings + n * (attention + mlp + 2 * d) + d


def _fork_rng(device: torch.device | None):
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if (
        device is not None and device.type == "cuda"
    ) else []
    return torch.random.fork_rng(devices=cuda)


def build_model(
    name_or_config,
    sparsity: SparsityConfig | None = SparsityConfig(),
    *,
    vocab_size: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int | None = None,
    **overrides,
):
    """A randomly initialized `LlamaForCausalLM` (sdpa attention), sparsified unless `sparsity` is None.

    name_or_config: a name from MODEL_NAMES (with `vocab_size` and `overrides` passed to
    `model_config`) or a transformers config (copied; `vocab_size` and overrides applied to the copy).
    device / dtype: where and in what dtype the weights are created (the thresholds stay fp32).
    seed: initialize from this seed without touching the global RNG state (None: the global RNG).
    """
    from transformers import AutoModelForCausalLM, PreTrainedConfig

    if sparsity is not None and not isinstance(sparsity, SparsityConfig):
        raise TypeError(f"sparsity must be a SparsityConfig or None, got {type(sparsity).__name__}")
    if isinstance(name_or_config, str):
        config = model_config(name_or_config, vocab_size=vocab_size, **overrides)
    elif isinstance(name_or_config, PreTrainedConfig):
        config = copy.deepcopy(name_or_config)
        _check_overrides(type(config), overrides)
        if vocab_size is not None:
            overrides["vocab_size"] = _check_positive_int(vocab_size, "vocab_size")
        for key, value in overrides.items():
            setattr(config, key, value)
    else:
        raise TypeError(
            f"name_or_config must be a model name {MODEL_NAMES} or a transformers config, got {type(name_or_config).__name__}"
        )
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    if seed is not None and (not isinstance(seed, numbers.Integral) or isinstance(seed, bool)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    device = torch.device(device) if device is not None else None
    kwargs = {"attn_implementation": "sdpa"}
    if dtype is not None:
        kwargs["dtype"] = dtype
    with _fork_rng(device) if seed is not None else contextlib.nullcontext():
        if seed is not None:
            torch.random.default_generator.manual_seed(int(seed))
            if device is not None and device.type == "cuda":
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(int(seed))
        with device if device is not None else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    if sparsity is not None:
        sparsify_(model, sparsity)
    return model
