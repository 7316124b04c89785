import math

import pytest

from sparseffn.train.schedule import WarmupCosine, l1_coeff_at


def test_l1_coefficient_ramps_linearly_then_holds():
    assert l1_coeff_at(0, 2e-3, 4) == pytest.approx(0.5e-3)
    assert l1_coeff_at(1, 2e-3, 4) == pytest.approx(1.0e-3)
    assert l1_coeff_at(3, 2e-3, 4) == pytest.approx(2e-3)
    assert l1_coeff_at(100, 2e-3, 4) == 2e-3
    assert l1_coeff_at(0, 2e-3, 0) == 2e-3
    values = [l1_coeff_at(s, 1.0, 10) for s in range(12)]
    assert all(b > a for a, b in zip(values[:10], values[1:10]))


def test_warmup_cosine():
    f = WarmupCosine(lr=1e-3, min_lr=1e-4, warmup_steps=10, total_steps=110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) * 1e-3 == pytest.approx(0.5 * (1e-3 + 1e-4))
    assert f(110) * 1e-3 == pytest.approx(1e-4) and f(500) * 1e-3 == pytest.approx(1e-4)
    after = [f(s) for s in range(10, 111)]
    assert all(b <= a for a, b in zip(after, after[1:]))
    assert WarmupCosine(0.0, 0.0, 0, 10)(3) == 0.0
    assert not math.isnan(WarmupCosine(1e-3, 1e-3, 0, 0)(0))


def test_l1_coefficient_sine_ramp_is_prosparse_shape():
    T, coeff = 8, 3e-2
    for step in range(T):
        assert l1_coeff_at(step, coeff, T, "sine") == pytest.approx(coeff * math.sin(math.pi / 2 * (step + 1) / T))
    assert l1_coeff_at(T - 1, coeff, T, "sine") == pytest.approx(coeff)
    assert l1_coeff_at(50, coeff, T, "sine") == coeff
    # below the linear ramp nowhere, and strictly above it inside the ramp (sin x > 2x/π on (0, π/2))
    assert all(l1_coeff_at(s, coeff, T, "sine") > l1_coeff_at(s, coeff, T) for s in range(T - 1))
    assert l1_coeff_at(0, coeff, T, "linear") == l1_coeff_at(0, coeff, T)
    with pytest.raises(ValueError, match="must be one of"):
        l1_coeff_at(0, coeff, T, "cosine")
