"""Several bias-free linear layers of one input, for one or two tokens, in one launch (inference).

    decode_projections(x, weights) -> [F.linear(x, w) for w in weights], or None

`weights`: 1 to 3 tensors [N_i, D] in x's dtype (bf16 / fp16) and device with unit stride along D
(the caller vouches that the weight is all its layer computes: nn.projections.is_plain, no bias).
The call is taken when x [..., D] holds one or two tokens, runs on CUDA (or on CPU under
TRITON_INTERPRET=1), nothing needs a gradient and autocast is off; it is then one launch of
`kernels/decode_linear.py` (products in fp32, each output rounded once, as cuBLAS rounds them), as
the custom op `sparseffn::decode_linear` (with a fake implementation) when torch.compile or another
tracer sees the call. Otherwise it returns None and the caller runs its layers as usual.
"""

from __future__ import annotations

import torch
from sparseffn.kernels._runtime import TL_DTYPES, interpreting
from sparseffn.kernels.decode_linear import MAX_TOKENS, launch_decode_linear
from sparseffn.ops.dispatch import eager_call


@torch.library.custom_op("sparseffn::decode_linear", mutates_args=())
def _decode_linear_op(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor | None,
                      w2: torch.Tensor | None) -> torch.Tensor:
    return launch_decode_linear(x, [w for w in (w0, w1, w2) if w is not None])


@_decode_linear_op.register_fake
def _(x, w0, w1, w2):
    return x.new_empty((x.shape[0], sum(w.shape[0] for w in (w0, w1, w2) if w is not None)))


def _takes(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    d = x.shape[-1]
    if x.dtype not in TL_DTYPES or not (x.is_cuda or interpreting()) or d == 0:
        return False
    if not 1 <= x.numel() // d <= MAX_TOKENS:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False
    if torch.is_autocast_enabled(x.device.type):  # nn.Linear would compute in autocast's dtype
        return False
    return all(w.dim() == 2 and w.shape[1] == d and w.dtype == x.dtype and w.device == x.device
               and (d == 1 or w.stride(1) == 1) for w in weights)


def decode_projections(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """[F.linear(x, w) for w in weights] from one launch, or None when the call is not one the kernel
    takes (module docstring)."""
    if not 1 <= len(weights) <= 3 or not _takes(x, weights):
        return None
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.shape[-1] > 1 and x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if eager_call(x2d, *weights):
        y = launch_decode_linear(x2d, weights)
    else:
        slots = weights + [None] * (3 - len(weights))
        y = _decode_linear_op(x2d, *slots)
    outs = torch.split(y, [w.shape[0] for w in weights], dim=1)
    return [out.view(*x.shape[:-1], out.shape[1]) for out in outs]
