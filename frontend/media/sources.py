"""Where a media URL's bytes come from: `data:` URLs (base64), `file:` URLs under the allowed
folder, and `http(s):` URLs on the allowed domains (frontend.media.remote). Every refusal is a 400
naming the request part; nothing here says more about the server's files than the user asked.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import stat
from pathlib import Path
from urllib.parse import unquote, urlsplit

from frontend.common.errors import APIError, bad_request
from frontend.media.policy import MediaPolicy
from frontend.media.remote import fetch_url


async def load_media_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    """The bytes `url` names, under `policy`; raises APIError (400 naming `param`) on refusal."""
    scheme = url.partition(":")[0].strip().lower() if ":" in url else ""
    if scheme == "data":
        return decode_data_url(url, policy, param)
    if scheme == "file":
        return await asyncio.to_thread(read_local_file, url, policy, param)
    if scheme in ("http", "https"):
        return await fetch_url(url, policy, param)
    shown = f"scheme {scheme!r}" if scheme else "no scheme"
    raise bad_request(
        f"the media URL has {shown}: use a data: URL, a file: URL (with "
        "--allowed-local-media-path) or an http(s): URL (with --allowed-media-domains)",
        param,
    )


# SGLang's load_image (python/sglang/srt/utils/common.py) reads a string that ends so as a file.
_IMAGE_FILE_ENDINGS = ("png", "jpg", "jpeg", "webp", "gif")
_AUDIO_FILE_ENDINGS = ("wav", "mp3", "flac", "ogg", "webm", "m4a", "opus")
_VIDEO_FILE_ENDINGS = ("mp4", "mov", "mkv", "webm", "avi", "mpeg", "mpg", "flv", "ogv")


def image_data_url(item: object, param: str) -> str:
    """One item of a /generate `image_data` (SGLang's, LMDeploy's) as a media URL, by SGLang's
    load_image rules: an http(s), data: or file: URL as it is; a string ending in an image
    extension is a file path (a file: URL: only under --allowed-local-media-path); anything else
    is base64 without the data: prefix (a data: URL: the same byte and pixel caps)."""
    return _data_item_url(item, param, "image", _IMAGE_FILE_ENDINGS)


def audio_data_url(item: object, param: str) -> str:
    """One item of SGLang's /generate `audio_data`, by the same rules (audio file endings)."""
    return _data_item_url(item, param, "audio", _AUDIO_FILE_ENDINGS)


def video_data_url(item: object, param: str) -> str:
    """One item of SGLang's /generate `video_data`, by the same rules (video file endings)."""
    return _data_item_url(item, param, "video", _VIDEO_FILE_ENDINGS)


def _data_item_url(item: object, param: str, kind: str, endings: tuple[str, ...]) -> str:
    if not isinstance(item, str) or not item:
        raise bad_request(
            f"{kind}_data items must be strings: a URL, a file path or base64 {kind} bytes", param
        )
    scheme = item.partition(":")[0].lower() if ":" in item[:8] else ""
    if scheme in ("http", "https", "data", "file"):
        return item
    if item.lower().endswith(endings):
        path = Path(item)
        if not path.is_absolute():
            raise bad_request(f"the {kind} path {item!s:.200} must be absolute", param)
        return path.as_uri()
    return f"data:{kind};base64," + item


def decode_data_url(url: str, policy: MediaPolicy, param: str) -> bytes:
    """`data:[<media type>][;params];base64,<payload>`; only base64 payloads are taken."""
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise bad_request("the data URL has no ',' before its payload", param)
    if header.split(";")[-1].strip().lower() != "base64":
        raise bad_request("only base64 data URLs are supported (data:image/png;base64,...)", param)
    # 4 base64 characters carry 3 bytes: refuse an oversized payload before decoding it.
    if len(payload) // 4 * 3 > policy.max_image_bytes + 3:
        raise _too_many_bytes(policy, param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the data URL's payload is not valid base64", param) from None
    if len(data) > policy.max_image_bytes:
        raise _too_many_bytes(policy, param)
    return data


def read_local_file(url: str, policy: MediaPolicy, param: str) -> bytes:
    """A `file:` URL's bytes, when the file (symlinks and `..` resolved) is under the folder."""
    folder = policy.allowed_local_media_path
    if folder is None:
        raise bad_request(
            "file: URLs are not allowed: the server was not started with "
            "--allowed-local-media-path",
            param,
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise bad_request("file: URLs must name a local path (file:///path)", param)
    requested = Path(unquote(parts.path))
    try:
        # NOTE: resolve() follows every symlink and folds `..`, so the check sees the real target.
        path = requested.resolve()
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop
        raise bad_request(f"{requested!s:.200} is not a usable path", param) from None
    if not requested.is_absolute() or not path.is_relative_to(folder.resolve()):
        raise bad_request(f"{requested} is outside the allowed local media folder", param)
    try:
        # O_NOFOLLOW: a symlink swapped in after the check above is not followed; O_NONBLOCK: a
        # FIFO does not wait for a writer (regular files read the same either way).
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        fd = os.open(path, flags)
    except (OSError, ValueError):
        raise bad_request(f"{requested}: no such file in the allowed folder", param) from None
    try:
        # A FIFO or device could stream forever; a directory has no bytes.
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise bad_request(f"{requested} is not a regular file", param)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(policy.max_image_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > policy.max_image_bytes:
        raise _too_many_bytes(policy, param)
    return data


def _too_many_bytes(policy: MediaPolicy, param: str) -> APIError:
    return bad_request(f"the media is larger than {policy.max_image_bytes} bytes", param)
