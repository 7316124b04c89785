"""CapturedDecoder: generation into a static cache, each decode step replayed from a CUDA graph; greedy
or sampled tokens, end tokens."""

import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import sparseffn
from sparseffn.models.generate import CapturedDecoder, Sampling, pick_tokens


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
    assert decoder._greedy is not None  # two sequences: the pick and advance in one launch (ops.greedy_pick)
    assert torch.equal(decoder.generate(prompt, max_new_tokens=9), want)  # the cache is reset between calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: off CUDA every step runs eagerly")
def test_off_cuda_every_step_runs_eagerly_with_the_same_tokens():
    """The README's `CapturedDecoder(model, batch_size=1, max_length=...).generate(ids, n)` on a CPU, with
    far more new tokens than eager_steps: Hugging Face's greedy tokens, greedy and sampled alike equal to
    a decoder told to run every step eagerly."""
    model = _model()
    sparseffn.sparsify_(model, sparseffn.SparsityConfig())
    prompt = torch.randint(128, (1, 5), generator=torch.Generator().manual_seed(3))
    want = model.generate(prompt, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(prompt))
    decoder = CapturedDecoder(model, batch_size=1, max_length=40)  # eager_steps=5 < 24
    assert torch.equal(decoder.generate(prompt, 24), want)
    assert decoder._greedy is None  # one sequence: torch's argmax, not the one-launch pick
    sampled = []
    for eager_steps in (2, 100):
        torch.manual_seed(7)
        sampler = CapturedDecoder(model, batch_size=1, max_length=40, eager_steps=eager_steps, do_sample=True)
        sampled.append(sampler.generate(prompt, 24))
    assert sampled[0].shape == (1, 29) and torch.equal(sampled[0], sampled[1])


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


def _reference_probs(logits, temperature, top_k, top_p):
    """softmax(logits / T) over the top_k logits, then over the fewest most likely tokens reaching top_p."""
    scores = logits / temperature
    if top_k:
        scores = torch.where(scores >= scores.topk(top_k).values[-1], scores, torch.tensor(float("-inf")))
    probs = scores.softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for i in order.tolist():
        if mass >= top_p:
            break
        keep[i], mass = True, mass + probs[i].item()
    return torch.where(keep, probs, 0.0) / probs[keep].sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.6),
                                                        (0.8, 4, 0.75)])
def test_sampled_tokens_follow_the_filtered_softmax(temperature, top_k, top_p):
    """pick_tokens draws each row from softmax(logits / T) after the top-k and top-p filters: the
    frequencies over 40,000 identical rows match the reference probabilities within 4 standard errors
    (and the filtered-out tokens never appear)."""
    logits = torch.tensor([2.0, 1.5, 1.4, 0.3, -0.5, -2.0])
    torch.manual_seed(0)
    n = 40_000
    tokens = pick_tokens(logits.expand(n, -1).clone(), Sampling(temperature, top_k, top_p))
    freq = torch.bincount(tokens, minlength=6).double() / n
    want = _reference_probs(logits.double(), temperature, top_k, top_p)
    assert torch.equal(freq == 0, want == 0)
    assert torch.all((freq - want).abs() <= 4 * (want * (1 - want) / n).sqrt() + 1e-12), (freq, want)
    assert torch.equal(pick_tokens(logits[None], None), torch.tensor([0]))  # greedy: the argmax


def test_sampling_with_one_candidate_is_greedy():
    model = _model()
    prompt = torch.randint(128, (2, 7), generator=torch.Generator().manual_seed(1))
    greedy = CapturedDecoder(model, batch_size=2, max_length=32, eager_steps=100).generate(prompt, 9)
    for kwargs in (dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, temperature=3.0)):
        sampled = CapturedDecoder(model, batch_size=2, max_length=32, eager_steps=100, do_sample=True, **kwargs)
        assert torch.equal(sampled.generate(prompt, 9), greedy), kwargs


