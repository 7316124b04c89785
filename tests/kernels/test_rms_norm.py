"""RMSNorm kernels (kernels/rms_norm.py) and the `sparseffn::rms_norm` op against fp64 truth and HF.

Truth: `rms_norm_reference` in fp64 (no intermediate rounding), gradients by fp64 autograd.
Rule (docs/design.md, "Exactness": flash-attention): max|out - ref| <= 2 max|hf_same_dtype - ref| + one ulp of the
output dtype at max|ref|, where hf_same_dtype is transformers' LlamaRMSNorm run in the test's
dtypes. Given the kernel's own rstd, y must equal HF's formula bit for bit (the rest of the forward
is one exactly-rounded product). The floor is one ulp of the coarsest dtype the semantics round to
(the output's, or x's: n is rounded to x.dtype before the weight product).; under the interpreter fp32 -> bf16 conversions truncate instead of
rounding to nearest, so there bf16 results may differ by one bf16 ulp per rounding.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from sparseffn.kernels.rms_norm import (MAX_D, _rms_norm_backward_kernel, _rms_norm_forward_kernel, rms_norm_backward,
                                        rms_norm_forward)
from sparseffn.kernels.configs.rms_norm import RMSNormConfig, default_config
from tests.kernels.compile_specs.rms_norm import compile_specs
from sparseffn.ops.fused_norm_rope import rms_norm, rms_norm_op, rms_norm_reference
from tests.kernels.jit import do_not_specialize

pytestmark = pytest.mark.filterwarnings(  # triton's interpreter turns 1-element arrays into ints
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
EPS = 1e-6
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
# (x dtype, weight dtype): same dtype, fp32 master weights, and a mixed pair promoting to fp32
DTYPE_PAIRS = [(bf16, bf16), (fp16, fp16), (fp32, fp32), (bf16, fp32), (fp16, bf16), (fp32, bf16)]
# (M, D): one row, odd M with D not a power of two, several programs, D a power of two
SHAPES = [(1, 64), (7, 96), (37, 200), (6, 1024)]
SMALL = RMSNormConfig(block_m=2, num_warps=1, programs_per_sm=1)  # backward: 2 programs looping over blocks


def _ids(v):
    return str(v).replace("torch.", "") if isinstance(v, torch.dtype) else None


def _problem(m, d, x_dtype, w_dtype, seed=0, strided=False):
    """x [M, D] with rows of very different scales (one all zero), weight near 1, on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.randint(-3, 4, (m, 1), generator=gen).double()
    x = torch.randn(m, d, generator=gen, dtype=torch.float64) * scale
    if m > 2:
        x[1] = 0
    w = 1 + 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)
    x, w = x.to(x_dtype).to(DEVICE), w.to(w_dtype).to(DEVICE)
    if strided:  # rows of a wider buffer: row stride D + 5, 1 element offset
        buffer = torch.zeros(m, d + 5, dtype=x_dtype, device=DEVICE)
        buffer[:, 1:d + 1] = x
        x = buffer[:, 1:d + 1]
        assert x.stride() == (d + 5, 1)
    return x, w


