"""Encoder-decoder generation speed: kvserve's engine against transformers' `generate` (static
batches) and CTranslate2, on a random checkpoint shaped like Marian opus-mt (6 + 6 layers,
d_model 512, 8 heads, FFN 2048, vocabulary 58,101) or T5-base (12 + 12 layers, d_model 768, 12
heads, FFN 3072, vocabulary 32,128, relative position bias), greedy or beam search, every output
forced to its length.

    python -m benchmarks.bench_seq2seq --batch-sizes 1 64 --num-prompts 64 --ct2 /tmp/ct2pkg
    python -m benchmarks.bench_seq2seq --shape t5-base --beam 4 --batch-sizes 64
    python -m benchmarks.bench_seq2seq --device cuda --kvserve-dtypes bfloat16 --transformers-dtypes bfloat16

Sources are random token ids of 32-128 tokens (seeded); each target is round(1.2 x its source)
tokens (EOS ignored). Batch 1 runs the sources one at a time; batch B hands B at a time to each
system (kvserve: B requests submitted together, continuous batching; transformers: padded static
batches; CTranslate2: `translate_batch` with that many). With `--beam W` every system keeps W
beams per source and, as a static batch must, runs each batch of sources to its longest target
(so every system makes the same number of tokens). Reported: generated tokens per second (of the
best hypothesis). `--ct2 DIR` puts a `pip install --target DIR ctranslate2` on the path (it is not
a dependency). `--kvserve-quantization int8` adds kvserve with int8 weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

MARIAN_SHAPE = dict(
    vocab_size=58101,
    d_model=512,
    encoder_layers=6,
    decoder_layers=6,
    encoder_attention_heads=8,
    decoder_attention_heads=8,
    encoder_ffn_dim=2048,
    decoder_ffn_dim=2048,
    max_position_embeddings=512,
    activation_function="swish",
    scale_embedding=True,
)
T5_BASE_SHAPE = dict(
    vocab_size=32128,
    d_model=768,
    d_kv=64,
    d_ff=3072,
    num_layers=12,
    num_heads=12,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="relu",
    tie_word_embeddings=True,
)


def model_config(shape: str) -> transformers.PretrainedConfig:
    if shape == "marian":
        vocab = MARIAN_SHAPE["vocab_size"]
        return transformers.MarianConfig(
            **MARIAN_SHAPE,
            pad_token_id=vocab - 1,
            decoder_start_token_id=vocab - 1,
            eos_token_id=0,
            bos_token_id=None,
            forced_eos_token_id=None,
        )
    # T5's pad and decoder start are id 0, EOS id 1; `<pad>` is made the last id below, so 0 and 1
    # are ordinary tokens of the tokenizer: harmless, prompts are token ids and EOS is ignored
    return transformers.T5Config(
        **T5_BASE_SHAPE, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0
    )


def build_checkpoint(path: Path, shape: str = "marian") -> Path:
    """A random checkpoint of `shape`. Its tokenizer is the default model's grown to the
    vocabulary's size with placeholder tokens, `<pad>` last (prompts are token ids; CTranslate2's
    converter wants a vocabulary as large as the embeddings)."""
    if (path / "config.json").exists():
        return path
    from kvserve.models import ensure_default_model

    config = model_config(shape)
    vocab = config.vocab_size
    torch.manual_seed(0)
    transformers.AutoModelForSeq2SeqLM.from_config(config).save_pretrained(path)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(ensure_default_model())
    tokenizer.add_tokens([f"<x{i}>" for i in range(len(tokenizer), vocab - 1)])
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    assert len(tokenizer) == vocab, len(tokenizer)
    tokenizer.save_pretrained(path)
    return path


def workload(
    num: int, seed: int, vocab: int = MARIAN_SHAPE["vocab_size"]
) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(32, 129, size=num)
    sources = [rng.integers(2, vocab - 1, size=n).tolist() for n in lengths]
    return sources, [round(1.2 * n) for n in lengths]


def batches(sources, targets, batch: int, beam: int):
    """(sources, target lengths) per batch; with beams, each batch's longest target for all."""
    for i in range(0, len(sources), batch):
        lens = targets[i : i + batch]
        yield sources[i : i + batch], lens if beam == 1 else [max(lens)] * len(lens)


