"""`helexa acp`'s endpoints: a TOML file or the environment, every problem named at once,
and the model picker's ids (bare with one endpoint, `endpoint:model` with several)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helexa.acp.config import AcpConfigError, load_config, model_selector, parse_selector

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "acp.toml"
    path.write_text(text)
    return path


def test_the_example_file_loads_with_its_key_in_the_environment():
    config = load_config(REPO / "helexa-acp.example.toml", env={"HELEXA_API_KEY": "sk-1"})
    assert len(config.endpoints) >= 2
    home = config.endpoints[0]
    assert home.wire_api == "openai-chat" and home.api_key == "sk-1"
    assert {e.wire_api for e in config.endpoints} <= {
        "openai-chat",
        "openai-responses",
        "anthropic-messages",
    }


def test_endpoints_from_toml(tmp_path):
    path = _write(
        tmp_path,
        """
[[endpoints]]
name = "home"
base_url = "http://gpu:8080/v1/"
api_key_env = "MY_KEY"
context_window = 32768
max_tokens = 4096
default_model = "qwen3-coder"

[[endpoints]]
name = "claude"
base_url = "https://api.anthropic.com/v1"
wire_api = "anthropic-messages"
api_key = "sk-ant"
""",
    )
    config = load_config(path, env={"MY_KEY": "secret"})
    home, claude = config.endpoints
    assert (home.base_url, home.api_key, home.context_window, home.max_tokens) == (
        "http://gpu:8080/v1",
        "secret",
        32768,
        4096,
    )
    assert home.wire_api == "openai-chat" and home.default_model == "qwen3-coder"
    assert (claude.wire_api, claude.api_key, claude.context_window) == (
        "anthropic-messages",
        "sk-ant",
        None,
    )


def test_every_problem_is_named_at_once(tmp_path):
    path = _write(
        tmp_path,
        """
[[endpoints]]
name = "a:b"
base_url = "ftp://x"
wire_api = "grpc"
api_key = "k"
api_key_env = "K"
context_window = 0
colour = "blue"

[[endpoints]]
name = "same"
base_url = "http://x/v1"

[[endpoints]]
name = "same"
base_url = "http://y/v1"
api_key_env = "UNSET_KEY"
""",
    )
    with pytest.raises(AcpConfigError) as e:
        load_config(path, env={})
    text = "\n".join(e.value.problems)
    for expected in (
        "endpoints[0].name",
        "endpoints[0].base_url: expected an http(s) URL",
        "endpoints[0].wire_api: expected one of",
        "set api_key or api_key_env, not both",
        "endpoints[0].context_window: expected a positive whole number",
        "unknown key 'colour'",
        "UNSET_KEY is not set",
    ):
        assert expected in text, (expected, text)


def test_not_toml_and_no_endpoints_are_clear(tmp_path):
    with pytest.raises(AcpConfigError, match="not valid TOML"):
        load_config(_write(tmp_path, "[[endpoints]\n"), env={})
    with pytest.raises(AcpConfigError, match=r"no \[\[endpoints\]\]"):
        load_config(_write(tmp_path, "x = 1\n"), env={})


def test_one_endpoint_from_the_environment(tmp_path):
    env = {
        "HOME": str(tmp_path),
        "HELEXA_ACP_BASE_URL": "http://127.0.0.1:8080/v1",
        "HELEXA_ACP_API_KEY": "sk-x",
        "HELEXA_ACP_WIRE_API": "openai-responses",
        "HELEXA_ACP_MODEL": "m",
        "HELEXA_ACP_CONTEXT_WINDOW": "8192",
    }
    config = load_config(env=env)
    [endpoint] = config.endpoints
    assert config.source == "environment"
    assert (endpoint.name, endpoint.wire_api, endpoint.api_key, endpoint.default_model) == (
        "default",
        "openai-responses",
        "sk-x",
        "m",
    )
    assert endpoint.context_window == 8192
    with pytest.raises(AcpConfigError, match="HELEXA_ACP_CONTEXT_WINDOW: expected a whole"):
        load_config(env={**env, "HELEXA_ACP_CONTEXT_WINDOW": "big"})
    with pytest.raises(AcpConfigError, match="HELEXA_ACP_BASE_URL"):
        load_config(env={"HOME": str(tmp_path)})


def test_the_default_file_is_read_when_it_exists(tmp_path):
    (tmp_path / "helexa").mkdir()
    (tmp_path / "helexa" / "acp.toml").write_text(
        '[[endpoints]]\nname = "x"\nbase_url = "http://x/v1"\n'
    )
    config = load_config(env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert config.endpoints[0].name == "x"


def test_model_ids_in_the_picker_and_back(tmp_path):
    one = load_config(env={"HOME": str(tmp_path), "HELEXA_ACP_BASE_URL": "http://x/v1"}).endpoints
    assert model_selector(one, "default", "qwen3:8b") == "qwen3:8b"
    assert parse_selector(one, "qwen3:8b") == (one[0], "qwen3:8b")  # a colon in an id
    path = _write(
        tmp_path,
        '[[endpoints]]\nname = "a"\nbase_url = "http://a/v1"\n'
        '[[endpoints]]\nname = "b"\nbase_url = "http://b/v1"\n',
    )
    two = load_config(path, env={}).endpoints
    assert model_selector(two, "b", "qwen3:8b") == "b:qwen3:8b"
    assert parse_selector(two, "b:qwen3:8b") == (two[1], "qwen3:8b")
    with pytest.raises(ValueError, match="names no endpoint"):
        parse_selector(two, "qwen3")
