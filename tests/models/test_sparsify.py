import copy

import pytest
import torch
from torch import nn

import sparseffn
from sparseffn import SparseMLP, SparsityConfig, collect_l1, sparsify_, unsparsify_
from sparseffn.models import named_sparse_mlps, set_track_l1, sparse_mlps, sparsity_config
from sparseffn.ops.reference import l1_penalty
from tests.models.hf import tiny_lm, token_ids

ARCHS = ["llama", "qwen2", "mistral"]


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_sparsified_logits_equal_plain_relu_model(arch):
    plain = tiny_lm(arch, act="relu")
    silu = tiny_lm(arch, act="silu")  # same seed: same weights, SiLU gates
    for (name, a), b in zip(plain.state_dict().items(), silu.state_dict().values()):
        assert torch.equal(a, b), name
    weights = {name: p for name, p in silu.named_parameters()}
    ids = token_ids()
    assert not torch.equal(_logits(silu, ids), _logits(plain, ids))
    assert sparsify_(silu) is silu
    assert silu.config.hidden_act == "relu"
    assert silu.config.sparseffn == SparsityConfig().to_dict()
    mlps = sparse_mlps(silu)
    assert len(mlps) == 2 and all(layer.mlp is m for layer, m in zip(silu.model.layers, mlps))
    assert [name for name, _ in named_sparse_mlps(silu)] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    # Same Parameters (shared, not copied), same logits bit for bit.
    assert {name: p for name, p in silu.named_parameters()} == weights
    assert torch.equal(_logits(silu, ids), _logits(plain, ids))


def test_sparsify_applies_config():
    config = SparsityConfig(threshold=0.05, mode="dense", expected_nnz=10)
    model = sparsify_(tiny_lm(), config)
    assert sparsity_config(model) == config
    for m in sparse_mlps(model):
        assert m.mode == "dense" and m.expected_nnz == 10.0 and m.has_threshold
        assert torch.equal(m.threshold, torch.full((96,), 0.05))
    plain = tiny_lm()
    assert not torch.equal(_logits(model, token_ids()), _logits(plain, token_ids()))


def test_loss_with_l1_has_the_reference_gradient():
    coeff = 1e-2
    plain = tiny_lm()
    sparse = sparsify_(copy.deepcopy(plain))
    ids = token_ids(length=16)
    sparse.train()
    loss = sparse(input_ids=ids, labels=ids).loss + coeff * collect_l1(sparse)
    loss.backward()

    # By hand: the plain ReLU model, h captured at each down_proj input, mean over layers of l1_penalty(h).
    plain.train()
    hs = []
    hooks = [layer.mlp.down_proj.register_forward_pre_hook(lambda m, args: hs.append(args[0])) for layer in plain.model.layers]
    ce = plain(input_ids=ids, labels=ids).loss
    for hook in hooks:
        hook.remove()
    aux = torch.stack([l1_penalty(h) for h in hs]).mean()
    torch.testing.assert_close(collect_l1(sparse), aux)
    (ce + coeff * aux).backward()
    grads = dict(sparse.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, msg=name)
    # The L1 term moves the gradient (so the comparison above is not of CE gradients alone).
    gate = plain.model.layers[0].mlp.gate_proj.weight
    with_l1 = gate.grad.clone()
    plain.zero_grad()
    plain(input_ids=ids, labels=ids).loss.backward()
    assert (gate.grad - with_l1).abs().max() > 1e-3 * with_l1.abs().max()