def run_kvserve(
    path: Path,
    sources,
    targets,
    batch: int,
    dtype: str,
    beam: int = 1,
    quantization: str | None = None,
    device: str = "cpu",
) -> float:
    from kvserve.engine import LLM, BeamSearchParams, SamplingParams
    from kvserve.engine.worker.kv_pool import prefault

    llm = LLM(
        str(path),
        dtype=dtype,
        device=device,
        max_num_seqs=max(batch * beam, 1),
        quantization=quantization,
    )
    llm.generate(
        [{"prompt_token_ids": sources[0]}],
        SamplingParams(max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    if device == "cpu":  # as the server does once it is up: no first-touch page faults timed
        prefault(llm.engine.runner.attn_layers)
    start = time.perf_counter()
    for chunk, lens in batches(sources, targets, batch, beam):
        prompts = [{"prompt_token_ids": s} for s in chunk]
        if beam > 1:
            llm.beam_search(
                prompts, BeamSearchParams(beam_width=beam, max_tokens=lens[0], ignore_eos=True)
            )
        else:
            params = [SamplingParams(max_tokens=t, temperature=0.0, ignore_eos=True) for t in lens]
            llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def run_transformers(
    path: Path,
    sources,
    targets,
    batch: int,
    beam: int = 1,
    dtype: str = "float32",
    device: str = "cpu",
) -> float:
    model = (
        transformers.AutoModelForSeq2SeqLM.from_pretrained(path, dtype=getattr(torch, dtype))
        .to(device)
        .eval()
    )
    pad = model.config.pad_token_id
    start = time.perf_counter()
    with torch.inference_mode():
        for chunk, lens in batches(sources, targets, batch, beam):
            width = max(map(len, chunk))
            ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk])
            # a static batch runs to its longest target (shorter outputs are cut afterwards)
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                do_sample=False,
                num_beams=beam,
                early_stopping=False,
            )
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_ct2(
    path: Path, sources, targets, batch: int, compute_type: str, work: Path, beam: int = 1
) -> float:
    import ctranslate2

    out = work / f"ct2-{path.name}"
    if not (out / "model.bin").exists():
        ctranslate2.converters.TransformersConverter(str(path)).convert(str(out), force=True)
        config = json.loads((out / "config.json").read_text())
        config["unk_token"] = config["unk_token"] or config["eos_token"]  # (the tokenizer has none)
        (out / "config.json").write_text(json.dumps(config))
    vocab = json.loads((out / "shared_vocabulary.json").read_text())
    translator = ctranslate2.Translator(
        str(out),
        device="cpu",
        compute_type=compute_type,
        inter_threads=1,
        intra_threads=torch.get_num_threads(),
    )
    tokens = [[vocab[t] for t in s] for s in sources]
    start = time.perf_counter()
    for chunk, lens in batches(tokens, targets, batch, beam):
        translator.translate_batch(
            chunk,
            max_batch_size=batch,
            beam_size=beam,
            max_decoding_length=max(lens),
            min_decoding_length=max(lens),
        )
    return time.perf_counter() - start


def write(args: argparse.Namespace, results: list[dict]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "shape": args.shape,
                "beam": args.beam,
                "num_prompts": args.num_prompts,
                "device": args.device,
                "threads": torch.get_num_threads(),
                "results": results,
            },
            indent=1,
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["marian", "t5-base"], default="marian")
    parser.add_argument("--beam", type=int, default=1, help="beam width (1: greedy)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", default="cpu", help="cpu or cuda (kvserve, transformers; CTranslate2: cpu)"
    )
    parser.add_argument(
        "--checkpoint", type=Path, help="default: loadtest_out/models/<shape>-shape-random"
    )
    parser.add_argument(
        "--ct2", type=Path, help="folder with ctranslate2 installed (pip install --target)"
    )
    parser.add_argument("--ct2-compute-types", nargs="+", default=["float32", "int8"])
    parser.add_argument("--kvserve-dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--transformers-dtypes", nargs="+", default=["float32"])
    parser.add_argument(
        "--kvserve-quantization",
        nargs="*",
        default=[],
        help="also run kvserve in bfloat16 with these weight formats (int8, int4)",
    )
    parser.add_argument("--skip", nargs="*", default=[], choices=["transformers", "ctranslate2"])
    parser.add_argument("--out", type=Path, default=Path("bench_out/seq2seq.json"))
    args = parser.parse_args(argv)
    if args.ct2:
        sys.path.insert(0, str(args.ct2))
    checkpoint = args.checkpoint or Path(f"loadtest_out/models/{args.shape}-shape-random")
    path = build_checkpoint(checkpoint, args.shape)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    sources, targets = workload(args.num_prompts, args.seed, vocab)
    results = []
    for batch in args.batch_sizes:
        total = sum(sum(lens) for _, lens in batches(sources, targets, batch, args.beam))
        runs = [
            (
                f"kvserve {d}",
                lambda d=d: run_kvserve(
                    path, sources, targets, batch, d, args.beam, device=args.device
                ),
            )
            for d in args.kvserve_dtypes
        ]
        runs += [
            (
                f"kvserve bfloat16 {q}",
                lambda q=q: run_kvserve(
                    path, sources, targets, batch, "bfloat16", args.beam, q, args.device
                ),
            )
            for q in args.kvserve_quantization
        ]
        if "transformers" not in args.skip:
            runs += [
                (
                    f"transformers {d}",
                    lambda d=d: run_transformers(
                        path, sources, targets, batch, args.beam, d, args.device
                    ),
                )
                for d in args.transformers_dtypes
            ]
        if args.ct2 and "ctranslate2" not in args.skip:
            runs += [
                (
                    f"ctranslate2 {c}",
                    lambda c=c: run_ct2(
                        path, sources, targets, batch, c, checkpoint.parent, args.beam
                    ),
                )
                for c in args.ct2_compute_types
            ]
        for name, run in runs:
            seconds = run()
            results.append(
                {
                    "system": name,
                    "batch": batch,
                    "seconds": seconds,
                    "tokens_per_s": total / seconds,
                }
            )
            print(
                f"{args.shape} beam {args.beam} batch {batch:3d}  {name:26s} {total / seconds:8.1f} tok/s  "
                f"({seconds:.1f} s)",
                flush=True,
            )
            write(args, results)  # after every row: a run cut short keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
