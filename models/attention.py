"""Paged attention over a block-structured KV cache, in portable PyTorch (CPU and CUDA).

The runner builds one `AttentionMetadata` per step and runs the model inside
`forward_context(meta)`. Every `Attention` layer then

1. writes the step's new keys/values into its `kv_cache` at `slot_mapping`, and
2. attends over the cache:
   * rows with query_len == 1 ("decode rows") together. On the CPU, one call of
     models.cpu_ops' paged decode kernel reads K/V in place. Elsewhere (and when the
     kernels cannot be built) their blocks are gathered
     through the block table into [B_dec, n * block_size] keys, masked by
     `seq_lens` (and the sliding window), and attended in one SDPA call (on the
     CPU, in chunks of a few MiB so the gathered keys are still in cache). The
     query heads that share a KV head act as that head's "query length", so
     GQA/MQA needs no repeated keys;
   * every other request ("prefill rows", possibly a chunk after a cached
     prefix) on its own: on AVX512-BF16 CPUs in bf16, models.cpu_ops' flash-style
     prefill kernel over the paged cache; otherwise one SDPA call, `is_causal` when
     there is no cached prefix and no window, else an explicit [query_len, num_keys] mask.

Everything that depends only on the step (which rows decode, gather indices,
masks) is derived once per step from the host-side lists and shared by all
layers; nothing here copies device data to the host.

Cache slots that hold no live token (the rest of a request's last block, the
null block 0 used as padding) are read and then masked out, so they must hold
finite values: allocate the cache with `torch.zeros` (SDPA turns 0 * NaN into NaN).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import cpu_ops


@dataclass
class AttentionMetadata:
    slot_mapping: Tensor  # [T] int64: block_id * block_size + offset, where each new token's K/V goes
    cu_seqlens_q: Tensor  # [B+1] int64 (device): request i's new tokens are rows cu[i]:cu[i+1]
    seq_lens: Tensor  # [B] int64 (device): context length after this step (cached + new)
    block_table: Tensor  # [B, max_num_blocks] int64 (device), unused entries 0 (null block)
    query_lens_cpu: list[int]  # [B] host copies, so attention needs no device->host sync
    seq_lens_cpu: list[int]  # [B]
    block_size: int


@dataclass
class _PrefillRequest:
    req_idx: int
    start: int  # first row in the flat batch
    query_len: int
    seq_len: int


# CPU decode attention is memory-bound: gathering every row's keys before one SDPA call
# streams them through DRAM twice. Gathering and attending in chunks of about this many
# bytes lets SDPA read them back from cache (~1.4x faster step at batch 64 x 1k context).
CPU_DECODE_CHUNK_BYTES = 4 << 20


@dataclass
class _DecodeChunk:
    """Decode rows start:stop (of the decode rows), attended in one SDPA call."""

    start: int
    stop: int
    block_ids: Tensor  # [(stop - start) * n] blocks to gather, n per row
    mask: Tensor | None  # [stop - start, 1, 1, L]; None when every row attends to exactly its first L keys
    num_keys: int  # L


@dataclass
class _StepPlan:
    """Step-level facts derived once from `AttentionMetadata` and shared by every layer."""

    meta: AttentionMetadata
    decode_req_ids: list[int]  # requests with query_len == 1
    is_all_decode: bool  # every row is a decode row, in request order
    decode_rows: Tensor | None  # [B_dec] int64 rows of the decode tokens (None when is_all_decode)
    decode_seq_lens: Tensor | None  # [B_dec]
    decode_block_table: Tensor | None  # [B_dec, max_num_blocks]
    prefills: list[_PrefillRequest]
    _decode_chunks: dict = field(default_factory=dict)  # (window, bytes per token) -> chunks

    def decode_chunks(self, window: int | None, kv_bytes_per_token: int) -> list[_DecodeChunk]:
        """How the decode rows are gathered and attended; built once per step for all layers."""
        key = (window, kv_bytes_per_token)
        if key not in self._decode_chunks:
            self._decode_chunks[key] = self._build_decode_chunks(window, kv_bytes_per_token)
        return self._decode_chunks[key]

    def _build_decode_chunks(self, window: int | None, kv_bytes_per_token: int) -> list[_DecodeChunk]:
        seq_lens = [self.meta.seq_lens_cpu[i] for i in self.decode_req_ids]
        if self.meta.block_table.device.type != "cpu":
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

    def _decode_chunk(self, start: int, stop: int, window: int | None) -> _DecodeChunk:
        bs = self.meta.block_size
        seq_lens_cpu = [self.meta.seq_lens_cpu[i] for i in self.decode_req_ids[start:stop]]
        max_len = max(seq_lens_cpu)
        seq_lens = self.decode_seq_lens[start:stop, None]  # [b, 1]
        table = self.decode_block_table[start:stop]  # [b, max_num_blocks]
        device = table.device
        if window is None or max_len <= window:
            num_blocks = -(-max_len // bs)
            block_ids = table[:, :num_blocks]  # [b, n]
            if min(seq_lens_cpu) == max_len:  # equal lengths (always so for one row): no mask
                return _DecodeChunk(start, stop, block_ids.flatten(), None, max_len)
            key_pos = torch.arange(num_blocks * bs, device=device)[None, :]  # [1, L]
            mask = key_pos < seq_lens
        else:
            # Only the blocks that overlap the window [seq_len - window, seq_len).
            num_blocks = min(-(-(window - 1) // bs) + 1, table.shape[1])
            first = (seq_lens - window).clamp_min(0) // bs  # [b, 1]
            cols = (first + torch.arange(num_blocks, device=device)).clamp_max(table.shape[1] - 1)
            block_ids = table.gather(1, cols)  # [b, n]
            key_pos = first * bs + torch.arange(num_blocks * bs, device=device)  # [b, L]
            mask = (key_pos < seq_lens) & (key_pos >= seq_lens - window)
        return _DecodeChunk(start, stop, block_ids.flatten(), mask[:, None, None, :], num_blocks * bs)


def _make_plan(meta: AttentionMetadata) -> _StepPlan:
    query_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    decode_req_ids = [i for i, n in enumerate(query_lens) if n == 1]
    prefills, start = [], 0
    for i, n in enumerate(query_lens):
        if n > 1:
            prefills.append(_PrefillRequest(i, start, n, seq_lens[i]))
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
    return _StepPlan(meta, decode_req_ids, is_all_decode, decode_rows, decode_seq_lens, decode_table, prefills)


_CURRENT: contextvars.ContextVar[_StepPlan | None] = contextvars.ContextVar("kvserve_forward_context", default=None)


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Make `meta` visible to every `Attention` layer for the duration of the block (restored on exit)."""
    token = _CURRENT.set(_make_plan(meta))
    try:
        yield meta
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> AttentionMetadata | None:
    """The metadata of the enclosing `forward_context`, or None outside one."""
    plan = _CURRENT.get()
    return None if plan is None else plan.meta


