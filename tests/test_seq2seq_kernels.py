"""Encoder-decoder models on the CPU's fast paths, against the PyTorch reference paths: in bf16
the decode rows' self- and cross-attention go to the paged decode kernel (T5's relative bias as
its per-distance table), the matrices to the packed linear kernel; with `quantization` the
matrices are int8 / int4. Checkpoints have head_dim 32, so the kernels apply."""

from __future__ import annotations

import pytest
import torch

from checkpoints import save_tokenizer
from kvserve.engine import LLM, SamplingParams
from test_seq2seq_models import random_checkpoint

VOCAB = 384
FAMILIES = {
    "marian": dict(
        d_model=64,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        pad_token_id=VOCAB - 1,
        decoder_start_token_id=VOCAB - 1,
    ),
    "bart": dict(d_model=64, encoder_attention_heads=2, decoder_attention_heads=2),
    "t5": dict(d_model=64, d_kv=32, num_heads=2),  # v1.0: tied, scaled head
    "t5-v1.1": dict(d_model=64, d_kv=32, num_heads=2),
}
SOURCES = [
    [5, 17, 42, 99, 7, 250, 31],
    [120, 3],
    [11, 250, 31, 8, 77, 200, 19, 54, 23, 300, 64, 90, 12, 5, 6],
    [64, 64, 64, 9],
]

needs_bf16 = pytest.mark.usefixtures("kernel_set")  # once per CPU kernel set this machine runs


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    random_checkpoint(request.param, path, vocab_size=VOCAB, **FAMILIES[request.param])
    save_tokenizer(path)
    return str(path)


def greedy(
    llm: LLM, max_tokens: int = 16, prefixes: bool = False
) -> list[tuple[list[int], list[float]]]:
    """Greedy outputs of SOURCES; with `prefixes`, each continues a decoder prefix of 3-9 tokens
    (several rows of a request in one step, across blocks of 4)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    start = llm.engine.info.decoder_start_token_id
    prompts = [{"prompt_token_ids": s} for s in SOURCES]
    if prefixes:
        for i, prompt in enumerate(prompts):
            prompt["decoder_prompt_token_ids"] = [start] + [
                (7 * i + 13 * j) % 300 + 2 for j in range(2 + 2 * i)
            ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
    return [
        (
            o.outputs[0].token_ids,
            [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
        )
        for o in outs
    ]


def split(run, ref) -> list[int]:
    """Per request, the first position where two runs' tokens part (the last position if never)."""
    return [
        next((i for i, (t, r) in enumerate(zip(tokens, ref_tokens)) if t != r), len(tokens) - 1)
        for (tokens, _), (ref_tokens, _) in zip(run, ref)
    ]


def deviation(run, ref, upto: list[int]) -> float:
    """The largest difference between two runs' logprobs of their chosen tokens, per request up
    to and at position `upto` (where a run parts from the other, a near-tie: there the top
    logprob is still continuous)."""
    return max(
        max(abs(a - b) for a, b in zip(lps[: end + 1], ref_lps[: end + 1]))
        for (_, lps), (_, ref_lps), end in zip(run, ref, upto)
    )


