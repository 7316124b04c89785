"""`warm_sparse_kernels`: every kernel launch key of a real call of the layer's shape (training forward and
backward, inference) is launched by the warm-up first, so a later switch compiles nothing; layers that
can never take the sparse path warm nothing. A spy on `Launcher.launch` records the launch keys (the
kernel and Triton's specialization of its arguments: kernels/launch.py), which decide compilation."""

import os

import pytest
import torch

from sparseffn.kernels import launch
from sparseffn.nn.sparse_mlp import SparseMLP
from sparseffn.nn.warm import BackgroundWarm, WarmedCall, start_warming, warm_sparse_kernels

needs_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or the Triton interpreter")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D, H, TOKENS = 32, 80, 80  # inference above the decode kernels (<= 64 tokens): TwELL


@pytest.fixture
def launches(monkeypatch):
    """The launch keys, in order: (kernel name, argument keys, constexprs and options)."""
    seen: list[tuple] = []
    real = launch.Launcher.launch

    def spy(self, grid, args, meta):
        seen.append((self.kernel.__name__, tuple(launch._arg_key(a) for a in args), tuple(sorted(meta.items()))))
        return real(self, grid, args, meta)

    monkeypatch.setattr(launch.Launcher, "launch", spy)
    return seen


def _mlp(mode="sparse", gated=True, seed=0):
    torch.manual_seed(seed)
    return SparseMLP(D, H, gated=gated, mode=mode, device=DEVICE, dtype=torch.bfloat16)


