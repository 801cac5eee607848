"""Build a model without random init and stream its safetensors weights in; checkpoint facts.

Loading fails loudly: a missing, unexpected or mis-shaped weight raises `ValueError`
naming it. Pickle checkpoints (`*.bin`, `*.pt`) are refused: unpickling can run code.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import Tensor, nn

from kvserve.models import cpu_ops
from kvserve.models.attention import Attention, select_backend
from kvserve.models.cpu_model import CpuFusedOps, pack_for_cpu, quantized_onto_huge_pages
from kvserve.models.fused_ops import TORCH_OPS, FusedOps
from kvserve.models.gguf_blocks import QuantBlocks
from kvserve.models.gguf_loader import (
    direct_tensors,
    gguf_eight_bit_weights,
    gguf_quantization,
    iter_gguf_tensors,
)
from kvserve.models.gguf_metadata import close_gguf_files, find_gguf, is_gguf
from kvserve.models.heap import release_free_memory
from kvserve.models.layers import LazyTensor, default_weight_loader
from kvserve.models.parallel import ParallelState, tensor_parallel
from kvserve.models.quantization import DEFAULT_GROUP_SIZE, QuantizationReport
from kvserve.models.quantizer import Quantizer, check_quantizable, mark_for_staging, weight_bytes
from kvserve.models.registry import get_model_class
from kvserve.models.timing import phase

if TYPE_CHECKING:
    from transformers import PretrainedConfig

HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]


def checkpoint_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files to read: those of `model.safetensors.index.json`, else `*.safetensors`."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} lists shards that are not in {root}: {absent}")
        return files
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    files = sorted(root.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for ext in ("*.bin", "*.pt", "*.pth") for p in root.glob(ext))
    if pickles:
        raise ValueError(
            f"{root} has only pickle checkpoints ({', '.join(pickles)}); kvserve loads safetensors only "
            "because unpickling can execute code. Convert them first, e.g. "
            "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir, safe_serialization=True)`."
        )
    raise ValueError(f"no *.safetensors weights in {root}")


def iter_checkpoint_lazy(
    model_dir: str | os.PathLike, as_blocks: Collection[str] = ()
) -> Iterator[tuple[str, LazyTensor | QuantBlocks]]:
    """(name, tensor not yet read) for every checkpoint tensor: a weight loader reads what it
    keeps (a tensor-parallel rank its slice); valid until the next item. A GGUF file's
    tensors come dequantized, under their Hugging Face names, those named in `as_blocks` as
    their blocks (models/gguf_blocks.py)."""
    if is_gguf(model_dir):
        for name, tensor in iter_gguf_tensors(model_dir, as_blocks):
            yield name, tensor if isinstance(tensor, QuantBlocks) else LazyTensor(tensor)
        return
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, LazyTensor(file=f, name=name)


def packed_name(model: nn.Module, name: str) -> str:
    """A checkpoint weight's parameter name in `model` (`.v_proj.` -> `.qkv_proj.`)."""
    name = getattr(model, "map_weight_name", lambda n: n)(name) or name
    for src, (dst, _) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{src}." in name:
            return name.replace(f".{src}.", f".{dst}.")
    return name


