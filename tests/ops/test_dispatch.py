"""Eager calls skip the custom-op dispatch (ops/dispatch.py); tracers still see the ops. Both routes
run the same bodies, so they must agree bit for bit."""

import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import sparseffn
from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.ops import train_mlp
from sparseffn.ops.dispatch import eager_call
from sparseffn.ops.sparse_mlp import _decode_mlp_op, _twell_mlp_op
from sparseffn.ops.twell_mlp import SparseMLPWeights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or the Triton interpreter"
)


class _Subclass(torch.Tensor):
    pass


def test_eager_call_only_outside_tracers():
    x = torch.randn(2, 3)
    assert eager_call(x, None, torch.nn.Parameter(torch.randn(3, 3)))
    assert not eager_call(x, x.as_subclass(_Subclass))
    with FakeTensorMode():
        assert not eager_call(x)
    seen = []

    def traced(t):
        seen.append(eager_call(t))
        return t + 1

    torch.compile(traced, backend="eager", fullgraph=True)(x)
    assert seen == [False]
    seen.clear()
    torch.func.grad(lambda t: traced(t).sum())(x)  # functorch wraps tensors without a subclass
    assert seen == [False]
    seen.clear()
    torch.jit.trace(traced, (x,), check_trace=False)
    assert seen == [False]


@needs_kernels
def test_inference_eager_route_equals_the_op():
    mlp = synthetic_mlp(70, 72, 200, 10, device=DEVICE, seed=3, heavy_fraction=0.1)  # > 64 tokens: TwELL
    args = (mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    w = SparseMLPWeights.prepare(*args[1:])
    eager = sparseffn.sparse_mlp(*args, mode="sparse", prepared=w, tile=64, slots=8)
    via_op = _twell_mlp_op(*args, w.down_t, None, 64, 8, False)
    assert torch.equal(eager, via_op)


@needs_kernels
@pytest.mark.parametrize("gated", [True, False])
def test_training_eager_route_equals_the_op(gated):
    mlp = synthetic_mlp(37, 72, 200, 10, device=DEVICE, seed=5, gated=gated, heavy_fraction=0.1)
    tensors = (mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    dy = torch.randn_like(mlp.x)
    results = []
    for route in ("eager", "op"):
        params = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
        if route == "eager":
            y, l1 = train_mlp.sparse_mlp_train(*params, None, tile=64, slots=8, gemm_rows=64)
        else:
            y, l1, *_ = train_mlp.sparse_mlp_train_fwd(*params, None, 64, 8, 64, False)
        leaves = [p for p in params if p is not None]
        grads = torch.autograd.grad([y, l1], leaves, [dy, torch.tensor(2.0, device=DEVICE)])
        results.append((y, l1, *grads))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@needs_kernels
@pytest.mark.parametrize("gated", [True, False])
def test_decode_eager_route_equals_the_op(gated):
    mlp = synthetic_mlp(5, 72, 200, 10, device=DEVICE, seed=7, gated=gated)
    args = (mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    w = SparseMLPWeights.prepare(*args[1:])
    eager = sparseffn.sparse_mlp(*args, mode="sparse", prepared=w)
    first = mlp.gate_weight if gated else mlp.up_weight
    via_op = _decode_mlp_op(mlp.x, first, mlp.up_weight if gated else None, w.down_t, None)
    assert torch.equal(eager, via_op)
    torch.library.opcheck(_decode_mlp_op, (mlp.x, first, mlp.up_weight if gated else None, w.down_t, None),
                          test_utils=("test_schema", "test_faketensor"))
