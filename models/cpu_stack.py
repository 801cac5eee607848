"""A Llama-family model's decoder layers as one C++ call per step on the CPU.

At batch 1 a decode step reads every weight once, and with int8/int4 weights that read is
short enough for the Python around the kernels (a dozen module calls and op dispatches per
layer) to cost about as much again. The host library's decoder stack
(models/csrc/host/decoder_stack.cpp) runs the same kernels in the same order as the model's
forward with the CPU backend, so its output is bit for bit the same; the runner calls it
instead of the model when `build` returns one.

A model qualifies when every piece of it is one the C++ loop knows: Llama, Mistral, Qwen2,
Qwen3 or Phi-3 layers (a dense silu MLP: mixture-of-experts models run their Python forward, whose
experts still multiply on the per-op CPU kernels; Phi-3's partial rotary and LongRoPE are in its q/k weights' layout
and the cos/sin rows the stack is given), bf16, one rank, the paged attention kernels, and every matmul on
models/cpu_ops' bf16 kernel or models/quantization's int8/int4 kernel. Anything else keeps the
Python forward; `why_not` says which piece stopped it.

LoRA (docs/lora.md): a linear wrapped by models/lora_cpu.py's `CpuLoRALinear` joins the stack with
its packed adapter slots, and each step passes the rows of each slot (the wrappers' shared
`LoRABatch`); the stack adds the adapters' outputs after that linear with the same op as the
wrapper's forward. Other LoRA wrappers (fp32, no kernel set) keep the Python forward.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from kvserve.models import cpu_ops
from kvserve.models.attention import Attention
from kvserve.models.attention.metadata import AttentionMetadata
from kvserve.models.cpu_model import CpuFusedOps, KernelLinear
from kvserve.models.layers import Linear
from kvserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from kvserve.models.lora import LoRABatch, LoRALinear
from kvserve.models.lora_cpu import CpuLoRALinear
from kvserve.models.quantization import QuantizedLinear
from kvserve.models.qwen import Qwen3Attention

logger = logging.getLogger(__name__)

_ATTENTION_FORWARDS = (LlamaAttention.forward, Qwen3Attention.forward)


def why_not(model: nn.Module) -> str | None:
    """None when the C++ decoder stack can run `model`'s layers, else what stops it."""
    if (
        not isinstance(model, LlamaForCausalLM)
        or type(model).forward is not LlamaForCausalLM.forward
    ):
        return f"{type(model).__name__} is not a Llama-family model"
    if not cpu_ops.has_fast_bf16():
        return "no CPU kernel set is loaded (models/cpu_isa.py)"
    inner = model.model
    if inner.norm.weight.dtype != torch.bfloat16 or inner.norm.weight.device.type != "cpu":
        return "the model is not bf16 on the CPU"
    for i, layer in enumerate(inner.layers):
        reason = _layer_why_not(layer)
        if reason:
            return f"layer {i}: {reason}"
    return None


def _layer_why_not(layer: nn.Module) -> str | None:
    if type(layer).forward is not LlamaDecoderLayer.forward:
        return f"{type(layer).__name__} is not a Llama decoder layer"
    if type(layer.mlp).forward is not LlamaMLP.forward:  # e.g. a mixture of experts (models/moe.py)
        return f"its MLP is a {type(layer.mlp).__name__}, not a dense Llama MLP"
    attn = layer.self_attn
    if type(attn).forward not in _ATTENTION_FORWARDS:
        return f"{type(attn).__name__} has its own forward"
    if layer.mlp.act is not None:
        return "the MLP's activation is not silu"
    norms = [
        getattr(attn, name)
        for name in ("q_norm", "k_norm")
        if getattr(attn, name, None) is not None
    ]
    if not all(
        isinstance(m.ops, CpuFusedOps)
        for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp, *norms)
    ):
        return "the fused ops are not the CPU's"
    backend = attn.attn.backend
    if not (
        getattr(backend, "paged_kernels", False) and backend.fused_write and backend.fused_rotary
    ):
        return "the attention backend is not the CPU kernels'"
    if attn.attn.rotary is None:
        return "no rotary embedding"
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        linear = getattr(attn if name in ("qkv_proj", "o_proj") else layer.mlp, name)
        if isinstance(linear, LoRALinear) and not isinstance(linear, CpuLoRALinear):
            return f"{name}'s LoRA adapters are not on the CPU kernels"
        if getattr(linear, "tp_size", 1) != 1:
            return "tensor parallelism"
        if _kernel_of(linear) is None:
            return f"{name} is not on a CPU matmul kernel"
    return None


