"""Random-weight Whisper checkpoints for tests and benchmarks, with everything a server needs beside
the weights: a tokenizer with Whisper's special tokens, the feature extractor's
preprocessor_config.json and a generation_config.json as OpenAI's releases carry them (language
and task tokens, suppressed tokens, alignment heads).

The tokenizer is a byte-level BPE trained here on a few sentences (no model hub at run time), then
Whisper's specials in their order: <|endoftext|>, <|startoftranscript|>, the languages,
<|translate|>, <|transcribe|>, <|startoflm|>, <|startofprev|>, <|nospeech|>, <|notimestamps|>,
and the 1501 timestamps <|0.00|> ... <|30.00|>.

    python scripts/make_tiny_whisper.py OUT_DIR [--shape test|tiny|base]

`tiny` and `base` have whisper-tiny's and whisper-base's sizes, vocabulary included (51,865: their
BPE is trained on pseudo-words until it has OpenAI's 50,256 text tokens); `test` is tiny
everywhere (a ~2k vocabulary) for the test suite.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

# text_vocab: the BPE's tokens before the specials (OpenAI's: 50,256, with 1,609 specials 51,865).
# The decoder's alignment heads (word timestamps), as OpenAI's releases name them: whisper-tiny's
# and whisper-base's own; `test` takes every head of its later half (OpenAI's default).
ALIGNMENT_HEADS = {
    "test": [[1, 0], [1, 1], [1, 2], [1, 3]],
    "tiny": [[2, 2], [3, 0], [3, 2], [3, 3], [3, 4], [3, 5]],
    "base": [[3, 1], [4, 2], [4, 3], [4, 7], [5, 1], [5, 2], [5, 4], [5, 6]],
}
SHAPES: dict[str, dict[str, int]] = {
    "test": {"d_model": 64, "layers": 2, "heads": 4, "ffn": 128, "text_vocab": 600},
    "tiny": {"d_model": 384, "layers": 4, "heads": 6, "ffn": 1536, "text_vocab": 50256},
    "base": {"d_model": 512, "layers": 6, "heads": 8, "ffn": 2048, "text_vocab": 50256},
}
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a test of speech recognition on a small server",
    "voice agents and meeting tools transcribe speech into text every day",
    "numbers like 1, 2, 3 and 42 show up; so do names: Alice, Bob and Carol.",
]


def _corpus(text_vocab: int) -> list[str]:
    """The sentences above; for a large vocabulary also pseudo-words (syllables), which give BPE
    enough distinct merges."""
    if text_vocab <= 1000:
        return _CORPUS * 20
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + list("aeiou")
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(300_000)]
    return _CORPUS * 20 + [" ".join(words[i : i + 20]) for i in range(0, len(words), 20)]


def _tokenizer(out_dir: Path, text_vocab: int) -> Any:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import WhisperTokenizer
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_corpus(text_vocab), vocab_size=text_vocab, min_frequency=1)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = WhisperTokenizer(vocab=model["vocab"], merges=merges)
    specials = [
        "<|startoftranscript|>", *(f"<|{code}|>" for code in LANGUAGES), "<|translate|>",
        "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>",
    ]  # fmt: skip
    tokenizer.add_tokens(["<|endoftext|>"], special_tokens=True)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.add_tokens([f"<|{i * 0.02:.2f}|>" for i in range(1501)])
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def _generation_config(tokenizer: Any) -> dict[str, Any]:
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    ids = tokenizer.convert_tokens_to_ids
    eos = ids("<|endoftext|>")
    space = tokenizer.encode(" ", add_special_tokens=False)
    return {
        "decoder_start_token_id": ids("<|startoftranscript|>"),
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "is_multilingual": True,
        "lang_to_id": {f"<|{c}|>": ids(f"<|{c}|>") for c in LANGUAGES},
        "task_to_id": {"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")},
        "no_timestamps_token_id": ids("<|notimestamps|>"),
        "prev_sot_token_id": ids("<|startofprev|>"),
        "max_initial_timestamp_index": 50,
        "max_length": 448,
        # As OpenAI's releases: symbols never transcribed, and a first token that is no space.
        "suppress_tokens": sorted(set(tokenizer.encode(" #", add_special_tokens=False)[-1:])
                                  | {ids("<|startoflm|>"), ids("<|startofprev|>")}),
        "begin_suppress_tokens": [*space[-1:], eos],
    }  # fmt: skip


def make_tiny_whisper(out_dir: Path, shape: str = "test", seed: int = 0) -> Path:
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    s = SHAPES[shape]
    tokenizer = _tokenizer(out_dir, s["text_vocab"])
    generation = _generation_config(tokenizer)
    generation["alignment_heads"] = ALIGNMENT_HEADS[shape]
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=80,
        d_model=s["d_model"],
        encoder_layers=s["layers"],
        decoder_layers=s["layers"],
        encoder_attention_heads=s["heads"],
        decoder_attention_heads=s["heads"],
        encoder_ffn_dim=s["ffn"],
        decoder_ffn_dim=s["ffn"],
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=generation["decoder_start_token_id"],
        eos_token_id=generation["eos_token_id"],
        pad_token_id=generation["pad_token_id"],
        bos_token_id=generation["bos_token_id"],
        suppress_tokens=None,
        begin_suppress_tokens=None,
        architectures=["WhisperForConditionalGeneration"],
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # wider than the default init: transcripts that differ between audios
        for name, param in model.named_parameters():
            if name.endswith("weight") and param.dim() >= 2:
                param.normal_(0.0, 0.1 if "embed" in name else 0.3)
    model.save_pretrained(out_dir)
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    WhisperFeatureExtractor(feature_size=80).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="test")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_tiny_whisper(args.out_dir, args.shape, args.seed))


if __name__ == "__main__":
    main()
