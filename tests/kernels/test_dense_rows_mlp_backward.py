"""dense_rows_mlp_backward: dx and the weight-gradient terms of device-flagged rows, against float64.

The reference is the backward of loss = Σ (y ⊙ dy) + l1_grad Σ |h| over the flagged rows (the
formulas of the kernel module's docstring, in float64). Checks, for dx in the flagged rows and for
the three fp32 accumulators (pre-filled with random values, so the += is checked):
  - flash-attention rule: max|out - ref| <= 2 max|torch_lowp - ref| + floor, torch_lowp being
    torch autograd of the same loss in the low dtype;
  - per element: |out - ref| <= eps·|ref| + 1e-4·mag + tiny, mag the float64 sum of |terms| (the
    hi + lo splits lose at most 2^-14 relative on the interpreter's truncating casts; dx is rounded
    once, one ulp on the interpreter), plus 2^-22·|prefill| for the accumulators' fp32 addition;
  - unflagged rows of dx_out keep their bytes (random bits, NaN patterns included); with no flagged
    row the accumulators keep theirs;
  - two runs give identical bits.
Random problems keep g - θ and u away from 0 by more than fp32 can blur (rows are redrawn), so the
relu mask and sign(h) are the same in fp32 and float64; values exactly at θ are tested with
small integers, where every intermediate is exact and the results must match bit for bit.

Problems are built on the CPU, run on DEVICE (the interpreter on CPU, tests/conftest.py), and
compared on the CPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from sparseffn.kernels.dense_rows_mlp import _compact_rows_kernel
from sparseffn.kernels.dense_rows_mlp_backward import (_dense_rows_mlp_backward_dw_kernel,
                                                       _dense_rows_mlp_backward_dx_kernel, dense_rows_mlp_backward)
from sparseffn.kernels.configs.dense_rows_mlp_backward import DenseRowsBackwardConfig, default_backward_config
from tests.kernels.compile_specs.dense_rows_mlp_backward import compile_specs
from tests.kernels.jit import do_not_specialize, positional_args

pytestmark = pytest.mark.filterwarnings(  # triton's interpreter turns 1-element arrays into ints
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning",
    "ignore:invalid value encountered:RuntimeWarning",  # NaN inputs in the interpreter's numpy
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16]
# exercises every loop: several row blocks, H chunks, K steps, dx slices, dw slices and D groups
SMALL = DenseRowsBackwardConfig(block_r=8, block_h=32, block_k=32, block_dx=32, num_warps=4, num_stages=2,
                                block_h_w=32, block_r_w=16, block_k_w=32, block_dw=32, num_warps_w=4,
                                num_stages_w=2, d_groups=2)
ACC_NAMES = ("grad_gate_acc", "grad_up_acc", "grad_down_t_acc")


# ----------------------------------------------------------------------------------------------------
# problem, reference, checker


def _copy(t):
    """A copy of t on DEVICE with t's strides and storage offset."""
    if t is None:
        return None
    flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())  # the whole storage, 1-D
    return flat.to(DEVICE, copy=True).as_strided(t.shape, t.stride(), t.storage_offset())


def _sentinel(m, d, dtype, gen):
    """[M, D] of random bits in `dtype` (NaNs and infs included)."""
    return torch.randint(-(2**15), 2**15, (m, d), generator=gen, dtype=torch.int16).view(dtype)


def _flags(m, kind):
    if kind == "none":
        return torch.zeros(m, dtype=torch.bool)
    if kind == "all":
        return torch.ones(m, dtype=torch.bool)
    return torch.tensor([i % 3 == 0 for i in range(m)])  # rows 0, 3, 6, ...: a third


def _strided_rows(t, extra, gen):
    """t as a column slice [:, 1:1+D] of a wider buffer (row stride D + extra, a 1-element offset)."""
    m, d = t.shape
    wide = torch.randn(m, d + extra, generator=gen).to(t.dtype)
    wide[:, 1:d + 1] = t
    return wide[:, 1:d + 1]


def _problem(m, d, h, dtype, gated, threshold, gen):
    """x, dy, gate (or None), up, down_t, theta: g - θ and u at least 1e-5 of their |terms| from 0
    in every row (rows of x redrawn until so), so fp32 and float64 agree on relu masks and signs."""
    gate = (torch.randn(h, d, generator=gen) / d**0.5).to(dtype) if gated else None
    up = (torch.randn(h, d, generator=gen) / d**0.5).to(dtype)
    down_t = (torch.randn(h, d, generator=gen) / h**0.5).to(dtype)
    theta = (torch.randn(h, generator=gen) * 0.3) if threshold else None
    first = gate if gated else up
    x = torch.randn(m, d, generator=gen).to(dtype)
    for _ in range(100):
        x64 = x.double()
        near = (x64 @ first.double().t() - (theta.double() if threshold else 0)).abs() \
            < 1e-5 * (x64.abs() @ first.double().abs().t() + (theta.double().abs() if threshold else 0))
        if gated:
            near |= (x64 @ up.double().t()).abs() < 1e-5 * (x64.abs() @ up.double().abs().t())
        bad = near.any(1)
        if not bad.any():
            break
        x[bad] = torch.randn(int(bad.sum()), d, generator=gen).to(dtype)
    else:
        raise AssertionError("could not draw rows away from the relu / sign boundaries")
    dy = torch.randn(m, d, generator=gen).to(dtype)
    return x, dy, gate, up, down_t, theta


