"""slots_by_unit / unit_weight_grads against references built from dense tensors, and the whole
training path (forward, token-major backward, unit-major weight gradients) against autograd.

Packed inputs are adversarial (tests/kernels/test_twell_up_down.py `_activation`, `_pack`): rows
of every kind including overflow rows, shuffled valid slots, garbage in unspecified slots. Per-slot
fp32 inputs hold NaN outside the valid ordinary slots and the gradient buffers start as NaN, so a
slot read that should not happen, or a row left unwritten, shows.

Tolerances: the CSR is compared exactly (entry order too when deterministic); weight gradients
(fp32 accumulation of fp32 terms) per element at fp32 slack of the magnitude of their terms, and
by the flash-attention rule against torch's own fp32 computation. The kernel multiplies and adds
in fp32 on CUDA cores: units with a single entry are checked to within fp32 roundings.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparseffn.format import TwELL
from sparseffn.kernels import unit_grads
from sparseffn.kernels.twell_train import twell_train_backward, twell_train_forward
from sparseffn.kernels.unit_grads import (_unit_histogram_kernel, _unit_scatter_kernel, SlotCoefficients, SlotsByUnit,
                                          slots_by_unit, unit_weight_grads)
from sparseffn.kernels.configs.unit_grads import UnitGradsConfig, default_unit_grads_config
from tests.kernels.compile_specs.unit_grads import compile_specs
from sparseffn.ops.reference import mlp_activation_reference
from tests.kernels.jit import do_not_specialize, positional_args
from tests.kernels.test_twell_up_down import _activation, _pack

pytestmark = pytest.mark.filterwarnings(  # triton's interpreter turns 1-element arrays into ints
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (M, H, tile, slots): M = 1, odd M, H off the tile multiple, several row blocks of the
# deterministic counting sort (at least 16 rows each) at M = 40
CSR_SHAPES = [(1, 100, 64, 16), (5, 320, 64, 4), (33, 100, 32, 4), (40, 320, 128, 16)]


def _packed(m, h, tile, slots, dtype, seed, dead=(3, 17), hot=()):
    """(p [M, H], values, columns, counts, overflow) with units `dead` never active and units `hot`
    active in every row (those rows of ordinary kind that still fit hold them: many entries)."""
    gen = torch.Generator().manual_seed(seed)
    p = _activation(m, h, tile, slots, dtype, gen)
    p[:, list(hot)] = 1.5
    p[:, [j for j in dead if j < h]] = 0
    values, columns, counts, overflow = _pack(p, tile, slots, gen)
    return p, values, columns, counts, overflow


def _reference_csr(columns, counts, overflow, tile, h, with_slots=False):
    """(offsets int64 [H + 1], entries int64 [E]: tokens ordered by (unit, token)[, the flat slot
    index of each entry])."""
    n_tiles, slots = columns.shape[1:]
    k = torch.arange(slots)
    mask = (k < counts.clamp(max=slots)[..., None]) & ~overflow[:, None, None]
    row, t, kk = mask.nonzero(as_tuple=True)
    unit = t * tile + columns[row, t, kk].long()
    flat = (row * n_tiles + t) * slots + kk
    order = torch.sort(unit * (columns.numel() + 1) + flat).indices
    offsets = torch.zeros(h + 1, dtype=torch.int64)
    offsets[1:] = torch.bincount(unit, minlength=h).cumsum(0)
    return (offsets, row[order], flat[order]) if with_slots else (offsets, row[order])


def _run_csr(columns, counts, tile, h, slots, deterministic):
    offsets, entries, order, coefficients = slots_by_unit(columns.to(DEVICE), counts.to(DEVICE), tile=tile,
                                                          h=h, slots=slots, deterministic=deterministic)
    assert coefficients is None
    _assert_hottest_first(offsets.cpu(), order.cpu())
    return offsets.cpu(), entries.cpu()


def _assert_hottest_first(offsets, order):
    """order is the units by count, most entries first, ties by ascending unit id."""
    h = offsets.shape[0] - 1
    assert order.dtype == torch.int32 and order.shape == (h,)
    count = (offsets[1:] - offsets[:-1]).tolist()
    assert order.tolist() == sorted(range(h), key=lambda j: (-count[j], j))


def _assert_csr(offsets, entries, ref_offsets, ref_entries, deterministic):
    assert torch.equal(offsets.long(), ref_offsets)
    n = int(ref_offsets[-1])
    got = entries[:n].long()
    if deterministic:
        assert torch.equal(got, ref_entries), "entries of a unit not in token order"
    else:
        for j in range(len(ref_offsets) - 1):
            a, b = int(ref_offsets[j]), int(ref_offsets[j + 1])
            assert torch.equal(got[a:b].sort().values, ref_entries[a:b]), f"unit {j}"


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("shape", CSR_SHAPES, ids=lambda s: "M{}-H{}-t{}-s{}".format(*s))
def test_slots_by_unit_matches_reference(shape, deterministic):
    m, h, tile, slots = shape
    _, _, columns, counts, overflow = _packed(m, h, tile, slots, torch.bfloat16, seed=m + h)
    if m >= 6:
        assert overflow.any() and not overflow.all()
    offsets, entries = _run_csr(columns, counts, tile, h, slots, deterministic)
    assert offsets.dtype == entries.dtype == torch.int32
    assert offsets.shape == (h + 1,) and entries.shape == (columns.numel(),)
    _assert_csr(offsets, entries, *_reference_csr(columns, counts, overflow, tile, h),
                deterministic)


def test_slots_by_unit_many_blocks_int64_and_reproducible(monkeypatch):
    """The deterministic path with many row blocks (2 rows each) and int64 indices (forced: the
    real switch is M * n_tiles * slots >= 2**31) gives the exact ordered CSR, twice bit for bit;
    the fast path gives the same CSR up to the order inside units. Small scan blocks: the block
    prefix takes several steps over blocks and programs over units, the unit offsets and order
    several steps over units; then both through torch's scan and argsort (H above the rank
    kernel's limit)."""
    monkeypatch.setattr(unit_grads, "_MIN_DET_ROWS", 2)
    monkeypatch.setattr(unit_grads, "_PREFIX_BLOCKS", 4)
    monkeypatch.setattr(unit_grads, "_ORDER_UNITS", 16)
    monkeypatch.setattr(unit_grads, "_ORDER_STEP", 32)
    monkeypatch.setattr(unit_grads, "_index_dtype", lambda n: torch.int64)
    m, h, tile, slots = 23, 100, 32, 8
    _, _, columns, counts, overflow = _packed(m, h, tile, slots, torch.float16, seed=9)
    assert unit_grads._det_rows_per_block(m) == 2
    ref = _reference_csr(columns, counts, overflow, tile, h)
    first = _run_csr(columns, counts, tile, h, slots, True)
    second = _run_csr(columns, counts, tile, h, slots, True)
    assert first[0].dtype == first[1].dtype == torch.int64
    _assert_csr(*first, *ref, True)
    n = int(ref[0][-1])
    assert torch.equal(first[0], second[0]) and torch.equal(first[1][:n], second[1][:n])
    _assert_csr(*_run_csr(columns, counts, tile, h, slots, False), *ref, False)
    # more units than the rank kernel takes: torch's cumsum and argsort, the same CSR and order
    monkeypatch.setattr(unit_grads, "_RANK_MAX_UNITS", h - 1)
    for det in (True, False):
        _assert_csr(*_run_csr(columns, counts, tile, h, slots, det), *ref, det)


