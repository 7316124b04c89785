"""RMSNorm over the last dimension, forward and backward, one pass over the rows each.

Math (Hugging Face LlamaRMSNorm semantics), for x [M, D] and weight [D]:

    xf   = x in fp32
    rstd = 1 / sqrt(mean_j(xf²) + eps)                fp32 [M], saved for backward
    n    = (xf * rstd) rounded to x.dtype             as HF rounds before the weight product
    y    = weight * n                                 fp32 product rounded once to the out dtype:
                                                      torch.promote_types(weight.dtype, x.dtype) by default

rstd uses a correctly rounded sqrt and division (sqrt_rn, div_rn); given rstd, y equals HF's y bit
for bit, and rstd differs from HF's only by summation order and torch.rsqrt's rounding.
Backward, in fp32 from dy (y's dtype), x, weight and rstd (xhat = xf * rstd, dyw = dy * weight):

    dx      = rstd * (dyw - xhat * mean_j(dyw * xhat))      rounded to x.dtype
    dweight = Σ_rows dy * n                                  n rounded to x.dtype as in forward

dweight has no atomics: each backward program sums its rows' dy * n in fp32 registers into one row
of a [programs, D] fp32 buffer, which torch sums (`.sum(0)`) and rounds once to weight.dtype. The
rows a program visits depend only on the grid size: deterministic for a given device.

Layout and grid. A program holds BLOCK_M whole rows in registers (BLOCK_D = next power of two >= D,
masked); row offsets int64; x, dy, dx, y take a row stride (last dimension contiguous, else the
launchers copy). Forward: one program per block of rows. Backward: min(row blocks, SMs x
programs_per_sm) programs, program p taking blocks p, p + G, ...
Constraints: x [M, D], any M >= 0, 1 <= D <= MAX_D; x, dy, weight bf16, fp16 or fp32 in any mix; one
device (CUDA, or CPU under TRITON_INTERPRET=1). Compiled variants do not depend on M
(`do_not_specialize`); the block config is a function of D only.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from sparseffn.kernels._runtime import cdiv, check_capability, interpreting, next_power_of_2, num_sms
from sparseffn.kernels.configs.rms_norm import RMSNormConfig, default_config
from sparseffn.kernels.launch import Launcher

# dtypes x, weight and dy may have, and their names in Triton signatures
NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TL_NORM_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
MAX_D = 32768  # whole rows in registers: past 16384 the backward spills (still correct)


# ----------------------------------------------------------------------------------------------------
# kernels


@triton.jit(do_not_specialize=["M"])
def _rms_norm_forward_kernel(
    x_ptr,
    weight_ptr,
    y_ptr,
    rstd_ptr,
    M,
    D,
    stride_xm,
    stride_ym,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    row_in = rows < M
    col_in = cols < D
    mask = row_in[:, None] & col_in[None, :]  # [BLOCK_M, BLOCK_D]
    rows64 = rows.to(tl.int64)

    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)  # [BLOCK_M, BLOCK_D] fp32, zero past D
    mean_sq = tl.math.div_rn(tl.sum(xf * xf, axis=1), tl.full((BLOCK_M,), D, tl.float32))  # [BLOCK_M]
    rstd = tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), tl.sqrt_rn(mean_sq + eps))  # [BLOCK_M]
    # n in x's dtype, as HF rounds it before the weight product
    n = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty)  # [BLOCK_M, BLOCK_D]
    w = tl.load(weight_ptr + cols, mask=col_in, other=0.0).to(tl.float32)  # [BLOCK_D]
    y = w[None, :] * n.to(tl.float32)  # [BLOCK_M, BLOCK_D] fp32, exact before the one rounding
    tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_in)


_rms_norm_forward_launch = Launcher(_rms_norm_forward_kernel)


@triton.jit(do_not_specialize=["M"])
def _rms_norm_backward_kernel(
    dy_ptr,
    x_ptr,
    weight_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    M,
    D,
    stride_dym,
    stride_xm,
    stride_dxm,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    col_in = cols < D
    d_f = tl.full((BLOCK_M,), D, tl.float32)
    # [BLOCK_M, BLOCK_D] fp32 partial dweight, reduced over rows once at the end
    dw_acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for block in tl.range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        row_in = rows < M
        mask = row_in[:, None] & col_in[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_in, other=0.0)  # [BLOCK_M] fp32
        xhat = x.to(tl.float32) * rstd[:, None]  # [BLOCK_M, BLOCK_D] fp32, zero past D and M
        dw_acc += dy * xhat.to(x_ptr.dtype.element_ty).to(tl.float32)  # dy * n, n as forward rounded it
        # weight is read again every step (an L1 / L2 hit) rather than held across the loop: at
        # D = 16384 the registers go to dw_acc, xhat and dyw
        w = tl.load(weight_ptr + cols, mask=col_in, other=0.0).to(tl.float32)  # [BLOCK_D]
        dyw = dy * w[None, :]
        c = tl.math.div_rn(tl.sum(dyw * xhat, axis=1), d_f)  # [BLOCK_M] mean(dyw * xhat)
        dx = rstd[:, None] * (dyw - xhat * c[:, None])
        tl.store(dx_ptr + rows64[:, None] * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    dw = tl.sum(dw_acc, axis=0)  # [BLOCK_D] fp32
    tl.store(dw_partial_ptr + pid.to(tl.int64) * D + cols, dw, mask=col_in)


_rms_norm_backward_launch = Launcher(_rms_norm_backward_kernel)


# ----------------------------------------------------------------------------------------------------
# launchers


def _check_tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in NORM_DTYPES:
        raise TypeError(f"{name} must be torch.bfloat16, torch.float16 or torch.float32, got {t.dtype}")
    return t


def _check_x_weight(x, weight, config):
    _check_tensor(x, "x")
    _check_tensor(weight, "weight")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, D] (flatten the leading dimensions), got shape {tuple(x.shape)}")
    d = x.shape[1]
    if not 1 <= d <= MAX_D:
        raise ValueError(f"x must have 1 <= D <= {MAX_D} columns (whole rows in registers), got D = {d}")
    if tuple(weight.shape) != (d,):
        raise ValueError(f"weight must have shape [D] = [{d}], got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")
    if not x.is_cuda and not interpreting():
        raise ValueError(f"x must be a CUDA tensor (CPU tensors run only under TRITON_INTERPRET=1), got {x.device}")
    check_capability(x.device)
    if config is not None:
        if not isinstance(config, RMSNormConfig):
            raise TypeError(f"config must be None or an RMSNormConfig, got {type(config).__name__}")
        if config.block_m < 1 or config.block_m & (config.block_m - 1) or config.programs_per_sm < 1:
            raise ValueError(f"config.block_m must be a power of two and programs_per_sm >= 1, got {config}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dimension is contiguous (any row stride), else a contiguous copy."""
    return t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous()