def test_collect_l1_errors_and_track_l1():
    model = sparsify_(tiny_lm())
    with pytest.raises(RuntimeError, match=r"2 of 2 SparseMLP layer\(s\) have no last_l1 \(first: model.layers.0.mlp\)"):
        collect_l1(model)
    model(input_ids=token_ids())
    l1 = collect_l1(model)
    assert l1.dtype == torch.float32 and l1.dim() == 0
    assert torch.equal(l1, (model.model.layers[0].mlp.last_l1 + model.model.layers[1].mlp.last_l1) / 2)
    set_track_l1(model, False)
    assert all(not m.track_l1 and m.last_l1 is None for m in sparse_mlps(model))
    model(input_ids=token_ids())
    with pytest.raises(RuntimeError, match="track_l1=True"):
        collect_l1(model)
    set_track_l1(model, None)  # back to the default: follow the mode
    model.eval()
    with torch.no_grad():
        model(input_ids=token_ids())
    assert all(m.track_l1 is None and m.last_l1 is None for m in sparse_mlps(model))
    model.train()
    model(input_ids=token_ids())
    assert collect_l1(model).requires_grad
    with pytest.raises(ValueError, match="has no SparseMLP"):
        collect_l1(tiny_lm())
    with pytest.raises(TypeError, match="enabled must be None or a bool"):
        set_track_l1(model, 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_unsparsify_reverses(arch):
    plain = tiny_lm(arch)
    mlp_class = type(plain.model.layers[0].mlp)
    model = sparsify_(copy.deepcopy(plain))
    weights = dict(model.named_parameters())
    assert unsparsify_(model) is model
    assert not sparse_mlps(model) and not hasattr(model.config, "sparseffn")
    assert model.config.hidden_act == "relu"
    for layer in model.model.layers:
        assert type(layer.mlp) is mlp_class and isinstance(layer.mlp.act_fn, nn.ReLU)
    assert dict(model.named_parameters()) == weights  # the same Parameter objects
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert torch.equal(_logits(model, token_ids()), _logits(plain, token_ids()))
    with pytest.raises(ValueError, match="nothing to unsparsify"):
        unsparsify_(model)


def test_unsparsify_refuses_thresholds():
    model = sparsify_(tiny_lm())
    model.model.layers[1].mlp.set_threshold_(0.1)
    with pytest.raises(ValueError, match=r"1 layer\(s\) have non-zero thresholds \(first: model.layers.1.mlp\)"):
        unsparsify_(model)
    assert len(sparse_mlps(model)) == 2  # nothing was replaced
    model.model.layers[1].mlp.set_threshold_(None)
    unsparsify_(model)


def test_sparsify_errors():
    with pytest.raises(ValueError, match="no MLP found in Sequential"):
        sparsify_(nn.Sequential(nn.Linear(4, 4)))
    model = sparsify_(tiny_lm())
    with pytest.raises(ValueError, match="already sparsified"):
        sparsify_(model)
    with pytest.raises(TypeError, match="config must be a SparsityConfig, got dict"):
        sparsify_(tiny_lm(), {"l1_coeff": 1e-5})
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        sparsify_("model")


def test_generate_greedy_batch_with_and_without_cache():
    plain = tiny_lm()
    model = sparsify_(copy.deepcopy(plain))
    ids = token_ids(batch=2, length=5, seed=3)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
    with_cache = model.generate(ids, use_cache=True, **kwargs)
    without = model.generate(ids, use_cache=False, **kwargs)
    assert with_cache.shape == (2, 13)
    assert torch.equal(with_cache, without)
    assert torch.equal(with_cache, plain.generate(ids, use_cache=True, **kwargs))
    assert not torch.equal(with_cache[0, 5:], with_cache[1, 5:])  # the two rows are really decoded apart


def test_sparse_mlp_is_used_in_forward():
    model = sparsify_(tiny_lm())
    calls = []
    for m in sparse_mlps(model):
        m.register_forward_hook(lambda mod, args, out: calls.append(type(mod)))
    model(input_ids=token_ids())
    assert calls == [SparseMLP, SparseMLP]


def test_sparsified_model_compiles_fullgraph_with_the_l1_loss():
    """torch.compile(fullgraph=True) traces SparseMLP's forward (mode choice, last_l1 store): the loss
    CE + λ·collect_l1 and its gradients equal eager."""
    model = sparsify_(tiny_lm("llama"))
    ids = token_ids()

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(ids) + 0.3 * collect_l1(model)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager = loss_and_grads(lambda i: model(input_ids=i, labels=i).loss)
    compiled_model = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled = loss_and_grads(lambda i: compiled_model(input_ids=i, labels=i).loss)
    torch.testing.assert_close(compiled[0], eager[0])
    for c, e in zip(compiled[1], eager[1]):
        torch.testing.assert_close(c, e)


def test_filter_fn_partial_model_saves_as_sparseffn_only(tmp_path):
    """Layer 1 kept dense with SiLU: no single activation field is true, so plain transformers refuses the
    checkpoint and load_pretrained rebuilds exactly this mix."""
    from transformers import AutoModelForCausalLM

    from sparseffn import load_pretrained
    from sparseffn.models.hf_config import UNLOADABLE_ACT

    model = sparsify_(tiny_lm(act="silu"), filter_fn=lambda module, fqn: fqn == "model.layers.0.mlp")
    assert [n for n, _ in named_sparse_mlps(model)] == ["model.layers.0.mlp"]
    assert model.config.hidden_act == UNLOADABLE_ACT
    assert type(model.model.layers[1].mlp).__name__ == "LlamaMLP"
    model.save_pretrained(tmp_path)
    with pytest.raises(KeyError, match="sparseffn.load_pretrained"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded = load_pretrained(tmp_path)
    assert [n for n, _ in named_sparse_mlps(loaded)] == ["model.layers.0.mlp"]
    assert torch.equal(_logits(loaded, token_ids()), _logits(model, token_ids()))
    with pytest.raises(ValueError, match="sparsified in part"):
        unsparsify_(model)
    with pytest.raises(ValueError, match="filter_fn selected none"):
        sparsify_(tiny_lm(), filter_fn=lambda module, fqn: False)
    with pytest.raises(TypeError, match="filter_fn must be callable"):
        sparsify_(tiny_lm(), filter_fn=3)


def test_unknown_mlps_are_named():
    class OddMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.w_in, self.w_out = nn.Linear(4, 8), nn.Linear(8, 4)

    with pytest.raises(ValueError, match=r"look like MLPs but match none: mlp \(OddMLP: children \['w_in', 'w_out'\]\)"):
        sparsify_(nn.ModuleDict({"mlp": OddMLP()}))
    model = tiny_lm()
    model.model.layers[1].extra = OddMLP()
    with pytest.raises(ValueError, match=r"1 module\(s\) look like MLPs that sparsify_ does not know: model.layers.1.extra"):
        sparsify_(model)
    sparsify_(model, filter_fn=lambda module, fqn: not fqn.endswith("extra"))
    assert len(sparse_mlps(model)) == 2


def test_thresholds_set_after_sparsify_reach_the_saved_config(tmp_path):
    import json

    model = sparsify_(tiny_lm())
    assert model.config.hidden_act == "relu"
    model.model.layers[0].mlp.set_threshold_(0.1)  # behind sparseffn's back: save_pretrained re-syncs
    model.save_pretrained(tmp_path)
    assert "load_pretrained" in json.loads((tmp_path / "config.json").read_text())["hidden_act"]


def test_dispatch_report_names_each_layer_and_what_auto_mode_decided():
    model = sparsify_(tiny_lm()).eval()
    report = sparseffn.dispatch_report(model)
    assert [r["layer"] for r in report] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(r["nnz_estimate"] is None and r["last_reason"] is None for r in report)
    with torch.no_grad():
        for _ in range(6):  # the activity sample of call 0 is read at call 4
            model(input_ids=token_ids())
    report = sparseffn.dispatch_report(model)
    assert all(r["mode"] == "auto" and r["samples"] == 1 and r["nnz_estimate"] > 0 for r in report)
    assert all(r["paths"] == {"decode": "dense"} or r["paths"] == {"prefill": "dense"} for r in report)
    assert all(r["last_reason"] and "dense" not in r["last_reason"] for r in report)  # a blocker named (CPU, fp32)
