"""Embeddings on the runner side: pool an embedding request's final hidden states into one vector.

A prompt longer than a step's token budget is computed over several steps (chunked prefill). `last`
pooling needs only the step that computes the last prompt token; `mean` pooling adds each chunk's
rows to a float32 sum kept per request, and divides by the prompt length at the last chunk. A request
that is preempted or finishes drops its sum; one that (re)joins the batch starts from zero, since the
scheduler recomputes its prompt from the start (embedding requests use no cached prefix).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch.nn import functional as F

from kvserve.engine.core.step_record import StepRecord


class PoolingRows(Protocol):
    """The per-row pooling settings the pooler reads (engine/worker/input_batch.py's InputBatch)."""

    num_prompt_tokens: np.ndarray
    pooling_type: np.ndarray
    pooling_normalize: np.ndarray
    pooling_dims: np.ndarray


POOL_NONE, POOL_LAST, POOL_MEAN = 0, 1, 2  # InputBatch.pooling_type codes
POOLING_CODES = {"last": POOL_LAST, "mean": POOL_MEAN}


class Pooler:
    def __init__(self) -> None:
        self.sums: dict[
            str, torch.Tensor
        ] = {}  # request id -> [hidden] float32, mean pooling's partial sum

    def __call__(
        self, step: StepRecord, hidden: torch.Tensor, batch: PoolingRows
    ) -> dict[str, bytes]:
        """The vectors of the embedding requests whose prompt this step completes: request id ->
        little-endian float32 bytes. `hidden` [T, hidden] is the step's flat batch, rows 0..B-1 of
        `batch` (an `InputBatch`) are the step's requests."""
        for req_id in (
            *step.finished_req_ids,
            *step.preempted_req_ids,
            *(r.req_id for r in step.new_requests),
        ):
            self.sums.pop(req_id, None)
        num_reqs = len(step.req_ids)
        kinds = batch.pooling_type[:num_reqs]
        rows = np.flatnonzero(kinds)
        if not len(rows):
            return {}
        query_lens = np.array(step.num_scheduled_tokens, np.int64)
        cu = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
        ends = np.array(step.num_computed_tokens, np.int64) + query_lens
        done_ids, vectors = [], []
        for i in rows.tolist():
            req_id, start, end = step.req_ids[i], cu[i], cu[i + 1]
            num_prompt = int(batch.num_prompt_tokens[i])
            is_last = ends[i] >= num_prompt
            if kinds[i] == POOL_MEAN:
                total = hidden[start:end].float().sum(0)  # [hidden]
                if req_id in self.sums:
                    total += self.sums.pop(req_id)
                if not is_last:
                    self.sums[req_id] = total
                    continue
                vector = total / num_prompt
            elif is_last:
                vector = hidden[end - 1].float()
            else:
                continue
            dims = int(batch.pooling_dims[i])
            if dims:  # Matryoshka: the first `dims` dimensions, normalized after the cut
                vector = vector[:dims]
            if batch.pooling_normalize[i]:
                vector = F.normalize(vector, dim=-1)
            done_ids.append(req_id)
            vectors.append(vector)
        if not vectors:
            return {}
        flat = (
            torch.cat(vectors).cpu().numpy().astype("<f4")
        )  # one device->host copy for the step's vectors
        sizes = np.cumsum([0] + [v.shape[0] for v in vectors]).tolist()
        return {
            req_id: flat[sizes[k] : sizes[k + 1]].tobytes() for k, req_id in enumerate(done_ids)
        }
