"""Swap a Hugging Face causal LM's RMSNorms and Llama rotary embeddings for fused kernels, and back.

`fuse_non_mlp_(model)`, in place and on instances only (no class or module-level function is
patched):
  * every module whose class is named `LlamaRMSNorm`, `MistralRMSNorm` or `Qwen2RMSNorm` (the same
    math in transformers 5.24) becomes an `nn.FusedRMSNorm` sharing its `weight` Parameter;
  * every `LlamaAttention` (by class name) gets the fused-RoPE forward (`nn.fuse_attention_rope_`).
    Other attention classes (Mistral's, Qwen2's, ...) are left alone: their forwards differ in
    details (sliding windows and the like) this package does not reproduce.
The function is unchanged (same math; low-precision results differ by rounding only, as the
kernels round once where Hugging Face rounds several times), the state dict keys and the config
are untouched, so save_pretrained / from_pretrained see the original model. `unfuse_non_mlp_`
puts the Hugging Face modules and forwards back. MLPs are not touched: `sparsify_` before or after
fusing works the same.
"""

from __future__ import annotations

from torch import nn

from sparseffn.nn.fused import FusedRMSNorm, fuse_attention_rope_, has_fused_rope, unfuse_attention_rope_

RMS_NORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
ROPE_ATTENTION_CLASSES = ("LlamaAttention",)


def _check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a Hugging Face model), got {type(model).__name__}")
    return model


def _replace_children(model: nn.Module, swap) -> int:
    """Replace every child c (at every place it is registered) for which swap(c) returns a module;
    a module registered twice gets one replacement. Every swap runs before the first replacement,
    so a swap that raises leaves the model as it was. Returns the number of distinct modules swapped."""
    places = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]
    new: dict[int, nn.Module] = {}
    for _, _, child in places:
        if id(child) not in new and (replacement := swap(child)) is not None:
            new[id(child)] = replacement
    for parent, name, child in places:
        if id(child) in new:
            setattr(parent, name, new[id(child)])
    return len(new)


def fuse_non_mlp_(model: nn.Module) -> nn.Module:
    """Fuse `model`'s RMSNorms and LlamaAttention rotary embeddings in place (module docstring);
    returns model. Raises ValueError when there is nothing to fuse (none found, or already fused)."""
    _check_model(model)
    attentions = [m for m in model.modules() if type(m).__name__ in ROPE_ATTENTION_CLASSES and not has_fused_rope(m)]
    overridden = [type(m).__name__ for m in attentions if "forward" in vars(m)]
    if overridden:  # checked before anything changes
        raise ValueError(
            f"{len(overridden)} attention module(s) already have an instance-level forward (e.g. accelerate "
            f"hooks); fusing would drop it"
        )
    norms = _replace_children(model, lambda m: FusedRMSNorm.from_hf(m) if type(m).__name__ in RMS_NORM_CLASSES else None)
    for module in attentions:
        fuse_attention_rope_(module)
    if norms == 0 and not attentions:
        if _is_fused(model):
            raise ValueError("model is already fused (it holds FusedRMSNorm modules or fused-RoPE attention)")
        raise ValueError(
            f"nothing to fuse in {type(model).__name__}: fuse_non_mlp_ replaces {', '.join(RMS_NORM_CLASSES)} "
            f"modules and gives {', '.join(ROPE_ATTENTION_CLASSES)} modules a fused rotary embedding"
        )
    return model


def _is_fused(model: nn.Module) -> bool:
    return any(isinstance(m, FusedRMSNorm) or has_fused_rope(m) for m in model.modules())


def unfuse_non_mlp_(model: nn.Module) -> nn.Module:
    """Undo `fuse_non_mlp_` in place: each FusedRMSNorm built by it becomes its original Hugging Face
    module again (holding the current weight), each fused attention runs its class's forward;
    returns model. Raises ValueError when nothing is fused."""
    _check_model(model)
    if not _is_fused(model):
        raise ValueError(f"model ({type(model).__name__}) has nothing fused: nothing to unfuse")
    unbuilt = [name for name, m in model.named_modules() if isinstance(m, FusedRMSNorm) and m._hf_norm is None]
    if unbuilt:
        raise ValueError(
            f"{len(unbuilt)} FusedRMSNorm module(s) were not built by fuse_non_mlp_ (first: {unbuilt[0]}): "
            f"there is no Hugging Face module to put back"
        )
    _replace_children(model, lambda m: m.to_hf() if isinstance(m, FusedRMSNorm) else None)
    for module in model.modules():
        if has_fused_rope(module):
            unfuse_attention_rope_(module)
    return model
