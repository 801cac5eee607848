"""Cost of the prefix-cache keys: the old unkeyed tuple hash against SHA-256 (and BLAKE2b).

Three measurements, old and new side by side, alternating within one run:
  1. per full block: the key alone (tuple hash, SHA-256, BLAKE2b-256) and the token check
     a hit adds;
  2. the block manager's work for one long prompt that misses (look-up, allocation, keys
     registered chunk by chunk as prefill computes them, free);
  3. the same prompt again once it is cached (a full-prefix hit: keys and token checks);
and with --engine, for scale, the whole prefill of a prompt on the embedded default model.
The old block manager is `engine/kv_cache.py` at --old-rev, read with `git show`; the new one is
`engine/core/kv_cache_manager.py` (`KVCacheManager`, over `engine/core/block_pool.py`).

    python benchmarks/bench_prefix_keys.py --prompt-tokens 8192 --repeats 31 --engine
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvserve.engine.core import kv_cache_manager as new_kv  # noqa: E402


def load_old(rev: str):
    source = subprocess.run(
        ["git", "show", f"{rev}:engine/kv_cache.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    spec = importlib.util.spec_from_loader("old_kv_cache", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, "old_kv_cache.py", "exec"), module.__dict__)
    return module


def manager(module, num_blocks: int, block_size: int):
    """The module's block manager: `KVCacheManager` today, `BlockManager` at the old revision."""
    cls = getattr(module, "KVCacheManager", None) or module.BlockManager
    return cls(num_blocks=num_blocks, block_size=block_size)


def per_call_ns(fn, number: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter_ns() - start) / number)
    return best


def bench_block_key(block_size: int, repeats: int) -> dict[str, float]:
    tokens = [random.randrange(150_000) for _ in range(block_size)]
    digest = hashlib.sha256(b"parent").digest()
    stored = tuple(tokens)
    packed = new_kv.pack_token_ids(tokens)
    cases = {
        "old: hash((parent, *tokens))": lambda: hash((12345, *tokens)),
        "new: hash_block(parent, pack_token_ids(tokens))": lambda: new_kv.hash_block(
            digest, new_kv.pack_token_ids(tokens)
        ),
        "  packing 16 ids to uint32 bytes": lambda: new_kv.pack_token_ids(tokens),
        "  sha256(parent + packed), inline": lambda: hashlib.sha256(digest + packed).digest(),
        "  blake2b-256(parent + packed), inline": lambda: hashlib.blake2b(
            digest + packed, digest_size=32
        ).digest(),
        "hit check: stored == tuple(tokens)": lambda: stored == tuple(tokens),
    }
    results = {name: [] for name in cases}
    for _ in range(repeats):  # alternate the cases, so drift hits them alike
        for name, fn in cases.items():
            results[name].append(per_call_ns(fn, 20_000, 3))
    return {name: statistics.median(values) for name, values in results.items()}


