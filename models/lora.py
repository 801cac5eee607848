"""LoRA adapters (PEFT's `adapter_config.json` + `adapter_model.safetensors`) on a Llama-family model.

A LoRA adapter adds `(x @ A.T) @ B.T * scaling` to a linear's output, A [r, in] and B [out, r];
`scaling` is `lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA (`use_rslora`).

The model file stays plain: when LoRA is enabled, `wrap_model` replaces each target linear
(`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`) by a `LoRALinear` holding the base linear
and its adapter slots, stacked tensors with one entry per slot (`max_loras`):

    lora_a  [max_loras, num_shards * max_rank, in]
    lora_b  [max_loras, out, num_shards * max_rank]

A packed linear has one shard per HF module (q/k/v, gate/up): shard s of an adapter of rank r
fills rows `s * max_rank : s * max_rank + r` of A and the same columns of B, only within the
shard's output rows of B (block diagonal), zeros elsewhere, so one shrink and one expand
compute every shard. B holds `scaling` already (folded in at load).

Each step the runner sets the batch's per-token slot (-1 = base) in the shared `LoRABatch`;
the wrappers add the adapters' outputs with the chosen kernel pair: the torch reference here
(tokens grouped by slot, one matmul pair per adapter in the step), Triton's
(models/kernels/triton_lora.py), or in bf16 on the CPU the kernel set's (models/lora_cpu.py,
whose wrappers the C++ decoder stack also runs).

Tensor parallelism (models/parallel.py), as vLLM shards adapters: a column-parallel linear's slots
hold the whole A and this rank's rows of B (its output features), so each rank adds its own output
columns; a row-parallel linear's hold this rank's input columns of A and the whole B, so each rank's
shrink is a partial sum over its inputs: the wrapper expands it and adds it to the base's partial
output before the layer's one all-reduce, which sums the adapters' parts with the base's (no
collective of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from kvserve.models.layers import Linear, PackedLinear
from kvserve.models.lora_config import SUPPORTED_TARGETS, read_adapter_config
from kvserve.models.parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
_PREFIX = "base_model.model."


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """One adapter read from disk, on the CPU: checked against the model, ready for a slot."""

    name: str
    path: str
    rank: int
    scaling: float
    # wrapper module name (e.g. model.layers.0.self_attn.qkv_proj) -> shard index -> (A [r, in], B [out_shard, r])
    # (B scaled)
    weights: dict[str, dict[int, tuple[Tensor, Tensor]]]


@dataclass(slots=True)
class LoRABatchMeta:
    """One step's tokens grouped by slot (built on the host, no per-token loop; see engine/worker/lora.py)."""

    token_order: Tensor  # [T'] int64: the tokens that use an adapter, sorted by slot
    seg_starts: Tensor  # [L] int32: where each slot's tokens start in token_order
    seg_lens: Tensor  # [L] int32
    seg_slots: Tensor  # [L] int32
    segments: list[tuple[int, int, int]]  # (slot, start, end) on the host, for the torch path
    max_seg_len: int


class LoRABatch:
    """The step's grouping, shared by every wrapper (None: no adapter in this step)."""

    def __init__(self) -> None:
        self.meta: LoRABatchMeta | None = None


LoRAKernel = Callable[[Tensor, Tensor, Tensor, Tensor, LoRABatchMeta], Tensor]


def lora_apply_torch(
    y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, meta: LoRABatchMeta
) -> Tensor:
    """y [T, out] += per-token adapter outputs; x [T, in]; the reference every kernel is checked against.
    One shrink/expand pair per adapter in the step (at most max_loras), none per token."""
    xs = x.index_select(0, meta.token_order)  # [T', in]
    for slot, start, end in meta.segments:
        shrunk = xs[start:end] @ lora_a[slot].t()  # [n, num_shards * max_rank]
        y.index_add_(0, meta.token_order[start:end], (shrunk @ lora_b[slot].t()).to(y.dtype))
    return y


