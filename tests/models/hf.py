"""Tiny Hugging Face causal LMs built from configs (nothing downloads), for the models/ tests."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
)
CONFIGS = {
    "llama": lambda act, tied: LlamaConfig(**COMMON, head_dim=32, hidden_act=act, tie_word_embeddings=tied),
    "qwen2": lambda act, tied: Qwen2Config(**COMMON, hidden_act=act, tie_word_embeddings=tied),
    "mistral": lambda act, tied: MistralConfig(**COMMON, head_dim=32, hidden_act=act, tie_word_embeddings=tied),
}


def tiny_lm(arch="llama", *, act="relu", tied=True, seed=0, dtype=torch.float32):
    """A randomly initialized tiny causal LM (sdpa attention, as build_model and load_pretrained use),
    from a seed without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(CONFIGS[arch](act, tied), attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def token_ids(batch=2, length=12, seed=0, vocab=VOCAB):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