def miss_then_register(module, prompt: list[int], block_size: int, chunk: int, rid: str) -> float:
    """One prefill that finds nothing: look-up, allocate, register keys per chunk, free."""
    bm = manager(module, len(prompt) // block_size + 8, block_size)
    start = time.perf_counter()
    assert bm.find_cached_prefix(rid, prompt) == []
    for done in range(chunk, len(prompt) + chunk, chunk):
        done = min(done, len(prompt))
        bm.allocate(rid, done)
        bm.cache_full_blocks(rid, prompt, done)
    bm.free(rid)
    return time.perf_counter() - start


def hit(module, prompt: list[int], block_size: int) -> float:
    """The same prompt once cached: the look-up of every block, and taking them."""
    bm = manager(module, len(prompt) // block_size + 8, block_size)
    bm.allocate("warm", len(prompt))
    bm.cache_full_blocks("warm", prompt, len(prompt))
    bm.free("warm")
    start = time.perf_counter()
    hit_ids = bm.find_cached_prefix("again", prompt)
    bm.allocate("again", len(prompt), hit_ids)
    elapsed = time.perf_counter() - start
    assert len(hit_ids) == (len(prompt) - 1) // block_size
    return elapsed


def engine_prefill(old_kv, repeats: int) -> None:
    """End to end on the embedded default model (CPU): a prompt as long as its context, once
    cold and once cached, with the old block manager swapped in and the new one, alternating."""
    from kvserve.engine import LLM, SamplingParams

    class OldKeys(old_kv.BlockManager):  # the old manager under the scheduler's new call signature
        def find_cached_prefix(self, request_id, token_ids, root=None):
            return super().find_cached_prefix(request_id, token_ids)

        def cache_full_blocks(self, request_id, token_ids, num_computed_tokens, root=None):
            return super().cache_full_blocks(request_id, token_ids, num_computed_tokens)

        def find_partial_block(self, request_id, token_ids, num_cached_blocks):
            return 0, 0  # the old manager kept no partly filled blocks

        def allocate(self, request_id, num_tokens, cached_block_ids=(), partial_block=(0, 0)):
            return super().allocate(request_id, num_tokens, cached_block_ids)

        def take_block_copies(self):
            return ()

        def free(self, request_id, token_ids=(), num_computed_tokens=0):
            return super().free(request_id)

    engines = {"old": LLM(dtype="float32", device="cpu"), "new": LLM(dtype="float32", device="cpu")}
    bm = engines["old"].engine.kv_cache_manager
    engines["old"].engine.kv_cache_manager = engines["old"].engine.scheduler.kv_cache_manager = (
        OldKeys(bm.num_blocks, bm.block_size, bm.enable_prefix_caching)
    )
    info = engines["new"].engine.info
    num_tokens = info.max_model_len - 1
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times = {(kind, impl): [] for kind in ("cold", "cached") for impl in engines}
    for _ in range(repeats):
        prompt = [random.randrange(3, info.vocab_size) for _ in range(num_tokens)]
        for impl, llm in engines.items():
            for kind in ("cold", "cached"):
                start = time.perf_counter()
                llm.generate([prompt], params, use_tqdm=False)
                times[(kind, impl)].append(time.perf_counter() - start)
    print(
        f"\nengine, default model ({info.max_model_len}-token context, CPU), one {num_tokens}-token prompt "
        f"and 1 generated token, median of {repeats}:"
    )
    for kind in ("cold", "cached"):
        old_ms, new_ms = (statistics.median(times[(kind, impl)]) * 1e3 for impl in ("old", "new"))
        print(f"  {kind:8s} old {old_ms:8.1f} ms   new {new_ms:8.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--chunk-tokens", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)"
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--old-rev", default="393ee78", help="git revision with the old tuple-hash keys"
    )
    parser.add_argument(
        "--engine",
        action="store_true",
        help="also time prefill end to end on the embedded default model (CPU)",
    )
    args = parser.parse_args()
    random.seed(0)
    old_kv = load_old(args.old_rev)
    print(
        f"python {platform.python_version()}, {platform.machine()}, {platform.processor() or '?'}"
    )

    print(f"\nper block of {args.block_size} tokens (median of {args.repeats}, best-of-3 each):")
    for name, ns in bench_block_key(args.block_size, args.repeats).items():
        print(f"  {name:48s} {ns:8.0f} ns")

    prompt = [random.randrange(150_000) for _ in range(args.prompt_tokens)]
    rows = {(kind, impl): [] for kind in ("miss", "hit") for impl in ("old", "new")}
    for i in range(args.repeats):  # old and new alternate
        for impl, module in (("old", old_kv), ("new", new_kv)):
            rows[("miss", impl)].append(
                miss_then_register(module, prompt, args.block_size, args.chunk_tokens, f"r{i}")
            )
            rows[("hit", impl)].append(hit(module, prompt, args.block_size))
    num_blocks = args.prompt_tokens // args.block_size
    print(
        f"\nblock manager, one {args.prompt_tokens}-token prompt ({num_blocks} blocks), "
        f"median of {args.repeats}, old and new alternating:"
    )
    for kind, what in (
        ("miss", "prefill miss (look-up + keys per chunk)"),
        ("hit", "full-prefix hit"),
    ):
        old_ms = statistics.median(rows[(kind, "old")]) * 1e3
        new_ms = statistics.median(rows[(kind, "new")]) * 1e3
        print(
            f"  {what:42s} old {old_ms:7.3f} ms   new {new_ms:7.3f} ms   (+{new_ms - old_ms:.3f} ms)"
        )
    if args.engine:
        engine_prefill(old_kv, max(3, args.repeats // 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
