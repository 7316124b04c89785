"""twell_up_down: fused up + down from a TwELL-packed gate activation, against a float64 reference.

Every packed input is adversarial: slots are shuffled inside each tile and the unspecified slots hold
NaN / inf / huge values and out-of-range or negative columns, so reading one of them poisons the row
or faults. Overflow rows must be left exactly as the caller wrote them.

Tolerances (docs/design.md, "Exactness"): the flash-attention rule `max|out - ref| <= 2 max|torch_lowp - ref|
+ floor`, and, tighter and per element, `|out - ref| <= eps·|ref| + fp32 slack`: y is accumulated in
fp32 and rounded once (the interpreter truncates: one ulp), so any dropped, duplicated or
bf16-rounded product shows.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from sparseffn.kernels.twell_up_down import twell_up_down
from sparseffn.kernels.configs.twell_up_down import UpDownConfig, benchmark_configs, default_config
from tests.kernels.compile_specs.twell_up_down import compile_specs

pytestmark = pytest.mark.filterwarnings(  # triton's interpreter turns 1-element arrays into ints
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DTYPES = [torch.bfloat16, torch.float16]
# Native kernels on a GPU machine, the interpreter on CPU (tests/conftest.py); problems are built on
# the CPU and results compared there.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(up, down, layout="separate"):
    """(up or None, down_t) as the kernel takes them: two contiguous [H, D] tensors ("separate"), or
    two views of one [H, 2, D] tensor whose rows hold a unit's up and down side by side ("interleaved")."""
    down_t = down.t().contiguous()
    if layout == "separate":
        return up, down_t
    if up is None:
        return None, torch.stack((down_t, down_t), 1)[:, 1]
    both = torch.stack((up, down_t), 1)
    return both[:, 0], both[:, 1]


def _on_device(t):
    """t on DEVICE with its strides and storage offset kept (views of interleaved weights stay views)."""
    if t is None or t.device.type == DEVICE:
        return t
    base = t._base if t._base is not None else t
    return base.to(DEVICE).as_strided(t.shape, t.stride(), t.storage_offset())


def _run(x, values, columns, counts, weights, *, tile, out=None, config=None, deterministic=False):
    """twell_up_down on DEVICE; writes into and returns `out` when given (a CPU tensor)."""
    args = [t.to(DEVICE) for t in (x, values, columns, counts)] + [_on_device(w) for w in weights]
    y = twell_up_down(*args, tile=tile, out=None if out is None else out.to(DEVICE), config=config,
                      deterministic=deterministic)
    if out is None:
        return y.cpu()
    out.copy_(y.cpu())
    return out
# a config that exercises every loop: several tokens per program (M not a multiple), several
# batches of compact slots per row (block_n 8), several chunks per batch, D split over programs
# (u looped over D blocks), several counts segments per row
SMALL = UpDownConfig(block_m=3, block_u=4, block_d=64, block_n=8, max_block_t=2, num_warps=1,
                     max_regs=None)
# every kernel variant (UpDownConfig fields); None = default_config(D). The interpreter ignores
# max_regs: those variants differ only when compiled (GPU runs of this file).
CONFIGS = {
    "default": None,
    "small": SMALL,
    # one chunk per batch: columns/values loaded per chunk (the first kernel's structure)
    "chunked": dataclasses.replace(SMALL, block_u=8, max_block_t=8, lookahead=False, evict=False),
    "prefetch": dataclasses.replace(SMALL, block_m=2, block_d=128, block_n=16, prefetch=True),
    "persistent": dataclasses.replace(SMALL, block_d=128, block_n=16, persistent=2),
    # rows of more than 8 valid slots split into pieces of 8 (whole D per program); the list holds
    # 2 rows, so other long rows run whole in the same launch
    "split": dataclasses.replace(SMALL, block_d=128, split_slots=8, split_cap=2),
    "split_all": dataclasses.replace(SMALL, block_d=128, block_n=16, split_slots=16, split_cap=64, persistent=2),
}

