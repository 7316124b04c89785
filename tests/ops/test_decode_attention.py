"""ops.decode_attention: the three decode-step calls composed as a layer's attention, their argument
errors, what tracers see, and (GPU only) 2b-sized shapes and CUDA-graph capture and replay with new
positions. Kernel accuracy is tested in tests/kernels/test_decode_attn_proj.py and
test_decode_attention.py."""

from __future__ import annotations

import pytest
import torch

from sparseffn.ops.decode_attention import decode_attention, decode_out_proj, decode_qkv_rope
from sparseffn.ops.decode_reference import (decode_attention_reference, decode_out_proj_reference,
                                            decode_qkv_rope_reference)
from tests.kernels.test_decode_attn_proj import QKV_ARGS, rope_tables

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def layer(b, dim, hq, hkv, d, s_max, *, bias=False, dtype=torch.bfloat16, seed=0):
    """A decode step's attention inputs: weights, a filled cache and per-sequence positions."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)

    cos, sin = rope_tables(s_max, d)
    p = dict(hidden=rnd(b, dim), norm_weight=(torch.rand(dim, generator=g) + 0.5).to(dtype).to(DEVICE), eps=1e-5,
             wq=rnd(hq * d, dim, scale=dim**-0.5), wk=rnd(hkv * d, dim, scale=dim**-0.5),
             wv=rnd(hkv * d, dim, scale=dim**-0.5), bq=rnd(hq * d) if bias else None, bk=rnd(hkv * d) if bias else None,
             bv=rnd(hkv * d) if bias else None, cos_table=cos.to(DEVICE), sin_table=sin.to(DEVICE),
             positions=torch.randint(s_max // 2, s_max, (b,), generator=g).to(DEVICE),
             k_cache=rnd(b, hkv, s_max, d), v_cache=rnd(b, hkv, s_max, d))
    p["wo"], p["bo"] = rnd(dim, hq * d, scale=(hq * d) ** -0.5), rnd(dim) if bias else None
    p["valid_from"] = torch.randint(0, s_max // 2, (b,), generator=g).to(DEVICE)
    return p


def step(p, counters=None):
    q = decode_qkv_rope(*(p[n] for n in QKV_ARGS))
    o = decode_attention(q, p["k_cache"], p["v_cache"], p["positions"], 0.125,
                         p["valid_from"], counters=counters)
    return decode_out_proj(o, p["wo"], p["bo"], p["hidden"])


def step_reference(p):
    """The step in fp32 from the fp32 references (the cache as it was before the step, plus the new row)."""
    q, k, v = decode_qkv_rope_reference(*(p[n] for n in QKV_ARGS[:-2]))
    rows = torch.arange(q.shape[0], device=q.device)
    k_cache, v_cache = p["k_cache"].float().clone(), p["v_cache"].float().clone()
    k_cache[rows, :, p["positions"]] = k
    v_cache[rows, :, p["positions"]] = v
    o = decode_attention_reference(q, k_cache, v_cache, p["positions"], 0.125, p["valid_from"])
    return decode_out_proj_reference(o, p["wo"], p["bo"], p["hidden"])


def check_step(p, y, ref, hidden_before):
    """y is the layer's residual + attention within a few 16-bit roundings of the fp32 step: the
    attention part's error relative to its own size, not to the residual's."""
    attn_ref = ref - hidden_before.float()
    err = (y.float() - ref).abs().max().item()
    assert err <= 0.05 * attn_ref.abs().max().item() + 2 * torch.finfo(y.dtype).eps * ref.abs().max().item(), err


@pytest.mark.parametrize("b, hq, hkv, bias", [(1, 2, 2, False), (3, 4, 2, True)])
def test_step_matches_the_fp32_step(b, hq, hkv, bias):
    p = layer(b, 64, hq, hkv, 16, 32, bias=bias, seed=b)
    ref = step_reference(p)
    check_step(p, step(p), ref, p["hidden"])


def test_argument_errors_name_the_argument():
    p = layer(2, 32, 2, 1, 16, 8)
    good = {n: p[n] for n in QKV_ARGS}
    cases = [
        ({"hidden": p["hidden"].float()}, TypeError, "hidden must be bf16 or fp16"),
        ({"hidden": p["hidden"][0]}, ValueError, "hidden must be a 2-D tensor"),
        ({"wq": p["wq"][:24]}, ValueError, "wq must have Hq·d rows"),
        ({"wk": p["wk"].half()}, TypeError, "wk must be torch.bfloat16"),
        ({"wv": p["wv"][:8]}, ValueError, "wv must have shape"),
        ({"bq": p["wq"][:, 0]}, ValueError, "bq must have unit stride"),
        ({"positions": p["positions"].float()}, TypeError, "positions must be torch.int32 or torch.int64"),
        ({"positions": p["positions"][:1]}, ValueError, "positions must have shape [2]"),
        ({"k_cache": p["k_cache"][:, :, :, :8]}, ValueError, "k_cache must have shape [2, 1, *, 16]"),
        ({"eps": -1.0}, ValueError, "eps must be a finite number"),
        ({"sin_table": p["sin_table"][:4]}, ValueError, "sin_table must have shape"),
    ]
    for override, error, message in cases:
        with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]").replace("*", r"\*")):
            decode_qkv_rope(**{**good, **override})
    q = torch.zeros(2, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="q's 2 heads must be a multiple"):
        decode_attention(q, p["k_cache"].expand(2, 3, 8, 16), p["v_cache"].expand(2, 3, 8, 16), p["positions"], 0.25)
    with pytest.raises(TypeError, match="scaling must be a number"):
        decode_attention(q, p["k_cache"], p["v_cache"], p["positions"], True)
    with pytest.raises(ValueError, match="counters must hold at least"):
        decode_attention(q, p["k_cache"], p["v_cache"], p["positions"], 0.25,
                         counters=torch.zeros(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="q must have 1 to 64 sequences"):
        decode_attention(q[:1].expand(65, 2, 16), p["k_cache"][:1].expand(65, 1, 8, 16),
                         p["v_cache"][:1].expand(65, 1, 8, 16), p["positions"][:1].expand(65), 0.25)
    attn = torch.zeros(2, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="out must not share memory with attn"):
        decode_out_proj(attn, p["wq"][:32], None, attn.clone(), out=attn)
    with pytest.raises(ValueError, match=r"residual must have shape \[2, 32\]"):
        decode_out_proj(attn, p["wq"][:32], None, attn[:, :16])


def test_tracers_see_one_custom_op_per_call():
    """make_fx records the three custom ops (qkv_rope as mutating the caches) and replays them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    p = layer(2, 32, 2, 2, 16, 8, seed=5)
    names = ("hidden", "positions", "k_cache", "v_cache")

    def fn(hidden, positions, k_cache, v_cache):
        return step({**p, "hidden": hidden, "positions": positions, "k_cache": k_cache, "v_cache": v_cache})

    args = [p[n].clone() for n in names]
    graph = make_fx(fn)(*[a.clone() for a in args])
    ops = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert ops == ["sparseffn.decode_qkv_rope.default", "sparseffn.decode_attention.default",
                   "sparseffn.decode_out_proj.default"], ops
    traced_args = [a.clone() for a in args]
    assert torch.equal(graph(*traced_args), fn(*args))
    assert torch.equal(traced_args[2], args[2]) and torch.equal(traced_args[3], args[3])  # the same cache writes


