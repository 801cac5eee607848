"""Load the tokenizer; validate and tokenize a prompt into a `ProcessedPrompt`, without touching engine state.

Both the in-process `LLMEngine` and `AsyncLLM`'s server-side client use it: the server
process tokenizes and validates, and only what passed is sent to the engine core.
Imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import RuntimeInfo
from engine.outputs import RequestOutputBuilder
from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A validated request, ready to be queued."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int

    def output_builder(self, request_id: str, arrival_time: float) -> RequestOutputBuilder:
        """What folds this request's deltas into `RequestOutput`s."""
        p = self.params
        return RequestOutputBuilder(request_id, self.prompt, self.prompt_token_ids, p.n, p.logprobs is not None,
                                    p.prompt_logprobs is not None, arrival_time)


def process_prompt(tokenizer, info: RuntimeInfo, prompt: str | Sequence[int],
                   params: SamplingParams) -> ProcessedPrompt:
    """Tokenize and validate; raises ValueError naming the bad value."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    params.validate()  # the caller may have mutated a validated object
    bad_bias = [t for t in params.logit_bias or () if t >= info.vocab_size]
    if bad_bias:
        raise ValueError(f"logit_bias token ids must be in [0, {info.vocab_size}), got {bad_bias[:5]}")
    if isinstance(prompt, str):
        text, token_ids = prompt, tokenizer.encode(prompt)
    else:
        text, token_ids = None, list(prompt)
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < info.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {info.vocab_size}), got {bad[:5]}")
    if not token_ids:
        raise ValueError("prompt must not be empty")
    num_prompt, limit = len(token_ids), info.max_model_len
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt
    if num_prompt + max_tokens > limit:
        raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
                         f"{num_prompt + max_tokens} exceeds the model's context length {limit}")
    if max_tokens < 1:
        raise ValueError(f"prompt ({num_prompt} tokens) leaves no room to generate within "
                         f"the context length {limit}")
    capacity = info.kv_capacity_tokens
    if num_prompt + max_tokens > capacity:
        raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) can never fit "
                         f"in the KV cache ({capacity} tokens); raise kv_cache_memory or lower max_tokens")
    return ProcessedPrompt(text, token_ids, params, max_tokens)


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, as `transformers.AutoTokenizer` picks it (its choice of class
    depends on config.json and the transformers version: both processes must agree)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)
