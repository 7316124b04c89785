"""Learning-rate and L1-coefficient schedules, functions of the optimizer step only."""

from __future__ import annotations

import math


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


def l1_coeff_at(step: int, coeff: float, warmup_steps: int) -> float:
    """λ(step): linear ramp from coeff/warmup_steps at step 0 to `coeff` at step warmup_steps - 1."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return float(coeff)
    return float(coeff) * (step + 1) / warmup_steps
