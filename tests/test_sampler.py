import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvserve.engine.core.request import Request
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.worker.sampler import (
    Sampler,
    SamplingTensors,
    _top_k_top_p_sorted,
    apply_penalties,
    apply_top_k_top_p,
    hash_exponential,
    hash_uniform,
    mix64,
)
from sampling_inputs import build_sampling_tensors

sampler = Sampler()
NUM_DRAWS = 6000
MASK64 = (1 << 64) - 1


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value (survival via the regularized gamma)."""
    observed, expected = observed.double(), expected.double()
    assert expected.min() >= 5, "bins too small for the chi-square approximation"
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(observed.numel() - 1, dtype=torch.float64)
    return torch.special.gammaincc(dof / 2, stat / 2).item()


def tensors(vocab_size: int, num_reqs: int, **kw) -> SamplingTensors:
    kw.setdefault("temperature", [1.0] * num_reqs)
    return SamplingTensors.from_lists(vocab_size=vocab_size, **kw)


def draw(logits_row: torch.Tensor, num: int = NUM_DRAWS, **per_request) -> torch.Tensor:
    """Sample `num` times from one row of logits; per_request values are scalars."""
    kw = {k: [v] * num for k, v in per_request.items()}
    t = tensors(logits_row.numel(), num, **kw)
    return sampler(logits_row.expand(num, -1).contiguous(), t).sampled_token_ids


def test_chi2_helper_sanity():
    assert chi2_pvalue(torch.tensor([100, 100]), torch.tensor([100.0, 100.0])) == pytest.approx(1.0)
    assert chi2_pvalue(torch.tensor([150, 50]), torch.tensor([100.0, 100.0])) < 1e-6


# ---- greedy ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    torch.manual_seed(0)
    logits = torch.randn(16, 100).to(dtype)
    out = sampler(logits, tensors(100, 16, temperature=[0.0] * 16))
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_ranks, torch.ones(16, dtype=torch.int64))


def test_mixed_greedy_and_random_batch():
    torch.manual_seed(1)
    logits = torch.randn(1, 50).expand(400, -1).contiguous()  # flat-ish: random rows vary
    temperature = [0.0 if i % 2 == 0 else 2.0 for i in range(400)]
    ids = sampler(
        logits, tensors(50, 400, temperature=temperature, top_p=[0.5] * 400)
    ).sampled_token_ids
    assert (ids[0::2] == logits[0].argmax()).all()  # top_p does not matter to greedy rows
    assert ids[1::2].unique().numel() > 3


def test_input_logits_not_modified():
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    before = logits.clone()
    t = tensors(
        30,
        4,
        top_k=[3] * 4,
        top_p=[0.8] * 4,
        min_p=[0.1] * 4,
        repetition_penalty=[1.5] * 4,
        output_token_ids=[[1, 2]] * 4,
        suppressed_token_ids=[[0]] * 4,
    )
    sampler(logits, t)
    assert torch.equal(logits, before)


# ---- support of top-k / top-p / min-p ----


def top_k_support(probs: torch.Tensor, k: int) -> torch.Tensor:
    kth = probs.sort(descending=True).values[k - 1]
    return probs >= kth


def top_p_support(probs: torch.Tensor, p: float) -> torch.Tensor:
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs
    assert (before - p).abs().min() > 1e-4, "test logits too close to the top-p boundary"
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order] = before < p
    return keep


def min_p_support(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    ratio = probs / probs.max()
    assert (ratio - min_p).abs().min() > 1e-4
    return ratio >= min_p


@pytest.fixture
def row():
    torch.manual_seed(3)
    return torch.randn(40, dtype=torch.float64) * 1.5  # distinct values, no ties


def assert_within(ids: torch.Tensor, support: torch.Tensor):
    allowed = support.nonzero().flatten().tolist()
    outside = set(ids.tolist()) - set(allowed)
    assert not outside, f"sampled outside the support: {outside}"


def test_top_k_support(row):
    probs = (row / 0.8).softmax(0)
    ids = draw(row.float(), temperature=0.8, top_k=5)
    assert_within(ids, top_k_support(probs, 5))
    assert ids.unique().numel() == 5  # the whole support is reachable


def test_top_k_without_host_max(row):
    """A builder that leaves max_top_k unset still gets correct top-k (full topk)."""
    t = tensors(40, NUM_DRAWS, top_k=[4] * NUM_DRAWS)
    t = dataclasses.replace(t, max_top_k=None)
    ids = sampler(row.float().expand(NUM_DRAWS, -1).contiguous(), t).sampled_token_ids
    assert_within(ids, top_k_support(row.softmax(0), 4))


def test_top_p_support(row):
    probs = (row / 1.3).softmax(0)
    ids = draw(row.float(), temperature=1.3, top_p=0.6)
    support = top_p_support(probs, 0.6)
    assert_within(ids, support)
    assert ids.unique().numel() == support.sum()


def test_top_k_then_top_p_support(row):
    k, p = 10, 0.7
    probs = row.softmax(0)
    in_k = top_k_support(probs, k)
    renorm = torch.where(in_k, probs, 0.0)
    renorm = renorm / renorm.sum()
    support = top_p_support(renorm, p) & in_k
    assert_within(draw(row.float(), top_k=k, top_p=p), support)


def test_min_p_support(row):
    probs = (row / 0.9).softmax(0)
    ids = draw(row.float(), temperature=0.9, min_p=0.2)
    assert_within(ids, min_p_support(probs, 0.2))


def test_per_row_settings_in_one_batch(row):
    """Different top-k/top-p/min-p per row, including rows with everything off."""
    configs = [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.3), dict(), dict(top_k=0, top_p=1.0)]
    reps = 600
    kw = {
        "top_k": [c.get("top_k", 0) for c in configs] * reps,
        "top_p": [c.get("top_p", 1.0) for c in configs] * reps,
        "min_p": [c.get("min_p", 0.0) for c in configs] * reps,
    }
    num = len(configs) * reps
    ids = sampler(
        row.float().expand(num, -1).contiguous(), tensors(40, num, **kw)
    ).sampled_token_ids
    probs = row.softmax(0)
    supports = [top_k_support(probs, 3), top_p_support(probs, 0.5), min_p_support(probs, 0.3)]
    for i, support in enumerate(supports):
        assert_within(ids[i :: len(configs)], support)
    assert ids[3 :: len(configs)].unique().numel() > 15  # unrestricted rows roam


# ---- distributions ----


def small_logits() -> torch.Tensor:
    return torch.tensor([1.0, 0.5, 0.0, -0.3, 0.8, -1.0, 0.2, 0.4])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_frequencies_match_softmax(temperature):
    torch.manual_seed(4)
    logits = small_logits()
    ids = draw(logits, temperature=temperature)
    observed = torch.bincount(ids, minlength=8)
    expected = (logits / temperature).softmax(0).double() * NUM_DRAWS
    assert chi2_pvalue(observed, expected) > 1e-3


def test_frequencies_match_truncated_distribution():
    torch.manual_seed(5)
    logits = small_logits()
    ids = draw(logits, top_k=6, top_p=0.8)
    probs = logits.double().softmax(0)
    keep = top_k_support(probs, 6)
    renorm = torch.where(keep, probs, 0.0) / probs[keep].sum()
    keep &= top_p_support(renorm, 0.8)
    target = torch.where(keep, probs, 0.0) / probs[keep].sum()
    observed = torch.bincount(ids, minlength=8)
    assert observed[~keep].sum() == 0
    assert chi2_pvalue(observed[keep], target[keep] * NUM_DRAWS) > 1e-3


def test_seeded_frequencies_match_softmax():
    """Across many seeds the hash-RNG race still samples from the right distribution."""
    logits = small_logits()
    seeds = list(range(1000, 1000 + NUM_DRAWS))
    t = tensors(8, NUM_DRAWS, seeds=seeds, steps=[3] * NUM_DRAWS)
    ids = sampler(logits.expand(NUM_DRAWS, -1).contiguous(), t).sampled_token_ids
    observed = torch.bincount(ids, minlength=8)
    assert chi2_pvalue(observed, logits.softmax(0).double() * NUM_DRAWS) > 1e-3


# ---- hash RNG ----


def splitmix_reference(seed: int, step: int, col: int) -> int:
    """Pure-Python spec of hash_uniform's 52-bit output (unsigned 64-bit arithmetic)."""

    def mix(z: int) -> int:
        z &= MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    golden = 0x9E3779B97F4A7C15
    key = mix(mix(seed) + (step + 1) * golden)
    return mix(key + (col + 1) * golden) >> 12


