"""DecodeEngine on the GPU at a realistic width: the replayed CUDA graph picks exactly the tokens the
same engine picks eagerly (teacher-forced), dense and sparse MLPs, CUDA-core (1) and tl.dot (16) rows;
and its logits stay within twice the bf16 Hugging Face forward's error of the fp32 model; with every kernel
launched as a programmatic dependent (config.pdl) it gives the same bits; CapturedDecoder's default takes
it on Hopper."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

import sparseffn
from sparseffn.models.decode_step import DecodeEngine
from sparseffn.models.generate import CapturedDecoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (captures CUDA graphs)")

PROMPT, NEW = 40, 12


def _model(mode):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=3, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=512, hidden_act="relu", max_position_embeddings=128)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    sparseffn.sparsify_(model, sparseffn.SparsityConfig())
    for layer in sparseffn.models.sparse_layers(model):
        layer.mode = mode
        layer.set_threshold_(0.03)  # a non-zero θ (about half the units fire on these random weights)
    return model


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("mode", ["sparse", "dense"])
@torch.no_grad()
def test_replayed_step_picks_the_eager_engines_tokens(mode, batch):
    model = _model(mode)
    prompt = torch.randint(512, (batch, PROMPT), device="cuda", generator=torch.Generator("cuda").manual_seed(batch))
    decoder = CapturedDecoder(model, batch_size=batch, max_length=PROMPT + NEW, eager_steps=1, engine="fused")
    tokens = decoder.generate(prompt, NEW)
    assert {layer.last_decision.mode for layer in sparseffn.models.sparse_layers(model)} == {mode}
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + NEW)
    engine = DecodeEngine(model, batch_size=batch, max_length=PROMPT + NEW)
    model(input_ids=prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(PROMPT, device="cuda"))
    engine.attach(cache, None)
    zeros = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    for t in range(PROMPT, PROMPT + NEW - 1):
        picked = engine.logits(tokens[:, t:t + 1], torch.tensor([t], device="cuda"), zeros).argmax(-1)
        assert torch.equal(picked, tokens[:, t + 1]), f"step {t - PROMPT}"


@torch.no_grad()
def test_logits_within_twice_torch_error_of_fp32():
    model = _model("sparse")
    ids = torch.randint(512, (2, PROMPT + 4), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + 4)
    engine = DecodeEngine(model, batch_size=2, max_length=PROMPT + 4)
    model(input_ids=ids[:, :PROMPT], past_key_values=cache, use_cache=True,
          cache_position=torch.arange(PROMPT, device="cuda"))
    engine.attach(cache, None)
    zeros = torch.zeros(2, 1, dtype=torch.long, device="cuda")
    got = torch.stack([engine.logits(ids[:, t:t + 1], torch.tensor([t], device="cuda"), zeros).float()
                       for t in range(PROMPT, PROMPT + 4)], 1)
    for layer in sparseffn.models.sparse_layers(model):
        layer.mode = "dense"  # the floor: torch's own bf16 layer (the engine's paths were fixed at attach)
    hf = model(input_ids=ids).logits[:, PROMPT:].float()
    ref_model = _model("dense").float()  # the same weights (same seed), fp32, dense relu(g - θ) * u
    ref = ref_model(input_ids=ids).logits[:, PROMPT:].float()
    torch_err = (hf - ref).abs().max()
    assert (got - ref).abs().max() <= 2 * torch_err + 1e-3


def _all_pdl(monkeypatch):
    """Every engine kernel's default config with pdl on (the config functions its launchers call)."""
    import dataclasses

    from sparseffn.kernels import decode_attention, decode_attn_proj, decode_mlp

    for module, name in ((decode_mlp, "default_config"), (decode_attn_proj, "projection_config"),
                         (decode_attention, "attention_config")):
        make = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _make=make, **k: dataclasses.replace(_make(*a, **k), pdl=True))


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("mode", ["sparse", "dense"])
@torch.no_grad()
def test_programmatic_dependent_launch_changes_no_bit(mode, batch, monkeypatch):
    """The engine's kernels launched as programmatic dependents (config.pdl) replay the same tokens and
    give the same logits as launched one after the other. The folded one-sequence MLPs are off here: their
    atomic adds have no fixed order, so the last bits of their sums may differ from run to run, PDL or not."""
    monkeypatch.setattr(DecodeEngine, "_folds", lambda self, i: False)
    model = _model(mode)
    ids = torch.randint(512, (batch, PROMPT + 4), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    runs = []
    for pdl in (False, True):
        if pdl:
            _all_pdl(monkeypatch)
        tokens = CapturedDecoder(model, batch_size=batch, max_length=PROMPT + NEW, eager_steps=1,
                                 engine="fused").generate(ids[:, :PROMPT], NEW)
        cache = StaticCache(config=model.config, max_cache_len=PROMPT + 4)
        engine = DecodeEngine(model, batch_size=batch, max_length=PROMPT + 4)
        model(input_ids=ids[:, :PROMPT], past_key_values=cache, use_cache=True,
              cache_position=torch.arange(PROMPT, device="cuda"))
        engine.attach(cache, None)
        zeros = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        logits = [engine.logits(ids[:, t:t + 1], torch.tensor([t], device="cuda"), zeros)
                  for t in range(PROMPT, PROMPT + 4)]
        runs.append((tokens, torch.stack(logits)))
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])


@torch.no_grad()
def test_auto_takes_the_engine_on_hopper():
    """CapturedDecoder's default (engine="auto") runs the fused engine on an H100 / H200 at batch <= 16,
    the same tokens as engine="fused"; elsewhere the Hugging Face step, saying why."""
    model = _model("sparse")
    prompt = torch.randint(512, (2, PROMPT), device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    auto = CapturedDecoder(model, batch_size=2, max_length=PROMPT + NEW, eager_steps=1)
    if torch.cuda.get_device_capability() != (9, 0):
        assert auto.engine == "hf" and "Hopper" in auto.engine_reason
        return
    assert auto.engine == "fused"
    fused = CapturedDecoder(model, batch_size=2, max_length=PROMPT + NEW, eager_steps=1, engine="fused")
    assert torch.equal(auto.generate(prompt, NEW), fused.generate(prompt, NEW))
