"""Engine logprobs (`dict[token_id, Logprob]` per token) in OpenAI's two response formats.

Legacy completions: parallel lists `tokens`, `token_logprobs`, `top_logprobs` (text -> logprob,
the k most likely plus the chosen token) and `text_offset` (character offset of each token in
the choice's `text`). A token whose bytes are not valid UTF-8 on their own (a piece of a
multi-byte character) is named `bytes:\\xNN...` there, as OpenAI does, so that such pieces
do not all collide on "\ufffd". Chat: `content: [{token, logprob, bytes, top_logprobs: [k entries]}]`.
"""

from __future__ import annotations

import codecs
import math
import re
from typing import Any

from kvserve.server.protocol import CompletionLogprobs, TokenLogprob, TopLogprob

_MIN_LOGPROB = -9999.0  # JSON has no -inf
_HEX_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable alphabet, inverted: character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table: dict[str, int] = {}
    num_shifted = 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + num_shifted)] = byte
            num_shifted += 1
    return table


_BYTE_LEVEL = _byte_level_decoder()


def clamp_logprob(value: float) -> float:
    if math.isnan(value):
        return _MIN_LOGPROB
    return max(float(value), _MIN_LOGPROB)


class TokenText:
    """Per-token text and raw bytes, cached (one per tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.is_byte_level = "ByteLevel" in type(decoder).__name__ or "ByteLevel" in repr(decoder)
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._keys: dict[int, str] = {}

    def text(self, token_id: int, logprob: Any = None) -> str:
        decoded = getattr(logprob, "decoded_token", None)
        if decoded is not None:
            return decoded
        text = self._text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._text[token_id] = text
        return text

    def bytes(self, token_id: int, text: str) -> list[int]:
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        result = None
        if isinstance(raw, str):
            if self.is_byte_level and all(ch in _BYTE_LEVEL for ch in raw):
                result = [_BYTE_LEVEL[ch] for ch in raw]
            elif (match := _HEX_BYTE_TOKEN.match(raw)) is not None:
                result = [int(match.group(1), 16)]
        if result is None:
            result = list(text.encode("utf-8"))
        self._bytes[token_id] = result
        return result

    def key(self, token_id: int, logprob: Any = None) -> str:
        """The token's name in legacy `tokens`/`top_logprobs`: its text, or `bytes:\\xNN...` (OpenAI's
        convention) when its bytes are not valid UTF-8 on their own."""
        key = self._keys.get(token_id)
        if key is None:
            text = self.text(token_id, logprob)
            raw = bytes(self.bytes(token_id, text))
            try:
                raw.decode("utf-8")
                key = text
            except UnicodeDecodeError:
                key = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._keys[token_id] = key
        return key


class TextOffsets:
    """Character offsets of tokens in a choice's text, fed one token at a time.

    A token's offset is the number of characters its predecessors' bytes complete, so the
    pieces of one multi-byte character share that character's offset. The state lives across
    calls: a stream that splits a character between two chunks reports what the whole
    response reports. Special tokens count only where the text shows them: in generated text
    unless `skip_special_tokens`; in a known `text` (an echoed prompt) where it holds them.
    """

    def __init__(
        self,
        token_text: TokenText,
        skip_special_tokens: bool,
        start: int = 0,
        text: str | None = None,
    ) -> None:
        self.token_text = token_text
        self.skip_special_tokens = skip_special_tokens
        self.text = text
        self.num_chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, token_id: int, logprob: Any = None) -> int:
        """The offset of `token_id`, which then counts towards the next one's."""
        offset = self.num_chars
        text = self.token_text.text(token_id, logprob)
        if token_id in self.token_text.special_ids:
            is_shown = (
                self.text.startswith(text, offset)
                if self.text is not None
                else not self.skip_special_tokens
            )
            if is_shown:  # it ends a character left incomplete (shown as U+FFFD) before it starts
                offset = self.num_chars = self.num_chars + len(
                    self._decoder.decode(b"", final=True)
                )
                self.num_chars += len(text)
            return offset
        self.num_chars += len(self._decoder.decode(bytes(self.token_text.bytes(token_id, text))))
        return offset


def _top(entries: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    return sorted(entries.items(), key=lambda item: item[1].rank)[:k]


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Any] | None],
    num_top: int,
    token_text: TokenText,
    offsets: TextOffsets | None = None,
) -> CompletionLogprobs:
    """Legacy logprobs for `token_ids` (a `None` entry, e.g. a prompt's first token, reports nulls);
    `offsets` continues from the tokens before these (default: they start the text)."""
    result = CompletionLogprobs()
    offsets = offsets or TextOffsets(token_text, skip_special_tokens=True)
    for token_id, entries in zip(token_ids, logprobs):
        chosen = entries.get(token_id) if entries else None
        key = token_text.key(token_id, chosen)
        result.tokens.append(key)
        result.text_offset.append(offsets.next(token_id, chosen))
        if entries is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(clamp_logprob(chosen.logprob) if chosen is not None else None)
        top = {token_text.key(i, lp): clamp_logprob(lp.logprob) for i, lp in _top(entries, num_top)}
        if chosen is not None:
            top.setdefault(key, clamp_logprob(chosen.logprob))
        result.top_logprobs.append(top)
    return result


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Any] | None], num_top: int, token_text: TokenText
) -> list[TokenLogprob]:
    """Chat `logprobs.content` entries for `token_ids`."""
    content = []
    for token_id, entries in zip(token_ids, logprobs):
        entries = entries or {}
        chosen = entries.get(token_id)
        text = token_text.text(token_id, chosen)
        top = []
        for i, lp in _top(entries, num_top):
            top_text = token_text.text(i, lp)
            top.append(
                TopLogprob(
                    token=top_text,
                    logprob=clamp_logprob(lp.logprob),
                    bytes=token_text.bytes(i, top_text),
                )
            )
        content.append(
            TokenLogprob(
                token=text,
                logprob=clamp_logprob(chosen.logprob) if chosen is not None else _MIN_LOGPROB,
                bytes=token_text.bytes(token_id, text),
                top_logprobs=top,
            )
        )
    return content
