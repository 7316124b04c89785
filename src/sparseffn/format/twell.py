"""TwELL: tile-wise ELLPACK with an exact dense backup for rows that overflow.

Layout (docs/format.md has the bit-level spec and a worked example). For an activation h [M, H]:

    n_tiles = ceil(H / tile)
    values   [M, n_tiles, slots]  activation dtype   stored non-zeros of each (row, tile)
    columns  [M, n_tiles, slots]  int16              column inside the tile, 0 <= c < tile width
    counts   [M, n_tiles]         int32              TRUE non-zeros of the (row, tile), may exceed slots
    overflow_rows   [R]           int64              ascending rows where some count > slots
    overflow_values [R, H]        activation dtype   those rows, dense (authoritative)

Slots k < min(count, slots) are valid (distinct columns, non-zero values, any order); the
others are unspecified. Tile-local int16 indices cap `tile` at 32768 but leave H unbounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparseffn.format._common import (
    SUPPORTED_DTYPES,
    bitwise_equal,
    canonical_zeros,
    check_activation,
    check_positive_int,
    nonzero_mask,
    row_chunks,
)

MAX_TILE = 1 << 15  # tile-local columns are int16


def check_tile_slots(tile: object, slots: object) -> tuple[int, int]:
    tile = check_positive_int(tile, "tile")
    slots = check_positive_int(slots, "slots")
    if tile > MAX_TILE:
        raise ValueError(f"tile must be <= {MAX_TILE} (int16 tile-local columns), got {tile}")
    if slots > tile:
        raise ValueError(f"slots must be <= tile ({tile}), got {slots}")
    return tile, slots


def num_tiles(num_columns: int, tile: int) -> int:
    return -(-num_columns // tile)


@dataclass(frozen=True, eq=False, repr=False)
class TwELL:
    values: torch.Tensor
    columns: torch.Tensor
    counts: torch.Tensor
    overflow_rows: torch.Tensor
    overflow_values: torch.Tensor
    num_columns: int
    tile: int
    slots: int

    def __post_init__(self) -> None:
        # Structure only (no device sync): kernels build TwELL values on the hot path.
        self._check_structure()

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_dense(cls, h: torch.Tensor, tile: int = 256, slots: int = 32) -> "TwELL":
        """Pack `h` [M, H]; exact for every input (the eager reference of the packing kernels)."""
        check_activation(h)
        tile, slots = check_tile_slots(tile, slots)
        m, n = h.shape
        tiles = num_tiles(n, tile)
        values = torch.zeros(m, tiles, slots, dtype=h.dtype, device=h.device)
        columns = torch.zeros(m, tiles, slots, dtype=torch.int16, device=h.device)
        counts = torch.zeros(m, tiles, dtype=torch.int32, device=h.device)
        for start, stop in row_chunks(m, tiles * tile):
            chunk = F.pad(h[start:stop], (0, tiles * tile - n)).view(stop - start, tiles, tile)
            nonzero = nonzero_mask(chunk)
            counts[start:stop] = nonzero.sum(-1, dtype=torch.int32)
            slot = nonzero.cumsum(-1) - 1  # ascending columns fill slots 0, 1, ...
            row, t, col = (nonzero & (slot < slots)).nonzero(as_tuple=True)
            k = slot[row, t, col]
            values[start + row, t, k] = chunk[row, t, col]
            columns[start + row, t, k] = col.to(torch.int16)
        overflow_rows = (counts > slots).any(1).nonzero().flatten()
        return cls(values, columns, counts, overflow_rows, canonical_zeros(h[overflow_rows]), n, tile, slots)

    # ----------------------------------------------------------------------------- properties
    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.num_columns)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def num_tiles(self) -> int:
        return self.values.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held by every tensor of the value, dense backup included."""
        return sum(t.nbytes for t in self._tensors())

    def nnz_per_row(self) -> torch.Tensor:
        """Exact non-zeros per row (int64 [M]); counts are true counts, overflow rows included."""
        return self.counts.sum(1, dtype=torch.int64)

    def valid_slots(self) -> torch.Tensor:
        """Bool [M, n_tiles, slots]: which slots hold entries (k < min(count, slots))."""
        k = torch.arange(self.slots, device=self.device)
        return k < self.counts.clamp(max=self.slots).unsqueeze(-1)

    # ----------------------------------------------------------------------------- conversion
    def to_dense(self) -> torch.Tensor:
        m, n = self.shape
        out = torch.zeros(m, self.num_tiles * self.tile, dtype=self.dtype, device=self.device)
        row, t, k = self.valid_slots().nonzero(as_tuple=True)
        out[row, t * self.tile + self.columns[row, t, k].long()] = self.values[row, t, k]
        out = out[:, :n].contiguous()
        out[self.overflow_rows] = self.overflow_values
        return out

    def to(self, device: torch.device | str) -> "TwELL":
        return TwELL(*(t.to(device) for t in self._tensors()), self.num_columns, self.tile, self.slots)

    # ----------------------------------------------------------------------------- checks
    def validate(self) -> None:
        """Raise ValueError on any inconsistency between the fields (syncs with the device)."""
        self._check_structure()
        m, n = self.shape
        widths = (n - torch.arange(self.num_tiles, device=self.device) * self.tile).clamp(max=self.tile)
        if bool((self.counts < 0).any()) or bool((self.counts > widths).any()):
            raise ValueError("TwELL.counts: every count must lie in [0, width of its tile]")
        valid = self.valid_slots()
        cols = self.columns.to(torch.int32)
        if bool((valid & ((cols < 0) | (cols >= widths[:, None]))).any()):
            raise ValueError("TwELL.columns: a valid slot holds a column outside its tile")
        if bool((valid & ~nonzero_mask(self.values)).any()):
            raise ValueError("TwELL.values: a valid slot holds a zero (counts would be wrong)")
        # Distinct columns inside each (row, tile): give invalid slots distinct out-of-range keys.
        k = torch.arange(self.slots, device=self.device, dtype=torch.int32)
        keys = torch.where(valid, cols, self.tile + k).sort(-1).values
        if bool((keys[..., 1:] == keys[..., :-1]).any()):
            raise ValueError("TwELL.columns: a column appears twice in one (row, tile)")
        expected_rows = (self.counts > self.slots).any(1).nonzero().flatten()
        if not torch.equal(self.overflow_rows, expected_rows):
            raise ValueError(
                "TwELL.overflow_rows must be exactly the ascending rows with a count > slots "
                f"({expected_rows.numel()} such rows, {self.overflow_rows.numel()} recorded)"
            )
        self._check_overflow_rows(valid)

    def _check_overflow_rows(self, valid: torch.Tensor) -> None:
        dense = self.overflow_values
        tiles = self.num_tiles * self.tile
        padded = F.pad(dense, (0, tiles - self.num_columns)).view(dense.shape[0], self.num_tiles, self.tile)
        if not torch.equal(nonzero_mask(padded).sum(-1, dtype=torch.int32), self.counts[self.overflow_rows]):
            raise ValueError("TwELL.overflow_values: per-tile non-zeros differ from counts")
        row_valid = valid[self.overflow_rows]
        i, t, k = row_valid.nonzero(as_tuple=True)
        stored = self.values[self.overflow_rows][i, t, k]
        dense_at = padded[i, t, self.columns[self.overflow_rows][i, t, k].long()]
        if not bitwise_equal(stored, dense_at):
            raise ValueError("TwELL.values: a slot of an overflow row differs from its dense row")

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.values, self.columns, self.counts, self.overflow_rows, self.overflow_values)

    def _check_structure(self) -> None:
        names = ("values", "columns", "counts", "overflow_rows", "overflow_values")
        for name, t in zip(names, self._tensors()):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"TwELL.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device != self.values.device:
                raise ValueError(f"TwELL.{name} is on {t.device}, values on {self.values.device}")
        if isinstance(self.num_columns, bool) or not isinstance(self.num_columns, int) or self.num_columns < 0:
            raise ValueError(f"TwELL.num_columns must be a non-negative int, got {self.num_columns!r}")
        try:
            check_tile_slots(self.tile, self.slots)
        except (TypeError, ValueError) as err:
            raise ValueError(f"TwELL: {err}") from None
        if self.values.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"TwELL.values has unsupported dtype {self.values.dtype}")
        expected = {
            "columns": torch.int16,
            "counts": torch.int32,
            "overflow_rows": torch.int64,
            "overflow_values": self.values.dtype,
        }
        for name, dtype in expected.items():
            if getattr(self, name).dtype != dtype:
                raise ValueError(f"TwELL.{name} must be {dtype}, got {getattr(self, name).dtype}")
        m = self.values.shape[0] if self.values.dim() == 3 else -1
        tiles = num_tiles(self.num_columns, self.tile)
        r = self.overflow_rows.shape[0] if self.overflow_rows.dim() == 1 else -1
        shapes = {
            "values": (m, tiles, self.slots),
            "columns": (m, tiles, self.slots),
            "counts": (m, tiles),
            "overflow_rows": (r,),
            "overflow_values": (r, self.num_columns),
        }
        for name, shape in shapes.items():
            if tuple(getattr(self, name).shape) != shape or -1 in shape:
                raise ValueError(
                    f"TwELL.{name} must have shape {shape} (M, n_tiles={tiles}, slots={self.slots}, "
                    f"H={self.num_columns}), got {tuple(getattr(self, name).shape)}"
                )

    def __repr__(self) -> str:
        m, n = self.shape
        return (
            f"TwELL(shape=({m}, {n}), dtype={self.dtype}, tile={self.tile}, slots={self.slots}, "
            f"overflow_rows={self.overflow_rows.numel()}, nbytes={self.nbytes}, device={self.device})"
        )
