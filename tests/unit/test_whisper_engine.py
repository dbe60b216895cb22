"""Whisper through the engine (in process) against Hugging Face: a random tiny checkpoint
(scripts/make_tiny_whisper.py) answers greedily token for token as
`WhisperForConditionalGeneration` in float32, given the same decoder prompt
(<|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>) and the same suppressed tokens.

The requests carry what the frontend sends: one audio item (MultiModalItem "audio", no spans,
the window's input_features). Several audios run in one batch, a repeated audio (its keys come
from the cache) answers as the first time, and a request without audio is refused."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from enginecore.messages import EngineCoreRequest, MultiModalItem, SamplingParams, TensorData
from tests.conftest import _load_script
from tests.unit.test_engine_inproc import drain, make_core

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(directory, HF model, feature extractor)."""
    import transformers

    model_dir = _load_script("make_tiny_whisper").make_tiny_whisper(
        tmp_path_factory.mktemp("whisper")
    )
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(model_dir).eval()
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(model_dir)
    return model_dir, hf, extractor


def _features(extractor: Any, seed: int, seconds: float) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    audio = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 900) * t) + 0.05 * rng.standard_normal(t.size)
    out = extractor(audio.astype(np.float32), sampling_rate=16000, return_tensors="pt")
    return out["input_features"][0]  # (80, 3000)


def _item(features: torch.Tensor) -> MultiModalItem:
    data = TensorData("float32", list(features.shape), features.numpy().tobytes())
    return MultiModalItem("audio", hashlib.sha256(data.data).hexdigest(), [],
                          {"input_features": data})  # fmt: skip


def _prompt(model_dir: Path) -> tuple[list[int], dict[str, Any]]:
    import json

    g = json.loads((model_dir / "generation_config.json").read_text())
    ids = [g["decoder_start_token_id"], g["lang_to_id"]["<|en|>"],
           g["task_to_id"]["transcribe"], g["no_timestamps_token_id"]]  # fmt: skip
    return ids, g


def _hf_greedy(hf: Any, features: torch.Tensor, prompt: list[int], g: dict[str, Any]) -> list[int]:
    """Greedy decoding over Hugging Face's forward, the whole sequence each step, with
    generate's suppressed tokens. (transformers 5.24's Whisper `generate` re-encodes and
    re-decodes the window a varying number of times on a random checkpoint, and its first token
    then changes with max_new_tokens: its own forward is the oracle here.)"""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(MAX_TOKENS):
            logits = hf(input_features=features[None], decoder_input_ids=torch.tensor([ids]))
            row = logits.logits[0, -1]
            row[g["suppress_tokens"]] = float("-inf")
            if len(ids) == len(prompt):
                row[g["begin_suppress_tokens"]] = float("-inf")
            ids.append(int(row.argmax()))
            if ids[-1] == g["eos_token_id"]:
                break
    return ids


def test_whisper_answers_as_hf(checkpoint: tuple[Path, Any, Any]) -> None:
    model_dir, hf, extractor = checkpoint
    prompt, g = _prompt(model_dir)
    feats = [_features(extractor, i, s) for i, s in enumerate([3.0, 7.5, 29.0])]
    core = make_core(model_dir, max_num_batched_tokens=64)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, eos_token_ids=[g["eos_token_id"]],
        suppress_token_ids=g["suppress_tokens"], begin_suppress_token_ids=g["begin_suppress_tokens"],
    )  # fmt: skip
    requests = [*feats, feats[0]]  # the last repeats the first audio
    for i, f in enumerate(requests):
        assert (
            core.add_request(EngineCoreRequest(f"r{i}", prompt, params, mm_items=[_item(f)])) == []
        )
    outs, _ = drain(core)
    expected = [_hf_greedy(hf, f, prompt, g) for f in feats]
    answers = [prompt + outs[f"r{i}"] for i in range(len(requests))]
    assert answers == [*expected, expected[0]]
    assert len({tuple(a) for a in answers}) == 3  # each audio its own transcript


def test_whisper_request_needs_its_audio(checkpoint: tuple[Path, Any, Any]) -> None:
    model_dir, _, extractor = checkpoint
    prompt, _ = _prompt(model_dir)
    core = make_core(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    refused = core.add_request(EngineCoreRequest("r", prompt, params))
    assert refused and "audio" in refused[0].error
    image = MultiModalItem("image", "x", [(0, 1)])
    refused = core.add_request(EngineCoreRequest("r2", prompt, params, mm_items=[image]))
    assert refused and "audio" in refused[0].error


def test_whisper_preempted_requests_resume(checkpoint: tuple[Path, Any, Any]) -> None:
    """A KV cache too small for every request: preempted requests come back (their audio's keys
    from the cache, their prompt recomputed) and answer as without preemption."""
    model_dir, _, extractor = checkpoint
    prompt, g = _prompt(model_dir)
    feats = [_features(extractor, 10 + i, 5.0 + i) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def run(**kw: Any) -> tuple[list[list[int]], int]:
        core = make_core(model_dir, max_num_batched_tokens=64, **kw)
        for i, f in enumerate(feats):
            core.add_request(EngineCoreRequest(f"r{i}", prompt, params, mm_items=[_item(f)]))
        outs, _ = drain(core)
        return [outs[f"r{i}"] for i in range(3)], core.scheduler.num_preempted_total

    roomy, _ = run()
    tight, preemptions = run(num_blocks=5, prefix_caching=False)
    assert preemptions > 0 and tight == roomy
