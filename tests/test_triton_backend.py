"""The Triton attention backend end to end on the CPU, under Triton's interpreter.

Every family's logits through the paged cache equal transformers' with the Triton
kernels doing rotary + cache write and attention (mixed decode / prefill steps,
cached prefixes, shuffled blocks), and the padded decode batches that CUDA graphs
replay (slot -1, seq_len 0 rows) leave the real rows' outputs unchanged.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from checkpoints import FAMILIES  # noqa: E402

pytest.importorskip("numpy")
pytest.importorskip("triton")

from kvserve.models.attention import forward_context  # noqa: E402
from kvserve.models.loader import load_model  # noqa: E402
from test_models import ATOL, PagedRunner, assert_close, hf_logits, make_meta, make_prompts  # noqa: E402

PROMPT_LENS = [
    1,
    3,
    9,
    26,
]  # the interpreter is slow: few, short prompts (26 > Mistral's window of 24)


@pytest.fixture(scope="module", params=FAMILIES)
def triton_models(request, checkpoint_dirs):
    model_dir = checkpoint_dirs[request.param]
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = load_model(model_dir, config, torch.float32, "cpu", attention_backend="triton")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    prompts = make_prompts(config.vocab_size, PROMPT_LENS)
    return request.param, model, prompts, hf_logits(hf_model, prompts)


def test_mixed_steps_with_cached_prefixes_match_transformers(triton_models):
    """Prefill chunks of 5 and decode rows in the same steps, in shuffled order."""
    _, model, prompts, want = triton_models
    assert "backend=triton" in repr(model)
    runner = PagedRunner(model, block_size=4, seed=2)
    chunk_sizes = [5 if i % 2 else 1 for i in range(len(prompts))]
    done = [0] * len(prompts)
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        order = [i for i in range(len(prompts)) if done[i] < len(prompts[i])]
        random.Random(sum(done)).shuffle(order)
        chunks = [(i, prompts[i][done[i] : done[i] + chunk_sizes[i]], done[i]) for i in order]
        for (i, tokens, _), logits in zip(chunks, runner.step(chunks)):
            got[i].append(logits)
            done[i] += len(tokens)
    assert_close([torch.cat(g) for g in got], want)


def test_padded_decode_rows_are_harmless(triton_models):
    """What a CUDA-graph replay sees: the decode batch padded with slot -1 / seq_len 0 rows, and
    max_seq_len at the model's limit; the real rows' logits are unchanged and the cache untouched
    by the padding."""
    family, model, prompts, want = triton_models
    if family not in ("llama", "gpt2"):  # one with rotary, one without: the interpreter is slow
        pytest.skip(
            "padding is checked on llama (rotary) and gpt2 (no rotary); the interpreter is too slow for all"
        )
    runner = PagedRunner(model, block_size=4, seed=3)
    runner.step([(i, p[:-1], 0) for i, p in enumerate(prompts) if len(p) > 1])
    rows = [i for i, p in enumerate(prompts) if len(p) > 1]
    bs = runner.block_size
    tables = [runner.tables[i] for i in rows]
    seq_lens = [len(prompts[i]) for i in rows]
    for table, n in zip(tables, seq_lens):
        while len(table) * bs < n:  # the last token may start a new block
            table.append(runner.free.pop())
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, seq_lens)]
    pad = 3
    width = max(len(t) for t in tables)
    meta = make_meta(
        model,
        [1] * (len(rows) + pad),
        seq_lens + [0] * pad,
        slots + [-1] * pad,
        [n - 1 for n in seq_lens] + [0] * pad,
        [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad,
        bs,
    )
    meta.max_seq_len = 2048  # as captured: an upper bound, not the batch's maximum
    caches = [
        m.kv_cache.clone() for m in model.modules() if getattr(m, "kv_cache", None) is not None
    ]
    ids = torch.tensor([prompts[i][-1] for i in rows] + [0] * pad)
    with torch.inference_mode(), forward_context(meta):
        logits = model.compute_logits(model(ids, meta.positions)).float()
    torch.testing.assert_close(
        logits[: len(rows)], torch.stack([want[i][-1] for i in rows]), atol=ATOL, rtol=0
    )
    assert torch.isfinite(logits).all()
    layers = [m for m in model.modules() if getattr(m, "kv_cache", None) is not None]
    # only the real rows' slots change; without rotary (GPT-2) padding rows may write the null block
    allowed = set(slots) | (set(range(bs)) if layers[0].rotary is None else set())
    for before, m in zip(caches, layers):
        changed = (
            (before != m.kv_cache).flatten(3).any(-1).any(0).flatten().nonzero().flatten().tolist()
        )
        assert set(changed) <= allowed


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_mixed_steps_match_transformers(tmp_path, family):
    """Soft-capped (Gemma 2) and q/k-normed, two-rotary (Gemma 3) layers, sliding and global,
    prompts longer than the window of 8, on the Triton kernels."""
    from gemma_checkpoints import make_gemma_checkpoint

    model_dir = make_gemma_checkpoint(tmp_path, family)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = load_model(model_dir, config, torch.float32, "cpu", attention_backend="triton")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompts = make_prompts(config.vocab_size, [1, 3, 12, 17])
    want = hf_logits(hf_model, prompts)
    runner = PagedRunner(model, block_size=4, seed=4)
    cut = [
        min(len(p), 10) for p in prompts
    ]  # whole prompts, or 10 tokens then the rest one at a time
    got = [[x] for x in runner.step([(i, p[: cut[i]], 0) for i, p in enumerate(prompts)])]
    for pos in range(10, max(len(p) for p in prompts)):
        chunks = [(i, p[pos : pos + 1], pos) for i, p in enumerate(prompts) if pos < len(p)]
        for (i, _, _), logits in zip(chunks, runner.step(chunks)):
            got[i].append(logits)
    assert_close([torch.cat(g) for g in got], want)


def test_phi3_partial_rotary_and_longrope(tmp_path):
    """Phi-4-mini's shape of rotary (partial, LongRoPE): the Triton rotary kernel reads the same
    cos/sin cache and permuted q/k as every backend; prompts past original_max_position_embeddings."""
    from checkpoints import make_checkpoint
    from test_phi3 import longrope

    path = make_checkpoint(tmp_path / "phi3", "phi3", partial_rotary_factor=0.5, **longrope(8))
    config = transformers.AutoConfig.from_pretrained(path)
    model = load_model(path, config, torch.float32, "cpu", attention_backend="triton")
    prompts = make_prompts(config.vocab_size, [33, 40])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = PagedRunner(model, block_size=4, seed=3)
    got = runner.step([(i, p[:30], 0) for i, p in enumerate(prompts)])
    rest = runner.step([(i, p[30:], 30) for i, p in enumerate(prompts)])
    assert_close([torch.cat(pair) for pair in zip(got, rest)], hf_logits(hf_model, prompts))
