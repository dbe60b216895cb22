"""Prefill/decode disaggregation's flags: vLLM's --kv-transfer-config JSON and SGLang's
--disaggregation-* give the same KVTransferConfig; bad keys, values and mixes are clear errors."""

from __future__ import annotations

import json

import pytest

from enginecore.config import KVTransferConfig
from frontend.cli.disaggregation import kv_transfer_config_from_args
from frontend.cli.launch import make_parser


def kv_config(*argv: str) -> KVTransferConfig:
    return kv_transfer_config_from_args(make_parser().parse_args(["launch", *argv]))


def vllm(config: dict, *argv: str) -> KVTransferConfig:
    return kv_config("--kv-transfer-config", json.dumps(config), *argv)


def test_off_by_default() -> None:
    kv = kv_config()
    assert not kv.enabled and not kv.produces and not kv.consumes


def test_vllm_form() -> None:
    kv = vllm({"kv_connector": "TernConnector", "kv_role": "kv_producer"})
    assert kv.enabled and kv.produces and not kv.consumes
    assert (kv.bootstrap_host, kv.bootstrap_port) == ("127.0.0.1", 8998)
    assert kv.load_failure_policy == "fail" and kv.lease_s == 480.0
    kv = vllm(
        {
            "kv_connector": "TernConnector",
            "kv_role": "kv_consumer",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "bootstrap_host": "10.0.0.5",
                "bootstrap_port": 9100,
                "kv_lease_duration": 60,
                "wait_s": 30,
                "reply_timeout_s": 2,
            },
        }
    )
    assert kv.consumes and not kv.produces and kv.load_failure_policy == "recompute"
    assert (kv.bootstrap_host, kv.bootstrap_port) == ("10.0.0.5", 9100)
    assert (kv.lease_s, kv.wait_s, kv.reply_timeout_s) == (60, 30, 2)
    assert vllm({"kv_connector": "TernConnector"}).role == "kv_both"


@pytest.mark.parametrize(
    "host, expected", [("0.0.0.0", "127.0.0.1"), ("", "127.0.0.1"), ("10.1.2.3", "10.1.2.3")]
)
def test_bootstrap_host_follows_host(host: str, expected: str) -> None:
    kv = vllm({"kv_connector": "TernConnector", "kv_role": "kv_producer"}, "--host", host)
    assert kv.bootstrap_host == expected
    assert kv_config("--disaggregation-mode", "prefill", "--host", host).bootstrap_host == expected


@pytest.mark.parametrize(
    "config, match",
    [
        ({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, "not served"),
        ({"kv_role": "kv_producer"}, "needs kv_connector"),
        ({"kv_connector": "TernConnector", "kv_role": "producer"}, "kv_role"),
        ({"kv_connector": "TernConnector", "kv_buffer_size": 1}, "unknown key.*kv_buffer_size"),
        (
            {"kv_connector": "TernConnector", "kv_connector_extra_config": {"backend": "x"}},
            "unknown key.*backend",
        ),
        (
            {
                "kv_connector": "TernConnector",
                "kv_connector_extra_config": {"lease_s": 1, "kv_lease_duration": 2},
            },
            "twice",
        ),
        ({"kv_connector": "TernConnector", "kv_load_failure_policy": "retry"}, "failure_policy"),
        (
            {"kv_connector": "TernConnector", "kv_connector_extra_config": {"bootstrap_port": 0}},
            "port",
        ),
    ],
)
def test_vllm_form_errors(config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        vllm(config)


def test_vllm_form_bad_json() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        kv_config("--kv-transfer-config", "{kv_connector")
    with pytest.raises(ValueError, match="JSON object"):
        kv_config("--kv-transfer-config", "[]")


def test_sglang_form() -> None:
    kv = kv_config("--disaggregation-mode", "prefill")
    assert kv.connector == "TernConnector" and kv.role == "kv_producer"
    assert kv.bootstrap_port == 8998
    kv = kv_config(
        "--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", "9000",
        "--disaggregation-transfer-backend", "tern",
    )  # fmt: skip
    assert kv.role == "kv_consumer" and kv.bootstrap_port == 9000
    assert not kv_config("--disaggregation-mode", "null").enabled


def test_both_forms_agree() -> None:
    a = kv_config("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9001")
    b = vllm(
        {
            "kv_connector": "TernConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"bootstrap_port": 9001},
        }
    )
    assert a == b


def test_sglang_form_errors() -> None:
    with pytest.raises(ValueError, match="own ZMQ transport"):
        kv_config(
            "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake"
        )
    with pytest.raises(ValueError, match="need --disaggregation-mode"):
        kv_config("--disaggregation-bootstrap-port", "9000")
    with pytest.raises(ValueError, match="use one"):
        kv_config(
            "--disaggregation-mode", "prefill",
            "--kv-transfer-config", '{"kv_connector": "TernConnector"}',
        )  # fmt: skip
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        kv_config("--disaggregation-mode", "both")
