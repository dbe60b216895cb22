"""`tern launch` flags of the HTTP server: its address, who may call it (API keys, remote control,
CORS), its limits on bodies and connections, the Responses API's store and uvicorn's log level.
Builds the ServerConfig (the address, which every process gets) and the FrontendConfig (HTTP-only
settings: names, access, limits, template, media policy). TERN_API_KEY and TERN_ADMIN_API_KEY are
read here, once.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from enginecore.config import Config, ServerConfig
from frontend.cli.media import media_policy_from_args
from frontend.cli.output import chat_options_from_args, load_chat_template
from frontend.common.http_protocol import DEFAULT_KEEP_ALIVE_S
from frontend.media.policy import MediaPolicy
from frontend.text.chat_options import ChatOptions

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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
    media: MediaPolicy = field(default_factory=MediaPolicy)  # where request images may come from
    proxy_url: str | None = None  # an LMDeploy proxy to register with (as a Hybrid node)

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


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    group.add_argument(
        "--uvicorn-log-level",
        choices=UVICORN_LOG_LEVELS,
        default="warning",
        help="uvicorn's log level (info and below also log each request)",
    )
    group.add_argument(
        "--proxy-url",
        help="LMDeploy proxy (`lmdeploy serve proxy`) to register this server with once it serves, "
        "as LMDeploy's api_server --proxy-url does (a Hybrid node); removed again at shutdown",
    )
    _add_access_args(group)
    _add_limit_args(group)


def _add_access_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on every route but /health, /metrics, "
        "/version and /ping (default: $TERN_API_KEY)",
    )
    group.add_argument(
        "--admin-api-key",
        default=None,
        help="the key the control routes (weight updates, sleep/wake, pause/resume, "
        "reset_prefix_cache) need instead of --api-key (default: $TERN_ADMIN_API_KEY)",
    )
    group.add_argument(
        "--allow-remote-control",
        action="store_true",
        help="serve the control routes to clients on other hosts when no key guards them "
        "(default: loopback clients only)",
    )
    group.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        help="origins allowed by CORS: a JSON list as for vllm serve, or plain origins; '*' for "
        "any (default: no CORS headers, so browsers deny other origins)",
    )


def _add_limit_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 (default: 16 MiB)",
    )
    group.add_argument(
        "--request-body-timeout",
        type=float,
        default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
        help="seconds a client has to send a whole request body, else 408: slow clients cannot "
        "hold connections (default: 30; weight pushes to /update_weights* are exempt)",
    )
    group.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=DEFAULT_KEEP_ALIVE_S,
        help="seconds an idle HTTP connection stays open (default: 120, longer than the "
        "connection pools of aiohttp, vllm bench, Go and reqwest clients, so they close first)",
    )
    group.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        help="Responses API answers kept in memory (store: true) for GET /v1/responses/{id} and "
        "previous_response_id; the least recently used are forgotten beyond it (0: none)",
    )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], not {args.port}")
    return ServerConfig(host=args.host, port=args.port)


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
        chat_options=chat_options_from_args(args),
        generation_config=args.generation_config,
        uvicorn_log_level=args.uvicorn_log_level,
        max_stored_responses=args.max_stored_responses,
        media=media_policy_from_args(args),
        proxy_url=_proxy_url(args.proxy_url),
    )


def _proxy_url(value: str | None) -> str | None:
    if value is None:
        return None
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"--proxy-url must be an http(s) URL, not {value!r}")
    return value.rstrip("/")


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
