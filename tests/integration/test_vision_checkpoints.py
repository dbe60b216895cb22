"""Checkpoints released with a vision tower, tiny and random, served by a real server with their
language model only (Qwen2-VL with `--language-model-only`, Qwen3.5 with no image allowed:
`--limit-mm-per-prompt '{"image": 0}'`), answer text; the start-up
log says image and audio inputs are not served, and a request with an image part is a 400 naming
that part, on chat and on Messages. Gemma 3's language model keeps its sliding layers' windows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import make_tiny_model

IMAGE = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="


def _serve(
    arch: str,
    shared_server: Any,
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer_dir: Any,
    *extra: str,
) -> Any:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer")
    model_dir = make_tiny_model(arch, tmp_path_factory.mktemp(arch), tokenizer_dir)
    return shared_server("--model", str(model_dir), "--served-model-name", "vl", *extra)


@pytest.fixture(scope="module")
def server(
    shared_server: Any, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None
) -> Any:
    return _serve("gemma3_vl", shared_server, tmp_path_factory, tokenizer_dir)


@pytest.fixture(
    scope="module", params=["qwen2_vl, language model only", "qwen3_5_vl, no image allowed"]
)
def text_only_server(
    request: pytest.FixtureRequest,
    shared_server: Any,
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer_dir: Path | None,
) -> Any:
    """vLLM's two ways of serving the language model only, the tower not loaded: the flag, and
    every modality's limit at 0."""
    if request.param.startswith("qwen2_vl"):
        flag = "--language-model-only"
        return _serve("qwen2_vl", shared_server, tmp_path_factory, tokenizer_dir, flag)
    limits = ("--limit-mm-per-prompt", '{"image": 0}')
    return _serve("qwen3_5_vl", shared_server, tmp_path_factory, tokenizer_dir, *limits)


def test_text_is_served_and_images_are_400(text_only_server: Any) -> None:
    server = text_only_server
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
    assert "image and audio inputs are not served" in server.log


def _blocks_used(base_url: str) -> int:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return int(float(re.search(r"^tern:kv_cache_blocks_used\{[^}]*\} (\S+)", text, re.M)[1]))


def test_a_long_request_holds_the_windows_of_its_sliding_layers(server: Any) -> None:
    """The tiny Gemma 3 has 2 global and 4 local layers (window 8): KV-cache groups of 2 layers,
    one global and two local. Its local groups hold the 2 blocks of 16 tokens a window of 8 can
    straddle, whatever the length; only the global group grows with it. /metrics' block count is
    up to 0.5 s old (the engine's stats interval): readings up to the last tokens of a 400-token
    answer include lengths where a cache keeping every layer's keys would hold 3x the blocks."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    stream = client.completions.create(
        model="vl", prompt="Once upon a time " * 8, max_tokens=400, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    generated, readings = 0, []
    for chunk in stream:
        if chunk.choices:
            generated += 1
            if 120 <= generated < 400 and generated % 40 == 0:  # still running
                readings.append(_blocks_used(server.base_url))
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage.completion_tokens == 400 and len(readings) == 7
    # Every reading is of the running request: its prompt's global blocks and the local ones.
    assert min(readings) >= -(-usage.prompt_tokens // 16) + 2
    # A cache that kept every layer's keys would hold 3 groups x ceil(length / 16).
    assert max(readings) <= -(-(usage.prompt_tokens + 400) // 16) + 2 * 2
    assert _blocks_used(server.base_url) == 0
