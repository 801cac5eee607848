"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from kvserve.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from kvserve.engine.config import EngineArgs
from kvserve.engine.generation_config import beam_step_constraints
from kvserve.engine.input_processor import ProcessedPrompt, PromptType
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.lora_request import LoRARequest
from kvserve.engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from kvserve.engine.pooling_params import PoolingParams
from kvserve.engine.sampling_params import SamplingParams


def _normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(p, int) and not isinstance(p, bool) for p in items):
        return [items]  # one prompt given as token ids
    for p in items:
        if not isinstance(p, (str, list, tuple, dict)):
            raise ValueError(
                f"each prompt must be a str, a list of token ids or a prompt dict, "
                f"got {type(p).__name__}"
            )
    return items


def _floats(embedding: bytes | None) -> list[float]:
    assert embedding is not None  # every pooling request's output carries its vector
    return np.frombuffer(embedding, "<f4").tolist()


def _first_logprobs(out: RequestOutput) -> dict[int, Logprob]:
    logprobs = out.outputs[0].logprobs
    assert logprobs is not None  # asked for with logprobs=k
    return logprobs[0]


class LLM:
    """Batch generation in-process. Keyword arguments are those of `EngineArgs`, e.g.
    `tensor_parallel_size=2` (docs/scaling.md) or `generation_config="vllm"`
    (docs/generation_config.md)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers (a no-op with tensor_parallel_size=1). They
        also exit on their own when this process does."""
        self.engine.shutdown()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """kvserve's defaults with the checkpoint's generation config in place of them (per
        `generation_config`); what `generate` uses when given no SamplingParams."""
        return self.engine.info.generation_config.default_sampling_params()

    def get_default_beam_search_params(self, max_tokens: int | None = None) -> BeamSearchParams:
        """The checkpoint's `num_beams` (else 1), `length_penalty`, `early_stopping` and
        `max_new_tokens` (else 16, or `max_tokens`)."""
        g = self.engine.info.generation_config
        kwargs = {
            k: getattr(g, k)
            for k in ("length_penalty", "early_stopping")
            if getattr(g, k) is not None
        }
        max_tokens = max_tokens or int(g.sampling_defaults.get("max_tokens", 16))
        return BeamSearchParams(beam_width=g.num_beams or 1, max_tokens=max_tokens, **kwargs)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` (one or a list of: text, token ids, or a dict `{"prompt": text}` /
        `{"prompt_token_ids": [...]}` with an optional `"cache_salt"`) to completion.
        `lora_request`: the LoRA adapter of every prompt, or a list with one per prompt (None: the
        base model); needs `enable_lora=True` (docs/lora.md)."""
        prompts = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        loras = (
            [lora_request] * len(prompts)
            if lora_request is None or isinstance(lora_request, LoRARequest)
            else list(lora_request)
        )
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        # validate everything before queueing anything, so a bad prompt or adapter leaves no partial batch
        for lora in dict.fromkeys(x for x in loras if x is not None):
            self.engine.add_lora(lora)
        return self._run(self._add(prompts, params, loras), use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (prompts as `generate` takes them): the final hidden states pooled
        (`last` or `mean`, the model's default unless `pooling_params` says), L2-normalized by default."""
        prompts = _normalize_prompts(prompts)
        params = pooling_params if pooling_params is not None else PoolingParams()
        params = [params] * len(prompts) if isinstance(params, PoolingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} PoolingParams for {len(prompts)} prompts")
        outputs = self._run(self._add(prompts, params), use_tqdm)
        return [
            EmbeddingRequestOutput(
                request_id=out.request_id,
                prompt_token_ids=out.prompt_token_ids,
                outputs=EmbeddingOutput(_floats(out.embedding)),
            )
            for out in outputs
        ]

    def _add(
        self,
        prompts: list[PromptType],
        params: Sequence[SamplingParams | PoolingParams],
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[str]:
        """Queue the requests, all or none: each is validated before any is queued."""
        loras = loras or [None] * len(prompts)
        processed = [
            self.engine.process_prompt(p, sp, lora) for p, sp, lora in zip(prompts, params, loras)
        ]
        request_ids = [f"offline-{next(self._ids)}" for _ in processed]
        added = []
        try:
            for rid, item in zip(request_ids, processed):
                self.engine.add_processed(
                    rid, item
                )  # may refuse: the grammar compile queue is full
                added.append(rid)
        except BaseException:
            for rid in added:
                self.engine.abort(rid)
            raise
        return request_ids

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search over `prompts` (as `generate` takes them) with transformers' selection and
        scores (engine/beam_search.py, docs/beam_search.md); each output's hypotheses best first.
        Without `params`, the checkpoint's (`get_default_beam_search_params`)."""
        prompts = _normalize_prompts(prompts)
        if params is None:
            params = self.get_default_beam_search_params()
        constraints = self.engine.info.generation_config.constraints
        # tokenize and check every prompt (its length + max_tokens within the context) up front
        processed = [
            self.engine.process_prompt(p, SamplingParams(max_tokens=params.max_tokens))
            for p in prompts
        ]
        # an encoder-decoder model's beams are decoder sequences over the prompt's fixed source
        seq2seq = self.engine.info.is_encoder_decoder
        bar = tqdm(total=params.max_tokens, desc="beam search steps", disable=not use_tqdm)

        def request(item: ProcessedPrompt, beam: list[int]) -> dict[str, Any]:
            req: dict[str, Any] = (
                {"prompt_token_ids": item.prompt_token_ids, "decoder_prompt_token_ids": beam}
                if seq2seq
                else {"prompt_token_ids": beam}
            )
            if (
                item.cache_salt
            ):  # a beam shares cached blocks only under its prompt's salt (docs/security.md)
                req["cache_salt"] = item.cache_salt
            return req

        step_index = [0]  # the search's step: the constraints depend on it

        def next_token_logprobs(
            owners: list[int], sequences: list[list[int]], k: int
        ) -> list[dict[int, float]]:
            requests = [request(processed[i], seq) for i, seq in zip(owners, sequences)]
            constrained = beam_step_constraints(constraints, step_index[0], params.max_tokens)
            step_index[0] += 1
            step = SamplingParams(
                max_tokens=1,
                temperature=0.0,
                logprobs=k,
                ignore_eos=True,
                generation_constraints=constrained,
            )
            outputs = self.generate(requests, step, use_tqdm=False)
            bar.update(1)
            return [
                {token: lp.logprob for token, lp in _first_logprobs(out).items()} for out in outputs
            ]

        try:
            starts = [
                list(item.decoder_prompt_token_ids or ()) if seq2seq else item.prompt_token_ids
                for item in processed
            ]
            results = beam_search(
                starts, params, self.engine.info.eos_token_ids, next_token_logprobs
            )
        finally:
            bar.close()
        for result in results:
            for seq in result.sequences:
                seq.text = self.tokenizer.decode(seq.generated_tokens, skip_special_tokens=True)
        return results

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm)
        try:
            while len(results) < len(wanted):
                for out in self.engine.step(finished_only=True):
                    if out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in wanted - results.keys():
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in request_ids]
