"""Gemma 2 and Gemma 3 (text): logits, greedy tokens and log-probs equal transformers'.

Tiny random checkpoints (tests/gemma_checkpoints.py) with both layer kinds, a sliding window of 8
(shorter than most prompts), Gemma 2's attention and final soft-capping, Gemma 3's q/k norms and
two rotary bases, and random norm weights (Gemma's `1 + weight`). fp32 on the CPU, atol 1e-4,
through the paged cache (whole prompts, cached prefixes, mixed decode/chunked prefill steps),
the engine (chunked prefill, prefix-cache hits, preemption), GGUF files and tensor parallelism.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
import transformers

from gemma_checkpoints import SLIDING_WINDOW, gemma_config, gemma_tensors, make_gemma_checkpoint
from gguf_files import make_gguf
from kvserve.models.attention import Attention
from kvserve.models.checkpoint_writer import write_checkpoint
from kvserve.models.gemma import GemmaRMSNorm
from kvserve.models.hf_config import load_hf_config
from kvserve.models.loader import get_max_model_len, load_model, resolve_model_path
from kvserve.models.registry import SUPPORTED_ARCHITECTURES
from test_engine import MAX_TOKENS, assert_greedy_matches, assert_no_leaks, greedy, make_llm
from test_engine import make_prompts as engine_prompts
from test_models import PagedRunner, assert_close, hf_logits, make_prompts

FAMILIES = ("gemma2", "gemma3")
PROMPT_LENS = [1, 3, 9, 17, 26]  # most longer than the window (8)


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gemma")
    return {family: make_gemma_checkpoint(root / family, family) for family in FAMILIES}


def hf_eager(model_dir: str):
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(
    scope="module",
    params=[(f, b) for f in FAMILIES for b in ("cpu", "torch")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def gemma_models(request, gemma_dirs):
    family, backend = request.param
    config = load_hf_config(gemma_dirs[family])
    model = load_model(gemma_dirs[family], config, torch.float32, "cpu", attention_backend=backend)
    prompts = make_prompts(config.vocab_size, PROMPT_LENS)
    return model, prompts, hf_logits(hf_eager(gemma_dirs[family]), prompts)


def test_layers_follow_the_config(gemma_dirs):
    g2 = load_model(
        gemma_dirs["gemma2"], load_hf_config(gemma_dirs["gemma2"]), torch.float32, "cpu"
    )
    attn = [m for m in g2.modules() if isinstance(m, Attention)]
    assert [a.sliding_window for a in attn] == [SLIDING_WINDOW, None, SLIDING_WINDOW]
    assert {a.logit_softcap for a in attn} == {2.0} and g2.final_logit_softcap == 8.0
    assert attn[0].scale == pytest.approx(24**-0.5)  # query_pre_attn_scalar, not head_dim
    g3 = load_model(
        gemma_dirs["gemma3"], load_hf_config(gemma_dirs["gemma3"]), torch.float32, "cpu"
    )
    attn = [m for m in g3.modules() if isinstance(m, Attention)]
    assert [a.sliding_window for a in attn] == [
        SLIDING_WINDOW,
        SLIDING_WINDOW,
        None,
        SLIDING_WINDOW,
    ]
    assert attn[0].rotary is attn[1].rotary is not attn[2].rotary  # local and global rotary tables
    assert {a.logit_softcap for a in attn} == {None}


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_whole_prompts(gemma_models, block_size):
    model, prompts, want = gemma_models
    assert_close(
        PagedRunner(model, block_size).step([(i, p, 0) for i, p in enumerate(prompts)]), want
    )


def test_prefill_after_cached_prefix(gemma_models):
    model, prompts, want = gemma_models
    runner = PagedRunner(model, block_size=4, seed=1)
    cut = [max(1, len(p) * 2 // 3) for p in prompts]
    first = runner.step([(i, p[: cut[i]], 0) for i, p in enumerate(prompts)])
    rest = [(i, p[cut[i] :], cut[i]) for i, p in enumerate(prompts) if len(p) > cut[i]]
    second = dict(zip([r[0] for r in rest], runner.step(rest)))
    assert_close(
        [torch.cat([first[i]] + ([second[i]] if i in second else [])) for i in range(len(prompts))],
        want,
    )


def test_mixed_decode_and_chunked_prefill(gemma_models):
    model, prompts, want = gemma_models
    runner = PagedRunner(model, block_size=4, seed=2)
    sizes = [5 if i % 2 else 1 for i in range(len(prompts))]
    done, got = [0] * len(prompts), [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        order = [i for i in range(len(prompts)) if done[i] < len(prompts[i])]
        random.Random(sum(done)).shuffle(order)
        chunks = [(i, prompts[i][done[i] : done[i] + sizes[i]], done[i]) for i in order]
        for (i, tokens, _), logits in zip(chunks, runner.step(chunks)):
            got[i].append(logits)
            done[i] += len(tokens)
    assert_close([torch.cat(g) for g in got], want)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "setting",
    [
        dict(),
        dict(max_num_batched_tokens=5),  # chunked prefill mixed with decodes
        dict(num_kv_blocks=16),  # so small that requests are preempted and recomputed
    ],
    ids=["plain", "chunked", "preempted"],
)
def test_engine_greedy_and_logprobs(gemma_dirs, family, setting):
    path = gemma_dirs[family]
    llm = make_llm(path, **setting)
    prompts = engine_prompts(llm.engine.info.vocab_size)  # 1 to 40 tokens
    outs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    assert_greedy_matches(path, prompts, outs, check_logprobs=True)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    if "num_kv_blocks" in setting:
        assert llm.engine.stats().num_preemptions_total > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits(gemma_dirs, family):
    path = gemma_dirs[family]
    llm = make_llm(path)
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, llm.engine.info.vocab_size, (20,), generator=g).tolist()
    prompts = [
        prefix + torch.randint(3, llm.engine.info.vocab_size, (n,), generator=g).tolist()
        for n in (3, 11)
    ]
    first = llm.generate(prompts[:1], greedy(), use_tqdm=False)
    second = llm.generate(prompts, greedy(logprobs=2), use_tqdm=False)
    assert llm.engine.stats().prefix_cache_hits_total > 0
    assert first[0].outputs[0].token_ids == second[0].outputs[0].token_ids
    assert_greedy_matches(path, prompts, second, check_logprobs=True)
    assert_no_leaks(llm)


def test_norm_weight_plus_one_is_exact_in_fp32():
    """The folded weight is HF's `1.0 + weight.float()` bit for bit, whatever the stored dtype."""
    norm = GemmaRMSNorm(7)
    norm.weight.data = torch.empty(7)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        w = torch.tensor([-2.5, -1.0, -0.75, -1e-8, 0.0, 3e-3, 7.25]).to(dtype)
        norm.weight_loader(norm.weight, w)
        assert torch.equal(norm.weight, 1.0 + w.float())


