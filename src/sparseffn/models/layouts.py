"""Which Hugging Face modules `sparsify_` replaces, and by what (the architecture table of
docs/architectures.md):

    kind      found by                                                   replaced by
    gated     children gate_proj, up_proj, down_proj: nn.Linear, or PEFT   SparseMLP (sharing them)
              layers over an nn.Linear (Llama, Mistral, Qwen2/3, Gemma*,
              OLMo*, Granite, StableLM, Cohere, SmolLM3, MoE shared experts)
    layout    class name in LAYOUTS (Phi-3's fused gate_up_proj; GPT-2,     HFSparseMLP (same children,
              GPT-NeoX, Falcon, Phi, Starcoder2 non-gated)                   same names)
    experts   3-D Parameters gate_up_proj [E, 2H, D] and down_proj           SparseExperts
              [E, D, H] and an `act_fn` (Mixtral, Qwen2-MoE, Qwen3-MoE)

Non-gated and fused MLPs are matched by class name, not by the names of their children: an MLP whose
forward does more (MPT's adds the residual inside) must not be taken for a plain one. A module whose
class name says MLP / FeedForward / Experts and that matches none of the kinds is "unknown": sparsify_
refuses to leave it silently dense.
"""

from __future__ import annotations

from torch import nn

from sparseffn.nn import HFSparseMLP, MLPLayout, SparseExperts, SparseMLP

GATED_NAMES = ("gate_proj", "up_proj", "down_proj")
LAYOUTS: dict[str, MLPLayout] = {
    "Phi3MLP": MLPLayout(up="gate_up_proj", down="down_proj", act="activation_fn", fused_gate_up=True),
    "GPT2MLP": MLPLayout(up="c_fc", down="c_proj", act="act", dropout="dropout"),
    "Starcoder2MLP": MLPLayout(up="c_fc", down="c_proj", act="act", dropout="residual_dropout"),
    "GPTNeoXMLP": MLPLayout(up="dense_h_to_4h", down="dense_4h_to_h", act="act"),
    "FalconMLP": MLPLayout(up="dense_h_to_4h", down="dense_4h_to_h", act="act"),
    "PhiMLP": MLPLayout(up="fc1", down="fc2", act="activation_fn"),
}
SPARSE_TYPES = (SparseMLP, HFSparseMLP, SparseExperts)
_MLP_LIKE = ("MLP", "FeedForward", "FFN", "Experts")


def base_linear(module: nn.Module | None) -> nn.Linear | None:
    """The nn.Linear a projection computes with: itself, or the base layer under PEFT wrappers."""
    seen = 0
    while module is not None and not isinstance(module, nn.Linear) and seen < 8:
        module = getattr(module, "base_layer", None)
        seen += 1
    return module if isinstance(module, nn.Linear) else None


def kind_of(module: nn.Module) -> str | None:
    """"gated", "layout", "experts" or None (module docstring)."""
    if isinstance(module, SPARSE_TYPES):
        return None
    if type(module).__name__ in LAYOUTS:
        return "layout"
    if all(base_linear(getattr(module, n, None)) is not None for n in GATED_NAMES):
        return "gated"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and hasattr(module, "act_fn")):
        return "experts"
    return None


def looks_like_mlp(module: nn.Module) -> bool:
    name = type(module).__name__
    return not isinstance(module, SPARSE_TYPES) and any(name.endswith(s) for s in _MLP_LIKE)


def build_sparse(module: nn.Module, kind: str, mode: str) -> nn.Module:
    """The sparse replacement of one module of a known kind (weights shared, never copied)."""
    if kind == "layout":
        return HFSparseMLP.from_hf(module, LAYOUTS[type(module).__name__], mode=mode)
    if kind == "experts":
        return SparseExperts.from_hf(module, mode=mode)
    linears = {n: getattr(module, n) for n in GATED_NAMES}
    if all(type(m) is nn.Linear for m in linears.values()):
        sparse = SparseMLP.from_dense(module, mode=mode)
    else:  # PEFT layers: build over their base Linear modules, then hold the wrappers themselves
        bases = nn.Module()
        for name, m in linears.items():
            bases.add_module(name, base_linear(m))
        sparse = SparseMLP.from_dense(bases, mode=mode)
        sparse._dense_class = type(module)
        for name, m in linears.items():
            setattr(sparse, name, m)
    object.__setattr__(sparse, "_hf_mlp", module)  # put back by unsparsify_ (a plain attribute, not a child)
    return sparse


def restore(sparse: nn.Module) -> nn.Module | None:
    """The Hugging Face module a sparse layer replaced, computing ReLU with the current children; None
    for a SparseMLP built by hand (the caller builds a plain one)."""
    if isinstance(sparse, (HFSparseMLP, SparseExperts)):
        return sparse.to_hf()
    original = getattr(sparse, "_hf_mlp", None)
    if original is None:
        return None
    for name in GATED_NAMES:
        setattr(original, name, getattr(sparse, name))
    original.act_fn = nn.ReLU()
    return original
