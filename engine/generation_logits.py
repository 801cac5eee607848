"""The generation-config processors (`GenerationConstraints`) on a step's logits, as transformers'
`generate()` applies them: `no_repeat_ngram_size`, `bad_words_ids`, `min_length` /
`min_new_tokens` (EOS banned) and `forced_bos_token_id` / `forced_eos_token_id`.

Each step the host works out, from each constrained row's tokens (the runner's `InputBatch`), the
(row, token) pairs to ban and the rows whose next token is forced; the device then gets one
indexed fill for every ban and one for every forced row. A batch with no constrained row builds
nothing (a host-side check).

Logprobs follow transformers' processed scores, which beam search ranks by: a banned token's is
-inf and the others keep the model's own log-probability (not renormalized over what is left); a
forced token's is 0. The renormalization the sampler's log-softmax would make is undone by a
per-row `logprob_shift` [B] that it adds to the logprobs it returns.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from kvserve.engine.sampling_params import GenerationConstraints


def banned_ngram_tokens(tokens: np.ndarray, size: int) -> np.ndarray:
    """Tokens that would repeat an n-gram of `size` already in `tokens` [L] (transformers'
    NoRepeatNGramLogitsProcessor): those that followed an earlier occurrence of the last size-1 tokens."""
    if size <= 0 or len(tokens) < size:  # (no n-gram yet)
        return tokens[:0]
    if size == 1:
        return tokens
    windows = sliding_window_view(tokens, size)  # [L - size + 1, size]
    match = (windows[:, :-1] == tokens[len(tokens) - size + 1 :]).all(axis=1)
    return windows[match, -1]


def banned_bad_words(tokens: np.ndarray, bad_words: tuple[tuple[int, ...], ...]) -> list[int]:
    """The last token of each bad word whose other tokens end `tokens` (a one-token word: always)."""
    banned = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix == 0 or (
            len(tokens) >= prefix and tokens[len(tokens) - prefix :].tolist() == list(word[:-1])
        ):
            banned.append(word[-1])
    return banned


def row_plan(
    c: GenerationConstraints,
    tokens: np.ndarray,
    num_output: int,
    max_tokens: int,
    eos_token_ids: tuple[int, ...],
) -> tuple[list[int] | None, list[int]]:
    """(forced token ids or None, banned token ids) for the next token of one sequence of
    `tokens` [L] (prompt + output; a decoder's tokens) with `num_output` generated so far.
    transformers' order: the forced processors come last, so forcing wins over any ban, and
    forced EOS over forced BOS."""
    if c.forced_eos_token_ids and num_output == max_tokens - 1:
        return list(c.forced_eos_token_ids), []
    if c.forced_bos_token_id is not None and len(tokens) == 1:
        return [c.forced_bos_token_id], []
    banned: list[int] = []
    if len(tokens) < c.min_length or num_output < c.min_new_tokens:
        banned += eos_token_ids
    if c.no_repeat_ngram_size:
        banned += banned_ngram_tokens(tokens, c.no_repeat_ngram_size).tolist()
    if c.bad_words_ids:
        banned += banned_bad_words(tokens, c.bad_words_ids)
    return None, banned


ConstrainedRow = tuple[int, int, GenerationConstraints, int, tuple[int, ...]]


def apply_constraints(
    logits: torch.Tensor,
    rows: list[ConstrainedRow],
    token_ids: np.ndarray,
    num_tokens: np.ndarray,
    num_prompt_tokens: np.ndarray,
    with_shift: bool,
) -> torch.Tensor | None:
    """Ban and force, in place, for `rows`: (logits row, batch row, constraints, max_tokens, eos
    ids) of each constrained row of `logits` [B, V]. Returns the logprob shift [B] when `with_shift`
    (None: no row changed)."""
    bans: list[tuple[int, int]] = []  # (row, token id)
    forced: list[tuple[int, int]] = []
    for row, i, c, max_tokens, eos in rows:
        tokens = token_ids[i, : num_tokens[i]]
        forced_ids, banned = row_plan(
            c, tokens, int(num_tokens[i] - num_prompt_tokens[i]), max_tokens, eos
        )
        if forced_ids is not None:
            forced += [(row, t) for t in forced_ids]
        else:
            bans += [(row, t) for t in banned]
    if not bans and not forced:
        return None
    device = logits.device
    ban_rows = torch.tensor(sorted({r for r, _ in bans}), dtype=torch.int64, device=device)
    forced_rows = torch.tensor(sorted({r for r, _ in forced}), dtype=torch.int64, device=device)
    if with_shift and bans:
        before = torch.logsumexp(logits.index_select(0, ban_rows).float(), dim=-1)  # [R]
    if bans:
        index = torch.tensor(bans, dtype=torch.int64, device=device).T  # [2, N]
        logits.index_put_(
            (index[0], index[1]), torch.tensor(float("-inf"), dtype=logits.dtype, device=device)
        )
    if forced:
        logits.index_fill_(0, forced_rows, float("-inf"))
        index = torch.tensor(forced, dtype=torch.int64, device=device).T
        logits.index_put_(
            (index[0], index[1]), torch.tensor(0.0, dtype=logits.dtype, device=device)
        )
    if not with_shift:
        return None
    shift = torch.zeros(logits.shape[0], dtype=torch.float32, device=device)
    if bans:  # undo the renormalization: logprob = logit - logsumexp(logits before the bans)
        shift[ban_rows] = torch.logsumexp(logits.index_select(0, ban_rows).float(), dim=-1) - before
    if forced:  # a forced token's logprob is 0 (transformers sets its score to 0)
        shift[forced_rows] = torch.logsumexp(logits.index_select(0, forced_rows).float(), dim=-1)
    return shift
