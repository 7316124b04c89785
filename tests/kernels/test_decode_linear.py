"""decode_linear (up to three projections of one or two tokens in one launch) against fp32 products.

Runs natively on a GPU and under the interpreter on CPU (tests/conftest.py). Each output is the fp32
product rounded once to bf16 / fp16, so it lies within one ulp of the exact product (the interpreter
truncates where the GPU rounds) plus fp32 summation-order noise.
"""

from __future__ import annotations

import pytest
import torch

from sparseffn.kernels.decode_linear import MAX_TOKENS, decode_linear
from tests.kernels.compile_specs.decode_linear import compile_specs

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(ns, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, d, generator=g) / d**0.5).to(dtype) for n in ns]


def _check(y, x, weights):
    ref = torch.cat([x.double() @ w.double().t() for w in weights], 1)
    ulp = torch.finfo(x.dtype).eps  # one ulp relative to the value's leading power of two
    tol = ulp * ref.abs() + 1e-5 * ref.abs().max()
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert ((y.double() - ref).abs() <= tol).all(), (y.double() - ref).abs().max()


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("ns, d", [((48, 16, 16), 200), ((7,), 96), ((5, 9), 130), ((33, 33, 2), 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_fp32_products(m, ns, d, dtype):
    g = torch.Generator().manual_seed(m * 1000 + d)
    x = torch.randn(m, d, generator=g).to(dtype)
    weights = _weights(ns, d, dtype, seed=d)
    y = decode_linear(x.to(DEVICE), [w.to(DEVICE) for w in weights]).cpu()
    _check(y, x, weights)
    outs = torch.split(y, list(ns), dim=1)
    for out, w in zip(outs, weights):  # each slice is its own projection
        _check(out, x, [w])


def test_row_strides_and_a_second_step_over_d():
    """Weights with row stride > D (views into wider matrices), x with a row stride, and D above
    the 2048-wide block (two steps of the loop over D)."""
    d = 2100
    x = torch.randn(2, d + 8, device=DEVICE).bfloat16()[:, :d]
    weights = [w.to(DEVICE) for w in _weights((3, 4, 2), d + 24, torch.bfloat16, seed=5)]
    weights = [w[:, :d] for w in weights]
    assert weights[0].stride(0) == d + 24 and x.stride(0) == d + 8
    _check(decode_linear(x, weights).cpu(), x.cpu(), [w.cpu() for w in weights])


def test_special_values():
    """Zero rows give exact zeros; inf and NaN in x propagate as in the dense product."""
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[1, 3] = float("nan")
    w = torch.randn(8, 64).bfloat16()
    y = decode_linear(x.to(DEVICE), [w.to(DEVICE)]).cpu()
    assert torch.equal(y[0], torch.zeros(8, dtype=torch.bfloat16))
    assert y[1].isnan().all()


def test_errors():
    x = torch.randn(1, 16).bfloat16()
    w = torch.randn(4, 16).bfloat16()
    with pytest.raises(ValueError, match="x must have 1 to 2 rows"):
        decode_linear(torch.randn(MAX_TOKENS + 1, 16).bfloat16(), [w])
    with pytest.raises(ValueError, match="x must be a 2-D tensor"):
        decode_linear(x[0], [w])
    with pytest.raises(TypeError, match="x must be bf16 or fp16"):
        decode_linear(x.float(), [w.float()])
    with pytest.raises(ValueError, match="weights must be a list of 1 to 3 tensors"):
        decode_linear(x, [w] * 4)
    with pytest.raises(ValueError, match=r"weights\[1\] must be a tensor \[N, D=16\]"):
        decode_linear(x, [w, torch.randn(4, 8).bfloat16()])
    with pytest.raises(ValueError, match=r"weights\[0\] must be torch.bfloat16"):
        decode_linear(x, [w.half()])
    with pytest.raises(ValueError, match=r"weights\[0\] must have unit stride along D"):
        decode_linear(x, [torch.randn(16, 4).bfloat16().t()])


def test_empty_outputs():
    x = torch.randn(1, 16).bfloat16().to(DEVICE)
    assert decode_linear(x, [torch.empty(0, 16, dtype=torch.bfloat16, device=DEVICE)]).shape == (1, 0)
    y = decode_linear(torch.empty(2, 0, dtype=torch.bfloat16, device=DEVICE),
                      [torch.empty(3, 0, dtype=torch.bfloat16, device=DEVICE)])
    assert torch.equal(y.cpu(), torch.zeros(2, 3, dtype=torch.bfloat16))


def test_compile_specs_cover_dtypes_and_token_counts():
    specs = compile_specs(with_options=True)
    assert {(s[1]["x_ptr"], s[2]["M_PAD"]) for s in specs} == {(t, m) for t in ("*bf16", "*fp16") for m in (1, 2)}
    assert all(len(s) == 4 for s in specs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_attention_projections_at_real_size(m):
    """q, k, v of a 2048-wide model (GQA-sized k and v too) against cuBLAS and fp32."""
    x = torch.randn(m, 2048, device="cuda").bfloat16()
    weights = [w.cuda() for w in _weights((2048, 512, 512), 2048, torch.bfloat16, seed=m)]
    y = decode_linear(x, weights)
    _check(y.cpu(), x.cpu(), [w.cpu() for w in weights])
    cublas = torch.cat([x @ w.t() for w in weights], 1)
    assert (y.float() - cublas.float()).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * cublas.abs().max()
