"""What the server <-> engine-core channel costs: message codec and pipe round trip.

    python -m benchmarks.bench_ipc [--iters 2000]

1. Encoding + decoding one step's message (`engine.messages`: msgspec structs as MessagePack,
   decoded with type checks) with B = 1 and 64 requests, each delta one token (and with 5
   logprobs per token).
2. Round trip of a small message between two processes over a `multiprocessing` pipe
   (what kvserve uses) and, if pyzmq is installed, a ZeroMQ PAIR socket over ipc://.
Prints microseconds per operation (median of 5 batches).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time

from kvserve.engine import messages
from kvserve.engine.outputs import (
    CompletionDelta,
    EngineStats,
    Logprob,
    RequestDelta,
    RequestMetrics,
)


def step_message(num_requests: int, num_logprobs: int) -> messages.StepOutputs:
    entry = {
        i: Logprob(logprob=-0.1 * i, rank=i + 1, decoded_token=f"t{i}") for i in range(num_logprobs)
    }
    metrics = RequestMetrics(
        arrival_time=1.0, first_scheduled_time=1.1, first_token_time=1.2, last_token_time=1.3
    )
    deltas = [
        RequestDelta(
            request_id=f"cmpl-{i:032x}-0",
            outputs=[
                CompletionDelta(
                    index=0,
                    text=" word",
                    token_ids=[1234],
                    logprobs=[entry] if entry else None,
                    cumulative_logprob=-1.5 if entry else None,
                )
            ],
            finished=False,
            metrics=metrics,
            num_cached_tokens=0,
        )
        for i in range(num_requests)
    ]
    stats = EngineStats(
        num_running=num_requests,
        num_waiting=0,
        kv_cache_usage=0.1,
        num_kv_blocks_total=1000,
        num_kv_blocks_free=900,
        prompt_tokens_total=10,
        generation_tokens_total=10,
        prefix_cache_queries_total=0,
        prefix_cache_hits_total=0,
        num_preemptions_total=0,
    )
    return messages.StepOutputs(deltas=deltas, stats=stats)


def per_op_us(fn, iters: int) -> float:
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(samples)


def bench_codec(iters: int) -> None:
    for num_requests in (1, 64):
        for num_logprobs in (0, 5):
            message = step_message(num_requests, num_logprobs)
            data = messages.encode(message)
            us = per_op_us(lambda: messages.decode(messages.encode(message)), iters)
            print(
                f"msgpack  B={num_requests:3d} logprobs={num_logprobs}: {us:8.1f} us encode+decode, "
                f"{len(data)} bytes"
            )


def _echo_pipe(conn) -> None:
    while (data := conn.recv_bytes()) != b"stop":
        conn.send_bytes(data)


def _echo_zmq(address: str) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(address)
    while (data := sock.recv()) != b"stop":
        sock.send(data)


def bench_round_trip(iters: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    payload = messages.encode(step_message(1, 0))
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_echo_pipe, args=(theirs,))
    proc.start()

    def pipe_round_trip() -> None:
        ours.send_bytes(payload)
        ours.recv_bytes()

    print(f"multiprocessing pipe round trip: {per_op_us(pipe_round_trip, iters):.1f} us")
    ours.send_bytes(b"stop")
    proc.join()
    try:
        import zmq
    except ImportError:
        return
    address = f"ipc://{tempfile.mkdtemp()}/bench"
    sock = zmq.Context().socket(zmq.PAIR)
    sock.bind(address)
    proc = ctx.Process(target=_echo_zmq, args=(address,))
    proc.start()

    def zmq_round_trip() -> None:
        sock.send(payload)
        sock.recv()

    print(f"zeromq PAIR ipc round trip:      {per_op_us(zmq_round_trip, iters):.1f} us")
    sock.send(b"stop")
    proc.join()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_ipc", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error(f"--iters must be positive, got {args.iters}")
    bench_codec(args.iters)
    bench_round_trip(args.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