# row kinds of the synthetic activation
_ZERO, _SPARSE, _MEDIUM, _FULL, _TIP, _DENSE = range(6)


def _activation(m: int, h: int, tile: int, slots: int, dtype: torch.dtype, gen: torch.Generator):
    """p [M, H] in `dtype`, non-negative, rows of every kind: all zero, sparse, medium, exactly
    `slots` non-zeros in every tile (the most an ordinary row holds), one tile at slots + 1
    (overflow by one), all dense (overflow)."""
    p = (torch.rand(m, h, generator=gen) * 2 + 0.25).to(dtype)
    mask = torch.zeros(m, h, dtype=torch.bool)
    kinds = [(_SPARSE, _ZERO, _MEDIUM, _FULL, _TIP, _DENSE)[i % 6] for i in range(m)]
    if m == 1:
        kinds = [_FULL]  # the largest ordinary row
    for row, kind in enumerate(kinds):
        if kind in (_SPARSE, _MEDIUM):
            mask[row] = torch.rand(h, generator=gen) < (0.02 if kind == _SPARSE else 0.08)
        elif kind == _DENSE:
            mask[row] = True
        elif kind in (_FULL, _TIP):
            for t0 in range(0, h, tile):
                width = min(tile, h - t0)
                take = min(slots, width)
                cols = torch.randperm(width, generator=gen)[:take]
                mask[row, t0 + cols] = True
            if kind == _TIP:
                # the last tile wider than slots gets one more (a late counts segment)
                t0 = [t0 for t0 in range(0, h, tile) if min(tile, h - t0) > slots][-1]
                free = (~mask[row, t0:t0 + tile]).nonzero().flatten()
                mask[row, t0 + free[0]] = True
    return torch.where(mask, p, torch.zeros((), dtype=dtype))


def _pack(p: torch.Tensor, tile: int, slots: int, gen: torch.Generator):
    """TwELL fields of p (docs/format.md) with shuffled valid slots and garbage in the rest."""
    m, h = p.shape
    n_tiles = -(-h // tile)
    poison = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0e4], dtype=p.dtype)
    values = poison[torch.randint(0, 4, (m, n_tiles, slots), generator=gen)]
    bad_columns = torch.tensor([-1, tile, 32767, -32768, tile + 5], dtype=torch.int16)
    columns = bad_columns[torch.randint(0, 5, (m, n_tiles, slots), generator=gen)]
    counts = torch.zeros(m, n_tiles, dtype=torch.int32)
    for row in range(m):
        for t in range(n_tiles):
            seg = p[row, t * tile:(t + 1) * tile]
            nz = seg.nonzero().flatten()
            nz = nz[torch.randperm(len(nz), generator=gen)]
            counts[row, t] = len(nz)
            k = min(len(nz), slots)
            values[row, t, :k] = seg[nz[:k]]
            columns[row, t, :k] = nz[:k].to(torch.int16)
    overflow = (counts > slots).any(1)
    return values, columns, counts, overflow


def _problem(m, d, h, tile, slots, dtype, gated, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen).to(dtype)
    up = (torch.randn(h, d, generator=gen) / d**0.5).to(dtype) if gated else None
    down = (torch.randn(d, h, generator=gen) * 0.5).to(dtype)
    p = _activation(m, h, tile, slots, dtype, gen)
    values, columns, counts, overflow = _pack(p, tile, slots, gen)
    return x, up, down, p, values, columns, counts, overflow


def _reference(x, up, down, p):
    """(float64 truth, |terms| bound for fp32 rounding slack, torch in the low dtype)."""
    x64, p64, down64 = x.double(), p.double(), down.double()
    if up is None:
        ref, mag = p64 @ down64.t(), p64.abs() @ down64.abs().t()
        lowp = p @ down.t()
    else:
        up64 = up.double()
        ref = (p64 * (x64 @ up64.t())) @ down64.t()
        mag = (p64.abs() * (x64.abs() @ up64.abs().t())) @ down64.abs().t()
        lowp = (p * (x @ up.t())) @ down.t()
    return ref, mag, lowp.double()


