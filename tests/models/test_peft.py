"""PEFT LoRA on the MLP projections of sparsified models: the adapters take effect and train, the
merged model equals the adapter model, and the sparse op still runs (on the merged weights)."""

import copy
import importlib

import pytest
import torch
from peft import LoraConfig, get_peft_model

from sparseffn import sparsify_
from sparseffn.models import collect_l1, sparse_layers
from sparseffn.nn import SparseMLP
from tests.models.families import family_lm, ids

nn_dispatch = importlib.import_module("sparseffn.nn.dispatch")
MLP_TARGETS = {"llama": ["gate_proj", "up_proj", "down_proj"], "phi3": ["gate_up_proj", "down_proj"],
               "gpt2": ["c_fc", "c_proj"]}  # matched in the MLPs only (GPT-2's attention has a c_proj too)


def _lora(model, family, dropout=0.0, seed=3):
    targets = r".*mlp\.(" + "|".join(MLP_TARGETS[family]) + ")"
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout,
                        fan_in_fan_out=family == "gpt2")
    peft = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # lora_B starts at zero (no effect): give it values
        for name, p in peft.named_parameters():
            if "lora_" in name:  # A and B from the seed: the same adapters on every model
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return peft


def _logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("family", sorted(MLP_TARGETS))
def test_lora_after_sparsify_matches_lora_on_the_relu_twin(family):
    tokens = ids()
    sparse = _lora(sparsify_(family_lm(family)), family)
    twin = _lora(family_lm(family, "relu"), family)
    base = _logits(sparsify_(family_lm(family)), tokens)
    got = _logits(sparse, tokens)
    assert (got - base).abs().max() > 1e-2  # the adapters change the output
    _close(got, _logits(twin, tokens))

    # gradients reach every MLP adapter and equal the twin's
    for model in (sparse, twin):
        model.train()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same dropout masks (GPT-2 drops out inside and after its MLP)
            model(input_ids=tokens, labels=tokens).loss.backward()
    grads = {n: p.grad for n, p in twin.named_parameters() if p.requires_grad}
    mlp_adapters = [n for n, p in sparse.named_parameters() if p.requires_grad and "mlp" in n]
    assert len(mlp_adapters) == 2 * len(MLP_TARGETS[family]) * 2  # A and B, per target, 2 layers
    for name, p in sparse.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().max() > 0, name
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)

    # merge_and_unload gives a sparse model computing the same function, without PEFT layers
    sparse.eval()
    expect = _logits(sparse, tokens)
    merged = copy.deepcopy(sparse).merge_and_unload()
    assert all(type(m).__name__ in ("SparseMLP", "HFSparseMLP") for m in sparse_layers(merged))
    assert not any("lora" in n for n, _ in merged.named_modules())
    _close(_logits(merged, tokens), expect)


def test_lora_runs_the_sparse_op_on_merged_weights(monkeypatch):
    """Plain LoRA (no dropout) resolves to merged weights and the op runs; dropout while training makes
    the projections be called as modules (dense), as PEFT's forward needs."""
    calls = []
    real = nn_dispatch.sparse_mlp_with_decision
    monkeypatch.setattr(nn_dispatch, "sparse_mlp_with_decision", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    model = _lora(sparsify_(family_lm("llama")), "llama")
    model(input_ids=ids())
    assert len(calls) == 2
    mlp = sparse_layers(model)[0]
    merged = mlp.gate_proj.base_layer.weight + mlp.gate_proj.get_delta_weight("default")
    assert torch.equal(calls[0], merged)
    assert isinstance(collect_l1(model), torch.Tensor)
    calls.clear()
    with_dropout = _lora(sparsify_(family_lm("llama")), "llama", dropout=0.1).train()
    with_dropout(input_ids=ids())
    assert calls == []


def test_sparsify_a_peft_model():
    """LoRA first (on the SiLU model), sparsify_ second: the adapters stay and apply."""
    tokens = ids()
    model = sparsify_(_lora(family_lm("llama"), "llama"))
    assert all(isinstance(m, SparseMLP) for m in sparse_layers(model)) and len(sparse_layers(model)) == 2
    assert type(sparse_layers(model)[0].gate_proj).__name__ == "Linear"  # peft's lora.Linear
    assert model.base_model.model.config.hidden_act == "relu"
    _close(_logits(model, tokens), _logits(_lora(family_lm("llama", "relu"), "llama"), tokens))
