"""The one builder of the small Llama that the bench, the harness, `explain` and the tests train:
a Hugging Face `LlamaForCausalLM` made from a config with random weights (nothing downloaded).

Callers choose the sizes (each keeps its own numbers, so the figures it compares stay the same);
what is shared is how a size becomes a config and a seeded model. transformers and torch are
imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations


def llama_config(*, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                 intermediate: int, positions: int, attention: str | None = None):
    """A LlamaConfig of these sizes, input and output embeddings untied (each its own weight,
    as sharded wrappers see them); `attention` picks an attention implementation by name."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=positions, tie_word_embeddings=False,
    )
    if attention is not None:
        config._attn_implementation = attention
    return config


def build_llama(config, seed: int | None = 0, device=None):
    """`LlamaForCausalLM(config)`, its weights drawn right after `torch.manual_seed(seed)` (with
    seed None, from the random state as the caller left it). With `device` it is built there
    whatever `torch.device` context encloses the call; without, where that context says."""
    import torch
    from transformers import LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    if device is None:
        return LlamaForCausalLM(config)
    with torch.device(device):
        return LlamaForCausalLM(config)


def parameter_count(config) -> int:
    """The parameters a Llama of `config` has, counted on the meta device (no memory, no time)."""
    model = build_llama(config, seed=None, device="meta")
    return sum(p.numel() for p in model.parameters())
