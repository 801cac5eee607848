"""The KV pool: zero pages without a write, the default sizing rule, explicit sizes kept."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvserve.engine.config import CacheConfig, SchedulerConfig
from kvserve.engine.worker import kv_pool
from kvserve.models import hugepages
from kvserve.models.timing import PhaseTimer, phase

CPU = torch.device("cpu")


def cache(num_kv_blocks=None, kv_cache_memory=None, block_size=16) -> CacheConfig:
    return CacheConfig(block_size, kv_cache_memory, num_kv_blocks, enable_prefix_caching=True)


def sched(max_num_seqs=256) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs, max_num_batched_tokens=2048)


@pytest.fixture
def big_ram(monkeypatch):
    """As if the RAM share were far larger than any default needs."""
    monkeypatch.setattr(kv_pool, "kv_cache_budget_bytes", lambda device: 2**40)


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((3, 5), torch.float32),
        ((2, 300, 16, 2, 64), torch.bfloat16),
        ((2, 4096, 16, 3, 64), torch.float16),
    ],
)
def test_hugepages_zeros_reads_zero_without_a_write(shape, dtype):
    x = hugepages.zeros(shape, dtype)
    assert x.shape == shape and x.dtype == dtype and x.is_contiguous()
    assert not x.any()
    x[-1].fill_(3)  # writable, and the rest stays zero
    assert x[-1].eq(3).all() and not x[:-1].any()


def test_hugepages_zeros_is_aligned_for_huge_pages():
    x = hugepages.zeros((4 * hugepages.HUGE_PAGE,), torch.uint8)
    assert x.data_ptr() % hugepages.HUGE_PAGE == 0


def test_default_cpu_pool_is_32k_tokens(big_ram):
    num_blocks = kv_pool.num_blocks_for(
        cache(), sched(), max_model_len=2048, block_bytes=1024, device=CPU
    )
    assert num_blocks == kv_pool.DEFAULT_CPU_KV_TOKENS // 16 + 1  # + the null block


def test_default_cpu_pool_holds_one_full_length_sequence(big_ram):
    num_blocks = kv_pool.num_blocks_for(
        cache(), sched(), max_model_len=131072, block_bytes=1024, device=CPU
    )
    assert num_blocks == 131072 // 16 + 1


def test_default_never_exceeds_what_max_num_seqs_can_fill(big_ram):
    num_blocks = kv_pool.num_blocks_for(
        cache(), sched(max_num_seqs=2), max_model_len=1000, block_bytes=1024, device=CPU
    )
    assert num_blocks == 2 * 63 + 1


def test_default_is_capped_by_the_ram_share(monkeypatch):
    monkeypatch.setattr(kv_pool, "kv_cache_budget_bytes", lambda device: 100 * 1024)
    assert kv_pool.num_blocks_for(cache(), sched(), 2048, block_bytes=1024, device=CPU) == 100


@pytest.mark.parametrize(
    "config, expected",
    [
        (cache(num_kv_blocks=100_000), 100_000),
        (cache(kv_cache_memory=10 * 2**30), 10 * 2**30 // 4096),
        (cache(num_kv_blocks=7, kv_cache_memory=2**30), 7),
    ],
)
def test_explicit_sizes_are_kept(monkeypatch, config, expected):
    monkeypatch.setattr(kv_pool, "kv_cache_budget_bytes", lambda device: 0)  # never consulted
    assert (
        kv_pool.num_blocks_for(config, sched(max_num_seqs=1), 64, block_bytes=4096, device=CPU)
        == expected
    )


def test_too_small_a_pool_raises():
    with pytest.raises(ValueError, match="KV cache too small: 1 blocks"):
        kv_pool.num_blocks_for(
            cache(kv_cache_memory=5000), sched(), 64, block_bytes=4096, device=CPU
        )


def test_allocate_gives_each_layer_a_zero_cache(caplog):
    layers = [
        SimpleNamespace(num_kv_heads=2, head_dim=32, kv_cache=None),
        SimpleNamespace(num_kv_heads=1, head_dim=64, kv_cache=None),
    ]
    with caplog.at_level(logging.INFO, logger="kvserve.engine.worker.kv_pool"):
        num_blocks = kv_pool.allocate_kv_pool(
            layers, cache(num_kv_blocks=9, block_size=4), sched(), 64, torch.bfloat16, CPU
        )
    assert num_blocks == 9
    assert layers[0].kv_cache.shape == (2, 9, 4, 2, 32) and layers[1].kv_cache.shape == (
        2,
        9,
        4,
        1,
        64,
    )
    assert all(not layer.kv_cache.any() for layer in layers)
    assert "KV cache: 8 blocks x 4 tokens = 32 tokens" in caplog.text
    assert kv_pool.bytes_per_block(layers, 4, torch.bfloat16) == 2 * 4 * (2 * 32 + 64) * 2


def test_phase_timer_charges_nested_phases_once():
    timer = PhaseTimer()
    with phase("untimed"):  # no timer active: nothing recorded anywhere
        pass
    with timer.active():
        with phase("outer"):
            with phase("inner"):
                pass
        with phase("inner"):
            pass
    assert list(timer.seconds) == ["outer", "inner"]
    assert sum(timer.seconds.values()) <= timer.total
    assert "other " in timer.summary()


def test_engine_logs_its_start_up_phases_and_default_pool(llama_dir, caplog):
    from kvserve.engine import EngineArgs, LLMEngine

    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        engine = LLMEngine(EngineArgs(model=llama_dir, device="cpu", max_num_seqs=4))
    line = next(
        r.getMessage() for r in caplog.records if r.getMessage().startswith("engine start-up")
    )
    assert re.match(
        r"engine start-up \d+\.\d\d s: (\w[\w+ ]* \d+\.\d\d, )*other \d+\.\d\d", line
    ), line
    assert (
        engine.info.num_kv_blocks == 4 * (engine.info.max_model_len // 16) + 1
    )  # 4 full-length sequences


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="anonymous mappings and madvise are Linux's"
)
def test_populate_faults_pages_in_and_keeps_zeros():
    def rss_anon_kib() -> int:
        line = next(
            x
            for x in Path("/proc/self/status").read_text().splitlines()
            if x.startswith("RssAnon:")
        )
        return int(line.split()[1])

    pool = hugepages.zeros((64, 1024, 1024), torch.uint8)  # 64 MiB, not touched yet
    before = rss_anon_kib()
    assert hugepages.populate(pool, chunk_bytes=8 << 20)
    assert rss_anon_kib() - before >= 60 * 1024  # the pages are resident now
    assert int(pool.count_nonzero()) == 0