def test_slots_by_unit_edge_cases():
    # no rows
    for det in (False, True):
        offsets, entries, order, _ = slots_by_unit(torch.empty(0, 2, 4, dtype=torch.int16, device=DEVICE),
                                                   torch.empty(0, 2, dtype=torch.int32, device=DEVICE),
                                                   tile=64, h=100, slots=4, deterministic=det)
        assert offsets.shape == (101,) and (offsets == 0).all().item() and entries.numel() == 0
        assert order.cpu().tolist() == list(range(100))
    # only empty and overflow rows: no entries at all
    columns = torch.full((3, 2, 4), -1, dtype=torch.int16)
    counts = torch.tensor([[0, 0], [5, 0], [0, 0]], dtype=torch.int32)
    for det in (False, True):
        offsets, _ = _run_csr(columns, counts, 64, 100, 4, det)
        assert (offsets == 0).all()


@pytest.mark.parametrize("change, error, match", [
    (dict(columns=torch.zeros(3, 2, 4, dtype=torch.int32)), TypeError, "columns must have dtype"),
    (dict(columns=torch.zeros(3, 2, 5, dtype=torch.int16)), ValueError, "columns must have shape"),
    (dict(counts=torch.zeros(3, 3, dtype=torch.int32)), ValueError, "counts must have shape"),
    (dict(h=200), ValueError, "columns must have shape"),
    (dict(slots=65), ValueError, "slots"),
    (dict(tile=0), ValueError, "tile"),
    (dict(deterministic=None), TypeError, "deterministic"),
])
def test_slots_by_unit_input_errors(change, error, match):
    args = dict(columns=torch.zeros(3, 2, 4, dtype=torch.int16),
                counts=torch.zeros(3, 2, dtype=torch.int32), tile=64, h=100, slots=4,
                deterministic=False)
    args.update(change)
    with pytest.raises(error, match=match):
        slots_by_unit(**args)


# ----------------------------------------------------------------------------------------------------
# unit_weight_grads

# D split over programs (D = 100) with several steps per unit and partial steps
SPLIT = UnitGradsConfig(block_e=16, block_d=32, num_warps=1, num_stages=1, units_per_program=4,
                        max_regs=None)
# (M, D, H, tile, slots, dtype, strided x / dy, config)
GRAD_SHAPES = [
    (1, 64, 100, 64, 16, torch.bfloat16, False, None),
    (33, 100, 100, 32, 4, torch.float16, False, SPLIT),
    (40, 64, 160, 64, 16, torch.bfloat16, True, None),
]


