"""Resident memory of a serving process tree (kvserve's API server and engine core, or llama-server).

    python -m benchmarks.server_memory --model /path/model-Q8_0.gguf \\
        --llama-bin /work/llama-build/bin --out bench_out/server_memory.json

Starts each server on the same model, waits for /health, sends one completion (so weights and the
first step's buffers are touched), then sums VmRSS over the server's process and its children
(read from /proc). kvserve serves the file as it comes (a Q8_0 GGUF held as int8); llama-server
runs with one slot and the context the comparison uses. Prints MiB per server and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import httpx

from benchmarks.bench_startup import serve_command
from benchmarks.procs import free_port, running_server


def tree_rss_bytes(pid: int) -> int:
    """VmRSS summed over `pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total


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


def measure(cmd: list[str], port: int, log: Path, name: str) -> int:
    with running_server(cmd, port, log) as url:
        httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "Hello there", "max_tokens": 16},
                   timeout=120).raise_for_status()
        # the server runs in a session of its own (kvserve: the API server and its engine core)
        return tree_rss_bytes(os.getsid(server_pid(port)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.server_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="what both serve (a GGUF file for llama-server)")
    p.add_argument("--llama-bin", type=Path, help="folder with llama-server (left out: kvserve only)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=320, help="llama-server's context (one slot)")
    p.add_argument("--kvserve-args", default="", help="extra `kvserve serve` flags, space-separated")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    out_dir = (args.out.parent if args.out else Path("bench_out")) / "server_memory_logs"
    result = {"model": args.model}
    port = free_port()
    result["kvserve_mib"] = measure(serve_command(args.model, port, ["--served-model-name", "m",
                                                                     *args.kvserve_args.split()]),
                                    port, out_dir / "kvserve.log", "m") / 2**20
    if args.llama_bin:
        port = free_port()
        cmd = [str(args.llama_bin / "llama-server"), "-m", args.model, "--alias", "m", "-t", str(args.threads),
               "-ngl", "0", "--parallel", "1", "-c", str(args.ctx), "--no-webui", "--host", "127.0.0.1",
               "--port", str(port)]
        result["llama_server_mib"] = measure(cmd, port, out_dir / "llama-server.log", "m") / 2**20
        result["ratio"] = result["kvserve_mib"] / result["llama_server_mib"]
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