@pytest.mark.parametrize("as_list", [False, True])
def test_end_tokens_pad_and_stop_as_hugging_face_generate(as_list):
    """With eos_token_id a sequence gets pad_token_id after its end token and generation stops once
    every sequence has ended: the same tokens, and the same length, as Hugging Face's greedy generate."""
    model = _model()
    sparseffn.sparsify_(model, sparseffn.SparsityConfig())
    prompt = torch.randint(128, (3, 7), generator=torch.Generator().manual_seed(1))
    free = CapturedDecoder(model, batch_size=3, max_length=40, eager_steps=100).generate(prompt, 20)
    eos = int(free[0, 7 + 3])  # the first sequence ends at its 4th new token (the others maybe later)
    want = model.generate(prompt, max_new_tokens=20, do_sample=False, attention_mask=torch.ones_like(prompt),
                          eos_token_id=[eos, 127] if as_list else eos, pad_token_id=5)
    decoder = CapturedDecoder(model, batch_size=3, max_length=40, eager_steps=100,
                              eos_token_id=[eos, 127] if as_list else eos, pad_token_id=5)
    got = decoder.generate(prompt, 20)
    assert torch.equal(got, want)
    assert torch.equal(decoder.generate(prompt, 20), want)  # the ended flags are reset between calls
    assert (got[0, 11:] == 5).all()
    # one sequence: generation stops after its end token
    want = model.generate(prompt[:1], max_new_tokens=20, do_sample=False, attention_mask=torch.ones_like(prompt[:1]),
                          eos_token_id=eos, pad_token_id=5)
    alone = CapturedDecoder(model, batch_size=1, max_length=40, eager_steps=100, eos_token_id=eos, pad_token_id=5)
    assert torch.equal(alone.generate(prompt[:1], 20), want) and want.shape == (1, 11)


