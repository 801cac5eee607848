"""The decoder's KV cache per request: each request's block table, prefix hits and prefix keys.

Plain Python, no tensors. The blocks themselves, their reference counts and the LRU free list are
the `BlockPool`'s (engine/core/block_pool.py); this manager decides which blocks each request
holds and hands the scheduler block ids only.

Prefix caching: once a block is full, it is registered under a SHA-256 digest
chained over its parent's digest and its own tokens; the first block's parent is the
request's root digest (`prefix_root`), which covers every other input that changes the
block's K/V (the cache salt, the LoRA adapter). A hit also compares the block's stored parent digest and
token ids with the request's, so even a forged digest collision is a miss, never
another request's KV (docs/security.md, "Prefix cache"). A freed block keeps its key
until it is reused, so a later request with the same prefix can pick it back up, and
requests running at the same time (e.g. the n samples of one prompt) share blocks.

A freed request's last, partly filled block is kept too, under its parent's digest with its
computed tokens (`free(..., token_ids, num_computed_tokens)`): a later request whose tokens run
on past them (a beam extended by one token, a conversation's next turn) copies those slots into
a block of its own (copy-on-write: `take_block_copies` hands them to the step's record,
`StepRecord.block_copies`, and the runner copies before the step's forward) and computes only
the rest. Several children of one block each copy.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from kvserve.engine.core.block_pool import Block, BlockPool

_KEY_VERSION = b"kvserve-prefix-v2"


def _field(tag: bytes, value: bytes) -> bytes:
    """One length-prefixed field of the root's key material, so no two inputs encode alike."""
    return tag + len(value).to_bytes(8, "little") + value


def prefix_root(
    cache_salt: str | None = None,
    encoder_token_ids: Sequence[int] = (),
    lora_key: str | None = None,
) -> bytes:
    """The parent digest of a request's first block.

    Every input besides the token ids that changes a block's K/V must be mixed in here, so
    that requests differing in it never share a block: the cache salt, an encoder-decoder
    request's encoder input (the same decoder tokens under another source have other K/V), and
    the LoRA adapter (`LoRARequest.cache_key`: its adapted q/k/v give other K/V).
    Unsalted decoder-only requests share one root.
    """
    material = _KEY_VERSION
    if cache_salt is not None:
        material += _field(b"salt", cache_salt.encode("utf-8", "surrogatepass"))
    if encoder_token_ids:
        material += _field(b"encoder", pack_token_ids(encoder_token_ids))
    if lora_key is not None:
        material += _field(b"lora", lora_key.encode("utf-8", "surrogatepass"))
    return hashlib.sha256(material).digest()


