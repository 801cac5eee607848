"""A GGUF file's metadata: its architecture, and its config and tokenizer as Hugging Face files.

Without torch, so that the API server process can load a GGUF file's tokenizer. transformers'
GGUF support (which converts the config, the tokenizer and the chat template from the file's
metadata) imports torch and takes seconds on a large vocabulary, so `gguf_metadata_dir` runs it
once per file and keeps what it made as an ordinary checkpoint directory (`config.json`,
tokenizer files) under `$KVSERVE_CACHE_DIR/gguf/`, keyed by the file's path, size and
modification time, transformers' version and this conversion's; every later load, in every
process, reads that.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.models.default_model import default_cache_root

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> the Hugging Face architecture kvserve serves it with.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# A `llama` file with experts (`llama.expert_count`) is a Mixtral.
MIXTRAL = "MixtralForCausalLM"
# Llama 3.1+ files store their rope scaling as per-frequency factors, not as the parameters
# transformers and kvserve compute them from; transformers drops the tensor, and so do we (warned).
ROPE_FREQS = "rope_freqs.weight"
# Phi-3's LongRoPE factors, read into the config's rope parameters (`_phi3_config`).
ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
ROPE_TENSORS = frozenset({ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT})
_DONE = "kvserve_gguf.json"  # written last: a directory with it is complete
_CONVERSION = 6  # part of the cache key: bump when `_convert` writes something else


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).endswith(".gguf") and Path(path).is_file()


def find_gguf(model_dir: str | os.PathLike) -> Path | None:
    """The one `*.gguf` of a directory without safetensors weights; None if it has none."""
    root = Path(model_dir)
    files = sorted(root.glob("*.gguf"))
    if not files or any(root.glob("*.safetensors")):
        return None
    if len(files) > 1:
        raise ValueError(
            f"{root} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
            "pass the path of the one to serve"
        )
    return files[0]


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` of the file (models/gguf_reader.py's, which reads metadata arrays in
    bulk), shared by the loader's steps; the tensors are memory-mapped."""
    path = Path(path).resolve()
    return _open_gguf(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int):
    import_gguf()
    from kvserve.models.gguf_reader import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises whatever numpy or struct hit first
        raise ValueError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from None


def close_gguf_files() -> None:
    """Forget the shared readers: their memory maps go (pages read stay resident while mapped)."""
    _open_gguf.cache_clear()


def import_gguf():
    try:
        import gguf
    except ImportError:
        raise ValueError(
            "reading a GGUF file needs the gguf package: pip install 'kvserve[gguf]'"
        ) from None
    return gguf


def field(reader, key: str, default: Any = None) -> Any:
    """Metadata value `key`; ValueError naming it when absent and no default is given."""
    value = reader.get_field(key)
    if value is None or not value.types:
        if default is None:
            raise ValueError(f"GGUF file has no {key!r} metadata")
        return default
    return value.contents()


