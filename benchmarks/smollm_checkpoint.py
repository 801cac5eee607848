"""A random-weight checkpoint shaped like SmolLM-135M, built offline for benchmarks.

Architecture: Llama, hidden 576, 30 layers, 9 heads, 3 KV heads, MLP 1536,
vocab 49152, tied embeddings, 2048 positions (the real SmolLM-135M shapes), so
compute and KV-cache sizes match the real model; only the weights are random.

Tokenizer: a byte-level BPE built programmatically with exactly 49152 tokens
(ids 0-2 specials, then the 256 byte symbols, then every pair of printable
ASCII symbols and as many triples as fit). Unlike a small trained tokenizer
with a 49152-row model, almost every id the random model samples decodes to
1-3 printable characters (all but the 128 lone bytes >= 0x80, kept so that any
text still encodes: 0.3% of ids), so servers stream one visible chunk per token
and chunks rarely wait on half a UTF-8 character; that keeps TTFT/ITL clean.

Other shapes, with the same kind of tokenizer (`--shape`, `--architecture`):

    python -m benchmarks.smollm_checkpoint --out loadtest_out/models/smollm-135m-random
    python -m benchmarks.smollm_checkpoint --shape qwen2.5-0.5b --out loadtest_out/models/qwen25-05b-shape-random
    python -m benchmarks.smollm_checkpoint --shape qwen2.5-1.5b --architecture Qwen2ForCausalLM \\
        --out loadtest_out/models/qwen25-15b-shape-random
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from kvserve.models.checkpoint_writer import (
    SPECIAL_TOKENS,
    decoder_shape,
    random_tensors,
    write_checkpoint,
    write_tokenizer,
)

SMOLLM_135M_SHAPE = decoder_shape(
    576,
    1536,
    30,
    9,
    3,
    vocab_size=49152,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
# Overrides of SMOLLM_135M_SHAPE for other real models' sizes (the 2048 positions and 1e-5 norm epsilon kept).
SHAPES: dict[str, dict] = {
    "smollm-135m": {},
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        head_dim=64,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        head_dim=128,
    ),
}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def ascii_bpe_vocab(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a byte-level BPE whose multi-byte tokens are printable ASCII."""
    from tokenizers import pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    # Printable ASCII maps to itself in the byte-level alphabet, except space -> "Ġ".
    symbols = [chr(c) for c in range(0x21, 0x7F)] + ["\u0120"]
    merges: list[tuple[str, str]] = []
    pairs = itertools.product(symbols, repeat=2)
    triples = ((a + b, c) for a, b, c in itertools.product(symbols, repeat=3))
    for left, right in itertools.chain(pairs, triples):
        if len(vocab) == vocab_size:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    if len(vocab) != vocab_size:
        raise ValueError(f"cannot build {vocab_size} tokens from printable ASCII")
    return vocab, merges


def ascii_bpe_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = ascii_bpe_vocab(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def save_tokenizer(path: Path, vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, ascii_bpe_tokenizer(vocab_size))
    return PreTrainedTokenizerFast.from_pretrained(path)


def build_smollm_like(
    path: str | Path,
    seed: int = 0,
    dtype: str = "bfloat16",
    architecture: str = "LlamaForCausalLM",
    **overrides,
) -> Path:
    """Write the checkpoint to `path` unless a complete one is already there."""
    path = Path(path)
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    shape = {**SMOLLM_135M_SHAPE, **overrides}
    config = {
        "architectures": [architecture],
        "model_type": MODEL_TYPES[architecture],
        "dtype": dtype,
        **shape,
    }
    write_checkpoint(
        path,
        config,
        random_tensors(config, seed=seed, dtype=dtype),
        ascii_bpe_tokenizer(shape["vocab_size"]),
    )
    (path / "loadtest_checkpoint.json").write_text(
        json.dumps({"seed": seed, "shape": shape}) + "\n"
    )
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.smollm_checkpoint", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, default=Path("loadtest_out/models/smollm-135m-random"))
    p.add_argument("--shape", choices=SHAPES, default="smollm-135m")
    p.add_argument("--architecture", choices=MODEL_TYPES, default="LlamaForCausalLM")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    print(
        build_smollm_like(
            args.out,
            seed=args.seed,
            dtype=args.dtype,
            architecture=args.architecture,
            **SHAPES[args.shape],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
