"""models/cpu_stack.py: the decoder layers as one C++ call per step give exactly the Python forward's
outputs (bf16, int8, int4; Llama with a tied head, Mistral's window, Qwen2's bias, Qwen3's q/k norms),
in decode, prefill, chunked and mixed steps and over cached prefixes; what it cannot run keeps the
Python forward."""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_checkpoint
from kvserve.engine import LLM, SamplingParams
from kvserve.models import cpu_stack

# each test runs once per CPU kernel set this machine can execute (skips naming missing CPU features)
pytestmark = pytest.mark.usefixtures("kernel_set")

# head_dim 32: the paged attention kernels' smallest
SHAPES = {
    "llama": dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True
    ),
    "mistral": dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, sliding_window=24
    ),
    "qwen2": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(),  # head_dim 32 explicitly, q/k norms
}


def generate(path: str, quantization: str, eager: bool):
    llm = LLM(
        path,
        dtype="bfloat16",
        device="cpu",
        block_size=16,
        quantization=quantization,
        enforce_eager=eager,
        max_num_batched_tokens=48,
        enable_prefix_caching=True,
    )
    runner = llm.engine.runner
    assert (runner.cpu_stack is None) == eager
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 384, (40,), generator=g).tolist()
    # one decode-only batch, chunked prompts beside decodes, a cached prefix (the second round)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 5, 70)] + [
        shared + [7],
        shared + [9, 11],
    ]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False) + llm.generate(
        prompts[3:], params, use_tqdm=False
    )
    stats = llm.engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total  # nothing leaked
    return [
        (
            o.outputs[0].token_ids,
            [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs],
        )
        for o in outs
    ]


@pytest.mark.parametrize(
    "family,quantization",
    [
        ("llama", "none"),
        ("llama", "int8"),
        ("llama", "int4"),
        ("mistral", "int8"),
        ("qwen2", "none"),
        ("qwen2", "int4"),
        ("qwen3", "int8"),
    ],
)
def test_stack_equals_the_python_forward_bit_for_bit(tmp_path, family, quantization):
    path = make_checkpoint(tmp_path / family, family, initializer_range=0.1, **SHAPES[family])
    assert generate(path, quantization, eager=False) == generate(path, quantization, eager=True)


@pytest.mark.parametrize(
    "family,dtype,reason",
    [
        ("llama", "bfloat16", "attention backend"),  # head_dim 16: no paged attention kernels
        ("gpt2", "bfloat16", "not a Llama-family model"),
        ("qwen3", "float32", "not bf16"),
    ],
)
def test_what_the_stack_cannot_run_keeps_the_python_forward(tmp_path, family, dtype, reason):
    llm = LLM(make_checkpoint(tmp_path / family, family), dtype=dtype, device="cpu")
    runner = llm.engine.runner
    assert runner.cpu_stack is None and reason in cpu_stack.why_not(runner.model)
    assert (
        len(
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
        == 3
    )


def test_the_stack_follows_caches_assigned_after_it_was_built(tmp_path):
    """The C++ stack holds the caches' pointers: a layer given a new cache rebuilds it, and the
    old caches are never read again."""
    path = make_checkpoint(tmp_path / "llama", "llama", **SHAPES["llama"])
    llm = LLM(path, dtype="bfloat16", device="cpu", block_size=16, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    stack = llm.engine.runner.cpu_stack
    built, old = stack._stack, [a.kv_cache for a in stack.attention]
    for a in stack.attention:
        a.kv_cache = torch.zeros_like(a.kv_cache)
    for cache in old:
        cache.fill_(float("nan"))
    again = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert stack._stack is not built and again == first
