"""`tern launch` arguments of the HTTP frontend: served names, API key (flag or TERN_API_KEY), admin
key (flag or TERN_ADMIN_API_KEY) and remote control, CORS origins, body limit, chat template (file
or string)."""

from __future__ import annotations

from pathlib import Path

import pytest

from enginecore.config import Config, ModelConfig
from frontend.cli.launch import make_parser
from frontend.cli.output import load_chat_template
from frontend.cli.server import frontend_config_from_args

CONFIG = Config(model=ModelConfig(path="/m", served_model_name="default-name"))


def parse(*argv: str):
    args = make_parser().parse_args(["launch", *argv])
    return frontend_config_from_args(args, CONFIG)


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TERN_API_KEY", raising=False)
    monkeypatch.delenv("TERN_ADMIN_API_KEY", raising=False)
    fc = parse()
    assert fc.served_model_names == ("default-name",) and fc.model_name == "default-name"
    assert fc.admin_api_key is None and not fc.allow_remote_control
    assert fc.api_key is None and fc.allowed_origins == () and fc.chat_template is None
    assert fc.max_request_body_bytes == 16 * 2**20


def test_several_served_names() -> None:
    fc = parse("--served-model-name", "a", "b")
    assert fc.served_model_names == ("a", "b") and fc.model_name == "a"
    with pytest.raises(ValueError, match="twice"):
        parse("--served-model-name", "a", "a")


def test_api_key_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERN_API_KEY", "from-env")
    assert parse().api_key == "from-env"
    assert parse("--api-key", "from-flag").api_key == "from-flag"
    monkeypatch.setenv("TERN_API_KEY", "")
    assert parse().api_key is None
    with pytest.raises(ValueError, match="api-key"):
        parse("--api-key", "")
    fc = parse("--api-key", "secret")
    assert "secret" not in repr(fc.public_dict()) and fc.public_dict()["api_key_required"]


def test_admin_key_and_remote_control(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TERN_API_KEY", raising=False)
    monkeypatch.setenv("TERN_ADMIN_API_KEY", "admin-env")
    fc = parse("--api-key", "user")
    assert fc.api_key == "user" and fc.admin_api_key == "admin-env"
    fc = parse("--admin-api-key", "admin-flag", "--allow-remote-control")
    assert fc.api_key is None and fc.admin_api_key == "admin-flag" and fc.allow_remote_control
    info = fc.public_dict()
    assert "admin-flag" not in repr(info) and info["admin_api_key_required"]
    assert info["allow_remote_control"] and not info["api_key_required"]
    monkeypatch.setenv("TERN_ADMIN_API_KEY", "")
    assert parse().admin_api_key is None
    with pytest.raises(ValueError, match="admin-api-key"):
        parse("--admin-api-key", "")


def test_allowed_origins_as_json_list_or_plain() -> None:
    assert parse("--allowed-origins", '["http://a", "http://b"]').allowed_origins == (
        "http://a",
        "http://b",
    )
    assert parse("--allowed-origins", "http://a", "*").allowed_origins == ("http://a", "*")
    with pytest.raises(ValueError, match="allowed-origins"):
        parse("--allowed-origins", "[not json")


def test_body_limit_must_be_positive() -> None:
    assert parse("--max-request-body-bytes", "1024").max_request_body_bytes == 1024
    with pytest.raises(ValueError, match="max-request-body-bytes"):
        parse("--max-request-body-bytes", "0")
    assert parse().request_body_timeout_s == 30.0
    assert parse("--request-body-timeout", "2.5").request_body_timeout_s == 2.5
    with pytest.raises(ValueError, match="request-body-timeout"):
        parse("--request-body-timeout", "0")


def test_chat_template_from_file_or_string(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert parse("--chat-template", str(path)).chat_template == template
    assert load_chat_template(template) == template
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="syntax"):
        load_chat_template("{% for m in messages %}")


def test_speculative_config_from_vllm_json_or_sglang_flags(tmp_path: Path) -> None:
    from frontend.cli.speculative import speculative_config_from_args

    def spec(*argv: str):
        return speculative_config_from_args(make_parser().parse_args(["launch", *argv]))

    assert not spec().enabled
    s = spec("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_max": 3}')  # fmt: skip
    assert (s.method, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max) == (
        "ngram", 4, 2, 3,
    )  # fmt: skip
    s = spec("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6",
             "--speculative-ngram-min-match-window-size", "3")  # fmt: skip
    assert (s.method, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max) == (
        "ngram", 6, 3, 5,
    )  # fmt: skip
    s = spec("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
             "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4")  # fmt: skip
    assert (s.method, s.num_speculative_tokens) == ("mtp", 3)
    assert spec("--speculative-algorithm", "EAGLE").method == "mtp"
    (tmp_path / "config.json").write_text("{}")
    s = spec("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(tmp_path))
    assert (s.method, s.model) == ("eagle3", str(tmp_path))
    assert spec("--speculative-config", '{"method": "qwen3_next_mtp"}').method == "mtp"
    with pytest.raises(ValueError, match="tree drafts"):
        spec("--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4")
    s = spec("--speculative-config", '{"method": "suffix", "disable_by_batch_size": 4}')
    assert s.num_speculative_tokens == 24 and s.disable_by_batch_size == 4
    for bad, message in [
        ('{"method": "ngram", "num_speculative_tokens": "x"}', "Expected `int`"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', r"\[1, 64\]"),
        ('{"method": "ngram", "lookahead": 3}', "unknown keys"),
        ('{"method": "medusa"}', "not served"),
        ('{"method": "eagle"}', "not served"),
        ('{"method": "eagle3"}', "draft model or head"),
        ('{"method": "draft_model", "model": "/nonexistent"}', "not a model directory"),
        ('{"method": "draft_model"}', "draft model"),
        ('{"method": "ngram", "prompt_lookup_min": 6, "prompt_lookup_max": 3}', "prompt_lookup"),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ]:
        with pytest.raises(ValueError, match=message):
            spec("--speculative-config", bad)
    with pytest.raises(ValueError, match="not both"):
        spec("--speculative-config", '{"method": "ngram"}', "--speculative-algorithm", "NGRAM")


def test_batch_invariant_flag() -> None:
    args = make_parser().parse_args(["launch", "--enable-deterministic-inference"])
    assert args.batch_invariant
    with pytest.raises(ValueError, match="float32"):
        ModelConfig(path="x", dtype="bfloat16", batch_invariant=True)


@pytest.mark.parametrize(
    ("argv", "language_model_only"),
    [
        ([], False),
        (["--language-model-only"], True),
        (["--limit-mm-per-prompt", '{"image": 0}'], True),
        (["--limit-mm-per-prompt", '{"image": 0, "audio": 0}'], True),
        (["--limit-mm-per-prompt", '{"image": 0, "audio": 1}'], False),
        (["--limit-mm-per-prompt", '{"image": 2}'], False),
    ],
)
def test_language_model_only_from_its_flag_or_all_zero_limits(
    tmp_path: Path, argv: list[str], language_model_only: bool
) -> None:
    """vLLM's --language-model-only, or --limit-mm-per-prompt with every named modality at 0."""
    from frontend.cli.model import model_config_from_args

    (tmp_path / "config.json").write_text("{}")
    args = make_parser().parse_args(["launch", "--model", str(tmp_path), *argv])
    assert model_config_from_args(args).language_model_only is language_model_only
