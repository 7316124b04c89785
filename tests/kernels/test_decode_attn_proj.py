"""The decode projections (kernels/decode_attn_proj.py via ops.decode_attention) against the fp32
references of ops/decode_reference.py.

Rule (flash-attention's): max|out - ref| <= 2 · max|torch same dtype - ref| + a rounding floor, the
torch side being Hugging Face's eager ops in the inputs' dtype. The interpreter truncates fp32 -> 16-bit
casts where the GPU rounds, so on CPU the floor adds a few ulp of the sum of |terms| behind each output.
Runs on a GPU natively and on CPU under the interpreter (tests/conftest.py), at tiny shapes there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from sparseffn.kernels.configs.decode_attention import ProjectionConfig
from sparseffn.kernels.decode_attn_proj import launch_decode_out_proj, launch_decode_qkv_rope
from sparseffn.ops.decode_attention import decode_out_proj, decode_qkv_rope
from sparseffn.ops.decode_reference import decode_out_proj_reference, decode_qkv_rope_reference, rotate_half_rope

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
EPS = 1e-5
QKV_ARGS = ("hidden", "norm_weight", "eps", "wq", "wk", "wv", "bq", "bk", "bv", "cos_table", "sin_table", "positions",
            "k_cache", "v_cache")


def rope_tables(s: int, d: int, *, theta: float = 1e4, factor: float = 1.0, random: bool = False, seed: int = 0):
    """(cos, sin) [s, d] fp32: Hugging Face's tables (halves equal) times an attention factor, or random
    values with unequal halves (catches a kernel that reads dim i's entry for dim i + d/2)."""
    if random:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(s, d, generator=g), torch.randn(s, d, generator=g)
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.outer(torch.arange(s).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * factor, emb.sin() * factor


def qkv_problem(b, dim, hq, hkv, d, s_max, *, bias, dtype=torch.bfloat16, seed=0, random_tables=False):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)

    p = dict(hidden=rnd(b, dim), norm_weight=(torch.rand(dim, generator=g) + 0.5).to(dtype).to(DEVICE), eps=EPS,
             wq=rnd(hq * d, dim, scale=dim**-0.5), wk=rnd(hkv * d, dim, scale=dim**-0.5),
             wv=rnd(hkv * d, dim, scale=dim**-0.5),
             bq=rnd(hq * d, scale=0.5) if bias else None, bk=rnd(hkv * d, scale=0.5) if bias else None,
             bv=rnd(hkv * d, scale=0.5) if bias else None)
    cos, sin = rope_tables(s_max, d, random=random_tables, seed=seed, factor=1.25)
    p["cos_table"], p["sin_table"] = cos.to(DEVICE), sin.to(DEVICE)
    p["positions"] = torch.randperm(s_max, generator=g)[:b].to(DEVICE)
    p["k_cache"] = rnd(b, hkv, s_max, d)
    p["v_cache"] = rnd(b, hkv, s_max, d)
    return p


def hf_qkv(p):
    """Hugging Face's eager decode step in the inputs' dtype: LlamaRMSNorm, nn.Linear, apply_rotary_pos_emb."""
    x = p["hidden"]
    xf = x.float()
    n = p["norm_weight"] * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + p["eps"])).to(x.dtype)
    d = p["cos_table"].shape[1]
    cos = p["cos_table"][p["positions"]].to(x.dtype)[:, None, :]
    sin = p["sin_table"][p["positions"]].to(x.dtype)[:, None, :]
    q, k, v = (F.linear(n, p[w], p[bias]).view(x.shape[0], -1, d)
               for w, bias in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
    return rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin), v


def _floor(p, ref_terms):
    """The interpreter's truncation allowance: a few ulp of the sum of |terms| behind each output."""
    return 0.0 if GPU else 4 * torch.finfo(p["hidden"].dtype).eps * ref_terms


def _abs_terms(p):
    """Σ|n_k w_jk| + |b_j| per unit, rotated with |cos|, |sin|: what rounding errors scale with."""
    x = p["hidden"].float()
    n = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * p["norm_weight"].float()).abs()
    d = p["cos_table"].shape[1]
    pos = p["positions"]
    cos, sin = p["cos_table"].float()[pos][:, None, :].abs(), p["sin_table"].float()[pos][:, None, :].abs()
    out = []
    for w, bias, rotate in (("wq", "bq", True), ("wk", "bk", True), ("wv", "bv", False)):
        t = n @ p[w].float().abs().t() + (0 if p[bias] is None else p[bias].float().abs())
        t = t.view(t.shape[0], -1, d)
        half = d // 2
        if rotate:
            t = torch.cat((t[..., :half] * cos[..., :half] + t[..., half:] * sin[..., :half],
                           t[..., half:] * cos[..., half:] + t[..., :half] * sin[..., half:]), -1)
        out.append(t)
    return out


