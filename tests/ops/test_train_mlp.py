"""The training path of `sparse_mlp` (return_l1, gradients) through the TwELL training kernels.

On CPU the kernels run under Triton's interpreter (tests/conftest.py), so shapes stay small.
Truth: fp64 autograd of `sparse_mlp_reference` on the loss (y·r).sum() + c·l1. Rule (flash-attention):
error ≤ 2 · (dense torch's error in the same dtype) + one rounding.
"""

import os

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import sparseffn
from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.bench.timing import cuda_graphed
from sparseffn.ops.reference import mlp_activation_reference
from sparseffn.ops.sparse_mlp import choose_mode
from sparseffn.ops.train_mlp import sparse_mlp_train, sparse_mlp_train_bwd, sparse_mlp_train_fwd
from sparseffn.ops.twell_mlp import dense_mlp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or the Triton interpreter"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
COEFF = 3.0


def _err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _params(mlp):
    return [t.detach().clone().requires_grad_() for t in (mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight)
            if t is not None]


def _split(params, gated):
    return (params[0], params[1], params[2], params[3]) if gated else (params[0], None, params[1], params[2])


def _step(fn, params, gated, r, threshold):
    y, l1 = fn(*_split(params, gated), threshold)
    grads = torch.autograd.grad((y.double() * r).sum() + COEFF * l1.double(), params)
    return y, l1, grads


def _sparse(x, gate, up, down, threshold, **kw):
    return sparseffn.sparse_mlp(x, gate, up, down, threshold, mode="sparse", return_l1=True, tile=64, slots=8, **kw)


def _dense(x, gate, up, down, threshold):
    return dense_mlp(x, gate, up, down, threshold, return_l1=True)


def _reference(params, gated, r, threshold):
    leaves = [p.detach().double().requires_grad_() for p in params]
    x, gate, up, down = _split(leaves, gated)
    th = threshold.double() if isinstance(threshold, torch.Tensor) else threshold
    _, h = mlp_activation_reference(x, gate, up, th)
    y, l1 = h @ down.t(), h.abs().sum(-1).mean()
    return y, l1, torch.autograd.grad((y * r).sum() + COEFF * l1, leaves)


