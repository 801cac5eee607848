"""The runner's side of speculative decoding (engine/spec_decode/proposer.py): score every draft position.

A speculating request's chunk is its last token followed by its K drafts; the model's outputs at
those 1 + K positions give K + 1 logits rows, each sampled with the request's own settings (the
sampling tensors repeated per row; a seeded request's row i draws at stream position
num_output + i, exactly where decoding one token at a time would draw it). Drafts are accepted
while each equals the token sampled at its position; the token sampled after the last accepted
draft is the step's new token. Other requests keep one row each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import overload

import numpy as np
import torch

from kvserve.engine.worker.sampler import SamplingTensors


@dataclass(frozen=True, slots=True)
class SpecRows:
    """The logits rows of a step in which some requests verify drafts."""

    num_drafts: np.ndarray  # [B] drafts per request (0: an ordinary row)
    row_req: np.ndarray  # [R] the request of each logits row
    first_row: np.ndarray  # [B] each request's first logits row; its draft rows follow
    offsets: np.ndarray  # [R] position of each row within its request's rows
    hidden_rows: np.ndarray  # [R] the rows of the step's hidden states they score

    @property
    def last_row(self) -> np.ndarray:  # [B] each request's last logits row
        return self.first_row + self.num_drafts


def spec_rows(cu_seqlens: np.ndarray, num_drafts: np.ndarray) -> SpecRows:
    """Rows for requests whose chunks end at cu_seqlens[1:] and carry `num_drafts` drafts each."""
    counts = num_drafts + 1
    row_req = np.repeat(np.arange(len(counts)), counts)
    first_row = np.cumsum(counts) - counts
    offsets = np.arange(len(row_req)) - first_row[row_req]
    hidden_rows = (cu_seqlens[1:] - 1 - num_drafts)[row_req] + offsets
    return SpecRows(num_drafts, row_req, first_row, offsets, hidden_rows)


def expand_sampling(
    t: SamplingTensors,
    rows: SpecRows,
    is_seeded: np.ndarray,
    drafts: list[tuple[int, ...]],
    device: torch.device,
) -> SamplingTensors:
    """Sampling tensors of rows 0..B-1 repeated for the R logits rows (host flags unchanged). A draft
    row's penalty counts include the drafts before it: its logits are those after them."""
    idx = torch.from_numpy(rows.row_req).to(device)

    @overload
    def pick(x: torch.Tensor) -> torch.Tensor: ...
    @overload
    def pick(x: torch.Tensor | None) -> torch.Tensor | None: ...
    def pick(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.index_select(0, idx)

    seeded = np.flatnonzero(is_seeded[rows.row_req])
    return replace(
        t,
        temperature=pick(t.temperature),
        top_k=pick(t.top_k),
        top_p=pick(t.top_p),
        min_p=pick(t.min_p),
        repetition_penalty=pick(t.repetition_penalty),
        presence_penalty=pick(t.presence_penalty),
        frequency_penalty=pick(t.frequency_penalty),
        seeds=pick(t.seeds),
        seeded_rows=torch.from_numpy(seeded).to(device) if len(seeded) else None,
        steps=pick(t.steps) + torch.from_numpy(rows.offsets).to(device),
        suppressed_token_ids=pick(t.suppressed_token_ids),
        prompt_mask=pick(t.prompt_mask),
        output_counts=None
        if t.output_counts is None
        else add_drafts(pick(t.output_counts), rows, drafts),
    )


def add_drafts(counts: torch.Tensor, rows: SpecRows, drafts: list[tuple[int, ...]]) -> torch.Tensor:
    """counts [R, V] + one for each draft before each row (row first + m sees drafts 1..m)."""
    pairs = [
        (first + m, draft)
        for first, ds in zip(rows.first_row.tolist(), drafts)
        for i, draft in enumerate(ds)
        for m in range(i + 1, len(ds) + 1)
    ]
    if pairs:
        index = torch.tensor(pairs, dtype=torch.int64, device=counts.device).T
        counts.index_put_(
            (index[0], index[1]), torch.ones(len(pairs), device=counts.device), accumulate=True
        )
    return counts


def accept(
    token_ids: np.ndarray, rows: SpecRows, drafts: list[tuple[int, ...]]
) -> tuple[list[int], list[int]]:
    """(the new token of each request, its number of accepted drafts) from the tokens sampled at
    every row [R]; `drafts[i]` are request i's drafts (() for an ordinary row)."""
    new_tokens, num_accepted = [], []
    for i, first in enumerate(rows.first_row.tolist()):
        j = 0
        for draft in drafts[i]:
            if int(token_ids[first + j]) != draft:
                break
            j += 1
        new_tokens.append(int(token_ids[first + j]))
        num_accepted.append(j)
    return new_tokens, num_accepted
