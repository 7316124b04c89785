"""twell_train_forward / twell_train_backward against float64 references built from dense tensors.

Packed inputs are adversarial (tests/kernels/test_twell_up_down.py `_activation`, `_pack`): rows
of every kind (zero, sparse, exactly `slots` in every tile, one tile at slots + 1, dense), valid
slots shuffled, unspecified slots holding NaN / inf and out-of-range columns. Every output is
pre-filled with a sentinel: overflow rows and unspecified slots must keep it bit for bit.

Tolerances (docs/design.md, "Exactness"): y and dx follow the flash-attention rule
`max|out - ref| <= 2 max|torch_lowp - ref| + floor` and, per element, `eps·|ref| + fp32 slack`
(fp32 accumulation, one rounding to the low dtype; the interpreter truncates: one ulp). Per-slot
fp32 results (u, du, dg) and row_l1 are compared, after mapping slots to units, at fp32 tolerance
relative to the magnitude of their terms, so a dropped unit, a wrong sign or a bf16 rounding shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparseffn.kernels.twell_train import (_twell_train_backward_kernel, _twell_train_forward_kernel,
                                           twell_train_backward, twell_train_forward)
from sparseffn.kernels.configs.twell_train import TwellTrainConfig, default_backward_config, default_forward_config
from tests.kernels.compile_specs.twell_train import compile_specs
from tests.kernels.jit import do_not_specialize, positional_args
from tests.kernels.test_twell_up_down import _activation, _pack

pytestmark = pytest.mark.filterwarnings(  # triton's interpreter turns 1-element arrays into ints
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DTYPES = [torch.bfloat16, torch.float16]
# Native kernels on a GPU machine, the interpreter on CPU (tests/conftest.py); problems are built on
# the CPU and results compared there.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SENTINEL = -1234.5

# several tokens per program (M not a multiple), several batches per row (block_n 4), several
# chunks per batch, D split over programs at D = 100 (u / dh looped over D blocks), several counts
# segments per row (max_block_t 2)
SMALL = TwellTrainConfig(block_m=3, block_u=2, block_d=64, block_n=4, max_block_t=2, num_warps=1)
# one chunk per batch (block_n == block_u: no tl.gather), one token per program, no L2 hints
WIDE = TwellTrainConfig(block_m=1, block_u=8, block_d=128, block_n=8, num_warps=2, evict=False)
# long rows split (kernels/row_split.py): pieces of 4 valid slots, room for 3 rows (other long
# rows run whole in the same launch); and pieces of 2 batches with room for every row
SPLIT = TwellTrainConfig(block_m=2, block_u=2, block_d=128, block_n=4, max_block_t=2, num_warps=1, split_slots=4,
                         split_cap=3)
SPLIT_ALL = TwellTrainConfig(block_m=1, block_u=4, block_d=128, block_n=8, num_warps=2, split_slots=16, split_cap=64)
CONFIGS = {"default": None, "small": SMALL, "wide": WIDE, "split": SPLIT, "split_all": SPLIT_ALL}

# (M, D, H, tile, slots, strided x / dy, config): M = 1 (the fullest ordinary row), odd M, D and H
# off the tile / block multiples, tile-multiple and aligned D (16-byte paths), D split over programs
SHAPES = [
    (1, 64, 100, 64, 16, False, "default"),
    (5, 100, 320, 64, 4, True, "small"),
    (33, 64, 320, 128, 16, False, "wide"),
    (33, 100, 100, 32, 4, False, "default"),
    (12, 64, 320, 64, 16, True, "small"),
    (7, 128, 512, 128, 32, False, "default"),
    (33, 100, 320, 64, 16, True, "split"),
    (12, 64, 512, 128, 32, False, "split_all"),
]


def _ids(s):
    return "M{}-D{}-H{}-t{}-s{}-{}-{}".format(*s[:5], "strided" if s[5] else "contig", s[6])


def _strided(t: torch.Tensor) -> torch.Tensor:
    """t's values as rows of a wider, misaligned buffer (row stride D + 5, 2-byte offset)."""
    m, d = t.shape
    wide = torch.cat([t.new_zeros(m, 1), t, t.new_zeros(m, 4)], 1)[:, 1:d + 1]
    assert wide.stride() == (d + 5, 1) and torch.equal(wide, t)
    return wide


