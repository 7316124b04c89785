"""A user's own decode loop in plain torch, gpt-fast style, on a Llama model's weights: what
`bench decode-model --user-compiled` times against the library's CapturedDecoder.

    x = embed[ids]
    per layer:  a = rms(x) · ln1;  q, k, v = split(a wqkv^T)          q/k/v fused in one weight
                q, k = rope(q), rope(k);  k_cache[:, :, pos] = k ...  static KV cache [B, kv heads, L, hd]
                x += sdpa(q, k_cache, v_cache, mask[pos]) wo^T
                x += mlp(rms(x) · ln2)
    logits = rms(x) · norm  lm_head^T

The MLP is three F.linear (dense, the down weight copied to [D, H] rows, a dense model's layout) or the
public op, `sparse_mlp(mode="auto", prepared=..., expected_nnz=...)` with the layer's measured activity
(sparse). `compile_step` wraps the one-token step in
torch.compile(mode="reduce-overhead", fullgraph=True): Inductor kernels replayed from CUDA graphs.
Parameters and norms are the model's own tensors (no copy); wqkv is one concatenated copy, and the dense
down weight another.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparseffn.ops import SparseMLPWeights, sparse_mlp


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face's LlamaRMSNorm: normalized in fp32, cast back, then scaled."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """t [B, heads, T, hd] rotated by the halves convention (Hugging Face's rotate_half); cos, sin [T, hd]."""
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rotated * sin


class _Layer(nn.Module):
    def __init__(self, layer: nn.Module, batch_size: int, max_length: int, sparse: bool) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        if any(getattr(m, "bias", None) is not None for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)):
            raise ValueError("the user decoder takes attention without biases (Llama)")
        if getattr(mlp, "gate_proj", None) is None or not hasattr(mlp, "threshold"):
            raise ValueError(f"the user decoder takes gated SparseMLP layers, got {type(mlp).__name__}")
        self.heads, self.kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.register_buffer("wqkv", torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach())
        self.wo = attn.o_proj.weight
        self.ln1, self.ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.gate, self.up = mlp.gate_proj.weight, mlp.up_proj.weight
        # dense: the down weight as a dense model stores it ([D, H] rows); sparse: SparseMLP's transposed one
        self.down = mlp.down_proj.weight if sparse else mlp.down_proj.weight.detach().contiguous()
        self.register_buffer("threshold", mlp.threshold)
        shape = (batch_size, self.kv_heads, max_length, self.head_dim)
        self.register_buffer("k_cache", self.wqkv.new_zeros(shape))
        self.register_buffer("v_cache", self.wqkv.new_zeros(shape))
        # the public op's arguments: weights prepared once, the layer's active units per token (its hint,
        # else what it measured: what auto mode in the layer would go by)
        self.prepared = SparseMLPWeights.prepare(self.gate, self.up, self.down) if sparse else None
        hint = getattr(mlp, "expected_nnz", None)
        self.expected_nnz = (hint if hint is not None else mlp.activity.nnz) if sparse else None
        if sparse and self.expected_nnz is None:
            raise ValueError("the sparse user decoder needs each layer's measured activity (run the model in "
                             "auto mode first)")

    def forward(self, x, pos, cos, sin, mask, eps: float):
        b, t, _ = x.shape
        q, k, v = F.linear(_rms_norm(x, self.ln1, eps), self.wqkv).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = _rope(q.view(b, t, self.heads, self.head_dim).transpose(1, 2), cos, sin)
        k = _rope(k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2))
        a = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask,
                                           enable_gqa=self.kv_heads != self.heads)
        x = x + F.linear(a.transpose(1, 2).reshape(b, t, -1), self.wo)
        h = _rms_norm(x, self.ln2, eps)
        if self.prepared is None:
            up = F.linear(h, self.up)
            return x + F.linear(torch.relu(F.linear(h, self.gate) - self.threshold.to(h.dtype)) * up, self.down)
        return x + sparse_mlp(h, self.gate, self.up, self.down, self.threshold, mode="auto", prepared=self.prepared,
                              expected_nnz=self.expected_nnz)


class UserDecoder(nn.Module):
    """Greedy generation by the loop above, for a Llama causal LM with SparseMLP layers (module
    docstring); one batch size and length. sparse: the MLPs call the public op (else F.linear)."""

    def __init__(self, model: nn.Module, *, batch_size: int, max_length: int, sparse: bool) -> None:
        super().__init__()
        cfg, inner = model.config, model.model
        self.eps = cfg.rms_norm_eps
        self.embed, self.norm, self.lm_head = inner.embed_tokens.weight, inner.norm.weight, model.lm_head.weight
        self.layers = nn.ModuleList(_Layer(layer, batch_size, max_length, sparse) for layer in inner.layers)
        head_dim = self.layers[0].head_dim
        theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=self.embed.device) / head_dim)
        freqs = torch.outer(torch.arange(max_length, dtype=torch.float32, device=self.embed.device), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)  # [L, hd]
        self.register_buffer("cos", angles.cos().to(self.embed.dtype))
        self.register_buffer("sin", angles.sin().to(self.embed.dtype))
        positions = torch.arange(max_length, device=self.embed.device)
        self.register_buffer("causal", positions[None, :] <= positions[:, None])  # [L, L]: query sees key
        self.compiled_step = None  # compile_step's torch.compile of next_token

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the last position, for ids [B, T] at cache positions pos [T]."""
        x = F.embedding(ids, self.embed)
        cos, sin, mask = self.cos[pos], self.sin[pos], self.causal[pos][None, None]
        for layer in self.layers:
            x = layer(x, pos, cos, sin, mask, self.eps)
        return F.linear(_rms_norm(x[:, -1], self.norm, self.eps), self.lm_head)

    def next_token(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The greedy next token [B] (int64) after ids [B, T] at cache positions pos [T]."""
        return self.forward(ids, pos).argmax(-1)

    def compile_step(self) -> None:
        """The one-token step through torch.compile, as gpt-fast compiles its decode_one_token (one static
        shape per decoder: the op decides its path per batch size at trace time)."""
        self.compiled_step = torch.compile(self.next_token, mode="reduce-overhead", fullgraph=True, dynamic=False)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int, step_ms: list[float] | None = None) -> torch.Tensor:
        """[B, P + new_tokens], greedy. The prompt runs eagerly (one forward); each new token is one call
        of the step (compiled by `compile_step`, else eager). step_ms: filled with the GPU ms of each step
        from the fourth on (CUDA events; the first ones compile, warm up and record the CUDA graph)."""
        p = prompt.shape[1]
        out = torch.empty(prompt.shape[0], p + new_tokens, dtype=torch.long, device=prompt.device)
        out[:, :p] = prompt
        token = self.next_token(prompt, torch.arange(p, device=prompt.device))
        out[:, p] = token
        pos = torch.tensor([p], device=prompt.device)
        step = self.compiled_step or self.next_token
        timed = step_ms is not None and prompt.is_cuda
        events = [torch.cuda.Event(enable_timing=True) for _ in range(new_tokens)] if timed else []
        for i in range(1, new_tokens):
            if events:
                events[i - 1].record()
            # cloned: a CUDA graph's output is overwritten by its next replay
            token = step(token[:, None], pos).clone()
            out[:, p + i] = token
            pos += 1
        if events:
            events[-1].record()
            events[-1].synchronize()
            step_ms[:] = [a.elapsed_time(b) for a, b in zip(events[3:-1], events[4:])]
        return out
