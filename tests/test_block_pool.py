"""Block pool alone: exact block ids, None on shortage, LRU reuse, reference counts, the prefix map
and the eviction hook a manager sets on a kept block."""

import pytest

from kvserve.engine.core.block_pool import NULL_BLOCK_ID, BlockPool


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocate_exact_ids_never_the_null_block_and_none_when_short():
    pool = BlockPool(num_blocks=5)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    assert ids(pool.allocate(3)) == [1, 2, 3]
    assert pool.allocate(2) is None  # only 1 free: nothing changes
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(0.75)
    assert ids(pool.allocate(1)) == [4] and pool.allocate(0) == []
    assert NULL_BLOCK_ID not in ids(pool.blocks[1:]) and pool.blocks[NULL_BLOCK_ID].ref_cnt == 1
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=1)


def test_free_order_is_reuse_order_and_references_count():
    pool = BlockPool(num_blocks=5)
    a = pool.allocate(3)  # 1, 2, 3
    pool.touch(a[:1])  # block 1 has two holders now
    pool.free(reversed(a))  # 3 then 2 join the free list; 1 is still held once
    assert pool.num_free_blocks == 3 and a[0].ref_cnt == 1
    assert ids(pool.allocate(3)) == [4, 3, 2]  # the never-used block first, then in freeing order
    pool.free(a[:1])
    assert pool.num_free_blocks == 1


def test_touch_revives_a_free_block_out_of_the_free_list():
    pool = BlockPool(num_blocks=4)
    (block,) = pool.allocate(1)
    pool.free([block])
    assert pool.num_free_blocks == 3
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    assert ids(pool.allocate(2)) == [2, 3]  # the revived block is not handed out again


def test_prefix_map_entry_goes_when_its_block_is_reused():
    pool = BlockPool(num_blocks=3)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], b"k" * 32, b"p" * 32, (1, 2))
    assert pool.cached_block(b"k" * 32) is blocks[0] and pool.cached_block(b"x" * 32) is None
    pool.free(blocks)  # still found while free: a later request may take it back
    assert pool.cached_block(b"k" * 32) is blocks[0]
    reused = pool.allocate(1)[0]
    assert reused is blocks[0] and pool.cached_block(b"k" * 32) is None
    assert (reused.block_hash, reused.parent_hash, reused.token_ids) == (None, None, None)


def test_on_evict_runs_once_when_the_pool_reuses_the_block():
    pool = BlockPool(num_blocks=3)
    evicted = []
    blocks = pool.allocate(2)
    blocks[1].token_ids = (5,)  # what a manager keeps on it
    blocks[1].on_evict = lambda block: evicted.append((block.block_id, block.token_ids))
    pool.free(reversed(blocks))  # 2 first: it is reused first
    pool.touch(blocks[1:])  # revived, not reused: the hook stays
    assert evicted == [] and blocks[1].on_evict is not None
    pool.free(blocks[1:])
    assert ids(pool.allocate(2)) == [1, 2]
    assert evicted == [(2, (5,))] and blocks[1].on_evict is None and blocks[1].token_ids is None
