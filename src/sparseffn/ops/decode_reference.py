"""Eager fp32 truth for the attention side of one decode step (ops/decode_attention.py).

One new token per sequence b, batch B; the layer's residual stream hidden [B, D]; heads of dim d,
Hq query heads and Hkv key/value heads (GQA: query head h reads key/value head h // (Hq / Hkv));
caches [B, Hkv, S_max, d]; positions [B] the new token's slot in each sequence.

    qkv:        n = rms_norm(hidden) · norm_weight;  q, k, v = n wq^T + bq, n wk^T + bk, n wv^T + bv
                q, k rotated at positions[b] (Hugging Face rotary layout: dim i pairs with i + d/2);
                k, v stored at k_cache[b, :, positions[b]], v_cache[b, :, positions[b]]
    attention:  o[b, h] = softmax_j(q[b, h] · k[b, h', j] · scaling) v[b, h', j] over
                j = valid_from[b] .. positions[b] inclusive (valid_from default 0)
    out_proj:   out = residual + attn wo^T + bo

Everything in fp32 without intermediate rounding (the caches, being stored, are read as stored).
"""

from __future__ import annotations

import torch


def _f(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def decode_qkv_rope_reference(hidden, norm_weight, eps, wq, wk, wv, bq, bk, bv, cos_table, sin_table,
                              positions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [B, Hq, d], k [B, Hkv, d], v [B, Hkv, d]) in fp32: q and k rotated, nothing stored."""
    x = hidden.float()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    d = cos_table.shape[-1]
    outs = []
    for w, bias in ((wq, bq), (wk, bk), (wv, bv)):
        y = n @ w.float().t()
        if bias is not None:
            y = y + bias.float()
        outs.append(y.view(y.shape[0], -1, d))
    q, k, v = outs
    pos = positions.long()
    cos = cos_table.float()[pos][:, None, :]  # [B, 1, d]: broadcast over heads
    sin = sin_table.float()[pos][:, None, :]
    return rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin), v


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x · cos + rotate_half(x) · sin, rotate_half(x) = [-x2, x1] for halves x1, x2 of the last dim."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decode_attention_reference(q, k_cache, v_cache, positions, scaling, valid_from=None) -> torch.Tensor:
    """[B, Hq·d] fp32: each query head's softmax attention over its sequence's valid cache slots."""
    b, hq, d = q.shape
    hkv, s_max = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    slots = torch.arange(s_max, device=q.device)
    lo = torch.zeros_like(positions) if valid_from is None else valid_from
    valid = (slots[None, :] >= lo.long()[:, None]) & (slots[None, :] <= positions.long()[:, None])  # [B, S_max]
    k = k_cache.float().repeat_interleave(group, dim=1)  # [B, Hq, S_max, d]
    v = v_cache.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), k) * scaling
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bhs,bhsd->bhd", p, v).reshape(b, hq * d)


def decode_out_proj_reference(attn, wo, bo, residual) -> torch.Tensor:
    """[B, D] fp32: residual + attn wo^T (+ bo)."""
    y = attn.float() @ wo.float().t()
    if bo is not None:
        y = y + bo.float()
    return residual.float() + y
