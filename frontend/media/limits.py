"""How many media items one prompt may carry: vLLM's `--limit-mm-per-prompt '{"image": N}'` JSON,
parsed at start-up, and the per-request count checked against it.

Defaults follow vLLM's vllm/config/multimodal.py (MultiModalConfig.limit_per_prompt, "Defaults to
999 for each modality"; read at vLLM main, commit 01230b4): a modality the flag leaves out keeps 999.
The refusal's text is vLLM's (BaseProcessingInfo.validate_num_items in its multimodal processing),
so clients that match on it carry over.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from frontend.common.errors import bad_request
from frontend.media.policy import MODALITIES, MediaPolicy


def parse_limit_mm_per_prompt(text: str) -> dict[str, int]:
    """The limits the flag names, e.g. '{"image": 2, "video": 0}' -> {"image": 2, "video": 0}.

    vLLM's configurable form '{"image": {"count": 2}}' is taken too, count only: its other keys
    size vLLM's memory profiling, which tern does not do. Raises ValueError with a message."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--limit-mm-per-prompt: not JSON ({e}): {text!r}") from None
    if not isinstance(parsed, dict):
        raise ValueError(
            f'--limit-mm-per-prompt: expected a JSON object like {{"image": 2}}, got {text!r}'
        )
    limits: dict[str, int] = {}
    for modality, value in parsed.items():
        if modality not in MODALITIES:
            raise ValueError(
                f"--limit-mm-per-prompt: unknown modality {modality!r} (one of {MODALITIES})"
            )
        if isinstance(value, dict) and set(value) == {"count"}:
            value = value["count"]
        # NOTE: bool is an int in Python; `{"image": true}` is a mistake, not 1.
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(
                f"--limit-mm-per-prompt: {modality!r} needs a non-negative integer, not {value!r}"
            )
        limits[modality] = value
    return limits


def check_limits(
    counts: Mapping[str, int],
    policy: MediaPolicy,
    param: str,
    supported: Mapping[str, int | None] | None = None,
) -> None:
    """Refuses (400 naming `param`) a prompt with more items of a modality than allowed.

    `supported` is what the model takes (vLLM's get_supported_mm_limits: a missing modality is
    not taken at all, None is unlimited); None means only the flag's limits apply. As in vLLM, the
    hint to raise `--limit-mm-per-prompt` is given only when the flag, not the model, is the bound.
    """
    for modality, count in counts.items():
        allowed = policy.max_items(modality)
        model_limit = None if supported is None else supported.get(modality, 0)
        limit = allowed if model_limit is None else min(allowed, model_limit)
        if count > limit:
            message = f"At most {limit} {modality}(s) may be provided in one prompt."
            if model_limit is None or count <= model_limit:
                message += " Set `--limit-mm-per-prompt` to increase this limit."
            raise bad_request(message, param)
