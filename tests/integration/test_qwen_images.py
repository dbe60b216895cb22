"""Qwen3.5's, Qwen3.5-MoE's, Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's and Qwen3-VL-MoE's images
through a real server, against Hugging Face: the tiny random Qwen3.5 and Qwen3.5-MoE (Gated
DeltaNet and gated attention layers, M-RoPE over (t, h, w) positions, interleaved) beside their
one-block vision transformer, the tiny Qwen2.5-VL (a Qwen2 with M-RoPE in sections) beside its
two-block windowed tower, the tiny Qwen2-VL (the same language model) beside its two-block
LayerNorm tower, the tiny Qwen3-VL (a Qwen3 whose first two layers add the tower's deepstack rows
at the image's placeholders) and Qwen3-VL-MoE (the same with Qwen3-MoE's experts, stacked as its
checkpoints store them) answer chat requests with images, each greedy answer token for token the
one `*ForConditionalGeneration.generate` gives in float32. Videos too: sampled at 2 frames a
second into temporal patches of two frames (Qwen3-VL's and Qwen3.5's with a timestamp before each),
their (t, h, w) positions spaced in time by Qwen2.5-VL's tokens_per_second; HF's model is given
the pixels tern's processor made (transformers' video processors need torchvision, which has no
build for this torch; tests/unit/test_qwen_video.py checks that processing against transformers'
own functions).

The server computes in float32 whatever the CPU, prompts in chunks of 16 tokens (an image
is up to 16 placeholders: chunks split images), caches prefixes (the hybrid model resumes from
state checkpoints every 16 tokens) and allows two images per prompt. Two different images give
different answers, so no test passes with the image ignored."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from tests.conftest import make_tiny_model
from tests.integration.conftest import FLOAT32, random_video

MAX_TOKENS = 8


def _image(seed: int, size: tuple[int, int] = (32, 32)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# The tiny checkpoint -> the Hugging Face class that answers for it.
_HF_CLASSES = {
    "qwen3_5_vl": "Qwen3_5ForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5_moe_vl": "Qwen3_5MoeForConditionalGeneration",
}


# Served at --tp 2 --pp 2 too.
_PARALLEL_ARCHS = ("qwen3_vl_moe", "qwen3_5_moe_vl")


@pytest.fixture(scope="module", params=sorted(_HF_CLASSES))
def qwen_dir(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer_dir: Path | None,
) -> Path:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), tokenizer_dir)


@pytest.fixture(scope="module")
def server(shared_server: Any, qwen_dir: Path) -> Any:
    return shared_server(
        "--model", str(qwen_dir), "--served-model-name", "qwen-vl",
        "--max-num-batched-tokens", "16", "--block-size", "16",
        "--limit-mm-per-prompt", json.dumps({"image": 2, "video": 1}), *FLOAT32,
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


class _HF:
    """Hugging Face's answers for the same messages and images: its tokenizer's chat template,
    its image processor, each <|image_pad|> expanded as Qwen3VLProcessor (Qwen2_5_VLProcessor)
    does."""

    def __init__(self, model_dir: Path) -> None:
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
        arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
        model_class = getattr(transformers, arch)
        self.model = model_class.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model_dir = model_dir

    def greedy(self, *turn: Any) -> list[int]:
        """The greedy answer to a turn (inputs' arguments)."""
        return self.generate(self.inputs(*turn))

    def inputs(
        self,
        content: list[dict[str, Any]],
        images: list[Image.Image],
        video: bytes | None = None,
        video_options: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The model's inputs for one user turn: ids with the placeholders expanded (as an RL
        trainer's own processor expands them), pixels and grids."""
        prompt = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        inputs: dict[str, Any] = {}
        if video is not None:
            tensors, text = self.video_inputs(video, video_options or {})
            prompt = prompt.replace("<|video_pad|>", text)
            inputs.update({name: torch.from_numpy(t) for name, t in tensors.items()})
        if images:
            inputs.update(self.image_processor(images, return_tensors="pt"))
            for grid in inputs["image_grid_thw"]:
                run = "<|placeholder|>" * (int(grid.prod()) // 4)
                prompt = prompt.replace("<|image_pad|>", run, 1)
            prompt = prompt.replace("<|placeholder|>", "<|image_pad|>")
        ids = self.tokenizer([prompt], add_special_tokens=False, return_tensors="pt")["input_ids"]
        image_id, video_id = self.model.config.image_token_id, self.model.config.video_token_id
        inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids),
                      mm_token_type_ids=(ids == image_id).int() + 2 * (ids == video_id).int())  # fmt: skip
        return inputs

    def generate(self, inputs: dict[str, Any]) -> list[int]:
        with torch.inference_mode():
            out = self.model.generate(
                **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                eos_token_id=None,
            )  # fmt: skip
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    def video_inputs(
        self, video: bytes, options: dict[str, Any]
    ) -> tuple[dict[str, np.ndarray], str]:
        """tern's processing of the video (frontend/media/qwen_video.py)."""
        from frontend.media.policy import MediaPolicy
        from frontend.media.qwen_video import QwenVideoProcessor
        from frontend.media.video import decode_video

        arch = self.model.config.architectures[0]
        processor = QwenVideoProcessor(self.model_dir, arch)
        decoded = decode_video(video, processor.sampler(options), MediaPolicy(), "video")
        return processor.process(decoded, "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


@pytest.fixture(scope="module")
def hf(qwen_dir: Path) -> _HF:
    return _HF(qwen_dir)


def _ask(
    client: openai.OpenAI, parts: list[Any], extra: dict[str, Any] | None = None
) -> tuple[list[int], list[dict[str, Any]], Any]:
    """`parts`: text, images, or video bytes; -> (tern's answer, the HF-side content, the
    response)."""
    content, hf_content = [], []
    for part in parts:
        if isinstance(part, str):
            content.append({"type": "text", "text": part})
            hf_content.append({"type": "text", "text": part})
        elif isinstance(part, bytes):
            url = "data:video/mp4;base64," + base64.b64encode(part).decode()
            content.append({"type": "video_url", "video_url": {"url": url}})
            hf_content.append({"type": "video"})
        else:
            content.append({"type": "image_url", "image_url": {"url": _data_url(part)}})
            hf_content.append({"type": "image"})
    r = client.chat.completions.create(
        model="qwen-vl", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
        temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True, **(extra or {})},
    )  # fmt: skip
    return r.choices[0].token_ids, hf_content, r


def test_one_image_is_hf_exact_and_the_image_matters(client: openai.OpenAI, hf: _HF) -> None:
    first, content, r = _ask(client, [_image(1), "What is in this picture?"])
    other, _, _ = _ask(client, [_image(3), "What is in this picture?"])
    assert first == hf.greedy(content, [_image(1)])
    assert other == hf.greedy(content, [_image(3)])
    assert first != other
    assert r.usage.prompt_tokens > 16  # the image's placeholders are prompt tokens


def test_two_images_and_text_after_each(client: openai.OpenAI, hf: _HF) -> None:
    """Images of two shapes (4x4 and 3x5 merged tokens), text between and after them."""
    images = [_image(3), _image(4, (24, 40))]
    parts = ["Compare", images[0], "with this one:", images[1], "What differs between them?"]
    answer, content, _ = _ask(client, parts)
    assert answer == hf.greedy(content, images)


def test_prefix_hits_past_an_image_stay_hf_exact(client: openai.OpenAI, hf: _HF) -> None:
    """The same long prompt twice: the second resumes from the prefix cache past the image (its
    text placed by the image's grid), and answers the same."""
    parts = [_image(5), "A long question about this picture, asked twice in the same words."]
    first, content, _ = _ask(client, parts)
    again, _, r = _ask(client, parts)
    assert again == first == hf.greedy(content, [_image(5)])
    assert (r.usage.prompt_tokens_details.cached_tokens or 0) >= 32


def test_tp2_pp2_with_images_is_hf_exact(
    request: pytest.FixtureRequest, module_server: Any, qwen_dir: Path, hf: _HF
) -> None:
    """At `--tp 2 --pp 2` the encoder runs on the first stage and the second stage rotates its
    layers by the same (t, h, w) positions: two images of two shapes, chunks of 16 tokens that
    split them, then a video, answers HF's. On the checkpoints whose stages hold more than rotation (Qwen3-VL's
    deepstack layers on the first stage; Qwen3.5-MoE's linear-attention states and experts on
    both); the others' later stages run the same code."""
    if request.node.callspec.params["qwen_dir"] not in _PARALLEL_ARCHS:
        pytest.skip("the parallel path is checked on " + ", ".join(_PARALLEL_ARCHS))
    server = module_server(
        "--model", str(qwen_dir), "--served-model-name", "qwen-vl", "--tp", "2", "--pp", "2",
        "--max-num-batched-tokens", "16", "--block-size", "16", "--kv-cache-memory", "0.05",
        "--limit-mm-per-prompt", json.dumps({"image": 2}), *FLOAT32,
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    images = [_image(6), _image(7, (40, 24))]
    answer, content, _ = _ask(client, ["First", images[0], "then", images[1], "Which is bigger?"])
    assert answer == hf.greedy(content, images)
    answer, content, _ = _ask(client, [random_video(6), "And in this video?"])
    assert answer == hf.greedy(content, [], random_video(6))


def test_a_video_is_hf_exact_and_the_video_matters(client: openai.OpenAI, hf: _HF) -> None:
    """A 4 s video (8 frames sampled: 4 temporal patches) then a question, and a video last in
    the prompt (Qwen2.5-VL's time positions then reach past the text after it, so decoding
    continues from them)."""
    first, content, r = _ask(client, [random_video(1), "What happens in this video?"])
    other, _, _ = _ask(client, [random_video(2), "What happens in this video?"])
    assert first == hf.greedy(content, [], random_video(1))
    assert other == hf.greedy(content, [], random_video(2))
    assert first != other
    assert r.usage.prompt_tokens > 48  # 4 temporal patches of 4x4 merged tokens at most
    last, content, _ = _ask(client, ["Describe:", random_video(3)])
    assert last == hf.greedy(content, [], random_video(3))


def test_mm_processor_kwargs_sample_fewer_frames(client: openai.OpenAI, hf: _HF) -> None:
    """num_frames 4 instead of 2 a second (8 frames of this 4 s video): half the temporal
    patches, HF's answer for the same frames."""
    parts: list[Any] = [random_video(7), "What happens?"]
    _, content, full = _ask(client, parts)
    fewer, _, r = _ask(client, parts, {"mm_processor_kwargs": {"num_frames": 4}})
    assert fewer == hf.greedy(content, [], random_video(7), {"num_frames": 4})
    assert r.usage.prompt_tokens < full.usage.prompt_tokens


def test_an_image_and_a_video_in_one_prompt(client: openai.OpenAI, hf: _HF) -> None:
    image, video = _image(8), random_video(4, num_frames=20, size=(32, 16))
    answer, content, _ = _ask(client, ["Here", image, "and", video, "Same scene?"])
    assert answer == hf.greedy(content, [image], video)


def test_sglang_generate_takes_video_data(server: Any, hf: _HF) -> None:
    """SGLang's /generate with `video_data`: text holding the video marker (the server expands
    it), and token ids another processor expanded (an RL trainer's) with the video as raw
    base64; both answer HF's tokens."""
    content = [{"type": "video"}, {"type": "text", "text": "What happens?"}]
    video = random_video(8)
    text = hf.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = hf.inputs(content, [], video)
    expected = hf.generate(inputs)
    raw = base64.b64encode(video).decode()
    greedy = {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}
    for body in (
        {"text": text, "video_data": "data:video/mp4;base64," + raw},
        {"input_ids": inputs["input_ids"][0].tolist(), "video_data": [raw]},
    ):
        r = httpx.post(
            f"{server.base_url}/generate", json={**body, "sampling_params": greedy}, timeout=120
        )
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == expected
        assert r.json()["meta_info"]["prompt_tokens"] == inputs["input_ids"].shape[1]


def test_server_info_says_it_takes_videos(server: Any) -> None:
    assert server.server_info()["engine"]["input_modalities"] == ["text", "image", "video"]


def test_video_refusals(client: openai.OpenAI) -> None:
    """Bytes that are not a video, and more videos than --limit-mm-per-prompt allows: a 400
    naming the part; the server answers the next request."""
    not_video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="qwen-vl", max_tokens=2,
            messages=[{"role": "user", "content": [not_video, {"type": "text", "text": "?"}]}],
        )  # fmt: skip
    assert e.value.body["param"] == "messages[0].content[0]"
    assert "video" in e.value.body["message"]
    url = "data:video/mp4;base64," + base64.b64encode(random_video(5, num_frames=8)).decode()
    two = [{"type": "video_url", "video_url": {"url": url}}] * 2
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="qwen-vl", max_tokens=2, messages=[{"role": "user", "content": two}]
        )
    assert "At most 1 video(s)" in e.value.body["message"]
    answer, _, _ = _ask(client, [random_video(5, num_frames=8), "Still there?"])
    assert len(answer) == MAX_TOKENS


