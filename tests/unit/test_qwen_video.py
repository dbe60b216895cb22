"""tern's Qwen video processing (frontend/media/qwen_video.py) against transformers' own code:
the frame indices of Qwen2VLVideoProcessor.sample_frames and Qwen3VLVideoProcessor.sample_frames,
both smart_resize functions, Qwen3VLProcessor's timestamps, and the patches of the image
processor. transformers' video classes cannot be built without torchvision (no build for this
torch), so their functions are taken from their source files as they are (tests/hf_source.py).

And decoding (frontend/media/video.py): a real MPEG-4 file's frames, and refusals of what is not
a video."""

from __future__ import annotations

import io
import types
from pathlib import Path

import numpy as np
import pytest
import transformers
from PIL import Image
from transformers.video_utils import VideoMetadata

from frontend.common.errors import APIError
from frontend.media.policy import MediaPolicy
from frontend.media.qwen_video import QwenVideoProcessor, qwen2_smart_resize, qwen3_smart_resize
from frontend.media.video import Video, decode_video
from tests.hf_source import HF_MODELS, hf_functions

_QWEN2 = hf_functions(
    HF_MODELS / "qwen2_vl" / "video_processing_qwen2_vl.py", ("smart_resize", "sample_frames")
)
_QWEN3 = hf_functions(
    HF_MODELS / "qwen3_vl" / "video_processing_qwen3_vl.py", ("smart_resize", "sample_frames")
)


def _processor(tmp_path: Path, architecture: str) -> QwenVideoProcessor:
    return QwenVideoProcessor(tmp_path, architecture)  # no config files: the classes' defaults


@pytest.mark.parametrize("size", [(28, 28), (100, 37), (480, 640), (1080, 1920), (17, 300)])
def test_both_smart_resizes_are_transformers(size: tuple[int, int]) -> None:
    h, w = size
    assert qwen2_smart_resize(h, w, 28, 56 * 56, 28 * 28 * 1280) == _QWEN2["smart_resize"](
        h, w, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280
    )
    for frames in (2, 9, 64):
        ours = qwen3_smart_resize(frames, h, w, 2, 32, 128 * 32 * 32, 32 * 32 * 768)
        theirs = _QWEN3["smart_resize"](
            frames, h, w, temporal_factor=2, factor=32, min_pixels=128 * 32 * 32,
            max_pixels=32 * 32 * 768,
        )  # fmt: skip
        assert ours == theirs


@pytest.mark.parametrize(("total", "fps"), [(32, 8.0), (300, 30.0), (7, 24.0), (5000, 25.0)])
def test_frame_sampling_is_transformers(tmp_path: Path, total: int, fps: float) -> None:
    qwen3 = _processor(tmp_path, "Qwen3VLForConditionalGeneration")
    hf3 = types.SimpleNamespace(fps=2, min_frames=4, max_frames=768)
    expected = _QWEN3["sample_frames"](hf3, VideoMetadata(total_num_frames=total, fps=fps))
    assert np.array_equal(qwen3.sampler({})(total, fps), expected)
    expected = _QWEN3["sample_frames"](hf3, VideoMetadata(total_num_frames=total, fps=fps), 6)
    assert np.array_equal(qwen3.sampler({"num_frames": 6})(total, fps), expected)
    # Qwen2-VL's processor samples only when asked: tern asks for 2 frames a second.
    qwen2 = _processor(tmp_path, "Qwen2_5_VLForConditionalGeneration")
    hf2 = types.SimpleNamespace(
        fps=None, num_frames=None, temporal_patch_size=2, min_frames=4, max_frames=768
    )
    metadata = VideoMetadata(total_num_frames=total, fps=fps)
    expected = _QWEN2["sample_frames"](hf2, metadata, fps=2)
    assert np.array_equal(qwen2.sampler({})(total, fps), expected.numpy())
    expected = _QWEN2["sample_frames"](hf2, metadata, fps=1.5)
    assert np.array_equal(qwen2.sampler({"fps": 1.5})(total, fps), expected.numpy())


def test_timestamps_and_text_are_qwen3vl_processors(tmp_path: Path) -> None:
    processor = _processor(tmp_path, "Qwen3VLForConditionalGeneration")
    indices = np.array([0, 9, 19, 28, 38])  # odd: the last is repeated to fill the patch
    video = Video(np.zeros((5, 64, 64, 3), np.uint8), indices, 24.0, 40)
    expected = transformers.Qwen3VLProcessor._calculate_timestamps(None, indices, 24.0, 2)
    assert processor._timestamps(video) == expected
    tensors, text = processor.process(video, "<V>", "<s>", "</s>")
    t, h, w = tensors["video_grid_thw"][0]
    assert t == 3 and text.startswith(f"<{expected[0]:.1f} seconds><s>")
    assert text.count("<s>") == 3 and text.count("<V>") == t * h * w // 4


def test_patches_of_two_equal_frames_are_the_image_processors(tmp_path: Path) -> None:
    """A frame already at its processed size, twice: the video's patches equal the image
    processor's for that frame (an image is its one frame repeated temporal_patch_size times),
    in the same layout and normalisation."""
    frame = np.random.default_rng(0).integers(0, 256, (280, 392, 3), dtype=np.uint8)
    image_processor = transformers.Qwen2VLImageProcessorPil()
    image = image_processor([Image.fromarray(frame)], return_tensors="np")
    processor = _processor(tmp_path, "Qwen2VLForConditionalGeneration")
    video = Video(np.stack([frame, frame]), np.array([0, 1]), 2.0, 2)
    tensors, text = processor.process(video, "<V>", "<s>", "</s>")
    assert tensors["video_grid_thw"].tolist() == image["image_grid_thw"].tolist()
    np.testing.assert_allclose(tensors["pixel_values_videos"], image["pixel_values"], atol=1e-5)
    assert text == "<V>" * (int(np.prod(image["image_grid_thw"])) // 4)


def _mp4(num_frames: int, fps: int = 8) -> tuple[bytes, np.ndarray]:
    import av

    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (num_frames, 32, 48, 3), dtype=np.uint8)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.height, stream.width, stream.pix_fmt = 32, 48, "yuv420p"
        for pixels in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue(), frames


def test_decoding_keeps_the_sampled_frames() -> None:
    data, _ = _mp4(24)
    every = decode_video(data, lambda total, fps: np.arange(total), MediaPolicy(), "p")
    assert (every.num_frames, every.fps, every.frames.shape) == (24, 8.0, (24, 32, 48, 3))
    some = decode_video(data, lambda total, fps: np.array([1, 7, 20]), MediaPolicy(), "p")
    assert np.array_equal(some.frames, every.frames[[1, 7, 20]])
    assert some.sampled_fps == pytest.approx(1.0)


def test_what_is_not_a_video_is_refused() -> None:
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    data, _ = _mp4(24)
    every = lambda total, fps: np.arange(total)  # noqa: E731
    cases = {
        b"not a video at all": "format FFmpeg can read",
        png.getvalue(): "not a video",
        data[: len(data) // 3]: "video",
    }
    for payload, message in cases.items():
        with pytest.raises(APIError) as e:
            decode_video(payload, every, MediaPolicy(), "messages[0].content[1]")
        assert e.value.status == 400 and message in e.value.message
        assert e.value.param == "messages[0].content[1]"
    with pytest.raises(APIError, match="above the limit of 100 pixels"):
        decode_video(data, every, MediaPolicy(max_image_pixels=100), "p")
    with pytest.raises(APIError, match="24 frames, above the limit of 10"):
        decode_video(data, every, MediaPolicy(max_video_frames=10), "p")
