"""Auto mode's rules (ops/decide.py) as a pure function of a call's facts: every GPU generation,
every kind of call, density limits and their hysteresis, explained decisions."""

import dataclasses

import pytest
import torch

from sparseffn.kernels._runtime import COMPILE_TARGETS
from sparseffn.ops.decide import (AUTO_MIN_TOKENS, AUTO_MIN_TOKENS_TRAIN, DECODE_MAX_TOKENS, HYSTERESIS, CallFacts,
                                  ModeDecision, decide, decode_union_limit, density_limit, expected_union,
                                  overflow_gemm_rows)
from sparseffn.ops.overflow_rows import gemm_capacity

H200 = CallFacts(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, d=2048, h=5632, tokens=16384,
                 training=False, down_t_ready=True, traced=True)


def facts(**changes) -> CallFacts:
    return dataclasses.replace(H200, **changes)


def test_every_kind_of_call_on_the_h200():
    assert decide(facts()).mode == "sparse" and "TwELL" in decide(facts()).reason
    assert decide(facts(tokens=AUTO_MIN_TOKENS - 1)).mode == "dense"
    decode = decide(facts(tokens=1))
    assert decode.mode == "sparse" and "decode" in decode.reason
    assert decide(facts(tokens=DECODE_MAX_TOKENS)).mode == "sparse"
    assert decide(facts(tokens=DECODE_MAX_TOKENS + 1)).mode == "dense"
    assert "copy" in decide(facts(tokens=1, down_t_ready=False)).reason
    assert "eager" in decide(facts(tokens=1, traced=False)).reason  # host-bound: dense is faster
    assert decide(facts(tokens=1, traced=False)).mode == "dense"
    assert decide(facts(training=True, tokens=AUTO_MIN_TOKENS_TRAIN)).mode == "sparse"
    assert decide(facts(training=True, tokens=AUTO_MIN_TOKENS_TRAIN // 2)).mode == "dense"
    assert decide(facts(training=True, tokens=1)).mode == "dense"  # the decode kernels are inference only
    assert "too narrow" in decide(facts(d=1024)).reason


@pytest.mark.parametrize("cap", sorted(COMPILE_TARGETS) + [(7, 5), (7, 0)])
def test_each_gpu_generation(cap):
    """Auto goes sparse only where the kernels were measured (9.0); older than 8.0 nothing runs and
    mode='sparse' says so, naming the capability; elsewhere mode='sparse' runs the compiled kernels."""
    f = facts(capability=cap)
    auto = decide(f)
    if cap < (8, 0):
        assert auto.mode == "dense" and f"{cap[0]}.{cap[1]}" in auto.reason
        with pytest.raises(NotImplementedError, match=rf"compute capability {cap[0]}\.{cap[1]}"):
            decide(f, "sparse")
    elif cap == (9, 0):
        assert auto.mode == "sparse"
    else:
        assert auto.mode == "dense" and "measured only on 9.0" in auto.reason
        assert decide(f, "sparse") == ModeDecision("sparse", "requested")


def test_density_limits_and_hysteresis():
    for kind in (facts(), facts(tokens=16), facts(tokens=1), facts(training=True)):
        limit = density_limit(kind)
        assert 0 < limit <= kind.h
        assert decide(kind, expected_nnz=limit).mode == "sparse"
        assert decide(kind, expected_nnz=limit * 1.01).mode == "dense"
        # a layer that ran dense re-enters only under HYSTERESIS x the limit
        between = limit * (1 + HYSTERESIS) / 2
        assert decide(kind, expected_nnz=between, previous="sparse").mode == "sparse"
        dense = decide(kind, expected_nnz=between, previous="dense")
        assert dense.mode == "dense" and "hysteresis" in dense.reason
        assert decide(kind, expected_nnz=limit * HYSTERESIS * 0.99, previous="dense").mode == "sparse"
    # the dense-ish start of a training run (~half of H active) runs dense
    assert decide(facts(training=True), expected_nnz=2800).mode == "dense"
    assert density_limit(facts(h=1000)) < density_limit(facts())  # small H breaks even at lower counts
    # decode: the expected union of the tokens' units must stay under 30% of H for 1-2 tokens, 20% up
    # to 16 (one 16-row tile), 13% beyond
    assert density_limit(facts(tokens=1)) > density_limit(facts(tokens=16)) > density_limit(facts(tokens=64))
    assert density_limit(facts(tokens=1)) == pytest.approx(0.30 * 5632)
    for tokens, fraction in ((2, 0.30), (3, 0.20), (16, 0.20), (17, 0.13), (64, 0.13)):
        assert decode_union_limit(tokens) == fraction
        n = density_limit(facts(tokens=tokens))
        assert expected_union(n, tokens, 5632) == pytest.approx(fraction * 5632)


def test_expected_union():
    assert expected_union(30, 1, 5632) == pytest.approx(30)
    assert expected_union(0, 16, 5632) == 0 and expected_union(5632, 4, 5632) == 5632
    assert expected_union(9000, 4, 5632) == 5632 and expected_union(10, 0, 5632) == 0
    # the synthetic benchmark's measured unions (decode_mlp.csv; its units fire with unequal rates, so
    # they overlap more than independent ones): from 2% over to 12% under the formula
    for nnz, tokens, measured in ((29.25, 4, 117), (28.94, 16, 443), (29.06, 64, 1478), (110.19, 16, 1438),
                                  (109.95, 64, 3642)):
        assert 0.98 * measured <= expected_union(nnz, tokens, 5632) <= 1.12 * measured


# (D, H, tokens, active units per token, speed-up measured, path auto must take). decode_mlp.csv
# (isolated calls, CUDA graphs, L2 flushed) and whole-model steps (decode_model.csv: calibrated 2b at 29
# per token; the SparseLM2B-shaped fixture at ~106, docs/checkpoints.md)
MEASURED_DECODE = [
    (2048, 5632, 1, 30, "2.10x", "sparse"),
    (2048, 5632, 1, 110, "2.03x", "sparse"),
    (2048, 5632, 1, 105.6, "1.24x whole step (fixture)", "sparse"),
    (2048, 5632, 4, 29.25, "1.60x", "sparse"),
    (2048, 5632, 4, 111, "1.56x", "sparse"),
    (2048, 5632, 16, 28.94, "1.54x; 1.15x whole step", "sparse"),
    (2048, 5632, 16, 105.6, "0.94x whole step (fixture)", "dense"),
    (2048, 5632, 16, 110.19, "1.32x isolated, a union of 26% (the fixture lost there)", "dense"),
    (2048, 5632, 64, 29.06, "1.02x; 1.00x whole step", "dense"),
    (2048, 5632, 64, 109.95, "0.79x", "dense"),
    (4096, 14336, 16, 110, "1.48x", "sparse"),
    (4096, 14336, 64, 29, "1.18x", "sparse"),
    (4096, 14336, 64, 110, "1.04x", "dense"),
]


@pytest.mark.parametrize("d, h, tokens, nnz, measured, path", MEASURED_DECODE)
def test_decode_rule_at_the_measured_points(d, h, tokens, nnz, measured, path):
    decision = decide(facts(d=d, h=h, tokens=tokens), expected_nnz=nnz)
    assert decision.mode == path, (measured, decision.reason)
    if path == "dense" and tokens > 1:
        assert f"over {tokens} tokens" in decision.reason and "% of H" in decision.reason


def test_decode_rule_follows_the_batch():
    """One layer's activity, growing batches: sparse while the union is small, dense once it is not,
    never back to sparse at a larger batch."""
    for nnz in (5, 29, 106, 180):
        paths = [decide(facts(tokens=b), expected_nnz=nnz).mode for b in range(1, DECODE_MAX_TOKENS + 1)]
        assert paths[0] == "sparse"
        if "dense" in paths:
            assert "sparse" not in paths[paths.index("dense"):], nnz


@pytest.mark.parametrize("nnz, path", [(15, "sparse"), (29, "sparse"), (55, "sparse"), (80, "dense"),
                                       (110, "dense"), (160, "dense")])
def test_training_at_the_measured_points(nnz, path):
    """bench mlp --train at D=2048/H=5632, 16384 tokens (H200): faster than dense up to ~55 active units
    per token (1.15x at 55 with the overflow GEMMs), slower from 80 on (0.73x at 110 without overflow rows)."""
    assert decide(facts(training=True), expected_nnz=nnz).mode == path


def test_overflow_gemm_rows_follow_the_expected_activity():
    # the synthetic tail overflows 32 slots of 256 from ~30 units per token (none at 29, 81 rows at 55)
    assert overflow_gemm_rows(16384, 5632, 29, 256, 32) == 0
    assert overflow_gemm_rows(16384, 5632, 55, 256, 32) == gemm_capacity(16384) == 128
    assert overflow_gemm_rows(16384, 5632, None, 256, 32) == 0  # no estimate: the low-activity path
    assert overflow_gemm_rows(16384, 5632, 29, 256, 64) == 0 < overflow_gemm_rows(16384, 5632, 29, 256, 16)
    assert [gemm_capacity(m) for m in (0, 1, 37, 4096, 65536)] == [0, 1, 37, 64, 512]


def test_requests_and_blockers():
    assert decide(facts(), "dense") == ModeDecision("dense", "requested")
    with pytest.raises(ValueError, match="mode must be one of"):
        decide(facts(), "fast")
    with pytest.raises(NotImplementedError, match="float32"):
        decide(facts(dtype=torch.float32), "sparse")
    with pytest.raises(NotImplementedError, match="D % 8 == 0"):
        decide(facts(training=True, d=2044), "sparse")
    cpu = facts(device_type="cpu", capability=(0, 0))
    with pytest.raises(NotImplementedError, match="CUDA device"):
        decide(cpu, "sparse")
    assert decide(dataclasses.replace(cpu, interpreted=True), "sparse").mode == "sparse"
    assert "never interprets" in decide(dataclasses.replace(cpu, interpreted=True)).reason
