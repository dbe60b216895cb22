"""Bytes -> a video's sampled frames, with PyAV (FFmpeg), as transformers' read_video_pyav reads
them: the first video stream's frame count and average rate are its metadata, the model's video
processor picks frame indices from them (frontend/media/qwen_video.py), and only the frames up to
the last index picked are decoded, each to RGB.

What cannot be a video is refused before any frame is decoded: bytes FFmpeg cannot open, a file
with no video stream, frames above the pixel cap, more frames than the cap.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from frontend.common.errors import bad_request
from frontend.media.policy import MediaPolicy

# The containers a request's bytes may be opened as (FFmpeg's demuxer names, as it probes them):
# naming them keeps FFmpeg's other demuxers (playlists that open further URLs, image sequences)
# out of reach of user bytes.
VIDEO_FORMATS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi", "mpeg", "gif", "flv", "ogg")

# (number of frames in the video, its frames per second) -> the indices of the frames to keep.
FrameSampler = Callable[[int, float], np.ndarray]


@dataclass(frozen=True)
class Video:
    """A video's sampled frames (T, H, W, 3) uint8 RGB, their indices in the video, and its
    frame rate and frame count (the timestamps of the frames are index / fps)."""

    frames: np.ndarray
    indices: np.ndarray
    fps: float
    num_frames: int

    @property
    def sampled_fps(self) -> float:
        """Frames kept per second of video (transformers' VideoMetadata.sampled_fps)."""
        return len(self.indices) / self.num_frames * self.fps


def resized_pixels(
    frames: np.ndarray, size: tuple[int, int], mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """(T, H, W, 3) uint8 frames -> (T, 3, h, w) float32: resized bicubic with antialiasing on the
    uint8 frames (what torchvision's resize runs on a CPU, as transformers' video processors call
    it), then (x - mean) / std with the mean and std on the 0-255 scale (their fused rescale and
    normalise)."""
    pixels = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    pixels = F.interpolate(pixels, size=size, mode="bicubic", antialias=True, align_corners=False)
    return (pixels.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)


def decode_video(data: bytes, sample: FrameSampler, policy: MediaPolicy, param: str) -> Video:
    import av  # only servers of video models pay for its import

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError):
        raise bad_request("the video is not in a format FFmpeg can read", param) from None
    with container:
        if container.format.name not in VIDEO_FORMATS or not container.streams.video:
            raise bad_request(
                f"the media is not a video (found a {container.format.name!r} file "
                f"with {len(container.streams.video)} video streams)",
                param,
            )
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > policy.max_image_pixels:
            raise bad_request(
                f"the video's frames are too large: {width}x{height} is above the limit of "
                f"{policy.max_image_pixels} pixels",
                param,
            )
        fps = float(stream.average_rate or 0)
        num_frames = stream.frames or _count_frames(container, stream)
        if num_frames < 1 or fps <= 0:
            raise bad_request("the video has no frames, or no frame rate", param)
        if num_frames > policy.max_video_frames:
            raise bad_request(
                f"the video has {num_frames} frames, above the limit of {policy.max_video_frames}",
                param,
            )
        indices = np.asarray(sample(num_frames, fps), dtype=np.int64)
        frames = _decode_frames(container, stream, indices, param)
    return Video(frames, indices, fps, num_frames)


def _count_frames(container: object, stream: object) -> int:
    """The frame count of a container that does not state it: its packets, demuxed (not decoded)."""
    count = sum(1 for packet in container.demux(stream) if packet.size)  # type: ignore[attr-defined]
    container.seek(0)  # type: ignore[attr-defined]
    return count


def _decode_frames(
    container: object, stream: object, indices: np.ndarray, param: str
) -> np.ndarray:
    import av

    wanted = {int(i) for i in indices}
    last = int(indices.max()) if len(indices) else -1
    found: dict[int, np.ndarray] = {}
    try:
        for i, frame in enumerate(container.decode(stream)):  # type: ignore[attr-defined]
            if i > last:
                break
            if i in wanted:
                found[i] = frame.to_ndarray(format="rgb24")
    except (av.FFmpegError, ValueError) as e:
        raise bad_request(f"the video could not be decoded: {e}", param) from None
    missing = [int(i) for i in indices if int(i) not in found]
    if missing or not len(indices):
        raise bad_request(
            f"the video ended before frame {missing[0] if missing else 0} (its header counts "
            "more frames than it holds)",
            param,
        )
    try:
        return np.stack([found[int(i)] for i in indices])
    except ValueError:
        raise bad_request("the video's frames change size mid-stream", param) from None
