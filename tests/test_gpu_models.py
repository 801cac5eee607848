"""The newer model families and features on CUDA (deselected by default: `pytest -m gpu
tests/test_gpu_models.py`, in a pytest process of its own, as tests/test_gpu.py; `.ci/gpu_session.sh
tests` runs it).

* Gemma 2 (attention and final soft-capping) and Gemma 3 (sliding windows shorter than the
  prompts, q/k norms, two rotary bases), and the mixture-of-experts families (the Triton grouped
  GEMM, its tile table built on the device under CUDA graphs): greedy tokens and logprobs equal to
  transformers in fp32, with chunked prefill and prefix hits, and under preemption;
* quantized experts (the per-expert Triton weight-only matmul) give the CPU's greedy tokens;
* LoRA adapters (the Triton shrink/expand) equal PEFT's merged model in fp32;
* embeddings (pooled hidden states) equal transformers'.

Each check is a function of the device, so `python tests/test_gpu_models.py cpu` runs the same
checks on the CPU (a check of the checks where no GPU is at hand).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers

from checkpoints import MOE_FAMILIES, make_checkpoint
from gemma_checkpoints import make_gemma_checkpoint
from kvserve.engine import LLM, PoolingParams, SamplingParams
from test_engine import assert_greedy_matches, assert_no_leaks, greedy, make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FAMILIES = ("gemma2", "gemma3", *MOE_FAMILIES)


def make_family_checkpoint(root: Path, family: str) -> str:
    maker = make_gemma_checkpoint if family.startswith("gemma") else make_checkpoint
    return maker(root / family, family)


def check_greedy_exact(path: str, device: str) -> None:
    """fp32 greedy against transformers: chunked prefill, then prefix hits, then preemption."""
    llm = LLM(
        path,
        dtype="float32",
        device=device,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=16,
    )
    prompts = make_prompts(llm.engine.info.vocab_size)
    first = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    assert_greedy_matches(path, prompts, first, check_logprobs=True)
    shared = [prompts[-1][:30] + p for p in prompts]  # a 30-token prefix the first round cached
    second = llm.generate(shared, greedy(logprobs=3), use_tqdm=False)
    assert llm.engine.stats().prefix_cache_hits_total > 0
    assert_greedy_matches(path, shared, second, check_logprobs=True)
    assert_no_leaks(llm)
    llm.shutdown()
    llm = LLM(path, dtype="float32", device=device, block_size=4, num_kv_blocks=16)
    outs = llm.generate(prompts, greedy(logprobs=2), use_tqdm=False)
    assert llm.engine.stats().num_preemptions_total > 0
    assert_greedy_matches(path, prompts, outs, check_logprobs=True)
    assert_no_leaks(llm)
    llm.shutdown()


def quantized_tokens(path: str, device: str, quantization: str) -> list[list[int]]:
    llm = LLM(
        path, device=device, dtype="float32", quantization=quantization, enable_prefix_caching=False
    )
    try:
        prompts = make_prompts(llm.engine.info.vocab_size)[:4]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=8, temperature=0),
            use_tqdm=False,
        )
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def check_lora_matches_peft(root: Path, device: str) -> None:
    from test_lora import ALL_TARGETS, MIXED, assert_matches, make_adapter, requests
    from test_lora import greedy as lora_greedy
    from test_lora import make_prompts as lora_prompts

    base = make_checkpoint(root / "lora-base", "llama")
    dirs = {
        "base": base,
        "a": make_adapter(base, root / "a", 8, seed=1, targets=ALL_TARGETS),
        "b": make_adapter(base, root / "b", 4, seed=2, targets=["q_proj", "v_proj", "down_proj"]),
    }
    llm = LLM(
        base,
        device=device,
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        block_size=4,
        max_num_batched_tokens=16,
    )
    prompts = lora_prompts([1, 3, 7, 17, 30, 9])
    loras = requests(dirs)
    outs = llm.generate(
        prompts, lora_greedy(), lora_request=[loras[a] for a in MIXED], use_tqdm=False
    )
    assert_matches(dirs, prompts, MIXED, outs)
    llm.shutdown()


def check_embeddings(root: Path, device: str) -> None:
    from test_embeddings import PROMPTS, hf_embedding

    path = make_checkpoint(root / "embed", "qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", device=device, max_num_batched_tokens=8, block_size=4)
    for pooling in ("last", "mean"):
        outs = llm.embed(PROMPTS, PoolingParams(pooling_type=pooling), use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            torch.testing.assert_close(
                torch.tensor(out.outputs.embedding),
                hf_embedding(hf.model, ids, pooling),
                atol=1e-4,
                rtol=1e-4,
            )
    llm.shutdown()


# ---- the tests (CUDA) ----


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {family: make_family_checkpoint(root, family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_greedy_equals_transformers_on_cuda(family_dirs, family):
    check_greedy_exact(family_dirs[family], "cuda")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_experts_on_cuda_give_the_cpus_tokens(family_dirs, quantization):
    path = family_dirs["qwen3_moe"]
    cuda, cpu = (quantized_tokens(path, d, quantization) for d in ("cuda", "cpu"))
    same = sum(a[:4] == b[:4] for a, b in zip(cuda, cpu, strict=True))
    assert same >= 3, (cuda, cpu)  # the CPU kernel also rounds activations: near-ties may differ


def test_lora_on_cuda_equals_merged_peft(tmp_path):
    pytest.importorskip("peft")
    check_lora_matches_peft(tmp_path, "cuda")


def test_embeddings_on_cuda_equal_transformers(tmp_path):
    check_embeddings(tmp_path, "cuda")


if __name__ == "__main__":  # the checks on another device: python tests/test_gpu_models.py cpu
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for family in FAMILIES:
            check_greedy_exact(make_family_checkpoint(root, family), device)
            print("greedy exact:", family, flush=True)
        check_lora_matches_peft(root, device)
        print("lora: ok", flush=True)
        check_embeddings(root, device)
        print("embeddings: ok", flush=True)
