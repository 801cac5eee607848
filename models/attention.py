"""Paged attention over a block-structured KV cache, in portable PyTorch (CPU and CUDA).

The runner builds one `AttentionMetadata` per step and runs the model inside
`forward_context(meta)`. Every `Attention` layer then

1. writes the step's new keys/values into its `kv_cache` at `slot_mapping`, and
2. attends over the cache:
   * all rows with query_len == 1 ("decode rows") in one batched SDPA call: keys
     are gathered through the block table into [B_dec, num_blocks * block_size]
     and masked by `seq_lens` (and the sliding window); the query heads that
     share a KV head are laid out as that head's "query length", so GQA/MQA
     needs no repeated keys;
   * every other request ("prefill rows", possibly a chunk after a cached
     prefix) with its own SDPA call: `is_causal` when there is no cached prefix
     and no window, otherwise an explicit [query_len, num_keys] mask.

Everything that depends only on the step (which rows decode, gather indices,
masks) is derived once in `forward_context` from the host-side lists and shared
by all layers; nothing here copies device data to the host.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
    _decode_gather: dict = field(default_factory=dict)  # window -> (block_ids, mask)

    def decode_gather(self, window: int | None) -> tuple[Tensor, Tensor]:
        """Block ids [B_dec, n] to gather and a key mask [B_dec, 1, 1, n * block_size]."""
        if window not in self._decode_gather:
            self._decode_gather[window] = self._build_decode_gather(window)
        return self._decode_gather[window]

    def _build_decode_gather(self, window: int | None) -> tuple[Tensor, Tensor]:
        meta = self.meta
        bs = meta.block_size
        seq_lens_cpu = [meta.seq_lens_cpu[i] for i in self.decode_req_ids]
        max_len = max(seq_lens_cpu)
        seq_lens = self.decode_seq_lens[:, None]  # [B_dec, 1]
        table = self.decode_block_table
        device = table.device
        if window is None or max_len <= window:
            num_blocks = -(-max_len // bs)
            block_ids = table[:, :num_blocks]  # [B_dec, n]
            key_pos = torch.arange(num_blocks * bs, device=device)[None, :]  # [1, L]
            mask = key_pos < seq_lens
        else:
            # Only the blocks that overlap the window [seq_len - window, seq_len).
            num_blocks = min(-(-(window - 1) // bs) + 1, table.shape[1])
            first = (seq_lens - window).clamp_min(0) // bs  # [B_dec, 1]
            cols = (first + torch.arange(num_blocks, device=device)).clamp_max(table.shape[1] - 1)
            block_ids = table.gather(1, cols)  # [B_dec, n]
            key_pos = first * bs + torch.arange(num_blocks * bs, device=device)  # [B_dec, L]
            mask = (key_pos < seq_lens) & (key_pos >= seq_lens - window)
        return block_ids, mask[:, None, None, :]


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
        cache = self._kv_cache
        if cache is not None:
            slots = plan.meta.slot_mapping
            cache[0].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k)
            cache[1].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)
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
        if self._kv_cache is None:
            raise RuntimeError("decode rows need a kv_cache (assign Attention.kv_cache first)")
        block_ids, mask = plan.decode_gather(self.sliding_window)  # [B, n], [B, 1, 1, n*bs]
        num_reqs = q.shape[0]
        kv = self._kv_cache[:, block_ids]  # [2, B, n, bs, KvH, D]
        kv = kv.view(2, num_reqs, -1, self.num_kv_heads, self.head_dim).transpose(2, 3)  # [2, B, KvH, L, D]
        # Query heads h = kv_head * G + g share kv_head: treat the G of them as a query length.
        q = q.view(num_reqs, self.num_kv_heads, self.num_queries_per_kv, self.head_dim)
        out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=self.scale)
        return out.reshape(num_reqs, self.num_heads * self.head_dim)

    def _prefill(self, plan: _StepPlan, p: _PrefillRequest, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One request's query_len > 1 rows (after seq_len - query_len cached tokens) -> [query_len, H*D]."""
        bs, window = plan.meta.block_size, self.sliding_window
        num_cached = p.seq_len - p.query_len
        rows = slice(p.start, p.start + p.query_len)
        qi = q[rows].transpose(0, 1)[None]  # [1, H, Lq, D]
        if num_cached == 0:
            first_key = 0
            ki, vi = k[rows], v[rows]  # [Lq, KvH, D]
        else:
            if self._kv_cache is None:
                raise RuntimeError("a cached prefix needs a kv_cache (assign Attention.kv_cache first)")
            first_key = 0 if window is None else max(0, num_cached - window + 1) // bs * bs
            block_ids = plan.meta.block_table[p.req_idx, first_key // bs : -(-p.seq_len // bs)]
            kv = self._kv_cache[:, block_ids].flatten(1, 2)[:, : p.seq_len - first_key]  # [2, Lk, KvH, D]
            ki, vi = kv[0], kv[1]
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


_HAS_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def _sdpa_gqa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """SDPA with fewer KV heads than query heads; causal when `mask` is None."""
    if q.shape[1] != k.shape[1] and not _HAS_ENABLE_GQA:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, **kwargs)
