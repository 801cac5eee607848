"""The GPU path end to end (CUDA only; deselected by default: `pytest -m gpu tests/test_gpu.py`).

Run this file in a pytest process of its own: tests/test_triton_*.py set TRITON_INTERPRET=1
when they are imported, after which every Triton kernel defined in the process runs on the
CPU interpreter (these tests then skip, saying so). `.ci/gpu_session.sh tests` does this.

* every family greedy-exact against transformers in fp32 (tie-aware, as tests/test_engine.py),
  with chunked prefill + prefix-cache hits, and with preemption (a tiny KV pool);
* bf16 within bf16 tolerance: kvserve's greedy tokens, teacher-forced through transformers
  in fp32, must be (near-)argmax there, and its logprobs must be as close to fp32 as
  transformers' own bf16 forward is (3x, with a floor);
* CUDA graphs vs eager (`enforce_eager`): identical greedy tokens and logprobs at a captured
  batch size, close ones with padding rows, the same seeded samples;
* a prompt near max_model_len after a prefix hit allocates no more than the memory profile saw;
* `device="cuda:1"` where a second GPU exists;
* the Triton kernels against torch in bf16 at real sizes (head_dim 128, GQA 4, 4k context).
* T5, BART and Marian: transformers' greedy tokens in fp32 through preemption, and bf16 in a
  pool the memory profile sized (its dummy step runs the encoder).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import transformers

from checkpoints import FAMILIES, make_checkpoint
from kvserve.engine import LLM, SamplingParams
from test_engine import assert_greedy_matches, assert_no_leaks, greedy, hf_model, make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
MiB = 1 << 20


@pytest.fixture(autouse=True)
def real_triton_and_clean_device():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip(
            "TRITON_INTERPRET=1 in this process (a tests/test_triton_* module set it): "
            "run tests/test_gpu.py in a pytest process of its own"
        )
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(0)  # the runner sets its device on the calling thread
    gc.collect()
    torch.cuda.empty_cache()


def cuda_llm(path: str, dtype: str = "float32", **kw) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_seqs", 16)  # CUDA graphs for batch sizes 1, 2, 4, 8, 16
    return LLM(path, dtype=dtype, device="cuda", **kw)


# ---- fp32: exact against transformers ----


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_greedy_with_chunked_prefill_and_prefix_hits(checkpoint_dirs, family):
    path = checkpoint_dirs[family]
    llm = cuda_llm(
        path, max_num_batched_tokens=16
    )  # prompts and prefix tails are split into chunks
    info = llm.engine.info
    assert (
        info.device.startswith("cuda") and info.attention_backend == "triton" and info.cuda_graphs
    )
    prompts = make_prompts(info.vocab_size)
    first = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    assert_greedy_matches(path, prompts, first, check_logprobs=True)
    shared = [
        prompts[-1][:30] + p for p in prompts
    ]  # a common 30-token prefix, cached by the first round
    second = llm.generate(prompts + shared, greedy(logprobs=3), use_tqdm=False)
    assert llm.engine.stats().prefix_cache_hits_total > 0
    assert [o.outputs[0].token_ids for o in second[: len(prompts)]] == [
        o.outputs[0].token_ids for o in first
    ]
    assert_greedy_matches(path, shared, second[len(prompts) :], check_logprobs=True)
    assert_no_leaks(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_greedy_under_preemption(checkpoint_dirs, family):
    path = checkpoint_dirs[family]
    llm = cuda_llm(path, num_kv_blocks=16)  # 60 tokens: requests are preempted and recomputed
    prompts = make_prompts(llm.engine.info.vocab_size)
    outs = llm.generate(prompts, greedy(logprobs=2), use_tqdm=False)
    assert llm.engine.stats().num_preemptions_total > 0
    assert_greedy_matches(path, prompts, outs, check_logprobs=True)
    assert_no_leaks(llm)


# ---- bf16: within bf16 tolerance ----

BF16_LOGPROB_FLOOR = (
    0.05  # measured on CPU: kvserve and transformers bf16 both ~0.01 from fp32 here
)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_close_to_transformers_fp32(checkpoint_dirs, family):
    path = checkpoint_dirs[family]
    llm = cuda_llm(path, dtype="bfloat16", max_num_batched_tokens=16)
    prompts = make_prompts(llm.engine.info.vocab_size)
    outs = llm.generate(prompts, greedy(logprobs=1), use_tqdm=False)
    fp32 = hf_model(path)  # CPU, fp32: the reference
    bf16 = (
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    )
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        seq = torch.tensor([prompt + tokens])
        with torch.no_grad():  # teacher-forced on kvserve's own tokens: no divergence to untangle
            ref = torch.log_softmax(fp32(seq).logits[0, len(prompt) - 1 : -1].float(), -1)
            theirs = torch.log_softmax(
                bf16(seq.cuda()).logits[0, len(prompt) - 1 : -1].float().cpu(), -1
            )
        steps, chosen = torch.arange(len(tokens)), torch.tensor(tokens)
        ours = torch.tensor([out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens)])
        our_error = (ours - ref[steps, chosen]).abs().max().item()
        their_error = (theirs[steps, chosen] - ref[steps, chosen]).abs().max().item()
        bound = max(BF16_LOGPROB_FLOOR, 3 * their_error)
        assert our_error <= bound, (
            f"prompt len {len(prompt)}: logprobs {our_error:.4f} from fp32 "
            f"(transformers bf16: {their_error:.4f})"
        )
        regret = (ref.max(-1).values - ref[steps, chosen]).max().item()  # 0 where fp32 agrees
        assert regret <= 2 * bound, (
            f"prompt len {len(prompt)}: a greedy token {regret:.4f} below fp32's best"
        )
    assert_no_leaks(llm)


# ---- CUDA graphs vs eager ----


class ReplayCounter:
    def __init__(self, llm: LLM) -> None:
        graphs = llm.engine.runner.graphs
        assert graphs is not None
        self.count, run = 0, graphs.run

        def counted(*args, **kwargs):
            self.count += 1
            return run(*args, **kwargs)

        graphs.run = counted


def generate_both(path: str, dtype: str, prompts, params) -> tuple[list, list, int]:
    """(graph outputs, eager outputs, graph replays): one engine at a time on the device."""
    llm = cuda_llm(path, dtype=dtype, block_size=16)
    assert llm.engine.info.cuda_graphs
    counter = ReplayCounter(llm)
    graph = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm)
    del llm
    gc.collect()
    llm = cuda_llm(path, dtype=dtype, block_size=16, enforce_eager=True)
    assert not llm.engine.info.cuda_graphs and llm.engine.runner.graphs is None
    eager = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm)
    return graph, eager, counter.count


def vocab_size(path: str) -> int:
    return transformers.AutoConfig.from_pretrained(path).vocab_size


def logprob_table(outs) -> list[list[dict[int, float]]]:
    return [
        [{t: lp.logprob for t, lp in entry.items()} for entry in o.outputs[0].logprobs]
        for o in outs
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_identical_to_eager_at_a_captured_size(checkpoint_dirs, dtype):
    """8 requests decode together at batch 8, a captured size: no padding rows, the same kernels
    on the same shapes, so tokens and logprobs are bit-identical; seeded sampling likewise."""
    path = checkpoint_dirs["llama"]
    prompts = make_prompts(vocab_size(path))
    prompts = prompts + prompts[2:]  # 8 prompts of 1-40 tokens
    params = [greedy(logprobs=5)] * 4 + [
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            top_k=50,
            seed=100 + i,
            max_tokens=12,
            ignore_eos=True,
            logprobs=2,
        )
        for i in range(4)
    ]
    graph, eager, replays = generate_both(path, dtype, prompts, params)
    assert replays >= 11  # every decode step (12 tokens: 1 from the prefill step)
    assert [o.outputs[0].token_ids for o in graph] == [o.outputs[0].token_ids for o in eager]
    assert logprob_table(graph) == logprob_table(eager)


def test_cuda_graph_padding_rows_are_harmless(checkpoint_dirs):
    """5 requests that finish one by one: batches 5, 4, 3, 2, 1 replay graphs of 8, 4, 4, 2, 1."""
    path = checkpoint_dirs["mistral"]  # sliding window too
    prompts = make_prompts(vocab_size(path))
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3)
        for n in (4, 8, 12, 16, 20)
    ]
    graph, eager, replays = generate_both(path, "float32", prompts, params)
    assert replays >= 19
    assert [o.outputs[0].token_ids for o in graph] == [o.outputs[0].token_ids for o in eager]
    for g_steps, e_steps in zip(logprob_table(graph), logprob_table(eager)):
        for g, e in zip(g_steps, e_steps):
            assert g.keys() == e.keys()
            assert all(
                g[t] == pytest.approx(e[t], abs=1e-4) for t in g
            )  # matmuls of 8 rows vs 5: rounding


# ---- memory ----


def test_long_prompt_after_prefix_hit_stays_inside_the_profiled_peak(tmp_path):
    """A prompt near max_model_len whose first half is cached: every chunk attends to up to 8k
    cached tokens. Nothing it allocates may exceed what the memory profile's dummy step took
    (a score matrix per chunk would: 8 heads x 512 x 8192 x 4 bytes = 128 MiB per layer)."""
    path = make_checkpoint(
        tmp_path,
        "llama",
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    llm = LLM(path, dtype="bfloat16", device="cuda", max_num_batched_tokens=512, max_num_seqs=4)
    profile = llm.engine.runner.memory_profile
    info = llm.engine.info
    assert info.max_model_len == 8192
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, info.vocab_size, (info.max_model_len // 2,), generator=g).tolist()
    llm.generate([prefix], SamplingParams(max_tokens=1), use_tqdm=False)
    tail = torch.randint(
        3, info.vocab_size, (info.max_model_len - len(prefix) - 8,), generator=g
    ).tolist()
    kv_pool = sum(
        layer.kv_cache.numel() * layer.kv_cache.element_size()
        for layer in llm.engine.runner.attn_layers
    )

    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()  # weights, KV pool, graph pool, persistent buffers
    torch.cuda.reset_peak_memory_stats()
    out = llm.generate(
        [prefix + tail], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=5), use_tqdm=False
    )
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()

    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.stats().prefix_cache_hits_total >= len(prefix) - info.block_size
    step_extra, profiled_extra = peak - resident, profile.peak - profile.weights
    other_resident = resident - profile.weights - kv_pool  # CUDA graph pool, persistent buffers
    # i.e. peak <= profiled peak + KV pool + graphs and buffers (+ 4 MiB of slack)
    assert step_extra <= profiled_extra + 4 * MiB, (
        f"the long prompt peaked at {peak / MiB:.1f} MiB: {step_extra / MiB:.1f} MiB above resident memory "
        f"(KV pool {kv_pool / MiB:.1f}, graphs and buffers {other_resident / MiB:.1f}), the profiled step took "
        f"{profiled_extra / MiB:.1f} MiB above the weights ({profile.summary()})"
    )
    assert_no_leaks(llm)


# ---- device selection ----


def test_second_gpu_by_name(checkpoint_dirs):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    path = checkpoint_dirs["llama"]
    before = torch.cuda.memory_allocated(0)
    llm = LLM(path, dtype="float32", device="cuda:1", block_size=4, max_num_seqs=8)
    assert llm.engine.info.device == "cuda:1"
    assert {p.device for p in llm.engine.runner.model.parameters()} == {torch.device("cuda:1")}
    prompts = make_prompts(llm.engine.info.vocab_size)
    outs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    assert_greedy_matches(path, prompts, outs, check_logprobs=True)
    assert torch.cuda.memory_allocated(0) == before  # nothing landed on cuda:0
    assert_no_leaks(llm)


def test_step_inputs_land_aligned_on_the_device():
    """The step's packed host arrays come back as device views that each start 16-byte aligned
    (Triton compiles a kernel variant per pointer alignment) and hold the values sent."""
    import numpy as np

    from kvserve.engine.worker.runner import HostToDevice

    staging = HostToDevice(torch.device("cuda", 0))
    for sizes in ((5, 3, 7), (1, 2, 1), (13, 6, 9, 4)):
        for dtype in (np.int32, np.int64):
            arrays = [np.arange(n, dtype=dtype) + 100 * i for i, n in enumerate(sizes)]
            views = staging.copy(arrays, dtype)
            for array, view in zip(arrays, views):
                assert view.data_ptr() % 16 == 0
                assert view.cpu().numpy().tolist() == array.tolist()


# ---- Triton kernels at real sizes, bf16 ----

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def paged_cache(seq_lens: list[int], seed: int = 0, device: str = "cuda"):
    """bf16 k/v caches [num_blocks, 16, 8, 128], NaN wherever no live token is, and block_table int32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = 1 + sum(blocks) + 4
    ids = (torch.randperm(num_blocks - 1, device=device, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(blocks) + 2, dtype=torch.int32, device=device)
    kv = torch.full(
        (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
        float("nan"),
        device=device,
        dtype=torch.bfloat16,
    )
    for r, (seq_len, n) in enumerate(zip(seq_lens, blocks)):
        own, ids = ids[:n], ids[n:]
        table[r, :n] = torch.tensor(own, dtype=torch.int32, device=device)
        pos = torch.arange(seq_len, device=device)
        blk = table[r, pos // BLOCK_SIZE].long()
        kv[:, blk, pos % BLOCK_SIZE] = torch.randn(
            2, seq_len, NUM_KV_HEADS, HEAD_DIM, device=device, generator=gen
        ).bfloat16()
    return kv[0], kv[1], table


def gathered(cache: torch.Tensor, table: torch.Tensor, r: int, seq_len: int) -> torch.Tensor:
    pos = torch.arange(seq_len, device=cache.device)
    return cache[table[r, pos // BLOCK_SIZE].long(), pos % BLOCK_SIZE]  # [S, KvH, D]


def references(q, k_cache, v_cache, table, seq_lens, query_lens, window):
    """(fp32 math, torch SDPA in bf16) per request: [T, H, D] each; SDPA is the torch reference backend's op."""
    from kvserve.models.attention.torch_ref import sdpa_gqa

    scale = HEAD_DIM**-0.5
    device = q.device
    exact = torch.empty(q.shape, dtype=torch.float32, device=device)
    sdpa = torch.empty_like(q)
    row = 0
    for r, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        k, v = (
            gathered(k_cache, table, r, seq_len),
            gathered(v_cache, table, r, seq_len),
        )  # [S, KvH, D]
        k_rep, v_rep = (
            x.float().repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1) for x in (k, v)
        )  # [S, H, D]
        q_pos = torch.arange(seq_len - query_len, seq_len, device=device)
        k_pos = torch.arange(seq_len, device=device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        for start in range(0, query_len, 1024):  # bounded score matrices
            stop = min(start + 1024, query_len)
            qr = q[row + start : row + stop]  # [n, H, D]
            scores = torch.einsum("qhd,khd->hqk", qr.float(), k_rep) * scale
            probs = scores.masked_fill(~mask[start:stop], float("-inf")).softmax(-1)
            exact[row + start : row + stop] = torch.einsum("hqk,khd->qhd", probs, v_rep)
            out = sdpa_gqa(
                qr.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                mask[start:stop][None, None],
                scale,
            )
            sdpa[row + start : row + stop] = out[0].transpose(0, 1)
        row += query_len
    return exact, sdpa


def assert_as_accurate_as_sdpa(out: torch.Tensor, exact: torch.Tensor, sdpa: torch.Tensor) -> None:
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    ours = (out.float() - exact).abs().max().item()
    torch_error = (sdpa.float() - exact).abs().max().item()
    assert ours <= 2 * torch_error + 1e-3, (
        f"kernel error {ours:.2e}, torch SDPA's {torch_error:.2e}"
    )


@pytest.mark.parametrize("window", [None, 1000])
def test_triton_decode_attention_bf16_real_sizes(window):
    from kvserve.models.kernels.triton_attention import paged_decode_attention

    seq_lens = [4096, 4000, 1, 17, 2048, 513, 4095, 1000]
    k_cache, v_cache, table = paged_cache(seq_lens)
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, device="cuda").bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    exact, sdpa = references(q, k_cache, v_cache, table, seq_lens, [1] * len(seq_lens), window)
    for max_seq_len in (
        4096,
        8192,
    ):  # the eager bound, and a CUDA graph's max_model_len (more splits)
        out = paged_decode_attention(
            q, k_cache, v_cache, table, lens, HEAD_DIM**-0.5, window, max_seq_len
        )
        assert_as_accurate_as_sdpa(out, exact, sdpa)


@pytest.mark.parametrize("window", [None, 1000])
def test_triton_prefill_attention_bf16_real_sizes(window):
    from kvserve.models.kernels.triton_attention import paged_prefill_attention

    # a whole 4k prompt, a chunk after a 3.5k cached prefix, a 1-token row after 4k, a short prompt
    query_lens, seq_lens = [4096, 512, 1, 100], [4096, 4012, 4001, 100]
    k_cache, v_cache, table = paged_cache(seq_lens, seed=1)
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, device="cuda").bfloat16()
    cu = torch.tensor([0, *query_lens], device="cuda").cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = paged_prefill_attention(
        q, k_cache, v_cache, table, cu, lens, HEAD_DIM**-0.5, window, max(query_lens)
    )
    exact, sdpa = references(q, k_cache, v_cache, table, seq_lens, query_lens, window)
    assert_as_accurate_as_sdpa(out, exact, sdpa)


def test_triton_rotary_and_cache_write_bf16_real_sizes():
    from kvserve.models.kernels.triton_ops import rotary_and_cache_write
    from kvserve.models.layers import RotaryEmbedding, apply_rotary

    num_tokens, num_blocks = 4096, 300
    rope = RotaryEmbedding(
        HEAD_DIM,
        8192,
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    cos_sin_cache = rope.cos_sin_cache.cuda().bfloat16()
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(
        num_tokens, q_size + 2 * kv_size, device="cuda"
    ).bfloat16()  # packed, as the model has it
    q = qkv[:, :q_size].view(num_tokens, NUM_HEADS, HEAD_DIM)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    v = qkv[:, q_size + kv_size :].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    positions = torch.randperm(8192, device="cuda")[:num_tokens]
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens].to(torch.int32)
    slots[::7] = -1  # padding rows: rotated, never written
    cos_sin = cos_sin_cache[positions].float()
    q_ref, k_ref, v_ref = (
        apply_rotary(q.float(), cos_sin),
        apply_rotary(k.float(), cos_sin),
        v.clone(),
    )
    k_cache = torch.full(
        (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), 7.0, device="cuda"
    ).bfloat16()
    v_cache = k_cache.clone()
    rotary_and_cache_write(q, k, v, cos_sin_cache, positions, k_cache, v_cache, slots)
    torch.testing.assert_close(q.float(), q_ref, atol=2e-2, rtol=1e-2)  # one rounding vs fp32
    torch.testing.assert_close(k.float(), k_ref, atol=2e-2, rtol=1e-2)
    live = slots >= 0
    flat_k, flat_v = (
        k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM),
        v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM),
    )
    assert torch.equal(flat_k[slots[live].long()], k[live]) and torch.equal(
        flat_v[slots[live].long()], v_ref[live]
    )
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device="cuda")
    untouched[slots[live].long()] = False
    assert (flat_k[untouched] == 7.0).all() and (flat_v[untouched] == 7.0).all()


