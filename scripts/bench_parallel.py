"""Where a decode step's time goes at --tp N: the step broadcast versus the forward pass.

For each tensor-parallel size, with a batch of B requests decoding (after a prefill of P tokens each):
- step: `MultiprocExecutor.execute_model` round trip, as the engine core sees it (broadcast to every
  rank, forward + collectives + sampling, the driver's reply);
- forward: `ModelRunner.execute_model` timed inside each rank, the ranks started by this script and
  kept in lock-step with a barrier (no broadcast, no reply);
- broadcast: enqueue -> dequeue of the same encoded `ExecuteModel` through the shared-memory
  MessageQueue to N reader processes, measured with CLOCK_MONOTONIC in the readers (the last
  reader counts), the writer pausing between steps so that readers are asleep as in serving.
Median and minimum over the decode steps (on a shared machine the minimum is the less noisy one).
Greedy sampling, fixed token ids (the cost does not depend on them).

    python scripts/bench_parallel.py [--model DIR] [--tp 1 2] [--batch 32] [--steps 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import struct
import time
from pathlib import Path

import zmq

from enginecore.config import CacheConfig, Config, ModelConfig, ParallelConfig
from enginecore.executor import MultiprocExecutor, free_port
from enginecore.messages import (
    Codec,
    ExecuteModel,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
    WorkerCall,
)
from enginecore.shm_broadcast import MessageQueue

BLOCK_SIZE = 16


def make_steps(batch: int, prompt_len: int, num_decode: int) -> list[SchedulerOutput]:
    """One prefill step of `batch` requests, then `num_decode` decode steps of all of them."""
    blocks_per_req = -(-(prompt_len + num_decode) // BLOCK_SIZE)
    params = SamplingParams(temperature=0.0, max_tokens=num_decode + 1, seed=0, ignore_eos=True)

    def blocks(j: int, first: int, last: int) -> list[int]:
        return [j * blocks_per_req + b for b in range(first, last)]

    prefill = [
        ScheduledRequest(
            f"r{j}",
            [(31 * j + t) % 1000 + 10 for t in range(prompt_len)],
            0,
            blocks(j, 0, -(-prompt_len // BLOCK_SIZE)),
            0,
            params,
        )
        for j in range(batch)
    ]
    steps = [SchedulerOutput(step_id=0, requests=prefill)]
    for i in range(num_decode):
        pos = prompt_len + i
        new = (pos // BLOCK_SIZE, pos // BLOCK_SIZE + 1) if pos % BLOCK_SIZE == 0 else (0, 0)
        reqs = [
            ScheduledRequest(f"r{j}", [(7 * j + i) % 1000 + 10], pos, blocks(j, *new), i + 1)
            for j in range(batch)
        ]
        steps.append(SchedulerOutput(step_id=i + 1, requests=reqs))
    return steps


def make_config(
    model: str, dtype: str, tp: int, batch: int, prompt_len: int, num_decode: int
) -> Config:
    num_blocks = batch * -(-(prompt_len + num_decode) // BLOCK_SIZE)
    return Config(
        model=ModelConfig(path=model, dtype=dtype),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=num_blocks),
        parallel=ParallelConfig(tensor_parallel_size=tp),
    )


def time_steps(run, steps: list[SchedulerOutput]) -> list[float]:
    """Runs every step; returns the seconds each decode step took."""
    run(steps[0])
    times = []
    for step in steps[1:]:
        start = time.perf_counter()
        run(step)
        times.append(time.perf_counter() - start)
    return times


def _forward_rank(rank: int, config: Config, steps: list[SchedulerOutput], out) -> None:
    import torch
    import torch.distributed as dist

    from workers.distributed import init_distributed
    from workers.runner.model_runner import ModelRunner
    from workers.worker_proc import num_threads

    torch.set_num_threads(num_threads(config.parallel.world_size))
    ctx = init_distributed(config.parallel, rank)
    runner = ModelRunner(config, rank=rank, device=torch.device("cpu"), parallel=ctx)
    runner.load_model()
    runner.init_kv_cache(config.cache.num_gpu_blocks_override)

    times = []
    for i, step in enumerate(steps):
        if config.parallel.world_size > 1:
            dist.barrier()  # every rank starts the step together, as after a broadcast
        start = time.perf_counter()
        runner.execute_model(step)
        if i > 0:  # decode steps only
            times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(times)


def bench_forward(config: Config, steps: list[SchedulerOutput]) -> list[float]:
    tp = config.parallel.world_size
    if tp > 1:
        parallel = config.parallel
        config = config.replace(
            parallel=ParallelConfig(
                tensor_parallel_size=tp,
                dist_init_addr=f"127.0.0.1:{free_port()}",
                distributed_timeout_s=parallel.distributed_timeout_s,
            )
        )
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_forward_rank, args=(r, config, steps, out)) for r in range(tp)]
    for p in procs:
        p.start()
    times = out.get(timeout=600)
    for p in procs:
        p.join(60)
    return times


def _reader(handle, rank: int, reply_addr: str, num: int) -> None:
    mq = MessageQueue.create_from_handle(handle, rank)
    zctx = zmq.Context()
    reply = zctx.socket(zmq.PUSH)
    reply.connect(reply_addr)
    mq.wait_until_ready(timeout=60)
    for _ in range(num):
        mq.dequeue(timeout=60)
        reply.send(struct.pack("<d", time.perf_counter()))
    reply.close(linger=1000)
    zctx.term()
    mq.close()


def bench_broadcast(n_readers: int, payloads: list[bytes], gap_s: float) -> list[float]:
    """enqueue -> last reader's dequeue, per payload, with readers idle for gap_s before each."""
    mq = MessageQueue(n_reader=n_readers, n_local_reader=n_readers)
    zctx = zmq.Context()
    pull = zctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    addr = f"tcp://127.0.0.1:{port}"
    ctx = mp.get_context("spawn")
    args = (mq.export_handle(), addr, len(payloads))
    procs = [ctx.Process(target=_reader, args=(args[0], r, *args[1:])) for r in range(n_readers)]
    for p in procs:
        p.start()
    mq.wait_until_ready(timeout=60)
    latencies = []
    for data in payloads:
        time.sleep(gap_s)
        start = time.perf_counter()
        mq.enqueue(data)
        arrived = [struct.unpack("<d", pull.recv())[0] for _ in range(n_readers)]
        latencies.append(max(arrived) - start)
    for p in procs:
        p.join(30)
    pull.close(linger=0)
    zctx.term()
    mq.close()
    return latencies


