"""CUDA graphs of the model's forward for decode-only steps.

A decode step at batch 1 is ~1,800 small kernel launches whose Python and launch
overhead outlasts the GPU work. Capturing the forward once per padded batch size
and replaying it turns a step into a few buffer copies and one launch.

* Sizes: 1, 2, 4, 8, then every 8 up to 256 and every 16 beyond, up to
  `max_num_seqs`; a step of B requests replays the smallest size >= B. Padding rows
  are harmless: slot -1 (the cache write skips them) and seq_len 0 (attention reads
  nothing for them); their outputs are dropped.
* Only steps where every request has one new token replay; anything with a prefill
  chunk runs eagerly. The attention backend must say `supports_cuda_graphs` (its
  decode path must depend on no host value that changes between steps: the captured
  metadata fixes `max_seq_len` at max_model_len).
* Graphs share one memory pool, captured largest first so smaller ones reuse it.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from kvserve.models.attention import AttentionMetadata, forward_context

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 1025, 16))
    capped = [s for s in sizes if s < max_num_seqs]
    return capped + [max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        max_model_len: int,
        index_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size, self.max_model_len = block_size, max_model_len
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=index_dtype, device=device)
        self.seq_lens = torch.zeros(n, dtype=index_dtype, device=device)
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=index_dtype, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=index_dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            positions=self.positions[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[1] * size,
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):
            with forward_context(self._meta(size)):
                self.model(
                    self.input_ids[:size], self.positions[:size]
                )  # warm-up: kernel builds, workspaces
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self.model(self.input_ids[:size], self.positions[:size])
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("CUDA graphs captured for decode batch sizes %s", self.sizes)

    def can_run(self, meta: AttentionMetadata, num_reqs: int) -> bool:
        return meta.is_all_decode and num_reqs <= self.sizes[-1]

    def run(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """The hidden states [B, hidden] of a decode-only step of B requests, by graph replay."""
        num_reqs = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num_reqs)
        self.input_ids[:num_reqs].copy_(input_ids, non_blocking=True)
        self.positions[:num_reqs].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_reqs].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:num_reqs].copy_(meta.seq_lens, non_blocking=True)
        if size > num_reqs:  # padding rows: no cache write, nothing to attend
            self.slot_mapping[num_reqs:size].fill_(-1)
            self.seq_lens[num_reqs:size].zero_()
        # (entries past a row's last block are never read: seq_lens bound the kernels)
        width = meta.block_table.shape[1]
        self.block_table[:num_reqs, :width].copy_(meta.block_table, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][:num_reqs]
