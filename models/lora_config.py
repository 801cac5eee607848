"""A PEFT LoRA adapter's `adapter_config.json`: what kvserve serves and what it refuses (no torch:
the server checks an adapter with it before the engine reads the weights; docs/lora.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

# HF module names an adapter may target; embeddings and the LM head are refused
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def read_adapter_config(path: str | Path, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of the PEFT adapter at `path`; ValueError naming the field kvserve cannot serve."""
    path = Path(path)
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(
            f"LoRA adapter_config.json in {str(path)!r} is not valid JSON: {e}"
        ) from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter peft_type must be 'LORA', got {config.get('peft_type')!r}")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"LoRA adapter r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter r={rank} exceeds max_lora_rank={max_rank}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter lora_alpha must be a number, got {alpha!r}")
    refused = {
        "modules_to_save": "trains whole modules (embeddings, the LM head): not supported",
        "rank_pattern": "per-module ranks are not supported",
        "alpha_pattern": "per-module alphas are not supported",
        "use_dora": "DoRA is not supported",
        "fan_in_fan_out": "Conv1D (GPT-2) layouts are not supported",
    }
    for field_name, why in refused.items():
        if config.get(field_name):
            raise ValueError(f"LoRA adapter {field_name}={config[field_name]!r}: {why}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter bias={config['bias']!r}: only 'none' is supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        bad = [t for t in targets if t.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS]
        if bad:
            raise ValueError(
                f"LoRA adapter target_modules {bad} not supported (supported: {list(SUPPORTED_TARGETS)})"
            )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)
