"""Resident memory of a serving process tree (kvserve's API server and engine core, or llama-server).

    python -m benchmarks.server_memory --model /path/model-Q8_0.gguf \\
        --llama-bin /work/llama-build/bin --out bench_out/server_memory.json

Starts each server on the same model, waits for /health, sends one completion (so weights and the
first step's buffers are touched), then sums VmRSS over the server's process and its children
(read from /proc). kvserve serves the file as it comes (a Q8_0 GGUF held as int8); llama-server
runs with one slot and the context the comparison uses. Prints MiB per server and the ratio, and
each process of each tree (kvserve: the API server, the engine core and multiprocessing's
resource tracker) with VmRSS split into anonymous and file-backed pages.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import httpx

from benchmarks.bench_startup import serve_command
from benchmarks.procs import free_port, running_server


def _status_kib(status: str, key: str) -> int:
    return next(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith(key + ":")), 0
    )


def tree_processes(pid: int) -> list[dict]:
    """`pid` and every process below it: pid, command line (cut short), VmRSS and its anonymous / file-backed
    parts in MiB (a mapped model file counts as file-backed, a model read into memory as anonymous)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    rows, todo = [], [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            status = Path(f"/proc/{p}/status").read_text()
            cmdline = (
                Path(f"/proc/{p}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
        except OSError:
            continue
        rows.append(
            {
                "pid": p,
                "cmd": cmdline.strip()[:120],
                **{
                    k: _status_kib(status, field) / 1024
                    for k, field in (
                        ("rss_mib", "VmRSS"),
                        ("anon_mib", "RssAnon"),
                        ("file_mib", "RssFile"),
                    )
                },
            }
        )
    return rows


def tree_rss_bytes(pid: int) -> int:
    """VmRSS summed over `pid` and every process below it."""
    return round(sum(row["rss_mib"] for row in tree_processes(pid)) * 2**20)


def server_pid(port: int) -> int:
    """The process listening on `port` (its tree is the server's)."""
    inode_hex = f"{port:04X}"
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1].endswith(":" + inode_hex) and fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                link = os.readlink(f"/proc/{entry}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(entry)
        except OSError:
            continue
    raise RuntimeError(f"no process listens on port {port}")


def measure(cmd: list[str], port: int, log: Path, name: str) -> list[dict]:
    """The server tree's processes (`tree_processes`) after one completion."""
    with running_server(cmd, port, log) as url:
        httpx.post(
            f"{url}/v1/completions",
            json={"model": name, "prompt": "Hello there", "max_tokens": 16},
            timeout=120,
        ).raise_for_status()
        # the server runs in a session of its own (kvserve: the API server and its engine core)
        return tree_processes(os.getsid(server_pid(port)))


def total_mib(processes: list[dict]) -> float:
    return sum(row["rss_mib"] for row in processes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.server_memory", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", required=True, help="what both serve (a GGUF file for llama-server)")
    p.add_argument(
        "--llama-bin", type=Path, help="folder with llama-server (left out: kvserve only)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=320, help="llama-server's context (one slot)")
    p.add_argument(
        "--kvserve-args", default="", help="extra `kvserve serve` flags, space-separated"
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    out_dir = (args.out.parent if args.out else Path("bench_out")) / "server_memory_logs"
    result = {"model": args.model}
    port = free_port()
    result["kvserve_processes"] = measure(
        serve_command(args.model, port, ["--served-model-name", "m", *args.kvserve_args.split()]),
        port,
        out_dir / "kvserve.log",
        "m",
    )
    result["kvserve_mib"] = total_mib(result["kvserve_processes"])
    if args.llama_bin:
        port = free_port()
        cmd = [
            str(args.llama_bin / "llama-server"),
            "-m",
            args.model,
            "--alias",
            "m",
            "-t",
            str(args.threads),
            "-ngl",
            "0",
            "--parallel",
            "1",
            "-c",
            str(args.ctx),
            "--no-webui",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        result["llama_server_processes"] = measure(cmd, port, out_dir / "llama-server.log", "m")
        result["llama_server_mib"] = total_mib(result["llama_server_processes"])
        result["ratio"] = result["kvserve_mib"] / result["llama_server_mib"]
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
