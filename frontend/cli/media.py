"""`tern launch` flags of media input (vLLM's names): the folder file: URLs may read, the hosts
http(s) URLs may fetch from (none by default: fetching user URLs is an SSRF hole), and the items a
prompt may carry per modality. Builds the MediaPolicy the frontend's routes read from
FrontendConfig.media."""

from __future__ import annotations

import argparse
from pathlib import Path

from frontend.media.limits import parse_limit_mm_per_prompt
from frontend.media.policy import MediaPolicy, default_limit_per_prompt, normalize_host


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Media input")
    group.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="let requests read images by file: URL from under this folder (symlinks and '..' "
        "resolved first); a security risk, only for trusted clients (default: no file: URLs)",
    )
    group.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        metavar="HOST",
        help="hosts (names or IP addresses, matched exactly) requests may name in http(s) image "
        "URLs; a name resolving to a private or loopback address needs that address listed too "
        "(default: no fetches)",
    )
    group.add_argument(
        "--limit-mm-per-prompt",
        default=None,
        metavar="JSON",
        help='items of each modality one prompt may carry, e.g. \'{"image": 2, "video": 0}\' '
        "(default: 999 each, as vLLM)",
    )
    group.add_argument(
        "--max-audio-filesize-mb",
        type=float,
        default=25.0,
        metavar="MB",
        help="largest audio file /v1/audio/transcriptions and /translations take, in MB "
        "(default: 25, OpenAI's; vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB); larger: 413",
    )
    group.add_argument(
        "--max-audio-seconds",
        type=float,
        default=3600.0,
        metavar="S",
        help="longest audio one transcription may carry, in seconds (default: 3600); longer: 413",
    )


def media_policy_from_args(args: argparse.Namespace) -> MediaPolicy:
    """The MediaPolicy; raises ValueError with a message for the user."""
    limits = default_limit_per_prompt()
    if args.limit_mm_per_prompt is not None:
        limits.update(parse_limit_mm_per_prompt(args.limit_mm_per_prompt))
    hosts = []
    for host in args.allowed_media_domains:
        try:
            hosts.append(normalize_host(host))
        except ValueError as e:
            raise ValueError(f"--allowed-media-domains: {e}") from None
    return MediaPolicy(
        allowed_local_media_path=_media_folder(args.allowed_local_media_path),
        allowed_media_domains=tuple(hosts),
        limit_per_prompt=limits,
        max_audio_bytes=int(args.max_audio_filesize_mb * 10**6),
        max_audio_seconds=args.max_audio_seconds,
    )


def _media_folder(value: str | None) -> Path | None:
    if value is None:
        return None
    folder = Path(value).expanduser().resolve()
    if not folder.is_dir():
        raise ValueError(f"--allowed-local-media-path {value}: not an existing folder")
    return folder