def _problem(m, d, h, tile, slots, dtype, gated, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen).to(dtype)
    gate = (torch.randn(h, d, generator=gen) / d**0.5).to(dtype) if gated else None
    up = (torch.randn(h, d, generator=gen) / d**0.5).to(dtype)
    down_t = (torch.randn(h, d, generator=gen) * 0.5).to(dtype)
    dy = torch.randn(m, d, generator=gen).to(dtype)
    p = _activation(m, h, tile, slots, dtype, gen)
    values, columns, counts, overflow = _pack(p, tile, slots, gen)
    return dict(x=x, gate=gate, up=up, down_t=down_t, dy=dy, p=p, values=values, columns=columns,
                counts=counts, overflow=overflow)


def _slot_map(columns, counts, overflow, tile):
    """(valid-and-ordinary mask [M, n_tiles, slots], row, t, k, unit) of the slots kernels use."""
    slots = columns.shape[2]
    k = torch.arange(slots)
    mask = (k < counts.clamp(max=slots)[..., None]) & ~overflow[:, None, None]
    row, t, kk = mask.nonzero(as_tuple=True)
    unit = t * tile + columns[row, t, kk].long()
    return mask, row, t, kk, unit


def _assert_rows_close(out, ref, mag, lowp, rows, dtype):
    """Flash rule on the rows, plus per element eps·|ref| + fp32 slack (3e-5 of the terms)."""
    assert rows.any(), "no ordinary row to compare"
    out, ref, mag, lowp = out[rows].double(), ref[rows], mag[rows], lowp[rows].double()
    assert torch.isfinite(out).all(), "non-finite output: an unspecified slot was read"
    eps = torch.finfo(dtype).eps
    err = (out - ref).abs()
    floor = eps * ref.abs().max().item() + torch.finfo(dtype).tiny
    bound = 2 * (lowp - ref).abs().max().item() + floor
    assert err.max().item() <= bound, f"flash rule: max err {err.max().item():.3g} > {bound:.3g}"
    worst = (err - (eps * ref.abs() + 3e-5 * mag + torch.finfo(dtype).tiny)).max().item()
    assert worst <= 0, f"error exceeds one {dtype} ulp + fp32 slack by {worst:.3g}"


def _assert_slots_close(out, ref, mag, smap, what):
    """fp32 per-slot results against the dense [M, H] reference at the slot's unit, and the
    sentinel untouched everywhere else."""
    mask, row, t, k, unit = smap
    got = out[row, t, k].double()
    assert torch.isfinite(got).all(), f"{what}: non-finite value at a valid slot"
    err = (got - ref[row, unit]).abs()
    tol = 2e-5 * mag[row, unit] + 1e-30
    assert (err <= tol).all(), f"{what}: max excess {(err - tol).max().item():.3g}"
    assert (out[~mask] == SENTINEL).all(), f"{what}: a slot outside the valid ordinary ones was written"


def _forward_reference(prob, gated):
    """(y, |y| term bound, y in the low dtype by torch, u, |u| term bound, h) in float64 [M, *]."""
    x, up, down_t, p = prob["x"], prob["up"], prob["down_t"], prob["p"]
    x64, p64, d64 = x.double(), p.double(), down_t.double()
    if gated:
        u = x64 @ up.double().t()
        u_mag = x64.abs() @ up.double().abs().t()
        h, h_mag = p64 * u, p64 * u_mag
        lowp = (p * (x @ up.t())) @ down_t
    else:
        u = u_mag = torch.zeros_like(p64)
        h, h_mag = p64, p64
        lowp = p @ down_t
    return h @ d64, h_mag @ d64.abs(), lowp, u, u_mag, h