def _reference(x, dy, flags, gate, up, down_t, theta, l1_grad):
    """float64 (dx [R, D], grads {name: [H, D]}) and the matching Σ|terms| bounds, flagged rows."""
    gated = gate is not None
    first = gate if gated else up
    x64, dy64 = x[flags].double(), dy[flags].double()
    xa, dya = x64.abs(), dy64.abs()
    f64, u64, d64 = first.double(), up.double(), down_t.double()
    lg = float(l1_grad) if l1_grad is not None else 0.0
    g = x64 @ f64.t()
    gmag = xa @ f64.abs().t()
    if theta is not None:
        g, gmag = g - theta.double(), gmag + theta.double().abs()
    p = torch.relu(g)
    on = (g > 0).double()
    e = dy64 @ d64.t()
    dhmag = dya @ d64.abs().t() + abs(lg)
    if gated:
        u = x64 @ u64.t()
        umag = xa @ u64.abs().t()
        h, hmag = p * u, gmag * umag
    else:
        h, hmag = p, gmag
    dh = e + lg * torch.sign(h)
    if gated:
        du, dumag = dh * p, dhmag * gmag
        dg, dgmag = dh * u * on, dhmag * umag
        dx = du @ u64 + dg @ f64
        dxmag = dumag @ u64.abs() + dgmag @ f64.abs()
        grads = {"grad_gate_acc": dg.t() @ x64, "grad_up_acc": du.t() @ x64, "grad_down_t_acc": h.t() @ dy64}
        mags = {"grad_gate_acc": dgmag.t() @ xa, "grad_up_acc": dumag.t() @ xa, "grad_down_t_acc": hmag.t() @ dya}
    else:
        df, dfmag = dh * on, dhmag
        dx, dxmag = df @ u64, dfmag @ u64.abs()
        grads = {"grad_up_acc": df.t() @ x64, "grad_down_t_acc": p.t() @ dy64}
        mags = {"grad_up_acc": dfmag.t() @ xa, "grad_down_t_acc": hmag.t() @ dya}
    return dx, dxmag, grads, mags


def _torch_lowp(x, dy, flags, gate, up, down_t, theta, l1_grad):
    """torch autograd of the same loss in the low dtype: (dx [R, D], grads {name: [H, D]}), float64."""
    dtype = x.dtype
    xs = x[flags].clone().requires_grad_()
    weights = {n: w.clone().requires_grad_() for n, w in (("grad_gate_acc", gate), ("grad_up_acc", up),
                                                           ("grad_down_t_acc", down_t)) if w is not None}
    first = weights.get("grad_gate_acc", weights["grad_up_acc"])
    g = F.linear(xs, first)
    if theta is not None:
        g = g - theta.to(dtype)
    h = torch.relu(g)
    if gate is not None:
        h = h * F.linear(xs, weights["grad_up_acc"])
    y = F.linear(h, weights["grad_down_t_acc"].t())
    loss = (y * dy[flags]).sum()
    if l1_grad is not None:
        loss = loss + (float(l1_grad) * h.abs()).sum()
    grads = torch.autograd.grad(loss, [xs, *weights.values()])
    return grads[0].double(), {n: gr.double() for n, gr in zip(weights, grads[1:])}


def _assert_close(out, ref, mag, lowp, eps, what, prefill=None):
    """out, ref, mag, lowp float64 of one shape; prefill: the accumulator's value before the call."""
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    tiny = torch.finfo(torch.float32).tiny
    if prefill is not None:
        ref, lowp = ref + prefill, lowp + prefill
        rounding = 2**-22 * prefill.abs()
    else:
        rounding = torch.zeros_like(ref)
    err = (out - ref).abs()
    bound = 2 * (lowp - ref).abs().max().item() + eps * ref.abs().max().item() + rounding.max().item() + tiny
    assert err.max().item() <= bound, f"{what}: flash rule: max err {err.max().item():.3g} > {bound:.3g}"
    worst = (err - (eps * ref.abs() + 1e-4 * mag + rounding + tiny)).max().item()
    assert worst <= 0, f"{what}: error exceeds eps |ref| + 1e-4 |terms| by {worst:.3g}"


