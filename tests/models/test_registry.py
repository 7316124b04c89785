import pytest
import torch

import sparseffn
from sparseffn.models import MODEL_NAMES, build_model, model_config, parameter_count, sparse_mlps

RANGES = {  # parameters at each name's default vocab
    "tiny": (1e6, 5e6),
    "20m": (15e6, 25e6),
    "100m": (80e6, 120e6),
    "0.5b": (0.45e9, 0.6e9),
    "1b": (0.9e9, 1.15e9),
    "1.5b": (1.4e9, 1.7e9),
    "2b": (1.9e9, 2.3e9),
}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_parameter_counts_in_range(name):
    low, high = RANGES[name]
    assert low <= parameter_count(model_config(name)) <= high


@pytest.mark.parametrize("name", ["tiny", "20m"])
def test_parameter_count_formula_matches_a_built_model(name):
    model = build_model(name, None, vocab_size=1000, seed=0)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(model.config)
    untied = model_config(name, vocab_size=1000, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                          num_key_value_heads=1)
    built = build_model(untied, None, seed=0)
    assert sum(p.numel() for p in built.parameters()) == parameter_count(untied)


@pytest.mark.parametrize("name, layers", [("0.5b", 8), ("1b", 18), ("1.5b", 28), ("2b", 38)])
def test_paper_shapes(name, layers):
    config = model_config(name)
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads, config.head_dim) == (2048, 5632, 32, 64)
    assert config.num_hidden_layers == layers and config.vocab_size == 49152
    assert config.max_position_embeddings == 2048


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_common_settings(name):
    config = model_config(name, vocab_size=32000, max_position_embeddings=512)
    assert config.hidden_act == "relu" and config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == 1e5 and config.head_dim == 64
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.hidden_size == 64 * config.num_attention_heads
    assert config.vocab_size == 32000 and config.max_position_embeddings == 512


def test_overrides():
    config = model_config("tiny", num_hidden_layers=2, rope_theta=1e4, num_attention_heads=1, head_dim=128)
    assert config.num_hidden_layers == 2 and config.rope_parameters["rope_theta"] == 1e4
    assert config.num_key_value_heads == 1


def test_build_model_sparse_seeded_and_rng_untouched():
    state = torch.random.get_rng_state()
    a = build_model("tiny", vocab_size=512, seed=3, num_hidden_layers=2)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = sparseffn.build_model("tiny", sparseffn.SparsityConfig(threshold=0.01), vocab_size=512, seed=3,
                              num_hidden_layers=2)
    c = build_model("tiny", vocab_size=512, seed=4, num_hidden_layers=2)
    assert type(a).__name__ == "LlamaForCausalLM" and a.config._attn_implementation == "sdpa"
    assert len(sparse_mlps(a)) == 2 and all(m.has_threshold for m in sparse_mlps(b))
    assert a.config.sparseffn == sparseffn.SparsityConfig().to_dict()
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.lm_head.weight is a.model.embed_tokens.weight


def test_build_model_plain_dtype_and_config_copy():
    config = model_config("tiny", vocab_size=300)
    model = build_model(config, None, vocab_size=512, dtype=torch.bfloat16, num_hidden_layers=1)
    assert not sparse_mlps(model) and model.dtype == torch.bfloat16
    assert model.config.vocab_size == 512 and model.config.num_hidden_layers == 1
    assert config.vocab_size == 300 and config.num_hidden_layers == 4  # the caller's config is not modified


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: model_config("3b"), ValueError, r"name must be one of \('tiny', '20m'"),
        (lambda: model_config("tiny", vocab_size=0), ValueError, "vocab_size must be >= 1"),
        (lambda: model_config("tiny", vocab_size="32k"), TypeError, "vocab_size must be an int"),
        (lambda: model_config("tiny", max_position_embeddings=-1), ValueError, "max_position_embeddings must be >= 1"),
        (lambda: model_config("tiny", hidden_sise=3), ValueError, r"unknown LlamaConfig field\(s\) in overrides: \['hidden_sise'\]"),
        (lambda: build_model(3), TypeError, "name_or_config must be a model name"),
        (lambda: build_model("tiny", sparsity={}), TypeError, "sparsity must be a SparsityConfig or None"),
        (lambda: build_model("tiny", dtype="bf16"), TypeError, "dtype must be a floating-point torch.dtype"),
        (lambda: build_model("tiny", seed=1.5), TypeError, "seed must be an int or None"),
    ],
)
def test_bad_inputs(call, error, message):
    with pytest.raises(error, match=message):
        call()
