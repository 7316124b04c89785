"""`SparsityConfig`: how a model is sparsified and trained for sparsity (docs/design.md).

Recorded by `sparsify_` as `model.config.sparseffn` (a plain dict), so `save_pretrained` writes it to
config.json and `load_pretrained` rebuilds the same sparse model.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ACTIVATIONS = ("relu",)
MODES = ("auto", "sparse", "dense")
L1_SCHEDULES = ("linear", "sine")


def _real(value: object, name: str) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"SparsityConfig.{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"SparsityConfig.{name} must be finite, got {value}")
    return value


def _int(value: object, name: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"SparsityConfig.{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


@dataclass(frozen=True)
class SparsityConfig:
    """Sparsity settings of a model.

    l1_coeff: λ of `loss = ce + λ · mean over layers of l1` (docs/design.md; the paper's released checkpoints use 2e-5).
    l1_warmup_steps: steps over which the training loop ramps λ from 0 (0 = no ramp).
    l1_schedule: the ramp's shape over those steps: "linear" (λ·t/T) or "sine" (ProSparse's λ·sin(π/2·t/T),
        above the linear ramp throughout, flattening as it reaches λ; train/schedule.py).
    activation: the gate activation; only "relu" exists.
    threshold: a global θ every unit starts with at `sparsify_` (None = 0, plain ReLU); per-unit
        thresholds come from `calibrate_thresholds` and live in the state dict.
    reinit_dead: re-initialize the gate weights of units that have not fired for `reinit_dead_after`
        steps (the paper's dead-neuron re-init, applied by the training loop).
    mode: `sparse_mlp` mode of every layer ("auto" | "sparse" | "dense").
    expected_nnz: expected non-zeros per token per layer, auto mode's density hint (None = unknown).
    """

    l1_coeff: float = 2e-5
    l1_warmup_steps: int = 0
    l1_schedule: str = "linear"
    activation: str = "relu"
    threshold: float | None = None
    reinit_dead: bool = False
    reinit_dead_after: int = 200
    mode: str = "auto"
    expected_nnz: float | None = None

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        set_("l1_coeff", _real(self.l1_coeff, "l1_coeff"))
        if self.l1_coeff < 0:
            raise ValueError(f"SparsityConfig.l1_coeff must be >= 0, got {self.l1_coeff}")
        set_("l1_warmup_steps", _int(self.l1_warmup_steps, "l1_warmup_steps"))
        if self.l1_warmup_steps < 0:
            raise ValueError(f"SparsityConfig.l1_warmup_steps must be >= 0, got {self.l1_warmup_steps}")
        if self.l1_schedule not in L1_SCHEDULES:
            raise ValueError(f"SparsityConfig.l1_schedule must be one of {L1_SCHEDULES}, got {self.l1_schedule!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"SparsityConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.threshold is not None:
            set_("threshold", _real(self.threshold, "threshold"))
            if self.threshold < 0:
                raise ValueError(
                    f"SparsityConfig.threshold must be >= 0 (a threshold only removes activations), got {self.threshold}"
                )
        if not isinstance(self.reinit_dead, bool):
            raise TypeError(f"SparsityConfig.reinit_dead must be a bool, got {type(self.reinit_dead).__name__}")
        set_("reinit_dead_after", _int(self.reinit_dead_after, "reinit_dead_after"))
        if self.reinit_dead_after < 1:
            raise ValueError(f"SparsityConfig.reinit_dead_after must be >= 1 step, got {self.reinit_dead_after}")
        if self.mode not in MODES:
            raise ValueError(f"SparsityConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.expected_nnz is not None:
            set_("expected_nnz", _real(self.expected_nnz, "expected_nnz"))
            if self.expected_nnz < 0:
                raise ValueError(f"SparsityConfig.expected_nnz must be >= 0, got {self.expected_nnz}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SparsityConfig":
        """The config from `to_dict` output; missing fields take their defaults, unknown keys raise."""
        if not isinstance(data, Mapping):
            raise TypeError(f"SparsityConfig.from_dict needs a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown SparsityConfig field(s) {unknown}; the fields are {sorted(known)}")
        return cls(**data)