def _assert_close(out, ref, mag, lowp, rows, dtype):
    assert rows.any(), "no ordinary row to compare"
    out, ref, mag, lowp = out[rows].double(), ref[rows], mag[rows], lowp[rows]
    assert torch.isfinite(out).all(), "non-finite output: an unspecified slot was read"
    eps = torch.finfo(dtype).eps
    err = (out - ref).abs()
    floor = eps * ref.abs().max().item() + torch.finfo(dtype).tiny
    bound = 2 * (lowp - ref).abs().max().item() + floor
    assert err.max().item() <= bound, f"flash rule: max err {err.max().item():.3g} > {bound:.3g}"
    elementwise = eps * ref.abs() + 3e-5 * mag + torch.finfo(dtype).tiny
    worst = (err - elementwise).max().item()
    assert worst <= 0, f"error exceeds one {dtype} ulp + fp32 slack by {worst:.3g}"


def _shapes():
    """(M, D, H, tile, slots, strided x, config name): every combination of M, D, H, tile and
    slots; strided x alternates and the configs take turns so that each meets every value of
    every other parameter."""
    grid = itertools.product((1, 5, 33), (64, 100), (100, 320), (64, 128), (4, 16))
    names = list(CONFIGS)
    return [(*s, i % 2 == 1, names[i % len(names)]) for i, s in enumerate(grid)]


SHAPES = _shapes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-D{}-H{}-t{}-s{}-{}-{}".format(
    *s[:5], "strided" if s[5] else "contig", s[6]))
def test_matches_float64_reference(shape, gated, dtype):
    m, d, h, tile, slots, strided, name = shape
    x, up, down, p, values, columns, counts, overflow = _problem(m, d, h, tile, slots, dtype, gated,
                                                                 seed=m * 1000 + d + h + slots)
    if strided:  # rows of a wider, misaligned buffer (row stride d + 5, 2-byte offset)
        x = torch.cat([torch.zeros(m, 1, dtype=dtype), x, torch.zeros(m, 4, dtype=dtype)], 1)[:, 1:d + 1]
        assert x.stride() == (d + 5, 1)
    if m >= 6:
        assert overflow.any() and not overflow.all()
    weights = _weights(up, down, "interleaved" if (m + d) % 2 else "separate")
    sentinel = torch.tensor(-1234.5, dtype=dtype)
    out = torch.full((m, d), sentinel.item(), dtype=dtype)
    y = _run(x, values, columns, counts, weights, tile=tile, out=out, config=CONFIGS[name])
    assert y is out
    ref, mag, lowp = _reference(x, up, down, p)
    _assert_close(y, ref, mag, lowp, ~overflow, dtype)
    assert torch.equal(y[overflow], out.new_full((int(overflow.sum()), d), sentinel.item()))


def test_shape_grid_gives_every_variant_every_parameter():
    for name in CONFIGS:
        shapes = [s for s in SHAPES if s[6] == name]
        for k in range(6):
            assert {s[k] for s in shapes} == {s[k] for s in SHAPES}, (name, k)


def test_rows_of_every_kind_are_present():
    """The synthetic activation does contain what the tests claim: zero rows, count == slots in
    every tile (ordinary), one tile at slots + 1 (overflow), dense rows (overflow)."""
    gen = torch.Generator().manual_seed(0)
    p = _activation(12, 320, 64, 16, torch.bfloat16, gen)
    _, _, counts, overflow = _pack(p, 64, 16, gen)
    assert (counts.sum(1) == 0).any()
    assert ((counts == 16).all(1) & ~overflow).any()
    assert ((counts == 17).sum(1) == 1).any()
    assert (counts == 64).all(1).any()
    assert overflow.tolist() == [False, False, False, False, True, True] * 2


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_default_output_and_transposed_x(gated):
    """out=None allocates; x with a non-unit stride along D is accepted (copied)."""
    m, d, h, tile, slots, dtype = 7, 64, 100, 64, 16, torch.float16
    x, up, down, p, values, columns, counts, overflow = _problem(m, d, h, tile, slots, dtype, gated, 7)
    xt = x.t().contiguous().t()
    assert xt.stride(1) != 1
    y = _run(xt, values, columns, counts, _weights(up, down), tile=tile)
    assert y.shape == (m, d) and y.dtype == dtype
    _assert_close(y, *_reference(x, up, down, p), ~overflow, dtype)


