"""ops.decode_linear.decode_projections: which calls take the one-launch kernel, and that they equal
F.linear. On CPU the kernel runs under the interpreter (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparseffn.ops.decode_linear import decode_projections

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(d=64, ns=(64, 32, 32), dtype=torch.bfloat16, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, d, generator=g) / d**0.5).to(DEVICE, dtype).requires_grad_(requires_grad) for n in ns]


def _close(got, want):
    tol = torch.finfo(want.dtype).eps * want.float().abs() + 1e-5 * want.float().abs().max()
    return got.shape == want.shape and got.dtype == want.dtype and bool(((got.float() - want.float()).abs() <= tol).all())


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 1, 64), (1, 2, 64), (64,)])
def test_one_or_two_tokens_equal_f_linear(shape):
    weights = _weights()
    x = torch.randn(*shape, device=DEVICE).bfloat16()
    got = decode_projections(x, weights)
    assert got is not None
    assert all(_close(g, F.linear(x, w)) for g, w in zip(got, weights))


def test_one_or_two_weights():
    weights = _weights(ns=(16, 8))
    x = torch.randn(1, 1, 64, device=DEVICE).bfloat16()
    for ws in (weights[:1], weights):
        got = decode_projections(x, ws)
        assert len(got) == len(ws) and all(_close(g, F.linear(x, w)) for g, w in zip(got, ws))


@pytest.mark.parametrize("case", ["three_tokens", "fp32", "grad", "autocast", "four", "none", "other_dtype"])
def test_calls_the_kernel_does_not_take(case):
    weights = _weights(dtype=torch.float32 if case == "fp32" else torch.bfloat16, requires_grad=case == "grad")
    x = torch.randn(3 if case == "three_tokens" else 1, 64, device=DEVICE, dtype=weights[0].dtype)
    ws = {"four": weights + weights[:1], "none": [], "other_dtype": [w.half() for w in weights]}.get(case, weights)
    if case == "autocast":
        with torch.autocast(DEVICE, dtype=torch.float16):
            assert decode_projections(x, ws) is None
    else:
        assert decode_projections(x, ws) is None


def test_compiled_call_goes_through_the_custom_op():
    weights = _weights()
    x = torch.randn(1, 1, 64, device=DEVICE).bfloat16()
    eager = decode_projections(x, weights)
    compiled = torch.compile(lambda t: decode_projections(t, weights), backend="aot_eager", fullgraph=True)(x)
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))
