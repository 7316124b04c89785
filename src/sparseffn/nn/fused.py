"""Fused replacements for Hugging Face's non-MLP elementwise code: RMSNorm and rotary embedding.

`FusedRMSNorm` is a drop-in for `LlamaRMSNorm` (and Mistral's / Qwen2's, which compute the same):
the same `weight` Parameter and `variance_epsilon` attribute, so state dicts are unchanged, and the
same function through `ops.rms_norm` (one kernel forward, one backward, instead of ~7 each).

Under autocast (training with fp32 weights), Hugging Face's norm and RoPE return fp32, which every
projection and the attention then cast to bf16, each on its own: per layer casts of the [tokens, D]
activations for q, k and v and for the MLP, of q and k for attention, their gradients' casts back and
fp32 sums. Where the consumers are known to cast, the fused modules return autocast's dtype directly
(the same values, rounded once as the cast would): a norm with `autocast_output` set
(`models.fuse_non_mlp_` sets it on a decoder layer's norm before its fused attention, and before an MLP
that only projects its input) while the projections that read its output are plain nn.Linear modules,
and the fused attention's RoPE when no cache is passed (a cache keeps Hugging Face's dtype: a static
cache's buffers have the model's). The backward then adds the projections' input gradients in bf16 where
Hugging Face adds them in fp32.

`fuse_attention_rope_(attn)` gives one `LlamaAttention` instance a forward that does what
transformers 5.24's `LlamaAttention.forward` does with `ops.apply_rope` in place of
`apply_rotary_pos_emb` (one kernel for q and k instead of ~10 elementwise ops and 2 concatenations):

    q, k, v = q_proj(x), k_proj(x), v_proj(x)        viewed [B, S, H, d], transposed to [B, H, S, d];
                                                     one launch at one or two tokens (ops.decode_linear)
    q, k    = apply_rope(q, k, cos, sin)             (cos, sin) = position_embeddings
    k, v    = cache.update(k, v, layer_idx, kwargs=kwargs)              when a cache is given
    out, w  = the config's attention interface (eager_attention_forward by default)
    return o_proj(out reshaped to [B, S, H * d]), w

Keyword handling: the cache arrives as `cache` (transformers 5.24) or `past_key_values` (the name
decoder layers of earlier 5.x releases pass, deprecated in 5.24: transformers' own class forward
warns there, this one takes either silently; when both are given `cache` wins), and every other
keyword reaches the cache update and the attention interface. Only the instance changes (its `forward` attribute); the class and
transformers' module-level functions are never patched, and `unfuse_attention_rope_` deletes the
attribute again. Written against transformers 5.24: a later release whose LlamaAttention.forward
does more would need this forward updated.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from sparseffn.nn.projections import is_plain
from sparseffn.ops.decode_linear import decode_projections
from sparseffn.ops.fused_norm_rope import apply_rope, autocast_output_dtype, rms_norm

_UNSET = object()  # `cache` not passed at all (distinct from cache=None, as transformers tells them apart)
_ATTENTION_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "layer_idx", "config", "scaling",
                    "attention_dropout")


class FusedRMSNorm(nn.Module):
    """y = weight * (x.float() * rsqrt(mean(x², -1) + variance_epsilon)).to(x.dtype), fused.

    Output dtype torch.promote_types(weight.dtype, x.dtype), as Hugging Face's; with `autocast_output`
    set (off by default), autocast's dtype under autocast where that would be fp32 (module docstring),
    as long as every projection named in `autocast_consumers` ((module, attribute names) pairs, read at
    each call) is a plain nn.Linear: a LoRA or hooked layer may compute on its input before casting it.
    `from_hf` shares the Hugging Face module's Parameter and remembers the module (a plain attribute,
    not a submodule: the state dict holds only `weight`) so that `to_hf` can put it back.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.autocast_output = False
        self.autocast_consumers: list[tuple[nn.Module, tuple[str, ...]]] = []  # a list: not submodules
        self._hf_norm = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out_dtype = None
        # autocast first: outside it (decode) the projections are not looked at
        if self.autocast_output and torch.is_autocast_enabled(hidden_states.device.type) and all(
                is_plain(getattr(owner, name)) for owner, names in self.autocast_consumers for name in names):
            out_dtype = autocast_output_dtype(hidden_states, self.weight)
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, out_dtype=out_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"

    @classmethod
    def from_hf(cls, norm: nn.Module) -> "FusedRMSNorm":
        """A FusedRMSNorm over `norm`'s own `weight` Parameter (shared, not copied) and epsilon.

        `norm`: a module with a 1-D Parameter `weight` and a number `variance_epsilon` computing the
        Llama RMSNorm (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm). Refused (ValueError) when
        `norm` carries forward hooks or an instance-level forward (e.g. accelerate's), which the
        replacement would silently drop.
        """
        if not isinstance(norm, nn.Module):
            raise TypeError(f"norm must be an nn.Module, got {type(norm).__name__}")
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            raise TypeError(f"norm must have a 1-D Parameter `weight` (a Llama-style RMSNorm), got {type(norm).__name__}")
        eps = getattr(norm, "variance_epsilon", None)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"norm must have a number `variance_epsilon`, got {eps!r} in {type(norm).__name__}")
        if "forward" in vars(norm) or norm._forward_hooks or norm._forward_pre_hooks:
            raise ValueError(
                f"norm ({type(norm).__name__}) has forward hooks or an instance-level forward (e.g. accelerate "
                f"device-map hooks); replacing it would drop them"
            )
        fused = cls(weight.shape[0], eps, device="meta")
        fused.weight = weight
        object.__setattr__(fused, "_hf_norm", norm)  # a plain attribute, not a submodule
        return fused

    def to_hf(self) -> nn.Module:
        """The Hugging Face module `from_hf` took, holding this module's current weight and epsilon."""
        norm = self._hf_norm
        if norm is None:
            raise ValueError("this FusedRMSNorm was not built by from_hf: there is no Hugging Face module to return")
        norm.weight = self.weight
        norm.variance_epsilon = self.variance_epsilon
        return norm


