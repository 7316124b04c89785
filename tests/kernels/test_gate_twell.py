"""gate_twell: GEMM + threshold + ReLU + TwELL packing, against a float64 reference.

The reference is g = x @ W^T - θ in float64; a kernel entry is *active* iff its value rounded to the
activation dtype is > 0 or NaN. The kernel accumulates in fp32 in another order, so entries with
|g| within the fp32 accumulation bound of 0 may go either way: they are masked out explicitly,
counted, and that count must be tiny. Everything else is exact: counts (within the masked entries
of their tile), the set of stored columns (all active ones when count <= slots, `slots` distinct
active ones otherwise) and values within one ulp of the dtype (the interpreter truncates).

`_check` is the whole contract; test_checker_catches_corruption shows it fails on a wrong column,
count, value, a dropped or duplicated slot and a stored inactive entry.
"""

from __future__ import annotations

import pytest
import torch

from sparseffn.kernels.gate_twell import FEW_TOKENS, _gate_twell_kernel, gate_twell
from sparseffn.kernels.configs.gate_twell import GateTwellConfig, default_config, few_tokens_config
from tests.kernels.jit import do_not_specialize, positional_args

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning",  # triton interpreter
    "ignore:invalid value encountered:RuntimeWarning",  # NaN inputs in the interpreter's numpy
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16]
EPS = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # one ulp, relative (normal numbers)
TINY = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}  # one ulp at the bottom of the range


# ----------------------------------------------------------------------------------------------------
# reference and checker


def _reference(x, weight, threshold):
    """(g, amb): g = x @ W^T - θ in float64; amb marks entries whose sign the kernel's fp32
    accumulation (any order, tensor-core rounding) may decide either way."""
    xd, wd = x.double(), weight.double()
    g = xd @ wd.T
    bound = xd.abs() @ wd.abs().T
    if threshold is not None:
        g = g - threshold.double()
        bound = bound + threshold.double().abs()
    tol = (x.shape[1] + 2) * 2.0**-23 * bound
    amb = g.abs() < tol  # strict: tol = 0 means an exact zero (zero row, no threshold)
    return g, amb, tol


