"""LoRA on the CPU's kernel set (bf16): the adapter slots packed for the set's bf16 linear.

`CpuLoRALinear` keeps models/lora.py's slots (`lora_a`, `lora_b`) and packs each slot again, when
it is written, for the narrow shrink and expand kernels of models/csrc/host/lora.cpp:

    packed_a  [max_loras, ceil(shards * rank_pad / 16), in, 16]   A of every shard, 16 ranks a group
    packed_b  [max_loras, rank_pad, sum_s round16(out_s)]          each shard's block of B, transposed

(`rank_pad`: max_lora_rank rounded up to even). A rank-16 adapter's A is read at its own size, not
padded to a 64-column block; B is block diagonal, so each shard's B sits on its own columns: the
expand multiplies only a shard's own rank columns.

Its forward adds the step's adapters with `cpu_ops.lora_apply_` (models/csrc/host/lora.cpp), the
op the C++ decoder stack (models/cpu_stack.py) runs after each LoRA'd linear: the stack and the
Python forward give the same bits, as they do without LoRA.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvserve.models import cpu_ops
from kvserve.models.layers import Linear
from kvserve.models.lora import LoRABatchMeta, LoRALinear


def fits(model: nn.Module) -> str | None:
    """None when the CPU kernels can run adapters on `model` (bf16 on the CPU, a kernel set loaded,
    even input sizes), else why not."""
    some = next(model.parameters())
    if some.device.type != "cpu" or some.dtype is not torch.bfloat16:
        return "the model is not bf16 on the CPU"
    if not cpu_ops.has_fast_bf16():
        return "no CPU kernel set is loaded"
    if any(m.in_features % 2 for m in model.modules() if isinstance(m, Linear)):
        return "a linear has an odd number of input features"
    return None


class CpuLoRALinear(LoRALinear):
    """A `LoRALinear` whose slots are also packed for the CPU kernel set (see the module doc)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        max_loras, num_shards = self.lora_a.shape[0], len(self.output_sizes)
        self.rank_pad = self.max_rank + self.max_rank % 2
        a_groups = -(-num_shards * self.rank_pad // 16)
        self.b_cols = [-(-n // 16) * 16 for n in self.output_sizes]
        self.register_buffer(
            "packed_a",
            torch.zeros(max_loras, a_groups, self.in_features, 16, dtype=torch.bfloat16),
        )
        self.register_buffer(
            "packed_b",
            torch.zeros(max_loras, self.rank_pad, sum(self.b_cols), dtype=torch.bfloat16),
        )
        self.register_buffer("shard_n", torch.tensor(self.output_sizes, dtype=torch.int64))

    def add_adapters(self, y: Tensor, x: Tensor, meta: LoRABatchMeta) -> Tensor:
        rows = (meta.token_order, meta.seg_starts, meta.seg_lens, meta.seg_slots)
        cpu_ops.lora_apply_(y, x, self.packed_a, self.packed_b, self.shard_n, self.rank_pad, rows)
        return y

    @torch.no_grad()
    def set_slot(self, slot: int, shards: dict[int, tuple[Tensor, Tensor]] | None) -> None:
        super().set_slot(slot, shards)
        r, rp, num_shards = self.max_rank, self.rank_pad, len(self.output_sizes)
        a = torch.zeros(
            self.packed_a.shape[1] * 16, self.in_features, dtype=torch.bfloat16
        )  # [groups * 16, in]: each shard's rank_pad rows, zeros after
        for s in range(num_shards):
            a[s * rp : s * rp + r] = self.lora_a[slot, s * r : (s + 1) * r]
        self.packed_a[slot] = a.view(-1, 16, self.in_features).transpose(1, 2)
        packed_b = self.packed_b[slot]  # [rank_pad, sum of the shards' padded columns]
        packed_b.zero_()
        row, col = 0, 0
        for s, (n, cols) in enumerate(zip(self.output_sizes, self.b_cols)):
            packed_b[:r, col : col + n] = self.lora_b[slot, row : row + n, s * r : (s + 1) * r].T
            row, col = row + n, col + cols