# ----------------------------------------------------------------------------------------------------
# GPU only: 2b-sized shapes, CUDA graphs

gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (CUDA graphs, 2b-sized shapes)")


@gpu
@pytest.mark.parametrize("b", [1, 4, 16, 64])
@pytest.mark.parametrize("hkv, bias", [(32, False), (8, True)])
def test_2b_sized_step_matches(b, hkv, bias):
    p = layer(b, 2048, 32, hkv, 64, 4096, bias=bias, seed=b)
    p["positions"] = torch.randint(300, 900, (b,), device=DEVICE)
    p["valid_from"] = torch.randint(0, 50, (b,), device=DEVICE)
    ref = step_reference(p)
    check_step(p, step(p), ref, p["hidden"])


@gpu
@pytest.mark.parametrize("b", [1, 16])
def test_cuda_graph_replays_with_new_positions(b):
    """One captured step (shared counters, as an engine would keep them) replayed at new positions
    and inputs equals the eager step on the same caches, bit for bit."""
    p = layer(b, 2048, 32, 32, 64, 1024, seed=7)
    counters = torch.zeros(b * 32, dtype=torch.int32, device=DEVICE)
    step(p, counters)  # compile and warm up outside the capture (it writes the caches: clone after it)
    torch.cuda.synchronize()
    eager = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in p.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step(p, counters)
    for trial in range(3):
        new_pos = torch.randint(100 + trial * 300, 400 + trial * 300, (b,), device=DEVICE)
        new_hidden = torch.randn(b, 2048, device=DEVICE).to(p["hidden"].dtype)
        for t in (p, eager):  # valid_from kept at or below the new positions: no empty range (NaN != NaN)
            t["positions"].copy_(new_pos)
            t["valid_from"].copy_(torch.minimum(t["valid_from"], new_pos))
            t["hidden"].copy_(new_hidden)
        graph.replay()
        expected = step(eager, counters)
        assert torch.equal(y, expected)
        assert torch.equal(p["k_cache"], eager["k_cache"]) and torch.equal(p["v_cache"], eager["v_cache"])
    assert torch.equal(counters, torch.zeros_like(counters))


@gpu
def test_compiled_variants_stay_put_when_positions_and_cache_length_change():
    from sparseffn.kernels.decode_attention import _launch as attention_launch
    from sparseffn.kernels.decode_attn_proj import _out_launch, _qkv_launch

    def run(s_max, seed):
        p = layer(1, 256, 4, 2, 64, s_max, seed=seed)
        step(p, torch.zeros(2, dtype=torch.int32, device=DEVICE))

    run(1024, 0)
    sizes = [len(launch.cache) for launch in (_qkv_launch, attention_launch, _out_launch)]
    run(2048, 1)  # other strides and positions, the same splits
    run(1024, 2)
    assert [len(launch.cache) for launch in (_qkv_launch, attention_launch, _out_launch)] == sizes
