"""models/phi3.py: Phi-3 / Phi-4 (`Phi3ForCausalLM`) against transformers, in fp32 (atol 1e-4).

Tiny random checkpoints in the variants real ones use: fused qkv/gate_up (all), LongRoPE
(Phi-3-mini-128k, Phi-3.5), partial rotary with LongRoPE and a tied head (Phi-4-mini), a sliding
window (Phi-3-mini-4k). original_max_position_embeddings is 32 so that sequences longer than it
are cheap. kvserve uses one LongRoPE factor set per server (models/phi3.py): the long one unless
max_model_len <= 32, so it equals transformers on sequences longer than 32 by default, and on
every sequence with max_model_len=32.
"""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import pytest
import torch
import transformers

from checkpoints import make_checkpoint
from gguf_files import make_gguf
from kvserve.engine import LLM
from kvserve.models import cpu_stack
from kvserve.models.hf_config import load_hf_config
from kvserve.models.layers import partial_rotary_permutation
from kvserve.models.loader import load_model
from kvserve.models.phi3 import LongRopeRotaryEmbedding, phi3_rope
from test_engine import assert_greedy_matches, greedy
from test_models import PagedRunner, assert_close, hf_logits, make_prompts

ORIGINAL = 32  # original_max_position_embeddings of the LongRoPE variants