def _kernel_of(linear: Linear) -> tuple | None:
    """(packed, scales, bias, n, bits, group) of a matmul the stack runs, or None."""
    if isinstance(linear, CpuLoRALinear):
        linear = linear.base
    packed = getattr(linear, "packed", None)
    if isinstance(packed, KernelLinear):
        return packed.weight, None, packed.bias, packed.out_features, 16, 0
    if isinstance(packed, QuantizedLinear) and packed.weight.packed and packed.triton is None:
        w = packed.weight
        return w.data, w.scales, packed.bias, w.n, w.bits, w.group
    return None


class CpuDecoderStack:
    """`model(input_ids, positions)` for the runner, through one C++ call per step.

    The C++ stack holds pointers to the layers' weights and KV caches (this object keeps the
    tensors alive); it is rebuilt if the runner gives the layers new caches."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.inner = model.model
        self.attention: list[Attention] = [layer.self_attn.attn for layer in self.inner.layers]
        self._caches: list[Tensor | None] = []  # kept alive: the C++ stack holds their pointers
        self._built_at = -1  # Attention.cache_assignments when the stack was built
        self._stack: cpu_ops.DecoderStack | None = None
        lora = [m for m in model.modules() if isinstance(m, CpuLoRALinear)]
        self.lora_batch: LoRABatch | None = lora[0].batch if lora else None

    def __call__(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata
    ) -> Tensor:  # -> [T, hidden]
        if self._stack is None or self._built_at != Attention.cache_assignments:
            self._stack = self._build()
        inner = self.inner
        x = inner.embed_tokens(input_ids)  # [T, hidden]: the residual stream, overwritten in place
        cos_sin = inner.rotary_emb.cos_sin_cache.index_select(0, positions.long())  # [T, 2, D]
        lora = None if self.lora_batch is None else self.lora_batch.meta
        rows = (
            None
            if lora is None
            else (lora.token_order, lora.seg_starts, lora.seg_lens, lora.seg_slots)
        )
        return self._stack.forward(
            x,
            inner.norm.weight,
            cos_sin,
            meta.slot_mapping,
            meta.block_table,
            meta.seq_lens,
            meta.query_lens_cpu,
            meta.seq_lens_cpu,
            rows,
        )

    def _build(self) -> cpu_ops.DecoderStack:
        self._caches = [a.kv_cache for a in self.attention]
        if any(c is None for c in self._caches):
            raise RuntimeError(
                "the CPU decoder stack needs the layers' KV caches (assign Attention.kv_cache first)"
            )
        self._built_at = Attention.cache_assignments
        stack = cpu_ops.DecoderStack(self.inner.norm.eps)
        for layer in self.inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                stack.add_linear(*_kernel_of(linear))
                if isinstance(linear, CpuLoRALinear):
                    stack.add_lora(
                        linear.packed_a, linear.packed_b, linear.shard_n, linear.rank_pad
                    )
            a = attn.attn
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            stack.add_layer(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                None if q_norm is None else q_norm.weight,
                None if k_norm is None else k_norm.weight,
                *a.kv,
                a.num_heads,
                a.num_kv_heads,
                a.head_dim,
                a.sliding_window or 0,
                a.scale,
                layer.input_layernorm.eps,
            )
        return stack


def build(model: nn.Module) -> CpuDecoderStack | None:
    """The stack for `model`, or None (the reason logged) when its layers need the Python forward."""
    reason = why_not(model)
    cpu_ops.use_own_pool(reason is None)
    if reason is not None:
        logger.info("CPU decoder stack off (%s): steps run the model's Python forward", reason)
        return None
    lora = " with LoRA" if any(isinstance(m, CpuLoRALinear) for m in model.modules()) else ""
    logger.info("CPU decoder stack on%s: %d layers per C++ call", lora, len(model.model.layers))
    return CpuDecoderStack(model)
