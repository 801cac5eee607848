"""Per-row changes to the step's logits before the sampler: `logit_bias`, then the generation
config's processors (engine/generation_logits.py), then grammar bitmasks.

Each touches only the rows that need them, batched (one indexed add for every biased row,
one masking call for every constrained row), and all run before the sampler, so
temperature, top-k/top-p/min-p and penalties then work inside what is left.
Bias comes first so that a +100 bias cannot re-allow a token the grammar forbids.
An unconstrained, unbiased batch builds nothing: the check is three host-side values.
Logprobs returned to the user are those of the logits after these changes (after the
generation config's, transformers' processed scores: `logprob_shift`).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.engine.core.step_record import GrammarBitmask
from kvserve.engine.generation_logits import apply_constraints
from kvserve.engine.spec_decode.verify import SpecRows
from kvserve.engine.worker.input_batch import InputBatch
from kvserve.models import cpu_ops


class LogitsProcessors:
    def __init__(self, batch: InputBatch, device: torch.device) -> None:
        self.batch = batch
        self.device = device
        self._bias_key: tuple[int, int] | None = None  # (rows_version, num_rows) of the cached bias
        self._bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._constrained_key: tuple[int, int] | None = None
        self._constrained: list[int] = []  # batch rows with generation-config processors
        # [B or R] added by the sampler to the logprobs it returns (generation_logits.py); None: nothing
        self.logprob_shift: torch.Tensor | None = None

    def __call__(
        self,
        logits: torch.Tensor,
        grammar: GrammarBitmask | None,
        num_rows: int,
        spec: SpecRows | None = None,
    ) -> torch.Tensor:
        """`logits` [B, V] for rows 0..B-1 of the batch (with `spec`, a speculative step's [R, V]:
        several rows per speculating request); modified in place and returned."""
        self.logprob_shift = None
        if spec is not None:
            return self._expanded(logits, grammar, num_rows, spec)
        bias = self._bias_tensors(num_rows)
        if bias is not None:
            rows, ids, values = bias
            logits.index_put_((rows, ids), values.to(logits.dtype), accumulate=True)
        self._constrain(logits, num_rows, None)
        if grammar is not None:
            apply_bitmask(logits, grammar, self.device)
        return logits

    def _expanded(
        self, logits: torch.Tensor, grammar: GrammarBitmask | None, num_rows: int, spec: SpecRows
    ) -> torch.Tensor:
        """Bias on every row of a biased request; the grammar bitmask, which `step_bitmask` already
        made one row per logits row (`GrammarBitmask.expanded`)."""
        per_row = self.batch.logit_bias[:num_rows]
        biased = [(r, per_row[i]) for r, i in enumerate(spec.row_req.tolist()) if per_row[i]]
        if biased:
            rows = torch.tensor([r for r, pairs in biased for _ in pairs], device=self.device)
            ids = torch.tensor([t for _, pairs in biased for t, _ in pairs], device=self.device)
            values = torch.tensor([b for _, pairs in biased for _, b in pairs], device=self.device)
            logits.index_put_((rows, ids), values.to(logits.dtype), accumulate=True)
        self._constrain(logits, num_rows, spec)
        if grammar is not None:
            apply_bitmask(logits, grammar, self.device)
        return logits

    def _constrain(self, logits: torch.Tensor, num_rows: int, spec: SpecRows | None) -> None:
        """The generation config's bans and forced tokens (a constrained request never speculates:
        with `spec`, its one logits row is its first)."""
        b = self.batch
        key = (b.rows_version, num_rows)
        if key != self._constrained_key:
            self._constrained_key = key
            self._constrained = [i for i, c in enumerate(b.constraints[:num_rows]) if c is not None]
        if not self._constrained:
            return
        first = None if spec is None else spec.first_row.tolist()
        rows = [
            (i if first is None else first[i], i, *c)
            for i in self._constrained
            if (c := b.constraints[i]) is not None
        ]
        with_shift = bool((b.num_logprobs[:num_rows] >= 0).any())
        self.logprob_shift = apply_constraints(
            logits, rows, b.token_ids, b.num_tokens, b.num_prompt_tokens, with_shift
        )

    def _bias_tensors(
        self, num_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(rows [R, 1], ids [R, L], values [R, L]) for the biased rows, rebuilt when the rows change."""
        key = (self.batch.rows_version, num_rows)
        if key == self._bias_key:
            return self._bias
        self._bias_key, self._bias = key, None
        per_row = self.batch.logit_bias[:num_rows]
        biased = [i for i, pairs in enumerate(per_row) if pairs]
        if biased:
            width = max(len(per_row[i]) for i in biased)
            ids = np.zeros((len(biased), width), np.int64)  # padding adds 0.0 to token 0
            values = np.zeros((len(biased), width), np.float32)
            for r, i in enumerate(biased):
                pairs = per_row[i]
                ids[r, : len(pairs)] = [t for t, _ in pairs]
                values[r, : len(pairs)] = [b for _, b in pairs]
            rows = np.array(biased, np.int64)[:, None]
            to_dev = [torch.from_numpy(a).to(self.device) for a in (rows, ids, values)]
            self._bias = (to_dev[0], to_dev[1], to_dev[2])
        return self._bias


def apply_bitmask(logits: torch.Tensor, grammar: GrammarBitmask, device: torch.device) -> None:
    """Set the disallowed tokens of `grammar.rows` to -inf, in place: kvserve's C++ kernel on the
    CPU (xgrammar's there without a compiler), xgrammar's on CUDA. Ids past the bitmask's
    vocabulary (a model vocab padded beyond the tokenizer) are covered: the bitmask is as wide as
    the model's vocabulary and those bits are 0."""
    rows, bitmask = list(grammar.rows), grammar.bitmask  # [B, ceil(V/32)] int32
    if device.type == "cpu":
        if cpu_ops.apply_token_bitmask_(
            logits,
            torch.from_numpy(np.ascontiguousarray(bitmask)),
            torch.tensor(rows, dtype=torch.int64),
        ):
            return
        bitmask = _fill_banned_words(logits, rows, bitmask)  # without the C++ kernels
    import xgrammar

    bitmask_t = torch.from_numpy(bitmask)
    if device.type != "cpu":
        bitmask_t = bitmask_t.to(device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(
        logits, bitmask_t, vocab_size=logits.shape[-1], indices=rows
    )


def _fill_banned_words(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> np.ndarray:
    """xgrammar's CPU kernel sets banned tokens one at a time, so a mostly banned vocabulary
    costs it far more than a mostly allowed one. When many 32-token words are wholly banned
    (keys, numbers, enums, punctuation), fill those with one broadcast masked_fill instead,
    and hand the kernel a bitmask with those words marked allowed (both compared in
    docs/performance.md). Decided on the host: no device sync."""
    num_rows, vocab_size = logits.shape
    num_words = vocab_size // 32  # whole words only; a ragged tail is left to the kernel
    zero = np.zeros((num_rows, num_words), bool)  # [B, V // 32] wholly banned words
    zero[rows] = bitmask[rows, :num_words] == 0
    if zero.sum() * 4 <= len(rows) * num_words:
        return bitmask
    words = logits[:, : num_words * 32].view(num_rows, num_words, 32)
    words.masked_fill_(torch.from_numpy(zero)[..., None], float("-inf"))
    bitmask = bitmask.copy()
    bitmask[:, :num_words][zero] = -1  # already done
    return bitmask
