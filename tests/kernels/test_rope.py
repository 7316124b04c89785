"""Rotary-embedding kernel (kernels/rope.py) and the `sparseffn::rope` op against fp64 truth and HF.

Truth: `rope_reference` in fp64, gradients by fp64 autograd (cos / sin get none). Rule (docs/design.md, "Exactness",
flash-attention): max|out - ref| <= 2 max|hf_same_dtype - ref| + one ulp of the output dtype at
max|ref|, hf_same_dtype being transformers' `apply_rotary_pos_emb` in the test's dtypes. Outputs
must also have HF's dtype and strides. cos / sin come both as HF builds them (cos = cat(f, f),
batch 1 broadcast with stride 0) and with unrelated halves per batch, so a kernel reading c1 for
c2 fails.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sparseffn.kernels.rope import _rope_kernel, empty_like_layout, rope_backward, rope_forward
from sparseffn.kernels.configs.rope import RopeConfig, default_config
from tests.kernels.compile_specs.rope import compile_specs
from sparseffn.ops.fused_norm_rope import apply_rope, rope_op, rope_reference
from tests.kernels.jit import do_not_specialize

pytestmark = pytest.mark.filterwarnings(  # triton's interpreter turns 1-element arrays into ints
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
# (B, Hq, Hk, S, d): one token, odd S with d not a power of two, GQA, several head steps, d = 200
SHAPES = [(1, 1, 1, 1, 2), (2, 3, 1, 5, 96), (2, 4, 2, 7, 64), (1, 5, 5, 3, 200)]
LAYOUTS = ["bshd", "bhsd", "qkv"]  # transposed views of [B, S, H, d], contiguous, slices of a fused qkv buffer
# tokens and heads split across programs and steps (B * 3 programs at S = 5; 2 q-head steps at Hq 3)
SMALL = RopeConfig(block_s=2, block_hq=2, block_hk=1, num_warps=1)


def _ids(v):
    return str(v).replace("torch.", "") if isinstance(v, torch.dtype) else None


def _qk(b, hq, hk, s, d, dtype, layout, gen):
    if layout == "bshd":
        q = torch.randn(b, s, hq, d, generator=gen).transpose(1, 2)
        k = torch.randn(b, s, hk, d, generator=gen).transpose(1, 2)
    elif layout == "bhsd":
        q, k = torch.randn(b, hq, s, d, generator=gen), torch.randn(b, hk, s, d, generator=gen)
    else:  # one [B, S, (Hq + 2 Hk) d] projection: q and k are non-dense views
        qkv = torch.randn(b, s, hq + 2 * hk, d, generator=gen)
        q, k = qkv[:, :, :hq].transpose(1, 2), qkv[:, :, hq:hq + hk].transpose(1, 2)
    q, k = q.to(dtype=dtype, device=DEVICE), k.to(dtype=dtype, device=DEVICE)
    assert q.stride(-1) == 1
    return q, k


def _cos_sin(b, s, d, dtype, hf_style, gen):
    """HF style: cos = cat(f, f) of positions [1, S] expanded over B (stride 0); else unrelated
    values in every half and batch, [B, S, d]."""
    if hf_style:
        inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        freqs = torch.arange(s, dtype=torch.float64)[None, :, None] * inv_freq  # [1, S, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype).expand(b, s, d), emb.sin().to(dtype).expand(b, s, d)
    else:
        cos, sin = torch.randn(b, s, d, generator=gen).to(dtype), torch.randn(b, s, d, generator=gen).to(dtype)
    return cos.to(DEVICE), sin.to(DEVICE)


def _layout(t):
    """Strides of the dimensions longer than 1 (a size-1 dimension's stride is arbitrary)."""
    return tuple(st for st, n in zip(t.stride(), t.shape) if n > 1)


def _floor(dtype, ref):
    return torch.finfo(dtype).eps * ref.abs().max().item() + torch.finfo(fp32).tiny


def _assert_flash(out, ref, hf, what):
    assert out.dtype == hf.dtype, f"{what}: dtype {out.dtype}, HF gives {hf.dtype}"
    assert out.shape == hf.shape
    err = (out.double() - ref).abs().max().item()
    bound = 2 * (hf.double() - ref).abs().max().item() + _floor(out.dtype, ref)
    assert err <= bound, f"{what}: max err {err:.3g} > {bound:.3g}"


def _reference_grads(q, k, cos, sin, gq, gk):
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    rq, rk = rope_reference(q64, k64, cos.double(), sin.double())
    return (rq.detach(), rk.detach(), *torch.autograd.grad((rq, rk), (q64, k64), (gq.double(), gk.double())))


# ----------------------------------------------------------------------------------------------------
# forward and backward


@pytest.mark.parametrize("hf_style", [True, False], ids=["hfcos", "randcos"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,cs_dtype", [(bf16, bf16), (fp16, fp16), (fp32, fp32), (bf16, fp32)], ids=_ids)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hk{}-S{}-d{}".format(*s))
def test_forward_and_backward_match_truth_and_hf(shape, dtype, cs_dtype, layout, hf_style):
    b, hq, hk, s, d = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q, k = _qk(b, hq, hk, s, d, dtype, layout, gen)
    cos, sin = _cos_sin(b, s, d, cs_dtype, hf_style, gen)
    config = SMALL if layout == "bhsd" else None

    q_out, k_out = rope_forward(q, k, cos, sin, config=config)
    hq_out, hk_out = apply_rotary_pos_emb(q, k, cos, sin)
    assert _layout(q_out) == _layout(hq_out) and _layout(k_out) == _layout(hk_out), "layout differs from HF's"

    gq = torch.randn(q_out.shape, generator=gen).to(dtype=q_out.dtype, device=DEVICE)
    gk = torch.randn(k_out.shape, generator=gen).to(dtype=k_out.dtype, device=DEVICE)
    ref_q, ref_k, ref_dq, ref_dk = _reference_grads(q, k, cos, sin, gq, gk)
    _assert_flash(q_out, ref_q, hq_out, "q_out")
    _assert_flash(k_out, ref_k, hk_out, "k_out")

    dq, dk = rope_backward(gq, gk, cos, sin, dtype=dtype, config=config)
    qh, kh = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    hf_dq, hf_dk = torch.autograd.grad(apply_rotary_pos_emb(qh, kh, cos, sin), (qh, kh), (gq, gk))
    _assert_flash(dq, ref_dq, hf_dq, "dq")
    _assert_flash(dk, ref_dk, hf_dk, "dk")


def test_reference_is_hf_in_fp64():
    gen = torch.Generator().manual_seed(0)
    q, k = _qk(2, 3, 1, 5, 96, torch.float64, "bshd", gen)
    cos, sin = _cos_sin(2, 5, 96, torch.float64, False, gen)
    for ours, theirs in zip(rope_reference(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.allclose(ours, theirs, rtol=1e-14, atol=1e-14)


def test_forward_is_exact_fp32_math():
    """fp32 in and out: the kernel's o1 = x1 c1 - x2 s1, o2 = x2 c2 + x1 s2 with each product and the
    sum rounded to fp32 is within one fp32 rounding of the same expression in torch."""
    gen = torch.Generator().manual_seed(1)
    q, k = _qk(2, 4, 2, 7, 64, fp32, "bshd", gen)
    cos, sin = _cos_sin(2, 7, 64, fp32, False, gen)
    q_out, _ = rope_forward(q, k, cos, sin)
    c, s_ = cos[:, None], sin[:, None]
    x1, x2 = q[..., :32], q[..., 32:]
    expect = torch.cat((x1 * c[..., :32] - x2 * s_[..., :32], x2 * c[..., 32:] + x1 * s_[..., 32:]), -1)
    tol = 2 * torch.finfo(fp32).eps * (x1.abs() * c[..., :32].abs() + x2.abs() * s_[..., :32].abs())
    assert ((q_out[..., :32] - expect[..., :32]).abs() <= tol + 1e-30).all()
    assert torch.allclose(q_out, expect, rtol=1e-6, atol=1e-6)


def test_empty_and_layout_helper():
    q = torch.empty(2, 3, 0, 8, device=DEVICE)
    k = torch.empty(2, 1, 0, 8, device=DEVICE)
    cos = torch.empty(2, 0, 8, device=DEVICE)
    q_out, k_out = rope_forward(q, k, cos, cos)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    t = torch.empty(2, 5, 3, 8).transpose(1, 2)
    assert empty_like_layout(t, bf16).stride() == t.stride()
    fused = torch.empty(2, 5, 9, 8)[:, :, :3].transpose(1, 2)  # non-dense: densely in the same order
    assert empty_like_layout(fused, fp32).stride() == (5 * 3 * 8, 8, 3 * 8, 1)


# ----------------------------------------------------------------------------------------------------
# the op: broadcast cos / sin, autograd, fake tensors, eager fallback


def test_apply_rope_broadcasts_and_differentiates():
    gen = torch.Generator().manual_seed(2)
    q, k = _qk(2, 3, 1, 5, 96, bf16, "bshd", gen)
    cos, sin = _cos_sin(1, 5, 96, bf16, True, gen)  # [1, S, d] as LlamaRotaryEmbedding returns
    qr, kr = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    q_out, k_out = apply_rope(qr, kr, cos, sin)
    expect = rope_forward(q, k, cos.expand(2, 5, 96), sin.expand(2, 5, 96))
    assert torch.equal(q_out, expect[0]) and torch.equal(k_out, expect[1])
    q2, k2 = apply_rope(q, k, cos[0], sin[0])  # [S, d]
    assert torch.equal(q2, expect[0]) and torch.equal(k2, expect[1])
    gq, gk = torch.randn_like(q_out), torch.randn_like(k_out)
    (q_out.float() * gq).sum().add((k_out.float() * gk).sum()).backward()
    dq, dk = rope_backward(gq, gk, cos.expand(2, 5, 96), sin.expand(2, 5, 96), dtype=bf16)
    assert torch.equal(qr.grad, dq) and torch.equal(kr.grad, dk)
    # only q's output used: k's gradient is zero, not an error
    qr.grad = kr.grad = None
    apply_rope(qr, kr, cos, sin)[0].float().sum().backward()
    assert kr.grad is None or not kr.grad.any()


def test_apply_rope_autocast_dtypes():
    """bf16 q / k with fp32 cos / sin (HF under autocast): fp32 outputs, bf16 gradients."""
    gen = torch.Generator().manual_seed(3)
    q, k = _qk(1, 2, 2, 3, 64, bf16, "bshd", gen)
    cos, sin = _cos_sin(1, 3, 64, fp32, True, gen)
    qr = q.detach().clone().requires_grad_()
    q_out, k_out = apply_rope(qr, k, cos, sin)
    assert q_out.dtype == k_out.dtype == fp32
    q_out.sum().backward()
    assert qr.grad.dtype == bf16
    # asked for bf16 outputs (what attention casts them to under autocast): the fp32 ones rounded once
    # (to nearest on the GPU, truncated by the interpreter), gradients still bf16
    q16, k16 = apply_rope(qr, k, cos, sin, out_dtype=bf16)
    assert q16.dtype == k16.dtype == bf16
    for got, want in ((q16, q_out), (k16, k_out)):
        if DEVICE == "cuda":
            assert torch.equal(got, want.to(bf16))
        else:
            assert ((got.float() - want).abs() <= want.abs() * 2 ** -7).all()
    qr.grad = None
    q16.float().sum().backward()
    assert qr.grad.dtype == bf16
    with pytest.raises(TypeError, match="out_dtype"):
        apply_rope(q, k, cos, sin, out_dtype=torch.int8)


@pytest.mark.parametrize("out_dtype", [None, bf16])
def test_op_passes_opcheck(out_dtype):
    gen = torch.Generator().manual_seed(4)
    q, k = _qk(2, 3, 1, 5, 96, bf16, "bshd", gen)
    cos, sin = _cos_sin(2, 5, 96, fp32 if out_dtype else bf16, True, gen)
    torch.library.opcheck(rope_op, (q.requires_grad_(), k.requires_grad_(), cos, sin, out_dtype))


@pytest.mark.skipif(DEVICE == "cuda", reason="the eager fallback serves CPU tensors without the interpreter")
@pytest.mark.parametrize("dtype,cs_dtype", [(bf16, bf16), (fp16, fp16), (fp32, fp32), (bf16, fp32)], ids=_ids)
def test_eager_fallback_is_the_same_function(monkeypatch, dtype, cs_dtype):
    """Without TRITON_INTERPRET, CPU tensors take the eager path: the kernel's math with the same
    layouts, bit for bit unless bf16 is rounded to (the interpreter truncates: one ulp)."""
    gen = torch.Generator().manual_seed(5)
    q, k = _qk(2, 3, 1, 5, 96, dtype, "bshd", gen)
    cos, sin = _cos_sin(1, 5, 96, cs_dtype, False, gen)

    def run():
        qr, kr = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        q_out, k_out = apply_rope(qr, kr, cos, sin)
        torch.autograd.backward((q_out, k_out), (torch.ones_like(q_out), torch.full_like(k_out, -2.0)))
        return q_out.detach(), k_out.detach(), qr.grad, kr.grad

    kernel = run()
    monkeypatch.delenv("TRITON_INTERPRET")
    eager = run()
    for a, b in zip(kernel, eager):
        assert a.dtype == b.dtype and a.stride() == b.stride()
        if a.dtype == bf16:
            assert torch.allclose(a, b, rtol=2 ** -7, atol=1e-30)
        else:
            assert torch.equal(a, b)


def test_fp64_runs_eagerly():
    gen = torch.Generator().manual_seed(6)
    q, k = _qk(2, 3, 1, 5, 96, torch.float64, "bshd", gen)
    cos, sin = _cos_sin(2, 5, 96, torch.float64, False, gen)
    for ours, theirs in zip(apply_rope(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        assert ours.dtype == torch.float64 and _layout(ours) == _layout(theirs)
        assert torch.allclose(ours, theirs, rtol=1e-14, atol=1e-14)


# ----------------------------------------------------------------------------------------------------
# errors, compile keys, sm_90 coverage


def _args():
    gen = torch.Generator().manual_seed(7)
    q, k = _qk(2, 3, 1, 5, 8, bf16, "bshd", gen)
    cos, sin = _cos_sin(2, 5, 8, bf16, True, gen)
    return q, k, cos, sin


@pytest.mark.parametrize("call,exc,words", [
    (lambda q, k, c, s: rope_forward(q[0], k, c, s), ValueError, "q must be 4-D"),
    (lambda q, k, c, s: rope_forward(q, k[:, :, :4], c, s), ValueError, "k must be"),
    (lambda q, k, c, s: rope_forward(q, k.half(), c, s), TypeError, "k must have q's dtype"),
    (lambda q, k, c, s: rope_forward(q, k, c[:1], s), ValueError, "cos must be"),
    (lambda q, k, c, s: rope_forward(q, k, c, s.double()), TypeError, "sin must be"),
    (lambda q, k, c, s: rope_forward(q[..., :7], k[..., :7], c[..., :7], s[..., :7]), ValueError, "even"),
    (lambda q, k, c, s: rope_forward(q, k, c, s, config=(1, 1, 1)), TypeError, "config must be"),
    (lambda q, k, c, s: rope_backward(q, k, c, s, dtype=torch.int32), TypeError, "dtype must be"),
    (lambda q, k, c, s: apply_rope(q, k, c[:, :4], s), ValueError, "cos must be"),
    (lambda q, k, c, s: apply_rope(q, k, c, s.clone().requires_grad_()), NotImplementedError, "sin requires grad"),
    (lambda q, k, c, s: apply_rope(q, "k", c, s), TypeError, "k must be a torch.Tensor"),
])
def test_errors_name_the_argument(call, exc, words):
    with pytest.raises(exc, match=words):
        call(*_args())


def test_compiled_variants_do_not_depend_on_batch_or_sequence():
    assert {"B", "S"} <= set(do_not_specialize(_rope_kernel))
    # Llama 2B: 32 heads of 64, all q heads in one step of two tokens
    assert default_config(32, 8, 64, cuda=True) == RopeConfig(block_s=2, block_hq=32, block_hk=8, num_warps=4)


def test_compile_specs_cover_dtypes_and_directions():
    specs = compile_specs(with_options=True)
    seen = {(sig["q_ptr"], sig["cos_ptr"], sig["q_out_ptr"], cx["BACKWARD"]) for _, sig, cx, _ in specs}
    for ty in ("bf16", "fp16", "fp32"):
        for backward in (False, True):
            assert (f"*{ty}", f"*{ty}", f"*{ty}", backward) in seen
    assert ("*bf16", "*fp32", "*fp32", False) in seen and ("*fp32", "*fp32", "*bf16", True) in seen
