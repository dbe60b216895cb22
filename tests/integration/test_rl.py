"""RL trainer flows against a real `tern launch`: weight pushes over HTTP, from /dev/shm, from a
trainer's process group (a separate trainer process, tern at --tp 2), sleep/wake with RSS checks,
503 while asleep, and failures that leave the old weights serving.

The oracle is Hugging Face greedy on the checkpoint tern was updated to.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file

from enginecore.executor import free_port
from frontend.client.trainer import TernAPIError, TrainerClient
from tests.integration.test_server import client_for
from tests.unit.test_engine_inproc import hf_greedy
from tests.worker_memory import memory_held, workers_of

N = 8
PROMPTS = [[101, 2024, 318, 257], [464, 3290, 286, 4881, 318, 6342, 11, 290]]


def greedy(server: Any, model: str) -> list[list[int]]:
    """Greedy token ids through the HTTP API (completions with token-id prompts)."""
    out = []
    for prompt in PROMPTS:
        r = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0,
                  "ignore_eos": True, "return_token_ids": True},
            timeout=60,
        )  # fmt: skip
        if r.status_code == 400 and "return_token_ids" in r.text:
            pytest.skip("return_token_ids not supported yet")
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out.append(choice["token_ids"])
    return out


def memory_of_workers(server: Any) -> int:
    return memory_held(workers_of(server.server_info()["engine"]["engine_core_pid"]))


def state_dict(model_dir: Path) -> dict:
    return load_file(next(model_dir.glob("*.safetensors")))


@pytest.fixture(scope="module")
def server(module_server: Any, tiny_llama: Path) -> Any:
    return module_server(
        "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "0.25"
    )


def test_disk_tensor_and_shm_updates(server: Any, tiny_llama: Path, tiny_llama_perturbed: Path):
    model = str(tiny_llama)
    original = hf_greedy(tiny_llama, PROMPTS, N)
    perturbed = hf_greedy(tiny_llama_perturbed, PROMPTS, N)
    assert greedy(server, model) == original
    client = TrainerClient(server.base_url)
    start = client.weight_version()

    client.update_weights_from_disk(str(tiny_llama_perturbed))
    v1 = client.weight_version()
    assert v1 != start
    assert greedy(server, model) == perturbed  # also: the cached prefix was not reused

    client.update_weights_from_tensors(state_dict(tiny_llama), bucket_bytes=1 << 20)
    v2 = client.weight_version()
    assert v2 != v1
    assert greedy(server, model) == original

    client.update_weights_from_tensors(state_dict(tiny_llama_perturbed), load_format="shm",
                                       weight_version="step-3")  # fmt: skip
    assert client.weight_version() == "step-3"
    r = client_for(server).completions.create(model=model, prompt=PROMPTS[0], max_tokens=2)
    assert r.model_extra["weight_version"] == "step-3"
    assert greedy(server, model) == perturbed
    client.update_weights_from_disk(str(tiny_llama))
    assert greedy(server, model) == original


def test_bad_updates_keep_serving_the_old_weights(server: Any, tiny_llama: Path, tmp_path: Path):
    model = str(tiny_llama)
    client = TrainerClient(server.base_url)
    before, version = greedy(server, model), client.weight_version()
    sd = state_dict(tiny_llama)
    name = "model.layers.0.self_attn.o_proj.weight"
    bad_shape = dict(sd, **{name: sd[name][:, :-1].contiguous()})
    for payload, match in [
        ({"model.no_such.weight": sd[name].clone()}, "matches no parameter"),
        (bad_shape, "shape"),
        ({name: sd[name].to(dtype=__import__("torch").int32)}, "dtype"),
    ]:
        with pytest.raises(TernAPIError) as e:
            client.update_weights_from_tensors(payload)
        assert e.value.status == 400 and match in str(e.value), str(e.value)
    with pytest.raises(TernAPIError) as e:
        client.update_weights_from_disk(str(tmp_path / "missing"))
    assert e.value.status == 400
    r = httpx.post(
        f"{server.base_url}/update_weights",
        json={"serialized_named_tensors": ["x"], "load_format": "flattened_bucket"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_format"  # fmt: skip
    assert client.weight_version() == version
    assert greedy(server, model) == before


def test_sleep_wake_memory_and_503(server: Any, tiny_llama: Path):
    model = str(tiny_llama)
    client = TrainerClient(server.base_url)
    before = greedy(server, model)
    kv_bytes = 0.25 * (1 << 30)
    weight_bytes = sum(t.numel() * 4 for t in state_dict(tiny_llama).values())

    awake = memory_of_workers(server)
    client.sleep(level=1)
    assert client.get("/is_sleeping") == {"is_sleeping": True}
    asleep = memory_of_workers(server)
    assert awake - asleep >= 0.9 * kv_bytes, (awake, asleep)
    r = httpx.post(f"{server.base_url}/v1/completions",
                   json={"model": model, "prompt": "hi", "max_tokens": 2})  # fmt: skip
    assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
    client.wake_up()
    assert client.get("/is_sleeping") == {"is_sleeping": False}
    assert greedy(server, model) == before

    awake = memory_of_workers(server)
    r = httpx.post(f"{server.base_url}/sleep?level=2")
    assert r.status_code == 200
    asleep = memory_of_workers(server)
    assert awake - asleep >= 0.9 * (kv_bytes + weight_bytes), (awake, asleep)
    with pytest.raises(TernAPIError):  # no weights to update while they sleep
        client.update_weights_from_disk(str(tiny_llama))
    client.wake_up(["weights"])
    r = httpx.post(f"{server.base_url}/v1/completions",
                   json={"model": model, "prompt": "hi", "max_tokens": 2})  # fmt: skip
    assert r.status_code == 503  # still asleep (kv_cache), and the weights are empty
    client.update_weights_from_disk(str(tiny_llama))
    client.wake_up(["kv_cache"])
    assert greedy(server, model) == before


# --------------------------------------------------------------------------- the distributed path


def _trainer(base_url: str, port: int, ckpt: str, die_mid_broadcast: bool, q: Any) -> None:
    """A trainer process: joins the group as rank 0 and broadcasts a checkpoint's weights."""
    import os

    import torch

    torch.set_num_threads(1)
    client = TrainerClient(base_url)
    try:
        client.init_weights_update_group("127.0.0.1", port, tern_world_size=2,
                                         group_name="g", timeout_s=20)  # fmt: skip
        sd = load_file(next(Path(ckpt).glob("*.safetensors")))
        if die_mid_broadcast:
            import threading

            names = list(sd)
            body = {"names": names, "dtypes": ["float32"] * len(names),
                    "shapes": [list(sd[n].shape) for n in names], "group_name": "g"}  # fmt: skip
            threading.Thread(target=lambda: client.post("/update_weights_from_distributed", body),
                             daemon=True).start()  # fmt: skip
            time.sleep(1.0)
            torch.distributed.broadcast(sd[names[0]], src=0, group=client._group)
            q.put("dying")
            q.close()
            q.join_thread()  # the queue's feeder thread must flush before the hard exit
            os._exit(3)
        client.update_weights_from_distributed(sd, bucket_bytes=1 << 20)
        client.destroy_weights_update_group()
        q.put("ok")
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put(f"error: {e}")


