"""The built-in default model that kvserve serves when no `--model` is given.

`ensure_default_model()` returns a directory holding a normal Hugging Face
checkpoint (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json with a ChatML `chat_template`), so every
code path treats it like any downloaded model. It is built from code on first
use and cached on disk:

* tokenizer: byte-level BPE (GPT-2 style, ~2k tokens) trained with `tokenizers`
  on `models/default_corpus.txt`: a few KB of public-domain English (Aesop's
  fables after *The Aesop for Children* (1919), the Gettysburg Address, the
  preamble of the Declaration of Independence, traditional nursery rhymes, and
  a short passage about the seasons). Special tokens: `<|endoftext|>` (id 0),
  `<|im_start|>`, `<|im_end|>`; both `<|endoftext|>` and `<|im_end|>` are EOS.
* model: a 4-layer Llama (hidden 256, 4 heads, 2 KV heads, intermediate 768,
  max 2048 positions, untied embeddings, ~3.5M parameters). It is not trained by
  gradient descent (too slow for a few seconds on two cores). Instead the
  embeddings and LM head are a rank-255 factorization (seeded randomized SVD) of
  smoothed bigram log-probabilities counted on the corpus, plus ChatML-wrapped
  copies of its paragraphs; one spare hidden dimension evens out the embedding
  norms so the final RMSNorm scales every row alike. The decoder layers have
  seeded random weights with small output projections, so they run for real
  (attention over the KV cache changes the logits a little) without drowning
  the bigram signal.

What its text looks like: a bigram model of the corpus. Sampled text is real
English words and phrases from the fables and rhymes stitched together without
sense ("The fox was walking summer's content. If he visited a great fall. He
stepped back..."); greedy decoding quickly loops ("and the tortoise, and the
tortoise, ..."). Chat replies usually end with `<|im_end|>` after a sentence or
a few. It knows nothing else; it exists so the server starts and streams
plausible text with no network and no download.

Building takes about a second. The bytes are deterministic (fixed seeds, one
thread for the fit, sorted JSON keys); a different torch/LAPACK build or CPU
may round the SVD differently, which is why the cache directory is versioned
by recipe (`DEFAULT_MODEL_NAME`), not by content.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.models.checkpoint_writer import SPECIAL_TOKENS, decoder_shape, write_checkpoint

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_NAME = "default-model-v1"  # bump when the recipe changes: caches are keyed by it
CORPUS_PATH = Path(__file__).with_name("default_corpus.txt")
VOCAB_SIZE = 2048
MODEL_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    **decoder_shape(
        256,
        768,
        4,
        4,
        2,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        dtype="float32",
    ),
)
WEIGHT_SEED = 1234
BIGRAM_SMOOTHING = 0.5  # pseudo-count mass per row spread over the unigram distribution
LAYER_OUT_SCALE = 0.05  # each layer's output rms relative to the residual stream's
CHAT_PROMPTS = [
    "Tell me a story.",
    "Say something.",
    "What do you know?",
    "Hello!",
    "Write a few lines.",
]


def default_cache_root() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve")


def built_default_model(cache_dir: str | None = None) -> str | None:
    """The default model's directory if it has been built, else None (cheap: no torch import)."""
    root = Path(cache_dir) if cache_dir else default_cache_root()
    final = root / DEFAULT_MODEL_NAME
    return str(final) if (final / "model.safetensors").is_file() else None


