"""Paged attention in portable PyTorch: any device, and the oracle the kernels are tested against.

* decode rows (query_len == 1) together: their blocks are gathered through the
  block table into [B_dec, n * block_size] keys, masked by `seq_lens` (and the
  sliding window), and attended in one SDPA call (on the CPU, in chunks of a few
  MiB so the gathered keys are still in cache). The query heads that share a KV
  head act as that head's "query length", so GQA/MQA needs no repeated keys;
* every other request ("prefill rows", possibly a chunk after a cached prefix) on
  its own: one SDPA call, `is_causal` when there is no cached prefix and no window,
  else an explicit [query_len, num_keys] mask.

Everything that depends only on the step (which rows decode, gather indices, masks)
is derived once per step from the host-side lists and shared by all layers; nothing
here copies device data to the host. Cache slots that hold no live token (the rest
of a request's last block, the null block 0) are read and then masked out, so they
must hold finite values: the pool is allocated zeroed (SDPA turns 0 * NaN into NaN).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from kvserve.models.attention.layer import Attention, AttentionBackend
from kvserve.models.attention.metadata import AttentionMetadata, ForwardContext, current_context
from kvserve.models.layers import apply_rotary

# CPU decode attention is memory-bound: gathering every row's keys before one SDPA call
# streams them through DRAM twice. Gathering and attending in chunks of about this many
# bytes lets SDPA read them back from cache.
CPU_DECODE_CHUNK_BYTES = 4 << 20


@dataclass
class PrefillRequest:
    req_idx: int
    start: int  # first row in the flat batch
    query_len: int
    seq_len: int


@dataclass
class DecodeChunk:
    """Decode rows start:stop (of the decode rows), attended in one SDPA call."""

    start: int
    stop: int
    block_ids: Tensor  # [(stop - start) * n] blocks to gather, n per row
    mask: (
        Tensor | None
    )  # [stop - start, 1, 1, L]; None when every row attends to exactly its first L keys
    num_keys: int  # L


@dataclass
class StepPlan:
    """Step-level facts derived once from `AttentionMetadata` and shared by every layer."""

    meta: AttentionMetadata
    decode_req_ids: list[int]  # requests with query_len == 1
    is_all_decode: bool  # every row is a decode row, in request order
    decode_rows: Tensor | None  # [B_dec] int64 rows of the decode tokens (None when is_all_decode)
    decode_seq_lens: Tensor | None  # [B_dec]
    decode_block_table: Tensor | None  # [B_dec, max_num_blocks]
    prefills: list[PrefillRequest]
    _decode_chunks: dict = field(default_factory=dict)  # (window, bytes per token) -> chunks

    def decode_chunks(self, window: int | None, kv_bytes_per_token: int) -> list[DecodeChunk]:
        """How the decode rows are gathered and attended; built once per step for all layers."""
        key = (window, kv_bytes_per_token)
        if key not in self._decode_chunks:
            self._decode_chunks[key] = self._build_decode_chunks(window, kv_bytes_per_token)
        return self._decode_chunks[key]

    def _build_decode_chunks(
        self, window: int | None, kv_bytes_per_token: int
    ) -> list[DecodeChunk]:
        seq_lens = [self.meta.seq_lens_cpu[i] for i in self.decode_req_ids]
        if self.meta.block_table.device.type != "cpu":  # no cache to stay inside: one chunk
            return [self._decode_chunk(0, len(seq_lens), window)]
        chunks, start, num_bytes = [], 0, 0
        bs = self.meta.block_size
        for i, seq_len in enumerate(seq_lens):
            keys = seq_len if window is None else min(seq_len, window + bs)
            if i > start and num_bytes + keys * kv_bytes_per_token > CPU_DECODE_CHUNK_BYTES:
                chunks.append(self._decode_chunk(start, i, window))
                start, num_bytes = i, 0
            num_bytes += keys * kv_bytes_per_token
        chunks.append(self._decode_chunk(start, len(seq_lens), window))
        return chunks

    def _decode_chunk(self, start: int, stop: int, window: int | None) -> DecodeChunk:
        bs = self.meta.block_size
        seq_lens_cpu = [self.meta.seq_lens_cpu[i] for i in self.decode_req_ids[start:stop]]
        max_len = max(seq_lens_cpu)
        seq_lens = self.decode_seq_lens[start:stop, None]  # [b, 1]
        table = self.decode_block_table[start:stop].long()  # [b, max_num_blocks]
        device = table.device
        if window is None or max_len <= window:
            num_blocks = -(-max_len // bs)
            block_ids = table[:, :num_blocks]  # [b, n]
            if min(seq_lens_cpu) == max_len:  # equal lengths (always so for one row): no mask
                return DecodeChunk(start, stop, block_ids.flatten(), None, max_len)
            key_pos = torch.arange(num_blocks * bs, device=device)[None, :]  # [1, L]
            mask = key_pos < seq_lens
        else:
            # Only the blocks that overlap the window [seq_len - window, seq_len).
            num_blocks = min(-(-(window - 1) // bs) + 1, table.shape[1])
            first = (seq_lens - window).clamp_min(0) // bs  # [b, 1]
            cols = (first + torch.arange(num_blocks, device=device)).clamp_max(table.shape[1] - 1)
            block_ids = table.gather(1, cols.long())  # [b, n]
            key_pos = first * bs + torch.arange(num_blocks * bs, device=device)  # [b, L]
            mask = (key_pos < seq_lens) & (key_pos >= seq_lens - window)
        return DecodeChunk(
            start, stop, block_ids.flatten(), mask[:, None, None, :], num_blocks * bs
        )


def make_plan(meta: AttentionMetadata) -> StepPlan:
    query_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    decode_req_ids = [i for i, n in enumerate(query_lens) if n == 1]
    prefills, start = [], 0
    for i, n in enumerate(query_lens):
        if n > 1:
            prefills.append(PrefillRequest(i, start, n, seq_lens[i]))
        start += n
    # All-decode steps need no row gather: request i is row i (rows past B, if any, are padding).
    is_all_decode = bool(decode_req_ids) and not prefills
    decode_rows = decode_seq_lens = decode_table = None
    if decode_req_ids:
        if is_all_decode:
            decode_seq_lens, decode_table = meta.seq_lens, meta.block_table
        else:
            device = meta.block_table.device
            req_idx = torch.tensor(decode_req_ids, dtype=torch.int64).to(device, non_blocking=True)
            starts = list(itertools.accumulate(query_lens, initial=0))
            rows = torch.tensor([starts[i] for i in decode_req_ids], dtype=torch.int64)
            decode_rows = rows.to(device, non_blocking=True)
            decode_seq_lens = meta.seq_lens.index_select(0, req_idx)
            decode_table = meta.block_table.index_select(0, req_idx)
    return StepPlan(
        meta, decode_req_ids, is_all_decode, decode_rows, decode_seq_lens, decode_table, prefills
    )


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, layer: Attention, qkv: Tensor) -> Tensor:
        context = current_context()
        q, k, v = self.rotate(layer, context, qkv)
        if layer.kv_cache is not None:
            self.write_kv(layer, k, v, context.meta.slot_mapping)
        plan = context.once("torch_plan", lambda: make_plan(context.meta))
        return self.attend(layer, plan, q, k, v)

    # ---- rotary and the cache write ----------------------------------------------
    def rotate(
        self, layer: Attention, context: ForwardContext, qkv: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """qkv -> q [T, H, D], k [T, KvH, D], v [T, KvH, D], q and k rotated (new tensors here)."""
        num_tokens = qkv.shape[0]
        q, k, v = layer.split_qkv(qkv)
        if layer.rotary is None:
            return q, k, v
        qk = qkv[:, : layer.q_size + layer.kv_size].view(
            num_tokens, layer.num_heads + layer.num_kv_heads, -1
        )
        qk = apply_rotary(qk, cos_sin_of(layer, context))  # q and k rotated in one pass
        return qk[:, : layer.num_heads], qk[:, layer.num_heads :], v

    def write_kv(self, layer: Attention, k: Tensor, v: Tensor, slots: Tensor) -> None:
        k_cache, v_cache = layer.kv
        num_kv_heads, head_dim = k_cache.shape[2:]
        slots = slots.long()
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)

    # ---- attention --------------------------------------------------------------
    def attend(self, layer: Attention, plan: StepPlan, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [T, H, D], k/v [T, KvH, D] (this step's, already in the cache) -> [T, H * D]."""
        num_tokens = q.shape[0]
        num_decodes = len(plan.decode_req_ids)
        if plan.is_all_decode and num_tokens == num_decodes:
            return self.decode(layer, plan, q)
        scheduled = sum(plan.meta.query_lens_cpu)
        out = (q.new_empty if num_tokens == scheduled else q.new_zeros)(
            num_tokens, layer.num_heads * layer.head_dim
        )
        if plan.is_all_decode:
            out[:num_decodes] = self.decode(layer, plan, q[:num_decodes])
        elif num_decodes:
            out.index_copy_(
                0, plan.decode_rows, self.decode(layer, plan, q.index_select(0, plan.decode_rows))
            )
        for p in plan.prefills:
            out[p.start : p.start + p.query_len] = self.prefill(layer, plan, p, q, k, v)
        return out

    def decode(self, layer: Attention, plan: StepPlan, q: Tensor) -> Tensor:
        """q [B_dec, H, D] (one token per request) -> [B_dec, H*D]."""
        cache = layer.kv_cache
        if cache is None:
            raise RuntimeError("decode rows need a kv_cache (assign Attention.kv_cache first)")
        kv_bytes_per_token = 2 * layer.num_kv_heads * layer.head_dim * cache.element_size()
        chunks = plan.decode_chunks(layer.sliding_window, kv_bytes_per_token)
        if len(chunks) == 1:
            return self._decode_chunk(layer, chunks[0], q)
        out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)
        for chunk in chunks:
            out[chunk.start : chunk.stop] = self._decode_chunk(
                layer, chunk, q[chunk.start : chunk.stop]
            )
        return out

    def _decode_chunk(self, layer: Attention, chunk: DecodeChunk, q: Tensor) -> Tensor:
        """q [b, H, D] -> [b, H*D]: gather the rows' keys/values, then one SDPA call."""
        num_reqs, kv_heads, head_dim = q.shape[0], layer.num_kv_heads, layer.head_dim
        k, v = gather_blocks(layer.kv_cache, chunk.block_ids)  # [b * n * bs, KvH, D] each
        k = k.view(num_reqs, -1, kv_heads, head_dim)[:, : chunk.num_keys].transpose(1, 2)
        v = v.view(num_reqs, -1, kv_heads, head_dim)[:, : chunk.num_keys].transpose(1, 2)
        # Query heads h = kv_head * G + g share kv_head: treat the G of them as a query length.
        # (Much faster on CPU than SDPA's enable_gqa with one query per head.)
        q = q.reshape(num_reqs, kv_heads, layer.num_queries_per_kv, head_dim)
        if layer.logit_softcap is None:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=chunk.mask, scale=layer.scale
            )  # [b, KvH, G, D]
        else:
            out = softcapped_attention(q, k, v, chunk.mask, layer.scale, layer.logit_softcap)
        return out.reshape(num_reqs, layer.num_heads * head_dim)

    def prefill(
        self, layer: Attention, plan: StepPlan, p: PrefillRequest, q: Tensor, k: Tensor, v: Tensor
    ) -> Tensor:
        """One request's query_len > 1 rows (after seq_len - query_len cached tokens) -> [query_len, H*D]."""
        bs, window = plan.meta.block_size, layer.sliding_window
        num_cached = p.seq_len - p.query_len
        rows = slice(p.start, p.start + p.query_len)
        qi = q[rows].transpose(0, 1)[None]  # [1, H, Lq, D]
        if num_cached == 0:
            first_key = 0
            ki, vi = k[rows], v[rows]  # [Lq, KvH, D]
        else:
            if layer.kv_cache is None:
                raise RuntimeError(
                    "a cached prefix needs a kv_cache (assign Attention.kv_cache first)"
                )
            first_key = 0 if window is None else max(0, num_cached - window + 1) // bs * bs
            block_ids = plan.meta.block_table[
                p.req_idx, first_key // bs : -(-p.seq_len // bs)
            ].long()
            ki, vi = gather_blocks(layer.kv_cache, block_ids)  # [n * bs, KvH, D] each
            ki, vi = ki[: p.seq_len - first_key], vi[: p.seq_len - first_key]
        ki, vi = ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]  # [1, KvH, Lk, D]
        needs_window = window is not None and p.seq_len > window
        if num_cached == 0 and not needs_window:
            out = sdpa_gqa(qi, ki, vi, None, layer.scale, layer.logit_softcap)
        else:
            q_pos = torch.arange(num_cached, p.seq_len, device=q.device)[:, None]  # [Lq, 1]
            k_pos = torch.arange(first_key, p.seq_len, device=q.device)[None, :]  # [1, Lk]
            mask = k_pos <= q_pos
            if needs_window:
                mask &= k_pos > q_pos - window
            out = sdpa_gqa(qi, ki, vi, mask, layer.scale, layer.logit_softcap)
        return out[0].transpose(0, 1).reshape(p.query_len, layer.num_heads * layer.head_dim)


