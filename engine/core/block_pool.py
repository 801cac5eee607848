"""The KV block pool: which blocks are free, their reference counts, and the prefix-cache map.

Plain Python bookkeeping, no tensors. The pool holds `num_blocks` blocks; block 0 is the null
block: it is never handed out, so padded block-table entries can point at it.

Every block has a reference count. A block whose count drops to 0 goes to the tail of a free
list (a doubly linked list threaded through the blocks, so removing a block from the middle is
O(1)); allocation pops from the head, so the least recently freed block is reused first (LRU).

A free block may still hold something worth keeping: a full block registered under its prefix
key (`cache_block`, found again with `cached_block`), or whatever a manager keeps on it (a
partly filled last block, an encoder output), which the manager sets `Block.on_evict` to forget
when the pool reuses the block. Reviving such a block (`touch`) takes it back out of the free list.

The pool knows nothing of requests: the per-request managers (engine/core/kv_cache_manager.py for
the decoder's blocks, engine/seq2seq/cross_cache.py for an encoder output's) hold the blocks and
hand the scheduler block ids only. Backpressure is `None`, never an exception: `allocate` returns
None when the free list cannot supply the blocks, and the scheduler decides whom to preempt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

NULL_BLOCK_ID = 0


class Block:
    """One KV block. A cached block also keeps what its key was made of (`parent_hash`,
    `token_ids`), which a prefix hit must match exactly."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "parent_hash",
        "token_ids",
        "on_evict",
        "prev_free",
        "next_free",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.parent_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None
        # set by a manager that keeps something on the block while it is free: called when it is reused
        self.on_evict: Callable[[Block], None] | None = None
        self.prev_free: Block | None = None
        self.next_free: Block | None = None


class FreeBlockQueue:
    """Doubly linked LRU list of free blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)  # sentinels
        self._tail = Block(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        assert last is not None  # the sentinels keep every linked block's neighbours set
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_blocks += 1

    def remove(self, block: Block) -> None:
        prev, next_ = block.prev_free, block.next_free
        assert prev is not None and next_ is not None, "remove of a block not in the free list"
        prev.next_free, next_.prev_free = next_, prev
        block.prev_free = block.next_free = None
        self.num_blocks -= 1

    def popleft(self) -> Block:
        block = self._head.next_free
        assert block is not None and block is not self._tail, "popleft from an empty free list"
        self.remove(block)
        return block

    def block_ids(self) -> list[int]:
        ids, block = [], self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """The blocks, their reference counts, the LRU free list and the prefix key -> block map.

    `enable_caching` says whether managers keep anything on free blocks (prefix caching)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_cnt = 1  # pinned forever
        self._free = FreeBlockQueue(self.blocks[1:])
        self._cached: dict[bytes, Block] = {}  # block key -> block holding that prefix

    @property
    def num_free_blocks(self) -> int:
        return self._free.num_blocks

    @property
    def usage(self) -> float:
        """Share of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def allocate(self, num: int) -> list[Block] | None:
        """`num` blocks with one reference each, the least recently freed first (whatever they
        kept is evicted); None, changing nothing, when fewer are free."""
        if num > self._free.num_blocks:
            return None
        return [self._take_free_block() for _ in range(num)]

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference to each block; a free one (kept for its contents) leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference to each block; those left unreferenced join the free list's tail in
        this order (so the first given is evicted first)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block)

    # ---- prefix cache ------------------------------------------------------
    def cached_block(self, block_hash: bytes) -> Block | None:
        return self._cached.get(block_hash)

    def cache_block(
        self, block: Block, block_hash: bytes, parent_hash: bytes, token_ids: tuple[int, ...]
    ) -> None:
        """Register a full block, not registered yet, under a key that no block holds."""
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self._cached[block_hash] = block

    def _take_free_block(self) -> Block:
        block = self._free.popleft()
        if block.block_hash is not None:  # evict its stale prefix entry
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
        if block.on_evict is not None:  # a manager kept something on it: let it forget
            on_evict, block.on_evict = block.on_evict, None
            on_evict(block)
        block.parent_hash = block.token_ids = None
        block.ref_cnt = 1
        return block
