"""What the frontend knows of a speech-to-text model (Whisper): its feature extractor, its decoder
prompts and the tokens its generation_config.json suppresses.

A window of audio (at most 30 s of 16 kHz samples) becomes one engine request: its log-mel
features travel as the request's audio item (MultiModalItem "audio", no placeholders: every
decoder position attends to it), and its decoder prompt is Hugging Face's
    [<|startofprev|> + the prompt's tokens] <|startoftranscript|> [<|lang|>] <|task|> <|notimestamps|>
(language and task tokens on multilingual models only; without <|notimestamps|> when the segments
are timed: the model then writes timestamp tokens, sampled under Hugging Face's timestamp rule,
enginecore/messages.py TimestampRule). A request without a language on a
multilingual model first asks the model which language token follows <|startoftranscript|>, as
Hugging Face's `detect_language` does (`language_detection_prompt`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from enginecore.messages import MultiModalItem, TensorData, TimestampRule
from frontend.audio.formats import language_names
from frontend.common.errors import bad_request

SAMPLE_RATE = 16000
WINDOW_SECONDS = 30.0
TIME_PRECISION = 0.02  # seconds between consecutive timestamp tokens


class SpeechModel:
    def __init__(self, model_path: str | Path, tokenizer: Any) -> None:
        from transformers import WhisperFeatureExtractor

        path = Path(model_path)
        if not (path / "preprocessor_config.json").is_file():
            raise ValueError(
                f"{path} has no preprocessor_config.json (Whisper's feature extractor)"
            )
        self.extractor = WhisperFeatureExtractor.from_pretrained(path)
        if self.extractor.sampling_rate != SAMPLE_RATE:
            raise ValueError(f"the feature extractor expects {self.extractor.sampling_rate} Hz")
        g = json.loads((path / "generation_config.json").read_text())
        self.start_id = int(g["decoder_start_token_id"])
        self.no_timestamps_id = int(g["no_timestamps_token_id"])
        self.prev_id = g.get("prev_sot_token_id")
        self.is_multilingual = bool(g.get("is_multilingual", False))
        # Language code ("en") -> its token id.
        self.language_ids = {
            token.strip("<|>"): int(i) for token, i in (g.get("lang_to_id") or {}).items()
        }
        self.task_ids = {task: int(i) for task, i in (g.get("task_to_id") or {}).items()}
        self.suppress_ids = [int(t) for t in g.get("suppress_tokens") or []]
        self.begin_suppress_ids = [int(t) for t in g.get("begin_suppress_tokens") or []]
        self.max_target_positions = int(g.get("max_length", 448))
        self.eos_id = int(g["eos_token_id"])
        self.max_initial_timestamp_index = g.get("max_initial_timestamp_index")
        # Word timestamps (alignment.py): the decoder's (layer, head) pairs whose cross-attention
        # follows the speech, as OpenAI's releases name them; None: the model offers no words.
        heads = g.get("alignment_heads")
        self.alignment_heads = [(int(a), int(b)) for a, b in heads] if heads else None
        model_config = json.loads((path / "config.json").read_text())
        self.median_filter_width = int(model_config.get("median_filter_width", 7))
        self._check_alignment_heads(model_config)
        self.tokenizer = tokenizer

    def _check_alignment_heads(self, model_config: dict[str, Any]) -> None:
        layers = int(model_config["decoder_layers"])
        heads = int(model_config["decoder_attention_heads"])
        for layer, head in self.alignment_heads or []:
            if not (0 <= layer < layers and 0 <= head < heads):
                raise ValueError(
                    f"generation_config.json's alignment head ({layer}, {head}) is not one of "
                    f"the decoder's {layers} layers x {heads} heads"
                )

    # ------------------------------------------------------------------ requests

    def language_code(self, language: str | None) -> str | None:
        """The request's `language` (an ISO-639-1 code, or a name: "english") as the model's
        code; None to detect it. 400 for a language the model does not have."""
        if language is None or language == "":
            return None
        if not self.is_multilingual:
            if language.lower() not in ("en", "english"):
                raise bad_request("this model transcribes English only", "language")
            return "en"
        code = language.lower()
        names = {name: c for c, name in language_names().items()}
        code = names.get(code, code)
        if code not in self.language_ids:
            raise bad_request(
                f"language {language!r} is not one of the model's "
                f"({', '.join(sorted(self.language_ids))})",
                "language",
            )
        return code

    def timestamp_rule(self) -> TimestampRule:
        """How the model's timestamp tokens are sampled (the first follows <|notimestamps|>)."""
        return TimestampRule(
            self.no_timestamps_id + 1, self.eos_id, self.no_timestamps_id,
            self.max_initial_timestamp_index,
        )  # fmt: skip

    def decoder_prompt(
        self, language: str | None, task: str, prompt: str | None, timestamps: bool = False
    ) -> list[int]:
        """With `timestamps` the prompt ends at the task token: the model then times its
        segments (<|0.00|> text <|2.40|> ...) instead of writing <|notimestamps|>."""
        ids = []
        if prompt:
            if self.prev_id is None:
                raise bad_request("this model takes no prompt", "prompt")
            text = self.tokenizer.encode(" " + prompt.strip(), add_special_tokens=False)
            # As Hugging Face: the prompt keeps at most half the decoder's context.
            ids = [int(self.prev_id), *text[-(self.max_target_positions // 2 - 1) :]]
        ids.append(self.start_id)
        if self.is_multilingual:
            if task not in self.task_ids:
                raise bad_request(f"this model does not {task}", "task")
            ids += [self.language_ids[language or "en"], self.task_ids[task]]
        elif task != "transcribe":
            raise bad_request("this model transcribes English only; it does not translate")
        if not timestamps:
            ids.append(self.no_timestamps_id)
        return ids

    def language_detection_prompt(self) -> list[int]:
        return [self.start_id]

    def no_speech_prompt(self) -> list[int]:
        """<|startoftranscript|> <|nospeech|> (Whisper's <|nospeech|> sits just before
        <|notimestamps|>, as Hugging Face's WhisperNoSpeechDetection takes it)."""
        return [self.start_id, self.no_timestamps_id - 1]

    def language_of(self, token_id: int) -> str:
        by_id = {i: code for code, i in self.language_ids.items()}
        return by_id[token_id]

    def num_frames(self, samples: np.ndarray) -> int:
        """A window's feature frames of real audio (the rest of its 3000 is padding): what the
        feature extractor's attention mask counts."""
        return -(-len(samples) // self.extractor.hop_length)

    def audio_item(self, samples: np.ndarray) -> MultiModalItem:
        """One window's log-mel features as the request's audio item (padded to 30 s)."""
        features = self.extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="np")[
            "input_features"
        ][0].astype(np.float32)  # (mel bins, 3000)
        data = features.tobytes()
        digest = hashlib.sha256(data).hexdigest()
        tensor = TensorData("float32", list(features.shape), data)
        return MultiModalItem("audio", digest, [], {"input_features": tensor})