def _check(values, columns, counts, g, amb, tol, dtype, tile, slots, *, max_ambiguous=0.002):
    """Assert (values, columns, counts) is a correct TwELL packing of relu(g) (module docstring)."""
    m, h = g.shape
    n_tiles = -(-h // tile)
    assert values.shape == (m, n_tiles, slots) and values.dtype == dtype
    assert columns.shape == (m, n_tiles, slots) and columns.dtype == torch.int16
    assert counts.shape == (m, n_tiles) and counts.dtype == torch.int32
    assert int(amb.sum()) <= max(2, max_ambiguous * amb.numel()), f"{int(amb.sum())} ambiguous entries"

    pad = n_tiles * tile - h
    g_t = torch.nn.functional.pad(g, (0, pad), value=-1.0).view(m, n_tiles, tile)
    amb_t = torch.nn.functional.pad(amb, (0, pad)).view(m, n_tiles, tile)
    tol_t = torch.nn.functional.pad(tol, (0, pad)).view(m, n_tiles, tile)
    rounded = g_t.to(dtype)
    active = ~(rounded <= 0)  # > 0 or NaN, in the activation dtype
    sure = active & ~amb_t
    maybe = active | amb_t
    widths = (h - torch.arange(n_tiles, device=g.device) * tile).clamp(max=tile)

    counts = counts.long()
    assert bool((counts >= sure.sum(-1)).all()), "a count misses active entries"
    assert bool((counts <= maybe.sum(-1)).all()), "a count includes inactive entries"
    assert bool((counts <= widths).all()), "a count exceeds its tile's width"

    valid = torch.arange(slots, device=g.device) < counts.clamp(max=slots).unsqueeze(-1)  # [M, T, S]
    cols = columns.long()
    in_tile = (cols >= 0) & (cols < widths[:, None])
    assert bool(in_tile[valid].all()), "a valid slot holds a column outside its tile"
    hits = torch.zeros(m, n_tiles, tile, dtype=torch.long, device=g.device)
    hits.scatter_add_(2, torch.where(valid, cols, 0), valid.long())
    assert hits.numel() == 0 or int(hits.max()) <= 1, "a column is stored twice in one (row, tile)"
    stored = hits.bool()
    assert not bool((stored & ~maybe).any()), "an inactive entry is stored"
    fits = (counts <= slots).unsqueeze(-1)
    assert not bool((sure & ~stored & fits).any()), "an active entry of a tile that fits is missing"

    ref = g_t.gather(2, torch.where(valid, cols, 0))[valid]
    got = values[valid].double()
    ref_amb = amb_t.gather(2, torch.where(valid, cols, 0))[valid]
    ref_tol = tol_t.gather(2, torch.where(valid, cols, 0))[valid]
    nan = torch.isnan(ref)
    assert bool((torch.isnan(got) == nan).all()), "NaN mismatch"
    ok = (got == ref) | ((got - ref).abs() <= EPS[dtype] * ref.abs() + ref_tol + TINY[dtype])
    assert bool((ok | nan | ref_amb).all()), "a stored value is off by more than one ulp"
    assert not bool((got[~nan] <= 0).any()), "a stored value is zero or negative"


def _data(m, d, h, dtype, threshold_kind, gen):
    """x [M, D], W [H, D] ~ N(0, 1) with row scales {1, 1, 0, 2.5} (zero rows and heavy rows) and
    θ per neuron: none; or per tile: moderate (some (row, tile) above `slots`, some below), huge
    (a tile that never fires), very negative (a tile that always fires, overflow), mild."""
    x = torch.randn(m, d, generator=gen)
    x = x * torch.tensor([1.0, 1.0, 0.0, 2.5]).repeat(m)[:m, None]
    w = torch.randn(h, d, generator=gen)
    theta = None
    if threshold_kind == "per_neuron":
        sigma = d**0.5
        level = torch.tensor([1.5, 1e3, -1e3, 2.0, 1.2])
        tile_of = torch.arange(h) // 32
        theta = (level[tile_of % 5] * sigma + 0.3 * torch.randn(h, generator=gen)).float()
    return x.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE), None if theta is None else theta.to(DEVICE)


def _run(x, w, theta, tile, slots, **kwargs):
    values, columns, counts = gate_twell(x, w, theta, tile=tile, slots=slots, **kwargs)
    g, amb, tol = _reference(x, w, theta)
    _check(values, columns, counts, g, amb, tol, x.dtype, tile, slots)
    return values, columns, counts


# ----------------------------------------------------------------------------------------------------
# correctness under the interpreter (and on the GPU when there is one)

CASES = [  # M, D, H, tile, slots: M odd / 1 / a block, D and H not multiples of the blocks
    (1, 72, 100, 64, 4),
    (37, 100, 200, 64, 8),
    (128, 72, 320, 128, 8),
    (37, 136, 300, 256, 16),
    (40, 40, 96, 32, 4),
    (5, 24, 5, 32, 3),  # H smaller than one tile
    (16, 64, 96, 32, 32),  # slots == tile: nothing overflows
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}-D{}-H{}-t{}-s{}".format(*c))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threshold_kind", ["none", "per_neuron"])
@pytest.mark.parametrize("path", ["tiles", "persistent"])
def test_matches_reference(case, dtype, threshold_kind, path):
    m, d, h, tile, slots = case
    gen = torch.Generator().manual_seed(m * 1000 + d + h)
    x, w, theta = _data(m, d, h, dtype, threshold_kind, gen)
    if path == "persistent":  # a grid smaller than the tile count; TMA descriptors when aligned
        tma = None if CUDA else d % 8 == 0
        _, _, counts = _run(x, w, theta, tile, slots, persistent=True, tma=tma)
    else:
        _, _, counts = _run(x, w, theta, tile, slots, persistent=False, tma=False)
    if threshold_kind == "per_neuron" and slots < tile and h > 2 * 32 and m >= 3:
        assert bool((counts == 0).any()) and bool((counts > slots).any())  # the data has both kinds


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_x_matches_contiguous(dtype):
    gen = torch.Generator().manual_seed(7)
    x, w, theta = _data(33, 72, 150, dtype, "per_neuron", gen)
    expected = gate_twell(x, w, theta, tile=64, slots=8, persistent=False, tma=False)
    wide = torch.zeros(66, 2 * 72 + 8, dtype=dtype, device=DEVICE)
    views = {
        "row stride": wide[::2, 8:80],  # unit inner stride, row stride 304: TMA-able
        "inner stride": wide[1::2, 8 : 8 + 2 * 72 : 2],  # stride 2 along D: pointer loads
        "transposed": x.T.contiguous().T,  # column-major
    }
    for name, view in views.items():
        view.copy_(x)
        got = gate_twell(view, w, theta, tile=64, slots=8, persistent=name != "transposed")
        assert _same_packing(got, expected), name


