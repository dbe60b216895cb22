"""`tern launch` flags of prefill/decode disaggregation, in both peers' spellings: vLLM's
`--kv-transfer-config JSON` and SGLang's `--disaggregation-mode prefill|decode` (with
`--disaggregation-bootstrap-port` and `--disaggregation-transfer-backend`). Either builds the same
KVTransferConfig (enginecore/config.py); giving both is an error. This module knows nothing about
how blocks move (enginecore/kv_transfer/) nor about requests (frontend/disagg/).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from enginecore.config import KVTransferConfig

# SGLang's --disaggregation-mode -> vLLM's kv_role.
SGLANG_MODES = {"null": None, "prefill": "kv_producer", "decode": "kv_consumer"}
SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998
# tern moves blocks over its own transport; SGLang's backends name other transfer engines.
TRANSFER_BACKENDS = ("tern",)

_TOP_KEYS = {"kv_connector", "kv_role", "kv_load_failure_policy", "kv_connector_extra_config"}
# kv_connector_extra_config's keys -> KVTransferConfig's fields (vLLM-ish aliases beside them).
_EXTRA_KEYS = {
    "bootstrap_host": "bootstrap_host",
    "bootstrap_port": "bootstrap_port",
    "lease_s": "lease_s",
    "kv_lease_duration": "lease_s",
    "wait_s": "wait_s",
    "reply_timeout_s": "reply_timeout_s",
}
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefill/decode disaggregation")
    group.add_argument(
        "--kv-transfer-config",
        default=None,
        help='vLLM\'s JSON: {"kv_connector": "TernConnector", "kv_role": "kv_producer" | '
        '"kv_consumer" | "kv_both", "kv_load_failure_policy": "fail" | "recompute", '
        '"kv_connector_extra_config": {"bootstrap_host", "bootstrap_port", "lease_s", "wait_s", '
        '"reply_timeout_s"}}',
    )
    group.add_argument(
        "--disaggregation-mode",
        choices=list(SGLANG_MODES),
        default="null",
        help="SGLang's spelling: prefill (a KV producer) or decode (a KV consumer)",
    )
    group.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=None,
        help=f"a prefill server's bootstrap port (default: {SGLANG_DEFAULT_BOOTSTRAP_PORT})",
    )
    group.add_argument(
        "--disaggregation-transfer-backend",
        default=None,
        help="SGLang's KV transfer engine; tern accepts only 'tern' (its own ZMQ transport)",
    )


def kv_transfer_config_from_args(args: argparse.Namespace) -> KVTransferConfig:
    """The KVTransferConfig of either spelling; raises ValueError with a message for the user."""
    default_host = _bootstrap_host_of(args.host)
    sglang_set = (
        args.disaggregation_mode != "null"
        or args.disaggregation_bootstrap_port is not None
        or args.disaggregation_transfer_backend is not None
    )
    if args.kv_transfer_config is not None:
        if sglang_set:
            raise ValueError(
                "--kv-transfer-config and --disaggregation-* both configure prefill/decode "
                "disaggregation: use one"
            )
        return parse_kv_transfer_config(args.kv_transfer_config, default_host)
    return _from_sglang_args(args, default_host)


def parse_kv_transfer_config(text: str, default_host: str = "127.0.0.1") -> KVTransferConfig:
    """vLLM's --kv-transfer-config JSON (keys beyond tern's are errors, never ignored)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-transfer-config is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    _check_keys(raw, _TOP_KEYS, "--kv-transfer-config")
    extra = raw.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("--kv-transfer-config: kv_connector_extra_config must be an object")
    _check_keys(extra, set(_EXTRA_KEYS), "--kv-transfer-config's kv_connector_extra_config")
    fields: dict[str, Any] = {"bootstrap_host": default_host}
    for key, value in extra.items():
        field = _EXTRA_KEYS[key]
        if field in fields and field != "bootstrap_host":
            raise ValueError(f"--kv-transfer-config: {field} is given twice (alias {key!r})")
        fields[field] = value
    connector = raw.get("kv_connector")
    if connector is None:
        raise ValueError("--kv-transfer-config needs kv_connector (tern serves TernConnector)")
    return _config(
        connector=connector,
        role=raw.get("kv_role", "kv_both"),
        load_failure_policy=raw.get("kv_load_failure_policy", "fail"),
        **fields,
    )


def _from_sglang_args(args: argparse.Namespace, default_host: str) -> KVTransferConfig:
    backend = args.disaggregation_transfer_backend
    if backend is not None and backend not in TRANSFER_BACKENDS:
        raise ValueError(
            f"--disaggregation-transfer-backend {backend!r} is not served: tern moves KV blocks "
            "over its own ZMQ transport (shared memory on one host); use 'tern' or leave it out"
        )
    role = SGLANG_MODES[args.disaggregation_mode]
    if role is None:
        if args.disaggregation_bootstrap_port is not None or backend is not None:
            raise ValueError(
                "--disaggregation-bootstrap-port and --disaggregation-transfer-backend need "
                "--disaggregation-mode prefill or decode"
            )
        return KVTransferConfig()
    port = args.disaggregation_bootstrap_port
    return _config(
        connector="TernConnector",
        role=role,
        bootstrap_host=default_host,
        bootstrap_port=SGLANG_DEFAULT_BOOTSTRAP_PORT if port is None else port,
    )


def _config(**fields: Any) -> KVTransferConfig:
    try:
        return KVTransferConfig(**fields)
    except TypeError as e:  # a value of the wrong type reaching a comparison
        raise ValueError(f"--kv-transfer-config: {e}") from None


def _check_keys(raw: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(unknown)}; tern reads {', '.join(sorted(known))}"
        )


def _bootstrap_host_of(host: str | None) -> str:
    """Where consumers reach this server's bootstrap: --host, unless it binds every address."""
    return "127.0.0.1" if host is None or host in _WILDCARD_HOSTS else host
