"""MediaPolicy: the operator's rules for the media a request may bring in, built once from the
`tern launch` flags (frontend/cli/media.py) and read by every route that takes images."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

MODALITIES = ("image", "video", "audio")
# vLLM's MultiModalConfig.get_limit_per_prompt: a modality the flag leaves out may have 999 items.
DEFAULT_MAX_ITEMS_PER_MODALITY = 999
# 20 MiB: room for a high-quality JPEG at the pixel cap (~10-15 MB), and a bound on what one
# data: URL, file or fetch may hold in memory.
DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20
# 36 MP: above every common camera (a 24 MP 6000x4000 DSLR frame, a 12-48 MP phone photo) and far
# above what vision processors keep (Qwen2-VL's max_pixels is 12.8 MP, SigLIP towers see < 1 MP),
# while one decoded RGB image stays at 108 MB and Pillow's own bomb warning (89 MP) is never reached.
DEFAULT_MAX_IMAGE_PIXELS = 6000 * 6000
DEFAULT_FETCH_TIMEOUT_S = 10.0  # one whole http(s) fetch, redirects included (vLLM's is 5 s)


def default_limit_per_prompt() -> dict[str, int]:
    return dict.fromkeys(MODALITIES, DEFAULT_MAX_ITEMS_PER_MODALITY)


@dataclass(frozen=True)
class MediaPolicy:
    """Where media may come from and how much of it: the defaults take data: URLs only."""

    # file: URLs are read only under this folder (resolved, symlinks followed); None: no file: URLs.
    allowed_local_media_path: Path | None = None
    # Host names (or IP literals) http(s) URLs may name, matched exactly; empty: no fetches at all.
    allowed_media_domains: tuple[str, ...] = ()
    # hash=False: the dict would make the policy (and FrontendConfig, which holds it) unhashable.
    limit_per_prompt: dict[str, int] = field(default_factory=default_limit_per_prompt, hash=False)
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width * height, checked before decoding
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    # Audio files of /v1/audio/* (OpenAI caps uploads at 25 MB), and the seconds of audio one
    # request may carry (each 30 s is one engine request).
    max_audio_bytes: int = 25 * 10**6
    # Frames in one video file (all of them, not only those sampled): the frames up to the last
    # one sampled are decoded. An hour at 30 frames per second.
    max_video_frames: int = 108_000
    max_audio_seconds: float = 3600.0

    def __post_init__(self) -> None:
        domains = tuple(normalize_host(host) for host in self.allowed_media_domains)
        object.__setattr__(self, "allowed_media_domains", domains)
        folder = self.allowed_local_media_path
        if folder is not None and not folder.is_absolute():
            raise ValueError(f"allowed_local_media_path must be absolute, not {folder}")
        for modality, limit in self.limit_per_prompt.items():
            is_count = isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0
            if modality not in MODALITIES or not is_count:
                raise ValueError(f"limit_per_prompt: bad entry {modality!r}: {limit!r}")
        if self.max_image_bytes < 1 or self.max_image_pixels < 1:
            raise ValueError("max_image_bytes and max_image_pixels must be positive")
        if self.max_video_frames < 1:
            raise ValueError("max_video_frames must be positive")
        if self.max_audio_bytes < 1 or not self.max_audio_seconds > 0:
            raise ValueError("max_audio_bytes and max_audio_seconds must be positive")
        if not self.fetch_timeout_s > 0:
            raise ValueError("fetch_timeout_s must be positive")

    def max_items(self, modality: str) -> int:
        """How many items of `modality` one prompt may carry."""
        return self.limit_per_prompt.get(modality, DEFAULT_MAX_ITEMS_PER_MODALITY)


def normalize_host(host: str) -> str:
    """A host as URLs are matched against it: lower case, no trailing dot, an IPv6 literal without
    brackets. Raises ValueError for what is not a bare host (a scheme, a port, a path)."""
    name = host.strip().lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if not name or any(c in name for c in "/@?#") or (":" in name and not _is_ipv6(name)):
        raise ValueError(f"{host!r} is not a host name or IP address (no scheme, port or path)")
    return name


def _is_ipv6(name: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(name), ipaddress.IPv6Address)
    except ValueError:
        return False
