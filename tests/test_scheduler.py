"""Scheduler: token budget, chunked prefill mixed with decode, preemption, abort, no leaks."""

import subprocess
import sys

import pytest

from kvserve.engine.config import SchedulerConfig
from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.request import Request, RequestStatus
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.sampling_params import SamplingParams

EOS = 0


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=1024):
    bm = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs, budget), bm, max_model_len), bm


def make_request(rid, prompt_len, max_tokens=4, **params):
    prompt = [100 + (hash(rid) + i) % 50 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), (EOS,), max_tokens)


def run_step(sched, token=7):
    plan = sched.schedule()
    sampled = [token if item.is_sampled else None for item in plan.scheduled]
    finished = sched.update(plan, sampled)
    return plan, finished


def test_scheduler_and_block_manager_do_not_import_torch():
    code = (
        "import sys, engine.core.scheduler, engine.core.kv_cache_manager, engine.core.block_pool, "
        "engine.core.request, engine.seq2seq.cross_cache; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_prefill_then_decode_until_max_tokens():
    sched, bm = make_scheduler()
    sched.add(make_request("a", prompt_len=10, max_tokens=3))
    plan, _ = run_step(sched)
    (item,) = plan.scheduled
    assert (item.start_pos, item.num_new_tokens, item.is_sampled) == (0, 10, True)
    plan, _ = run_step(sched)
    assert plan.scheduled[0].num_new_tokens == 1 and plan.scheduled[0].start_pos == 10
    plan, finished = run_step(sched)
    assert [f.request.request_id for f in finished] == ["a"]
    assert finished[0].request.status == RequestStatus.FINISHED_LENGTH
    assert bm.num_free_blocks == bm.num_blocks - 1
    assert not sched.has_unfinished()


def test_chunked_prefill_mixes_with_decode_under_budget():
    sched, _ = make_scheduler(budget=8)
    sched.add(make_request("a", prompt_len=3, max_tokens=10))
    run_step(sched)  # a prefilled
    sched.add(make_request("b", prompt_len=20, max_tokens=2))
    plan, _ = run_step(sched)
    assert [(i.request.request_id, i.num_new_tokens, i.is_sampled) for i in plan.scheduled] == [
        ("a", 1, True),
        ("b", 7, False),
    ]
    assert plan.num_batched_tokens == 8
    plan, _ = run_step(sched)
    assert [(i.request.request_id, i.start_pos, i.num_new_tokens) for i in plan.scheduled] == [
        ("a", 4, 1),
        ("b", 7, 7),
    ]
    plan, _ = run_step(sched)
    assert [(i.request.request_id, i.num_new_tokens, i.is_sampled) for i in plan.scheduled] == [
        ("a", 1, True),
        ("b", 6, True),
    ]


def test_max_num_seqs_limits_running():
    sched, _ = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add(make_request(rid, prompt_len=2))
    plan, _ = run_step(sched)
    assert [i.request.request_id for i in plan.scheduled] == ["a", "b"]
    assert sched.num_waiting == 1


def test_eos_and_stop_token_ids_and_min_tokens():
    sched, _ = make_scheduler()
    sched.add(make_request("a", 2, max_tokens=10))
    _, finished = run_step(sched, token=EOS)
    assert finished[0].request.status == RequestStatus.FINISHED_STOPPED

    sched.add(make_request("b", 2, max_tokens=10, stop_token_ids=[9]))
    _, finished = run_step(sched, token=9)
    assert finished[0].request.stop_reason == 9

    sched.add(make_request("c", 2, max_tokens=10, ignore_eos=True))
    _, finished = run_step(sched, token=EOS)
    assert finished == []

    sched2, _ = make_scheduler()
    sched2.add(make_request("d", 2, max_tokens=10, min_tokens=2))
    _, finished = run_step(sched2, token=EOS)
    assert finished == []  # below min_tokens
    _, finished = run_step(sched2, token=EOS)
    assert finished[0].request.request_id == "d"


def test_context_length_stops_generation():
    sched, _ = make_scheduler(max_model_len=6)
    sched.add(make_request("a", 4, max_tokens=100))
    run_step(sched)
    _, finished = run_step(sched)
    assert finished and finished[0].request.status == RequestStatus.FINISHED_LENGTH
    assert finished[0].request.num_tokens == 6


def test_preemption_newest_first_and_recompute():
    # 6 usable blocks of 2 tokens; two requests that each grow to 6 blocks
    sched, bm = make_scheduler(num_blocks=7, block_size=2, budget=64)
    sched.add(make_request("old", 4, max_tokens=8))
    sched.add(make_request("new", 4, max_tokens=8))
    preempted_ever = []
    for _ in range(40):
        if not sched.has_unfinished():
            break
        plan, _ = run_step(sched)
        preempted_ever += plan.preempted_req_ids
        # invariant: held blocks never exceed the pool
        assert bm.num_free_blocks >= 0
    assert not sched.has_unfinished()
    assert preempted_ever and preempted_ever[0] == "new"
    assert sched.num_preemptions == len(preempted_ever)
    assert bm.num_free_blocks == 6


def make_priority_request(rid, prompt_len, priority, arrival, max_tokens=8):
    prompt = [100 + (hash(rid) + i) % 50 for i in range(prompt_len)]
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens),
        (EOS,),
        max_tokens,
        arrival_time=arrival,
        priority=priority,
    )


