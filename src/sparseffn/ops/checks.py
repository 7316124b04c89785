"""Input checks shared by every public MLP op: clear errors naming the argument, expected and given.

`check_sparse_mlp_args` is the whole set for `sparse_mlp`, run before the mode is chosen, so auto,
dense and sparse accept and reject the same calls (tile and slots are checked even where the dense
path does not use them).
"""

from __future__ import annotations

import math
import numbers

import torch

from sparseffn.kernels.gate_twell import SUPPORTED_TILES
from sparseffn.ops.twell_mlp import SparseMLPWeights

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
            and (threshold is None or (type(threshold) is float and math.isfinite(threshold)))):
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
    """None, a finite number, or a float tensor of shape [] or [H] on `device` (a tensor's values
    are not read: that would wait for the device)."""
    if threshold is None:
        return
    if isinstance(threshold, numbers.Real) and not isinstance(threshold, bool):
        if not math.isfinite(threshold):
            raise ValueError(f"threshold must be a finite number, got {threshold}")
        return
    if not isinstance(threshold, torch.Tensor):
        raise TypeError(f"threshold must be None, a number or a tensor of shape [H], got {type(threshold).__name__}")
    check_tensor(threshold, "threshold")
    if threshold.dim() > 1 or (threshold.dim() == 1 and threshold.shape[0] != h):
        raise ValueError(f"threshold must have shape [] or [H] = [{h}], got {tuple(threshold.shape)}")
    if threshold.device != device:
        raise ValueError(f"threshold is on {threshold.device} but x is on {device}")


def check_sparse_mlp_args(
    x: torch.Tensor,
    gate_weight: torch.Tensor | None,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    threshold: torch.Tensor | float | None,
    *,
    return_l1: object,
    prepared: object,
    expected_nnz: object,
    tile: object,
    slots: object,
) -> tuple[int, int]:
    """Every argument check of `sparse_mlp`, whatever the mode; return (D, H)."""
    d, h = check_mlp_inputs(x, gate_weight, up_weight, down_weight, threshold)
    if not (type(tile) is int and tile in SUPPORTED_TILES and type(slots) is int and 1 <= slots <= tile):
        check_tile_slots(tile, slots)
    if expected_nnz is not None:
        check_expected_nnz(expected_nnz)
    if type(return_l1) is not bool:
        raise TypeError(f"return_l1 must be a bool, got {type(return_l1).__name__}")
    if prepared is not None:
        check_prepared(prepared, gate_weight, up_weight, down_weight)
    return d, h


def check_tile_slots(tile: object, slots: object) -> None:
    """TwELL capacity of the kernels: tile one of SUPPORTED_TILES, 1 <= slots <= tile."""
    for name, value in (("tile", tile), ("slots", slots)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if tile not in SUPPORTED_TILES:
        raise ValueError(f"tile must be one of {SUPPORTED_TILES} (the kernels' TwELL tile widths), got {tile}")
    if not 1 <= slots <= tile:
        raise ValueError(f"slots must satisfy 1 <= slots <= tile = {tile}, got {slots}")


def check_expected_nnz(expected_nnz: object) -> float:
    """A caller's estimate of non-zeros per token: a finite number >= 0."""
    if not isinstance(expected_nnz, numbers.Real) or isinstance(expected_nnz, bool):
        raise TypeError(f"expected_nnz must be None or a number, got {type(expected_nnz).__name__}")
    if not (math.isfinite(expected_nnz) and expected_nnz >= 0):
        raise ValueError(f"expected_nnz must be a finite number >= 0, got {expected_nnz}")
    return float(expected_nnz)


def check_prepared(prepared: object, gate_weight: torch.Tensor | None, up_weight: torch.Tensor,
                   down_weight: torch.Tensor) -> None:
    if not isinstance(prepared, SparseMLPWeights):
        raise TypeError(f"prepared must be None or a SparseMLPWeights (SparseMLPWeights.prepare builds it), "
                        f"got {type(prepared).__name__}")
    if not prepared.matches(gate_weight, up_weight, down_weight):
        raise ValueError("prepared was built from other weight tensors than gate_weight/up_weight/down_weight")
