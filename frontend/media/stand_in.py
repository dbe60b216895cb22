"""What tern's stand-ins for Hugging Face processors that require torchvision (which has no build
for this torch) share: frontend/media/qwen_vl.py (Qwen VL) and pixtral.py (Mistral 3). Each keeps
the processor's contract for images: the checkpoint's own image processor (its PIL backend) makes
the tensors, and each image marker of the text, in order, becomes that image's text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PIL import Image


def first_architecture(model_path: str | Path) -> str | None:
    """config.json's first architecture, None without one."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    archs = json.loads(config.read_text()).get("architectures") or []
    return archs[0] if archs else None


class StandInProcessor:
    """Called as a processor: (text, images) -> the ids, placeholders expanded, and the image
    processor's tensors. Subclasses say what text each image becomes (`image_texts`) and what
    they add to the image processor's call (`image_options`)."""

    image_token: str
    # Whether the image processor takes each prompt's images as one list (its outputs for an image
    # depend on the prompt's other images: see image_share) rather than all images flat.
    processes_images_together = False

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.image_processor = AutoImageProcessor.from_pretrained(str(model_path))
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))

    def __call__(
        self,
        text: list[str],
        images: list[list[Image.Image]] | None = None,
        add_special_tokens: bool = False,
        return_tensors: str = "np",
        **options: Any,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if images:
            batch = images if self.processes_images_together else [i for g in images for i in g]
            options = self.image_options(options)
            out.update(self.image_processor(batch, return_tensors=return_tensors, **options))
            text = expand_markers(text, self.image_token, self.image_texts(out))
        ids = self.tokenizer(
            text, add_special_tokens=add_special_tokens, return_tensors=return_tensors
        )
        return {**ids, **out}

    def image_options(self, options: dict[str, Any]) -> dict[str, Any]:
        return options

    def image_texts(self, processed: dict[str, Any]) -> list[str]:
        """Each image's text, from the image processor's outputs."""
        raise NotImplementedError


def expand_markers(texts: list[str], marker: str, runs: list[str]) -> list[str]:
    """`texts` with their `marker`s replaced by `runs`, one each in order; ValueError unless
    markers and runs pair up one to one."""
    pending = list(runs)
    out = []
    for text in texts:
        pieces = text.split(marker)
        if len(pieces) - 1 > len(pending):
            raise ValueError(f"more image markers ({marker}) than images")
        taken, pending = pending[: len(pieces) - 1], pending[len(pieces) - 1 :]
        out.append(pieces[0] + "".join(run + piece for run, piece in zip(taken, pieces[1:])))
    if pending:
        raise ValueError(f"{len(runs)} images for {len(runs) - len(pending)} image markers")
    return out