def _run_forward(prob, tile, gated, config=None, strided=False, counts=None, deterministic=False):
    m, d = prob["x"].shape
    n_tiles, slots = prob["values"].shape[1:]
    x = _strided(prob["x"]) if strided else prob["x"]
    out = torch.full((m, d), SENTINEL, dtype=x.dtype, device=DEVICE)
    u_out = torch.full((m, n_tiles, slots), SENTINEL, device=DEVICE) if gated else None
    l1 = torch.full((m,), SENTINEL, device=DEVICE)
    counts = prob["counts"] if counts is None else counts
    result = twell_train_forward(
        x.to(DEVICE), prob["values"].to(DEVICE), prob["columns"].to(DEVICE), counts.to(DEVICE),
        prob["up"].to(DEVICE) if gated else None, prob["down_t"].to(DEVICE),
        tile=tile, gated=gated, out=out, u_out=u_out, row_l1_out=l1, config=config, deterministic=deterministic)
    assert result is None
    return out.cpu(), None if u_out is None else u_out.cpu(), l1.cpu()


def _check_forward(prob, tile, gated, out, u_out, l1):
    overflow = prob["overflow"]
    dtype = prob["x"].dtype
    y, y_mag, lowp, u, u_mag, h = _forward_reference(prob, gated)
    _assert_rows_close(out, y, y_mag, lowp, ~overflow, dtype)
    assert (out[overflow] == SENTINEL).all(), "an overflow row of out was written"
    if gated:
        smap = _slot_map(prob["columns"], prob["counts"], overflow, tile)
        _assert_slots_close(u_out, u, u_mag, smap, "u_out")
    l1_ref = h.abs().sum(1)
    l1_tol = 2e-5 * (prob["p"].double() * u_mag).sum(1) if gated else 1e-6 * l1_ref
    assert ((l1[~overflow].double() - l1_ref[~overflow]).abs() <= l1_tol[~overflow] + 1e-30).all()
    assert (l1[overflow] == SENTINEL).all(), "an overflow row of row_l1_out was written"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_forward_matches_float64_reference(shape, gated, dtype):
    m, d, h, tile, slots, strided, name = shape
    prob = _problem(m, d, h, tile, slots, dtype, gated, seed=m * 1000 + d + h + slots)
    if m >= 6:
        assert prob["overflow"].any() and not prob["overflow"].all()
    out, u_out, l1 = _run_forward(prob, tile, gated, CONFIGS[name], strided)
    _check_forward(prob, tile, gated, out, u_out, l1)


def _backward_reference(prob, gated, u32, l1_grad):
    """Float64 (dx, |dx| term bound, dx in the low dtype by torch, du, dg, |du|, |dg| bounds)
    [M, *] from the fp32 u the kernel is given (so sign(h) is the kernel's)."""
    dy, up, down_t, p = prob["dy"], prob["up"], prob["down_t"], prob["p"]
    p64, supp = p.double(), (p > 0).double()
    sign = torch.sign(p64 * u32.double()) if gated else supp  # sign(h), h = p u or p
    dh = (dy.double() @ down_t.double().t() + l1_grad * sign) * supp
    dh_mag = (dy.double().abs() @ down_t.double().abs().t() + l1_grad) * supp
    dh_lp = (dy @ down_t.t() + l1_grad * sign.to(p.dtype)) * supp.to(p.dtype)
    if gated:
        gate = prob["gate"]
        du, dg = dh * p64, dh * u32.double()
        du_mag, dg_mag = dh_mag * p64, dh_mag * u32.double().abs()
        dx = du @ up.double() + dg @ gate.double()
        dx_mag = du_mag @ up.double().abs() + dg_mag @ gate.double().abs()
        dx_lp = (dh_lp * p) @ up + (dh_lp * u32.to(p.dtype)) @ gate
    else:
        du = du_mag = None
        dg, dg_mag = dh, dh_mag
        dx, dx_mag = dh @ up.double(), dh_mag @ up.double().abs()
        dx_lp = dh_lp @ up
    return dx, dx_mag, dx_lp, du, dg, du_mag, dg_mag


