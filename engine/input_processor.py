"""Load the tokenizer; validate and tokenize a prompt into a `ProcessedPrompt`, without touching engine state.

Both the in-process `LLMEngine` and `AsyncLLM`'s server-side client use it: the server
process tokenizes and validates, and only what passed is sent to the engine core.
Imports no torch.

Big inputs stay off the event loop: `run_off_loop` runs tokenization (and chat-template
rendering) in a small thread pool. A thread is enough: transformers' fast tokenizers
encode through `encode_batch`, which releases the GIL while Rust works (a bare
`tokenizers.Tokenizer.encode` does not), and Jinja rendering only shares the GIL at the
interpreter's switch interval. `max_chars_per_token` bounds how many characters one token
can cover, so a prompt that cannot fit is refused before it is tokenized at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from kvserve.engine.config import RuntimeInfo
from kvserve.engine.lora_request import LoRARequest
from kvserve.engine.outputs import RequestOutputBuilder
from kvserve.engine.pooling_params import PoolingParams
from kvserve.engine.sampling_params import GenerationConstraints, SamplingParams

T = TypeVar("T")
# Inputs up to this many characters are tokenized on the caller's thread: so little work that a
# hop to a worker thread would cost more on a busy event loop.
INLINE_MAX_CHARS = 4096
MAX_TOKENIZER_THREADS = 4
# Canonical composition (NFC/NFKC) folds at most 4 code points into one character (Greek
# letters with three marks), so a composing normalizer multiplies the bound by this.
_MAX_CODE_POINTS_PER_COMPOSED_CHAR = 4
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
# Parts that keep every input character (Replace and Split are checked one by one); any
# other part may drop characters (StripAccents, Whitespace, Precompiled...) and voids the bound.
_KEEPING_NORMALIZERS = {"Sequence", "NFC", "NFKC", "NFD", "NFKD", "Lowercase", "Prepend", "Replace"}
_KEEPING_PRE_TOKENIZERS = {
    "Sequence",
    "ByteLevel",
    "Metaspace",
    "Digits",
    "UnicodeScripts",
    "Punctuation",
    "Split",
}


# A prompt: text, token ids, or (as vLLM takes them) a dict {"prompt": text} or
# {"prompt_token_ids": [...]}, optionally with "cache_salt" and "priority".
PromptType = str | Sequence[int] | dict[str, Any]
_PROMPT_KEYS = {"prompt", "prompt_token_ids"}


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A validated request, ready to be queued."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    # requests share cached KV blocks only with requests of the same salt (docs/security.md)
    cache_salt: str | None = None
    # encoder-decoder models: `prompt_token_ids` are the encoder's input, these the decoder's first tokens
    decoder_prompt_token_ids: list[int] | None = None
    priority: int = 0  # the priority scheduling policy runs lower values first
    # an embedding request (defaults resolved): its prompt is pooled, nothing is sampled (`params` is greedy)
    pooling: PoolingParams | None = None
    lora_request: LoRARequest | None = (
        None  # its LoRA adapter (docs/lora.md); None = the base model
    )

    def output_builder(self, request_id: str, arrival_time: float) -> RequestOutputBuilder:
        """What folds this request's deltas into `RequestOutput`s."""
        p = self.params
        return RequestOutputBuilder(
            request_id=request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            n=p.n,
            has_logprobs=p.logprobs is not None,
            has_prompt_logprobs=p.prompt_logprobs is not None,
            arrival_time=arrival_time,
        )