def _check(mlp, threshold=None, expect_overflow=None):
    gated = mlp.gate_weight is not None
    params = _params(mlp)
    r = torch.randn(mlp.x.shape, dtype=torch.float64, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    grads = _assert_matches_reference(mlp, params, r, threshold, _step(_sparse, params, gated, r, threshold))
    if expect_overflow is not None:
        _, _, _, _, counts, _, flags = sparse_mlp_train_fwd(mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight,
                                                            None if threshold is None else _theta(threshold, mlp),
                                                            64, 8, 64, False)
        assert bool(flags.any()) == expect_overflow
    return grads


def _assert_matches_reference(mlp, params, r, threshold, sparse):
    """The sparse step's (y, l1, grads) within twice dense torch's error of the fp64 reference."""
    gated = mlp.gate_weight is not None
    y, l1, grads = sparse
    y_d, l1_d, grads_d = _step(_dense, params, gated, r, threshold)
    y_r, l1_r, grads_r = _reference(params, gated, r, threshold)
    floor = torch.finfo(mlp.x.dtype).eps / 2
    assert y.dtype == mlp.x.dtype and l1.dtype == torch.float32 and l1.dim() == 0
    assert _err(y, y_r) <= 2 * _err(y_d, y_r) + floor
    assert _err(l1, l1_r) <= 2 * _err(l1_d, l1_r) + floor
    for name, g, g_d, g_r in zip(("x", "gate", "up", "down") if gated else ("x", "up", "down"), grads, grads_d, grads_r):
        assert g.dtype == mlp.x.dtype and g.shape == g_r.shape, name
        assert _err(g, g_r) <= 2 * _err(g_d, g_r) + floor, (name, _err(g, g_r), _err(g_d, g_r))
    return grads


def _theta(threshold, mlp):
    h = mlp.up_weight.shape[0]
    if isinstance(threshold, torch.Tensor):
        return threshold.float()
    return torch.full((h,), float(threshold), device=DEVICE)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gated", [True, False])
def test_gradients_match_reference_with_overflow_rows(dtype, gated):
    # H=200 is not a tile multiple, D=72 not a block multiple; heavy rows overflow slots=8.
    mlp = synthetic_mlp(37, 72, 200, 10, dtype=dtype, device=DEVICE, seed=4, gated=gated, heavy_fraction=0.1)
    _check(mlp, expect_overflow=True)


def _with_gemm_rows(gemm_rows, tile=64, slots=8):
    """The training op with `gemm_rows` overflow rows as GEMMs (threshold: None or a float)."""
    def fn(x, gate, up, down, threshold):
        theta = None if threshold is None else torch.full((up.shape[0],), float(threshold), device=x.device)
        return sparse_mlp_train(x, gate, up, down, theta, tile=tile, slots=slots, gemm_rows=gemm_rows)
    return fn


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gemm_rows", [0, 2, 64])
def test_overflow_rows_split_between_gemms_and_kernels(dtype, gemm_rows):
    """The first gemm_rows overflow rows run as GEMMs (ops/overflow_rows.py), the rest through the
    Triton dense backup: every split matches the reference (0: the kernels alone; 64: the GEMMs alone)."""
    mlp = synthetic_mlp(37, 72, 200, 10, dtype=dtype, device=DEVICE, seed=4, heavy_fraction=0.1)
    flags = sparse_mlp_train_fwd(mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight, None, 64, 8, 0, False)[6]
    assert int(flags.sum()) > 2  # so the split at 2 leaves rows to the kernels
    params = _params(mlp)
    r = torch.randn(mlp.x.shape, dtype=torch.float64, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    _assert_matches_reference(mlp, params, r, 0.1, _step(_with_gemm_rows(gemm_rows), params, True, r, 0.1))


@needs_kernels
@pytest.mark.parametrize("gated", [True, False])
def test_overflow_gemms_leave_ordinary_rows_bitwise_alone(gated):
    """The GEMMs' padding entries (count < gemm_rows) read and write back rows of the ordinary path:
    y and dx of every row that does not overflow have the same bits with or without the GEMMs
    (deterministic mode: the long rows' sums do not follow the programs' timing on a GPU)."""
    mlp = synthetic_mlp(37, 72, 200, 10, device=DEVICE, seed=6, gated=gated, heavy_fraction=0.1)
    gate = mlp.gate_weight if gated else None
    flags = sparse_mlp_train_fwd(mlp.x, gate, mlp.up_weight, mlp.down_weight, None, 64, 8, 0, False)[6]
    assert 0 < int(flags.sum()) < 32
    dy = torch.randn_like(mlp.x)
    outs = []
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for gemm_rows in (0, 32):
            x = mlp.x.detach().clone().requires_grad_()
            y, l1 = _with_gemm_rows(gemm_rows)(x, gate, mlp.up_weight, mlp.down_weight, None)
            (dx,) = torch.autograd.grad([y, l1], [x], [dy, torch.tensor(2.0, device=DEVICE)])
            outs.append((y[~flags], dx[~flags], y[flags]))
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][2], torch.zeros_like(outs[0][2]))


@needs_kernels
def test_gradients_without_overflow_rows():
    mlp = synthetic_mlp(33, 64, 192, 4, device=DEVICE, seed=7, heavy_fraction=0.0)
    _check(mlp, expect_overflow=False)


@needs_kernels
def test_threshold_zero_rows_and_dense_rows():
    mlp = synthetic_mlp(20, 64, 128, 6, device=DEVICE, seed=5)
    theta = torch.zeros(128, device=DEVICE)
    theta[:4] = -50.0  # units that are always on
    x = mlp.x.clone()
    x[3] = 0  # no active unit except the forced ones
    x[7, 0] = -20.0  # the bias feature negative: every threshold flips, the row is dense
    mlp = type(mlp)(**{**mlp.__dict__, "x": x})
    _check(mlp, threshold=theta, expect_overflow=True)
    _check(mlp, threshold=0.25)


@needs_kernels
def test_every_row_dense():
    mlp = synthetic_mlp(9, 64, 128, 100, device=DEVICE, seed=8)
    _check(mlp, expect_overflow=True)