def gguf_architecture(reader) -> str:
    """The file's `general.architecture`; ValueError naming it when kvserve does not serve it."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported GGUF architectures: "
            f"{', '.join(ARCHITECTURES)}"
        )
    return arch


def gguf_metadata_dir(path: str | os.PathLike) -> Path:
    """A checkpoint directory with the file's config.json and tokenizer files (made once, see the
    module doc); where the cache cannot be written, a temporary one. Warnings about the file (rope
    scaling factors that are not applied) are logged on every load."""
    path = Path(path).resolve()
    stat = path.stat()
    key = (
        f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{importlib.metadata.version('transformers')}"
        f"\0{_CONVERSION}"
    )
    target = (
        default_cache_root()
        / "gguf"
        / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    )
    if not (target / _DONE).is_file():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=target.parent))
        except OSError:  # a read-only cache: convert into a directory of our own
            staging = target = Path(tempfile.mkdtemp(prefix="kvserve-gguf-"))
        try:
            _convert(path, staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if staging != target:
            try:
                staging.rename(target)
            except OSError:  # another process finished first: keep its directory
                shutil.rmtree(staging, ignore_errors=True)
    for warning in json.loads((target / _DONE).read_text())["warnings"]:
        logger.warning("%s %s", path, warning)
    return target


# llama.cpp's layer counts of Gemma 2 27B and Gemma 3 27B: the only sizes whose query scale is
# 1 / sqrt(hidden / heads) (their query_pre_attn_scalar) rather than 1 / sqrt(head_dim)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_config(config, reader, arch: str) -> None:
    """What transformers' GGUF conversion leaves at its defaults, set as llama.cpp reads the file:
    the query scale, the soft-capping values, which layers slide, and Gemma 3's two rotary bases
    (`rope.freq_base_swa`, else llama.cpp's 10000, for sliding layers; `rope.freq_base` and a
    linear `rope.scaling` for global ones)."""
    num_layers = int(config.num_hidden_layers)
    wide = num_layers == _GEMMA_27B_LAYERS[arch]
    config.query_pre_attn_scalar = (
        config.hidden_size // config.num_attention_heads if wide else config.head_dim
    )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = reader.get_field(f"{arch}.{key}")
        if value is not None:  # else transformers' default, which is llama.cpp's too
            setattr(config, key, float(value.contents()))
    # sliding_window_pattern: n (every n-th layer global), or one bool per layer (True = sliding)
    pattern = field(
        reader, f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6
    )
    sliding = (
        [bool(x) for x in pattern]
        if isinstance(pattern, list)
        else [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
    )
    config.layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    if arch == "gemma3":
        full = {
            "rope_type": "default",
            "rope_theta": float(field(reader, f"{arch}.rope.freq_base", 1_000_000.0)),
        }
        if field(reader, f"{arch}.rope.scaling.type", "none") == "linear":
            full.update(
                rope_type="linear", factor=float(field(reader, f"{arch}.rope.scaling.factor"))
            )
        local = {
            "rope_type": "default",
            "rope_theta": float(field(reader, f"{arch}.rope.freq_base_swa", 10000.0)),
        }
        config.rope_parameters = {"sliding_attention": local, "full_attention": full}


def llama3_factors(
    dim: int, theta: float, factor: float, low: float, high: float, old_len: float
) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as `rope_freqs.weight` for Llama 3's
    rope scaling (its formula, in fp32 like it)."""
    freqs = 1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    wavelen = np.float32(2 * math.pi) / freqs
    smooth = (old_len / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, mid)
    ).astype(np.float32)


