"""Learning-rate and L1-coefficient schedules, functions of the optimizer step only."""

from __future__ import annotations

import math

from sparseffn.models.config import L1_SCHEDULES


class WarmupCosine:
    """lr multiplier for `torch.optim.lr_scheduler.LambdaLR`: linear warmup from lr/warmup to lr over
    `warmup_steps`, then cosine decay to `min_lr` at `total_steps` (held there afterwards).

    A plain object (not a closure) so LambdaLR's state_dict stores it and a resumed run checks it.
    """

    def __init__(self, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> None:
        self.lr, self.min_lr, self.warmup_steps, self.total_steps = lr, min_lr, warmup_steps, total_steps

    def __call__(self, step: int) -> float:
        if self.lr == 0:
            return 0.0
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        lr = self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))
        return lr / self.lr


def l1_coeff_at(step: int, coeff: float, warmup_steps: int, shape: str = "linear") -> float:
    """λ(step) over a ramp of T = warmup_steps steps, with t = step + 1 (so the ramp reaches `coeff` at
    step T - 1 and holds it): "linear" λ·t/T; "sine" λ·sin(π/2 · t/T), ProSparse's progressive ramp
    (above linear throughout, and flat near its end, so λ eases into its final value)."""
    if shape not in L1_SCHEDULES:
        raise ValueError(f"L1 schedule shape must be one of {L1_SCHEDULES}, got {shape!r}")
    if warmup_steps <= 0 or step >= warmup_steps:
        return float(coeff)
    progress = (step + 1) / warmup_steps
    if shape == "sine":
        return float(coeff) * math.sin(0.5 * math.pi * progress)
    return float(coeff) * progress