def ensure_default_model(cache_dir: str | None = None) -> str:
    """Directory of the default model under `cache_dir` (default `$KVSERVE_CACHE_DIR` or
    `~/.cache/kvserve`), building it first if needed. Safe with concurrent callers: each
    builds in a private temp dir and renames it into place; the first rename wins."""
    built = built_default_model(cache_dir)
    if built is not None:
        return built
    root = Path(cache_dir) if cache_dir else default_cache_root()
    final = root / DEFAULT_MODEL_NAME
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=root))
    try:
        build_default_model(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def build_default_model(out_dir: str | os.PathLike) -> None:
    """Write the whole checkpoint into `out_dir` (deterministic for a given machine)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = CORPUS_PATH.read_text(encoding="utf-8")
    tokenizer = _train_tokenizer(text)
    config = dict(MODEL_CONFIG, vocab_size=tokenizer.get_vocab_size())
    state = _fit_weights(config, _training_stream(tokenizer, text))
    _write_checkpoint(out, config, tokenizer, state)


def _train_tokenizer(text: str):
    return train_bytelevel_bpe(_paragraphs(text), VOCAB_SIZE)


def train_bytelevel_bpe(texts: list[str], vocab_size: int):
    """A GPT-2-style byte-level BPE `tokenizers.Tokenizer` trained on `texts`, with
    `SPECIAL_TOKENS` first (ids 0, 1, 2). Deterministic; also used by the tests."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def _training_stream(tokenizer, text: str) -> torch.Tensor:
    """The text the bigram statistics are counted on: documents separated by <|endoftext|>,
    then the same paragraphs as ChatML replies."""
    import torch  # only building needs it: finding a built model must stay light

    eos = tokenizer.token_to_id("<|endoftext|>")
    pieces = []
    paragraphs = [p for p in _paragraphs(text) if len(p) > 80]
    for paragraph in paragraphs:
        pieces += tokenizer.encode(paragraph).ids + [eos]
    for i, paragraph in enumerate(paragraphs):
        # No "\n" after <|im_end|> (unlike the template): in a bigram model "\n" would then
        # predict <|im_start|> right after "assistant\n" instead of the reply's first word.
        chat = (
            f"<|im_start|>user\n{CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}<|im_end|>"
            f"<|im_start|>assistant\n{paragraph[:400]}<|im_end|>"
        )
        pieces += tokenizer.encode(chat).ids + [eos]
    return torch.tensor(pieces, dtype=torch.int64)


def _bigram_logprobs(stream: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Smoothed next-token log-probabilities [V, V], each row centered (softmax-invariant)."""
    import torch  # only building needs it: finding a built model must stay light

    counts = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
    counts.index_put_(
        (stream[:-1], stream[1:]), torch.ones(len(stream) - 1, dtype=torch.float64), accumulate=True
    )
    unigram = torch.bincount(stream, minlength=vocab_size).double() + 1.0
    probs = counts + BIGRAM_SMOOTHING * unigram / unigram.sum()  # unseen pairs fall back to unigram
    logp = (probs / probs.sum(1, keepdim=True)).log()
    return logp - logp.mean(1, keepdim=True)


def _fit_weights(config: dict, stream: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights: a bigram model in the embeddings/LM head, near-identity layers."""
    import torch  # only building needs it: finding a built model must stay light

    vocab, hidden = config["vocab_size"], config["hidden_size"]
    logp = _bigram_logprobs(stream, vocab)  # [V, V]
    rank = hidden - 1
    # Rank hidden-1 factorization logp ~= E @ W.T. Randomized SVD: seeded, one thread, so the
    # bytes do not depend on the caller's RNG state or core count.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.random.fork_rng():
            torch.manual_seed(WEIGHT_SEED)
            u, s, v = torch.svd_lowrank(logp, q=rank + 8, niter=3)
    finally:
        torch.set_num_threads(threads)
    vh = v.T
    emb = u[:, :rank] * s[:rank].sqrt()  # [V, rank]
    head = vh[:rank].T * s[:rank].sqrt()  # [V, rank]
    # The last hidden dim pads every embedding row to the same norm, so the final RMSNorm
    # scales all rows alike; the head is scaled to undo it: logits == E @ W.T exactly.
    norms = emb.norm(dim=1, keepdim=True)
    radius = float(norms.max()) * 1.05
    emb = torch.cat(
        [emb, (radius**2 - norms**2).sqrt()], dim=1
    )  # [V, hidden], rows of norm `radius`
    head = torch.cat([head, torch.zeros(vocab, 1, dtype=head.dtype)], dim=1) * (
        radius / hidden**0.5
    )
    gen = torch.Generator().manual_seed(WEIGHT_SEED)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    out_scale = LAYER_OUT_SCALE * (radius / hidden**0.5)  # target rms of a layer's output
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    inter = config["intermediate_size"]
    state = {
        "model.embed_tokens.weight": emb.float(),
        "lm_head.weight": head.float(),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden, std=hidden**-0.5),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden, std=hidden**-0.5),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden, std=hidden**-0.5),
            # Small outputs: the layers nudge the residual stream (so attention affects the
            # logits a little) without drowning the bigram signal.
            p + "self_attn.o_proj.weight": rand(
                hidden, heads * head_dim, std=out_scale / (heads * head_dim) ** 0.5
            ),
            p + "mlp.gate_proj.weight": rand(inter, hidden, std=hidden**-0.5),
            p + "mlp.up_proj.weight": rand(inter, hidden, std=hidden**-0.5),
            p + "mlp.down_proj.weight": rand(hidden, inter, std=out_scale / inter**0.5),
        }
    return state


def _write_checkpoint(out: Path, config: dict, tokenizer, state: dict[str, torch.Tensor]) -> None:
    write_checkpoint(out, config, sorted(state.items()), tokenizer)
    (out / "README.md").write_text(
        f"# kvserve {DEFAULT_MODEL_NAME}\n\nBuilt by `models/default_model.py`; its docstring says what this is.\n"
    )
