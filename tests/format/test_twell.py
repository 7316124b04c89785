import dataclasses

import pytest
import torch
from hypothesis import given, settings

from sparseffn.format import TwELL
from sparseffn.format._common import bitwise_equal, canonical_zeros, nonzero_mask
from tests.format.strategies import activations, tile_and_slots


def _bits(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFF for v in t.view(torch.int16).flatten().tolist()]


def test_worked_example_of_docs_bit_for_bit():
    h = torch.tensor([[0, 1.5, 0, 0, 0, 2.0, 0, 3.0], [4.0, 0.5, 0, 0.25, 0, 0, 0, 0]], dtype=torch.bfloat16)
    t = TwELL.from_dense(h, tile=4, slots=2)
    assert _bits(t.values) == [0x3FC0, 0, 0x4000, 0x4040, 0x4080, 0x3F00, 0, 0]
    assert t.columns.flatten().tolist() == [1, 0, 1, 3, 0, 1, 0, 0]
    assert t.counts.tolist() == [[1, 2], [3, 0]]
    assert t.overflow_rows.tolist() == [1]
    assert bitwise_equal(t.overflow_values, h[1:])
    assert t.nnz_per_row().tolist() == [3, 3]
    assert torch.equal(t.to_dense(), h)
    t.validate()


def _independent_counts(h: torch.Tensor, tile: int) -> torch.Tensor:
    nz = nonzero_mask(h)
    m, n = h.shape
    return torch.tensor(
        [[int(nz[r, s : s + tile].sum()) for s in range(0, n, tile)] for r in range(m)], dtype=torch.int32
    ).reshape(m, -(-n // tile))


@settings(max_examples=120, deadline=None)
@given(h=activations(), ts=tile_and_slots())
def test_round_trip_is_bit_exact(h, ts):
    tile, slots = ts
    t = TwELL.from_dense(h, tile=tile, slots=slots)
    t.validate()
    dense = t.to_dense()
    assert torch.equal(dense.nan_to_num(7.0), h.nan_to_num(7.0))
    assert bitwise_equal(dense, canonical_zeros(h))
    counts = _independent_counts(h, tile)
    assert torch.equal(t.counts, counts)
    assert torch.equal(t.nnz_per_row(), nonzero_mask(h).sum(1))
    expected_overflow = [r for r in range(h.shape[0]) if bool((counts[r] > slots).any())]
    assert t.overflow_rows.tolist() == expected_overflow
    assert t.nbytes == sum(x.nbytes for x in (t.values, t.columns, t.counts, t.overflow_rows, t.overflow_values))


def test_signed_zeros_are_zeros_and_nan_inf_are_kept():
    # relu(g) * u is -0.0 wherever the gate is off and u < 0: those must not be stored.
    g = torch.tensor([[-1.0, 2.0, -3.0, 0.5, -0.5, 1.0]])
    u = torch.tensor([[-2.0, -1.0, -1.0, 2.0, 3.0, float("nan")]])
    h = torch.relu(g) * u
    assert bool(torch.signbit(h[0, 0]))  # a real -0.0
    t = TwELL.from_dense(h, tile=4, slots=2)
    assert t.counts.tolist() == [[2, 1]]
    dense = t.to_dense()
    assert torch.equal(dense.nan_to_num(9.0), h.nan_to_num(9.0))
    assert not bool(torch.signbit(dense[0, 0]))
    assert dense[0, 5].isnan()
    inf = TwELL.from_dense(torch.tensor([[float("inf"), 0.0, -float("inf")]]), tile=2, slots=1)
    assert inf.counts.tolist() == [[1, 1]] and inf.to_dense().isinf().sum() == 2


def _kernel_like(t: TwELL, seed: int = 0) -> TwELL:
    """Same content as a kernel could write it: valid slots permuted, garbage in unused slots."""
    gen = torch.Generator().manual_seed(seed)
    valid = t.valid_slots()
    perm = torch.argsort(torch.rand(t.values.shape, generator=gen) + (~valid) * 2.0, dim=-1)
    values = torch.gather(t.values, -1, perm)
    columns = torch.gather(t.columns, -1, perm)
    values[~valid] = float("nan")
    columns[~valid] = -12345
    return dataclasses.replace(t, values=values, columns=columns)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_arbitrary_slot_order_and_garbage_in_unused_slots(dtype):
    gen = torch.Generator().manual_seed(1)
    h = (torch.rand(40, 700, generator=gen) * (torch.rand(40, 700, generator=gen) < 0.03)).to(dtype)
    h[3] = 1.0  # a dense row: overflows
    t = _kernel_like(TwELL.from_dense(h, tile=256, slots=32))
    t.validate()
    assert torch.equal(t.to_dense(), h)
    assert t.overflow_rows.tolist() == [3]


def _packed(h=None):
    gen = torch.Generator().manual_seed(2)
    if h is None:
        h = (torch.rand(6, 20, generator=gen) * (torch.rand(6, 20, generator=gen) < 0.25)).to(torch.float32)
        h[:, 0] = 0.5  # every row has a non-zero in tile 0 ...
        h[5, :8] = 1.0  # ... and row 5 overflows it at slots=4
    t = TwELL.from_dense(h, tile=8, slots=4)
    assert t.overflow_rows.tolist() == [5]
    return t


def _corrupt(field, fn):
    t = _packed()
    tensor = getattr(t, field).clone()
    fn(tensor, t)
    return dataclasses.replace(t, **{field: tensor})


@pytest.mark.parametrize(
    "field, corruption, message",
    [
        ("counts", lambda c, t: c.__setitem__((0, 0), c[0, 0] + 1), "counts|zero|differ|overflow"),
        ("counts", lambda c, t: c.__setitem__((0, 2), 5), "counts"),  # last tile is 4 wide
        ("counts", lambda c, t: c.__setitem__((1, 1), -1), "counts"),
        ("columns", lambda c, t: c.__setitem__((5, 1, 0), 9), "outside"),
        ("values", lambda c, t: c.__setitem__((5, 0, 0), 0.0), "zero"),
        ("overflow_rows", lambda c, t: c.__setitem__(0, 4), "overflow_rows"),
        ("overflow_values", lambda c, t: c.__setitem__((0, 0), 0.0), "overflow_values|differs"),
        ("overflow_values", lambda c, t: c.__setitem__((0, 1), 7.0), "overflow_values|differs"),
    ],
)
def test_validate_catches_inconsistencies(field, corruption, message):
    t = _corrupt(field, corruption)
    with pytest.raises(ValueError, match=message):
        t.validate()


def test_validate_catches_duplicate_columns():
    h = torch.zeros(1, 8)
    h[0, 1] = h[0, 2] = 1.0
    t = TwELL.from_dense(h, tile=8, slots=4)
    columns = t.columns.clone()
    columns[0, 0, 1] = columns[0, 0, 0]
    with pytest.raises(ValueError, match="twice"):
        dataclasses.replace(t, columns=columns).validate()


def test_validate_catches_overflow_slot_mismatch():
    t = _packed()
    values = t.values.clone()
    values[5, 0, 0] = 3.0  # the dense backup says 1.0
    with pytest.raises(ValueError, match="overflow row"):
        dataclasses.replace(t, values=values).validate()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(columns=torch.zeros(6, 3, 4, dtype=torch.int32)), "columns must be torch.int16"),
        (dict(counts=torch.zeros(6, 2, dtype=torch.int32)), "counts must have shape"),
        (dict(values=torch.zeros(6, 3, 4, dtype=torch.int32)), "unsupported dtype"),
        (dict(overflow_rows=torch.zeros(1, dtype=torch.int32)), "overflow_rows must be torch.int64"),
        (dict(slots=9), "slots must be <= tile"),
        (dict(tile=0), "tile must be positive"),
        (dict(num_columns=-1), "num_columns"),
        (dict(counts=[1, 2]), "counts must be a torch.Tensor"),
    ],
)
def test_construction_checks_structure(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(_packed(), **change)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(tile=0), ValueError, "tile must be positive"),
        (dict(tile=-4), ValueError, "tile must be positive"),
        (dict(slots=0), ValueError, "slots must be positive"),
        (dict(tile=8, slots=9), ValueError, r"slots must be <= tile \(8\), got 9"),
        (dict(tile=1 << 16), ValueError, "tile must be <= 32768"),
        (dict(tile=2.0), TypeError, "tile must be an int, got float"),
        (dict(slots=True), TypeError, "slots must be an int, got bool"),
    ],
)
def test_from_dense_rejects_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        TwELL.from_dense(torch.zeros(2, 8), **kwargs)


