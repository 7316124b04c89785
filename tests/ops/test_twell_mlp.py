"""The sparse path of `sparse_mlp` end to end (gate kernel -> fused up/down -> dense backup).

On CPU the kernels run under Triton's interpreter (tests/conftest.py), so shapes stay small.
Error rule (flash-attention): ‖y − ref‖ ≤ 2 · ‖dense torch − ref‖ + one rounding of the output.
"""

import os

import pytest
import torch

import sparseffn
from sparseffn.bench.synthetic import synthetic_mlp
from sparseffn.ops.reference import sparse_mlp_reference
from sparseffn.ops.sparse_mlp import ModeDecision, _twell_mlp_op, choose_mode
from sparseffn.ops.twell_mlp import SparseMLPWeights, dense_mlp, twell_mlp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the module (sparseffn.ops exports its `sparse_mlp` function under the same name)
needs_kernels = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or the Triton interpreter"
)


def _err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _check(mlp, threshold=None, tile=64, slots=8, expect_overflow=None):
    args = (mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    y = sparseffn.sparse_mlp(*args, threshold, mode="sparse", tile=tile, slots=slots)
    ref = sparse_mlp_reference(*(None if t is None else t.double() for t in args), threshold)
    dense = dense_mlp(*args, threshold)
    assert y.dtype == mlp.x.dtype and y.shape == mlp.x.shape
    assert y.isfinite().all()
    bound = 2 * _err(dense, ref) + torch.finfo(mlp.x.dtype).eps / 2
    assert _err(y, ref) <= bound, (_err(y, ref), _err(dense, ref))
    if expect_overflow is not None:
        first = mlp.first_weight.float()
        p = torch.relu(mlp.x.float() @ first.t() - (0 if threshold is None else threshold))
        nnz_tiles = torch.nn.functional.pad((p > 0), (0, -p.shape[1] % tile)).view(p.shape[0], -1, tile).sum(-1)
        assert bool((nnz_tiles > slots).any()) == expect_overflow
    return y


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gated", [True, False])
def test_sparse_path_matches_reference_with_overflow_rows(dtype, gated):
    # H=200 is not a tile multiple, D=72 not a block multiple; heavy rows overflow slots=8.
    mlp = synthetic_mlp(37, 72, 200, 10, dtype=dtype, device=DEVICE, seed=4, gated=gated, heavy_fraction=0.1)
    _check(mlp, expect_overflow=True)


@needs_kernels
def test_sparse_path_with_threshold_zero_rows_and_dense_rows():
    mlp = synthetic_mlp(20, 64, 128, 6, device=DEVICE, seed=5)
    theta = torch.zeros(128, device=DEVICE)
    theta[:4] = -50.0  # units that are always on
    x = mlp.x.clone()
    x[3] = 0  # a row with no active unit except the forced ones
    x[7, 0] = -20.0  # the bias feature negative: every threshold flips, the row is dense
    mlp = type(mlp)(**{**mlp.__dict__, "x": x})
    _check(mlp, threshold=theta, expect_overflow=True)
    _check(mlp, threshold=0.25)


@needs_kernels
def test_single_token_and_leading_dims():
    mlp = synthetic_mlp(6, 64, 128, 5, device=DEVICE, seed=6)
    prepared = SparseMLPWeights.prepare(mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    args = (mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    y1 = sparseffn.sparse_mlp(mlp.x[:1], *args, mode="sparse", prepared=prepared, tile=64, slots=8)
    y = sparseffn.sparse_mlp(mlp.x.view(2, 3, 64), *args, mode="sparse", prepared=prepared, tile=64, slots=8)
    assert y.shape == (2, 3, 64)
    torch.testing.assert_close(y.view(6, 64)[:1], y1, rtol=0, atol=0)


@needs_kernels
def test_prepared_weights_must_match():
    mlp = synthetic_mlp(4, 64, 128, 5, device=DEVICE)
    other = SparseMLPWeights.prepare(mlp.gate_weight, mlp.up_weight.clone(), mlp.down_weight)
    with pytest.raises(ValueError, match="prepared was built from other weight tensors"):
        sparseffn.sparse_mlp(mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight, mode="sparse", prepared=other)


@needs_kernels
def test_hand_built_weights_are_checked_before_the_unchecked_launches():
    """twell_mlp checks x, the first weight, θ, tile and slots through gate_twell, then launches the
    up/down and dense-rows kernels unchecked: a SparseMLPWeights built by hand with the wrong
    down^T or up layout or unit count must fail with an error naming it, not read out of bounds."""
    mlp = synthetic_mlp(4, 64, 128, 5, device=DEVICE)
    good = SparseMLPWeights.prepare(mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    g, u, d = mlp.gate_weight, mlp.up_weight, mlp.down_weight
    cases = [
        (SparseMLPWeights(g, u, d, good.down_t[:64]), ValueError, r"weights.down_t must be .* shape \[128, 64\]"),
        (SparseMLPWeights(g, u, d, good.down_t.float()), ValueError, "weights.down_t must be a torch.bfloat16"),
        (SparseMLPWeights(g, u, d, good.down_t.t().contiguous().t()), ValueError,
         "weights.down_t must have unit stride"),
        (SparseMLPWeights(g, u.t().contiguous().t(), d, good.down_t), ValueError, "weights.up_weight must have unit"),
        (SparseMLPWeights(g, u, d, "down_t"), TypeError, "weights.down_t must be a torch.Tensor"),
        (SparseMLPWeights(g[:64], u, d, good.down_t), ValueError, "weights.gate_weight must have up_weight's 128 units"),
    ]
    for weights, error, match in cases:
        with pytest.raises(error, match=match):
            twell_mlp(mlp.x, weights, tile=64, slots=8)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        twell_mlp(mlp.x, good, tile=64, slots=8, deterministic=1)
    with pytest.raises(NotImplementedError, match="tile must be one of"):
        twell_mlp(mlp.x, good, tile=48, slots=8)
    torch.testing.assert_close(twell_mlp(mlp.x, good, tile=64, slots=8),
                               _twell_mlp_op(mlp.x, g, u, d, good.down_t, None, 64, 8, False), rtol=0, atol=0)


def test_mode_decisions_are_explained_and_overridable():
    x = torch.zeros(16384, 64, dtype=torch.bfloat16)
    up = torch.zeros(256, 64, dtype=torch.bfloat16)
    assert choose_mode(x, up, mode="dense") == ModeDecision("dense", "requested")
    with pytest.raises(ValueError, match="mode must be one of"):
        choose_mode(x, up, mode="fast")
    with pytest.raises(NotImplementedError, match="mode='sparse' cannot run: .*float32"):
        choose_mode(x.float(), up, mode="sparse")
    if DEVICE == "cuda":  # the training kernels' dense-rows backward needs 16-byte rows
        with pytest.raises(NotImplementedError, match="D % 8 == 0"):
            choose_mode(torch.zeros(16384, 60, dtype=torch.bfloat16, device=DEVICE),
                        torch.zeros(256, 60, dtype=torch.bfloat16, device=DEVICE), mode="sparse", needs_grad=True)
    elif os.environ.get("TRITON_INTERPRET") == "1":  # training kernels run interpreted on CPU
        assert choose_mode(x, up, mode="sparse", needs_grad=True, return_l1=True).mode == "sparse"
    auto = choose_mode(x, up)
    if DEVICE == "cpu":
        assert auto.mode == "dense" and ("cpu" in auto.reason or "CPU" in auto.reason)
    else:
        assert "too narrow" in choose_mode(x.cuda(), up.cuda()).reason  # D = 64
        wide_x = torch.zeros(16384, 2048, dtype=torch.bfloat16, device=DEVICE)
        wide_up = torch.zeros(5632, 2048, dtype=torch.bfloat16, device=DEVICE)
        assert choose_mode(wide_x, wide_up).mode == "sparse"
        assert choose_mode(wide_x[:8], wide_up).mode == "dense"
        assert choose_mode(wide_x, wide_up, expected_nnz=200).mode == "dense"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_calls_are_routed_and_captured():
    """Few-token inference calls take the decode kernels under CUDA-graph capture when down^T is at
    hand (prepared weights), and stay dense eagerly or without it; a captured call replays to the
    reference and to the eager call bit for bit."""
    wide_x = torch.zeros(65, 2048, dtype=torch.bfloat16, device=DEVICE)
    wide_up = torch.zeros(5632, 2048, dtype=torch.bfloat16, device=DEVICE)
    assert "eager" in choose_mode(wide_x[:1], wide_up, down_t_ready=True).reason
    decisions = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for tokens in (1, 64):
            decisions.append(choose_mode(wide_x[:tokens], wide_up, down_t_ready=True))
            decisions.append(choose_mode(wide_x[:tokens], wide_up))  # down^T would be copied
            decisions.append(choose_mode(wide_x[:tokens], wide_up, down_t_ready=True, expected_nnz=4000))
            decisions.append(choose_mode(wide_x[:tokens], wide_up, down_t_ready=True, needs_grad=True))
        decisions.append(choose_mode(wide_x, wide_up, down_t_ready=True))  # 65 tokens: neither kernel pays
    assert [d.mode for d in decisions] == ["sparse", "dense", "dense", "dense"] * 2 + ["dense"]
    assert "decode" in decisions[0].reason

    mlp = synthetic_mlp(5, 2048, 768, 6, device="cuda", seed=3)  # H = 768: variants no other test compiled
    args = (mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    weights = SparseMLPWeights.prepare(*args[1:])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            sparseffn.sparse_mlp(*args, prepared=weights)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = sparseffn.sparse_mlp(*args, prepared=weights)
    mlp.x.copy_(torch.randn_like(mlp.x))
    graph.replay()
    torch.cuda.synchronize()
    ref = sparse_mlp_reference(*(t.float() for t in args))
    assert _err(y, ref) <= 2 * _err(dense_mlp(*args, None), ref) + 2.0**-8
    assert torch.equal(y, sparseffn.sparse_mlp(*args, mode="sparse", prepared=weights))


def test_autograd_inputs_take_the_dense_path_in_auto_mode():
    mlp = synthetic_mlp(8, 32, 64, 4, dtype=torch.float32)
    x = mlp.x.clone().requires_grad_()
    y = sparseffn.sparse_mlp(x, mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("nnz", [29, 110, 900])
def test_gpu_realistic_sizes_every_density(nnz):
    mlp = synthetic_mlp(4096, 2048, 5632, nnz, device="cuda", seed=1)
    _check(mlp, tile=256, slots=32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_torch_compile_fullgraph():
    mlp = synthetic_mlp(1000, 256, 1024, 12, device="cuda", seed=2)
    prepared = SparseMLPWeights.prepare(mlp.gate_weight, mlp.up_weight, mlp.down_weight)

    def fn(x):
        return sparseffn.sparse_mlp(x, mlp.gate_weight, mlp.up_weight, mlp.down_weight, mode="sparse",
                                    prepared=prepared)

    eager = fn(mlp.x)
    compiled = torch.compile(fn, fullgraph=True)(mlp.x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_no_host_sync_and_cuda_graph_replay():
    mlp = synthetic_mlp(2048, 256, 1024, 40, device="cuda", seed=3, heavy_fraction=0.02)
    prepared = SparseMLPWeights.prepare(mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    static_x = mlp.x.clone()

    def fn():
        return sparseffn.sparse_mlp(static_x, mlp.gate_weight, mlp.up_weight, mlp.down_weight, mode="sparse",
                                    prepared=prepared)

    expected = fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fn()
    graph.replay()
    torch.testing.assert_close(static_y, expected, rtol=0, atol=0)
    # New inputs through the same graph: more heavy rows than before, still exact.
    static_x.copy_(synthetic_mlp(2048, 256, 1024, 40, device="cuda", seed=4, heavy_fraction=0.2).x)
    graph.replay()
    torch.testing.assert_close(static_y, fn(), rtol=0, atol=0)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("threshold", [None, 0.25, "per_unit"])
def test_dense_inference_route_gives_dense_mlp_bits(gated, threshold):
    """Auto mode's dense route without autograd (in-place relu and product) computes what
    `dense_mlp` does, bit for bit, and leaves its inputs alone; with gradients it is `dense_mlp`."""
    from sparseffn.ops.twell_mlp import dense_mlp_inference

    mlp = synthetic_mlp(9, 64, 96, 8, seed=6, gated=gated)
    if threshold == "per_unit":
        threshold = torch.linspace(-0.5, 0.5, 96)
    args = (mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight, threshold)
    copies = [None if t is None else t.clone() for t in args[:4]]
    y = dense_mlp_inference(*args)
    assert torch.equal(y.view(torch.int16), dense_mlp(*args).view(torch.int16))
    assert all(a is None or torch.equal(a, c) for a, c in zip(args, copies))
    routed = sparseffn.sparse_mlp(*args, mode="dense")
    assert torch.equal(routed.view(torch.int16), y.view(torch.int16))
    x = mlp.x.clone().requires_grad_()
    sparseffn.sparse_mlp(x, *args[1:], mode="dense").float().sum().backward()
    assert x.grad is not None and x.grad.isfinite().all()


@needs_kernels
@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_flag_reaches_the_up_down_kernel(monkeypatch, deterministic):
    """torch.use_deterministic_algorithms(True) asks the up/down pass for piece-ordered sums of long
    rows (kernels/row_split.py, "Bits"), through the eager route and through the custom op."""
    import sparseffn.ops.twell_mlp as twell_ops
    from sparseffn.ops.sparse_mlp import _twell_mlp_op

    seen = []
    real = twell_ops.launch_up_down
    monkeypatch.setattr(twell_ops, "launch_up_down", lambda *a, **kw: seen.append(kw["deterministic"]) or real(*a, **kw))
    mlp = synthetic_mlp(72, 64, 128, 6, device=DEVICE, seed=13)  # > 64 tokens: TwELL, not decode
    args = (mlp.x, mlp.gate_weight, mlp.up_weight, mlp.down_weight)
    w = SparseMLPWeights.prepare(*args[1:])
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        y = sparseffn.sparse_mlp(*args, mode="sparse", prepared=w, tile=64, slots=8)
        y_op = _twell_mlp_op(*args, w.down_t, None, 64, 8, deterministic)
    finally:
        torch.use_deterministic_algorithms(was)
    assert seen == [deterministic, deterministic] and torch.equal(y, y_op)
