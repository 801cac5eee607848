"""Benchmark prompts: synthetic random, ShareGPT files, and shared-prefix groups.

Every generator is deterministic in its seed. Prompts are token-id lists when
the endpoint accepts them (`/v1/completions`), so their lengths are exact; for
text-only endpoints (chat) the ids are decoded and re-encoded until the text
has the requested length under the server's tokenizer (or an estimate of it).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvserve.loadtest.token_source import TokenSource

log = logging.getLogger(__name__)

# Same filters as common ShareGPT benchmarks: skip tiny and very long turns.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str | list[int]  # token ids when lengths must be exact
    prompt_len: int  # tokens (an estimate when the token source is approximate)
    output_len: int  # max_tokens (and min_tokens when EOS is ignored)
    prefix_group: int | None = None  # prompts in one group share a prefix


def sample_lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    """Uniform integers in [mean * (1 - r), mean * (1 + r)], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


def _random_ids(rng: np.random.Generator, source: TokenSource, n: int) -> list[int]:
    pool = source.pool_ids
    return [pool[i] for i in rng.integers(0, len(pool), size=n)]


def _text_of_length(rng: np.random.Generator, source: TokenSource, token_ids: list[int]) -> str:
    """Text that re-encodes to len(token_ids) tokens (a few fix-up rounds)."""
    target = len(token_ids)
    text = source.decode(token_ids)
    if not source.is_exact:
        return text
    for _ in range(5):
        ids = source.encode(text)
        if len(ids) == target:
            break
        # Decoding then encoding merges or splits tokens; trim or pad and retry.
        ids = (
            ids[:target] if len(ids) > target else ids + _random_ids(rng, source, target - len(ids))
        )
        text = source.decode(ids)
    return text


def _make_prompt(
    rng: np.random.Generator, source: TokenSource, prefix: list[int], body: list[int], as_text: bool
) -> tuple[str | list[int], int]:
    if not as_text:
        return prefix + body, len(prefix) + len(body)
    # decode() is deterministic, so all prompts of a group start with the same text.
    text = (source.decode(prefix) if prefix else "") + _text_of_length(rng, source, body)
    return text, (source.count(text) if source.is_exact else len(prefix) + len(body))


def random_requests(
    source: TokenSource,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    as_text: bool = False,
) -> list[BenchRequest]:
    """Random-token prompts; an optional prefix of `prefix_len` is shared by all."""
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, input_len, range_ratio, num_requests)
    out_lens = sample_lengths(rng, output_len, range_ratio, num_requests)
    prefix = _random_ids(rng, source, prefix_len)
    requests = []
    for in_len, out_len in zip(in_lens, out_lens):
        prompt, n = _make_prompt(rng, source, prefix, _random_ids(rng, source, in_len), as_text)
        requests.append(BenchRequest(prompt, n, out_len, 0 if prefix_len else None))
    return requests


def translation_requests(
    source: TokenSource,
    num_requests: int,
    source_len: int,
    target_ratio: float,
    range_ratio: float = 0.0,
    seed: int = 0,
    as_text: bool = False,
) -> list[BenchRequest]:
    """Translation-shaped requests: random source texts of about `source_len` tokens, each
    answered by round(target_ratio * its own length) tokens (a target follows its source's length,
    as a translation does)."""
    if not 0 < target_ratio <= 16:
        raise ValueError(f"target ratio must be in (0, 16], got {target_ratio}")
    rng = np.random.default_rng(seed)
    requests = []
    for length in sample_lengths(rng, source_len, range_ratio, num_requests):
        prompt, n = _make_prompt(rng, source, [], _random_ids(rng, source, length), as_text)
        requests.append(BenchRequest(prompt, n, max(1, round(target_ratio * length))))
    return requests


def prefix_repetition_requests(
    source: TokenSource,
    num_requests: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    num_groups: int = 4,
    range_ratio: float = 0.0,
    seed: int = 0,
    as_text: bool = False,
) -> list[BenchRequest]:
    """`num_groups` long prefixes, each shared by ~num_requests/num_groups prompts.

    Each prompt is its group's prefix (exactly `prefix_len` tokens) followed by
    a unique random suffix. Groups are interleaved in a seeded random order, so
    a prefix cache sees hits spread over the whole run.
    """
    if prefix_len < 1 or num_groups < 1:
        raise ValueError(
            f"need prefix_len >= 1 and num_groups >= 1, got {prefix_len}, {num_groups}"
        )
    rng = np.random.default_rng(seed)
    prefixes = [_random_ids(rng, source, prefix_len) for _ in range(num_groups)]
    suffix_lens = sample_lengths(rng, suffix_len, range_ratio, num_requests)
    out_lens = sample_lengths(rng, output_len, range_ratio, num_requests)
    groups = rng.permutation([i % num_groups for i in range(num_requests)]).tolist()
    requests = []
    for group, s_len, out_len in zip(groups, suffix_lens, out_lens):
        body = _random_ids(rng, source, s_len)
        prompt, n = _make_prompt(rng, source, prefixes[group], body, as_text)
        requests.append(BenchRequest(prompt, n, out_len, group))
    return requests


def _first_exchange(conversation: dict) -> tuple[str, str] | None:
    """(first human turn, the reply after it) of one ShareGPT record."""
    turns = conversation.get("conversations") or conversation.get("messages") or []
    texts = [(t.get("from") or t.get("role"), t.get("value") or t.get("content")) for t in turns]
    for (role, text), (next_role, reply) in zip(texts, texts[1:]):
        if role in ("human", "user") and next_role in ("gpt", "assistant", "chatgpt"):
            if isinstance(text, str) and isinstance(reply, str):
                return text, reply
    return None


def sharegpt_requests(
    path: str | Path,
    source: TokenSource,
    num_requests: int,
    seed: int = 0,
    output_len: int | None = None,
) -> list[BenchRequest]:
    """First human turn as the prompt, the reply's token count as output length.

    `output_len` overrides the reply length. Conversations are shuffled with
    the seed; if fewer than `num_requests` pass the length filters, they repeat.
    """
    with open(path, encoding="utf-8") as f:
        records = json.load(f)
    rng = np.random.default_rng(seed)
    requests: list[BenchRequest] = []
    for idx in rng.permutation(len(records)).tolist():
        exchange = _first_exchange(records[idx])
        if exchange is None:
            continue
        prompt, reply = exchange
        prompt_len = source.count(prompt)
        out_len = output_len if output_len is not None else source.count(reply)
        if prompt_len < SHAREGPT_MIN_LEN or out_len < (1 if output_len else SHAREGPT_MIN_LEN):
            continue
        if prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + out_len > SHAREGPT_MAX_TOTAL_LEN:
            continue
        requests.append(BenchRequest(prompt, prompt_len, out_len))
        if len(requests) == num_requests:
            return requests
    if not requests:
        raise ValueError(f"no usable conversations in {path}")
    log.warning("%s has only %d usable conversations; repeating them", path, len(requests))
    return [requests[i % len(requests)] for i in range(num_requests)]