def test_distributed_update_from_a_trainer_process_at_tp2(
    launch_server: Any, tiny_llama: Path, tiny_llama_perturbed: Path
):
    server = launch_server("--model", str(tiny_llama), "--dtype", "float32", "--tp", "2",
                           "--kv-cache-memory", "0.25")  # fmt: skip
    model = str(tiny_llama)
    original = hf_greedy(tiny_llama, PROMPTS, N)
    perturbed = hf_greedy(tiny_llama_perturbed, PROMPTS, N)
    assert greedy(server, model) == original
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    for ckpt, expected in [(tiny_llama_perturbed, perturbed), (tiny_llama, original)]:
        proc = ctx.Process(
            target=_trainer, args=(server.base_url, free_port(), str(ckpt), False, q)
        )
        proc.start()
        assert q.get(timeout=120) == "ok"
        proc.join(30)
        assert proc.exitcode == 0
        assert greedy(server, model) == expected

    # The trainer dies mid-broadcast: the update fails after the group timeout and rolls back.
    client = TrainerClient(server.base_url)
    version = client.weight_version()
    proc = ctx.Process(target=_trainer, args=(server.base_url, free_port(), str(tiny_llama_perturbed), True, q))  # fmt: skip
    proc.start()
    assert q.get(timeout=120) == "dying"
    proc.join(30)
    # Requests wait for the failed update to roll back, then get the old weights.
    assert greedy(server, model) == original
    assert client.weight_version() == version
    assert server.proc.poll() is None


def test_int8_at_tp2_through_every_weight_update_path(
    launch_server: Any, tiny_llama: Path, tiny_llama_perturbed: Path
):
    """`--quantization int8 --tp 2`: weights pushed from disk, as tensors, through /dev/shm and from
    a trainer's process group are quantized as they load, so each update leaves the server
    generating what it generated when it last served those weights. (How close int8 stays to
    float32 is tests/dist/test_quantized_layers.py's and scripts/bench_quant.py's job.)"""
    server = launch_server("--model", str(tiny_llama), "--dtype", "float32", "--tp", "2",
                           "--quantization", "int8", "--kv-cache-memory", "0.25")  # fmt: skip
    model = str(tiny_llama)
    original = greedy(server, model)
    client = TrainerClient(server.base_url)
    client.update_weights_from_disk(str(tiny_llama_perturbed))
    perturbed = greedy(server, model)
    assert perturbed != original
    client.update_weights_from_tensors(state_dict(tiny_llama), bucket_bytes=1 << 20)
    assert greedy(server, model) == original
    client.update_weights_from_tensors(state_dict(tiny_llama_perturbed), load_format="shm")
    assert greedy(server, model) == perturbed

    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_trainer, args=(server.base_url, free_port(), str(tiny_llama), False, q))  # fmt: skip
    proc.start()
    assert q.get(timeout=120) == "ok"
    proc.join(30)
    assert proc.exitcode == 0
    assert greedy(server, model) == original
