"""The encoder-decoder model files (models/bart.py, models/t5.py) against transformers: logits
for a source and a target prefix, and greedy decoding, in float32 on tiny random checkpoints
loaded through kvserve's own weight loader."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvserve.models.bart import (
    BartForConditionalGeneration,
    MarianMTModel,
    MBartForConditionalGeneration,
    sinusoidal_positions,
)
from kvserve.models.loader import load_weights
from kvserve.models.t5 import T5ForConditionalGeneration, relative_position_bucket

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, d_model=32, max_position_embeddings=64)
BART = dict(
    **SMALL,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    bos_token_id=0,
    pad_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=2,
    forced_eos_token_id=None,
    forced_bos_token_id=None,
)
CONFIGS = {
    "bart": (transformers.BartConfig, BART, BartForConditionalGeneration),
    "mbart": (
        transformers.MBartConfig,
        {**BART, "scale_embedding": True},
        MBartForConditionalGeneration,
    ),
    "marian": (
        transformers.MarianConfig,
        {
            **BART,
            "activation_function": "swish",
            "pad_token_id": VOCAB - 1,
            "decoder_start_token_id": VOCAB - 1,
            "eos_token_id": 0,
            "scale_embedding": True,
        },
        MarianMTModel,
    ),
    "t5": (
        transformers.T5Config,
        dict(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=20,
            feed_forward_proj="relu",
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        ),
        T5ForConditionalGeneration,
    ),
    "t5-v1.1": (
        transformers.T5Config,
        dict(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=3,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=20,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        ),
        T5ForConditionalGeneration,
    ),
}


def random_checkpoint(family: str, path, **overrides):
    """A transformers model of `family` with random weights, saved to `path`; returns it."""
    config_cls, kwargs, ours_cls = CONFIGS[family]
    config = config_cls(**{**kwargs, **overrides})
    config.architectures = [ours_cls.__name__]
    torch.manual_seed(0)
    hf = transformers.AutoModelForSeq2SeqLM.from_config(config).eval()
    # peaked distributions, so that greedy decoding is not decided by noise (less for T5, whose
    # attention scores are not scaled: float32 rounding grows with their size)
    scale = 2.0 if family.startswith("t5") else 4.0
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() == 2 and "embed_positions" not in name:  # (Marian's are a fixed table)
                param.mul_(scale)
            elif "bias" in name:
                param.normal_(0.0, 0.2)
        if hasattr(hf, "final_logits_bias"):
            hf.final_logits_bias.normal_(0.0, 1.0)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, kvserve model) of one family with the same random weights."""
    path = tmp_path_factory.mktemp(request.param)
    hf = random_checkpoint(request.param, path)
    ours = CONFIGS[request.param][2](transformers.AutoConfig.from_pretrained(path))
    load_weights(ours, path)  # (final_logits_bias, a buffer, included)
    return request.param, hf, ours.eval()


def test_logits_equal_transformers(pair):
    family, hf, ours = pair
    generator = torch.Generator().manual_seed(1)
    for source_len, target_len in [(7, 1), (13, 5), (1, 9), (40, 30)]:
        source = torch.randint(3, VOCAB - 1, (source_len,), generator=generator)
        target = torch.randint(3, VOCAB - 1, (target_len,), generator=generator)
        target[0] = hf.config.decoder_start_token_id
        with torch.no_grad():
            expected = hf(input_ids=source[None], decoder_input_ids=target[None]).logits[0]
            got = ours.compute_logits(ours.decode(target, ours.encode(source)))
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() <= 1e-5 * max(scale, 1.0), (
            family,
            source_len,
            target_len,
            (got - expected).abs().max(),
            scale,
        )


def greedy(model, source: torch.Tensor, start: int, eos: int, max_new: int) -> list[int]:
    target = [start]
    with torch.no_grad():
        encoder_out = model.encode(source)
        for _ in range(max_new):
            logits = model.compute_logits(model.decode(torch.tensor(target), encoder_out)[-1:])
            target.append(int(logits.argmax()))
            if target[-1] == eos:
                break
    return target[1:]


def test_greedy_equals_generate(pair):
    family, hf, ours = pair
    generator = torch.Generator().manual_seed(2)
    for source_len in (5, 17):
        source = torch.randint(3, VOCAB - 1, (source_len,), generator=generator)
        # (use_cache=False: transformers' cache assumes as many decoder layers as encoder layers)
        expected = hf.generate(
            source[None], max_new_tokens=12, do_sample=False, num_beams=1, use_cache=False
        )[0, 1:].tolist()
        eos = hf.generation_config.eos_token_id
        got = greedy(ours, source, hf.config.decoder_start_token_id, eos, 12)
        assert got == expected[: len(got)] and (len(got) == 12 or got[-1] == eos), (
            family,
            got,
            expected,
        )


def test_relative_position_buckets_equal_transformers():
    relative = torch.arange(-150, 150)[None, :] - torch.arange(0, 40)[:, None]
    for bidirectional in (True, False):
        for buckets, distance in [(32, 128), (8, 20)]:
            expected = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
                relative, bidirectional=bidirectional, num_buckets=buckets, max_distance=distance
            )
            assert torch.equal(
                relative_position_bucket(relative, bidirectional, buckets, distance), expected
            )


def test_sinusoidal_table_equals_marians():
    for dim in (32, 33):
        marian = transformers.models.marian.modeling_marian
        expected = marian.MarianSinusoidalPositionalEmbedding(50, dim).create_weight()
        torch.testing.assert_close(sinusoidal_positions(50, dim), expected, atol=1e-6, rtol=0)
