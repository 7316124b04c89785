"""Swap a Hugging Face causal LM's RMSNorms and Llama rotary embeddings for fused kernels, and back.

`fuse_non_mlp_(model)`, in place and on instances only (no class or module-level function is
patched):
  * every norm whose class's `forward` is LlamaRMSNorm's (the same code, compared as syntax trees, as
    transformers copies it into Mistral, Qwen2/3, Granite, SmolLM3, Mixtral, Phi-3, ...) becomes an
    `nn.FusedRMSNorm` sharing its `weight` Parameter;
  * every attention whose class's `forward` is LlamaAttention's, in a module whose rotary and eager
    attention functions are Llama's too, gets the fused-RoPE forward (`nn.fuse_attention_rope_`),
    which at one or two tokens per call also computes q, k and v in one launch (`ops.decode_linear`).
A decoder layer whose forward is LlamaDecoderLayer's gets autocast outputs on its norms where their
consumers are known to cast (`FusedRMSNorm.autocast_output`, nn/fused.py): the norm before a fused
attention, and the norm before an MLP that is a SparseMLP or computes LlamaMLP's forward, while the
projections reading their output are plain nn.Linear modules (checked at each call: PEFT may wrap them later).
Everything else is left alone and reported: Gemma's norms scale by (1 + weight), OLMo2's multiply
before casting, Cohere and StableLM use LayerNorm, Qwen3 normalizes q and k, Mistral passes sliding
windows; the kernels compute none of these. `fusion_plan(model)` lists, per module, what would be
fused and why the rest would not; `fuse_non_mlp_` warns with that list for what it skipped.
The function is unchanged (same math; low-precision results differ by rounding only, as the
kernels round once where Hugging Face rounds several times), the state dict keys and the config
are untouched, so save_pretrained / from_pretrained see the original model. `unfuse_non_mlp_`
puts the Hugging Face modules and forwards back. MLPs are not touched: `sparsify_` before or after
fusing works the same.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import warnings

from torch import nn

from sparseffn.nn.fused import FusedRMSNorm, fuse_attention_rope_, has_fused_rope, unfuse_attention_rope_
from sparseffn.nn.sparse_mlp import SparseMLP

_ATTENTION_HELPERS = ("apply_rotary_pos_emb", "rotate_half", "eager_attention_forward", "repeat_kv")


def _check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a Hugging Face model), got {type(model).__name__}")
    return model


@functools.cache
def _tree(fn) -> str | None:
    """The syntax tree of a function without its docstring (None when its source is unavailable)."""
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError):
        return None
    body = node.body[1:] if node.body and isinstance(node.body[0], ast.Expr) and isinstance(
        getattr(node.body[0], "value", None), ast.Constant) and isinstance(node.body[0].value.value, str) else node.body
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def _llama():
    from transformers.models.llama import modeling_llama

    return modeling_llama


def _same_forward(cls, reference) -> bool:
    forward = getattr(cls, "forward", None)
    return forward is not None and _tree(forward) is not None and _tree(forward) == _tree(reference.forward)


def _norm_reason(module: nn.Module) -> str | None:
    """None when `module` computes LlamaRMSNorm's function, else why not."""
    if not _same_forward(type(module), _llama().LlamaRMSNorm):
        return "its forward is not LlamaRMSNorm's"
    if not isinstance(getattr(module, "weight", None), nn.Parameter) or not hasattr(module, "variance_epsilon"):
        return "it lacks LlamaRMSNorm's weight / variance_epsilon"
    return None


def _attention_reason(module: nn.Module) -> str | None:
    """None when `module` computes LlamaAttention's function (forward and helpers), else why not."""
    llama = _llama()
    if not _same_forward(type(module), llama.LlamaAttention):
        return "its forward is not LlamaAttention's"
    home = sys.modules.get(type(module).__module__)
    for name in _ATTENTION_HELPERS:
        theirs, ours = getattr(home, name, None), getattr(llama, name)
        if theirs is not None and theirs is not ours and _tree(theirs) != _tree(ours):
            return f"its module's {name} is not Llama's"
    return None