def check_cache_salt(cache_salt: Any) -> str | None:
    """`cache_salt` as vLLM accepts it: None, or a non-empty string; ValueError otherwise."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
    return cache_salt


def split_prompt(prompt: PromptType) -> tuple[str | Sequence[int], str | None]:
    """(text or token ids, cache salt) of a prompt; ValueError for a malformed prompt dict."""
    if not isinstance(prompt, dict):
        return prompt, None
    given = _PROMPT_KEYS & prompt.keys()
    unknown = prompt.keys() - _PROMPT_KEYS - {"cache_salt", "decoder_prompt_token_ids", "priority"}
    if len(given) != 1 or unknown:
        raise ValueError(
            f"a prompt dict takes exactly one of 'prompt' and 'prompt_token_ids', and optionally "
            f"'cache_salt', 'priority' (and, for an encoder-decoder model, 'decoder_prompt_token_ids'); "
            f"got {sorted(map(str, prompt))}"
        )
    (key,) = given
    value = prompt[key]
    if key == "prompt" and not isinstance(value, str):
        raise ValueError(f"'prompt' must be a string, got {type(value).__name__}")
    if key == "prompt_token_ids" and (
        isinstance(value, (str, bytes)) or not isinstance(value, Sequence)
    ):
        raise ValueError(f"'prompt_token_ids' must be a list of ints, got {type(value).__name__}")
    return value, check_cache_salt(prompt.get("cache_salt"))


def process_prompt(
    tokenizer: Any,
    info: RuntimeInfo,
    prompt: PromptType,
    params: SamplingParams | PoolingParams,
    max_chars_per_token: int | None = None,
) -> ProcessedPrompt:
    """Tokenize and validate; raises ValueError naming the bad value. With `max_chars_per_token`
    (see `max_chars_per_token()`), a text prompt that cannot fit is refused before tokenizing.
    `PoolingParams` make an embedding request."""
    if isinstance(params, PoolingParams):
        return process_pooling_prompt(tokenizer, info, prompt, params, max_chars_per_token)
    if info.task == "embed":
        raise ValueError(
            "this model serves embeddings only (task 'embed'): use /v1/embeddings or LLM.embed"
        )
    decoder_prompt = prompt.get("decoder_prompt_token_ids") if isinstance(prompt, dict) else None
    priority = prompt.get("priority", 0) if isinstance(prompt, dict) else 0
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    processed = _process_prompt(
        tokenizer, info, prompt, params, decoder_prompt, max_chars_per_token
    )
    return replace(processed, priority=priority) if priority else processed


def check_constraints(c: GenerationConstraints, vocab_size: int) -> None:
    """A request's own `generation_constraints`: sizes >= 0, ids within the vocabulary."""
    for name in ("no_repeat_ngram_size", "min_length", "min_new_tokens"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"generation_constraints.{name} must be an integer >= 0, got {value!r}"
            )
    ids = [
        *(t for word in c.bad_words_ids for t in word),
        *c.forced_eos_token_ids,
        *(() if c.forced_bos_token_id is None else (c.forced_bos_token_id,)),
    ]
    if any(not word for word in c.bad_words_ids) or any(
        isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in ids
    ):
        raise ValueError(
            f"generation_constraints: token ids must be in [0, {vocab_size}) and bad words "
            f"non-empty, got {c!r}"
        )


def _process_prompt(
    tokenizer: Any,
    info: RuntimeInfo,
    prompt: PromptType,
    params: SamplingParams,
    decoder_prompt: list[int] | None,
    max_chars_per_token: int | None,
) -> ProcessedPrompt:
    prompt, cache_salt = split_prompt(prompt)
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    params.validate()  # the caller may have mutated a validated object
    if params.generation_constraints is not None:
        check_constraints(params.generation_constraints, info.vocab_size)
    bad_bias = [t for t in params.logit_bias or () if t >= info.vocab_size]
    if bad_bias:
        raise ValueError(
            f"logit_bias token ids must be in [0, {info.vocab_size}), got {bad_bias[:5]}"
        )
    if isinstance(prompt, str):
        check_prompt_chars(
            len(prompt), params.max_tokens or 1, info.max_model_len, max_chars_per_token
        )
        text, token_ids = prompt, tokenizer.encode(prompt)
    else:
        text, token_ids = None, list(prompt)
        bad = [
            t
            for t in token_ids
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < info.vocab_size
        ]
        if bad:
            raise ValueError(
                f"prompt token ids must be ints in [0, {info.vocab_size}), got {bad[:5]}"
            )
    if not token_ids:
        raise ValueError("prompt must not be empty")
    if info.is_encoder_decoder:
        return _encoder_decoder_prompt(text, token_ids, params, cache_salt, info, decoder_prompt)
    if decoder_prompt is not None:
        raise ValueError("decoder_prompt_token_ids applies only to encoder-decoder models")
    num_prompt, limit = len(token_ids), info.max_model_len
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt
    if num_prompt + max_tokens > limit:
        raise ValueError(
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
            f"{num_prompt + max_tokens} exceeds the model's context length {limit}"
        )
    if max_tokens < 1:
        raise ValueError(
            f"prompt ({num_prompt} tokens) leaves no room to generate within "
            f"the context length {limit}"
        )
    capacity = info.kv_capacity_tokens
    if num_prompt + max_tokens > capacity:
        raise ValueError(
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) can never fit "
            f"in the KV cache ({capacity} tokens); raise kv_cache_memory or lower max_tokens"
        )
    return ProcessedPrompt(
        prompt=text,
        prompt_token_ids=token_ids,
        params=params,
        max_tokens=max_tokens,
        cache_salt=cache_salt,
    )