def check_qkv(p, q):
    """q and the cache rows written at positions against the reference; every other cache slot unchanged."""
    before_k, before_v = p["k_cache_before"], p["v_cache_before"]
    refs = decode_qkv_rope_reference(*(p[n] for n in QKV_ARGS[:-2]))
    hf = hf_qkv(p)
    rows = torch.arange(q.shape[0], device=q.device)
    pos = p["positions"]
    got = (q, p["k_cache"][rows, :, pos], p["v_cache"][rows, :, pos])
    for name, out, ref, torch_out, terms in zip("qkv", got, refs, hf, _abs_terms(p)):
        assert out.dtype == p["hidden"].dtype and out.shape == ref.shape, name
        err = (out.float() - ref).abs()
        torch_err = (torch_out.float() - ref).abs().max().item()
        assert torch.isfinite(out).all(), name
        assert (err <= 2 * torch_err + _floor(p, terms) + 1e-6).all(), (name, err.max().item(), torch_err)
    for cache, before in ((p["k_cache"], before_k), (p["v_cache"], before_v)):
        untouched = torch.ones(cache.shape[0], cache.shape[2], dtype=torch.bool, device=cache.device)
        untouched[rows, pos] = False
        assert torch.equal(cache.permute(0, 2, 1, 3)[untouched], before.permute(0, 2, 1, 3)[untouched])


def run_qkv(p):
    p["k_cache_before"], p["v_cache_before"] = p["k_cache"].clone(), p["v_cache"].clone()
    return decode_qkv_rope(*(p[n] for n in QKV_ARGS))


@pytest.mark.parametrize("b", [1, 2, 3])
@pytest.mark.parametrize("hq, hkv, bias", [(4, 2, False), (2, 2, True)])
def test_qkv_rope_matches_reference(b, hq, hkv, bias):
    p = qkv_problem(b, 80, hq, hkv, 16, 24, bias=bias, seed=b * 10 + hq)
    check_qkv(p, run_qkv(p))


def test_qkv_rope_fp16_random_tables_int32_positions_head_dim_32():
    p = qkv_problem(3, 64, 2, 1, 32, 16, bias=True, dtype=torch.float16, seed=7, random_tables=True)
    p["positions"] = p["positions"].int()
    check_qkv(p, run_qkv(p))


@pytest.mark.parametrize("b, block_n", [(1, 2), (3, 16)])
def test_qkv_rope_several_steps_over_d(b, block_n):
    """D = 80 in steps of 32 (the last one partial): rstd from a first pass over x."""
    p = qkv_problem(b, 80, 2, 1, 16, 12, bias=True, seed=11)
    p["k_cache_before"], p["v_cache_before"] = p["k_cache"].clone(), p["v_cache"].clone()
    q = launch_decode_qkv_rope(*(p[n] for n in QKV_ARGS), config=ProjectionConfig(block_n=block_n, block_k=32))
    check_qkv(p, q)


@pytest.mark.parametrize("block_k", [32, 128], ids=["steps", "one_step"])
def test_qkv_rope_streamed_at_one_token(block_k):
    """config.stream: decode_mlp._streamed_dot's loop (rstd behind the first tile, the next step's tiles a
    step ahead), within the same bound."""
    p = qkv_problem(1, 80, 4, 2, 16, 12, bias=True, seed=12)
    p["k_cache_before"], p["v_cache_before"] = p["k_cache"].clone(), p["v_cache"].clone()
    config = ProjectionConfig(block_n=4, block_k=block_k, stream=True)
    check_qkv(p, launch_decode_qkv_rope(*(p[n] for n in QKV_ARGS), config=config))


