"""Size the GPU KV pool from a measured peak, as vLLM and nano-vllm do.

With the weights loaded and no pool yet, one dummy step at `max_num_batched_tokens`
(prefill sequences up to max_model_len long, the LM head and the sampler on
`max_num_seqs` rows with every sampling option on; an encoder-decoder model's encoder
over sources as long first) shows the most memory a step can take. The pool gets what
is left of `gpu_memory_utilization` x the GPU's memory after that peak and after what
lives outside PyTorch's allocator (the CUDA context, library workspaces). Steps never
allocate more than the profile saw: prompt logprobs are computed in chunks of
`max_num_seqs` rows, like the profiled sampler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.engine.worker.sampler import Sampler, SamplingTensors
from kvserve.models.attention import Attention, AttentionMetadata, forward_context

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    total: int  # the GPU's memory
    weights: int  # allocated before the dummy step
    peak: int  # the step's peak allocation (weights included, the dummy cache not)
    non_torch: int  # used on the device outside PyTorch's allocator
    kv_budget: int  # what the pool may take

    def summary(self) -> str:
        gib = 2**30
        return (
            f"GPU memory {self.total / gib:.1f} GiB: weights {self.weights / gib:.2f}, step peak "
            f"{(self.peak - self.weights) / gib:.2f}, outside PyTorch {self.non_torch / gib:.2f}, "
            f"KV pool {self.kv_budget / gib:.2f} GiB"
        )


def profile_kv_budget(
    model: Any,
    vocab_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    index_dtype: torch.dtype,
    dtype: torch.dtype,
    device: torch.device,
    gpu_memory_utilization: float,
) -> MemoryProfile:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    try:
        cache_bytes = run_dummy_step(
            model,
            vocab_size,
            max_num_batched_tokens,
            max_num_seqs,
            max_model_len,
            block_size,
            index_dtype,
            dtype,
            device,
        )
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - cache_bytes
    finally:
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    budget = int(total * gpu_memory_utilization) - peak - non_torch
    profile = MemoryProfile(total, weights, peak, non_torch, budget)
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache at gpu_memory_utilization={gpu_memory_utilization}: "
            f"{profile.summary()}; raise it or lower max_num_batched_tokens"
        )
    logger.info("memory profile: %s", profile.summary())
    return profile


def run_dummy_step(
    model: Any,
    vocab_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    index_dtype: torch.dtype,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """The profile's step, in a throwaway pool just big enough for it (gone afterwards, the
    layers left without a cache); -> the pool's bytes (any device: the tests run it on the CPU)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    seq_len = min(max_num_batched_tokens, max_model_len)
    seq_lens = [seq_len] * (max_num_batched_tokens // seq_len)
    if max_num_batched_tokens % seq_len:
        seq_lens.append(max_num_batched_tokens % seq_len)
    blocks = [-(-n // block_size) for n in seq_lens]
    # an encoder-decoder model's dummy step encodes sources as long as its rows into cross blocks too
    num_blocks = sum(blocks) * (2 if getattr(model, "is_encoder_decoder", False) else 1) + 1
    cache_bytes = 0
    for layer in layers:
        layer.kv_cache = torch.zeros(
            2,
            num_blocks,
            block_size,
            layer.num_kv_heads,
            layer.head_dim,
            dtype=dtype,
            device=device,
        )
        cache_bytes += layer.kv_cache.numel() * layer.kv_cache.element_size()
    try:
        _dummy_step(
            model, vocab_size, seq_lens, blocks, max_num_seqs, block_size, index_dtype, device
        )
    finally:
        for layer in layers:
            layer.kv_cache = None
    return cache_bytes


@torch.inference_mode()
def _dummy_step(
    model: Any,
    vocab_size: int,
    seq_lens: list[int],
    blocks: list[int],
    max_num_seqs: int,
    block_size: int,
    index_dtype: torch.dtype,
    device: torch.device,
) -> None:
    num_tokens = sum(seq_lens)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int64)
    next_block = 1
    for i, n in enumerate(blocks):
        table[i, :n] = torch.arange(next_block, next_block + n)
        next_block += n
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    req = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    slots = table[req, positions // block_size] * block_size + positions % block_size
    cu = torch.tensor([0, *seq_lens]).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=slots.to(device, index_dtype),
        positions=positions.to(device),
        cu_seqlens_q=cu.to(device, index_dtype),
        seq_lens=torch.tensor(seq_lens).to(device, index_dtype),
        block_table=table.to(device, index_dtype),
        query_lens_cpu=list(seq_lens),
        seq_lens_cpu=list(seq_lens),
        block_size=block_size,
        max_query_len=max(seq_lens),
        max_seq_len=max(seq_lens),
    )
    if getattr(model, "is_encoder_decoder", False):
        # the encoder first (its activations are gone before the decoder runs, as in a real step),
        # each row's source as long as its decoder sequence, in the blocks after the decoder's
        cross = table + next_block - 1
        cross_slots = cross[req, positions // block_size] * block_size + positions % block_size
        model.encode_into_cache(
            torch.zeros(num_tokens, dtype=torch.int64, device=device),
            cu.tolist(),
            cross_slots.to(device),
        )
        meta.cross_block_table = cross.to(device)
        meta.cross_lens_cpu = list(seq_lens)
    with forward_context(meta):
        hidden = model(
            torch.zeros(num_tokens, dtype=torch.int64, device=device), positions.to(device)
        )
    rows = min(max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[-rows:])
    tensors = SamplingTensors.from_lists(
        vocab_size=vocab_size,
        temperature=[1.0] * rows,
        top_k=[50] * rows,
        top_p=[0.9] * rows,
        min_p=[0.05] * rows,
        repetition_penalty=[1.1] * rows,
        max_num_logprobs=20,
        device=device,
    )
    Sampler()(logits, tensors)
