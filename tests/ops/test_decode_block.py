"""decode_mlp_block (x + MLP(RMSNorm(x)) in two launches): every path against an fp64 reference;
fp32 tightly, bf16 under the flash-attention rule against torch's own bf16 layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from sparseffn.kernels.configs.decode_mlp import DecodeConfig
from sparseffn.kernels.decode_dense_mlp import launch_dense_mlp_rows_down
from sparseffn.kernels.decode_mlp import launch_decode_mlp
from sparseffn.ops.decode_block import decode_mlp_block, decode_norm

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
# (sparse, act, down stored transposed)
PATHS = [(True, "relu", True), (False, "relu", True), (False, "relu", False), (False, "silu", False)]


def _problem(m, d, h, dtype, *, seed=0, active=0.15, threshold=True, gated=True):
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(m, d, generator=g)
    norm_weight = 1 + 0.3 * torch.randn(d, generator=g)
    gate = torch.randn(h, d, generator=g) / d**0.5
    up = torch.randn(h, d, generator=g) / d**0.5
    down = torch.randn(d, h, generator=g) / h**0.5
    n = _norm(x.double(), norm_weight.double())
    pre = n @ (gate if gated else up).double().t()
    theta = torch.quantile(pre.flatten(), 1 - active).float() + 0.02 * torch.randn(h, generator=g) if threshold else None
    cast = lambda t: t.to(dtype).to(DEVICE)  # noqa: E731
    return (cast(x), cast(norm_weight), cast(gate) if gated else None, cast(up), cast(down),
            None if theta is None else theta.to(DEVICE))


def _norm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _reference(x, norm_weight, gate, up, down, theta, act):
    """fp64: x + down(act(n first^T - θ) * (n up^T))."""
    n = _norm(x.double(), norm_weight.double())
    g = n @ (gate if gate is not None else up).double().t()
    if theta is not None:
        g = g - theta.double()
    a = torch.relu(g) if act == "relu" else F.silu(g)
    h = a * (n @ up.double().t()) if gate is not None else a
    return x.double() + h @ down.double().t()


def _torch_same_dtype(x, norm_weight, gate, up, down, theta, act):
    """Hugging Face's layer in x's dtype (its roundings)."""
    xf = x.float()
    n = norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    g = F.linear(n, gate if gate is not None else up)
    if theta is not None:
        g = g - theta.to(x.dtype)
    a = torch.relu(g) if act == "relu" else F.silu(g)
    h = a * F.linear(n, up) if gate is not None else a
    return x + F.linear(h, down)


def _down(down, transposed):
    return down.t().contiguous().t() if transposed else down.contiguous()


SMALL = DecodeConfig(block_h=16, block_k=32, block_s=16, block_d=32, prefix=64)


@pytest.mark.parametrize("sparse,act,transposed", PATHS)
@pytest.mark.parametrize("m", [1, 2, 3])
def test_fp32_matches_reference(sparse, act, transposed, m):
    x, nw, gate, up, down, theta = _problem(m, 48, 80, torch.float32, seed=m, threshold=act == "relu")
    y = decode_mlp_block(x, nw, EPS, gate, up, _down(down, transposed), theta, act=act, sparse=sparse)
    ref = _reference(x, nw, gate, up, down, theta, act)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("sparse,act,transposed", PATHS)
def test_bf16_within_twice_torch_error(sparse, act, transposed):
    x, nw, gate, up, down, theta = _problem(2, 64, 96, torch.bfloat16, seed=5, threshold=act == "relu")
    y = decode_mlp_block(x, nw, EPS, gate, up, _down(down, transposed), theta, act=act, sparse=sparse)
    ref = _reference(x, nw, gate, up, down, theta, act)
    torch_err = (_torch_same_dtype(x, nw, gate, up, down, theta, act).double() - ref).abs().max()
    ulp = torch.finfo(torch.bfloat16).eps  # the interpreter truncates casts: a few ulps of the output's size
    assert (y.double() - ref).abs().max() <= 2 * torch_err + 4 * ulp * ref.abs().max()


def test_sixteen_tokens_split_spans_and_ungated():
    """tl.dot rows (M = 16), K2's spans summed at the end with the residual, and the non-gated MLP."""
    x, nw, gate, up, down, theta = _problem(16, 48, 80, torch.float32, seed=7)
    y = launch_decode_mlp(x, gate, up, down.t().contiguous(), theta, norm_weight=nw, eps=EPS, residual=True,
                          config=DecodeConfig(block_h=16, block_k=32, block_s=16, block_d=32, prefix=64, split=3))
    ref = _reference(x, nw, gate, up, down, theta, "relu")
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    x, nw, _, up, down, theta = _problem(3, 48, 80, torch.float32, seed=8, gated=False)
    for sparse in (True, False):
        y = decode_mlp_block(x, nw, EPS, None, up, _down(down, True), theta, sparse=sparse)
        ref = _reference(x, nw, None, up, down, theta, "relu")
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("gated", [True, False])
def test_streamed_one_token_with_norm_and_residual(gated):
    """config.stream (the streamed K1 loops, the norm's pass behind the first tile) under the fused norm
    and residual: fp32 tightly, bf16 under the rule."""
    config = DecodeConfig(block_h=8, block_k=16, block_s=16, block_d=32, prefix=64, split=2, stream=True)
    for dtype in (torch.float32, torch.bfloat16):
        x, nw, gate, up, down, theta = _problem(1, 48, 80, dtype, seed=12, gated=gated)
        y = launch_decode_mlp(x, gate if gated else up, up if gated else None, down.t().contiguous(), theta,
                              norm_weight=nw, eps=EPS, residual=True, config=config)
        ref = _reference(x, nw, gate, up, down, theta, "relu")
        if dtype == torch.float32:
            assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
        else:
            torch_err = (_torch_same_dtype(x, nw, gate, up, down, theta, "relu").double() - ref).abs().max()
            ulp = torch.finfo(torch.bfloat16).eps
            assert (y.double() - ref).abs().max() <= 2 * torch_err + 4 * ulp * ref.abs().max()


