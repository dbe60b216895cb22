"""Incremental detokenization: never a broken character mid-stream, stop strings found across chunk
boundaries and never leaked, and the token accounting that `usage` reports.

Two tokenizers: a byte-level BPE trained here in milliseconds (multi-byte characters always span
several tokens), and the default model's SmolLM2 tokenizer when it has been prepared.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from frontend.text.detokenizer import IncrementalDetokenizer

TEXT = "Héllo wörld! I love 🦀 and 日本語, naïve café ☕ — done. 👩‍👩‍👧 ok"
CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "I love tea and code"] * 20


def _byte_level_tokenizer() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _smollm2_tokenizer() -> tokenizers.Tokenizer | None:
    from frontend.model_prep import default_model_dir, is_complete

    model_dir = Path(default_model_dir())
    if not is_complete(model_dir):
        return None
    return tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module", params=["byte_level", "smollm2"])
def tok(request: pytest.FixtureRequest) -> tokenizers.Tokenizer:
    if request.param == "byte_level":
        return _byte_level_tokenizer()
    smol = _smollm2_tokenizer()
    if smol is None:
        pytest.skip("the default model (SmolLM2 tokenizer) is not prepared")
    return smol


def stream(
    detok: IncrementalDetokenizer, ids: list[int], batch_sizes: list[int] | None = None
) -> list[str]:
    """Feeds ids in batches (default one at a time); returns the chunks, the final flush last."""
    chunks, i = [], 0
    sizes = iter(batch_sizes or [])
    while i < len(ids) and not detok.is_stopped:
        n = next(sizes, 1)
        detok.update(ids[i : i + n])
        chunks.append(detok.take_new_text())
        i += n
    chunks.append(detok.take_new_text(final=True))
    return chunks


def test_multibyte_characters_split_over_tokens(tok: tokenizers.Tokenizer) -> None:
    ids = tok.encode(TEXT).ids
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the test needs characters split over tokens"
    chunks = stream(IncrementalDetokenizer(tok), ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == TEXT


def test_random_batches_give_the_same_text(tok: tokenizers.Tokenizer) -> None:
    ids = tok.encode(TEXT * 3).ids
    rng = random.Random(0)
    for _ in range(5):
        sizes = [rng.randint(1, 4) for _ in ids]
        chunks = stream(IncrementalDetokenizer(tok), ids, sizes)
        assert all("\ufffd" not in c for c in chunks)
        assert "".join(chunks) == TEXT * 3


def test_prompt_context_does_not_change_the_output(tok: tokenizers.Tokenizer) -> None:
    prompt = tok.encode("Some prompt that ends 日").ids
    ids = tok.encode(" and then: 🦀 crab").ids
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(stream(detok, ids)) == " and then: 🦀 crab"


@pytest.mark.parametrize("stop", ["wörld", "ö", "🦀 and", "日本", "done. 👩"])
def test_stop_string_across_tokens_is_cut_and_never_leaked(
    tok: tokenizers.Tokenizer, stop: str
) -> None:
    ids = tok.encode(TEXT).ids
    detok = IncrementalDetokenizer(tok, stop=[stop])
    chunks = stream(detok, ids)
    expected = TEXT[: TEXT.index(stop)]
    assert "".join(chunks) == expected
    assert detok.is_stopped and detok.stop_reason == stop
    # Text released before the end never held a piece of the stop string past the cut point.
    released = ""
    for c in chunks:
        released += c
        assert expected.startswith(released)
    # Tokens are counted up to the one that completed the stop string, not beyond.
    assert detok.num_tokens < len(ids) or stop == TEXT[-len(stop) :]
    prefix_ids = ids[: detok.num_tokens]
    assert stop in tok.decode(prefix_ids) and stop not in tok.decode(prefix_ids[:-1])


def test_stop_string_is_withheld_until_decided(tok: tokenizers.Tokenizer) -> None:
    # Whatever could still grow into the stop string is withheld, and nothing else.
    stop = "lo wx"
    ids = tok.encode("hello world, hello w").ids
    detok = IncrementalDetokenizer(tok, stop=[stop])
    released = ""
    for k in range(1, len(ids) + 1):
        detok.update([ids[k - 1]])
        released += detok.take_new_text()
        full = tok.decode(ids[:k])
        hold = max((n for n in range(1, len(stop)) if full.endswith(stop[:n])), default=0)
        assert released == full[: len(full) - hold]
    assert released == "hello world, hel"
    released += detok.take_new_text(final=True)
    assert released == "hello world, hello w" and not detok.is_stopped


def test_unfinished_stop_prefix_is_released_at_the_end(tok: tokenizers.Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["world peace"])
    chunks = stream(detok, tok.encode("hello world").ids)
    assert chunks[-1].endswith("world") and "".join(chunks) == "hello world"
    assert not detok.is_stopped


def test_earliest_stop_string_wins(tok: tokenizers.Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["fox", "quick"])
    text = "".join(stream(detok, tok.encode("the quick brown fox").ids))
    assert text == "the " and detok.stop_reason == "quick"


def test_include_stop_str_in_output(tok: tokenizers.Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["brown"], include_stop_str_in_output=True)
    text = "".join(stream(detok, tok.encode("the quick brown fox").ids))
    assert text == "the quick brown" and detok.stop_reason == "brown"


def test_tokens_after_a_stop_string_in_one_batch_are_not_counted(
    tok: tokenizers.Tokenizer,
) -> None:
    ids = tok.encode("the quick brown fox jumps").ids
    detok = IncrementalDetokenizer(tok, stop=["brown"])
    detok.update(ids)  # all at once, as a slow reader gets them
    assert detok.is_stopped and detok.num_tokens < len(ids)
    assert detok.take_new_text() == "the quick "


def test_stop_token_text_is_dropped_but_counted(tok: tokenizers.Tokenizer) -> None:
    ids = tok.encode("hello world").ids
    detok = IncrementalDetokenizer(tok)
    detok.update(ids, ends_with_stop_token=True)  # the last token is a stop token id
    assert detok.take_new_text(final=True) == tok.decode(ids[:-1])
    assert detok.num_tokens == len(ids)
    keep = IncrementalDetokenizer(tok, include_stop_str_in_output=True)
    keep.update(ids, ends_with_stop_token=True)
    assert keep.take_new_text(final=True) == "hello world"


def test_special_tokens_are_skipped_unless_asked() -> None:
    tok = _byte_level_tokenizer()
    eos = tok.token_to_id("<eos>")
    ids = [*tok.encode("hello").ids, eos, *tok.encode(" world").ids]
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == "hello world"
    kept = "".join(stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids))
    assert kept == "hello<eos> world"


def test_unknown_token_ids_decode_to_nothing() -> None:
    tok = _byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok)
    detok.update([*tok.encode("hi").ids, 10**6, *tok.encode(" there").ids])
    assert detok.take_new_text(final=True) == "hi there" and detok.num_tokens > 0
