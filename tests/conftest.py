"""Shared pytest fixtures: tiny random-weight checkpoints of each supported architecture, and the
lanes (docs/testing.md).

The checkpoints borrow the default model's tokenizer (vocab 49152) when that model has been
prepared, so tests that go through text can use them; otherwise they have a 512-token vocabulary
and no tokenizer. Torch runs on few threads: the machine's cores are shared.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

torch.set_num_threads(1)

# The KV cache of an engine a test runs in its own process (the default is 1 GiB): a tiny model's
# 1 GiB is ~130,000 blocks, which take ~0.4 s of page faults to zero at each engine's start (115 s
# of the unit lane's CPU, 642 engines), and no test here fills more than a few hundred blocks.
IN_PROCESS_KV_CACHE_GIB = 0.125

# --------------------------------------------------------------------------- lanes
# What a test needs, as a marker (registered in pyproject.toml; `-m unit`, `-m "unit or server"`):
# unit: in-process; server: requests to a server from the `shared_server` factory (one per
# argument list, shared by modules); multiproc: a server of its own (weight updates, pauses,
# sleeps, faults, LoRA loading), several servers, or engine cores and workers as processes;
# system: the minutes-long whole-system runs in tests/system.
LANES = ("unit", "server", "multiproc", "system")


def lane_of(item: pytest.Item) -> str:
    """By folder; in tests/integration, by fixture: a test that reaches `shared_server` (through
    its module's `server` fixture) is in the server lane, any other is multiproc."""
    folder = Path(item.path).relative_to(ROOT / "tests").parts[0]
    if folder == "integration":
        return "server" if "shared_server" in getattr(item, "fixturenames", ()) else "multiproc"
    return {"dist": "multiproc", "system": "system"}.get(folder, "unit")


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator:
    # Before every other implementation: the lanes, which `-m` selects by.
    for item in items:
        if ROOT / "tests" in Path(item.path).parents and not any(
            item.get_closest_marker(lane) for lane in LANES
        ):
            item.add_marker(lane_of(item))
    result = yield
    # After them all: `-m` has selected and pytest has grouped the tests of a parametrized
    # module-scoped fixture (which moves tests within a file).
    call_seconds = _recorded_call_seconds()
    _longest_files_first(items, call_seconds)
    limit = os.environ.get("TERN_FAST_MAX_S")
    if limit:
        _deselect_slow(config, items, call_seconds, float(limit))
    return result


def _recorded_call_seconds() -> dict[str, float]:
    """Each test's call time in the last whole run on this CPU tier (tests/timings/<tier>.json),
    or nothing where none was recorded."""
    timings = ROOT / "tests" / "timings" / f"{_load_script('test_timings').cpu_tier()}.json"
    return json.loads(timings.read_text()) if timings.is_file() else {}


def _longest_files_first(items: list[pytest.Item], call_seconds: dict[str, float]) -> None:
    """pytest-xdist (`--dist loadfile`) hands each worker the next file in collection order as
    it runs out of work: with the longest files first, the last ones handed out are short and the
    workers finish together (a 300 s file handed out last kept one worker busy while the other
    idled). The server lane's tests stay first and in their order: consecutive modules reuse
    the shared servers they launch with the same arguments (a file with tests in two lanes is
    two groups; scripts/test runs the lanes apart anyway). Tests keep their order in a file;
    a test not recorded counts as one second. Every xdist worker sorts alike: the order only
    depends on the committed timings."""

    def in_server_lane(item: pytest.Item) -> bool:
        return item.get_closest_marker("server") is not None

    seconds: dict[tuple[Path, bool], float] = {}
    for item in items:
        group = (item.path, in_server_lane(item))
        seconds[group] = seconds.get(group, 0.0) + call_seconds.get(item.nodeid, 1.0)
    first_seen = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}

    def key(item: pytest.Item) -> tuple:
        if in_server_lane(item):
            return (0, first_seen[item.path])
        return (1, -seconds[(item.path, False)], first_seen[item.path])

    items.sort(key=key)


