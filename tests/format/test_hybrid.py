import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseffn.format import Hybrid, UnitMajor
from sparseffn.format._common import bitwise_equal, canonical_zeros, nonzero_mask
from tests.format.strategies import activations


@settings(max_examples=120, deadline=None)
@given(h=activations(), width=st.integers(1, 64))
def test_round_trip_and_transpose_are_exact(h, width):
    hy = Hybrid.from_dense(h, width=width)
    hy.validate()
    assert bitwise_equal(hy.to_dense(), canonical_zeros(h))
    nnz = nonzero_mask(h).sum(1)
    assert torch.equal(hy.nnz_per_row(), nnz)
    heavy = [r for r in range(h.shape[0]) if int(nnz[r]) > width]
    assert hy.tail_rows.tolist() == heavy
    # The unit-major view is the transpose of the ELL rows; with the tail it is all of h^T.
    ell = h.clone()
    ell[heavy] = 0
    assert bitwise_equal(hy.unit_major.to_dense(), canonical_zeros(ell.t()))
    full = hy.unit_major.to_dense()
    full[:, hy.tail_rows] = hy.tail_values.t()
    assert bitwise_equal(full, canonical_zeros(h.t()))


def test_worked_example():
    h = torch.tensor([[0, 1.5, 0, 0, 0, 2.0, 0, 3.0], [4.0, 0.5, 0, 0.25, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 1.0]])
    hy = Hybrid.from_dense(h, width=2)
    assert hy.row_nnz.tolist() == [3, 3, 1]
    assert hy.tail_rows.tolist() == [0, 1]
    assert hy.columns[2].tolist()[:1] == [7]
    um = hy.unit_major
    assert um.offsets.tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 1]
    assert um.rows.tolist() == [2] and um.values.tolist() == [1.0]
    assert torch.equal(hy.to_dense(), h)


def test_unit_major_of_dense_matrix():
    h = torch.tensor([[1.0, 0, 2.0], [0, 3.0, 4.0]])
    um = UnitMajor.from_dense(h)
    um.validate()
    assert um.offsets.tolist() == [0, 1, 2, 4]
    assert um.rows.tolist() == [0, 1, 0, 1]
    assert um.values.tolist() == [1.0, 3.0, 2.0, 4.0]
    assert torch.equal(um.to_dense(), h.t())


def _hybrid():
    gen = torch.Generator().manual_seed(3)
    h = torch.rand(8, 30, generator=gen) * (torch.rand(8, 30, generator=gen) < 0.2)
    h[:, 2] = 0.5
    h[6] = 1.0  # heavy row
    hy = Hybrid.from_dense(h, width=10)
    assert hy.tail_rows.tolist() == [6]
    return hy


@pytest.mark.parametrize(
    "field, corruption, message",
    [
        ("row_nnz", lambda t: t.__setitem__(0, 31), "row_nnz"),
        ("columns", lambda t: t.__setitem__((0, 0), 30), "outside"),
        ("columns", lambda t: t.__setitem__((0, 1), t[0, 0]), "twice"),
        ("values", lambda t: t.__setitem__((0, 0), 0.0), "zero"),
        ("tail_rows", lambda t: t.__setitem__(0, 5), "tail_rows"),
        ("tail_values", lambda t: t.__setitem__((0, 0), 0.0), "tail_values"),
        ("values", lambda t: t.__setitem__((6, 0), 9.0), "tail row"),
    ],
)
def test_validate_catches_inconsistencies(field, corruption, message):
    hy = _hybrid()
    t = getattr(hy, field).clone()
    corruption(t)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(hy, **{field: t}).validate()


@pytest.mark.parametrize(
    "corruption, message",
    [
        (lambda um: dataclasses.replace(um, values=um.values * 2), "differs from the transpose"),
        (lambda um: dataclasses.replace(um, rows=um.rows.flip(0)), "ascending|differs"),
        (lambda um: dataclasses.replace(um, offsets=um.offsets.flip(0)), "offsets"),
        (lambda um: dataclasses.replace(um, rows=um.rows + 100), r"rows must lie in \[0, 8\)"),
    ],
)
def test_validate_catches_bad_unit_major(corruption, message):
    hy = _hybrid()
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(hy, unit_major=corruption(hy.unit_major)).validate()


@pytest.mark.parametrize(
    "width, error, message",
    [(0, ValueError, "width must be positive"), (-3, ValueError, "width must be positive"),
     (2.5, TypeError, "width must be an int")],
)
def test_from_dense_rejects_bad_width(width, error, message):
    with pytest.raises(error, match=message):
        Hybrid.from_dense(torch.zeros(2, 4), width=width)


def test_construction_checks_structure():
    hy = _hybrid()
    with pytest.raises(ValueError, match="columns must be torch.int32"):
        dataclasses.replace(hy, columns=hy.columns.to(torch.int64))
    with pytest.raises(ValueError, match="unit_major must be a UnitMajor"):
        dataclasses.replace(hy, unit_major=None)
    with pytest.raises(ValueError, match="row_nnz must have shape"):
        dataclasses.replace(hy, row_nnz=hy.row_nnz[:3])


def test_empty_inputs():
    for h in (torch.zeros(0, 5), torch.zeros(4, 0), torch.zeros(3, 9, dtype=torch.float16)):
        hy = Hybrid.from_dense(h, width=4)
        hy.validate()
        assert bitwise_equal(hy.to_dense(), h)
        assert "Hybrid(shape=" in repr(hy)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_round_trip_on_cuda():
    h = torch.rand(500, 3000, device="cuda")
    h = (h * (h > 0.97)).to(torch.bfloat16)
    h[11] = 2.0
    hy = Hybrid.from_dense(h)
    hy.validate()
    assert torch.equal(hy.to_dense(), h)
    assert torch.equal(hy.to("cpu").to_dense(), h.cpu())
