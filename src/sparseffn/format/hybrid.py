"""Hybrid: per-row ELL + dense tail of heavy rows + unit-major (transposed) view, for training.

Layout (docs/format.md has the full spec). For an activation h [M, H] and ELL width W:

    values      [M, W]   activation dtype   ELL values of each row
    columns     [M, W]   int32              global column of each value
    row_nnz     [M]      int32              TRUE non-zeros per row, may exceed W
    tail_rows   [R]      int64              ascending rows with row_nnz > W (every one of them)
    tail_values [R, H]   activation dtype   those rows, dense (authoritative)
    unit_major  UnitMajor                   CSR by unit of the non-tail rows: for each unit j,
                                            the tokens where it is active (weight gradients dW = d^T x)

ELL slots k < min(row_nnz, W) are valid (distinct columns, non-zero values, any order).
There is no tail capacity: the tail is exactly the heavy rows, so nothing is ever dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseffn.format._common import (
    SUPPORTED_DTYPES,
    bitwise_equal,
    canonical_zeros,
    check_activation,
    check_positive_int,
    nonzero_mask,
    row_chunks,
)


@dataclass(frozen=True, eq=False, repr=False)
class UnitMajor:
    """CSR over units: entries of unit j are `rows/values[offsets[j]:offsets[j + 1]]`.

    offsets [H + 1] int64, rows [E] int32 (token ids, ascending within a unit), values [E].
    """

    offsets: torch.Tensor
    rows: torch.Tensor
    values: torch.Tensor
    num_tokens: int

    @classmethod
    def from_dense(cls, h: torch.Tensor) -> "UnitMajor":
        """Unit-major view of every non-zero of `h` [M, H]."""
        m, n = h.shape
        unit, token = nonzero_mask(h).t().nonzero(as_tuple=True)  # sorted by unit, then token
        offsets = torch.zeros(n + 1, dtype=torch.int64, device=h.device)
        offsets[1:] = torch.bincount(unit, minlength=n).cumsum(0)
        return cls(offsets, token.to(torch.int32), h[token, unit], m)

    @property
    def num_units(self) -> int:
        return self.offsets.shape[0] - 1

    def to_dense(self) -> torch.Tensor:
        """Dense [H, M] (the transpose of the activation it came from)."""
        out = torch.zeros(self.num_units, self.num_tokens, dtype=self.values.dtype, device=self.values.device)
        unit = torch.repeat_interleave(
            torch.arange(self.num_units, device=self.offsets.device), self.offsets.diff()
        )
        out[unit, self.rows.long()] = self.values
        return out

    def validate(self) -> None:
        if self.offsets.dtype != torch.int64 or self.offsets.dim() != 1 or self.offsets.numel() < 1:
            raise ValueError("UnitMajor.offsets must be a non-empty 1-D int64 tensor")
        if self.rows.dtype != torch.int32 or self.rows.dim() != 1:
            raise ValueError("UnitMajor.rows must be a 1-D int32 tensor")
        if self.values.dtype not in SUPPORTED_DTYPES or self.values.shape != self.rows.shape:
            raise ValueError("UnitMajor.values must be a floating tensor shaped like rows")
        if int(self.offsets[0]) != 0 or int(self.offsets[-1]) != self.rows.numel():
            raise ValueError("UnitMajor.offsets must start at 0 and end at the number of entries")
        if bool((self.offsets.diff() < 0).any()):
            raise ValueError("UnitMajor.offsets must be non-decreasing")
        if bool(((self.rows < 0) | (self.rows >= self.num_tokens)).any()):
            raise ValueError(f"UnitMajor.rows must lie in [0, {self.num_tokens})")
        if not bool(nonzero_mask(self.values).all()):
            raise ValueError("UnitMajor.values must not hold zeros")
        # Tokens strictly ascending inside each unit (so no duplicates).
        same_unit = torch.ones(self.rows.numel(), dtype=torch.bool, device=self.rows.device)
        same_unit[self.offsets[1:-1][self.offsets[1:-1] < self.rows.numel()]] = False
        if bool((same_unit[1:] & (self.rows[1:] <= self.rows[:-1])).any()):
            raise ValueError("UnitMajor.rows must be strictly ascending inside each unit")


@dataclass(frozen=True, eq=False, repr=False)
class Hybrid:
    values: torch.Tensor
    columns: torch.Tensor
    row_nnz: torch.Tensor
    tail_rows: torch.Tensor
    tail_values: torch.Tensor
    unit_major: UnitMajor
    width: int

    def __post_init__(self) -> None:
        self._check_structure()

    @classmethod
    def from_dense(cls, h: torch.Tensor, width: int = 128) -> "Hybrid":
        """Pack `h` [M, H]; exact for every input. One host sync sizes the tail and the view."""
        check_activation(h)
        width = check_positive_int(width, "width")
        m, n = h.shape
        values = torch.zeros(m, width, dtype=h.dtype, device=h.device)
        columns = torch.zeros(m, width, dtype=torch.int32, device=h.device)
        row_nnz = torch.zeros(m, dtype=torch.int32, device=h.device)
        for start, stop in row_chunks(m, n):
            nonzero = nonzero_mask(h[start:stop])
            row_nnz[start:stop] = nonzero.sum(-1, dtype=torch.int32)
            slot = nonzero.cumsum(-1) - 1
            row, col = (nonzero & (slot < width)).nonzero(as_tuple=True)
            values[start + row, slot[row, col]] = h[start + row, col]
            columns[start + row, slot[row, col]] = col.to(torch.int32)
        tail_rows = (row_nnz > width).nonzero().flatten()
        ell_only = h.clone()
        ell_only[tail_rows] = 0
        return cls(values, columns, row_nnz, tail_rows, canonical_zeros(h[tail_rows]), UnitMajor.from_dense(ell_only), width)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.tail_values.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors())

    def nnz_per_row(self) -> torch.Tensor:
        return self.row_nnz.to(torch.int64)

    def valid_slots(self) -> torch.Tensor:
        k = torch.arange(self.width, device=self.device)
        return k < self.row_nnz.clamp(max=self.width).unsqueeze(-1)

    def to_dense(self) -> torch.Tensor:
        m, n = self.shape
        out = torch.zeros(m, n, dtype=self.dtype, device=self.device)
        row, k = self.valid_slots().nonzero(as_tuple=True)
        out[row, self.columns[row, k].long()] = self.values[row, k]
        out[self.tail_rows] = self.tail_values
        return out

    def to(self, device: torch.device | str) -> "Hybrid":
        um = self.unit_major
        view = UnitMajor(um.offsets.to(device), um.rows.to(device), um.values.to(device), um.num_tokens)
        return Hybrid(*(t.to(device) for t in self._tensors()[:5]), view, self.width)

    def validate(self) -> None:
        """Raise ValueError on any inconsistency between the fields (syncs with the device)."""
        self._check_structure()
        m, n = self.shape
        if bool((self.row_nnz < 0).any()) or bool((self.row_nnz > n).any()):
            raise ValueError(f"Hybrid.row_nnz must lie in [0, H={n}]")
        valid = self.valid_slots()
        if bool((valid & ((self.columns < 0) | (self.columns >= n))).any()):
            raise ValueError(f"Hybrid.columns: a valid slot holds a column outside [0, {n})")
        if bool((valid & ~nonzero_mask(self.values)).any()):
            raise ValueError("Hybrid.values: a valid slot holds a zero")
        k = torch.arange(self.width, device=self.device, dtype=torch.int32)
        keys = torch.where(valid, self.columns, n + k).sort(-1).values
        if bool((keys[:, 1:] == keys[:, :-1]).any()):
            raise ValueError("Hybrid.columns: a column appears twice in one row")
        expected_tail = (self.row_nnz > self.width).nonzero().flatten()
        if not torch.equal(self.tail_rows, expected_tail):
            raise ValueError("Hybrid.tail_rows must be exactly the ascending rows with row_nnz > width")
        tail_nnz = nonzero_mask(self.tail_values).sum(-1, dtype=torch.int32)
        if not torch.equal(tail_nnz, self.row_nnz[self.tail_rows]):
            raise ValueError("Hybrid.tail_values: non-zeros per row differ from row_nnz")
        i, k_ = valid[self.tail_rows].nonzero(as_tuple=True)
        stored = self.values[self.tail_rows][i, k_]
        if not bitwise_equal(stored, self.tail_values[i, self.columns[self.tail_rows][i, k_].long()]):
            raise ValueError("Hybrid.values: a slot of a tail row differs from its dense row")
        self.unit_major.validate()
        if self.unit_major.num_units != n or self.unit_major.num_tokens != m:
            raise ValueError(f"Hybrid.unit_major must be [H={n}, M={m}]")
        ell = self.to_dense()
        ell[self.tail_rows] = 0
        if not bitwise_equal(self.unit_major.to_dense(), ell.t()):
            raise ValueError("Hybrid.unit_major differs from the transpose of the ELL rows")

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        um = self.unit_major
        return (self.values, self.columns, self.row_nnz, self.tail_rows, self.tail_values,
                um.offsets, um.rows, um.values)

    def _check_structure(self) -> None:
        if not isinstance(self.unit_major, UnitMajor):
            raise ValueError(f"Hybrid.unit_major must be a UnitMajor, got {type(self.unit_major).__name__}")
        names = ("values", "columns", "row_nnz", "tail_rows", "tail_values",
                 "unit_major.offsets", "unit_major.rows", "unit_major.values")
        for name, t in zip(names, self._tensors()):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"Hybrid.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device != self.values.device:
                raise ValueError(f"Hybrid.{name} is on {t.device}, values on {self.values.device}")
        try:
            check_positive_int(self.width, "width")
        except (TypeError, ValueError) as err:
            raise ValueError(f"Hybrid: {err}") from None
        if self.values.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"Hybrid.values has unsupported dtype {self.values.dtype}")
        expected = {
            "columns": torch.int32,
            "row_nnz": torch.int32,
            "tail_rows": torch.int64,
            "tail_values": self.values.dtype,
        }
        for name, dtype in expected.items():
            if getattr(self, name).dtype != dtype:
                raise ValueError(f"Hybrid.{name} must be {dtype}, got {getattr(self, name).dtype}")
        if self.unit_major.values.dtype != self.values.dtype:
            raise ValueError("Hybrid.unit_major.values must have the activation dtype")
        if self.values.dim() != 2 or self.tail_values.dim() != 2 or self.tail_rows.dim() != 1:
            raise ValueError("Hybrid: values/tail_values must be 2-D and tail_rows 1-D")
        m = self.values.shape[0]
        shapes = {
            "values": (m, self.width),
            "columns": (m, self.width),
            "row_nnz": (m,),
            "tail_values": (self.tail_rows.shape[0], self.tail_values.shape[1]),
        }
        for name, shape in shapes.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"Hybrid.{name} must have shape {shape}, got {tuple(getattr(self, name).shape)}")

    def __repr__(self) -> str:
        m, n = self.shape
        return (
            f"Hybrid(shape=({m}, {n}), dtype={self.dtype}, width={self.width}, "
            f"tail_rows={self.tail_rows.numel()}, nbytes={self.nbytes}, device={self.device})"
        )
