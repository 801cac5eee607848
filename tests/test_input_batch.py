"""The scheduler -> runner step record (plain data) and the runner's persistent InputBatch.

Most tests drive a real Scheduler and an InputBatch with made-up sampled tokens (no
model): after every step the batch's rows must mirror the scheduler's running
requests, and its sampling tensors must equal the from-scratch builder's.
"""

from __future__ import annotations

import pickle
import random

import msgspec
import numpy as np
import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.config import SchedulerConfig
from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.request import Request, RequestStatus
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.core.step_record import NewRequestData, SamplingInputs, StepRecord
from kvserve.engine.worker.input_batch import InputBatch
from kvserve.engine.worker.sampler import Sampler, apply_penalty_state, penalty_state
from sampling_inputs import build_sampling_tensors

VOCAB = 40
EOS = 0
CPU = torch.device("cpu")


class Harness:
    """A scheduler and an InputBatch driven like the engine drives the runner."""

    def __init__(self, num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=64):
        self.bm = KVCacheManager(num_blocks, block_size)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget), self.bm, max_model_len)
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size, VOCAB, CPU)
        self.rng = random.Random(0)
        self.num_prompts = 0

    def add(
        self, rid: str, prompt_len: int = 6, max_tokens: int = 8, seed: int | None = None, **params
    ) -> Request:
        prompt = [self.rng.randrange(1, VOCAB) for _ in range(prompt_len)]
        params.setdefault("temperature", 0.0)
        req = Request(
            rid,
            prompt,
            SamplingParams(max_tokens=max_tokens, seed=seed, **params),
            (EOS,),
            max_tokens,
            seed=seed,
        )
        self.sched.add(req)
        return req

    def step(self, pick=None):
        """One step; `pick(request) -> token`; returns (plan, the step's sampling tensors)."""
        plan = self.sched.schedule()
        if plan.is_empty:
            return plan, None
        record, batch = plan.record, self.batch
        running_ids = [r.request_id for r in self.sched.running]
        batch.update(record)
        self.check_rows(running_ids)
        num_reqs = len(record.req_ids)
        computed = np.array(record.num_computed_tokens)
        is_sampled = computed + np.array(record.num_scheduled_tokens) == batch.num_tokens[:num_reqs]
        assert is_sampled.tolist() == [it.is_sampled for it in plan.scheduled]
        tensors = batch.sampling_tensors(num_reqs)
        pick = pick or (lambda req: self.rng.randrange(1, VOCAB))
        tokens = [pick(it.request) if it.is_sampled else 0 for it in plan.scheduled]
        rows = np.flatnonzero(is_sampled)
        mask = None if is_sampled.all() else torch.tensor(is_sampled, dtype=torch.float32)
        batch.append_sampled(rows, np.array(tokens)[rows], torch.tensor(tokens), mask)
        self.sched.update(plan, [t if s else None for t, s in zip(tokens, is_sampled)])
        return plan, tensors

    def check_rows(self, running_ids: list[str]) -> None:
        """Rows mirror the running requests: ids, tokens and block tables (zero-padded)."""
        batch = self.batch
        assert batch.req_ids == running_ids
        assert batch.row_of == {r: i for i, r in enumerate(running_ids)}
        for row, rid in enumerate(running_ids):
            req = self.sched.requests[rid]
            assert batch.token_ids[row, : batch.num_tokens[row]].tolist() == req.all_token_ids
            assert batch.num_prompt_tokens[row] == req.num_prompt_tokens
            block_ids = self.bm.block_ids(rid)
            assert batch.block_table[row, : len(block_ids)].tolist() == block_ids
            assert not batch.block_table[row, len(block_ids) :].any()

    def run(self, max_steps=200, pick=None):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step(pick)
        raise AssertionError("did not finish")


