"""Model runner: turns a step's plain-data `StepRecord` into flat tensors, runs the model, samples.

It owns the model, the KV cache tensors, the sampler and a persistent `InputBatch`
(engine/worker/input_batch.py) that each record updates: it never sees a live `Request`,
never allocates blocks (the block manager did) and never decides who runs (the
scheduler did).
`execute` makes exactly one device-to-host copy in the common path: the sampled
token ids (logprobs, when asked for, come with them).

With tensor parallelism (engine/worker/executor.py) this runner is rank 0: it holds its shard of
the model and samples; `engine.worker.tp_worker.WorkerRunner` (ranks 1..N-1) runs the same forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvserve.engine.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from kvserve.engine.core.step_record import (
    GrammarBitmask,
    NewRequestData,
    SamplingInputs,
    StepRecord,
)
from kvserve.engine.spec_decode.verify import SpecRows, accept, expand_sampling, spec_rows
from kvserve.engine.worker.cuda_graphs import DecodeGraphs
from kvserve.engine.worker.device import resolve_device, resolve_dtype
from kvserve.engine.worker.input_batch import InputBatch
from kvserve.engine.worker.kv_pool import allocate_kv_pool, bytes_per_block, num_blocks_for
from kvserve.engine.worker.logits_processors import LogitsProcessors
from kvserve.engine.worker.lora import LoRAManager
from kvserve.engine.worker.memory_profile import MemoryProfile, profile_kv_budget
from kvserve.engine.worker.pooler import Pooler
from kvserve.engine.worker.sampler import Sampler
from kvserve.models import cpu_stack
from kvserve.models.attention import Attention, AttentionMetadata, forward_context
from kvserve.models.cpu_stack import CpuDecoderStack
from kvserve.models.loader import load_model
from kvserve.models.parallel import ParallelState
from kvserve.models.timing import phase

if TYPE_CHECKING:
    from kvserve.models.quantization import QuantizationReport

logger = logging.getLogger(__name__)

# (token id, logprob, rank) of the chosen token, then the top-k ids and logprobs
TokenLogprobs = tuple[int, float, int, list[int], list[float]]


@dataclass(slots=True)
class RunnerOutput:
    sampled_token_ids: list[int | None]  # aligned with plan.scheduled
    logprobs: dict[str, TokenLogprobs]  # request id -> the sampled token's logprobs
    prompt_logprobs: dict[str, list[TokenLogprobs]]  # request id -> new prompt positions
    # speculative decoding: request id -> its accepted drafts, which come before its sampled token,
    # and their logprobs (for requests that asked for logprobs)
    accepted: dict[str, tuple[int, ...]] = field(default_factory=dict)
    draft_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # embedding requests whose prompt this step completed: request id -> the vector (little-endian float32)
    pooled: dict[str, bytes] = field(default_factory=dict)


class ModelRunner:
    """The whole model in this process: an `Executor` (engine/worker/executor_protocol.py), and rank 0's
    part of a tensor-parallel one."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        model_path: str,
        hf_config: Any,
        max_model_len: int,
        parallel: ParallelState | None = None,
        join_group: Callable[[], None] | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """`parallel`: this rank of a tensor-parallel group (None: the whole model here); the
        model loads its shard, then `join_group()` connects the ranks (every later step, the
        memory profile and the KV pool sizing included, runs in lockstep on all of them).
        `lora_config`: serve LoRA adapters (engine/worker/lora.py): no CUDA graphs then (the model runs
        its Python forward); on the CPU in bf16 the C++ decoder stack runs the adapters too."""
        self.device = resolve_device(model_config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # this thread's kernels and graphs go to cuda:N
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        self.block_size = cache_config.block_size
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = max_model_len
        torch.manual_seed(model_config.seed)
        # the class varies by architecture (models/registry.py); its methods are duck-typed
        self.model: Any = load_model(
            model_path,
            hf_config,
            self.dtype,
            self.device,
            model_config.attention_backend,
            parallel,
            model_config.quantization,
            model_config.quantization_group_size,
            max_model_len=max_model_len,
        )
        self.parallel = parallel if parallel is not None and parallel.size > 1 else None
        if join_group is not None:
            join_group()
        self.vocab_size = hf_config.vocab_size
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.attn_backend = self.attn_layers[0].backend
        self.lora: LoRAManager | None = None
        if lora_config is not None:
            self.lora = LoRAManager(
                self.model,
                hf_config.architectures[0],
                lora_config.max_loras,
                lora_config.max_lora_rank,
                lora_config.num_cpu_loras,
                self.attn_backend.name,
                self.device,
            )
        self.index_dtype = np.int32 if self.attn_backend.index_dtype == torch.int32 else np.int64
        self.staging = HostToDevice(self.device)
        self.memory_profile: MemoryProfile | None = None  # CUDA: what sized the KV pool
        if self.device.type == "cuda":
            with phase("memory profile"):
                self.memory_profile = profile_kv_budget(
                    self.model,
                    self.vocab_size,
                    scheduler_config.max_num_batched_tokens,
                    self.max_num_seqs,
                    max_model_len,
                    self.block_size,
                    self.attn_backend.index_dtype,
                    self.dtype,
                    self.device,
                    model_config.gpu_memory_utilization,
                )
        budget = None if self.memory_profile is None else self.memory_profile.kv_budget
        if self.parallel is not None:  # one block count for every rank: what fits on each
            block_bytes = bytes_per_block(self.attn_layers, cache_config.block_size, self.dtype)
            num_blocks = num_blocks_for(
                cache_config, scheduler_config, max_model_len, block_bytes, self.device, budget
            )
            cache_config = replace(cache_config, num_kv_blocks=self.parallel.min_int(num_blocks))
        self.num_kv_blocks = allocate_kv_pool(
            self.attn_layers,
            cache_config,
            scheduler_config,
            max_model_len,
            self.dtype,
            self.device,
            budget,
        )
        self.sampler = Sampler()
        self.batch = InputBatch(
            scheduler_config.max_num_seqs,
            max_model_len,
            self.block_size,
            self.vocab_size,
            self.device,
        )
        self.logits_processors = LogitsProcessors(
            self.batch, self.device
        )  # logit_bias, grammar bitmasks
        self.pooler = Pooler()  # embedding requests' vectors
        self.graphs: DecodeGraphs | None = None
        # encoder-decoder models (models/seq2seq.py): each held request's cross blocks and encoder length
        self.is_encoder_decoder = bool(getattr(self.model, "is_encoder_decoder", False))
        self.cross: dict[str, tuple[tuple[int, ...], int]] = {}
        eager = model_config.enforce_eager
        if self.lora is not None and self.device.type == "cuda" and not eager:
            logger.info("LoRA enabled: the model runs its Python forward (no CUDA graphs)")
        if (
            self.device.type == "cuda"
            and not eager
            and self.lora is None
            and self.parallel is None
            and not self.is_encoder_decoder
        ):
            if self.attn_backend.supports_cuda_graphs:
                with phase("CUDA graphs"):
                    self.graphs = DecodeGraphs(
                        self.model,
                        self.max_num_seqs,
                        -(-max_model_len // self.block_size),
                        self.block_size,
                        max_model_len,
                        self.attn_backend.index_dtype,
                        self.device,
                    )
                    self.graphs.capture()
            else:
                logger.warning(
                    "attention backend %r cannot be captured: CUDA graphs off",
                    self.attn_backend.name,
                )
        # the CPU's counterpart of CUDA graphs: the decoder layers as one C++ call per step
        self.cpu_stack: CpuDecoderStack | None = None
        if (
            self.device.type == "cpu"
            and not eager
            and self.parallel is None
            and not self.is_encoder_decoder
        ):
            self.cpu_stack = cpu_stack.build(self.model)

    # ---- the rest of the Executor protocol ----------------------------------
    @property
    def has_cuda_graphs(self) -> bool:
        return self.graphs is not None

    @property
    def weights_report(self) -> QuantizationReport:
        return self.model.weights_report

    @property
    def dead_reason(self) -> str | None:
        return None  # a step that fails here fails alone; the next one may succeed

    def shutdown(self) -> None:
        pass  # nothing runs outside this process

    def add_lora(self, lora_id: int, name: str, path: str, in_use: tuple[int, ...] = ()) -> None:
        """Read and check a LoRA adapter now (ValueError naming what is wrong), before a request uses
        it; `in_use`: the adapters of the unfinished requests, which reading it never drops."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True")
        self.lora.in_use, self.lora.step_in_use = frozenset(in_use), frozenset()  # the newer word
        self.lora.add(lora_id, name, path)

    def remove_lora(self, lora_id: int) -> bool:
        return self.lora is not None and self.lora.remove(lora_id)

    def has_lora(self, lora_id: int) -> bool:
        """Adapter `lora_id` was read here (it may since have been dropped from host memory)."""
        return self.lora is not None and lora_id in self.lora.paths

    # ---- warm-up -----------------------------------------------------------
    def warm_up(self) -> bool:
        """Run one dummy step, a prefill row beside a decode row, and forget both, so that the
        first real step pays no first-use cost: on the CPU, the page faults of the KV blocks the
        block manager hands out first (its free list starts at block 1); on CUDA, the kernel
        variants a mixed prefill + decode step compiles. The block manager never sees it; the
        batch and the global RNG are left as they were. The blocks written are free and hold no
        cached prefix (a request writes a block's slots before it reads them). False if it cannot
        run one (too small an engine, an encoder-decoder model)."""
        num_tokens = min(self.block_size + 1, self.max_model_len, self.max_num_batched_tokens - 1)
        if num_tokens < 2 or self.is_encoder_decoder:  # (its requests need an encoder input)
            return False
        num_usable = self.num_kv_blocks - 1  # block 0 is the null block: never written
        blocks_per_row = -(-num_tokens // self.block_size)
        token_ids = tuple(i % self.vocab_size for i in range(num_tokens))
        greedy = SamplingInputs(
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
        rows: list[NewRequestData] = []
        computed: list[int] = []
        scheduled: list[int] = []
        for name, num_computed in (("prefill", 0), ("decode", num_tokens - 1))[
            : min(2, self.max_num_seqs)
        ]:
            first = len(rows) * blocks_per_row
            block_ids = tuple(1 + (first + i) % num_usable for i in range(blocks_per_row))
            rows.append(
                NewRequestData(
                    req_id=f"kvserve-warm-up-{name}",
                    prompt_token_ids=token_ids,
                    output_token_ids=(),
                    block_ids=block_ids,
                    sampling=greedy,
                )
            )
            computed.append(num_computed)  # the decode row's earlier K/V: whatever its block holds
            scheduled.append(num_tokens - num_computed)
        req_ids = tuple(row.req_id for row in rows)
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        try:
            self.execute(
                StepRecord(
                    finished_req_ids=(),
                    preempted_req_ids=(),
                    new_requests=tuple(rows),
                    req_ids=req_ids,
                    num_computed_tokens=tuple(computed),
                    num_scheduled_tokens=tuple(scheduled),
                    new_block_ids={},
                )
            )
        finally:
            self.batch.update(
                StepRecord(
                    finished_req_ids=req_ids,
                    preempted_req_ids=(),
                    new_requests=(),
                    req_ids=(),
                    num_computed_tokens=(),
                    num_scheduled_tokens=(),
                    new_block_ids={},
                )
            )
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)
        return True

    # ---- one step ----------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self, step: StepRecord, grammar_bitmask: Callable[[], GrammarBitmask | None] | None = None
    ) -> RunnerOutput:
        """Run one step from its plain-data record; outputs follow `step.req_ids`.
        `grammar_bitmask` (structured outputs) is called once the forward is launched, so that on a
        GPU the host fills the bitmask while the device computes; None when nothing is constrained."""
        batch = self.batch
        hidden, logits, is_sampled, prompt_rows, prompt_targets, prompt_owners, spec = (
            self._forward(step)
        )
        num_reqs = len(step.req_ids)
        sampled: list[int | None] = [None] * num_reqs
        logprobs: dict[str, TokenLogprobs] = {}
        pooled = self.pooler(step, hidden, batch)  # embedding rows: pooled, never sampled
        is_sampled &= batch.pooling_type[:num_reqs] == 0
        if spec is not None:
            grammar = grammar_bitmask() if grammar_bitmask is not None else None
            sampled, accepted, logprobs, draft_logprobs = self._verify(
                step, logits, grammar, is_sampled, spec
            )
            prompt_lps = self._prompt_logprobs(hidden, prompt_rows, prompt_targets, prompt_owners)
            return RunnerOutput(sampled, logprobs, prompt_lps, accepted, draft_logprobs, pooled)
        if is_sampled.any():  # else every request is mid-way through a chunked prefill
            grammar = grammar_bitmask() if grammar_bitmask is not None else None
            logits = self.logits_processors(logits, grammar, num_reqs)  # no-op when unused
            tensors = batch.sampling_tensors(num_reqs)
            if self.logits_processors.logprob_shift is not None:
                tensors = replace(tensors, logprob_shift=self.logits_processors.logprob_shift)
            out = self.sampler(logits, tensors)
            token_ids = out.sampled_token_ids.cpu().numpy()  # [B] the one device->host sync
            if is_sampled.all():
                sampled = token_ids.tolist()
                batch.append_sampled(np.arange(num_reqs), token_ids, out.sampled_token_ids, None)
            else:
                sampled_rows = np.flatnonzero(is_sampled)
                for i in sampled_rows.tolist():
                    sampled[i] = int(token_ids[i])
                batch.append_sampled(
                    sampled_rows,
                    token_ids[sampled_rows],
                    out.sampled_token_ids,
                    self._to_device(is_sampled.astype(np.float32)),
                )
            logprobs = self._collect_logprobs(step.req_ids, is_sampled, token_ids, out)
        prompt_lps = self._prompt_logprobs(hidden, prompt_rows, prompt_targets, prompt_owners)
        return RunnerOutput(sampled, logprobs, prompt_lps, pooled=pooled)

    def _verify(
        self,
        step: StepRecord,
        logits: torch.Tensor,
        grammar: GrammarBitmask | None,
        is_sampled: np.ndarray,
        spec: SpecRows,
    ) -> tuple[Any, Any, Any, Any]:
        """Sample every logits row of a speculative step [R, V], accept drafts, record the tokens;
        -> (each request's sampled token, the accepted drafts of those that speculated, the sampled
        tokens' logprobs, the accepted drafts' logprobs), logprobs for the requests asking for them."""
        batch, num_reqs = self.batch, len(step.req_ids)
        logits = self.logits_processors(logits, grammar, num_reqs, spec)
        drafts = [step.spec_token_ids.get(r, ()) for r in step.req_ids]
        tensors = expand_sampling(
            batch.sampling_tensors(num_reqs), spec, batch.is_seeded[:num_reqs], drafts, self.device
        )
        if self.logits_processors.logprob_shift is not None:
            tensors = replace(tensors, logprob_shift=self.logits_processors.logprob_shift)
        out = self.sampler(logits, tensors)
        token_ids = out.sampled_token_ids.cpu().numpy()  # [R] the one device->host sync
        new_tokens, num_accepted = accept(token_ids, spec, drafts)
        if tensors.output_counts is not None:  # the accepted drafts are outputs too
            batch.count_outputs(
                [(i, d) for i, (ds, j) in enumerate(zip(drafts, num_accepted)) for d in ds[:j]]
            )
        rows = np.flatnonzero(is_sampled)
        batch.num_tokens[:num_reqs] += np.array(
            num_accepted
        )  # the accepted drafts are in token_ids already
        new_rows = spec.first_row + np.array(
            num_accepted
        )  # where each request's new token was drawn
        batch.append_sampled(
            rows,
            np.array(new_tokens)[rows],
            out.sampled_token_ids.index_select(0, torch.from_numpy(new_rows).to(self.device)),
            self._to_device(is_sampled.astype(np.float32)),
        )
        sampled = [t if s else None for t, s in zip(new_tokens, is_sampled.tolist())]
        accepted = {r: d[:j] for r, d, j in zip(step.req_ids, drafts, num_accepted) if d}
        # logprobs of each request's new tokens: its accepted drafts' rows, then its sampled token's
        logprobs = self._collect_logprobs(step.req_ids, is_sampled, token_ids, out, new_rows)
        wanted = [i for i, j in enumerate(num_accepted) if j and batch.num_logprobs[i] >= 0]
        draft_logprobs = {}
        if wanted:
            entry, first = self._logprob_entry(out, token_ids), spec.first_row.tolist()
            draft_logprobs = {
                step.req_ids[i]: [
                    entry(r, int(batch.num_logprobs[i]))
                    for r in range(first[i], first[i] + num_accepted[i])
                ]
                for i in wanted
            }
        return sampled, accepted, logprobs, draft_logprobs

    def _forward(self, step: StepRecord) -> tuple[Any, ...]:
        """Apply the record to the batch, run the model and the LM head on each request's last row
        (and on every draft position of a speculating request); -> (hidden [T, hidden], logits
        [B or R, V], is_sampled [B], the step's prompt-logprob rows, the `SpecRows` or None)."""
        batch = self.batch
        if step.block_copies:  # before anything of this step writes the cache (the encoder too)
            self._copy_blocks(step.block_copies)
        batch.update(step)  # the step's requests are now rows 0..B-1
        num_reqs = len(step.req_ids)
        num_drafts = self._write_drafts(step)  # [B] or None
        computed = np.array(step.num_computed_tokens, np.int64)  # [B]
        query_lens = np.array(step.num_scheduled_tokens, np.int64)  # [B]
        input_ids, positions, last_rows, meta, cu = self._prepare_inputs(
            computed, query_lens, num_drafts
        )
        if self.lora is not None:
            for new in step.new_requests:
                self.lora.remember(new.lora_id, new.lora_name, new.lora_path)
            self.lora.prepare(batch.lora_ids[:num_reqs], query_lens, step.lora_ids_in_use)
        if self.is_encoder_decoder:
            self._encode(step, meta)
        ends = (
            batch.num_tokens[:num_reqs]
            if num_drafts is None
            else batch.num_tokens[:num_reqs] + num_drafts
        )
        is_sampled = computed + query_lens == ends  # [B] reaches the end (of the drafts too)
        prompt_rows, prompt_targets, prompt_owners = self._prompt_logprob_rows(
            step.req_ids, computed, query_lens, cu
        )
        # a logits row for every request (a mid-prefill row's draw is discarded: the batch's
        # sampling tensors then apply as they are); prompt-logprob rows come after sampling

        # (a speculative step's rows are decode rows too: its graphs replay when all its rows decode)
        if self.graphs is not None and self.graphs.can_run(meta, len(meta.query_lens_cpu)):
            hidden = self.graphs.run(input_ids, positions, meta)  # [rows, hidden]
        elif self.cpu_stack is not None:
            hidden = self.cpu_stack(input_ids, positions, meta)  # [T, hidden]
        else:
            with forward_context(meta):
                hidden = self.model(input_ids, positions)  # [T, hidden]
        if num_drafts is not None:
            spec = spec_rows(cu, num_drafts)
            logits = self.model.compute_logits(
                hidden[torch.from_numpy(spec.hidden_rows).to(self.device)]
            )
            return hidden, logits, is_sampled, prompt_rows, prompt_targets, prompt_owners, spec
        # each request's last row (no gather when every request has one row)
        logits = self.model.compute_logits(
            hidden if hidden.shape[0] == num_reqs else hidden[last_rows]
        )
        return hidden, logits, is_sampled, prompt_rows, prompt_targets, prompt_owners, None

    def _copy_blocks(self, copies: tuple[tuple[int, int, int], ...]) -> None:
        """Copy-on-write of kept partly filled blocks: the first `n` slots of block `src` into
        block `dst`, in every layer's K and V (all reads before any write)."""
        bs = self.block_size
        src = np.concatenate([np.arange(n) + s * bs for s, _, n in copies])
        dst = np.concatenate([np.arange(n) + d * bs for _, d, n in copies])
        src_t, dst_t = self._to_device(src), self._to_device(dst)
        for layer in self.attn_layers:
            assert layer.kv_cache is not None  # allocated at load
            flat = layer.kv_cache.flatten(1, 2)  # [2, blocks * block_size, heads, dim]
            flat[:, dst_t] = flat[:, src_t]

    def _encode(self, step: StepRecord, meta: AttentionMetadata) -> None:
        """Encoder-decoder models: run the encoder of the step's new requests into their cross blocks,
        and give the step's metadata every scheduled request's cross blocks and encoder length."""
        for req_id in step.finished_req_ids + step.preempted_req_ids:
            self.cross.pop(req_id, None)
        new = [r for r in step.new_requests if r.encoder_token_ids]
        if new:
            bs = self.block_size
            cu = np.cumsum([0] + [len(r.encoder_token_ids) for r in new]).tolist()
            ids = np.concatenate([np.array(r.encoder_token_ids, np.int64) for r in new])
            positions = np.concatenate([np.arange(len(r.encoder_token_ids)) for r in new])
            blocks = np.concatenate(
                [
                    np.array(r.cross_block_ids, np.int64)[np.arange(len(r.encoder_token_ids)) // bs]
                    for r in new
                ]
            )
            self.model.encode_into_cache(
                self._to_device(ids), cu, self._to_device(blocks * bs + positions % bs)
            )
        for r in step.new_requests:  # (those sharing another request's encoder output too)
            self.cross[r.req_id] = (r.cross_block_ids, r.cross_len)
        rows = [self.cross[req_id] for req_id in step.req_ids]
        table = np.zeros((len(rows), max(len(b) for b, _ in rows)), np.int64)
        for i, (block_ids, _) in enumerate(rows):
            table[i, : len(block_ids)] = block_ids
        meta.cross_block_table = self._to_device(table)
        meta.cross_lens_cpu = [n for _, n in rows]

    def _write_drafts(self, step: StepRecord) -> np.ndarray | None:
        """Put each speculating request's drafts after its tokens (not counted in num_tokens until
        accepted) so the inputs gather them; -> drafts per request [B], or None when nobody speculates."""
        if not step.spec_token_ids:
            return None
        batch = self.batch
        num_drafts = np.zeros(len(step.req_ids), np.int64)
        for i, req_id in enumerate(step.req_ids):
            drafts = step.spec_token_ids.get(req_id)
            if drafts:
                n = batch.num_tokens[i]
                batch.token_ids[i, n : n + len(drafts)] = drafts
                num_drafts[i] = len(drafts)
        return num_drafts

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _prompt_logprob_chunk(
        self, hidden: torch.Tensor, rows: np.ndarray, targets: list[int], k: int
    ) -> list[Any]:
        logprobs = torch.log_softmax(
            self.model.compute_logits(hidden[self._to_device(rows)]).float(), dim=-1
        )
        target_t = torch.tensor(targets, device=logprobs.device)
        target_lp = logprobs.gather(1, target_t[:, None])  # [R, 1]
        ranks = (logprobs > target_lp).sum(-1) + 1
        top_lp, top_ids = (
            logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], target_t[:, None][:, :0])
        )
        return [t.tolist() for t in (target_lp[:, 0], ranks, top_lp, top_ids)]

    def _prepare_inputs(
        self, computed: np.ndarray, query_lens: np.ndarray, num_drafts: np.ndarray | None = None
    ) -> tuple[Any, ...]:
        """Flat step tensors for rows 0..B-1 of the batch, gathered with numpy (no per-token loop).

        A speculating request's chunk (its last token and its drafts) reaches attention as one
        decode row per token, each with its own sequence length: the kernels then compute every
        draft position exactly as decoding one token at a time would (a prefill kernel's sums
        round differently in bf16, and a near-tie could flip a greedy token)."""
        batch, bs = self.batch, self.block_size
        num_reqs = len(query_lens)
        cu = np.zeros(num_reqs + 1, np.int64)  # cu_seqlens_q
        np.cumsum(query_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        req_idx = np.repeat(np.arange(num_reqs), query_lens)  # [T]
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(
            cu[:-1] - computed, query_lens
        )
        input_ids = batch.token_ids[req_idx, positions].astype(np.int64)  # [T]
        max_blocks = int(batch.num_blocks[:num_reqs].max())
        block_table = batch.block_table[:num_reqs, :max_blocks].copy()  # [B, max_blocks], 0-padded
        slot_mapping = block_table[req_idx, positions // bs] * bs + positions % bs
        seq_lens = computed + query_lens
        att_cu, att_query_lens = cu, query_lens
        if num_drafts is not None:  # every token of a speculating chunk its own decode row
            split = np.repeat(
                num_drafts > 0, query_lens
            )  # [T] the token belongs to a speculating chunk
            starts = np.flatnonzero(
                np.r_[True, split[1:] | (req_idx[1:] != req_idx[:-1])]
            )  # tokens starting a row
            att_query_lens = np.diff(np.r_[starts, num_tokens])
            seq_lens = positions[starts + att_query_lens - 1] + 1
            block_table = block_table[req_idx[starts]]
            att_cu = np.zeros(len(starts) + 1, np.int64)
            np.cumsum(att_query_lens, out=att_cu[1:])
        index = self.index_dtype
        ids_dev, positions_dev, last_rows = self.staging.copy(
            [input_ids, positions, cu[1:] - 1], np.int64
        )
        slots_dev, cu_dev, seq_lens_dev, table_dev = self.staging.copy(
            [slot_mapping, att_cu, seq_lens, block_table], index, second=True
        )
        meta = AttentionMetadata(
            slot_mapping=slots_dev,
            positions=positions_dev,
            cu_seqlens_q=cu_dev,
            seq_lens=seq_lens_dev,
            block_table=table_dev,
            query_lens_cpu=att_query_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            block_size=bs,
            max_query_len=int(att_query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return ids_dev, positions_dev, last_rows, meta, cu

    # ---- logprobs ----------------------------------------------------------
    def _collect_logprobs(
        self,
        req_ids: tuple[str, ...],
        is_sampled: np.ndarray,
        token_ids: np.ndarray,
        out: Any,
        rows: np.ndarray | None = None,
    ) -> dict[str, TokenLogprobs]:
        """The sampled token's logprobs of each request that asked for them, from its row of the
        sampler's outputs (`rows[i]`; None: row i)."""
        num_logprobs = self.batch.num_logprobs[: len(req_ids)]  # -1 = none
        wanted = np.flatnonzero((num_logprobs >= 0) & is_sampled).tolist()
        if not wanted:
            return {}
        entry = self._logprob_entry(out, token_ids)
        return {
            req_ids[i]: entry(i if rows is None else int(rows[i]), int(num_logprobs[i]))
            for i in wanted
        }

    @staticmethod
    def _logprob_entry(out: Any, token_ids: np.ndarray) -> Callable[[int, int], TokenLogprobs]:
        """(row, k) -> that row's token, its logprob and rank, and the top k (one host copy of each)."""
        lps = out.sampled_logprobs.tolist()
        ranks = out.sampled_ranks.tolist()
        top_ids = out.topk_token_ids.tolist() if out.topk_token_ids is not None else None
        top_lps = out.topk_logprobs.tolist() if out.topk_logprobs is not None else None

        def entry(r: int, k: int) -> TokenLogprobs:
            return (
                int(token_ids[r]),
                lps[r],
                ranks[r],
                top_ids[r][:k] if top_ids and k else [],
                top_lps[r][:k] if top_lps and k else [],
            )

        return entry

    def _prompt_logprob_rows(
        self, req_ids: tuple[str, ...], computed: np.ndarray, query_lens: np.ndarray, cu: np.ndarray
    ) -> tuple[np.ndarray, list[int], list[tuple[str, int, int]]]:
        """Rows whose logits score the next prompt token, for requests asking prompt_logprobs."""
        batch = self.batch
        num_prompt = batch.num_prompt_tokens[: len(req_ids)]
        todo = np.flatnonzero(
            (batch.num_prompt_logprobs[: len(req_ids)] >= 0) & (computed < num_prompt - 1)
        )
        rows: list[int] = []
        targets: list[int] = []
        owners: list[tuple[str, int, int]] = []  # (request, its top k, its rows)
        for i in todo.tolist():
            # logits at position p score prompt token p+1; skip positions already scored
            # (a request recomputed after a preemption scored them before it)
            start, req_id = int(computed[i]), req_ids[i]
            first = max(start, batch.num_prompt_logprobs_done.get(req_id, 0))
            last = min(start + int(query_lens[i]), int(num_prompt[i]) - 1)
            if first >= last:
                continue
            rows.extend(range(cu[i] + first - start, cu[i] + last - start))
            targets.extend(batch.token_ids[i, first + 1 : last + 1].tolist())
            owners.append((req_id, int(batch.num_prompt_logprobs[i]), last - first))
            batch.num_prompt_logprobs_done[req_id] = last
        return np.array(rows, np.int64), targets, owners

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        rows: np.ndarray,
        targets: list[int],
        owners: list[tuple[str, int, int]],
    ) -> dict[str, list[Any]]:
        """Logprobs of the next prompt token at `rows` of `hidden`, in chunks of max_num_seqs rows so
        that no step needs more memory than the sampler's (what the memory profile measured)."""
        if not owners:
            return {}
        k = max(kk for _, kk, _ in owners)
        chunk = self.max_num_seqs
        parts = [
            self._prompt_logprob_chunk(hidden, rows[i : i + chunk], targets[i : i + chunk], k)
            for i in range(0, len(rows), chunk)
        ]
        target_lp, ranks, top_lp, top_ids = (
            [x for part in parts for x in part[j]] for j in range(4)
        )
        result: dict[str, list[Any]] = {}
        row = 0
        for req_id, kk, count in owners:
            result[req_id] = [
                (targets[r], target_lp[r], ranks[r], top_ids[r][:kk], top_lp[r][:kk])
                for r in range(row, row + count)
            ]
            row += count
        return result


_ALIGN_BYTES = 64


class HostToDevice:
    """The step's small host arrays onto the device. On the CPU, zero-copy views. On CUDA, packed
    into a persistent pinned buffer and moved with one non-blocking copy per group (the buffer is
    reused next step: the step's own device-to-host sync has finished the copy by then)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: dict[tuple[Any, ...], torch.Tensor] = {}
        self._dev: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(
        self, arrays: list[np.ndarray], dtype: Any, second: bool = False
    ) -> list[torch.Tensor]:
        if self.device.type == "cpu":
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)) for a in arrays]
        key = (np.dtype(dtype).str, second)
        # every array starts on a 64-byte boundary: Triton specializes a kernel on each pointer's
        # 16-byte alignment, so unaligned views would compile new variants as batch shapes change
        align = _ALIGN_BYTES // np.dtype(dtype).itemsize
        starts = np.cumsum([0, *(-(-a.size // align) * align for a in arrays)])
        total = int(starts[-1])
        host = self._host.get(key)
        if host is None or host.numel() < total:
            torch_dtype = torch.from_numpy(np.zeros(0, dtype)).dtype
            capacity = max(total, 2 * (0 if host is None else host.numel()), 4096)
            host = self._host[key] = torch.empty(capacity, dtype=torch_dtype, pin_memory=True)
            self._dev[key] = torch.empty(capacity, dtype=torch_dtype, device=self.device)
        flat, dev = host.numpy(), self._dev[key]
        for a, start in zip(arrays, starts):
            flat[start : start + a.size] = a.ravel()
        dev[:total].copy_(host[:total], non_blocking=True)
        return [dev[start : start + a.size].view(a.shape) for a, start in zip(arrays, starts)]
