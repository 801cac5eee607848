"""Triton batched LoRA (models/kernels/triton_lora.py) under the interpreter, against the torch reference."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (the kernels run on the CPU)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvserve.engine.worker.lora import group_tokens  # noqa: E402
from kvserve.models.kernels import triton_lora  # noqa: E402
from kvserve.models.lora import lora_apply_torch  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_expand_match_the_torch_reference(dtype, monkeypatch):
    monkeypatch.setattr(triton_lora, "BLOCK_N", 16)
    monkeypatch.setattr(triton_lora, "BLOCK_K", 16)
    g = torch.Generator().manual_seed(0)
    num_slots, width, d_in, d_out = 3, 24, 40, 56  # widths not multiples of the tiles: masks
    a = torch.randn(num_slots, width, d_in, generator=g).to(dtype)
    b = torch.randn(num_slots, d_out, width, generator=g).to(dtype)
    query_lens = np.array([5, 1, 19, 1, 3])
    row_slots = np.array([2, -1, 0, 2, -1])  # two base rows, slot 1 unused, slot 2 twice
    meta = group_tokens(row_slots, query_lens, torch.device("cpu"))
    x = torch.randn(int(query_lens.sum()), d_in, generator=g).to(dtype)
    base = torch.randn(x.shape[0], d_out, generator=g).to(dtype)
    want = lora_apply_torch(base.clone(), x, a, b, meta)
    got = triton_lora.lora_apply_triton(base.clone(), x, a, b, meta)
    is_base = torch.from_numpy(np.repeat(row_slots, query_lens) < 0)
    assert torch.equal(got[is_base], base[is_base])  # base tokens untouched
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # the reference rounds each adapter's product to bf16 before adding it: a few ulps apart
        assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()


def test_engine_with_triton_backend_matches_merged_peft(tmp_path):
    """The runner picks the Triton pair with the Triton attention backend; outputs equal PEFT's merged model."""
    pytest.importorskip("peft")
    from kvserve.engine import LLM
    from kvserve.engine.lora_request import LoRARequest
    from kvserve.models.kernels.triton_lora import lora_apply_triton
    from tests.checkpoints import make_checkpoint
    from tests.test_lora import ALL_TARGETS, greedy, make_adapter, reference_greedy

    base = make_checkpoint(tmp_path / "base", "llama")
    adapter = make_adapter(base, tmp_path / "a", 8, seed=1, targets=ALL_TARGETS)
    llm = LLM(
        base,
        dtype="float32",
        device="cpu",
        block_size=4,
        attention_backend="triton",
        enable_lora=True,
        max_lora_rank=8,
    )
    assert next(iter(llm.engine.runner.lora.wrappers.values())).kernel is lora_apply_triton
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    outs = llm.generate(
        prompts, greedy(), use_tqdm=False, lora_request=[LoRARequest("a", 1, adapter), None]
    )
    for prompt, path, out in zip(prompts, [adapter, None], outs):
        tokens, logprobs, trusted = reference_greedy(base, path, tuple(prompt))
        assert trusted >= 4 and out.outputs[0].token_ids[:trusted] == tokens[:trusted]
        for step in range(trusted):
            for token_id, lp in out.outputs[0].logprobs[step].items():
                assert lp.logprob == pytest.approx(logprobs[step, token_id].item(), abs=1e-4)
