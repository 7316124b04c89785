"""Split-KV decode attention (kernels/decode_attention.py via ops.decode_attention) against the fp32
reference of ops/decode_reference.py.

Rule: max|out - ref| <= 2 · max|torch same dtype - ref| + a rounding floor, the torch side being
scaled_dot_product_attention over each sequence's valid slots in the inputs' dtype. On CPU (the
interpreter truncates the output cast) the floor adds one ulp of the output.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from sparseffn.kernels.configs.decode_attention import AttentionConfig, attention_config
from sparseffn.kernels.decode_attention import launch_decode_attention, num_splits
from sparseffn.ops.decode_attention import decode_attention
from sparseffn.ops.decode_reference import decode_attention_reference

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def attention_problem(b, hq, hkv, d, s_max, *, positions, valid_from=None, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g).to(dtype).to(DEVICE)
    k_cache = (torch.randn(b, hkv, s_max, d, generator=g) * 2).to(dtype).to(DEVICE)
    v_cache = torch.randn(b, hkv, s_max, d, generator=g).to(dtype).to(DEVICE)
    pos = torch.tensor(positions, device=DEVICE)
    lo = None if valid_from is None else torch.tensor(valid_from, device=DEVICE)
    return q, k_cache, v_cache, pos, lo


def torch_attention(q, k_cache, v_cache, positions, scaling, valid_from):
    """SDPA in the inputs' dtype, one sequence at a time over its valid slots."""
    outs = []
    for i in range(q.shape[0]):
        lo = 0 if valid_from is None else int(valid_from[i])
        hi = int(positions[i]) + 1
        k, v = k_cache[i, :, lo:hi], v_cache[i, :, lo:hi]
        o = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=scaling, enable_gqa=True)
        outs.append(o.reshape(1, -1))
    return torch.cat(outs)


def check_attention(o, q, k_cache, v_cache, pos, lo, scaling):
    ref = decode_attention_reference(q, k_cache, v_cache, pos, scaling, lo)
    torch_err = (torch_attention(q, k_cache, v_cache, pos, scaling, lo).float() - ref).abs().max().item()
    floor = 0.0 if GPU else torch.finfo(q.dtype).eps * ref.abs()
    assert o.dtype == q.dtype and o.shape == ref.shape
    err = (o.float() - ref).abs()
    assert (err <= 2 * torch_err + floor + 1e-5).all(), (err.max().item(), torch_err)


CASES = [  # (b, hq, hkv, positions, valid_from)
    (1, 2, 2, [37], None),
    (3, 4, 4, [40, 0, 17], None),
    (3, 4, 1, [5, 47, 30], [0, 9, 30]),  # GQA group of 4: tl.dot rows
    (2, 6, 2, [47, 20], [3, 1]),  # group of 3, padded
]


