import pytest
import torch

import sparseffn
from sparseffn.ops.reference import sparse_mlp_reference


def _inputs(m=6, d=16, h=24, dtype=torch.float32, gated=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen).to(dtype)
    gate = (torch.randn(h, d, generator=gen) / d**0.5).to(dtype) if gated else None
    up = (torch.randn(h, d, generator=gen) / d**0.5).to(dtype)
    down = (torch.randn(d, h, generator=gen) / h**0.5).to(dtype)
    return x, gate, up, down


def _max_err(a, b):
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("threshold", [None, 0.1, "tensor"])
def test_eager_path_follows_reference_semantics(dtype, gated, threshold):
    x, gate, up, down = _inputs(m=33, d=40, h=72, dtype=dtype, gated=gated)
    if threshold == "tensor":
        threshold = torch.linspace(-0.2, 0.6, 72)
    y = sparseffn.sparse_mlp(x, gate, up, down, threshold)
    assert y.dtype == dtype and y.shape == x.shape
    ref = sparse_mlp_reference(*(None if t is None else t.double() for t in (x, gate, up, down)), threshold)
    # The eager path is dense torch in the input dtype; the rule of the kernels is
    # err <= 2 * err(dense torch) + floor, so for the eager path itself: err == err(dense torch).
    first = torch.nn.functional.linear(x, gate if gated else up)
    if threshold is not None:
        first = first - (threshold.to(dtype) if isinstance(threshold, torch.Tensor) else threshold)
    dense = torch.relu(first)
    if gated:
        dense = dense * torch.nn.functional.linear(x, up)
    dense = torch.nn.functional.linear(dense, down)
    assert torch.equal(y, dense)
    assert _max_err(y, ref) <= 2 * _max_err(dense, ref) + torch.finfo(dtype).eps


def test_leading_batch_dims():
    x, gate, up, down = _inputs(m=12)
    y = sparseffn.sparse_mlp(x.view(3, 4, -1), gate, up, down)
    assert y.shape == (3, 4, 16)
    torch.testing.assert_close(y.view(12, -1), sparseffn.sparse_mlp(x, gate, up, down))


def test_nan_propagates():
    x, gate, up, down = _inputs()
    x[2, 0] = float("nan")
    y = sparseffn.sparse_mlp(x, gate, up, down)
    assert y[2].isnan().all() and y[[0, 1, 3]].isfinite().all()