def _accumulators(h, d, gated, gen, *, strided=False, scale=1.0):
    """{name: fp32 [H, D] random prefill} (no grad_gate_acc when non-gated); strided: column
    slices [:, 4:D + 4] of [H, D + 8] buffers: row stride D + 8, a 16-byte offset, as CUDA requires
    of accumulators (it refuses misaligned ones, see test_cuda_refuses_misaligned_accumulators)."""
    accs = {}
    for name in ACC_NAMES if gated else ACC_NAMES[1:]:
        t = torch.randn(h, d + (8 if strided else 0), generator=gen) * scale
        accs[name] = t[:, 4:d + 4] if strided else t
    return accs


def _run(x, dy, flags, gate, up, down_t, theta, l1_grad, dx_out, accs, config=None):
    """The kernel on DEVICE into copies of dx_out and the accumulators (same layouts); returns
    (dx, {name: accumulator}) on the CPU."""
    dx_dev = _copy(dx_out)
    acc_dev = {n: _copy(a) for n, a in accs.items()}
    res = dense_rows_mlp_backward(*(_copy(t) for t in (x, dy, flags, gate, up, down_t, theta, l1_grad)),
                                  dx_out=dx_dev, grad_gate_acc=acc_dev.get("grad_gate_acc"),
                                  grad_up_acc=acc_dev["grad_up_acc"], grad_down_t_acc=acc_dev["grad_down_t_acc"],
                                  config=config)
    assert res is dx_dev
    return res.cpu(), {n: a.cpu() for n, a in acc_dev.items()}


def _check(x, dy, flags, gate, up, down_t, theta, l1_grad, dx_out, accs, dx, acc_out):
    """Every check of the module docstring but determinism, for one finished call."""
    dtype = x.dtype
    assert torch.equal(dx[~flags].view(torch.int16), dx_out[~flags].view(torch.int16)), "unflagged row of dx written"
    if not flags.any():
        for name, a in accs.items():
            assert torch.equal(acc_out[name].view(torch.int32), a.view(torch.int32)), f"{name} changed with no row"
        return
    ref_dx, mag_dx, ref_w, mag_w = _reference(x, dy, flags, gate, up, down_t, theta, l1_grad)
    low_dx, low_w = _torch_lowp(x, dy, flags, gate, up, down_t, theta, l1_grad)
    _assert_close(dx[flags].double(), ref_dx, mag_dx, low_dx, torch.finfo(dtype).eps, "dx")
    for name, a in accs.items():
        _assert_close(acc_out[name].double(), ref_w[name], mag_w[name], low_w[name], 2**-23, name, a.double())


def _check_case(m, d, h, dtype, gated, threshold, flag_kind, *, layout, config, seed, l1=True):
    gen = torch.Generator().manual_seed(seed)
    x, dy, gate, up, down_t, theta = _problem(m, d, h, dtype, gated, threshold, gen)
    flags = _flags(m, flag_kind)
    l1_grad = torch.tensor([0.37]) if l1 else None
    dx_out = _sentinel(m, d, dtype, gen)
    strided = layout == "strided"
    if strided:  # x, dy, dx_out: column slices of wider buffers (odd row strides, 2-byte offsets)
        x, dy, dx_out = _strided_rows(x, 3, gen), _strided_rows(dy, 5, gen), _strided_rows(dx_out, 7, gen)
    accs = _accumulators(h, d, gated, gen, strided=strided)
    dx, acc_out = _run(x, dy, flags, gate, up, down_t, theta, l1_grad, dx_out, accs, config)
    _check(x, dy, flags, gate, up, down_t, theta, l1_grad, dx_out, accs, dx, acc_out)
    return x, dy, flags, gate, up, down_t, theta, l1_grad, dx_out, accs, dx, acc_out


# ----------------------------------------------------------------------------------------------------
# correctness


