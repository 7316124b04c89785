"""An independent plain-torch forward of a reference-format (`*_sparse_relu`) checkpoint: reads config.json
and the safetensors files itself and computes the causal LM in fp32 (RMSNorm, rotary embedding, causal
attention with grouped key/value heads, ReLU MLP), sharing no code with sparseffn or transformers."""

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(load_file(str(folder / name)))
    return tensors


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def reference_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] in fp32 of the checkpoint in `folder` for input ids [B, T]."""
    c = json.loads((folder / "config.json").read_text())
    w = {k: v.float() for k, v in read_tensors(folder).items()}
    get = w.get
    d, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or d // heads
    eps, theta = c["rms_norm_eps"], c["rope_theta"]
    gated = c.get("sparsity_gated_mlp", True)
    b, t = ids.shape
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.outer(torch.arange(t, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos().float(), angles.sin().float()
    mask = torch.full((t, t), float("-inf")).triu(1)

    def linear(x, name):
        y = x @ w[name + ".weight"].T
        bias = get(name + ".bias")
        return y if bias is None else y + bias

    x = w["model.embed_tokens.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = linear(h, p + "self_attn.q_proj").view(b, t, heads, hd).transpose(1, 2)
        k = linear(h, p + "self_attn.k_proj").view(b, t, kv_heads, hd).transpose(1, 2)
        v = linear(h, p + "self_attn.v_proj").view(b, t, kv_heads, hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k = k.repeat_interleave(heads // kv_heads, 1)
        v = v.repeat_interleave(heads // kv_heads, 1)
        att = (q @ k.transpose(-1, -2) / math.sqrt(hd) + mask).softmax(-1)
        x = x + linear((att @ v).transpose(1, 2).reshape(b, t, heads * hd), p + "self_attn.o_proj")
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        if gated:
            a = torch.relu(linear(h, p + "mlp.gate_proj")) * linear(h, p + "mlp.up_proj")
        else:
            a = torch.relu(linear(h, p + "mlp.up_proj"))
        x = x + linear(a, p + "mlp.down_proj")
    x = _rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T