def _same_packing(a, b):
    """Equal counts and, per (row, tile), equal sets of (column, value) over the valid slots."""
    (va, ca, na), (vb, cb, nb) = a, b
    if not torch.equal(na, nb):
        return False
    k = na.clamp(max=va.shape[-1])
    for r, t in zip(*torch.nonzero(k, as_tuple=True)):
        n = int(k[r, t])
        sa = sorted(zip(ca[r, t, :n].tolist(), va[r, t, :n].float().tolist()))
        sb = sorted(zip(cb[r, t, :n].tolist(), vb[r, t, :n].float().tolist()))
        if sa != sb:
            return False
    return True


def test_empty_and_degenerate_shapes():
    w = torch.randn(100, 24, dtype=torch.bfloat16, device=DEVICE)
    values, columns, counts = gate_twell(torch.empty(0, 24, dtype=torch.bfloat16, device=DEVICE), w, tile=64, slots=4)
    assert values.shape == (0, 2, 4) and values.dtype == torch.bfloat16
    assert columns.shape == (0, 2, 4) and columns.dtype == torch.int16
    assert counts.shape == (0, 2) and counts.dtype == torch.int32
    # D = 0: g = -θ for every row
    theta = torch.linspace(-2, 2, 100, device=DEVICE)
    x0 = torch.empty(3, 0, dtype=torch.bfloat16, device=DEVICE)
    w0 = torch.empty(100, 0, dtype=torch.bfloat16, device=DEVICE)
    values, columns, counts = gate_twell(x0, w0, theta, tile=64, slots=64)
    g, amb, tol = _reference(x0, w0, theta)
    _check(values, columns, counts, g, amb, tol, torch.bfloat16, 64, 64)
    assert counts.tolist() == [[50, 0]] * 3  # θ < 0 on the first 50 neurons


def test_nan_and_inf_inputs_propagate_like_relu():
    """relu(NaN) = NaN: a NaN gate value is active (stored, counted), as TwELL and dense torch keep
    it; columns past H stay inactive even where x's inf makes them NaN (W is zero-padded)."""
    gen = torch.Generator().manual_seed(3)
    x, w, _ = _data(6, 40, 70, torch.bfloat16, "none", gen)
    x[1, 3] = float("nan")
    x[4, 5] = float("inf")
    for tile, slots in ((64, 64), (32, 8)):
        values, columns, counts = _run(x, w, None, tile, slots)
        assert counts[1].tolist() == [min(tile, 70 - t * tile) for t in range(counts.shape[1])]
        dense = gate_twell(x, w, None, tile=tile, slots=slots, mode="dense")
        assert int(torch.isnan(dense[1]).sum()) == 70


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_diagnostic_modes(dtype):
    gen = torch.Generator().manual_seed(11)
    x, w, theta = _data(37, 72, 200, dtype, "per_neuron", gen)
    _, _, counts = gate_twell(x, w, theta, tile=64, slots=8)
    counts_only = gate_twell(x, w, theta, tile=64, slots=8, mode="counts")[2]
    assert torch.equal(counts_only, counts)
    dense = gate_twell(x, w, theta, tile=64, slots=8, mode="dense")
    assert dense.shape == (37, 200) and dense.dtype == dtype
    g, amb, tol = _reference(x, w, theta)
    active = ~(g.to(dtype) <= 0)
    assert not bool((dense != 0)[~active & ~amb].any())
    ok = (dense.double() - g).abs() <= EPS[dtype] * g.abs() + tol + TINY[dtype]
    assert bool((ok | ~active | amb).all())


