import pytest
import torch

from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.ops.reference import mlp_activation_reference


@pytest.mark.parametrize("target", [8.0, 29.0, 110.0])
def test_hits_target_nnz_with_a_heavy_tail(target):
    mlp = synthetic_mlp(2000, 64, 1024, target, dtype=torch.float32, seed=1)
    p, _ = mlp_activation_reference(mlp.x, mlp.gate_weight, mlp.up_weight)
    nnz = (p > 0).sum(1).double()
    assert abs(nnz.mean().item() - target) <= 0.05 * target
    assert abs(mlp.calibrated_nnz - target) <= 0.01 * target
    assert mlp.heavy_rows.numel() == 10
    # Heavy tokens carry several times the mean (capped at half the units): the tail that
    # overflows fixed-capacity formats.
    heavy = min(5 * target, 0.4 * 1024)
    assert nnz[mlp.heavy_rows].mean() > heavy
    assert nnz.max() > heavy
    # Units differ in popularity (jittered thresholds).
    per_unit = (p > 0).sum(0).double()
    assert per_unit.max() > 3 * per_unit.mean()


def test_shapes_dtypes_and_determinism():
    a = synthetic_mlp(50, 32, 96, 10, dtype=torch.bfloat16, seed=3)
    b = synthetic_mlp(50, 32, 96, 10, dtype=torch.bfloat16, seed=3)
    assert a.x.shape == (50, 32) and a.gate_weight.shape == (96, 32) and a.down_weight.shape == (32, 96)
    assert a.x.dtype == torch.bfloat16
    assert all(torch.equal(s, t) for s, t in zip((a.x, a.gate_weight, a.up_weight), (b.x, b.gate_weight, b.up_weight)))
    assert torch.all(a.x[:, 0][~torch.isin(torch.arange(50), a.heavy_rows)] == 1)
    c = synthetic_mlp(50, 32, 96, 10, gated=False)
    assert c.gate_weight is None and c.first_weight is c.up_weight


@pytest.mark.parametrize(
    "args, message",
    [((0, 8, 8, 1), "m must be a positive int"), ((4, 1, 8, 1), "d must be >= 2"),
     ((4, 8, 8, 9), r"target_nnz must lie in \(0, h=8\]"), ((4, 8, 8, 0), "target_nnz")],
)
def test_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        synthetic_mlp(*args)
