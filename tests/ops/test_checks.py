"""One set of argument checks for every mode of `sparse_mlp`, and empty shapes on every path."""

import os

import pytest
import torch

import sparseffn
from sparseffn.ops.reference import l1_penalty, mlp_activation_reference
from sparseffn.ops.train_mlp import sparse_mlp_train
from sparseffn.ops.twell_mlp import SparseMLPWeights

needs_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or the Triton interpreter",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODES = ("auto", "dense", "sparse")


def _inputs(m=3, d=16, h=64, gated=True, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen)
    gate = torch.randn(h, d, generator=gen) / max(d, 1) ** 0.5 if gated else None
    up = torch.randn(h, d, generator=gen) / max(d, 1) ** 0.5
    down = torch.randn(d, h, generator=gen) / max(h, 1) ** 0.5
    return tuple(None if t is None else t.to(DEVICE, dtype) for t in (x, gate, up, down))


OTHER = _inputs(seed=1)
BAD_CALLS = [
    # (id, keyword arguments of sparse_mlp, error, message)
    ("tile=0", dict(tile=0), ValueError, r"tile must be one of \(32, 64, 128, 256\) .*got 0"),
    ("tile=-32", dict(tile=-32), ValueError, "tile must be one of"),
    ("tile=48", dict(tile=48), ValueError, "tile must be one of .*got 48"),
    ("tile=64.0", dict(tile=64.0), TypeError, "tile must be an int, got float"),
    ("tile=True", dict(tile=True), TypeError, "tile must be an int, got bool"),
    ("slots=-1", dict(slots=-1), ValueError, r"slots must satisfy 1 <= slots <= tile = 256, got -1"),
    ("slots=0", dict(slots=0), ValueError, "slots must satisfy"),
    ("slots>tile", dict(tile=32, slots=33), ValueError, r"slots must satisfy 1 <= slots <= tile = 32, got 33"),
    ("slots=2.5", dict(slots=2.5), TypeError, "slots must be an int, got float"),
    ("expected_nnz=nan", dict(expected_nnz=float("nan")), ValueError,
     "expected_nnz must be a finite number >= 0, got nan"),
    ("expected_nnz=inf", dict(expected_nnz=float("inf")), ValueError, "expected_nnz must be a finite number >= 0"),
    ("expected_nnz=-1", dict(expected_nnz=-1), ValueError, "expected_nnz must be a finite number >= 0, got -1"),
    ("expected_nnz='3'", dict(expected_nnz="3"), TypeError, "expected_nnz must be None or a number, got str"),
    ("expected_nnz=True", dict(expected_nnz=True), TypeError, "expected_nnz must be None or a number, got bool"),
    ("threshold=nan", dict(threshold=float("nan")), ValueError, "threshold must be a finite number, got nan"),
    ("threshold=-inf", dict(threshold=float("-inf")), ValueError, "threshold must be a finite number, got -inf"),
    ("threshold=[5]", dict(threshold=torch.zeros(5)), ValueError, r"threshold must have shape \[\] or \[H\] = \[64\]"),
    ("threshold='0.5'", dict(threshold="0.5"), TypeError, "threshold must be None, a number or a tensor"),
    ("return_l1=1", dict(return_l1=1), TypeError, "return_l1 must be a bool, got int"),
    ("prepared=dict", dict(prepared={}), TypeError, "prepared must be None or a SparseMLPWeights"),
    ("prepared of other weights", dict(prepared=SparseMLPWeights.prepare(*OTHER[1:])), ValueError,
     "prepared was built from other weight tensors"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_every_mode_rejects_the_same_calls(case, mode):
    _, kwargs, error, message = case
    x, gate, up, down = _inputs()
    kwargs = dict(kwargs)
    threshold = kwargs.pop("threshold", None)
    for grad in (False, True):  # the inference and the training routes
        with torch.set_grad_enabled(grad), pytest.raises(error, match=message):
            sparseffn.sparse_mlp(x.requires_grad_(grad), gate, up, down, threshold, mode=mode, **kwargs)


GOOD_CALLS = [
    ("tile=32 slots=1", dict(tile=32, slots=1)),
    ("tile=32 slots=32", dict(tile=32, slots=32)),
    ("expected_nnz=0, threshold=0.05", dict(expected_nnz=0, threshold=0.05)),
    ("expected_nnz=5.5, per-unit threshold", dict(expected_nnz=5.5, threshold="tensor", tile=64, slots=8)),
]


@needs_kernels
@pytest.mark.parametrize("case", GOOD_CALLS, ids=[c[0] for c in GOOD_CALLS])
def test_every_mode_accepts_the_same_calls(case):
    _, kwargs = case
    kwargs = dict(kwargs)
    x, gate, up, down = _inputs()
    threshold = kwargs.pop("threshold", None)
    if threshold == "tensor":
        threshold = torch.linspace(-0.1, 0.2, 64, device=DEVICE)
    ref = sparseffn.sparse_mlp_reference(*(t.double() for t in (x, gate, up, down)), threshold)
    dense = sparseffn.sparse_mlp(x, gate, up, down, threshold, mode="dense")
    floor = float((dense.double() - ref).abs().max())
    for mode in MODES:
        y = sparseffn.sparse_mlp(x, gate, up, down, threshold, mode=mode, **kwargs)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert float((y.double() - ref).abs().max()) <= 2 * floor + 1e-2, mode


EMPTY_SHAPES = [(0, 16, 64), (3, 0, 64), (3, 16, 0), (0, 0, 0)]


def _reference(x, gate, up, down, threshold):
    """fp64 (y, l1, gradients of sum(y * r) + 0.5 * l1) by torch autograd on the reference formulas."""
    leaves = [t.detach().double().requires_grad_() for t in (x, gate, up, down) if t is not None]
    xs, rest = leaves[0], leaves[1:]
    g = rest.pop(0) if gate is not None else None
    _, h = mlp_activation_reference(xs, g, rest[0], threshold)
    y = h @ rest[1].t()
    l1 = l1_penalty(h)
    r = torch.ones_like(y)
    grads = torch.autograd.grad((y * r).sum() + 0.5 * l1, leaves, allow_unused=True)
    return y, l1, [torch.zeros_like(t) if gr is None else gr for t, gr in zip(leaves, grads)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=lambda s: "M={} D={} H={}".format(*s))
def test_empty_shapes_give_the_exact_result_on_every_mode(shape, mode):
    """M, D or H = 0: y is empty or zeros, l1 is the mean over tokens (0 over none, Σ relu(-θ) per token
    for a non-gated layer with D = 0), gradients are those of the formula; no kernel is launched."""
    m, d, h = shape
    for gated in (True, False):
        for threshold in (None, -0.25):
            x, gate, up, down = _inputs(m, d, h, gated=gated)
            y_ref, l1_ref, grads_ref = _reference(x, gate, up, down, threshold)
            y = sparseffn.sparse_mlp(x, gate, up, down, threshold, mode=mode)
            assert torch.equal(y, y_ref.to(y.dtype)), (gated, threshold)
            leaves = [t.requires_grad_() for t in (x, gate, up, down) if t is not None]
            y, l1 = sparseffn.sparse_mlp(x, gate, up, down, threshold, mode=mode, return_l1=True)
            assert l1.dtype == torch.float32 and l1.isfinite()
            torch.testing.assert_close(l1.double(), l1_ref, msg=f"l1 gated={gated} threshold={threshold}")
            grads = torch.autograd.grad((y.float().sum() + 0.5 * l1), leaves, allow_unused=True)
            for leaf, got, want in zip(leaves, grads, grads_ref):
                got = torch.zeros_like(leaf) if got is None else got
                assert got.shape == leaf.shape and torch.equal(got.double(), want)
    x, gate, up, down = _inputs(m, d, h)
    batched = sparseffn.sparse_mlp(x.view(1, m, d), gate, up, down, mode=mode)  # leading dims are kept
    assert batched.shape == (1, m, d)


@needs_kernels
def test_training_kernels_give_zero_l1_over_no_tokens():
    x, gate, up, down = _inputs(0, 16, 64)
    y, l1 = sparse_mlp_train(x, gate, up, down, None, tile=32, slots=8)
    assert y.shape == (0, 16) and l1.item() == 0.0


def test_l1_penalty_of_no_tokens_is_zero():
    assert l1_penalty(torch.zeros(0, 4)).item() == 0.0
    h = torch.zeros(2, 0, 4, requires_grad=True)
    l1_penalty(h).backward()
    assert h.grad.shape == h.shape