def test_pack_is_bit_exact_against_dense_mode_through_twell():
    """Same kernel, same accumulation: packing the dense mode's output with TwELL.from_dense gives
    the packed mode's counts, and TwELL built from the packed fields round-trips bit for bit."""
    from sparseffn.format import TwELL

    gen = torch.Generator().manual_seed(5)
    x, w, theta = _data(64, 72, 300, torch.bfloat16, "per_neuron", gen)
    for tile, slots in ((64, 8), (128, 16)):
        values, columns, counts = gate_twell(x, w, theta, tile=tile, slots=slots)
        dense = gate_twell(x, w, theta, tile=tile, slots=slots, mode="dense")
        reference = TwELL.from_dense(dense, tile=tile, slots=slots)
        assert torch.equal(counts, reference.counts)
        packed = TwELL(values, columns, counts, reference.overflow_rows, reference.overflow_values, 300, tile, slots)
        packed.validate()
        assert torch.equal(packed.to_dense().view(torch.int16), dense.view(torch.int16))


def test_scan_reference_epilogue_agrees_and_is_in_column_order():
    gen = torch.Generator().manual_seed(9)
    x, w, theta = _data(37, 72, 300, torch.float16, "per_neuron", gen)
    config = default_config(72, 300, torch.float16, 128, cuda=CUDA)
    scan = GateTwellConfig(**{**config.__dict__, "scan_epilogue": True})
    a = _run(x, w, theta, 128, 8)
    b = _run(x, w, theta, 128, 8, config=scan)
    assert torch.equal(a[2], b[2])
    fits = (a[2] <= 8).nonzero()
    for r, t in fits.tolist():  # tiles that fit hold the same set in both
        n = int(a[2][r, t])
        assert sorted(a[1][r, t, :n].tolist()) == sorted(b[1][r, t, :n].tolist())
    k = b[2].clamp(max=8)
    for r, t in k.nonzero().tolist():  # the scan version stores ascending columns
        cols = b[1][r, t, : int(k[r, t])].tolist()
        assert cols == sorted(cols)


@pytest.mark.parametrize("tile,slots", [(256, 32), (64, 8), (32, 4)])
def test_few_tokens_path_matches_reference(tile, slots):
    """Few-token calls pack through the dense relu output (N-blocks of 32) and a packing kernel:
    a correct TwELL (slots in column order), the same counts and column sets as the packing
    epilogue, for 1 and 37 rows (the 16- and 64-row configs), thresholds, D not a block multiple."""
    gen = torch.Generator().manual_seed(23)
    x, w, theta = _data(37, 200, 300, torch.bfloat16, "per_neuron", gen)
    for rows, th in ((1, None), (5, theta), (37, theta)):
        few = _run(x[:rows], w, th, tile, slots, few_tokens=True)
        tiles = gate_twell(x[:rows], w, th, tile=tile, slots=slots, few_tokens=False)
        assert torch.equal(few[2], tiles[2])
        k = few[2].clamp(max=slots)
        for r, t in k.nonzero().tolist():
            n = int(k[r, t])
            cols = few[1][r, t, :n].tolist()
            assert cols == sorted(cols)
            if int(few[2][r, t]) <= slots:
                assert cols == sorted(tiles[1][r, t, :n].tolist())
    with pytest.raises(ValueError, match="few_tokens=True packs with its own launches"):
        gate_twell(x, w, theta, few_tokens=True, mode="counts")