def _deselect_slow(
    config: pytest.Config, items: list[pytest.Item], call_seconds: dict[str, float], limit: float
) -> None:
    """`scripts/test --fast`: leaves out the tests whose call took more than `limit` seconds in the
    last whole run on this CPU tier (a test not recorded there runs)."""
    if not call_seconds:
        return
    slow = [item for item in items if call_seconds.get(item.nodeid, 0.0) > limit]
    if slow:
        config.hook.pytest_deselected(items=slow)
        slow_ids = {id(item) for item in slow}
        items[:] = [item for item in items if id(item) not in slow_ids]


# Each test's time (setup + call + teardown) and lane, written as JSON to $TERN_TEST_TIMINGS at
# the end of the session; scripts/test turns the runs' files into tests/timings/<cpu tier>.txt.
_TIMES: dict[str, dict] = {}
_START = time.monotonic()
_START_EPOCH = time.time()  # reports carry epoch stop times


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not os.environ.get("TERN_TEST_TIMINGS"):
        return
    lane = next((lane for lane in LANES if lane in report.keywords), "?")
    entry = _TIMES.setdefault(
        report.nodeid, {"seconds": 0.0, "call": 0.0, "lane": lane, "outcome": "passed"}
    )
    entry["seconds"] += report.duration
    # Which xdist worker ran it, and when it ended: whether the workers finished together.
    node = getattr(report, "node", None)  # the xdist worker, on the controller
    if node is not None:
        entry["worker"] = node.gateway.id
    entry["ended_s"] = round(report.stop - _START_EPOCH, 1)
    if report.when == "call":
        entry["call"] = report.duration
    if report.outcome != "passed" and entry["outcome"] == "passed":
        entry["outcome"] = report.outcome


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("TERN_TEST_TIMINGS")
    if not path or hasattr(session.config, "workerinput"):  # xdist workers: the controller writes
        return
    record = {"wall_seconds": time.monotonic() - _START, "tests": _TIMES}
    Path(path).write_text(json.dumps(record))


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / f"scripts/{name}.py")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as an import would: dataclasses look their module up there.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _load_tiny_model_module():
    return _load_script("make_tiny_model")


make_tiny_model = _load_tiny_model_module().make_tiny_model


