"""The weights a projection module really applies: plain Linear, Conv1D, PEFT LoRA, or "call it".

A sparse MLP reads its projections' weights and hands them to `ops.sparse_mlp` (the kernels need the
tensors, not the modules). That is only right when the weight tensor is the whole story:

    module                                         resolved as (weight [out, in], bias | None)
    nn.Linear (exact type), no hooks               (weight, bias)
    transformers Conv1D (GPT-2), no hooks          (weight.t(), bias)          a view, not a copy
    peft lora.Linear over such a module, with      (W + sum_a scale_a * B_a A_a, bias)   differentiable:
      plain LoRA adapters (no DoRA or other          the adapters get gradients, and the weight equals
      variant, no lora_bias, no dropout while        what merge_and_unload writes into the base layer
      training, no merged adapter)
    anything else                                  None: the caller must call the module (dense)

"Anything else" is every other PEFT tuner layer, a LoRA layer with dropout in training or a merged /
disabled adapter, a module carrying accelerate's hook (device-mapped or offloaded weights only arrive
when the module is called) or any forward hook, and Linear subclasses (quantized layers). Calling the
module is exact by construction; the resolved weight is exact up to the rounding of the merged sum.
"""

from __future__ import annotations

import torch
from torch import nn


def is_plain(module: nn.Module | None) -> bool:
    """Whether `module` is None or an nn.Linear (exact type) whose weight can be read: no hooks.

    Cheap (a few attribute reads): SparseMLP calls it on every forward.
    """
    return module is None or (
        type(module) is nn.Linear
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and "forward" not in module.__dict__
    )


def _unhooked(module: nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in module.modules())


def _conv1d_type():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers absent: no Conv1D can exist either
        return None
    return Conv1D


def _lora_linear_type():
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


def _plain_weight(module: nn.Module):
    if type(module) is nn.Linear and _unhooked(module):
        return module.weight, module.bias
    conv1d = _conv1d_type()
    if conv1d is not None and type(module) is conv1d and _unhooked(module):
        return module.weight.t(), module.bias
    return None


def _lora_weight(module: nn.Module):
    """(W + merged LoRA deltas, bias) for a peft lora.Linear that merges exactly, else None."""
    lora = _lora_linear_type()
    if lora is None or type(module) is not lora or not _unhooked(module):
        return None
    if module.disable_adapters or module.merged:  # PEFT's forward unmerges / skips: let it
        return None
    base = _plain_weight(module.base_layer)
    if base is None or getattr(module, "fan_in_fan_out", False) != (type(module.base_layer) is not nn.Linear):
        return None
    weight, bias = base
    adapters = [a for a in module.active_adapters if a in module.lora_A.keys()]
    for adapter in adapters:
        dropout = module.lora_dropout[adapter]
        if (adapter in getattr(module, "lora_variant", {}) or module.use_dora.get(adapter, False)
                or module.lora_bias.get(adapter, False)
                or (module.training and not isinstance(dropout, nn.Identity) and dropout.p > 0)):
            return None
    merged = weight
    for adapter in adapters:
        delta = module.get_delta_weight(adapter)  # [out, in] in the base layer's layout, scaled
        if type(module.base_layer) is not nn.Linear:
            delta = delta.t()  # fan_in_fan_out: get_delta_weight returned the base's [in, out]
        merged = merged + delta
    return merged.to(weight.dtype), bias


def resolve(module: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [out, in], bias or None) that `module` applies, or None when it must be called.

    None for module=None is not distinguishable from "must be called": callers pass real modules.
    """
    if module is None:
        return None
    return _plain_weight(module) or _lora_weight(module)


def resolved_weights(*projections: nn.Module | None) -> list[torch.Tensor | None] | None:
    """The weights of bias-free projections (None entries stay None), or None when some projection
    must be called as a module or applies a bias (the caller's dense formula handles those)."""
    weights = []
    for module in projections:
        if module is None:
            weights.append(None)
            continue
        got = resolve(module)
        if got is None or got[1] is not None:
            return None
        weights.append(got[0])
    return weights