@pytest.mark.parametrize("hidden, intermediate", [(2048, 8192), (4096, 14336)])
def test_triton_norms_and_silu_bf16_real_sizes(hidden, intermediate):
    from kvserve.models.fused_ops import TORCH_OPS
    from kvserve.models.kernels import triton_ops

    x = torch.randn(4096, hidden, device="cuda").bfloat16()
    residual = torch.randn(4096, hidden, device="cuda").bfloat16()
    weight = (1 + 0.3 * torch.randn(hidden, device="cuda")).bfloat16()
    torch.testing.assert_close(
        triton_ops.rms_norm(x, weight, 1e-5), TORCH_OPS.rms_norm(x, weight, 1e-5)
    )
    want_out, want_residual = TORCH_OPS.add_rms_norm(x, residual.clone(), weight, 1e-5)
    out, new_residual = triton_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, want_residual)
    torch.testing.assert_close(out, want_out)
    gate_up = torch.randn(4096, 2 * intermediate, device="cuda").bfloat16()
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up))


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_quant_linear_real_sizes(fmt, dtype):
    """The weight-only int8 / int4 / fp8 kernel on the GPU against the dequantized matmul (bf16
    included, which the interpreter cannot run)."""
    from kvserve.models.kernels import triton_quant
    from kvserve.models.quantization import (
        dequantize,
        pack_int4,
        quantize_fp8,
        quantize_int4,
        quantize_int8,
    )

    torch.manual_seed(0)
    bits = 4 if fmt == "int4" else 8
    for m, n, k in [(1, 4096, 4096), (7, 14336, 4096), (300, 4096, 14336)]:
        w = torch.randn(n, k, device="cuda") * 0.02
        q, d = {"int8": quantize_int8, "int4": quantize_int4, "fp8": quantize_fp8}[fmt](w, 32)
        x = torch.randn(m, k, device="cuda").to(dtype)
        y = triton_quant.quant_linear(x, pack_int4(q) if bits == 4 else q, d, None, bits, 32)
        want = x.float() @ dequantize(q, d, 32).T
        assert (y.float() - want).abs().max() <= 2**-7 * want.abs().max()


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_quantized_model_on_cuda_matches_the_cpu(checkpoint_dirs, quantization):
    """A quantized model on CUDA (the Triton weight-only kernel) gives the greedy tokens of the same
    quantized weights on the CPU (whose kernel also rounds activations), up to near-ties."""
    prompts = make_prompts(384)[:3]
    outs = {}
    for device in ("cuda", "cpu"):
        llm = LLM(
            checkpoint_dirs["llama"],
            device=device,
            dtype="float32",
            quantization=quantization,
            enable_prefix_caching=False,
        )
        try:
            outs[device] = [
                o.outputs[0].token_ids
                for o in llm.generate(
                    [{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(max_tokens=8, temperature=0),
                    use_tqdm=False,
                )
            ]
        finally:
            llm.shutdown()
    same = sum(a[:4] == b[:4] for a, b in zip(outs["cuda"], outs["cpu"]))
    assert same >= 2, (outs["cuda"], outs["cpu"])


def test_speculative_decoding_on_cuda_matches_without(checkpoint_dirs):
    """n-gram speculation on CUDA: a step whose rows all decode (drafts included, each its own decode
    row) replays CUDA graphs; greedy tokens equal those without speculation and of enforce_eager
    (fp32 and the tests' peaked tiny model: no near-ties for other GEMM shapes to flip)."""
    prompts = [(list(range(5, 25)) * 3)[:50], list(range(40, 47)) * 4]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "max_batch_size": 8,
    }
    outs = []
    for kw in (
        {},
        {"speculative_config": spec},
        {"speculative_config": spec, "enforce_eager": True},
    ):
        llm = LLM(checkpoint_dirs["llama"], device="cuda", dtype="float32", **kw)
        try:
            outs.append(
                [
                    o.outputs[0].token_ids
                    for o in llm.generate(
                        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
                    )
                ]
            )
            if kw:
                assert llm.engine.scheduler.num_accepted_tokens > 0
        finally:
            llm.shutdown()
    assert outs[0] == outs[1] == outs[2]


# ---- encoder-decoder models ----


@pytest.mark.parametrize("family", ["t5", "t5-v1.1", "bart", "marian"])
def test_encoder_decoder_greedy_on_cuda(tmp_path, family):
    """T5, BART and Marian on CUDA (eager steps, Triton's paged decode kernel for every row, T5's
    bias as its per-distance table): transformers' greedy tokens and logprobs in fp32, with a pool
    that preempts and re-encodes; a pool sized by the memory profile (its dummy step runs the
    encoder) serves bf16; no block leaked."""
    from checkpoints import save_tokenizer
    from test_seq2seq_engine import SOURCES, VOCAB, check_against_hf
    from test_seq2seq_kernels import FAMILIES as KERNEL_FAMILIES  # head_dim 32
    from test_seq2seq_models import random_checkpoint

    hf = random_checkpoint(family, tmp_path, vocab_size=VOCAB, **KERNEL_FAMILIES[family])
    save_tokenizer(tmp_path)
    llm = cuda_llm(str(tmp_path), num_kv_blocks=14, max_num_batched_tokens=24)
    try:
        check_against_hf(llm, hf, SOURCES)
        assert llm.engine.stats().num_preemptions_total > 0
    finally:
        llm.shutdown()
    llm = cuda_llm(str(tmp_path), dtype="bfloat16")
    try:
        outs = llm.generate(
            [{"prompt_token_ids": s} for s in SOURCES],
            SamplingParams(max_tokens=12, temperature=0),
            use_tqdm=False,
        )
        assert all(o.outputs[0].token_ids for o in outs)
        assert_no_leaks(llm)
    finally:
        llm.shutdown()