# --------------------------------------------------------------------------- built once per run
def built_once(
    name: str, factory: pytest.TempPathFactory, build: Callable[[Path], tuple[Path, ...]]
) -> tuple[Path, ...]:
    """`build(work_dir)`'s paths, built once per `scripts/test` run: its pytest processes (the
    xdist workers, then the multiproc lane) share $TERN_TEST_SHARED, a directory scripts/test
    makes and removes, and take turns under a lock, so the first builds and the others reuse.
    Without it (a plain pytest run), built in this session's temporary directory. For inputs that
    take seconds to make and that tests only read (a GGUF file, its prepared directory and Hugging
    Face's reference of it)."""
    root = os.environ.get("TERN_TEST_SHARED")
    if not root:
        return build(factory.mktemp(name))
    work = Path(root) / name
    built = work / ".built.json"
    Path(root).mkdir(parents=True, exist_ok=True)
    with open(Path(root) / f".{name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built.is_file():
            shutil.rmtree(work, ignore_errors=True)  # a build that failed or was killed
            work.mkdir()
            paths = build(work)
            built.write_text(json.dumps([str(p) for p in paths]))
    return tuple(Path(p) for p in json.loads(built.read_text()))


def _prepared_tokenizer_dir() -> Path | None:
    """The default model's directory when it is prepared (it holds the tokenizer), else None."""
    try:
        from frontend.model_prep import default_model_dir, is_complete
    except ImportError:
        return None
    model_dir = Path(default_model_dir())
    return model_dir if is_complete(model_dir) else None


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path | None:
    return _prepared_tokenizer_dir()


def _tiny(arch: str, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> Path:
    return make_tiny_model(arch, tmp_path_factory.mktemp(f"tiny_{arch}"), tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> Path:
    """Llama: tied embeddings, llama3 rope scaling, transformers-5 style config.json."""
    return _tiny("llama", tmp_path_factory, tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> Path:
    """Qwen2: untied embeddings, q/k/v bias, linear rope scaling, transformers-4 style config.json."""
    return _tiny("qwen2", tmp_path_factory, tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> Path:
    """Qwen3: q/k norm, head_dim from config.json."""
    return _tiny("qwen3", tmp_path_factory, tokenizer_dir)


def _zoo_fixture(arch: str) -> Callable[..., Path]:
    @pytest.fixture(scope="session")
    def fixture(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> Path:
        return _tiny(arch, tmp_path_factory, tokenizer_dir)

    fixture.__doc__ = f"A tiny {arch} (scripts/make_tiny_model.py: what the family changes)."
    return fixture


# tiny_mistral, tiny_gemma3, ...: one fixture per family of the model zoo; tiny_qwen3_moe, ...:
# one per mixture-of-experts family.
ZOO_FIXTURES = tuple(f"tiny_{arch}" for arch in _load_tiny_model_module().ZOO_ARCHS)
MOE_FIXTURES = tuple(f"tiny_{arch}" for arch in _load_tiny_model_module().MOE_ARCHS)
for _name in ZOO_FIXTURES + MOE_FIXTURES:
    globals()[_name] = _zoo_fixture(_name.removeprefix("tiny_"))


@pytest.fixture(scope="session")
def tiny_qwen3_5_mtp(tiny_qwen3_5: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3.5 with a random multi-token-prediction head (`mtp.*`), as releases have."""
    return _load_tiny_model_module().add_mtp_head(
        tiny_qwen3_5, tmp_path_factory.mktemp("tiny_qwen3_5_mtp")
    )


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_mtp(tiny_qwen3_5_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3.5-MoE with a random multi-token-prediction head (its layer has experts)."""
    return _load_tiny_model_module().add_mtp_head(
        tiny_qwen3_5_moe, tmp_path_factory.mktemp("tiny_qwen3_5_moe_mtp")
    )


@pytest.fixture(scope="session")
def tiny_llama_eagle3(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random EAGLE-3 head for the tiny Llama (features before its layers 0, 1 and 2)."""
    return _load_tiny_model_module().make_eagle3_head(
        tiny_llama, tmp_path_factory.mktemp("tiny_llama_eagle3"), [0, 1, 2]
    )


@pytest.fixture(scope="session")
def tiny_llama_perturbed(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None
) -> Path:
    """The tiny Llama's architecture with other random weights: the "trained" checkpoint of RL tests."""
    return make_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny_llama_perturbed"), tokenizer_dir, 1
    )


@pytest.fixture(scope="session")
def tiny_llama_with_tokenizer(tiny_llama: Path, tokenizer_dir: Path | None) -> Path:
    """The tiny Llama, for tests that go through text (it has the default model's tokenizer)."""
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer (python -m frontend.model_prep)")
    return tiny_llama


@pytest.fixture(scope="session")
def tiny_pooling_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory of tiny pooling checkpoints, each built once: (arch, head, num_labels) -> directory.

    head "score": <Arch>ForSequenceClassification with num_labels; "score_mlp" (qwen2): a
    Qwen2ForRewardModel checkpoint; "none": the bare <Arch>Model (scripts/make_tiny_model.py).
    """
    made: dict[tuple[str, str, int, int], Path] = {}

    def make(arch: str, head: str, num_labels: int = 1, seed: int = 0) -> Path:
        key = (arch, head, num_labels, seed)
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny_{arch}_{head}{num_labels}_s{seed}")
            made[key] = make_tiny_model(arch, out, None, seed, head, num_labels)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_qwen3_classifier(tiny_pooling_model: Callable[..., Path]) -> Path:
    """Qwen3ForSequenceClassification with 3 labels (served as classify by --task auto)."""
    return tiny_pooling_model("qwen3", "score", 3)


@pytest.fixture(scope="session")
def tiny_qwen2_reward(tiny_pooling_model: Callable[..., Path]) -> Path:
    """A Qwen2ForRewardModel checkpoint (score MLP; served as reward by --task auto)."""
    return tiny_pooling_model("qwen2", "score_mlp")


def _runnable_kernel_tiers() -> list[str]:
    from workers.kernels.kernel_library import runnable_tiers

    return [t.name for t in runnable_tiers()]


@pytest.fixture(params=_runnable_kernel_tiers())
def kernel_tier(request: pytest.FixtureRequest):
    """Runs the test once per kernel tier this CPU can run (workers/kernels/kernel_library.py):
    the kernels a test calls, and models it builds, use that tier's build."""
    from workers.kernels.kernel_library import load_tier, use_tier

    assert load_tier(request.param) is not None, f"the {request.param} kernels did not build"
    with use_tier(request.param):
        yield request.param