@pytest.mark.parametrize("b, hq, hkv, positions, valid_from", CASES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mma", [False, True], ids=["", "mma"])
def test_matches_reference(b, hq, hkv, positions, valid_from, splits, mma):
    """mma: tl.dot on padded query rows also without GQA."""
    q, k, v, pos, lo = attention_problem(b, hq, hkv, 16, 48, positions=positions, valid_from=valid_from, seed=b + hq)
    counters = torch.zeros(b * hkv, dtype=torch.int32, device=DEVICE)
    config = AttentionConfig(block_s=16, splits=splits, mma=mma)
    o = launch_decode_attention(q, k, v, pos, 0.3, lo, counters, config=config)
    check_attention(o, q, k, v, pos, lo, 0.3)
    assert torch.equal(counters, torch.zeros_like(counters))  # left zero for the next call


@pytest.mark.parametrize("b, hq, hkv, positions, valid_from", CASES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mma", [False, True], ids=["", "mma"])
def test_prefetch_gives_the_same_bits(b, hq, hkv, positions, valid_from, splits, mma):
    """config.prefetch (the first block's older slots read before the PDL wait, the slot at positions[b]
    after it, merged) computes exactly what the plain loop computes."""
    q, k, v, pos, lo = attention_problem(b, hq, hkv, 16, 48, positions=positions, valid_from=valid_from, seed=b + hq)
    config = AttentionConfig(block_s=16, splits=splits, mma=mma)
    want = launch_decode_attention(q, k, v, pos, 0.3, lo, config=config)
    got = launch_decode_attention(q, k, v, pos, 0.3, lo, config=dataclasses.replace(config, prefetch=True))
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_default_split_fp16_head_dim_32_and_determinism():
    q, k, v, pos, lo = attention_problem(2, 4, 2, 32, 64, positions=[63, 12], valid_from=[4, 0], dtype=torch.float16)
    o = decode_attention(q, k, v, pos, 32**-0.5, lo)
    check_attention(o, q, k, v, pos, lo, 32**-0.5)
    assert torch.equal(o, decode_attention(q, k, v, pos, 32**-0.5, lo))
    # more splits than slots: empty splits contribute nothing
    o_many = launch_decode_attention(q, k, v, pos, 32**-0.5, lo, config=AttentionConfig(block_s=16, splits=20))
    check_attention(o_many, q, k, v, pos, lo, 32**-0.5)


def test_reads_only_valid_slots():
    """NaN in every slot outside valid_from .. positions leaves the output finite and unchanged."""
    q, k, v, pos, lo = attention_problem(2, 2, 2, 16, 40, positions=[20, 33], valid_from=[3, 30])
    o = decode_attention(q, k, v, pos, 0.25, lo, counters=torch.zeros(4, dtype=torch.int32, device=DEVICE))
    slots = torch.arange(40, device=DEVICE)
    outside = (slots[None, :] < lo[:, None]) | (slots[None, :] > pos[:, None])  # [B, S_max]
    k[outside[:, None, :, None].expand_as(k)] = float("nan")
    v[outside[:, None, :, None].expand_as(v)] = float("nan")
    assert torch.equal(decode_attention(q, k, v, pos, 0.25, lo), o)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's 0 / 0
def test_empty_range_is_nan():
    q, k, v, pos, _ = attention_problem(2, 2, 2, 16, 16, positions=[3, 5])
    o = decode_attention(q, k, v, pos, 0.25, torch.tensor([4, 0], device=DEVICE))
    assert torch.isnan(o[0]).all() and torch.isfinite(o[1]).all()


def test_default_config_one_split_from_a_pair_per_sm():
    """A (sequence, key/value head) pair per SM or more: one split of 128-slot steps by tl.dot; fewer: splits
    for about 4 programs per SM (batch 1 of a 32-head model on 132 SMs: 16)."""
    assert attention_config(132, 132) == AttentionConfig(splits=1, block_s=128, mma=True)
    assert attention_config(512, 132).splits == 1
    assert attention_config(32, 132) == AttentionConfig(pdl=True)
    assert num_splits(attention_config(32, 132), 32, 4096, 132) == 16
    # a caller meeting prefetch's contract: taken with pdl only
    assert attention_config(32, 132, prefetch=True) == AttentionConfig(pdl=True, prefetch=True, num_warps=2)
    assert attention_config(132, 132, prefetch=True) == AttentionConfig(splits=1, block_s=128, mma=True)


def test_public_prefetch_gives_the_same_bits():
    """decode_attention(prefetch=True): the launcher's default config with prefetch where it takes pdl
    (under the interpreter pdl is dropped, prefetch's loads still run first), the same output."""
    q, k, v, pos, lo = attention_problem(1, 2, 2, 16, 48, positions=[41], seed=5)  # 2 programs < 4 "SMs"
    want = decode_attention(q, k, v, pos, 0.3, lo)
    assert torch.equal(decode_attention(q, k, v, pos, 0.3, lo, prefetch=True), want)
    with pytest.raises(TypeError, match="prefetch must be a bool"):
        decode_attention(q, k, v, pos, 0.3, lo, prefetch=1)
