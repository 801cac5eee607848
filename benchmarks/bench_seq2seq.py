"""Encoder-decoder generation speed: kvserve's engine against transformers' `generate` (static
batches) and CTranslate2, on one random checkpoint shaped like Marian opus-mt (6 + 6 layers,
d_model 512, 8 heads, FFN 2048, vocabulary 58,101), greedy, every output forced to its length.

    python -m benchmarks.bench_seq2seq --batch-sizes 1 64 --num-prompts 64 --ct2 /tmp/ct2pkg

Sources are random token ids of 32-128 tokens (seeded); each target is round(1.2 x its source)
tokens (EOS ignored). Batch 1 runs the sources one at a time; batch B hands B at a time to each
system (kvserve: B requests submitted together, continuous batching; transformers: padded static
batches; CTranslate2: `translate_batch` with that many). Reported: generated tokens per second.
`--ct2 DIR` puts a `pip install --target DIR ctranslate2` on the path (it is not a dependency).
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

MARIAN_SHAPE = dict(vocab_size=58101, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                    decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                    max_position_embeddings=512, activation_function="swish", scale_embedding=True)


def build_checkpoint(path: Path) -> Path:
    """A random Marian-shaped checkpoint. Its tokenizer is the default model's grown to the
    vocabulary's size with placeholder tokens, `<pad>` last (prompts are token ids; CTranslate2's
    converter wants a vocabulary as large as the embeddings)."""
    if (path / "config.json").exists():
        return path
    from kvserve.models import ensure_default_model

    vocab = MARIAN_SHAPE["vocab_size"]
    config = transformers.MarianConfig(**MARIAN_SHAPE, pad_token_id=vocab - 1, decoder_start_token_id=vocab - 1,
                                       eos_token_id=0, bos_token_id=None, forced_eos_token_id=None)
    torch.manual_seed(0)
    transformers.MarianMTModel(config).save_pretrained(path)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(ensure_default_model())
    tokenizer.add_tokens([f"<x{i}>" for i in range(len(tokenizer), vocab - 1)])
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    assert len(tokenizer) == vocab, len(tokenizer)
    tokenizer.save_pretrained(path)
    return path


def workload(num: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(32, 129, size=num)
    sources = [rng.integers(1, MARIAN_SHAPE["vocab_size"] - 1, size=n).tolist() for n in lengths]
    return sources, [round(1.2 * n) for n in lengths]


def run_kvserve(path: Path, sources, targets, batch: int, dtype: str) -> float:
    from kvserve.engine import LLM, SamplingParams

    llm = LLM(str(path), dtype=dtype, device="cpu", max_num_seqs=max(batch, 1))
    llm.generate([{"prompt_token_ids": sources[0]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    for i in range(0, len(sources), batch):
        prompts = [{"prompt_token_ids": s} for s in sources[i:i + batch]]
        params = [SamplingParams(max_tokens=t, temperature=0.0, ignore_eos=True) for t in targets[i:i + batch]]
        llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def run_transformers(path: Path, sources, targets, batch: int) -> float:
    model = transformers.MarianMTModel.from_pretrained(path, dtype=torch.float32).eval()
    pad = model.config.pad_token_id
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(sources), batch):
            chunk, lens = sources[i:i + batch], targets[i:i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk])
            mask = (ids != pad).long()
            # a static batch runs to its longest target (shorter outputs are cut afterwards)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, num_beams=1)
    return time.perf_counter() - start


def run_ct2(path: Path, sources, targets, batch: int, compute_type: str, work: Path) -> float:
    import ctranslate2

    out = work / "ct2-marian"
    if not (out / "model.bin").exists():
        ctranslate2.converters.TransformersConverter(str(path)).convert(str(out), force=True)
        config = json.loads((out / "config.json").read_text())
        config["unk_token"] = config["unk_token"] or config["eos_token"]  # (the tokenizer has none)
        (out / "config.json").write_text(json.dumps(config))
    vocab = json.loads((out / "shared_vocabulary.json").read_text()) if (out / "shared_vocabulary.json").exists() \
        else None
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type=compute_type, inter_threads=1,
                                        intra_threads=torch.get_num_threads())
    tokens = [[vocab[t] for t in s] for s in sources]
    start = time.perf_counter()
    for i in range(0, len(tokens), batch):
        lens = targets[i:i + batch]
        translator.translate_batch(tokens[i:i + batch], max_batch_size=batch, beam_size=1,
                                   max_decoding_length=max(lens), min_decoding_length=max(lens))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", type=Path, default=Path("loadtest_out/models/marian-shape-random"))
    parser.add_argument("--ct2", type=Path, help="folder with ctranslate2 installed (pip install --target)")
    parser.add_argument("--ct2-compute-types", nargs="+", default=["float32", "int8"])
    parser.add_argument("--kvserve-dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=Path("bench_out/seq2seq.json"))
    args = parser.parse_args(argv)
    if args.ct2:
        sys.path.insert(0, str(args.ct2))
    path = build_checkpoint(args.checkpoint)
    sources, targets = workload(args.num_prompts, args.seed)
    total = sum(targets)
    results = []
    for batch in args.batch_sizes:
        runs = [(f"kvserve {d}", lambda d=d: run_kvserve(path, sources, targets, batch, d))
                for d in args.kvserve_dtypes]
        runs.append(("transformers float32", lambda: run_transformers(path, sources, targets, batch)))
        if args.ct2:
            runs += [(f"ctranslate2 {c}", lambda c=c: run_ct2(path, sources, targets, batch, c, args.checkpoint.parent))
                     for c in args.ct2_compute_types]
        for name, run in runs:
            seconds = run()
            results.append({"system": name, "batch": batch, "seconds": seconds, "tokens_per_s": total / seconds})
            print(f"batch {batch:3d}  {name:24s} {total / seconds:8.1f} tok/s  ({seconds:.1f} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"num_prompts": args.num_prompts, "generated_tokens": total,
                                    "threads": torch.get_num_threads(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
