"""Micro-benchmarks of kvserve's CPU kernels on SmolLM-135M shapes (no model, no engine).

    python -m loadtest.bench_kernels [--rows 1,16,64,256,2048] [--contexts 192,512] [--threads 2]

linear: the 30 layers' q/k/v, o, gate/up and down matrices (and the tied LM head) at each row
count, kvserve's `linear_bf16` on its packed weights vs oneDNN's packed bf16 linear, weights
on huge pages as in the engine; best of 3 passes over all layers (GFLOP/s).
attention: `paged_decode_attention` at batch 64 over 30 layers' KV caches laid out like the
engine's (prompt blocks contiguous, decode blocks interleaved across requests): "cold" walks
the layers in turn, so every call reads its 9+ MB from DRAM as in a decode step; "warm"
repeats one layer. For scale, a gather copy of the same blocks (index_select).
Prints one line per measurement; numbers move 10-20% between runs on a shared VM.
"""

from __future__ import annotations

import argparse
import time

import torch

from models import cpu_ops, hugepages

SMOLLM_LINEARS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK = 30, 3, 9, 64, 16


def best_of(fn, passes: int = 3) -> float:
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_linear(rows: int) -> None:
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    shapes = dict(SMOLLM_LINEARS, lm_head=(49152, 576))
    for name, (n, k) in shapes.items():
        layers = 1 if name == "lm_head" else LAYERS
        weights = [torch.randn(n, k).bfloat16() * 0.05 for _ in range(layers)]
        ours = hugepages.arena([cpu_ops.packed_linear_shape(w.shape) for w in weights], torch.bfloat16)
        for slot, w in zip(ours, weights):
            slot.copy_(cpu_ops.pack_linear_weight(w))
        x = torch.randn(rows, k).bfloat16()
        flops = 2 * rows * n * k * layers
        t_ours = best_of(lambda: [cpu_ops.linear_bf16(x, w, None, n) for w in ours])
        line = f"linear {name:8s} rows {rows:5d}: kvserve {t_ours * 1e3:8.2f} ms ({flops / t_ours / 1e9:4.0f} GFLOP/s)"
        if reorder is not None:
            onednn = [reorder(w, None) for w in weights]
            t_dnn = best_of(lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")
                                     for w in onednn])
            line += f"  oneDNN {t_dnn * 1e3:8.2f} ms ({flops / t_dnn / 1e9:4.0f} GFLOP/s)"
        print(line, flush=True)


def bench_decode_attention(context: int, batch: int = 64) -> None:
    num_blocks = batch * (-(-context // BLOCK)) + 1
    caches = [hugepages.empty((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), torch.bfloat16).normal_()
              for _ in range(LAYERS)]
    per_req = -(-context // BLOCK)
    prompt_blocks = min(per_req, 8)  # a 128-token prompt's blocks, allocated together
    table = torch.zeros(batch, per_req, dtype=torch.long)
    for i in range(batch):
        for j in range(per_req):
            table[i, j] = 1 + prompt_blocks * i + j if j < prompt_blocks \
                else 1 + prompt_blocks * batch + i + batch * (j - prompt_blocks)
    seq_lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()

    def attend(layer: int) -> None:
        cpu_ops.paged_decode_attention(q, caches[layer][0], caches[layer][1], table, seq_lens, 0.125, None)

    attend(0)
    mb = batch * context * KV_HEADS * HEAD_DIM * 2 * 2 / 1e6
    cold = best_of(lambda: [attend(layer) for layer in range(LAYERS)]) / LAYERS
    warm = best_of(lambda: [attend(0) for _ in range(LAYERS)]) / LAYERS
    ids = table.flatten()
    gather = best_of(lambda: [(c[0].index_select(0, ids), c[1].index_select(0, ids)) for c in caches]) / LAYERS
    print(f"decode attention batch {batch} context {context} ({mb:.1f} MB of KV per layer): "
          f"cold {cold * 1e3:.3f} ms/layer ({mb / cold / 1e3:.1f} GB/s), warm {warm * 1e3:.3f} ms/layer; "
          f"gather copy {gather * 1e3:.3f} ms/layer", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64,256,2048")
    parser.add_argument("--contexts", default="192,512")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_ops.has_fast_bf16():
        print("kvserve's AVX512-BF16 kernels are not available on this machine; nothing to measure")
        return 1
    for rows in (int(r) for r in args.rows.split(",") if r):
        bench_linear(rows)
    for context in (int(c) for c in args.contexts.split(",") if c):
        bench_decode_attention(context)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
