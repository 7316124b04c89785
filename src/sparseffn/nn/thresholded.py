"""What every sparse layer of a Hugging Face model shares besides `SparseMLP`: θ, mode, L1 tracking.

`HFSparseMLP` (nn/hf_mlp.py) and `SparseExperts` (nn/moe.py) keep a per-unit fp32 threshold buffer
`threshold` of shape `threshold_shape` ([H], or [E, H] for E experts), the attributes `mode`,
`expected_nnz`, `track_l1`, `last_l1`, `activity` and `last_decision` with SparseMLP's meaning (the
rules of nn/dispatch.py), and the same threshold rules: θ changes
through `set_threshold_` (or load_state_dict), which keeps the "any θ != 0" flag; `.to(dtype)` keeps θ
in fp32.
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

from sparseffn.nn.activity import Activity
from sparseffn.nn.dispatch import checked_attribute


class ThresholdedLayer(nn.Module):
    """Base of the sparse layers over Hugging Face modules (module docstring). Subclasses call
    `_init_state(threshold_shape, mode, device)` in their constructor."""

    def _init_state(self, threshold_shape: tuple[int, ...], mode: str, device) -> None:
        self.register_buffer("threshold", torch.zeros(threshold_shape, dtype=torch.float32, device=device))
        self.mode = mode
        self.expected_nnz: float | None = None
        self.track_l1: bool | None = None
        self.last_l1: torch.Tensor | None = None
        self.activity = Activity()
        self.last_decision = None
        self._threshold_active = False

    @property
    def threshold_shape(self) -> tuple[int, ...]:
        return tuple(self.threshold.shape)

    @torch.no_grad()
    def set_threshold_(self, threshold: torch.Tensor | float | None) -> "ThresholdedLayer":
        """Set θ: None (zeros), a number for every unit, or a tensor broadcastable to `threshold_shape`
        (e.g. [H] for every expert, or [E, H]). Stored as fp32; syncs with the host once."""
        shape = self.threshold_shape
        if threshold is None:
            self.threshold.zero_()
        elif isinstance(threshold, numbers.Real) and not isinstance(threshold, bool):
            self.threshold.fill_(float(threshold))
        elif isinstance(threshold, torch.Tensor):
            if not threshold.is_floating_point():
                raise TypeError(f"threshold must be a floating-point tensor, got {threshold.dtype}")
            try:
                expanded = threshold.detach().to(torch.float32).expand(shape)
            except RuntimeError:
                raise ValueError(
                    f"threshold must broadcast to {list(shape)}, got shape {tuple(threshold.shape)}") from None
            self.threshold.copy_(expanded)
        else:
            raise TypeError(f"threshold must be None, a number or a tensor, got {type(threshold).__name__}")
        return finish_threshold_(self)

    @property
    def has_threshold(self) -> bool:
        """Whether any unit has a non-zero θ (a flag kept by set_threshold_, no host sync)."""
        return self._threshold_active

    def refresh_threshold_flag_(self) -> "ThresholdedLayer":
        """Recompute the "any θ != 0" flag after θ was written by something other than set_threshold_
        (a checkpoint loader that assigns tensors directly)."""
        if self.threshold.device.type != "meta":
            self._threshold_active = bool(self.threshold.any())
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.refresh_threshold_flag_()

    def _apply(self, fn, recurse=True):
        theta = self.threshold
        super()._apply(fn, recurse)
        if self.threshold.dtype != torch.float32:
            self.threshold = theta.to(device=self.threshold.device, dtype=torch.float32)
        return self

    def _theta(self) -> torch.Tensor | None:
        return self._buffers["threshold"] if self._threshold_active else None

    def _store_l1(self, l1: torch.Tensor | None) -> None:
        self.__dict__["last_l1"] = l1

    def __setattr__(self, name, value):
        super().__setattr__(name, checked_attribute(name, value))


def finish_threshold_(layer: nn.Module) -> nn.Module:
    """After `layer.threshold` was written: reset it to zero and raise if any value is not finite,
    else record whether any unit has a non-zero θ (one host sync). Returns layer. On the meta device
    (a model being built by from_pretrained, before its tensors exist) nothing can be read: the flag is
    set by whoever fills the buffer (load_pretrained)."""
    if layer.threshold.device.type == "meta":
        return layer
    if not bool(torch.isfinite(layer.threshold).all()):
        layer.threshold.zero_()
        layer._threshold_active = False
        raise ValueError("threshold must be finite; the module's threshold was reset to zero")
    layer._threshold_active = bool(layer.threshold.any())
    return layer