def llama3_rope_parameters(factors: np.ndarray, theta: float, dim: int) -> dict | None:
    """Llama 3's rope parameters that give `factors` (a GGUF file's `rope_freqs.weight`), or None.

    The file keeps only the divisors; between the unscaled and the fully scaled frequencies they
    follow s = (L / wavelength - low) / (high - low), linear in 1 / wavelength, so two of them give
    L and high (with low = 1, Llama 3's; any (L, low, high) on that line gives the same divisors).
    Without two such points, Llama 3's published values are tried. Accepted only if the rule gives
    back every divisor."""
    if factors.shape != (dim // 2,) or not (factors >= 1).all():
        return None
    factor = float(factors.max())
    candidates = [(factor, 1.0, 4.0, float(2**k)) for k in range(8, 18)]
    freqs = 1.0 / (np.float64(theta) ** (np.arange(0, dim, 2) / dim))
    mid = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor > 1 and mid.sum() >= 2:
        x = freqs[mid] / (2 * math.pi)  # 1 / wavelength
        s = (1 / factors[mid].astype(np.float64) - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(x, s, 1)  # s = a x + b = (L x - low) / (high - low)
        if b < 0:
            high = 1 - 1 / b
            candidates.insert(
                0, (factor, 1.0, round(float(high), 4), round(float(a * (high - 1)), 2))
            )
    for factor_, low, high, old_len in candidates:
        if np.allclose(
            llama3_factors(dim, theta, factor_, low, high, old_len), factors, rtol=1e-5, atol=0
        ):
            return {
                "rope_type": "llama3",
                "rope_theta": theta,
                "factor": factor_,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(old_len),
            }
    return None


def _phi3_config(config, reader) -> None:
    """What transformers' conversion leaves out of a phi3 file's config, as llama.cpp's converter
    wrote it: partial rotary (`rope.dimension_count`), the sliding window (0: none) and LongRoPE
    (the `rope_factors_long/short` tensors, `rope.scaling.original_context_length`, and
    `rope.scaling.attn_factor` when it is not the default transformers computes)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", float(field(reader, "phi3.rope.freq_base", 10000.0)))
    params["rope_type"] = "default"
    rotary_dim = int(field(reader, "phi3.rope.dimension_count", head_dim))
    params["partial_rotary_factor"] = rotary_dim / head_dim
    window = int(field(reader, "phi3.attention.sliding_window", 0))
    config.sliding_window = window or None
    tensors = {t.name: t for t in reader.tensors}
    if ROPE_FACTORS_LONG in tensors and ROPE_FACTORS_SHORT in tensors:
        original = int(field(reader, "phi3.rope.scaling.original_context_length"))
        params.update(
            rope_type="longrope",
            original_max_position_embeddings=original,
            long_factor=np.array(tensors[ROPE_FACTORS_LONG].data, dtype=np.float32).tolist(),
            short_factor=np.array(tensors[ROPE_FACTORS_SHORT].data, dtype=np.float32).tolist(),
        )
        scale = config.max_position_embeddings / original
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        attn_factor = field(reader, "phi3.rope.scaling.attn_factor", default)
        if np.float32(attn_factor) != np.float32(
            default
        ):  # the file's own, not the default in float32
            params["attention_factor"] = float(attn_factor)
        config.original_max_position_embeddings = original
    if hasattr(config, "rope_parameters"):  # transformers >= 5
        config.rope_parameters = params
    else:
        config.partial_rotary_factor = params.pop("partial_rotary_factor")
        config.rope_theta = params.pop("rope_theta")
        config.rope_scaling = params if params["rope_type"] == "longrope" else None


# Byte-level BPE pre-tokenizer types whose words found whole in the vocabulary skip the merges
# (llama.cpp treats these so, as the tokenizers they were converted from do: Llama 3's and others').
IGNORE_MERGES_PRE = frozenset(
    {
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "tekken",
        "minicpm5",
        "youtu",
        "glm4",
        "glm5",
        "lfm2",
        "jina-v5-nano",
    }
)
# Byte-level BPE pre-tokenizer types that start a prompt with BOS when the file does not say
# (`tokenizer.ggml.add_bos_token`): what llama.cpp does for them (older Llama 3 files lack the key).
ADD_BOS_PRE = frozenset(
    {
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
        "tekken",
        "chameleon",
    }
)


def _bos_template(bos: str, bos_id: int) -> dict:
    """tokenizer.json's post-processor that puts BOS before each sequence (Llama 3's own)."""
    token = {"SpecialToken": {"id": bos, "type_id": 0}}
    return {
        "type": "TemplateProcessing",
        "single": [token, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            token,
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }


def _tokenizer_as_the_file_says(out: Path, reader) -> None:
    """Make the converted tokenizer split text as the file says, as llama.cpp does, and name the
    generic fast class so that it loads from tokenizer.json as written here (the family's class,
    Qwen2Tokenizer for a qwen2 file, would rebuild its own split from the vocabulary whatever the
    file says; the generic one also keeps no Python copy of the vocabulary).

    Byte-level BPE (`gpt2`): transformers' conversion already writes the split the file's
    pre-tokenizer type names; some types also take a word found whole in the vocabulary without
    merging (`IGNORE_MERGES_PRE`), and some start a prompt with BOS when the file does not say
    whether to (`ADD_BOS_PRE`). SentencePiece (`llama`): a space is put before every run of
    text (`add_space_prefix`, on unless the file says otherwise; decoding drops it again), where
    the conversion's Metaspace skipped it for text that already starts with a space."""
    model = field(reader, "tokenizer.ggml.model", "")
    if model not in ("gpt2", "llama"):
        return
    tokenizer_path = out / "tokenizer.json"
    tokenizer = json.loads(tokenizer_path.read_text())
    pre = field(reader, "tokenizer.ggml.pre", "")
    if model == "gpt2" and pre in IGNORE_MERGES_PRE:
        tokenizer["model"]["ignore_merges"] = True
    bos_id = field(reader, "tokenizer.ggml.bos_token_id", -1)
    if (
        model == "gpt2"
        and pre in ADD_BOS_PRE
        and reader.get_field("tokenizer.ggml.add_bos_token") is None
        and bos_id >= 0
    ):
        tokenizer["post_processor"] = _bos_template(
            field(reader, "tokenizer.ggml.tokens")[bos_id], bos_id
        )
    if model == "llama":
        prefix = field(reader, "tokenizer.ggml.add_space_prefix", True)
        spaces = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
        tokenizer["normalizer"] = {
            "type": "Sequence",
            "normalizers": ([{"type": "Prepend", "prepend": "\u2581"}] if prefix else [])
            + [spaces],
        }
        tokenizer["pre_tokenizer"] = None
        decoder = tokenizer.get("decoder") or {}
        if (
            not prefix and decoder.get("type") == "Sequence"
        ):  # no prefix to strip when decoding either
            decoder["decoders"] = [d for d in decoder["decoders"] if d.get("type") != "Strip"]
    tokenizer_path.write_text(json.dumps(tokenizer, ensure_ascii=False))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _convert(path: Path, out: Path) -> None:
    """transformers' config and tokenizer for the file, with what kvserve reads beyond them."""
    import transformers

    from kvserve.models.gguf_reader import bulk_arrays_everywhere

    reader = open_gguf(path)
    arch = gguf_architecture(reader)
    with bulk_arrays_everywhere():  # transformers reads the file twice, vocabulary included
        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config.architectures = [ARCHITECTURES[arch]]
    config = _with_experts(config, reader, arch)
    # A file without an output matrix ties the head to the embedding (llama.cpp does the same).
    config.tie_word_embeddings = not any(t.name == "output.weight" for t in reader.tensors)
    # transformers leaves Qwen3's head_dim and GPT-2's n_positions at their defaults
    config.max_position_embeddings = int(field(reader, f"{arch}.context_length"))
    head_dim = field(reader, f"{arch}.attention.key_length", 0)
    if head_dim and arch != "gpt2":
        config.head_dim = int(head_dim)
    warnings = []
    rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if rope_freqs is not None:
        theta = float(field(reader, f"{arch}.rope.freq_base", 10000.0))
        dim = int(field(reader, f"{arch}.rope.dimension_count", 0)) or int(
            config.hidden_size // config.num_attention_heads
        )
        params = llama3_rope_parameters(
            np.array(rope_freqs.data, dtype=np.float32).reshape(-1), theta, dim
        )
        if params is None:
            warnings.append(
                f"has rope scaling factors ({ROPE_FREQS}) that are not Llama 3's rule, which kvserve "
                "does not apply: rotary embedding as without rope scaling"
            )
        elif hasattr(config, "rope_parameters"):  # transformers >= 5
            config.rope_parameters = params
        else:
            config.rope_scaling = params
    if arch in ("gemma2", "gemma3"):
        _gemma_config(config, reader, arch)
    if arch == "phi3":
        _phi3_config(config, reader)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _tokenizer_as_the_file_says(out, reader)
    (out / _DONE).write_text(json.dumps({"source": str(path), "warnings": warnings}) + "\n")


def _with_experts(config, reader, arch: str):
    """A mixture of experts' fields that transformers' conversion leaves out: Qwen3-MoE's expert
    size; a `llama` file with experts becomes a Mixtral config (llama.cpp names both `llama`)."""
    import transformers

    num_experts = int(field(reader, f"{arch}.expert_count", 0))
    if arch == "qwen3moe":
        config.moe_intermediate_size = int(field(reader, f"{arch}.expert_feed_forward_length"))
    if arch == "llama" and num_experts:
        fields = {
            k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")
        }
        config = transformers.MixtralConfig(**fields)
        config.num_local_experts = num_experts
        config.num_experts_per_tok = int(field(reader, f"{arch}.expert_used_count"))
        config.sliding_window = None
        config.architectures = [MIXTRAL]
    return config
