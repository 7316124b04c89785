"""RMSNorm and rotary embedding as differentiable custom ops over the Triton kernels.

    rms_norm(x, weight, eps)     y = weight * (x * rstd).to(x.dtype),  rstd = 1/sqrt(mean(x², -1) + eps)
    apply_rope(q, k, cos, sin)   Llama's q * cos + rotate_half(q) * sin (and k), computed in fp32

Semantics are Hugging Face's `LlamaRMSNorm` and `apply_rotary_pos_emb`, including output dtypes
(torch type promotion of weight and x, of q and cos / sin); the math, rounding points and layouts
are in kernels/rms_norm.py and kernels/rope.py. RMSNorm rounds where Hugging Face does (n to
x.dtype, then the weight product), so it differs only through rstd's summation order; RoPE rounds
once where Hugging Face's eager code rounds three times. Low-precision results therefore differ
from Hugging Face's by rounding only.

Ops (`torch.library`, with fake implementations and registered autograd, so torch.compile and
activation checkpointing see ordinary differentiable ops):

    sparseffn::rms_norm(x, weight, eps, out_dtype) -> (y, rstd)   rstd fp32 [...], not differentiable
    sparseffn::rms_norm_backward(dy, x, weight, rstd) -> (dx, dweight)
    sparseffn::rope(q, k, cos, sin, out_dtype) -> (q_out, k_out)   cos / sin get no gradient
    sparseffn::rope_backward(dq_out, dk_out, cos, sin, dtype) -> (dq, dk)

Paths. CUDA tensors of bf16 / fp16 / fp32 run the kernels; so do CPU tensors under
TRITON_INTERPRET=1 (how the tests run them). Anything else (CPU tensors without the interpreter,
fp64) runs an eager torch implementation of the same math with the same rounding points (fp32
compute; with fp64 inputs the norm's statistics stay fp32, as in Hugging Face's norm, and the rest
is fp64): it is a fallback for where the kernels cannot run, not an approximation. `rms_norm_reference` and `rope_reference` are
the eager truth the tests compare against (fp32, fp64 for fp64 inputs, no intermediate rounding).
"""

from __future__ import annotations

import functools
import numbers

import torch

from sparseffn.kernels._runtime import interpreting
from sparseffn.kernels.rms_norm import NORM_DTYPES, rms_norm_backward, rms_norm_forward
from sparseffn.kernels.rope import ROPE_DTYPES, empty_like_layout, rope_backward, rope_forward
from sparseffn.ops.checks import check_tensor


def _kernels_run(*tensors: torch.Tensor, dtypes) -> bool:
    """Whether the Triton kernels take these tensors (else the eager implementation does)."""
    return all(t.dtype in dtypes for t in tensors) and (tensors[0].is_cuda or interpreting())


# ----------------------------------------------------------------------------------------------------
# eager references (truth) and eager fallbacks (the kernels' own rounding points)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x², -1) + eps) in fp32 (fp64 if x or weight is fp64), unrounded: the
    truth, returned in the compute dtype. Differentiable."""
    ct = _compute_dtype(x, weight)
    xf = x.to(ct)
    return weight.to(ct) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x1, x2, c1, c2, s1, s2):
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (q, k) in fp32 (fp64 if any input is fp64), unrounded: the truth. q [B, Hq, S, d],
    k [B, Hk, S, d]; cos / sin [S, d] or [B or 1, S, d]. Differentiable."""
    ct = _compute_dtype(q, k, cos, sin)
    c1, c2 = _halves(cos.to(ct).unsqueeze(-3))  # [..., 1, S, d/2]: broadcast over heads
    s1, s2 = _halves(sin.to(ct).unsqueeze(-3))
    outs = []
    for x in (q, k):
        x1, x2 = _halves(x.to(ct))
        outs.append(torch.cat(_rotate(x1, x2, c1, c2, s1, s2), dim=-1))
    return outs[0], outs[1]


def _norm_dtype(x, weight, out_dtype):
    return torch.promote_types(weight.dtype, x.dtype) if out_dtype is None else out_dtype


