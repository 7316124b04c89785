"""SparseExperts: routed experts with ReLU gates, per-expert thresholds, L1 over each expert's tokens."""

import pytest
import torch
import torch.nn.functional as F

from sparseffn import calibrate_thresholds, sparsify_
from sparseffn.models import collect_l1, sparse_layers
from sparseffn.nn import SparseExperts
from tests.models.families import family_lm, ids

E, D, H, N, K = 4, 16, 24, 11, 2


def _experts(seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.nn.Parameter(torch.randn(E, 2 * H, D, generator=gen) * 0.3)
    down = torch.nn.Parameter(torch.randn(E, D, H, generator=gen) * 0.3)
    return SparseExperts(gate_up, down, mode="dense")


def _routing(seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=gen)
    index = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)])
    weights = torch.rand(N, K, generator=gen).softmax(-1)
    return x, index, weights


def _by_hand(experts, x, index, weights):
    """Token by token: y_t = Σ_k w_tk down_e(relu(gate_e x - θ_e) * up_e x), l1 = Σ_t Σ_k Σ_j |h| / N."""
    ys, l1 = [], 0.0
    for t in range(N):
        y = torch.zeros(D)
        for k in range(K):
            e = int(index[t, k])
            gate, up = experts.gate_up_proj[e].chunk(2, 0)
            h = torch.relu(F.linear(x[t], gate) - experts.threshold[e]) * F.linear(x[t], up)
            y = y + weights[t, k] * F.linear(h, experts.down_proj[e])
            l1 = l1 + h.abs().sum()
        ys.append(y)
    return torch.stack(ys), l1 / N


@pytest.mark.parametrize("thresholds", [False, True])
def test_outputs_and_l1_match_the_token_by_token_formula(thresholds):
    experts = _experts()
    if thresholds:
        theta = torch.rand(E, H, generator=torch.Generator().manual_seed(2)) * 0.3
        theta[1] = 0  # one expert without θ
        experts.set_threshold_(theta)
    x, index, weights = _routing()
    y = experts(x, index, weights)
    expect, l1 = _by_hand(experts, x, index, weights)
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(experts.last_l1, l1, rtol=1e-5, atol=1e-6)


def test_a_threshold_changes_only_its_experts_tokens():
    experts = _experts()
    x, index, weights = _routing()
    before = experts(x, index, weights)
    theta = torch.zeros(E, H)
    theta[2] = 0.2
    after = experts.set_threshold_(theta)(x, index, weights)
    routed = (index == 2).any(-1)
    assert routed.any() and (~routed).any()
    assert torch.equal(after[~routed], before[~routed])
    assert (after[routed] - before[routed]).abs().max() > 1e-4


def test_gradients_and_collect_l1():
    model = sparsify_(family_lm("mixtral")).train()
    tokens = ids()
    loss = model(input_ids=tokens, labels=tokens).loss + 0.1 * collect_l1(model)
    loss.backward()
    for layer in sparse_layers(model):
        assert layer.gate_up_proj.grad.abs().max() > 0 and layer.down_proj.grad.abs().max() > 0


def test_errors():
    with pytest.raises(ValueError, match=r"down_proj must be \[E, D, H\]"):
        SparseExperts(torch.nn.Parameter(torch.zeros(E, 2 * H, D)), torch.nn.Parameter(torch.zeros(E, D, H + 1)))
    with pytest.raises(ValueError, match=r"threshold must broadcast to \[4, 24\]"):
        _experts().set_threshold_(torch.zeros(3))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_calibrate_per_expert(family):
    model = sparsify_(family_lm(family))
    batches = [ids(batch=4, length=16, seed=s) for s in range(2)]
    report = calibrate_thresholds(model, batches, 6, tolerance=0.2)
    experts = [m for m in sparse_layers(model) if isinstance(m, SparseExperts)]
    assert experts and all(m.threshold.shape == (4, m.intermediate_size) and m.has_threshold for m in experts)
    for m in experts:  # per-expert levels: the experts' thresholds differ
        assert not torch.equal(m.threshold[0], m.threshold[1])
    for r in report:
        assert r["reached"], r
