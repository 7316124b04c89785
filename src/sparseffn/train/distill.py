"""Distillation from a frozen teacher (the dense original of a ReLUfied model) while fine-tuning it.

    loss = CE + λ(step) · L1 + distill_weight · T² · KL(softmax(z_t / T) ‖ softmax(z_s / T))

z_t, z_s: teacher and student logits at every position; the KL is summed over the vocabulary and
averaged over positions; T² keeps the gradient's scale independent of the temperature T (Hinton et
al., 2015). The teacher is a deep copy of the model taken before `relufy_`, in eval mode, with
requires_grad off on every parameter, run under no_grad: it costs one more forward per micro-batch,
its weights (a second copy of the model, in the training dtype) and one [batch, seq, vocab] fp32
logits tensor; it receives no gradient and no optimizer state.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` in eval mode with every parameter's requires_grad off (the teacher)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    teacher = copy.deepcopy(model).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def distill_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T² · KL(softmax(teacher / T) ‖ softmax(student / T)), summed over the last dim, mean over the
    other positions; an fp32 scalar, differentiable in the student logits only."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape (same tokenizer and vocabulary?)")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab = student_logits.shape[-1]
    log_s = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.detach().float().reshape(-1, vocab) / temperature, dim=-1)
    return F.kl_div(log_s, log_t, log_target=True, reduction="batchmean") * temperature ** 2


class Distiller:
    """Holds the frozen teacher; `loss(input_ids, student_logits)` runs it and returns distill_kl."""

    def __init__(self, teacher: nn.Module, temperature: float) -> None:
        if teacher.training or any(p.requires_grad for p in teacher.parameters()):
            raise ValueError("the teacher must be frozen (eval mode, requires_grad off): build it with frozen_copy")
        self.teacher, self.temperature = teacher, float(temperature)

    def loss(self, input_ids: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=input_ids).logits
        return distill_kl(student_logits, teacher_logits, self.temperature)
