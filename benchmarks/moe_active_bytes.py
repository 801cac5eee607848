"""The weight bytes a decode step reads in a mixture-of-experts model: the active-parameter roofline.

    python -m benchmarks.moe_active_bytes /path/to/checkpoint-or-config.json [--batch 1,8,64]
    python -m benchmarks.moe_active_bytes qwen3-30b-a3b      # built-in shapes: qwen3-30b-a3b, mixtral-8x7b
    python -m benchmarks.moe_active_bytes model-Q4_0.gguf --bandwidth   # a GGUF file's own bytes; measure GB/s

A decode step of a dense model reads every weight once, so at batch 1 its speed is bounded by
memory bandwidth / model bytes. An MoE step reads the attention, the router, the dense layers
(and shared experts) and only the experts its tokens chose: at batch 1, top_k of num_experts per sparse layer. With B
tokens routed uniformly, an expert is chosen by at least one token with probability
1 - (1 - k/E)^B, so the expected experts read per layer grow toward all of them as B grows.
(Real routers are not uniform: this is the roofline's shape, not a measurement.) Bytes per
weight: bf16 2; int8 1 + 2/G; int4 0.5 + 2/G (models/quantization.py's formats, G = 32; the
LM head stays int8). The embedding row lookup is negligible and not counted. For a GGUF file
the bytes are its tensors' own (whatever each tensor's type: a Q4_0 file's Q6_K head included).
`--bandwidth` times a plain read of a 1 GiB buffer on this machine and prints the decode
tokens/s each row's bytes allow at that rate (batch 1: the roofline a measured figure is held
against).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

SHAPES: dict[str, dict] = {  # config.json fields as the Hub has them
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        tie_word_embeddings=False,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class MoeShape:
    """Parameter counts of one model (weights only, norms left out)."""

    attention: int  # all layers
    dense_mlp: int  # all dense layers (Qwen3-MoE's mlp_only_layers)
    router: int  # all sparse layers
    shared: (
        int  # all sparse layers' shared experts and their gates (Qwen2-MoE): every token runs them
    )
    expert: int  # one expert of one layer
    num_sparse_layers: int
    num_experts: int
    top_k: int
    lm_head: int

    @property
    def total(self) -> int:
        return (
            self.attention
            + self.dense_mlp
            + self.router
            + self.shared
            + self.expert * self.num_experts * self.num_sparse_layers
        )

    def experts_read(self, batch: int) -> float:
        """Expected distinct experts per sparse layer for `batch` uniformly routed tokens."""
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)

    def step_params(self, batch: int) -> float:
        """Layer weights read by a decode step of `batch` tokens (the LM head apart)."""
        experts = self.expert * self.experts_read(batch) * self.num_sparse_layers
        return self.attention + self.dense_mlp + self.router + self.shared + experts


def moe_shape(c: dict) -> MoeShape:
    hidden, layers = c["hidden_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    attention = layers * hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
    num_experts = c.get("num_experts") or c.get("num_local_experts") or 0
    if not num_experts:
        raise ValueError(
            "the config names no experts (num_experts / num_local_experts): not a mixture of experts"
        )
    expert_inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    dense_layers = [
        i
        for i in range(layers)
        if i in (c.get("mlp_only_layers") or []) or (i + 1) % c.get("decoder_sparse_step", 1)
    ]
    sparse = layers - len(dense_layers)
    return MoeShape(
        attention=attention,
        dense_mlp=len(dense_layers) * 3 * hidden * c["intermediate_size"],
        router=sparse * num_experts * hidden,
        shared=sparse
        * (
            3 * hidden * c.get("shared_expert_intermediate_size", 0) + hidden
            if c.get("shared_expert_intermediate_size")
            else 0
        ),
        expert=3 * hidden * expert_inter,
        num_sparse_layers=sparse,
        num_experts=num_experts,
        top_k=c["num_experts_per_tok"],
        lm_head=c["vocab_size"] * hidden,
    )


BYTES_PER_WEIGHT = {"bf16": 2.0, "int8": 1 + 2 / 32, "int4": 0.5 + 2 / 32}


def step_bytes(shape: MoeShape, batch: int, fmt: str) -> float:
    head = shape.lm_head * (2.0 if fmt == "bf16" else BYTES_PER_WEIGHT["int8"])
    return shape.step_params(batch) * BYTES_PER_WEIGHT[fmt] + head


_EXPERTS = ("_exps.weight",)  # llama.cpp's stacked experts: blk.N.ffn_{gate,up,down}_exps.weight


@dataclass(frozen=True)
class GgufBytes:
    """A GGUF file's bytes by role: what every step reads, and one expert of all sparse layers."""

    dense: float  # attention, routers, norms, dense FFNs, the output head (token_embd if tied)
    expert: float  # one expert's three matrices, summed over the sparse layers
    shape: MoeShape

    def step_bytes(self, batch: int) -> float:
        return self.dense + self.expert * self.shape.experts_read(batch)