def _llama_attention_forward_fused_rope(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache=_UNSET,
    **kwargs,
):
    """LlamaAttention.forward of transformers 5.24 with the fused rotary embedding (module docstring)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    if "past_key_values" in kwargs:  # the cache's name before transformers 5.24 (deprecated there); `cache` wins
        legacy = kwargs.pop("past_key_values")
        if cache is _UNSET:
            cache = legacy
    if cache is _UNSET:
        cache = None

    batch_seq = hidden_states.shape[:-1]
    heads_shape = (*batch_seq, -1, self.head_dim)
    # one launch for the three projections at one or two tokens (inference) when each is a plain,
    # bias-free nn.Linear without hooks (else a LoRA, quantized or hooked layer would be bypassed)
    layers = (self.q_proj, self.k_proj, self.v_proj)
    qkv = None
    if all(is_plain(m) and m.bias is None for m in layers):
        qkv = decode_projections(hidden_states, [m.weight for m in layers])
    if qkv is None:
        qkv = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    # [B, S, H * d] -> [B, H, S, d] views of [B, S, H, d] memory
    query, key, value = (t.view(heads_shape).transpose(1, 2) for t in qkv)

    cos, sin = position_embeddings
    # without a cache (training) q and k go only to attention, which casts them to autocast's dtype
    out_dtype = None if cache is not None else autocast_output_dtype(query, cos, sin)
    query, key = apply_rope(query, key, cos, sin, out_dtype=out_dtype)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)

    attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    out, weights = attend(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=self.attention_dropout if self.training else 0.0,
        scaling=self.scaling,
        **kwargs,
    )
    out = out.reshape(*batch_seq, -1).contiguous()
    return self.o_proj(out), weights


def has_fused_rope(attn: nn.Module) -> bool:
    """Whether `attn` runs the fused-RoPE forward of `fuse_attention_rope_`."""
    forward = vars(attn).get("forward")
    return getattr(forward, "__func__", None) is _llama_attention_forward_fused_rope


def fuse_attention_rope_(attn: nn.Module) -> nn.Module:
    """Give one Hugging Face `LlamaAttention` instance the fused-RoPE forward (module docstring), in
    place; returns attn. Already fused: unchanged. Refused when the instance's forward is already
    overridden by something else (e.g. accelerate hooks: ValueError) or it lacks LlamaAttention's
    attributes (TypeError). Other attention classes are not checked for equivalence: the caller
    picks LlamaAttention (models.fuse_non_mlp_ does)."""
    if not isinstance(attn, nn.Module):
        raise TypeError(f"attn must be an nn.Module, got {type(attn).__name__}")
    missing = [name for name in _ATTENTION_ATTRS if not hasattr(attn, name)]
    if missing:
        raise TypeError(f"attn must be a Hugging Face LlamaAttention; {type(attn).__name__} lacks {missing}")
    if has_fused_rope(attn):
        return attn
    if "forward" in vars(attn):
        raise ValueError(
            f"attn ({type(attn).__name__}) already has an instance-level forward (e.g. accelerate hooks); "
            f"replacing it would drop that"
        )
    attn.forward = types.MethodType(_llama_attention_forward_fused_rope, attn)
    return attn


def unfuse_attention_rope_(attn: nn.Module) -> nn.Module:
    """Undo `fuse_attention_rope_`: the instance runs its class's forward again; returns attn."""
    if not has_fused_rope(attn):
        raise ValueError(f"attn ({type(attn).__name__}) does not run the fused-RoPE forward")
    del attn.forward
    return attn
