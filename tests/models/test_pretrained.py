import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparseffn import SparsityConfig, load_pretrained, sparsify_, unsparsify_
from sparseffn.models import sparse_mlps
from tests.models.hf import tiny_lm, token_ids


def _thresholded(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for m in sparse_mlps(model):
        m.set_threshold_(torch.rand(m.intermediate_size, generator=gen) * 0.05)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_save_load_round_trip(tmp_path, arch):
    config = SparsityConfig(l1_coeff=1e-4, mode="dense", expected_nnz=7.5)
    model = _thresholded(sparsify_(tiny_lm(arch), config))
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["sparseffn"] == config.to_dict()

    loaded = load_pretrained(tmp_path)
    assert type(loaded) is type(model) and not loaded.training
    saved = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
    assert {k: v for k, v in loaded.config.to_dict().items() if k != "_name_or_path"} == saved
    assert loaded.config.sparseffn == config.to_dict()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied embeddings stay tied
    for a, b in zip(sparse_mlps(model), sparse_mlps(loaded)):
        assert torch.equal(a.threshold, b.threshold) and b.has_threshold
        assert b.mode == "dense" and b.expected_nnz == 7.5
    assert model.state_dict().keys() == loaded.state_dict().keys()
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    ids = token_ids()
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_untied_bf16_round_trip_and_dtype_override(tmp_path):
    model = _thresholded(sparsify_(tiny_lm(tied=False, dtype=torch.bfloat16)))
    model.save_pretrained(tmp_path)
    loaded = load_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16 and loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    assert all(m.threshold.dtype == torch.float32 for m in sparse_mlps(loaded))
    ids = token_ids()
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    as_fp32 = load_pretrained(tmp_path, dtype=torch.float32, device="cpu")
    assert as_fp32.dtype == torch.float32
    assert torch.equal(as_fp32.model.embed_tokens.weight, model.model.embed_tokens.weight.float())


def test_unsparsified_model_saves_as_plain_hf(tmp_path):
    plain = tiny_lm()
    model = unsparsify_(sparsify_(tiny_lm()))
    model.save_pretrained(tmp_path)
    assert "sparseffn" not in json.loads((tmp_path / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert torch.equal(_logits(reloaded, token_ids()), _logits(plain, token_ids()))
    with pytest.raises(ValueError, match="not saved from a sparsified model"):
        load_pretrained(tmp_path)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory with a config.json"):
        load_pretrained(tmp_path / "missing")
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
        load_pretrained(3)
    sparsify_(tiny_lm()).save_pretrained(tmp_path)
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype, 'auto' or None"):
        load_pretrained(tmp_path, dtype=torch.int8)
    config = json.loads((tmp_path / "config.json").read_text())
    config["sparseffn"]["l1_coef"] = 1.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unknown SparsityConfig field\(s\) \['l1_coef'\]"):
        load_pretrained(tmp_path)
    del config["sparseffn"]["l1_coef"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(OSError, match="no file named model.safetensors"):
        load_pretrained(tmp_path)


def test_sharded_checkpoint(tmp_path):
    model = _thresholded(sparsify_(tiny_lm()))
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    loaded = load_pretrained(tmp_path)
    assert torch.equal(_logits(loaded, token_ids()), _logits(model, token_ids()))


def test_damaged_files_are_one_error_naming_the_file(tmp_path):
    """A cut weights file, a cut shard or a cut config.json: SavedFileError naming it, before transformers
    reads anything (whose own errors would be a SafetensorError traceback without the file)."""
    from sparseffn.models.saved_files import SavedFileError

    sparsify_(tiny_lm()).save_pretrained(tmp_path / "one")
    weights = tmp_path / "one" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(SavedFileError, match=rf"^{weights}: truncated \(\d+ bytes, its header describes \d+\)$"):
        load_pretrained(tmp_path / "one")
    sparsify_(tiny_lm()).save_pretrained(tmp_path / "shards", max_shard_size="50KB")
    shard = sorted((tmp_path / "shards").glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(SavedFileError, match=rf"^{shard}: truncated"):
        load_pretrained(tmp_path / "shards")
    config = tmp_path / "shards" / "config.json"
    config.write_text(config.read_text()[:50])
    with pytest.raises(SavedFileError, match=rf"^{config}: not valid JSON"):
        load_pretrained(tmp_path / "shards")
