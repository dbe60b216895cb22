"""Command-line arguments of `tern launch`, and the configuration they build: the one Config that
every process gets, plus the FrontendConfig (HTTP-only settings: names, access, limits, template).

Names follow `vllm serve` where the two overlap, so that scripts carry over. TERN_API_KEY and
TERN_ADMIN_API_KEY are read here, once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import jinja2
import msgspec

from enginecore.config import (
    LOGPROBS_MODES,
    POOLING_TYPES,
    TASKS,
    CacheConfig,
    Config,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
    StructuredOutputConfig,
)
from frontend.common.http_protocol import DEFAULT_KEEP_ALIVE_S
from frontend.gguf_model import is_gguf, prepare_gguf
from frontend.text.chat_options import ChatOptions
from frontend.text.reasoning_parsers import REASONING_PARSERS
from frontend.text.tool_parsers import TOOL_PARSERS

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0
DEFAULT_KV_CACHE_GIB = 1.0
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class _VllmBoolean(argparse.Action):
    """--enable-X sets True, --no-enable-X sets False (vLLM's pairs of boolean flags)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)  # type: ignore[arg-type]

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, not (option_string or "").startswith("--no-"))


@dataclass(frozen=True)
class FrontendConfig:
    """Settings only the HTTP frontend uses (the engine core and workers never see them)."""

    served_model_names: tuple[str, ...]
    api_key: str | None = None
    admin_api_key: str | None = None  # when set, the control routes need it (and only they)
    allow_remote_control: bool = False  # control routes for non-loopback clients without a key
    allowed_origins: tuple[str, ...] = ()
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S  # whole body, else 408
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_S  # an idle connection's lifetime
    chat_template: str | None = None  # the template's text
    chat_options: ChatOptions = ChatOptions()
    generation_config: str = "auto"  # auto | vllm | a folder with generation_config.json
    uvicorn_log_level: str = "warning"
    max_stored_responses: int = 1000  # /v1/responses kept for GET and previous_response_id

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("--served-model-name needs at least one non-empty name")
        if len(set(self.served_model_names)) != len(self.served_model_names):
            raise ValueError("--served-model-name lists a name twice")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        if self.admin_api_key is not None and not self.admin_api_key:
            raise ValueError("--admin-api-key must not be empty")
        options = self.chat_options
        if options.enable_auto_tool_choice and options.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.max_stored_responses < 0:
            raise ValueError("--max-stored-responses must not be negative")
        if self.max_request_body_bytes < 1:
            raise ValueError("--max-request-body-bytes must be positive")
        if not self.request_body_timeout_s > 0:
            raise ValueError("--request-body-timeout must be positive")
        if not self.keep_alive_timeout_s > 0:
            raise ValueError("--timeout-keep-alive must be positive")
        gen = self.generation_config
        if gen not in ("auto", "vllm") and not (Path(gen) / "generation_config.json").is_file():
            raise ValueError(
                f"--generation-config {gen}: use 'auto', 'vllm' or a folder holding "
                "generation_config.json"
            )

    @property
    def model_name(self) -> str:
        """The name responses carry (vLLM: the first served name)."""
        return self.served_model_names[0]

    def public_dict(self) -> dict[str, object]:
        """For /server_info: everything but the keys' values."""
        return {
            "served_model_names": list(self.served_model_names),
            "api_key_required": self.api_key is not None,
            "admin_api_key_required": self.admin_api_key is not None,
            "allow_remote_control": self.allow_remote_control,
            "allowed_origins": list(self.allowed_origins),
            "max_request_body_bytes": self.max_request_body_bytes,
            "request_body_timeout_s": self.request_body_timeout_s,
            "keep_alive_timeout_s": self.keep_alive_timeout_s,
            "chat_template": self.chat_template,
            "generation_config": self.generation_config,
        }


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tern", description="tern: an OpenAI-compatible LLM inference server"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # `tern serve MODEL` is vLLM's spelling of `tern launch --model MODEL`.
    launch = sub.add_parser(
        "launch", aliases=["serve"], help="serve a model over HTTP (OpenAI-compatible API)"
    )
    launch.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="as --model (vLLM's form)"
    )
    launch.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory or a .gguf file (default: SmolLM2-135M-Instruct, "
        "prepared on first use)",
    )
    launch.add_argument("--host", default="127.0.0.1")
    launch.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    launch.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    launch.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4"],
        help="weight-only quantization at load time (int8: per-channel scales; int4: blocks of "
        "32 with a scale and zero point each)",
    )
    launch.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (default: the model's, at most 32768)",
    )
    launch.add_argument("--max-num-seqs", type=int, default=64)
    launch.add_argument("--max-num-batched-tokens", type=int, default=2048)
    launch.add_argument("--block-size", type=int, default=16)
    launch.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        metavar="GiB",
        help=f"memory for the KV cache, in GiB (default: {DEFAULT_KV_CACHE_GIB})",
    )
    launch.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the activations' dtype) or int8: each token's keys and values per head as "
        "int8 with a float32 scale per 16 values, 62%% of bfloat16's bytes (vLLM's flag; "
        "LMDeploy's --quant-policy 8)",
    )
    launch.add_argument(
        "--quant-policy",
        type=int,
        choices=[0, 8],
        default=None,
        help="LMDeploy's spelling: 8 is --kv-cache-dtype int8, 0 auto",
    )
    launch.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="FRACTION",
        help="vLLM's spelling: the KV cache takes this fraction of the memory free at start-up "
        "(of each GPU; on CPU, of the available system memory, shared by the local workers); "
        "instead of --kv-cache-memory",
    )
    launch.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="disable automatic prefix caching",
    )
    launch.add_argument(
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action=_VllmBoolean,
        default=True,
        help="vLLM's spelling of the prefix-caching switch (on by default)",
    )
    launch.add_argument(
        "--batch-invariant",
        "--enable-deterministic-inference",
        action="store_true",
        help="each request's logits and logprobs bitwise the same whatever else is in the batch, "
        "however its prompt is chunked and whether its prefix comes from the cache (float32; "
        "SGLang's --enable-deterministic-inference, vLLM's VLLM_BATCH_INVARIANT=1)",
    )
    launch.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="mixture-of-experts models: record the experts each token was routed to in each "
        "layer (routing replay for RL): vLLM's choices[i].routed_experts, SGLang's "
        "return_routed_experts",
    )
    launch.add_argument(
        "--state-checkpoint-interval",
        type=int,
        default=None,
        metavar="TOKENS",
        help="hybrid models (Qwen3.5): keep linear-attention states for the prefix cache every "
        "this many tokens, a multiple of --block-size (default: where one checkpoint costs the "
        "KV cache of the tokens since the last); prompts also keep one at their last block",
    )
    launch.add_argument(
        "--generation-config",
        default="auto",
        help="default sampling parameters: 'auto' (the model's generation_config.json), 'vllm' "
        "(none: the API's defaults), or a folder holding a generation_config.json",
    )
    launch.add_argument(
        "--uvicorn-log-level",
        choices=UVICORN_LOG_LEVELS,
        default="warning",
        help="uvicorn's log level (info and below also log each request)",
    )
    launch.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model name(s) clients use; the first is the one responses carry "
        "(default: --model as given)",
    )
    launch.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on every route but /health, /metrics, "
        "/version and /ping (default: $TERN_API_KEY)",
    )
    launch.add_argument(
        "--admin-api-key",
        default=None,
        help="the key the control routes (weight updates, sleep/wake, pause/resume, "
        "reset_prefix_cache) need instead of --api-key (default: $TERN_ADMIN_API_KEY)",
    )
    launch.add_argument(
        "--allow-remote-control",
        action="store_true",
        help="serve the control routes to clients on other hosts when no key guards them "
        "(default: loopback clients only)",
    )
    launch.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        help="origins allowed by CORS: a JSON list as for vllm serve, or plain origins; '*' for "
        "any (default: no CORS headers, so browsers deny other origins)",
    )
    launch.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 (default: 16 MiB)",
    )
    launch.add_argument(
        "--request-body-timeout",
        type=float,
        default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
        help="seconds a client has to send a whole request body, else 408: slow clients cannot "
        "hold connections (default: 30; weight pushes to /update_weights* are exempt)",
    )
    launch.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=DEFAULT_KEEP_ALIVE_S,
        help="seconds an idle HTTP connection stays open (default: 120, longer than the "
        "connection pools of aiohttp, vllm bench, Go and reqwest clients, so they close first)",
    )
    launch.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file, or the template itself, replacing the model's",
    )
    launch.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs '
        "--tool-call-parser",
    )
    launch.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSERS,
        default=None,
        help="how tool calls are written in the model's output",
    )
    launch.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split <think>...</think> off into message.reasoning_content",
    )
    launch.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        help="Responses API answers kept in memory (store: true) for GET /v1/responses/{id} and "
        "previous_response_id; the least recently used are forgotten beyond it (0: none)",
    )
    launch.add_argument(
        "--no-json-number-bound",
        dest="json_number_bound",
        action="store_false",
        help="let JSON numbers in structured output have any number of digits (by default at "
        "most 17 significant digits and a 3-digit exponent, so a weak model cannot loop in one)",
    )
    launch.add_argument("--seed", type=int, default=0)
    launch.add_argument(
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
    launch.add_argument(
        "--task",
        choices=TASKS,
        default="auto",
        help="what the model serves: generate (text), or a pooling task: embed (the pooled final "
        "hidden state; any decoder), classify (a *ForSequenceClassification's logits), reward "
        "(Qwen2ForRewardModel, or a one-label classifier). auto (default): from the "
        "checkpoint's architectures (*ForCausalLM: generate; *ForSequenceClassification: "
        "classify; Qwen2ForRewardModel: reward; bare *Model: embed)",
    )
    launch.add_argument(
        "--pooling-type",
        choices=POOLING_TYPES,
        type=str.upper,
        default="LAST",
        help="how a pooling task pools a prompt's final hidden states: LAST token (default, as "
        "Hugging Face's classifiers), MEAN over its tokens, or CLS (its first token)",
    )
    lora = launch.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (PEFT's format) beside the base model",
    )
    lora.add_argument(
        "--lora-modules",
        "--lora-paths",
        "--adapters",
        nargs="+",
        default=[],
        metavar="ADAPTER",
        help="adapters served from start-up: name=path, vLLM's JSON "
        '\'{"name": ..., "path": ...}\', or a path (named after its directory); SGLang\'s '
        "--lora-paths and LMDeploy's --adapters are the same flag (and enable LoRA)",
    )
    lora.add_argument(
        "--max-loras", type=int, default=4, help="distinct adapters in one batch (default 4)"
    )
    lora.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        help="the largest adapter rank served (default 16; at most 256)",
    )
    lora.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept loaded (least recently used evicted beyond; default --max-loras)",
    )
    spec = launch.add_argument_group("speculative decoding")
    spec.add_argument(
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
    spec.add_argument(
        "--speculative-algorithm",
        default=None,
        help="SGLang's: NGRAM (= method ngram), STANDALONE (= draft_model, with "
        "--speculative-draft-model-path), SUFFIX, EAGLE3 (= eagle3, the head's path as "
        "--speculative-draft-model-path), or NEXTN / EAGLE without a draft model path (= mtp); "
        "with the flags below",
    )
    spec.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    spec.add_argument(
        "--speculative-num-steps",
        type=int,
        default=None,
        help="SGLang's draft steps (NEXTN / EAGLE): the drafts a sequence verifies at most",
    )
    spec.add_argument("--speculative-eagle-topk", type=int, default=None, help="1 only")
    spec.add_argument("--speculative-draft-model-path", default=None)
    spec.add_argument("--speculative-ngram-min-match-window-size", type=int, default=None)
    spec.add_argument("--speculative-ngram-max-match-window-size", type=int, default=None)
    parallel = launch.add_argument_group("parallelism")
    parallel.add_argument("--tensor-parallel-size", "--tp", "-tp", type=int, default=1, dest="tp")
    parallel.add_argument("--pipeline-parallel-size", "--pp", "-pp", type=int, default=1, dest="pp")
    parallel.add_argument(
        "--enable-expert-parallel",
        "-ep",
        action="store_true",
        help="mixture-of-experts models: each tensor-parallel rank holds num_experts / tp whole "
        "experts (vLLM's flag), instead of a share of every expert's features",
    )
    parallel.add_argument(
        "--data-parallel-size",
        "--dp",
        "-dp",
        type=int,
        default=1,
        dest="dp",
        help="engine replicas, each with its own tp x pp workers, behind this one frontend",
    )
    parallel.add_argument(
        "--distributed-backend",
        choices=["gloo", "nccl"],
        default=None,
        help="torch.distributed backend (default: nccl on GPU, gloo on CPU)",
    )
    parallel.add_argument(
        "--distributed-timeout",
        type=float,
        default=None,
        help="seconds after which a stuck collective fails (default: 60, or TERN_DIST_TIMEOUT)",
    )
    parallel.add_argument("--nnodes", type=int, default=1)
    parallel.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this host's index; nodes other than 0 only run their workers",
    )
    parallel.add_argument(
        "--dist-init-addr", default=None, help="host:port of node 0 (needed with --nnodes > 1)"
    )
    launch.add_argument("--num-gpu-blocks-override", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    """Builds the Config; raises ValueError (with a message for the user) on bad arguments.

    Without --model the default model is prepared (converted once, then cached).
    """
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], not {args.port}")
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
    if args.num_gpu_blocks_override is not None and args.num_gpu_blocks_override < 1:
        raise ValueError("--num-gpu-blocks-override must be positive")
    parallel = parallel_config_from_args(args)
    return Config(
        model=ModelConfig(
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
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_gib=kv_cache_gib_from_args(args, parallel),
            enable_prefix_caching=args.enable_prefix_caching,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            state_checkpoint_interval=args.state_checkpoint_interval,
            kv_cache_dtype=_kv_cache_dtype(args),
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        ),
        parallel=parallel,
        server=ServerConfig(host=args.host, port=args.port),
        structured_output=StructuredOutputConfig(bound_json_numbers=args.json_number_bound),
        lora=lora_config_from_args(args),
        speculative=speculative_config_from_args(args),
    )