@pytest.mark.parametrize("flag_dtype", [torch.uint8, torch.bool], ids=str)
@pytest.mark.parametrize("config", ["default", "split"])
def test_overflow_out_flags_the_overflow_rows(flag_dtype, config):
    m, d, h, tile, slots, dtype = 13, 64, 320, 64, 4, torch.bfloat16
    x, up, down, p, values, columns, counts, overflow = _problem(m, d, h, tile, slots, dtype, True, 9)
    assert overflow.any() and not overflow.all()
    args = [t.to(DEVICE) for t in (x, values, columns, counts)] + [_on_device(w) for w in _weights(up, down)]
    flags = torch.full((m,), 7, dtype=torch.uint8).to(flag_dtype).to(DEVICE)
    y = twell_up_down(*args, tile=tile, overflow_out=flags, config=CONFIGS[config]).cpu()
    assert torch.equal(flags.cpu().bool(), overflow)
    _assert_close(y, *_reference(x, up, down, p), ~overflow, dtype)


@pytest.mark.parametrize("config", ["default", "split"])
@pytest.mark.parametrize("with_flags", [False, True], ids=["list", "list+flags"])
def test_overflow_list_names_each_overflow_row_once(config, with_flags):
    """The overflow rows as a list (ids[0:count], any order): the same rows as the flags, each
    once, in the same launch as the flags when both are asked for; the output is unchanged."""
    m, d, h, tile, slots, dtype = 150, 64, 320, 64, 4, torch.bfloat16  # 3 classification blocks
    x, up, down, p, values, columns, counts, overflow = _problem(m, d, h, tile, slots, dtype, True, 9)
    assert 1 < int(overflow.sum()) < m
    args = [t.to(DEVICE) for t in (x, values, columns, counts)] + [_on_device(w) for w in _weights(up, down)]
    ids = torch.full((m,), -1, dtype=torch.int32, device=DEVICE)
    count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    flags = torch.zeros(m, dtype=torch.bool, device=DEVICE) if with_flags else None
    y = twell_up_down(*args, tile=tile, overflow_out=flags, overflow_list=(ids, count),
                      config=CONFIGS[config]).cpu()
    n = int(count)
    assert n == int(overflow.sum())
    assert torch.equal(ids[:n].cpu().long().sort().values, overflow.nonzero().flatten())
    assert (ids[n:].cpu() == -1).all()  # nothing written past the list
    if with_flags:
        assert torch.equal(flags.cpu(), overflow)
    _assert_close(y, *_reference(x, up, down, p), ~overflow, dtype)


