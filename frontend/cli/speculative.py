"""`tern launch` flags of speculative decoding: vLLM's --speculative-config JSON, or SGLang's
--speculative-* flags, both turned into one SpeculativeConfig (older method names mapped to
today's, defaults filled in, methods not served refused)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import msgspec

from enginecore.config import SpeculativeConfig

_SPEC_KEYS = {f.name for f in dataclasses.fields(SpeculativeConfig)}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\': method '
        "ngram (prompt lookup: prompt_lookup_min/max) or suffix (suffix decoding: "
        "suffix_decoding_max_tree_depth, _max_cached_requests, _max_spec_factor, "
        '_min_token_prob), draft_model ("model": a small model with the same vocabulary), '
        "mtp (the checkpoint's own multi-token-prediction layer: Qwen3.5, Qwen3.5-MoE) or eagle3 "
        '("model": an EAGLE-3 head trained for this model); '
        "disable_by_batch_size: no drafts in larger steps (default 8)",
    )
    group.add_argument(
        "--speculative-algorithm",
        default=None,
        help="SGLang's: NGRAM (= method ngram), STANDALONE (= draft_model, with "
        "--speculative-draft-model-path), SUFFIX, EAGLE3 (= eagle3, the head's path as "
        "--speculative-draft-model-path), or NEXTN / EAGLE without a draft model path (= mtp); "
        "with the flags below",
    )
    group.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    group.add_argument(
        "--speculative-num-steps",
        type=int,
        default=None,
        help="SGLang's draft steps (NEXTN / EAGLE): the drafts a sequence verifies at most",
    )
    group.add_argument("--speculative-eagle-topk", type=int, default=None, help="1 only")
    group.add_argument("--speculative-draft-model-path", default=None)
    group.add_argument("--speculative-ngram-min-match-window-size", type=int, default=None)
    group.add_argument("--speculative-ngram-max-match-window-size", type=int, default=None)


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig:
    """--speculative-config (vLLM's JSON), or SGLang's --speculative-* flags."""
    if args.speculative_config is not None and args.speculative_algorithm is not None:
        raise ValueError("give --speculative-config or --speculative-algorithm, not both")
    if args.speculative_config is not None:
        spec = _spec_from_json(args.speculative_config)
    elif args.speculative_algorithm is not None:
        spec = _spec_from_sglang_flags(args)
    else:
        return SpeculativeConfig()
    return _spec_config(spec)


def _spec_from_json(text: str) -> dict[str, Any]:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError("--speculative-config must be a JSON object")
    return spec


def _spec_from_sglang_flags(args: argparse.Namespace) -> dict[str, Any]:
    algorithm = args.speculative_algorithm.lower()
    if algorithm == "nextn" or (
        algorithm == "eagle" and args.speculative_draft_model_path is None
    ):  # SGLang drafts with the checkpoint's own MTP layers
        algorithm = "mtp"
    if (args.speculative_eagle_topk or 1) != 1:
        raise ValueError("--speculative-eagle-topk above 1 (tree drafts) is not served")
    steps = args.speculative_num_steps
    spec: dict[str, Any] = {"method": "draft_model" if algorithm == "standalone" else algorithm}
    sglang = {
        "model": args.speculative_draft_model_path,
        "num_speculative_tokens": args.speculative_num_draft_tokens if steps is None else steps,
        "prompt_lookup_min": args.speculative_ngram_min_match_window_size,
        "prompt_lookup_max": args.speculative_ngram_max_match_window_size,
    }
    spec.update({k: v for k, v in sglang.items() if v is not None})
    return spec


def _spec_config(spec: dict[str, Any]) -> SpeculativeConfig:
    """vLLM's older spellings mapped, the draft model's path resolved, defaults filled in."""
    if spec.get("model") == "[ngram]":  # vLLM's older spelling of method ngram
        spec.pop("model")
        spec.setdefault("method", "ngram")
    if spec.get("model") is not None:
        spec.setdefault("method", "draft_model")
        model = Path(str(spec["model"])).expanduser()
        if not (model / "config.json").is_file():
            raise ValueError(f"the draft model {spec['model']}: not a model directory")
        spec["model"] = str(model.resolve())
    method = spec.get("method")
    if isinstance(method, str) and method.endswith("_mtp"):  # vLLM's older per-family names
        spec["method"] = method = "mtp"
    if method in ("eagle", "medusa", "mlp_speculator"):
        raise ValueError(
            f"speculative method {method!r} is not served yet: tern drafts with ngram, suffix, "
            "draft_model, mtp (the checkpoint's own multi-token-prediction head) or eagle3"
        )
    unknown = sorted(set(spec) - _SPEC_KEYS)
    if unknown:
        raise ValueError(f"--speculative-config: unknown keys {unknown}")
    if method == "suffix":
        spec.setdefault("num_speculative_tokens", spec.get("suffix_decoding_max_tree_depth", 24))
    spec.setdefault("num_speculative_tokens", 5)
    lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    if lo is None and hi is not None:
        spec["prompt_lookup_min"] = min(2, hi)
    if hi is None and lo is not None:
        spec["prompt_lookup_max"] = max(lo, 5)
    try:
        return msgspec.convert(spec, SpeculativeConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"--speculative-config: {e}") from None
