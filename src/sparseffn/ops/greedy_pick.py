"""Greedy decoding's token pick and step advance in one launch (inference).

    advance_greedy_(logits, out, ids, position, scratch) -> None
        token[b] = argmax(logits[b]): the first maximum, or the first NaN where a row holds one (torch.argmax's
        rule); then out[b, position + 1] = token[b], ids[b, 0] = token[b] and position += 1, in place.
    greedy_scratch(batch, vocab, device) -> scratch for calls at logits [batch, vocab]

logits [B, V] bf16 / fp16 / fp32 with unit stride along V; out [B, L] int64 with unit stride along L; ids
[B, 1] int64, contiguous; position [1] int64 (position + 1 < L, unchecked: a device value). Nothing is read
on the host, so a call can be captured in a CUDA graph. On CUDA (or on CPU under TRITON_INTERPRET=1) one
launch of kernels/greedy_pick.py; elsewhere `advance_greedy_reference`, torch's ops (the same tokens).
"""

from __future__ import annotations

import torch

from sparseffn.kernels._runtime import interpreting
from sparseffn.kernels.greedy_pick import greedy_scratch, launch_greedy_pick

__all__ = ["advance_greedy_", "advance_greedy_reference", "greedy_scratch"]

LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def advance_greedy_reference(logits: torch.Tensor, out: torch.Tensor, ids: torch.Tensor,
                             position: torch.Tensor) -> None:
    """The contract in torch ops (module docstring)."""
    token = logits.argmax(-1)
    out.index_copy_(1, position + 1, token[:, None])
    ids.copy_(token[:, None])
    position.add_(1)


def advance_greedy_(logits: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, position: torch.Tensor,
                    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Pick each row's greedy token and advance the decode state in place (module docstring)."""
    _check(logits, out, ids, position, scratch)
    if logits.is_cuda or interpreting():
        launch_greedy_pick(logits, out, ids, position, scratch)
    else:
        advance_greedy_reference(logits, out, ids, position)


def _check(logits, out, ids, position, scratch) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"logits must be a [B, V] bf16 / fp16 / fp32 tensor, got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} {list(getattr(logits, 'shape', []))}")
    b, v = logits.shape
    if v == 0 or logits.stride(1) != 1:
        raise ValueError(f"logits must have a vocabulary of unit stride, got shape {list(logits.shape)}, "
                         f"strides {logits.stride()}")
    for name, t, shape in (("out", out, (b, None)), ("ids", ids, (b, 1)), ("position", position, (1,))):
        if (t.dtype != torch.int64 or t.device != logits.device or t.dim() != len(shape)
                or any(want is not None and got != want for got, want in zip(t.shape, shape))):
            raise ValueError(f"{name} must be an int64 tensor of shape {['L' if s is None else s for s in shape]} on "
                             f"{logits.device}, got {t.dtype} {list(t.shape)} on {t.device}")
    if out.stride(1) != 1 or not ids.is_contiguous():
        raise ValueError("out must have unit stride along its length and ids must be contiguous")
    want = greedy_scratch(b, v, torch.device("meta"))
    if len(scratch) != 3 or any(s.shape != w.shape or s.dtype != w.dtype or s.device != logits.device
                                for s, w in zip(scratch, want)):
        raise ValueError(f"scratch must be greedy_scratch({b}, {v}, {logits.device})")
