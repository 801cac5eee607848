"""How fast can rank 0 hand a step to a tensor-parallel worker? A pipe against a shared-memory buffer.

Each round trip encodes a `WorkerStep` (the `StepRecord` and the sampled ids) as engine/worker/executor.py
does (engine/messages.py), sends it, lets the other process decode it, and waits for a one-byte reply (in the engine
the reply is the step's first collective). Shared memory: the bytes go into a
`multiprocessing.shared_memory` buffer and two POSIX semaphores signal each way (no spinning:
the machine has fewer cores than busy processes).

    python -m benchmarks.bench_tp_channel [--steps 2000]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import struct
import time
from multiprocessing import shared_memory

from kvserve.engine import messages as wire
from kvserve.engine.core.step_record import StepRecord

_SHM_BYTES = 1 << 22


def decode_record(batch_size: int, step: int) -> wire.WorkerStep:
    """A decode step of `batch_size` running requests and the previous step's samples."""
    req_ids = tuple(f"cmpl-{i:08x}#0" for i in range(batch_size))
    record = StepRecord(
        finished_req_ids=(),
        preempted_req_ids=(),
        new_requests=(),
        req_ids=req_ids,
        num_computed_tokens=tuple(500 + step for _ in req_ids),
        num_scheduled_tokens=(1,) * batch_size,
        new_block_ids={req_ids[0]: (1000 + step,)} if step % 16 == 0 else {},
    )
    return wire.WorkerStep(record=record, prev_sampled_token_ids=tuple(range(batch_size)))


def _pipe_child(conn) -> None:
    while True:
        message = wire.decode(conn.recv_bytes())
        if isinstance(message, wire.Stop):
            return
        conn.send_bytes(b"k")


def _shm_child(name: str, ready, done) -> None:
    shm = shared_memory.SharedMemory(name=name)
    try:
        while True:
            ready.acquire()
            (size,) = struct.unpack_from("<I", shm.buf, 0)
            message = wire.decode(shm.buf[4 : 4 + size])
            done.release()
            if isinstance(message, wire.Stop):
                return
    finally:
        shm.close()


def bench_pipe(messages: list[wire.WorkerStep]) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=_pipe_child, args=(child_conn,))
    process.start()
    times = []
    for message in messages:
        start = time.perf_counter()
        conn.send_bytes(wire.encode(message))
        conn.recv_bytes()
        times.append(time.perf_counter() - start)
    conn.send_bytes(wire.encode(wire.Stop()))
    process.join()
    return times


def bench_shm(messages: list[wire.WorkerStep]) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    shm = shared_memory.SharedMemory(create=True, size=_SHM_BYTES)
    ready, done = ctx.Semaphore(0), ctx.Semaphore(0)
    process = ctx.Process(target=_shm_child, args=(shm.name, ready, done))
    process.start()
    times = []
    try:
        for message in [*messages, wire.Stop()]:
            start = time.perf_counter()
            data = wire.encode(message)
            struct.pack_into("<I", shm.buf, 0, len(data))
            shm.buf[4 : 4 + len(data)] = data
            ready.release()
            done.acquire()
            times.append(time.perf_counter() - start)
        process.join()
    finally:
        shm.close()
        shm.unlink()
    return times[:-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args(argv)
    print("| batch | message bytes | pipe median / p99 (us) | shared memory median / p99 (us) |")
    print("|---|---|---|---|")
    for batch_size in (1, 32, 256):
        messages = [decode_record(batch_size, step) for step in range(args.steps)]
        size = len(wire.encode(messages[1]))
        row = [f"{batch_size}", f"{size}"]
        for bench in (bench_pipe, bench_shm):
            times = sorted(bench(messages)[100:])  # after warm-up
            row.append(
                f"{statistics.median(times) * 1e6:.0f} / {times[int(len(times) * 0.99)] * 1e6:.0f}"
            )
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
