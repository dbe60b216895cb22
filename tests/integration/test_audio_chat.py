"""Audio parts in chat, end to end through the openai SDK, on a tiny random Qwen2-Audio served by
`tern launch`: `input_audio` (base64 + format) and vLLM's `audio_url` (a data: URL) reach the
model as Hugging Face's processor makes them, and the greedy answer is
`Qwen2AudioForConditionalGeneration.generate`'s token for token (float32). The checkpoint carries
the default model's tokenizer with Qwen2-Audio's audio tokens and chat template."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch

from frontend.audio.decoding import decode_audio
from tests.audio_files import encode_audio, tiny_qwen2_audio

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen2_audio(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path | None):
    """(directory, HF model, HF processor)."""
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer (python -m frontend.model_prep)")
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]}
    )
    extractor = transformers.WhisperFeatureExtractor(feature_size=128)
    template = transformers.Qwen2AudioProcessor(extractor, tokenizer).default_chat_template
    tokenizer.chat_template = template
    processor = transformers.Qwen2AudioProcessor(extractor, tokenizer, chat_template=template)
    vocab_size = len(tokenizer) + 64 - len(tokenizer) % 64
    hf = tiny_qwen2_audio(vocab_size, tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    model_dir = tmp_path_factory.mktemp("qwen2_audio")
    hf.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, hf, processor


@pytest.fixture
def server(shared_server: Any, qwen2_audio: tuple[Path, Any, Any]) -> Any:
    return shared_server(
        "--model", str(qwen2_audio[0]), "--served-model-name", "qwen2-audio", "--dtype", "float32",
    )  # fmt: skip


def _speech(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.3 * np.sin(2 * np.pi * rng.uniform(150, 900) * t)).astype(np.float32)


def _hf_answer(qwen2_audio: tuple[Path, Any, Any], audios: list[bytes], question: str) -> list[int]:
    _, hf, processor = qwen2_audio
    content = [{"type": "audio"} for _ in audios] + [{"type": "text", "text": question}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(
        text=[prompt], audio=[decode_audio(a) for a in audios], sampling_rate=16000,
        return_tensors="pt",
    )  # fmt: skip
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_audio_parts_answer_as_hf(server: Any, qwen2_audio: tuple[Path, Any, Any]) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    wav = encode_audio(_speech(2.0, 1), 16000, "wav")
    mp3 = encode_audio(_speech(3.0, 2), 22050, "mp3")
    extra = {"return_token_ids": True, "ignore_eos": True}
    answers = []
    for content in (
        [{"type": "input_audio",
          "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}],
        [{"type": "audio_url",
          "audio_url": {"url": "data:audio/mpeg;base64," + base64.b64encode(mp3).decode()}}],
    ):  # fmt: skip
        reply = client.chat.completions.create(
            model="qwen2-audio", max_tokens=MAX_TOKENS, temperature=0, extra_body=extra,
            messages=[{"role": "user", "content": [*content, {"type": "text", "text": "What?"}]}],
        )  # fmt: skip
        answers.append(reply.choices[0].model_extra["token_ids"])
    assert answers == [_hf_answer(qwen2_audio, [a], "What?") for a in (wav, mp3)]
    assert answers[0] != answers[1]


def test_audio_limits_and_refusals(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    long_wav = encode_audio(_speech(31.0, 3), 16000, "wav")
    for part, words in [
        ({"type": "input_audio", "input_audio": {"data": "bm90IGF1ZGlv", "format": "wav"}},
         "decode"),
        ({"type": "input_audio",
          "input_audio": {"data": base64.b64encode(long_wav).decode(), "format": "wav"}}, "30 s"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "image"),
    ]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="qwen2-audio", max_tokens=2,
                messages=[{"role": "user", "content": [part, {"type": "text", "text": "?"}]}],
            )  # fmt: skip
        assert words in str(e.value)


def test_sglang_generate_audio_data(server: Any, qwen2_audio: tuple[Path, Any, Any]) -> None:
    """SGLang's /generate: a text prompt with the model's audio marker and `audio_data` (base64
    bytes, as SGLang's load_audio reads a string that is no URL or path)."""
    import httpx

    _, hf, processor = qwen2_audio
    wav = encode_audio(_speech(2.5, 4), 16000, "wav")
    prompt = "<|im_start|>user\nAudio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nWhat?<|im_end|>\n"
    r = httpx.post(
        f"{server.base_url}/generate",
        json={"text": prompt, "audio_data": base64.b64encode(wav).decode(),
              "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0,
                                  "ignore_eos": True}},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    inputs = processor(text=[prompt], audio=[decode_audio(wav)], sampling_rate=16000,
                       return_tensors="pt")  # fmt: skip
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    assert r.json()["output_ids"] == out[0, inputs["input_ids"].shape[1] :].tolist()
    r = httpx.post(
        f"{server.base_url}/generate",
        json={"input_ids": [1, 2, 3], "audio_data": base64.b64encode(wav).decode()},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "audio_data"


def test_tp2_pp2_audio_parts_answer_as_hf(
    module_server: Any, qwen2_audio: tuple[Path, Any, Any]
) -> None:
    """At `--tp 2 --pp 2` the audio tower runs on the first stage (replicated across its
    tensor-parallel ranks) and its rows fill the placeholders as at one rank."""
    server = module_server(
        "--model", str(qwen2_audio[0]), "--served-model-name", "qwen2-audio", "--dtype", "float32",
        "--tp", "2", "--pp", "2", "--kv-cache-memory", "0.05",
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    wav = encode_audio(_speech(2.5, 5), 16000, "wav")
    reply = client.chat.completions.create(
        model="qwen2-audio", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        messages=[{"role": "user", "content": [
            {"type": "input_audio",
             "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
            {"type": "text", "text": "Who speaks?"}]}],
    )  # fmt: skip
    assert reply.choices[0].model_extra["token_ids"] == _hf_answer(
        qwen2_audio, [wav], "Who speaks?"
    )