class LoRALinear(nn.Module):
    """A target linear with adapter slots; forward = base + the step's adapters (see the module doc)."""

    def __init__(
        self,
        base: Linear,
        max_loras: int,
        max_rank: int,
        batch: LoRABatch,
        kernel: LoRAKernel,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.output_sizes = (
            list(base.output_sizes) if isinstance(base, PackedLinear) else [base.out_features]
        )
        self.shard_ids = list(base.shard_ids) if isinstance(base, PackedLinear) else [None]
        self.max_rank = max_rank
        width = len(self.output_sizes) * max_rank
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, width, self.in_features, dtype=dtype, device=device)
        )
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, self.out_features, width, dtype=dtype, device=device)
        )
        self.batch, self.kernel = batch, kernel

    def forward(self, x: Tensor) -> Tensor:  # [T, in] -> [T, out]
        base = self.base
        if not isinstance(base, RowParallelLinear):
            y = base(x)
            return y if self.batch.meta is None else self.add_adapters(y, x, self.batch.meta)
        y = base.forward_partial(x)  # this rank's part; the adapters' part joins its all-reduce
        if self.batch.meta is not None:
            y = self.add_adapters(y, x, self.batch.meta)
        return base.reduce(y)

    def add_adapters(self, y: Tensor, x: Tensor, meta: LoRABatchMeta) -> Tensor:
        """y [T, out] += the step's adapter outputs for x [T, in]."""
        return self.kernel(y, x, self.lora_a, self.lora_b, meta)

    @torch.no_grad()
    def set_slot(self, slot: int, shards: dict[int, tuple[Tensor, Tensor]] | None) -> None:
        """Write an adapter's shards into `slot` (None or missing shards: zeros)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        for i, (a, b) in (shards or {}).items():
            r, col = a.shape[0], i * self.max_rank
            self.lora_a[slot, col : col + r].copy_(a)
            self.lora_b[slot, offsets[i] : offsets[i] + self.output_sizes[i], col : col + r].copy_(
                b
            )


def _target_map(model: nn.Module) -> dict[str, tuple[str, object]]:
    """HF module name -> (kvserve module name, shard id), e.g. q_proj -> (qkv_proj, "q")."""
    packed: dict = getattr(model, "packed_modules_mapping", {})
    return {t: packed.get(t, (t, None)) for t in SUPPORTED_TARGETS}


def wrap_model(
    model: nn.Module,
    architecture: str,
    max_loras: int,
    max_rank: int,
    batch: LoRABatch,
    kernel: LoRAKernel,
    wrapper_cls: type[LoRALinear] = LoRALinear,
) -> dict[str, LoRALinear]:
    """Replace every target linear of `model` by a `wrapper_cls` (weights loaded already; the CPU
    kernels' is models/lora_cpu.py's); -> module name -> wrapper."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"enable_lora supports {', '.join(SUPPORTED_ARCHITECTURES)}, not {architecture!r}"
        )
    names = {dst for dst, _ in _target_map(model).values()}
    some = next(p for p in model.parameters())
    wrappers: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in names and isinstance(child, Linear):
                wrapper = wrapper_cls(
                    child, max_loras, max_rank, batch, kernel, some.dtype, some.device
                )
                setattr(module, child_name, wrapper)
                wrappers[f"{name}.{child_name}" if name else child_name] = wrapper
    return wrappers