def _walk(obj, path="record"):
    """Every leaf is an int, float, str, bool or None; containers are tuples, lists, dicts."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return
    if isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            _walk(x, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(k, f"{path} key")
            _walk(v, f"{path}[{k!r}]")
    elif type(obj) in (StepRecord, NewRequestData, SamplingInputs):
        for f in msgspec.structs.fields(obj):
            _walk(getattr(obj, f.name), f"{path}.{f.name}")
    else:
        raise AssertionError(f"{path} is a {type(obj).__name__}")


def test_step_record_is_plain_data_and_pickles():
    h = Harness(num_blocks=10, budget=8)
    h.add(
        "a",
        prompt_len=10,
        seed=3,
        temperature=0.7,
        top_k=5,
        min_tokens=2,
        stop_token_ids=[7],
        logprobs=2,
        prompt_logprobs=1,
        repetition_penalty=1.2,
    )
    h.add("b", prompt_len=3)
    records = []
    for _ in range(12):
        plan, _ = h.step()
        if not plan.is_empty:
            records.append(plan.record)
    assert any(r.new_requests for r in records) and any(r.new_block_ids for r in records)
    for record in records:
        _walk(record)
        assert pickle.loads(pickle.dumps(record)) == record
    first = records[0].new_requests[0]
    assert first.sampling == SamplingInputs(
        temperature=0.7,
        top_k=5,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=1.2,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        seed=3,
        min_tokens=2,
        suppressed_token_ids=(7, EOS),
        num_logprobs=2,
        num_prompt_logprobs=1,
    )


def test_rows_compacted_after_finish_abort_and_preempt():
    h = Harness(num_blocks=11, block_size=4, budget=64)
    for i, max_tokens in enumerate([3, 12, 6, 12, 12]):
        h.add(str(i), prompt_len=5, max_tokens=max_tokens)
    h.step()
    assert h.batch.req_ids == ["0", "1", "2", "3", "4"]
    seen_preempted = False
    for k in range(40):  # finishes at different times, and the small pool preempts
        if k == 6:
            assert h.batch.req_ids == ["1", "3", "4"]  # "4" was preempted and came back last
            h.sched.finish("3", RequestStatus.FINISHED_ABORTED)  # abort from the middle
        plan, _ = h.step()
        seen_preempted |= bool(plan.record.preempted_req_ids)
        if not h.sched.has_unfinished():
            break
    assert seen_preempted and h.sched.num_preemptions > 0
    assert "3" not in h.batch.row_of
    h.step()  # nothing scheduled: rows stay until a step carries the drops
    h.add("late", prompt_len=3, max_tokens=1)
    h.step()  # carries the last finishes, then adds "late"
    assert h.batch.req_ids == ["late"]


def test_drops_survive_an_empty_step():
    h = Harness()
    h.add("a", max_tokens=2)
    h.run()
    assert h.batch.req_ids == ["a"]  # its finish is pending: no step has carried it yet
    plan = h.sched.schedule()
    assert plan.is_empty and plan.record.finished_req_ids == ()
    h.add("b", max_tokens=1)
    plan, _ = h.step()
    assert plan.record.finished_req_ids == ("a",) and h.batch.req_ids == ["b"]


def test_block_table_rows_updated_in_place():
    h = Harness(block_size=4)
    h.add("a", prompt_len=7, max_tokens=20)  # next block at token 9
    h.add("b", prompt_len=2, max_tokens=20)  # next block at token 5
    h.step()
    table = h.batch.block_table
    for _ in range(6):
        before = table.copy()
        plan, _ = h.step()
        assert h.batch.block_table is table
        changed = set(zip(*np.nonzero(before != table)))
        expected = {
            (h.batch.row_of[rid], int(h.batch.num_blocks[h.batch.row_of[rid]]) - len(ids) + j)
            for rid, ids in plan.record.new_block_ids.items()
            for j in range(len(ids))
        }
        assert changed == expected


def test_sampling_tensors_cached_and_flags_current():
    h = Harness()
    h.add("greedy", max_tokens=2)
    h.add("random", max_tokens=6, temperature=0.8, top_p=0.9)
    _, t1 = h.step()
    assert (t1.all_greedy, t1.all_random, t1.no_top_p) == (False, False, False)
    _, t2 = h.step()
    assert t2 is t1  # nothing joined or left: the device tensors are reused as they are
    _, t3 = h.step()  # "greedy" finished in the previous step: its row is gone
    assert h.batch.req_ids == ["random"]
    assert (t3.all_greedy, t3.all_random) == (False, True)
    assert t3.temperature.tolist() == pytest.approx([0.8])


def _reference(plan) -> object:
    """The old from-scratch sampling tensors for the same step."""
    return build_sampling_tensors([it.request for it in plan.scheduled], VOCAB, CPU)


def test_sampling_matches_the_from_scratch_builder_over_many_steps():
    """Penalties, seeds, min_tokens, logprobs: every step's tensors and draws equal the old builder's,
    through joins, finishes at different times, aborts, preemptions and resumes."""
    h = Harness(num_blocks=16, budget=16, max_num_seqs=6)
    kinds = [
        dict(
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            presence_penalty=0.2,
            temperature=0.9,
            seed=1,
        ),
        dict(temperature=0.0, min_tokens=4, stop_token_ids=[5]),
        dict(temperature=1.0, top_k=7, logprobs=3),
        dict(repetition_penalty=0.8, temperature=0.0, min_tokens=2),
        dict(temperature=0.7, min_p=0.05, seed=11, n=2),
        dict(frequency_penalty=-0.5, temperature=1.2, top_p=0.8),
    ]
    for i in range(12):
        h.add(
            f"r{i}",
            prompt_len=3 + (5 * i) % 11,
            max_tokens=4 + (3 * i) % 9,
            **kinds[i % len(kinds)],
        )
    sampler = Sampler()
    gen = torch.Generator().manual_seed(0)
    for num_steps in range(300):
        if num_steps == 5:
            h.sched.finish("r2", RequestStatus.FINISHED_ABORTED)
        plan = h.sched.schedule()
        if plan.is_empty:
            if not h.sched.has_unfinished():
                break
            continue
        batch, record = h.batch, plan.record
        batch.update(record)
        num_reqs = len(record.req_ids)
        new = batch.sampling_tensors(num_reqs)
        old = _reference(plan)
        for name in (
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            assert torch.equal(getattr(new, name), getattr(old, name)), name
        for name in (
            "max_num_logprobs",
            "all_greedy",
            "all_random",
            "no_top_k",
            "no_top_p",
            "no_min_p",
            "no_penalties",
            "max_top_k",
            "needs_logprobs",
            "top_p_rows_have_top_k",
        ):
            assert getattr(new, name) == getattr(old, name), name
        assert (new.suppressed_token_ids is None) == (old.suppressed_token_ids is None)
        if old.suppressed_token_ids is not None:

            def banned(t):
                return [set(row) - {VOCAB} for row in t.suppressed_token_ids.tolist()]

            assert banned(new) == banned(old)
        if old.seeded_rows is not None:
            rows = old.seeded_rows
            assert torch.equal(new.seeded_rows, rows)
            assert torch.equal(new.seeds[rows], old.seeds[rows]) and torch.equal(
                new.steps[rows], old.steps[rows]
            )
        logits = torch.randn(num_reqs, VOCAB, generator=gen) * 3
        if not old.no_penalties:
            old_mask, old_counts = penalty_state(
                old.prompt_token_ids, old.output_token_ids, num_reqs, VOCAB, CPU
            )
            args = (old.repetition_penalty, old.presence_penalty, old.frequency_penalty)
            assert torch.equal(
                apply_penalty_state(logits, new.prompt_mask, new.output_counts, *args),
                apply_penalty_state(logits, old_mask, old_counts, *args),
            )
        torch.manual_seed(num_steps)
        new_out = sampler(logits, new)
        torch.manual_seed(num_steps)
        old_out = sampler(logits, old)
        assert torch.equal(new_out.sampled_token_ids, old_out.sampled_token_ids)
        # feed the draws back (EOS now and then, to stop some early)
        tokens = new_out.sampled_token_ids.clone()
        tokens[torch.rand(num_reqs, generator=gen) < 0.05] = EOS
        is_sampled = np.array([it.is_sampled for it in plan.scheduled])
        rows = np.flatnonzero(is_sampled)
        mask = None if is_sampled.all() else torch.tensor(is_sampled, dtype=torch.float32)
        batch.append_sampled(rows, tokens.numpy()[rows], tokens, mask)
        h.sched.update(plan, [int(t) if s else None for t, s in zip(tokens, is_sampled)])
    assert not h.sched.has_unfinished()
    assert h.sched.num_preemptions > 0


# ---- end to end (tiny llama, fp32) ----


def _llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cpu", block_size=4, **kw)


def test_prompt_logprobs_under_chunked_prefill_and_preemption(llama_dir):
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate([30, 11, 23, 2])]
    params = SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=2, logprobs=1
    )
    calm = _llm(llama_dir).generate(prompts, params, use_tqdm=False)
    llm = _llm(llama_dir, max_num_batched_tokens=7, num_kv_blocks=14)
    pressed = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions_total > 0
    for a, b, prompt in zip(calm, pressed, prompts):
        assert len(b.prompt_logprobs) == len(prompt) and b.prompt_logprobs[0] is None
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert [v.logprob for v in x.values()] == pytest.approx(
                [v.logprob for v in y.values()], abs=1e-4
            )
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_penalties_seeds_and_min_tokens_survive_preemption(llama_dir):
    prompts = [list(range(5, 5 + n)) for n in (9, 14, 6)]
    params = SamplingParams(
        n=2,
        temperature=0.8,
        seed=5,
        max_tokens=12,
        min_tokens=6,
        repetition_penalty=1.5,
        frequency_penalty=0.7,
        presence_penalty=0.3,
        logprobs=2,
    )
    calm = _llm(llama_dir).generate(prompts, params, use_tqdm=False)
    llm = _llm(llama_dir, num_kv_blocks=12, max_num_batched_tokens=8)
    pressed = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions_total > 0
    for a, b in zip(calm, pressed):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert len({tuple(c.token_ids) for c in a.outputs}) == 2  # the two samples differ
    assert llm.engine.runner.batch.num_reqs == 0 or not llm.engine.has_unfinished_requests()
