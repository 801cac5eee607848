"""Random-weight checkpoints of real shapes (Llama, Gemma 3, Qwen3-MoE), written straight from device tensors.

    from benchmarks.llama_shapes import write_llama_checkpoint
    write_llama_checkpoint("/tmp/llama-8b", "llama-8b", device="cuda")

Shapes (config.json as the Hub has them; only the weights are random):
  llama-1b  Llama-3.2-1B: hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, vocab 128256,
            tied embeddings, llama3 rope scaling (2.5 GB in bf16)
  llama-8b  Llama-3-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336, vocab 128256,
            untied (16 GB in bf16)
  tiny      hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 512: CPU smoke tests
  gemma3-1b Gemma-3-1B-it's text config: hidden 1152, 26 layers, 4 heads, 1 KV head, head_dim 256,
            MLP 6912 (GeLU-tanh), vocab 262144, tied; sliding window 512 on 5 of every 6 layers
            (rope base 10000 there, 1e6 on the global ones) (2.0 GB in bf16)
  qwen3-moe-6l  Qwen3-30B-A3B's layer shapes (hidden 2048, 32 heads, 4 KV heads, head_dim 128, 128
            experts of MLP 768, top 8, vocab 151936, untied) with 6 of its 48 layers, so that
            its files and a run fit a small machine (4.4 B parameters, 8.7 GB in bf16; a batch-1
            step reads 0.65 B of them, half of that the LM head)

Each tensor is drawn on `device` (normal, std 0.02; norms 1) and written with safetensors
in shards of about 2 GiB, with `model.safetensors.index.json`, so no 16 GB `save_pretrained`
and no whole model in host memory. Tensor names and shapes come from a `transformers` model
built on the meta device, so they are exactly the names `from_pretrained` expects. The
tokenizer is the printable-ASCII byte-level BPE of benchmarks/smollm_checkpoint.py built with
exactly `vocab_size` tokens, so every id the random model samples decodes to visible text
(what a serving benchmark streams).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.models.checkpoint_writer import random_tensors, write_checkpoint

LLAMA_SHAPES: dict[str, dict] = {  # config.json fields; the architecture is Llama's
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}
# Other families, as (architectures[0], model_type, config.json fields).
OTHER_SHAPES: dict[str, tuple[str, str, dict]] = {
    "gemma3-1b": (
        "Gemma3ForCausalLM",
        "gemma3_text",
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=262144,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=256,
            sliding_window=512,
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)
            ],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-moe-6l": (
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=6,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
        ),
    ),
}
SHAPES = sorted(LLAMA_SHAPES) + sorted(OTHER_SHAPES)
SHARD_BYTES = 2 << 30
INIT_STD = 0.02


def shape_config(shape: str, **overrides) -> dict:
    """config.json's content for `shape` (with `architectures` and `model_type`)."""
    if shape in LLAMA_SHAPES:
        arch, model_type, fields = "LlamaForCausalLM", "llama", LLAMA_SHAPES[shape]
    elif shape in OTHER_SHAPES:
        arch, model_type, fields = OTHER_SHAPES[shape]
    else:
        raise ValueError(f"unknown shape {shape!r}: one of {SHAPES}")
    return {
        "architectures": [arch],
        "model_type": model_type,
        **fields,
        "bos_token_id": 0,
        "eos_token_id": 0,
        **overrides,
    }


def write_llama_checkpoint(
    path: str | Path,
    shape: str,
    device: str = "cpu",
    dtype: str = "bfloat16",
    seed: int = 0,
    **overrides,
) -> Path:
    """Write `shape`'s checkpoint to `path` unless a complete one is there; returns the path."""
    from benchmarks.smollm_checkpoint import ascii_bpe_tokenizer

    path = Path(path)
    marker = path / "kvserve_checkpoint.json"
    fields = shape_config(shape, **overrides)
    recipe = {"shape": shape, "dtype": dtype, "seed": seed, "config": fields}
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*.safetensors"):
        old.unlink()
    config = {**fields, "dtype": dtype}
    tensors = random_tensors(
        config, seed=seed, dtype=dtype, device=device, init="normal", std=INIT_STD
    )
    write_checkpoint(
        path, config, tensors, ascii_bpe_tokenizer(fields["vocab_size"]), shard_bytes=SHARD_BYTES
    )
    marker.write_text(json.dumps(recipe) + "\n")
    return path


def weight_bytes_per_step(config, dtype_bytes: int = 2) -> int:
    """Weight bytes one decode step reads: every layer, the final norm and the LM head; the
    embedding table only through the LM head (a lookup reads B rows of it)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    return dtype_bytes * (
        config.num_hidden_layers * per_layer + hidden + config.vocab_size * hidden
    )


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes
