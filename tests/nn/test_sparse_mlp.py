import copy
import importlib
import inspect
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from sparseffn.nn import DenseMLP, SparseMLP

# the modules (their packages export functions and classes under the same names)
nn_dispatch = importlib.import_module("sparseffn.nn.dispatch")
ops_sparse_mlp = importlib.import_module("sparseffn.ops.sparse_mlp")
from sparseffn.ops.reference import l1_penalty

D, H = 48, 80


def _llama_mlp(act="relu", seed=0, dtype=torch.float32):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mlp = LlamaMLP(LlamaConfig(hidden_size=D, intermediate_size=H, num_attention_heads=1, hidden_act=act)).to(dtype)
    return mlp


def _x(*shape, seed=1, dtype=torch.float32):
    return torch.randn(*shape, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _theta(seed=2):
    return torch.rand(H, generator=torch.Generator().manual_seed(seed)) * 0.3


def _by_hand(mlp, x, theta=None):
    """down(relu(gate(x) - θ) * up(x)) and h, written out."""
    g = F.linear(x, mlp.gate_proj.weight)
    if theta is not None:
        g = g - theta.to(g.dtype)
    h = torch.relu(g) * F.linear(x, mlp.up_proj.weight)
    return F.linear(h, mlp.down_proj.weight), h


def test_equals_llama_mlp_with_relu_bitwise():
    hf = _llama_mlp()
    sparse = SparseMLP.from_dense(hf)
    x = _x(3, 7)
    y = sparse(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y, hf(x))
    # Built directly and loaded from the Llama MLP's state dict: same keys plus the threshold.
    direct = SparseMLP(D, H)
    assert set(direct.state_dict()) == set(hf.state_dict()) | {"threshold"}
    missing, unexpected = direct.load_state_dict(hf.state_dict(), strict=False)
    assert missing == ["threshold"] and unexpected == []
    assert torch.equal(direct(x), hf(x))


def test_from_dense_shares_parameters():
    hf = _llama_mlp()
    sparse = SparseMLP.from_dense(hf, mode="dense")
    assert sparse.mode == "dense" and sparse.expected_nnz is None
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert getattr(sparse, name).weight is getattr(hf, name).weight
    n_params = sum(p.numel() for p in hf.parameters())
    assert sum(p.numel() for p in sparse.parameters()) == n_params
    assert sparse.threshold.dtype == torch.float32 and not sparse.threshold.any() and not sparse.has_threshold
    with torch.no_grad():
        hf.up_proj.weight.mul_(2)  # an optimizer step on the HF module is seen by the sparse one
    x = _x(4)
    assert torch.equal(sparse(x), hf(x))


def test_to_dense_round_trip():
    silu = _llama_mlp(act="silu")
    sparse = SparseMLP.from_dense(silu)
    x = _x(2, 5)
    relu_dense = sparse.to_dense()
    assert isinstance(relu_dense, DenseMLP) and relu_dense.gate_proj.weight is silu.gate_proj.weight
    assert torch.equal(relu_dense(x), sparse(x))
    back = sparse.to_dense(act="silu")
    assert torch.equal(back(x), silu(x))
    assert not torch.equal(back(x), sparse(x))
    # Non-gated: down(relu(up(x))).
    plain = SparseMLP(D, H, gated=False)
    assert plain.gate_proj is None
    dense = plain.to_dense()
    assert torch.equal(dense(x), plain(x))
    assert torch.equal(plain(x), F.linear(torch.relu(F.linear(x, plain.up_proj.weight)), plain.down_proj.weight))


def test_threshold_forward_mask_and_flag():
    hf = _llama_mlp()
    sparse = SparseMLP.from_dense(hf)
    x, theta = _x(3, 11), _theta()
    assert sparse.set_threshold_(theta) is sparse
    assert sparse.has_threshold and "threshold=per-unit" in repr(sparse)
    y_ref, h_ref = _by_hand(hf, x, theta)
    assert torch.equal(sparse(x), y_ref)
    mask = sparse.activation_mask(x)
    assert mask.shape == (3, 11, H) and mask.dtype == torch.bool and not mask.requires_grad
    assert torch.equal(mask, F.linear(x, hf.gate_proj.weight) - theta > 0)
    assert 0 < mask.sum() < mask.numel() and mask.sum() < sparse.set_threshold_(None).activation_mask(x).sum()
    assert not sparse.has_threshold and torch.equal(sparse(x), hf(x))
    sparse.set_threshold_(0.25)
    assert torch.equal(sparse.threshold, torch.full((H,), 0.25))
    assert torch.equal(sparse(x), _by_hand(hf, x, torch.full((H,), 0.25))[0])


def test_threshold_survives_dtype_casts_and_load_state_dict():
    sparse = SparseMLP.from_dense(_llama_mlp())
    theta = _theta()
    sparse.set_threshold_(theta)
    sparse.to(torch.bfloat16)
    assert sparse.up_proj.weight.dtype == torch.bfloat16
    assert sparse.threshold.dtype == torch.float32 and torch.equal(sparse.threshold, theta)
    sparse.half().float()
    assert sparse.threshold.dtype == torch.float32 and torch.equal(sparse.threshold, theta)
    # load_state_dict copies into the buffer behind set_threshold_'s back: the flag must follow.
    other = SparseMLP.from_dense(_llama_mlp())
    assert not other.has_threshold
    other.load_state_dict(sparse.float().state_dict())
    assert other.has_threshold and torch.equal(other.threshold, theta)
    x = _x(6)
    assert torch.equal(other(x), sparse(x))
    other.load_state_dict(SparseMLP.from_dense(_llama_mlp()).state_dict())
    assert not other.has_threshold


def test_to_dense_with_threshold():
    hf = _llama_mlp()
    sparse = SparseMLP.from_dense(hf).set_threshold_(_theta())
    with pytest.raises(ValueError, match="keep_threshold=True"):
        sparse.to_dense()
    with pytest.raises(ValueError, match="act must be 'relu'"):
        sparse.to_dense("silu", keep_threshold=True)
    folded = sparse.to_dense(keep_threshold=True)
    assert folded.gate_proj.weight is hf.gate_proj.weight
    assert torch.equal(folded.gate_proj.bias, -sparse.threshold)
    x = _x(4, 9)
    torch.testing.assert_close(folded(x), sparse(x))


def test_last_l1_value_and_gradient_match_reference():
    theta = _theta()
    hf = _llama_mlp()
    sparse = SparseMLP.from_dense(hf).set_threshold_(theta)
    x = _x(3, 6).requires_grad_()
    y = sparse(x)
    l1 = sparse.last_l1
    assert l1.dtype == torch.float32 and l1.dim() == 0 and l1.requires_grad
    (y.square().sum() + 0.1 * l1).backward()
    got = [t.grad.clone() for t in (x, hf.gate_proj.weight, hf.up_proj.weight, hf.down_proj.weight)]

    for t in (x, hf.gate_proj.weight, hf.up_proj.weight, hf.down_proj.weight):
        t.grad = None
    y_ref, h_ref = _by_hand(hf, x, theta)
    l1_ref = l1_penalty(h_ref)
    torch.testing.assert_close(l1, l1_ref)
    (y_ref.square().sum() + 0.1 * l1_ref).backward()
    want = [t.grad for t in (x, hf.gate_proj.weight, hf.up_proj.weight, hf.down_proj.weight)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    # The L1 term really is in the gradient: without it the gate gradient differs.
    for t in (x, hf.gate_proj.weight, hf.up_proj.weight, hf.down_proj.weight):
        t.grad = None
    _by_hand(hf, x, theta)[0].square().sum().backward()
    assert not torch.allclose(hf.gate_proj.weight.grad, want[1])


def test_bias_module_matches_formula():
    sparse = SparseMLP(D, H, bias=True)
    theta = _theta()
    sparse.set_threshold_(theta)
    x = _x(5)
    g = sparse.gate_proj(x) - theta
    h = torch.relu(g) * sparse.up_proj(x)
    assert torch.equal(sparse(x), sparse.down_proj(h))
    torch.testing.assert_close(sparse.last_l1, l1_penalty(h))
    assert torch.equal(sparse.activation_mask(x), g > 0)
    assert "bias=True" in repr(sparse)


def test_autocast_matches_llama_mlp():
    hf = _llama_mlp()
    sparse = SparseMLP.from_dense(hf)
    x = _x(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_hf = sparse(x), hf(x)
        y_half_input = sparse(x.bfloat16())  # bf16 activations with fp32 weights, as under autocast
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_hf)
    assert torch.equal(y_half_input, y_hf)


def test_extra_repr_and_attributes():
    sparse = SparseMLP(D, H, mode="dense")
    sparse.expected_nnz = 12
    text = repr(sparse)
    for part in (f"hidden_size={D}", f"intermediate_size={H}", "gated=True", "bias=False", "mode='dense'",
                 "threshold=zero", "expected_nnz=12"):
        assert part in text
    assert sparse.expected_nnz == 12.0 and isinstance(sparse.expected_nnz, float)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: SparseMLP(0, H), ValueError, "hidden_size must be >= 1, got 0"),
        (lambda: SparseMLP(D, 2.5), TypeError, "intermediate_size must be an int, got float"),
        (lambda: SparseMLP(D, H, gated=1), TypeError, "gated must be a bool"),
        (lambda: SparseMLP(D, H, mode="fast"), ValueError, "mode must be one of"),
        (lambda: setattr(SparseMLP(D, H), "mode", "fast"), ValueError, "mode must be one of"),
        (lambda: setattr(SparseMLP(D, H), "expected_nnz", -1), ValueError, "expected_nnz must be a finite number >= 0"),
        (lambda: setattr(SparseMLP(D, H), "expected_nnz", "10"), TypeError, "expected_nnz must be None or a number"),
        (lambda: setattr(SparseMLP(D, H), "track_l1", 1), TypeError, "track_l1 must be None or a bool"),
        (lambda: SparseMLP.from_dense(torch.nn.Linear(D, H)), TypeError, "mlp must have an nn.Linear gate_proj"),
        (lambda: SparseMLP.from_dense("mlp"), TypeError, "mlp must be an nn.Module, got str"),
        (lambda: SparseMLP(D, H).to_dense(act="gelu"), ValueError, "act must be one of"),
        (lambda: SparseMLP(D, H).set_threshold_(torch.zeros(H + 1)), ValueError, r"threshold must have shape \[\] or \[H\]"),
        (lambda: SparseMLP(D, H).set_threshold_(torch.zeros(H, dtype=torch.long)), TypeError,
         "threshold must be a floating-point tensor"),
        (lambda: SparseMLP(D, H).set_threshold_("0.1"), TypeError, "threshold must be None, a number or a tensor"),
        (lambda: SparseMLP(D, H).set_threshold_(float("nan")), ValueError, "threshold must be finite"),
        (lambda: SparseMLP(D, H)(torch.randn(3, D + 1)), ValueError, r"up_weight must be \[H, D\]"),
        (lambda: SparseMLP(D, H)(torch.randn(3, D).double()), TypeError, "has dtype torch.float32 but x has torch.float64"),
    ],
)
def test_bad_inputs_name_the_argument(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_nan_threshold_leaves_module_usable():
    sparse = SparseMLP.from_dense(_llama_mlp())
    with pytest.raises(ValueError):
        sparse.set_threshold_(torch.full((H,), float("inf")))
    assert not sparse.has_threshold and not sparse.threshold.any()


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the sparse path needs CUDA or Triton's CPU interpreter",
)
def test_sparse_inference_holds_one_copy_of_the_weights():
    """The down weight is stored transposed, so the kernels read it as it is: after sparse inference
    calls the module holds exactly the bytes of its weights plus the threshold, and the output
    follows in-place weight changes (nothing stale is cached)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = _llama_mlp(dtype=torch.bfloat16).to(device)
    sparse = SparseMLP.from_dense(hf, mode="sparse").set_threshold_(_theta().to(device))
    assert sparse.down_proj.weight.t().is_contiguous() and sparse.down_proj.weight is hf.down_proj.weight
    weight_bytes = sum(p.numel() * p.element_size() for p in sparse.parameters())
    x = _x(5, dtype=torch.bfloat16).to(device)
    with torch.no_grad():
        y = sparse(x)
        y_ref, _ = _by_hand(copy.deepcopy(hf).float(), x.float(), sparse.threshold)  # the bf16 weights, in fp32
        dense_err = (_by_hand(hf, x, sparse.threshold)[0].float() - y_ref).abs().max()
        assert (y.float() - y_ref).abs().max() <= 2 * dense_err + 1e-3
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*sparse.parameters(), *sparse.buffers()]}
        assert sum(held.values()) == weight_bytes + 4 * H
        assert all(not isinstance(v, torch.Tensor) or v.numel() < H for v in vars(sparse).values())
        hf.up_proj.weight.mul_(2)
        assert not torch.equal(sparse(x), y)


def test_down_weight_stays_transposed_through_state_dict_to_and_optimizer():
    sparse = SparseMLP(D, H)
    param = sparse.down_proj.weight
    assert param.shape == (D, H) and param.t().is_contiguous()
    other = SparseMLP(D, H)
    other.load_state_dict(sparse.state_dict())
    assert other.down_proj.weight.t().is_contiguous() and torch.equal(other.down_proj.weight, param)
    sparse.to(torch.float64)
    assert sparse.down_proj.weight is param and param.t().is_contiguous()
    optimizer = torch.optim.AdamW(sparse.parameters(), lr=1e-2)
    sparse(_x(4).double()).square().sum().backward()
    assert param.grad.stride() == param.stride()
    before = param.detach().clone()
    optimizer.step()
    assert param.t().is_contiguous() and not torch.equal(param, before)
    # a loader that assigns a contiguous tensor: the next forward re-stores it in place
    with torch.no_grad():
        param.data = param.data.contiguous()
    y = sparse(_x(4).double())
    assert sparse.down_proj.weight is param and param.t().is_contiguous() and y.shape == (4, D)


def test_l1_follows_the_module_mode():
    sparse = SparseMLP.from_dense(_llama_mlp())
    assert sparse.track_l1 is None and sparse.last_l1 is None
    sparse(_x(2))  # training mode
    assert sparse.last_l1 is not None
    sparse.eval()
    with torch.no_grad():
        sparse(_x(2))
    assert sparse.last_l1 is None  # eval + no_grad: inference, no penalty
    sparse(_x(2))  # eval, but gradients flow to the parameters
    assert sparse.last_l1 is not None and sparse.last_l1.requires_grad
    sparse.track_l1 = True  # explicit override: evaluate the penalty under no_grad
    with torch.no_grad():
        sparse(_x(2))
    assert sparse.last_l1 is not None
    sparse.track_l1 = False
    sparse.train()
    assert sparse(_x(2)) is not None and sparse.last_l1 is None
    assert "track_l1=False" in repr(sparse)


def test_eval_no_grad_takes_the_inference_kernels_training_the_training_kernels(monkeypatch):
    seen = []
    real = ops_sparse_mlp.sparse_mlp_with_decision

    def spy(*args, **kwargs):
        seen.append((kwargs["return_l1"], torch.is_grad_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(nn_dispatch, "sparse_mlp_with_decision", spy)
    sparse = SparseMLP.from_dense(_llama_mlp())
    sparse(_x(3))
    sparse.eval()
    with torch.no_grad():
        sparse(_x(3))
    assert seen == [(True, True), (False, False)]


def _spy_decisions(monkeypatch) -> list[dict]:
    """Every decision made (ops.sparse_mlp._decision, the memoized rules), as a dict of its inputs."""
    real = ops_sparse_mlp._decision
    names = list(inspect.signature(real).parameters)
    seen = []

    def spy(*args):
        seen.append(dict(zip(names, args)))
        return real(*args)

    monkeypatch.setattr(ops_sparse_mlp, "_decision", spy)
    return seen


def test_auto_mode_dispatches_on_measured_activity(monkeypatch):
    """Unmeasured: dense. The activity sample taken on call 0 is read `lag` calls later (before call
    `lag` decides); from then on the op decides from it, once per call, per kind of call, with the
    last decision of that kind as hysteresis input; a hint replaces it and stops the counting."""
    sparse = SparseMLP.from_dense(_llama_mlp())
    sparse.eval()
    decisions = _spy_decisions(monkeypatch)
    x = _x(3)
    with torch.no_grad():
        want = float(sparse.activation_mask(x).sum()) / 3
        for call in range(sparse.activity.lag):
            sparse(x)
            assert sparse.last_decision.reason.startswith("activity not measured")
            assert len(decisions) == call + 1 and decisions[-1]["expected_nnz"] is None
            assert decisions[-1]["wait"] == sparse.last_decision.reason
        assert sparse.activity.nnz is None
        sparse(x)
        assert sparse.activity.nnz == want and 0 < want < H
        assert decisions[-1]["expected_nnz"] == want and decisions[-1]["previous"] == "dense"
        assert decisions[-1]["wait"] is None and not sparse.last_decision.reason.startswith("activity not measured")
        sparse(x)
    assert len(decisions) == sparse.activity.lag + 2  # one decision per call
    assert sparse.activity.last == {"decode": "dense"} and sparse.activity.calls == sparse.activity.lag + 2
    assert "activity=Activity(" in repr(sparse)
    sparse.expected_nnz = 7.0
    with torch.no_grad():
        sparse(x)
    assert decisions[-1]["expected_nnz"] == 7.0 and sparse.activity.calls == sparse.activity.lag + 2


def test_the_decision_sees_the_training_kernels_the_call_runs(monkeypatch):
    """track_l1=False while gradients flow: the call runs the training kernels (if sparse), so the one
    decision is made, and recorded, as a training call's."""
    sparse = SparseMLP.from_dense(_llama_mlp())
    sparse.track_l1 = False
    sparse.expected_nnz = 3.0
    decisions = _spy_decisions(monkeypatch)
    sparse(_x(2))
    assert [d["training"] for d in decisions] == [True]
    assert sparse.last_decision.kind == "training" and sparse.activity.last == {"training": "dense"}
    with torch.no_grad():
        sparse(_x(2))
    assert [d["training"] for d in decisions] == [True, False] and sparse.last_decision.kind == "decode"


