"""Reasoning parsers: split a thinking model's `<think>...</think>` text from its answer.

`--reasoning-parser` picks one (`deepseek_r1`, `qwen3`), or `auto` finds it from the chat
template where that is unambiguous. The answer alone is what tool-call and structured-output
parsing see; the thinking becomes `reasoning_content` (chat), a reasoning item (responses) or a
`thinking` block (messages).

Where the output starts is read from the rendered prompt: a template that opens a think block
(DeepSeek-R1's `<think>\\n` after the assistant tag) starts the output inside it, and one that
closes it (Qwen3 with `enable_thinking: false` renders an empty `<think>\\n\\n</think>`) starts it
in the answer. Otherwise `qwen3` starts in the answer and enters reasoning only if the output
opens with `<think>`; `deepseek_r1` starts in reasoning (its older templates leave `<think>` to
the model). Thinking cut off before `</think>` (max_tokens) is all reasoning. A constrained output
(a grammar from response_format or an enforced tool_choice) starts in the answer: the grammar
decides its first token.

`ReasoningStreamer` does the work piece by piece, holding back text that may be the start of a
marker; `split` feeds it the whole text, so a stream and a whole response always agree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger("kvserve.server")

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """A family's thinking format: its markers and where an output starts without a hint."""

    name: str
    starts_in_reasoning: bool  # when the prompt neither opens nor closes a think block
    start: str = THINK_START
    end: str = THINK_END

    def initial_state(
        self, prompt_text: str, is_constrained: bool = False
    ) -> Literal["open", "reasoning"]:
        """ "reasoning" when the output starts inside a think block, else "open" (an answer that
        may still open one with the start marker)."""
        if is_constrained:
            return "open"
        opened = prompt_text.rfind(self.start)
        if opened >= 0 and prompt_text.rfind(self.end) < opened:
            tail = prompt_text[opened + len(self.start) :]
            if not tail.strip():  # the prompt ends inside the block it opened
                return "reasoning"
        elif opened >= 0:  # the prompt closed the block (thinking turned off)
            return "open"
        return "reasoning" if self.starts_in_reasoning else "open"


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_in_reasoning=True),
    "qwen3": ReasoningParser("qwen3", starts_in_reasoning=False),
}


def detect_reasoning_parser(template: str | None) -> str | None:
    """The parser a chat template implies (`--reasoning-parser auto`), None when there is no
    think marker or the family cannot be told."""
    if not template or THINK_END not in template:
        return None
    if "<|im_start|>" in template or "enable_thinking" in template:
        return "qwen3"
    if "<｜Assistant｜>" in template:
        return "deepseek_r1"
    logger.warning(
        "the chat template mentions %s but its family is unknown: no reasoning parser "
        "(set --reasoning-parser deepseek_r1 or qwen3)",
        THINK_END,
    )
    return None


def resolve_reasoning_parser(setting: str, template: str | None) -> ReasoningParser | None:
    """`--reasoning-parser` (auto, none or a name) as a parser."""
    name = (
        detect_reasoning_parser(template)
        if setting == "auto"
        else None
        if setting == "none"
        else setting
    )
    return REASONING_PARSERS[name] if name is not None else None


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningStreamer:
    """One choice's text as (reasoning, answer) pieces. The answer's leading whitespace after
    `</think>` is dropped; `has_reasoning` says whether any think block was entered."""

    def __init__(self, parser: ReasoningParser, state: Literal["open", "reasoning"]) -> None:
        self.parser = parser
        self.state: Literal["open", "reasoning", "after", "answer"] = state
        self.has_reasoning = state == "reasoning"
        self.is_reasoning_ended = False
        self.buffer = ""
        self.at_block_start = (
            state == "reasoning"
        )  # a model may repeat the start marker the prompt gave

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) that are safe to send now."""
        self.buffer += text
        reasoning, answer = "", ""
        while self.buffer:
            if self.state == "open":
                stripped = self.buffer.lstrip()
                if stripped.startswith(self.parser.start):
                    self.buffer = stripped[len(self.parser.start) :]
                    self.state, self.has_reasoning, self.at_block_start = "reasoning", True, True
                    continue
                if self.parser.start.startswith(
                    stripped
                ):  # whitespace or part of the marker so far
                    break
                self.state = "answer"
            elif self.state == "reasoning":
                if self.at_block_start:
                    stripped = self.buffer.lstrip()
                    if self.parser.start.startswith(stripped):
                        break
                    self.buffer = stripped.removeprefix(self.parser.start).lstrip()
                    self.at_block_start = (
                        not self.buffer
                    )  # the marker alone so far: whitespace may follow
                    continue
                end = self.buffer.find(self.parser.end)
                if end >= 0:
                    reasoning += self.buffer[:end]
                    self.buffer = self.buffer[end + len(self.parser.end) :]
                    self.state, self.is_reasoning_ended = "after", True
                    continue
                keep = _held_back(self.buffer, self.parser.end)
                reasoning += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            elif self.state == "after":  # whitespace between the block and the answer is dropped
                self.buffer = self.buffer.lstrip()
                if self.buffer:
                    self.state = "answer"
            else:
                answer += self.buffer
                self.buffer = ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What was held back: unfinished thinking is reasoning, the rest answer."""
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest if self.state in ("open", "answer") else ""


def split_reasoning(
    parser: ReasoningParser, state: Literal["open", "reasoning"], text: str
) -> tuple[str | None, str, bool]:
    """(reasoning or None, answer, whether the think block ended) of a whole output."""
    streamer = ReasoningStreamer(parser, state)
    reasoning, answer = streamer.feed(text)
    rest_reasoning, rest_answer = streamer.finish()
    reasoning += rest_reasoning
    return (
        (reasoning if streamer.has_reasoning else None),
        answer + rest_answer,
        streamer.is_reasoning_ended,
    )


def num_reasoning_tokens(
    token_ids: list[int], decode: Callable[[list[int]], str], end: str, is_ended: bool
) -> int:
    """How many of `token_ids` belong to the reasoning: up to the one that completes `end`
    (all of them when it never came). A binary search over decoded prefixes: O(log n) decodes."""
    if not is_ended:
        return len(token_ids)
    low, high = 1, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if end in decode(token_ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return low
