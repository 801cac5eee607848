"""AsyncLLM: concurrent streams, streamed deltas equal the final text, abort on early exit."""

import asyncio

import pytest

from kvserve.engine import LLM, AsyncLLM, EngineArgs, SamplingParams

PROMPTS = ["Hello café 東京", "The quick brown fox", "Once upon a time", "def add(a, b):"]


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = AsyncLLM(EngineArgs(model=llama_dir, dtype="float32", device="cpu", block_size=4))
    yield eng
    asyncio.run(eng.shutdown())


async def collect(engine, prompt, params, rid):
    deltas, token_deltas, last = [], [], None
    async for out in engine.generate(prompt, params, rid):
        deltas.append(out.outputs[0].delta_text)
        token_deltas.extend(out.outputs[0].delta_token_ids)
        last = out
    return "".join(deltas), token_deltas, last


def test_concurrent_streams_match_offline(engine, llama_dir):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=None)

    async def main():
        return await asyncio.gather(
            *(collect(engine, p, params, f"r{i}") for i, p in enumerate(PROMPTS * 4))
        )

    results = asyncio.run(main())
    offline = LLM(llama_dir, dtype="float32", device="cpu", block_size=4).generate(
        PROMPTS, params, use_tqdm=False
    )
    for i, (text, tokens, last) in enumerate(results):
        ref = offline[i % len(PROMPTS)].outputs[0]
        assert last.finished
        assert text == last.outputs[0].text == ref.text
        assert tokens == last.outputs[0].token_ids == ref.token_ids
        m = last.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    stats = engine.stats()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    assert stats.generation_tokens_total >= 16 * 20


def test_breaking_out_aborts_and_frees_blocks(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        async def partial(i):
            n = 0
            async for _ in engine.generate(PROMPTS[i % 4], params, f"gone{i}"):
                n += 1
                if n == 3:
                    break

        await asyncio.gather(*(partial(i) for i in range(8)))
        for _ in range(100):
            stats = engine.stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                return stats
            await asyncio.sleep(0.05)
        return engine.stats()

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0
    assert engine.is_healthy


def test_bad_input_raises_before_yielding(engine):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate("", SamplingParams(), "bad"):
                pass
        with pytest.raises(ValueError, match="context length"):
            async for _ in engine.generate([1] * 10, SamplingParams(max_tokens=10**5), "bad2"):
                pass

    asyncio.run(main())
    assert engine.is_healthy


def test_n_and_stop_strings_stream(engine):
    async def main():
        ref = await collect(
            engine, PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), "x"
        )
        text = ref[0]
        stop = text[4:7]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], n=2)
        outs = [o async for o in engine.generate(PROMPTS[1], params, "y")]
        return text, stop, outs

    text, stop, outs = asyncio.run(main())
    final = outs[-1]
    for i in range(2):
        streamed = "".join(o.outputs[i].delta_text for o in outs)
        assert streamed == final.outputs[i].text == text[: text.index(stop)]
        assert final.outputs[i].finish_reason == "stop"