def process_pooling_prompt(
    tokenizer: Any,
    info: RuntimeInfo,
    prompt: PromptType,
    params: PoolingParams,
    max_chars_per_token: int | None = None,
) -> ProcessedPrompt:
    """An embedding request: its whole prompt within the context length and the KV cache."""
    if info.pooler is None:
        raise ValueError(
            f"{info.architecture} cannot compute embeddings (an encoder-decoder model)"
        )
    pooling = info.pooler.resolve(params)
    if isinstance(prompt, dict) and prompt.keys() - {"prompt", "prompt_token_ids", "cache_salt"}:
        raise ValueError(
            f"an embedding prompt dict takes 'prompt' or 'prompt_token_ids', got {sorted(prompt)}"
        )
    text, _ = split_prompt(prompt)
    limit, capacity = info.max_model_len, info.kv_capacity_tokens
    if isinstance(text, str):
        check_prompt_chars(len(text), 0, limit, max_chars_per_token)
    # the length checks below are an embedding's own (no output tokens): here only tokenize and check ids
    unbounded = replace(info, max_model_len=2**62, num_kv_blocks=2**62)
    greedy = SamplingParams(
        max_tokens=1, temperature=0.0
    )  # fills the runner's sampling row; nothing is sampled
    processed = _process_prompt(tokenizer, unbounded, prompt, greedy, None, None)
    num_prompt = len(processed.prompt_token_ids)
    if num_prompt > limit:
        raise PromptTooLongError(
            f"This model's maximum context length is {limit} tokens. However, your input "
            f"has {num_prompt} tokens. Please reduce the length of the input."
        )
    if num_prompt > capacity:
        raise ValueError(
            f"input ({num_prompt} tokens) can never fit in the KV cache ({capacity} tokens); "
            f"raise kv_cache_memory"
        )
    return replace(processed, pooling=pooling)


