import numpy as np
import pytest
import torch

from sparseffn.format import TwELL
from sparseffn.ops.reference import (
    l1_penalty,
    mlp_activation_reference,
    sparse_mlp_reference,
    twell_up_down_reference,
)


def _numpy_mlp(x, gate, up, down, threshold):
    """Independent float64 computation, one token at a time."""
    x, up, down = (t.double().numpy() for t in (x, up, down))
    gate = None if gate is None else gate.double().numpy()
    theta = np.zeros(up.shape[0]) if threshold is None else np.broadcast_to(
        np.asarray(threshold.double().numpy() if isinstance(threshold, torch.Tensor) else threshold), up.shape[:1])
    out = np.zeros((x.shape[0], down.shape[0]))
    for i, row in enumerate(x):
        if gate is None:
            h = np.maximum(up @ row - theta, 0.0)
        else:
            h = np.maximum(gate @ row - theta, 0.0) * (up @ row)
        out[i] = down @ h
    return torch.from_numpy(out)


def _weights(d, h, gated, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(h, d, generator=gen) / d**0.5 if gated else None
    up = torch.randn(h, d, generator=gen) / d**0.5
    down = torch.randn(d, h, generator=gen) / h**0.5
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(gate), cast(up), cast(down)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("threshold", [None, 0.3, "tensor"])
def test_reference_matches_independent_float64(gated, threshold):
    d, h = 24, 40
    gate, up, down = _weights(d, h, gated)
    x = torch.randn(9, d, generator=torch.Generator().manual_seed(5))
    if threshold == "tensor":
        threshold = torch.linspace(-0.5, 1.0, h)
    y = sparse_mlp_reference(x.double(), *(None if w is None else w.double() for w in (gate, up, down)), threshold)
    expected = _numpy_mlp(x, gate, up, down, threshold)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    y32 = sparse_mlp_reference(x, gate, up, down, threshold)
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_computes_in_fp32_and_returns_input_dtype(dtype):
    d, h = 32, 64
    gate, up, down = _weights(d, h, True, dtype=dtype)
    x = torch.randn(3, 5, d).to(dtype)  # leading batch dims
    y = sparse_mlp_reference(x, gate, up, down)
    assert y.dtype == dtype and y.shape == (3, 5, d)
    expected = _numpy_mlp(x.reshape(-1, d), gate, up, down, None).reshape(3, 5, d)
    # Only the final rounding to the low dtype separates it from the float64 truth.
    torch.testing.assert_close(y.double(), expected, rtol=torch.finfo(dtype).eps, atol=1e-6)


def test_activation_reference_is_relu_of_shifted_gate_times_up():
    d, h = 8, 12
    gate, up, _ = _weights(d, h, True)
    x = torch.randn(4, d)
    theta = torch.rand(h)
    p, hh = mlp_activation_reference(x, gate, up, theta)
    g = x.double() @ gate.double().t() - theta.double()
    torch.testing.assert_close(p.double(), g.clamp_min(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hh.double(), g.clamp_min(0) * (x.double() @ up.double().t()), rtol=1e-5, atol=1e-6)
    assert bool((p == 0).any()) and bool((p > 0).any())


def test_nan_and_inf_propagate():
    d, h = 8, 16
    gate, up, down = _weights(d, h, True)
    x = torch.randn(3, d)
    x[1, 2] = float("nan")
    x[2, 0] = float("inf")
    y = sparse_mlp_reference(x, gate, up, down)
    assert y[0].isfinite().all()
    assert y[1].isnan().all()
    assert not y[2].isfinite().all()


def test_l1_penalty_is_mean_over_tokens_of_sum_of_abs():
    h = torch.tensor([[[1.0, -2.0, 0.0], [0.0, 0.0, 3.0]], [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]])
    # per-token sums: 3, 3, 1, 0 -> mean 1.75
    assert l1_penalty(h).item() == 1.75
    hb = h.to(torch.bfloat16).requires_grad_()
    val = l1_penalty(hb)
    assert val.dtype == torch.float32
    val.backward()
    # d/dh mean_t sum_j |h| = sign(h) / tokens; zero where h == 0
    torch.testing.assert_close(hb.grad.float(), torch.sign(h) / 4)


def test_l1_penalty_rejects_bad_input():
    with pytest.raises(TypeError, match="h must be floating point"):
        l1_penalty(torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="0-D"):
        l1_penalty(torch.tensor(1.0))


@pytest.mark.parametrize("gated", [True, False])
def test_twell_up_down_reference_equals_dense_mlp(gated):
    d, h = 16, 300
    gate, up, down = _weights(d, h, gated, seed=7)
    x = torch.randn(40, d, generator=torch.Generator().manual_seed(8))
    theta = torch.full((h,), 1.2)
    theta[:5] = -3.0  # 5 units always on
    x[3] *= 20  # a heavy row: many units on, overflows slots=4
    p, _ = mlp_activation_reference(x, gate, up, theta)
    packed = TwELL.from_dense(p, tile=64, slots=4)
    assert packed.overflow_rows.numel() > 0
    y = twell_up_down_reference(x, packed, up if gated else None, down)
    expected = _numpy_mlp(x, gate, up, down, theta)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