@needs_kernels
def test_deterministic_mode_is_bitwise_repeatable():
    """Two runs give the same bits, and they match the reference with torch's NaN fill of new
    memory on (deterministic mode's default): no unwritten scratch reaches a result."""
    mlp = synthetic_mlp(24, 64, 128, 8, device=DEVICE, seed=9, heavy_fraction=0.1)
    r = torch.randn(mlp.x.shape, dtype=torch.float64, device=DEVICE)
    was, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    params = _params(mlp)
    try:
        # the Triton dense backup alone, then with 2 of the overflow rows as GEMMs
        runs = [_step(fn, params, True, r, None) for fn in (_sparse, _sparse, _with_gemm_rows(2), _with_gemm_rows(2))]
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    _assert_matches_reference(mlp, params, r, None, runs[0])  # dense torch's cuBLAS GEMMs outside the mode
    _assert_matches_reference(mlp, params, r, None, runs[2])
    for first, second in (runs[:2], runs[2:]):
        for a, b in zip(first[2], second[2]):
            assert torch.equal(a, b)


@needs_kernels
def test_l1_unused_and_y_unused():
    mlp = synthetic_mlp(16, 64, 128, 6, device=DEVICE, seed=10)
    params = _params(mlp)
    y, l1 = _sparse(*_split(params, True), None)
    g_y = torch.autograd.grad(y.float().sum(), params, retain_graph=True)
    g_l1 = torch.autograd.grad(l1, params)
    y_d, l1_d = _dense(*_split(params, True), None)
    g_y_d = torch.autograd.grad(y_d.float().sum(), params, retain_graph=True)
    g_l1_d = torch.autograd.grad(l1_d, params, allow_unused=True)  # l1 does not depend on down
    g_l1_d = tuple(torch.zeros_like(p) if g is None else g for p, g in zip(params, g_l1_d))
    assert torch.equal(g_l1[3], torch.zeros_like(params[3]))
    for a, b in zip(g_y + g_l1, g_y_d + g_l1_d):
        assert _err(a, b) < 2e-2 or (b.abs().max() == 0 and a.abs().max() == 0)


@needs_kernels
def test_activation_checkpointing_recomputes_the_same_path():
    mlp = synthetic_mlp(16, 64, 128, 6, device=DEVICE, seed=11)
    params = _params(mlp)

    def block(x, gate, up, down):
        y, l1 = _sparse(x, gate, up, down, None)
        return y.float().sum() + l1

    plain = torch.autograd.grad(block(*params), params)
    ckpt = torch.autograd.grad(checkpoint(block, *params, use_reentrant=False), params)
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


@needs_kernels
def test_custom_ops_pass_opcheck():
    mlp = synthetic_mlp(8, 64, 128, 6, device=DEVICE, seed=12)
    args = (mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight, None, 64, 8, 4, False)
    torch.library.opcheck(sparse_mlp_train_fwd, args, test_utils=("test_schema", "test_faketensor"))
    out = sparse_mlp_train_fwd(*args)
    bwd_args = (torch.randn_like(mlp.x), torch.ones(1, device=DEVICE), mlp.x, mlp.gate_weight, mlp.up_weight,
                mlp.down_weight, None, out[2], out[3], out[4], out[5], out[6], 64, 8, 4, False)
    torch.library.opcheck(sparse_mlp_train_bwd, bwd_args, test_utils=("test_schema", "test_faketensor"))


def test_auto_mode_takes_the_training_kernels_only_where_they_run():
    x = torch.randn(4, 8)
    up = torch.randn(16, 8)
    assert choose_mode(x, up, needs_grad=True).mode == "dense"
    assert choose_mode(x.double(), up.double(), needs_grad=True, return_l1=True).mode == "dense"


@needs_cuda
def test_auto_mode_trains_sparse_on_cuda_at_scale():
    x = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16)  # auto needs D >= AUTO_MIN_D
    up = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    assert choose_mode(x, up, needs_grad=True, return_l1=True).mode == "sparse"
    decision = choose_mode(x[:8192], up, needs_grad=True)  # measured break-even lies above 8192
    assert decision.mode == "dense" and "16384" in decision.reason
    assert choose_mode(x[:4096], up).mode == "sparse"  # inference starts at 4096
    assert choose_mode(x[:4095], up).mode == "dense"


@needs_cuda
def test_torch_compile_fullgraph_training_step():
    mlp = synthetic_mlp(512, 256, 1024, 12, device="cuda", seed=13)
    params = _params(mlp)

    def block(x, gate, up, down):
        y, l1 = sparseffn.sparse_mlp(x, gate, up, down, mode="sparse", return_l1=True)
        return y.float().square().mean() + l1

    eager = torch.autograd.grad(block(*params), params)
    compiled = torch.autograd.grad(torch.compile(block, fullgraph=True)(*params), params)
    for a, b in zip(eager, compiled):
        assert _err(a, b) < 1e-2