def _hf(x, w, requires_grad=False):
    norm = LlamaRMSNorm(x.shape[-1], eps=EPS).to(device=x.device, dtype=w.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    return norm


def _floor(dtypes, ref):
    """One ulp, at max|ref|, of the coarsest dtype the semantics round to (n is rounded to x's)."""
    eps = max(torch.finfo(t).eps for t in dtypes)
    return eps * ref.abs().max().item() + torch.finfo(fp32).tiny


def _assert_flash(out, ref, hf, what, x_dtype):
    assert out.dtype == hf.dtype, f"{what}: dtype {out.dtype}, HF gives {hf.dtype}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = (out.double() - ref).abs().max().item()
    bound = 2 * (hf.double() - ref).abs().max().item() + _floor((out.dtype, x_dtype), ref)
    assert err <= bound, f"{what}: max err {err:.3g} > {bound:.3g}"


def _ulps_apart(a, b, dtype, n):
    """|a - b| <= n ulps of dtype at |b| (element-wise), exact equality when n = 0."""
    if n == 0:
        return torch.equal(a, b)
    tol = n * torch.finfo(dtype).eps * b.double().abs() + torch.finfo(dtype).tiny
    return bool(((a.double() - b.double()).abs() <= tol).all())


# ----------------------------------------------------------------------------------------------------
# forward


@pytest.mark.parametrize("strided", [False, True], ids=["contig", "rowstrided"])
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PAIRS, ids=_ids)
@pytest.mark.parametrize("m,d", SHAPES)
def test_forward_matches_truth_and_hf(m, d, x_dtype, w_dtype, strided):
    x, w = _problem(m, d, x_dtype, w_dtype, seed=m + d, strided=strided)
    y, rstd = rms_norm_forward(x, w, EPS)
    assert y.shape == (m, d) and y.is_contiguous() and rstd.shape == (m,) and rstd.dtype == fp32

    # rstd: correctly rounded sqrt and division of an fp32 sum: a few fp32 ulps from fp64 truth
    x64 = x.double()
    rstd64 = torch.rsqrt(x64.pow(2).mean(-1) + EPS)
    assert _ulps_apart(rstd.cpu(), rstd64.cpu(), fp32, 4), "rstd is more than 4 fp32 ulps from the truth"

    ref = rms_norm_reference(x64, w.double(), EPS)
    with torch.no_grad():
        hf = _hf(x, w)(x)
    _assert_flash(y, ref, hf, "y", x_dtype)

    # the rest of the forward is HF's formula exactly, given the kernel's rstd
    expect = w * (x.float() * rstd[:, None]).to(x_dtype)
    truncating = not ON_GPU and bf16 in (x_dtype, y.dtype)
    assert _ulps_apart(y, expect, bf16, 2 if truncating else 0), "y differs from HF's formula at the kernel's rstd"


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_forward_bitwise_hf_when_the_sum_is_exact():
    """Rows whose sum of squares is exact in any order and whose mean is a power of 4 (rsqrt exact):
    the kernel's y equals LlamaRMSNorm's bit for bit, fp32 and fp16 (eps = 0)."""
    gen = torch.Generator().manual_seed(3)
    m, d = 5, 96
    for dtype in (fp32, fp16):
        # 16 entries of ±2, 32 of ±1, 48 zeros: Σx² = 96 = D, so mean = 1; rows scaled by 2^k
        base = torch.cat([torch.full((16,), 2.0), torch.ones(32), torch.zeros(48)])
        rows = [base[torch.randperm(d, generator=gen)] * torch.where(torch.rand(d, generator=gen) < 0.5, -1.0, 1.0)
                * 2.0 ** (k - 2) for k in range(m)]
        x = torch.stack(rows).to(dtype).to(DEVICE)
        w = torch.randn(d, generator=gen).to(dtype).to(DEVICE)
        hf = LlamaRMSNorm(d, eps=0.0).to(device=DEVICE, dtype=dtype)
        with torch.no_grad():
            hf.weight.copy_(w)
            expect = hf(x)
        y, rstd = rms_norm_forward(x, w, 0.0)
        assert torch.equal(rstd.cpu(), 2.0 ** -(torch.arange(m, dtype=fp32) - 2)), "rstd of an exact row is not exact"
        assert torch.equal(y, expect), f"{dtype}: y differs from LlamaRMSNorm's"


def test_forward_non_contiguous_last_dim_is_copied():
    x, w = _problem(9, 96, bf16, bf16, seed=1)
    xt = x.t().contiguous().t()  # same values, column-major
    assert xt.stride(1) != 1
    y, rstd = rms_norm_forward(xt, w, EPS)
    y0, rstd0 = rms_norm_forward(x, w, EPS)
    assert torch.equal(y, y0) and torch.equal(rstd, rstd0)


def test_forward_empty_and_large_d():
    x, w = _problem(0, 64, bf16, bf16)
    y, rstd = rms_norm_forward(x, w, EPS)
    assert y.shape == (0, 64) and rstd.shape == (0,)
    x, w = _problem(2, 3000, bf16, fp32, seed=5)  # D past 2048, masked (BLOCK_D 4096)
    y, _ = rms_norm_forward(x, w, EPS)
    with torch.no_grad():
        _assert_flash(y, rms_norm_reference(x.double(), w.double(), EPS), _hf(x, w)(x), "y", bf16)


# ----------------------------------------------------------------------------------------------------
# backward


@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PAIRS, ids=_ids)
@pytest.mark.parametrize("m,d", SHAPES[1:])
def test_backward_matches_truth_and_hf(m, d, x_dtype, w_dtype, config):
    x, w = _problem(m, d, x_dtype, w_dtype, seed=2 * m + d, strided=config is SMALL)
    out_dtype = torch.promote_types(w_dtype, x_dtype)
    gen = torch.Generator().manual_seed(m)
    dy = torch.randn(m, d, generator=gen).to(out_dtype).to(DEVICE)

    _, rstd = rms_norm_forward(x, w, EPS)
    dx, dw = rms_norm_backward(dy, x, w, rstd, config=config)
    assert dx.dtype == x_dtype and dw.dtype == w_dtype and dx.shape == (m, d) and dw.shape == (d,)

    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    dx_ref, dw_ref = torch.autograd.grad(rms_norm_reference(x64, w64, EPS), (x64, w64), dy.double())

    xh = x.detach().clone().requires_grad_()
    hf = _hf(x, w)
    dx_hf, dw_hf = torch.autograd.grad(hf(xh), (xh, hf.weight), dy)
    _assert_flash(dx, dx_ref, dx_hf, "dx", x_dtype)
    _assert_flash(dw, dw_ref, dw_hf, "dweight", x_dtype)


