"""DecodeEngine (CapturedDecoder(engine="fused")): Hugging Face's greedy tokens, logits within twice
bf16 torch's error of an fp32 reference, per-layer paths from ops/decide.py, refusals, engine="auto".

The kernels run under the interpreter here (slow: tiny models, few steps); the GPU test captures."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import StaticCache

import sparseffn
from sparseffn.models import decode_step
from sparseffn.models.decode_step import DecodeEngine, Unsupported
from sparseffn.models.generate import CapturedDecoder
from sparseffn.ops.sparse_mlp import as_captured, choose_mode
from tests.models.families import family_lm
from tests.models.hf import tiny_lm, token_ids

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _model(arch, *, sparse, act="relu", threshold=False, dtype=torch.bfloat16):
    model = tiny_lm(arch, act=act, dtype=dtype).to(DEVICE)
    if sparse:
        sparseffn.sparsify_(model, sparseffn.SparsityConfig())
        for i, layer in enumerate(sparseffn.models.sparse_layers(model)):
            layer.mode = "sparse"
            if threshold:
                layer.set_threshold_(0.02 * (i + 1))
    return model


def _prompt(batch, length, padded):
    ids = token_ids(batch, length).to(DEVICE)
    mask = torch.ones_like(ids)
    if padded:
        for row in range(1, batch):
            mask[row, :2 * row] = 0  # row r padded by 2r tokens
            ids[row, :2 * row] = 0
    return ids, mask


@pytest.mark.parametrize("arch,sparse,act,batch", [("llama", True, "relu", 3), ("qwen2", False, "silu", 1)])
def test_greedy_tokens_equal_hugging_face(arch, sparse, act, batch):
    """Sparsified Llama (sparse kernels, left-padded batch of 3) and a dense Qwen2 (silu, q/k/v biases):
    the fused engine takes every step after the prompt and continues as Hugging Face's generate."""
    model = _model(arch, sparse=sparse, act=act)
    ids, mask = _prompt(batch, 6, padded=batch > 1)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    decoder = CapturedDecoder(model, batch_size=batch, max_length=16, eager_steps=1, engine="fused")
    assert torch.equal(decoder.generate(ids, 3, attention_mask=mask), want)
    if sparse:
        assert {layer.last_decision.mode for layer in sparseffn.models.sparse_layers(model)} == {"sparse"}


def _fp32_logits(model, ids):
    """Logits of every position of ids by an fp32 copy of the model (its SparseMLPs dense: the same
    function, relu(g - θ) * u)."""
    ref = copy.deepcopy(model).float()
    for layer in sparseffn.models.sparse_layers(ref):
        layer.mode = "dense"
    with torch.no_grad():
        return ref(input_ids=ids).logits[0].float()


@pytest.mark.parametrize("mode,deterministic", [("sparse", False), ("sparse", True), ("dense", False)],
                         ids=["sparse_folded", "sparse_deterministic", "dense"])
def test_step_logits_within_twice_torch_error_of_fp32(mode, deterministic):
    """Two engine steps after a prompt, teacher-forced: the engine's bf16 logits are within twice the
    error of the Hugging Face bf16 forward against the fp32 model (thresholded SparseMLP layers). At one
    sequence the sparse layers are folded, the last one's sum added by the final norm (every sum left pending
    is zero again after the step), unless torch.use_deterministic_algorithms is on."""
    model = _model("llama", sparse=True, threshold=True)
    for layer in sparseffn.models.sparse_layers(model):
        layer.mode = mode
    ids = token_ids(1, 8).to(DEVICE)
    p = 6
    cache = StaticCache(config=model.config, max_cache_len=12)
    engine = DecodeEngine(model, batch_size=1, max_length=12)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        with torch.no_grad():
            model(input_ids=ids[:, :p], past_key_values=cache, use_cache=True,
                  cache_position=torch.arange(p, device=DEVICE))
            engine.attach(cache, None)
            got = torch.stack([engine.logits(ids[:, t:t + 1], torch.tensor([t], device=DEVICE),
                                             torch.zeros(1, 1, dtype=torch.long, device=DEVICE))[0].float()
                               for t in (p, p + 1)])
            folded = [engine._folds(i) for i in range(len(engine.layers))]
            assert torch.utils.deterministic.fill_uninitialized_memory  # the step's own no-fill is undone
    finally:
        torch.use_deterministic_algorithms(was)
    assert folded == [mode == "sparse" and not deterministic] * len(engine.layers)
    assert not engine.pending.any()
    with torch.no_grad():
        assert {layer.last_decision.mode for layer in sparseffn.models.sparse_layers(model)} == {mode}
        for layer in sparseffn.models.sparse_layers(model):
            layer.mode = "dense"  # the floor: torch's own bf16 layer (the engine's paths were fixed at attach)
        hf = model(input_ids=ids).logits[0, p:p + 2].float()
    ref = _fp32_logits(model, ids)[p:p + 2]
    torch_err = (hf - ref).abs().max()
    assert torch_err > 0
    assert (got - ref).abs().max() <= 2 * torch_err + 1e-3


