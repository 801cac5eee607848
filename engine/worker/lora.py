"""The runner's LoRA state: adapters read on the CPU (an LRU of `max_cpu_loras`), `max_loras` device
slots, and each step's per-token slot grouping (models/lora.py holds the wrappers and kernels).

The scheduler admits at most `max_loras` distinct adapters into the running batch
(engine/core/scheduler.py), so a step's adapters always fit the slots; a slot is reused
least recently used first when an adapter not in one arrives.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch import nn

from kvserve.models import lora_cpu
from kvserve.models.lora import (
    LoRAAdapter,
    LoRABatch,
    LoRABatchMeta,
    LoRAKernel,
    LoRALinear,
    load_adapter,
    lora_apply_torch,
    wrap_model,
)

logger = logging.getLogger(__name__)


def select_kernel(attention_backend: str) -> LoRAKernel:
    """Triton's shrink/expand with the Triton attention backend (CUDA, or the interpreter), else torch's."""
    if attention_backend == "triton":
        from kvserve.models.kernels.triton_lora import (
            lora_apply_triton,  # imports triton: only when chosen
        )

        return lora_apply_triton
    return lora_apply_torch


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        architecture: str,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        attention_backend: str,
        device: torch.device,
    ) -> None:
        self.model, self.device = model, device
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = (
            max_loras,
            max_lora_rank,
            max_cpu_loras,
        )
        self.batch = LoRABatch()
        # bf16 on the CPU: the kernel set's shrink/expand, which the C++ decoder stack runs too
        cpu_reason = lora_cpu.fits(model) if device.type == "cpu" else "not on the CPU"
        wrapper_cls = lora_cpu.CpuLoRALinear if cpu_reason is None else LoRALinear
        self.wrappers: dict[str, LoRALinear] = wrap_model(
            model,
            architecture,
            max_loras,
            max_lora_rank,
            self.batch,
            select_kernel(attention_backend),
            wrapper_cls,
        )
        self.cpu: OrderedDict[int, LoRAAdapter] = (
            OrderedDict()
        )  # lora id -> adapter, least recent first
        self.paths: dict[
            int, tuple[str, str]
        ] = {}  # lora id -> (name, path), to reload after an eviction
        self.slots: OrderedDict[int, int] = (
            OrderedDict()
        )  # lora id -> slot, least recently used first
        # the adapters of unfinished requests, as the engine said when it last read one (those
        # waiting on a grammar included) and as the last step record said: never dropped from
        # host memory, so a request never depends on a directory that may be gone by its turn
        self.in_use: frozenset[int] = frozenset()
        self.step_in_use: frozenset[int] = frozenset()
        logger.info(
            "LoRA: %d slots of rank <= %d on %d linears (%s)",
            max_loras,
            max_lora_rank,
            len(self.wrappers),
            "CPU kernels" if cpu_reason is None else f"{attention_backend} kernels: {cpu_reason}",
        )

    def add(self, lora_id: int, name: str, path: str) -> LoRAAdapter:
        """Read (or find) adapter `lora_id` on the CPU; ValueError if it cannot be served."""
        known = self.paths.get(lora_id)
        if known is not None and known != (name, path):
            raise ValueError(
                f"lora_int_id {lora_id} is already {known[0]!r} at {known[1]!r}, not {name!r} at {path!r}"
            )
        adapter = self.cpu.get(lora_id)
        if adapter is None:
            adapter = load_adapter(path, name, self.model, self.wrappers, self.max_lora_rank)
            self.cpu[lora_id] = adapter
            self.paths[lora_id] = (name, path)
        self.cpu.move_to_end(lora_id)
        self._trim(keep=lora_id)
        return adapter

    def _trim(self, keep: int) -> None:
        """Drop least recently used adapters past `max_cpu_loras` (re-read from their path if they
        come back), but none in use: while more are, host memory holds them all."""
        excess = len(self.cpu) - self.max_cpu_loras
        if excess > 0:
            kept = self.in_use | self.step_in_use | {keep}
            victims = [i for i in self.cpu if i not in kept][:excess]
            for lora_id in victims:
                del self.cpu[lora_id]

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter (its slot is freed); False if it was not loaded."""
        known = self.paths.pop(lora_id, None) is not None
        self.cpu.pop(lora_id, None)
        slot = self.slots.pop(lora_id, None)
        if slot is not None:
            for wrapper in self.wrappers.values():
                wrapper.set_slot(slot, None)
        return known

    def remember(self, lora_id: int, name: str, path: str) -> None:
        """A request's adapter as it reached the runner (read when it first needs a slot)."""
        if lora_id and lora_id not in self.paths:
            self.paths[lora_id] = (name, path)

    def _slot_for(self, lora_id: int, keep: set[int]) -> int:
        slot = self.slots.get(lora_id)
        if slot is None:
            name, path = self.paths[lora_id]
            adapter = self.add(lora_id, name, path)
            used = set(self.slots.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:  # the least recently used slot whose adapter is not in this step
                victim = next(i for i in self.slots if i not in keep)
                slot = self.slots.pop(victim)
            for module_name, wrapper in self.wrappers.items():
                wrapper.set_slot(slot, adapter.weights.get(module_name))
            self.slots[lora_id] = slot
        self.slots.move_to_end(lora_id)
        return slot

    def prepare(
        self, row_lora_ids: np.ndarray, query_lens: np.ndarray, in_use: tuple[int, ...]
    ) -> None:
        """Slots for the step's adapters and the per-token grouping (rows' lora ids [B], 0 = base;
        `in_use`: the adapters of every unfinished request, kept read)."""
        self.step_in_use = frozenset(in_use)
        active = set(np.unique(row_lora_ids).tolist()) - {0}
        if not active:
            self.batch.meta = None
            return
        if len(active) > self.max_loras:
            raise RuntimeError(f"{len(active)} adapters in one step, max_loras={self.max_loras}")
        slot_of = {i: self._slot_for(i, active) for i in sorted(active)}
        row_slots = np.array([slot_of.get(i, -1) for i in row_lora_ids.tolist()], np.int64)  # [B]
        self.batch.meta = group_tokens(row_slots, query_lens, self.device)


def group_tokens(
    row_slots: np.ndarray, query_lens: np.ndarray, device: torch.device
) -> LoRABatchMeta:
    """The step's tokens that use an adapter, grouped by slot: rows' slots [B] (-1 = base) and
    tokens [B] -> the kernels' segments (numpy, no per-token loop)."""
    token_slots = np.repeat(row_slots, query_lens)  # [T]
    adapted = np.flatnonzero(token_slots >= 0)
    order = adapted[np.argsort(token_slots[adapted], kind="stable")]  # [T'] grouped by slot
    slots, starts, lens = np.unique(token_slots[order], return_index=True, return_counts=True)

    def to_dev(a: np.ndarray, dtype: Any) -> torch.Tensor:
        return torch.from_numpy(a.astype(dtype)).to(device, non_blocking=True)

    return LoRABatchMeta(
        token_order=to_dev(order, np.int64),
        seg_starts=to_dev(starts, np.int32),
        seg_lens=to_dev(lens, np.int32),
        seg_slots=to_dev(slots, np.int32),
        segments=[(int(s), int(b), int(b + n)) for s, b, n in zip(slots, starts, lens)],
        max_seg_len=int(lens.max()),
    )
