"""The engine core's share of image inputs: prefix-cache blocks keyed by the images their
placeholders stand for, chunks that never split an image on models that attend inside it in both
directions, and the images sent to the workers with a request's first chunk (again after a
preemption)."""

from __future__ import annotations

from enginecore.config import CacheConfig, Config, ModelConfig, SchedulerConfig
from enginecore.messages import ModelRunnerOutput, MultiModalItem, SamplingParams, TensorData
from enginecore.request import Request
from enginecore.scheduler import Scheduler

PLACEHOLDER = 9
BLOCK = 4


def _item(content_hash: str, start: int, length: int) -> MultiModalItem:
    return MultiModalItem("image", content_hash, [(start, length)],
                          {"pixel_values": TensorData("float32", [1], b"\0\0\0\0")})  # fmt: skip


def _request(
    req_id: str, content_hash: str, image_at: int = 6, length: int = 8, tail: int = 4
) -> Request:
    """`image_at` text tokens, the image's `length` placeholders, `tail` text tokens."""
    prompt = list(range(1, image_at + 1)) + [PLACEHOLDER] * length + list(range(20, 20 + tail))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    return Request(req_id, prompt, params, mm_items=[_item(content_hash, image_at, length)])


def _scheduler(budget: int = 64, whole: bool = False) -> Scheduler:
    config = Config(
        model=ModelConfig(path="unused"),
        cache=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4),
    )
    return Scheduler(config, 64, max_model_len=256, whole_image_spans=whole)


def _finish(sched: Scheduler, req_id: str) -> None:
    """Runs the request to its end, one sampled token per step."""
    for _ in range(50):
        step = sched.schedule()
        if not step.requests:
            return
        sampled = [[5] if r.sample_index >= 0 else [] for r in step.requests]
        ids = [r.req_id for r in step.requests]
        keep = [(i, t) for i, t in zip(ids, sampled) if t]
        sched.update_from_output(
            step, ModelRunnerOutput(step.step_id, [i for i, _ in keep], [t for _, t in keep])
        )
    raise AssertionError(f"{req_id} never finished")


def test_the_same_placeholders_with_another_image_never_hit() -> None:
    sched = _scheduler()
    sched.add_request(_request("a", "cat"))
    _finish(sched, "a")
    same, other = _request("b", "cat"), _request("c", "dog")
    _, hit_same = sched.kv.find_cached_prefix(same)
    _, hit_other = sched.kv.find_cached_prefix(other)
    assert hit_same == 16  # every full block but the last token's
    assert hit_other == 4  # the blocks before the image's first placeholder (position 6)


def test_images_travel_with_the_first_chunk_and_again_after_preemption() -> None:
    sched = _scheduler(budget=8)
    sched.add_request(_request("a", "cat"))
    first = sched.schedule().requests[0]
    assert [item.content_hash for item in first.mm_items] == ["cat"]
    assert sched.retract_running() == 1
    again = sched.schedule().requests[0]
    assert again.sampling_params is not None and [i.content_hash for i in again.mm_items] == ["cat"]


def test_chunks_split_images_unless_the_model_attends_inside_them_both_ways() -> None:
    split = _scheduler(budget=8)
    split.add_request(_request("a", "cat"))
    assert len(split.schedule().requests[0].token_ids) == 8  # ends at position 8, inside 6..13
    whole = _scheduler(budget=8, whole=True)
    whole.add_request(_request("a", "cat"))
    step = whole.schedule()
    assert len(step.requests[0].token_ids) == 6  # up to the image
    whole.update_from_output(step, ModelRunnerOutput(step.step_id, [], []))
    assert len(whole.schedule().requests[0].token_ids) == 8  # the whole image


def test_a_prefix_hit_never_ends_inside_an_image_that_must_be_whole() -> None:
    sched = _scheduler(whole=True)
    sched.add_request(_request("a", "cat", image_at=2, length=12))
    _finish(sched, "a")
    _, hit = sched.kv.find_cached_prefix(_request("b", "cat", image_at=2, length=12, tail=4))
    assert hit == 16  # past the image (positions 2..13)
    # Its first 12 tokens are cached, but a hit may end at 4, 8 or 12 only: inside the image.
    _, hit = sched.kv.find_cached_prefix(_request("c", "cat", image_at=2, length=12, tail=0))
    assert hit == 0
