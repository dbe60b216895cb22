"""--distributed-executor-backend ray: tern's ranks as Ray actors in a placement group, on a
two-node Ray cluster on loopback (ray.cluster_utils.Cluster, 2 CPUs a node).

Each server is a real `tern launch` joining the cluster with --ray-address; its engine core is a
Ray driver, so its actors and placement group are found by that driver's job.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from safetensors.torch import load_file

from enginecore.executor import free_port
from frontend.client.trainer import TrainerClient
from tests.unit.test_engine_inproc import hf_greedy

ray = pytest.importorskip("ray")  # in the test extra: present wherever scripts/test runs
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.state import list_actors, list_jobs, list_placement_groups  # noqa: E402

PROMPT_IDS = [101, 2024, 318, 257]
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    node = {"num_cpus": 2, "object_store_memory": 128 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": True})
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def model(tiny_llama_with_tokenizer: Path) -> Path:
    return tiny_llama_with_tokenizer


def _args(model: Path, cluster: Cluster, *extra: str) -> list[str]:
    return [
        "--model", str(model), "--dtype", "float32", "--kv-cache-memory", "0.1",
        "--distributed-executor-backend", "ray", "--ray-address", cluster.address, *extra,
    ]  # fmt: skip


def greedy(server: Any, model: Path) -> list[str]:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", timeout=60)
    out = client.completions.create(
        model=str(model), prompt=PROMPTS, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def engine_actors(server: Any) -> list[Any]:
    """The live actors of the server's engine core (the Ray driver whose pid it has)."""
    pid = server.server_info()["engine"]["engine_core_pid"]
    jobs = {j.job_id for j in list_jobs() if (j.driver_info and int(j.driver_info.pid) == pid)}
    actors = list_actors(filters=[("state", "=", "ALIVE")], detail=True)
    return sorted(
        (a for a in actors if a.job_id in jobs), key=lambda a: int(a.name.rpartition("-")[2])
    )


def live_tern_actors_and_groups() -> tuple[list[str], list[str]]:
    actors = [
        a.name
        for a in list_actors(filters=[("state", "=", "ALIVE")])
        if (a.name or "").startswith("tern-worker-")
    ]
    groups = [g.placement_group_id for g in list_placement_groups() if g.state == "CREATED"]
    return actors, groups


def wait_until_gone(timeout: float = 20.0) -> tuple[list[str], list[str]]:
    deadline = time.monotonic() + timeout
    while True:
        left = live_tern_actors_and_groups()
        if left == ([], []) or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


@pytest.fixture(scope="module")
def mp_tokens(module_server: Any, model: Path) -> list[str]:
    server = module_server(
        "--model", str(model), "--dtype", "float32", "--kv-cache-memory", "0.1", "--tp", "2"
    )  # fmt: skip
    tokens = greedy(server, model)
    server.shut_down()
    return tokens


def test_tp2_packed_ranks_sit_in_their_bundles_and_equal_mp(
    cluster: Cluster, launch_server: Any, model: Path, mp_tokens: list[str]
) -> None:
    server = launch_server(*_args(model, cluster, "--tp", "2"))
    assert greedy(server, model) == mp_tokens
    actors = engine_actors(server)
    assert [a.name.rpartition("-")[2] for a in actors] == ["0", "1"]
    (group,) = {a.placement_group_id for a in actors}
    table = ray.util.placement_group_table()[group]
    assert table["strategy"] == "PACK" and len(table["bundles"]) == 2
    # Each rank's actor runs on its bundle's node; PACK keeps both on one node.
    assert {a.node_id for a in actors} <= set(table["bundles_to_node_id"].values())
    assert len({a.node_id for a in actors}) == 1


def test_pp2_spread_over_two_nodes_equals_mp(
    cluster: Cluster, launch_server: Any, model: Path, mp_tokens: list[str]
) -> None:
    server = launch_server(
        *_args(model, cluster, "--pp", "2", "--ray-placement-strategy", "SPREAD")
    )
    assert greedy(server, model) == mp_tokens
    actors = engine_actors(server)
    assert len(actors) == 2 and len({a.node_id for a in actors}) == 2


def test_a_killed_actor_ends_its_request_and_the_server_with_nothing_left(
    cluster: Cluster, launch_server: Any, model: Path
) -> None:
    server = launch_server(*_args(model, cluster, "--tp", "2"))
    actors = engine_actors(server)
    assert len(actors) == 2
    events: list[str] = []
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/completions",
        json={"model": str(model), "prompt": PROMPTS[0], "max_tokens": 1500,
              "ignore_eos": True, "stream": True},
        timeout=60,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line)
            if len(events) == 3:
                assert actors[1].ray_namespace == "tern", actors[1]
                psutil.Process(actors[1].pid).kill()  # the rank's actor process dies
                killed = time.monotonic()
    assert time.monotonic() - killed < 30
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data:"))["error"]
    assert error["code"] in ("engine_error", "engine_dead"), error
    assert "tern-worker-" in error["message"] and "died" in error["message"], error
    assert server.proc.wait(30) == 1
    assert wait_until_gone() == ([], [])  # and no process: launch_server checks


def test_a_killed_engine_core_takes_its_actors_and_group_along(
    cluster: Cluster, launch_server: Any, model: Path
) -> None:
    server = launch_server(*_args(model, cluster, "--tp", "2"))
    core = psutil.Process(server.server_info()["engine"]["engine_core_pid"])
    assert len(engine_actors(server)) == 2
    core.kill()  # no shutdown of its own: Ray's fate sharing must remove what it owned
    assert server.proc.wait(30) == 1
    assert wait_until_gone() == ([], [])
    with contextlib.suppress(psutil.Error):
        core.wait(5)


def test_a_trainer_group_update_reaches_ranks_placed_by_ray(
    cluster: Cluster, launch_server: Any, model: Path, tiny_llama_perturbed: Path
) -> None:
    """TrainerClient's process-group path: the Ray actors join the trainer's group as worker
    processes do, and the output becomes Hugging Face's on the new weights."""
    server = launch_server(*_args(model, cluster, "--tp", "2"))
    client = TrainerClient(server.base_url)
    client.init_weights_update_group("127.0.0.1", free_port(), tern_world_size=2)
    try:
        client.update_weights_from_distributed(
            load_file(next(tiny_llama_perturbed.glob("*.safetensors")))
        )
    finally:
        client.destroy_weights_update_group()
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": str(model), "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0,
              "ignore_eos": True, "return_token_ids": True},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert (
        r.json()["choices"][0]["token_ids"] == hf_greedy(tiny_llama_perturbed, [PROMPT_IDS], 8)[0]
    )