_SPEC_KEYS = {f.name for f in dataclasses.fields(SpeculativeConfig)}


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig:
    """--speculative-config (vLLM's JSON), or SGLang's --speculative-* flags."""
    if args.speculative_config is not None and args.speculative_algorithm is not None:
        raise ValueError("give --speculative-config or --speculative-algorithm, not both")
    if args.speculative_config is not None:
        try:
            spec = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError("--speculative-config must be a JSON object")
    elif args.speculative_algorithm is not None:
        algorithm = args.speculative_algorithm.lower()
        if algorithm == "nextn" or (
            algorithm == "eagle" and args.speculative_draft_model_path is None
        ):  # SGLang drafts with the checkpoint's own MTP layers
            algorithm = "mtp"
        if (args.speculative_eagle_topk or 1) != 1:
            raise ValueError("--speculative-eagle-topk above 1 (tree drafts) is not served")
        steps = args.speculative_num_steps
        spec = {"method": "draft_model" if algorithm == "standalone" else algorithm}
        sglang = {
            "model": args.speculative_draft_model_path,
            "num_speculative_tokens": args.speculative_num_draft_tokens if steps is None else steps,
            "prompt_lookup_min": args.speculative_ngram_min_match_window_size,
            "prompt_lookup_max": args.speculative_ngram_max_match_window_size,
        }
        spec.update({k: v for k, v in sglang.items() if v is not None})
    else:
        return SpeculativeConfig()
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


