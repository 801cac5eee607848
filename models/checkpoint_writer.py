"""Writes a Hugging Face checkpoint directory: the one writer behind the default model, the
tests' tiny random models and the benchmarks' real-shaped ones.

What it writes is what a checkpoint on the Hub holds, so kvserve and `transformers` both load
it: `config.json`, the weights (`model.safetensors`, or shards plus
`model.safetensors.index.json` when a size is given), `generation_config.json`, and a ChatML
tokenizer (`tokenizer.json`, `tokenizer_config.json` with the chat template,
`special_tokens_map.json`). `random_tensors` makes seeded random weights for any supported
family, for the tests and benchmarks.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
EOS_TOKEN_IDS = [
    0,
    SPECIAL_TOKENS.index("<|im_end|>"),
]  # <|endoftext|> and <|im_end|> both end a turn


def decoder_shape(
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    **fields,
) -> dict:
    """The size fields of a Llama-family config.json, plus `fields`, with the special-token ids
    (`SPECIAL_TOKENS`) of every checkpoint written here."""
    return dict(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        bos_token_id=0,
        eos_token_id=0,
        **fields,
    )


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_tokenizer(
    out: str | Path, tokenizer: Tokenizer, model_max_length: int | None = None
) -> None:
    """A fast tokenizer whose first ids are `SPECIAL_TOKENS`, with the ChatML chat template
    (`model_max_length` None: no limit of its own, as `transformers` reads a missing one)."""
    out = Path(out)
    tokenizer.save(str(out / "tokenizer.json"))
    specials = {
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "additional_special_tokens": SPECIAL_TOKENS[1:],
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    write_json(out / "tokenizer_config.json", config)
    write_json(out / "special_tokens_map.json", specials)


def write_weights(
    out: str | Path, tensors: Iterable[tuple[str, torch.Tensor]], shard_bytes: int | None = None
) -> None:
    """Tensors in name order of arrival: one `model.safetensors`, or, with `shard_bytes`, shards
    of at most that size (one tensor may exceed it) and the index `transformers` reads. Shards
    are written as they fill, so a model larger than host memory can stream from the device."""
    from safetensors.torch import save_file

    out = Path(out)
    shards: list[list[str]] = []  # tensor names per written shard
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            save_file(
                pending, str(out / f"shard-{len(shards) + 1:05d}.tmp"), metadata={"format": "pt"}
            )
            shards.append(list(pending))
            pending, pending_bytes = {}, 0

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard_bytes is not None and pending and pending_bytes + nbytes > shard_bytes:
            flush()
        pending[name] = tensor.contiguous()
        pending_bytes += nbytes
        total += nbytes
    flush()
    if shard_bytes is None:
        (out / "shard-00001.tmp").rename(out / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        (out / f"shard-{i:05d}.tmp").rename(out / file)
        weight_map.update(dict.fromkeys(names, file))
    write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def write_checkpoint(
    out: str | Path,
    config: dict,
    tensors: Iterable[tuple[str, torch.Tensor]],
    tokenizer: Tokenizer,
    shard_bytes: int | None = None,
) -> Path:
    """The whole checkpoint directory; `config` is config.json's content (with `architectures`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_weights(out, tensors, shard_bytes)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": EOS_TOKEN_IDS})
    write_tokenizer(
        out, tokenizer, config.get("max_position_embeddings") or config.get("n_positions")
    )
    return out


def random_tensors(
    config: dict,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    init: str = "hf",
    matrix_scale: float = 1.0,
    std: float = 0.02,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights for `config`'s architecture, tied weights once.

    init "hf": `transformers`' own initialization (the model is built on the CPU), with every
    matrix scaled by `matrix_scale`; "normal": N(0, std) matrices, ones for norm weights and
    zeros for biases, made one tensor at a time on `device` (for shapes too large for the host)."""
    import torch
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config)
    torch_dtype = getattr(torch, dtype)
    if init == "hf":
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        seen: set[int] = set()
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                if tensor.data_ptr() in seen:  # a tied weight: stored once, under its first name
                    continue
                seen.add(tensor.data_ptr())
                yield name, (tensor * matrix_scale if tensor.dim() > 1 else tensor).to(torch_dtype)
        return
    if init != "normal":
        raise ValueError(f"init must be 'hf' or 'normal', got {init!r}")
    with torch.device("meta"):
        shapes = {
            name: p.shape
            for name, p in transformers.AutoModelForCausalLM.from_config(
                hf_config
            ).named_parameters()
        }
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in shapes.items():
        if len(shape) > 1:
            yield (
                name,
                torch.empty(shape, dtype=torch_dtype, device=device).normal_(
                    0.0, std, generator=gen
                ),
            )
        else:
            fill = 1.0 if name.endswith("weight") else 0.0  # norm weights, biases
            yield name, torch.full(shape, fill, dtype=torch_dtype, device=device)