def _rms_norm_eager(x, weight, eps, out_dtype):
    """(y, rstd) with the kernel's math and rounding points; x [..., D]."""
    xf = x.float().contiguous()  # contiguous outputs, as the kernels (and the fake) give
    rstd = 1.0 / torch.sqrt(xf.pow(2).mean(-1) + eps)  # correctly rounded sqrt and division, as the kernel
    n = (xf * rstd.unsqueeze(-1)).to(x.dtype)
    natural = torch.promote_types(weight.dtype, x.dtype)
    ct = torch.float64 if natural == torch.float64 else torch.float32  # the product is exact in ct
    return (weight.to(ct) * n.to(ct)).to(_norm_dtype(x, weight, out_dtype)), rstd


def _rms_norm_backward_eager(dy, x, weight, rstd):
    xf, dyf, r = x.float().contiguous(), dy.float().contiguous(), rstd.unsqueeze(-1)
    xhat = xf * r
    dyw = dyf * weight.float()
    dx = r * (dyw - xhat * (dyw * xhat).mean(-1, keepdim=True))
    dweight = (dyf * xhat.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dweight.to(weight.dtype)


def _rope_eager(q, k, cos, sin, out_dtype, backward):
    """The kernel's math (fp32, fp64 for fp64 inputs; one rounding to out_dtype) into tensors with
    q's / k's layouts."""
    ct = _compute_dtype(q, k, cos, sin)
    c1, c2 = _halves(cos.to(ct).unsqueeze(1))
    s1, s2 = _halves(sin.to(ct).unsqueeze(1))
    if backward:
        s1, s2 = -s2, -s1
    outs = []
    for x in (q, k):
        x1, x2 = _halves(x.to(ct))
        o1, o2 = _rotate(x1, x2, c1, c2, s1, s2)
        out = empty_like_layout(x, out_dtype)
        half = x.shape[-1] // 2
        out[..., :half] = o1
        out[..., half:] = o2
        outs.append(out)
    return outs[0], outs[1]


# ----------------------------------------------------------------------------------------------------
# custom ops


@torch.library.custom_op("sparseffn::rms_norm", mutates_args=())
def rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [..., D] in out_dtype (None: promote_types(weight, x)), rstd fp32 [...]) for x [..., D], weight [D]."""
    if not _kernels_run(x, weight, dtypes=NORM_DTYPES) or _norm_dtype(x, weight, out_dtype) not in NORM_DTYPES:
        return _rms_norm_eager(x, weight, eps, out_dtype)
    y, rstd = rms_norm_forward(x.reshape(-1, x.shape[-1]), weight, eps, out_dtype=out_dtype)
    return y.view(x.shape), rstd.view(x.shape[:-1])


@rms_norm_op.register_fake
def _(x, weight, eps, out_dtype):
    y = x.new_empty(x.shape, dtype=_norm_dtype(x, weight, out_dtype))
    return y, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("sparseffn::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [..., D] in x.dtype, dweight [D] in weight.dtype)."""
    if not _kernels_run(x, weight, dy, dtypes=NORM_DTYPES):
        return _rms_norm_backward_eager(dy, x, weight, rstd)
    d = x.shape[-1]
    dx, dweight = rms_norm_backward(dy.reshape(-1, d), x.reshape(-1, d), weight, rstd.reshape(-1))
    return dx.view(x.shape), dweight


@rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, _, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.mark_non_differentiable(rstd)


def _rms_norm_autograd(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_backward_op(dy, x, weight, rstd)
    return dx, dweight, None, None


rms_norm_op.register_autograd(_rms_norm_autograd, setup_context=_rms_norm_setup_context)


@torch.library.custom_op("sparseffn::rope", mutates_args=())
def rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out) in out_dtype (None: promote_types(q, cos, sin)) for q [B, Hq, S, d], k [B, Hk, S, d],
    cos / sin [B, S, d] (may be expanded)."""
    dtype = _rope_dtype(q, cos, sin, out_dtype)
    if not _kernels_run(q, k, cos, sin, dtypes=ROPE_DTYPES) or dtype not in ROPE_DTYPES:
        return _rope_eager(q, k, cos, sin, dtype, backward=False)
    return rope_forward(q, k, cos, sin, out_dtype=dtype)


@rope_op.register_fake
def _(q, k, cos, sin, out_dtype):
    dtype = _rope_dtype(q, cos, sin, out_dtype)
    return empty_like_layout(q, dtype), empty_like_layout(k, dtype)


@torch.library.custom_op("sparseffn::rope_backward", mutates_args=())
def rope_backward_op(
    dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk) in `dtype` (q's and k's), in dq_out's / dk_out's layouts."""
    if not _kernels_run(dq_out, dk_out, cos, sin, dtypes=ROPE_DTYPES) or dtype not in ROPE_DTYPES:
        return _rope_eager(dq_out, dk_out, cos, sin, dtype, backward=True)
    return rope_backward(dq_out, dk_out, cos, sin, dtype=dtype)