def gguf_bytes(path: str | Path) -> GgufBytes:
    """Byte counts of a GGUF mixture of experts, as its tensors are stored."""
    from kvserve.models.gguf_metadata import field, gguf_architecture, open_gguf

    reader = open_gguf(path)
    arch = gguf_architecture(reader)
    num_experts, top_k = (
        int(field(reader, f"{arch}.expert_count", 0)),
        int(field(reader, f"{arch}.expert_used_count", 0)),
    )
    if not num_experts:
        raise ValueError(f"{path}: no {arch}.expert_count: not a mixture of experts")
    names = {t.name for t in reader.tensors}
    dense = expert = 0
    for t in reader.tensors:
        if t.name.endswith(_EXPERTS):
            expert += int(t.n_bytes) / num_experts
        elif (
            t.name != "token_embd.weight" or "output.weight" not in names
        ):  # a lookup reads one row
            dense += int(t.n_bytes)
    layers = int(field(reader, f"{arch}.block_count"))
    shape = MoeShape(
        attention=0,
        dense_mlp=0,
        router=0,
        shared=0,
        expert=0,
        num_sparse_layers=layers,
        num_experts=num_experts,
        top_k=top_k,
        lm_head=0,
    )
    return GgufBytes(dense=dense, expert=expert, shape=shape)


def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of the best of `repeats` sums over a `num_bytes` buffer (torch's threads): a plain read."""
    import time

    import torch

    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def load_config(source: str) -> dict:
    if source in SHAPES:
        return SHAPES[source]
    path = Path(source)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(
            f"{source!r} is not a checkpoint directory, a config.json or one of {sorted(SHAPES)}"
        )
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.moe_active_bytes", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "model",
        help=f"checkpoint directory, config.json, a .gguf file, or one of {', '.join(SHAPES)}",
    )
    p.add_argument("--batch", default="1,4,16,64", help="decode batch sizes, comma-separated")
    p.add_argument(
        "--bandwidth",
        action="store_true",
        help="measure a plain read's GB/s; print the tok/s roofline",
    )
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    bandwidth = read_bandwidth() if args.bandwidth else None
    if bandwidth:
        print(f"plain read: {bandwidth / 1e9:.1f} GB/s (best of 5 sums over 1 GiB)")
    gib = 2**30
    if args.model.endswith(".gguf"):
        counts = gguf_bytes(args.model)
        print(
            f"{args.model}: {counts.dense / gib:.2f} GiB read every step, {counts.expert / 2**20:.1f} MiB per expert "
            f"(all layers); {counts.shape.num_experts} experts, top {counts.shape.top_k}"
        )
        print(
            f"{'batch':>6} {'experts/layer':>14} {'GiB/step':>9}"
            + (f" {'tok/s bound':>12}" if bandwidth else "")
        )
        for batch in batches:
            step = counts.step_bytes(batch)
            bound = f" {batch * bandwidth / step:>12.1f}" if bandwidth else ""
            print(f"{batch:>6} {counts.shape.experts_read(batch):>14.1f} {step / gib:>9.3f}{bound}")
        return 0
    shape = moe_shape(load_config(args.model))
    print(
        f"parameters: {shape.total / 1e9:.2f} B in the layers (+ {shape.lm_head / 1e6:.0f} M LM head); "
        f"{shape.num_sparse_layers} sparse layers of {shape.num_experts} experts, top {shape.top_k}"
    )
    print(
        f"{'batch':>6} {'experts/layer':>14} {'active params':>14} "
        + " ".join(f"{f + ' GiB':>10}" for f in BYTES_PER_WEIGHT)
    )
    for batch in batches:
        cells = " ".join(f"{step_bytes(shape, batch, f) / gib:>10.2f}" for f in BYTES_PER_WEIGHT)
        print(
            f"{batch:>6} {shape.experts_read(batch):>14.1f} {shape.step_params(batch) / 1e9:>13.2f}B {cells}"
        )
    print("(read per decode step; divide the memory bandwidth by it for the steps/s roofline)")
    if bandwidth:
        print(
            f"batch-1 tok/s bound at {bandwidth / 1e9:.1f} GB/s: "
            + ", ".join(f"{f} {bandwidth / step_bytes(shape, 1, f):.1f}" for f in BYTES_PER_WEIGHT)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