ROOT_DIGEST = prefix_root()


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as the bytes a key is made of: 4 bytes each (an id beyond uint32 raises).

    Native byte order: keys are never shared between processes or machines."""
    return array("I", token_ids).tobytes()


def hash_block(parent_hash: bytes, token_bytes: bytes) -> bytes:
    """A full block's key: SHA-256 over the parent's digest and the block's packed token ids.

    Cryptographic, so that nobody can craft a block whose key equals another's (Python's
    built-in hash is unkeyed and cheap to collide); 32-byte digests also make an accidental
    collision impossible in practice. Fixed-width fields, so the input is never ambiguous.
    """
    return hashlib.sha256(parent_hash + token_bytes).digest()


class KVCacheManager:
    """Which decoder blocks each request holds, and the prefix cache over them; hands out block ids only.

    Makes the pool of `num_blocks` blocks; an encoder-decoder model's cross blocks come from the
    same pool (`CrossCache(manager.pool, ...)`, engine/seq2seq/cross_cache.py)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._req_blocks: dict[str, list[Block]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}  # chained keys of the request's full blocks
        self._req_roots: dict[str, bytes] = {}  # the parent digest of each request's first block
        # freed requests' partly filled last blocks, by their parent's digest (in the free list;
        # each keeps its computed tokens in `token_ids`, `block_hash` None)
        self._partial: dict[bytes, list[Block]] = {}
        self._block_copies: list[
            tuple[int, int, int]
        ] = []  # (source, destination, slots) not yet in a step
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ---- capacity ----------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    # ---- prefix cache ------------------------------------------------------
    def _extend_hashes(
        self, request_id: str, token_ids: Sequence[int], num_full_blocks: int, root: bytes
    ) -> list[bytes]:
        hashes = self._req_hashes.setdefault(request_id, [])
        root = self._req_roots.setdefault(request_id, root)
        start, bs = len(hashes), self.block_size
        if start < num_full_blocks:
            packed = pack_token_ids(
                token_ids[start * bs : num_full_blocks * bs]
            )  # one conversion for all
            width = len(packed) // (num_full_blocks - start)
            for offset in range(0, len(packed), width):
                hashes.append(
                    hash_block(hashes[-1] if hashes else root, packed[offset : offset + width])
                )
        return hashes

    def find_cached_prefix(
        self, request_id: str, token_ids: Sequence[int], root: bytes = ROOT_DIGEST
    ) -> list[int]:
        """Block ids holding the longest cached prefix of `token_ids` (not yet referenced).

        `root` is the request's `prefix_root`. A block counts only if its stored parent digest
        and token ids equal the request's: a key collision is a miss. At least one token is
        always left to compute, so the request has logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = self._extend_hashes(request_id, token_ids, max_blocks, root)
        parent, bs = self._req_roots[request_id], self.block_size
        hit_ids = []
        for i, h in enumerate(hashes[:max_blocks]):
            block = self.pool.cached_block(h)
            if (
                block is None
                or block.parent_hash != parent
                or block.token_ids != tuple(token_ids[i * bs : (i + 1) * bs])
            ):
                break
            hit_ids.append(block.block_id)
            parent = h
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += len(hit_ids) * self.block_size
        return hit_ids

    def find_partial_block(
        self, request_id: str, token_ids: Sequence[int], num_cached_blocks: int
    ) -> tuple[int, int]:
        """After `find_cached_prefix` gave `num_cached_blocks` blocks: a kept partly filled block
        whose tokens continue them as `token_ids` does -> (its id, how many of its slots to copy),
        the longest such; (0, 0) when there is none. At least one token is left to compute."""
        if not self.enable_prefix_caching:
            return 0, 0
        hashes, start = self._req_hashes.get(request_id, []), num_cached_blocks * self.block_size
        parent = (
            hashes[num_cached_blocks - 1] if num_cached_blocks else self._req_roots.get(request_id)
        )
        best, best_len = 0, 0
        for block in self._partial.get(parent, ()) if parent is not None else ():
            kept = block.token_ids or ()  # always set on a kept partial block
            n = len(kept)
            if (
                best_len < n < len(token_ids) - start
                and tuple(token_ids[start : start + n]) == kept
            ):
                best, best_len = block.block_id, n
        self.prefix_cache_hits += best_len
        return best, best_len

    def cache_full_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        root: bytes = ROOT_DIGEST,
    ) -> None:
        """Register the request's blocks that are full of computed tokens under their keys."""
        if not self.enable_prefix_caching:
            return
        blocks = self._req_blocks.get(request_id)
        if not blocks:
            return
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        hashes = self._extend_hashes(request_id, token_ids, num_full, root)
        parent, bs = self._req_roots[request_id], self.block_size
        for i, (block, h) in enumerate(zip(blocks[:num_full], hashes)):
            if block.block_hash is None and self.pool.cached_block(h) is None:
                self.pool.cache_block(block, h, parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            parent = h

    # ---- allocation --------------------------------------------------------
    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        cached_block_ids: Sequence[int] = (),
        partial_block: tuple[int, int] = (0, 0),
    ) -> list[int] | None:
        """Grow the request's blocks to hold `num_tokens` tokens; return the new block ids.

        `cached_block_ids` (from `find_cached_prefix`, only when the request holds no
        blocks yet) are shared rather than allocated; `partial_block` (from `find_partial_block`)
        is copied into the first block after them (`take_block_copies`). Returns None,
        changing nothing, when the free list cannot supply what is needed.
        """
        held = self._req_blocks.setdefault(request_id, [])
        if not cached_block_ids and len(held) * self.block_size >= num_tokens:
            return []  # the common decode step: the last block still has room
        cached = [self.pool.blocks[i] for i in cached_block_ids]
        num_new = self.num_blocks_for(num_tokens) - len(held) - len(cached)
        # cached blocks nobody holds sit in the free list: taking them shrinks it too
        num_revived = sum(1 for b in cached if b.ref_cnt == 0)
        if num_new + num_revived > self.pool.num_free_blocks:
            if not held:
                del self._req_blocks[request_id]
            return None
        self.pool.touch(cached)
        held.extend(cached)
        new_blocks = self.pool.allocate(max(num_new, 0))
        assert new_blocks is not None  # the free list was checked above
        held.extend(new_blocks)
        if partial_block[1]:  # the kept block's slots into the request's own next block
            self._block_copies.append(
                (partial_block[0], held[len(cached)].block_id, partial_block[1])
            )
        return [b.block_id for b in cached + new_blocks]

    def take_block_copies(self) -> tuple[tuple[int, int, int], ...]:
        """The copy-on-write of kept partial blocks since the last call: (source, destination, slots)."""
        copies = tuple(self._block_copies)
        self._block_copies.clear()
        return copies

    def _keep_partial(
        self, request_id: str, block: Block, token_ids: Sequence[int], index: int, count: int
    ) -> None:
        """Register block `index` of a request being freed, its first `count` slots computed."""
        if block.ref_cnt != 1 or block.block_hash is not None:  # shared, or a full cached block
            return
        root = self._req_roots.get(request_id)
        if root is None:
            return
        hashes = self._extend_hashes(request_id, token_ids, index, root) if index else []
        if len(hashes) < index:
            return
        block.parent_hash = hashes[index - 1] if index else self._req_roots[request_id]
        block.token_ids = tuple(
            token_ids[index * self.block_size : index * self.block_size + count]
        )
        block.on_evict = self._forget_partial
        self._partial.setdefault(block.parent_hash, []).append(block)

    def _forget_partial(self, block: Block) -> None:
        """The pool reuses a kept partly filled block."""
        parent = block.parent_hash
        assert parent is not None  # set by _keep_partial
        kept = self._partial[parent]
        kept.remove(block)
        if not kept:
            del self._partial[parent]

    def free(
        self, request_id: str, token_ids: Sequence[int] = (), num_computed_tokens: int = 0
    ) -> None:
        """Drop the request's references; tail blocks go first into the free list,
        so they are evicted before the shared prefix blocks. With the request's tokens and how many
        have K/V, a partly filled last block is kept for `find_partial_block`."""
        blocks = self._req_blocks.pop(request_id, [])
        full, rest = divmod(num_computed_tokens, self.block_size)
        if self.enable_prefix_caching and rest and full < len(blocks):
            self._keep_partial(request_id, blocks[full], token_ids, full, rest)
        self.pool.free(reversed(blocks))
        self._req_hashes.pop(request_id, None)
        self._req_roots.pop(request_id, None)
