"""Read a GGUF file's weights (llama.cpp's format) under their Hugging Face names.

A GGUF checkpoint is one file; kvserve's model path is then that file. Weights are dequantized
here, one tensor at a time, to fp32 (`gguf.quants.dequantize`, the gguf package's reference,
so the values are exactly its values), except the Q8_0 / Q4_0 matrices that the quantizer holds
in their own format (`direct_tensors`): those come as their blocks (models/gguf_blocks.py), the
file's own; `--quantization none` keeps every matrix in the model dtype instead. Config and
tokenizer come from the file's metadata through transformers' own GGUF support, converted once
(models/gguf_metadata.py), so they are read as `transformers` reads them.

llama.cpp's converter permutes the q/k rows of llama-family files (each head's two rotary
halves become interleaved pairs); `_unpermute` undoes it, as transformers does (Phi-3 files keep
HF's layout: fused `attn_qkv` and `ffn_up`, not permuted). GPT-2's
matrices are stored [out, in] and go back to Conv1D's [in, out] that the model file expects.
Gemma files store every norm weight w as `1 + w` (in fp32, the converter's `data + 1` on the
fp32-converted tensor); the reader subtracts the 1, as transformers does. `g - 1` of an fp32
`g = fl(1 + w)` is exact (Sterbenz for g in [0.5, 2]; a multiple of g's ulp above; exact adds below),
so the model's `1 + (g - 1)` is `g` bit for bit: the safetensors checkpoint's value.

A mixture of experts' stacked matrices (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`
[E, out, in]) come one expert at a time under Hugging Face's per-expert names, its router
(`ffn_gate_inp`) as `mlp.gate` (Qwen3-MoE files: arch `qwen3moe`; Mixtral: arch `llama` with
`llama.expert_count`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterator

import numpy as np
import torch
from torch import Tensor

from kvserve.models.gguf_blocks import QuantBlocks, block_bits, read_blocks
from kvserve.models.gguf_metadata import (
    ROPE_TENSORS,
    field,
    gguf_architecture,
    import_gguf,
    open_gguf,
)

logger = logging.getLogger(__name__)

# Tensor types read (each dequantized exactly as the gguf package's reference does): the float
# types, the legacy blocks, and the K-quants of llama.cpp's Q4_K_M / Q5_K_M / Q6_K files (with the
# legacy types it falls back to for rows that are not a multiple of 256).
TENSOR_TYPES: tuple[str, ...] = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

_DECODER_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_DECODER_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router [E, hidden]
}
# Gemma 2/3: "ffn_norm" is the norm before the MLP, and each sub-block has a norm after it too
_GEMMA_BLOCK = {
    **_DECODER_BLOCK,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# Phi-3 keeps HF's fused tensors: `attn_qkv` is qkv_proj, `ffn_up` holds gate_up_proj (gate rows first).
_PHI3_BLOCK = {**_DECODER_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# A mixture of experts' matrices, stacked [E, out, in]: read one expert at a time (`_EXPERTS_PART`).
_EXPERT_STACKS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_EXPERTS_PART = "mlp.experts.{}"
_GPT2_GLOBAL = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
_GPT2_BLOCK = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}


def gguf_tensor_names(arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, for every tensor a file of `arch` may hold."""
    is_gpt2 = arch == "gpt2"
    glob, block = (_GPT2_GLOBAL, _GPT2_BLOCK) if is_gpt2 else (_DECODER_GLOBAL, _DECODER_BLOCK)
    if arch in GEMMA_ARCHITECTURES:
        block = _GEMMA_BLOCK
    elif arch == "phi3":
        block = _PHI3_BLOCK
    prefix = "transformer.h" if is_gpt2 else "model.layers"
    names = {}
    for suffix in ("weight", "bias"):
        names |= {f"{g}.{suffix}": f"{hf}.{suffix}" for g, hf in glob.items()}
        for i in range(num_layers):
            names |= {
                f"blk.{i}.{g}.{suffix}": f"{prefix}.{i}.{hf}.{suffix}" for g, hf in block.items()
            }
            if not is_gpt2:  # "{}": the expert's index
                names |= {
                    f"blk.{i}.{g}.{suffix}": f"{prefix}.{i}.{_EXPERTS_PART}.{hf}.{suffix}"
                    for g, hf in _EXPERT_STACKS.items()
                }
    return names


# What each tensor type is kept as when the file is served as it comes (`gguf_quantization`): the
# format with at least its bits. Only Q8_0 -> int8 and Q4_0 -> int4 give back the file's blocks
# exactly; the others are re-quantized from their exact values (docs/quantization.md).
_KEPT_AS = {
    "Q8_0": "int8",
    "Q6_K": "int8",
    "Q5_K": "int8",
    "Q5_0": "int8",
    "Q5_1": "int8",
    "Q4_0": "int4",
    "Q4_1": "int4",
    "Q4_K": "int4",
}


def gguf_quantization(path: str | os.PathLike) -> str:
    """The quantization that serves the file as it comes: that of the type holding most of its
    layers' matrix weights (Q8_0, Q6_K, Q5_K, Q5_0, Q5_1: int8; Q4_0, Q4_1, Q4_K: int4; float
    types: none). Under int4 the matrices of a wider type stay int8 (`gguf_eight_bit_weights`)."""
    gguf = import_gguf()
    counts: dict[str, int] = {}
    for t in open_gguf(path).tensors:
        if t.name.startswith("blk.") and len(t.shape) >= 2:  # matrices and stacked experts
            kept = _KEPT_AS.get(gguf.GGMLQuantizationType(t.tensor_type).name, "none")
            counts[kept] = counts.get(kept, 0) + int(t.n_elements)
    return max(counts, key=counts.get) if counts else "none"


