"""Checkpoints of the paper's reference implementation (`*_sparse_relu`): the format fixture, import by
load_pretrained, export back, project-format saves of imported models, and the errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from sparseffn import SparsityConfig, calibrate_thresholds, collect_l1, fuse_non_mlp_, load_pretrained, unsparsify_
from sparseffn.models import sparse_mlps
from sparseffn.models.generate import CapturedDecoder
from sparseffn.models.reference import REFERENCE_FIELDS, export_reference
from sparseffn.models.reference_fixture import FixtureSpec, fixture_config, fixture_shapes, write_fixture
from tests.models.reference_forward import read_tensors, reference_logits

VARIANTS = {
    "llama": FixtureSpec(),
    "llama-nongated-resized": FixtureSpec(gated=False, new_intermediate_size=96),
    "llama-bias-untied": FixtureSpec(bias=True, tie_word_embeddings=False),
    "qwen2-bias": FixtureSpec(base="qwen2", bias=True, num_key_value_heads=2),
    "qwen2-nongated": FixtureSpec(base="qwen2", gated=False),
    "llama-sharded-fp32": FixtureSpec(dtype="float32", max_shard_bytes=40_000, dtype_key="dtype"),
}


def _ids(vocab=320, batch=2, length=12, seed=0):
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    return {name: write_fixture(root / name, spec) for name, spec in VARIANTS.items()}


def test_fixture_writes_the_reference_format(fixtures):
    folder = fixtures["llama-sharded-fp32"]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama_sparse_relu" and config["architectures"] == ["SparseLlamaForCausalLM"]
    assert config["auto_map"] == {"AutoConfig": "sparse_models.SparseLlamaConfig",
                                  "AutoModelForCausalLM": "sparse_models.SparseLlamaForCausalLM"}
    assert {k: config[k] for k in REFERENCE_FIELDS if k != "sparsity_gated_mlp"} == {
        k: v for k, v in REFERENCE_FIELDS.items() if k != "sparsity_gated_mlp"}
    assert config["dtype"] == "float32" and "torch_dtype" not in config
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((folder / s).is_file() for s in shards)
    tensors = read_tensors(folder)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == fixture_shapes(VARIANTS["llama-sharded-fp32"])
    assert all(v.dtype == torch.float32 for v in tensors.values())
    nongated = read_tensors(fixtures["llama-nongated-resized"])
    assert "model.layers.0.mlp.gate_proj.weight" not in nongated
    assert nongated["model.layers.0.mlp.up_proj.weight"].shape == (96, 64)
    assert nongated["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    qwen = json.loads((fixtures["qwen2-bias"] / "config.json").read_text())
    assert qwen["model_type"] == "qwen2_sparse_relu" and qwen["mlp_bias"] is True
    assert "model.layers.1.self_attn.q_proj.bias" in read_tensors(fixtures["qwen2-bias"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_import_matches_an_independent_forward(fixtures, variant):
    folder, spec = fixtures[variant], VARIANTS[variant]
    model = load_pretrained(folder, dtype=torch.float32)
    mlps = sparse_mlps(model)
    assert len(mlps) == spec.num_hidden_layers
    assert all((m.gate_proj is not None) == spec.gated and m.intermediate_size == spec.mlp_size for m in mlps)
    assert all(m._has_bias() == spec.bias and not m.has_threshold for m in mlps)
    assert type(model).__name__ == ("LlamaForCausalLM" if spec.base == "llama" else "Qwen2ForCausalLM")
    ids = _ids()
    want = reference_logits(folder, ids)
    got = _logits(model, ids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    as_saved = load_pretrained(folder)  # the checkpoint's dtype
    assert as_saved.dtype == getattr(torch, spec.dtype)
    err = (_logits(as_saved, ids) - want).norm() / want.norm()
    assert err <= (2e-2 if spec.dtype == "bfloat16" else 1e-5)


def test_fixture_activity_is_sparse_but_not_silent(fixtures):
    model = load_pretrained(fixtures["llama"], dtype=torch.float32)
    active = []
    hooks = [m.register_forward_hook(lambda m, a, o: active.append(m.activation_mask(a[0]).float().sum(-1).mean()))
             for m in sparse_mlps(model)]
    _logits(model, _ids(length=64))
    for h in hooks:
        h.remove()
    h = VARIANTS["llama"].mlp_size
    assert all(0.5 < float(a) < 0.15 * h for a in active)  # a few percent of the units, never none


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_imported_model_evaluates_calibrates_trains_and_generates(fixtures, variant):
    from sparseffn.train.eval import evaluate

    model = load_pretrained(fixtures[variant], dtype=torch.float32)
    assert model.config.sparseffn["l1_coeff"] == REFERENCE_FIELDS["sparsity_l1_coeff"]
    ids = _ids(length=16)
    result = evaluate(model, _ids(length=17, batch=4, seed=3), batch_size=2, device=torch.device("cpu"))
    assert result.tokens == 64 and result.ce > 0 and 0 < result.stats.nnz_mean_all < 0.2 * VARIANTS[variant].mlp_size
    # captured generation (on CPU: every step eager) equals Hugging Face's greedy generate
    want = model.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids))
    got = CapturedDecoder(model, batch_size=2, max_length=32, eager_steps=100).generate(ids, max_new_tokens=6)
    assert torch.equal(got, want)
    # calibration
    layers = calibrate_thresholds(model, [ids], 0.5)
    assert all(m.has_threshold for m in sparse_mlps(model)) and len(layers) == len(sparse_mlps(model))
    assert all(layer["mean_nnz"] <= 0.6 for layer in layers), layers
    # one training step reaches every MLP weight
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for m in sparse_mlps(model) for p in m.parameters()]
    out = model(input_ids=ids, labels=ids)
    loss = out.loss + 1e-3 * collect_l1(model)
    loss.backward()
    opt.step()
    after = [p for m in sparse_mlps(model) for p in m.parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("variant", ["llama", "llama-nongated-resized", "qwen2-bias", "llama-sharded-fp32"])
def test_export_round_trips_bit_exactly(fixtures, tmp_path, variant):
    folder = fixtures[variant]
    exported = export_reference(load_pretrained(folder), tmp_path / "out")
    assert json.loads((exported / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    want, got = read_tensors(folder), read_tensors(exported)
    assert want.keys() == got.keys()
    for name in want:
        assert want[name].dtype == got[name].dtype and torch.equal(want[name], got[name]), name


def test_project_save_of_an_imported_model(fixtures, tmp_path):
    """Saving writes the project's format; a plain transformers reload of it computes the same function, or
    refuses when the architecture cannot hold the MLPs (non-gated); exporting the save gives the original."""
    ids = _ids()
    gated = load_pretrained(fixtures["llama"], dtype=torch.float32)
    gated.save_pretrained(tmp_path / "gated")
    saved = json.loads((tmp_path / "gated" / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved["hidden_act"] == "relu" and "sparseffn" in saved
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "gated", dtype=torch.float32)
    assert torch.allclose(_logits(plain, ids), _logits(gated, ids), rtol=0, atol=1e-5)

    biased = load_pretrained(fixtures["llama-bias-untied"], dtype=torch.float32)  # LlamaMLP has mlp_bias
    biased.save_pretrained(tmp_path / "biased")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "biased", dtype=torch.float32)
    assert torch.allclose(_logits(plain, ids), _logits(biased, ids), rtol=0, atol=1e-5)
    qwen = load_pretrained(fixtures["qwen2-bias"], dtype=torch.float32)  # Qwen2MLP has no biases: refused
    qwen.save_pretrained(tmp_path / "qwen")
    with pytest.raises(KeyError, match="load_pretrained"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "qwen")
    assert torch.equal(_logits(load_pretrained(tmp_path / "qwen"), ids), _logits(qwen, ids))

    nongated = load_pretrained(fixtures["llama-nongated-resized"], dtype=torch.float32)
    nongated.save_pretrained(tmp_path / "nongated")
    with pytest.raises(KeyError, match="load_pretrained"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "nongated")
    reloaded = load_pretrained(tmp_path / "nongated")
    assert torch.equal(_logits(reloaded, ids), _logits(nongated, ids))
    with pytest.raises(ValueError, match="structure"):
        unsparsify_(reloaded)
    exported = export_reference(reloaded, tmp_path / "back")
    original = json.loads((fixtures["llama-nongated-resized"] / "config.json").read_text())
    assert json.loads((exported / "config.json").read_text()) == {**original, "torch_dtype": "float32"}
    want = read_tensors(fixtures["llama-nongated-resized"])
    got = read_tensors(exported)
    assert all(torch.equal(want[k].float(), got[k]) for k in want) and want.keys() == got.keys()


def test_export_of_a_project_model_reads_back(tmp_path):
    """A model trained with sparseffn (no reference record) exports to a config the reference reads."""
    from sparseffn import build_model

    model = build_model("tiny", SparsityConfig(l1_coeff=1e-3), num_hidden_layers=2, hidden_size=64,
                        intermediate_size=96, num_attention_heads=2, vocab_size=300, seed=0)
    exported = export_reference(model, tmp_path / "ref")
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "llama_sparse_relu" and config["sparsity_l1_coeff"] == 1e-3
    assert config["rope_theta"] == 1e5 and "rope_parameters" not in config and config["intermediate_size"] == 96
    ids = _ids(vocab=300)
    assert torch.allclose(reference_logits(exported, ids), _logits(model, ids), rtol=0, atol=1e-4)
    assert torch.equal(_logits(load_pretrained(exported), ids), _logits(model, ids))
    sparse_mlps(model)[0].set_threshold_(0.1)
    with pytest.raises(ValueError, match="non-zero thresholds"):
        export_reference(model, tmp_path / "refused")


def _edit(folder, tmp_path, edit):
    """A copy of a single-file fixture with its tensors edited by edit(dict)."""
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "tensor model.layers.1.mlp.up_proj.weight is missing"),
    (lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
     "tensor model.layers.0.mlp.extra.weight is in the checkpoint but not in the model"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 159, dtype=torch.bfloat16)}),
     r"tensor model.layers.0.mlp.down_proj.weight has shape \[64, 159\], the config implies \[64, 160\]"),
])
def test_tensor_errors_name_the_tensor(fixtures, tmp_path, edit, message):
    folder = _edit(fixtures["llama"], tmp_path, edit)
    with pytest.raises(ValueError, match=message) as info:
        load_pretrained(folder)
    assert "\n" not in str(info.value)


def test_config_errors(fixtures, tmp_path):
    import shutil

    folder = tmp_path / "c"
    shutil.copytree(fixtures["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sparsity_use_hybrid_kernel": True}))
    with pytest.raises(NotImplementedError, match="sparsity_use_hybrid_kernel"):
        load_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mistral_sparse_relu"}))
    with pytest.raises(NotImplementedError, match="base 'mistral'"):
        load_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_pretrained(folder)


def test_hub_ids_go_through_transformers_cache_and_formats_are_told_apart(fixtures, tmp_path):
    from sparseffn.models import checkpoint_format

    with pytest.raises(OSError):  # not cached here, and local_files_only forbids the download
        load_pretrained("SakanaAI/SparseLM2B", local_files_only=True)
    with pytest.raises(FileNotFoundError, match="is not a directory with a config.json"):
        load_pretrained(tmp_path / "SparseLM2B")
    assert checkpoint_format(fixtures["qwen2-bias"]) == "reference"
    load_pretrained(fixtures["llama"]).save_pretrained(tmp_path / "project")
    assert checkpoint_format(tmp_path / "project") == "sparseffn"
    unsparsify_(load_pretrained(fixtures["llama"])).save_pretrained(tmp_path / "plain")
    assert checkpoint_format(tmp_path / "plain") == "dense"


def test_fixture_config_is_what_the_spec_says():
    config = fixture_config(FixtureSpec(gated=False, new_intermediate_size=96, bias=True))
    assert config["sparsity_gated_mlp"] is False and config["sparsity_new_intermediate_size"] == 96
    assert config["intermediate_size"] == 160 and config["mlp_bias"] is True and config["hidden_act"] == "silu"
    paper = FixtureSpec.paper("2b")
    assert (paper.hidden_size, paper.intermediate_size, paper.num_hidden_layers, paper.vocab_size) == (
        2048, 5632, 38, 49152)
    with pytest.raises(ValueError, match="shape must be one of"):
        FixtureSpec.paper("3b")
    with pytest.raises(ValueError, match="base must be one of"):
        FixtureSpec(base="mistral")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the sparse kernels need a CUDA GPU")
@pytest.mark.parametrize("gated", [True, False])
def test_gpu_sparse_kernels_on_an_imported_checkpoint(tmp_path, gated):
    """An imported fixture in bf16 on the GPU: the sparse kernels (forced) give the dense path's logits
    within bf16 rounding, and captured decode steps give the tokens of the all-eager loop."""
    spec = FixtureSpec(gated=gated, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=8, vocab_size=1024)
    model = load_pretrained(write_fixture(tmp_path / "ck", spec), device="cuda")
    assert model.dtype == torch.bfloat16
    ids = _ids(vocab=1024, batch=4, length=256).cuda()
    reference = reference_logits(tmp_path / "ck", ids.cpu()).cuda()
    for mode in ("dense", "sparse"):
        for m in sparse_mlps(model):
            m.mode = mode
        logits = _logits(model, ids)
        err = float((logits - reference).norm() / reference.norm())
        assert err <= 2e-2, (mode, err)
    fuse_non_mlp_(model)  # fused RMSNorm / RoPE kernels around the sparse MLPs
    err = float((_logits(model, ids) - reference).norm() / reference.norm())
    assert err <= 2e-2, ("fused", err)
    for m in sparse_mlps(model):
        m.mode = "auto"
    prompt = ids[:1, :24]
    eager = CapturedDecoder(model, engine="hf", batch_size=1, max_length=64, eager_steps=100).generate(prompt, 24)
    captured = CapturedDecoder(model, engine="hf", batch_size=1, max_length=64, eager_steps=3).generate(prompt, 24)
    assert torch.equal(eager, captured)
