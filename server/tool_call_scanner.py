"""Find tool calls in JSON text while it is still being generated, so that their arguments stream.

A call is a JSON object `{"name": ..., "arguments": ...}` (Llama 3 says `parameters`), either
alone, one after another (Llama 3's `;`, Hermes' `<tool_call>` blocks) or as the items of one
top-level array (Mistral, `tool_choice: "required"`). `CallScanner.feed` reads only the
characters it has not seen yet and records, for each call, its name once the name's string is
complete and where the raw text of its arguments starts and (so far) ends. Text outside JSON
values (markers, separators) is skipped. The scanner does not validate: the finished output is
parsed properly (server/tool_parsers.py) and the scan only says which raw slice was generated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(slots=True)
class ScannedCall:
    name: str | None = None
    args_start: int | None = None  # where the arguments' value starts in the text
    args_end: int = 0  # one past its last non-space character seen so far
    is_complete: bool = False  # the call object has closed

    def arguments(self, text: str) -> str | None:
        """The raw arguments generated so far; None while unknown or when they are a JSON string
        (that string's content is the arguments, known only once it closes)."""
        if self.args_start is None or text[self.args_start] == '"':
            return None
        return text[self.args_start : self.args_end]


class CallScanner:
    def __init__(self, start: int = 0) -> None:
        self.pos = start  # next character to read
        self.calls: list[ScannedCall] = []
        self._stack: list[str] = []  # open containers, "{" or "["
        self._call_depth = 0  # len(stack) inside the current call object; 0 = none open
        self._in_string = self._escape = False
        self._string_start = 0
        self._is_key = False  # the next string at call depth is a key
        self._key: str | None = None  # the key whose value is being read
        self._value_start: int | None = None

    def feed(self, text: str) -> list[ScannedCall]:
        """Scan `text` (the whole output so far: it only grows) from where the last call stopped."""
        for i in range(self.pos, len(text)):
            self._step(text, i, text[i])
        self.pos = len(text)
        return self.calls

    def _step(self, text: str, i: int, ch: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                self._string_closed(text, i)
            self._extend_value(i)
            return
        depth = len(self._stack)
        at_call = self._call_depth and depth == self._call_depth
        if depth == 0 and ch not in "{[":
            return  # text between calls
        if ch.isspace():
            return
        if at_call and ch in ",}":
            self._end_value()
            if ch == ",":
                self._is_key = True
            else:
                self.calls[-1].is_complete = True
                self._call_depth = 0
                self._stack.pop()
            return
        if at_call and ch == ":":
            self._value_start = None
            return
        if at_call and self._value_start is None and not self._is_key and self._key is not None:
            self._value_start = (
                i  # a value begins (a string, a number, a literal, an object or an array)
            )
            if self._key in ARGUMENT_KEYS:
                self.calls[-1].args_start = i
        if ch in "{[":
            if ch == "{" and not self._call_depth and self._stack in ([], ["["]):
                self.calls.append(ScannedCall())
                self._call_depth, self._is_key, self._key = depth + 1, True, None
            self._stack.append(ch)
        elif ch in "}]":
            if self._stack:
                self._stack.pop()
        elif ch == '"':
            self._in_string, self._string_start = True, i
        self._extend_value(i)

    def _extend_value(self, i: int) -> None:
        call = self.calls[-1] if self._call_depth else None
        if (
            call is not None
            and self._value_start is not None
            and call.args_start == self._value_start
        ):
            call.args_end = i + 1

    def _string_closed(self, text: str, i: int) -> None:
        if not self._call_depth or len(self._stack) != self._call_depth:
            return
        raw = text[self._string_start : i + 1]
        if self._is_key:
            self._key, self._is_key = _decode(raw), False
        elif self._key == "name" and self._value_start == self._string_start:
            name = _decode(raw)
            self.calls[-1].name = name if isinstance(name, str) else None

    def _end_value(self) -> None:
        self._key, self._value_start = None, None


def _decode(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return None