def test_checker_catches_corruption():
    gen = torch.Generator().manual_seed(13)
    x, w, theta = _data(37, 72, 200, torch.bfloat16, "per_neuron", gen)
    values, columns, counts = gate_twell(x, w, theta, tile=64, slots=8)
    g, amb, tol = _reference(x, w, theta)
    _check(values, columns, counts, g, amb, tol, torch.bfloat16, 64, 8)
    fit = ((counts > 1) & (counts <= 8)).nonzero()[0].tolist()  # a (row, tile) with 2..8 entries
    over = (counts > 8).nonzero()[0].tolist()
    r, t = fit
    n = int(counts[r, t])
    free = sorted(set(range(min(64, 200 - 64 * t))) - set(columns[r, t, :n].tolist()))

    def corrupted(fn):
        v, c, k = values.clone(), columns.clone(), counts.clone()
        fn(v, c, k)
        return v, c, k

    mutations = {
        "wrong column": lambda v, c, k: c[r, t].__setitem__(0, free[0]),
        "duplicate slot": lambda v, c, k: c[r, t].__setitem__(1, c[r, t, 0]),
        "dropped slot": lambda v, c, k: k[r].__setitem__(t, n - 1),
        "count too high": lambda v, c, k: k[r].__setitem__(t, n + 1),
        "overflow count low": lambda v, c, k: k[over[0]].__setitem__(over[1], int(k[over[0], over[1]]) - 1),
        "value off by 2 ulp": lambda v, c, k: v[r, t].__setitem__(0, v[r, t, 0] * (1 + 2 * EPS[torch.bfloat16])),
        "zero value": lambda v, c, k: v[r, t].__setitem__(0, 0.0),
        "column outside tile": lambda v, c, k: c[r, t].__setitem__(0, 64),
    }
    for name, fn in mutations.items():
        with pytest.raises(AssertionError):
            _check(*corrupted(fn), g, amb, tol, torch.bfloat16, 64, 8)
            pytest.fail(f"the checker missed: {name}")


# ----------------------------------------------------------------------------------------------------
# contract of the launcher