def test_hash_rng_matches_unsigned_reference():
    seeds = [0, 1, 42, -1, -(2**63), 2**63 - 1, 123456789123]
    steps = [0, 5, 1, 1000, 7, 2**40, 3]
    u = hash_uniform(torch.tensor(seeds), torch.tensor(steps), 17)
    for i, (seed, step) in enumerate(zip(seeds, steps)):
        for col in range(17):
            expected = (splitmix_reference(seed & MASK64, step, col) + 0.5) * 2.0**-52
            assert u[i, col].item() == expected


def test_mix64_is_a_bijection_on_samples():
    x = torch.arange(-5000, 5000, dtype=torch.int64) * 7919
    assert mix64(x).unique().numel() == x.numel()


def test_hash_uniforms_are_uniform():
    seeds = torch.arange(40, dtype=torch.int64)
    steps = torch.arange(40, dtype=torch.int64) % 4
    u = hash_uniform(seeds, steps, 500).flatten()  # 20,000 values
    assert ((u > 0) & (u < 1)).all()
    observed = torch.histc(u, bins=50, min=0.0, max=1.0)
    assert chi2_pvalue(observed, torch.full((50,), u.numel() / 50)) > 1e-3
    # consecutive columns and consecutive steps are not correlated
    grid = hash_uniform(torch.tensor([7] * 200), torch.arange(200), 100)
    assert (
        abs(torch.corrcoef(torch.stack([grid[:, :-1].flatten(), grid[:, 1:].flatten()]))[0, 1])
        < 0.03
    )
    assert abs(torch.corrcoef(torch.stack([grid[:-1].flatten(), grid[1:].flatten()]))[0, 1]) < 0.03
    e = hash_exponential(seeds, steps, 500)
    assert torch.isfinite(e).all() and (e > 0).all()
    assert e.mean().item() == pytest.approx(1.0, abs=0.03)


