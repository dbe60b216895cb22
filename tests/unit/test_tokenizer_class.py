"""frontend/text/tokenizer_class.py: the tokenizer AutoTokenizer makes, made again from the class
it picked (remembered in TERN_HOME) without importing torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from frontend.text import tokenizer_class
from frontend.text.tokenizer_class import auto_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["Hello, world!", "  two  spaces\tand a tab\n", "<|im_start|>user\nhé 😀<|im_end|>"]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def _as_family(src: Path, dst: Path, model_type: str, tokenizer_class_name: str) -> Path:
    """The tiny model's tokenizer in a directory whose config says `model_type` and whose
    tokenizer_config names `tokenizer_class_name` (AutoTokenizer's per-family rules read both)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    tok_config = json.loads((dst / "tokenizer_config.json").read_text())
    tok_config["tokenizer_class"] = tokenizer_class_name
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return dst


@pytest.fixture
def tern_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "tern_home"
    monkeypatch.setenv("TERN_HOME", str(home))
    return home


@pytest.mark.parametrize(
    ("model_type", "class_name"),
    [("llama", "PreTrainedTokenizerFast"), ("qwen2", "Qwen2Tokenizer"), ("gpt2", "GPT2Tokenizer")],
)
def test_the_remembered_class_makes_autotokenizers_tokenizer(
    tiny_llama_with_tokenizer: Path, tmp_path: Path, tern_home: Path, model_type: str,
    class_name: str,
) -> None:  # fmt: skip
    model_dir = _as_family(tiny_llama_with_tokenizer, tmp_path / "m", model_type, class_name)
    auto = AutoTokenizer.from_pretrained(str(model_dir))
    first = auto_tokenizer(model_dir)  # AutoTokenizer's pick, remembered
    entries = json.loads((tern_home / tokenizer_class.CACHE_FILE).read_text())
    assert list(entries.values()) == [[type(auto).__module__, type(auto).__qualname__]]
    again = auto_tokenizer(model_dir)  # made from the remembered class
    for tok in (first, again):
        assert type(tok) is type(auto)
        for text in TEXTS:
            assert tok.encode(text) == auto.encode(text)
            assert tok.encode(text, add_special_tokens=False) == auto.encode(
                text, add_special_tokens=False
            )
        assert tok.apply_chat_template(MESSAGES, tokenize=False) == auto.apply_chat_template(
            MESSAGES, tokenize=False
        )
        assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (
            auto.bos_token_id, auto.eos_token_id, len(auto)
        )  # fmt: skip


def test_a_changed_directory_or_a_bad_entry_is_picked_again(
    tiny_llama_with_tokenizer: Path, tmp_path: Path, tern_home: Path
) -> None:
    model_dir = _as_family(tiny_llama_with_tokenizer, tmp_path / "m", "gpt2", "GPT2Tokenizer")
    assert type(auto_tokenizer(model_dir)).__name__ == "GPT2Tokenizer"
    _as_family(tiny_llama_with_tokenizer, tmp_path / "m2", "llama", "PreTrainedTokenizerFast")
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "m2" / name, model_dir / name)
    assert type(auto_tokenizer(model_dir)).__name__ == "TokenizersBackend"
    cache = tern_home / tokenizer_class.CACHE_FILE
    entries = json.loads(cache.read_text())
    assert len(entries) == 2
    cache.write_text(json.dumps(dict.fromkeys(entries, ["transformers", "NoSuchTokenizer"])))
    assert type(auto_tokenizer(model_dir)).__name__ == "TokenizersBackend"
    cache.write_text("not json")
    assert type(auto_tokenizer(model_dir)).__name__ == "TokenizersBackend"


def test_a_second_start_imports_no_torch(tiny_llama_with_tokenizer: Path, tern_home: Path) -> None:
    script = (
        "import sys; from pathlib import Path; "
        "from frontend.text.tokenizer import Tokenizer; "
        f"Tokenizer(Path({str(tiny_llama_with_tokenizer)!r})); print('torch' in sys.modules)"
    )
    env = {"PATH": "/usr/bin:/bin", "TERN_HOME": str(tern_home), "PYTHONPATH": str(ROOT)}

    def start() -> str:
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env=env, timeout=120, check=True)  # fmt: skip
        return run.stdout.strip()

    assert start() == "True"  # AutoTokenizer picked the class
    assert start() == "False"