# Served with 10 KV blocks too, where concurrent requests preempt each other.
_PREEMPTED_ARCHS = ("qwen2_5_vl", "qwen3_vl")


def test_preempted_images_and_videos_resume_hf_exact(
    request: pytest.FixtureRequest, module_server: Any, qwen_dir: Path, hf: _HF
) -> None:
    """Six requests at once in 10 blocks of 16 (text only, an image, a video): they preempt each
    other and resume (their images' and videos' tensors and grids sent again, M-RoPE positions
    rebuilt), and every answer is HF's. On Qwen2.5-VL (time-spaced video positions) and Qwen3-VL
    (a run per temporal patch, deepstack rows)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.integration.test_routers import metric

    if request.node.callspec.params["qwen_dir"] not in _PREEMPTED_ARCHS:
        pytest.skip("preemption is checked on " + ", ".join(_PREEMPTED_ARCHS))
    server = module_server(
        "--model", str(qwen_dir), "--served-model-name", "qwen-vl",
        "--max-num-batched-tokens", "16", "--block-size", "16",
        "--num-gpu-blocks-override", "10", "--no-enable-prefix-caching",
        "--limit-mm-per-prompt", json.dumps({"image": 2, "video": 1}), *FLOAT32,
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    jobs: list[list[Any]] = [
        [f"Question {i}: what is shown in this, and why? " * 3, *([_image(20 + i)] if i % 3 == 1 else []),
         *([random_video(20 + i, num_frames=16)] if i % 3 == 2 else [])]
        for i in range(6)
    ]  # fmt: skip
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda parts: _ask(client, parts), jobs))
    for parts, (answer, content, _) in zip(jobs, answers):
        images = [p for p in parts if isinstance(p, Image.Image)]
        video = next((p for p in parts if isinstance(p, bytes)), None)
        assert answer == hf.greedy(content, images, video)
    assert metric(server.base_url, "tern:num_preemptions_total") > 0
