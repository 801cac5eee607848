"""Tiny GGUF files built at test time (no network): a `make_checkpoint` model rewritten as
llama.cpp's converter writes it, so kvserve and `transformers` can both load it.

The weights get GGUF names, llama-family q/k rows are permuted for llama.cpp's rotary layout,
GPT-2's Conv1D weights are stored [out, in], matrices are stored in `tensor_type` (one type, or a
K-quant mix such as "Q4_K_M"; norms, biases and GPT-2's position table stay F32, as llama.cpp
keeps them) and the byte-level BPE
tokenizer goes in as tokenizer model "gpt2" with its merges and the ChatML chat template.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from checkpoints import make_checkpoint
from gemma_checkpoints import make_gemma_checkpoint
from kquants import K_TYPES, quantize_k
from kvserve.models.checkpoint_writer import CHAT_TEMPLATE, SPECIAL_TOKENS
from kvserve.models.gguf_loader import gguf_tensor_names
from kvserve.models.gguf_metadata import llama3_factors

GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gpt2": "gpt2",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
}
GEMMA = ("gemma2", "gemma3")
MOE = ("qwen3_moe", "mixtral")


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotary halves become interleaved pairs."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def make_gguf(
    out_dir: str | Path,
    family: str = "llama",
    tensor_type: str = "F32",
    tokenizer_pre: str = "default",
    add_bos: bool | None = False,
    **overrides,
) -> Path:
    """Write `out_dir/model.gguf` from a tiny random `family` checkpoint (made in out_dir/hf);
    `tokenizer_pre` is the pre-tokenizer type the file names, `add_bos` its add_bos_token (None:
    the file does not say)."""
    out_dir = Path(out_dir)
    if family in MOE:  # experts as 3-D tensors, the way llama.cpp stacks them
        overrides["fused_experts"] = True
    make = make_gemma_checkpoint if family in GEMMA else make_checkpoint
    hf_dir = Path(make(out_dir / "hf", family, **overrides))
    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[family]
    path = out_dir / "model.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    _add_config(writer, config, arch)
    _add_tokenizer(
        writer, json.loads((hf_dir / "tokenizer.json").read_text()), tokenizer_pre, add_bos
    )
    to_gguf = {hf: name for name, hf in gguf_tensor_names(arch, _num_layers(config)).items()}
    for hf_name, w in _expert_stacks(load_file(hf_dir / "model.safetensors")):
        if hf_name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        w = w.float().numpy()  # as the converter does first (bf16 included)
        if arch in GEMMA and hf_name.endswith("norm.weight"):
            w = w + np.float32(1)  # the converter stores Gemma's 1 + w (in fp32)
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, config["num_attention_heads"])
        if arch == "llama" and hf_name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, config["num_key_value_heads"])
        if arch == "gpt2" and w.ndim == 2 and ".h." in hf_name:
            w = np.ascontiguousarray(w.T)  # Conv1D [in, out] -> [out, in]
        if arch == "gpt2" and not hf_name.startswith(("transformer.", "lm_head.")):
            hf_name = "transformer." + hf_name
        name = to_gguf.get(hf_name) or to_gguf[hf_name.replace(".experts.", ".experts.{}.")]
        qtype = gguf.GGMLQuantizationType[tensor_type_of(name, tensor_type)]
        if (
            w.ndim >= 2
            and name != "position_embd.weight"
            and not name.endswith("ffn_gate_inp.weight")
            and qtype != gguf.GGMLQuantizationType.F32
        ):  # (llama.cpp keeps the router in F32)
            writer.add_tensor(name, _quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if arch == "llama" and rope.get("rope_type") == "llama3":  # as llama.cpp's converter writes it
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        writer.add_tensor(
            "rope_freqs.weight",
            llama3_factors(
                head_dim,
                rope["rope_theta"],
                rope["factor"],
                rope["low_freq_factor"],
                rope["high_freq_factor"],
                rope["original_max_position_embeddings"],
            ),
        )
    if arch == "phi3":
        _add_phi3(writer, config)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# llama.cpp's K-quant mixes (its `llama_tensor_get_type`, simplified): the value and FFN-down
# matrices and the output matrix one step up, at Q6_K; every other matrix at the base type.
MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
_MIX_HIGH = (".attn_v.weight", ".ffn_down.weight")


def tensor_type_of(name: str, tensor_type: str) -> str:
    """The type a matrix `name` gets in a file of `tensor_type` (one type, or a mix in `MIXES`)."""
    if tensor_type not in MIXES:
        return tensor_type
    return "Q6_K" if name.endswith(_MIX_HIGH) or name == "output.weight" else MIXES[tensor_type]


def _expert_stacks(tensors: dict[str, torch.Tensor]):
    """transformers' stacked experts (`mlp.experts.gate_up_proj` [E, 2I, H]) as llama.cpp's
    `ffn_{gate,up,down}_exps` [E, out, in] (named here `mlp.experts.{gate,up,down}_proj.weight`)."""
    for name, w in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = w.chunk(2, dim=1)
            yield name.replace("gate_up_proj", "gate_proj.weight"), gate.contiguous()
            yield name.replace("gate_up_proj", "up_proj.weight"), up.contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            yield name + ".weight", w
        else:
            yield name, w


def _quantize(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if qtype.name in K_TYPES:  # the gguf package cannot quantize to these (tests/kquants.py)
        return quantize_k(w, qtype.name)
    return gguf.quants.quantize(w, qtype)


def _num_layers(config: dict) -> int:
    return config.get("num_hidden_layers", config.get("n_layer"))


def _add_config(writer: gguf.GGUFWriter, c: dict, arch: str) -> None:
    if arch == "gpt2":
        writer.add_context_length(c["n_positions"])
        writer.add_embedding_length(c["n_embd"])
        writer.add_block_count(c["n_layer"])
        writer.add_feed_forward_length(c["n_inner"] or 4 * c["n_embd"])
        writer.add_head_count(c["n_head"])
        writer.add_layer_norm_eps(c["layer_norm_epsilon"])
        return
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if arch in GEMMA:
        _add_gemma_config(writer, c)
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    if arch != "gemma3":
        writer.add_rope_freq_base(
            c.get("rope_theta") or c.get("rope_parameters", {}).get("rope_theta", 10000.0)
        )
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch != "phi3":  # (its own: `_add_phi3`)
        writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(c["vocab_size"])
    num_experts = c.get("num_experts") or c.get("num_local_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(c["num_experts_per_tok"])
        if c.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(c["moe_intermediate_size"])


def _add_gemma_config(writer: gguf.GGUFWriter, c: dict) -> None:
    """llama.cpp's Gemma keys: window, soft-capping, which layers slide, Gemma 3's rotary bases."""
    writer.add_sliding_window(c["sliding_window"])
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if c.get(key) is not None:
            getattr(writer, f"add_{key}")(c[key])
    if c["model_type"] == "gemma3_text":
        full, local = (
            c["rope_parameters"]["full_attention"],
            c["rope_parameters"]["sliding_attention"],
        )
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_freq_base_swa(local["rope_theta"])
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])


def _add_phi3(writer: gguf.GGUFWriter, c: dict) -> None:
    """What llama.cpp's converter adds for Phi-3: rotary dims, sliding window, LongRoPE factors."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rotary_dim = int(
        head_dim * (rope.get("partial_rotary_factor") or c.get("partial_rotary_factor") or 1.0)
    )
    writer.add_rope_dimension_count(rotary_dim)
    writer.add_sliding_window(c.get("sliding_window") or 0)
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):
        original = c["original_max_position_embeddings"]
        scale = c["max_position_embeddings"] / original
        writer.add_rope_scaling_orig_ctx_len(original)
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_attn_factors(attn_factor)
        writer.add_tensor(
            "rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)
        )
        writer.add_tensor(
            "rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)
        )


