"""`relufy_`: the first step of sparsifying a pretrained dense model (ReLUfication, then L1 fine-tuning).

A dense model's MLPs gate with SiLU or GELU (Llama, Qwen, Mistral, Gemma, GPT-2, ...). relufy_ swaps
that activation for ReLU, optionally shifted (h = relu(g - s) for a shift s >= 0: units fire only
above s, the FAT-ReLU idea of ProSparse with its jump replaced by a continuous shift), by replacing
every MLP with its sparse layer through `sparsify_`: same Parameters, same families, and the shift
is each layer's starting per-unit threshold θ = s (a state-dict buffer, fitted later by
`calibrate_thresholds` if wanted). Nothing else in the model changes.

The swap costs quality (SiLU(g) and ReLU(g) differ for small |g|) that fine-tuning recovers while the
L1 penalty drives activations to zero; the SparsityConfig passed here is recorded and holds those
fine-tuning settings (λ, its ramp and shape, dead-unit re-initialisation). docs/sparsify.md has the
recipe. The config also records what was replaced, `config.sparseffn_layers["relufied_from"]`: the
activation fields as they were ({"hidden_act": "silu"}, ...), kept through save_pretrained /
load_pretrained.
"""

from __future__ import annotations

import dataclasses
import numbers

from torch import nn

from sparseffn.models.config import SparsityConfig
from sparseffn.models.hf_config import LAYERS_KEY, activation_fields, configs
from sparseffn.models.sparsify import sparse_layers, sparsify_

RELUFIED_KEY = "relufied_from"  # key of config.sparseffn_layers: the activation fields before relufy_


def relufy_(model: nn.Module, config: SparsityConfig = SparsityConfig(), *, shift: float | None = None,
            filter_fn=None) -> nn.Module:
    """Swap each MLP's gate activation of the dense `model` for ReLU (shifted by `shift`), in place;
    returns model. Every family `sparsify_` knows (docs/architectures.md), with its `filter_fn`.

    config: the SparsityConfig recorded for fine-tuning (λ, l1_warmup_steps, l1_schedule, reinit_dead,
    mode). shift: the starting threshold s of every unit, h = relu(g - s) (None: config.threshold, else
    0 = plain ReLU); giving both with different values is refused. Refused (ValueError) on a model that
    already holds sparse layers: relufy_ starts from the dense original.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a Hugging Face model), got {type(model).__name__}")
    if not isinstance(config, SparsityConfig):
        raise TypeError(f"config must be a SparsityConfig, got {type(config).__name__}")
    if shift is not None:
        if not isinstance(shift, numbers.Real) or isinstance(shift, bool):
            raise TypeError(f"shift must be a number or None, got {type(shift).__name__}")
        if config.threshold is not None and float(shift) != config.threshold:
            raise ValueError(f"shift={shift} and config.threshold={config.threshold} disagree: give one of them")
        config = dataclasses.replace(config, threshold=float(shift) or None)
    if sparse_layers(model):
        raise ValueError("model already holds sparse layers: relufy_ starts from a dense model (its original "
                         "activation is what it records)")
    original = activation_fields(model)
    sparsify_(model, config, filter_fn=filter_fn)
    cfgs = configs(model)
    if cfgs:
        getattr(cfgs[0], LAYERS_KEY)[RELUFIED_KEY] = original
    return model


def relufied_from(model: nn.Module) -> dict[str, str] | None:
    """The activation fields `relufy_` replaced ({"hidden_act": "silu"}, ...), or None if it did not run."""
    cfgs = configs(model)
    meta = getattr(cfgs[0], LAYERS_KEY, None) if cfgs else None
    return None if meta is None else meta.get(RELUFIED_KEY)
