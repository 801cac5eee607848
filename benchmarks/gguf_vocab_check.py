"""kvserve's GGUF tokenizers against llama.cpp's tokenizer test vectors.

    python -m benchmarks.gguf_vocab_check LLAMA_CPP_DIR

llama.cpp's source tree keeps vocabulary-only GGUF files of real models (`models/ggml-vocab-*.gguf`)
with texts (`.inp`, separated by `__ggml_vocab_test__` lines) and the ids each model's own Hugging
Face tokenizer gives them (`.out`), which llama.cpp's tokenizer tests reproduce. For every file of
an architecture kvserve serves, this loads its tokenizer as `kvserve serve --model FILE` would
and counts the texts whose ids equal the expected ones (special tokens not added). Files of other
architectures are listed as skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SEPARATOR = "\n__ggml_vocab_test__\n"


def check(path: Path) -> tuple[int, int, str]:
    """(texts tokenized as expected, texts, the first mismatch or '')."""
    from kvserve.engine.input_processor import load_tokenizer

    tokenizer = load_tokenizer(str(path))
    texts = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split(SEPARATOR)
    expected = (
        path.with_name(path.name + ".out")
        .read_text(encoding="utf-8")
        .removesuffix("\n")
        .split("\n")
    )
    exact, first = 0, ""
    if (
        texts[-1] == "" and len(expected) == len(texts) - 1
    ):  # (some files give the empty last text no line)
        texts.pop()
    if len(texts) != len(expected):
        raise ValueError(f"{path.name}: {len(texts)} texts but {len(expected)} lines of ids")
    for text, line in zip(texts, expected):
        want = [int(t) for t in line.split()]
        got = tokenizer.encode(text, add_special_tokens=False)
        exact += got == want
        if got != want and not first:
            first = f"{text[:30]!r}: {got[:8]} instead of {want[:8]}"
    return exact, len(texts), first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "llama_cpp_dir", type=Path, help="llama.cpp's source tree (the llama-cpp-python sdist's)"
    )
    args = parser.parse_args(argv)
    from kvserve.models.gguf_metadata import ARCHITECTURES, field, open_gguf

    failed = 0
    for path in sorted((args.llama_cpp_dir / "models").glob("ggml-vocab-*.gguf")):
        if not path.with_name(path.name + ".inp").exists():
            continue
        arch = field(open_gguf(path), "general.architecture")
        if arch not in ARCHITECTURES:
            print(f"{path.name:36s} {arch:12s} skipped (not an architecture kvserve serves)")
            continue
        exact, total, first = check(path)
        failed += exact != total
        print(f"{path.name:36s} {arch:12s} {exact}/{total} exact {first}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
