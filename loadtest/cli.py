"""`python -m kvserve.loadtest serve ...` / `kvserve bench serve ...`: the benchmark CLI.

`main(argv)` is the entry point the project CLI calls; argv starts with the
subcommand (`serve`). See docs/loadtest.md for every option and figure.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvserve.loadtest.arrivals import arrival_offsets_for_duration
from kvserve.loadtest.bench import (
    RunConfig,
    RunResult,
    auth_headers,
    fetch_model_name,
    probe,
    run_benchmark,
)
from kvserve.loadtest.client import OK
from kvserve.loadtest.datasets import (
    BenchRequest,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
    translation_requests,
)
from kvserve.loadtest.report import (
    dump_json,
    format_table,
    markdown_table,
    parse_goodput,
    summarize,
    write_result,
)
from kvserve.loadtest.token_source import TokenSource, resolve_token_source

log = logging.getLogger("loadtest")
DEFAULT_OUTPUT_LEN = 64
DEFAULT_PREFIX_LEN = 256  # for --dataset prefix-repetition
DURATION_POOL_SIZE = 1000  # prompts generated for closed-loop --duration runs


def _rate(text: str) -> float:
    rate = float(text)  # accepts "inf"
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text}")
    return rate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loadtest", description="Benchmark an OpenAI-compatible server."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="benchmark a running server over HTTP")
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", help="model name to request (default: first of GET /v1/models)")
    p.add_argument(
        "--dataset",
        default="random",
        help="random | sharegpt:PATH | prefix-repetition | translation",
    )
    p.add_argument(
        "--input-len",
        type=int,
        default=256,
        help="prompt tokens (prefix-repetition: suffix; translation: source)",
    )
    p.add_argument(
        "--target-ratio",
        type=float,
        default=1.2,
        help="translation: output tokens per source token (each request's own length)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        help=f"output tokens (default {DEFAULT_OUTPUT_LEN}; ShareGPT: the reply's length)",
    )
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in L*(1±r)")
    p.add_argument(
        "--prefix-len",
        type=int,
        help=f"shared prefix tokens (random: 0, prefix-repetition: {DEFAULT_PREFIX_LEN})",
    )
    p.add_argument(
        "--num-prefix-groups", type=int, default=4, help="prefix-repetition: distinct prefixes"
    )
    bound = p.add_mutually_exclusive_group()
    bound.add_argument("--num-prompts", type=int, help="requests per run (default 100)")
    bound.add_argument("--duration", type=float, help="send requests for this many seconds instead")
    p.add_argument(
        "--request-rate",
        type=_rate,
        nargs="+",
        default=[math.inf],
        help="requests/s (inf = all at once); several values = a sweep",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument(
        "--max-concurrency",
        type=int,
        nargs="+",
        help="cap on requests in flight; several values = a sweep",
    )
    p.add_argument(
        "--disconnect-fraction",
        type=float,
        default=0.0,
        help="share of clients that hang up mid-stream",
    )
    p.add_argument(
        "--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:5000"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--out", help="output folder (default loadtest_out/<timestamp>)")
    p.add_argument(
        "--tokenizer", help="local tokenizer for prompts (default: the server's /tokenize)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--prompt-format",
        choices=["auto", "tokens", "text"],
        default="auto",
        help="auto: token ids for completions, text for chat and ShareGPT",
    )
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="force output_len tokens (ignore_eos + min_tokens)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--metrics-interval", type=float, default=0.5, help="/metrics scrape period (s)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for KV use to return to 0 after a run",
    )
    return parser


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _pool_size(args: argparse.Namespace) -> int:
    if args.duration is None:
        return args.num_prompts or 100
    finite = [r for r in args.request_rate if not math.isinf(r)]
    counts = [
        len(arrival_offsets_for_duration(args.duration, r, args.burstiness, args.seed))
        for r in finite
    ]
    return max(counts + [1 if finite else DURATION_POOL_SIZE])


def build_requests(args: argparse.Namespace, source: TokenSource, seed: int) -> list[BenchRequest]:
    """One load point's prompts.

    Each sweep point gets its own seed (base seed + point index): fresh random
    prompts, so a point does not hit the prefix cache that earlier points
    filled, while two servers run with the same options still get identical prompts.
    """
    n = _pool_size(args)
    name, _, path = args.dataset.partition(":")
    if name == "sharegpt":
        if not path:
            raise ValueError("--dataset sharegpt needs a file: sharegpt:PATH")
        return sharegpt_requests(path, source, n, seed, args.output_len)
    if args.endpoint == "chat" and args.prompt_format == "tokens":
        raise ValueError("the chat endpoint takes text; use --prompt-format auto or text")
    as_text = args.prompt_format == "text" or (
        args.prompt_format == "auto" and args.endpoint == "chat"
    )
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    if name == "random":
        return random_requests(
            source,
            n,
            args.input_len,
            output_len,
            args.range_ratio,
            args.prefix_len or 0,
            seed,
            as_text,
        )
    if name == "translation":
        if args.output_len is not None:
            raise ValueError(
                "--dataset translation sets each output length from its source: "
                "use --target-ratio instead of --output-len"
            )
        return translation_requests(
            source, n, args.input_len, args.target_ratio, args.range_ratio, seed, as_text
        )
    if name == "prefix-repetition":
        prefix_len = args.prefix_len or DEFAULT_PREFIX_LEN
        return prefix_repetition_requests(
            source,
            n,
            prefix_len,
            args.input_len,
            output_len,
            args.num_prefix_groups,
            args.range_ratio,
            seed,
            as_text,
        )
    raise ValueError(
        f"unknown --dataset {args.dataset!r}: random | sharegpt:PATH | prefix-repetition | translation"
    )


def point_label(rate: float, concurrency: int | None) -> str:
    rate_text = "inf" if math.isinf(rate) else f"{rate:g}"
    return f"rate-{rate_text}" + (f"_conc-{concurrency}" if concurrency else "")


def save_run(out_dir: Path, cfg: RunConfig, result: RunResult, slos: dict, extra: dict) -> dict:
    """Write result.json and plots for one point; returns the summary."""
    from kvserve.loadtest.plots import plot_run  # matplotlib import is slow; only when writing

    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(result.records, result.duration_s, slos)
    config = {**cfg.to_dict(), **extra}
    write_result(
        out_dir / "result.json", config, summary, result.server, result.records, result.series
    )
    plot_run(json.loads((out_dir / "result.json").read_text()), out_dir)
    return summary


async def run_points(args: argparse.Namespace, model: str, source: TokenSource, out: Path) -> int:
    slos = parse_goodput(args.goodput)
    points = list(itertools.product(args.request_rate, args.max_concurrency or [None]))
    results: list[Any] = []
    status = 0
    for index, (rate, concurrency) in enumerate(points):
        seed = args.seed + index
        requests = await asyncio.to_thread(build_requests, args, source, seed)
        extra = {
            "dataset": args.dataset,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "range_ratio": args.range_ratio,
            "prefix_len": args.prefix_len,
            "token_source": source.name,
            "target_ratio": args.target_ratio if args.dataset == "translation" else None,
            "num_requests_in_pool": len(requests),
            "base_seed": args.seed,
        }
        cfg = RunConfig(
            base_url=args.base_url,
            model=model,
            endpoint=args.endpoint,
            request_rate=rate,
            burstiness=args.burstiness,
            max_concurrency=concurrency,
            num_prompts=None if args.duration else len(requests),
            duration_s=args.duration,
            disconnect_fraction=args.disconnect_fraction,
            seed=seed,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            timeout_s=args.timeout,
            api_key=args.api_key,
            show_progress=not args.no_progress,
            metrics_interval_s=args.metrics_interval,
            drain_timeout_s=args.drain_timeout,
        )
        if not results:
            check = await probe(cfg, requests[0])
            if check.status != OK:
                print(f"probe request failed: {check.error}", file=sys.stderr)
                return 1
        label = point_label(rate, concurrency)
        result = await run_benchmark(cfg, requests, label)
        point_dir = out / label if len(points) > 1 else out
        summary = save_run(point_dir, cfg, result, slos, extra)
        print(format_table(summary, result.server, title=f"{model} @ {label}"))
        results.append(
            {
                "label": label,
                "request_rate": rate,
                "max_concurrency": concurrency,
                "summary": summary,
                "server": result.server,
            }
        )
        status = status or (0 if summary["completed"] else 1)
    if len(points) > 1:
        write_sweep(out, results)
    print(f"results in {out}")
    return status


def write_sweep(out: Path, results: list[dict]) -> None:
    from kvserve.loadtest.plots import plot_sweep

    table = markdown_table(results)
    (out / "sweep.md").write_text(table + "\n")
    dump_json(out / "sweep.json", results)
    plot_sweep(results, out / "sweep.png")
    print(table)


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python -m kvserve.loadtest` and `kvserve bench`; returns an exit code."""
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    args.base_url = _base_url(args.base_url)
    try:
        model = args.model or fetch_model_name(args.base_url, args.api_key)
        source = resolve_token_source(
            args.tokenizer, args.base_url, model, auth_headers(args.api_key)
        )
        log.info("token source: %s", source.name)
        out = Path(args.out or f"loadtest_out/{time.strftime('%Y%m%d-%H%M%S')}")
        out.mkdir(parents=True, exist_ok=True)
        return asyncio.run(run_points(args, model, source, out))
    except (ValueError, OSError, httpx.HTTPError) as exc:  # bad options, files or server
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
