"""The toy task: "Describe <topic> in exactly <n> words." with a verifiable, shaped reward.

SmolLM2-135M-Instruct sampled at temperature 1.0 rambles (about a dozen words, often cut off at
max_new_tokens), so it rarely hits n: its reward starts low. The reward is 2^-|words - n| (1 for
the exact count, 1/2 when one word off, ...) rather than 0/1, so that a group of samples differs
in reward even before any sample is exact, and GRPO has an advantage to follow from step 0.

This module knows nothing about tern or torch: prompts are chat messages, rewards are floats.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TOPICS = (
    "the sea", "cats", "winter", "music", "bread", "the moon", "a forest", "coffee", "rain",
    "a city at night", "dogs", "the desert", "snow", "a library", "summer", "mountains", "tea",
    "a train", "the wind", "autumn", "a garden", "fire", "the sky", "a river", "chocolate",
    "an old house", "birds", "the ocean floor", "a storm", "friendship", "a market", "the stars",
)  # fmt: skip
MIN_WORDS, MAX_WORDS = 2, 5


@dataclass(frozen=True)
class Prompt:
    topic: str
    num_words: int

    @property
    def messages(self) -> list[dict[str, str]]:
        text = f"Describe {self.topic} in exactly {self.num_words} words."
        return [{"role": "user", "content": text}]


def sample_prompts(rng: random.Random, k: int) -> list[Prompt]:
    return [Prompt(rng.choice(TOPICS), rng.randint(MIN_WORDS, MAX_WORDS)) for _ in range(k)]


def count_words(text: str) -> int:
    """Whitespace-separated pieces that hold a letter: a lone dash or emoji is not a word."""
    return sum(any(c.isalpha() for c in piece) for piece in text.split())


def reward(prompt: Prompt, completion: str) -> float:
    return 2.0 ** -abs(count_words(completion) - prompt.num_words)


def is_exact(prompt: Prompt, completion: str) -> bool:
    return count_words(completion) == prompt.num_words
