import torch

from sparseffn.models import SparsityConfig, build_model, sparse_mlps
from sparseffn.train.tracking import ActivationStats, DeadUnits, reinit_dead_gates


def _model():
    return build_model("tiny", SparsityConfig(), vocab_size=64, seed=0, num_hidden_layers=2, intermediate_size=300)


def test_stats_match_the_activation_masks():
    model = _model()
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(0))
    inputs = []
    hooks = [m.register_forward_hook(lambda mod, a, o: inputs.append(a[0])) for m in sparse_mlps(model)]
    stats = ActivationStats(model, tile=128, slots=66)
    with torch.no_grad():
        model(input_ids=ids)  # outside capture: nothing recorded
        assert not stats.has_data
        inputs.clear()
        with stats.capture():
            model(input_ids=ids)
    for h in hooks:
        h.remove()
    s = stats.collect()
    assert not stats.has_data
    for i, (mlp, x) in enumerate(zip(sparse_mlps(model), inputs)):
        mask = mlp.activation_mask(x).reshape(-1, 300)
        nnz = mask.sum(-1)
        assert s.tokens == 33 and s.hidden[i] == 300
        assert abs(s.nnz_mean[i] - nnz.double().mean().item()) < 1e-9
        assert s.nnz_max[i] == nnz.max().item()
        padded = torch.nn.functional.pad(mask, (0, 84)).view(33, 3, 128).sum(-1)
        assert abs(s.overflow_rate[i] - (padded > 66).any(-1).double().mean().item()) < 1e-12
        assert torch.equal(s.fired[i], mask.any(0))
    assert 0 < s.overflow_rate[0] < 1  # the check above is not vacuous
    stats.remove()
    with torch.no_grad(), stats.capture():
        model(input_ids=ids)
    assert not stats.has_data  # hooks removed


def test_dead_units_window_and_revive():
    dead = DeadUnits([4], after=3)
    dead.update([torch.tensor([True, False, False, True])], 1)
    assert dead.dead(3)[0].tolist() == [False, True, True, False]
    assert dead.dead(2)[0].tolist() == [False, False, False, False]
    dead.update([torch.tensor([False, True, False, False])], 3)
    assert dead.dead(4)[0].tolist() == [True, False, True, True]
    dead.revive([torch.tensor([True, False, False, False])], 4)
    assert dead.dead(4)[0].tolist() == [False, False, True, True]
    other = DeadUnits([4], after=3)
    other.load_state_dict(dead.state_dict())
    assert torch.equal(other.last_fired[0], dead.last_fired[0])


def test_reinit_changes_only_dead_gate_rows_and_resets_their_moments():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids).logits.square().mean().backward()
    opt.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    mlps = sparse_mlps(model)
    dead = [torch.zeros(300, dtype=torch.bool) for _ in mlps]
    dead[1][[3, 17, 299]] = True
    counts = reinit_dead_gates(mlps, dead, opt, torch.Generator().manual_seed(0), std=0.02)
    assert counts == [0, 3]
    gate = mlps[1].gate_proj.weight
    name = next(n for n, p in model.named_parameters() if p is gate)
    changed = (gate != before[name]).any(1)
    assert changed.tolist() == dead[1].tolist()
    assert 0.005 < gate[dead[1]].std().item() < 0.05
    for n, p in model.named_parameters():
        if p is not gate:
            assert torch.equal(p, before[n]), n
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            now, old = opt.state[p][key], moments[id(p)][key]
            if p is gate:
                assert torch.count_nonzero(now[dead[1]]) == 0 and torch.count_nonzero(old[dead[1]]) > 0
                assert torch.equal(now[~dead[1]], old[~dead[1]])
            else:
                assert torch.equal(now, old)
    # The same generator state draws the same rows (what keeps DDP replicas and resumed runs identical).
    again = _model()
    again.load_state_dict({k: v for k, v in zip(before, before.values())}, strict=False)
    reinit_dead_gates(sparse_mlps(again), dead, None, torch.Generator().manual_seed(0), std=0.02)
    assert torch.equal(sparse_mlps(again)[1].gate_proj.weight, gate)
