"""Qwen2-Audio through the engine (in process) against Hugging Face: a random tiny checkpoint
(2-layer Whisper-style audio tower, Qwen2 text model, saved by transformers) answers prompts with
one audio and with two greedily token for token as `Qwen2AudioForConditionalGeneration.generate`
in float32.

The requests carry what the frontend sends (frontend/audio/prompts.py): each audio's run of
<|AUDIO|> placeholders, its `input_features` (1, 128, 3000) and `feature_attention_mask`; chunks
of 16 tokens split the audio's placeholders."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from enginecore.messages import EngineCoreRequest, MultiModalItem, SamplingParams, TensorData
from tests.audio_files import tiny_qwen2_audio
from tests.unit.test_engine_inproc import drain, make_core
from workers.audio.qwen2_audio import num_audio_rows

AUDIO = 200  # the audio placeholder token
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(directory, HF model, feature extractor)."""
    hf = tiny_qwen2_audio(vocab_size=256, audio_token=AUDIO)
    model_dir = tmp_path_factory.mktemp("qwen2_audio")
    hf.save_pretrained(model_dir)
    extractor = transformers.WhisperFeatureExtractor(feature_size=128)
    return model_dir, hf, extractor


def _audio_inputs(extractor: Any, seed: int, seconds: float) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    audio = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 900) * t) + 0.05 * rng.standard_normal(t.size)
    out = extractor(
        audio.astype(np.float32), sampling_rate=16000, return_attention_mask=True,
        padding="max_length", return_tensors="pt",
    )  # fmt: skip
    return {"input_features": out["input_features"],
            "feature_attention_mask": out["attention_mask"]}  # fmt: skip


def _item(tensors: dict[str, torch.Tensor], start: int, length: int) -> MultiModalItem:
    data = {
        name: TensorData(str(t.dtype).removeprefix("torch."), list(t.shape), t.numpy().tobytes())
        for name, t in tensors.items()
    }
    digest = hashlib.sha256(b"".join(d.data for d in data.values())).hexdigest()
    return MultiModalItem("audio", digest, [(start, length)], data)


def _prompt(extractor: Any, audios: list[tuple[int, float]]):
    ids, items, inputs = [5, 6, 7], [], []
    for seed, seconds in audios:
        tensors = _audio_inputs(extractor, seed, seconds)
        n = num_audio_rows(int(tensors["feature_attention_mask"].sum()))
        items.append(_item(tensors, len(ids), n))
        inputs.append(tensors)
        ids += [AUDIO] * n + [10 + seed]
    return ids + [30, 31], items, inputs


def _hf_greedy(hf: Any, ids: list[int], inputs: list[dict[str, torch.Tensor]]) -> list[int]:
    input_ids = torch.tensor([ids])
    features = torch.cat([x["input_features"] for x in inputs])
    mask = torch.cat([x["feature_attention_mask"] for x in inputs])
    with torch.inference_mode():
        out = hf.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
            input_features=features, feature_attention_mask=mask, max_new_tokens=MAX_TOKENS,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_one_and_two_audios_answer_as_hf(checkpoint: tuple[Path, Any, Any]) -> None:
    model_dir, hf, extractor = checkpoint
    cases = [[(1, 2.0)], [(2, 2.0)], [(3, 1.0), (4, 3.5)]]
    prompts = [_prompt(extractor, audios) for audios in cases]
    assert prompts[0][1][0].spans[0][1] == num_audio_rows(200) == 50
    core = make_core(model_dir, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, (ids, items, _) in enumerate(prompts):
        assert core.add_request(EngineCoreRequest(f"r{i}", ids, params, mm_items=items)) == []
    outs, _ = drain(core)
    answers = [outs[f"r{i}"] for i in range(len(cases))]
    assert answers == [_hf_greedy(hf, ids, inputs) for ids, _, inputs in prompts]
    assert answers[0] != answers[1]  # the same words, another audio