def _strided(t: torch.Tensor) -> torch.Tensor:
    m, d = t.shape
    return torch.cat([t.new_zeros(m, 1), t, t.new_zeros(m, 4)], 1)[:, 1:d + 1]


def _grad_problem(m, d, h, tile, slots, dtype, gated, seed, hot=(), spread=0):
    """Packed p, token rows and fp32 per-slot inputs (NaN outside the valid ordinary slots), and
    their dense [M, H] float64 versions (zero outside). spread > 0: the per-slot inputs are scaled
    by 2^k, k uniform in [-spread, spread] (beyond fp16's range for spread > 16)."""
    p, values, columns, counts, overflow = _packed(m, h, tile, slots, dtype, seed, hot=hot)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, d, generator=gen).to(dtype)
    dy = torch.randn(m, d, generator=gen).to(dtype)
    k = torch.arange(slots)
    mask = (k < counts.clamp(max=slots)[..., None]) & ~overflow[:, None, None]
    row, t, kk = mask.nonzero(as_tuple=True)
    unit = t * tile + columns[row, t, kk].long()
    per_slot, dense = {}, {}
    for name in ("u", "du", "dg"):
        s = torch.full(values.shape, float("nan"))
        s[mask] = torch.randn(int(mask.sum()), generator=gen)
        if spread:
            k = torch.randint(-spread, spread + 1, (int(mask.sum()),), generator=gen)
            s[mask] *= torch.pow(2.0, k.float())
        per_slot[name] = s
        dense[name] = torch.zeros(m, h, dtype=torch.float64)
        dense[name][row, unit] = s[row, t, kk].double()
    dense["p"] = torch.zeros(m, h, dtype=torch.float64)
    dense["p"][row, unit] = values[row, t, kk].double()
    return dict(x=x, dy=dy, values=values, columns=columns, counts=counts, overflow=overflow,
                slots=per_slot, dense=dense)


def _by_unit(prob, gated, h, tile, deterministic):
    """slots_by_unit of the problem's packing, with its coefficients, on DEVICE."""
    n_tiles, slots = prob["values"].shape[1:]
    s = {k: v.to(DEVICE) for k, v in prob["slots"].items()}
    coefficients = SlotCoefficients(prob["values"].to(DEVICE), s["dg"], s["u"] if gated else None,
                                    s["du"] if gated else None)
    return slots_by_unit(prob["columns"].to(DEVICE), prob["counts"].to(DEVICE), tile=tile, h=h,
                         slots=slots, deterministic=deterministic, coefficients=coefficients)


def _run_grads(prob, gated, by_unit, strided=False, config=None):
    m, d = prob["x"].shape
    n_tiles, slots = prob["values"].shape[1:]
    h = by_unit.offsets.shape[0] - 1
    outs = [torch.full((h, d), float("nan"), device=DEVICE) for _ in range(3)]
    if not gated:
        outs[0] = None
    x, dy = (_strided(prob["x"]), _strided(prob["dy"])) if strided else (prob["x"], prob["dy"])
    unit_weight_grads(
        x.to(DEVICE), dy.to(DEVICE), by_unit, n_tiles=n_tiles, slots=slots,
        gated=gated, grad_gate_out=outs[0], grad_up_out=outs[1], grad_down_t_out=outs[2],
        config=config)
    return [None if o is None else o.cpu() for o in outs]


def _grad_references(prob, gated):
    """[(name, float64 ref, |terms| bound, torch fp32 result)] for the gradients the kernel writes."""
    dn = prob["dense"]
    x64, dy64 = prob["x"].double(), prob["dy"].double()
    h = dn["p"] * dn["u"] if gated else dn["p"]
    pairs = [("grad_up", dn["du"] if gated else dn["dg"], x64), ("grad_down_t", h, dy64)]
    if gated:
        pairs.insert(0, ("grad_gate", dn["dg"], x64))
    return [(name, a.t() @ b, a.abs().t() @ b.abs(), (a.float().t() @ b.float()).double())
            for name, a, b in pairs]


def _assert_grads(outs, prob, gated):
    refs = _grad_references(prob, gated)
    outs = [o for o in outs if o is not None]
    assert len(outs) == len(refs)
    for out, (name, ref, mag, torch32) in zip(outs, refs):
        out = out.double()
        assert torch.isfinite(out).all(), f"{name}: non-finite (a row left unwritten?)"
        err = (out - ref).abs()
        floor = torch.finfo(torch.float32).eps * ref.abs().max().item() + 1e-30
        bound = 2 * (torch32 - ref).abs().max().item() + floor
        assert err.max().item() <= bound, f"{name}: flash rule {err.max().item():.3g} > {bound:.3g}"
        assert (err <= 1e-5 * mag + 1e-30).all(), f"{name}: beyond fp32 slack"


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("shape", GRAD_SHAPES,
                         ids=lambda s: "M{}-D{}-H{}-t{}-s{}-{}-{}-{}".format(
                             *s[:5], str(s[5])[6:], "strided" if s[6] else "contig",
                             "split" if s[7] else "default"))
