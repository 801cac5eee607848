"""Random-weight Llama checkpoints of real shapes, written straight from device tensors.

    from benchmarks.llama_shapes import write_llama_checkpoint
    write_llama_checkpoint("/tmp/llama-8b", "llama-8b", device="cuda")

Shapes (config.json as the Hub has them; only the weights are random):
  llama-1b  Llama-3.2-1B: hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, vocab 128256,
            tied embeddings, llama3 rope scaling (2.5 GB in bf16)
  llama-8b  Llama-3-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336, vocab 128256,
            untied (16 GB in bf16)
  tiny      hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 512: CPU smoke tests

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

LLAMA_SHAPES: dict[str, dict] = {
    "llama-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)),
    "llama-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
}
SHARD_BYTES = 2 << 30
INIT_STD = 0.02


def shape_config(shape: str, **overrides) -> dict:
    if shape not in LLAMA_SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {sorted(LLAMA_SHAPES)}")
    return {**LLAMA_SHAPES[shape], "bos_token_id": 0, "eos_token_id": 0, **overrides}


def parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, from a model built on the meta device (tied weights once)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}  # dedups tied weights


def write_llama_checkpoint(path: str | Path, shape: str, device: str = "cpu", dtype: str = "bfloat16",
                           seed: int = 0, **overrides) -> Path:
    """Write `shape`'s checkpoint to `path` unless a complete one is there; returns the path."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from benchmarks.smollm_checkpoint import SPECIAL_TOKENS, save_tokenizer

    path = Path(path)
    marker = path / "kvserve_checkpoint.json"
    fields = shape_config(shape, **overrides)
    recipe = {"shape": shape, "dtype": dtype, "seed": seed, "config": fields}
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*.safetensors"):
        old.unlink()
    config = transformers.LlamaConfig(**fields)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = dtype
    config.save_pretrained(path)
    eos_token_ids = [0, SPECIAL_TOKENS.index("<|im_end|>")]
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=eos_token_ids).save_pretrained(path)
    save_tokenizer(path, fields["vocab_size"])

    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict] = [{}]
    shard_bytes = 0
    weight_map: dict[str, int] = {}
    total = 0

    def flush() -> None:
        nonlocal shard_bytes
        if shards[-1]:
            save_file(shards[-1], str(path / f"shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
            shards[-1] = {}  # free the device tensors
            shards.append({})
            shard_bytes = 0

    for name, dims in parameter_shapes(config).items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(dims, dtype=torch_dtype, device=device)
        else:
            tensor = torch.empty(dims, dtype=torch_dtype, device=device).normal_(0.0, INIT_STD, generator=gen)
        nbytes = tensor.numel() * tensor.element_size()
        if shard_bytes and shard_bytes + nbytes > SHARD_BYTES:
            flush()
        shards[-1][name] = tensor
        weight_map[name] = len(shards)
        shard_bytes += nbytes
        total += nbytes
    flush()
    num_shards = len(shards) - 1
    files = {i: f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)}
    for i, name in files.items():
        (path / f"shard-{i:05d}.safetensors").rename(path / name)
    index = {"metadata": {"total_size": total}, "weight_map": {k: files[v] for k, v in weight_map.items()}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    marker.write_text(json.dumps(recipe) + "\n")
    return path


def weight_bytes_per_step(config, dtype_bytes: int = 2) -> int:
    """Weight bytes one decode step reads: every layer, the final norm and the LM head; the
    embedding table only through the LM head (a lookup reads B rows of it)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    return dtype_bytes * (config.num_hidden_layers * per_layer + hidden + config.vocab_size * hidden)


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes
