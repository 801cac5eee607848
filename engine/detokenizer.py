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
"""

from __future__ import annotations

from collections.abc import Sequence

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
        tokenizer,  # transformers.PreTrainedTokenizerFast (or anything with .decode)
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool,
        stop: Sequence[str],
        include_stop_str: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skip_special_tokens = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop_str = include_stop_str

        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_INCOMPLETE):
            context = []  # the prompt ends mid-character: decode the output on its own
        self._ids: list[int] = context  # decode window: ids[0:read] already emitted
        self._read_offset = len(context)
        self._text = ""  # all decoded output text (truncated at a stop string)
        self._is_done = False
        self._token_texts: dict[int, str] = {}
        self._anchor: tuple[list[int], str] | None = None

        self.output_text = ""  # what update() has returned so far
        self.stop_reason: str | None = None

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> str:
        """Add generated ids; return the text that is now safe to emit ("" if none).

        After a stop string matched (`stop_reason` set) or after `finished=True`,
        further calls return "".
        """
        if self._is_done:
            return ""
        old_len = len(self._text)
        self._text += self._decode_new(new_token_ids, flush=finished)
        if self._stop and self._truncate_at_stop(old_len):
            finished = True
        end = len(self._text)
        if not finished and not self._include_stop_str:
            end -= self._num_held_chars()
        delta = self._text[len(self.output_text) : end]
        self.output_text += delta
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

    # ---- stop strings ----

    def _truncate_at_stop(self, old_len: int) -> bool:
        """Cut the text at the stop string that completes first; True if one matched.

        Only text from old_len - (len(stop) - 1) on can hold a new match: anything
        earlier was checked by a previous update.
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stop:
            start = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if start != -1:
                match = (start + len(stop), start, stop)
                best = match if best is None else min(best, match)
        if best is None:
            return False
        end, start, stop = best
        self._text = self._text[: end if self._include_stop_str else start]
        self.stop_reason = stop
        return True

    def _num_held_chars(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self._text
        for k in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(stop.startswith(tail) for stop in self._stop):
                return k
        return 0