def test_unit_weight_grads_match_reference(shape, gated, deterministic):
    m, d, h, tile, slots, dtype, strided, config = shape
    prob = _grad_problem(m, d, h, tile, slots, dtype, gated, seed=m + d + h)
    by_unit = _by_unit(prob, gated, h, tile, deterministic)
    offsets = by_unit.offsets.cpu()
    assert (offsets[1:] == offsets[:-1])[3].item(), "unit 3 should have no entries"
    outs = _run_grads(prob, gated, by_unit, strided, config)
    _assert_grads(outs, prob, gated)
    for out in outs:
        if out is not None:
            assert (out[3] == 0).all(), "a unit without entries must be overwritten with 0"


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_unit_weight_grads_with_different_row_strides(gated):
    """x a row-strided view, dy contiguous: each gather takes its own row offsets (the shared
    int32 offset of equal strides would read dy's rows at x's stride); bitwise the shared path's
    result on contiguous copies."""
    m, d, h, tile, slots = 40, 64, 160, 64, 16
    prob = _grad_problem(m, d, h, tile, slots, torch.bfloat16, gated, seed=12)
    by_unit = _by_unit(prob, gated, h, tile, True)
    outs = [torch.full((h, d), float("nan"), device=DEVICE) for _ in range(3)]
    unit_weight_grads(_strided(prob["x"]).to(DEVICE), prob["dy"].to(DEVICE), by_unit,
                      n_tiles=prob["values"].shape[1], slots=slots, gated=gated,
                      grad_gate_out=outs[0] if gated else None, grad_up_out=outs[1], grad_down_t_out=outs[2])
    got = [o.cpu() for o in (outs if gated else outs[1:])]
    _assert_grads(got, prob, gated)
    want = [o for o in _run_grads(prob, gated, by_unit) if o is not None]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_unmasked_gathers_match_masked_ones(gated):
    """D = 64 in 64-column slices gathers without masks (dead lanes read token 0's rows, with zero
    coefficients); a 128-column slice masks them: the same sums (to fp32 rounding: the interpreter's
    matmul may order its products by shape), and token 0's huge row leaks into no unit."""
    m, d, h, tile, slots = 40, 64, 160, 64, 16
    prob = _grad_problem(m, d, h, tile, slots, torch.bfloat16, gated, seed=14)
    prob["x"][0] = 1e30  # large but finite: zero coefficients still cancel it exactly
    by_unit = _by_unit(prob, gated, h, tile, True)
    unmasked = _run_grads(prob, gated, by_unit, config=UnitGradsConfig(block_d=64))
    masked = _run_grads(prob, gated, by_unit, config=UnitGradsConfig(block_d=128))
    _assert_grads(unmasked, prob, gated)
    for a, b in zip(unmasked, masked):
        assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())


def test_unit_weight_grads_without_tokens_writes_zeros():
    h, d, n_tiles, slots = 100, 64, 2, 4
    x = torch.empty(0, d, dtype=torch.bfloat16, device=DEVICE)
    by_unit = slots_by_unit(torch.empty(0, n_tiles, slots, dtype=torch.int16, device=DEVICE),
                            torch.empty(0, n_tiles, dtype=torch.int32, device=DEVICE), tile=64, h=h,
                            slots=slots, deterministic=False,
                            coefficients=SlotCoefficients(*(torch.empty(0, n_tiles, slots, dtype=t, device=DEVICE)
                                                            for t in (torch.bfloat16, torch.float32, torch.float32,
                                                                      torch.float32))))
    outs = [torch.full((h, d), float("nan"), device=DEVICE) for _ in range(3)]
    unit_weight_grads(x, x.clone(), by_unit, n_tiles=n_tiles, slots=slots, gated=True, grad_gate_out=outs[0],
                      grad_up_out=outs[1], grad_down_t_out=outs[2])
    assert all((o == 0).all() for o in outs)