def _u_slots(prob, tile, gated):
    """fp32 u at the valid ordinary slots (the forward's u_out), NaN elsewhere; and dense fp32 u."""
    if not gated:
        return None, torch.zeros(prob["p"].shape)
    u32 = (prob["x"].double() @ prob["up"].double().t()).float()
    _, row, t, k, unit = _slot_map(prob["columns"], prob["counts"], prob["overflow"], tile)
    u_slots = torch.full(prob["values"].shape, float("nan"))
    u_slots[row, t, k] = u32[row, unit]
    return u_slots, u32


def _run_backward(prob, u_slots, l1_grad, tile, gated, config=None, strided=False, counts=None, deterministic=False):
    m, d = prob["dy"].shape
    n_tiles, slots = prob["values"].shape[1:]
    dy = _strided(prob["dy"]) if strided else prob["dy"]
    dx = torch.full((m, d), SENTINEL, dtype=dy.dtype, device=DEVICE)
    du = torch.full((m, n_tiles, slots), SENTINEL, device=DEVICE) if gated else None
    dg = torch.full((m, n_tiles, slots), SENTINEL, device=DEVICE)
    counts = prob["counts"] if counts is None else counts
    result = twell_train_backward(
        dy.to(DEVICE), prob["values"].to(DEVICE), prob["columns"].to(DEVICE), counts.to(DEVICE),
        u_slots.to(DEVICE) if gated else None, prob["gate"].to(DEVICE) if gated else None,
        prob["up"].to(DEVICE), prob["down_t"].to(DEVICE),
        torch.tensor([l1_grad], dtype=torch.float32, device=DEVICE),
        tile=tile, gated=gated, dx_out=dx, du_out=du, dg_out=dg, config=config, deterministic=deterministic)
    assert result is None
    return dx.cpu(), None if du is None else du.cpu(), dg.cpu()


def _check_backward(prob, tile, gated, u32, l1_grad, dx, du, dg):
    overflow = prob["overflow"]
    ref_dx, dx_mag, dx_lp, ref_du, ref_dg, du_mag, dg_mag = _backward_reference(
        prob, gated, u32, l1_grad)
    _assert_rows_close(dx, ref_dx, dx_mag, dx_lp, ~overflow, prob["dy"].dtype)
    assert (dx[overflow] == SENTINEL).all(), "an overflow row of dx_out was written"
    smap = _slot_map(prob["columns"], prob["counts"], overflow, tile)
    _assert_slots_close(dg, ref_dg, dg_mag, smap, "dg_out")
    if gated:
        _assert_slots_close(du, ref_du, du_mag, smap, "du_out")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_backward_matches_float64_reference(shape, gated, dtype):
    m, d, h, tile, slots, strided, name = shape
    prob = _problem(m, d, h, tile, slots, dtype, gated, seed=m * 1000 + d + h + slots + 1)
    u_slots, u32 = _u_slots(prob, tile, gated)
    l1_grad = 0.375  # the size of a typical |dy · down_t[j]|: a missing or wrong sign term shows
    dx, du, dg = _run_backward(prob, u_slots, l1_grad, tile, gated, CONFIGS[name], strided)
    _check_backward(prob, tile, gated, u32, l1_grad, dx, du, dg)


