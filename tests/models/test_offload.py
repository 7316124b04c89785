"""load_pretrained with transformers' loading options, and sparse layers under accelerate's hooks."""

import copy

import pytest
import torch
from accelerate import cpu_offload

from sparseffn import load_pretrained, sparsify_
from sparseffn.models import sparse_layers
from tests.models.families import family_lm, ids


def _saved(tmp_path, family="llama"):
    model = sparsify_(family_lm(family))
    gen = torch.Generator().manual_seed(0)
    for layer in sparse_layers(model):
        layer.set_threshold_(torch.rand(layer.threshold.shape, generator=gen) * 0.05)
    model.save_pretrained(tmp_path)
    return model


def _logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_device_map_with_a_layer_on_disk(tmp_path, family):
    model = _saved(tmp_path / "model", family)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    loaded = load_pretrained(tmp_path / "model", device_map=device_map, offload_folder=str(tmp_path / "offload"))
    offloaded = [p for p in loaded.model.layers[1].parameters() if p.device.type == "meta"]
    assert offloaded  # really on disk, brought in by accelerate's hooks during the forward
    assert all(m.has_threshold for m in sparse_layers(loaded))
    assert torch.equal(_logits(loaded, ids()), _logits(model, ids()))


def test_cpu_offload_hooks_are_honoured():
    model = sparsify_(family_lm("llama"))
    for layer in sparse_layers(model):
        layer.set_threshold_(0.02)
    expect = _logits(model, ids())
    offloaded = cpu_offload(copy.deepcopy(model), execution_device=torch.device("cpu"))
    assert sparse_layers(offloaded)[0].up_proj.weight.device.type == "meta"
    assert torch.equal(_logits(offloaded, ids()), expect)


def test_dtype_and_attention_from_the_caller(tmp_path):
    model = _saved(tmp_path)
    loaded = load_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="eager", device="cpu")
    assert loaded.dtype == torch.bfloat16 and loaded.config._attn_implementation == "eager"
    for a, b in zip(sparse_layers(model), sparse_layers(loaded)):
        assert b.threshold.dtype == torch.float32 and torch.equal(a.threshold, b.threshold)
    with pytest.raises(ValueError, match="pass device or device_map, not both"):
        load_pretrained(tmp_path, device="cpu", device_map="cpu")


def test_gemma2_loads_with_its_own_attention(tmp_path):
    """load_pretrained no longer forces sdpa (Gemma2 refuses it): the config's choice applies."""
    model = _saved(tmp_path, "gemma2")
    loaded = load_pretrained(tmp_path)
    assert loaded.config._attn_implementation == model.config._attn_implementation
    assert torch.equal(_logits(loaded, ids()), _logits(model, ids()))
