"""M-RoPE (Qwen3.5's language model with images): the (t, h, w) positions of a prompt's tokens as
Hugging Face's get_rope_index gives them, computed chunk by chunk from each image's span and grid;
the rotation by them as Qwen3_5TextRotaryEmbedding's; and the tiny Qwen3.5 with images in the
engine (chunked prefill, prefix cache with state checkpoints) answering as HF generate does."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen

from enginecore.messages import EngineCoreRequest, MultiModalItem, SamplingParams, TensorData
from tests.conftest import make_tiny_model
from tests.unit.test_engine_inproc import make_core
from workers.layers.rotary import RopeParams, RotaryEmbedding
from workers.runner.mrope import MRopeLayout, VisionGrid, mrope_positions, vision_grids

IMAGE = 7  # the placeholder id of the sequences HF's get_rope_index reads here


def hf_rope_index(ids: list[int], grids: list[tuple[int, int, int]], merge: int):
    """HF's (3, L) positions and delta for `ids`, images' grids (t, h, w) in patches."""
    config = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge))
    fake = SimpleNamespace(config=config)
    fake.get_vision_position_ids = functools.partial(
        transformers.Qwen3_5Model.get_vision_position_ids, fake
    )
    input_ids = torch.tensor([ids])
    positions, delta = transformers.Qwen3_5Model.get_rope_index(
        fake, input_ids, mm_token_type_ids=(input_ids == IMAGE).int(),
        image_grid_thw=torch.tensor(grids),
    )  # fmt: skip
    return positions[:, 0], int(delta)


def test_positions_are_hfs_chunk_by_chunk_and_past_the_prompt() -> None:
    merge = 2
    patch_grids = [(1, 4, 6), (1, 8, 2)]  # 2x3 and 4x1 merged tokens
    ids, grids = [1, 2, 3], []
    for t, h, w in patch_grids:
        ids += [5]
        grids.append(VisionGrid(len(ids), (t, h // merge, w // merge)))
        ids += [IMAGE] * (t * h * w // merge**2) + [6]
    ids += [4, 4]
    expected, delta = hf_rope_index(ids, patch_grids, merge)
    whole = mrope_positions(grids, 0, len(ids))
    assert torch.equal(whole, expected)
    assert delta < 0  # the images took fewer positions than tokens
    for cut in (5, 7, 12):  # chunks that split the first image, the second, the text
        parts = [mrope_positions(grids, 0, cut), mrope_positions(grids, cut, len(ids))]
        assert torch.equal(torch.cat(parts, 1), expected)
    decode = mrope_positions(grids, len(ids), len(ids) + 3)
    assert torch.equal(decode, torch.arange(len(ids), len(ids) + 3).expand(3, -1) + delta)
    assert torch.equal(mrope_positions([], 4, 9), torch.arange(4, 9).expand(3, -1))


VIDEO = 8


def _video_item(start: int, grid: tuple[int, int, int], runs: int, seconds: float | None):
    """A video's item: `runs` runs of placeholders from `start`, one token of text between."""
    tensors = {"video_grid_thw": TensorData("int64", [1, 3], np.array([grid]).tobytes())}
    if seconds is not None:
        tensors["second_per_grid_ts"] = TensorData("float32", [1], np.float32([seconds]).tobytes())
    length = grid[0] * grid[1] * grid[2] // 4 // runs
    spans = [(start + i * (length + 1), length) for i in range(runs)]
    return MultiModalItem("video", "h", spans, tensors)