def load_weights(
    model: nn.Module,
    model_dir: str | os.PathLike,
    on_loaded: Callable[[str], None] | None = None,
    quantizer: Quantizer | None = None,
) -> set[str]:
    """Copy every checkpoint tensor through its parameter's `weight_loader`; return the loaded names.

    Names go through `model.map_weight_name` (None = skip, e.g. rotary buffers; a (name, shard id)
    pair = a shard the model names itself, e.g. one expert's matrix of stacked experts) and
    `model.packed_modules_mapping` (e.g. `.q_proj.` -> `.qkv_proj.` shard "q"). A
    packed parameter counts as loaded once all of its shards are; then `on_loaded(name)` runs
    (the quantizer: each matrix is quantized as soon as it is whole). With a `quantizer`, a GGUF
    file's Q8_0 / Q4_0 matrices that it holds as they stand (`direct_tensors`) come as blocks,
    which the weight loaders copy into its staging (`Quantizer.stage_blocks`) as they would floats.
    """
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())  # a checkpoint may carry some (BART's final_logits_bias)
    mapping: dict = getattr(model, "packed_modules_mapping", {})
    map_name = getattr(model, "map_weight_name", lambda name: name)
    loaded: set[str] = set()
    shards_loaded: dict[str, set] = defaultdict(set)
    unexpected: list[str] = []
    as_blocks = set() if quantizer is None else _direct_tensors(model, model_dir, quantizer)
    for ckpt_name, tensor in iter_checkpoint_lazy(model_dir, as_blocks):
        name = map_name(ckpt_name)
        if name is None:
            continue
        shard_id = None
        if isinstance(
            name, tuple
        ):  # the model names the shard itself (one expert of stacked experts)
            name, shard_id = name
        else:
            for src, (dst, sid) in mapping.items():
                if f".{src}." in name:
                    name, shard_id = name.replace(f".{src}.", f".{dst}."), sid
                    break
        param = params.get(name)
        if param is None and name in buffers:
            with torch.no_grad():
                buffers[name].copy_(tensor.read())
            continue
        if param is None:
            unexpected.append(ckpt_name)
            continue
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        targets: list[tuple[Tensor, LazyTensor | QuantBlocks]] = [(param, tensor)]
        if isinstance(tensor, QuantBlocks) and quantizer is not None:
            # q and d, each loaded as the weight would be, into the quantizer's staging
            q, d = quantizer.stage_blocks(name)
            targets = [(q, LazyTensor(tensor.q)), (d, LazyTensor(tensor.d))]
        try:
            for target, part in targets:
                weight_loader(target, part, *(() if shard_id is None else (shard_id,)))
        except ValueError as e:
            raise ValueError(
                f"cannot load checkpoint weight {ckpt_name!r} into {name!r}: {e}"
            ) from None
        if shard_id is None:
            loaded.add(name)
        else:
            shards_loaded[name].add(shard_id)
        if on_loaded is not None and (
            shard_id is None or set(param.shard_ids) <= shards_loaded[name]
        ):
            on_loaded(name)
    if unexpected:
        raise ValueError(
            f"checkpoint has {len(unexpected)} weights the model does not expect "
            f"(config and checkpoint disagree?): {unexpected[:10]}"
        )
    loaded |= {n for n, got in shards_loaded.items() if set(params[n].shard_ids) <= got}
    # a weight a checkpoint may leave out because its writer tied it to another (`model.tied_fallbacks`:
    # name -> the parameter it equals then), e.g. T5 v1.1's head as transformers >= 5 saves it
    for name, source in getattr(model, "tied_fallbacks", {}).items():
        if name in params and name not in loaded and source in loaded:
            with torch.no_grad():
                params[name].copy_(params[source])
            loaded.add(name)
    missing = _describe_missing(params, loaded, shards_loaded, mapping)
    if missing:
        raise ValueError(
            f"checkpoint in {model_dir} is missing {len(missing)} weights: {missing[:10]}"
        )
    return loaded


def _direct_tensors(
    model: nn.Module, model_dir: str | os.PathLike, quantizer: Quantizer
) -> set[str]:
    """The GGUF tensors `quantizer` takes as their blocks (none from a safetensors checkpoint)."""
    held = quantizer.held_bits()
    if not held or not is_gguf(model_dir):
        return set()
    return direct_tensors(model_dir, lambda name: _param_name(model, name), held)


def _param_name(model: nn.Module, ckpt_name: str) -> str | None:
    """The parameter a checkpoint tensor fills (None: skipped), as `load_weights` maps it."""
    name = getattr(model, "map_weight_name", lambda n: n)(ckpt_name)
    if name is None or isinstance(name, tuple):  # (name, shard id): a part the model names itself
        return None if name is None else name[0]
    return packed_name(model, name)