def test_split_list_takes_long_rows_up_to_its_capacity():
    """With room for 2, two long rows are split and the other long rows run whole in the same
    launch; every ordinary row is right either way."""
    from sparseffn.kernels.row_split import classify_rows

    m, d, h, tile, slots, dtype = 24, 64, 320, 64, 16, torch.float16
    config = CONFIGS["split"]
    x, up, down, p, values, columns, counts, overflow = _problem(m, d, h, tile, slots, dtype, True, 11)
    nnz = counts.sum(1)
    long_rows = ~overflow & (nnz > config.split_slots)
    assert int(long_rows.sum()) > config.split_cap
    split = classify_rows(counts.to(DEVICE), slots, piece=config.split_slots, cap=config.split_cap,
                          max_block_t=config.max_block_t, d=d, split=True)
    flags, ids, state, cap, max_pieces = split.flags.cpu(), split.ids.cpu(), split.state.cpu(), split.cap, split.max_pieces
    assert cap == config.split_cap and max_pieces == -(-5 * slots // config.split_slots)
    assert int(state[cap]) == int(long_rows.sum())  # every long row counted, only cap taken
    assert torch.equal(flags.bool(), torch.isin(torch.arange(m), ids.long()))
    assert long_rows[ids.long()].all() and int(flags.sum()) == cap
    y = _run(x, values, columns, counts, _weights(up, down), tile=tile, config=config)
    _assert_close(y, *_reference(x, up, down, p), ~overflow, dtype)


def test_deterministic_long_rows_give_the_same_bits_listed_or_not():
    """Which long rows the split list takes follows the programs' arrival when there are more than
    it holds. Deterministic, a row run whole adds its pieces' sums in piece order, as a listed row
    does: room for 2 rows (the others whole) gives the bits of room for every row."""
    m, d, h, tile, slots, dtype = 64, 64, 320, 64, 16, torch.float16
    x, up, down, p, values, columns, counts, overflow = _problem(m, d, h, tile, slots, dtype, True, 11)
    config = CONFIGS["split"]
    assert int((~overflow & (counts.sum(1) > config.split_slots)).sum()) > config.split_cap
    weight = _weights(up, down)
    y_two, y_all = (_run(x, values, columns, counts, weight, tile=tile, config=cfg, out=torch.zeros(m, d, dtype=dtype),
                         deterministic=True)
                    for cfg in (config, dataclasses.replace(config, split_cap=m)))
    assert y_two is not y_all and torch.equal(y_two.view(torch.uint8), y_all.view(torch.uint8))
    _assert_close(y_two, *_reference(x, up, down, p), ~overflow, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_deterministic_long_rows_at_scale():
    """The paper's shape at 65536 tokens has ~330 heavy rows, more than the list's 256. Deterministic:
    the bits of room for every row. Default: some rows differ in their last bits (what the flag is
    for; rows split or whole round differently in fp32)."""
    from sparseffn.bench.synthetic import synthetic_mlp
    from sparseffn.kernels.gate_twell import gate_twell

    m, d, h, tile = 65536, 2048, 5632, 256
    mlp = synthetic_mlp(m, d, h, 29.0, device="cuda", seed=0)
    values, columns, counts = gate_twell(mlp.x, mlp.gate_weight, None, tile=tile, slots=32)
    config = default_config(d)
    assert int((counts.sum(1) > config.split_slots).sum()) > config.split_cap
    weight = (mlp.up_weight, mlp.down_weight.t().contiguous())

    def run(cfg, deterministic):
        return twell_up_down(mlp.x, values, columns, counts, *weight, tile=tile, config=cfg, out=torch.zeros_like(mlp.x),
                             deterministic=deterministic).view(torch.int16)

    room_for_all = dataclasses.replace(config, split_cap=m)
    assert torch.equal(run(config, True), run(room_for_all, True))
    assert not torch.equal(run(config, False), run(room_for_all, False))


def test_split_list_capacity_keeps_partials_within_budget():
    """The partials buffer (list rows x pieces of the longest row x D, fp32) stays within the
    budget: the paper's shapes keep 256 rows, a wide MLP gets fewer, and never fewer than one."""
    from sparseffn.kernels.row_split import PARTIALS_BUDGET_BYTES, list_capacity

    assert list_capacity(256, 65536, 2048, 6) == 256  # D = 2048 / H = 5632, tile 256, slots 32
    assert list_capacity(256, 65536, 4096, 14) == 256  # D = 4096 / H = 14336
    wide = list_capacity(256, 65536, 8192, 28)  # D = 8192 / H = 28672
    assert 0 < wide < 256 and wide * 28 * 8192 * 4 <= PARTIALS_BUDGET_BYTES
    assert list_capacity(256, 3, 2048, 6) == 3 and list_capacity(256, 65536, 10**9, 1000) == 1


def test_agrees_with_twell_format_and_reference_op():
    """Packed by `TwELL.from_dense`, overflow rows filled by the caller from the eager reference op
    (`ops.reference.twell_up_down_reference`): the whole output matches it within rounding."""
    twell = pytest.importorskip("sparseffn.format.twell")
    reference = pytest.importorskip("sparseffn.ops.reference")
    m, d, h, tile, slots, dtype = 12, 64, 320, 64, 16, torch.bfloat16
    x, up, down, p, *_ = _problem(m, d, h, tile, slots, dtype, True, 11)
    packed = twell.TwELL.from_dense(p, tile=tile, slots=slots)
    assert len(packed.overflow_rows) > 0
    ref = reference.twell_up_down_reference(x, packed, up, down)
    out = torch.empty(m, d, dtype=dtype)
    out[packed.overflow_rows] = ref[packed.overflow_rows]
    _run(x, packed.values, packed.columns, packed.counts, _weights(up, down),
                  tile=packed.tile, out=out)
    # both round an fp32 result once (the interpreter truncates): at most ~1.5 ulp apart
    tol = 2 * torch.finfo(dtype).eps * ref.float().abs() + 1e-6
    assert ((out.float() - ref.float()).abs() <= tol).all()


def test_tolerance_rejects_a_missing_unit():
    """The comparison used above fails when one active unit of one row is dropped."""
    m, d, h, tile, slots, dtype = 5, 64, 100, 64, 16, torch.bfloat16
    x, up, down, p, values, columns, counts, overflow = _problem(m, d, h, tile, slots, dtype, True, 3)
    weight = _weights(up, down)
    y = _run(x, values, columns, counts, weight, tile=tile)
    ref, mag, lowp = _reference(x, up, down, p)
    _assert_close(y, ref, mag, lowp, ~overflow, dtype)
    row = int((counts.sum(1) > 1).logical_and(~overflow).nonzero()[0])
    t = int(counts[row].nonzero()[0])
    counts_dropped = counts.clone()
    counts_dropped[row, t] -= 1  # the last valid slot of that tile becomes unspecified
    y_dropped = _run(x, values, columns, counts_dropped, weight, tile=tile)
    with pytest.raises(AssertionError):
        _assert_close(y_dropped, ref, mag, lowp, ~overflow, dtype)


def test_empty_and_no_active_units():
    dtype = torch.bfloat16
    weight = _weights(torch.randn(100, 64).to(dtype), torch.randn(64, 100).to(dtype))
    y = _run(torch.empty(0, 64, dtype=dtype), torch.empty(0, 2, 4, dtype=dtype),
                      torch.empty(0, 2, 4, dtype=torch.int16), torch.empty(0, 2, dtype=torch.int32),
                      weight, tile=64)
    assert y.shape == (0, 64)
    values = torch.full((3, 2, 4), float("nan"), dtype=dtype)
    columns = torch.full((3, 2, 4), -1, dtype=torch.int16)
    out = torch.full((3, 64), 7.0, dtype=dtype)
    _run(torch.randn(3, 64).to(dtype), values, columns, torch.zeros(3, 2, dtype=torch.int32),
                  weight, tile=64, out=out)
    assert torch.equal(out, torch.zeros(3, 64, dtype=dtype))


def _valid_args(m=3, d=64, h=100, tile=64, slots=4, dtype=torch.bfloat16):
    n_tiles = -(-h // tile)
    return dict(
        x=torch.randn(m, d).to(dtype),
        values=torch.zeros(m, n_tiles, slots, dtype=dtype),
        columns=torch.zeros(m, n_tiles, slots, dtype=torch.int16),
        counts=torch.zeros(m, n_tiles, dtype=torch.int32),
        up_weight=torch.zeros(h, d, dtype=dtype),
        down_t=torch.zeros(h, d, dtype=dtype),
        tile=tile,
    )


@pytest.mark.parametrize("change, error, match", [
    (dict(x=torch.randn(3, 64)), TypeError, "x must be bf16 or fp16"),
    (dict(x=torch.randn(3, 64, 1).bfloat16()), ValueError, "x must have shape"),
    (dict(values=torch.zeros(3, 2, 4)), TypeError, "values must have dtype"),
    (dict(values=torch.zeros(3, 3, 4, dtype=torch.bfloat16)), ValueError, "n_tiles"),
    (dict(values=torch.zeros(3, 2, 65, dtype=torch.bfloat16)), ValueError, "slots"),
    (dict(columns=torch.zeros(3, 2, 4, dtype=torch.int32)), TypeError, "columns must have dtype"),
    (dict(columns=torch.zeros(3, 2, 5, dtype=torch.int16)), ValueError, "columns must have shape"),
    (dict(counts=torch.zeros(3, 2, dtype=torch.int64)), TypeError, "counts must have dtype"),
    (dict(counts=torch.zeros(2, 3, dtype=torch.int32).t()), ValueError, "counts must be contiguous"),
    (dict(up_weight=torch.zeros(100, 63, dtype=torch.bfloat16)), ValueError, "up_weight must have shape"),
    (dict(down_t=torch.zeros(100, 64, dtype=torch.float16)), TypeError, "down_t must have dtype"),
    (dict(down_t=torch.zeros(64, 100, dtype=torch.bfloat16).t()), ValueError, "down_t must have unit stride"),
    (dict(tile=0), ValueError, "tile"),
    (dict(out=torch.zeros(3, 63, dtype=torch.bfloat16)), ValueError, "out must have shape"),
    (dict(out=torch.zeros(64, 3, dtype=torch.bfloat16).t()), ValueError, "out must have unit stride"),
    (dict(config=dict(block_u=8)), TypeError, "config"),
    (dict(overflow_out=torch.zeros(3, dtype=torch.int32)), TypeError, "overflow_out must have dtype"),
    (dict(overflow_out=torch.zeros(4, dtype=torch.uint8)), ValueError, "overflow_out must have shape"),
    (dict(overflow_out=torch.zeros(3, 2, dtype=torch.uint8)[:, 0]), ValueError, "overflow_out must be contiguous"),
    (dict(overflow_list=torch.zeros(3, dtype=torch.int32)), TypeError, "overflow_list must be a pair"),
    (dict(overflow_list=(torch.zeros(4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))), ValueError,
     "overflow_list ids must be a contiguous int32 tensor of shape"),
    (dict(overflow_list=(torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))), ValueError,
     "overflow_list count must be a contiguous int32"),
])
def test_input_errors(change, error, match):
    args = dict(_valid_args(), **change)
    with pytest.raises(error, match=match):
        twell_up_down(**args)


def test_config_validation_and_default():
    with pytest.raises(ValueError, match="block_u"):
        UpDownConfig(block_u=3)
    with pytest.raises(ValueError, match="block_m"):
        UpDownConfig(block_m=0)
    with pytest.raises(ValueError, match="block_n"):
        UpDownConfig(block_u=8, block_n=4)
    with pytest.raises(ValueError, match="num_warps"):
        UpDownConfig(num_warps=0)
    with pytest.raises(TypeError):
        UpDownConfig(num_stages=3)  # the pipelined variant faulted on sm_90 and was removed
    with pytest.raises(ValueError, match="persistent"):
        UpDownConfig(persistent=-1)
    with pytest.raises(ValueError, match="max_regs"):
        UpDownConfig(max_regs=300)
    with pytest.raises(TypeError, match="evict"):
        UpDownConfig(evict=1)
    for bad in (-64, 96, 32, True):  # a multiple of block_n = 64, or 0
        with pytest.raises(ValueError, match="split_slots"):
            UpDownConfig(split_slots=bad)
    with pytest.raises(ValueError, match="split_cap"):
        UpDownConfig(split_cap=0)
    assert UpDownConfig(split_slots=0).split_slots == 0
    cfg = default_config(2048)
    assert cfg == UpDownConfig()
    assert cfg.block_d == 2048 and cfg.block_u * cfg.block_d <= 16384
    assert (cfg.block_m, cfg.block_u, cfg.block_n, cfg.num_warps, cfg.max_regs) == (2, 4, 64, 4, 128)
    assert (cfg.split_slots, cfg.split_cap) == (128, 256)
    assert cfg.lookahead and cfg.evict and not cfg.prefetch and not cfg.persistent
    assert default_config(100).block_d == 128 and default_config(20000).block_d == 8192
    assert default_config(100).max_regs is None and default_config(8192).max_regs is None
    # few tokens: one token per program, rows cut into short pieces; M itself adds no variant
    for m, piece in ((1, 16), (64, 16), (65, 32), (512, 32)):
        small = default_config(2048, m)
        assert (small.block_m, small.block_n, small.split_slots) == (1, piece, piece), m
        assert small == dataclasses.replace(cfg, block_m=1, block_n=piece, split_slots=piece)
    assert default_config(2048, 513) == default_config(2048, 1 << 20) == cfg
    assert default_config(2048, 3) is default_config(2048, 40)


def test_benchmark_configs_run_correctly():
    """The configs the GPU tuning run times: at most 16, distinct, the default first, and each
    one computes the right result at D = 2048 (rows of every kind, a row with 2 batches)."""
    d = 2048
    configs = benchmark_configs(d)
    assert configs[0] == default_config(d)
    assert 1 < len(configs) <= 16 and len(set(configs)) == len(configs)
    for flag in ("prefetch", "persistent", "evict", "lookahead"):
        assert len({bool(getattr(c, flag)) for c in configs}) == 2, flag
    assert any(c.block_n == c.block_u for c in configs)
    m, h, tile, slots, dtype = 6, 320, 32, 8, torch.bfloat16
    x, up, down, p, values, columns, counts, overflow = _problem(m, d, h, tile, slots, dtype, True, 5)
    assert counts.sum(1)[~overflow].max() > 64 and overflow.any()
    weight = _weights(up, down)
    ref, mag, lowp = _reference(x, up, down, p)
    for config in configs:
        _assert_close(_run(x, values, columns, counts, weight, tile=tile, config=config),
                      ref, mag, lowp, ~overflow, dtype)


def test_compile_specs_cover_launcher_variants():
    """The GPU compile list (tests/kernels/gpu_compile.py) covers both dtypes, gated and
    non-gated, aligned and not, whole-D and split-D programs, every kernel variant, and every
    benchmark config's specialization."""
    from sparseffn.kernels.twell_up_down import _constexprs

    specs = compile_specs()
    assert {c["SPLIT"] for _, _, c in specs} == {True, False}
    seen = set()
    compiled = set()
    for _, signature, constexprs in specs:
        assert set(constexprs) == {k for k, v in signature.items() if v == "constexpr"}
        seen.add((signature["x_ptr"], constexprs["GATED"], constexprs["ALIGNED"],
                  constexprs["ONE_D_BLOCK"]))
        compiled.add((signature["x_ptr"], tuple(constexprs.items())))
    for dtype, gated in itertools.product(("*bf16", "*fp16"), (True, False)):
        assert {(dtype, gated, True, True), (dtype, gated, False, True),
                (dtype, gated, True, False)} <= seen
        assert not any("NUM_STAGES" in c for _, _, c in specs)
        variants = {(c["PREFETCH"], c["PERSISTENT"], c["LOOKAHEAD"],
                     c["BLOCK_N"] == c["BLOCK_U"], c["EVICT"])
                    for _, s, c in specs if (s["x_ptr"], c["GATED"]) == (dtype, gated)}
        for k in range(5):
            assert {v[k] for v in variants} == {True, False}, (dtype, gated, k)
    for config in benchmark_configs(2048):
        constexprs = _constexprs(config, 2048, 22, 32, gated=True, aligned=True)
        if not constexprs["SPLIT"]:  # the split list's pointers are None then
            constexprs.update(dict.fromkeys(("split_flags_ptr", "split_ids_ptr", "split_state_ptr", "partials_ptr")))
        assert ("*bf16", tuple(constexprs.items())) in compiled, config