def _cases():
    """Every (dtype, gated, threshold, flags) with M, D, H, the layout and the config rotating
    over them (each value meets each flags kind), plus M = 1 and the no-L1 variant."""
    cases = []
    shapes = ((40, 72, 160), (7, 64, 100), (33, 64, 160), (1, 72, 100))
    layouts = ("contiguous", "strided")
    for i, (dtype, gated, threshold, flag_kind) in enumerate(itertools.product(
            DTYPES, (True, False), (False, True), ("none", "some", "all"))):
        m, d, h = shapes[(i // 3) % 4]
        if m == 1 and flag_kind == "some":
            flag_kind = "all"
        config = SMALL if (i // 3) % 3 == 1 else None
        cases.append((m, d, h, dtype, gated, threshold, flag_kind, layouts[i % 2], config, True, i))
    for j, (dtype, gated) in enumerate(itertools.product(DTYPES, (True, False))):
        cases.append((5, 64, 100, dtype, gated, True, "some", "contiguous", None, False, 100 + j))  # no L1
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda c: "M{}-D{}-H{}-{}-{}-{}-{}-{}-{}-{}".format(
    c[0], c[1], c[2], str(c[3])[6:], "gated" if c[4] else "nongated", "theta" if c[5] else "nothr", c[6], c[7],
    "small" if c[8] else "default", "l1" if c[9] else "nol1"))
def test_matches_float64_reference(case):
    m, d, h, dtype, gated, threshold, flag_kind, layout, config, l1, seed = case
    _check_case(m, d, h, dtype, gated, threshold, flag_kind, layout=layout, config=config, seed=seed, l1=l1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_exact_at_threshold_small_integers(dtype, gated):
    """Small integers make every intermediate exact in fp32 (and the hi + lo splits exact), so dx
    and the accumulators must equal the float64 formulas bit for bit. θ_j equals g[0, j] for half
    the units (relu'(0) = 0, sign(0) = 0: no dg, du or L1 term there) and other rows land on both
    sides of θ; l1_grad = 1/8 gives dh a fractional part the 16-bit operands alone would lose."""
    m, d, h = 12, 24, 40
    gen = torch.Generator().manual_seed(11 if gated else 12)

    def ints(*shape, lo=-1, hi=2, density=0.3):
        v = torch.randint(lo, hi, shape, generator=gen).float()
        return v * (torch.rand(shape, generator=gen) < density)

    x = ints(m, d, density=0.6)
    first, up, down_t = ints(h, d), ints(h, d), ints(h, d)
    dy = ints(m, d, density=0.6)
    g = x @ first.t()
    theta = torch.randint(-1, 2, (h,), generator=gen).float()
    theta[::2] = g[0, ::2]  # exactly at θ in row 0 for every other unit
    x, first, up, down_t, dy = (t.to(dtype) for t in (x, first, up, down_t, dy))
    gate, up = (first, up) if gated else (None, first)
    flags = torch.ones(m, dtype=torch.bool)
    flags[5] = False
    l1_grad = torch.tensor([0.125])
    g_theta = g[flags] - theta
    assert (g_theta == 0).sum() >= h // 2 and (g_theta > 0).any() and (g_theta < 0).any()
    gen_fill = torch.Generator().manual_seed(0)
    accs = {n: torch.randint(-4, 5, (h, d), generator=gen_fill).float() for n in
            (ACC_NAMES if gated else ACC_NAMES[1:])}
    dx_out = _sentinel(m, d, dtype, gen_fill)
    dx, acc_out = _run(x, dy, flags, gate, up, down_t, theta, l1_grad, dx_out, accs, SMALL)
    ref_dx, _, ref_w, _ = _reference(x, dy, flags, gate, up, down_t, theta, l1_grad)
    assert torch.equal(ref_dx.to(dtype).double(), ref_dx), "test data: dx not exact in the dtype"
    assert torch.equal(dx[flags], ref_dx.to(dtype))
    assert torch.equal(dx[~flags].view(torch.int16), dx_out[~flags].view(torch.int16))
    for name, a in accs.items():
        expect = a.double() + ref_w[name]
        assert torch.equal(expect.float().double(), expect), "test data: gradient not exact in fp32"
        assert torch.equal(acc_out[name], expect.float()), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp32_operands_keep_their_bits(dtype):
    """dh = 1 + 2^-12 (l1_grad = 2^-12, e = 1) needs 13 significant bits: a 16-bit du, dg or h would
    lose the 2^-12 (bf16 and fp16 both), the hi + lo splits carry it exactly into the fp32
    accumulators. h = 2^20 is past fp16's range (fp16 terms are scaled by powers of two)."""
    d, h, m = 16, 16, 2
    x = torch.zeros(m, d)
    x[:, 0] = 2.0**8
    gate = torch.zeros(h, d)
    gate[0, 0] = 4.0  # g0 = 2^10
    up = torch.zeros(h, d)
    up[0, 0] = 4.0  # u0 = 2^10: h0 = 2^20
    down_t = torch.zeros(h, d)
    down_t[0, 1] = 1.0
    dy = torch.zeros(m, d)
    dy[:, 1] = 1.0  # e0 = 1
    x, gate, up, down_t, dy = (t.to(dtype) for t in (x, gate, up, down_t, dy))
    l1_grad = torch.tensor([2.0**-12])
    flags = torch.ones(m, dtype=torch.bool)
    accs = {n: torch.zeros(h, d) for n in ACC_NAMES}
    dx, acc_out = _run(x, dy, flags, gate, up, down_t, None, l1_grad, torch.zeros(m, d, dtype=dtype), accs)
    dh = 1.0 + 2.0**-12
    # du0 = dh·p0 = dh·2^10 = dg0 = dh·u0; Σ_rows du0·x = 2·dh·2^18; Σ_rows h0·dy = 2·2^20
    assert acc_out["grad_up_acc"][0, 0].item() == m * dh * 2.0**18
    assert acc_out["grad_gate_acc"][0, 0].item() == m * dh * 2.0**18
    assert acc_out["grad_down_t_acc"][0, 1].item() == m * 2.0**20
    for name in ACC_NAMES:
        assert torch.count_nonzero(acc_out[name]) == 1, name
    # dx[:, 0] = du0·up[0, 0] + dg0·gate[0, 0] = dh·2^13: rounded once (the interpreter truncates)
    ulp = 2.0**13 * torch.finfo(dtype).eps
    assert ((dx[:, 0].double() - dh * 2.0**13).abs() <= ulp).all(), dx[:, 0]
    assert torch.count_nonzero(dx[:, 1:]) == 0


def test_checker_fails_when_a_flagged_row_is_skipped():
    """The checks are not vacuous: leave one flagged row out of the kernel's flags and the
    comparison over the intended flagged rows fails, for dx and for the accumulators."""
    case = _check_case(7, 64, 100, torch.bfloat16, True, True, "some", layout="contiguous", config=None, seed=5)
    x, dy, flags, gate, up, down_t, theta, l1_grad, dx_out, accs, dx, acc_out = case
    fewer = flags.clone()
    fewer[int(flags.nonzero()[-1])] = False
    # dx_out of zeros: the skipped row is finite (zeros), so only the comparison can fail
    dx_skip, acc_skip = _run(x, dy, fewer, gate, up, down_t, theta, l1_grad, torch.zeros_like(dx_out), accs)
    ref_dx, mag_dx, ref_w, mag_w = _reference(x, dy, flags, gate, up, down_t, theta, l1_grad)
    low_dx, low_w = _torch_lowp(x, dy, flags, gate, up, down_t, theta, l1_grad)
    _assert_close(dx[flags].double(), ref_dx, mag_dx, low_dx, 2**-7, "dx")  # the full run passes
    with pytest.raises(AssertionError):
        _assert_close(dx_skip[flags].double(), ref_dx, mag_dx, low_dx, 2**-7, "dx")
    for name in ACC_NAMES:
        with pytest.raises(AssertionError):
            _assert_close(acc_skip[name].double(), ref_w[name], mag_w[name], low_w[name], 2**-23, name,
                          accs[name].double())
    # and an l1 term left out is caught too
    dx_nol1, acc_nol1 = _run(x, dy, flags, gate, up, down_t, theta, torch.zeros(1), dx_out, accs)
    with pytest.raises(AssertionError):
        _assert_close(acc_nol1["grad_up_acc"].double(), ref_w["grad_up_acc"], mag_w["grad_up_acc"],
                      low_w["grad_up_acc"], 2**-23, "grad_up_acc", accs["grad_up_acc"].double())


def test_deterministic_bits():
    """Two runs (SMALL: several programs per kernel, every loop taken) give identical bits."""
    gen = torch.Generator().manual_seed(21)
    m, d, h, dtype = 40, 72, 100, torch.bfloat16
    x, dy, gate, up, down_t, theta = _problem(m, d, h, dtype, True, True, gen)
    flags = _flags(m, "some")
    accs = _accumulators(h, d, True, gen)
    dx_out = _sentinel(m, d, dtype, gen)
    runs = [_run(x, dy, flags, gate, up, down_t, theta, torch.tensor([0.37]), dx_out, accs, SMALL) for _ in range(2)]
    assert torch.equal(runs[0][0].view(torch.int16), runs[1][0].view(torch.int16))
    for name in ACC_NAMES:
        assert torch.equal(runs[0][1][name].view(torch.int32), runs[1][1][name].view(torch.int32))


def test_flags_dtypes_strides_and_l1_grad_shapes():
    """Integer flags (any non-zero value), strided flags, a 0-d l1_grad."""
    gen = torch.Generator().manual_seed(4)
    m, d, h, dtype = 9, 64, 100, torch.float16
    x, dy, gate, up, down_t, theta = _problem(m, d, h, dtype, False, True, gen)
    flagged = torch.tensor([1, 0, 0, 1, 1, 0, 0, 0, 1], dtype=torch.bool)
    flags = torch.zeros(2 * m, dtype=torch.int64)[::2]
    flags[flagged] = -3
    accs = _accumulators(h, d, False, gen)
    dx_out = _sentinel(m, d, dtype, gen)
    dx, acc_out = _run(x, dy, flags, None, up, down_t, theta, torch.tensor(0.37), dx_out, accs)
    _check(x, dy, flagged, None, up, down_t, theta, torch.tensor([0.37]), dx_out, accs, dx, acc_out)


def test_nan_row_is_its_own_in_dx():
    """A NaN in one flagged token reaches that token's dx and no other token's, even inside one row
    block; a transposed x (non-unit stride along D) works."""
    gen = torch.Generator().manual_seed(9)
    m, d, h, dtype = 6, 64, 100, torch.bfloat16
    x, dy, gate, up, down_t, theta = _problem(m, d, h, dtype, True, False, gen)
    x[2, 7] = float("nan")
    flags = torch.ones(m, dtype=torch.bool)
    accs = _accumulators(h, d, True, gen)
    xt = x.t().contiguous().t()
    assert xt.stride(1) != 1
    dx, _ = _run(xt, dy, flags, gate, up, down_t, theta, torch.tensor([0.37]), torch.zeros(m, d, dtype=dtype), accs)
    assert torch.isnan(dx[2]).all()
    others = torch.arange(m) != 2
    ref_dx, mag_dx, _, _ = _reference(x[others], dy[others], flags[others], gate, up, down_t, theta,
                                      torch.tensor([0.37]))
    low_dx, _ = _torch_lowp(x[others], dy[others], flags[others], gate, up, down_t, theta, torch.tensor([0.37]))
    _assert_close(dx[others].double(), ref_dx, mag_dx, low_dx, 2**-7, "dx")


def test_empty_shapes_and_no_units():
    dtype = torch.bfloat16
    w = torch.zeros(16, 64, dtype=dtype)
    acc = {n: torch.zeros(16, 64) for n in ACC_NAMES}
    dx, _ = _run(torch.empty(0, 64, dtype=dtype), torch.empty(0, 64, dtype=dtype), torch.empty(0, dtype=torch.bool),
                 w, w, w, None, torch.zeros(1), torch.empty(0, 64, dtype=dtype), acc)
    assert dx.shape == (0, 64)
    w0 = torch.zeros(16, 0, dtype=dtype)
    acc0 = {n: torch.zeros(16, 0) for n in ACC_NAMES}
    dx, _ = _run(torch.empty(3, 0, dtype=dtype), torch.empty(3, 0, dtype=dtype), torch.ones(3, dtype=torch.bool),
                 w0, w0, w0, None, torch.zeros(1), torch.empty(3, 0, dtype=dtype), acc0)
    assert dx.shape == (3, 0)
    # H = 0: flagged rows of dx are the empty sum, zeros; the others keep their bytes
    wh = torch.zeros(0, 64, dtype=dtype)
    acch = {n: torch.zeros(0, 64) for n in ACC_NAMES}
    dx_out = torch.full((3, 64), 5.0, dtype=dtype)
    dx, _ = _run(torch.randn(3, 64).to(dtype), torch.randn(3, 64).to(dtype), torch.tensor([True, False, True]),
                 wh, wh, wh, None, torch.ones(1), dx_out, acch)
    assert torch.equal(dx[[0, 2]], torch.zeros(2, 64, dtype=dtype)) and torch.equal(dx[1], dx_out[1])


# ----------------------------------------------------------------------------------------------------
# no host synchronisation (GPU only)


def _gpu_problem(m=300, d=128, h=384, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, dy, gate, up, down_t, theta = _problem(m, d, h, dtype, True, True, gen)
    return x, dy, gate, up, down_t, theta, _accumulators(h, d, True, gen)


def _call_on(dev_tensors, flags, l1_grad, dx_out, accs):
    x, dy, gate, up, down_t, theta = dev_tensors
    dense_rows_mlp_backward(x, dy, flags, gate, up, down_t, theta, l1_grad, dx_out=dx_out,
                            grad_gate_acc=accs["grad_gate_acc"], grad_up_acc=accs["grad_up_acc"],
                            grad_down_t_acc=accs["grad_down_t_acc"])


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_no_host_sync():
    """torch's sync debug mode raises on any synchronising torch op inside the call."""
    *tensors, accs = _gpu_problem()
    tensors = [t.cuda() for t in tensors]
    accs = {n: a.cuda() for n, a in accs.items()}
    flags = torch.rand(tensors[0].shape[0], device="cuda") < 0.1
    l1_grad = torch.full((1,), 0.37, device="cuda")
    dx = torch.zeros_like(tensors[0])
    _call_on(tensors, flags, l1_grad, dx, accs)  # compile outside the checked region
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _call_on(tensors, flags, l1_grad, dx, accs)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_cuda_graph_capture_and_replay_with_new_flags():
    """The call captures into a CUDA graph and a replay follows whatever flags and l1_grad the
    device holds: none (nothing written), some, all."""
    *cpu, accs0 = _gpu_problem()
    x_cpu = cpu[0]
    m, d = x_cpu.shape
    dev = [t.cuda() for t in cpu]
    flags = torch.zeros(m, dtype=torch.bool, device="cuda")
    l1_grad = torch.zeros(1, device="cuda")
    dx = torch.zeros(m, d, dtype=x_cpu.dtype, device="cuda")
    accs = {n: a.cuda() for n, a in accs0.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) on the capture stream
        _call_on(dev, flags, l1_grad, dx, accs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _call_on(dev, flags, l1_grad, dx, accs)
    gen = torch.Generator().manual_seed(3)
    for new_flags, lg in ((torch.zeros(m, dtype=torch.bool), 0.5), (torch.rand(m, generator=gen) < 0.2, 0.37),
                          (torch.ones(m, dtype=torch.bool), -0.25)):
        sentinel = _sentinel(m, d, x_cpu.dtype, gen)
        flags.copy_(new_flags)
        l1_grad.fill_(lg)
        dx.copy_(sentinel)
        for n, a in accs0.items():
            accs[n].copy_(a)
        graph.replay()
        x, dy, gate, up, down_t, theta = cpu
        _check(x, dy, new_flags, gate, up, down_t, theta, torch.tensor([lg]), sentinel, accs0, dx.cpu(),
               {n: a.cpu() for n, a in accs.items()})


def test_m_adds_no_specialization():
    """The kernels never see M, the scan has M do_not_specialize, the config depends on D only;
    on a GPU the compiled-kernel caches must not grow with M."""
    assert "M" in do_not_specialize(_compact_rows_kernel)
    assert "m" not in positional_args(default_backward_config)
    if not CUDA:
        return
    *tensors, accs = _gpu_problem()
    tensors = [t.cuda() for t in tensors]
    accs = {n: a.cuda() for n, a in accs.items()}
    kernels = (_compact_rows_kernel, _dense_rows_mlp_backward_dx_kernel, _dense_rows_mlp_backward_dw_kernel)

    def call(m):
        x, dy = tensors[0][:m], tensors[1][:m]
        _call_on([x, dy, *tensors[2:]], torch.ones(m, dtype=torch.bool, device="cuda"),
                 torch.zeros(1, device="cuda"), torch.empty_like(x), accs)

    call(17)
    before = [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]
    for m in (1, 2, 16, 33, 128, 300):
        call(m)
    after = [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]
    assert after == before


# ----------------------------------------------------------------------------------------------------
# inputs, config, compile coverage


def _valid_args(m=3, d=64, h=32, dtype=torch.bfloat16):
    w = torch.zeros(h, d, dtype=dtype)
    return dict(x=torch.zeros(m, d, dtype=dtype), dy=torch.zeros(m, d, dtype=dtype),
                row_flags=torch.zeros(m, dtype=torch.bool), gate_weight=w, up_weight=w, down_weight_t=w,
                threshold=None, l1_grad=torch.zeros(1), dx_out=torch.zeros(m, d, dtype=dtype),
                grad_gate_acc=torch.zeros(h, d), grad_up_acc=torch.zeros(h, d), grad_down_t_acc=torch.zeros(h, d))


@pytest.mark.parametrize("change, error, match", [
    (dict(x=torch.zeros(3, 64)), TypeError, "x must be torch.bfloat16"),
    (dict(dy=torch.zeros(3, 64, dtype=torch.float16)), TypeError, "dy must have x's dtype"),
    (dict(dy=torch.zeros(4, 64, dtype=torch.bfloat16)), ValueError, "dy must have shape"),
    (dict(row_flags=torch.zeros(4, dtype=torch.bool)), ValueError, "row_flags must have shape"),
    (dict(row_flags=torch.zeros(3)), TypeError, "row_flags must be bool"),
    (dict(gate_weight=torch.zeros(33, 64, dtype=torch.bfloat16)), ValueError, "gate_weight must have shape"),
    (dict(up_weight=torch.zeros(64, 32, dtype=torch.bfloat16).t()), ValueError, "up_weight must have unit stride"),
    (dict(threshold=torch.zeros(32, dtype=torch.float64)), TypeError, "threshold must be torch.float32"),
    (dict(l1_grad=torch.zeros(1, dtype=torch.float64)), TypeError, "l1_grad must be torch.float32"),
    (dict(l1_grad=torch.zeros(2)), ValueError, "l1_grad must have shape"),
    (dict(l1_grad=0.5), TypeError, "l1_grad must be None or a torch.Tensor"),
    (dict(dx_out=torch.zeros(3, 63, dtype=torch.bfloat16)), ValueError, "dx_out must have shape"),
    (dict(dx_out=torch.zeros(64, 3, dtype=torch.bfloat16).t()), ValueError, "dx_out must have unit stride"),
    (dict(grad_gate_acc=None), TypeError, "grad_gate_acc must be a torch.Tensor"),
    (dict(gate_weight=None), ValueError, "grad_gate_acc must be None when gate_weight is None"),
    (dict(grad_up_acc=torch.zeros(32, 64, dtype=torch.bfloat16)), TypeError, "grad_up_acc must be torch.float32"),
    (dict(grad_down_t_acc=torch.zeros(32, 65)), ValueError, r"grad_down_t_acc must have shape \[H, D\]"),
    (dict(grad_up_acc=torch.zeros(64, 32).t()), ValueError, "grad_up_acc must have unit stride"),
    (dict(config=dict(block_r=16)), TypeError, "config"),
    ("dx_is_x", ValueError, "dx_out must not share memory with x"),
    ("acc_is_acc", ValueError, "grad_up_acc must not share memory with grad_down_t_acc"),
])
def test_input_errors(change, error, match):
    args = {k: v.to(DEVICE) if v is not None else None for k, v in _valid_args().items()}
    if change == "dx_is_x":
        change = dict(dx_out=args["x"])
    elif change == "acc_is_acc":
        change = dict(grad_up_acc=args["grad_down_t_acc"])
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in change.items()})
    config = args.pop("config", None)
    with pytest.raises(error, match=match):
        dense_rows_mlp_backward(args["x"], args["dy"], args["row_flags"], args["gate_weight"], args["up_weight"],
                                args["down_weight_t"], args["threshold"], args["l1_grad"], dx_out=args["dx_out"],
                                grad_gate_acc=args["grad_gate_acc"], grad_up_acc=args["grad_up_acc"],
                                grad_down_t_acc=args["grad_down_t_acc"], config=config)


def test_config_validation_and_default():
    with pytest.raises(ValueError, match="block_r"):
        DenseRowsBackwardConfig(block_r=4)
    with pytest.raises(ValueError, match="block_r_w"):
        DenseRowsBackwardConfig(block_r_w=8)
    with pytest.raises(ValueError, match="block_dw"):
        DenseRowsBackwardConfig(block_dw=48)
    with pytest.raises(ValueError, match="d_groups"):
        DenseRowsBackwardConfig(d_groups=0)
    cfg = default_backward_config(2048, cuda=True)
    assert (cfg.block_r, cfg.block_dx, cfg.num_warps, cfg.block_h_w, cfg.block_dw) == (16, 256, 8, 64, 128)
    assert default_backward_config(16, cuda=True).block_dx == 64  # the wgmma minimum


def test_compile_specs_cover_launcher_variants():
    """The GPU compile list has both kernels for both dtypes, gated and not, threshold on and
    off, with and without l1_grad, aligned (the only CUDA path)."""
    seen = set()
    for fn, signature, constexprs in compile_specs():
        assert set(constexprs) <= {k for k, v in signature.items() if v == "constexpr"}
        assert constexprs["ALIGNED"] and not constexprs["DOT_IN_FP32"]
        seen.add((fn.__name__, signature["x_ptr"], constexprs["GATED"], constexprs["HAS_THRESHOLD"],
                  constexprs["HAS_L1"]))
    for fn in (_dense_rows_mlp_backward_dx_kernel, _dense_rows_mlp_backward_dw_kernel):
        for ty, gated, thr in itertools.product(("*bf16", "*fp16"), (True, False), (True, False)):
            assert (fn.__name__, ty, gated, thr, True) in seen
            assert (fn.__name__, ty, gated, True, False) in seen
    assert all(len(spec) == 4 for spec in compile_specs(with_options=True))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_refuses_the_unaligned_path():
    x = torch.randn(4, 100, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16, 100, device="cuda", dtype=torch.bfloat16)
    accs = [torch.zeros(16, 100, device="cuda") for _ in range(3)]
    with pytest.raises(NotImplementedError, match="D % 8 == 0"):
        dense_rows_mlp_backward(x, x.clone(), torch.ones(4, dtype=torch.bool, device="cuda"), w, w, w, None, None,
                                dx_out=torch.empty_like(x), grad_gate_acc=accs[0], grad_up_acc=accs[1],
                                grad_down_t_acc=accs[2])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_refuses_misaligned_accumulators():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    wide = torch.zeros(16, 68, device="cuda")
    accs = [wide[:, 2:66], torch.zeros(16, 64, device="cuda"), torch.zeros(16, 64, device="cuda")]
    with pytest.raises(NotImplementedError, match="grad_gate_acc with a 16-byte aligned base"):
        dense_rows_mlp_backward(x, x.clone(), torch.ones(4, dtype=torch.bool, device="cuda"),
                                w, w, w, None, None, dx_out=torch.empty_like(x), grad_gate_acc=accs[0],
                                grad_up_acc=accs[1], grad_down_t_acc=accs[2])
