"""Hypothesis strategies for sparse activations: any shape, density, dtype, with heavy rows."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@st.composite
def activations(draw, max_rows: int = 24, max_cols: int = 300) -> torch.Tensor:
    """A ReLU-like activation: random density per row, some all-zero and some all-dense rows,
    and occasionally signed zeros, NaN and infinities (which must survive packing bit for bit)."""
    m = draw(st.integers(0, max_rows))
    n = draw(st.integers(0, max_cols))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    density = torch.rand(m, 1, generator=gen) ** draw(st.sampled_from([0.5, 1.0, 3.0]))
    kind = torch.randint(0, 8, (m, 1), generator=gen)
    density = torch.where(kind == 0, 0.0, torch.where(kind == 1, 1.0, density))
    mask = torch.rand(m, n, generator=gen) < density
    h = (torch.rand(m, n, generator=gen) + 0.01).to(dtype) * mask
    if draw(st.booleans()) and h.numel():
        special = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), -1.5], dtype=dtype)
        idx = torch.randint(0, h.numel(), (min(5, h.numel()),), generator=gen)
        h.view(-1)[idx] = special[: idx.numel()]
    return h


@st.composite
def tile_and_slots(draw) -> tuple[int, int]:
    tile = draw(st.sampled_from([1, 3, 8, 32, 64, 256]))
    slots = draw(st.integers(1, tile))
    return tile, slots
