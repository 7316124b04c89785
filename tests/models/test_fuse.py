"""fuse_non_mlp_ / unfuse_non_mlp_ on tiny Hugging Face models: same function, same state, reversible.

On CPU the fused kernels run under Triton's interpreter (tests/conftest.py). Every comparison of a
fused model with the plain one also checks that the fused ops really ran (call counters), so a
fusion that silently did nothing fails.
"""

import copy
import inspect
import warnings

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm

import sparseffn.nn.fused as fused_module
from sparseffn import sparsify_
from sparseffn.models import fuse_non_mlp_, sparse_mlps, unfuse_non_mlp_
from sparseffn.nn.fused import FusedRMSNorm, has_fused_rope
from tests.models.hf import tiny_lm, token_ids

pytestmark = pytest.mark.filterwarnings(  # triton's interpreter turns 1-element arrays into ints
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

GEN = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
CLASS_FORWARD, HF_ROPE = LlamaAttention.forward, modeling_llama.apply_rotary_pos_emb


@pytest.fixture
def calls(monkeypatch):
    """Counts of the fused ops the fused modules call (wrapping the names nn/fused.py uses)."""
    counts = {"rms_norm": 0, "apply_rope": 0}
    for name in counts:
        real = getattr(fused_module, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(fused_module, name, counting)
    return counts


def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits


def _close(a, b, tol=1e-5):
    return torch.allclose(a, b, rtol=tol, atol=tol * b.abs().max().item())


def test_fused_llama_has_the_same_logits_and_state(calls):
    plain = tiny_lm("llama")
    model = copy.deepcopy(plain)
    params = dict(model.named_parameters())
    state = model.state_dict()
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    config = model.config.to_dict()

    assert fuse_non_mlp_(model) is model
    fused_norms = [m for m in model.modules() if isinstance(m, FusedRMSNorm)]
    assert len(norms) == len(fused_norms) == 5  # 2 per layer + the final norm
    assert not any(isinstance(m, LlamaRMSNorm) for m in model.modules())
    assert all(has_fused_rope(layer.self_attn) for layer in model.model.layers)
    assert type(model.model.layers[0].self_attn) is LlamaAttention  # the class is untouched
    # nothing global changed
    assert LlamaAttention.forward is CLASS_FORWARD and modeling_llama.apply_rotary_pos_emb is HF_ROPE
    # same Parameters, same state dict (keys and storage), same config
    assert dict(model.named_parameters()) == params
    assert list(model.state_dict()) == list(state)
    assert all(model.state_dict()[k].data_ptr() == v.data_ptr() for k, v in state.items())
    assert model.config.to_dict() == config

    ids = token_ids()
    expect = _logits(plain, ids)
    got = _logits(model, ids)
    assert calls == {"rms_norm": 5, "apply_rope": 2}
    assert _close(got, expect), (got - expect).abs().max()


def test_fused_llama_gradients_match():
    plain = tiny_lm("llama")
    model = fuse_non_mlp_(copy.deepcopy(plain))
    ids = token_ids(length=16, seed=1)
    for m in (plain, model):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
    grads = {name: p.grad for name, p in plain.named_parameters()}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert _close(p.grad, grads[name], 1e-4), f"{name}: {(p.grad - grads[name]).abs().max():.3g}"


def test_generate_with_cache_gives_the_same_tokens(calls):
    plain = tiny_lm("llama")
    model = fuse_non_mlp_(copy.deepcopy(plain))
    ids = token_ids(batch=2, length=5, seed=3)
    kwargs = dict(attention_mask=torch.ones_like(ids), **GEN)
    expect = plain.generate(ids, use_cache=True, **kwargs)
    got = model.generate(ids, use_cache=True, **kwargs)
    assert calls["apply_rope"] == 2 * 8  # prefill + 7 cached steps, 2 layers each
    assert torch.equal(got, expect)
    assert torch.equal(model.generate(ids, use_cache=False, **kwargs), expect)
    assert not torch.equal(got[0, 5:], got[1, 5:])  # the two rows are really decoded apart


def test_left_padded_batch_positions():
    """Left padding gives per-row position ids, so cos / sin are [B, S, d], not broadcast."""
    plain = tiny_lm("llama")
    model = fuse_non_mlp_(copy.deepcopy(plain))
    ids = token_ids(batch=2, length=6, seed=4)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kwargs = dict(attention_mask=mask, **GEN)
    assert torch.equal(model.generate(ids, **kwargs), plain.generate(ids, **kwargs))


def test_unfuse_restores_modules_and_forwards():
    plain = tiny_lm("llama")
    model = copy.deepcopy(plain)
    norms = {name: m for name, m in model.named_modules() if isinstance(m, LlamaRMSNorm)}
    ids = token_ids()
    expect = _logits(model, ids)
    fuse_non_mlp_(model)
    with torch.no_grad():  # the fused model's weights are the ones the restored modules hold
        model.model.norm.weight.mul_(1.5)
    assert unfuse_non_mlp_(model) is model
    restored = {name: m for name, m in model.named_modules() if isinstance(m, LlamaRMSNorm)}
    assert restored.keys() == norms.keys() and all(restored[n] is norms[n] for n in norms)
    assert not any(isinstance(m, FusedRMSNorm) for m in model.modules())
    assert all("forward" not in vars(layer.self_attn) for layer in model.model.layers)
    assert list(model.state_dict()) == list(plain.state_dict())
    with torch.no_grad():
        model.model.norm.weight.div_(1.5)
    assert torch.equal(_logits(model, ids), expect)
    with pytest.raises(ValueError, match="nothing fused"):
        unfuse_non_mlp_(model)


def test_deepcopy_of_a_fused_model_unfuses_onto_its_own_weights():
    model = fuse_non_mlp_(tiny_lm("llama"))
    clone = copy.deepcopy(model)
    unfuse_non_mlp_(clone)
    clone_params = {id(p) for p in clone.parameters()}
    norms = [m for m in clone.modules() if isinstance(m, LlamaRMSNorm)]
    assert len(norms) == 5 and all(id(m.weight) in clone_params for m in norms)
    assert not any(id(p) in clone_params for p in model.parameters())
    ids = token_ids()
    assert _close(_logits(clone, ids), _logits(model, ids))


def test_sparsified_models_fuse_both_ways(calls):
    plain = sparsify_(tiny_lm("llama"))
    ids = token_ids()
    expect = _logits(plain, ids)
    sparse_then_fused = fuse_non_mlp_(copy.deepcopy(plain))
    fused_then_sparse = sparsify_(fuse_non_mlp_(tiny_lm("llama")))
    for model in (sparse_then_fused, fused_then_sparse):
        assert len(sparse_mlps(model)) == 2
        assert _close(_logits(model, ids), expect)
        assert list(model.state_dict()) == list(plain.state_dict())
    assert calls["apply_rope"] == 4
    assert sparse_then_fused.config.to_dict() == plain.config.to_dict()


@pytest.mark.parametrize("cache_name", ["cache", "past_key_values"])
def test_cache_keywords_and_eager_attention(calls, cache_name):
    """The fused forward takes the cache under either name (`past_key_values` is what decoder layers
    of transformers < 5.24 pass) and the eager interface with attention weights, against the class
    forward on an identical module."""
    model = tiny_lm("llama")
    model.config._attn_implementation = "eager"
    attn = model.model.layers[0].self_attn
    # the class forward's own name for the cache: `cache` from transformers 5.24, `past_key_values` before
    class_name = "cache" if "cache" in inspect.signature(type(attn).forward).parameters else "past_key_values"
    fused = fuse_non_mlp_(copy.deepcopy(model)).model.layers[0].self_attn
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    cos, sin = model.model.rotary_emb(x, torch.arange(5)[None])
    mask = torch.full((5, 5), float("-inf")).triu(1)[None, None].expand(2, 1, 5, 5)
    outs = []
    for module, name in ((attn, class_name), (fused, cache_name)):
        cache = DynamicCache(config=model.config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecation of a name, if any
            with torch.no_grad():
                out, weights = module(x, position_embeddings=(cos, sin), attention_mask=mask, **{name: cache})
        outs.append((out, weights, cache.layers[0].keys, cache.layers[0].values))
    assert calls["apply_rope"] == 1
    for a, b in zip(*outs):
        assert a is not None and _close(b, a), (b - a).abs().max()


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_architectures_fuse_norms_only(arch, calls):
    plain = tiny_lm(arch)
    model = fuse_non_mlp_(copy.deepcopy(plain))
    assert sum(isinstance(m, FusedRMSNorm) for m in model.modules()) == 5
    assert not any("forward" in vars(layer.self_attn) for layer in model.model.layers)
    ids = token_ids()
    assert _close(_logits(model, ids), _logits(plain, ids))
    assert calls == {"rms_norm": 5, "apply_rope": 0}
    unfuse_non_mlp_(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in plain.modules()]


def test_bf16_model_stays_within_rounding_of_hf():
    """bf16 logits: the fused model is no further from the fp32 model than 2x HF's bf16 model."""
    ref = _logits(tiny_lm("llama"), token_ids()).double()
    plain = tiny_lm("llama", dtype=torch.bfloat16)
    model = fuse_non_mlp_(copy.deepcopy(plain))
    err_hf = (_logits(plain, token_ids()).double() - ref).abs().max().item()
    err = (_logits(model, token_ids()).double() - ref).abs().max().item()
    assert err <= 2 * err_hf + torch.finfo(torch.bfloat16).eps * ref.abs().max().item()


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _training_step(model, ids, autocast=True):
    """Logits and parameter gradients (fp32) of one training step of `model`, under bf16 autocast."""
    model.train()
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()
    return logits.detach().float(), {name: p.grad.float() for name, p in model.named_parameters()}


@pytest.mark.parametrize("sparse", [False, True], ids=["llama_mlp", "sparse_mlp"])
def test_autocast_training_gets_autocast_outputs_and_hf_gradients(sparse, calls):
    """Under autocast the decoder layers' norms and the RoPE of an uncached call return bf16 (their
    consumers cast to it anyway), the final norm keeps fp32; logits and every gradient stay as close
    to the fp32 model's as twice Hugging Face's under autocast (STYLE's rule, by relative norm)."""
    plain = tiny_lm("llama").to(DEVICE)
    if sparse:
        sparsify_(plain)
    model = fuse_non_mlp_(copy.deepcopy(plain))
    marked = [name for name, m in model.named_modules() if isinstance(m, FusedRMSNorm) and m.autocast_output]
    assert marked == [f"model.layers.{i}.{n}" for i in range(2)
                      for n in ("input_layernorm", "post_attention_layernorm")]
    dtypes = {}
    hooks = [m.register_forward_hook(lambda m, a, out, name=name: dtypes.__setitem__(name, out.dtype))
             for name, m in model.named_modules() if isinstance(m, FusedRMSNorm)]
    ids = token_ids(length=16, seed=1).to(DEVICE)
    truth = _training_step(copy.deepcopy(plain), ids, autocast=False)
    hf = _training_step(plain, ids)
    fused = _training_step(model, ids)
    for hook in hooks:
        hook.remove()
    assert calls == {"rms_norm": 5, "apply_rope": 2}
    assert dtypes == {**{name: torch.bfloat16 for name in marked}, "model.norm": torch.float32}

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(fused[0], truth[0]) <= 2 * rel(hf[0], truth[0]) + 1e-3
    for name, grad in fused[1].items():
        assert rel(grad, truth[1][name]) <= 2 * rel(hf[1][name], truth[1][name]) + 1e-2, name


def test_autocast_outputs_only_while_the_projections_are_plain_linears():
    """A projection wrapped after fusing (a hook here, a LoRA layer alike) may compute on its input before
    casting it: the norm before it returns Hugging Face's fp32 again."""
    model = fuse_non_mlp_(tiny_lm("llama"))
    layer = model.model.layers[0]
    dtypes = {}
    for name in ("input_layernorm", "post_attention_layernorm"):
        getattr(layer, name).register_forward_hook(lambda m, a, out, name=name: dtypes.__setitem__(name, out.dtype))
    ids = token_ids(length=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids)
        assert dtypes == {"input_layernorm": torch.bfloat16, "post_attention_layernorm": torch.bfloat16}
        layer.self_attn.k_proj.register_forward_pre_hook(lambda m, a: None)
        layer.mlp.up_proj.register_forward_hook(lambda m, a, out: None)
        model(input_ids=ids)
        assert dtypes == {"input_layernorm": torch.float32, "post_attention_layernorm": torch.float32}


def test_bf16_decode_steps_project_q_k_v_in_one_launch(monkeypatch):
    """A cached step of one or two tokens (eval, no grad) computes q, k and v in one launch
    (ops.decode_linear); its logits are no further from the fp32 model's than 2x HF's bf16 model's."""
    taken = []

    def counting(x, weights, _real=fused_module.decode_projections):
        out = _real(x, weights)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(fused_module, "decode_projections", counting)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernel under the interpreter
    ref, plain = tiny_lm("llama").to(device), tiny_lm("llama", dtype=torch.bfloat16).to(device)
    model = fuse_non_mlp_(copy.deepcopy(plain))
    ids = token_ids(batch=2, length=6, seed=5).to(device)
    for rows, step in ((ids[:1], 1), (ids[:1], 2), (ids, 1)):  # 1 or 2 tokens per step
        logits = []
        for m in (ref, plain, model):
            cache = DynamicCache(config=m.config)
            with torch.no_grad():
                m(input_ids=rows[:, :-step], past_key_values=cache, use_cache=True)
                taken.clear()
                logits.append(m(input_ids=rows[:, -step:], past_key_values=cache, use_cache=True).logits.double())
        assert taken == [True, True], (rows.shape, step, taken)  # the fused model's two layers
        err_hf = (logits[1] - logits[0]).abs().max().item()
        err = (logits[2] - logits[0]).abs().max().item()
        assert err <= 2 * err_hf + torch.finfo(torch.bfloat16).eps * logits[0].abs().max().item()
    # a hooked projection (e.g. accelerate's, or a user's) must be called, not bypassed
    seen = []
    model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *args: seen.append(1))
    taken.clear()
    with torch.no_grad():
        model(input_ids=ids[:1, :1])
    assert taken == [True] and seen == [1]  # layer 0 ran its modules; layer 1 took the kernel


def test_save_pretrained_round_trip(tmp_path):
    model = fuse_non_mlp_(tiny_lm("llama"))
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, attn_implementation="sdpa")
    assert not hasattr(loaded.config, "sparseffn_fused_non_mlp")
    assert any(isinstance(m, LlamaRMSNorm) for m in loaded.modules())
    ids = token_ids()
    assert _close(_logits(loaded.eval(), ids), _logits(model, ids))


def test_errors():
    model = fuse_non_mlp_(tiny_lm("llama"))
    with pytest.raises(ValueError, match="already fused"):
        fuse_non_mlp_(model)
    with pytest.raises(ValueError, match="nothing to fuse"):
        fuse_non_mlp_(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        fuse_non_mlp_("model")
    with pytest.raises(ValueError, match="nothing fused"):
        unfuse_non_mlp_(torch.nn.Linear(2, 2))
    hooked = tiny_lm("llama")
    hooked.model.norm.register_forward_hook(lambda *args: None)
    names = [type(m) for m in hooked.modules()]
    with pytest.raises(ValueError, match="forward hooks"):
        fuse_non_mlp_(hooked)
    assert [type(m) for m in hooked.modules()] == names  # refused before anything changed
    assert not any(has_fused_rope(m) for m in hooked.modules())


def test_fused_model_compiles_fullgraph():
    """torch.compile(fullgraph=True) traces the fused ops through their fake implementations and
    autograd formulas: logits and gradients equal the eager fused model's."""
    model = fuse_non_mlp_(tiny_lm("llama"))
    ids = token_ids()

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(ids).logits.float().square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager = loss_and_grads(lambda i: model(input_ids=i, use_cache=False))
    compiled_model = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled = loss_and_grads(lambda i: compiled_model(input_ids=i, use_cache=False))
    assert _close(compiled[0], eager[0])
    assert all(_close(c, e) for c, e in zip(compiled[1], eager[1]))


FUSE_EXPECTED = {  # family: (norm classes fused, attention classes fused)
    "qwen3": (True, False), "gemma": (False, True), "olmo2": (False, False), "granite": (True, True),
    "stablelm": (False, False), "cohere": (False, False), "smollm3": (True, False), "phi3": (True, False),
}


@pytest.mark.parametrize("family", sorted(FUSE_EXPECTED))
def test_families_fuse_what_matches_llama_and_report_the_rest(family, calls):
    from sparseffn.models.fuse import fusion_plan
    from tests.models.families import family_lm, ids

    plain = family_lm(family)
    plan = fusion_plan(plain)
    norms, attentions = FUSE_EXPECTED[family]
    assert {a == "fuse" for _, c, a in plan if c.endswith("Norm")} == {norms}
    assert {a == "fuse" for _, c, a in plan if c.endswith("Attention")} == {attentions}
    if not norms and not attentions:
        with pytest.raises(ValueError, match="nothing to fuse .*: .*(not LlamaRMSNorm's|not LlamaAttention's)"):
            fuse_non_mlp_(plain)
        return
    model = copy.deepcopy(plain)
    if norms and attentions:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing skipped, nothing to say
            fuse_non_mlp_(model)
    else:
        with pytest.warns(UserWarning, match=r"fuse_non_mlp_ skipped .* module\(s\) \(.*\): its forward is not Llama"):
            fuse_non_mlp_(model)
    tokens = ids()
    assert _close(_logits(model, tokens), _logits(plain, tokens))
    planned_norms = sum(1 for _, c, a in plan if a == "fuse" and c.endswith("Norm"))
    planned_attn = sum(1 for _, c, a in plan if a == "fuse" and c.endswith("Attention"))
    assert calls == {"rms_norm": planned_norms, "apply_rope": planned_attn}


def test_compile_non_mlp_refuses_a_model_without_norms_or_attention():
    from sparseffn.models import compile_non_mlp_

    with pytest.raises(ValueError, match="no norm or attention module to compile"):
        compile_non_mlp_(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        compile_non_mlp_("model")
