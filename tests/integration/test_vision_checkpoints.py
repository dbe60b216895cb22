"""A checkpoint released with a vision tower (Gemma3ForConditionalGeneration, tiny and random) served
by a real server: its language model answers text, the start-up log says image inputs are not
served, and a request with an image part is a 400 naming that part, on chat and on Messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import make_tiny_model

IMAGE = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="


@pytest.fixture(scope="module")
def server(
    module_server: Any, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None
) -> Any:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    model_dir = make_tiny_model("gemma3_vl", tmp_path_factory.mktemp("vl"), tokenizer_dir)
    return module_server("--model", str(model_dir), "--served-model-name", "vl")


def test_text_is_served_and_images_are_400(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model="vl", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
    parts = [{"type": "text", "text": "What is this?"},
             {"type": "image_url", "image_url": {"url": IMAGE}}]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="vl", messages=[{"role": "user", "content": parts}], max_tokens=4
        )
    assert info.value.body["param"] == "messages[0].content[1]"
    assert "image_url" in info.value.body["message"]
    messages = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": IMAGE.split(",")[1]}}  # fmt: skip
    with pytest.raises(anthropic.BadRequestError) as err:
        messages.messages.create(
            model="vl", max_tokens=4, messages=[{"role": "user", "content": [block]}]
        )
    assert "image" in err.value.body["error"]["message"]
    assert "image inputs are not served" in server.log
