"""kvserve's own thread pool for the CPU kernels (models/csrc/host/pool.cpp) against torch's
OpenMP pool: the same bits, whichever pool and however many threads; calls from two threads at
once, a nested call, a forked child, and the choice `use_own_pool` makes."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from kvserve.models import cpu_ops

pytestmark = pytest.mark.skipif(
    not cpu_ops.load() or not cpu_ops.has_fast_bf16(),
    reason="no CPU kernel set could be built and run here",
)


@pytest.fixture
def pools():
    """Yields a function that switches pools; torch's is back afterwards (the default)."""
    yield cpu_ops.use_own_pool
    cpu_ops.use_own_pool(False)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 256, generator=g).bfloat16()
    packed = cpu_ops.pack_linear_weight(torch.randn(200, 256, generator=g).bfloat16())
    big = torch.randn(1000, 256, generator=g).bfloat16()
    return x, packed, big, torch.randn(256, generator=g).bfloat16()


def _run(x, packed, big, norm_w) -> list[torch.Tensor]:
    """Only the kernels (a forked child must not enter torch's OpenMP pool, which fork leaves stuck)."""
    return [cpu_ops.linear_bf16(x, packed, None, 200), cpu_ops.rms_norm(big, norm_w, 1e-5)]


def _work(seed: int = 0) -> list[torch.Tensor]:
    return _run(*_inputs(seed))


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_both_pools_and_any_thread_count_give_the_same_bits(pools):
    pools(False)
    expected = _work()
    pools(True)
    assert _same(_work(), expected)
    before = torch.get_num_threads()
    try:
        for n in (1, 3, before):  # the pool is remade for each count
            torch.set_num_threads(n)
            assert cpu_ops._lib.kv_num_threads() == n
            assert _same(_work(), expected)
    finally:
        torch.set_num_threads(before)


def test_calls_from_two_threads_at_once(pools):
    pools(True)
    expected = [_work(seed) for seed in range(4)]
    results: dict[int, bool] = {}

    def run(seed: int) -> None:
        results[seed] = all(_same(_work(seed), expected[seed]) for _ in range(20))

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == {s: True for s in range(4)}


def _child(queue, inputs) -> None:
    queue.put([t.tolist() for t in _run(*inputs)])


def test_a_forked_child_runs_the_kernels(pools):
    pools(True)
    inputs = _inputs()
    expected = _run(*inputs)  # the parent's pool has threads now; the child's copy has none
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue, inputs))
    child.start()
    got = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert got == [t.tolist() for t in expected]


def test_the_choice_and_its_override(pools, monkeypatch):
    parallel_for, num_threads = cpu_ops.torch_thread_pool()
    assert parallel_for and num_threads
    monkeypatch.setenv("KVSERVE_CPU_POOL", "torch")
    pools(True)  # the variable wins
    expected = _work()
    monkeypatch.setenv("KVSERVE_CPU_POOL", "kvserve")
    pools(False)
    assert _same(_work(), expected)
    monkeypatch.setenv("KVSERVE_CPU_POOL", "openmp")
    with pytest.raises(ValueError, match="KVSERVE_CPU_POOL must be kvserve or torch, not 'openmp'"):
        pools(True)