def longrope(rotary_dim: int, seed: int = 0, rope_type: str = "longrope") -> dict:
    """LongRoPE overrides; the factors are float32 values, as a GGUF file stores them."""
    g = torch.Generator().manual_seed(seed)
    short = (1 + torch.rand(rotary_dim // 2, generator=g)).tolist()
    long = (1 + 20 * torch.rand(rotary_dim // 2, generator=g)).tolist()
    return dict(
        rope_scaling={"rope_type": rope_type, "short_factor": short, "long_factor": long},
        original_max_position_embeddings=ORIGINAL,
    )


VARIANTS = {  # head_dim 16 (hidden 64, 4 heads, 2 KV heads)
    "plain": {},
    "partial": dict(partial_rotary_factor=0.75),
    "longrope": longrope(16),
    "longrope-partial-tied": dict(
        partial_rotary_factor=0.5, tie_word_embeddings=True, **longrope(8)
    ),
    "window": dict(sliding_window=8),
}
LONG = [35, 47, 70]  # prompt lengths past ORIGINAL


@pytest.fixture(scope="module")
def phi3_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("phi3")
    return {
        name: make_checkpoint(root / name, "phi3", **overrides)
        for name, overrides in VARIANTS.items()
    }


def hf_model(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_whole_and_chunked(phi3_dirs, variant, backend):
    path = phi3_dirs[variant]
    model = load_model(path, load_hf_config(path), torch.float32, "cpu", attention_backend=backend)
    prompts = make_prompts(384, LONG)
    want = hf_logits(hf_model(path), prompts)
    assert_close(PagedRunner(model, 4).step([(i, p, 0) for i, p in enumerate(prompts)]), want)
    # the same prompts in chunks of 13 tokens, the three requests in one step each time
    runner, got = PagedRunner(model, 4, seed=1), [[] for _ in prompts]
    for start in range(0, max(LONG), 13):
        chunks = [
            (i, p[start : start + 13], start) for i, p in enumerate(prompts) if start < len(p)
        ]
        for (i, _, _), logits in zip(chunks, runner.step(chunks)):
            got[i].append(logits)
    assert_close([torch.cat(g) for g in got], want)


@pytest.mark.parametrize("variant", ["longrope", "longrope-partial-tied"])
def test_max_model_len_within_the_original_uses_the_short_factors(phi3_dirs, variant):
    path = phi3_dirs[variant]
    config = load_hf_config(path)
    prompts = make_prompts(384, [5, 20, ORIGINAL])
    want = hf_logits(hf_model(path), prompts)
    short = load_model(path, config, torch.float32, "cpu", max_model_len=ORIGINAL)
    assert_close(PagedRunner(short, 4).step([(i, p, 0) for i, p in enumerate(prompts)]), want)
    long = load_model(path, config, torch.float32, "cpu")  # max_model_len 512: the long factors
    assert long.model.rotary_emb.use_long and not short.model.rotary_emb.use_long
    got = PagedRunner(long, 4).step([(0, prompts[1], 0)])[0]
    assert (got - want[1]).abs().max() > 1e-2  # transformers uses the short ones up to 32 tokens


def test_longrope_attention_factor_and_legacy_su_type(tmp_path):
    """`su` (older Phi-3 configs, transformers 4.x's `rope_scaling` form) reads as longrope; the
    default attention factor is sqrt(1 + ln(s) / ln(L0)), s = max_position_embeddings / L0, an
    explicit one wins."""
    legacy = longrope(16)
    legacy["rope_scaling"]["type"] = "su"
    del legacy["rope_scaling"]["rope_type"]
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=512,
        rope_theta=10000.0,
        **legacy,
    )
    params, rotary_dim = phi3_rope(config)
    assert params["rope_type"] == "longrope" and rotary_dim == 16
    assert params["original_max_position_embeddings"] == ORIGINAL
    rotary = LongRopeRotaryEmbedding(16, 512, params, rotary_dim)
    assert rotary.inv_freq_and_scaling()[1] == pytest.approx(
        (1 + torch.log(torch.tensor(16.0)).item() / torch.log(torch.tensor(32.0)).item()) ** 0.5
    )
    rotary = LongRopeRotaryEmbedding(16, 512, {**params, "attention_factor": 1.25}, rotary_dim)
    assert rotary.inv_freq_and_scaling()[1] == 1.25
    with pytest.raises(ValueError, match="long_factor must list rotary_dim / 2 = 8 numbers, got 3"):
        LongRopeRotaryEmbedding(16, 512, {**params, "long_factor": [1.0, 2.0, 3.0]}, rotary_dim)


def test_partial_rotary_permutation_pairs():
    perm = partial_rotary_permutation(16, 12).tolist()
    assert sorted(perm) == list(range(16))
    # HF's rotated pairs (i, i + 6) for i < 6 land at (j, j + 8); the 4 passed-through features fill the rest
    assert [perm[j] for j in range(6)] == [0, 1, 2, 3, 4, 5] and [
        perm[8 + j] for j in range(6)
    ] == [6, 7, 8, 9, 10, 11]
    assert perm[6:8] + perm[14:] == [12, 13, 14, 15]


# block_size 4, 16-token chunks and a pool too small for every sequence at once: chunked prefill,
# prefix-cache hits (the shared prefix) and preemptions in one run
ENGINE = dict(
    block_size=4,
    max_num_batched_tokens=16,
    num_kv_blocks=24,
    max_num_seqs=4,
    enable_prefix_caching=True,
)


@pytest.mark.parametrize("variant", ["longrope-partial-tied", "window"])
def test_engine_greedy_and_logprobs_match_transformers(phi3_dirs, variant):
    path = phi3_dirs[variant]
    llm = LLM(path, dtype="float32", device="cpu", **ENGINE)
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 384, (36,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 384, (n,), generator=g).tolist() for n in (3, 11, 0, 7)]
    prompts += [torch.randint(3, 384, (n,), generator=g).tolist() for n in (41, 50)]
    outs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    assert_greedy_matches(path, prompts, outs, check_logprobs=True)
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


def test_engine_short_factors_match_transformers(phi3_dirs):
    path = phi3_dirs["longrope"]
    llm = LLM(
        path,
        dtype="float32",
        device="cpu",
        max_model_len=ORIGINAL,
        block_size=4,
        max_num_batched_tokens=8,
    )
    prompts = make_prompts(384, [1, 6, 20])  # + 12 new tokens: at most 32
    outs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    assert_greedy_matches(path, prompts, outs, check_logprobs=True)


BF16_SHAPE = dict(
    hidden_size=128, num_attention_heads=4, num_key_value_heads=2
)  # head_dim 32: the paged kernels


def test_bf16_cpu_kernels_close_to_transformers(tmp_path):
    path = make_checkpoint(
        tmp_path / "bf16", "phi3", partial_rotary_factor=0.75, **longrope(24), **BF16_SHAPE
    )
    model = load_model(path, load_hf_config(path), torch.bfloat16, "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = make_prompts(384, [40, 57])
    got = PagedRunner(model, 16).step([(i, p, 0) for i, p in enumerate(prompts)])
    for g, w in zip(got, hf_logits(hf, prompts)):
        assert (g.argmax(-1) == w.argmax(-1)).float().mean() > 0.9
        torch.testing.assert_close(g, w, atol=0.1, rtol=0.05)


def test_cpu_decoder_stack_runs_phi3_bit_for_bit(tmp_path, kernel_set):
    """Partial rotary and LongRoPE live in the weights' layout and the cos/sin cache, so the C++
    decoder stack runs Phi-3 as it runs Llama, with the Python forward's exact outputs."""
    from test_cpu_stack import generate

    path = make_checkpoint(
        tmp_path / "stack",
        "phi3",
        partial_rotary_factor=0.75,
        sliding_window=24,
        initializer_range=0.1,
        **longrope(24),
        **BF16_SHAPE,
    )
    llm = LLM(path, dtype="bfloat16", device="cpu")
    assert cpu_stack.why_not(llm.engine.runner.model) is None
    llm.shutdown()
    assert generate(path, "none", eager=False) == generate(path, "none", eager=True)
    assert generate(path, "int8", eager=False) == generate(path, "int8", eager=True)


@pytest.mark.parametrize("variant", ["plain", "longrope-partial-tied", "window"])
def test_gguf_round_trip_equals_safetensors(tmp_path, variant):
    """A phi3 GGUF file (fused attn_qkv, ffn_up holding gate and up, rope_factors_long/short,
    rope.dimension_count, sliding_window) gives the safetensors checkpoint's config and logits."""
    path = make_gguf(tmp_path, "phi3", "F32", **VARIANTS[variant])
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.0.attn_qkv.weight" in names and "blk.0.ffn_up.weight" in names
    assert ("rope_factors_long.weight" in names) == ("rope_scaling" in VARIANTS[variant])
    config, want_config = load_hf_config(str(path)), load_hf_config(str(tmp_path / "hf"))
    assert config.architectures == ["Phi3ForCausalLM"]
    assert phi3_rope(config) == phi3_rope(want_config)
    assert config.sliding_window == want_config.sliding_window
    assert config.tie_word_embeddings == want_config.tie_word_embeddings
    prompts = make_prompts(384, [5, 40])
    logits = [
        PagedRunner(load_model(p, c, torch.float32, "cpu", quantization="none"), 4).step(
            [(i, q, 0) for i, q in enumerate(prompts)]
        )
        for p, c in ((str(path), config), (str(tmp_path / "hf"), want_config))
    ]
    for a, b in zip(*logits):
        assert torch.equal(a, b)
