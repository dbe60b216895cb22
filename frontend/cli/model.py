"""`tern launch` flags of the model: which checkpoint (a Hugging Face directory or a .gguf file,
prepared here), its dtype and weight quantization, its context length and task, and what its
outputs' logprobs describe. Builds the ModelConfig.

It knows nothing about HTTP: the served names are its because ModelConfig carries the first one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from enginecore.config import LOGPROBS_MODES, POOLING_TYPES, TASKS, ModelConfig
from frontend.gguf_model import is_gguf, prepare_gguf
from frontend.media.limits import parse_limit_mm_per_prompt


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="as --model (vLLM's form)"
    )
    group.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory or a .gguf file (default: SmolLM2-135M-Instruct, "
        "prepared on first use)",
    )
    group.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    group.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4"],
        help="weight-only quantization at load time (int8: per-channel scales; int4: blocks of "
        "32 with a scale and zero point each)",
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (default: the model's, at most 32768)",
    )
    _add_rl_args(group)
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model name(s) clients use; the first is the one responses carry "
        "(default: --model as given)",
    )
    group.add_argument("--seed", type=int, default=0)
    _add_task_args(group)


def _add_rl_args(group: argparse._ArgumentGroup) -> None:
    """What RL trainers ask of the engine: reproducible logits, and the experts each token used."""
    group.add_argument(
        "--batch-invariant",
        "--enable-deterministic-inference",
        action="store_true",
        help="each request's logits and logprobs bitwise the same whatever else is in the batch, "
        "however its prompt is chunked and whether its prefix comes from the cache (float32; "
        "SGLang's --enable-deterministic-inference, vLLM's VLLM_BATCH_INVARIANT=1)",
    )
    group.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="mixture-of-experts models: record the experts each token was routed to in each "
        "layer (routing replay for RL): vLLM's choices[i].routed_experts, SGLang's "
        "return_routed_experts",
    )


def _add_task_args(group: argparse._ArgumentGroup) -> None:
    """What the model serves, and what its sampled tokens' logprobs describe."""
    group.add_argument(
        "--logprobs-mode",
        choices=LOGPROBS_MODES,
        default="raw_logprobs",
        help="what the sampled tokens' logprobs and top logprobs describe: raw_logprobs (default), "
        "log_softmax of the model's logits; processed_logprobs, the distribution each token was "
        "sampled from, after the grammar, allowed_token_ids, logit_bias, min_tokens, penalties, "
        "temperature, top_k, top_p and min_p (masked tokens: -9999.0). At temperature 0, as "
        "vLLM: log_softmax of the logits after the processors, without temperature or top-k/p. "
        "Prompt logprobs are always raw",
    )
    group.add_argument(
        "--task",
        choices=TASKS,
        default="auto",
        help="what the model serves: generate (text), or a pooling task: embed (the pooled final "
        "hidden state; any decoder), classify (a *ForSequenceClassification's logits), reward "
        "(Qwen2ForRewardModel, or a one-label classifier). auto (default): from the "
        "checkpoint's architectures (*ForCausalLM: generate; *ForSequenceClassification: "
        "classify; Qwen2ForRewardModel: reward; bare *Model: embed)",
    )
    group.add_argument(
        "--language-model-only",
        action="store_true",
        help="a checkpoint released with a vision or audio tower: serve its language model alone "
        "(the towers are neither built nor loaded, leaving their memory to the KV cache; image "
        "and audio parts are 400s), as vLLM's flag; also what --limit-mm-per-prompt setting "
        "every modality it names to 0 means",
    )
    group.add_argument(
        "--pooling-type",
        choices=POOLING_TYPES,
        type=str.upper,
        default="LAST",
        help="how a pooling task pools a prompt's final hidden states: LAST token (default, as "
        "Hugging Face's classifiers), MEAN over its tokens, or CLS (its first token)",
    )


def model_config_from_args(args: argparse.Namespace) -> ModelConfig:
    model_path, served_name = _model_source(args)
    return ModelConfig(
        path=str(model_path.resolve()),
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        served_model_name=served_name,
        seed=args.seed,
        logprobs_mode=args.logprobs_mode,
        enable_return_routed_experts=args.enable_return_routed_experts,
        batch_invariant=args.batch_invariant,
        task=args.task,
        pooling_type=args.pooling_type,
        language_model_only=args.language_model_only or _no_media_allowed(args),
    )


def _no_media_allowed(args: argparse.Namespace) -> bool:
    """--limit-mm-per-prompt names modalities, each with a limit of 0 (vLLM: the same as
    --language-model-only). A malformed value is left to the media flags' own check."""
    if getattr(args, "limit_mm_per_prompt", None) is None:
        return False
    try:
        limits = parse_limit_mm_per_prompt(args.limit_mm_per_prompt)
    except ValueError:
        return False
    return bool(limits) and not any(limits.values())


def _model_source(args: argparse.Namespace) -> tuple[Path, str]:
    """(model directory, first served name). Without --model the default model is prepared
    (converted once, then cached); a .gguf file is prepared into a model directory. Sets
    args.model from `tern serve MODEL`."""
    if args.model_tag is not None:  # `tern serve MODEL`
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    if args.model is None:
        from frontend.model_prep import MODEL_NAME, ensure_default_model

        model_path = ensure_default_model()
        served_name = args.served_model_name[0] if args.served_model_name else MODEL_NAME
    else:
        model_path = Path(args.model).expanduser()
        if is_gguf(model_path):
            model_path = prepare_gguf(model_path)
        elif not (model_path / "config.json").is_file():
            raise ValueError(
                f"--model {args.model}: not a model directory (no config.json) or a .gguf file"
            )
        served_name = args.served_model_name[0] if args.served_model_name else args.model
    return model_path, served_name
