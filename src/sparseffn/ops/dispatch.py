"""When the sparse ops may skip their `torch.library` custom-op wrappers.

The kernels are registered as custom ops (with fake implementations and autograd) so that
torch.compile, torch.export and make_fx see one opaque node. In plain eager mode that dispatch buys
nothing and costs host time (docs/kernel-notes.md), so eager calls run the bodies
directly, and everything else goes through the ops.
"""

from __future__ import annotations

import torch

from sparseffn.ops.checks import PLAIN_TENSOR_TYPES


def eager_call(*tensors: torch.Tensor | None) -> bool:
    """True when nothing traces or transforms this call: not torch.compile / export, not
    torch.jit.trace (it records only torch ops, not the Triton launches), no dispatch mode on the
    stack (FakeTensorMode, make_fx's proxy mode, functionalization), no torch.func transform (grad,
    vmap: their wrapped tensors look like plain ones) and no tensor subclass among `tensors`
    (FakeTensor, FunctionalTensor, DTensor). Then the op bodies may run directly."""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._C._len_torch_dispatch_stack()
            or torch._C._are_functorch_transforms_active()):
        return False
    return all(t is None or type(t) in PLAIN_TENSOR_TYPES for t in tensors)