def _describe_missing(
    params: dict, loaded: set[str], shards_loaded: dict, mapping: dict
) -> list[str]:
    """Missing names as the checkpoint would spell them (`k_proj`, not `qkv_proj`)."""
    missing = []
    for name in sorted(set(params) - loaded):
        shard_ids = getattr(params[name], "shard_ids", None)
        if not shard_ids:
            missing.append(name)
            continue
        for sid in shard_ids:
            if sid in shards_loaded.get(name, ()):
                continue
            src = next((s for s, (d, i) in mapping.items() if i == sid and f".{d}." in name), None)
            missing.append(
                name.replace(f".{mapping[src][0]}.", f".{src}.") if src else f"{name}[{sid}]"
            )
    return missing


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace meta parameters/buffers by uninitialized tensors, keeping parameter attributes
    (`weight_loader`, `shard_ids`); `nn.Module.to_empty` would drop them."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in done:
                # weights loaded to be quantized: models/quantizer.mark_for_staging
                param_dtype, param_device = (
                    getattr(param, "stage_dtype", dtype),
                    getattr(param, "stage_device", device),
                )
                new = nn.Parameter(
                    torch.empty(param.shape, dtype=param_dtype, device=param_device),
                    requires_grad=False,
                )
                new.__dict__.update(param.__dict__)
                done[id(param)] = new
            module._parameters[name] = done[id(param)]
        for name, buf in module._buffers.items():
            if buf is not None:
                buf_dtype = dtype if buf.is_floating_point() else buf.dtype
                module._buffers[name] = torch.empty(buf.shape, dtype=buf_dtype, device=device)
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()


def resolve_quantization(requested: str | None, model_path: str | os.PathLike) -> str:
    """The quantization to apply: the one requested, else a GGUF file's own (its weights' type),
    else none."""
    if requested is not None:
        return requested
    return gguf_quantization(model_path) if is_gguf(model_path) else "none"


def load_model(
    model_dir: str,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    attention_backend: str = "auto",
    parallel: ParallelState | None = None,
    quantization: str | None = None,
    quantization_group_size: int = DEFAULT_GROUP_SIZE,
    max_model_len: int | None = None,
) -> nn.Module:
    """The model for `hf_config` in eval mode on `device`, weights loaded from `model_dir`, with
    the device's attention backend and fused ops bound to its layers (chosen here, once).
    With `parallel` (tensor parallelism) the layers hold, and load, that rank's shard only.
    `quantization` (int8, int4, fp8, none; None: `resolve_quantization`'s choice) is applied as the
    weights load; `model.weights_report` says the format and the bytes. `max_model_len` (None: the
    model's own limit) reaches the modules whose numerics depend on it (`set_max_model_len`:
    LongRoPE's factors, models/phi3.py)."""
    cls = get_model_class(hf_config, model_dir)
    device = torch.device(device)
    method = resolve_quantization(quantization, model_dir)
    with phase("model"):
        with torch.device("meta"), tensor_parallel(parallel or ParallelState()):
            model = cls(hf_config)
        if max_model_len is not None:
            for module in model.modules():
                if hasattr(module, "set_max_model_len"):
                    module.set_max_model_len(max_model_len)
        if method != "none":
            check_quantizable(model, quantization_group_size)  # before any weight is read
            # quantized from the checkpoint's own values: a GGUF file's are exact in fp32, so
            # quantizing them again gives its blocks (each matrix is freed once quantized)
            mark_for_staging(model)
        _materialize(model, dtype, device)
    quantizer = None
    if method != "none":
        if device.type == "cpu":
            cpu_ops.load()  # the quantized layout is the kernel's where it runs
        eight_bit = frozenset()
        if (
            quantization is None and method == "int4" and is_gguf(model_dir)
        ):  # as it comes: wider matrices int8
            eight_bit = frozenset(packed_name(model, n) for n in gguf_eight_bit_weights(model_dir))
        quantizer = Quantizer(model, method, quantization_group_size, dtype, device, eight_bit)
    with phase("weights"):  # a quantized model: each matrix quantized as soon as it is loaded
        load_weights(model, model_dir, None if quantizer is None else quantizer.loaded, quantizer)
    close_gguf_files()
    report = QuantizationReport("none", 0, 0, 0) if quantizer is None else quantizer.finish()
    if device.type == "cpu":
        with phase("kernels"):  # the cached library; the first use builds it (docs/performance.md)
            cpu_ops.load()
        if dtype == torch.bfloat16:
            with phase("CPU packing"):
                pack_for_cpu(model)
        if quantizer is not None:
            quantized_onto_huge_pages(model)
    report.weight_bytes = weight_bytes(model)
    model.weights_report = report
    attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
    backend = select_backend(
        attention_backend, device, dtype, {layer.head_dim for layer in attn_layers}
    )
    for layer in attn_layers:
        layer.backend = backend
    bind_ops(model, select_ops(device, dtype, backend.name))
    release_free_memory(collect_cycles=False)
    return model.eval()


