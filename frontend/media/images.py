"""Bytes -> an RGB Pillow image, refusing what is not an image or is too large before the pixels
are decoded (a small PNG can declare a 100000x100000 canvas: the header is read, the canvas never).

Only the formats the OpenAI API takes are opened (PNG, JPEG, WebP, GIF): naming them keeps
Pillow's other decoders (EPS runs Ghostscript, for one) out of reach of user bytes.
"""

from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

from frontend.common.errors import APIError, bad_request
from frontend.media.policy import MediaPolicy

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# Transparent pixels become white, as transformers' convert_to_rgb and vLLM's rgba_to_rgb do.
_BACKGROUND = (255, 255, 255)


def decode_image(data: bytes, policy: MediaPolicy, param: str) -> Image.Image:
    """The image in `data` (a GIF's or animated WebP's first frame) as a loaded RGB image."""
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
    except Image.DecompressionBombError:
        # Pillow's own guard, at twice its 89 MP warning: above any max_image_pixels it could meet.
        raise _too_many_pixels(None, policy, param) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise bad_request(
            f"the image is not a {', '.join(IMAGE_FORMATS[:-1])} or {IMAGE_FORMATS[-1]} image "
            "Pillow can read",
            param,
        ) from None
    width, height = image.size
    if width * height > policy.max_image_pixels:
        raise _too_many_pixels((width, height), policy, param)
    try:
        image.load()  # the first frame: Image.open leaves a GIF or WebP positioned there
        return _to_rgb(image)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, EOFError):
        raise bad_request(f"the {image.format} image could not be decoded", param) from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (*_BACKGROUND, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _too_many_pixels(size: tuple[int, int] | None, policy: MediaPolicy, param: str) -> APIError:
    shown = f"{size[0]}x{size[1]} " if size else ""
    return bad_request(
        f"the image is too large: {shown}above the limit of {policy.max_image_pixels} pixels",
        param,
    )