BAD_CASES = [
    # (description, mutate(x, gate, up, down) -> args tuple, error, message)
    ("x not a tensor", lambda x, g, u, d: ([1.0], g, u, d), TypeError, "x must be a torch.Tensor, got list"),
    ("0-D x", lambda x, g, u, d: (torch.tensor(1.0), g, u, d), ValueError, "x must have shape"),
    ("integer x", lambda x, g, u, d: (x.long(), g, u, d), TypeError, "x must be floating point"),
    ("mixed dtypes", lambda x, g, u, d: (x, g.double(), u, d), TypeError,
     "gate_weight has dtype torch.float64 but x has torch.float32"),
    ("1-D up", lambda x, g, u, d: (x, g, u[0], d), ValueError, "up_weight must be 2-D"),
    ("3-D gate", lambda x, g, u, d: (x, g[None], u, d), ValueError, "gate_weight must be 2-D"),
    ("D mismatch", lambda x, g, u, d: (x[:, :8], g, u, d), ValueError,
     r"up_weight must be \[H, D\] with D = x.shape\[-1\] = 8, got \(24, 16\)"),
    ("gate/up mismatch", lambda x, g, u, d: (x, g[:20], u, d), ValueError,
     r"gate_weight must have up_weight's shape \(24, 16\), got \(20, 16\)"),
    ("down transposed", lambda x, g, u, d: (x, g, u, d.t().contiguous()), ValueError,
     r"down_weight must be \[D, H\] = \[16, 24\], got \(24, 16\) \(it looks transposed"),
    ("down wrong H", lambda x, g, u, d: (x, g, u, d[:, :5]), ValueError, r"down_weight must be \[D, H\]"),
    ("integer down", lambda x, g, u, d: (x, g, u, d.int()), TypeError, "down_weight must be floating point"),
    # consistent in dtype, device and shape, so only the dtype check can catch it
    ("all integer", lambda x, g, u, d: (x.int(), g.int(), u.int(), d.int()), TypeError, "x must be floating point"),
    ("mixed devices", lambda x, g, u, d: (x, g.to("meta"), u, d), ValueError, "gate_weight is on meta but x is on cpu"),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_names_the_argument(case):
    _, mutate, error, message = case
    args = mutate(*_inputs())
    for fn in (sparseffn.sparse_mlp, sparse_mlp_reference):
        with pytest.raises(error, match=message):
            fn(*args)


@pytest.mark.parametrize(
    "threshold, error, message",
    [
        (torch.zeros(5), ValueError, r"threshold must have shape \[\] or \[H\] = \[24\], got \(5,\)"),
        (torch.zeros(2, 24), ValueError, "threshold must have shape"),
        (torch.zeros(24, dtype=torch.int32), TypeError, "threshold must be floating point"),
        ("0.5", TypeError, "threshold must be None, a number or a tensor"),
    ],
)
def test_bad_threshold(threshold, error, message):
    x, gate, up, down = _inputs()
    with pytest.raises(error, match=message):
        sparseffn.sparse_mlp(x, gate, up, down, threshold)


def test_tensors_on_different_devices():
    x, gate, up, down = _inputs()
    meta = down.to("meta")
    with pytest.raises(ValueError, match="down_weight is on meta but x is on cpu"):
        sparseffn.sparse_mlp(x, gate, up, meta)
    with pytest.raises(ValueError, match="threshold is on meta"):
        sparseffn.sparse_mlp(x, gate, up, down, torch.zeros(24, device="meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_reference():
    x, gate, up, down = (t.cuda() for t in _inputs(m=64, d=128, h=256, dtype=torch.bfloat16))
    y = sparseffn.sparse_mlp(x, gate, up, down)
    ref = sparse_mlp_reference(x.double(), gate.double(), up.double(), down.double())
    assert _max_err(y, ref) < 0.05


def _reference_loss(x, gate, up, down, threshold, r, coeff):
    """fp64 autograd truth for loss = (y·r).sum() + coeff·l1, l1 = mean over tokens of Σ|h|."""
    from sparseffn.ops.reference import mlp_activation_reference

    _, h = mlp_activation_reference(x, gate, up, threshold)
    y = h @ down.t()
    return (y * r).sum() + coeff * h.abs().sum(-1).mean()


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("threshold", [None, "tensor"])
def test_return_l1_value_and_gradients_match_reference(gated, threshold):
    x, gate, up, down = _inputs(m=9, d=12, h=20, dtype=torch.float64, gated=gated, seed=3)
    if threshold == "tensor":
        threshold = torch.linspace(-0.3, 0.3, 20, dtype=torch.float64)
    r = torch.randn(9, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    params = [t.requires_grad_() for t in (x, gate, up, down) if t is not None]
    y, l1 = sparseffn.sparse_mlp(x, gate, up, down, threshold, return_l1=True)
    _, l1_bf16 = sparseffn.sparse_mlp(x.bfloat16(), *(None if t is None else t.bfloat16() for t in (gate, up, down)), return_l1=True)
    assert l1_bf16.dtype == torch.float32
    assert l1.dim() == 0 and l1.dtype == torch.float64 and l1.item() > 0
    grads = torch.autograd.grad((y * r).sum() + 0.7 * l1, params)
    ref_params = [t.detach().clone().requires_grad_() for t in params]
    ref_x, ref_gate, ref_up, ref_down = (ref_params if gated else [ref_params[0], None, *ref_params[1:]])
    ref_loss = _reference_loss(ref_x, ref_gate, ref_up, ref_down, threshold, r, 0.7)
    ref_grads = torch.autograd.grad(ref_loss, ref_params)
    _, ref_h = sparseffn.ops.reference.mlp_activation_reference(x.detach(), None if gate is None else gate.detach(),
                                                                up.detach(), threshold)
    torch.testing.assert_close(l1, ref_h.abs().sum(-1).mean())
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("gated", [True, False])
def test_gradcheck_through_eager_path(gated):
    x, gate, up, down = _inputs(m=4, d=5, h=7, dtype=torch.float64, gated=gated, seed=5)
    args = [t.requires_grad_() for t in (x, gate, up, down) if t is not None]

    def f(*ts):
        xs, rest = ts[0], list(ts[1:])
        g = rest.pop(0) if gated else None
        return sparseffn.sparse_mlp(xs, g, rest[0], rest[1], 0.05)

    torch.autograd.gradcheck(f, args)


def test_return_l1_must_be_bool():
    x, gate, up, down = _inputs()
    with pytest.raises(TypeError, match="return_l1 must be a bool, got int"):
        sparseffn.sparse_mlp(x, gate, up, down, return_l1=1)