@pytest.mark.parametrize("config", ["default", "split"])
def test_forward_flags_and_lists_overflow_rows(config):
    m, d, h, tile, slots = 33, 64, 320, 64, 16
    prob = _problem(m, d, h, tile, slots, torch.bfloat16, True, seed=3)
    assert prob["overflow"].any() and not prob["overflow"].all()
    flags = torch.zeros(m, dtype=torch.bool, device=DEVICE)
    ids = torch.full((m,), -1, dtype=torch.int32, device=DEVICE)
    count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = torch.empty(m, d, dtype=torch.bfloat16, device=DEVICE)
    u_out = torch.empty(prob["values"].shape, dtype=torch.float32, device=DEVICE)
    twell_train_forward(prob["x"].to(DEVICE), prob["values"].to(DEVICE), prob["columns"].to(DEVICE),
                        prob["counts"].to(DEVICE), prob["up"].to(DEVICE), prob["down_t"].to(DEVICE), tile=tile,
                        gated=True, out=out, u_out=u_out, row_l1_out=torch.empty(m, device=DEVICE),
                        overflow_out=flags, overflow_list=(ids, count), config=CONFIGS[config])
    assert torch.equal(flags.cpu(), prob["overflow"])
    n = int(count)
    assert torch.equal(ids[:n].cpu().long().sort().values, prob["overflow"].nonzero().flatten())
    assert (ids[n:].cpu() == -1).all()
    with pytest.raises(TypeError, match="overflow_out"):
        twell_train_forward(prob["x"].to(DEVICE), prob["values"].to(DEVICE), prob["columns"].to(DEVICE),
                            prob["counts"].to(DEVICE), prob["up"].to(DEVICE), prob["down_t"].to(DEVICE), tile=tile,
                            gated=True, out=out, u_out=u_out, row_l1_out=torch.empty(m, device=DEVICE),
                            overflow_out=flags.int())


def _bits(outputs):
    return [t.contiguous().view(torch.uint8) for t in outputs]


def test_deterministic_long_rows_give_the_same_bits_listed_or_not():
    """Deterministic: forward (y, u, row L1) and backward (dx, du, dg) bits do not depend on which
    long rows the split list took (room for 3 rows, the others run whole in piece order, against
    room for all). Without the flag they do here (rows split or whole round differently in fp32)."""
    m, d, h, tile, slots = 33, 128, 320, 64, 16
    prob = _problem(m, d, h, tile, slots, torch.bfloat16, True, seed=3)
    assert int((~prob["overflow"] & (prob["counts"].sum(1) > SPLIT.split_slots)).sum()) > SPLIT.split_cap
    room_for_all = dataclasses.replace(SPLIT, split_cap=m)
    for deterministic in (True, False):
        fwd = [_run_forward(prob, tile, True, cfg, deterministic=deterministic) for cfg in (SPLIT, room_for_all)]
        u_slots = fwd[1][1]
        bwd = [_run_backward(prob, u_slots, 0.375, tile, True, cfg, deterministic=deterministic)
               for cfg in (SPLIT, room_for_all)]
        same = all(torch.equal(a, b) for a, b in zip(_bits(fwd[0] + bwd[0]), _bits(fwd[1] + bwd[1])))
        assert same == deterministic
        _check_forward(prob, tile, True, *fwd[0])


def test_forward_u_feeds_backward():
    """The forward's u_out, passed as u_slots, gives the backward the reference gradients."""
    m, d, h, tile, slots, dtype = 9, 64, 100, 64, 8, torch.bfloat16
    prob = _problem(m, d, h, tile, slots, dtype, True, seed=5)
    _, u_out, _ = _run_forward(prob, tile, True)
    u_slots = torch.where(u_out == SENTINEL, float("nan"), u_out)
    dense_u = torch.zeros(m, h)
    _, row, t, k, unit = _slot_map(prob["columns"], prob["counts"], prob["overflow"], tile)
    dense_u[row, unit] = u_out[row, t, k]
    dx, du, dg = _run_backward(prob, u_slots, 0.25, tile, True)
    _check_backward(prob, tile, True, dense_u, 0.25, dx, du, dg)


