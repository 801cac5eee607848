"""Cross cache alone (encoder-decoder models): a source's encoder output in blocks of the shared pool,
shared by key, kept after its last holder only once written, dropped whole when a block is reused."""

from kvserve.engine.core.kv_cache_manager import KVCacheManager, prefix_root
from kvserve.engine.core.request import Request
from kvserve.engine.core.step_record import NewRequestData, SamplingInputs, StepRecord
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.seq2seq.cross_cache import CrossCache


def make(num_blocks=7, block_size=4, enable_prefix_caching=True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    return kv, CrossCache(kv.pool, block_size)


def test_encoder_output_kept_only_once_written():
    """Cross blocks outlive their last holder (prefix caching) only if a completed step wrote them;
    evicting any of them drops the whole kept output; another key never sees them."""
    kv, cross = make()
    assert cross.allocate("a", 8, b"src") is True
    cross.free("a")  # the step that would have run its encoder never completed
    assert cross.allocate("b", 8, b"src") is True  # so nothing was kept: encode again
    cross.written("b")
    blocks = cross.block_ids("b")
    cross.free("b")
    assert kv.num_free_blocks == 6  # kept, but free: counted as free
    assert cross.allocate("c", 8, b"other salt") is True and cross.block_ids("c") != blocks
    cross.free("c")
    assert cross.allocate("d", 8, b"src") is False and cross.block_ids("d") == blocks
    assert kv.num_free_blocks == 4
    cross.free("d")
    assert kv.allocate("e", 6 * 4) is not None  # takes every free block: the kept output is evicted
    kv.free("e")
    assert cross.allocate("f", 8, b"src") is True
    cross.free("f")
    assert kv.num_free_blocks == 6

    no_cache, no_cross = make(enable_prefix_caching=False)
    assert no_cross.allocate("a", 8, b"src") is True
    no_cross.written("a")
    no_cross.free("a")
    assert no_cross.allocate("b", 8, b"src") is True


def _request(rid: str, source: tuple[int, ...]) -> Request:
    return Request(
        rid,
        [0],
        SamplingParams(max_tokens=4),
        (1,),
        4,
        prefix_root=prefix_root(None, source),
        encoder_token_ids=source,
    )


def test_admit_counts_the_encoder_in_the_budget_and_shares_a_source():
    kv, cross = make(num_blocks=9)
    source = tuple(range(10, 19))  # 9 tokens: 3 blocks
    assert (
        cross.admit(_request("plain", ()), budget=4, has_scheduled=True) == 0
    )  # no source: nothing to do
    assert (
        cross.admit(_request("a", source), budget=9, has_scheduled=True) is None
    )  # not beside others
    assert kv.num_free_blocks == 8
    assert (
        cross.admit(_request("a", source), budget=9, has_scheduled=False) == 9
    )  # alone: it runs anyway
    assert cross.block_ids("a") == [1, 2, 3]
    assert (
        cross.admit(_request("b", source), budget=9, has_scheduled=True) is None
    )  # (the budget comes first)
    assert (
        cross.admit(_request("b", source), budget=64, has_scheduled=True) == 0
    )  # shares a's blocks
    assert cross.block_ids("b") == [1, 2, 3] and kv.num_free_blocks == 5
    assert (
        cross.admit(_request("c", tuple(range(30, 54))), budget=64, has_scheduled=False) is None
    )  # 6 > 5 free
    assert kv.num_free_blocks == 5


def test_mark_written_follows_the_steps_that_encoded():
    kv, cross = make()
    sampling = SamplingInputs.from_request(_request("x", (5,)))
    cross.allocate("a", 8, b"src")
    cross.allocate("b", 8, b"src")  # shares a's blocks
    new = (
        NewRequestData("a", (0,), (), (4,), sampling, (1, 2), 8, (5,) * 8),
        NewRequestData("b", (0,), (), (5,), sampling, (1, 2), 8, ()),
    )
    record = StepRecord((), (), new, ("a", "b"), (0, 0), (1, 1), {})
    cross.mark_written(record)
    cross.free("a")
    cross.free("b")
    assert cross.allocate("c", 8, b"src") is False  # kept: a's step wrote it
    cross.free("c")
    cross.mark_written(
        StepRecord((), (), new, ("a", "b"), (0, 0), (1, 1), {})
    )  # nobody holds a any more
    assert cross.allocate("d", 8, b"other") is True
    cross.free("d")
    assert kv.num_free_blocks == 6


def test_scheduler_with_a_cross_cache_encodes_a_source_once_and_frees_every_block():
    from kvserve.engine.config import SchedulerConfig
    from kvserve.engine.core.request import RequestStatus
    from kvserve.engine.core.scheduler import Scheduler

    kv, cross = make(num_blocks=16)
    sched = Scheduler(SchedulerConfig(4, 32), kv, 64, cross_cache=cross)
    source = tuple(range(10, 16))  # 6 tokens: 2 blocks
    for rid in ("a", "b"):
        sched.add(_request(rid, source))
    plan = sched.schedule()
    a, b = plan.record.new_requests
    assert (a.encoder_token_ids, a.cross_block_ids, a.cross_len) == (source, (1, 2), 6)
    assert (b.encoder_token_ids, b.cross_block_ids, b.cross_len) == (
        (),
        (1, 2),
        6,
    )  # shares a's encoding
    assert plan.num_batched_tokens == 6 + 1 + 1  # the source counts in the step's budget
    sched.update(plan, [7, 7])
    for rid in ("a", "b"):
        sched.finish(rid, RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 15  # the written encoder output is kept, but free
    sched.add(_request("c", source))
    (c,) = sched.schedule().record.new_requests
    assert c.encoder_token_ids == () and c.cross_block_ids == (1, 2)  # found it: no encoding