def get_max_model_len(hf_config: PretrainedConfig) -> int:
    """Longest sequence the model supports (`max_position_embeddings`, GPT-2's `n_positions`)."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    if getattr(
        hf_config, "relative_attention_num_buckets", None
    ):  # T5: relative positions, no table
        return RELATIVE_POSITION_MAX_LEN
    raise ValueError(
        "cannot tell the model's maximum length: config has no max_position_embeddings"
    )


# T5 has no position table to bound its length; it was trained on 512-token inputs and targets
# (`--max-model-len` raises it for a model trained longer).
RELATIVE_POSITION_MAX_LEN = 512


def get_decoder_start_token_id(model_dir: str, hf_config: PretrainedConfig) -> int | None:
    """The first decoder token of an encoder-decoder model (its config's, else generation_config.json's,
    else its pad id, as transformers falls back); None for a decoder-only model."""
    if not getattr(hf_config, "is_encoder_decoder", False):
        return None
    for source in (
        hf_config.to_dict() if hasattr(hf_config, "to_dict") else {},
        _generation_config(model_dir),
    ):
        if source.get("decoder_start_token_id") is not None:
            return int(source["decoder_start_token_id"])
    pad = getattr(hf_config, "pad_token_id", None)
    if pad is None:
        raise ValueError(
            "the encoder-decoder config names no decoder_start_token_id and no pad_token_id"
        )
    return int(pad)


def _generation_config(model_dir: str) -> dict:
    path = Path(model_dir) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def get_eos_token_ids(model_dir: str, hf_config: PretrainedConfig) -> list[int]:
    """EOS ids from generation_config.json (an int or a list), else from the model config."""
    ids: list[int] = []
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        ids = _as_id_list(json.loads(gen_path.read_text()).get("eos_token_id"))
    if not ids:
        ids = _as_id_list(getattr(hf_config, "eos_token_id", None))
    return list(dict.fromkeys(ids))


def resolve_model_path(name_or_path: str) -> str:
    """A local checkpoint directory as-is; otherwise a Hugging Face Hub id, downloaded (or found in
    the local Hub cache) with only the files kvserve reads. A GGUF checkpoint is its file: a
    `.gguf` path, or the one `.gguf` of a directory without safetensors weights."""
    path = Path(name_or_path).expanduser()
    if is_gguf(path):
        return str(path)
    if path.is_dir():
        gguf_file = find_gguf(path)
        return str(gguf_file if gguf_file is not None else path)
    if path.exists() or name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1:
        raise ValueError(f"model path {name_or_path!r} is not a directory or a .gguf file")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise ValueError(
            f"{name_or_path!r} is not a local directory and huggingface_hub is missing"
        ) from e
    try:
        return snapshot_download(repo_id=name_or_path, allow_patterns=HUB_ALLOW_PATTERNS)
    except Exception as online_error:  # offline, unknown repo, gated, ...
        try:
            return snapshot_download(
                repo_id=name_or_path, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=True
            )
        except Exception:
            pass
        raise ValueError(
            f"{name_or_path!r} is not a local directory and could not be fetched from the Hugging Face Hub "
            f"({type(online_error).__name__}: {online_error}). Pass a local checkpoint directory, "
            "or check the network / HF_TOKEN."
        ) from None


def select_ops(device: torch.device, dtype: torch.dtype, attention_backend: str) -> FusedOps:
    """The fused ops that go with the model's attention backend (Triton's also on the CPU, where
    only the interpreter runs them: the tests)."""
    if attention_backend == "triton":
        from kvserve.models.kernels.triton_ops import (
            TritonFusedOps,  # imports triton: only when chosen
        )

        return TritonFusedOps()
    if device.type == "cpu":
        return CpuFusedOps()
    return TORCH_OPS


def bind_ops(model: torch.nn.Module, ops: FusedOps) -> None:
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops
