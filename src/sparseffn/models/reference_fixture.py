"""A checkpoint in the reference implementation's format, at random weights: the released SparseLM models'
shape and layout, without downloading them (`sparseffn fixture OUT_DIR`).

Written as the reference's `save_pretrained` writes (models/reference.py has the format): a config.json
with the base config's fields as a transformers 4.x save holds them (rope_theta, torch_dtype), the
reference's extra fields at their defaults, its architectures and auto_map; safetensors under the Hugging
Face names, one file or shards with their index; generation_config.json; and a small byte-level tokenizer
(tokenizer.json with "<|endoftext|>" as id 0, as the SmolLM2 tokenizer the released models use), so every
command runs on it offline. Tensor names and shapes are enumerated here, not taken from transformers or
from the loader, so the fixture checks the reader instead of agreeing with it by construction.

Random ReLU gates fire for half the units. To give the fixture a sparsity of the kind a trained model has
(most units silent on most tokens, a different few per token), every embedding row gets a component
c·e along one unit vector e, the attention and MLP outputs are kept orthogonal to e (so every layer's
input keeps it), and every gate row gets -k_j·σ/ρ along e: unit j's pre-activation is then centred about
k_j standard deviations below zero (k_j ~ `gate_shift` · (1 + 0.25·N(0,1))), so a few percent of the units
fire per token. Measure the activity the fixture really has (`sparseffn eval`, the benchmarks' activity
columns); nothing here calibrates it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from sparseffn.models.reference import ARCHITECTURES, REFERENCE_FIELDS, SUFFIX, auto_map, write_safetensors

PAPER_SHAPES = ("0.5b", "1b", "1.5b", "2b")  # SakanaAI/SparseLM0.5B ... SparseLM2B (models/registry.py shapes)
EOS = "<|endoftext|>"
TRANSFORMERS_VERSION = "4.57.1"  # what the config says it was written by (a 4.x save: the reference's)


@dataclass(frozen=True)
class FixtureSpec:
    """What to write. intermediate_size: the config's; new_intermediate_size: the MLPs' H when resized (the
    reference's sparsity_new_intermediate_size), None to keep intermediate_size. max_shard_bytes: shard size
    (None: one model.safetensors). dtype_key: "torch_dtype" (4.x up to 4.55) or "dtype" (later saves)."""

    base: str = "llama"
    gated: bool = True
    bias: bool = False
    hidden_size: int = 64
    intermediate_size: int = 160
    new_intermediate_size: int | None = None
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    vocab_size: int = 320
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    rope_theta: float = 100000.0
    dtype: str = "bfloat16"
    max_shard_bytes: int | None = None
    dtype_key: str = "torch_dtype"
    seed: int = 0
    gate_shift: float = 2.5  # k: mean gate pre-activation in standard deviations below zero (0: plain random)
    tokenizer: bool = True

    def __post_init__(self) -> None:
        if self.base not in ARCHITECTURES:
            raise ValueError(f"base must be one of {sorted(ARCHITECTURES)}, got {self.base!r}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.dtype_key not in ("torch_dtype", "dtype"):
            raise ValueError(f"dtype_key must be 'torch_dtype' or 'dtype', got {self.dtype_key!r}")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must split into num_attention_heads "
                             f"{self.num_attention_heads}, which must split into num_key_value_heads "
                             f"{self.num_key_value_heads}")
        if self.tokenizer and self.vocab_size < 257:
            raise ValueError(f"vocab_size must be >= 257 for the byte-level tokenizer, got {self.vocab_size}")
        if self.gate_shift < 0 or not math.isfinite(self.gate_shift):
            raise ValueError(f"gate_shift must be a finite number >= 0, got {self.gate_shift}")

    @classmethod
    def paper(cls, name: str, **overrides) -> "FixtureSpec":
        """The shape of the released SparseLM model `name` ("0.5b" ... "2b"), Llama base, gated, bf16."""
        from sparseffn.models.registry import model_config

        if name not in PAPER_SHAPES:
            raise ValueError(f"shape must be one of {PAPER_SHAPES} (or give the dimensions), got {name!r}")
        c = model_config(name)
        fields = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, vocab_size=c.vocab_size,
                      max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_parameters["rope_theta"],
                      max_shard_bytes=5 * 10**9)
        fields.update(overrides)
        return cls(**fields)

    @property
    def mlp_size(self) -> int:
        return self.new_intermediate_size or self.intermediate_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def fixture_config(spec: FixtureSpec) -> dict:
    """The config.json dict the reference's save_pretrained writes for this model."""
    d, n = spec.hidden_size, spec.num_hidden_layers
    config = {
        "architectures": [ARCHITECTURES[spec.base]],
        "auto_map": auto_map(spec.base),
        "model_type": spec.base + SUFFIX,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "hidden_act": "silu",  # the reference's configs keep the base's; its MLP is ReLU regardless
        "hidden_size": d,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": n,
        "num_key_value_heads": spec.num_key_value_heads,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_word_embeddings,
        spec.dtype_key: spec.dtype,
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": spec.vocab_size,
        "mlp_bias": spec.bias,
        **REFERENCE_FIELDS,
        "sparsity_new_intermediate_size": spec.new_intermediate_size,
        "sparsity_gated_mlp": spec.gated,
    }
    if spec.base == "llama":
        config.update(attention_bias=False, head_dim=spec.head_dim, pretraining_tp=1,
                      # extra keys the released models' training configs pass through (kept by the reference)
                      is_llama_config=True, rope_interleaved=False, sparsity_max_seq_length=2048)
    else:
        config.update(layer_types=["full_attention"] * n, max_window_layers=n, sliding_window=None,
                      use_sliding_window=False)
    return dict(sorted(config.items()))


def fixture_shapes(spec: FixtureSpec) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every tensor the reference saves for this model, in save order."""
    d, h, v, hd = spec.hidden_size, spec.mlp_size, spec.vocab_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    qkv_bias = spec.base == "qwen2"  # Qwen2's q/k/v projections have biases, Llama's (attention_bias false) not
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"{p}self_attn.{name}.weight"] = (out, d)
            if qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        shapes[f"{p}self_attn.o_proj.weight"] = (d, q)
        for name, shape in ((("gate_proj", (h, d)),) if spec.gated else ()) + (("up_proj", (h, d)), ("down_proj", (d, h))):
            shapes[f"{p}mlp.{name}.weight"] = shape
            if spec.bias:
                shapes[f"{p}mlp.{name}.bias"] = (shape[0],)
        shapes[f"{p}input_layernorm.weight"] = (d,)
        shapes[f"{p}post_attention_layernorm.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def fixture_tensors(spec: FixtureSpec, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Random weights of the fixture (module docstring), in spec.dtype, on the CPU."""
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    std, d = 0.02, spec.hidden_size
    e = torch.randn(d, generator=gen, device=device)
    e /= e.norm()
    out_std = std / math.sqrt(2 * spec.num_hidden_layers)  # scaled init of the residual branches' outputs
    embed_std = 1.0
    rho = 1 / math.sqrt(2)  # cosine between an embedding row (random part of norm c, plus c·e) and e
    dtype = getattr(torch, spec.dtype)
    tensors = {}
    for name, shape in fixture_shapes(spec).items():
        if name.endswith("layernorm.weight"):
            t = torch.ones(shape, device=device)
        elif name == "model.norm.weight":  # logits of a few units' spread (the tied embedding rows are large)
            t = torch.full(shape, 3 / math.sqrt(d), device=device)
        elif name == "model.embed_tokens.weight":
            t = embed_std * torch.randn(shape, generator=gen, device=device)
            if spec.gate_shift > 0:
                t += embed_std * math.sqrt(d) * e  # c = the random part's norm: cosine rho with e
        elif name.endswith(".bias"):
            t = std * torch.randn(shape, generator=gen, device=device)
        else:
            scale = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            t = scale * torch.randn(shape, generator=gen, device=device)
        if spec.gate_shift > 0 and name.endswith(("o_proj.weight", "down_proj.weight", "down_proj.bias")):
            t -= torch.outer(e, e @ t) if t.dim() == 2 else e * (e @ t)  # outputs orthogonal to e
        first = "gate_proj.weight" if spec.gated else "up_proj.weight"
        if name.endswith(first) and spec.gate_shift > 0:
            k = spec.gate_shift * (1 + 0.25 * torch.randn(shape[0], 1, generator=gen, device=device)).clamp_min(0)
            t += -(k * std / rho) * e  # k_j standard deviations below zero where the input's cosine with e is rho
        tensors[name] = t.to(dtype).cpu()
    return tensors


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer without merges: "<|endoftext|>" = 0, then the 256 bytes (ids 1..256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {EOS: 0, **{ch: i + 1 for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS, "unk_token": EOS,
         "model_max_length": 2048}, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS}, indent=2) + "\n")


def write_fixture(folder: str | os.PathLike, spec: FixtureSpec = FixtureSpec(), *,
                  device: torch.device | str = "cpu") -> Path:
    """Write the fixture checkpoint into `folder` (created; must not hold a config.json). Returns the folder.
    device: where the random weights are drawn (a GPU is faster at the paper's sizes; the values differ
    by device for one seed)."""
    folder = Path(folder)
    if (folder / "config.json").exists():
        raise FileExistsError(f"{folder} already holds a config.json: give an empty or new directory")
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(fixture_tensors(spec, device), folder, spec.max_shard_bytes)
    (folder / "config.json").write_text(json.dumps(fixture_config(spec), indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(
        {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 0,
         "transformers_version": TRANSFORMERS_VERSION}, indent=2) + "\n")
    if spec.tokenizer:
        write_tokenizer(folder)
    return folder