def test_deterministic_weight_grads_are_bitwise_reproducible():
    """deterministic=True, run twice from the packing on: bitwise equal gradients (and equal to
    the fast path's within fp32 rounding)."""
    m, d, h, tile, slots = 40, 64, 100, 32, 8
    prob = _grad_problem(m, d, h, tile, slots, torch.bfloat16, True, seed=21)
    runs = []
    for _ in range(2):
        runs.append(_run_grads(prob, True, _by_unit(prob, True, h, tile, True)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    for a, b in zip(runs[0], _run_grads(prob, True, _by_unit(prob, True, h, tile, False))):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_grad_tolerance_rejects_a_missing_entry():
    m, d, h, tile, slots = 12, 64, 100, 64, 16
    prob = _grad_problem(m, d, h, tile, slots, torch.bfloat16, True, seed=4)
    by_unit = _by_unit(prob, True, h, tile, True)
    _assert_grads(_run_grads(prob, True, by_unit), prob, True)
    offsets = by_unit.offsets.cpu()
    j = int(torch.argmax((offsets[1:] - offsets[:-1]).float()))
    e = int(offsets[j])
    entries, coefficients = by_unit.entries.clone(), by_unit.coefficients.clone()
    entries[e], coefficients[:, e] = entries[e + 1], coefficients[:, e + 1]  # an entry counted twice
    with pytest.raises(AssertionError):
        moved = SlotsByUnit(by_unit.offsets, entries, by_unit.order, coefficients)
        _assert_grads(_run_grads(prob, True, moved), prob, True)


# several steps per unit (hot units), units of one program of every length, D off the slice width
HOT_CONFIGS = [
    UnitGradsConfig(block_e=16, block_d=32, num_warps=1, num_stages=1, units_per_program=2,
                    max_regs=None),
    UnitGradsConfig(block_e=16, block_d=64, num_warps=2, num_stages=1, units_per_program=32,
                    max_regs=None),
]


@pytest.mark.parametrize("config", HOT_CONFIGS, ids=["2units", "32units"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_unit_weight_grads_hot_units_wide_range(dtype, gated, config):
    """Hot units walk several steps (and share programs with short and empty units), and the
    per-slot coefficients span 2^-30 .. 2^30, beyond fp16's range: the kernel's fp32 products and
    sums take them as they are. Same tolerances as everywhere."""
    m, d, h, tile, slots = 72, 48, 64, 32, 8
    prob = _grad_problem(m, d, h, tile, slots, dtype, gated, seed=5, hot=(0, 1, 2, 40), spread=30)
    by_unit = _by_unit(prob, gated, h, tile, True)
    offsets = by_unit.offsets.cpu()
    n = offsets[1:] - offsets[:-1]
    assert int(n.max()) > 2 * config.block_e and int((n == 0).sum()) >= 2
    outs = _run_grads(prob, gated, by_unit, config=config)
    _assert_grads(outs, prob, gated)


@pytest.mark.parametrize("config", HOT_CONFIGS[:1], ids=["2units"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_hot_units_spill_past_the_cap(gated, config):
    """Entries of a unit past cap_entries are summed in chunks by the spill kernel and added to the rows
    the main kernel stored (several chunks per hot unit, one unit in several programs' turns); in
    deterministic mode nothing spills and the bits repeat."""
    m, d, h, tile, slots = 72, 48, 64, 32, 8
    prob = _grad_problem(m, d, h, tile, slots, torch.bfloat16, gated, seed=5, hot=(0, 1, 2, 40), spread=30)
    by_unit = _by_unit(prob, gated, h, tile, False)
    offsets = by_unit.offsets.cpu()
    capped = dataclasses.replace(config, cap_entries=16)
    assert int((offsets[1:] - offsets[:-1]).max()) > 2 * capped.cap_entries  # two or more chunks spill
    _assert_grads(_run_grads(prob, gated, by_unit, config=capped), prob, gated)
    m_, n_tiles, _ = prob["values"].shape
    outs = []
    for _ in range(2):
        grads = [torch.full((h, d), float("nan"), device=DEVICE) for _ in range(3)]
        unit_weight_grads(prob["x"].to(DEVICE), prob["dy"].to(DEVICE), by_unit, n_tiles=n_tiles, slots=slots,
                          gated=gated, grad_gate_out=grads[0] if gated else None, grad_up_out=grads[1],
                          grad_down_t_out=grads[2], config=capped, deterministic=True)
        outs.append([g.cpu() for g in grads[0 if gated else 1:]])
    _assert_grads(outs[0] if gated else [None] + outs[0], prob, gated)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_single_entry_units_are_exact_to_fp32_rounding(dtype):
    """A unit with one entry e gets c_e * x[m_e] up to the fp32 roundings of h = p u and of the
    product (<= 2 * 2^-24 relative): the coefficients reach the product with all their fp32 bits
    (a kernel that rounded them to x's dtype, or to a two-term hi + lo split, fails this)."""
    m, d, h, tile, slots = 24, 64, 100, 64, 16
    prob = _grad_problem(m, d, h, tile, slots, dtype, True, seed=8, spread=12)
    by_unit = _by_unit(prob, True, h, tile, True)
    offsets = by_unit.offsets.cpu()
    single = (offsets[1:] - offsets[:-1]) == 1
    assert int(single.sum()) >= 5
    outs = _run_grads(prob, True, by_unit)
    for out, (name, ref, _, _) in zip(outs, _grad_references(prob, True)):
        err = (out.double() - ref)[single].abs()
        assert (err <= 2.0**-22 * ref[single].abs() + 1e-45).all(), f"{name}: {err.max():.3g}"


@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_slots_by_unit_moves_coefficients_into_entry_order(dtype, gated, deterministic):
    """coefficients[:, e] are the coefficients of the slot entries[e] (dg, h = p u or p, du), bit
    for bit; the CSR itself is the one built without them."""
    m, d, h, tile, slots = 33, 16, 100, 32, 4
    prob = _grad_problem(m, d, h, tile, slots, dtype, gated, seed=6)
    offsets, entries, _, coefficients = (t.cpu() for t in _by_unit(prob, gated, h, tile, deterministic))
    ref_offsets, ref_entries, ref_flat = _reference_csr(prob["columns"], prob["counts"], prob["overflow"],
                                                        tile, h, with_slots=True)
    _assert_csr(offsets, entries, ref_offsets, ref_entries, deterministic)
    n = int(offsets[-1])
    assert coefficients.shape == (3 if gated else 2, prob["values"].numel()) and n > 0
    # the slot of each entry: (unit, token) names it
    units = torch.repeat_interleave(torch.arange(h), offsets[1:] - offsets[:-1])
    slot_of = torch.full((prob["x"].shape[0], h), -1, dtype=torch.int64)
    slot_of[ref_entries, torch.repeat_interleave(torch.arange(h), ref_offsets[1:] - ref_offsets[:-1])] = ref_flat
    flat = slot_of[entries[:n].long(), units]
    assert (flat >= 0).all()
    s = {k: v.reshape(-1)[flat] for k, v in prob["slots"].items()}
    p = prob["values"].reshape(-1)[flat].float()
    want = [s["dg"], p * s["u"], s["du"]] if gated else [s["dg"], p]
    assert torch.equal(coefficients[:, :n], torch.stack(want))


def _grad_args(m=3, d=64, h=100, n_tiles=2, slots=4, dtype=torch.bfloat16):
    return dict(
        x=torch.randn(m, d).to(dtype), dy=torch.randn(m, d).to(dtype),
        offsets=torch.zeros(h + 1, dtype=torch.int32),
        entries=torch.zeros(m * n_tiles * slots, dtype=torch.int32),
        order=torch.arange(h, dtype=torch.int32),
        coefficients=torch.zeros(3, m * n_tiles * slots),
        n_tiles=n_tiles, slots=slots, gated=True,
        grad_gate_out=torch.zeros(h, d), grad_up_out=torch.zeros(h, d),
        grad_down_t_out=torch.zeros(h, d),
    )


@pytest.mark.parametrize("change, error, match", [
    (dict(x=torch.randn(3, 64)), TypeError, "x must be bf16 or fp16"),
    (dict(dy=torch.randn(3, 64).half()), TypeError, "dy must have dtype"),
    (dict(coefficients=None), ValueError, "coefficients is None"),
    (dict(coefficients=torch.zeros(2, 24)), ValueError, "coefficients must have shape"),
    (dict(coefficients=torch.zeros(3, 24, dtype=torch.bfloat16)), TypeError, "coefficients must have dtype"),
    (dict(gated=False), ValueError, "coefficients must have shape"),
    (dict(gated=False, coefficients=torch.zeros(2, 24)), ValueError, "grad_gate_out must be None"),
    (dict(offsets=torch.zeros(101, dtype=torch.int64)), TypeError, "offsets must have dtype"),
    (dict(entries=torch.zeros(23, dtype=torch.int32)), ValueError, "entries must have shape"),
    (dict(order=torch.arange(100)), TypeError, "order must have dtype"),
    (dict(order=torch.arange(99, dtype=torch.int32)), ValueError, "order must have shape"),
    (dict(grad_up_out=torch.zeros(100, 64, dtype=torch.bfloat16)), TypeError, "grad_up_out"),
    (dict(grad_down_t_out=torch.zeros(64, 100).t()), ValueError, "grad_down_t_out must have unit"),
    (dict(grad_gate_out=torch.zeros(99, 64)), ValueError, "grad_gate_out must have shape"),
    (dict(slots=0), ValueError, "slots"),
    (dict(config=UnitGradsConfig(block_e=16).__dict__), TypeError, "config"),
])
def test_unit_weight_grads_input_errors(change, error, match):
    args = dict(_grad_args(), **change)
    by_unit = SlotsByUnit(args.pop("offsets"), args.pop("entries"), args.pop("order"), args.pop("coefficients"))
    with pytest.raises(error, match=match):
        unit_weight_grads(by_unit=by_unit, **args)


def test_unit_weight_grads_takes_only_a_by_unit():
    args = _grad_args()
    plain = (args.pop("offsets"), args.pop("entries"), args.pop("order"), args.pop("coefficients"))
    with pytest.raises(TypeError, match="by_unit must be a SlotsByUnit"):
        unit_weight_grads(by_unit=plain, **args)


@pytest.mark.parametrize("change, error, match", [
    (dict(values=torch.zeros(3, 2, 4)), TypeError, "coefficients.values must be a bf16 or fp16"),
    (dict(values=torch.zeros(3, 2, 5, dtype=torch.float16)), ValueError, "values must have shape"),
    (dict(dg_slots=torch.zeros(3, 2, 4, dtype=torch.float16)), TypeError, "dg_slots must have dtype"),
    (dict(u_slots=None), ValueError, "both be given"),
    (dict(du_slots=torch.zeros(3, 4, 2).transpose(1, 2)), ValueError, "du_slots must be contiguous"),
])
def test_slots_by_unit_coefficient_errors(change, error, match):
    fields = dict(values=torch.zeros(3, 2, 4, dtype=torch.bfloat16), dg_slots=torch.zeros(3, 2, 4),
                  u_slots=torch.zeros(3, 2, 4), du_slots=torch.zeros(3, 2, 4))
    fields.update(change)
    with pytest.raises(error, match=match):
        slots_by_unit(torch.zeros(3, 2, 4, dtype=torch.int16), torch.zeros(3, 2, dtype=torch.int32),
                      tile=64, h=100, slots=4, deterministic=False, coefficients=SlotCoefficients(**fields))
    with pytest.raises(TypeError, match="coefficients must be a SlotCoefficients"):
        slots_by_unit(torch.zeros(3, 2, 4, dtype=torch.int16), torch.zeros(3, 2, dtype=torch.int32),
                      tile=64, h=100, slots=4, deterministic=False, coefficients=tuple(fields.values()))


def test_config_validation_and_default():
    with pytest.raises(ValueError, match="block_e"):
        UnitGradsConfig(block_e=3)
    with pytest.raises(ValueError, match="block_d must be >= 16"):
        UnitGradsConfig(block_d=8)
    with pytest.raises(ValueError, match="num_warps"):
        UnitGradsConfig(num_warps=0)
    with pytest.raises(ValueError, match="num_stages"):
        UnitGradsConfig(num_stages=0)
    with pytest.raises(ValueError, match="units_per_program"):
        UnitGradsConfig(units_per_program=3)
    with pytest.raises(ValueError, match="max_regs"):
        UnitGradsConfig(max_regs=300)
    with pytest.raises(ValueError, match="cap_entries must be a multiple of block_e"):
        UnitGradsConfig(block_e=8, cap_entries=12)
    assert default_unit_grads_config(2048) == UnitGradsConfig(
        block_e=8, block_d=1024, num_warps=4, num_stages=1, units_per_program=4, max_regs=None)
    # a slice of up to 1024 columns, one warp per 256 of them: the threads span the slice
    assert default_unit_grads_config(4096) == default_unit_grads_config(2048)
    assert default_unit_grads_config(100) == dataclasses.replace(default_unit_grads_config(2048), block_d=128,
                                                                 num_warps=1)
    assert (default_unit_grads_config(512).block_d, default_unit_grads_config(512).num_warps) == (512, 2)
    assert default_unit_grads_config(1).block_d == 16 and default_unit_grads_config(1).num_warps == 1


def test_m_adds_no_specialization():
    for kernel in (_unit_histogram_kernel, _unit_scatter_kernel):
        assert "M" in do_not_specialize(kernel)
    assert positional_args(default_unit_grads_config) == ("d",)  # the weight-gradient config: D only


def test_compile_specs_cover_launcher_variants():
    specs = compile_specs(with_options=True)
    names = {fn.__name__ for fn, *_ in specs}
    assert names == {"_unit_histogram_kernel", "_block_prefix_kernel", "_unit_offsets_kernel", "_unit_scatter_kernel",
                     "_unit_weight_grads_kernel", "_unit_spill_grads_kernel"}
    assert {(c["SERIAL"], c["COEFFICIENTS"]) for fn, _, c, _ in specs if "SERIAL" in c} == {
        (serial, n) for serial in (True, False) for n in (0, 1, 2)}
    grads = {(s["x_ptr"], s["entries_ptr"], c["GATED"], c["ALIGNED"], c["SHARED_ROWS"])
             for fn, s, c, _ in specs if fn.__name__ == "_unit_weight_grads_kernel"}
    assert len(grads) == 16
    for fn, s, c, options in specs:  # the launcher's options are compiled too
        if fn.__name__ == "_unit_weight_grads_kernel" and c["ALIGNED"]:
            assert (c["BLOCK_E"], c["BLOCK_D"]) == (8, 1024)
            assert options == {"num_warps": 4, "num_stages": 1}
    for _, signature, constexprs, _ in specs:
        assert set(constexprs) == {k for k, v in signature.items() if v == "constexpr"}


# ----------------------------------------------------------------------------------------------------
# the whole training path against autograd


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_training_path_matches_autograd(gated):
    """Forward, token-major backward and unit-major weight gradients on `TwELL.from_dense` of the
    activation from `mlp_activation_reference`, against float64 autograd of
    loss = Σ y·dy_seed + λ · mean over the M tokens of Σ_j |h_j|, restricted to ordinary rows
    (the dense-rows kernels own the others). p is the activation rounded to bf16 as the gate
    kernel stores it; its gradient flows through the ReLU."""
    m, d, h, tile, slots, dtype, lam = 24, 64, 192, 64, 12, torch.bfloat16, 3.0
    gen = torch.Generator().manual_seed(17 + gated)
    x = torch.randn(m, d, generator=gen)
    x[::5] *= 3  # heavy tokens: these rows overflow
    x = x.to(dtype)
    gate = (torch.randn(h, d, generator=gen) / d**0.5).to(dtype) if gated else None
    up = (torch.randn(h, d, generator=gen) / d**0.5).to(dtype)
    down = (torch.randn(d, h, generator=gen) / h**0.5).to(dtype)
    dy = (torch.randn(m, d, generator=gen) * 0.1).to(dtype)
    theta = 1.0 + torch.randn(h, generator=gen).abs()  # ~5% of units active per ordinary token
    theta[:4] = -1.0  # hot units
    p32, _ = mlp_activation_reference(x, gate, up, theta)
    packed = TwELL.from_dense(p32.to(dtype), tile=tile, slots=slots)
    ordinary = torch.ones(m, dtype=torch.bool)
    ordinary[packed.overflow_rows] = False
    assert 0 < int(ordinary.sum()) < m
    n_tiles = packed.num_tiles
    down_t = down.t().contiguous()
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731

    y = torch.zeros(m, d, dtype=dtype, device=DEVICE)
    u_out = torch.zeros(m, n_tiles, slots, device=DEVICE) if gated else None
    row_l1 = torch.zeros(m, device=DEVICE)
    fields = [dev(packed.values), dev(packed.columns), dev(packed.counts)]
    twell_train_forward(dev(x), *fields, dev(up) if gated else None, dev(down_t), tile=tile,
                        gated=gated, out=y, u_out=u_out, row_l1_out=row_l1)
    dx = torch.zeros(m, d, dtype=dtype, device=DEVICE)
    du = torch.zeros(m, n_tiles, slots, device=DEVICE) if gated else None
    dg = torch.zeros(m, n_tiles, slots, device=DEVICE)
    l1_grad = torch.tensor([lam / m], device=DEVICE)
    twell_train_backward(dev(dy), *fields, u_out, dev(gate), dev(up), dev(down_t), l1_grad,
                         tile=tile, gated=gated, dx_out=dx, du_out=du, dg_out=dg)
    by_unit = slots_by_unit(fields[1], fields[2], tile=tile, h=h, slots=slots, deterministic=True,
                            coefficients=SlotCoefficients(fields[0], dg, u_out, du))
    grads = [torch.zeros(h, d, device=DEVICE) if gated else None,
             torch.zeros(h, d, device=DEVICE), torch.zeros(h, d, device=DEVICE)]
    unit_weight_grads(dev(x), dev(dy), by_unit,
                      n_tiles=n_tiles, slots=slots, gated=gated, grad_gate_out=grads[0],
                      grad_up_out=grads[1], grad_down_t_out=grads[2])

    def reference(lam):
        leaves = [t.double().requires_grad_() for t in (x, gate, up, down) if t is not None]
        xr, *w = leaves
        gr, ur, dr = (w if gated else [None, *w])
        first = xr[ordinary] @ (gr if gated else ur).t() - theta.double()
        p_lowp = packed.to_dense()[ordinary].double()
        # value: p as stored (bf16); gradient: the ReLU's, on the stored support
        p = torch.where(p_lowp > 0, first + (p_lowp - first).detach(), 0.0)
        hh = p * (xr[ordinary] @ ur.t()) if gated else p
        yr = hh @ dr.t()
        loss = (yr * dy[ordinary].double()).sum() + lam * hh.abs().sum() / m
        loss.backward()
        got = [leaf.grad for leaf in leaves]
        l1 = hh.abs().sum(1)
        return yr.detach(), l1.detach(), got

    y_ref, l1_ref, (dx_ref, *w_ref) = reference(lam)
    _, _, (dx_nol1, *w_nol1) = reference(0.0)
    dw_ref = ([w_ref[0], w_ref[1]] if gated else [None, w_ref[0]]) + [w_ref[-1].t()]
    dw_nol1 = ([w_nol1[0], w_nol1[1]] if gated else [None, w_nol1[0]]) + [w_nol1[-1].t()]

    def rel(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    eps = torch.finfo(dtype).eps  # y and dx: fp32 accumulation, one rounding to bf16
    assert rel(y.cpu()[ordinary], y_ref) <= eps
    assert rel(row_l1.cpu()[ordinary], l1_ref) <= 1e-5
    assert rel(dx.cpu()[ordinary], dx_ref[ordinary]) <= eps
    assert rel(dx_nol1[ordinary], dx_ref[ordinary]) > 10 * eps, "the L1 term must matter here"
    for i, (got, ref, nol1) in enumerate(zip(grads, dw_ref, dw_nol1)):
        if ref is None:
            assert got is None
            continue
        assert rel(got.cpu(), ref) <= 1e-4
        if i < 2:  # gate and up gradients carry the L1 term (down's does not: dWd = dy^T h)
            assert rel(nol1, ref) > 1e-2, "the L1 term must matter here"