def gguf_eight_bit_weights(path: str | os.PathLike) -> set[str]:
    """Hugging Face names of the file's matrices that a model served as int4 holds in int8: those
    whose type has more than 4 bits (or is a float type), e.g. the Q6_K value and FFN-down
    matrices of a Q4_K_M file, which llama.cpp keeps at 6 bits on purpose."""
    gguf = import_gguf()
    reader = open_gguf(path)
    arch = gguf_architecture(reader)
    names = gguf_tensor_names(arch, int(field(reader, f"{arch}.block_count")))
    return {
        names[t.name]
        for t in reader.tensors
        if t.name in names
        and len(t.shape) == 2
        and _KEPT_AS.get(gguf.GGMLQuantizationType(t.tensor_type).name, "none") != "int4"
    }


def direct_tensors(
    path: str | os.PathLike, param_of: Callable[[str], str | None], held_bits: dict[str, int]
) -> set[str]:
    """GGUF names of the Q8_0 / Q4_0 tensors to read as their blocks (models/gguf_blocks.py):
    those filling a parameter of `held_bits` (parameter -> the bits the quantizer holds it at, in
    groups of 32) all of whose tensors have that many bits. `param_of`: a Hugging Face name ->
    the parameter it fills (None: none)."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader)
    if arch == "gpt2":  # matrices stored [out, in] for Conv1D's [in, out]: blocks across rows
        return set()
    names = gguf_tensor_names(arch, int(field(reader, f"{arch}.block_count")))
    kinds: dict[str, set[int | None]] = {}  # parameter -> the bits of the tensors filling it
    param_of_tensor: dict[str, str] = {}
    for t in reader.tensors:
        param = param_of(names[t.name].format(0)) if t.name in names else None
        if param is not None:
            kinds.setdefault(param, set()).add(block_bits(t))
            param_of_tensor[t.name] = param
    return {
        name
        for name, param in param_of_tensor.items()
        if param in held_bits and kinds[param] == {held_bits[param]}
    }


def iter_gguf_tensors(
    path: str | os.PathLike, as_blocks: Collection[str] = ()
) -> Iterator[tuple[str, Tensor | QuantBlocks]]:
    """(Hugging Face name, fp32 tensor) for every tensor of the file, dequantized one at a time;
    the GGUF tensors named in `as_blocks` (Q8_0 / Q4_0) come as their blocks instead
    (models/gguf_blocks.py)."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader)
    names = gguf_tensor_names(arch, int(field(reader, f"{arch}.block_count")))
    num_heads = int(field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(field(reader, f"{arch}.attention.head_count_kv", num_heads))
    for t in reader.tensors:
        if t.name in ROPE_TENSORS:  # rope scaling, read into the config (models/gguf_metadata.py)
            continue
        if t.name not in names:
            raise ValueError(f"GGUF tensor {t.name!r} has no counterpart in a {arch!r} model")
        hf_name = names[t.name]
        w: Tensor | QuantBlocks = read_blocks(t) if t.name in as_blocks else dequantize(t)
        if arch == "llama" and t.name.endswith("attn_q.weight"):
            w = _unpermute(w, num_heads)
        elif arch == "llama" and t.name.endswith("attn_k.weight"):
            w = _unpermute(w, num_kv_heads)
        elif arch == "gpt2" and isinstance(w, Tensor) and w.ndim == 2 and t.name.startswith("blk."):
            w = w.t()  # back to Conv1D's [in, out]
        elif arch in GEMMA_ARCHITECTURES and t.name.endswith("norm.weight"):
            w = (
                w - 1.0
            )  # the file holds Gemma's 1 + w; exact in fp32, and models/gemma.py adds the 1 back exactly
        if (
            "{}" in hf_name
        ):  # stacked experts [E, out, in]: under the per-expert names checkpoints use
            for e in range(w.shape[0]):
                yield hf_name.format(e), w[e]
            continue
        yield hf_name, w


def dequantize(t) -> Tensor:
    """A GGUF reader tensor as fp32, in PyTorch's dimension order; ValueError for a type not read."""
    gguf = import_gguf()

    qtype = gguf.GGMLQuantizationType(t.tensor_type)
    if qtype.name not in TENSOR_TYPES:
        raise ValueError(
            f"GGUF tensor {t.name!r} has type {qtype.name}, which kvserve does not read; "
            f"supported tensor types: {', '.join(TENSOR_TYPES)}"
        )
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
    if qtype == gguf.GGMLQuantizationType.F32:
        values = np.array(t.data)  # a copy: the reader's array is a read-only memory map
    else:
        values = gguf.quants.dequantize(t.data, qtype)
    return torch.from_numpy(values).reshape(shape)


def _unpermute(w: Tensor | QuantBlocks, num_heads: int) -> Tensor | QuantBlocks:
    """Inverse of llama.cpp's q/k permutation: per head, interleaved rotary pairs back to halves
    (a row permutation: a matrix's blocks, q and d, take it alike)."""
    if isinstance(w, QuantBlocks):
        return w.apply(lambda x: _unpermute(x, num_heads))
    # [out, in] -> [heads, out / heads / 2, 2, in] -> swap -> [heads, 2, out / heads / 2, in]
    return (
        w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )
