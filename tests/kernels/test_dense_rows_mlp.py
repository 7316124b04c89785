"""dense_rows_mlp: the dense MLP on device-flagged rows, against a float64 reference.

The optional row_l1 output (Σ_j |h_j| per flagged row, fp32) is checked the same way: flash rule
against torch's Σ|h| in the low dtype, and per row `|l1 - ref| <= 1e-5 (ref + Σ_j mag_j) + tiny`
(fp32 h and sum); unflagged entries keep their bits; y is bit-identical with and without it.

Flagged rows follow the flash-attention rule `max|out - ref| <= 2 max|torch_lowp - ref| + floor`
and, per element, `|out - ref| <= eps·|ref| + 1e-4·mag` (mag = Σ |terms|): y is rounded once (the
interpreter truncates: one ulp), and 1e-4 covers fp32 accumulation plus the hi + lo split of h
(worst case 2^-14 relative on the interpreter's truncating casts). Unflagged rows of `out` must keep
their bytes exactly: `out` is pre-filled with random bits (NaN patterns included) and compared as
int16. test_h_stays_fp32 isolates the precision of h (a cancellation no 16-bit h survives).

Problems are built on the CPU, run on DEVICE (the interpreter on CPU, tests/conftest.py), and
compared on the CPU.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from sparseffn.kernels.dense_rows_mlp import _compact_rows_kernel, dense_rows_mlp
from sparseffn.kernels.configs.dense_rows_mlp import DenseRowsConfig, default_config
from tests.kernels.compile_specs.dense_rows_mlp import compile_specs
from tests.kernels.jit import do_not_specialize, positional_args

pytestmark = pytest.mark.filterwarnings(  # triton's interpreter turns 1-element arrays into ints
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning",
    "ignore:invalid value encountered:RuntimeWarning",  # NaN inputs in the interpreter's numpy
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16]
# exercises every loop: several row blocks, K steps, H chunks and D slices at the test shapes
SMALL = DenseRowsConfig(block_r=8, block_h=32, block_k=32, block_dy=32, num_warps=4, num_stages=2)


# ----------------------------------------------------------------------------------------------------
# problem, reference, checker


def _weights(d, h, dtype, gated, gen, *, interleaved):
    """(gate, up, down_t, keep-alive): down_t = down_proj.weight^T [H, D]. interleaved: up and
    down_t are views of one [H, 2, D] (gated) / [H, 1, D] (non-gated) tensor, as the TwELL MLP
    holds them (row stride 2·D / D)."""
    gate = (torch.randn(h, d, generator=gen) / d**0.5).to(dtype) if gated else None
    up = (torch.randn(h, d, generator=gen) / d**0.5).to(dtype)
    down_t = (torch.randn(h, d, generator=gen) / h**0.5).to(dtype)
    if not interleaved:
        return gate, up, down_t
    if gated:
        up_down = torch.stack((up, down_t), 1)  # [H, 2, D]
        return gate, up_down[:, 0], up_down[:, 1]
    up_down = down_t.unsqueeze(1).contiguous()  # [H, 1, D]
    return gate, up, up_down[:, 0]


def _reference(x, gate, up, down_t, theta):
    """(float64 truth, Σ|terms| bound, torch in the low dtype), all [M, D]."""
    first = gate if gate is not None else up
    x64, f64, u64, d64 = x.double(), first.double(), up.double(), down_t.double()
    g = x64 @ f64.t()
    gmag = x64.abs() @ f64.abs().t()
    glow = F.linear(x, first)
    if theta is not None:
        g = g - theta.double()
        gmag = gmag + theta.double().abs()
        glow = glow - theta.to(x.dtype)
    h, hmag, hlow = torch.relu(g), gmag, torch.relu(glow)
    if gate is not None:
        h = h * (x64 @ u64.t())
        hmag = hmag * (x64.abs() @ u64.abs().t())
        hlow = hlow * F.linear(x, up)
    return h @ d64, hmag @ d64.abs(), F.linear(hlow, down_t.t()).double()


def _assert_close(out, ref, mag, lowp, rows, dtype):
    """Flagged rows `rows` of out against the reference (module docstring)."""
    out, ref, mag, lowp = out[rows].double(), ref[rows], mag[rows], lowp[rows]
    assert torch.isfinite(out).all(), "non-finite output in a flagged row"
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    err = (out - ref).abs()
    bound = 2 * (lowp - ref).abs().max().item() + eps * ref.abs().max().item() + tiny
    assert err.max().item() <= bound, f"flash rule: max err {err.max().item():.3g} > {bound:.3g}"
    worst = (err - (eps * ref.abs() + 1e-4 * mag + tiny)).max().item()
    assert worst <= 0, f"error exceeds one {dtype} ulp + 1e-4 |terms| by {worst:.3g}"


def _sentinel(m, d, dtype, gen):
    """[M, D] of random bits in `dtype` (NaNs and infs included)."""
    return torch.randint(-(2**15), 2**15, (m, d), generator=gen, dtype=torch.int16).view(dtype)


def _flags(m, kind):
    if kind == "none":
        return torch.zeros(m, dtype=torch.bool)
    if kind == "all":
        return torch.ones(m, dtype=torch.bool)
    return torch.tensor([(i * 5) % 3 == 0 for i in range(m)])  # rows 0, 3, 6, ...: a third


def _copy(t):
    """A copy of t on DEVICE with t's strides and storage offset (views such as up_down[:, 0] and
    column slices keep their layout)."""
    if t is None:
        return None
    flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())  # the whole storage, 1-D
    return flat.to(DEVICE, copy=True).as_strided(t.shape, t.stride(), t.storage_offset())


def _run(x, flags, gate, up, down_t, theta, out, config=None):
    """dense_rows_mlp on DEVICE into a copy of `out` (same layout); returns the result on the CPU."""
    out_dev = _copy(out)
    res = dense_rows_mlp(*(_copy(t) for t in (x, flags, gate, up, down_t, theta)), out_dev, config=config)
    assert res is out_dev
    return res.cpu()


def _check_case(m, d, h, dtype, gated, threshold, flag_kind, *, layout, config, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen).to(dtype)
    if layout == "strided":  # rows of a wider buffer: row stride d + 3, a 2-byte offset
        x = torch.cat([torch.zeros(m, 1, dtype=dtype), x, torch.zeros(m, 2, dtype=dtype)], 1)[:, 1:d + 1]
    gate, up, down_t = _weights(d, h, dtype, gated, gen, interleaved=layout == "interleaved")
    theta = (torch.randn(h, generator=gen) * 0.3) if threshold else None
    flags = _flags(m, flag_kind)
    out = _sentinel(m, d, dtype, gen)
    if layout == "strided":  # out: a column slice of a wider buffer
        out = torch.cat([_sentinel(m, 5, dtype, gen), out], 1)[:, 5:]
    y = _run(x, flags, gate, up, down_t, theta, out, config)
    assert torch.equal(y[~flags].view(torch.int16), out[~flags].view(torch.int16)), "unflagged row written"
    if flags.any():
        _assert_close(y, *_reference(x, gate, up, down_t, theta), flags, dtype)
    return x, flags, gate, up, down_t, theta, out, y


# ----------------------------------------------------------------------------------------------------
# correctness


def _cases():
    """Every (M, D, H, dtype, gated, threshold, flags); the layout (contiguous, interleaved up_down
    views, strided x and out) and the config (default, SMALL) rotate over them."""
    cases = []
    layouts = ("interleaved", "contiguous", "strided")
    for i, (m, d, h, dtype, gated, threshold, flag_kind) in enumerate(itertools.product(
            (1, 7, 40), (64, 72), (100, 160), DTYPES, (True, False), (False, True), ("none", "some", "all"))):
        if m == 1 and flag_kind == "some":
            continue  # "some" of one row is row 0: the same as "all"
        # i // 3 steps once per flags triple, so layouts and configs meet every flags kind
        layout, config = layouts[(i // 3) % 3], SMALL if (i // 3) % 4 in (1, 2) else None
        cases.append((m, d, h, dtype, gated, threshold, flag_kind, layout, config))
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda c: "M{}-D{}-H{}-{}-{}-{}-{}-{}-{}".format(
    c[0], c[1], c[2], str(c[3])[6:], "gated" if c[4] else "nongated", "theta" if c[5] else "nothr", c[6], c[7],
    "small" if c[8] else "default"))
def test_matches_float64_reference(case):
    m, d, h, dtype, gated, threshold, flag_kind, layout, config = case
    _check_case(m, d, h, dtype, gated, threshold, flag_kind, layout=layout, config=config, seed=m * 1000 + d + h)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("a, delta", [(1.0, 2.0**-12), (2.0**10, 1.0)], ids=["small_h", "h_past_fp16_range"])
def test_h_stays_fp32(dtype, gated, a, delta):
    """y = h0 - h1 with h0 = a² + δ, h1 = a²: a 16-bit h loses δ entirely (bf16 and fp16 cannot hold
    1 + 2^-12), and at a = 2^10 h is 2^20, past fp16's range (fp16 h needs its scale). fp32 h gives
    y = δ exactly."""
    d, h, m = 64, 40, 3
    x = torch.zeros(m, d)
    x[:, 0], x[:, 1] = a, delta
    first = torch.zeros(h, d)
    first[0, :2] = torch.tensor([a, 1.0])  # g0 = a² + δ
    first[1, 0] = a  # g1 = a²
    up = torch.zeros(h, d)
    up[:2, 0] = 1.0 / a  # u0 = u1 = 1
    down_t = torch.zeros(h, d)
    down_t[0, 0], down_t[1, 0] = 1.0, -1.0
    x, first, up, down_t = (t.to(dtype) for t in (x, first, up, down_t))
    gate, up = (first, up) if gated else (None, first)
    out = torch.full((m, d), 7.0, dtype=dtype)
    y = _run(x, torch.ones(m, dtype=torch.bool), gate, up, down_t, None, out)
    expect = torch.zeros(m, d, dtype=dtype)
    expect[:, 0] = delta
    assert torch.equal(y, expect), y[:, :2]


def test_checker_fails_when_a_flagged_row_is_skipped():
    """The checks above are not vacuous: leave one flagged row out of the kernel's flags and the
    comparison over the intended flagged rows fails."""
    m, d, h, dtype = 7, 64, 100, torch.bfloat16
    x, flags, gate, up, down_t, theta, out, y = _check_case(m, d, h, dtype, True, True, "some", layout="contiguous",
                                                           config=None, seed=5)
    ref = _reference(x, gate, up, down_t, theta)
    _assert_close(y, *ref, flags, dtype)
    fewer = flags.clone()
    fewer[int(flags.nonzero()[-1])] = False
    y_skipped = _run(x, fewer, gate, up, down_t, theta, out)
    with pytest.raises(AssertionError):
        _assert_close(y_skipped, *ref, flags, dtype)
    # and a sentinel that happens to be finite and small is still caught: zeros instead of y
    with pytest.raises(AssertionError):
        _assert_close(torch.zeros_like(y), *ref, flags, dtype)


@pytest.mark.parametrize("flag_dtype, stride", [(torch.bool, 1), (torch.int32, 1), (torch.int64, 2), (torch.uint8, 3)])
def test_flags_dtypes_and_strides_and_many_scan_blocks(flag_dtype, stride):
    """Integer flags (non-zero = flagged, any value), strided flags, and M past the compaction
    block (2048 rows per scan step) with flagged rows at the block edges."""
    m, d, h, dtype = 4500, 64, 48, torch.float16
    gen = torch.Generator().manual_seed(stride)
    x = torch.randn(m, d, generator=gen).to(dtype)
    gate, up, down_t = _weights(d, h, dtype, True, gen, interleaved=True)
    flagged = torch.zeros(m, dtype=torch.bool)
    flagged[[0, 5, 2047, 2048, 4095, 4096, 4499]] = True
    flags = torch.zeros(m * stride, dtype=flag_dtype)[::stride]
    flags[flagged] = 1 if flag_dtype == torch.bool else 3  # any non-zero value
    out = _sentinel(m, d, dtype, gen)
    y = _run(x, flags, gate, up, down_t, None, out)
    assert torch.equal(y[~flagged].view(torch.int16), out[~flagged].view(torch.int16))
    _assert_close(y, *_reference(x, gate, up, down_t, None), flagged, dtype)


@pytest.mark.parametrize("with_l1", [False, True], ids=["y", "y+row_l1"])
def test_row_list_in_any_order_gives_the_flags_result(with_l1):
    """row_list = (ids, count) names the rows instead of flags: in any order (here shuffled, the
    list's tail past count holds unflagged ids that must not be computed), the outputs are bit for
    bit those of the flags, since every row's result is its own."""
    m, d, h, dtype = 40, 64, 48, torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(m, d, generator=gen).to(dtype)
    gate, up, down_t = _weights(d, h, dtype, True, gen, interleaved=True)
    flags = _flags(m, "third")
    rows = flags.nonzero().flatten()
    ids = torch.cat([rows[torch.randperm(rows.numel(), generator=gen)], (~flags).nonzero().flatten()]).int()
    count = torch.tensor([rows.numel()], dtype=torch.int32)
    out = _sentinel(m, d, dtype, gen)
    results = []
    for row_flags, row_list in ((flags, None), (None, (ids, count))):
        out_dev = _copy(out)
        l1 = torch.full((m,), -1.0, device=DEVICE) if with_l1 else None
        dense_rows_mlp(_copy(x), _copy(row_flags), *(_copy(t) for t in (gate, up, down_t)), None, out_dev, row_l1=l1,
                       row_list=None if row_list is None else tuple(t.to(DEVICE) for t in row_list))
        results.append((out_dev.cpu(), None if l1 is None else l1.cpu()))
    (y_flags, l1_flags), (y_list, l1_list) = results
    assert torch.equal(y_list.view(torch.int16), y_flags.view(torch.int16))
    assert torch.equal(y_list[~flags].view(torch.int16), out[~flags].view(torch.int16)), "unlisted row written"
    _assert_close(y_list, *_reference(x, gate, up, down_t, None), flags, dtype)
    if with_l1:
        assert torch.equal(l1_list, l1_flags) and (l1_list[~flags] == -1).all()


def test_row_list_without_columns_marks_only_listed_rows():
    """D = 0 with row_l1: only the listed rows (ids[0:count]) get the empty MLP's L1."""
    dtype, m, h = torch.bfloat16, 4, 8
    w0 = torch.zeros(h, 0, dtype=dtype, device=DEVICE)
    theta = torch.full((h,), -0.5, device=DEVICE)  # non-gated: h = relu(0 - θ) = 0.5 per unit
    ids = torch.tensor([2, 0, 1, 3], dtype=torch.int32, device=DEVICE)
    l1 = torch.full((m,), -1.0, device=DEVICE)
    dense_rows_mlp(torch.empty(m, 0, dtype=dtype, device=DEVICE), None, None, w0, w0, theta,
                   torch.empty(m, 0, dtype=dtype, device=DEVICE), row_l1=l1,
                   row_list=(ids, torch.tensor([2], dtype=torch.int32, device=DEVICE)))
    assert l1.cpu().tolist() == [4.0, -1.0, 4.0, -1.0]


def test_nan_row_is_its_own():
    """A NaN in one flagged token reaches that token's output (relu keeps NaN, as torch does) and
    no other token's, even inside one row block; a transposed x (non-unit stride along D) works."""
    m, d, h, dtype = 6, 64, 100, torch.bfloat16
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(m, d, generator=gen).to(dtype)
    x[2, 7] = float("nan")
    gate, up, down_t = _weights(d, h, dtype, True, gen, interleaved=False)
    flags = torch.ones(m, dtype=torch.bool)
    xt = x.t().contiguous().t()
    assert xt.stride(1) != 1
    y = _run(xt, flags, gate, up, down_t, None, torch.zeros(m, d, dtype=dtype))
    assert torch.isnan(y[2]).all()
    others = torch.arange(m) != 2
    _assert_close(y, *_reference(x, gate, up, down_t, None), others, dtype)


def test_empty_shapes_and_no_units():
    dtype = torch.bfloat16
    w = torch.zeros(16, 64, dtype=dtype)
    out = torch.empty(0, 64, dtype=dtype)
    assert _run(torch.empty(0, 64, dtype=dtype), torch.empty(0, dtype=torch.bool), w, w, w, None, out).shape == (0, 64)
    w0 = torch.zeros(16, 0, dtype=dtype)
    assert _run(torch.empty(3, 0, dtype=dtype), torch.ones(3, dtype=torch.bool), w0, w0, w0, None,
                torch.empty(3, 0, dtype=dtype)).shape == (3, 0)
    # H = 0: flagged rows are the empty sum, zeros; the others keep their bytes
    wh = torch.zeros(0, 64, dtype=dtype)
    out = torch.full((3, 64), 5.0, dtype=dtype)
    y = _run(torch.randn(3, 64).to(dtype), torch.tensor([True, False, True]), wh, wh, wh, None, out)
    assert torch.equal(y[[0, 2]], torch.zeros(2, 64, dtype=dtype)) and torch.equal(y[1], out[1])


# ----------------------------------------------------------------------------------------------------
# row L1 (the training forward's penalty term)


def _l1_reference(x, gate, up, theta):
    """(float64 Σ_j |h_j|, Σ_j of the |h_j| bound, torch's Σ|h| in the low dtype), all [M]."""
    first = gate if gate is not None else up
    x64 = x.double()
    g = x64 @ first.double().t()
    mag = x64.abs() @ first.double().abs().t()
    glow = F.linear(x, first)
    if theta is not None:
        g, mag, glow = g - theta.double(), mag + theta.double().abs(), glow - theta.to(x.dtype)
    h, hlow = torch.relu(g), torch.relu(glow)
    if gate is not None:
        h = h * (x64 @ up.double().t())
        mag = mag * (x64.abs() @ up.double().abs().t())
        hlow = hlow * F.linear(x, up)
    return h.abs().sum(1), mag.sum(1), hlow.abs().sum(1).double()


def _assert_l1_close(l1, ref, mag, lowp, rows):
    l1, ref, mag, lowp = l1[rows].double(), ref[rows], mag[rows], lowp[rows]
    assert torch.isfinite(l1).all(), "non-finite row_l1 in a flagged row"
    tiny = torch.finfo(torch.float32).tiny
    err = (l1 - ref).abs()
    bound = 2 * (lowp - ref).abs().max().item() + 2**-23 * ref.abs().max().item() + tiny
    assert err.max().item() <= bound, f"flash rule: max err {err.max().item():.3g} > {bound:.3g}"
    worst = (err - (1e-5 * (ref + mag) + tiny)).max().item()
    assert worst <= 0, f"row_l1 error exceeds 1e-5 (ref + |terms|) by {worst:.3g}"


def _l1_cases():
    """(M, D, H, dtype, gated, threshold, flags, config, strided row_l1), every value of each met."""
    cases = []
    for i, (dtype, gated, threshold, flag_kind) in enumerate(itertools.product(
            DTYPES, (True, False), (False, True), ("none", "some", "all"))):
        m, d, h = ((40, 72, 160), (7, 64, 100), (1, 72, 100))[i % 3]
        if m == 1 and flag_kind == "some":
            flag_kind = "all"
        cases.append((m, d, h, dtype, gated, threshold, flag_kind, SMALL if i % 4 == 1 else None, i % 2 == 1))
    return cases


@pytest.mark.parametrize("case", _l1_cases(), ids=lambda c: "M{}-D{}-H{}-{}-{}-{}-{}-{}-{}".format(
    c[0], c[1], c[2], str(c[3])[6:], "gated" if c[4] else "nongated", "theta" if c[5] else "nothr", c[6],
    "small" if c[7] else "default", "strided" if c[8] else "contiguous"))
def test_row_l1_matches_float64_reference(case):
    """Flagged rows get Σ|h| (only one D-slice tile writes it: SMALL has 3 slices at D = 72),
    unflagged entries keep their bits (random fp32 bits, NaNs included), and y is unchanged."""
    m, d, h, dtype, gated, threshold, flag_kind, config, strided = case
    gen = torch.Generator().manual_seed(m * 100 + d + h)
    x = torch.randn(m, d, generator=gen).to(dtype)
    gate, up, down_t = _weights(d, h, dtype, gated, gen, interleaved=False)
    theta = (torch.randn(h, generator=gen) * 0.3) if threshold else None
    flags = _flags(m, flag_kind)
    out = _sentinel(m, d, dtype, gen)
    l1_init = torch.randint(-(2**31), 2**31, (m * (2 if strided else 1),), generator=gen, dtype=torch.int32)
    l1_init = l1_init.view(torch.float32)[::2 if strided else 1]
    out_dev, l1_dev = _copy(out), _copy(l1_init)
    dense_rows_mlp(*(_copy(t) for t in (x, flags, gate, up, down_t, theta)), out_dev, row_l1=l1_dev, config=config)
    y, l1 = out_dev.cpu(), l1_dev.cpu()
    assert torch.equal(y.view(torch.int16), _run(x, flags, gate, up, down_t, theta, out, config).view(torch.int16))
    assert torch.equal(l1[~flags].view(torch.int32), l1_init[~flags].view(torch.int32)), "unflagged row_l1 written"
    if flags.any():
        _assert_l1_close(l1, *_l1_reference(x, gate, up, theta), flags)


def test_row_l1_checker_is_not_vacuous():
    m, d, h, dtype = 7, 64, 100, torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m, d, generator=gen).to(dtype)
    gate, up, _ = _weights(d, h, dtype, True, gen, interleaved=False)
    ref, mag, lowp = _l1_reference(x, gate, up, None)
    rows = torch.ones(m, dtype=torch.bool)
    _assert_l1_close(ref.float(), ref, mag, lowp, rows)
    for wrong in (ref * (1 + 2e-2), torch.zeros_like(ref), ref - 0.5 * ref.min()):
        with pytest.raises(AssertionError):
            _assert_l1_close(wrong.float(), ref, mag, lowp, rows)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_row_l1_no_units_and_no_columns(gated):
    """H = 0: Σ over no units is 0. D = 0 (no MLP tile runs): g = 0, so h = relu(-θ) non-gated
    and relu(-θ) * 0 = 0 gated, summed over the units. Unflagged entries keep their value."""
    dtype = torch.bfloat16
    flags = torch.tensor([True, False, True])
    wh = torch.zeros(0, 64, dtype=dtype)
    l1 = _copy(torch.full((3,), 7.0))
    dense_rows_mlp(*(_copy(t) for t in (torch.randn(3, 64).to(dtype), flags)), _copy(wh) if gated else None,
                   _copy(wh), _copy(wh), None, _copy(torch.zeros(3, 64, dtype=dtype)), row_l1=l1)
    assert l1.cpu().tolist() == [0.0, 7.0, 0.0]
    w0 = torch.zeros(4, 0, dtype=dtype)
    theta = torch.tensor([-1.5, 2.0, -0.25, 0.0])
    l1 = _copy(torch.full((3,), 7.0))
    dense_rows_mlp(*(_copy(t) for t in (torch.empty(3, 0, dtype=dtype), flags)), _copy(w0) if gated else None,
                   _copy(w0), _copy(w0), _copy(theta), _copy(torch.empty(3, 0, dtype=dtype)), row_l1=l1)
    expect = 0.0 if gated else 1.75
    assert l1.cpu().tolist() == [expect, 7.0, expect]