def load_adapter(
    path: str, name: str, model: nn.Module, wrappers: dict[str, LoRALinear], max_rank: int
) -> LoRAAdapter:
    """Read and check a PEFT adapter entirely before anything uses it (a refused one leaves no trace)."""
    root = Path(path)
    rank, scaling = read_adapter_config(root, max_rank)
    weights_file = root / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ValueError(
            f"LoRA adapter {path!r} has no adapter_model.safetensors (pickle .bin files are refused)"
        )
    targets = _target_map(model)
    halves: dict[tuple[str, int], dict[str, Tensor]] = {}
    with safe_open(str(weights_file), framework="pt", device="cpu") as f:
        for key in f.keys():
            module, ab = _split_key(key)
            prefix, _, hf_target = module.rpartition(".")
            dst, shard_id = targets[hf_target]
            wrapper_name = f"{prefix}.{dst}"
            wrapper = wrappers.get(wrapper_name)
            if wrapper is None:
                raise ValueError(
                    f"LoRA adapter tensor {key!r} targets {module!r}, not in the model"
                )
            halves.setdefault((wrapper_name, wrapper.shard_ids.index(shard_id)), {})[ab] = (
                f.get_tensor(key)
            )
    weights: dict[str, dict[int, tuple[Tensor, Tensor]]] = {}
    for (wrapper_name, shard), pair in halves.items():
        wrapper = wrappers[wrapper_name]
        if set(pair) != {"A", "B"}:
            raise ValueError(
                f"LoRA adapter has lora_{'A' if 'B' in pair else 'B'} missing for {wrapper_name!r}"
            )
        a, b = pair["A"], pair["B"]
        in_full, out_full = _full_sizes(wrapper.base, shard)
        expect_a, expect_b = (rank, in_full), (out_full, rank)
        if tuple(a.shape) != expect_a or tuple(b.shape) != expect_b:
            raise ValueError(
                f"LoRA adapter shapes for {wrapper_name!r} shard {shard}: lora_A {tuple(a.shape)}, "
                f"lora_B {tuple(b.shape)}; the base model expects {expect_a} and {expect_b} (r={rank})"
            )
        a, b = _rank_part(wrapper.base, shard, a, b)
        dtype = wrapper.lora_a.dtype
        weights.setdefault(wrapper_name, {})[shard] = (a.to(dtype), (b.float() * scaling).to(dtype))
    if not weights:
        raise ValueError(f"LoRA adapter {path!r} has no LoRA weights")
    return LoRAAdapter(name=name, path=str(path), rank=rank, scaling=scaling, weights=weights)


def _full_sizes(base: Linear, shard: int) -> tuple[int, int]:
    """(input features, output features of `shard`) of the whole layer, every rank's together."""
    if isinstance(base, RowParallelLinear):
        return base.in_features * base.tp.size, base.out_features
    if isinstance(base, MergedColumnParallelLinear):  # q/k/v (KV heads maybe replicated), gate/up
        return base.in_features, base.full_sizes[shard]
    if isinstance(base, ColumnParallelLinear):
        return base.in_features, base.out_features * base.tp.size
    sizes = base.output_sizes if isinstance(base, PackedLinear) else [base.out_features]
    return base.in_features, sizes[shard]


def _rank_part(base: Linear, shard: int, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """This rank's part of A [r, in] and B [out_shard, r]: a column-parallel layer's output rows of
    B (A whole), a row-parallel layer's input columns of A (B whole)."""
    if isinstance(base, RowParallelLinear):
        n = base.in_features
        return a[:, base.tp.rank * n : (base.tp.rank + 1) * n].contiguous(), b
    if isinstance(base, MergedColumnParallelLinear):
        return a, base.shard_rows(base.shard_ids[shard], b).read()
    if isinstance(base, ColumnParallelLinear):
        n = base.out_features
        return a, b[base.tp.rank * n : (base.tp.rank + 1) * n]
    return a, b


def _split_key(key: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (<module>, "A"); ValueError for anything else."""
    parts = key.removeprefix(_PREFIX).split(".")
    if (
        any(p.startswith("lora_embedding") for p in parts)
        or "embed_tokens" in parts
        or "lm_head" in parts
    ):
        raise ValueError(
            f"LoRA adapter tensor {key!r} adapts the embeddings or the LM head: not supported"
        )
    if parts[-1] == "weight" and parts[-2] in ("default",):  # an adapter name left in the key
        parts = parts[:-2] + parts[-1:]
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise ValueError(
            f"LoRA adapter tensor {key!r} is not a lora_A/lora_B weight (bias, DoRA: not supported)"
        )
    module = ".".join(parts[:-2])
    if module.rpartition(".")[2] not in SUPPORTED_TARGETS:
        raise ValueError(
            f"LoRA adapter tensor {key!r}: target module not supported "
            f"(supported: {list(SUPPORTED_TARGETS)})"
        )
    return module, parts[-2][-1]