def test_tolerances_reject_a_missing_unit_and_a_missing_l1_term():
    """The comparisons above fail when one active unit of one row is dropped (forward and
    backward), and when the backward ignores l1_grad."""
    m, d, h, tile, slots, dtype = 6, 64, 100, 64, 16, torch.bfloat16
    prob = _problem(m, d, h, tile, slots, dtype, True, seed=3)
    row = int(((prob["counts"].sum(1) > 1) & ~prob["overflow"]).nonzero()[0])
    t = int(prob["counts"][row].nonzero()[0])
    dropped = prob["counts"].clone()
    dropped[row, t] -= 1  # the last valid slot of that tile becomes unspecified
    _check_forward(prob, tile, True, *_run_forward(prob, tile, True))
    with pytest.raises(AssertionError):
        _check_forward(prob, tile, True, *_run_forward(prob, tile, True, counts=dropped))
    u_slots, u32 = _u_slots(prob, tile, True)
    _check_backward(prob, tile, True, u32, 0.5, *_run_backward(prob, u_slots, 0.5, tile, True))
    with pytest.raises(AssertionError):
        _check_backward(prob, tile, True, u32, 0.5,
                        *_run_backward(prob, u_slots, 0.5, tile, True, counts=dropped))
    with pytest.raises(AssertionError):
        _check_backward(prob, tile, True, u32, 0.5, *_run_backward(prob, u_slots, 0.0, tile, True))


def test_empty_inputs_and_rows_without_units():
    dtype = torch.bfloat16
    w = torch.randn(100, 64).to(dtype).to(DEVICE)
    e3 = torch.empty(0, 2, 4, device=DEVICE)
    twell_train_forward(torch.empty(0, 64, dtype=dtype, device=DEVICE), e3.to(dtype),
                        e3.to(torch.int16), torch.empty(0, 2, dtype=torch.int32, device=DEVICE),
                        w, w, tile=64, gated=True, out=torch.empty(0, 64, dtype=dtype, device=DEVICE),
                        u_out=e3, row_l1_out=torch.empty(0, device=DEVICE))
    # rows whose tiles are all empty: y = 0, row_l1 = 0, dx = 0, no slot written
    values = torch.full((3, 2, 4), float("nan"), dtype=dtype, device=DEVICE)
    columns = torch.full((3, 2, 4), -1, dtype=torch.int16, device=DEVICE)
    counts = torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)
    x = torch.randn(3, 64).to(dtype).to(DEVICE)
    out = torch.full((3, 64), 7.0, dtype=dtype, device=DEVICE)
    u_out = torch.full((3, 2, 4), 7.0, device=DEVICE)
    l1 = torch.full((3,), 7.0, device=DEVICE)
    twell_train_forward(x, values, columns, counts, w, w, tile=64, gated=True, out=out, u_out=u_out,
                        row_l1_out=l1)
    assert (out == 0).all() and (l1 == 0).all() and (u_out == 7.0).all()
    dx = torch.full((3, 64), 7.0, dtype=dtype, device=DEVICE)
    dg = torch.full((3, 2, 4), 7.0, device=DEVICE)
    twell_train_backward(x, values, columns, counts, None, None, w, w,
                         torch.ones(1, device=DEVICE), tile=64, gated=False, dx_out=dx, du_out=None,
                         dg_out=dg)
    assert (dx == 0).all() and (dg == 7.0).all()


