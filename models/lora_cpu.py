"""LoRA on the CPU's kernel set (bf16): the adapter slots packed for the set's bf16 linear.

`CpuLoRALinear` keeps models/lora.py's slots (`lora_a`, `lora_b`) and packs each slot again, when
it is written, into the layout `cpu_ops.pack_linear_weight` gives a linear's weight:

    packed_a  [max_loras, ceil(shards * rank_pad / 64), in / 2, 64, 2]    A of every shard
    packed_b  [max_loras, sum_s ceil(out_s / 64), rank_pad / 2, 64, 2]   each shard's block of B

(`rank_pad`: max_lora_rank rounded up to even, the kernel's feature pairs). B is block diagonal,
so each shard's B is packed alone: the expand multiplies only a shard's own rank columns.

Its forward adds the step's adapters with `cpu_ops.lora_apply_` (models/csrc/host/lora.cpp), the
op the C++ decoder stack (models/cpu_stack.py) runs after each LoRA'd linear: the stack and the
Python forward give the same bits, as they do without LoRA.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvserve.models import cpu_ops
from kvserve.models.layers import Linear
from kvserve.models.lora import LoRALinear


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
        a_blocks = -(-num_shards * self.rank_pad // 64)
        self.b_blocks = [-(-n // 64) for n in self.output_sizes]
        self.register_buffer(
            "packed_a",
            torch.zeros(max_loras, a_blocks, self.in_features // 2, 64, 2, dtype=torch.bfloat16),
        )
        self.register_buffer(
            "packed_b",
            torch.zeros(
                max_loras, sum(self.b_blocks), self.rank_pad // 2, 64, 2, dtype=torch.bfloat16
            ),
        )
        self.register_buffer("shard_n", torch.tensor(self.output_sizes, dtype=torch.int64))

    def forward(self, x: Tensor) -> Tensor:  # [T, in] -> [T, out]
        y = self.base(x)
        meta = self.batch.meta
        if meta is not None:
            rows = (meta.token_order, meta.seg_starts, meta.seg_lens, meta.seg_slots)
            cpu_ops.lora_apply_(
                y, x, self.packed_a, self.packed_b, self.shard_n, self.rank_pad, rows
            )
        return y

    @torch.no_grad()
    def set_slot(self, slot: int, shards: dict[int, tuple[Tensor, Tensor]] | None) -> None:
        super().set_slot(slot, shards)
        r, rp, num_shards = self.max_rank, self.rank_pad, len(self.output_sizes)
        a = torch.zeros(
            num_shards * rp, self.in_features, dtype=torch.bfloat16
        )  # [shards * rank_pad, in]
        for s in range(num_shards):
            a[s * rp : s * rp + r] = self.lora_a[slot, s * r : (s + 1) * r]
        cpu_ops.pack_linear_weight(a, out=self.packed_a[slot])
        row, block = 0, 0
        for s, (n, num_blocks) in enumerate(zip(self.output_sizes, self.b_blocks)):
            b = torch.zeros(
                n, rp, dtype=torch.bfloat16
            )  # [out_s, rank_pad]: the shard's block of B
            b[:, :r] = self.lora_b[slot, row : row + n, s * r : (s + 1) * r]
            cpu_ops.pack_linear_weight(b, out=self.packed_b[slot, block : block + num_blocks])
            row, block = row + n, block + num_blocks
