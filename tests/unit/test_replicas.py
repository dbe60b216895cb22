"""The data-parallel frontend's pieces without processes: the load balancer's choices, and control
calls over replicas as one transaction (fake replicas that answer as engine cores do, one of them
failing where a real one could)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from enginecore.messages import (
    EngineControlOp,
    FinishLoraLoad,
    FinishWeightsUpdate,
    InitWeightsUpdateGroup,
    LoadLora,
    LoadLoraAdapter,
    MultiModalItem,
    PauseGeneration,
    ResumeGeneration,
    UpdateOptions,
    UpdateWeights,
    UpdateWeightsFromTensors,
)
from frontend.cli.launch import config_from_args, make_parser
from frontend.engine.client import replica_config
from frontend.engine.core_client import EngineDeadError, UtilityError
from frontend.engine.load_balancer import AFFINITY_SLACK, LoadBalancer, ReplicaLoad
from frontend.engine.replicas import ReplicaControl

BLOCK = 4


def idle(n: int = 2) -> list[ReplicaLoad | None]:
    return [ReplicaLoad(0, 0.0) for _ in range(n)]


def test_least_loaded_wins_and_idle_replicas_take_turns() -> None:
    lb = LoadBalancer(2, BLOCK)
    assert lb.choose([1, 2], [ReplicaLoad(3, 0.0), ReplicaLoad(1, 0.9)]) == 1
    assert lb.choose([1, 2], [ReplicaLoad(1, 0.5), ReplicaLoad(1, 0.1)]) == 1  # KV breaks ties
    assert {lb.choose([1, 2], idle()) for _ in range(4)} == {0, 1}
    assert lb.choose([1, 2], [None, ReplicaLoad(50, 1.0)]) == 1  # the dead never
    with pytest.raises(ValueError):
        lb.choose([1], [None, None])


def test_a_cached_prefix_wins_within_the_slack_and_spreads_beyond_it() -> None:
    lb = LoadBalancer(2, BLOCK)
    prefix = list(range(100, 100 + 3 * BLOCK))
    first = lb.choose(prefix + [1], idle())
    other = 1 - first
    loads: list[ReplicaLoad | None] = [ReplicaLoad(0, 0.0), ReplicaLoad(0, 0.0)]
    loads[first] = ReplicaLoad(AFFINITY_SLACK, 0.0)
    assert lb.choose(prefix + [2], loads) == first  # busier, but holds the prefix
    assert lb.num_routed[first]["prefix"] == 1
    loads[first] = ReplicaLoad(AFFINITY_SLACK + 1, 0.0)
    assert lb.choose(prefix + [3], loads) == other  # too busy: the other computes it
    # Now both hold it: the less loaded of them.
    assert lb.choose(prefix + [4], [ReplicaLoad(2, 0.0), ReplicaLoad(1, 0.0)]) == 1
    # The longest remembered prefix decides: only `first` was sent this longer one.
    longer = prefix + list(range(7, 7 + BLOCK))
    loads = idle()
    loads[other] = None
    lb.choose(longer, loads)
    assert lb.choose(longer + [5], [ReplicaLoad(2, 0.0), ReplicaLoad(2, 0.0)]) == first
    lb.forget(first)
    assert lb.choose(longer + [6], [ReplicaLoad(2, 0.0), ReplicaLoad(2, 0.0)]) == other
    lb.forget()
    assert not lb._holders


def test_the_same_placeholders_with_another_image_are_another_prefix() -> None:
    """A prompt's blocks are remembered with the images their placeholders stand for, as the
    replicas' own prefix caches key them: another image under the same ids has no affinity."""
    lb = LoadBalancer(2, BLOCK)
    prompt = [9] * (2 * BLOCK) + [1]  # both full blocks are an image's placeholders

    def image(content_hash: str) -> list[MultiModalItem]:
        return [MultiModalItem("image", content_hash, [(0, 2 * BLOCK)])]

    first = lb.choose(prompt, idle(), image("cat"))
    loads: list[ReplicaLoad | None] = [ReplicaLoad(0, 0.0), ReplicaLoad(0, 0.0)]
    loads[first] = ReplicaLoad(AFFINITY_SLACK, 0.0)
    assert lb.choose(prompt, loads, image("cat")) == first  # busier, but holds the blocks
    assert lb.choose(prompt, loads, image("dog")) == 1 - first  # nothing of it cached anywhere
    assert lb.num_routed[first]["prefix"] == 1 and lb.num_routed[1 - first]["load"] == 1
    # Text before the image is shared whatever the image.
    text_then_image = [1, 2, 3, 4] + [9] * BLOCK + [1]
    after_text = [MultiModalItem("image", "cat", [(BLOCK, BLOCK)])]
    other_image = [MultiModalItem("image", "dog", [(BLOCK, BLOCK)])]
    cat, dog = (lb._prefix_hashes(text_then_image, i) for i in (after_text, other_image))
    assert cat[0] == dog[0] and cat[1] != dog[1]


