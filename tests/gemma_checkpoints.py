"""Tiny random Gemma 2 / Gemma 3 checkpoints (no network), for tests/test_gemma.py.

Gemma initializes its norm weights to zero (the norm scales by 1 + weight); these checkpoints give
them random values instead, so that a wrong `+ 1` cannot pass unnoticed.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from checkpoints import train_tokenizer
from kvserve.models.checkpoint_writer import random_tensors, write_checkpoint

SLIDING_WINDOW = 8
# both layer kinds, and a sliding layer after the global one
GEMMA3_LAYER_TYPES = [
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
]


def gemma_config(family: str, vocab_size: int, **overrides) -> dict:
    """config.json's content: 'gemma2' (soft-capping, alternating layers), 'gemma3' (q/k norms,
    two rotary bases, linear rope scaling on the global layers)."""
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        sliding_window=SLIDING_WINDOW,
        query_pre_attn_scalar=24,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    if family == "gemma2":
        kw.update(num_hidden_layers=3, attn_logit_softcapping=2.0, final_logit_softcapping=8.0)
        kw.update(overrides)
        config = transformers.Gemma2Config(**kw).to_dict()
        config["architectures"] = ["Gemma2ForCausalLM"]
    elif family == "gemma3":
        kw.update(
            num_hidden_layers=4,
            layer_types=GEMMA3_LAYER_TYPES,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        )
        kw.update(overrides)
        config = transformers.Gemma3TextConfig(**kw).to_dict()
        config["architectures"] = ["Gemma3ForCausalLM"]
    else:
        raise ValueError(f"unknown family {family!r}")
    return config


def gemma_tensors(
    config: dict, seed: int = 0, dtype: str = "float32"
) -> list[tuple[str, torch.Tensor]]:
    """transformers' init with every matrix scaled up (peaked logits: greedy is not decided by
    ties) and random norm weights."""
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for name, t in random_tensors(config, seed=seed, matrix_scale=3.0):
        if name.endswith("norm.weight"):
            t = torch.randn(t.shape, generator=gen) * 0.5
        out.append((name, t.to(getattr(torch, dtype))))
    return out


def make_gemma_checkpoint(
    path: str | Path, family: str = "gemma2", seed: int = 0, dtype: str = "float32", **overrides
) -> str:
    tokenizer = train_tokenizer()
    config = gemma_config(family, tokenizer.get_vocab_size(), **overrides)
    write_checkpoint(path, config, gemma_tensors(config, seed, dtype), tokenizer)
    return str(path)
