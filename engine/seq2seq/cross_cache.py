"""The encoder output's blocks of encoder-decoder requests (their cross-attention K/V in every decoder layer).

Plain Python, no tensors. The blocks come from the same `BlockPool` as the decoder's
(engine/core/block_pool.py); this manager decides which of them each request holds. A request's
cross blocks are keyed by its prefix root (`kv_cache_manager.prefix_root`, which covers the source
and the cache salt): requests with the same key share one encoder output, so a source is encoded
once while some request holds it and, with prefix caching, after the last one let go, as long as
a completed step wrote it and none of its blocks has been reused (then the whole output goes).

The scheduler calls `admit` when it admits a request, `mark_written` after each step and `free`
when a request finishes or is preempted; `block_ids` go into the runner's `NewRequestData`.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from kvserve.engine.core.block_pool import Block, BlockPool

if TYPE_CHECKING:
    from kvserve.engine.core.request import Request
    from kvserve.engine.core.step_record import StepRecord


class CrossCache:
    """Which cross blocks each encoder-decoder request holds; shares a source's blocks between requests."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._req_blocks: dict[str, list[Block]] = {}
        self._req_key: dict[str, bytes] = {}
        # a source's cross blocks by key: kept while a request holds them or, written, until one is reused
        self._sets: dict[bytes, list[Block]] = {}
        self._written: set[bytes] = set()  # keys whose encoder output a completed step wrote

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def admit(self, request: Request, budget: int, has_scheduled: bool) -> int | None:
        """Cross blocks for a request being admitted -> how many encoder tokens its first step runs
        (0 when it shares an encoder output already there), or None (nothing changed) when it cannot
        be admitted now: the pool is short, or its encoder would not fit the step's token budget
        (`budget`) beside the requests already scheduled (a larger one runs alone)."""
        num_encoder = len(request.encoder_token_ids)
        if not num_encoder:
            return 0
        if num_encoder >= budget and has_scheduled:
            return None
        must_encode = self.allocate(request.request_id, num_encoder, request.prefix_root)
        if must_encode is None:
            return None
        return num_encoder if must_encode else 0

    def allocate(self, request_id: str, num_encoder_tokens: int, key: bytes) -> bool | None:
        """Blocks for the request's encoder output, held until `free`. `key` is the request's prefix
        root: the blocks another request with the same key holds, or left written (prefix caching),
        are shared. -> True when the request must run its encoder into new blocks, False when it
        shares written ones, None (nothing changed) when the pool cannot supply them."""
        shared = self._sets.get(key)
        if shared is None:
            shared = self.pool.allocate(-(-num_encoder_tokens // self.block_size))
            if shared is None:
                return None
            self._sets[key] = shared
            on_evict = partial(self._evicted, key)
            for block in shared:
                block.on_evict = on_evict
            self._written.discard(key)
            is_new = True
        else:
            self.pool.touch(shared)  # kept after its last holder: back out of the free list
            is_new = False
        self._req_blocks[request_id], self._req_key[request_id] = list(shared), key
        return is_new

    def mark_written(self, record: StepRecord) -> None:
        """The step of `record` completed: the encoder outputs it computed are in their blocks, and
        may be kept for later requests once nobody holds them."""
        for new in record.new_requests:
            if new.encoder_token_ids:
                self.written(new.req_id)

    def written(self, request_id: str) -> None:
        """A completed step ran the request's encoder into its cross blocks (a request no longer
        held, aborted while the step ran, is ignored)."""
        key = self._req_key.get(request_id)
        if key is not None:
            self._written.add(key)

    def free(self, request_id: str) -> None:
        """Drop the request's references; the blocks join the free list's tail (evicted last: every
        later request with that source needs them) and stay a cached encoder output if a step wrote them."""
        blocks = self._req_blocks.pop(request_id, [])
        self.pool.free(blocks)
        key = self._req_key.pop(request_id, None)
        if (
            key is not None
            and blocks
            and blocks[0].ref_cnt == 0
            and not (self.pool.enable_caching and key in self._written)
        ):
            self._drop(key)  # its last holder, and nothing worth keeping

    def _evicted(self, key: bytes, block: Block) -> None:
        """The pool reuses a block of a kept encoder output: the rest of it is no use now."""
        self._drop(key)

    def _drop(self, key: bytes) -> None:
        for block in self._sets.pop(key):
            block.on_evict = None
        self._written.discard(key)
