"""The benchmark model: a random Llama shaped like SmolLM-135M, built locally (no download).

hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536, vocab 49152, tied
embeddings. Its tokenizer is a word-level vocabulary of 49152 entries ("t0",
"t1", ...), so every token id decodes to text and detokenization costs what it
would with a real vocabulary. The text it produces is meaningless.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SMOLLM_135M_SHAPE = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
    max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
    bos_token_id=1, eos_token_id=2,
)


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    hf.save_pretrained(path)


def make_bench_model(path: str | Path, seed: int = 0) -> str:
    """Create (once) the SmolLM-135M-shaped random checkpoint at `path`; returns the path."""
    import torch
    import transformers

    path = Path(path)
    marker = path / "config.json"
    if marker.exists() and json.loads(marker.read_text()).get("hidden_size") == 576:
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path, SMOLLM_135M_SHAPE["vocab_size"])
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SMOLLM_135M_SHAPE)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path", nargs="?", default="bench_out/smollm-135m-random")
    print(make_bench_model(parser.parse_args().path))
