"""relufy_ on every family of docs/architectures.md: the model computes its dense original with each MLP
activation replaced by a (shifted) ReLU, records what it replaced, and survives save / load_pretrained."""

import pytest
import torch
from torch import nn

from sparseffn import SparsityConfig, load_pretrained, relufy_
from sparseffn.models import relufied_from, sparse_layers, sparsity_config
from sparseffn.models.layouts import LAYOUTS, kind_of
from tests.models.families import FAMILIES, SPARSE_KIND, family_lm, ids

SHIFT = 0.01
CONFIG = SparsityConfig(l1_coeff=1e-2, l1_warmup_steps=50, l1_schedule="sine", reinit_dead=True)


class ShiftedReLU(nn.Module):
    def __init__(self, shift: float):
        super().__init__()
        self.shift = shift

    def forward(self, g):
        return torch.relu(g - self.shift)


def _reference(family: str, shift: float) -> nn.Module:
    """The dense original with every MLP's own activation module swapped for relu(g - shift): the
    Hugging Face MLP code itself, with nothing of sparseffn in its forward."""
    model = family_lm(family)
    for module in list(model.modules()):
        kind = kind_of(module)
        if kind is None:
            continue
        attr = LAYOUTS[type(module).__name__].act if kind == "layout" else "act_fn"
        assert isinstance(getattr(module, attr), nn.Module), (family, type(module).__name__, attr)
        setattr(module, attr, ShiftedReLU(shift))
    return model


def _logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_relufy_family_matches_shifted_relu_reference_and_round_trips(family, tmp_path):
    _, field, original = FAMILIES[family]
    tokens = ids()
    model = family_lm(family)
    dense = _logits(model, tokens)
    assert relufy_(model, CONFIG, shift=SHIFT) is model
    assert {type(m).__name__ for m in sparse_layers(model)} == SPARSE_KIND.get(family, {"SparseMLP"})
    assert all(bool((m.threshold == SHIFT).all()) and m.has_threshold for m in sparse_layers(model))
    out = _logits(model, tokens)
    _close(out, _logits(_reference(family, SHIFT), tokens))
    assert not torch.allclose(out, dense, rtol=1e-4, atol=1e-4)  # the swap changed the function
    assert not torch.allclose(out, _logits(_reference(family, 0.0), tokens), rtol=1e-4, atol=1e-4)  # so did s
    assert relufied_from(model) == {field: original}
    assert sparsity_config(model) == SparsityConfig(**{**CONFIG.to_dict(), "threshold": SHIFT})

    model.save_pretrained(tmp_path)
    loaded = load_pretrained(tmp_path)
    assert torch.equal(_logits(loaded, tokens), out)
    assert relufied_from(loaded) == {field: original}
    assert sparsity_config(loaded) == sparsity_config(model)


def test_relufy_without_shift_is_plain_relu_and_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = relufy_(family_lm("llama"))
    tokens = ids()
    assert not any(m.has_threshold for m in sparse_layers(model))
    _close(_logits(model, tokens), _logits(family_lm("llama", "relu"), tokens))
    assert model.config.hidden_act == "relu" and relufied_from(model) == {"hidden_act": "silu"}
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    _close(_logits(plain, tokens), _logits(model, tokens))


def test_relufy_refuses_bad_input():
    model = family_lm("llama")
    with pytest.raises(TypeError, match="config must be a SparsityConfig"):
        relufy_(model, {"l1_coeff": 1.0})
    with pytest.raises(TypeError, match="shift must be a number"):
        relufy_(model, shift="0.1")
    with pytest.raises(ValueError, match="disagree"):
        relufy_(model, SparsityConfig(threshold=0.2), shift=0.1)
    with pytest.raises(ValueError, match="SparsityConfig.threshold must be >= 0"):
        relufy_(model, shift=-0.1)
    assert not sparse_layers(model)  # nothing changed by the refusals
    relufy_(model)
    with pytest.raises(ValueError, match="already holds sparse layers"):
        relufy_(model)


def test_relufy_with_filter_fn_records_the_original_of_the_dense_rest():
    model = family_lm("llama")
    relufy_(model, filter_fn=lambda module, fqn: fqn.endswith("layers.0.mlp"))
    assert len(sparse_layers(model)) == 1
    assert relufied_from(model) == {"hidden_act": "silu"}
    assert model.config.sparseffn_layers["modules"] == ["model.layers.0.mlp"]