def _encoder_decoder_prompt(
    text: str | None,
    token_ids: list[int],
    params: SamplingParams,
    cache_salt: str | None,
    info: RuntimeInfo,
    decoder_prompt: Sequence[int] | None = None,
) -> ProcessedPrompt:
    """The prompt is the encoder's input (the source); the decoder starts from its start token, or
    from `decoder_prompt` (a prefix the output continues; it must begin with the start token).
    Both are bounded by the context length; together they must fit in the KV cache."""
    if params.prompt_logprobs is not None:
        raise ValueError(
            "prompt_logprobs is not supported for encoder-decoder models (the prompt is "
            "the encoder's input, which is not scored)"
        )
    if decoder_prompt is None:
        assert info.decoder_start_token_id is not None  # every encoder-decoder checkpoint has one
        decoder_prompt = [info.decoder_start_token_id]
    else:
        decoder_prompt = list(decoder_prompt)
        bad = [
            t
            for t in decoder_prompt
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < info.vocab_size
        ]
        if bad or not decoder_prompt or decoder_prompt[0] != info.decoder_start_token_id:
            raise ValueError(
                f"decoder_prompt_token_ids must be token ids in [0, {info.vocab_size}) starting "
                f"with the decoder start token {info.decoder_start_token_id}, got {decoder_prompt[:8]}"
            )
    num_source, limit = len(token_ids), info.max_model_len
    if num_source > limit:
        raise ValueError(
            f"the source ({num_source} tokens) exceeds the encoder's limit of {limit} tokens"
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(decoder_prompt)
    if len(decoder_prompt) + max_tokens > limit:
        raise ValueError(
            f"max_tokens ({max_tokens}) exceeds the decoder's context length {limit} "
            f"(less its {len(decoder_prompt)} start token)"
        )
    capacity = info.kv_capacity_tokens
    if num_source + len(decoder_prompt) + max_tokens > capacity:
        raise ValueError(
            f"source ({num_source} tokens) + max_tokens ({max_tokens}) can never fit in the KV "
            f"cache ({capacity} tokens); raise kv_cache_memory or lower max_tokens"
        )
    return ProcessedPrompt(
        prompt=text,
        prompt_token_ids=token_ids,
        params=params,
        max_tokens=max_tokens,
        cache_salt=cache_salt,
        decoder_prompt_token_ids=decoder_prompt,
    )


def check_prompt_chars(
    num_chars: int, max_tokens: int, max_model_len: int, max_chars_per_token: int | None
) -> None:
    """Refuse, before tokenizing, a prompt of `num_chars` characters that cannot fit with
    `max_tokens` more tokens: it is at least ceil(num_chars / max_chars_per_token) tokens.
    Raises PromptTooLongError (a ValueError) with the numbers; None disables the check."""
    if not max_chars_per_token:
        return
    min_prompt_tokens = -(-num_chars // max_chars_per_token)
    if min_prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{num_chars} characters, which is at least {min_prompt_tokens} tokens (no token covers more "
            f"than {max_chars_per_token} characters), and you requested {max_tokens} tokens in the "
            f"completion. Please reduce the length of the prompt or completion."
        )


class PromptTooLongError(ValueError):
    """A prompt that cannot fit in the context, found before or after tokenizing it."""


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most input characters one token of `tokenizer` can stand for, or None when no
    safe bound is known (slow tokenizers, models or normalizers that can drop characters).

    For BPE (GPT-2, Llama, Mistral, Qwen) every input character ends up in some token, and a
    token covers at most as many characters as its vocabulary entry has (byte-level entries
    spell one character per byte); added tokens match their literal text. Computed once at
    start-up: it reads the whole vocabulary.
    """
    backend: Any = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if model is None or type(model).__name__ != "BPE":
        return None  # WordPiece maps a too-long word to one [UNK]; Unigram fuses unknowns
    if model.unk_token is not None and model.fuse_unk and not model.byte_fallback:
        return None  # a run of unknown characters becomes one token
    normalizers = _components(backend.normalizer, "normalizers")
    pre_tokenizers = _components(backend.pre_tokenizer, "pretokenizers")
    if not all(_keeps_chars(n, _KEEPING_NORMALIZERS) for n in normalizers) or not all(
        _keeps_chars(p, _KEEPING_PRE_TOKENIZERS) for p in pre_tokenizers
    ):
        return None
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    is_composing = any(n.get("type") in _COMPOSING_NORMALIZERS for n in normalizers)
    return longest * (_MAX_CODE_POINTS_PER_COMPOSED_CHAR if is_composing else 1)


def _components(component: Any, list_key: str) -> list[dict[str, Any]]:
    """A tokenizers normalizer/pre-tokenizer as its JSON nodes, Sequences flattened."""
    if component is None:
        return []
    nodes, stack = [], [json.loads(component.__getstate__())]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.get(list_key) or [])
    return nodes


def _keeps_chars(node: dict[str, Any], keeping: set[str]) -> bool:
    kind = node.get("type")
    if (
        kind == "Replace"
    ):  # e.g. Llama's " " -> "▁"; a pattern replaced by less text drops characters
        pattern = node.get("pattern", {}).get("String")
        return pattern is not None and len(node.get("content", "")) >= len(pattern)
    if kind == "Split":  # Llama-3 / Qwen's regex split keeps its matches ("Isolated")
        return node.get("behavior") != "Removed"
    return kind in keeping


@functools.cache
def _tokenizer_executor() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(
        min(MAX_TOKENIZER_THREADS, os.cpu_count() or 1), thread_name_prefix="kvserve-tokenize"
    )


async def run_off_loop(fn: Callable[..., T], *args: Any, num_chars: int | None = None) -> T:
    """`fn(*args)` in the tokenizer thread pool, so the event loop goes on serving other
    streams; inline when the input is known to be small (`num_chars <= INLINE_MAX_CHARS`).
    A cancelled caller stops waiting; the thread finishes its call and the result is dropped."""
    if num_chars is not None and num_chars <= INLINE_MAX_CHARS:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(
        _tokenizer_executor(), functools.partial(fn, *args)
    )


# model_types for which AutoTokenizer loads a `tokenizer_class: PreTrainedTokenizerFast` checkpoint
# with that class itself (transformers 5 swaps in its own class for some others, e.g. qwen2).
_GENERIC_TOKENIZER_MODEL_TYPES = frozenset({"llama", "mistral", "qwen3", "gpt2"})
_GENERIC_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer, as `transformers.AutoTokenizer` picks it (its choice of class
    depends on config.json and the transformers version: both processes must agree).

    A checkpoint that names the generic fast tokenizer class is loaded with that class directly:
    the same object, without AutoTokenizer's import of transformers' config machinery (over a
    second of start-up; tests/test_hf_config.py checks the two agree). A GGUF file's tokenizer
    and chat template come from its metadata, converted by transformers once
    (models/gguf_metadata.py)."""
    if str(path).endswith(".gguf"):  # its metadata converted once into tokenizer files
        from kvserve.models.gguf_metadata import gguf_metadata_dir

        return _load_named_tokenizer(gguf_metadata_dir(path))
    if _names_generic_fast_tokenizer(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


def _load_named_tokenizer(path: Path) -> Any:
    """The class the directory's tokenizer_config.json names, loaded directly: AutoTokenizer would
    import transformers' config machinery, and with it torch (a GGUF file's converted tokenizer
    names its family's class, e.g. Qwen2Tokenizer)."""
    import transformers

    name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return (cls or transformers.AutoTokenizer).from_pretrained(path)


def _names_generic_fast_tokenizer(path: str) -> bool:
    def read(name: str) -> dict[str, Any]:
        try:
            value = json.loads((Path(path) / name).read_text())
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    tokenizer_config = read("tokenizer_config.json")
    return (
        tokenizer_config.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES
        and "auto_map" not in tokenizer_config
        and (Path(path) / "tokenizer.json").is_file()
        and read("config.json").get("model_type") in _GENERIC_TOKENIZER_MODEL_TYPES
    )
