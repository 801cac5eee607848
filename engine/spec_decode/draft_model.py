"""Speculative decoding's draft model: a smaller checkpoint with the target's vocabulary proposes the
drafts, k greedy steps per target step (engine/spec_decode/proposer.py verifies them as any drafts).

The draft runs on a `ModelRunner` of its own (its own KV pool, its blocks from its own
`KVCacheManager`), driven with the same `StepRecord`s the engine's scheduler writes. Each request's
draft K/V is kept between steps: what the target accepted matches what the draft computed, so the
next call computes only from the first token that differs (the target's own token after the
accepted drafts, or every token after a rejection point).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from kvserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.step_record import NewRequestData, SamplingInputs, StepRecord
from kvserve.engine.spec_decode.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from kvserve.engine.spec_decode.proposer import Proposer
from kvserve.engine.tokenizer import load_model_files
from kvserve.engine.worker.runner import ModelRunner

if TYPE_CHECKING:
    from kvserve.engine.core.request import Request

logger = logging.getLogger(__name__)

_GREEDY = SamplingInputs(
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    seed=None,
    min_tokens=0,
    suppressed_token_ids=(),
    num_logprobs=None,
    num_prompt_logprobs=None,
)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelProposer(Proposer):
    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        target: ModelConfig,
        vocab_size: int,
        block_size: int,
        max_num_seqs: int,
    ) -> None:
        super().__init__(config, max_model_len)
        draft_config = replace(
            target,
            model=config.model,
            tokenizer=None,
            quantization=None,
            max_model_len=max_model_len,
        )
        files = load_model_files(draft_config)
        if files.hf_config.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model {config.model!r} has a vocabulary of {files.hf_config.vocab_size} "
                f"tokens, the target {vocab_size}: a draft must share the target's vocabulary"
            )
        # room for twice the sequences that may speculate at once, each at its full length plus the
        # drafts (a request holds its draft K/V until it finishes; when the pool is full, no drafts)
        blocks_per_seq = -(-(max_model_len + MAX_SPECULATIVE_TOKENS) // block_size)
        cache = CacheConfig(
            block_size=block_size,
            kv_cache_memory=None,
            num_kv_blocks=2 * config.max_batch_size * blocks_per_seq + 1,
            enable_prefix_caching=False,
        )
        # the other options take EngineArgs' defaults (sub_config)
        sched = SchedulerConfig(max_num_seqs, max_model_len + MAX_SPECULATIVE_TOKENS)  # type: ignore[call-arg]
        self.runner = ModelRunner(
            draft_config, cache, sched, files.model_path, files.hf_config, max_model_len
        )
        self.blocks = KVCacheManager(
            self.runner.num_kv_blocks, block_size, enable_prefix_caching=False
        )
        self.computed: dict[
            str, list[int]
        ] = {}  # request id -> the tokens whose draft K/V its blocks hold
        self._released: list[str] = []  # rows for the draft runner to drop on its next step
        logger.info(
            "speculative decoding: draft model %s (%d layers)",
            files.model_path,
            getattr(files.hf_config, "num_hidden_layers", 0),
        )

    def draft(self, request: Request, k: int) -> list[int]:
        rid, tokens = request.request_id, request.all_token_ids
        n = len(tokens)
        valid = min(
            _common_prefix(self.computed.get(rid, []), tokens), n - 1
        )  # at least one token to run
        if self.blocks.allocate(rid, n + k - 1) is None:
            return []  # the draft's pool is full: no drafts this step
        prompt = request.num_prompt_tokens
        new = NewRequestData(
            req_id=rid,
            prompt_token_ids=tuple(tokens[:prompt]),
            output_token_ids=tuple(tokens[prompt:]),
            block_ids=tuple(self.blocks.block_ids(rid)),
            sampling=_GREEDY,
        )
        # the runner takes the request anew each time (its tokens changed since), computing from `valid`
        drop, self._released = (*self._released, rid), []
        record = StepRecord(
            finished_req_ids=drop,
            preempted_req_ids=(),
            new_requests=(new,),
            req_ids=(rid,),
            num_computed_tokens=(valid,),
            num_scheduled_tokens=(n - valid,),
            new_block_ids={},
        )
        drafts: list[int] = []
        for i in range(k):
            token = self.runner.execute(record).sampled_token_ids[0]
            assert token is not None  # a decoding row always samples
            drafts.append(token)
            record = StepRecord(
                finished_req_ids=(),
                preempted_req_ids=(),
                new_requests=(),
                req_ids=(rid,),
                num_computed_tokens=(n + i,),
                num_scheduled_tokens=(1,),
                new_block_ids={},
            )
        self.computed[rid] = tokens + drafts[:-1]
        return drafts

    def release(self, request_id: str) -> None:
        self.blocks.free(request_id)  # (a no-op for a request that never drafted)
        if self.computed.pop(request_id, None) is not None:
            self._released.append(request_id)