class FakeReplica:
    """Answers control operations as an engine core does: an update opens (finished=false) or
    commits; FinishWeightsUpdate commits or rolls back; `fail` names operation types it fails."""

    def __init__(self, index: int, fail: tuple[type, ...] = ()) -> None:
        self.index = index
        self.fail = fail
        self.die_on: tuple[type, ...] = ()
        self.is_dead = False
        self.weights, self.staged, self.version = "old", None, "default"
        self.calls: list[EngineControlOp] = []
        self.paused = False

    async def call_utility(self, op: EngineControlOp, timeout: float = 10.0) -> Any:
        self.calls.append(op)
        await asyncio.sleep(0)
        if isinstance(op, self.die_on):
            self.is_dead = True
            raise EngineDeadError("the engine core process exited with code 1")
        if isinstance(op, self.fail):
            self.staged = None  # an engine core rolls back its own open update
            raise UtilityError(f"replica {self.index}: bad tensor shape")
        if isinstance(op, UpdateWeights):
            self.staged = op.source.shm_paths
            return {"success": True}
        if isinstance(op, FinishWeightsUpdate):
            if self.staged is None:
                raise UtilityError("no weight update is open")
            if op.commit:
                self.weights, self.version = self.staged, op.weight_version
            self.staged = None
            return {"success": True, "weight_version": self.version}
        if isinstance(op, PauseGeneration | ResumeGeneration):
            self.paused = isinstance(op, PauseGeneration)
            return {"paused": getattr(op, "mode", None), "is_sleeping": False, "asleep_tags": [],
                    "weights_valid": True, "update_open": False, "weight_version": self.version}  # fmt: skip
        return {"success": True}


def run(control: ReplicaControl, op: EngineControlOp) -> Any:
    return asyncio.run(control.call(op, 10.0))


def push(name: str, **options: Any) -> UpdateWeights:
    """An update whose tensors the fakes know by name."""
    return UpdateWeights(UpdateWeightsFromTensors(shm_paths=[name]), UpdateOptions(**options))


def test_an_update_commits_on_every_replica_with_one_version() -> None:
    replicas = [FakeReplica(0), FakeReplica(1)]
    control = ReplicaControl(replicas, ranks_per_replica=2)
    run(control, push("new"))
    assert [(r.weights, r.version) for r in replicas] == [(["new"], "1"), (["new"], "1")]
    # Every replica prepared (finished=false) before any committed.
    assert [type(op) for op in replicas[0].calls] == [UpdateWeights, FinishWeightsUpdate]
    assert replicas[0].calls[0].options.finished is False
    # Buckets: held open on every replica until the last one.
    run(control, push("b1", finished=False))
    assert all(r.staged == ["b1"] and r.weights == ["new"] for r in replicas)
    run(control, push("b2", weight_version="v7"))
    assert [(r.weights, r.version) for r in replicas] == [(["b2"], "v7"), (["b2"], "v7")]


def test_a_failure_on_one_replica_rolls_back_every_replica() -> None:
    good, bad = FakeReplica(0), FakeReplica(1, fail=(UpdateWeights,))
    control = ReplicaControl([good, bad], ranks_per_replica=1)
    with pytest.raises(UtilityError, match="bad tensor shape"):
        run(control, push("new"))
    assert (good.weights, good.staged, bad.weights) == ("old", None, "old")
    assert good.calls[-1] == FinishWeightsUpdate(commit=False)
    # A dead replica fails the call too; the living one rolls back, and later calls skip the dead.
    bad.die_on = (UpdateWeights,)
    with pytest.raises(UtilityError, match="replica 1 failed"):
        run(control, push("new"))
    assert (good.weights, good.staged) == ("old", None)
    run(control, push("new"))
    assert good.weights == ["new"]
    good.is_dead = True
    with pytest.raises(EngineDeadError):
        run(control, ResumeGeneration())


def test_group_ranks_per_replica_and_pause_as_a_whole() -> None:
    replicas = [FakeReplica(0), FakeReplica(1), FakeReplica(2)]
    control = ReplicaControl(replicas, ranks_per_replica=4)
    run(control, InitWeightsUpdateGroup(rank_offset=1, world_size=13, master_address="h",
                                        master_port=1, group_name="g"))  # fmt: skip
    assert [r.calls[-1].rank_offset for r in replicas] == [1, 5, 9]
    run(control, PauseGeneration(mode="keep"))
    assert all(r.paused for r in replicas)
    run(control, ResumeGeneration())
    replicas[2].fail = (PauseGeneration,)
    with pytest.raises(UtilityError):
        run(control, PauseGeneration(mode="keep"))
    assert not any(r.paused for r in replicas)  # the ones that paused resumed


@pytest.mark.parametrize("flag", ["--dp", "-dp", "--data-parallel-size"])
def test_dp_flags_and_each_replicas_config(tmp_path: Path, flag: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    config = config_from_args(make_parser().parse_args(["launch", str(tmp_path), flag, "2"]))
    parallel = config.parallel
    assert (parallel.data_parallel_size, parallel.num_local_workers) == (2, 2)
    second = replica_config(config, 1)
    assert second.parallel.data_parallel_rank == 1 and second.parallel.first_device_index == 1
    assert second.ipc_dir.startswith(config.ipc_dir) and second.ipc_dir != config.ipc_dir
    # a Config makes no directory: the first socket bound in it does (and its server removes it)
    assert not Path(config.ipc_dir).exists() and not Path(second.ipc_dir).exists()
    with pytest.raises(ValueError):
        config_from_args(make_parser().parse_args(["launch", str(tmp_path), flag, "0"]))


def test_a_lora_load_is_served_by_every_replica_or_by_none() -> None:
    source = LoadLora(-1, 8, 2.0, path="/adapters/a")
    good, bad = FakeReplica(0), FakeReplica(1, fail=(LoadLoraAdapter,))
    control = ReplicaControl([good, bad], ranks_per_replica=1)
    with pytest.raises(UtilityError, match="bad tensor shape"):
        run(control, LoadLoraAdapter("a", source))
    assert good.calls[0] == LoadLoraAdapter("a", source, stage=True)
    assert good.calls[-1] == FinishLoraLoad("a", commit=False)
    assert not any(isinstance(op, FinishLoraLoad) for op in bad.calls)
    bad.fail = ()
    run(control, LoadLoraAdapter("a", source))
    assert [r.calls[-1] for r in (good, bad)] == [FinishLoraLoad("a", commit=True)] * 2
