"""Input checks shared by every public MLP op: clear errors naming the argument, expected and given."""

from __future__ import annotations

import numbers

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# tensor types taken as they are (exactly these: subclasses such as FakeTensor or DTensor are not)
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def check_tensor(t: object, name: str, *, dims: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be floating point ({', '.join(map(str, FLOAT_DTYPES))}), got {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    return t


def check_mlp_inputs(
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    threshold: torch.Tensor | float | None,
) -> tuple[int, int]:
    """Validate a (gated or non-gated) MLP call in Hugging Face layouts; return (D, H).

    x [..., D]; gate_weight, up_weight [H, D]; down_weight [D, H]; threshold None, a number, or a
    tensor of shape [] or [H]. All tensors share x's dtype (threshold may be any float dtype) and device.
    """
    if _well_formed(x, gate_weight, up_weight, down_weight, threshold):
        return x.shape[-1], up_weight.shape[0]
    check_tensor(x, "x")
    if x.dim() < 1:
        raise ValueError("x must have shape [..., D], got a 0-D tensor")
    d = x.shape[-1]
    check_tensor(up_weight, "up_weight", dims=2)
    h = up_weight.shape[0]
    weights = {"up_weight": up_weight, "down_weight": down_weight}
    if gate_weight is not None:
        weights["gate_weight"] = check_tensor(gate_weight, "gate_weight", dims=2)
    check_tensor(down_weight, "down_weight", dims=2)
    for name, w in weights.items():
        if w.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {w.dtype} but x has {x.dtype}; cast them to one dtype")
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device} but x is on {x.device}")
    if up_weight.shape[1] != d:
        raise ValueError(f"up_weight must be [H, D] with D = x.shape[-1] = {d}, got {tuple(up_weight.shape)}")
    if gate_weight is not None and gate_weight.shape != up_weight.shape:
        raise ValueError(
            f"gate_weight must have up_weight's shape {tuple(up_weight.shape)}, got {tuple(gate_weight.shape)}"
        )
    if tuple(down_weight.shape) != (d, h):
        hint = " (it looks transposed: pass down_proj.weight, which is [D, H])" if down_weight.shape == (h, d) else ""
        raise ValueError(f"down_weight must be [D, H] = [{d}, {h}], got {tuple(down_weight.shape)}{hint}")
    check_threshold(threshold, h, x.device)
    return d, h


def _well_formed(x, gate_weight, up_weight, down_weight, threshold) -> bool:
    """The common valid call, tested with few attribute reads (about half the host time of the
    detailed checks). Every public MLP call runs the checks, and auto mode's dense route at small M
    is host-bound, so their time adds to the call; the detailed checks only run to name what is
    wrong. Plain tensors only: subclasses take the detailed path."""
    plain = PLAIN_TENSOR_TYPES
    if not (type(x) in plain and type(up_weight) in plain and type(down_weight) in plain
            and (gate_weight is None or type(gate_weight) in plain)
            and (threshold is None or type(threshold) is float)):
        return False
    dtype, device = x.dtype, x.device
    up_shape = up_weight.shape
    return (
        dtype in FLOAT_DTYPES
        and len(up_shape) == 2
        and up_weight.dtype is dtype and down_weight.dtype is dtype
        and (gate_weight is None or (gate_weight.dtype is dtype and gate_weight.shape == up_shape
                                     and gate_weight.device == device))
        and x.dim() >= 1 and x.shape[-1] == up_shape[1]
        and down_weight.shape == (up_shape[1], up_shape[0])
        and up_weight.device == device and down_weight.device == device
    )


def check_threshold(threshold: object, h: int, device: torch.device) -> None:
    if threshold is None or (isinstance(threshold, numbers.Real) and not isinstance(threshold, bool)):
        return
    if not isinstance(threshold, torch.Tensor):
        raise TypeError(f"threshold must be None, a number or a tensor of shape [H], got {type(threshold).__name__}")
    check_tensor(threshold, "threshold")
    if threshold.dim() > 1 or (threshold.dim() == 1 and threshold.shape[0] != h):
        raise ValueError(f"threshold must have shape [] or [H] = [{h}], got {tuple(threshold.shape)}")
    if threshold.device != device:
        raise ValueError(f"threshold is on {threshold.device} but x is on {device}")