@pytest.mark.parametrize("m", [3, 16])
def test_compact_up_with_norm_and_residual(m):
    """config.compact_up (the up pass over the gathered active units) under the fused norm and residual,
    fp32 against fp64; at 60% active most 32-unit blocks gather two groups."""
    x, nw, gate, up, down, theta = _problem(m, 48, 80, torch.float32, seed=14, active=0.6)
    config = DecodeConfig(block_h=32, block_k=16, block_s=16, block_d=32, prefix=64, compact_up=True, up_k=16)
    y = launch_decode_mlp(x, gate, up, down.t().contiguous(), theta, norm_weight=nw, eps=EPS, residual=True,
                          config=config)
    ref = _reference(x, nw, gate, up, down, theta, "relu")
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("act", ["relu", "silu"])
def test_one_token_streamed_dense(act):
    """The dense MLP (every unit, act relu / silu) with the streamed K1 loops, fp32 against fp64."""
    x, nw, gate, up, down, theta = _problem(1, 48, 80, torch.float32, seed=13, threshold=act == "relu")
    config = DecodeConfig(block_h=8, block_k=16, block_s=16, block_d=32, prefix=64, split=2, stream=True)
    y = launch_decode_mlp(x, gate, up, down.t().contiguous(), theta, norm_weight=nw, eps=EPS, residual=True,
                          act=act, config=config)
    ref = _reference(x, nw, gate, up, down, theta, act)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("transposed", [True, False])