def fusion_plan(model: nn.Module) -> list[tuple[str, str, str]]:
    """(module name, class name, "fuse" or the reason it is skipped) for every norm and attention."""
    _check_model(model)
    plan = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if isinstance(module, FusedRMSNorm) or has_fused_rope(module):
            plan.append((name, cls, "already fused"))
        elif cls.endswith("Norm"):
            plan.append((name, cls, _norm_reason(module) or "fuse"))
        elif cls.endswith("Attention"):
            plan.append((name, cls, _attention_reason(module) or "fuse"))
    return plan


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
    """Fuse `model`'s Llama RMSNorms and Llama attention rotary embeddings in place (module docstring);
    returns model. Warns with the norms and attentions it skipped and why. Raises ValueError when
    there is nothing to fuse (with the reasons), or when it is already fused."""
    _check_model(model)
    plan = fusion_plan(model)
    chosen = {name for name, _, action in plan if action == "fuse"}
    modules = dict(model.named_modules())
    attentions = [modules[n] for n, cls, a in plan if a == "fuse" and cls.endswith("Attention")]
    overridden = [type(m).__name__ for m in attentions if "forward" in vars(m)]
    if overridden:  # checked before anything changes
        raise ValueError(
            f"{len(overridden)} attention module(s) already have an instance-level forward (e.g. accelerate "
            f"hooks); fusing would drop it"
        )
    norm_ids = {id(modules[n]) for n in chosen if not type(modules[n]).__name__.endswith("Attention")}
    norms = _replace_children(model, lambda m: FusedRMSNorm.from_hf(m) if id(m) in norm_ids else None)
    for module in attentions:
        fuse_attention_rope_(module)
    _set_autocast_outputs(model)
    skipped = [(n, cls, a) for n, cls, a in plan if a not in ("fuse", "already fused")]
    if norms == 0 and not attentions:
        if _is_fused(model):
            raise ValueError("model is already fused (it holds FusedRMSNorm modules or fused-RoPE attention)")
        raise ValueError(f"nothing to fuse in {type(model).__name__}: " + (_describe(skipped) if skipped else
                         "it has no RMSNorm or attention module"))
    if skipped:
        warnings.warn(f"fuse_non_mlp_ skipped {_describe(skipped)}", stacklevel=2)
    return model


def _set_autocast_outputs(model: nn.Module) -> None:
    """Autocast outputs on the norms of Llama decoder layers whose consumers cast them (module docstring)."""
    llama = _llama()
    for layer in model.modules():
        if not _same_forward(type(layer), llama.LlamaDecoderLayer):
            continue
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        pre, post = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
        if isinstance(pre, FusedRMSNorm) and attn is not None and has_fused_rope(attn):
            pre.autocast_output = True
            pre.autocast_consumers = [(attn, ("q_proj", "k_proj", "v_proj"))]
        if isinstance(post, FusedRMSNorm) and (isinstance(mlp, SparseMLP) or _same_forward(type(mlp), llama.LlamaMLP)):
            post.autocast_output = True
            post.autocast_consumers = [(mlp, ("gate_proj", "up_proj"))]


def _describe(skipped) -> str:
    """"N module(s) of Class (first, ...): reason; ..." grouped by class and reason."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, cls, reason in skipped:
        groups.setdefault((cls, reason), []).append(name)
    return "; ".join(f"{len(names)} {cls} module(s) ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): "
                     f"{reason}" for (cls, reason), names in groups.items())


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


def compile_non_mlp_(model: nn.Module, **options) -> list[str]:
    """torch.compile, in place, every norm and attention module of `model` (those `fusion_plan` lists, fused
    or not) through `nn.Module.compile(**options)`, which keeps the module tree, the state dict keys and
    save_pretrained as they were. MLPs stay eager: a sparse layer's activity bookkeeping, which auto mode
    decides on, runs only outside compiled code (nn/dispatch.py). Returns the names compiled; ValueError
    when there is no norm or attention to compile."""
    _check_model(model)
    modules = dict(model.named_modules())
    names = [name for name, _, _ in fusion_plan(model)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no norm or attention module to compile")
    for name in names:
        modules[name].compile(**options)
    return names