@needs_bf16
@pytest.mark.parametrize("prefixes", [False, True])
def test_bf16_kernels_follow_the_reference(checkpoint, prefixes):
    """The cpu backend (kernels: every row of a step in one call, prompt rows too) and the torch
    backend (gathered SDPA) differ only in rounding: as close to float32 as each other."""
    fast = LLM(checkpoint, dtype="bfloat16", device="cpu", block_size=4)
    decoder_cache = fast.engine.runner.model
    holders = [m for m in decoder_cache.modules() if type(m).__name__ == "Attention"]
    assert holders and all(getattr(h.backend, "paged_kernels", False) for h in holders)
    got = greedy(fast, prefixes=prefixes)
    ref = greedy(
        LLM(checkpoint, dtype="bfloat16", device="cpu", block_size=4, attention_backend="torch"),
        prefixes=prefixes,
    )
    exact = greedy(LLM(checkpoint, dtype="float32", device="cpu", block_size=4), prefixes=prefixes)
    # as close to float32 as the reference path in bf16 (T5's unscaled scores make bf16 noisy), on
    # the positions where both still follow float32's tokens
    upto = [min(a, b) for a, b in zip(split(got, exact), split(ref, exact))]
    assert deviation(got, exact, upto) <= 1.5 * deviation(ref, exact, upto) + 0.02


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_weights(request, checkpoint, method):
    """Every matrix (the LM head 8-bit) quantized at load: fewer weight bytes, and with int8 the
    unquantized model's tokens and logprobs (closely for BART and Marian; T5's unscaled attention
    on these tiny random checkpoints amplifies any rounding)."""
    base = LLM(checkpoint, dtype="float32", device="cpu", block_size=4)
    quant = LLM(
        checkpoint,
        dtype="float32",
        device="cpu",
        block_size=4,
        quantization=method,
        quantization_group_size=32,
    )
    report = quant.engine.runner.model.weights_report
    assert report.method == method and report.quantized_layers > 0
    full = base.engine.runner.model.weights_report.weight_bytes
    # of float32: 8 or 4.5 bits per weight, plus the norms and positions
    assert report.weight_bytes < full * (0.35 if method == "int8" else 0.25)
    got = greedy(quant)
    if method == "int8":
        # T5: bf16 rounding alone moves its logprobs about as much
        ref = greedy(base)
        assert deviation(got, ref, split(got, ref)) <= (
            0.5 if "t5" in request.node.callspec.id else 0.05
        )


@needs_bf16
@pytest.mark.parametrize("with_bias", [False, True])
def test_step_attention_every_row_through_the_kernel(with_bias):
    """One step mixing decode rows and several-row requests (a decoder prefix, a chunk): the
    kernel plan (every row a query over its request's table rows, causal by its own length; the
    cross blocks unmasked) equals the reference plan (padded SDPA for decode rows, one call per
    other request), self- and cross-attention, with and without a per-distance bias."""
    from kvserve.models.attention.metadata import AttentionMetadata
    from kvserve.models.seq2seq import kv_holder, paged_attention, step_plan

    g = torch.Generator().manual_seed(0)
    heads, dim, bs = 4, 32, 4
    holder = kv_holder(heads, dim)
    holder.kv_cache = torch.randn(2, 41, bs, heads, dim, generator=g).bfloat16()
    query_lens, seq_lens, cross_lens = [1, 5, 1, 3, 1], [7, 5, 12, 9, 1], [6, 3, 13, 8, 2]
    perm = torch.randperm(40, generator=g) + 1  # (block 0 is the null block)
    table = perm[:20].view(5, 4)
    cross_table = perm[20:].view(5, 4)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long),
        positions=torch.zeros(sum(query_lens), dtype=torch.long),
        cu_seqlens_q=torch.tensor([0, 1, 6, 7, 10, 11]),
        seq_lens=torch.tensor(seq_lens),
        block_table=table,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_size=bs,
        max_query_len=5,
        max_seq_len=12,
        cross_block_table=cross_table,
        cross_lens_cpu=cross_lens,
    )
    q = torch.randn(sum(query_lens), heads, dim, generator=g).bfloat16()
    kernel_plan, ref_plan = step_plan(meta, q.device, kernels=True), step_plan(meta, q.device)
    length = max(seq_lens)
    distance = torch.randn(heads, length, generator=g) if with_bias else None
    masks = []
    for r in ref_plan.prefill:
        mask = r.causal_mask(q.device)
        if with_bias:  # query j at position p = seq_len - query_len + j, key t: distance p - t
            pos = torch.arange(r.seq_len - r.query_len, r.seq_len)[:, None]
            dist = (pos - torch.arange(r.seq_len)[None, :]).clamp(min=0)
            mask = mask + distance[:, length - 1 - dist]
        masks.append(mask.bfloat16())
    ref_bias = None
    if with_bias:
        lens = ref_plan.self_lens
        keys = ref_plan.self_mask.shape[-1]
        dist = ((lens - 1)[:, None] - torch.arange(keys)[None, :]).clamp(0, length - 1)
        ref_bias = (
            distance[:, length - 1 - dist].permute(1, 0, 2)[:, :, None, :] + ref_plan.self_mask
        )
    for cross in (False, True):
        got = paged_attention(holder, q, kernel_plan, 0.5, cross, [], None if cross else distance)
        ref = paged_attention(holder, q, ref_plan, 0.5, cross, masks, None if cross else ref_bias)
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