def test_one_token_dense_with_prefetch_gives_the_same_bits(transposed):
    """config.prefetch with pdl (K1's first gate tile and, for the [D, H] down weight, the row products'
    first down tile read before the wait; where pdl is dropped, as under the interpreter, after it): the
    dense block's output unchanged, bf16, several K steps (H = 80 over 16-column steps)."""
    x, nw, gate, up, down, theta = _problem(1, 48, 80, torch.bfloat16, seed=16)
    config = DecodeConfig(block_h=8, block_k=16, block_s=16, block_d=32, prefix=64, split=2, stream=True, pdl=True)
    run = lambda c: (launch_decode_mlp(x, gate, up, down.t().contiguous(), theta, norm_weight=nw,  # noqa: E731
                                       eps=EPS, residual=True, act="relu", config=c) if transposed else
                     launch_dense_mlp_rows_down(x, gate, up, down.contiguous(), theta, act="relu", norm_weight=nw,
                                                eps=EPS, residual=True, config=c))
    assert torch.equal(run(dataclasses.replace(config, prefetch=True)), run(config))


FOLD = DecodeConfig(block_h=8, block_k=16, stream=True)  # 3 K steps over D = 48


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("config", [None, FOLD], ids=["default", "streamed_steps"])
def test_fold_adds_the_mlp_output_into_the_buffer(gated, config):
    """fold_into: K1 alone adds MLP(RMSNorm(x)) into the fp32 buffer (on top of what it holds), x unchanged;
    fp32 against fp64, and the buffer rounded and added to x (as the next layer's kernels add it) within
    the rule in bf16."""
    x, nw, gate, up, down, theta = _problem(1, 48, 80, torch.float32, seed=21, gated=gated, active=0.3)
    start = torch.randn(1, 48, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    fold = start.clone()
    out = launch_decode_mlp(x, gate if gated else up, up if gated else None, down.t().contiguous(), theta,
                            norm_weight=nw, eps=EPS, config=config, fold_into=fold)
    ref = _reference(x, nw, gate, up, down, theta, "relu") - x.double()
    assert out is fold
    assert (fold.double() - start.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    x, nw, gate, up, down, theta = _problem(1, 64, 96, torch.bfloat16, seed=22, gated=gated)
    fold = torch.zeros(1, 64, device=DEVICE)
    decode_mlp_block(x, nw, EPS, gate, up, _down(down, True), theta, sparse=True, fold_into=fold)
    y = x + fold.to(x.dtype)
    ref = _reference(x, nw, gate, up, down, theta, "relu")
    torch_err = (_torch_same_dtype(x, nw, gate, up, down, theta, "relu").double() - ref).abs().max()
    ulp = torch.finfo(torch.bfloat16).eps
    assert (y.double() - ref).abs().max() <= 2 * torch_err + 4 * ulp * ref.abs().max()


def test_fold_with_no_active_unit_adds_nothing_and_is_checked():
    x, nw, gate, up, down, _ = _problem(1, 48, 80, torch.float32, seed=23)
    fold = torch.zeros(1, 48, device=DEVICE)
    decode_mlp_block(x, nw, EPS, gate, up, _down(down, True), torch.full((80,), 1e4, device=DEVICE), sparse=True,
                     fold_into=fold)
    assert torch.equal(fold, torch.zeros_like(fold))
    with pytest.raises(ValueError, match="fold_into is for sparse=True at one token"):
        decode_mlp_block(x, nw, EPS, gate, up, _down(down, True), None, fold_into=fold)
    with pytest.raises(ValueError, match="fold_into is for sparse=True at one token"):
        decode_mlp_block(x.repeat(2, 1), nw, EPS, gate, up, _down(down, True), None, sparse=True,
                         fold_into=fold.repeat(2, 1))
    with pytest.raises(ValueError, match="fold_into must be an fp32 tensor"):
        decode_mlp_block(x, nw, EPS, gate, up, _down(down, True), None, sparse=True, fold_into=fold.double())


def test_sparse_skips_inactive_units_yet_equals_dense_relu():
    """No unit active: the sparse block returns x itself; the dense relu block agrees."""
    x, nw, gate, up, down, _ = _problem(2, 48, 80, torch.float32, seed=9)
    theta = torch.full((80,), 1e4, device=DEVICE)
    for sparse in (True, False):
        assert torch.equal(decode_mlp_block(x, nw, EPS, gate, up, _down(down, True), theta, sparse=sparse), x)


def test_rejects_bad_arguments():
    x, nw, gate, up, down, theta = _problem(2, 48, 80, torch.float32)
    with pytest.raises(ValueError, match="store it transposed"):
        decode_mlp_block(x, nw, EPS, gate, up, down.contiguous(), theta, sparse=True)
    with pytest.raises(ValueError, match="act must be one of"):
        decode_mlp_block(x, nw, EPS, gate, up, down, None, act="gelu")
    with pytest.raises(ValueError, match="threshold needs act='relu'"):
        decode_mlp_block(x, nw, EPS, gate, up, down, theta, act="silu")
    with pytest.raises(ValueError, match="one-token field, got 2 tokens"):  # the dense rows path's K1 too
        launch_dense_mlp_rows_down(x, gate, up, down, theta, act="relu", config=DecodeConfig(stream=True))
    with pytest.raises(ValueError, match="norm_weight must be"):
        decode_mlp_block(x, nw[:-1], EPS, gate, up, down)
    with pytest.raises(ValueError, match="x must be a tensor"):
        decode_mlp_block(x.repeat(40, 1), nw, EPS, gate, up, down)


@pytest.mark.parametrize("m,d", [(1, 48), (3, 300)])
def test_norm_is_hugging_faces_rmsnorm_of_x_plus_pending(m, d):
    """decode_norm: fp32 against fp64; bf16 within two ulps of Hugging Face's RMSNorm in bf16 (its two roundings,
    which the interpreter truncates; the sum of squares in another order), of x + pending with pending, which
    is zeroed (x and pending multiples of 1/8 below 16: every sum exact, as the interpreter truncates roundings)."""
    g = torch.Generator().manual_seed(m * d)
    x, w = torch.randint(-64, 64, (m, d), generator=g) / 8, 1 + 0.3 * torch.randn(d, generator=g)
    pending = torch.randint(-64, 64, (m, d), generator=g) / 8
    got = decode_norm(x.to(DEVICE), w.to(DEVICE), EPS)
    ref = _norm(x.double(), w.double())
    assert (got.cpu().double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    for with_pending in (False, True):
        xb, wb, pb = x.bfloat16().to(DEVICE), w.bfloat16().to(DEVICE), pending.to(DEVICE)
        inp = (xb.float() + pb).bfloat16() if with_pending else xb
        hf = wb * (inp.float() * torch.rsqrt(inp.float().pow(2).mean(-1, keepdim=True) + EPS)).bfloat16()
        got = decode_norm(xb, wb, EPS, pending=pb if with_pending else None)
        ulp = torch.finfo(torch.bfloat16).eps
        assert ((got.float() - hf.float()).abs() <= 2 * ulp * hf.float().abs() + 1e-30).all()
        assert not pb.any() if with_pending else torch.equal(pb, pending.to(DEVICE))


def test_norm_rejects_bad_arguments():
    x, w = torch.randn(2, 48, device=DEVICE), torch.randn(48, device=DEVICE)
    with pytest.raises(ValueError, match="norm_weight must be a tensor of shape"):
        decode_norm(x, w[:-1], EPS)
    with pytest.raises(ValueError, match="norm_weight must be torch.float32"):
        decode_norm(x, w.half(), EPS)
    with pytest.raises(ValueError, match="pending must be an fp32 tensor"):
        decode_norm(x, w, EPS, pending=x[:1])
    with pytest.raises(ValueError, match="eps must be a number"):
        decode_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="x must have unit stride"):
        decode_norm(torch.randn(48, 2, device=DEVICE).t(), w, EPS)
