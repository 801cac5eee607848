"""Encoder-decoder models on the GPU's code path, run on the CPU: the engine with the Triton
backend (its attention kernels and fused ops under Triton's interpreter: the same flattened
rows, block tables and bias table a CUDA step hands them) gives transformers' greedy tokens and
logprobs for T5 v1.1 (relative bias) and Marian, through a tight pool; and the memory profile's dummy
step (what sizes a GPU's KV pool) runs the encoder into cross blocks and the decoder over them.
On a GPU, tests/test_gpu.py runs the same models on CUDA."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from checkpoints import save_tokenizer  # noqa: E402
from test_seq2seq_engine import VOCAB, check_against_hf  # noqa: E402
from test_seq2seq_kernels import FAMILIES as KERNEL_FAMILIES  # noqa: E402
from test_seq2seq_models import random_checkpoint  # noqa: E402

pytest.importorskip("triton")

from kvserve.engine import LLM  # noqa: E402
from kvserve.engine.worker.memory_profile import run_dummy_step  # noqa: E402
from kvserve.models.attention import Attention  # noqa: E402
from kvserve.models.loader import load_model  # noqa: E402

SOURCES = [
    [5, 17, 42, 99, 7, 250, 31],
    [120, 3],
    [11, 250, 31, 8, 77, 200, 19, 54, 23],
]  # the interpreter is slow


@pytest.fixture(scope="module", params=["t5-v1.1", "marian"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)  # head_dim 32, a size the kernels take
    hf = random_checkpoint(request.param, path, vocab_size=VOCAB, **KERNEL_FAMILIES[request.param])
    save_tokenizer(path)
    return request.param, hf, str(path)


def test_triton_backend_greedy_equals_transformers(checkpoint):
    """Every step's rows (decode rows and decoder-prefix rows alike) through Triton's paged decode
    kernel, T5's bias as its per-distance table; a pool small enough to preempt and re-encode."""
    _, hf, path = checkpoint
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        block_size=4,
        attention_backend="triton",
        num_kv_blocks=10,
        max_num_batched_tokens=24,
    )
    assert {
        m.backend.name for m in llm.engine.runner.model.modules() if isinstance(m, Attention)
    } == {"triton"}
    check_against_hf(llm, hf, SOURCES, max_new=6)
    assert llm.engine.stats().num_preemptions_total > 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_memory_profile_step_encodes_and_decodes(checkpoint, backend):
    """The dummy step that sizes a GPU's pool, on the CPU: sources as long as its rows encoded into
    cross blocks, the decoder over both kinds of blocks; the layers left without a cache."""
    _, _, path = checkpoint
    config = transformers.AutoConfig.from_pretrained(path)
    model = load_model(path, config, torch.float32, "cpu", attention_backend=backend)
    index = torch.int32 if backend == "triton" else torch.int64
    cache_bytes = run_dummy_step(
        model,
        config.vocab_size,
        max_num_batched_tokens=20,  # rows of 8, 8 and 4 tokens: a partly filled last block
        max_num_seqs=8,
        max_model_len=8,
        block_size=4,
        index_dtype=index,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    holders = [m for m in model.modules() if isinstance(m, Attention)]
    per_block = 2 * 4 * holders[0].num_kv_heads * holders[0].head_dim * 4
    assert (
        cache_bytes == len(holders) * (2 * 5 + 1) * per_block
    )  # 5 decoder blocks, 5 cross blocks, null
    assert all(h.kv_cache is None for h in holders)