def test_left_padded_prompts_generate_as_hugging_face_and_as_alone():
    """Prompts of different lengths, padded on the left with an attention mask: the same tokens as
    Hugging Face's greedy generate, and each row as that prompt generates alone (unpadded); an all-ones
    mask is the unpadded call."""
    model = _model()
    sparseffn.sparsify_(model, sparseffn.SparsityConfig())
    prompt = torch.randint(1, 128, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    mask[0, :4], mask[1, :1] = 0, 0
    prompt = prompt.masked_fill(mask == 0, 0)
    want = model.generate(prompt, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    decoder = CapturedDecoder(model, batch_size=3, max_length=40, eager_steps=100)
    assert torch.equal(decoder.generate(prompt, 10, attention_mask=mask), want)
    alone = CapturedDecoder(model, batch_size=1, max_length=40, eager_steps=100).generate(prompt[:1, 4:], 10)
    assert torch.equal(want[:1, 4:], alone)
    unpadded = decoder.generate(prompt, 10)
    assert torch.equal(decoder.generate(prompt, 10, attention_mask=torch.ones_like(mask)), unpadded)


def test_arguments_are_checked():
    model = _model()
    decoder = CapturedDecoder(model, batch_size=1, max_length=16, eager_steps=1)
    with pytest.raises(ValueError, match="batch"):
        decoder.generate(torch.zeros(2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="must fit max_length"):
        decoder.generate(torch.zeros(1, 10, dtype=torch.long), 7)
    with pytest.raises(ValueError, match="positive int"):
        CapturedDecoder(model, batch_size=0, max_length=16)
    for kwargs, match in ((dict(do_sample=True, temperature=0.0), "temperature must be a positive finite"),
                          (dict(do_sample=True, top_k=-1), "top_k must be an int >= 0"),
                          (dict(do_sample=True, top_p=0.0), r"top_p must be in \(0, 1\]"),
                          (dict(eos_token_id=128), r"eos_token_id must be None, a token id .* \[0, 128\)"),
                          (dict(eos_token_id=[]), "eos_token_id must be None, a token id or a non-empty list"),
                          (dict(eos_token_id=2, pad_token_id=-1), "pad_token_id must be None, a token id"),
                          (dict(eos_token_id=2, pad_token_id=[1, 2]), "pad_token_id must be one token id")):
        with pytest.raises(ValueError, match=match):
            CapturedDecoder(model, batch_size=1, max_length=16, **kwargs)
    ids = torch.zeros(1, 3, dtype=torch.long)
    for mask, match in ((torch.ones(1, 4, dtype=torch.long), "attention_mask must be a tensor shaped like input_ids"),
                        (torch.tensor([[0, 2, 1]]), "must hold 0 .* and 1 .* only"),
                        (torch.tensor([[1, 1, 0]]), "must pad on the left"),
                        (torch.tensor([[1, 0, 1]]), "must pad on the left")):
        with pytest.raises(ValueError, match=match):
            decoder.generate(ids, 1, attention_mask=mask)
    with pytest.raises(TypeError, match="do_sample must be a bool"):
        CapturedDecoder(model, batch_size=1, max_length=16, do_sample=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["auto", "sparse"])
def test_gpu_captured_steps_match_eager_steps(mode):
    """A sparsified model in auto mode and with the sparse kernels forced (the decode kernels then run
    inside the captured step): the replays give the tokens of the all-eager loop."""
    model = _model().cuda().to(torch.bfloat16)
    sparseffn.sparsify_(model, sparseffn.SparsityConfig(mode=mode))
    prompt = torch.randint(128, (1, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    eager = CapturedDecoder(model, engine="hf", batch_size=1, max_length=64, eager_steps=100).generate(prompt, 30)
    captured = CapturedDecoder(model, engine="hf", batch_size=1, max_length=64, eager_steps=5).generate(prompt, 30)
    assert torch.equal(eager, captured)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_captured_steps_match_eager_steps():
    """compile=True: the decode step's forward goes through torch.compile (the sparse layers' auto
    dispatch traced into it), then into the graph; the replays give the tokens of the compiled steps
    run one by one (Inductor's fused kernels round as they like, so uncompiled steps may differ)."""
    model = _model().cuda().to(torch.bfloat16)
    sparseffn.sparsify_(model, sparseffn.SparsityConfig(mode="auto"))
    prompt = torch.randint(128, (1, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    stepped = CapturedDecoder(model, engine="hf", batch_size=1, max_length=64, eager_steps=100,
                              compile=True).generate(prompt, 30)
    captured = CapturedDecoder(model, engine="hf", batch_size=1, max_length=64, compile=True).generate(prompt, 30)
    assert torch.equal(stepped, captured)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_captured_steps_stop_at_end_tokens_and_sample():
    """End tokens inside the replayed step: the captured run pads, stops and cuts as the all-eager one
    (the end token is the one greedy decoding emits at step 40, or its first occurrence); sampled runs
    draw fresh tokens on every replay (two calls differ). (Top-k 1 against greedy is a CPU test: bf16
    logits tie often enough that top-k keeps two tokens.)"""
    model = _model().cuda().to(torch.bfloat16)
    sparseffn.sparsify_(model, sparseffn.SparsityConfig(mode="auto"))
    prompt = torch.randint(128, (1, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    free = CapturedDecoder(model, engine="hf", batch_size=1, max_length=96, eager_steps=100).generate(prompt, 60)
    eos = int(free[0, 12 + 40])
    end = int((free[0, 12:] == eos).int().argmax())  # its first occurrence, at or before step 40
    kwargs = dict(batch_size=1, max_length=96, eos_token_id=eos, pad_token_id=0)
    eager = CapturedDecoder(model, engine="hf", eager_steps=100, **kwargs).generate(prompt, 60)
    captured = CapturedDecoder(model, engine="hf", **kwargs).generate(prompt, 60)
    assert torch.equal(eager, captured) and captured.shape == (1, 12 + end + 1)
    sampler = CapturedDecoder(model, engine="hf", batch_size=1, max_length=96, do_sample=True, temperature=2.0)
    first, second = sampler.generate(prompt, 60), sampler.generate(prompt, 60)
    assert not torch.equal(first[:, 20:], second[:, 20:]) and int(first.max()) < 128


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_captured_left_padded_batch_matches_eager_steps():
    """A left-padded batch replays its own captured step (the mask and shifts are static tensors): the
    tokens of the all-eager loop, and the unpadded step of the same decoder is untouched."""
    model = _model().cuda().to(torch.bfloat16)
    sparseffn.sparsify_(model, sparseffn.SparsityConfig(mode="auto"))
    prompt = torch.randint(1, 128, (2, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    mask = torch.ones_like(prompt)
    mask[0, :5] = 0
    eager = CapturedDecoder(model, engine="hf", batch_size=2, max_length=64,
                            eager_steps=100).generate(prompt, 30, attention_mask=mask)
    decoder = CapturedDecoder(model, engine="hf", batch_size=2, max_length=64)
    plain = decoder.generate(prompt, 30)
    assert torch.equal(decoder.generate(prompt, 30, attention_mask=mask), eager)
    assert torch.equal(decoder.generate(prompt, 30), plain)


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
    captured = CapturedDecoder(model, engine="hf", batch_size=batch, max_length=128, eager_steps=1).generate(prompt, 24)
    decisions = {(layer.last_decision.mode, layer.last_decision.reason.split(":")[0]) for layer in layers}
    assert decisions == {("sparse", "decode")}, decisions
    with as_captured():
        stepped = CapturedDecoder(model, engine="hf", batch_size=batch, max_length=128,
                                  eager_steps=100).generate(prompt, 24)
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
