"""Hugging Face as the oracle of the image tests: a checkpoint's own processor and model class, in
float32, answering the chat prompts (one user turn: its images, then its text) that the tests send
tern, greedily, with each answer token's logprob."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image


class HFVision:
    def __init__(self, model_dir: Path, class_name: str, max_tokens: int = 8) -> None:
        import transformers

        self.model_dir = model_dir
        if class_name == "Mistral3ForConditionalGeneration":
            # PixtralProcessor requires torchvision: its image processor's PIL backend with the
            # expansion tern does as it (tests/unit/test_pixtral_processor.py checks that).
            from frontend.media.pixtral import PixtralImageProcessor

            self.processor: Any = PixtralImageProcessor(model_dir)
        elif class_name == "LlavaOnevisionForConditionalGeneration":
            # LlavaOnevisionProcessor requires torchvision (for videos): its image processor's
            # PIL backend and its own counting methods, which tern's stand-in borrows; the model
            # refuses placeholders that do not match its image features.
            from frontend.media.llava_onevision import LlavaOnevisionImageProcessor

            self.processor = LlavaOnevisionImageProcessor(model_dir)
        else:
            self.processor = transformers.AutoProcessor.from_pretrained(model_dir)
        model_class = getattr(transformers, class_name)
        self.model = model_class.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.max_tokens = max_tokens

    def prompt(self, text: str, num_images: int) -> str:
        """The chat template's text for one user turn: its images, then `text`."""
        content = [{"type": "image"} for _ in range(num_images)]
        content.append({"type": "text", "text": text})
        template = getattr(self.processor, "apply_chat_template", None)
        return (template or self.processor.tokenizer.apply_chat_template)(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )

    def inputs(
        self,
        prompt: str,
        images: list[Image.Image],
        add_special_tokens: bool = False,
        **options: Any,
    ) -> Any:
        """The processor's outputs: ids with the images' placeholders, pixel tensors."""
        out = self.processor(
            text=[prompt], images=[images] if images else None,
            add_special_tokens=add_special_tokens, return_tensors="pt", **options,
        )  # fmt: skip
        return dict(out)

    def generate(self, **inputs: Any) -> tuple[list[int], list[float]]:
        """Greedy answer tokens after inputs["input_ids"] and their logprobs."""
        with torch.inference_mode():
            out = self.model.generate(
                **inputs, max_new_tokens=self.max_tokens, do_sample=False, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        logprobs = [
            torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)
        ]
        return tokens, logprobs

    def answer(
        self, text: str, images: list[Image.Image], **options: Any
    ) -> tuple[list[int], list[float]]:
        """The greedy answer to a chat turn of `images` then `text`, and its logprobs."""
        return self.generate(**self.inputs(self.prompt(text, len(images)), images, **options))

    def greedy(self, text: str, images: list[Image.Image], **options: Any) -> list[int]:
        return self.answer(text, images, **options)[0]