def test_priority_policy_preempts_the_lowest_priority_first():
    # the same squeeze as above, but the earlier request has the lower priority (higher value):
    # fcfs would preempt the newer one, the priority policy preempts the earlier
    bm = KVCacheManager(7, 2)
    sched = Scheduler(SchedulerConfig(8, 64, scheduling_policy="priority"), bm, 1024)
    sched.add(make_priority_request("low", 4, priority=5, arrival=1.0))
    sched.add(make_priority_request("high", 4, priority=-5, arrival=2.0))
    preempted_ever, finished_order = [], []
    for _ in range(40):
        if not sched.has_unfinished():
            break
        plan, finished = run_step(sched)
        preempted_ever += plan.preempted_req_ids
        finished_order += [f.request.request_id for f in finished]
    assert not sched.has_unfinished()
    assert preempted_ever and set(preempted_ever) == {"low"}
    assert finished_order == ["high", "low"]
    assert bm.num_free_blocks == 6


def test_priority_policy_admits_by_priority_then_arrival():
    bm = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(1, 64, scheduling_policy="priority"), bm, 1024)  # one seat
    for rid, priority, arrival in (("b", 1, 1.0), ("c", 0, 3.0), ("a", 0, 2.0), ("d", 2, 0.5)):
        sched.add(make_priority_request(rid, 4, priority, arrival, max_tokens=1))
    order = []
    while sched.has_unfinished():
        plan, finished = run_step(sched)
        order += [f.request.request_id for f in finished]
    assert order == ["a", "c", "b", "d"]
    fcfs = Scheduler(
        SchedulerConfig(1, 64), KVCacheManager(64, 4), 1024
    )  # fcfs ignores priority: arrival order
    for rid, priority, arrival in (("b", 1, 1.0), ("c", 0, 3.0), ("a", 0, 2.0)):
        fcfs.add(make_priority_request(rid, 4, priority, arrival, max_tokens=1))
    order = []
    while fcfs.has_unfinished():
        order += [f.request.request_id for f in run_step(fcfs)[1]]
    assert order == ["b", "c", "a"]


def test_scheduling_policy_is_checked():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(8, 64, scheduling_policy="lifo")


def test_abort_frees_everything_at_any_time():
    sched, bm = make_scheduler(budget=4)
    sched.add(make_request("a", 10, max_tokens=5))
    sched.add(make_request("b", 3, max_tokens=5))
    run_step(sched)  # a mid-prefill, b waiting
    assert (
        sched.finish("a", RequestStatus.FINISHED_ABORTED).status == RequestStatus.FINISHED_ABORTED
    )
    assert sched.finish("b", RequestStatus.FINISHED_ABORTED) is not None
    assert sched.finish("missing", RequestStatus.FINISHED_ABORTED) is None
    assert bm.num_free_blocks == bm.num_blocks - 1
    assert not sched.has_unfinished()


def test_prefix_cache_hit_skips_computed_tokens():
    sched, bm = make_scheduler(block_size=4)
    a = make_request("a", 10, max_tokens=1)
    sched.add(a)
    run_step(sched)
    b = Request("b", list(a.prompt_token_ids), SamplingParams(max_tokens=1), (EOS,), 1)
    sched.add(b)
    plan, _ = run_step(sched)
    (item,) = plan.scheduled
    assert item.start_pos == 8 and item.num_new_tokens == 2
    assert bm.prefix_cache_hits == 8


def test_fcfs_waiting_request_not_overtaken():
    sched, _ = make_scheduler(num_blocks=5, block_size=4)  # 16 tokens of cache
    sched.add(make_request("big", 12, max_tokens=1))
    sched.add(make_request("huge", 16, max_tokens=1))
    sched.add(make_request("small", 2, max_tokens=1))
    plan, _ = run_step(sched)
    assert [i.request.request_id for i in plan.scheduled] == ["big"]


def test_engine_and_models_import_without_the_web_stack():
    """The GPU image has torch and transformers but no fastapi/pydantic (layering: server -> engine -> models)."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if (name.split('.')[0] in ('fastapi', 'pydantic', 'starlette', 'uvicorn')\n"
        "                or name.startswith(('kvserve.server', 'kvserve.loadtest'))):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import kvserve.engine, kvserve.models\n"
        "from kvserve.engine import LLM, AsyncLLM, SamplingParams, EngineArgs\n"
        "import kvserve.engine.worker.runner, kvserve.engine.llm_engine\n"
        "import kvserve.engine.async_llm, kvserve.models.loader\n"
        "import kvserve.models.default_model\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