# ---- seeds ----


def test_seeded_tokens_independent_of_batch():
    vocab = 1000
    torch.manual_seed(6)
    target_logits = torch.randn(vocab) * 0.1  # near-flat: the token is decided by the noise

    def run(batch_seeds, temperatures, position, global_seed):
        torch.manual_seed(global_seed)
        num = len(batch_seeds)
        logits = torch.randn(num, vocab)
        logits[position] = target_logits
        steps = [9 if i == position else i for i in range(num)]
        t = tensors(
            vocab, num, temperature=temperatures, seeds=batch_seeds, steps=steps, top_p=[0.95] * num
        )
        return sampler(logits, t).sampled_token_ids[position].item()

    alone = run([77], [1.0], 0, global_seed=0)
    crowded = run([None, 5, 77, None, 8, 9], [1.0, 1.0, 1.0, 0.0, 0.5, 1.0], 2, global_seed=1)
    few_seeded = run([None, None, None, 77], [1.0, 0.0, 1.0, 1.0], 3, global_seed=2)
    assert alone == crowded == few_seeded


def test_seeded_is_reproducible_and_seeds_differ():
    vocab = 1000
    logits = torch.zeros(20, vocab)
    seeds = list(range(20))
    first = sampler(logits, tensors(vocab, 20, seeds=seeds)).sampled_token_ids
    torch.manual_seed(123)  # the global generator does not matter to seeded rows
    again = sampler(logits, tensors(vocab, 20, seeds=seeds)).sampled_token_ids
    assert torch.equal(first, again)
    assert first.unique().numel() >= 15  # different seeds give different tokens
    next_step = sampler(logits, tensors(vocab, 20, seeds=seeds, steps=[1] * 20)).sampled_token_ids
    assert (next_step != first).sum() >= 15  # the stream advances with the step


