"""What the request-body depth check costs, next to what parsing the same body costs.

    python -m benchmarks.bench_json_depth [--repeat 5]

For typical and large bodies (a long prompt, a long chat) and for bodies made to be expensive
to scan (many tiny strings, many escaped quotes), prints the time of `server.json_depth.json_depth`
(the scan `BodyLimitMiddleware` runs on every POST body) and of `json.loads` on the same bytes,
in microseconds (best of `--repeat` batches), plus the surrogate walk every request model runs
(`server.protocol.replace_lone_surrogates`) on the parsed body.
"""

from __future__ import annotations

import argparse
import json
import random
import timeit

from kvserve.server.json_depth import json_depth
from kvserve.server.protocol import replace_lone_surrogates


def _text(rng: random.Random, num_chars: int) -> str:
    words = [
        "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 9))) for _ in range(500)
    ]
    out, size = [], 0
    while size < num_chars:
        word = rng.choice(words)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def bodies() -> dict[str, bytes]:
    rng = random.Random(0)
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": _text(rng, 200)}
        for i in range(2000)
    ]
    cases = {
        "chat, 3 messages": {"model": "m", "messages": messages[:3], "max_tokens": 16},
        "chat, 150 short messages (scanned)": {
            "messages": [{"role": "user", "content": "hi"}] * 150
        },
        "prompt of 450 KB": {"prompt": _text(rng, 450_000), "max_tokens": 16},
        "chat of 450 KB, 2000 messages (scanned)": {"messages": messages, "max_tokens": 16},
        "450 KB of tiny strings (scanned)": {"x": [[""]] * 200 + [""] * 110_000},
        "450 KB of escaped quotes (scanned)": {"x": [[1]] * 200, "p": '\\"[{' * 75_000},
        "4 MB of tiny strings (scanned)": {"x": [[""]] * 200 + [""] * 1_000_000},
    }
    return {name: json.dumps(body).encode() for name, body in cases.items()}


def best_us(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{'body':42s} {'KiB':>8s} {'scan us':>9s} {'json.loads us':>14s} {'surrogate walk us':>18s}"
    )
    for name, body in bodies().items():
        number = 2000 if len(body) < 10_000 else 20
        parsed = json.loads(body)
        scan = best_us(lambda: json_depth(body), number, args.repeat)
        parse = best_us(lambda: json.loads(body), number, args.repeat)
        walk = best_us(lambda: replace_lone_surrogates(parsed), number, args.repeat)
        print(f"{name:42s} {len(body) / 1024:8.1f} {scan:9.1f} {parse:14.1f} {walk:18.1f}")


if __name__ == "__main__":
    main()