@pytest.mark.parametrize(
    "h, error, message",
    [
        (torch.zeros(8), ValueError, r"h must be 2-D \[M, H\], got shape \(8,\)"),
        (torch.zeros(2, 3, 4), ValueError, "h must be 2-D"),
        (torch.zeros(2, 8, dtype=torch.int32), TypeError, "floating dtype"),
        ([[1.0]], TypeError, "h must be a torch.Tensor, got list"),
    ],
)
def test_from_dense_rejects_bad_activation(h, error, message):
    with pytest.raises(error, match=message):
        TwELL.from_dense(h)


def test_empty_and_all_zero_inputs():
    for h in (torch.zeros(0, 300), torch.zeros(5, 0), torch.zeros(0, 0), torch.zeros(7, 513, dtype=torch.bfloat16)):
        t = TwELL.from_dense(h)
        t.validate()
        assert bitwise_equal(t.to_dense(), h)
        assert t.overflow_rows.numel() == 0
        assert int(t.nnz_per_row().sum()) == 0


def test_large_tile_uses_local_columns_beyond_int16_global_range():
    h = torch.zeros(2, 70000)
    h[0, 69999] = 2.0
    h[1, 40000] = 3.0
    t = TwELL.from_dense(h, tile=32768, slots=4)
    t.validate()
    assert torch.equal(t.to_dense(), h)
    assert t.columns[0, 2, 0] == 69999 - 2 * 32768


def test_to_device_keeps_content():
    t = _packed()
    moved = t.to("cpu")
    assert torch.equal(moved.to_dense(), t.to_dense())
    assert "TwELL(shape=(6, 20)" in repr(t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_round_trip_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.rand(300, 5000, device="cuda", generator=gen)
    h = (h * (h > 0.98)).to(torch.bfloat16)
    h[7] = 1.0
    t = TwELL.from_dense(h)
    t.validate()
    assert t.device.type == "cuda"
    assert torch.equal(t.to_dense(), h)
    assert torch.equal(t.to("cpu").to_dense(), h.cpu())
