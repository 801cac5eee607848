"""Encoder-decoder models on the CPU's fast paths, against the PyTorch reference paths: in bf16
the decode rows' self- and cross-attention go to the paged decode kernel (T5's relative bias as
its per-distance table), the matrices to the packed linear kernel; with `quantization` the
matrices are int8 / int4. Checkpoints have head_dim 32, so the kernels apply."""

from __future__ import annotations

import pytest

from checkpoints import save_tokenizer
from kvserve.engine import LLM, SamplingParams
from kvserve.models import cpu_ops
from test_seq2seq_models import random_checkpoint

VOCAB = 384
FAMILIES = {
    "marian": dict(d_model=64, encoder_attention_heads=2, decoder_attention_heads=2, pad_token_id=VOCAB - 1,
                   decoder_start_token_id=VOCAB - 1),
    "bart": dict(d_model=64, encoder_attention_heads=2, decoder_attention_heads=2),
    "t5": dict(d_model=64, d_kv=32, num_heads=2),  # v1.0: tied, scaled head
    "t5-v1.1": dict(d_model=64, d_kv=32, num_heads=2),
}
SOURCES = [[5, 17, 42, 99, 7, 250, 31], [120, 3], [11, 250, 31, 8, 77, 200, 19, 54, 23, 300, 64, 90, 12, 5, 6],
           [64, 64, 64, 9]]

needs_bf16 = pytest.mark.skipif(not cpu_ops.load() or not cpu_ops.has_fast_bf16(), reason="needs AVX512-BF16")


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    random_checkpoint(request.param, path, vocab_size=VOCAB, **FAMILIES[request.param])
    save_tokenizer(path)
    return str(path)


def greedy(llm: LLM, max_tokens: int = 16) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": s} for s in SOURCES], params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
    return [(o.outputs[0].token_ids, [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def deviation(run, ref) -> float:
    """The largest difference between two runs' logprobs of their chosen tokens, up to and at the
    first position where they part (a near-tie: there the top logprob is still continuous)."""
    worst = 0.0
    for (tokens, lps), (ref_tokens, ref_lps) in zip(run, ref):
        split = next((i for i, (t, r) in enumerate(zip(tokens, ref_tokens)) if t != r), len(tokens) - 1)
        worst = max(worst, max(abs(a - b) for a, b in zip(lps[: split + 1], ref_lps[: split + 1])))
    return worst


@needs_bf16
def test_bf16_kernels_follow_the_reference(checkpoint):
    """The cpu backend (kernels) and the torch backend (gathered SDPA) differ only in rounding:
    the same greedy tokens, logprobs within bf16's noise."""
    fast = LLM(checkpoint, dtype="bfloat16", device="cpu", block_size=4)
    decoder_cache = fast.engine.runner.model
    holders = [m for m in decoder_cache.modules() if type(m).__name__ == "Attention"]
    assert holders and all(getattr(h.backend, "paged_kernels", False) for h in holders)
    got = greedy(fast)
    ref = greedy(LLM(checkpoint, dtype="bfloat16", device="cpu", block_size=4, attention_backend="torch"))
    exact = greedy(LLM(checkpoint, dtype="float32", device="cpu", block_size=4))
    # as close to float32 as the reference path in bf16 (T5's unscaled scores make bf16 noisy)
    assert deviation(got, exact) <= 1.5 * deviation(ref, exact) + 0.02


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_weights(request, checkpoint, method):
    """Every matrix (the LM head 8-bit) quantized at load: fewer weight bytes, and with int8 the
    unquantized model's tokens and logprobs (closely for BART and Marian; T5's unscaled attention
    on these tiny random checkpoints amplifies any rounding)."""
    base = LLM(checkpoint, dtype="float32", device="cpu", block_size=4)
    quant = LLM(checkpoint, dtype="float32", device="cpu", block_size=4, quantization=method,
                quantization_group_size=32)
    report = quant.engine.runner.model.weights_report
    assert report.method == method and report.quantized_layers > 0
    full = base.engine.runner.model.weights_report.weight_bytes
    # of float32: 8 or 4.5 bits per weight, plus the norms and positions
    assert report.weight_bytes < full * (0.35 if method == "int8" else 0.25)
    got = greedy(quant)
    if method == "int8":
        # T5: bf16 rounding alone moves its logprobs about as much
        assert deviation(got, greedy(base)) <= (0.5 if "t5" in request.node.callspec.id else 0.05)