# ----------------------------------------------------------------------------------------------------
# no host synchronisation (GPU only)


def _gpu_problem(m=300, d=128, h=384, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen).to(dtype)
    gate, up, down_t = _weights(d, h, dtype, True, gen, interleaved=False)
    theta = torch.randn(h, generator=gen) * 0.3
    return x, gate, up, down_t, theta


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_no_host_sync():
    """torch's sync debug mode raises on any synchronising torch op inside the call."""
    x, gate, up, down_t, theta = (t.cuda() for t in _gpu_problem())
    flags = torch.rand(x.shape[0], device="cuda") < 0.1
    out = torch.zeros_like(x)
    dense_rows_mlp(x, flags, gate, up, down_t, theta, out)  # compile outside the checked region
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dense_rows_mlp(x, flags, gate, up, down_t, theta, out)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_cuda_graph_capture_and_replay_with_new_flags():
    """The call captures into a CUDA graph (a host sync would break capture) and a replay follows
    whatever flags the device holds: none, some, all."""
    x_cpu, gate, up, down_t, theta = _gpu_problem()
    m, d = x_cpu.shape
    ref = _reference(x_cpu, gate, up, down_t, theta)
    x, gate_d, up_d, down_d, theta_d = (t.cuda() for t in (x_cpu, gate, up, down_t, theta))
    flags = torch.zeros(m, dtype=torch.bool, device="cuda")
    out = torch.zeros(m, d, dtype=x.dtype, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) on the capture stream
        dense_rows_mlp(x, flags, gate_d, up_d, down_d, theta_d, out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dense_rows_mlp(x, flags, gate_d, up_d, down_d, theta_d, out)
    gen = torch.Generator().manual_seed(3)
    for new_flags in (torch.zeros(m, dtype=torch.bool), torch.rand(m, generator=gen) < 0.2,
                      torch.ones(m, dtype=torch.bool)):
        sentinel = _sentinel(m, d, x.dtype, gen)
        flags.copy_(new_flags)
        out.copy_(sentinel)
        graph.replay()
        y = out.cpu()
        assert torch.equal(y[~new_flags].view(torch.int16), sentinel[~new_flags].view(torch.int16))
        if new_flags.any():
            _assert_close(y, *ref, new_flags, x.dtype)


def test_m_adds_no_specialization():
    """The MLP kernel never sees M, the scan has M do_not_specialize, the config depends on D only;
    on a GPU the compiled-kernel caches must not grow with M."""
    assert "M" in do_not_specialize(_compact_rows_kernel)
    assert "m" not in positional_args(default_config)
    if not CUDA:
        return
    from sparseffn.kernels.dense_rows_mlp import _dense_rows_mlp_kernel

    x, gate, up, down_t, theta = (t.cuda() for t in _gpu_problem())
    kernels = (_compact_rows_kernel, _dense_rows_mlp_kernel)

    def call(m):
        flags = torch.ones(m, dtype=torch.bool, device="cuda")
        dense_rows_mlp(x[:m], flags, gate, up, down_t, theta, torch.empty_like(x[:m]))

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
    return dict(x=torch.zeros(m, d, dtype=dtype), row_flags=torch.zeros(m, dtype=torch.bool), gate_weight=w,
                up_weight=w, down_weight_t=w, threshold=None, out=torch.zeros(m, d, dtype=dtype))


@pytest.mark.parametrize("change, error, match", [
    (dict(x=torch.zeros(3, 64)), TypeError, "x must be torch.bfloat16"),
    (dict(x=torch.zeros(3, 64, 1, dtype=torch.bfloat16)), ValueError, "x must have shape"),
    (dict(row_flags=torch.zeros(4, dtype=torch.bool)), ValueError, "row_flags must have shape"),
    (dict(row_flags=torch.zeros(3)), TypeError, "row_flags must be bool"),
    (dict(row_flags=[True, False, True]), TypeError, "row_flags must be a torch.Tensor"),
    (dict(gate_weight=torch.zeros(33, 64, dtype=torch.bfloat16)), ValueError, "gate_weight must have shape"),
    (dict(gate_weight=torch.zeros(32, 64, dtype=torch.float16)), TypeError, "gate_weight must have x's dtype"),
    (dict(up_weight=torch.zeros(32, 63, dtype=torch.bfloat16)), ValueError, "up_weight must have shape"),
    (dict(up_weight=torch.zeros(64, 32, dtype=torch.bfloat16).t()), ValueError, "up_weight must have unit stride"),
    (dict(down_weight_t=torch.zeros(64, 32, dtype=torch.bfloat16)), ValueError, "down_weight_t must have shape"),
    (dict(down_weight_t=None), TypeError, "down_weight_t must be a torch.Tensor"),
    (dict(threshold=torch.zeros(32, dtype=torch.float64)), TypeError, "threshold must be torch.float32"),
    (dict(threshold=torch.zeros(31)), ValueError, "threshold must have shape"),
    (dict(threshold=0.5), TypeError, "threshold must be None or a torch.Tensor"),
    (dict(out=torch.zeros(3, 63, dtype=torch.bfloat16)), ValueError, "out must have shape"),
    (dict(out=torch.zeros(3, 64, dtype=torch.float16)), TypeError, "out must have x's dtype"),
    (dict(out=torch.zeros(64, 3, dtype=torch.bfloat16).t()), ValueError, "out must have unit stride"),
    (dict(config=dict(block_r=16)), TypeError, "config"),
    ("in_place", ValueError, "out must not share memory with x"),
    (dict(row_l1=torch.zeros(3, dtype=torch.float64)), TypeError, "row_l1 must be torch.float32"),
    (dict(row_l1=torch.zeros(4)), ValueError, "row_l1 must have shape"),
    (dict(row_l1=[0.0, 0.0, 0.0]), TypeError, "row_l1 must be None or a torch.Tensor"),
    (dict(row_list=(torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))), ValueError,
     "row_flags must be None when row_list gives the rows"),
    (dict(row_flags=None, row_list=[torch.zeros(3, dtype=torch.int32)]), TypeError, "row_list must be a pair"),
    (dict(row_flags=None, row_list=(torch.zeros(3, dtype=torch.int64), torch.zeros(1, dtype=torch.int32))),
     ValueError, "row_list ids must be a contiguous int32"),
    (dict(row_flags=None, row_list=(torch.zeros(3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))),
     ValueError, r"row_list count must be a contiguous int32 tensor of shape \[1\]"),
])
def test_input_errors(change, error, match):
    args = {k: v.to(DEVICE) for k, v in _valid_args().items() if v is not None}
    if change == "in_place":
        change = dict(out=args["x"])
    on_device = lambda v: v.to(DEVICE) if isinstance(v, torch.Tensor) else v  # noqa: E731
    args.update({k: type(v)(map(on_device, v)) if isinstance(v, (tuple, list)) else on_device(v)
                 for k, v in change.items()})
    config = args.pop("config", None)
    with pytest.raises(error, match=match):
        dense_rows_mlp(args["x"], args["row_flags"], args["gate_weight"], args["up_weight"],
                       args["down_weight_t"], args.get("threshold"), args["out"], row_l1=args.get("row_l1"),
                       config=config, row_list=args.get("row_list"))