class Attention(nn.Module):
    """Causal (optionally sliding-window) attention of new tokens over the paged KV cache.

    `kv_cache` is assigned by the runner: [2, num_blocks, block_size, num_kv_heads, head_dim]
    (0 = keys, 1 = values; block 0 is the null block). Until then (e.g. a memory
    profiling pass) the layer can only run prefills without a cached prefix.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self._kv_cache: Tensor | None = None
        self._kv: tuple[Tensor, Tensor] | None = None

    @property
    def kv_cache(self) -> Tensor | None:
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: Tensor | None) -> None:
        if cache is not None and (
            cache.dim() != 5 or cache.shape[0] != 2 or tuple(cache.shape[3:]) != (self.num_kv_heads, self.head_dim)
        ):
            raise ValueError(
                f"kv_cache must be [2, num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}], "
                f"got {tuple(cache.shape)}"
            )
        self._kv_cache = cache
        self._kv = None if cache is None else (cache[0], cache[1])  # views made once, not per step

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"scale={self.scale:.4g}, sliding_window={self.sliding_window}"
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [T, H*D], k/v [T, KvH*D] (any row stride) -> [T, H*D]."""
        plan = _CURRENT.get()
        if plan is None:
            raise RuntimeError("Attention must run inside models.attention.forward_context(meta)")
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self._kv is not None:
            write_kv_cache(*self._kv, k, v, plan.meta.slot_mapping)
        num_decodes = len(plan.decode_req_ids)
        if plan.is_all_decode and num_tokens == num_decodes:
            return self._decode(plan, q)
        scheduled = sum(plan.meta.query_lens_cpu)
        out = (q.new_empty if num_tokens == scheduled else q.new_zeros)(num_tokens, self.num_heads * self.head_dim)
        if plan.is_all_decode:
            out[:num_decodes] = self._decode(plan, q[:num_decodes])
        elif num_decodes:
            out.index_copy_(0, plan.decode_rows, self._decode(plan, q.index_select(0, plan.decode_rows)))
        for p in plan.prefills:
            out[p.start : p.start + p.query_len] = self._prefill(plan, p, q, k, v)
        return out

    def _decode(self, plan: _StepPlan, q: Tensor) -> Tensor:
        """q [B_dec, H, D] (one token per request) -> [B_dec, H*D]."""
        cache = self._kv_cache
        if cache is None:
            raise RuntimeError("decode rows need a kv_cache (assign Attention.kv_cache first)")
        if cpu_ops.attention_kernels_apply(q, self.head_dim):
            # reads K/V in place through the block table: no gather copy
            return cpu_ops.paged_decode_attention(q, *self._kv, plan.decode_block_table,
                                                  plan.decode_seq_lens, self.scale, self.sliding_window)
        kv_bytes_per_token = 2 * self.num_kv_heads * self.head_dim * self._kv_cache.element_size()
        chunks = plan.decode_chunks(self.sliding_window, kv_bytes_per_token)
        if len(chunks) == 1:
            return self._decode_chunk(chunks[0], q)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        for chunk in chunks:
            out[chunk.start : chunk.stop] = self._decode_chunk(chunk, q[chunk.start : chunk.stop])
        return out

    def _decode_chunk(self, chunk: _DecodeChunk, q: Tensor) -> Tensor:
        """q [b, H, D] -> [b, H*D]: gather the rows' keys/values, then one SDPA call."""
        num_reqs = q.shape[0]
        k, v = _gather_blocks(self._kv_cache, chunk.block_ids)  # [b * n * bs, KvH, D] each
        k = k.view(num_reqs, -1, self.num_kv_heads, self.head_dim)[:, : chunk.num_keys].transpose(1, 2)
        v = v.view(num_reqs, -1, self.num_kv_heads, self.head_dim)[:, : chunk.num_keys].transpose(1, 2)
        # Query heads h = kv_head * G + g share kv_head: treat the G of them as a query length.
        # (Much faster on CPU than SDPA's enable_gqa with one query per head.)
        q = q.view(num_reqs, self.num_kv_heads, self.num_queries_per_kv, self.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=self.scale)  # [b, KvH, G, D]
        return out.reshape(num_reqs, self.num_heads * self.head_dim)

    def _prefill(self, plan: _StepPlan, p: _PrefillRequest, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One request's query_len > 1 rows (after seq_len - query_len cached tokens) -> [query_len, H*D]."""
        bs, window = plan.meta.block_size, self.sliding_window
        num_cached = p.seq_len - p.query_len
        rows = slice(p.start, p.start + p.query_len)
        cache = self._kv_cache
        if cache is not None and cpu_ops.attention_kernels_apply(q, self.head_dim):
            # causal over the paged cache (this chunk's K/V are already written), no gathers
            return cpu_ops.paged_prefill_attention(q[rows], *self._kv, plan.meta.block_table[p.req_idx],
                                                   p.seq_len, self.scale, window)
        qi = q[rows].transpose(0, 1)[None]  # [1, H, Lq, D]
        if num_cached == 0:
            first_key = 0
            ki, vi = k[rows], v[rows]  # [Lq, KvH, D]
        else:
            if self._kv_cache is None:
                raise RuntimeError("a cached prefix needs a kv_cache (assign Attention.kv_cache first)")
            first_key = 0 if window is None else max(0, num_cached - window + 1) // bs * bs
            block_ids = plan.meta.block_table[p.req_idx, first_key // bs : -(-p.seq_len // bs)]
            ki, vi = _gather_blocks(self._kv_cache, block_ids)  # [n * bs, KvH, D] each
            ki, vi = ki[: p.seq_len - first_key], vi[: p.seq_len - first_key]
        ki, vi = ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]  # [1, KvH, Lk, D]
        needs_window = window is not None and p.seq_len > window
        if num_cached == 0 and not needs_window:
            out = _sdpa_gqa(qi, ki, vi, None, self.scale)
        else:
            q_pos = torch.arange(num_cached, p.seq_len, device=q.device)[:, None]  # [Lq, 1]
            k_pos = torch.arange(first_key, p.seq_len, device=q.device)[None, :]  # [1, Lk]
            mask = k_pos <= q_pos
            if needs_window:
                mask &= k_pos > q_pos - window
            out = _sdpa_gqa(qi, ki, vi, mask, self.scale)
        return out[0].transpose(0, 1).reshape(p.query_len, self.num_heads * self.head_dim)


def write_kv_cache(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor) -> None:
    """k, v [T, KvH, D] into the caches [num_blocks, block_size, KvH, D] at flat slots [T]."""
    heads_contiguous = all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (k, v))
    if k_cache.device.type == "cpu" and heads_contiguous and cpu_ops.load():
        torch.ops.kvserve.write_kv_cache(k, v, k_cache, v_cache, slots)
        return
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


_workspace = threading.local()


def _gather_blocks(cache: Tensor, block_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values of the blocks `block_ids` [n], each [n * block_size, KvH, D].

    `index_select` on the contiguous K and V halves is several times faster than
    `cache[:, ids]`. On the CPU the results go into a per-thread buffer reused by
    every layer and step: fresh multi-MB tensors each layer make glibc hand pages
    back to the OS and fault them in again (~90k page faults per decode step at batch
    64, nearly half the step time). CUDA's caching allocator needs no such help.
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


def _sdpa_gqa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """SDPA with fewer KV heads than query heads; causal when `mask` is None."""
    if q.shape[1] != k.shape[1] and not _HAS_ENABLE_GQA:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, **kwargs)