def test_backward_is_deterministic_and_dx_independent_of_the_grid():
    x, w = _problem(37, 200, bf16, fp32, seed=9)
    dy = torch.randn(37, 200, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    _, rstd = rms_norm_forward(x, w, EPS)
    a = rms_norm_backward(dy, x, w, rstd, config=SMALL)
    b = rms_norm_backward(dy, x, w, rstd, config=SMALL)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = rms_norm_backward(dy, x, w, rstd, config=RMSNormConfig(block_m=4, num_warps=1, programs_per_sm=3))
    assert torch.equal(a[0], c[0]), "dx depends on the grid"
    # dweight: the same fp32 terms summed in another order
    assert torch.allclose(a[1], c[1], rtol=1e-5, atol=1e-5 * a[1].abs().max().item())


# ----------------------------------------------------------------------------------------------------
# the op: shapes, autograd, fake tensors, eager fallback


def test_op_leading_dims_autograd_and_hf_module():
    """rms_norm on [B, S, D] with gradients through the custom op equals the kernels on [M, D]."""
    x, w = _problem(10, 96, bf16, fp32, seed=4)
    x3 = x.view(2, 5, 96).clone().requires_grad_()
    wp = w.clone().requires_grad_()
    y = rms_norm(x3, wp, EPS)
    assert y.shape == (2, 5, 96) and y.dtype == fp32
    dy = torch.randn_like(y)
    y.backward(dy)
    y2, rstd = rms_norm_forward(x, w, EPS)
    dx2, dw2 = rms_norm_backward(dy.view(10, 96), x, w, rstd)
    assert torch.equal(y.view(10, 96).detach(), y2)
    assert torch.equal(x3.grad.view(10, 96), dx2) and torch.equal(wp.grad, dw2)


def test_op_rstd_is_not_differentiable():
    x, w = _problem(3, 64, fp32, fp32)
    y, rstd = rms_norm_op(x.requires_grad_(), w, EPS, None)
    assert y.requires_grad and not rstd.requires_grad


@pytest.mark.parametrize("dtype,out_dtype", [(bf16, None), (fp32, bf16)], ids=["bf16", "fp32_to_bf16"])
def test_op_passes_opcheck(dtype, out_dtype):
    x, w = _problem(5, 96, dtype, dtype, seed=2)
    torch.library.opcheck(rms_norm_op, (x.requires_grad_(), w.requires_grad_(), EPS, out_dtype))


def test_out_dtype_rounds_the_fp32_result_once():
    """fp32 x and weight with a bf16 output (autocast): the fp32 result rounded once (to nearest on
    the GPU; the interpreter truncates: one bf16 ulp), and bf16 gradients of y give the dx and dweight
    of those gradients in fp32."""
    x, w = _problem(6, 96, fp32, fp32, seed=5)
    y32, _ = rms_norm_forward(x, w, EPS)
    y16, rstd = rms_norm_forward(x, w, EPS, out_dtype=bf16)
    assert y16.dtype == bf16
    if ON_GPU:
        assert torch.equal(y16, y32.to(bf16))
    else:
        assert ((y16.float() - y32).abs() <= y32.abs() * 2 ** -7).all()
    dy = torch.randn(6, 96, generator=torch.Generator().manual_seed(6)).to(x.device, bf16)
    # (equal up to fp32 summation order: a bf16 dy compiles to another load layout on the GPU)
    for got, want in zip(rms_norm_backward(dy, x, w, rstd), rms_norm_backward(dy.float(), x, w, rstd)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    with pytest.raises(TypeError, match="out_dtype"):
        rms_norm_forward(x, w, EPS, out_dtype=torch.float64)
    with pytest.raises(TypeError, match="out_dtype"):
        rms_norm(x, w, EPS, out_dtype=torch.int32)


@pytest.mark.skipif(ON_GPU, reason="the eager fallback serves CPU tensors without the interpreter")
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PAIRS, ids=_ids)
def test_eager_fallback_is_the_same_function(monkeypatch, x_dtype, w_dtype):
    """Without TRITON_INTERPRET, CPU tensors take the eager path: the same rounding points, so it
    meets the same rule, and without bf16 (which the interpreter truncates) it matches the kernels
    up to summation order."""
    m, d = 7, 96
    x, w = _problem(m, d, x_dtype, w_dtype, seed=11)
    dy = torch.randn(m, d, generator=torch.Generator().manual_seed(2)).to(torch.promote_types(w_dtype, x_dtype))

    def run():
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = rms_norm(xr, wr, EPS)
        y.backward(dy)
        return y.detach(), xr.grad, wr.grad

    kernel = run()
    monkeypatch.delenv("TRITON_INTERPRET")
    eager = run()
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref_y = rms_norm_reference(x64, w64, EPS)
    refs = (ref_y.detach(), *torch.autograd.grad(ref_y, (x64, w64), dy.double()))
    xh = x.clone().requires_grad_()
    hf = _hf(x, w)
    hf_y = hf(xh)
    hfs = (hf_y.detach(), *torch.autograd.grad(hf_y, (xh, hf.weight), dy))
    for what, out, ref, hf_out in zip(("y", "dx", "dweight"), eager, refs, hfs):
        _assert_flash(out, ref, hf_out, f"eager {what}", x_dtype)
    if bf16 not in (x_dtype, w_dtype):
        for what, a, b in zip(("y", "dx", "dweight"), kernel, eager):
            assert torch.allclose(a.double(), b.double(), rtol=4 * torch.finfo(a.dtype).eps,
                                  atol=4 * torch.finfo(a.dtype).eps * b.abs().max().item()), what


def test_fp64_runs_eagerly_with_hf_semantics():
    x, w = _problem(4, 96, torch.float64, torch.float64)
    with torch.no_grad():
        y, hf = rms_norm(x, w, EPS), _hf(x, w)(x)
    assert y.dtype == torch.float64 and torch.allclose(y, hf, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------------
# errors, compile keys, sm_90 coverage


@pytest.mark.parametrize("call,exc,words", [
    (lambda x, w: rms_norm_forward(x.view(-1), w, EPS), ValueError, "x must be 2-D"),
    (lambda x, w: rms_norm_forward(x.double(), w, EPS), TypeError, "x must be torch.bfloat16"),
    (lambda x, w: rms_norm_forward(x, w[:-1], EPS), ValueError, "weight must have shape [D]"),
    (lambda x, w: rms_norm_forward(x, w.int(), EPS), TypeError, "weight must be"),
    (lambda x, w: rms_norm_forward(x, w, -1.0), ValueError, "eps must be"),
    (lambda x, w: rms_norm_forward(x, w, EPS, config=(1, 4)), TypeError, "config must be"),
    (lambda x, w: rms_norm_forward(x.new_zeros(2, MAX_D + 1), w, EPS), ValueError, "1 <= D <="),
    (lambda x, w: rms_norm_backward(x[:-1], x, w, torch.ones(4)), ValueError, "dy must have x's shape"),
    (lambda x, w: rms_norm_backward(x, x, w, torch.ones(3)), ValueError, "rstd must be"),
    (lambda x, w: rms_norm(x, w, float("nan")), ValueError, "eps must be"),
    (lambda x, w: rms_norm(x, "w", EPS), TypeError, "weight must be a torch.Tensor"),
    (lambda x, w: rms_norm(x.new_zeros(3, 0), w[:0], EPS), ValueError, "D >= 1"),
])
def test_errors_name_the_argument(call, exc, words):
    x, w = _problem(4, 64, bf16, bf16)
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        call(x, w)


def test_compiled_variants_do_not_depend_on_m():
    for kernel in (_rms_norm_forward_kernel, _rms_norm_backward_kernel):
        assert "M" in do_not_specialize(kernel)
    assert default_config(2048, cuda=True) == RMSNormConfig(block_m=2, num_warps=8, programs_per_sm=2)
    assert default_config(16384, cuda=True).block_m == 1


def test_compile_specs_cover_every_dtype_pair():
    specs = compile_specs(with_options=True)
    seen = {(fn.__name__, sig["x_ptr"], sig["weight_ptr"]) for fn, sig, _, _ in specs}
    names = {"bf16": bf16, "fp16": fp16, "fp32": fp32}
    for kernel, (x_ty, w_ty) in itertools.product((_rms_norm_forward_kernel, _rms_norm_backward_kernel),
                                                  itertools.product(names, names)):
        assert (kernel.__name__, f"*{x_ty}", f"*{w_ty}") in seen
    assert all(set(cx) <= {k for k, v in sig.items() if v == "constexpr"} for _, sig, cx, _ in specs)
