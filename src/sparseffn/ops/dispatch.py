"""When the sparse ops may skip their `torch.library` custom-op wrappers.

The kernels are registered as custom ops (with fake implementations and autograd) so that
torch.compile, torch.export and make_fx see one opaque node. In plain eager mode that dispatch buys
nothing and costs host time: on the H200's host a call of `sparseffn::twell_mlp` took 550 µs against
297 µs for its body called directly (M = 1, where the GPU work is tiny; benchmarks/profile_host.py).
So eager calls run the bodies directly, and everything else goes through the ops.
"""

from __future__ import annotations

import torch

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def eager_call(*tensors: torch.Tensor | None) -> bool:
    """True when nothing traces this call: not torch.compile / export, no dispatch mode on the stack
    (FakeTensorMode, make_fx's proxy mode, functionalization) and no tensor subclass among `tensors`
    (FakeTensor, FunctionalTensor, DTensor). Then the op bodies may run directly."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    return all(t is None or type(t) in _PLAIN_TYPES for t in tensors)