def rms_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out_dtype: torch.dtype | None = None,
    config: RMSNormConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, D], rstd fp32 [M]) for x [M, D] (any row stride), weight [D]; module docstring.

    y is contiguous, of `out_dtype` (None: torch.promote_types(weight.dtype, x.dtype); another dtype
    rounds the fp32 product once to it). eps: a finite number >= 0.
    """
    _check_x_weight(x, weight, config)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if out_dtype is None:
        out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out_dtype not in NORM_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    m, d = x.shape
    x = _rows(x)
    weight = weight.contiguous()
    config = config or default_config(d, cuda=x.is_cuda)
    y = torch.empty((m, d), dtype=out_dtype, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return y, rstd
    grid = (cdiv(m, config.block_m),)
    _rms_norm_forward_launch[grid](
        x, weight, y, rstd,
        m, d,
        x.stride(0), y.stride(0),
        float(eps),
        BLOCK_M=config.block_m,
        BLOCK_D=next_power_of_2(d),
        num_warps=config.num_warps,
    )
    return y, rstd


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    *,
    config: RMSNormConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [M, D] in x.dtype, dweight [D] in weight.dtype) from dy [M, D] (y's gradient, any float
    dtype of the three, any row stride), the forward's x and weight, and its rstd fp32 [M]."""
    _check_x_weight(x, weight, config)
    _check_tensor(dy, "dy")
    m, d = x.shape
    if tuple(dy.shape) != (m, d):
        raise ValueError(f"dy must have x's shape {(m, d)}, got {tuple(dy.shape)}")
    if dy.device != x.device:
        raise ValueError(f"dy must be on x's device {x.device}, got {dy.device}")
    if not isinstance(rstd, torch.Tensor):
        raise TypeError(f"rstd must be a torch.Tensor, got {type(rstd).__name__}")
    if rstd.dtype != torch.float32 or tuple(rstd.shape) != (m,) or rstd.device != x.device:
        raise ValueError(
            f"rstd must be the forward's fp32 [M] = [{m}] tensor on {x.device}, "
            f"got {rstd.dtype} {tuple(rstd.shape)} on {rstd.device}"
        )
    x, dy = _rows(x), _rows(dy)
    weight, rstd = weight.contiguous(), rstd.contiguous()
    cuda = x.is_cuda
    config = config or default_config(d, cuda=cuda)
    dx = torch.empty((m, d), dtype=x.dtype, device=x.device)
    if m == 0:
        return dx, torch.zeros_like(weight)
    blocks = cdiv(m, config.block_m)
    programs = min(blocks, (num_sms(x.device) if cuda else 2) * config.programs_per_sm)
    dw_partial = torch.empty((programs, d), dtype=torch.float32, device=x.device)
    _rms_norm_backward_launch[(programs,)](
        dy, x, weight, rstd, dx, dw_partial,
        m, d,
        dy.stride(0), x.stride(0), dx.stride(0),
        BLOCK_M=config.block_m,
        BLOCK_D=next_power_of_2(d),
        num_warps=config.num_warps,
    )
    return dx, dw_partial.sum(0).to(weight.dtype)
