"""KV cache manager (the decoder's blocks per request): exact block ids, reference counts, LRU
eviction, prefix hits, no leaks."""

import pytest

from kvserve.engine.core.block_pool import Block, FreeBlockQueue
from kvserve.engine.core.kv_cache_manager import KVCacheManager


def test_allocate_exact_ids_and_free():
    bm = KVCacheManager(num_blocks=6, block_size=4)  # block 0 = null
    assert bm.num_free_blocks == 5
    assert bm.allocate("a", num_tokens=9) == [1, 2, 3]
    assert bm.block_ids("a") == [1, 2, 3]
    assert bm.allocate("a", num_tokens=12) == []  # still fits in 3 blocks
    assert bm.allocate("a", num_tokens=13) == [4]
    assert bm.num_free_blocks == 1
    bm.free("a")
    assert bm.num_free_blocks == 5


def test_allocate_returns_none_and_changes_nothing_when_full():
    bm = KVCacheManager(num_blocks=4, block_size=4)
    assert bm.allocate("a", 8) == [1, 2]
    assert bm.allocate("b", 9) is None  # needs 3, only 1 free
    assert bm.block_ids("b") == []
    assert bm.num_free_blocks == 1
    assert bm.allocate("b", 4) == [3]


def test_free_in_reverse_order_evicts_tail_first():
    bm = KVCacheManager(num_blocks=5, block_size=2, enable_prefix_caching=False)
    bm.allocate("a", 8)  # [1, 2, 3, 4]
    bm.free("a")
    # the tail block (4) was freed first, so it is reused first
    assert bm.allocate("b", 2) == [4]
    assert bm.allocate("c", 2) == [3]


def test_free_queue_o1_remove():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert q.block_ids() == [1, 3, 4, 2]
    assert q.num_blocks == 4


def test_prefix_hit_shares_blocks_and_counts_tokens():
    bm = KVCacheManager(num_blocks=10, block_size=4)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    assert bm.find_cached_prefix("a", tokens) == []
    bm.allocate("a", 10)
    bm.cache_full_blocks("a", tokens, num_computed_tokens=10)
    hit = bm.find_cached_prefix("b", tokens)
    assert hit == [1, 2]
    free_before = bm.num_free_blocks
    assert bm.allocate("b", 10, hit) == [1, 2, 4]
    assert bm.num_free_blocks == free_before - 1  # only the partial block is new
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 20
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 9


def test_prefix_never_covers_the_whole_prompt():
    bm = KVCacheManager(num_blocks=10, block_size=4)
    tokens = list(range(8))  # exactly 2 blocks
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", tokens, 8)
    # the last token must be recomputed to get logits: only 1 block may hit
    assert bm.find_cached_prefix("b", tokens) == [1]


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    bm = KVCacheManager(num_blocks=4, block_size=2)
    tokens = [5, 6, 7, 8, 9]
    bm.allocate("a", 5)  # [1, 2, 3]
    bm.cache_full_blocks("a", tokens, 5)
    bm.free("a")
    assert bm.num_free_blocks == 3
    hit = bm.find_cached_prefix("b", tokens)
    assert hit == [1, 2]
    assert bm.allocate("b", 5, hit) == [1, 2, 3]  # 3 is reused (its hash was never set)
    assert bm.num_free_blocks == 0
    bm.free("b")
    # a different prompt evicts the cached blocks in LRU order and drops their hashes
    assert bm.allocate("c", 6) == [3, 2, 1]
    assert bm.find_cached_prefix("d", tokens) == []


def test_prefix_hash_chains_over_parent():
    bm = KVCacheManager(num_blocks=10, block_size=2)
    bm.allocate("a", 5)
    bm.cache_full_blocks("a", [1, 2, 3, 4, 0], 5)
    # same second block, different first block: no hit at all
    assert bm.find_cached_prefix("b", [9, 9, 3, 4, 0]) == []


def test_reference_counts_with_shared_blocks():
    bm = KVCacheManager(num_blocks=6, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    bm.allocate("a", 5)
    bm.cache_full_blocks("a", tokens, 5)
    for rid in ("b", "c"):
        bm.allocate(rid, 5, bm.find_cached_prefix(rid, tokens))
    bm.free("a")
    bm.free("b")
    assert bm.block_ids("c")[:2] == [1, 2]
    assert bm.num_free_blocks == 5 - 2 - 1  # c holds 2 shared + 1 own
    bm.free("c")
    assert bm.num_free_blocks == 5


def test_usage_and_bad_size():
    bm = KVCacheManager(num_blocks=5, block_size=4)
    bm.allocate("a", 8)
    assert bm.usage == pytest.approx(0.5)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=1, block_size=4)


def test_disabled_prefix_caching_never_hits():
    bm = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", [1, 2, 3, 4], 4)
    assert bm.find_cached_prefix("b", [1, 2, 3, 4, 5]) == []


def test_partly_filled_last_block_is_kept_for_continuations():
    """A freed request's last block, partly filled with computed tokens, is found by a request whose
    tokens continue them (its slots are copied, not shared), under the same root only, leaving at
    least one token to compute; evicting the block drops it."""
    from kvserve.engine.core.kv_cache_manager import ROOT_DIGEST, prefix_root

    bm = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(10))  # 2 full blocks + 2
    assert bm.find_cached_prefix("a", tokens) == []
    bm.allocate("a", 11)
    bm.cache_full_blocks("a", tokens + [10], 10)
    held = bm.block_ids("a")
    bm.free("a", tokens + [10], 10)  # 10 of its 11 tokens have K/V
    follow = tokens + [77, 78]
    assert bm.find_cached_prefix("b", follow) == held[:2]
    assert bm.find_partial_block("b", follow, 2) == (held[2], 2)
    inside = tokens[:9] + [
        99,
        100,
    ]  # parts within the block: its first slot only would fit, not kept
    assert bm.find_cached_prefix("c", inside) == held[:2]
    assert bm.find_partial_block("c", inside, 2) == (0, 0)
    assert bm.find_cached_prefix("d", tokens) == held[:2]
    assert bm.find_partial_block("d", tokens, 2) == (0, 0)  # nothing would be left to compute
    salted = prefix_root("tenant")
    assert bm.find_cached_prefix("e", follow, salted) == []
    assert bm.find_partial_block("e", follow, 0) == (0, 0)
    for rid in "bcde":
        bm.free(rid)
    assert bm.allocate("f", 7 * 4) is not None  # every block: the kept ones are evicted
    bm.free("f")
    assert bm.find_cached_prefix("g", follow, ROOT_DIGEST) == []
    assert bm.find_partial_block("g", follow, 0) == (0, 0)
    assert bm.num_free_blocks == 7
