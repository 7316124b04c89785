"""convert (kernels/convert.py) against torch's `.to()`: bitwise on the GPU and for same-dtype copies;
under the interpreter, whose fp32 -> bf16 / fp16 cast truncates, within one ulp of the output dtype."""

from __future__ import annotations

import pytest
import torch

from sparseffn.kernels.convert import convert
from tests.kernels.compile_specs.convert import compile_specs

pytestmark = pytest.mark.filterwarnings(  # triton's interpreter turns 1-element arrays into ints
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _assert_rounded(got: torch.Tensor, src: torch.Tensor) -> None:
    want = src.to(got.dtype)
    assert got.shape == want.shape and got.is_contiguous()
    if DEVICE == "cuda" or src.dtype == got.dtype:
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        return
    ulp = torch.finfo(got.dtype).eps * src.abs().double().clamp_min(torch.finfo(got.dtype).tiny)
    assert ((got.double() - src.double()).abs() <= ulp).all()


@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 1), (65, 130), (128, 64), (3, 200)], ids=lambda s: "{}x{}".format(*s))
def test_convert_matches_torch(shape, dtype, transpose):
    gen = torch.Generator().manual_seed(sum(shape))
    src = (torch.randn(*shape, generator=gen) * 4).to(DEVICE)
    got = convert(src, dtype, transpose=transpose)
    _assert_rounded(got, src.t() if transpose else src)


@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_convert_copies_a_weight_exactly(dtype, transpose):
    """Same dtype in and out (the training passes' down_proj.weight^T): a bitwise copy."""
    src = torch.randn(70, 130, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    got = convert(src, dtype, transpose=transpose)
    assert torch.equal(got, src.t() if transpose else src) and got.is_contiguous()


def test_convert_takes_row_strided_views_and_empty_tensors():
    src = torch.randn(40, 100).to(DEVICE)[:, 3:67]  # row stride 100
    _assert_rounded(convert(src, torch.bfloat16), src)
    _assert_rounded(convert(src, torch.bfloat16, transpose=True), src.t())
    assert convert(torch.empty(0, 5, device=DEVICE), torch.float16, transpose=True).shape == (5, 0)


@pytest.mark.parametrize("args, error, match", [
    ((torch.zeros(2, 2, dtype=torch.float64), torch.bfloat16), TypeError, "src must be an fp32, bf16 or fp16"),
    ((torch.zeros(2, 2, 2), torch.bfloat16), TypeError, "src must be an fp32, bf16 or fp16"),
    ((torch.zeros(2, 2), torch.float32), TypeError, "dtype must be bf16 or fp16"),
    (([[0.0]], torch.bfloat16), TypeError, "src must be a torch.Tensor"),
])
def test_convert_input_errors(args, error, match):
    with pytest.raises(error, match=match):
        convert(*args)
    with pytest.raises(TypeError, match="transpose must be a bool"):
        convert(torch.zeros(2, 2), torch.bfloat16, transpose=1)


def test_compile_specs_cover_both_dtypes_and_layouts():
    specs = compile_specs(with_options=True)
    pairs = [("*fp32", "*bf16"), ("*fp32", "*fp16"), ("*bf16", "*bf16"), ("*fp16", "*fp16")]
    assert {(s["src_ptr"], s["dst_ptr"], c["TRANSPOSE"]) for _, s, c, _ in specs} == {
        (a, b, t) for a, b in pairs for t in (False, True)}
