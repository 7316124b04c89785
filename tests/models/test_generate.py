"""CapturedDecoder: greedy generation into a static cache, each decode step replayed from a CUDA graph."""

import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import sparseffn
from sparseffn.models.generate import CapturedDecoder


def _model(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()


def test_eager_steps_match_hugging_face_greedy_generate():
    model = _model()
    sparseffn.sparsify_(model, sparseffn.SparsityConfig())
    prompt = torch.randint(128, (2, 7), generator=torch.Generator().manual_seed(1))
    want = model.generate(prompt, max_new_tokens=9, do_sample=False, attention_mask=torch.ones_like(prompt))
    decoder = CapturedDecoder(model, batch_size=2, max_length=32, eager_steps=100)
    got = decoder.generate(prompt, max_new_tokens=9)
    assert torch.equal(got, want)
    assert torch.equal(decoder.generate(prompt, max_new_tokens=9), want)  # the cache is reset between calls


@pytest.mark.parametrize("compile", [False, True])
def test_a_deleted_decoder_frees_its_cache_without_the_garbage_collector(compile):
    """No reference cycle through the decoder: its static cache (and on CUDA its graph's pool) goes
    when the last reference does, not whenever the collector runs."""
    import gc
    import weakref

    model = _model()
    decoder = CapturedDecoder(model, batch_size=1, max_length=16, eager_steps=100, compile=compile)
    if not compile:
        decoder.generate(torch.zeros(1, 3, dtype=torch.long), 4)
    refs = [weakref.ref(decoder), weakref.ref(decoder.cache)]
    gc.disable()
    try:
        del decoder
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


def test_arguments_are_checked():
    model = _model()
    decoder = CapturedDecoder(model, batch_size=1, max_length=16, eager_steps=1)
    with pytest.raises(ValueError, match="batch"):
        decoder.generate(torch.zeros(2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="must fit max_length"):
        decoder.generate(torch.zeros(1, 10, dtype=torch.long), 7)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        decoder.generate(torch.zeros(1, 3, dtype=torch.long), 5)  # 4 steps after 1 eager one: capture
    with pytest.raises(ValueError, match="positive int"):
        CapturedDecoder(model, batch_size=0, max_length=16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["auto", "sparse"])
def test_gpu_captured_steps_match_eager_steps(mode):
    """A sparsified model in auto mode and with the sparse kernels forced (the decode kernels then run
    inside the captured step): the replays give the tokens of the all-eager loop."""
    model = _model().cuda().to(torch.bfloat16)
    sparseffn.sparsify_(model, sparseffn.SparsityConfig(mode=mode))
    prompt = torch.randint(128, (1, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    eager = CapturedDecoder(model, batch_size=1, max_length=64, eager_steps=100).generate(prompt, 30)
    captured = CapturedDecoder(model, batch_size=1, max_length=64, eager_steps=5).generate(prompt, 30)
    assert torch.equal(eager, captured)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_captured_steps_match_eager_steps():
    """compile=True: the decode step's forward goes through torch.compile (the sparse layers' auto
    dispatch traced into it), then into the graph; the replays give the tokens of the compiled steps
    run one by one (Inductor's fused kernels round as they like, so uncompiled steps may differ)."""
    model = _model().cuda().to(torch.bfloat16)
    sparseffn.sparsify_(model, sparseffn.SparsityConfig(mode="auto"))
    prompt = torch.randint(128, (1, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    stepped = CapturedDecoder(model, batch_size=1, max_length=64, eager_steps=100, compile=True).generate(prompt, 30)
    captured = CapturedDecoder(model, batch_size=1, max_length=64, compile=True).generate(prompt, 30)
    assert torch.equal(stepped, captured)


_FRESH_PROCESS_CAPTURE = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import sparseffn
from sparseffn.models import calibrate_thresholds, sparse_layers
from sparseffn.models.generate import CapturedDecoder
from sparseffn.ops.sparse_mlp import as_captured

torch.manual_seed(0)
config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=16,
                     num_key_value_heads=4, vocab_size=256)
model = LlamaForCausalLM(config).cuda().to(torch.bfloat16).eval()
sparseffn.sparsify_(model, sparseffn.SparsityConfig())
calibrate_thresholds(model, [torch.randint(256, (4, 80), device="cuda")], 30)
layers = sparse_layers(model)
for layer in layers:
    layer.expected_nnz = 30.0  # auto mode decides from this hint (no activity to measure first)
for batch in (1, 4):  # the decode kernels' variants for 1 and for 3-16 tokens, each loaded first here
    prompt = torch.randint(256, (batch, 80), device="cuda")  # > 64 tokens: the prefill never runs as captured
    captured = CapturedDecoder(model, batch_size=batch, max_length=128, eager_steps=1).generate(prompt, 24)
    decisions = {(layer.last_decision.mode, layer.last_decision.reason.split(":")[0]) for layer in layers}
    assert decisions == {("sparse", "decode")}, decisions
    with as_captured():
        stepped = CapturedDecoder(model, batch_size=batch, max_length=128, eager_steps=100).generate(prompt, 24)
    assert torch.equal(captured, stepped), batch
print("captured in a fresh process")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_capture_in_a_fresh_process_loads_the_decode_kernels_first():
    """Auto mode takes the decode kernels only under capture; a GPU module cannot load while a stream
    captures, so the last eager step runs as captured first. In a fresh process (no kernel loaded yet),
    the captured tokens equal those of every step run eagerly as captured."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _FRESH_PROCESS_CAPTURE], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "captured in a fresh process" in result.stdout