def bench_step(config: Config, steps: list[SchedulerOutput]) -> list[float]:
    executor = MultiprocExecutor(config)
    try:
        return time_steps(executor.execute_model, steps)
    finally:
        executor.shutdown()


def ms(times: list[float]) -> str:
    """median/min in milliseconds."""
    return f"{statistics.median(times) * 1e3:8.2f}/{min(times) * 1e3:<8.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the prepared default model")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from frontend.model_prep import default_model_dir

        model = str(default_model_dir())
    steps = make_steps(args.batch, args.prompt_len, args.steps)
    codec = Codec(WorkerCall)
    payloads = [codec.encode(ExecuteModel(s)) for s in steps[1:]]
    print(
        f"{Path(model).name}, {args.dtype}, decode batch {args.batch} after {args.prompt_len}-token "
        f"prompts, {args.steps} steps, step message {len(payloads[0])} B; median/min in ms"
    )
    print(f"{'tp':>3} {'step':>17} {'forward':>17} {'broadcast':>17} {'rest (median)':>14}")
    for tp in args.tp:
        config = make_config(model, args.dtype, tp, args.batch, args.prompt_len, args.steps)
        step = bench_step(config, steps)
        forward = bench_forward(config, steps)
        bcast = bench_broadcast(tp, payloads, gap_s=statistics.median(forward))
        rest = statistics.median(step) - statistics.median(forward) - statistics.median(bcast)
        print(f"{tp:>3} {ms(step)} {ms(forward)} {ms(bcast)} {rest * 1e3:14.2f}", flush=True)


if __name__ == "__main__":
    main()
