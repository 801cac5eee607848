"""Incremental detokenization and stop strings for one generated sequence.

Text is produced with the prefix/read-offset scheme (as in TGI and vLLM): each
update decodes two short windows of ids, `ids[prefix:read]` (already emitted)
and `ids[prefix:]`, and emits the difference. Decoding a window rather than a
single token keeps decoder context (SentencePiece/Metaspace leading spaces,
byte-level BPE characters split over tokens). A window whose text ends in
U+FFFD is an unfinished UTF-8 character: nothing is emitted until it
completes, or until `finished=True`, which flushes whatever is left.

We do not use `tokenizers.decoders.DecodeStream`: it has no flush, so a
sequence that ends in an incomplete character (or an invalid byte) would lose
its tail, while `tokenizer.decode(all_ids)` shows it as U+FFFD.

The first output tokens are decoded with up to `PROMPT_CONTEXT_TOKENS` prompt
tokens as context, so the text is the continuation of the prompt (" world",
not "world", after "Hello" with a SentencePiece tokenizer). With an empty
prompt, or a byte-level BPE tokenizer, the final text equals
`tokenizer.decode(output_ids, skip_special_tokens=...)` (before stop truncation).

Known limit: SentencePiece `ByteFallback` decoders turn *every* byte of an
invalid run of <0xNN> tokens into U+FFFD, so an invalid byte can change text
that was valid (and already streamed) a moment earlier. Streamed text can then
differ from a full decode, but only for invalid UTF-8, which models rarely emit.

Stop strings are matched by `StopMatcher`, one KMP automaton per stop string fed
only the new text of each update: a step costs O(new text) per stop string
(amortized; O(new text + longest stop) at worst), never O(text so far x stop
length). Only the not-yet-emitted tail of the text is kept as a string; emitted
deltas are joined on demand, so appending is not quadratic either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# How many trailing prompt tokens seed the decode window (vLLM uses 5 as well).
PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, stopping at the first stop string.

    Invariants: `output_text` is the concatenation of every returned delta; it
    never contains a stop string (unless `include_stop_str`, in which case it
    ends with the one that matched) nor any text after one. While streaming,
    a tail of the text that could be the start of a stop string is held back
    and released once it cannot be (or when `finished=True`).
    """

    def __init__(
        self,
        tokenizer: Any,  # transformers.PreTrainedTokenizerFast (or anything with .decode)
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool,
        stop: Sequence[str],
        include_stop_str: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skip_special_tokens = skip_special_tokens
        self._stop = StopMatcher(stop) if any(stop) else None
        self._include_stop_str = include_stop_str

        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_INCOMPLETE):
            context = []  # the prompt ends mid-character: decode the output on its own
        self._ids: list[int] = context  # decode window: ids[0:read] already emitted
        self._read_offset = len(context)
        self._pending = ""  # decoded text not emitted yet: the held-back tail
        self._emitted: list[str] = []  # every delta returned so far
        self._is_done = False
        self._token_texts: dict[int, str] = {}
        self._anchor: tuple[list[int], str] | None = None
        self.stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """What update() has returned so far."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> str:
        """Add generated ids; return the text that is now safe to emit ("" if none).

        After a stop string matched (`stop_reason` set) or after `finished=True`,
        further calls return "".
        """
        if self._is_done:
            return ""
        new_text = self._decode_new(new_token_ids, flush=finished)
        text = self._pending + new_text  # the held tail (at most the longest stop - 1) + new
        if self._stop is not None and new_text:
            match = self._stop.feed(new_text)
            if match is not None:
                stop_end, stop = match  # the stop ends at new_text[stop_end]
                end = len(text) - len(new_text) + stop_end
                # without include_stop_str the whole stop is in `text`: its head was held back
                text = text[: end if self._include_stop_str else end - len(stop)]
                self.stop_reason = stop
                finished = True
        end = len(text)
        if not finished and not self._include_stop_str and self._stop is not None:
            end -= self._stop.num_held_chars
        delta, self._pending = text[:end], text[end:]
        if delta:
            self._emitted.append(delta)
        self._is_done = finished
        return delta

    def decode_token(self, token_id: int) -> str:
        """Text of one token for logprob entries (special tokens shown, leading space kept)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._decode_after_anchor(token_id)
            self._token_texts[token_id] = text
        return text

    # ---- decoding ----

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool | None = None) -> str:
        skip = self._skip_special_tokens if skip_special_tokens is None else skip_special_tokens
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip)
        return self._tokenizer.decode(
            list(ids), skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )

    def _decode_new(self, new_token_ids: Sequence[int], flush: bool) -> str:
        """Append ids to the window and return the newly completed text."""
        self._ids.extend(new_token_ids)
        prefix_text = self._decode(self._ids[: self._read_offset])
        full_text = self._decode(self._ids)
        if len(full_text) <= len(prefix_text):
            if full_text == prefix_text:
                self._read_offset = len(self._ids)  # ids without text (skipped specials)
            return ""
        if full_text.endswith(_INCOMPLETE) and not flush:
            return ""  # wait for the rest of the character
        # The emitted ids become the next window's prefix context.
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _decode_after_anchor(self, token_id: int) -> str:
        """decode([anchor, token]) minus decode([anchor]): keeps the leading space that
        SentencePiece-style decoders strip from the first token of a decode call."""
        if self._anchor is None:
            anchor_ids = self._tokenizer.encode("a", add_special_tokens=False)[-1:]
            self._anchor = (anchor_ids, self._decode(anchor_ids, skip_special_tokens=False))
        anchor_ids, anchor_text = self._anchor
        if anchor_ids and anchor_text and _INCOMPLETE not in anchor_text:
            text = self._decode([*anchor_ids, token_id], skip_special_tokens=False)
            if text.startswith(anchor_text):
                return text[len(anchor_text) :]
        return self._decode([token_id], skip_special_tokens=False)