@pytest.mark.parametrize("block_k", [32, 128], ids=["steps", "one_step"])
def test_prefetch_gives_the_same_bits(block_k):
    """config.prefetch (with pdl, the first weight tile, or in one step the whole row, loaded before the
    wait; where pdl is dropped, as under the interpreter, the same loads after it): q, the cache writes and
    o_proj's output unchanged."""
    p = qkv_problem(1, 80, 4, 2, 16, 12, bias=True, seed=13)
    config = ProjectionConfig(block_n=4, block_k=block_k, stream=True, pdl=True)
    before = p["k_cache"].clone(), p["v_cache"].clone()
    want = launch_decode_qkv_rope(*(p[n] for n in QKV_ARGS), config=config)
    caches = p["k_cache"].clone(), p["v_cache"].clone()
    p["k_cache"].copy_(before[0]), p["v_cache"].copy_(before[1])
    got = launch_decode_qkv_rope(*(p[n] for n in QKV_ARGS), config=dataclasses.replace(config, prefetch=True))
    assert torch.equal(got, want)
    assert torch.equal(p["k_cache"], caches[0]) and torch.equal(p["v_cache"], caches[1])
    with pytest.raises(ValueError, match="needs config.stream"):
        launch_decode_qkv_rope(*(p[n] for n in QKV_ARGS), config=ProjectionConfig(block_n=4, block_k=32, prefetch=True))
    attn, wo, bo, residual = _out_problem(1, 96, 72, bias=True, seed=6)
    for config in (ProjectionConfig(block_n=4, block_k=block_k, stream=True, pdl=True),
                   ProjectionConfig(block_n=4, block_k=128, pdl=True)):  # streamed, and one K step
        want = launch_decode_out_proj(attn, wo, bo, residual, config=config)
        got = launch_decode_out_proj(attn, wo, bo, residual, config=dataclasses.replace(config, prefetch=True))
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="one K step"):
        launch_decode_out_proj(attn, wo, bo, residual, config=ProjectionConfig(block_n=4, block_k=32, prefetch=True))
    with pytest.raises(ValueError, match="one-token field"):
        attn2, wo2, bo2, residual2 = _out_problem(2, 96, 72, bias=True, seed=6)
        config = ProjectionConfig(block_n=4, block_k=128, prefetch=True)
        launch_decode_out_proj(attn2, wo2, bo2, residual2, config=config)


def test_kv_write_is_exactly_the_kernels_q():
    """With wk = wq, bk = bq (Hq = Hkv) the k written into the cache is q bit for bit, and with unit
    cos and zero sin (no rotation) so is v: the write lands at [b, :, positions[b]] in q's layout."""
    p = qkv_problem(3, 64, 2, 2, 16, 20, bias=True, seed=3)
    p["wk"], p["wv"], p["bk"], p["bv"] = p["wq"], p["wq"].clone(), p["bq"], p["bq"].clone()
    rows = torch.arange(3, device=DEVICE)
    q = run_qkv(p)
    assert torch.equal(p["k_cache"][rows, :, p["positions"]], q)
    p["cos_table"], p["sin_table"] = torch.ones_like(p["cos_table"]), torch.zeros_like(p["sin_table"])
    q = run_qkv(p)
    assert torch.equal(p["v_cache"][rows, :, p["positions"]], q)
    assert torch.equal(p["k_cache"][rows, :, p["positions"]], q)