def _add_tokenizer(
    writer: gguf.GGUFWriter, tokenizer: dict, pre: str, add_bos: bool | None
) -> None:
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_pad_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)


SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there!",
    "A journey of a thousand miles",
    "begins with a single step.",
    "Tokenizers split text into pieces; models read the pieces.",
    "def add(a, b):\n    return a + b",
    "Numbers like 12, 345 and 6789 appear too.",
    "Zürich, naïve café, Ελλάδα",
    "llama.cpp and kvserve read the same file",
    "  indented lines keep their spaces",
    "new\nlines\n\nand tabs\there",
]


def make_spm_gguf(out_dir: str | Path, add_space_prefix: bool = True):
    """A tokenizer-only GGUF with a SentencePiece BPE vocabulary (tokenizer model "llama", as Llama
    2 and Mistral files have) trained here with byte fallback and no normalization, as Llama's;
    -> (path, the trained `sentencepiece` processor: the reference)."""
    import io

    import sentencepiece as spm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS * 4),
        model_writer=buffer,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_space_prefix,
        split_digits=True,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=buffer.getvalue())
    path = out_dir / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_config(
        writer,
        dict(
            max_position_embeddings=128,
            hidden_size=32,
            num_hidden_layers=1,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            rms_norm_eps=1e-6,
            vocab_size=sp.get_piece_size(),
        ),
        "llama",
    )
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    writer.add_token_types(
        [
            gguf.TokenType.UNKNOWN
            if sp.is_unknown(i)
            else gguf.TokenType.CONTROL
            if sp.is_control(i)
            else gguf.TokenType.BYTE
            if sp.is_byte(i)
            else gguf.TokenType.NORMAL
            for i in range(sp.get_piece_size())
        ]
    )
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path, sp