def test_input_errors_name_the_argument():
    x = torch.randn(4, 16, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(40, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(NotImplementedError, match="tile"):
        gate_twell(x, w, tile=48)
    with pytest.raises(NotImplementedError, match="tile"):
        gate_twell(x, w, tile=512)
    with pytest.raises(ValueError, match="slots"):
        gate_twell(x, w, tile=32, slots=33)
    with pytest.raises(ValueError, match="slots"):
        gate_twell(x, w, tile=32, slots=0)
    with pytest.raises(ValueError, match="x must be 2-D"):
        gate_twell(x[None], w)
    with pytest.raises(TypeError, match="x must be torch.bfloat16 or torch.float16"):
        gate_twell(x.float(), w.float())
    with pytest.raises(TypeError, match="weight must have x's dtype"):
        gate_twell(x, w.half())
    with pytest.raises(ValueError, match="weight must be"):
        gate_twell(x, w[:, :8])
    with pytest.raises(ValueError, match="weight must have unit stride"):
        gate_twell(x, torch.randn(16, 40, dtype=torch.bfloat16, device=DEVICE).T)
    with pytest.raises(TypeError, match="threshold must be torch.float32"):
        gate_twell(x, w, torch.zeros(40, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="threshold must have shape"):
        gate_twell(x, w, torch.zeros(41, device=DEVICE))
    with pytest.raises(ValueError, match="mode"):
        gate_twell(x, w, mode="fast")
    with pytest.raises(ValueError, match="tma=True"):
        gate_twell(x[:, 1:15], w[:, 1:15], tma=True)


def test_m_adds_no_specialization():
    """M is do_not_specialize (Triton would otherwise specialize M == 1 and M % 16) and the config
    depends on (D, H, dtype, tile) only, the few-token one on two buckets (M <= 16, M <= 64); on a
    GPU the compiled-kernel cache must not grow with M once each bucket ran."""
    assert "M" in do_not_specialize(_gate_twell_kernel)
    assert "m" not in positional_args(default_config)
    assert few_tokens_config(2048, 1) is few_tokens_config(2048, 16)
    assert few_tokens_config(2048, 17) is few_tokens_config(2048, FEW_TOKENS)
    assert few_tokens_config(2048, 1).block_m == 16 and few_tokens_config(2048, 64).block_m == 64
    assert few_tokens_config(64, 1).num_stages == 1  # never more stages than k-steps
    if not CUDA:
        return
    gen = torch.Generator().manual_seed(1)
    x, w, theta = _data(300, 64, 512, torch.bfloat16, "per_neuron", gen)
    for m in (1, 17, 65):
        gate_twell(x[:m], w, theta)  # warm up every variant used below
    before = sum(len(cache[0]) for cache in _gate_twell_kernel.device_caches.values())
    for m in (1, 2, 16, 33, 64, 128, 300):
        gate_twell(x[:m], w, theta)
    after = sum(len(cache[0]) for cache in _gate_twell_kernel.device_caches.values())
    assert after == before


# ----------------------------------------------------------------------------------------------------
# GPU only: realistic shapes and every launch variant (skipped on CPU)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tile,slots", [(256, 32), (128, 16), (64, 8)])
def test_gpu_variants(dtype, tile, slots):
    gen = torch.Generator().manual_seed(17)
    m, d, h = 1000, 512, 2000
    x, w, theta = _data(m, d, h, dtype, "per_neuron", gen)
    base = default_config(d, h, dtype, tile, cuda=True)
    variants = {
        "default": {},
        "tiles": {"persistent": False},
        "persistent pointers": {"persistent": True, "tma": False},
        "tl.store": {"config": GateTwellConfig(**{**base.__dict__, "asm_stores": False})},
        "2 per SM": {"config": GateTwellConfig(64, 64, 8, 4, 2, programs_per_sm=2)},
    }
    if tile <= 128:
        variants["scan"] = {"config": GateTwellConfig(**{**base.__dict__, "scan_epilogue": True})}
    for name, kwargs in variants.items():
        _run(x, w, theta, tile, slots, **kwargs)
        _run(x[:1], w, theta, tile, slots, **kwargs)
    strided = torch.zeros(m, d + 8, dtype=dtype, device=DEVICE)[:, 8:]
    strided.copy_(x)
    _run(strided, w, theta, tile, slots)
    _run(x[:, ::2].contiguous().T.contiguous().T, w[:, ::2].contiguous(), theta, tile, slots)


@pytest.mark.parametrize("arch", [(8, 0), (8, 6), (8, 9)], ids=lambda a: f"sm{a[0]}{a[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_portable_path_matches_the_native_one(arch, dtype):
    """The code path of older GPUs (bf16 compared as fp32, no TMA, configs shrunk to their shared
    memory) forced on this device: the same packing as the native path, within the reference's
    tolerance, and bit for bit where the config is the same (sm_80 keeps Hopper's)."""
    gen = torch.Generator().manual_seed(23)
    m, d, h = (300, 256, 700) if CUDA else (40, 72, 300)
    x, w, theta = _data(m, d, h, dtype, "per_neuron", gen)
    tile, slots = (256, 32) if CUDA else (64, 8)
    native = _run(x, w, theta, tile, slots)
    portable = _run(x, w, theta, tile, slots, arch=arch)
    if arch == (8, 0) or not CUDA:
        assert _same_packing(native, portable)
    assert default_config(d, h, dtype, 256, cuda=True, arch=arch).num_stages >= 2
    with pytest.raises(ValueError, match="arch must be"):
        gate_twell(x, w, theta, tile=tile, slots=slots, arch=(12, 0))


def test_default_configs_fit_every_generation():
    from sparseffn.kernels._runtime import COMPILE_TARGETS

    for arch, limit in COMPILE_TARGETS.items():
        for tile in (32, 64, 128, 256):
            cfg = default_config(2048, 5632, torch.bfloat16, tile, cuda=True, arch=arch)
            assert cfg.num_stages * (cfg.block_m + tile) * cfg.block_k * 2 <= limit - 8 * 1024
    assert default_config(2048, 5632, torch.bfloat16, 256, cuda=True) == \
        default_config(2048, 5632, torch.bfloat16, 256, cuda=True, arch=(10, 0))
