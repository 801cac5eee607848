"""Where prompt tokens come from: a local tokenizer, the server's, or a guess.

Datasets need three things: a pool of token ids to draw random prompts from,
`encode` (to measure and trim text), and `decode` (to turn ids into text for
endpoints that only take text, like chat). In order of preference:

1. `--tokenizer PATH`: a local `transformers` tokenizer (exact, fast).
2. The server's `/tokenize` + `/detokenize` (kvserve and vLLM have them): exact,
   one HTTP call per operation.
3. A fallback for servers with neither: token-id prompts drawn from ids
   1..255 (valid in any real vocabulary), and lengths of text estimated at
   4 characters per token. Only text prompts (chat, ShareGPT) are approximate.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import httpx

log = logging.getLogger(__name__)

# Tokenized to find ids that are surely valid on a server we only know by API.
_POOL_CORPUS = (
    "The quick brown fox jumps over the lazy dog while the server streams tokens. "
    "Paged attention stores keys and values in blocks; continuous batching admits "
    "new requests at every step. Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 2048, "
    "punctuation ! ? ; : , . ( ) [ ] { } - + = / and words such as river, mountain, "
    "library, engine, window, garden, question, answer, morning, evening, silver, "
    "orange, violet, thunder, whisper, journey, harbor, lantern, meadow, puzzle."
)
_FALLBACK_WORDS = _POOL_CORPUS.split()


class TokenSource(ABC):
    """Encode/decode plus the id pool that random prompts are sampled from."""

    name: str = "abstract"
    is_exact: bool = True  # False: encode() only estimates a length
    pool_ids: list[int]

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, token_ids: list[int]) -> str: ...

    def count(self, text: str) -> int:
        return len(self.encode(text))


class LocalTokenSource(TokenSource):
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # heavy import, only when asked for

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.name = f"local:{path}"
        special = set(self.tokenizer.all_special_ids)
        self.pool_ids = [i for i in range(len(self.tokenizer)) if i not in special]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)  # type: ignore[return-value]  # a list of ids decodes to a str


class ServerTokenSource(TokenSource):
    """Uses POST /tokenize and /detokenize (the vLLM request/response shape)."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str]) -> None:
        self.client = httpx.Client(base_url=base_url, headers=headers, timeout=30.0)
        self.model = model
        self.name = f"server:{base_url}/tokenize"
        try:
            self.pool_ids = sorted(set(self.encode(_POOL_CORPUS)))
            if not self.pool_ids:
                raise ValueError("/tokenize returned no tokens for the pool corpus")
        except Exception:
            self.client.close()
            raise

    def encode(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        resp = self.client.post("/tokenize", json=body)
        resp.raise_for_status()
        return list(resp.json()["tokens"])

    def decode(self, token_ids: list[int]) -> str:
        resp = self.client.post("/detokenize", json={"model": self.model, "tokens": token_ids})
        resp.raise_for_status()
        return resp.json()["prompt"]


class FallbackTokenSource(TokenSource):
    """No tokenizer at all: token-id prompts stay exact, text is estimated."""

    name = "fallback (ids 1..255, ~4 chars/token)"
    is_exact = False

    def __init__(self) -> None:
        self.pool_ids = list(range(1, 256))

    def encode(self, text: str) -> list[int]:
        # A length estimate only; the ids carry no meaning.
        return [0] * max(1, round(len(text) / 4))

    def decode(self, token_ids: list[int]) -> str:
        # About one token per short word; deterministic in the ids.
        return " ".join(_FALLBACK_WORDS[i % len(_FALLBACK_WORDS)] for i in token_ids)


def resolve_token_source(
    tokenizer_path: str | None, base_url: str, model: str, headers: dict[str, str]
) -> TokenSource:
    """--tokenizer if given, else the server's /tokenize if it works, else the fallback."""
    if tokenizer_path:
        return LocalTokenSource(tokenizer_path)
    try:
        return ServerTokenSource(base_url, model, headers)
    except (httpx.HTTPError, KeyError, ValueError, TypeError) as exc:
        log.warning("server has no usable /tokenize (%s); using the fallback token source", exc)
        return FallbackTokenSource()