def test_as_captured_calls_decide_as_captured_and_are_not_counted(monkeypatch):
    """Inside ops.sparse_mlp.as_captured (nested too) a call is traced: the decision sees it as
    captured and the activity does not count it; outside, both as before."""
    from sparseffn.ops.sparse_mlp import as_captured, call_traced

    sparse = SparseMLP.from_dense(_llama_mlp())
    sparse.eval()
    seen = _spy_decisions(monkeypatch)
    x = _x(2)
    with torch.no_grad():
        sparse(x)
        with as_captured(), as_captured():
            sparse(x)
            assert call_traced(x)
        assert sparse.activity.calls == 1 and not call_traced(x)
    sparse.expected_nnz = 3.0
    with torch.no_grad():
        sparse(x)
        with as_captured():
            sparse(x)
    assert [d["traced"] for d in seen] == [False, True, False, True]


def test_activity_samples_and_resumes_exactly():
    """A counted call: poll, (decide,) maybe record, tick. Restored from a state taken with a sample
    in flight, an Activity folds it in at the same call as the original."""
    from sparseffn.nn.activity import Activity

    def call(act, i):
        act.poll()
        if act.wants_sample():
            act.record(torch.tensor(10 * (i + 1)), tokens=5)
        act.tick()

    a = Activity(period=4, lag=2)
    seen = []
    for i in range(10):
        if a.wants_sample():
            seen.append(i)
        call(a, i)
        if i == 4:  # checkpoint right after a sample was taken
            b = Activity()
            b.load_state_dict(a.state_dict())
        elif i > 4:
            call(b, i)
    assert seen == [0, 4, 8]
    w = 5 / (5 + 1024)  # a sample of 5 tokens
    assert a.nnz == b.nnz == (1 - w) * 2.0 + w * 10.0  # the sample of call 8 is due at call 10
    assert a.calls == b.calls == 10 and a.samples == b.samples == 2
    with pytest.raises(ValueError, match="period"):
        Activity(period=0)


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or the Triton interpreter",
)
def test_autocast_training_reaches_the_kernels_with_fp32_master_weights():
    # fp32 weights under bf16 autocast: the module casts x and the weights itself, so mode="sparse"
    # runs the training kernels, and the gradients reach the fp32 parameters through the casts.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = _llama_mlp().to(device)
    sparse, dense = SparseMLP.from_dense(hf, mode="sparse"), SparseMLP.from_dense(copy.deepcopy(hf), mode="dense")
    x = _x(24, seed=3).to(device)
    grads = []
    for module in (sparse, dense):
        with torch.autocast(device, dtype=torch.bfloat16):
            y = module(x)
            loss = y.float().square().mean() + 0.1 * module.last_l1
        params = [module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight]
        grads.append(torch.autograd.grad(loss, params))
        assert y.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads[-1])
    for got, want in zip(*grads):
        assert float((got - want).norm() / want.norm()) < 2e-2  # both bf16 computations of the same function


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_auto_training_starts_dense_and_goes_sparse_as_activity_falls():
    """A training-size call at the paper's shape: at initialization (about half the units active)
    auto mode runs dense; once thresholds make the layer ~0.5% active, the measured activity takes
    it to the sparse training kernels."""
    torch.manual_seed(0)
    layer = SparseMLP(2048, 5632, device="cuda", dtype=torch.bfloat16)
    layer.activity.period, layer.activity.lag = 2, 1
    x = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16)
    paths = []
    for _ in range(4):
        layer(x).float().square().mean().backward()
        paths.append(layer.last_decision.mode)
    assert paths == ["dense"] * 4 and layer.activity.nnz > 1000
    with torch.no_grad():
        g = (x @ layer.gate_proj.weight.t()).float()
        layer.set_threshold_(g.kthvalue(x.shape[0] - 84, dim=0).values)  # ~0.5% of tokens per unit
    for _ in range(6):
        layer(x).float().square().mean().backward()
        paths.append(layer.last_decision.mode)
    assert paths[-1] == "sparse" and layer.activity.nnz < 40, (paths, layer.activity)
    assert layer.activity.last["training"] == "sparse"


def test_compiled_auto_layer_compiles_once():
    """Under torch.compile an auto-mode layer neither reads nor writes its activity's last paths (the
    read and the write would guard on that dict, which the first call changes: a recompile of the whole
    caller); its decision is still recorded in last_decision."""
    from torch._dynamo.utils import counters

    layer = SparseMLP(32, 64, dtype=torch.bfloat16).eval()
    layer.activity.observe(5.0, 1024)
    x = torch.randn(1, 1, 32, dtype=torch.bfloat16)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with torch.no_grad():
        outs = [compiled(x) for _ in range(3)]
    assert counters["stats"]["unique_graphs"] == 1
    assert layer.activity.last == {} and layer.last_decision.kind == "decode"
    with torch.no_grad():
        assert all(torch.equal(out, layer(x)) for out in outs)
    assert layer.activity.last == {"decode": layer.last_decision.mode}  # eager calls record it