def cos_sin_of(layer: Attention, context: ForwardContext) -> Tensor:
    """[T, 2, D] rows of the layer's rotary cache at the step's positions, gathered once per step."""
    rotary = layer.rotary
    return context.once(("cos_sin", id(rotary)), lambda: rotary(context.meta.positions.long()))


_workspace = threading.local()


def gather_blocks(cache: Tensor, block_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values of the blocks `block_ids` [n], each [n * block_size, KvH, D].

    `index_select` on the contiguous K and V halves is several times faster than
    `cache[:, ids]`. On the CPU the results go into a per-thread buffer reused by
    every layer and step: fresh multi-MB tensors each layer make glibc hand pages
    back to the OS and fault them in again. CUDA's caching allocator needs no such help.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape[1:]
    n = block_ids.shape[0]
    if cache.device.type != "cpu":
        k, v = cache[0].index_select(0, block_ids), cache[1].index_select(0, block_ids)
    else:
        numel = n * block_size * num_kv_heads * head_dim
        buf = getattr(_workspace, "buf", None)
        if buf is None or buf.dtype != cache.dtype or buf.numel() < 2 * numel:
            buf = _workspace.buf = torch.empty(2 * numel, dtype=cache.dtype)
        shape = (n, block_size, num_kv_heads, head_dim)
        k = torch.index_select(cache[0], 0, block_ids, out=buf[:numel].view(shape))
        v = torch.index_select(cache[1], 0, block_ids, out=buf[numel : 2 * numel].view(shape))
    return k.flatten(0, 1), v.flatten(0, 1)


_HAS_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def sdpa_gqa(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, softcap: float | None = None
) -> Tensor:
    """SDPA with fewer KV heads than query heads; causal when `mask` is None. With `softcap`
    (which SDPA cannot do), `softcapped_attention`."""
    if softcap is not None:
        rep = q.shape[1] // k.shape[1]
        if mask is None:  # causal, the queries being the last Lq keys
            num_queries, num_keys = q.shape[2], k.shape[2]
            mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device).tril(
                num_keys - num_queries
            )
        return softcapped_attention(
            q,
            k.repeat_interleave(rep, dim=1),
            v.repeat_interleave(rep, dim=1),
            mask,
            scale,
            softcap,
        )
    if q.shape[1] != k.shape[1] and not _HAS_ENABLE_GQA:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, **kwargs
    )


def softcapped_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, softcap: float
) -> Tensor:
    """Attention with Gemma 2's logit soft-capping, in HF's eager order: scores = q k^T * scale,
    capped as `softcap * tanh(scores / softcap)`, masked, softmax in fp32 rounded to q's dtype,
    times v. q [..., Lq, D], k/v [..., Lk, D] (same number of heads), mask bool broadcastable to
    [..., Lq, Lk] (True = visible) or None (all visible) -> [..., Lq, D]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if (
        mask is not None
    ):  # the dtype's minimum as HF adds it, so a row with nothing visible stays finite
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
