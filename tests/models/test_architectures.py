"""The architecture matrix of docs/architectures.md, tested on tiny random models of every family.

Per family: sparsify_ the model with its own activation and compare it with its ReLU twin (same seed,
activation field "relu"); save and load_pretrained back exactly; plain from_pretrained gives the same
model with θ = 0 and refuses (naming sparseffn.load_pretrained) with θ != 0; greedy generation with a
cache gives the twin's tokens; unsparsify_ gives the twin back.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparseffn import load_pretrained, sparsify_, unsparsify_
from sparseffn.models import sparse_layers
from sparseffn.models.hf_config import UNLOADABLE_ACT
from tests.models.families import FAMILIES, SPARSE_KIND, family_lm, ids

GEN = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)


def _logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _close(a, b):
    """Equal up to fp32 rounding (experts and fused projections split matmuls Hugging Face fuses)."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def _thresholds(model):
    gen = torch.Generator().manual_seed(5)
    for layer in sparse_layers(model):
        layer.set_threshold_(torch.rand(layer.threshold.shape, generator=gen) * 0.05)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family(family, tmp_path):
    _, field, original = FAMILIES[family]
    twin = family_lm(family, "relu")
    model = family_lm(family)
    tokens = ids()
    assert not torch.allclose(_logits(model, tokens), _logits(twin, tokens))  # the activation matters
    sparsify_(model)
    kinds = {type(m).__name__ for m in sparse_layers(model)}
    assert kinds == SPARSE_KIND.get(family, {"SparseMLP"}), kinds
    assert getattr(model.config, field) == "relu"
    _close(_logits(model, tokens), _logits(twin, tokens))

    # θ = 0: plain transformers loads the same model; load_pretrained loads it exactly
    model.save_pretrained(tmp_path / "zero")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "zero")
    assert not sparse_layers(plain) and getattr(plain.config, field) == "relu"
    _close(_logits(plain, tokens), _logits(twin, tokens))
    loaded = load_pretrained(tmp_path / "zero")
    assert torch.equal(_logits(loaded, tokens), _logits(model, tokens))

    # θ != 0: the config says so, plain transformers refuses, load_pretrained is exact
    _thresholds(model)
    expect = _logits(model, tokens)
    assert not torch.allclose(expect, _logits(twin, tokens), rtol=1e-4, atol=1e-4)
    model.save_pretrained(tmp_path / "theta")
    assert json.loads((tmp_path / "theta" / "config.json").read_text())[field] == UNLOADABLE_ACT
    with pytest.raises(KeyError, match="sparseffn.load_pretrained"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "theta")
    loaded = load_pretrained(tmp_path / "theta")
    assert all(a.has_threshold and torch.equal(a.threshold, b.threshold)
               for a, b in zip(sparse_layers(loaded), sparse_layers(model)))
    assert torch.equal(_logits(loaded, tokens), expect)
    assert getattr(loaded.config, field) == UNLOADABLE_ACT

    # generation with a cache, then back to a plain ReLU model
    for layer in sparse_layers(model):
        layer.set_threshold_(None)
    prompt = ids(length=4, seed=1)
    mask = torch.ones_like(prompt)
    out = model.generate(prompt, attention_mask=mask, use_cache=True, **GEN)
    assert torch.equal(out, twin.generate(prompt, attention_mask=mask, use_cache=True, **GEN))
    assert torch.equal(out, model.generate(prompt, attention_mask=mask, use_cache=False, **GEN))
    unsparsify_(model)
    assert not sparse_layers(model) and getattr(model.config, field) == "relu"
    assert not hasattr(model.config, "sparseffn")
    _close(_logits(model, tokens), _logits(twin, tokens))
    assert model.state_dict().keys() == twin.state_dict().keys()