def test_huge_seed_is_accepted():
    t = tensors(10, 2, seeds=[2**80 + 5, -(2**70)])
    ids = sampler(torch.zeros(2, 10), t).sampled_token_ids
    assert ((ids >= 0) & (ids < 10)).all()


# ---- penalties ----


def test_apply_penalties_exact():
    vocab = 6
    pad = vocab
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0], [1.0, 1.0, 1.0, -1.0, -1.0, 0.0]])
    prompt = torch.tensor([[0, 1, pad], [5, pad, pad]])
    output = torch.tensor([[2, 2, 3], [3, 3, pad]])
    rep = torch.tensor([2.0, 1.0])
    pres = torch.tensor([0.5, 0.0])
    freq = torch.tensor([0.25, 1.0])
    out = apply_penalties(logits.clone(), prompt, output, rep, pres, freq)
    expected = torch.tensor(
        [
            # row 0: tokens 0,1 in prompt; 2 (x2) and 3 (x1) in output
            [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.25 * 2 - 0.5, -0.5 * 2 - 0.25 * 1 - 0.5, 3.0, 0.0],
            # row 1: repetition 1 is a no-op; token 3 twice in the output
            [1.0, 1.0, 1.0, -1.0 - 1.0 * 2, -1.0, 0.0],
        ]
    )
    torch.testing.assert_close(out, expected)


def test_penalties_change_sampling():
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]])
    greedy = dict(temperature=[0.0], prompt_token_ids=[[]], output_token_ids=[[]])
    assert sampler(logits, tensors(4, 1, **greedy)).sampled_token_ids.item() == 0
    cases = [
        dict(repetition_penalty=[2.0], prompt_token_ids=[[0]]),  # 5.0 -> 2.5
        dict(frequency_penalty=[0.1], output_token_ids=[[0, 0]]),  # 5.0 -> 4.8
        dict(presence_penalty=[0.2], output_token_ids=[[0]]),  # 5.0 -> 4.8
    ]
    for case in cases:
        t = tensors(4, 1, **{**greedy, **case})
        assert sampler(logits, t).sampled_token_ids.item() == 1, case


# ---- suppression ----


def test_suppressed_tokens_never_sampled():
    torch.manual_seed(7)
    logits = torch.tensor([10.0, 9.0, 0.0, 0.0, 0.0])
    num = 3000
    t = tensors(
        5,
        num,
        temperature=[0.0, 1.0, 1.0] * (num // 3),
        seeds=[None, None, 3] * (num // 3),
        suppressed_token_ids=[[0, 1]] * num,
    )
    ids = sampler(logits.expand(num, -1).contiguous(), t).sampled_token_ids
    assert not ((ids == 0) | (ids == 1)).any()
    assert (ids[0::3] == 2).all()  # greedy picks the best remaining (first of the ties)


def test_engine_builder_min_tokens_and_flags():
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
        SamplingParams(min_tokens=3, ignore_eos=True, seed=5, logprobs=4, top_k=50),
        SamplingParams(min_tokens=1, top_p=0.9, repetition_penalty=1.2),
    ]
    requests = []
    for i, (p, prompt, out) in enumerate(zip(params, [[1, 2], [3], [4, 5, 6]], [[], [9], [8]])):
        req = Request(str(i), prompt, p, eos_token_ids=(0, 2), max_tokens=16, seed=p.seed)
        for tok in out:
            req.append_output_token(tok)
        requests.append(req)
    t = build_sampling_tensors(requests, vocab_size=10, device=torch.device("cpu"))
    assert t.suppressed_token_ids.tolist() == [[7, 0, 2], [10, 10, 10], [10, 10, 10]]
    assert t.steps.tolist() == [0, 1, 1]
    assert t.seeded_rows.tolist() == [1]
    assert t.max_num_logprobs == 4
    assert t.top_k.tolist() == [0, 0, 0]  # top_k >= vocab size is off
    assert (t.all_greedy, t.all_random, t.no_top_k, t.no_top_p, t.no_min_p, t.no_penalties) == (
        False,
        False,
        True,
        False,
        True,
        False,
    )
    assert t.prompt_token_ids.tolist() == [[1, 2, 10], [3, 10, 10], [4, 5, 6]]
    logits = torch.zeros(3, 10)
    logits[:, 0] = 5.0
    assert sampler(logits, t).sampled_token_ids[0].item() != 0


# ---- logprobs ----


def test_logprobs_and_ranks_come_from_raw_logits():
    torch.manual_seed(8)
    logits = torch.randn(6, 30)
    t = tensors(
        30,
        6,
        temperature=[0.0, 0.5, 1.0, 2.0, 1.0, 0.0],
        top_k=[0, 3, 0, 0, 5, 0],
        repetition_penalty=[1.0, 1.5, 1.0, 1.0, 1.0, 3.0],
        output_token_ids=[[1, 2]] * 6,
        suppressed_token_ids=[[], [], [0], [], [], [int(logits[5].argmax())]],
        max_num_logprobs=4,
    )
    out = sampler(logits, t)
    raw = torch.log_softmax(logits, -1)
    ids = out.sampled_token_ids
    torch.testing.assert_close(out.sampled_logprobs, raw.gather(1, ids[:, None]).squeeze(1))
    order = raw.argsort(dim=-1, descending=True)
    expected_ranks = (order == ids[:, None]).float().argmax(-1) + 1
    assert torch.equal(out.sampled_ranks, expected_ranks)
    assert out.sampled_ranks[5].item() > 1  # greedy row whose best token was suppressed
    top_values, top_ids = raw.topk(4, dim=-1)
    assert torch.equal(out.topk_token_ids, top_ids)
    torch.testing.assert_close(out.topk_logprobs, top_values)
    assert out.sampled_logprobs.dtype == out.topk_logprobs.dtype == torch.float32


def test_no_logprobs_requested():
    out = sampler(torch.randn(2, 10), tensors(10, 2))
    assert out.topk_token_ids is None and out.topk_logprobs is None


# ---- GPU ----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_and_never_syncs():
    torch.manual_seed(9)
    logits = torch.randn(64, 5000).bfloat16()
    kw = dict(
        temperature=[0.0, 0.8] * 32,
        top_k=[0, 40] * 32,
        top_p=[0.9] * 64,
        min_p=[0.05] * 64,
        repetition_penalty=[1.2] * 64,
        output_token_ids=[[1, 2, 3]] * 64,
        seeds=list(range(64)),
        suppressed_token_ids=[[4]] * 64,
        max_num_logprobs=5,
    )
    t = tensors(5000, 64, device="cuda", **kw)
    cuda_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device->host sync raises
    try:
        out = sampler(cuda_logits, t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = sampler(logits, tensors(5000, 64, **kw))
    assert torch.equal(out.sampled_token_ids[0::2].cpu(), cpu.sampled_token_ids[0::2])  # greedy
    # seeded rows share the noise; only float rounding at a top-p/min-p edge could differ
    same = (out.sampled_token_ids[1::2].cpu() == cpu.sampled_token_ids[1::2]).float().mean()
    assert same >= 0.9
    assert torch.equal(
        hash_uniform(torch.arange(4).cuda(), torch.arange(4).cuda(), 1000).cpu(),
        hash_uniform(torch.arange(4), torch.arange(4), 1000),
    )


# ---- top-k / top-p without a full-vocabulary sort ----


class SortRecorder(TorchDispatchMode):
    """Records the last-dim sizes that aten sort and topk are asked to order."""

    def __init__(self):
        super().__init__()
        self.sorted_sizes, self.topk_sizes = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "sort":
            self.sorted_sizes.append(args[0].shape[-1])
        elif name == "topk":
            self.topk_sizes.append(args[1])
        return func(*args, **(kwargs or {}))


def tie_heavy_logits(num_reqs: int, vocab_size: int, seed: int) -> torch.Tensor:
    """Logits with many exact ties (bf16 has 8 significant bits, like real bf16 logits)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_reqs, vocab_size, generator=gen) * 2).bfloat16().float()


def mixed_batch(vocab_size: int, seed: int, **kw) -> SamplingTensors:
    """Rows with top-k + top-p, top-k only, and neither (random or greedy), all seeded."""
    top_k = [5, 1, 17, 40, 3, 0, 0, 9, 17, 2]
    top_p = [0.9, 0.5, 0.3, 0.999, 1.0, 1.0, 1.0, 0.05, 0.7, 0.6]
    temperature = [1.0, 0.7, 1.3, 1.0, 0.9, 1.0, 0.0, 2.0, 1.0, 0.5]
    return SamplingTensors.from_lists(
        vocab_size=vocab_size,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seeds=[seed + i for i in range(len(top_k))],
        **kw,
    )


@pytest.mark.parametrize("seed", range(4))
def test_top_p_within_top_k_keeps_the_full_sorts_tokens(seed):
    """Sorting only the [B, max_top_k] candidates drops exactly what the full stable sort drops,
    ties at the k-th value and at the top-p boundary included."""
    vocab_size = 300
    t = mixed_batch(vocab_size, seed)
    assert t.top_p_rows_have_top_k and t.max_top_k == 40
    logits = tie_heavy_logits(len(t.top_k), vocab_size, seed)
    logits[0, :10] = logits[0].max() + 1  # 10 tokens tie for first place under top_k=5
    logits[4, 100:] = float("-inf")  # a row with -inf logits (e.g. suppressed tokens)
    fast = apply_top_k_top_p(logits.clone(), t.top_k, t.top_p, t.max_top_k, True)
    full = _top_k_top_p_sorted(logits.clone(), t.top_k, t.top_p)
    assert torch.equal(fast, full)
    assert torch.equal(fast[5], logits[5]) and torch.equal(fast[6], logits[6])  # rows with neither
    kept = (fast > float("-inf")).sum(dim=-1)
    assert kept[0] == 5 and (kept[:5] <= t.top_k[:5]).all()


@pytest.mark.parametrize("seed", range(3))
def test_sampler_tokens_equal_with_and_without_the_full_sort(seed):
    vocab_size = 300
    t = mixed_batch(vocab_size, seed, max_num_logprobs=2)
    logits = tie_heavy_logits(len(t.top_k), vocab_size, seed + 10)
    fast = sampler(logits, t)
    full = sampler(logits, dataclasses.replace(t, top_p_rows_have_top_k=False))
    assert torch.equal(fast.sampled_token_ids, full.sampled_token_ids)
    assert torch.equal(fast.sampled_logprobs, full.sampled_logprobs)


def test_top_p_without_top_k_on_some_row_still_sorts_everything():
    t = tensors(50, 3, top_k=[4, 0, 0], top_p=[0.8, 0.6, 1.0])
    assert not t.top_p_rows_have_top_k
    recorder = SortRecorder()
    with recorder:
        sampler(torch.randn(3, 50), t)
    assert 50 in recorder.sorted_sizes


@pytest.mark.parametrize("kind", ["greedy", "top_k", "top_k_and_top_p", "mixed_greedy_top_k"])
def test_no_full_vocabulary_sort(kind):
    vocab_size, num_reqs = 500, 4
    settings = {
        "greedy": dict(temperature=[0.0] * num_reqs),
        "top_k": dict(top_k=[3, 8, 0, 1]),
        "top_k_and_top_p": dict(top_k=[3, 8, 0, 20], top_p=[0.5, 0.9, 1.0, 0.8]),
        "mixed_greedy_top_k": dict(
            temperature=[0.0, 1.0, 0.0, 0.8], top_k=[0, 5, 0, 7], top_p=[1.0, 0.5, 1.0, 1.0]
        ),
    }[kind]
    t = tensors(vocab_size, num_reqs, max_num_logprobs=3, **settings)
    recorder = SortRecorder()
    with recorder:
        out = sampler(torch.randn(num_reqs, vocab_size), t)
    assert out.sampled_token_ids.shape == (num_reqs,)
    assert vocab_size not in recorder.sorted_sizes
    assert vocab_size not in recorder.topk_sizes
    assert all(n <= 20 for n in recorder.sorted_sizes + recorder.topk_sizes)