def _out_problem(b, k, n, *, bias, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    attn = torch.randn(b, k, generator=g).to(dtype).to(DEVICE)
    wo = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(DEVICE)
    bo = (torch.randn(n, generator=g) * 0.5).to(dtype).to(DEVICE) if bias else None
    residual = (torch.randn(b, n, generator=g) * 2).to(dtype).to(DEVICE)
    return attn, wo, bo, residual


def check_out(y, attn, wo, bo, residual):
    ref = decode_out_proj_reference(attn, wo, bo, residual)
    torch_err = (residual + F.linear(attn, wo, bo) - ref).abs().max().item()
    terms = attn.float().abs() @ wo.float().abs().t() + residual.float().abs()
    floor = 0.0 if GPU else 3 * torch.finfo(attn.dtype).eps * terms
    assert y.dtype == attn.dtype and y.shape == ref.shape
    assert ((y.float() - ref).abs() <= 2 * torch_err + floor + 1e-6).all(), ((y.float() - ref).abs().max(), torch_err)


@pytest.mark.parametrize("b", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_out_proj_matches_reference(b, bias):
    attn, wo, bo, residual = _out_problem(b, 96, 72, bias=bias, seed=b)
    check_out(decode_out_proj(attn, wo, bo, residual), attn, wo, bo, residual)


@pytest.mark.parametrize("bias", [False, True])
def test_out_proj_streamed_at_one_token(bias):
    attn, wo, bo, residual = _out_problem(1, 96, 72, bias=bias, seed=5)
    config = ProjectionConfig(block_n=4, block_k=32, stream=True)  # 3 steps over K = 96
    check_out(launch_decode_out_proj(attn, wo, bo, residual, config=config), attn, wo, bo, residual)
    with pytest.raises(ValueError, match="one-token field"):
        attn2, wo2, bo2, residual2 = _out_problem(2, 96, 72, bias=bias, seed=5)
        launch_decode_out_proj(attn2, wo2, bo2, residual2, config=config)


def test_out_proj_into_the_residual_and_strided_rows():
    attn, wo, bo, residual = _out_problem(2, 64, 48, bias=True, dtype=torch.float16, seed=4)
    expected = decode_out_proj(attn, wo, bo, residual)
    wide = torch.zeros(2, 80, dtype=residual.dtype, device=DEVICE)
    wide[:, :48] = residual
    view = wide[:, :48]  # row stride 80
    assert decode_out_proj(attn, wo, bo, view, out=view) is view
    assert torch.equal(view, expected)
    assert torch.equal(wide[:, 48:], torch.zeros_like(wide[:, 48:]))


def _exact_pair(b, dim, dtype, seed):
    """(x, pending): multiples of 1/8 whose sums are exact in 16 bits, so `x + pending` added beforehand by
    torch is the kernels' round(x + round(pending)) bit for bit, under the interpreter's truncating casts too."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(-60, 61, (b, dim), generator=g) / 8).to(dtype).to(DEVICE)
    pending = (torch.randint(-60, 61, (b, dim), generator=g) / 8).to(DEVICE)
    return x, pending


@pytest.mark.parametrize("b, config", [(1, ProjectionConfig(block_n=4, block_k=32, stream=True)),
                                       (1, ProjectionConfig(block_n=4, block_k=128, stream=True)),
                                       (3, ProjectionConfig(block_n=16, block_k=32)),
                                       (2, None)], ids=["streamed_steps", "streamed_one_step", "dot_rows", "default"])
def test_pending_is_added_to_the_input_first(b, config):
    """pending (a folded MLP's fp32 output): q/k/v and o_proj give the bits of the same launch on
    hidden + pending added beforehand; q/k/v leave pending as it was, o_proj zeroes it."""
    p = qkv_problem(b, 80, 4, 2, 16, 12, bias=True, seed=30 + b)
    hidden, pending = _exact_pair(b, 80, torch.bfloat16, seed=b)
    p["hidden"] = hidden + pending.to(hidden.dtype)
    caches = p["k_cache"].clone(), p["v_cache"].clone()
    want = launch_decode_qkv_rope(*(p[n] for n in QKV_ARGS), config=config)
    written = p["k_cache"].clone(), p["v_cache"].clone()
    p["k_cache"].copy_(caches[0]), p["v_cache"].copy_(caches[1])
    p["hidden"] = hidden
    kept = pending.clone()
    got = launch_decode_qkv_rope(*(p[n] for n in QKV_ARGS), pending, config=config)
    assert torch.equal(got, want) and torch.equal(pending, kept)
    assert torch.equal(p["k_cache"], written[0]) and torch.equal(p["v_cache"], written[1])
    attn, wo, bo, _ = _out_problem(b, 96, 80, bias=True, seed=b)
    residual, pending = _exact_pair(b, 80, torch.bfloat16, seed=10 + b)
    want = launch_decode_out_proj(attn, wo, bo, residual + pending.to(residual.dtype), config=config)
    got = launch_decode_out_proj(attn, wo, bo, residual, None, pending, config=config)
    assert torch.equal(got, want)
    assert torch.equal(pending, torch.zeros_like(pending))


def test_pending_is_checked_and_taken_by_the_ops():
    p = qkv_problem(1, 80, 4, 2, 16, 12, bias=False, seed=40)
    with pytest.raises(TypeError, match="pending must be torch.float32"):
        decode_qkv_rope(*(p[n] for n in QKV_ARGS), pending=torch.zeros(1, 80, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="pending must have shape"):
        decode_qkv_rope(*(p[n] for n in QKV_ARGS), pending=torch.zeros(2, 80, device=DEVICE))
    attn, wo, bo, residual = _out_problem(1, 96, 80, bias=False, seed=41)
    residual, pending = _exact_pair(1, 80, torch.bfloat16, seed=42)
    want = decode_out_proj(attn, wo, bo, residual + pending.to(residual.dtype))
    assert torch.equal(decode_out_proj(attn, wo, bo, residual, out=residual, pending=pending), want)
    assert torch.equal(residual, want) and not pending.any()


def test_pending_forms_trace_under_torch_compile():
    """The pending forms as custom ops inside torch.compile(fullgraph=True) (aot_eager: functionalized, the
    fakes' shapes): the eager bits, and o_proj's zeroing of pending kept as a mutation."""
    attn, wo, bo, _ = _out_problem(1, 96, 80, bias=True, seed=43)
    residual, pending = _exact_pair(1, 80, torch.bfloat16, seed=44)
    want = decode_out_proj(attn, wo, bo, residual, pending=pending.clone())
    step = torch.compile(lambda a, r, p: decode_out_proj(a, wo, bo, r, pending=p) * 1, backend="aot_eager",
                         fullgraph=True)
    assert torch.equal(step(attn, residual, pending), want) and not pending.any()
    p = qkv_problem(1, 80, 4, 2, 16, 12, bias=False, seed=45)
    hidden, pending = _exact_pair(1, 80, torch.bfloat16, seed=46)
    p["hidden"] = hidden
    want = decode_qkv_rope(*(p[n] for n in QKV_ARGS), pending=pending)
    qkv = torch.compile(lambda *args: decode_qkv_rope(*args, pending=pending), backend="aot_eager", fullgraph=True)
    assert torch.equal(qkv(*(p[n] for n in QKV_ARGS)), want)
