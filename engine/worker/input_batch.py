"""The runner's persistent batch: one row per live request, updated from each `StepRecord`.

Rows follow the scheduler's running order (requests join at the end, leavers are
compacted out in order), so a step's scheduled requests are normally rows
`0..B-1` with no reordering. Host state is numpy: token ids (the runner appends
the tokens it samples), block-table rows (written when a request joins, appended
to in place when it gets blocks) and per-row sampling settings (written once, when
a request joins). Device state: penalty counts, kept current by adding each step's
sampled tokens, and the sampling tensors, rebuilt only when the rows change.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from kvserve.engine.core.step_record import NewRequestData, StepRecord
from kvserve.engine.sampling_params import GREEDY_TEMPERATURE_EPS, GenerationConstraints
from kvserve.engine.worker.pooler import POOLING_CODES
from kvserve.engine.worker.sampler import SamplingTensors, _to_device, _to_int64

_NO_LOGPROBS = -1  # host arrays only: the row wants no (prompt) logprobs


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.req_ids: list[str] = []  # [n] row -> request id
        self.row_of: dict[str, int] = {}
        num_rows = max_num_reqs
        # np.zeros is calloc'd: pages of long rows nobody reaches are never touched
        self.token_ids = np.zeros((num_rows, max_model_len + 1), np.int32)  # prompt + outputs
        self.block_table = np.zeros(
            (num_rows, -(-max_model_len // block_size)), np.int64
        )  # 0 = null
        self.num_tokens = np.zeros(num_rows, np.int64)
        self.num_prompt_tokens = np.zeros(num_rows, np.int64)
        self.num_blocks = np.zeros(num_rows, np.int64)
        # sampling settings, normalized when written (a greedy row has no top-k/top-p/min-p/seed)
        self.temperature = np.zeros(num_rows, np.float32)
        self.top_k = np.zeros(num_rows, np.int64)  # 0 = off
        self.top_p = np.ones(num_rows, np.float32)
        self.min_p = np.zeros(num_rows, np.float32)
        self.repetition_penalty = np.ones(num_rows, np.float32)
        self.presence_penalty = np.zeros(num_rows, np.float32)
        self.frequency_penalty = np.zeros(num_rows, np.float32)
        self.seeds = np.zeros(num_rows, np.int64)
        self.is_seeded = np.zeros(num_rows, bool)
        self.min_tokens = np.zeros(num_rows, np.int64)
        self.num_logprobs = np.full(num_rows, _NO_LOGPROBS, np.int64)
        self.num_prompt_logprobs = np.full(num_rows, _NO_LOGPROBS, np.int64)
        # embedding requests (engine/worker/pooler.py): pooling kind (0 = a generating row), normalize, kept dims
        self.pooling_type = np.zeros(num_rows, np.int8)
        self.pooling_normalize = np.zeros(num_rows, bool)
        self.pooling_dims = np.zeros(num_rows, np.int64)  # 0 = all
        self.lora_ids = np.zeros(num_rows, np.int64)  # the row's LoRA adapter; 0 = the base model
        # every per-row array above: compaction moves them all
        self._columns = [
            v for v in vars(self).values() if isinstance(v, np.ndarray) and v.ndim == 1
        ]
        self.suppressed: list[tuple[int, ...]] = []  # [n] ids banned while outputs < min_tokens
        self.logit_bias: list[tuple[tuple[int, float], ...]] = []  # [n] (token id, bias) pairs
        # [n] generation-config processors: (constraints, max_tokens, eos ids), None for most rows
        self.constraints: list[tuple[GenerationConstraints, int, tuple[int, ...]] | None] = []
        self.rows_version = 0  # bumped whenever rows join, leave or move (caches key on it)
        # prompt positions already scored, per request: survives a preemption (the recompute
        # must not score them twice), dropped when the request finishes
        self.num_prompt_logprobs_done: dict[str, int] = {}
        # device penalty state, allocated when a penalized request first joins; rows of
        # unpenalized requests stay finite but unused
        self.prompt_mask: torch.Tensor | None = None  # [rows, V] bool
        self.output_counts: torch.Tensor | None = None  # [rows, V] float32
        self._sampling: SamplingTensors | None = None  # for rows [0, _sampling_rows)
        self._sampling_rows = 0
        self._pad_suppressed: np.ndarray | None = None  # [n, Ls] suppressed ids padded with V
        self._has_suppressed: np.ndarray | None = None  # [n] bool, the row has ids to suppress
        self._ones = torch.ones(max_num_reqs, dtype=torch.float32, device=device)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    # ---- rows from the step record -------------------------------------------
    def update(self, step: StepRecord) -> None:
        """Drop, add and extend rows; leave the step's requests in rows 0..B-1, in order."""
        for req_id in step.finished_req_ids:
            self.num_prompt_logprobs_done.pop(req_id, None)
        self._remove([*step.finished_req_ids, *step.preempted_req_ids])
        for new in step.new_requests:
            self._add(new)
        for req_id, block_ids in step.new_block_ids.items():
            row = self.row_of[req_id]
            start = self.num_blocks[row]
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)
        num_sched = len(step.req_ids)
        if self.req_ids[:num_sched] != list(step.req_ids):
            scheduled = [self.row_of[r] for r in step.req_ids]
            rest = sorted(set(range(self.num_reqs)) - set(scheduled))
            self._permute(np.array(scheduled + rest, np.int64))

    def _remove(self, req_ids: list[str]) -> None:
        gone = {self.row_of[r] for r in req_ids if r in self.row_of}
        if gone:
            self._permute(np.array([i for i in range(self.num_reqs) if i not in gone], np.int64))

    def _permute(self, order: np.ndarray) -> None:
        """Row i becomes old row order[i]; rows past len(order) are dropped."""
        num_old, num_new = self.num_reqs, len(order)
        moved = np.flatnonzero(order != np.arange(num_new))
        first = int(moved[0]) if len(moved) else num_new  # rows before it stay where they are
        src = order[first:]
        if len(src):
            for column in self._columns:
                column[first:num_new] = column[src]
            width = int(self.num_tokens[:num_old].max())
            self.token_ids[first:num_new, :width] = self.token_ids[src, :width]
            width = int(self.num_blocks[:num_old].max())  # every row is zero past its blocks
            self.block_table[first:num_new, :width] = self.block_table[src, :width]
            if self.output_counts is not None and self.prompt_mask is not None:  # set together
                idx = torch.from_numpy(src).to(self.device)
                self.output_counts[first:num_new] = self.output_counts.index_select(0, idx)
                self.prompt_mask[first:num_new] = self.prompt_mask.index_select(0, idx)
        self.req_ids = [self.req_ids[i] for i in order]
        self.suppressed = [self.suppressed[i] for i in order]
        self.logit_bias = [self.logit_bias[i] for i in order]
        self.constraints = [self.constraints[i] for i in order]
        self.row_of = {r: i for i, r in enumerate(self.req_ids)}
        self._sampling = None
        self.rows_version += 1

    def _add(self, new: NewRequestData) -> None:
        if (
            new.req_id in self.row_of
        ):  # cannot happen with a consistent scheduler; stay correct anyway
            self._remove([new.req_id])
        row = self.num_reqs
        if row >= self.max_num_reqs:
            raise RuntimeError(f"input batch full ({self.max_num_reqs} rows) adding {new.req_id!r}")
        num_prompt, num_tokens = (
            len(new.prompt_token_ids),
            len(new.prompt_token_ids) + len(new.output_token_ids),
        )
        self.token_ids[row, :num_prompt] = new.prompt_token_ids
        self.token_ids[row, num_prompt:num_tokens] = new.output_token_ids
        self.num_tokens[row], self.num_prompt_tokens[row] = num_tokens, num_prompt
        self.block_table[row] = 0
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
        self.lora_ids[row] = new.lora_id
        self._write_sampling(row, new)
        p = new.pooling
        self.pooling_type[row] = 0 if p is None else POOLING_CODES[p.pooling_type]
        self.pooling_normalize[row] = p is not None and p.normalize
        self.pooling_dims[row] = 0 if p is None or p.dimensions is None else p.dimensions
        self.req_ids.append(new.req_id)
        self.row_of[new.req_id] = row
        self._sampling = None
        self.rows_version += 1

    def _write_sampling(self, row: int, new: NewRequestData) -> None:
        s = new.sampling
        greedy = s.temperature < GREEDY_TEMPERATURE_EPS
        self.temperature[row] = s.temperature
        self.top_k[row] = 0 if greedy or s.top_k < 0 or s.top_k >= self.vocab_size else s.top_k
        self.top_p[row] = 1.0 if greedy else s.top_p
        self.min_p[row] = 0.0 if greedy else s.min_p
        self.repetition_penalty[row] = s.repetition_penalty
        self.presence_penalty[row] = s.presence_penalty
        self.frequency_penalty[row] = s.frequency_penalty
        self.is_seeded[row] = s.seed is not None and not greedy
        self.seeds[row] = _to_int64(s.seed) if s.seed is not None and self.is_seeded[row] else 0
        self.min_tokens[row] = s.min_tokens
        self.num_logprobs[row] = _NO_LOGPROBS if s.num_logprobs is None else s.num_logprobs
        self.num_prompt_logprobs[row] = (
            _NO_LOGPROBS if s.num_prompt_logprobs is None else s.num_prompt_logprobs
        )
        self.suppressed.append(s.suppressed_token_ids)
        self.logit_bias.append(s.logit_bias)
        self.constraints.append(
            None if s.constraints is None else (s.constraints, s.max_tokens, s.eos_token_ids)
        )
        if s.has_penalties or self.output_counts is not None:
            self._ensure_penalty_rows(row + 1)
        if self.output_counts is not None and self.prompt_mask is not None:
            self.output_counts[row].zero_()
            self.prompt_mask[row].zero_()
            if s.has_penalties:
                self.prompt_mask[row, self._to_device(np.array(new.prompt_token_ids, np.int64))] = (
                    True
                )
                if new.output_token_ids:
                    out_ids = self._to_device(np.array(new.output_token_ids, np.int64))
                    self.output_counts[row].index_add_(
                        0, out_ids, torch.ones_like(out_ids, dtype=torch.float32)
                    )

    def _ensure_penalty_rows(self, num_rows: int) -> None:
        """Penalty state for at least `num_rows` rows, grown by doubling (memory follows the batch)."""
        have = 0 if self.output_counts is None else self.output_counts.shape[0]
        if have >= num_rows:
            return
        size = min(self.max_num_reqs, max(8, 1 << (num_rows - 1).bit_length()))
        counts = torch.zeros(size, self.vocab_size, dtype=torch.float32, device=self.device)
        mask = torch.zeros(size, self.vocab_size, dtype=torch.bool, device=self.device)
        if self.output_counts is not None and self.prompt_mask is not None:
            counts[:have], mask[:have] = self.output_counts, self.prompt_mask
        self.output_counts, self.prompt_mask = counts, mask

    # ---- after sampling --------------------------------------------------------
    def append_sampled(
        self,
        rows: np.ndarray,
        token_ids: np.ndarray,
        sampled: torch.Tensor | None,
        sampled_mask: torch.Tensor | None,
    ) -> None:
        """Record this step's tokens: rows [S] got token_ids [S] (host); `sampled` [B] (device)
        holds every scheduled row's draw, `sampled_mask` [B] float (None = all rows count)."""
        t = self._sampling
        if (
            t is not None
            and not t.no_penalties
            and self.output_counts is not None
            and sampled is not None
        ):
            num_rows = sampled.shape[0]
            weight = self._ones[:num_rows] if sampled_mask is None else sampled_mask
            self.output_counts[:num_rows].scatter_add_(1, sampled[:, None], weight[:, None])
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def count_outputs(self, pairs: list[tuple[int, int]]) -> None:
        """Add (row, token id) outputs to the penalty counts: a speculating row's accepted drafts."""
        if pairs and self.output_counts is not None:
            index = torch.tensor(pairs, dtype=torch.int64, device=self.device).T
            self.output_counts.index_put_(
                (index[0], index[1]), torch.ones(len(pairs), device=self.device), accumulate=True
            )

    # ---- sampling tensors --------------------------------------------------------
    def sampling_tensors(self, num_rows: int) -> SamplingTensors:
        """For rows [0, num_rows): cached per batch composition; only the seeded-stream
        positions and the min_tokens suppression change from step to step."""
        if self._sampling is None or self._sampling_rows != num_rows:
            self._sampling, self._sampling_rows = self._build_sampling(num_rows), num_rows
        t = self._sampling
        changes: dict[str, Any] = {}
        num_output = self.num_tokens[:num_rows] - self.num_prompt_tokens[:num_rows]
        if t.seeded_rows is not None:
            changes["steps"] = self._to_device(num_output)
        if self._pad_suppressed is not None and self._has_suppressed is not None:  # set together
            active = (num_output < self.min_tokens[:num_rows]) & self._has_suppressed
            if active.any():
                ids = np.where(active[:, None], self._pad_suppressed, self.vocab_size)
                changes["suppressed_token_ids"] = self._to_device(ids)
        return replace(t, **changes) if changes else t

    def _build_sampling(self, n: int) -> SamplingTensors:
        greedy = self.temperature[:n] < GREEDY_TEMPERATURE_EPS
        top_k = self.top_k[:n]
        rep, pres, freq = (
            self.repetition_penalty[:n],
            self.presence_penalty[:n],
            self.frequency_penalty[:n],
        )
        no_penalties = bool((rep == 1.0).all() and not pres.any() and not freq.any())
        seeded = np.flatnonzero(self.is_seeded[:n])
        num_logprobs = self.num_logprobs[:n]
        suppressed = self.suppressed[:n]
        self._pad_suppressed = self._has_suppressed = None
        if any(suppressed):
            self._has_suppressed = np.array([bool(ids) for ids in suppressed])
            width = max(len(s) for s in suppressed)
            self._pad_suppressed = np.full((n, width), self.vocab_size, np.int64)
            for i, ids in enumerate(suppressed):
                self._pad_suppressed[i, : len(ids)] = ids
        dev = self._to_device
        return SamplingTensors(
            temperature=dev(self.temperature[:n]),
            top_k=dev(top_k),
            top_p=dev(self.top_p[:n]),
            min_p=dev(self.min_p[:n]),
            repetition_penalty=dev(rep),
            presence_penalty=dev(pres),
            frequency_penalty=dev(freq),
            seeds=dev(self.seeds[:n]) if len(seeded) else None,
            seeded_rows=dev(seeded) if len(seeded) else None,
            steps=dev(np.zeros(n, np.int64)),
            prompt_token_ids=None,
            output_token_ids=None,
            suppressed_token_ids=None,
            max_num_logprobs=int(max(num_logprobs.max(), 0)),
            all_greedy=bool(greedy.all()),
            all_random=not greedy.any(),
            no_top_k=not top_k.any(),
            no_top_p=bool((self.top_p[:n] >= 1.0).all()),
            no_min_p=not self.min_p[:n].any(),
            no_penalties=no_penalties,
            max_top_k=int(top_k.max()) if top_k.any() else None,
            top_p_rows_have_top_k=bool((top_k[self.top_p[:n] < 1.0] > 0).all()),
            needs_logprobs=bool((num_logprobs != _NO_LOGPROBS).any()),
            prompt_mask=None if no_penalties or self.prompt_mask is None else self.prompt_mask[:n],
            output_counts=None
            if no_penalties or self.output_counts is None
            else self.output_counts[:n],
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A device copy that never aliases the batch's own (mutable) arrays."""
        return _to_device(np.array(array), self.device)
