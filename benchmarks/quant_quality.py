"""Quantization quality: next-token KL divergence of int8 / int4 models from the unquantized one.

    python -m benchmarks.quant_quality --model loadtest_out/models/smollm-135m-random \\
        --text models/default_corpus.txt --ctx 512 --methods int8,int4

What llama.cpp's `llama-perplexity --kl-divergence` measures, on kvserve's models: the text is
tokenized once (the checkpoint's tokenizer) and cut into chunks of --ctx tokens; each chunk runs
as one sequence, and the second half of its positions is scored (the first half is context).
For each method: mean and 99th-percentile KL(P_unquantized || P_quantized), the share of positions
whose top token is the same, and both perplexities. The reference is the checkpoint held in
--dtype (bf16); a GGUF --model is read as its own values. Prints a table; writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvserve.engine.input_processor import load_tokenizer
from kvserve.models.attention import Attention, AttentionMetadata, forward_context
from kvserve.models.hf_config import load_hf_config
from kvserve.models.loader import load_model, resolve_model_path


def chunk_logits(model: torch.nn.Module, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Log-probabilities [len(ids), vocab] of one sequence run as a single prefill."""
    n, layers = len(ids), [m for m in model.modules() if isinstance(m, Attention)]
    num_blocks = -(-n // block_size)
    dtype = next(p for p in model.parameters() if p.is_floating_point() and p.numel()).dtype
    for layer in layers:
        layer.kv_cache = torch.zeros(
            2, num_blocks + 1, block_size, layer.num_kv_heads, layer.head_dim, dtype=dtype
        )
    index = layers[0].backend.index_dtype
    table = list(range(1, num_blocks + 1))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(n)], dtype=index
        ),
        positions=torch.arange(n),
        cu_seqlens_q=torch.tensor([0, n], dtype=index),
        seq_lens=torch.tensor([n], dtype=index),
        block_table=torch.tensor([table + [0]], dtype=index),
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
        block_size=block_size,
        max_query_len=n,
        max_seq_len=n,
    )
    with torch.inference_mode(), forward_context(meta):
        hidden = model(torch.tensor(ids), torch.arange(n))
        return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.quant_quality", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", required=True, help="checkpoint directory or GGUF file")
    p.add_argument(
        "--text", default=str(Path(__file__).parent.parent / "models" / "default_corpus.txt")
    )
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--max-chunks", type=int, default=0, help="0: every whole chunk of the text")
    p.add_argument("--methods", default="int8,int4")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--out")
    args = p.parse_args(argv)
    path = resolve_model_path(args.model)
    config, dtype = load_hf_config(path), getattr(torch, args.dtype)
    ids = load_tokenizer(path).encode(Path(args.text).read_text())
    chunks = [ids[i : i + args.ctx] for i in range(0, len(ids) - args.ctx + 1, args.ctx)]
    chunks = chunks[: args.max_chunks] if args.max_chunks else chunks
    if not chunks:
        p.error(f"the text has {len(ids)} tokens, fewer than --ctx {args.ctx}")
    first = args.ctx // 2

    def scored(model) -> list[torch.Tensor]:
        return [chunk_logits(model, c)[first:-1] for c in chunks]

    def nll(logprobs: list[torch.Tensor]) -> float:
        targets = torch.cat([torch.tensor(c[first + 1 :]) for c in chunks])
        return -torch.cat(logprobs).gather(1, targets[:, None]).mean().item()

    base = scored(load_model(path, config, dtype, "cpu", quantization="none"))
    results = {
        "model": args.model,
        "tokens_scored": sum(len(b) for b in base),
        "chunks": len(chunks),
        "ctx": args.ctx,
        "ppl_none": float(torch.tensor(nll(base)).exp()),
        "methods": {},
    }
    for method in args.methods.split(","):
        quant = scored(load_model(path, config, dtype, "cpu", quantization=method))
        kl = torch.cat([(b.exp() * (b - q)).sum(-1) for b, q in zip(base, quant)])
        same = (
            torch.cat([b.argmax(-1) == q.argmax(-1) for b, q in zip(base, quant)])
            .float()
            .mean()
            .item()
        )
        results["methods"][method] = {
            "kl_mean": kl.mean().item(),
            "kl_p99": kl.quantile(0.99).item(),
            "same_top1": same,
            "ppl": float(torch.tensor(nll(quant)).exp()),
        }
    print(
        f"{results['tokens_scored']} positions scored ({len(chunks)} chunks of {args.ctx}); "
        f"PPL unquantized {results['ppl_none']:.3f}"
    )
    print("| method | mean KL | KL p99 | same top-1 | PPL |\n| --- | --- | --- | --- | --- |")
    for method, r in results["methods"].items():
        print(
            f"| {method} | {r['kl_mean']:.6f} | {r['kl_p99']:.6f} | {100 * r['same_top1']:.2f}% | {r['ppl']:.3f} |"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