def _real_calls(mlp):
    x = torch.randn(2, TOKENS // 2, D, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    mlp.train()
    y = mlp(x)
    (y.float().sum() + mlp.last_l1).backward()
    mlp.eval()
    with torch.no_grad():
        mlp(x.detach())


@needs_kernels
@pytest.mark.parametrize("gated", [True, False])
def test_warm_launches_every_kernel_a_real_call_launches(launches, gated):
    mlp = _mlp(gated=gated)
    if gated:
        mlp.set_threshold_(0.01)  # the threshold is a constexpr of the kernels: warmed with the layer's
    warmed = warm_sparse_kernels([mlp], train_tokens=TOKENS, eval_tokens=[TOKENS])
    assert warmed == [WarmedCall("training", TOKENS, D, H, gated, gated, torch.bfloat16),
                      WarmedCall("inference", TOKENS, D, H, gated, gated, torch.bfloat16)]
    warm_keys = set(launches)
    names = {key[0] for key in warm_keys}
    # forward, backward (per-unit weight gradients) and inference kernels all ran
    assert {"_gate_twell_kernel", "_twell_train_forward_kernel", "_twell_train_backward_kernel",
            "_twell_up_down_kernel"} <= names
    assert all(p.grad is None for p in mlp.parameters())  # the layer's own gradients are untouched
    assert mlp.activity.calls == 0 and mlp.activity.nnz is None  # the layer's bookkeeping is untouched
    launches.clear()
    _real_calls(mlp)
    assert launches and set(launches) <= warm_keys, set(launches) - warm_keys


@pytest.fixture
def overflow_ops(monkeypatch):
    """The PyTorch ops (name, input dtypes and shapes) run inside the overflow rows' path: the row list's
    split and spare row, the dense forward and backward of the listed rows (ops/overflow_rows.py). The
    mode records only inside those functions (active around the whole call, it would see the sparse op
    as one custom op)."""
    import sparseffn.nn.warm as warm
    import sparseffn.ops.train_mlp as train_mlp
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[tuple] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            seen.add((str(func), tuple((t.dtype, tuple(t.shape)) for t in flat if isinstance(t, torch.Tensor))))
            return func(*args, **(kwargs or {}))

    for module in (warm, train_mlp):
        for name in ("overflow_rows_forward", "overflow_rows_backward", "row_list_split", "spare_row"):
            def recorded(*args, _real=getattr(module, name), **kwargs):
                with Record():
                    return _real(*args, **kwargs)
            monkeypatch.setattr(module, name, recorded)
    return seen


@needs_kernels
@pytest.mark.parametrize("gated", [True, False])
def test_loading_outside_triton_runs_the_overflow_path_of_a_switching_call(overflow_ops, gated):
    """start_warming loads in this process, before the child is done, the PyTorch kernels a training call
    at the switching activity runs for its overflow rows: the same ops on the same dtypes and shapes."""
    from sparseffn.nn.warm import _load_outside_triton
    from sparseffn.ops.decide import train_break_even
    from sparseffn.ops.sparse_mlp import sparse_mlp

    h = 512  # where the break-even activity sends overflow rows to the GEMMs
    _load_outside_triton(d=D, h=h, gated=gated, threshold=True, down_transposed=True, device=DEVICE, tokens=TOKENS,
                         training=True, dtype="bfloat16", seed=0)
    loaded = set(overflow_ops)
    assert loaded
    overflow_ops.clear()
    gen = torch.Generator().manual_seed(1)
    x, gate, up, down_t = (torch.randn(*shape, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
                           for shape in ((TOKENS, D), (h, D), (h, D), (h, D)))
    y, l1 = sparse_mlp(x, gate if gated else None, up, down_t.t(), torch.full((h,), 0.01, device=DEVICE),
                       mode="sparse", return_l1=True, expected_nnz=train_break_even(h))
    torch.autograd.grad((y.float().sum() + l1), [x, up, down_t] + ([gate] if gated else []))
    assert overflow_ops and overflow_ops <= loaded, overflow_ops - loaded


@needs_kernels
def test_warm_once_per_shape_and_not_for_dense_layers(launches):
    same = [_mlp(seed=0), _mlp(seed=1)]  # one shape: warmed once
    dense = _mlp(mode="dense")
    warmed = warm_sparse_kernels([*same, dense], train_tokens=TOKENS)
    assert warmed == [WarmedCall("training", TOKENS, D, H, True, False, torch.bfloat16)]
    count = len(launches)
    assert warm_sparse_kernels([dense], train_tokens=TOKENS, eval_tokens=[TOKENS]) == [] and len(launches) == count


def test_auto_layers_on_cpu_warm_nothing(launches):
    """Auto mode never takes the kernels on CPU (ops/decide.py), so nothing compiles for it."""
    mlp = SparseMLP(D, H, mode="auto", dtype=torch.bfloat16)
    assert warm_sparse_kernels([mlp], train_tokens=TOKENS, eval_tokens=[TOKENS]) == [] and not launches


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_layers_on_the_h200_warm_at_the_training_shape(launches):
    mlp = SparseMLP(2048, 5632, mode="auto", device="cuda", dtype=torch.bfloat16)
    warmed = warm_sparse_kernels([mlp], train_tokens=16384, eval_tokens=[16384], dtype=torch.bfloat16)
    assert [c.kind for c in warmed] == (["training", "inference"] if torch.cuda.get_device_capability() == (9, 0)
                                        else [])


@needs_kernels
def test_background_warm_runs_the_same_calls_in_a_child(launches):
    mlp = _mlp()
    job = start_warming([mlp], train_tokens=TOKENS, eval_tokens=[TOKENS])
    assert job.calls == [WarmedCall("training", TOKENS, D, H, True, False, torch.bfloat16),
                         WarmedCall("inference", TOKENS, D, H, True, False, torch.bfloat16)]
    assert not launches  # none in this process while the child compiles
    assert job.held == []  # a layer in sparse mode is not auto's to hold (start_warming holds auto layers)
    assert job.wait() > 0 and job.poll()
    loaded = set(launches)  # then a thread ran the same calls here: the kernels are loaded in this process
    launches.clear()
    _real_calls(mlp)
    assert launches and set(launches) <= loaded, set(launches) - loaded
    assert start_warming([_mlp(mode="dense")], train_tokens=TOKENS) is None  # nothing to warm


@needs_kernels
def test_a_failed_load_in_this_process_raises_and_releases_the_layers(monkeypatch):
    """The child compiled (it does not see this process's patch); loading here fails: poll() raises with
    the error and the held layers run again."""
    import sparseffn.nn.warm as warm

    def broken(**run):
        raise OSError("no such module")

    monkeypatch.setattr(warm, "_run_once", broken)
    held = _mlp(mode="auto")  # (on a CPU auto mode plans nothing: the sparse layer's calls, auto's hold)
    job = BackgroundWarm(warm._plan([_mlp()], TOKENS, [], None, 0), held=[held])
    assert held.activity.hold == BackgroundWarm.HOLD
    with pytest.raises(RuntimeError, match="loading the compiled kernels into this process.*no such module"):
        job.wait()
    assert held.activity.hold is None


def test_a_failed_load_outside_triton_raises_at_once_stops_the_child_and_releases_the_layers(monkeypatch):
    """What start_warming loads before returning fails: the next poll() raises with the error (the run goes
    on without it), the child is stopped and the held layers run again."""
    import sparseffn.nn.warm as warm

    def broken(**run):
        raise MemoryError("out of memory")

    monkeypatch.setattr(warm, "_load_outside_triton", broken)
    held = _mlp(mode="auto")
    job = BackgroundWarm(warm._plan([_mlp()], TOKENS, [], None, 0), held=[held])
    job.load_outside_triton()
    with pytest.raises(RuntimeError, match="loading PyTorch's kernels into this process.*out of memory"):
        job.poll()
    assert held.activity.hold is None and job._process.poll() is not None and job._loader is None


def _failing_job(held=()):
    call = WarmedCall("training", 4, D, H, True, False, torch.bfloat16)
    return BackgroundWarm([(call, dict(d=D, h=H, gated=True, threshold=False, down_transposed=True, device="cpu",
                                       tokens=4, training=True, dtype="no_such_dtype", seed=0))], held)


def test_background_warm_failure_raises_with_the_childs_error():
    with pytest.raises(RuntimeError, match="(?s)background kernel warm-up failed.*no_such_dtype"):
        _failing_job().wait()


def test_layers_stay_dense_while_the_child_compiles():
    """The auto layers are held dense (the first rule of auto mode, with the reason) until poll() sees the
    child finished, failed included, or the job is stopped; a hold set by someone else is left alone."""
    from sparseffn.ops.sparse_mlp import choose_mode

    held, other = _mlp(mode="auto"), _mlp(mode="auto")
    other.activity.hold = "another reason"
    job = _failing_job([held, other])
    assert held.activity.hold == BackgroundWarm.HOLD and other.activity.hold == BackgroundWarm.HOLD
    x, w = torch.zeros(4096, D, dtype=torch.bfloat16), torch.zeros(H, D, dtype=torch.bfloat16)
    decision = choose_mode(x, w, mode="auto", expected_nnz=1.0, activity=held.activity)
    assert (decision.mode, decision.reason) == ("dense", BackgroundWarm.HOLD)
    with pytest.raises(RuntimeError):
        job.wait()
    assert held.activity.hold is None and other.activity.hold is None
    assert choose_mode(x, w, mode="auto", expected_nnz=1.0, activity=held.activity).reason != BackgroundWarm.HOLD
    stopped = _failing_job([held])
    stopped.stop()
    assert held.activity.hold is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_background_warm_fills_the_triton_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    mlp = SparseMLP(2048, 5632, mode="sparse", device="cuda", dtype=torch.bfloat16)
    start_warming([mlp], train_tokens=4096, dtype=torch.bfloat16).wait()
    names = {p.stem for p in tmp_path.rglob("*.cubin")}
    assert {"_twell_train_forward_kernel", "_twell_train_backward_kernel"} <= names, names


def test_bad_arguments():
    mlp = SparseMLP(D, H)
    with pytest.raises(ValueError, match="train_tokens"):
        warm_sparse_kernels([mlp], train_tokens=0)
    with pytest.raises(ValueError, match="eval_tokens"):
        warm_sparse_kernels([mlp], eval_tokens=[-1])
    with pytest.raises(TypeError, match="SparseMLP"):
        warm_sparse_kernels([torch.nn.Linear(2, 2)], train_tokens=4)
