"""What the server <-> engine-core channel costs: message codec and pipe round trip.

    python -m benchmarks.bench_ipc [--iters 2000]

1. Encoding + decoding one step's message (`engine.messages`, pickle protocol 5) with
   B = 1 and 64 requests, each delta one token (and with 5 logprobs per token), and, if
   msgspec is installed, the same records as msgspec msgpack structs for comparison.
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
from kvserve.engine.outputs import CompletionDelta, EngineStats, Logprob, RequestDelta, RequestMetrics


def step_message(num_requests: int, num_logprobs: int) -> messages.StepOutputs:
    entry = {i: Logprob(-0.1 * i, i + 1, f"t{i}") for i in range(num_logprobs)} if num_logprobs else None
    deltas = [RequestDelta(f"cmpl-{i:032x}-0", [CompletionDelta(0, " word", [1234], [entry] if entry else None,
                                                                 -1.5 if entry else None)],
                           False, RequestMetrics(1.0, 1.1, 1.2, 1.3, None), 0) for i in range(num_requests)]
    return messages.StepOutputs(deltas, EngineStats(num_requests, 0, 0.1, 1000, 900, 10, 10, 0, 0, 0))


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
            print(f"pickle   B={num_requests:3d} logprobs={num_logprobs}: {us:8.1f} us encode+decode, {len(data)} bytes")
            msgspec_us = _msgspec_codec(num_requests, num_logprobs, iters)
            if msgspec_us is not None:
                print(f"msgspec  B={num_requests:3d} logprobs={num_logprobs}: {msgspec_us[0]:8.1f} us encode+decode, "
                      f"{msgspec_us[1]} bytes")


try:  # optional: only to compare codecs
    import msgspec

    class _Delta(msgspec.Struct, array_like=True):
        index: int
        text: str
        token_ids: list[int]
        logprobs: list[dict[int, tuple[float, int, str]]] | None
        cumulative_logprob: float | None

    class _Request(msgspec.Struct, array_like=True):
        request_id: str
        outputs: list[_Delta]
        finished: bool
        metrics: tuple[float, float, float, float, float | None]
except ImportError:
    msgspec = None


def _msgspec_codec(num_requests: int, num_logprobs: int, iters: int) -> tuple[float, int] | None:
    if msgspec is None:
        return None
    entry = {i: (-0.1 * i, i + 1, f"t{i}") for i in range(num_logprobs)} if num_logprobs else None
    batch = [_Request(f"cmpl-{i:032x}-0", [_Delta(0, " word", [1234], [entry] if entry else None, -1.5)], False,
                      (1.0, 1.1, 1.2, 1.3, None)) for i in range(num_requests)]
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(list[_Request])
    data = encoder.encode(batch)
    return per_op_us(lambda: decoder.decode(encoder.encode(batch)), iters), len(data)


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
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_ipc", description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error(f"--iters must be positive, got {args.iters}")
    bench_codec(args.iters)
    bench_round_trip(args.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