@pytest.mark.usefixtures("kernel_set")  # once per CPU kernel set this machine runs
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_cpu_kernels_close_to_fp32(tmp_path, family):
    """bf16 on the CPU backend (packed matmuls, fused rotary/cache ops, the C++ attention kernels,
    soft-capping included) against the fp32 model on the same bf16 checkpoint."""
    path = make_gemma_checkpoint(tmp_path / family, family, dtype="bfloat16")
    config = load_hf_config(path)
    prompts = make_prompts(config.vocab_size, [3, 17, 26])
    want = PagedRunner(load_model(path, config, torch.float32, "cpu"), 4).step(
        [(i, p, 0) for i, p in enumerate(prompts)]
    )
    model = load_model(path, config, torch.bfloat16, "cpu", attention_backend="cpu")
    assert next(m for m in model.modules() if isinstance(m, Attention)).backend.paged_kernels
    got = PagedRunner(model, 4).step([(i, p, 0) for i, p in enumerate(prompts)])
    for g, w in zip(got, want):
        probs_g, probs_w = g.softmax(-1), w.softmax(-1)
        assert (probs_g - probs_w).abs().max() < 0.05
        assert (g.argmax(-1) == w.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_file_loads_the_checkpoints_weights_exactly(tmp_path, family, dtype):
    """An F32 file written as llama.cpp's converter writes it (norm weights stored as 1 + w) gives
    the safetensors checkpoint's parameters bit for bit, the same layer set-up, the same logits."""
    path = make_gguf(
        tmp_path, family, "F32", dtype=dtype, query_pre_attn_scalar=32
    )  # llama.cpp: head_dim
    models = []
    for model_path in (resolve_model_path(str(path)), str(tmp_path / "hf")):
        config = load_hf_config(model_path)
        assert config.architectures == [
            {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[family]
        ]
        models.append(load_model(model_path, config, torch.float32, "cpu", quantization="none"))
    from_gguf, from_safetensors = models
    want = dict(from_safetensors.named_parameters())
    for name, param in from_gguf.named_parameters():
        assert torch.equal(param, want[name]), name
    for a, b in zip(
        *[[m for m in model.modules() if isinstance(m, Attention)] for model in models], strict=True
    ):
        assert (a.sliding_window, a.scale, a.logit_softcap) == (
            b.sliding_window,
            pytest.approx(b.scale),
            b.logit_softcap,
        )
        assert a.rotary.params == b.rotary.params
    assert from_gguf.final_logit_softcap == from_safetensors.final_logit_softcap
    prompts = make_prompts(from_gguf.config.vocab_size, [3, 17])
    got, want_logits = [
        PagedRunner(m, 4).step([(i, p, 0) for i, p in enumerate(prompts)]) for m in models
    ]
    for g, w in zip(got, want_logits):
        assert torch.equal(g, w)


def _multimodal_checkpoint(path, hf_naming_v4: bool) -> tuple[str, torch.nn.Module]:
    """A Gemma3ForConditionalGeneration checkpoint (tiny SigLIP tower) and transformers' model of it."""
    from checkpoints import train_tokenizer

    tokenizer = train_tokenizer()
    text = gemma_config("gemma3", tokenizer.get_vocab_size())
    text.pop("architectures")
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    text_values = dict(gemma_tensors(text))
    with (
        torch.no_grad()
    ):  # the text part as the text-only checkpoint has it (random norms, scaled matrices)
        for name, param in hf.model.language_model.named_parameters():
            param.copy_(text_values[f"model.{name}"])
    tensors = []
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        if hf_naming_v4:  # as checkpoints written by transformers 4 name them
            name = name.replace("model.language_model.", "language_model.model.").replace(
                "model.vision_tower.", "vision_tower."
            )
            name = name.replace("model.multi_modal_projector.", "multi_modal_projector.")
        tensors.append((name, t.contiguous()))
    out = config.to_dict()
    out["architectures"] = ["Gemma3ForConditionalGeneration"]
    write_checkpoint(path, out, tensors, tokenizer)
    return str(path), hf


@pytest.mark.parametrize(
    "hf_naming_v4", [False, True], ids=["transformers5-names", "transformers4-names"]
)
def test_multimodal_checkpoint_serves_its_text_decoder(tmp_path, caplog, hf_naming_v4):
    path, hf = _multimodal_checkpoint(tmp_path / "mm", hf_naming_v4)
    config = load_hf_config(path)
    assert (
        config.architectures == ["Gemma3ForConditionalGeneration"]
        and config.vocab_size == hf.config.text_config.vocab_size
    )
    assert get_max_model_len(config) == 512
    with caplog.at_level(logging.INFO, logger="kvserve.models.gemma"):
        model = load_model(path, config, torch.float32, "cpu")
    assert sum("vision tower" in r.getMessage() for r in caplog.records) == 1
    assert not any("vision" in name for name, _ in model.named_parameters())
    prompts = make_prompts(config.vocab_size, [3, 17])
    with torch.no_grad():
        want = [hf(input_ids=torch.tensor([p])).logits[0].float() for p in prompts]
    assert_close(PagedRunner(model, 4).step([(i, p, 0) for i, p in enumerate(prompts)]), want)


def test_bidirectional_config_is_refused():
    from kvserve.models.gemma import Gemma3ForCausalLM

    config = transformers.Gemma3TextConfig(
        **{**gemma_config("gemma3", 100), "use_bidirectional_attention": True}
    )
    with torch.device("meta"), pytest.raises(ValueError, match="use_bidirectional_attention"):
        Gemma3ForCausalLM(config)


def test_registered():
    assert {"Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"} <= set(
        SUPPORTED_ARCHITECTURES
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_matches_single_rank(gemma_dirs, family):
    """tp=2 (gloo) against tp=1 with chunked prefill, prefix-cache hits and preemptions in the run
    (tests/test_tensor_parallel.py's set-up)."""
    from test_tensor_parallel import _compare_tokens, _run

    want, want_stats = _run(gemma_dirs[family], 1)
    got, got_stats = _run(gemma_dirs[family], 2)
    assert got_stats["tp"] == 2 and want_stats["preemptions"] > 0 and want_stats["prefix_hits"] > 0
    for i, (a, b) in enumerate(zip(want, got)):
        _compare_tokens(a.outputs[0], b.outputs[0], f"{family} request {i}")


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_quantized_at_load(gemma_dirs, family):
    """bf16 with int8 matrices (the tied head/embedding included) serves; the int8 greedy tokens
    follow the bf16 ones for these peaked tiny models."""
    from kvserve.engine import LLM

    prompt = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    tokens = []
    for quantization in (None, "int8"):
        llm = LLM(
            gemma_dirs[family],
            dtype="bfloat16",
            device="cpu",
            block_size=4,
            quantization=quantization,
            quantization_group_size=32,
        )
        tokens.append(llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].token_ids[:4])
    assert tokens[0] == tokens[1]
