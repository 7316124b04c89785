"""Tiny configs of every architecture family docs/architectures.md lists (nothing downloads).

`family_lm(name, act)` builds the family's causal LM from a seed with the MLP activation `act` written
into whichever config field the family reads (its `ACT_FIELD`), so act="relu" is the ReLU twin of the
model sparsify_ starts from.
"""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MOE = dict(num_experts_per_tok=2)
FAMILIES = {  # model_type: (extra config fields, activation field, original activation)
    "llama": ({}, "hidden_act", "silu"),
    "mistral": ({}, "hidden_act", "silu"),
    "qwen2": ({}, "hidden_act", "silu"),
    "qwen3": ({"head_dim": 16}, "hidden_act", "silu"),
    "gemma": ({"head_dim": 16}, "hidden_act", "gelu_pytorch_tanh"),
    "gemma2": ({"head_dim": 16}, "hidden_activation", "gelu_pytorch_tanh"),
    "gemma3_text": ({"head_dim": 16}, "hidden_activation", "gelu_pytorch_tanh"),
    "olmo": ({}, "hidden_act", "silu"),
    "olmo2": ({}, "hidden_act", "silu"),
    "granite": ({}, "hidden_act", "silu"),
    "stablelm": ({}, "hidden_act", "silu"),
    "cohere": ({}, "hidden_act", "silu"),
    "smollm3": ({}, "hidden_act", "silu"),
    "phi3": ({}, "hidden_act", "silu"),
    "mixtral": ({"num_local_experts": 4, **_MOE}, "hidden_act", "silu"),
    "qwen2_moe": ({"num_experts": 4, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40, **_MOE},
                  "hidden_act", "silu"),
    "qwen3_moe": ({"num_experts": 4, "moe_intermediate_size": 24, "head_dim": 16, **_MOE}, "hidden_act", "silu"),
    "gpt2": ({"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64, "n_inner": 48}, "activation_function",
             "gelu_new"),
    "gpt_neox": ({}, "hidden_act", "gelu"),
    "falcon": ({"ffn_hidden_size": 48}, "activation", "gelu"),
    "phi": ({}, "hidden_act", "gelu_new"),
    "starcoder2": ({}, "hidden_act", "gelu_pytorch_tanh"),
}
SPARSE_KIND = {  # the sparse layer classes each family ends up with
    "phi3": {"HFSparseMLP"}, "gpt2": {"HFSparseMLP"}, "gpt_neox": {"HFSparseMLP"}, "falcon": {"HFSparseMLP"},
    "phi": {"HFSparseMLP"}, "starcoder2": {"HFSparseMLP"}, "mixtral": {"SparseExperts"},
    "qwen2_moe": {"SparseExperts", "SparseMLP"}, "qwen3_moe": {"SparseExperts"},
}


def family_config(name, act=None):
    extra, field, original = FAMILIES[name]
    fields = {**_COMMON, **extra, field: act or original}
    return AutoConfig.for_model(name, **fields)


def family_lm(name, act=None, *, seed=0, dtype=torch.float32):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(family_config(name, act), dtype=dtype)
    return model.eval()


def ids(batch=2, length=9, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
