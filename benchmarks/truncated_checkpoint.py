"""A copy of a Llama-family checkpoint with only its first N layers (the embedding, final norm and
head kept): a draft model for speculative decoding that shares the target's vocabulary and weights.

    python -m benchmarks.truncated_checkpoint --model DIR --layers 4 --out DIR
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def truncate(model: Path, layers: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    if not 0 < layers <= config["num_hidden_layers"]:
        raise ValueError(f"--layers must be in 1..{config['num_hidden_layers']}, got {layers}")
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {}
    for path in sorted(model.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            m = re.search(r"\.layers\.(\d+)\.", name)
            if m is None or int(m.group(1)) < layers:
                tensors[name] = tensor
    save_file(tensors, out / "model.safetensors")
    for path in model.iterdir():  # tokenizer and generation files
        if path.suffix != ".safetensors" and path.name != "config.json" and path.is_file():
            shutil.copy(path, out / path.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.truncated_checkpoint", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    truncate(args.model, args.layers, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