class StopMatcher:
    """Finds the first stop string in a text fed piece by piece, in time linear in the text.

    One Knuth-Morris-Pratt automaton per stop string: its state is the length of the
    longest suffix of the text fed so far that is a proper prefix of that stop. So
    `num_held_chars` (the longest tail that could still become a stop) is the largest
    state, and a match is found when a state reaches its stop's length. Each feed
    looks at each new character once per stop (a C-level `find` skips to the stop's
    first character while no match is in progress), plus failure-link steps that are
    O(1) amortized and O(longest stop) in one feed at worst.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._failure = [_failure_links(s) for s in self.stops]
        self._states = [0] * len(self.stops)
        self.num_chars_scanned = 0  # characters looked at by every feed (for tests)

    @property
    def num_held_chars(self) -> int:
        return max(self._states, default=0)

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over `text`; if a stop string completes in it, `(end, stop)` with
        `text[:end]` ending in `stop`: the one that ends first, the longest on a tie
        (the earliest start). After a match the matcher must not be fed again."""
        best: tuple[int, str] | None = None
        for i, stop in enumerate(self.stops):
            end = self._advance(i, text)
            if end is not None and (best is None or (end, -len(stop)) < (best[0], -len(best[1]))):
                best = (end, stop)
        return best

    def _advance(self, i: int, text: str) -> int | None:
        stop, failure, state = self.stops[i], self._failure[i], self._states[i]
        pos, num_scanned = 0, 0
        while pos < len(text):
            if state == 0:  # no match in progress: jump to the next possible start
                found = text.find(stop[0], pos)
                num_scanned += (found if found >= 0 else len(text)) - pos
                if found < 0:
                    break
                pos = found
            char = text[pos]
            while state and stop[state] != char:
                state = failure[state - 1]
                num_scanned += 1
            if stop[state] == char:
                state += 1
            pos += 1
            num_scanned += 1
            if state == len(stop):
                self._states[i] = state
                self.num_chars_scanned += num_scanned
                return pos
        self._states[i] = state
        self.num_chars_scanned += num_scanned
        return None


def _failure_links(stop: str) -> list[int]:
    """KMP failure function: links[k] is the longest proper border of stop[:k + 1]."""
    links = [0] * len(stop)
    k = 0
    for j in range(1, len(stop)):
        while k and stop[j] != stop[k]:
            k = links[k - 1]
        if stop[j] == stop[k]:
            k += 1
        links[j] = k
    return links