@rope_backward_op.register_fake
def _(dq_out, dk_out, cos, sin, dtype):
    return empty_like_layout(dq_out, dtype), empty_like_layout(dk_out, dtype)


def _rope_dtype(q, cos, sin, out_dtype=None):
    return torch.promote_types(q.dtype, torch.promote_types(cos.dtype, sin.dtype)) if out_dtype is None else out_dtype


def _rope_setup_context(ctx, inputs, output):
    q, _, cos, sin, _ = inputs
    ctx.save_for_backward(cos, sin)
    ctx.dtype = q.dtype


def _rope_autograd(ctx, dq_out, dk_out):
    cos, sin = ctx.saved_tensors
    dq, dk = rope_backward_op(dq_out, dk_out, cos, sin, ctx.dtype)
    return dq, dk, None, None, None


rope_op.register_autograd(_rope_autograd, setup_context=_rope_setup_context)


# ----------------------------------------------------------------------------------------------------
# public functions


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Hugging Face LlamaRMSNorm: weight * (x.float() * rstd).to(x.dtype), rstd = rsqrt(mean(x², -1) + eps).

    x [..., D] (the last dimension need not be contiguous: it is copied then), weight [D], eps a
    finite number >= 0. Returns [..., D] in `out_dtype`, by default torch.promote_types(weight.dtype,
    x.dtype) as Hugging Face's; another floating dtype rounds the result once to it (what a consumer
    that casts it would see). Differentiable in x and weight.
    """
    _check_out_dtype(out_dtype)
    check_tensor(x, "x")
    check_tensor(weight, "weight")
    if x.dim() < 1:
        raise ValueError("x must have shape [..., D], got a 0-D tensor")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight must have shape [D] = [{x.shape[-1]}], got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if x.shape[-1] == 0:
        raise ValueError("x must have D >= 1 columns, got D = 0")
    y, _ = rms_norm_op(x, weight, float(eps), out_dtype)
    return y


def _check_out_dtype(out_dtype) -> None:
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise TypeError(f"out_dtype must be a floating-point torch.dtype or None, got {out_dtype!r}")


def autocast_output_dtype(*inputs: torch.Tensor) -> torch.dtype | None:
    """The dtype a fused op over `inputs` returns under autocast: autocast's lower-precision dtype where
    its output would be fp32 (the inputs' promoted dtype, as rms_norm's and apply_rope's by default) and
    its consumers (projections, attention) cast it to that dtype anyway; None (the natural dtype)
    outside autocast or for other dtypes."""
    device = inputs[0].device.type
    natural = functools.reduce(torch.promote_types, (t.dtype for t in inputs))
    if natural != torch.float32 or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's `apply_rotary_pos_emb(q, k, cos, sin)` (unsqueeze_dim=1), fused.

    q [B, Hq, S, d], k [B, Hk, S, d] (any strides, typically transposed views of [B, S, H, d]);
    cos, sin [B or 1, S, d] or [S, d] (broadcast over the batch without a copy). Returns (q_out,
    k_out) in `out_dtype`, by default torch.promote_types(q.dtype, cos.dtype, sin.dtype) as Hugging
    Face's, laid out like q and k. Differentiable in q and k (their gradients in q's dtype); cos and
    sin get no gradient (an error if they require one).
    """
    _check_out_dtype(out_dtype)
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_tensor(t, name)
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D [B, H, S, d], got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    b, _, s, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d):
        raise ValueError(f"k must be [B, Hk, S, d] = [{b}, Hk, {s}, {d}] like q, got {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    if d % 2:
        raise ValueError(f"the head dim d must be even, got d = {d}")
    expanded = []
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() == 2:
            t = t.unsqueeze(0)
        if t.dim() != 3 or t.shape[0] not in (1, b) or tuple(t.shape[1:]) != (s, d):
            raise ValueError(f"{name} must be [B or 1, S, d] or [S, d] with B={b}, S={s}, d={d}, got {tuple(t.shape)}")
        if t.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError(f"{name} requires grad, but apply_rope gives cos and sin no gradient")
        expanded.append(t.expand(b, s, d))
    return rope_op(q, k, expanded[0], expanded[1], out_dtype)