def test_config_validation_and_default():
    with pytest.raises(ValueError, match="block_r"):
        DenseRowsConfig(block_r=4)
    with pytest.raises(ValueError, match="block_h"):
        DenseRowsConfig(block_h=48)
    with pytest.raises(ValueError, match="num_stages"):
        DenseRowsConfig(num_stages=0)
    cfg = default_config(2048, cuda=True)
    assert (cfg.block_r, cfg.block_dy, cfg.num_warps) == (16, 512, 8)
    assert default_config(72, cuda=True).block_dy == 128 and default_config(100, cuda=True).num_warps == 8
    assert default_config(16, cuda=True).block_dy == 64  # the wgmma minimum
    # registers: the y accumulator stays at <= 32 fp32 per thread on the GPU configs
    for d in (64, 100, 2048, 8192):
        c = default_config(d, cuda=True)
        assert c.block_dy * c.block_r // (32 * c.num_warps) <= 32


def test_compile_specs_cover_launcher_variants():
    """The GPU compile list (tests/kernels/gpu_compile.py) has the scan and the MLP kernel for
    both dtypes, gated and not, threshold on and off, aligned and generic loads, and the row_l1
    variants (aligned) of the training forward."""
    seen = set()
    for fn, signature, constexprs in compile_specs():
        assert set(constexprs) <= {k for k, v in signature.items() if v == "constexpr"}
        if fn is _compact_rows_kernel:
            seen.add("scan")
        else:
            seen.add((signature["x_ptr"], constexprs["GATED"], constexprs["HAS_THRESHOLD"], constexprs["ALIGNED"],
                      constexprs["WRITE_L1"]))
    assert "scan" in seen
    for ty, gated, thr, aligned in itertools.product(("*bf16", "*fp16"), (True, False), (True, False), (True, False)):
        assert (ty, gated, thr, aligned, False) in seen
        assert not aligned or (ty, gated, thr, aligned, True) in seen
    assert all(len(spec) == 4 for spec in compile_specs(with_options=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_refuses_the_unaligned_path():
    from sparseffn.kernels.dense_rows_mlp import cuda_supported

    x = torch.randn(4, 100, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16, 100, device="cuda", dtype=torch.bfloat16)
    assert not cuda_supported(100, w, w, w)
    with pytest.raises(NotImplementedError, match="D % 8 == 0"):
        dense_rows_mlp(x, torch.ones(4, dtype=torch.bool, device="cuda"), w, w, w, None, torch.empty_like(x))