@pytest.mark.parametrize("model", ["Qwen2_5_VLModel", "Qwen3VLModel"])
def test_video_positions_are_hfs(model: str) -> None:
    """Qwen2.5-VL: a video is one (t, h, w) run whose time coordinate steps by tokens_per_second *
    second_per_grid_ts (here 3 * 1.5: 4.5, quantised as HF does); Qwen3-VL: a run per temporal
    patch, text between, each a (1, h, w) grid. Chunked, and text after the video."""
    qwen3 = model == "Qwen3VLModel"
    grid = (3, 4, 6)  # 3 temporal patches of 2x3 merged tokens
    ids = [1, 2]
    item = _video_item(len(ids), grid, 3 if qwen3 else 1, None if qwen3 else 1.5)
    for start, length in item.spans:
        ids += [9] * (start - len(ids)) + [VIDEO] * length
    ids += [5, 6, 7]
    config = SimpleNamespace(
        vision_config=SimpleNamespace(spatial_merge_size=2, tokens_per_second=3)
    )
    fake = SimpleNamespace(config=config)
    hf_class = getattr(transformers, model)
    fake.get_vision_position_ids = functools.partial(hf_class.get_vision_position_ids, fake)
    input_ids = torch.tensor([ids])
    extra = {} if qwen3 else {"second_per_grid_ts": torch.tensor([1.5])}
    expected, _ = hf_class.get_rope_index(
        fake, input_ids, mm_token_type_ids=2 * (input_ids == VIDEO).int(),
        video_grid_thw=torch.tensor([grid]), **extra,
    )  # fmt: skip
    grids = vision_grids([item], MRopeLayout(2, 3.0))
    assert len(grids) == (3 if qwen3 else 1)
    for cut in (len(ids), 5, 11):
        parts = [mrope_positions(grids, 0, cut), mrope_positions(grids, cut, len(ids))]
        assert torch.equal(torch.cat(parts, 1), expected[:, 0])


