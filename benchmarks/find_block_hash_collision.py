"""Find two different token blocks whose old prefix-cache keys collide.

The old key of a request's first block was Python's `hash((ROOT, *tokens))`. CPython's
tuple hash (3.8+) is xxHash-like and unkeyed: per item, acc += hash(item) * P2; acc =
rotl(acc, 31); acc *= P1. The last item enters as `acc + t_last * P2` before two
bijections, so two blocks collide exactly when their states after all but the last item,
times the inverse of P2, differ by the difference of their last tokens. A birthday search
over random prefixes (numpy, wrapping uint64 arithmetic) finds such a pair in seconds once
the vocabulary is large; tests/test_security_prefix_cache.py hard-codes the result.

    python benchmarks/find_block_hash_collision.py --vocab-size 65536 --block-size 16
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

OLD_ROOT_HASH = 0x6B76736572766531
P1 = 11400714785074694791
P2 = 14029467366897019727
P5 = 2870177450012600261
MASK = 2**64 - 1


def _rotl31(acc: np.ndarray) -> np.ndarray:
    return (acc << np.uint64(31)) | (acc >> np.uint64(33))


def _tokens(start: int, count: int, num_tokens: int, vocab_size: int, seed: int) -> np.ndarray:
    """Prefix i's tokens, a pure function of (seed, i): the winners are rebuilt, not stored."""
    index = np.arange(start, start + count, dtype=np.uint64)[:, None] * np.uint64(num_tokens)
    x = (
        index
        + np.arange(num_tokens, dtype=np.uint64)[None, :]
        + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
    )
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 finalizer
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (np.uint64(1) + x % np.uint64(vocab_size - 1)).astype(np.int64)  # ids in [1, vocab_size)


def _scaled_states(tokens: np.ndarray) -> np.ndarray:
    """acc after the root and all of `tokens` (one row per prefix), times inverse(P2) mod 2^64."""
    acc = np.full(tokens.shape[0], P5, dtype=np.uint64)
    lanes = [np.full(tokens.shape[0], OLD_ROOT_HASH % (2**61 - 1), dtype=np.uint64)]
    lanes += [tokens[:, j].astype(np.uint64) for j in range(tokens.shape[1])]
    for lane in lanes:
        acc = _rotl31(acc + lane * np.uint64(P2)) * np.uint64(P1)
    return acc * np.uint64(pow(P2, -1, 2**64))


def find_pair(
    vocab_size: int, block_size: int, log2_prefixes: int, seed: int
) -> tuple[list[int], list[int]] | None:
    num_prefixes, chunk = 1 << log2_prefixes, 1 << 21
    with np.errstate(over="ignore"):
        y = np.concatenate(
            [
                _scaled_states(
                    _tokens(s, min(chunk, num_prefixes - s), block_size - 1, vocab_size, seed)
                )
                for s in range(0, num_prefixes, chunk)
            ]
        )
        order = np.argsort(y, kind="stable")
        gaps = y[order[1:]] - y[order[:-1]]
    for k in np.flatnonzero(gaps < np.uint64(vocab_size - 1)):
        low, high = int(order[k]), int(order[k + 1])
        gap = int(gaps[k])
        if gap == 0:
            continue  # same state: equal prefixes, or a collision earlier in the chain; not wanted
        # y_high - y_low = gap, so state_high + 1 * P2 == state_low + (1 + gap) * P2
        a = _tokens(low, 1, block_size - 1, vocab_size, seed)[0].tolist() + [1 + gap]
        b = _tokens(high, 1, block_size - 1, vocab_size, seed)[0].tolist() + [1]
        if a != b and hash((OLD_ROOT_HASH, *a)) == hash((OLD_ROOT_HASH, *b)):
            return a, b
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=65536)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--log2-prefixes",
        type=int,
        default=25,
        help="prefixes tried; about log2(2^64 / vocab_size) / 2 + 1 finds a pair",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pair = find_pair(args.vocab_size, args.block_size, args.log2_prefixes, args.seed)
    if pair is None:
        print("no pair found; try more prefixes or another seed", file=sys.stderr)
        return 1
    a, b = pair
    print(f"BLOCK_A = {a}\nBLOCK_B = {b}\nhash = {hash((OLD_ROOT_HASH, *a))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