def lora_config_from_args(args: argparse.Namespace) -> LoraConfig:
    modules = tuple(_lora_module(spec) for spec in args.lora_modules)
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {names}")
    return LoraConfig(
        enabled=args.enable_lora or bool(modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        modules=modules,
    )


def _lora_module(spec: str) -> tuple[str, str]:
    """(name, absolute path) of one --lora-modules entry: name=path, vLLM's JSON object, or a
    path (named after its directory)."""
    if spec.lstrip().startswith("{"):
        try:
            entry = json.loads(spec)
            name, path = str(entry["name"]), str(entry["path"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f'--lora-modules {spec!r}: JSON entries are {{"name": ..., "path": ...}}'
            ) from None
    else:
        name, sep, path = spec.partition("=")
        if not sep:
            path, name = spec, Path(spec.rstrip("/")).name
    if not name or not path:
        raise ValueError(f"--lora-modules {spec!r}: give name=path")
    return name, str(Path(path).resolve())


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    timeout = (
        {}
        if args.distributed_timeout is None
        else {"distributed_timeout_s": args.distributed_timeout}
    )
    return ParallelConfig(
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        enable_expert_parallel=args.enable_expert_parallel,
        data_parallel_size=args.dp,
        distributed_backend=args.distributed_backend,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        **timeout,
    )


def _kv_cache_dtype(args: argparse.Namespace) -> str:
    """--kv-cache-dtype, or LMDeploy's --quant-policy (8: int8)."""
    if args.quant_policy is None:
        return args.kv_cache_dtype
    policy = "int8" if args.quant_policy == 8 else "auto"
    if args.kv_cache_dtype not in ("auto", policy):
        raise ValueError("--quant-policy and --kv-cache-dtype disagree")
    return policy


def kv_cache_gib_from_args(args: argparse.Namespace, parallel: ParallelConfig) -> float:
    """--kv-cache-memory, or --gpu-memory-utilization's fraction of the memory free now: of the
    first GPU's (each rank has its own device), or of the available system memory on CPU, where
    this node's workers share it (each gets its part)."""
    fraction = args.gpu_memory_utilization
    if fraction is None:
        return DEFAULT_KV_CACHE_GIB if args.kv_cache_memory is None else args.kv_cache_memory
    if args.kv_cache_memory is not None:
        raise ValueError("give --kv-cache-memory or --gpu-memory-utilization, not both")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], not {fraction}")
    free_bytes, sharers = _free_memory(parallel.num_local_workers)
    return fraction * free_bytes / sharers / 2**30


def _free_memory(ranks_per_node: int) -> tuple[int, int]:
    """(bytes free for the KV caches, how many workers share them)."""
    import torch  # noqa: PLC0415 - torch is slow to import and only needed here

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(0)
        return free, 1
    import psutil  # noqa: PLC0415

    return psutil.virtual_memory().available, ranks_per_node


def frontend_config_from_args(args: argparse.Namespace, config: Config) -> FrontendConfig:
    """The frontend's settings; raises ValueError with a message for the user."""
    names = tuple(args.served_model_name or [config.model.served_model_name])
    return FrontendConfig(
        served_model_names=names,
        api_key=_flag_or_env(args.api_key, "TERN_API_KEY"),
        admin_api_key=_flag_or_env(args.admin_api_key, "TERN_ADMIN_API_KEY"),
        allow_remote_control=args.allow_remote_control,
        allowed_origins=parse_origins(args.allowed_origins or []),
        max_request_body_bytes=args.max_request_body_bytes,
        request_body_timeout_s=args.request_body_timeout,
        keep_alive_timeout_s=args.timeout_keep_alive,
        chat_template=load_chat_template(args.chat_template),
        chat_options=ChatOptions(
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
        ),
        generation_config=args.generation_config,
        uvicorn_log_level=args.uvicorn_log_level,
        max_stored_responses=args.max_stored_responses,
    )


def _flag_or_env(value: str | None, env: str) -> str | None:
    """The flag's value, else the environment variable's when set and not empty."""
    return value if value is not None else os.environ.get(env) or None


def parse_origins(values: list[str]) -> tuple[str, ...]:
    """`--allowed-origins '["a", "b"]'` (vLLM's JSON form) or `--allowed-origins a b`."""
    origins: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--allowed-origins: bad JSON list {value!r}: {e}") from None
            if not isinstance(parsed, list) or not all(isinstance(o, str) for o in parsed):
                raise ValueError(f"--allowed-origins: expected a JSON list of strings: {value!r}")
            origins += parsed
        else:
            origins.append(value)
    return tuple(origins)


def load_chat_template(value: str | None) -> str | None:
    """A template file's text, or the argument itself when it is a template; checked for syntax."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        template = path.read_text()
    elif any(c in value for c in "{}\n"):
        template = value
    else:
        raise ValueError(f"--chat-template {value}: no such file, and not a Jinja template")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: template syntax error (line {e.lineno}): {e}") from None
    return template
