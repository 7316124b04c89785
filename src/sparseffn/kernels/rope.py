"""Rotary position embedding (Llama convention) on q and k in one launch, forward and backward.

Math. For x [B, H, S, d] (q or k), cos and sin [B, S, d], halves x1 = x[..., :d/2], x2 = x[..., d/2:]
and likewise c1, c2, s1, s2 of cos and sin at the token's (b, s):

    forward:   out1 = x1 * c1 - x2 * s1          out2 = x2 * c2 + x1 * s2
    backward:  dx1  = g1 * c1 + g2 * s2          dx2  = g2 * c2 - g1 * s1     (g = d out)

The backward is the transpose of the forward's per-pair 2 x 2 map, i.e. the forward with (s1, s2)
replaced by (-s2, -s1). cos and sin are read at all d positions (nothing assumes c1 == c2). All in
fp32, rounded once to the output dtype: torch.promote_types(x.dtype, cos.dtype) by default, as Hugging
Face's `apply_rotary_pos_emb` gives (e.g. fp32 for bf16 q under autocast with fp32 cos), or the one
asked for (under autocast, the autocast dtype attention casts q and k to).

Layout. Any strides with a contiguous last dimension (the launchers copy otherwise): q and k are
usually the [B, H, S, d] transposed views of [B, S, H, d] projections, and cos / sin are often
broadcast over B (stride 0). Outputs get the inputs' memory layout (`empty_like_layout`: the
inputs' dimension order by stride, densely), so attention sees the strides Hugging Face's version
produces.

Grid. One program per (b, block of BLOCK_S tokens): it loads the four halves of cos / sin once
as [BLOCK_S, 1, BLOCK_HALF] fp32 tiles, then rotates all of q's heads (BLOCK_HQ at a time) and all
of k's (BLOCK_HK at a time) as [BLOCK_S, BLOCK_H, BLOCK_HALF] tiles, each half one load.
BLOCK_HALF = next power of two >= d / 2 (masked). Offsets are int64.

Constraints. q [B, Hq, S, d] and k [B, Hk, S, d] with one dtype, cos and sin [B, S, d]; d even;
dtypes bf16, fp16 or fp32 (cos and sin may differ from q); one device (CUDA, or CPU under
TRITON_INTERPRET=1). Compiled variants do not depend on B or S (`do_not_specialize`); the block
config is a function of (Hq, Hk, d).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import cdiv, check_capability, interpreting, next_power_of_2
from sparseffn.kernels.configs.rope import RopeConfig, default_config
from sparseffn.kernels.launch import Launcher

ROPE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TL_ROPE_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
MAX_HEAD_DIM = 1024


# ----------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, x_token, out_token, c1, c2, s1, s2, token_in,
    H, stride_xh, stride_oh,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Rotate the H heads of one tensor at the program's tokens. x_token / out_token [BLOCK_S, 1, 1]
    int64: offsets of the tokens' head 0; c1.. [BLOCK_S, 1, BLOCK_HALF] fp32."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, BLOCK_HALF)[None, None, :]  # [1, 1, BLOCK_HALF]
    for h0 in range(0, H, BLOCK_H):
        heads = (h0 + offs_h).to(tl.int64)[None, :, None]  # [1, BLOCK_H, 1]
        mask = token_in & (heads < H) & (offs_j < HALF)  # [BLOCK_S, BLOCK_H, BLOCK_HALF]
        x1_ptrs = x_ptr + x_token + heads * stride_xh + offs_j
        x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_H, BLOCK_HALF]
        x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
        o1_ptrs = out_ptr + out_token + heads * stride_oh + offs_j
        tl.store(o1_ptrs, o1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(o1_ptrs + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["B", "S"])
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    B,
    S,
    Hq,
    Hk,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_qob, stride_qoh, stride_qos,
    stride_kob, stride_koh, stride_kos,
    stride_cb, stride_cs,
    stride_sb, stride_ss,
    HALF: tl.constexpr,
    BACKWARD: tl.constexpr,  # apply the transposed rotation (gradients)
    BLOCK_S: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    pid = tl.program_id(0)
    s_blocks = tl.cdiv(S, BLOCK_S)
    b = (pid // s_blocks).to(tl.int64)
    tokens = (pid % s_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    token_in = (tokens < S)[:, None, None]  # [BLOCK_S, 1, 1]
    s = tokens.to(tl.int64)[:, None, None]
    offs_j = tl.arange(0, BLOCK_HALF)[None, None, :]  # [1, 1, BLOCK_HALF]
    cs_mask = token_in & (offs_j < HALF)

    cos_ptrs = cos_ptr + b * stride_cb + s * stride_cs + offs_j
    sin_ptrs = sin_ptr + b * stride_sb + s * stride_ss + offs_j
    c1 = tl.load(cos_ptrs, mask=cs_mask, other=0.0).to(tl.float32)  # [BLOCK_S, 1, BLOCK_HALF]
    c2 = tl.load(cos_ptrs + HALF, mask=cs_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptrs, mask=cs_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptrs + HALF, mask=cs_mask, other=0.0).to(tl.float32)
    if BACKWARD:
        s1, s2 = -s2, -s1

    _rotate_heads(q_ptr, q_out_ptr, b * stride_qb + s * stride_qs, b * stride_qob + s * stride_qos,
                  c1, c2, s1, s2, token_in, Hq, stride_qh, stride_qoh, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, b * stride_kb + s * stride_ks, b * stride_kob + s * stride_kos,
                  c1, c2, s1, s2, token_in, Hk, stride_kh, stride_koh, HALF, BLOCK_HK, BLOCK_HALF)


_rope_launch = Launcher(_rope_kernel)


# ----------------------------------------------------------------------------------------------------
# launchers


def empty_like_layout(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor of t's shape and `dtype` laid out densely in t's dimension order (by
    decreasing stride, ties in index order; the last dimension innermost): for a [B, H, S, d] view of
    [B, S, H, d] memory it is again such a view. Works on fake tensors too."""
    last = t.dim() - 1
    order = sorted(range(last), key=lambda i: -t.stride(i)) + [last]
    buffer = torch.empty([t.shape[i] for i in order], dtype=dtype, device=t.device)
    return buffer.permute([order.index(i) for i in range(t.dim())])


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _check_inputs(q, k, cos, sin, config, names=("q", "k")):
    qn, kn = names
    for name, t in ((qn, q), (kn, k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in ROPE_DTYPES:
            raise TypeError(f"{name} must be torch.bfloat16, torch.float16 or torch.float32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {qn}'s device {q.device}, got {t.device}")
    if q.dim() != 4:
        raise ValueError(f"{qn} must be 4-D [B, Hq, S, d], got shape {tuple(q.shape)}")
    b, _, s, d = q.shape
    if k.dim() != 4 or (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d):
        raise ValueError(f"{kn} must be [B, Hk, S, d] = [{b}, Hk, {s}, {d}] like {qn}, got {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"{kn} must have {qn}'s dtype {q.dtype}, got {k.dtype}")
    if d % 2 or not 2 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"the head dim d must be even and 2 <= d <= {MAX_HEAD_DIM}, got d = {d}")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (b, s, d):
            raise ValueError(f"{name} must be [B, S, d] = {[b, s, d]} (expand a broadcast batch), got {tuple(t.shape)}")
    if not q.is_cuda and not interpreting():
        raise ValueError(f"{qn} must be a CUDA tensor (CPU tensors run only under TRITON_INTERPRET=1), got {q.device}")
    check_capability(q.device)
    if config is not None and not isinstance(config, RopeConfig):
        raise TypeError(f"config must be None or a RopeConfig, got {type(config).__name__}")


def _launch(q, k, cos, sin, q_out, k_out, config, backward):
    b, hq, s, d = q.shape
    hk = k.shape[1]
    if q.numel() == 0 and k.numel() == 0:
        return
    config = config or default_config(hq, hk, d, cuda=q.is_cuda)
    grid = (b * cdiv(s, config.block_s),)
    _rope_launch[grid](
        q, k, cos, sin, q_out, k_out,
        b, s, hq, hk,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos.stride(0), cos.stride(1),
        sin.stride(0), sin.stride(1),
        HALF=d // 2,
        BACKWARD=backward,
        BLOCK_S=config.block_s,
        BLOCK_HQ=config.block_hq,
        BLOCK_HK=config.block_hk,
        BLOCK_HALF=next_power_of_2(d // 2),
        num_warps=config.num_warps,
    )


def rope_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    config: RopeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out): q [B, Hq, S, d] and k [B, Hk, S, d] rotated by cos / sin [B, S, d] (module
    docstring), in `out_dtype` (None: torch.promote_types(q.dtype, cos.dtype, sin.dtype)) and q's / k's
    memory layouts."""
    _check_inputs(q, k, cos, sin, config)
    if out_dtype is None:
        out_dtype = torch.promote_types(q.dtype, torch.promote_types(cos.dtype, sin.dtype))
    if out_dtype not in ROPE_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    q, k, cos, sin = map(_unit_last, (q, k, cos, sin))
    q_out, k_out = empty_like_layout(q, out_dtype), empty_like_layout(k, out_dtype)
    _launch(q, k, cos, sin, q_out, k_out, config, backward=False)
    return q_out, k_out


def rope_backward(
    dq_out: torch.Tensor,
    dk_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    config: RopeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk) from the outputs' gradients (shapes as q / k), the forward's cos / sin: the
    transposed rotation, in `dtype` (q's; None = dq_out's dtype) and dq_out's / dk_out's layouts."""
    _check_inputs(dq_out, dk_out, cos, sin, config, names=("dq_out", "dk_out"))
    if dtype is None:
        dtype = dq_out.dtype
    if dtype not in ROPE_DTYPES:
        raise TypeError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    dq_out, dk_out, cos, sin = map(_unit_last, (dq_out, dk_out, cos, sin))
    dq, dk = empty_like_layout(dq_out, dtype), empty_like_layout(dk_out, dtype)
    _launch(dq_out, dk_out, cos, sin, dq, dk, config, backward=True)
    return dq, dk