def test_plan_takes_auto_modes_decision_at_the_batch_size():
    """Auto mode's layers get decide's answer for a captured call of batch_size tokens (on CPU: dense,
    saying why), recorded as the layers record their own calls."""
    model = _model("llama", sparse=True)
    layers = sparseffn.models.sparse_layers(model)
    for layer in layers:
        layer.mode = "auto"
        layer.expected_nnz = 3.0
    engine = DecodeEngine(model, batch_size=4, max_length=16)
    with pytest.raises(RuntimeError, match="plans its MLP paths at its first attach"):
        engine.mlp_paths()
    engine.plan()
    assert engine.mlp_paths() == ["sparse" if step_layer.sparse else "dense" for step_layer in engine.layers]
    x = torch.empty(4, model.config.hidden_size, dtype=torch.bfloat16, device=DEVICE)
    for layer, step_layer in zip(layers, engine.layers):
        with as_captured():
            want = choose_mode(x, layer.up_proj.weight, mode="auto", expected_nnz=3.0, down_t_ready=True,
                               activity=layer.activity)
        assert layer.last_decision == want and step_layer.sparse == (want.mode == "sparse")
        assert layer.activity.last["decode"] == want.mode
    if DEVICE == "cpu":
        assert "never interprets kernels on CPU" in layers[0].last_decision.reason


def test_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="Llama-family models"):
        DecodeEngine(family_lm("gemma", "relu"), batch_size=1, max_length=16)
    mistral = tiny_lm("mistral", act="relu")
    mistral.config.sliding_window = 8
    with pytest.raises(ValueError, match="sliding_window 8 < max_length 16"):
        DecodeEngine(mistral, batch_size=1, max_length=16)
    gelu = tiny_lm("llama", act="gelu")
    with pytest.raises(ValueError, match="gated relu / silu MLP"):
        DecodeEngine(gelu, batch_size=1, max_length=16)
    contiguous = _model("llama", sparse=True)
    sparseffn.nn.sparse_mlp.contiguous_down_(contiguous)
    with pytest.raises(ValueError, match="stores down_proj.weight contiguous"):
        DecodeEngine(contiguous, batch_size=1, max_length=16).plan()
    model = tiny_lm("llama", act="relu")
    with pytest.raises(ValueError, match="engine must be one of"):
        CapturedDecoder(model, batch_size=1, max_length=16, engine="megakernel")
    with pytest.raises(ValueError, match="pick one"):
        CapturedDecoder(model, batch_size=1, max_length=16, engine="fused", compile=True)


def test_auto_takes_the_engine_where_its_step_was_measured_faster(monkeypatch):
    """engine="auto" (the default): the Hugging Face step off Hopper GPUs, with compile=True, above batch 16
    and for a model the engine refuses, saying why; the engine otherwise. Explicit engines stay as asked."""
    model = _model("llama", sparse=True)
    if DEVICE == "cpu":
        decoder = CapturedDecoder(model, batch_size=1, max_length=16)
        assert decoder.engine == "hf" and "timed on CUDA GPUs" in decoder.engine_reason
    monkeypatch.setattr(decode_step, "_device_refusal", lambda device: None)  # as on an H100 / H200
    decoder = CapturedDecoder(model, batch_size=1, max_length=16)
    assert decoder.engine == "fused" and decoder.engine_reason == "a llama model at batch 1 on a Hopper GPU"
    assert CapturedDecoder(model, batch_size=16, max_length=16).engine == "fused"
    assert CapturedDecoder(model, batch_size=1, max_length=16, engine="hf").engine == "hf"
    for kwargs, why in (({"batch_size": 17}, "batch 17 > 16"),
                        ({"batch_size": 1, "compile": True}, "compile=True compiles the Hugging Face forward")):
        decoder = CapturedDecoder(model, max_length=16, **kwargs)
        assert decoder.engine == "hf" and why in decoder.engine_reason
    hooked = _model("llama", sparse=False)
    hooked.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    hooked_norm = _model("llama", sparse=False)
    hooked_norm.model.norm.register_forward_pre_hook(lambda *args: None)
    refused = {"Llama-family models": family_lm("gemma", "relu"), "bf16 / fp16 models, this one is torch.float32":
               _model("llama", sparse=False, dtype=torch.float32), "layers.1.mlp has forward hooks": hooked,
               "norm has forward hooks": hooked_norm}
    for why, other in refused.items():
        decoder = CapturedDecoder(other, batch_size=1, max_length=16)
        assert decoder.engine == "hf" and why in decoder.engine_reason
        with pytest.raises(Unsupported, match=why.split(",")[0]):
            CapturedDecoder(other, batch_size=1, max_length=16, engine="fused")


def test_reads_the_models_own_weights_fused_norms_too():
    """Views, no copies: every weight the engine reads is the model's Parameter (after fuse_non_mlp_ as
    before); the rotary tables are the model's own cos / sin."""
    model = _model("llama", sparse=True)
    sparseffn.fuse_non_mlp_(model)
    engine = DecodeEngine(model, batch_size=2, max_length=16)
    for block, layer in zip(model.model.layers, engine.layers):
        attn, mlp = block.self_attn, block.mlp
        assert layer.wq is attn.q_proj.weight and layer.wo is attn.o_proj.weight
        assert layer.attn_norm is block.input_layernorm.weight and layer.mlp_norm is block.post_attention_layernorm.weight
        assert layer.gate is mlp.gate_proj.weight and layer.down is mlp.down_proj.weight
    assert engine.norm is model.model.norm.weight
    positions = torch.arange(16, device=DEVICE)[None]
    cos, sin = model.model.rotary_emb(torch.empty(0, dtype=torch.bfloat16, device=DEVICE), positions)
    assert torch.equal(engine.cos, cos[0]) and torch.equal(engine.sin, sin[0])
