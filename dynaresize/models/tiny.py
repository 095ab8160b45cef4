"""The tiny LLaMA-style policy built from ``model.tiny``: shapes vLLM accepts, ids from its trained tokenizer.

Why LLaMA and not Qwen2 (the two differ here only by Qwen2's q/k/v biases): transformers 5.24's ``AutoTokenizer``
lists ``qwen2`` among model types whose declared tokenizer class it overrides, and rebuilds the saved tokenizer as a
byte-level BPE ``Qwen2Tokenizer`` (its own normaliser and split, not the ones our tokenizer was trained with). With
``model_type=llama`` it loads our ``tokenizer.json`` as is. head_dim = hidden / heads; vLLM's attention backends
want a multiple of 8 and >= 32 (hidden 128, 2 heads -> 64, the default). Embeddings are tied; weights float32.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_config(tiny, tokenizer) -> LlamaConfig:
    """``tiny`` is a ``TinyModelConfig``; special-token ids and vocabulary size come from ``tokenizer``."""
    if tiny.hidden_size % tiny.num_heads:
        raise ValueError(f"model.tiny.hidden_size={tiny.hidden_size} is not a multiple of model.tiny.num_heads={tiny.num_heads}")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_heads,
        max_position_embeddings=tiny.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def build_model(tiny, tokenizer, seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised model (deterministic given ``seed``)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(tiny, tokenizer))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model
