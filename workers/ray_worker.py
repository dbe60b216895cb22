"""A worker rank as a Ray actor (--distributed-executor-backend ray; enginecore/ray_executor.py).

The actor runs tern's own worker entry point (workers/worker_proc.run_worker), so a rank behaves
the same whichever backend started it: it reads the engine core's broadcast, joins the
torch.distributed world and answers on the reply socket. The actor is single-threaded on purpose:
`run` holds its main thread (the worker installs signal handlers there) until the worker exits,
which ends the actor's process; the engine core watches `run`'s result to notice that.
"""

from __future__ import annotations

import os

from enginecore.config import Config
from enginecore.shm_broadcast import Handle


class RayWorker:
    """Decorated with ray.remote by the executor (this module imports no Ray)."""

    def pid(self) -> int:
        """This actor's process: the engine core watches it when it runs on the same host."""
        return os.getpid()

    def run(self, config: Config, rank: int, mq_handle: Handle, reply_addr: str) -> None:
        import ray

        from workers.worker_proc import run_worker

        # Ray sets CUDA_VISIBLE_DEVICES to the actor's own GPU: it is device 0 here.
        device_index = 0 if ray.get_gpu_ids() else None
        run_worker(config, rank, mq_handle, reply_addr, device_index)
