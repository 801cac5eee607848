"""Tiny random Hugging Face checkpoints built at test time (no network).

Every test that needs a model calls `make_checkpoint(tmp_dir, family)`: it writes
`config.json`, `model.safetensors`, `generation_config.json`, `tokenizer.json`
and `tokenizer_config.json` (with a ChatML chat template) exactly as a real
checkpoint on the Hub has them, so that both kvserve and `transformers` load it
(models/checkpoint_writer.py, the writer the benchmarks and the default model use too).
"""

from __future__ import annotations

import functools
from pathlib import Path

import transformers
from tokenizers import Tokenizer

from kvserve.models.checkpoint_writer import (
    decoder_shape,
    random_tensors,
    write_checkpoint,
    write_tokenizer,
)
from kvserve.models.default_model import train_bytelevel_bpe

# A small corpus with some multi-byte UTF-8 so that byte-level BPE merges
# split characters across tokens (the detokenizer must cope).
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention stores keys and values in fixed-size blocks of tokens.",
    "Continuous batching lets new requests join a running batch at every step.",
    "Once upon a time there was a small server that streamed tokens to its users.",
    "Café, naïve, jalapeño, Zürich, Łódź, 東京, 北京, こんにちは, 안녕하세요, Привет мир.",
    "Emoji: 🚀🔥✨ and math: ∑ ∫ √ π ≈ 3.14159; arrows → ← ↑ ↓.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 2048 4096 and punctuation !?;:,.()[]{}",
]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "phi3")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
# mixture-of-experts families (models/moe.py), tested in tests/test_moe.py
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")


@functools.lru_cache(maxsize=4)
def train_tokenizer(vocab_size: int = 384) -> Tokenizer:
    """A deterministic byte-level BPE tokenizer (GPT-2 style), the default model's recipe."""
    return train_bytelevel_bpe(CORPUS * 4, vocab_size)


def save_tokenizer(path: Path, vocab_size: int = 384) -> transformers.PreTrainedTokenizerFast:
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, train_tokenizer(vocab_size))
    return transformers.PreTrainedTokenizerFast.from_pretrained(path)


def tiny_config(family: str, vocab_size: int, **overrides) -> transformers.PretrainedConfig:
    if family == "gpt2":
        kw = dict(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=512,
            vocab_size=vocab_size,
            bos_token_id=0,
            eos_token_id=0,
        )
        kw.update(overrides)
        return transformers.GPT2Config(**kw)
    kw = decoder_shape(
        64,
        128,
        2,
        4,
        2,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if family == "mistral":
        kw["sliding_window"] = 24
    if family == "qwen2":
        kw["use_sliding_window"] = False
    if family in ("qwen3", "qwen3_moe"):
        kw["head_dim"] = 32  # explicit head_dim != hidden / heads
    if family == "phi3":
        kw["pad_token_id"] = 0  # Phi3Config's default, 32000, is past the tiny vocabulary
    if family == "qwen3_moe":  # 3 layers, the middle one dense (mlp_only_layers)
        kw.update(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            decoder_sparse_step=1,
        )
    if family == "qwen2_moe":  # a shared expert; the first layer dense
        kw.update(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            mlp_only_layers=[0],
            decoder_sparse_step=1,
            use_sliding_window=False,
        )
    if family == "mixtral":
        kw.update(num_local_experts=8, num_experts_per_tok=2, sliding_window=None)
    kw.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "phi3": transformers.Phi3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
    }[family]
    return cls(**kw)


def make_checkpoint(
    path: str | Path, family: str = "llama", seed: int = 0, fused_experts: bool = False, **overrides
) -> str:
    """Write a tiny random `family` checkpoint (weights + tokenizer) to `path`. A `vocab_size`
    override larger than the tokenizer's gives the model ids that only token-id prompts use.
    MoE experts are written per expert as `save_pretrained` does (`fused_experts`: as transformers'
    3-D module parameters)."""
    tokenizer = train_tokenizer()
    vocab_size = overrides.pop("vocab_size", tokenizer.get_vocab_size())
    config = tiny_config(family, vocab_size=vocab_size, **overrides).to_dict()
    config["architectures"] = [ARCHITECTURES[family]]
    # Random init is near-uniform over the vocabulary; scale up the matrices so the
    # distribution is peaked enough that greedy decoding is not decided by ties.
    tensors = random_tensors(config, seed=seed, matrix_scale=3.0)
    if family in MOE_FAMILIES and not fused_experts:
        tensors = per_expert_tensors(tensors, family)
    write_checkpoint(path, config, tensors, tokenizer)
    return str(path)


def per_expert_tensors(tensors, family: str):
    """transformers' stacked experts (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])
    as the per-expert tensors `save_pretrained` writes (Mixtral: `block_sparse_moe.experts.{e}.w1/w3/w2`)."""
    block, gate, up, down = (
        ("block_sparse_moe", "w1", "w3", "w2")
        if family == "mixtral"
        else ("mlp", "gate_proj", "up_proj", "down_proj")
    )
    for name, tensor in tensors:
        if ".mlp." not in name or (
            ".experts." not in name and not name.endswith(".mlp.gate.weight")
        ):
            yield name, tensor
            continue
        prefix = name.split(".mlp.")[0] + f".{block}"
        if name.endswith(".mlp.gate.weight"):
            yield f"{prefix}.gate.weight", tensor
        elif name.endswith("gate_up_proj"):
            for e, (g, u) in enumerate(zip(*tensor.chunk(2, dim=1))):
                yield f"{prefix}.experts.{e}.{gate}.weight", g.clone()
                yield f"{prefix}.experts.{e}.{up}.weight", u.clone()
        else:
            for e, d in enumerate(tensor):
                yield f"{prefix}.experts.{e}.{down}.weight", d.clone()


# The benchmarks' smoke tests: benchmarks/smollm_checkpoint.py's model at a size that runs in a second
TINY_SMOLLM = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)


def tiny_smollm(path: str | Path) -> Path:
    """The SmolLM-shaped random checkpoint of the benchmarks, tiny, written to `path`."""
    from benchmarks.smollm_checkpoint import build_smollm_like

    return build_smollm_like(path, **TINY_SMOLLM)