def test_the_rotation_is_hfs_interleaved_mrope() -> None:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "mrope_section": [2, 2, 2], "mrope_interleaved": True}  # fmt: skip
    text = transformers.Qwen3_5TextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_parameters=rope,
    )  # fmt: skip
    hf_rotary = hf_qwen.Qwen3_5TextRotaryEmbedding(text)
    ours = RotaryEmbedding(16, 128, RopeParams.from_hf_config(text.to_dict()))
    torch.manual_seed(0)
    positions = torch.randint(0, 100, (3, 10))
    q, k = torch.randn(10, 4, 16), torch.randn(10, 2, 16)
    cos, sin = hf_rotary(q, positions[:, None, :])  # (1, T, R)
    hf_q, hf_k = hf_qwen.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    got_q, got_k = ours(positions[0], q.clone(), k.clone(), positions)
    torch.testing.assert_close(got_q, hf_q[0].transpose(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(got_k, hf_k[0].transpose(0, 1), atol=1e-6, rtol=0)
    # Equal axes: the plain rotation by that position.
    same = positions[0].expand(3, -1)
    plain_q, _ = ours(positions[0], q.clone(), k.clone())
    torch.testing.assert_close(ours(positions[0], q.clone(), k.clone(), same)[0], plain_q)


def test_qwen2_5_vl_rotates_in_sections() -> None:
    """Qwen2.5-VL's M-RoPE: the first mrope_section[0] frequencies turn by time, the next by
    height, the last by width (Hugging Face's Qwen2_5_VLRotaryEmbedding), from config.json as
    released (transformers 4: rope_scaling type "mrope") and as transformers 5 saves it."""
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as hf_qwen2_5

    section = [2, 3, 3]
    text = transformers.Qwen2_5_VLTextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
    )  # fmt: skip
    hf_rotary = hf_qwen2_5.Qwen2_5_VLRotaryEmbedding(text)
    arch = {"architectures": ["Qwen2_5_VLForConditionalGeneration"]}
    released = {**arch, "max_position_embeddings": 128, "rope_theta": 10000.0,
                "rope_scaling": {"type": "mrope", "mrope_section": section}}  # fmt: skip
    torch.manual_seed(0)
    positions = torch.randint(0, 100, (3, 10))
    q, k = torch.randn(10, 4, 16), torch.randn(10, 2, 16)
    cos, sin = hf_rotary(q, positions[:, None, :])
    hf_q, hf_k = hf_qwen2_5.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    for config in ({**text.to_dict(), **arch}, released):
        ours = RotaryEmbedding(16, 128, RopeParams.from_hf_config(config))
        got_q, got_k = ours(positions[0], q.clone(), k.clone(), positions)
        torch.testing.assert_close(got_q, hf_q[0].transpose(0, 1), atol=1e-6, rtol=0)
        torch.testing.assert_close(got_k, hf_k[0].transpose(0, 1), atol=1e-6, rtol=0)


def _image(seed: int, height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _tensor(t: torch.Tensor) -> TensorData:
    a = np.ascontiguousarray(t.numpy())
    return TensorData(str(a.dtype), list(a.shape), a.tobytes())


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None) -> Path:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    return make_tiny_model("qwen3_5_vl", tmp_path_factory.mktemp("qwen3_5_vl"), tokenizer_dir)


def _prompt(model_dir: Path, images: list[Image.Image], words: list[list[int]]):
    """words[0], image 0, words[1], image 1, ... -> (ids, items, HF's inputs)."""
    config = json.loads((model_dir / "config.json").read_text())
    processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
    ids, items = list(words[0]), []
    for i, image in enumerate(images):
        tensors = dict(processor([image], return_tensors="pt"))
        n = int(tensors["image_grid_thw"].prod()) // 4
        ids.append(config["vision_start_token_id"])
        data = {name: _tensor(t) for name, t in tensors.items()}
        digest = hashlib.sha256(data["pixel_values"].data).hexdigest()  # names the image
        items.append(MultiModalItem("image", digest, [(len(ids), n)], data))
        ids += [config["image_token_id"]] * n + [config["vision_end_token_id"]]
        ids += words[i + 1]
    batch = dict(processor(images, return_tensors="pt"))
    input_ids = torch.tensor([ids])
    hf_inputs = {**batch, "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                 "mm_token_type_ids": (input_ids == config["image_token_id"]).int()}  # fmt: skip
    return ids, items, hf_inputs


def test_engine_with_images_is_hf_exact(qwen_vl: Path) -> None:
    """One image, two images with text between and after; greedy equals HF generate (fp32) with
    prefills in chunks of 7 that split images, and again from the prefix cache (hybrid state
    checkpoints); two different images give different answers."""
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        qwen_vl, dtype=torch.float32
    ).eval()
    cases = {
        "one": ([_image(1, 32, 32)], [[10, 11], [12, 13, 14]]),
        "other": ([_image(2, 32, 32)], [[10, 11], [12, 13, 14]]),
        "two": ([_image(3, 24, 40), _image(4, 40, 16)], [[20], [21, 22], [23, 24, 25]]),
    }
    prompts = {name: _prompt(qwen_vl, *case) for name, case in cases.items()}
    expected = {}
    with torch.no_grad():
        for name, (ids, _, inputs) in prompts.items():
            out = hf.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0,
                              eos_token_id=None)  # fmt: skip
            expected[name] = out[0, len(ids) :].tolist()
    assert expected["one"] != expected["other"]
    core = make_core(qwen_vl, block_size=4, max_num_batched_tokens=7, state_checkpoint_interval=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for rnd in range(2):  # the second round from the prefix cache, past the images
        for name, (ids, items, _) in prompts.items():
            assert (
                core.add_request(EngineCoreRequest(f"{name}{rnd}", ids, params, mm_items=items))
                == []
            )
        outs: dict[str, list[int]] = {}
        cached = 0
        while core.scheduler.has_requests:
            for o in core.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
                cached = max(cached, o.num_cached_tokens or 0)
        assert {name: outs[f"{name}{rnd}"] for name in prompts} == expected, rnd
        # Round 1 resumes past an image from a state checkpoint (every 8 tokens): the text after
        # it is placed by the grids of images the workers never see encoded again.
        images_end = max(item.end for _, items, _ in prompts.values() for item in items)
        assert cached == 0 if rnd == 0 else cached >= images_end
