"""`decode_mlp_block`: a decoder layer's second half at decode, x + MLP(RMSNorm(x)), in two launches.

    y = x + down(act(n gate^T - θ) ⊙ (n up^T)),   n = RMSNorm(x; norm_weight, eps)   (gated)
    y = x + down(act(n up^T - θ))                                                    (gate_weight None)

Paths (the caller decides which; ops/decide.py is where auto mode decides):
- sparse=True: the exact sparse decode kernels (kernels/decode_mlp.py), relu only, with the norm fused
  into K1 and the residual into K2's write; the down weight must be stored transposed ([H, D] rows).
  fold_into (one token): K1 alone, its programs with an active unit adding that unit's down row into
  fold_into (fp32 [1, D], atomic adds in no fixed order: the last bits of the sum may differ from run
  to run); the residual add is left to the next layer's decode_qkv_rope / decode_out_proj (`pending`).
- sparse=False: the dense MLP, act "relu" or "silu", rounded as torch's dense MLP: K1 with every unit,
  then the down projection (decode_mlp's K2 over every unit for a transposed down weight,
  kernels/decode_dense_mlp.py's row products for Hugging Face's [D, H] layout).
Inputs: x [M, D] (1 <= M <= 64, unit stride along D), bf16 / fp16 (fp32 runs exactly, for references);
gate/up [H, D] and norm_weight [D] in x's dtype; down_weight [D, H] as nn.Linear holds it; threshold
fp32 [H] or None.

`decode_norm(x, norm_weight, eps, *, pending=None)`: the step's last RMSNorm (the model's final norm), one
launch (kernels/decode_norm.py); with pending (fp32 [M, D], the last folded MLP's sum) it normalizes
round(x + round(pending)) and zeroes pending, as the next layer's launches would have.
"""

from __future__ import annotations

import torch

from sparseffn.kernels._runtime import check_capability, interpreting
from sparseffn.kernels.decode_dense_mlp import launch_dense_mlp_rows_down
from sparseffn.kernels.decode_mlp import MAX_TOKENS, launch_decode_mlp
from sparseffn.kernels.decode_norm import launch_decode_norm
from sparseffn.ops.twell_mlp import stored_transposed

ACTS = ("relu", "silu")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def decode_mlp_block(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor | None,
                     up_weight: torch.Tensor, down_weight: torch.Tensor, threshold: torch.Tensor | None = None, *,
                     act: str = "relu", sparse: bool = False, fold_into: torch.Tensor | None = None) -> torch.Tensor:
    """[M, D] = x + MLP(RMSNorm(x)); with fold_into, fold_into += MLP(RMSNorm(x)) in fp32, returned
    (module docstring)."""
    _check(x, norm_weight, eps, gate_weight, up_weight, down_weight, threshold, act, sparse)
    first = gate_weight if gate_weight is not None else up_weight
    up = up_weight if gate_weight is not None else None
    if fold_into is not None:
        _check_fold(fold_into, x, sparse)
        return launch_decode_mlp(x, first, up, down_weight.t(), threshold, norm_weight=norm_weight, eps=eps,
                                 fold_into=fold_into)
    if sparse:
        return launch_decode_mlp(x, first, up, down_weight.t(), threshold, norm_weight=norm_weight, eps=eps,
                                 residual=True)
    if stored_transposed(down_weight):
        return launch_decode_mlp(x, first, up, down_weight.t(), threshold, norm_weight=norm_weight, eps=eps,
                                 residual=True, act=act)
    return launch_dense_mlp_rows_down(x, first, up, down_weight, threshold, act=act, norm_weight=norm_weight,
                                      eps=eps, residual=True)


def decode_norm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, *,
                pending: torch.Tensor | None = None) -> torch.Tensor:
    """[M, D] = RMSNorm(x) (Hugging Face's rounding), of round(x + round(pending)) with pending, which is then
    zeroed (module docstring)."""
    _check_x(x)
    if not isinstance(norm_weight, torch.Tensor) or tuple(norm_weight.shape) != (x.shape[1],):
        raise ValueError(f"norm_weight must be a tensor of shape [{x.shape[1]}], got {getattr(norm_weight, 'shape', norm_weight)}")
    if norm_weight.dtype != x.dtype or norm_weight.device != x.device:
        raise ValueError(f"norm_weight must be {x.dtype} on {x.device} like x, got {norm_weight.dtype} on "
                         f"{norm_weight.device}")
    _check_eps(eps)
    if pending is not None:
        _check_fp32_like(pending, x, "pending")
    return launch_decode_norm(x, norm_weight, eps, pending)


def _check_fold(fold_into, x, sparse) -> None:
    if not sparse or x.shape[0] != 1:
        raise ValueError(f"fold_into is for sparse=True at one token, got sparse={sparse} and {x.shape[0]} tokens")
    _check_fp32_like(fold_into, x, "fold_into")


def _check_fp32_like(t, x, name: str) -> None:
    if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != tuple(x.shape)
            or t.device != x.device or (x.shape[1] > 1 and t.stride(1) != 1)):
        raise ValueError(f"{name} must be an fp32 tensor {list(x.shape)} on {x.device} with unit stride along D, "
                         f"got {getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}")


def _check_x(x) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not 1 <= x.shape[0] <= MAX_TOKENS:
        raise ValueError(f"x must be a tensor [M, D] with 1 <= M <= {MAX_TOKENS}, got {getattr(x, 'shape', x)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must have unit stride along D, got strides {tuple(x.stride())}")
    if not x.is_cuda and not interpreting():
        raise ValueError(f"x must be a CUDA tensor (CPU tensors run only under TRITON_INTERPRET=1), got {x.device}")
    check_capability(x.device)


def _check_eps(eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")


def _check(x, norm_weight, eps, gate_weight, up_weight, down_weight, threshold, act, sparse) -> None:
    _check_x(x)
    m, d = x.shape
    h = up_weight.shape[0]
    shapes = {"norm_weight": (norm_weight, (d,)), "up_weight": (up_weight, (h, d)),
              "gate_weight": (gate_weight, (h, d)), "down_weight": (down_weight, (d, h))}
    for name, (w, shape) in shapes.items():
        if w is None and name == "gate_weight":
            continue
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != shape:
            raise ValueError(f"{name} must be a tensor of shape {list(shape)}, got {getattr(w, 'shape', w)}")
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"{name} must be {x.dtype} on {x.device} like x, got {w.dtype} on {w.device}")
    for name, w in (("up_weight", up_weight), ("gate_weight", gate_weight)):
        if w is not None and d > 1 and w.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along D, got strides {tuple(w.stride())}")
    if not (stored_transposed(down_weight) or down_weight.stride(1) == 1 or h <= 1):
        raise ValueError(f"down_weight must be contiguous or stored transposed, got strides {tuple(down_weight.stride())}")
    if threshold is not None and (not isinstance(threshold, torch.Tensor) or threshold.dtype != torch.float32
                                  or tuple(threshold.shape) != (h,) or threshold.device != x.device):
        raise ValueError(f"threshold must be None or an fp32 tensor [H] = [{h}] on {x.device}")
    _check_eps(eps)
    if act not in ACTS:
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")
    if threshold is not None and act != "relu":
        raise ValueError(f"a threshold needs act='relu' (relu(g - θ)), got act={act!r}")
    if sparse and act != "relu":
        raise ValueError(f"sparse=True computes relu MLPs only, got act={act!r}")
    if sparse and not stored_transposed(down_weight) and h > 1:
        raise ValueError("sparse=True reads down_weight's transpose as [H, D] rows: store it transposed "
                         "(SparseMLP does) or use sparse=False")
