"""decode_mlp (few-token sparse MLP) against the fp32 reference, under the flash-attention rule.

Runs natively on a GPU and under the interpreter on CPU (tests/conftest.py); problems are built on
the CPU. Shapes cover M = 1, 2, 3, 16, 64 (CUDA-core and tl.dot paths, every padded bucket), D and H that are not block multiples,
all-zero and all-active rows, thresholds, gated and non-gated, one and several steps in every loop.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparseffn.kernels.decode_mlp import MAX_TOKENS, decode_mlp, m_pad
from sparseffn.kernels.configs.decode_mlp import DecodeConfig
from tests.kernels.compile_specs.decode_mlp import compile_specs
from sparseffn.ops.reference import mlp_activation_reference, sparse_mlp_reference

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU = torch.cuda.is_available()
# the interpreter is slow: small blocks where they add loop steps that matter
SMALL = DecodeConfig(block_h=16, block_k=64, block_s=16, block_d=32, prefix=64)  # several steps in every loop
LARGE = DecodeConfig(block_h=32, block_k=128, block_s=32, block_d=64)
SPLIT = DecodeConfig(block_h=16, block_k=64, block_s=16, block_d=32, prefix=64, split=3)  # spans summed at the end
STREAM = DecodeConfig(block_h=8, block_k=32, block_s=16, block_d=32, prefix=64, stream=True)  # 3 steps at D = 80
STREAM_ONE = dataclasses.replace(STREAM, block_k=128)  # the whole row in one tile
# 3+ tokens: the up pass over each block's active units gathered 16 at a time, in steps of up_k columns
COMPACT = DecodeConfig(block_h=32, block_k=64, block_s=16, block_d=32, prefix=64, compact_up=True, up_k=32)


def _problem(m, d, h, *, gated=True, dtype=torch.bfloat16, active=0.1, seed=0, threshold=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g).to(dtype)
    first = torch.randn(h, d, generator=g) / d**0.5
    # shift each unit's pre-activation so about `active` of the units fire, some rows all-off / all-on
    first_b = first.to(dtype)
    pre = x.float() @ first_b.float().t()
    if active <= 0:
        cut = pre.max() + 1
    elif active >= 1:
        cut = pre.min() - 0.5
    else:
        cut = torch.quantile(pre.flatten(), 1 - active)
    theta = torch.full((h,), float(cut))
    if threshold:
        theta += 0.05 * torch.randn(h, generator=g)
    up = (torch.randn(h, d, generator=g) / d**0.5).to(dtype)
    down = (torch.randn(d, h, generator=g) / h**0.5).to(dtype)
    return x, (first_b if gated else None), up, down, theta


def _run(x, gate, up, down, theta, config=None):
    first = gate if gate is not None else up
    args = [t.to(DEVICE) for t in (x, first, down.t().contiguous())]
    y = decode_mlp(args[0], args[1], up.to(DEVICE) if gate is not None else None, args[2],
                   theta.to(DEVICE) if theta is not None else None, config=config)
    return y.cpu()


def _check(y, x, gate, up, down, theta):
    ref = sparse_mlp_reference(x.double(), None if gate is None else gate.double(), up.double(), down.double(),
                               theta.double()).float()
    # dense torch in the same dtype (its own rounding), as the floor of the rule
    first = torch.nn.functional.linear(x, gate if gate is not None else up)
    hh = torch.relu(first - theta.to(x.dtype))
    if gate is not None:
        hh = hh * torch.nn.functional.linear(x, up)
    dense = torch.nn.functional.linear(hh, down).float()
    err = (y.float() - ref).abs()
    torch_err = (dense - ref).abs().max().item()
    assert torch.isfinite(y).all()
    # the interpreter truncates fp32 -> 16-bit casts: one ulp of p and of h per active unit, biased
    slack = 0.0
    if not GPU:
        _, h_ref = mlp_activation_reference(x.double(), None if gate is None else gate.double(), up.double(),
                                            theta.double())
        ulp = torch.finfo(x.dtype).eps
        slack = 2 * ulp * (h_ref.abs() @ down.double().abs().t()).float()
    assert (err <= 2 * torch_err + slack + 1e-6).all(), (err.max().item(), torch_err)


@pytest.mark.parametrize("m", [1, 2, 3, 16, 64])
@pytest.mark.parametrize("gated", [True, False])
def test_matches_reference(m, gated):
    x, gate, up, down, theta = _problem(m, 80, 200, gated=gated, active=0.08, seed=m)
    _check(_run(x, gate, up, down, theta, SMALL), x, gate, up, down, theta)
    if gated:
        y = _run(x, gate, up, down, theta, SPLIT)
        _check(y, x, gate, up, down, theta)
        assert torch.equal(y, _run(x, gate, up, down, theta, SPLIT))  # spans summed in span order


@pytest.mark.parametrize("stream", [STREAM, STREAM_ONE], ids=["steps", "one_step"])
@pytest.mark.parametrize("gated", [True, False])
def test_streamed_one_token_matches_reference_and_repeats_bitwise(gated, stream):
    x, gate, up, down, theta = _problem(1, 80, 200, gated=gated, active=0.08, seed=11, threshold=True)
    y = _run(x, gate, up, down, theta, stream)
    _check(y, x, gate, up, down, theta)
    assert torch.equal(y, _run(x, gate, up, down, theta, stream))
    plain = _run(x, gate, up, down, theta, SMALL)  # the same units active; fp32 sums in another order
    assert (y.float() - plain.float()).abs().max() <= 2 * torch.finfo(x.dtype).eps * plain.float().abs().max()


@pytest.mark.parametrize("stream", [STREAM, STREAM_ONE], ids=["steps", "one_step"])
@pytest.mark.parametrize("gated", [True, False])
def test_streamed_with_prefetch_gives_the_same_bits(gated, stream):
    """config.prefetch (with pdl, the first gate tile, or in one step the whole row, loaded before the wait;
    where pdl is dropped, as under the interpreter, the same load after it): the streamed K1's output
    unchanged."""
    x, gate, up, down, theta = _problem(1, 80, 200, gated=gated, active=0.08, seed=12, threshold=True)
    config = dataclasses.replace(stream, pdl=True)
    assert torch.equal(_run(x, gate, up, down, theta, dataclasses.replace(config, prefetch=True)),
                       _run(x, gate, up, down, theta, config))


def test_prefetch_is_checked():
    with pytest.raises(TypeError, match="DecodeConfig.prefetch must be a bool"):
        DecodeConfig(prefetch=1)
    x, gate, up, down, theta = _problem(1, 32, 64)
    with pytest.raises(ValueError, match="prefetch .* needs config.stream"):
        _run(x, gate, up, down, theta, dataclasses.replace(SMALL, prefetch=True))


@pytest.mark.parametrize("m", [3, 16, 64])
@pytest.mark.parametrize("active", [0.08, 0.6])
def test_compact_up_matches_reference_and_the_masked_pass(m, active):
    """config.compact_up: at 0.6 most 32-unit blocks have more than 16 active units (two groups)."""
    x, gate, up, down, theta = _problem(m, 80, 200, active=active, seed=m + 20, threshold=True)
    y = _run(x, gate, up, down, theta, COMPACT)
    _check(y, x, gate, up, down, theta)
    assert torch.equal(y, _run(x, gate, up, down, theta, COMPACT))
    masked = _run(x, gate, up, down, theta, dataclasses.replace(COMPACT, compact_up=False))
    assert (y.float() - masked.float()).abs().max() <= 2 * torch.finfo(x.dtype).eps * masked.float().abs().max()


@pytest.mark.parametrize("active", [0.0, 1.0])
def test_no_unit_and_every_unit_active(active):
    x, gate, up, down, theta = _problem(5, 64, 96, active=active)
    y = _run(x, gate, up, down, theta, LARGE)
    if active == 0.0:
        assert torch.equal(y, torch.zeros_like(y))
    _check(y, x, gate, up, down, theta)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_threshold_and_dtypes(dtype):
    x, gate, up, down, theta = _problem(2, 48, 160, dtype=dtype, threshold=True, active=0.2)
    _check(_run(x, gate, up, down, theta, SMALL), x, gate, up, down, theta)


def test_configs_agree_and_repeat_bitwise():
    x, gate, up, down, theta = _problem(16, 64, 256, active=0.3, seed=3)
    a = _run(x, gate, up, down, theta, SMALL)
    b = _run(x, gate, up, down, theta, SMALL)
    assert torch.equal(a, b)  # the list is summed in ascending unit order
    c = _run(x, gate, up, down, theta, LARGE)
    assert (a.float() - c.float()).abs().max() <= 2e-2 * c.float().abs().max()


def test_default_config_and_nan_row():
    x, gate, up, down, theta = _problem(1, 64, 128, active=0.1)
    _check(_run(x, gate, up, down, theta), x, gate, up, down, theta)
    x[0, 3] = float("nan")
    assert torch.isnan(_run(x, gate, up, down, theta)).all()  # as dense torch: NaN reaches the output


def test_rejects_bad_arguments():
    x, gate, up, down, theta = _problem(2, 32, 64)
    down_t = down.t().contiguous()
    with pytest.raises(ValueError, match="1 to 64 rows"):
        decode_mlp(torch.zeros(MAX_TOKENS + 1, 32, dtype=x.dtype), gate, up, down_t)
    with pytest.raises(ValueError, match="down_t must be"):
        decode_mlp(x, gate, up, down)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        decode_mlp(x.float(), gate, up, down_t)
    with pytest.raises(ValueError, match="threshold"):
        decode_mlp(x, gate, up, down_t, theta.double())
    with pytest.raises(ValueError, match="block_h must be >= 16"):
        x16 = torch.zeros(16, 32, dtype=x.dtype)  # 16 tokens take tl.dot
        decode_mlp(*(t.to(DEVICE) for t in (x16, gate, up, down_t)), config=DecodeConfig(block_h=8))
    with pytest.raises(ValueError, match="one-token field"):
        decode_mlp(*(t.to(DEVICE) for t in (x, gate, up, down_t)), config=STREAM)
    with pytest.raises(TypeError, match="DecodeConfig.stream must be a bool"):
        DecodeConfig(stream=1)
    with pytest.raises(TypeError, match="DecodeConfig.pdl must be a bool"):
        DecodeConfig(pdl=1)
    with pytest.raises(ValueError, match="compact_up is for 3 or more tokens"):
        decode_mlp(*(t.to(DEVICE) for t in (x, gate, up, down_t)), config=COMPACT)


def test_m_pad_buckets():
    assert [m_pad(m) for m in (1, 2, 3, 9, 16, 17, 33, 64)] == [1, 2, 16, 16, 16, 32, 64, 64]


def specs_of(specs, name):
    return [s[2] for s in specs if s[0].__name__ == name]


def test_compile_specs_cover_variants():
    specs = compile_specs(with_options=True)
    names = {(s[0].fn.__name__ if hasattr(s[0], "fn") else s[0].__name__) for s in specs}
    assert names == {"_decode_gate_up_kernel", "_decode_down_kernel", "_dense_down_kernel"}
    streamed = [c for c in specs_of(specs, "_decode_gate_up_kernel") if c.get("STREAM")]
    assert {(c["M_PAD"], c["ACT"], c["NORM"]) for c in streamed} == {(1, 0, False), (1, 0, True), (1, 1, True),
                                                                     (1, 2, True)}
    rows_down = specs_of(specs, "_dense_down_kernel")  # the engine's, for Hugging Face's [D, H] down weight
    assert {(c["M_PAD"], c["STREAM"], c.get("PDL"), c.get("PREFETCH")) for c in rows_down} >= {
        (1, True, False, False), (1, True, True, True), (16, False, False, False)}
    assert {c["ALL_UNITS"] for c in specs_of(specs, "_decode_down_kernel")} == {False, True}
    compact = [s[2] for s in specs if s[2].get("COMPACT_UP")]
    assert {(c["M_PAD"], c["NORM"]) for c in compact} == {(m, n) for m in (16, 32, 64) for n in (False, True)}
    fused = [s[2] for s in specs if (s[2].get("NORM") or s[2].get("RESIDUAL")) and not s[2].get("COMPACT_UP")]
    assert {c["M_PAD"] for c in fused} == {1, 16} and {c.get("ACT") for c in fused} >= {0, 1, 2}
    assert {s[2]["M_PAD"] for s in specs} == {1, 2, 16, 32, 64}
    assert len({(s[0].__name__, repr(s[1]), repr(s[2])) for s in specs}) == len(specs)
