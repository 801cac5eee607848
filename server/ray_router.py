"""Prefix-affinity routing for kvserve replicas on Ray Serve, in plain Python (no Ray import).

The ingress reduces each request's prompt to `prefix_hashes`: chained hashes of its first
characters, one per `CHUNK_CHARS` (about one 16-token KV block of English text). A
`PrefixAffinity` remembers which replicas served which hashes and ranks the replicas for a
new request: first the replica holding the longest matching prefix, unless it is busy (its
queue is more than `max_imbalance` requests longer than the least-loaded replica's); otherwise
the least-loaded replicas. `server.ray_serve.PrefixAffinityRouter` plugs it into Ray Serve.

Characters, not tokens: tokenizing in the router would tokenize every prompt a second time,
in the one ingress process, with the tokenizer loaded there too. Equal text prefixes give
equal token prefixes up to the boundary token, so the proxy costs at most one block.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, TypeVar

CHUNK_CHARS = 64
MAX_CHUNKS = 64  # hash at most the first 4096 characters
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")

R = TypeVar("R", bound=Hashable)


def _text_of(content: Any) -> str:
    """The text of a message's content: a string, or the `text` of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            if isinstance(part, dict) and isinstance(part.get("text"), str)
            else ""
            for part in content
        )
    return ""


def routing_text(body: Any) -> str:
    """The text a request's prefix affinity is computed on: the prompt of a completion (the
    first one of a batch; token ids as decimal text) or the roles and texts of chat messages.
    Anything malformed gives "" (no affinity); the replica answers it with its own 400."""
    if not isinstance(body, dict):
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(
            f"{m.get('role', '')}\n{_text_of(m.get('content'))}\n"
            for m in messages
            if isinstance(m, dict)
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return ",".join(map(str, prompt))
    return ""


def prefix_hashes(
    text: str, chunk_chars: int = CHUNK_CHARS, max_chunks: int = MAX_CHUNKS
) -> list[int]:
    """Chained 64-bit hashes of the full `chunk_chars` chunks of `text` (at most `max_chunks`):
    hash i covers the first (i + 1) * chunk_chars characters, so equal hashes mean equal prefixes."""
    if chunk_chars < 1 or max_chunks < 0:
        raise ValueError(
            f"need chunk_chars >= 1 and max_chunks >= 0, got {chunk_chars}, {max_chunks}"
        )
    hashes = []
    parent = b""
    for i in range(min(len(text) // chunk_chars, max_chunks)):
        chunk = text[i * chunk_chars : (i + 1) * chunk_chars].encode("utf-8", "surrogatepass")
        parent = hashlib.blake2b(parent + chunk, digest_size=8).digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes


class PrefixAffinity:
    """Which replicas hold which prompt prefixes, and the ranking that follows from it.

    `holders` maps a prefix hash to the replicas that served it, most recent first (at most
    `max_holders`: a prefix that overflowed to a second replica is then cached on both). The
    map is an LRU bounded by `max_entries` hashes. Replicas are any hashable ids.
    """

    def __init__(
        self, max_imbalance: int, max_entries: int = 100_000, max_holders: int = 2
    ) -> None:
        if max_imbalance < 0 or max_entries < 1 or max_holders < 1:
            raise ValueError(
                f"need max_imbalance >= 0, max_entries >= 1, max_holders >= 1, got "
                f"{max_imbalance}, {max_entries}, {max_holders}"
            )
        self.max_imbalance = max_imbalance
        self.max_entries = max_entries
        self.max_holders = max_holders
        self._holders: OrderedDict[int, list[Any]] = OrderedDict()
        self._num_ties = 0

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, hashes: Sequence[int], loads: Mapping[R, int]) -> tuple[R | None, int]:
        """(the least-loaded replica in `loads` holding the longest prefix, its length in chunks)."""
        for depth in range(len(hashes), 0, -1):
            holders = [r for r in self._holders.get(hashes[depth - 1], ()) if r in loads]
            if holders:
                return min(holders, key=loads.__getitem__), depth
        return None, 0

    def rank(
        self, candidates: Sequence[R], queue_lens: Mapping[R, int | None], hashes: Sequence[int]
    ) -> list[list[R]]:
        """Ranks of replicas to try, best first. An unknown queue length counts as 0."""
        if not candidates:
            return []
        loads: dict[R | None, int] = {r: queue_lens.get(r) or 0 for r in candidates}
        least = min(loads.values())
        preferred, _ = self.match(hashes, loads)
        if preferred is not None and loads[preferred] - least <= self.max_imbalance:
            rest = sorted((r for r in candidates if r != preferred), key=loads.__getitem__)
            return [[preferred], rest] if rest else [[preferred]]
        least_loaded = [r for r in candidates if loads[r] == least]
        turn = self._num_ties % len(
            least_loaded
        )  # unrelated requests take equally loaded replicas in turn
        least_loaded = least_loaded[turn:] + least_loaded[:turn]
        self._num_ties += 1
        rest = sorted((r for r in candidates if loads[r] != least), key=loads.__getitem__)
        return [least_loaded, rest] if rest else [least_loaded]

    def record(self, hashes: Sequence[int], replica: Hashable) -> None:
        """`replica` now holds these prefixes (called once a request is sent to it)."""
        for h in hashes:
            holders = self._holders.pop(h, [])
            if replica in holders:
                holders.remove(replica)
            holders.insert(0, replica)
            del holders[self.max_holders :]
            self._holders[h] = holders
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """Drop a replica that is gone (its cache went with it)."""
        for h in list(self._holders):
            holders = self._holders[h]
            if replica in holders:
                holders.remove(replica)
                if not holders:
                    del self._holders[h]
