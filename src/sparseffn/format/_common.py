"""Helpers shared by the packed formats: argument checks, non-zero masks, bit-level equality."""

from __future__ import annotations

import torch

# Same-width integer views for bit-level comparisons (NaN payloads included).
_SAME_WIDTH_INT = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}

SUPPORTED_DTYPES = tuple(_SAME_WIDTH_INT)


def nonzero_mask(t: torch.Tensor) -> torch.Tensor:
    """Elements a packed format stores: everything that is not == 0, so NaN and ±inf are kept.

    -0.0 is a zero (an activation `relu(g) * u` produces it wherever u < 0): it is not stored and
    comes back as +0.0, which `torch.equal` treats as equal.
    """
    return t != 0


def canonical_zeros(t: torch.Tensor) -> torch.Tensor:
    """`t` with -0.0 replaced by +0.0: what a round trip through a packed format returns, bit for bit."""
    return torch.where(t == 0, torch.zeros((), dtype=t.dtype, device=t.device), t)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when shapes, dtypes and every bit agree (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.view(_SAME_WIDTH_INT[a.dtype]), b.view(_SAME_WIDTH_INT[b.dtype]))


def check_activation(h: object, name: str = "h") -> torch.Tensor:
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(h).__name__}")
    if h.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, H], got shape {tuple(h.shape)}")
    if h.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} must have a floating dtype in {[str(d) for d in SUPPORTED_DTYPES]}, got {h.dtype}"
        )
    return h


def check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def row_chunks(num_rows: int, row_elems: int, budget: int = 1 << 24):
    """Row ranges whose temporaries stay near `budget` elements (bounds eager-conversion memory)."""
    step = max(1, budget // max(row_elems, 1))
    for start in range(0, num_rows, step):
        yield start, min(start + step, num_rows)