@needs_cuda
@pytest.mark.parametrize("rank_kernel", [True, False], ids=["rank-kernel", "torch-argsort"])
@pytest.mark.parametrize("expected_nnz", [None, 12.0])
def test_training_step_replays_in_a_cuda_graph(monkeypatch, rank_kernel, expected_nnz):
    """A captured step (no host synchronisation, no host copies) replays to the eager step's
    gradients, with the unit order from the rank kernel and from torch's argsort (H above
    _RANK_MAX_UNITS), and with the overflow rows as GEMMs (an estimate over the fill threshold)."""
    import sparseffn.kernels.unit_grads as unit_grads

    if not rank_kernel:
        monkeypatch.setattr(unit_grads, "_RANK_MAX_UNITS", 64)
    mlp = synthetic_mlp(512, 256, 1024, 12, device="cuda", seed=16)
    params = _params(mlp)
    dy = torch.randn_like(mlp.x)

    def step():
        y, l1 = sparseffn.sparse_mlp(*params, mode="sparse", return_l1=True, expected_nnz=expected_nnz)
        return torch.autograd.grad([y, l1], params, [dy, torch.ones_like(l1)])

    eager = step()
    captured = cuda_graphed(step, torch.device("cuda"))()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert _err(b, a) < 1e-2


@needs_cuda
def test_make_graphed_callables_trains_like_eager():
    """torch.cuda.make_graphed_callables (PyTorch's fix for host-bound small batches) captures the
    sparse forward and backward as graphs; replays on the live inputs give the eager step's y, l1
    and gradients."""
    mlp = synthetic_mlp(512, 256, 1024, 12, device="cuda", seed=17)
    params = _params(mlp)
    dy = torch.randn_like(mlp.x)

    def block(x, gate, up, down):
        return sparseffn.sparse_mlp(x, gate, up, down, mode="sparse", return_l1=True)

    def step(fn):
        y, l1 = fn(*params)
        grads = torch.autograd.grad([y, l1], params, [dy, torch.ones_like(l1)])
        return y.detach(), l1.detach(), *grads

    eager = step(block)
    graphed = torch.cuda.make_graphed_callables(block, tuple(p.detach().clone().requires_grad_() for p in params))
    for _ in range(2):
        for a, b in zip(eager, step(graphed)):
            assert _err(b, a) < 1e-2


@needs_cuda
def test_realistic_size_on_gpu():
    mlp = synthetic_mlp(4096, 2048, 5632, 29, device="cuda", seed=14)
    _check(mlp)
    mlp = synthetic_mlp(2048, 2048, 5632, 110, device="cuda", seed=15)
    _check(mlp, expect_overflow=True)
    # ~10 overflow rows: 4 as GEMMs, the rest through the Triton backup
    params = _params(mlp)
    r = torch.randn(mlp.x.shape, dtype=torch.float64, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    _assert_matches_reference(mlp, params, r, None, _step(_with_gemm_rows(4, 256, 32), params, True, r, None))


@needs_kernels
@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_flag_reaches_the_token_major_kernels(monkeypatch, deterministic):
    """torch.use_deterministic_algorithms(True) asks the forward and backward kernels for the
    piece-ordered sums of long rows (kernels/row_split.py, "Bits"); off, they run the faster way."""
    import sparseffn.ops.train_mlp as train_mlp

    seen = []

    def recording(name):
        real = getattr(train_mlp, name)
        return lambda *args, **kw: seen.append((name, kw["deterministic"])) or real(*args, **kw)

    for name in ("twell_train_forward", "twell_train_backward"):
        monkeypatch.setattr(train_mlp, name, recording(name))
    mlp = synthetic_mlp(12, 64, 128, 6, device=DEVICE, seed=13)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        _step(_sparse, _params(mlp), True, torch.randn(mlp.x.shape, dtype=torch.float64, device=DEVICE), None)
    finally:
        torch.use_deterministic_algorithms(was)
    assert seen == [("twell_train_forward", deterministic), ("twell_train_backward", deterministic)]
