"""How logprobs are shown: token texts and real bytes (a character split over byte-level tokens
comes back whole from the bytes), OpenAI's chat and completions shapes, vLLM's prompt_logprobs,
LMDeploy's [logprob, token id] pairs."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers

from enginecore.messages import Logprobs
from frontend.text.logprobs import (
    TokenStrings,
    chat_logprobs,
    completion_logprobs,
    lmdeploy_logprobs,
    prompt_logprobs,
)


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path | None) -> tokenizers.Tokenizer:
    if tokenizer_dir is None:
        pytest.skip("needs the default model's tokenizer (python -m frontend.model_prep)")
    return tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def test_token_bytes_rebuild_split_characters(tok: tokenizers.Tokenizer) -> None:
    strings = TokenStrings(tok)
    ids = tok.encode("crab 🦀!", add_special_tokens=False).ids
    assert b"".join(bytes(strings.bytes(t)) for t in ids) == "crab 🦀!".encode()
    assert any(strings.text(t) == "\ufffd" for t in ids)  # a piece of the crab alone
    eos = tok.token_to_id("<|im_end|>")
    assert strings.text(eos) == "<|im_end|>" and strings.bytes(eos) == list(b"<|im_end|>")
    as_ids = TokenStrings(tok, as_token_ids=True)
    assert as_ids.text(eos) == f"token_id:{eos}" and as_ids.bytes(eos) == list(b"token_id:2")


def test_shapes(tok: tokenizers.Tokenizer) -> None:
    s = TokenStrings(tok)
    a, b, c = (tok.token_to_id(t) for t in ("Hello", "Ġworld", "!"))
    # Two positions, two alternatives each; the second position's token is not among them.
    lp = Logprobs([b, c], [-0.5, -3.0], [1, 4], 2, [b, a, a, b], [-0.5, -1.5, -1.0, -2.0])
    chat = chat_logprobs(lp, 1, s)
    assert [(x.token, x.logprob) for x in chat] == [(" world", -0.5), ("!", -3.0)]
    assert [[(t.token, t.logprob) for t in x.top_logprobs] for x in chat] == [
        [(" world", -0.5)],
        [("Hello", -1.0)],
    ]
    out = completion_logprobs([lp], 2, s, 10, unscored_first=a)
    assert out.tokens == ["Hello", " world", "!"] and out.text_offset == [10, 15, 21]
    assert out.token_logprobs == [None, -0.5, -3.0]
    assert out.top_logprobs == [None, {" world": -0.5, "Hello": -1.5}, {"!": -3.0, "Hello": -1.0, " world": -2.0}]  # fmt: skip
    prompt = prompt_logprobs([a, b, c], lp, 1, s)
    assert prompt[0] is None
    assert {k: (v.logprob, v.rank) for k, v in prompt[2].items()} == {
        str(c): (-3.0, 4),
        str(a): (-1.0, 1),
    }
    assert lmdeploy_logprobs(Logprobs([c], [-1e6])) == [[-9999.0, c]]  # clamped, as vLLM
