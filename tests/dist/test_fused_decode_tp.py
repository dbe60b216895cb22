"""The fused decoder layer at --tp 2 (gloo world of 2, shared-memory collectives): its two
all-reduces run inside the native call, both ranks take it, and the logits of every decode step
equal the module path's bit for bit, for decode steps of 1, 2 (few-row kernel) and 5 (AMX)
sequences: bfloat16 activations (AVX512-BF16 kernels) and float32 (any kernel tier)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from enginecore.config import CacheConfig, Config, ModelConfig, ParallelConfig
from enginecore.messages import SamplingParams, ScheduledRequest, SchedulerOutput
from workers.kernels import kernel_library, linear_ops

pytestmark = pytest.mark.skipif(kernel_library.load() is None, reason="no C compiler")
BLOCK = 4


def _steps(batch: int, prompt_len: int, num_decode: int) -> list[SchedulerOutput]:
    blocks_per_req = -(-(prompt_len + num_decode) // BLOCK)
    params = SamplingParams(temperature=0.0, max_tokens=num_decode + 1, ignore_eos=True, seed=0)
    steps = [
        SchedulerOutput(
            step_id=0,
            requests=[
                ScheduledRequest(
                    f"r{j}",
                    [(31 * j + t) % 400 + 3 for t in range(prompt_len)],
                    0,
                    list(range(j * blocks_per_req, (j + 1) * blocks_per_req)),
                    0,
                    params,
                )  # fmt: skip
                for j in range(batch)
            ],
        )
    ]
    for i in range(num_decode):
        reqs = [
            ScheduledRequest(f"r{j}", [(7 * j + i) % 400 + 3], prompt_len + i, [], i + 1)
            for j in range(batch)
        ]
        steps.append(SchedulerOutput(step_id=i + 1, requests=reqs))
    return steps


def _rank_main(rank: int, model_dir: str, port: int, dtype: str, out) -> None:
    from gloo_world import leave_world

    from workers.distributed import destroy_distributed, init_distributed
    from workers.kernels.fused_decode import FusedDecodeLayer
    from workers.runner.model_runner import ModelRunner

    torch.set_num_threads(1)
    config = Config(
        model=ModelConfig(path=model_dir, dtype=dtype),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=64),
        parallel=ParallelConfig(tensor_parallel_size=2, dist_init_addr=f"127.0.0.1:{port}"),
    )
    ctx = init_distributed(config.parallel, rank)
    try:
        assert ctx.tp_shm is not None
        runner = ModelRunner(config, rank=rank, device=torch.device("cpu"), parallel=ctx)
        runner.load_model()
        results = {}
        for fused in (True, False):
            if not fused:
                FusedDecodeLayer.prepare = lambda self, x, meta, residual: None
            logits = []
            for batch in (1, 2, 5):
                runner.init_kv_cache(64)
                layer = runner.model.model.layers[0]
                assert (layer.fused_decode._fixed_struct() is not None) or not fused
                for step in _steps(batch, 6, 4):
                    if ctx.is_driver:  # its logits hold every rank's all-reduced contributions
                        logits.append(runner.execute_model_with_logprobs(step)[1])
                    else:
                        runner.execute_model(step)
            results[fused] = logits
        out.put((rank, all(torch.equal(a, b) for a, b in zip(results[True], results[False]))))
    except Exception as e:  # report rather than leave the test waiting for the queue
        out.put((rank, repr(e)))
        destroy_distributed()
        raise
    out.close()
    out.join_thread()  # the result is in the pipe before the rank leaves by os._exit
    leave_world()


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(
            "bfloat16",
            marks=pytest.mark.skipif(linear_ops.bf16_gemv_max_rows() < 2, reason="no AVX512-BF16"),
        ),
        "float32",
    ],
)
def test_fused_layer_at_tp2_equals_the_module_path(tiny_llama: Path, dtype: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(r, str(tiny_llama), port, dtype, out)) for r in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in procs)  # both ranks, or the first error
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert results == {0: True, 1: True}
    assert all(p.exitcode == 0 for p in procs)
