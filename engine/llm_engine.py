"""LLMEngine: the synchronous core. add_request / step / abort.

One step = schedule (plain Python) -> run the model and sample (one sync) ->
update the scheduler -> detokenize and check stop strings -> outputs.
Not thread-safe: `AsyncLLM` drives it from one background thread.
The runner is an `Executor` (engine/worker/executor_protocol.py): a `ModelRunner`, or with
`tensor_parallel_size` > 1 a `TensorParallelExecutor` (engine/worker/executor.py), rank 0 here and
the other ranks in worker processes; `shutdown()` stops them. Importing this module imports
no torch: the executor does, when the engine is built.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from functools import partial

from kvserve.engine.config import EngineArgs, ModelConfig, RuntimeInfo
from kvserve.engine.core.kv_cache_manager import KVCacheManager, prefix_root
from kvserve.engine.core.request import Request, RequestStatus
from kvserve.engine.core.scheduler import Scheduler, StepPlan
from kvserve.engine.errors import StepFailed
from kvserve.engine.generation_config import load_generation_config
from kvserve.engine.input_processor import ProcessedPrompt, PromptType, process_prompt
from kvserve.engine.lora_request import LoRARequest
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.outputs import EngineStats, RequestDelta, RequestOutput, RequestOutputBuilder
from kvserve.engine.pooling_params import PoolingParams, read_pooler_config, resolve_task
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.spec_decode.proposer import Proposer
from kvserve.engine.structured_output.grammar import StructuredOutputManager, fill_threads_for
from kvserve.engine.structured_output.limits import check_limits
from kvserve.engine.tokenizer import ModelFiles, load_model_files
from kvserve.engine.worker.executor_protocol import Executor
from kvserve.models.timing import PhaseTimer, process_uptime

logger = logging.getLogger(__name__)

_SEED_MASK = 2**63 - 1


def _host_cores() -> int:
    """The cores this process may run on (the affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _torch_threads() -> int:
    import torch  # (loaded by the executor by now)

    return torch.get_num_threads()


def compile_threads_for(host_cores: int) -> int:
    """Grammar compile threads: one per two cores, at most 2, so that compiles (niced, but still
    runnable) never hold more than half of a small machine."""
    return max(1, min(2, host_cores // 2))


def _check_encoder_decoder(args: EngineArgs, tp_size: int) -> None:
    """What encoder-decoder models (models/seq2seq.py) do not run with yet: a clear error at start."""
    unsupported = [
        name
        for name, used in (
            ("tensor_parallel_size > 1", tp_size > 1),
            ("speculative_config", args.speculative() is not None),
        )
        if used
    ]
    if unsupported:
        raise ValueError(
            f"encoder-decoder models do not support {', '.join(unsupported)} yet "
            "(docs/architecture.md, encoder-decoder models)"
        )


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        before = process_uptime()  # the interpreter, imports and whatever ran before the engine
        timer = PhaseTimer()
        with timer.active():
            self._build(args)
        logger.info(
            "engine start-up %s%s",
            timer.summary(),
            "" if before is None else f"; the process ran {before:.2f} s before it (imports)",
        )

    def _build(self, args: EngineArgs) -> None:
        args.validate()
        model_config = args.model_config()
        files = load_model_files(model_config)
        self.tokenizer = files.tokenizer
        self.chat_template: str | None = getattr(self.tokenizer, "chat_template", None)
        cache_config = args.cache_config()
        scheduler_config = args.scheduler_config()
        tp_size = args.parallel_config().tensor_parallel_size
        is_encoder_decoder = files.decoder_start_token_id is not None
        if is_encoder_decoder:
            _check_encoder_decoder(args, tp_size)
        task = resolve_task(args.task, files.model_path, files.hf_config)
        pooler = (
            None if is_encoder_decoder else read_pooler_config(files.model_path, files.hf_config)
        )
        generation_config = load_generation_config(
            model_config.generation_config,
            files.model_path,
            files.hf_config.vocab_size,
            files.eos_token_ids,
        )
        lora_config = args.lora_config()
        self.lora_enabled = lora_config is not None
        self.runner: Executor
        if tp_size == 1:
            from kvserve.engine.worker.runner import ModelRunner

            self.runner = ModelRunner(
                model_config,
                cache_config,
                scheduler_config,
                files.model_path,
                files.hf_config,
                files.max_model_len,
                lora_config=lora_config,
            )
        else:
            from kvserve.engine.worker.executor import TensorParallelExecutor
            from kvserve.models.parallel import check_tensor_parallel

            hf = files.hf_config
            check_tensor_parallel(
                hf.num_attention_heads,
                getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
                tp_size,
            )
            self.runner = TensorParallelExecutor(
                model_config,
                cache_config,
                scheduler_config,
                files.model_path,
                hf,
                files.max_model_len,
                tp_size,
                lora_config=lora_config,
            )
        self.info = RuntimeInfo(
            model_path=files.model_path,
            architecture=files.hf_config.architectures[0],  # type: ignore[index]  # the registry found it
            dtype=str(self.runner.dtype).removeprefix("torch."),
            device=str(self.runner.device),
            vocab_size=files.hf_config.vocab_size,
            max_model_len=files.max_model_len,
            eos_token_ids=files.eos_token_ids,
            num_kv_blocks=self.runner.num_kv_blocks,
            block_size=cache_config.block_size,
            attention_backend=self.runner.attn_backend.name,
            cuda_graphs=self.runner.has_cuda_graphs,
            tensor_parallel_size=tp_size,
            quantization=self.runner.weights_report.method,
            weight_bytes=self.runner.weights_report.weight_bytes,
            decoder_start_token_id=files.decoder_start_token_id,
            task=task,
            pooler=pooler,
            generation_config=generation_config,
        )
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        # an encoder-decoder model's encoder outputs: blocks of the same pool
        cross_cache = None
        if files.decoder_start_token_id is not None:
            from kvserve.engine.seq2seq.cross_cache import CrossCache

            cross_cache = CrossCache(self.kv_cache_manager.pool, cache_config.block_size)
        self.scheduler = Scheduler(
            scheduler_config,
            self.kv_cache_manager,
            files.max_model_len,
            self._proposer(args, model_config, files),
            cross_cache,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        # constrained requests wait there (not in the scheduler) while their grammar compiles
        so_config = args.structured_outputs_config()
        self.grammar_limits = so_config.limits
        self.structured = StructuredOutputManager(
            self.tokenizer,
            self.info.vocab_size,
            self.info.eos_token_ids,
            so_config,
            max_workers=so_config.grammar_compile_threads or compile_threads_for(_host_cores()),
            fill_threads=fill_threads_for(self.runner.device.type, _torch_threads(), _host_cores()),
        )
        self._rejected: list[tuple[str, str]] = []  # (request id, why): failed grammar compiles
        self._builders: dict[str, RequestOutputBuilder] = {}  # in-process callers' outputs
        # prompt tokens: of every request once, when it is first scheduled (n samples share one prompt);
        # of those, found in the prefix cache then; and run through the model, recomputation included
        self.prompt_tokens_total = 0
        self.prompt_tokens_cached_total = 0
        self.prompt_tokens_computed_total = 0
        self.generation_tokens_total = 0
        self.num_consecutive_step_failures = (
            0  # a sticky device error fails every step; the core counts on this
        )
        logger.info(
            "engine ready: %s (%s) on %s, dtype %s, attention %s%s, max_model_len %d, KV cache %d tokens; %s",
            files.model_path,
            self.info.architecture,
            self.info.device,
            self.info.dtype,
            self.info.attention_backend,
            " + CUDA graphs" if self.info.cuda_graphs else "",
            self.info.max_model_len,
            self.info.kv_capacity_tokens,
            self.runner.weights_report.describe(),
        )
        if applied := generation_config.describe():  # (vLLM's words, which users grep for)
            logger.info(
                "Default sampling parameters have been overridden by the model's generation config "
                "(%s): %s",
                generation_config.source,
                applied,
            )

    # ---- requests ----------------------------------------------------------
    def process_prompt(
        self,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedPrompt:
        """Tokenize and validate; raises ValueError naming the bad value. Touches no engine state.
        `PoolingParams` make an embedding request."""
        processed = process_prompt(self.tokenizer, self.info, prompt, params)
        if (
            processed.pooling is None
            and isinstance(params, SamplingParams)
            and params.structured_outputs is not None
        ):
            check_limits(params.structured_outputs, self.grammar_limits)
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(
                    f"lora_request must be a LoRARequest, got {type(lora_request).__name__}"
                )
            processed = replace(processed, lora_request=lora_request)
        return processed

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (ValueError naming what is wrong); requests naming it
        later find it read. Without enable_lora: ValueError."""
        if not self.lora_enabled:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True")
        # adapters of unfinished requests stay read (those waiting on a grammar included)
        in_use = set(self.scheduler.lora_ids_in_use()) | self.structured.lora_ids_pending()
        # the ModelRunner, or the tensor-parallel executor on every rank (not in the Executor protocol)
        self.runner.add_lora(  # type: ignore[attr-defined]
            lora_request.lora_int_id,
            lora_request.lora_name,
            lora_request.lora_path,
            tuple(sorted(in_use - {0})),
        )

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget adapter `lora_int_id` (its id may then name another adapter); False if unknown.
        ValueError while requests with it are unfinished."""
        if any(
            r.lora_id == lora_int_id for r in (*self.scheduler.running, *self.scheduler.waiting)
        ):
            raise ValueError(f"LoRA adapter {lora_int_id} still has unfinished requests")
        return self.lora_enabled and self.runner.remove_lora(lora_int_id)  # type: ignore[attr-defined]

    def add_processed(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        arrival_time: float | None = None,
        build_outputs: bool = True,
    ) -> None:
        """Queue a validated request. `build_outputs=False` (the engine core process) keeps no
        cumulative output here: the caller folds `step_deltas()` itself. Raises `EngineOverloadedError`
        (engine/structured_output/grammar.py) when its grammar would overfill the compile queue."""
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already running")
        params = processed.params
        lora = processed.lora_request
        if lora is not None:  # read and checked before anything is queued
            self.add_lora(lora)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        # an encoder-decoder request: its source goes to the encoder, its decoder starts afresh
        encoder_ids = (
            tuple(processed.prompt_token_ids)
            if processed.decoder_prompt_token_ids is not None
            else ()
        )
        decoder_prompt = processed.decoder_prompt_token_ids or processed.prompt_token_ids
        root = prefix_root(
            processed.cache_salt, encoder_ids, None if lora is None else lora.cache_key
        )
        constraints = (
            params.generation_constraints
            if params.generation_constraints is not None
            else self.info.generation_config.constraints
        )
        constraints = None if constraints is None or constraints.is_empty else constraints
        children = [
            Request(
                request_id=f"{request_id}#{i}",
                prompt_token_ids=decoder_prompt,
                params=params,
                eos_token_ids=self.info.eos_token_ids,
                max_tokens=processed.max_tokens,
                parent_id=request_id,
                sample_index=i,
                seed=self._child_seed(params.seed, i),
                arrival_time=arrival,
                prefix_root=root,
                encoder_token_ids=encoder_ids,
                priority=processed.priority,
                pooling=processed.pooling,
                constraints=constraints,
                lora_request=lora,
            )
            for i in range(params.n)
        ]
        if params.structured_outputs is not None:
            self.structured.add(
                request_id, children, params.structured_outputs
            )  # first: it may refuse
        self.output_processor.add(request_id, children)
        if build_outputs:
            self._builders[request_id] = processed.output_builder(request_id, arrival)
        if params.structured_outputs is not None:
            return
        for child in children:
            self.scheduler.add(child)

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams
    ) -> None:
        self.add_processed(request_id, self.process_prompt(prompt, params))

    def _proposer(
        self, args: EngineArgs, model_config: ModelConfig, files: ModelFiles
    ) -> Proposer | None:
        spec = args.speculative()
        if spec is None:
            return None
        if spec.method == "draft_model":
            from kvserve.engine.spec_decode.draft_model import DraftModelProposer

            return DraftModelProposer(
                spec,
                files.max_model_len,
                model_config,
                files.hf_config.vocab_size,
                args.block_size,
                args.max_num_seqs,
            )
        return Proposer(spec, files.max_model_len)

    @staticmethod
    def _child_seed(seed: int | None, index: int) -> int | None:
        if seed is None:
            return None
        return seed & _SEED_MASK if index == 0 else hash((seed, index)) & _SEED_MASK

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request at any time and free its blocks; returns its final output (or None)."""
        outputs = self._fold([d for d in [self.abort_delta(request_id)] if d is not None])
        return outputs[0] if outputs else None

    def abort_delta(self, request_id: str) -> RequestDelta | None:
        self.structured.abort(request_id)
        for child_id in self.output_processor.child_ids(request_id):
            self.scheduler.finish(child_id, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        # a failed compile not yet reported counts: the next step() raises it
        return (
            self.scheduler.has_unfinished() or self.structured.has_pending or bool(self._rejected)
        )

    def take_rejected(self) -> list[tuple[str, str]]:
        """(request id, error) of requests failed since the last call: their grammar did not compile.
        They produce no output; the engine core reports them as rejected (a ValueError)."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def _admit_compiled(self) -> None:
        """Queue the constrained requests whose grammar is ready; drop those whose compile failed."""
        if not self.structured.has_pending:
            return
        if not self.scheduler.has_unfinished():
            self.structured.wait(0.05)  # nothing else to run: wait a little for a compile, not spin
        ready, failed = self.structured.take_ready()
        for child in ready:
            self.scheduler.add(child)
        for request_id, message in failed:
            self.output_processor.parents.pop(request_id, None)
            self._rejected.append((request_id, message))

    # ---- one step ----------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One step; an output for every request that produced something (or that finished).
        Raises ValueError (before running the step) for a request whose grammar failed to compile."""
        self._admit_compiled()
        for request_id, message in self.take_rejected():
            if self._builders.pop(request_id, None) is not None:
                raise ValueError(f"request {request_id!r}: {message}")
        return self._fold(self.step_deltas(), finished_only)

    def _fold(self, deltas: list[RequestDelta], finished_only: bool = False) -> list[RequestOutput]:
        outputs = []
        for delta in deltas:
            builder = self._builders.get(delta.request_id)
            if builder is None:
                continue  # added with build_outputs=False
            builder.add(delta)
            if delta.finished:
                del self._builders[delta.request_id]
            if delta.finished or not finished_only:
                outputs.append(builder.output())
        return outputs

    def step_deltas(self) -> list[RequestDelta]:
        """One step; a `RequestDelta` (what is new) for every request that produced something."""
        self._admit_compiled()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        self._mark_scheduled(plan)
        try:
            # the runner fills the grammar bitmask after launching the forward: on a GPU the host work overlaps it
            result = self.runner.execute(plan.record, partial(self.structured.step_bitmask, plan))
            # before update: it checks is_terminated
            self.structured.accept_tokens(plan, result.sampled_token_ids, result.accepted)
            num_before = sum(item.request.num_output_tokens for item in plan.scheduled)
            finished = self.scheduler.update(plan, result.sampled_token_ids, result.accepted)
            self.generation_tokens_total += (
                sum(item.request.num_output_tokens for item in plan.scheduled) - num_before
            )
            outputs, stopped = self.output_processor.process(
                plan, result, finished, time.monotonic()
            )
        except Exception as e:
            # fail only the requests of this step (freeing their blocks); the engine goes on
            self.num_consecutive_step_failures += 1
            parent_ids = list(dict.fromkeys(item.request.parent_id for item in plan.scheduled))
            for rid in parent_ids:
                self.abort(rid)
            raise StepFailed(parent_ids) from e
        self.num_consecutive_step_failures = 0
        for child_id in stopped:
            self.scheduler.finish(child_id, RequestStatus.FINISHED_STOPPED)
        return outputs

    def _mark_scheduled(self, plan: StepPlan) -> None:
        """First-scheduled times and the prompt token counts of the step about to run."""
        now = time.monotonic()
        for item in plan.scheduled:
            req = item.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                self.output_processor.mark_scheduled(req, now)
                if req.sample_index == 0:
                    self.prompt_tokens_total += req.num_prompt_tokens + len(req.encoder_token_ids)
                    self.prompt_tokens_cached_total += item.start_pos  # what the prefix cache held
            self.prompt_tokens_computed_total += max(
                0, min(item.start_pos + item.num_new_tokens, req.num_prompt_tokens) - item.start_pos
            )
        # encoder-decoder requests new to the runner: their sources run through the encoder this step
        self.prompt_tokens_computed_total += sum(
            len(r.encoder_token_ids) for r in plan.record.new_requests
        )

    @property
    def dead_reason(self) -> str | None:
        """Why the engine can run no more steps (a tensor-parallel worker died); None while it can."""
        return self.runner.dead_reason

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; nothing to do otherwise)."""
        self.runner.shutdown()

    def stats(self) -> EngineStats:
        bm = self.kv_cache_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=bm.usage,
            num_kv_blocks_total=bm.num_blocks - 1,
            num_kv_blocks_free=bm.num_free_blocks,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            prefix_cache_queries_total=bm.prefix_cache_queries,
            prefix_cache_hits_total=bm.prefix_cache_hits,
            num_preemptions_total=self.scheduler.num_preemptions,
            num_compiling=self.structured.num_pending,
            structured_requests_total=self.structured.num_requests,
            grammar_compiles_total=self.structured.num_compiles,
            grammar_compile_seconds_total=self.structured.compile_time_s,
            prompt_tokens_cached_total=self.prompt_tokens_cached_total,
            prompt_tokens_computed_total=self.prompt_tokens_computed_total,
            num_grammars_compiling=self.structured.num_jobs,
            spec_verifications_total=self.scheduler.num_verifications,
            spec_draft_tokens_total=self.scheduler.num_draft_tokens,
            spec_accepted_tokens_total=self.scheduler.num_accepted_tokens,
        )
