"""Micro-benchmarks of kvserve's kernels (no model, no engine): the CPU kernels on SmolLM-135M
shapes, and with `--device cuda` the GPU's elementwise ops at Llama-8B sizes.

    python -m benchmarks.bench_kernels [--rows 1,16,64,256,2048] [--contexts 192,512] [--threads 2]

linear: the 30 layers' q/k/v, o, gate/up and down matrices (and the tied LM head) at each row
count, kvserve's `linear_bf16` on its packed weights vs oneDNN's packed bf16 linear, weights
on huge pages as in the engine; best of 3 passes over all layers (GFLOP/s).
attention: `paged_decode_attention` at batch 64 over 30 layers' KV caches laid out like the
engine's (prompt blocks contiguous, decode blocks interleaved across requests): "cold" walks
the layers in turn, so every call reads its 9+ MB from DRAM as in a decode step; "warm"
repeats one layer. For scale, a gather copy of the same blocks (index_select).
Prints one line per measurement; numbers move 10-20% between runs on a shared VM.

    python -m benchmarks.bench_kernels --device cuda [--rows 1,64,2048] [--impls eager,compile,triton]

On a GPU: add + RMSNorm (hidden 4096) and SiLU * up (intermediate 14336), Llama-8B's sizes in
bf16, per call (median of 5 CUDA-event timings of 50 calls each; `--cuda-graphs`: replayed
from a CUDA graph, i.e. without launch overhead, as decode steps run) for PyTorch eager
(models/fused_ops.py), the same functions under torch.compile, and the Triton kernels
(models/kernels/triton_ops.py); GB/s counts each call's HBM reads and writes once.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from kvserve.models import cpu_ops, hugepages

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
        ours = hugepages.arena(
            [cpu_ops.packed_linear_shape(w.shape) for w in weights], torch.bfloat16
        )
        for slot, w in zip(ours, weights):
            slot.copy_(cpu_ops.pack_linear_weight(w))
        x = torch.randn(rows, k).bfloat16()
        flops = 2 * rows * n * k * layers
        t_ours = best_of(lambda: [cpu_ops.linear_bf16(x, w, None, n) for w in ours])
        line = f"linear {name:8s} rows {rows:5d}: kvserve {t_ours * 1e3:8.2f} ms ({flops / t_ours / 1e9:4.0f} GFLOP/s)"
        if reorder is not None:
            onednn = [reorder(w, None) for w in weights]
            t_dnn = best_of(
                lambda: [
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")
                    for w in onednn
                ]
            )
            line += f"  oneDNN {t_dnn * 1e3:8.2f} ms ({flops / t_dnn / 1e9:4.0f} GFLOP/s)"
        print(line, flush=True)


def bench_decode_attention(context: int, batch: int = 64) -> None:
    num_blocks = batch * (-(-context // BLOCK)) + 1
    caches = [
        hugepages.empty((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), torch.bfloat16).normal_()
        for _ in range(LAYERS)
    ]
    per_req = -(-context // BLOCK)
    prompt_blocks = min(per_req, 8)  # a 128-token prompt's blocks, allocated together
    table = torch.zeros(batch, per_req, dtype=torch.long)
    for i in range(batch):
        for j in range(per_req):
            table[i, j] = (
                1 + prompt_blocks * i + j
                if j < prompt_blocks
                else 1 + prompt_blocks * batch + i + batch * (j - prompt_blocks)
            )
    seq_lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()

    def attend(layer: int) -> None:
        cpu_ops.paged_decode_attention(
            q, caches[layer][0], caches[layer][1], table, seq_lens, 0.125, None
        )

    attend(0)
    mb = batch * context * KV_HEADS * HEAD_DIM * 2 * 2 / 1e6
    cold = best_of(lambda: [attend(layer) for layer in range(LAYERS)]) / LAYERS
    warm = best_of(lambda: [attend(0) for _ in range(LAYERS)]) / LAYERS
    ids = table.flatten()
    gather = (
        best_of(lambda: [(c[0].index_select(0, ids), c[1].index_select(0, ids)) for c in caches])
        / LAYERS
    )
    print(
        f"decode attention batch {batch} context {context} ({mb:.1f} MB of KV per layer): "
        f"cold {cold * 1e3:.3f} ms/layer ({mb / cold / 1e3:.1f} GB/s), warm {warm * 1e3:.3f} ms/layer; "
        f"gather copy {gather * 1e3:.3f} ms/layer",
        flush=True,
    )


ELEMENTWISE_IMPLS = ("eager", "compile", "triton")


def elementwise_ops(impl: str) -> tuple[Callable, Callable]:
    """(add_rms_norm(x, residual, weight, eps), silu_and_mul(x)) of one implementation."""
    if impl == "eager":
        from kvserve.models.fused_ops import TORCH_OPS

        return TORCH_OPS.add_rms_norm, TORCH_OPS.silu_and_mul
    from kvserve.models.kernels import triton_ops

    if impl == "compile":
        return triton_ops.compiled_fused_add_rms_norm, triton_ops.compiled_silu_and_mul
    if impl == "triton":
        return triton_ops.fused_add_rms_norm, triton_ops.silu_and_mul
    raise ValueError(f"unknown implementation {impl!r} (expected one of {ELEMENTWISE_IMPLS})")


def time_per_call(
    fn: Callable[[], object],
    device: torch.device,
    calls: int,
    repeats: int = 5,
    cuda_graph: bool = False,
) -> float:
    """Median seconds per call over `repeats` timings of `calls` calls (CUDA events on a GPU;
    `cuda_graph`: the calls captured once in a CUDA graph and replayed, so no launch overhead)."""
    for _ in range(3):
        fn()  # warm-up (and torch.compile's first compile)
    run = lambda: [fn() for _ in range(calls)]  # noqa: E731
    if cuda_graph and device.type == "cuda":
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            begin = time.perf_counter()
            run()
            samples.append((time.perf_counter() - begin) / calls)
    return statistics.median(samples)


def bench_elementwise(
    device: str = "cuda",
    rows: Sequence[int] = (1, 64, 2048),
    impls: Sequence[str] = ELEMENTWISE_IMPLS,
    hidden: int = 4096,
    intermediate: int = 14336,
    dtype: torch.dtype = torch.bfloat16,
    calls: int = 50,
    cuda_graph: bool = False,
) -> list[tuple[str, int, str, float]]:
    """Time add + RMSNorm and SiLU * up per implementation; prints a table, returns
    (op, rows, impl, seconds per call) for every measurement."""
    dev = torch.device(device)
    ops = {impl: elementwise_ops(impl) for impl in impls}
    size = torch.finfo(dtype).bits // 8
    results = []
    print(
        f"{'op':14s} {'rows':>5s}" + "".join(f" {impl + ' us (GB/s)':>22s}" for impl in impls),
        flush=True,
    )
    for num_rows in rows:
        x = torch.randn(num_rows, hidden, device=dev).to(dtype) * 0.01
        residual = torch.randn(num_rows, hidden, device=dev).to(dtype)
        weight = torch.randn(hidden, device=dev).to(dtype)
        gate_up = torch.randn(num_rows, 2 * intermediate, device=dev).to(dtype)
        cases = {  # (call for an impl's ops, bytes read + written per call)
            "add_rms_norm": (
                lambda f: f[0](x, residual, weight, 1e-5),
                4 * num_rows * hidden * size + hidden * size,
            ),
            "silu_and_mul": (lambda f: f[1](gate_up), 3 * num_rows * intermediate * size),
        }
        for op, (call, num_bytes) in cases.items():
            line = f"{op:14s} {num_rows:5d}"
            for impl in impls:
                seconds = time_per_call(lambda: call(ops[impl]), dev, calls, cuda_graph=cuda_graph)
                results.append((op, num_rows, impl, seconds))
                line += f" {seconds * 1e6:12.2f} ({num_bytes / seconds / 1e9:6.0f})"
            print(line, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: kvserve's CPU kernels (linear, decode attention); "
        "cuda: Triton vs torch.compile vs eager add+RMSNorm and SiLU*up",
    )
    parser.add_argument(
        "--rows", default=None, help="token counts (default 1,16,64,256,2048; cuda: 1,64,2048)"
    )
    parser.add_argument("--contexts", default="192,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--impls", default=",".join(ELEMENTWISE_IMPLS), help="cuda: implementations to time"
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="cuda: replay the calls from a CUDA graph (GPU time without launch overhead)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device: nothing to measure with --device cuda")
            return 1
        rows = [int(r) for r in (args.rows or "1,64,2048").split(",") if r]
        print(
            f"{torch.cuda.get_device_name()}, bf16, {'CUDA graph replay' if args.cuda_graphs else 'eager launches'}"
        )
        bench_elementwise(
            "cuda", rows, [i for i in args.impls.split(",") if i], cuda_graph=args.cuda_graphs
        )
        return 0
    args.rows = args.rows or "1,16,64,256,2048"
    if not cpu_ops.has_fast_bf16():
        print("no kvserve CPU kernel set runs on this machine; nothing to measure")
        return 1
    for rows in (int(r) for r in args.rows.split(",") if r):
        bench_linear(rows)
    for context in (int(c) for c in args.contexts.split(",") if c):
        bench_decode_attention(context)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