def _forward_args(m=3, d=64, h=100, tile=64, slots=4, dtype=torch.bfloat16):
    n_tiles = -(-h // tile)
    return dict(
        x=torch.randn(m, d).to(dtype),
        values=torch.zeros(m, n_tiles, slots, dtype=dtype),
        columns=torch.zeros(m, n_tiles, slots, dtype=torch.int16),
        counts=torch.zeros(m, n_tiles, dtype=torch.int32),
        up_weight=torch.zeros(h, d, dtype=dtype),
        down_weight_t=torch.zeros(h, d, dtype=dtype),
        tile=tile, gated=True,
        out=torch.zeros(m, d, dtype=dtype),
        u_out=torch.zeros(m, n_tiles, slots),
        row_l1_out=torch.zeros(m),
    )


def _backward_args(m=3, d=64, h=100, tile=64, slots=4, dtype=torch.bfloat16):
    n_tiles = -(-h // tile)
    return dict(
        dy=torch.randn(m, d).to(dtype),
        values=torch.zeros(m, n_tiles, slots, dtype=dtype),
        columns=torch.zeros(m, n_tiles, slots, dtype=torch.int16),
        counts=torch.zeros(m, n_tiles, dtype=torch.int32),
        u_slots=torch.zeros(m, n_tiles, slots),
        gate_weight=torch.zeros(h, d, dtype=dtype),
        up_weight=torch.zeros(h, d, dtype=dtype),
        down_weight_t=torch.zeros(h, d, dtype=dtype),
        l1_grad=torch.zeros(1),
        tile=tile, gated=True,
        dx_out=torch.zeros(m, d, dtype=dtype),
        du_out=torch.zeros(m, n_tiles, slots),
        dg_out=torch.zeros(m, n_tiles, slots),
    )


@pytest.mark.parametrize("change, error, match", [
    (dict(x=torch.randn(3, 64)), TypeError, "x must be bf16 or fp16"),
    (dict(gated=1), TypeError, "gated"),
    (dict(values=torch.zeros(3, 3, 4, dtype=torch.bfloat16),
          columns=torch.zeros(3, 3, 4, dtype=torch.int16),
          counts=torch.zeros(3, 3, dtype=torch.int32)), ValueError, "n_tiles"),
    (dict(values=torch.zeros(3, 3, 4, dtype=torch.bfloat16)), ValueError, "columns must have shape"),
    (dict(values=torch.zeros(3, 2, 65, dtype=torch.bfloat16)), ValueError, "slots"),
    (dict(values=torch.zeros(3, 2, 4, dtype=torch.float16)), TypeError, "values must have dtype"),
    (dict(columns=torch.zeros(3, 2, 4, dtype=torch.int32)), TypeError, "columns must have dtype"),
    (dict(counts=torch.zeros(2, 3, dtype=torch.int32).t()), ValueError, "counts must be contiguous"),
    (dict(up_weight=None), TypeError, "up_weight"),
    (dict(up_weight=torch.zeros(99, 64, dtype=torch.bfloat16)), ValueError, "up_weight"),
    (dict(down_weight_t=torch.zeros(64, 100, dtype=torch.bfloat16)), ValueError, "down_weight_t"),
    (dict(down_weight_t=torch.zeros(64, 100, dtype=torch.bfloat16).t()), ValueError,
     "down_weight_t must have unit stride"),
    (dict(u_out=None), TypeError, "u_out"),
    (dict(u_out=torch.zeros(3, 2, 4, dtype=torch.float64)), TypeError, "u_out must have dtype"),
    (dict(row_l1_out=torch.zeros(4)), ValueError, "row_l1_out must have shape"),
    (dict(out=torch.zeros(64, 3, dtype=torch.bfloat16).t()), ValueError, "out must have unit stride"),
    (dict(tile=0), ValueError, "tile"),
    (dict(config=dict(block_u=8)), TypeError, "config"),
])
def test_forward_input_errors(change, error, match):
    args = dict(_forward_args(), **change)
    with pytest.raises(error, match=match):
        twell_train_forward(**args)


@pytest.mark.parametrize("change, error, match", [
    (dict(dy=torch.randn(3, 64)), TypeError, "dy must be bf16 or fp16"),
    (dict(u_slots=None), TypeError, "u_slots"),
    (dict(gate_weight=None), TypeError, "gate_weight"),
    (dict(gated=False), ValueError, "gate_weight must be None when gated=False"),
    (dict(gated=False, gate_weight=None), ValueError, "u_slots must be None"),
    (dict(gated=False, gate_weight=None, u_slots=None), ValueError, "du_out must be None"),
    (dict(l1_grad=torch.zeros(())), ValueError, "l1_grad must have shape"),
    (dict(l1_grad=torch.zeros(1, dtype=torch.float64)), TypeError, "l1_grad must have dtype"),
    (dict(up_weight=torch.zeros(100, 63, dtype=torch.bfloat16)), ValueError, "up_weight"),
    (dict(dg_out=torch.zeros(3, 2, 5)), ValueError, "dg_out must have shape"),
    (dict(du_out=torch.zeros(3, 2, 4, dtype=torch.bfloat16)), TypeError, "du_out must have dtype"),
    (dict(dx_out=torch.zeros(3, 64, dtype=torch.float16)), TypeError, "dx_out must have dtype"),
])
def test_backward_input_errors(change, error, match):
    args = dict(_backward_args(), **change)
    with pytest.raises(error, match=match):
        twell_train_backward(**args)


def test_config_validation_and_defaults():
    with pytest.raises(ValueError, match="block_u"):
        TwellTrainConfig(block_u=3)
    with pytest.raises(ValueError, match="block_n"):
        TwellTrainConfig(block_u=8, block_n=4)
    with pytest.raises(ValueError, match="max_regs"):
        TwellTrainConfig(max_regs=300)
    with pytest.raises(TypeError, match="evict"):
        TwellTrainConfig(evict=1)
    for bad in (-64, 96, True):
        with pytest.raises(ValueError, match="split_slots"):
            TwellTrainConfig(split_slots=bad)
    with pytest.raises(ValueError, match="split_cap"):
        TwellTrainConfig(split_cap=0)
    fwd, bwd = default_forward_config(2048), default_backward_config(2048)
    assert (fwd.split_slots, fwd.split_cap, fwd.max_regs, bwd.max_regs) == (128, 256, 128, 168)
    assert (fwd.block_d, fwd.block_u, fwd.num_warps) == (2048, 4, 4)
    assert (bwd.block_d, bwd.block_u, bwd.num_warps) == (2048, 4, 4)
    assert default_forward_config(100).block_d == 128 and default_backward_config(100).block_u == 4
    assert default_forward_config(20000).block_d == 8192


def test_m_adds_no_specialization():
    """M never reaches a constexpr or the specialization key: compiled variants stay put when only
    M changes (the configs are functions of D)."""
    for kernel in (_twell_train_forward_kernel, _twell_train_backward_kernel):
        assert "M" in do_not_specialize(kernel)
    for fn in (default_forward_config, default_backward_config):
        assert positional_args(fn) == ("d",)


def test_compile_specs_cover_launcher_variants():
    """Both kernels, both dtypes, gated and not, aligned and not, whole-D and split-D programs;
    the constexprs named in every signature; options carry the launch's warps."""
    specs = compile_specs(with_options=True)
    seen = set()
    for fn, signature, constexprs, options in specs:
        assert set(constexprs) == {k for k, v in signature.items() if v == "constexpr"}
        assert options["num_warps"] >= 1
        ty = signature.get("x_ptr", signature.get("dy_ptr"))
        seen.add((fn.__name__, ty, constexprs["GATED"], constexprs["ALIGNED"],
                  constexprs["ONE_D_BLOCK"]))
    for fn in ("_twell_train_forward_kernel", "_twell_train_backward_kernel"):
        for ty in ("*bf16", "*fp16"):
            for gated in (True, False):
                assert {(fn, ty, gated, True, True), (fn, ty, gated, False, True),
                        (fn, ty, gated, True, False)} <= seen
    assert len(compile_specs()[0]) == 3


def test_small_config_exercises_every_loop():
    """SMALL splits D = 100 over programs, several batches, chunks and counts segments per row."""
    assert SMALL.block_d < 100 and SMALL.block_n < 16 and SMALL.block_u < SMALL.block_n
    assert SMALL.max_block_t < 320 // 64
    assert WIDE.block_n == WIDE.block_u
    assert dataclasses.replace(SMALL) == SMALL
