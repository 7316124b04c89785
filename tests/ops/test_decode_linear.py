"""ops.decode_linear.projections: which calls take the one-launch kernel, and that they equal the modules.

On CPU the kernel runs under the interpreter (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparseffn.ops.decode_linear import projections

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _linears(d=64, ns=(64, 32, 32), dtype=torch.bfloat16, bias=False, cls=nn.Linear):
    torch.manual_seed(0)
    return [cls(d, n, bias=bias).to(DEVICE, dtype) for n in ns]


def _close(got, want):
    tol = torch.finfo(want.dtype).eps * want.float().abs() + 1e-5 * want.float().abs().max()
    return got.shape == want.shape and got.dtype == want.dtype and bool(((got.float() - want.float()).abs() <= tol).all())


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 1, 64), (1, 2, 64), (64,)])
def test_one_or_two_tokens_equal_the_modules(shape):
    linears = _linears()
    x = torch.randn(*shape, device=DEVICE).bfloat16()
    with torch.no_grad():
        got = projections(x, linears)
        want = [m(x) for m in linears]
    assert got is not None
    assert all(_close(g, w) for g, w in zip(got, want))


def test_one_or_two_linears():
    linears = _linears(ns=(16, 8))
    x = torch.randn(1, 1, 64, device=DEVICE).bfloat16()
    with torch.no_grad():
        for mods in (linears[:1], linears):
            got = projections(x, mods)
            assert len(got) == len(mods) and all(_close(g, m(x)) for g, m in zip(got, mods))


class _Subclass(nn.Linear):
    """A layer that is an nn.Linear but may compute more (LoRA, quantized layers)."""


@pytest.mark.parametrize("case", ["bias", "subclass", "three_tokens", "fp32", "grad", "autocast", "four", "none"])
def test_calls_the_kernel_does_not_take(case):
    linears = _linears(bias=case == "bias", cls=_Subclass if case == "subclass" else nn.Linear,
                       dtype=torch.float32 if case == "fp32" else torch.bfloat16)
    x = torch.randn(3 if case == "three_tokens" else 1, 64, device=DEVICE, dtype=linears[0].weight.dtype)
    mods = {"four": linears + linears[:1], "none": []}.get(case, linears)
    if case == "grad":
        assert projections(x, mods) is None  # the weights require grad and grad mode is on
        return
    with torch.no_grad():
        if case == "autocast":
            with torch.autocast(DEVICE, dtype=torch.float16):
                assert projections(x, mods) is None
            return
        assert projections(x, mods) is None


def test_compiled_call_goes_through_the_custom_op():
    linears = _linears()
    x = torch.randn(1, 1, 64, device=DEVICE).bfloat16()

    def qkv(t):
        return projections(t, linears)

    with torch.no_grad():
        eager = qkv(x)
        compiled = torch.compile(qkv, backend="aot_eager", fullgraph=True)(x)
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))
