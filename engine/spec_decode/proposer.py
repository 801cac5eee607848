"""Speculative decoding: propose a few tokens per decoding request, verify them all in one step.

At batch 1 a decode step reads every weight once to make one token; a step that also scores K
proposed tokens reads the same weights. So the scheduler asks a proposer for up to K draft
tokens per eligible request (`propose_for`), schedules the request's last token plus the drafts
as one chunk, and the runner samples the target model at every one of those positions. The
drafts are accepted while each equals the token sampled at its position; the first sampled token
that differs (or the one after the last draft) is kept too. Since every position is sampled from
the target model's own distribution given the accepted tokens before it, the output is exactly
what decoding one token at a time would give: the same tokens for greedy and seeded requests, the
same distribution otherwise. (For a proposer that puts all its probability on one token, this
sample-and-compare is the rejection sampling of Leviathan et al.: accept with probability p(d),
else draw from p without d.)

Configured as vLLM's users write it: `speculative_config={"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}` or `{"method":
"draft_model", "model": DIR, ...}` (a dict offline, JSON for `--speculative-config` /
`KVSERVE_SPECULATIVE_CONFIG`). Plain Python: the scheduler runs it (a draft model's forward lives
behind `Proposer.draft`, in engine/spec_decode/draft_model.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvserve.engine.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from kvserve.engine.core.request import Request

# A verification that accepts nothing pauses the request's drafts for 2, 4, 8, ... up to 64 steps
# (reset by one that accepts): rejected drafts cost little each, but need not cost often.
FIRST_BACKOFF_STEPS = 2
MAX_BACKOFF_STEPS = 64


def ngram_proposal(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: the up to `k` tokens that followed an earlier occurrence of the sequence's last
    n tokens, trying n from `n_max` down to `n_min`; [] when nothing matches. The occurrence is the
    latest one that k tokens follow, else the earliest (in a repeating run the latest occurrences
    overlap the end and leave fewer tokens to propose)."""
    length = len(token_ids)
    if k < 1 or length < n_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = tokens[length - n :]
        # windows starting at 0 .. length - n - 1: every earlier occurrence, overlapping ones included
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            full = hits[hits + n + k <= length]
            start = int(full[-1] if len(full) else hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


class Proposer:
    """Drafts for the scheduler: which requests speculate this step and what they propose."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def propose_for(self, request: Request, num_running: int, budget: int) -> list[int]:
        """Draft tokens for a request about to decode one token; [] when it should not speculate."""
        c = self.config
        if num_running > c.max_batch_size or not eligible(request):
            return []
        if request.spec_skip:
            request.spec_skip -= 1
            return []
        # never past max_tokens or the context: the step adds the accepted drafts plus one token
        room = min(
            c.num_speculative_tokens,
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        drafts = self.draft(request, room) if room > 0 else []
        if (
            drafts and request.structured is not None
        ):  # only what the grammar allows, short of its end
            drafts = drafts[: request.structured.valid_drafts(drafts)]
        return drafts

    def release(self, request_id: str) -> None:
        """The request finished or was preempted (a draft model frees its draft K/V)."""

    def draft(self, request: Request, k: int) -> list[int]:
        """Up to k draft tokens to follow the request's tokens (the method's own part: n-gram lookup
        here, a draft model in engine/spec_decode/draft_model.py)."""
        c = self.config
        return ngram_proposal(request.all_token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)

    @staticmethod
    def record(request: Request, num_accepted: int) -> None:
        """After a verification: a request whose drafts were all rejected pauses them (back-off)."""
        if num_accepted:
            request.spec_backoff = 0
        else:
            request.spec_skip = request.spec_backoff or FIRST_BACKOFF_STEPS
            request.spec_backoff = min(2 * request.spec_skip, MAX_BACKOFF_STEPS)


def eligible(request: Request) -> bool:
    """Whether a request may speculate now: not one that opted out, and not while min_tokens bans
    its stop ids or EOS (the ban holds for some draft rows and not for others), nor one with
    generation-config processors (they hold per row of its own tokens)."""
    p = request.params
    if request.constraints is not None:
        return False
    bans = bool(p.stop_token_ids) or (not p.ignore_eos and bool(request.eos_token_ids))
    return p.speculative and not (bans and request.num_output_tokens < p.min_tokens)
