import re
from dataclasses import fields
from pathlib import Path

import pytest

from helexa.config import (
    AdminConfig,
    ConfigError,
    Cost,
    EngineConfig,
    GatewayConfig,
    HttpConfig,
    LogConfig,
    ModelEntry,
    NodeConfig,
    NodeEntry,
    SourceConfig,
    load_config,
)
from helexa.protocol.wire import Price

EXAMPLE = Path(__file__).resolve().parent.parent / "helexa.toml.example"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "helexa.toml"
    path.write_text(text)
    return path


def problems_of(text: str, tmp_path: Path, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), env=env or {})
    return str(e.value)


def problems_of_env(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(env=env)
    return str(e.value)


# --- defaults and precedence -----------------------------------------------------------


def test_defaults_without_a_file_make_a_zero_config_node():
    cfg = load_config(env={})
    assert (cfg.node.host, cfg.node.port) == ("0.0.0.0", 13131)
    assert cfg.node.default_models == []
    assert cfg.node.per_principal_max == 0  # fair shares, no hard cap
    assert cfg.engine.device == "auto" and cfg.engine.dtype == "auto"
    assert cfg.engine.block_size == 16 and cfg.engine.max_num_seqs == 64
    assert (cfg.gateway.port, cfg.gateway.metrics_port) == (31313, 31314)
    assert cfg.gateway.require_auth is False
    assert cfg.hubs["huggingface"].endpoint == "https://huggingface.co"
    assert cfg.path is None


def test_state_dir_follows_xdg_state_home_and_holds_the_default_database(tmp_path):
    cfg = load_config(env={"XDG_STATE_HOME": str(tmp_path)})
    assert cfg.node.state_dir == tmp_path / "helexa"
    assert cfg.gateway.database_url == f"sqlite:///{tmp_path}/helexa/helexa.db"


def test_state_dir_defaults_under_the_home_directory():
    assert load_config(env={}).node.state_dir == Path.home() / ".local/state/helexa"


def test_file_values_replace_defaults(tmp_path):
    path = write(tmp_path, '[node]\nlisten = "127.0.0.1:9000"\n[engine]\ndtype = "float16"\n')
    cfg = load_config(path, env={})
    assert (cfg.node.host, cfg.node.port) == ("127.0.0.1", 9000)
    assert cfg.engine.dtype == "float16"
    assert cfg.path == path


def test_environment_overrides_the_file(tmp_path):
    path = write(tmp_path, '[node]\nlisten = "127.0.0.1:9000"\n[engine]\ndtype = "float16"\n')
    env = {"HELEXA_NODE_LISTEN": "10.0.0.1:9100", "HELEXA_ENGINE_MAX_NUM_SEQS": "8"}
    cfg = load_config(path, env=env)
    assert cfg.node.listen == "10.0.0.1:9100"
    assert cfg.engine.max_num_seqs == 8
    assert cfg.engine.dtype == "float16"


def test_helexa_config_names_the_file_when_no_path_is_given(tmp_path):
    path = write(tmp_path, "[gateway]\nrequire_auth = true\n")
    cfg = load_config(env={"HELEXA_CONFIG": str(path)})
    assert cfg.gateway.require_auth is True
    assert cfg.path == path


def test_an_explicit_path_wins_over_helexa_config(tmp_path):
    path = write(tmp_path, "[log]\njson = true\n")
    cfg = load_config(path, env={"HELEXA_CONFIG": str(tmp_path / "elsewhere.toml")})
    assert cfg.log.json is True


def test_a_named_file_that_does_not_exist_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"(?s)missing\.toml: .*cannot read config file"):
        load_config(tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        load_config(env={"HELEXA_CONFIG": str(tmp_path / "missing.toml")})


def test_malformed_toml_names_the_file(tmp_path):
    assert re.search(r"(?s)helexa\.toml: .*invalid TOML", problems_of("[node\n", tmp_path))


# --- environment value parsing ---------------------------------------------------------


def test_comma_lists_from_the_environment_are_split_and_trimmed():
    env = {"HELEXA_NODE_DEFAULT_MODELS": " Qwen/Qwen3-1.7B, hf:org/b ,,"}
    assert load_config(env=env).node.default_models == ["Qwen/Qwen3-1.7B", "hf:org/b"]
    assert load_config(env={"HELEXA_NODE_DEFAULT_MODELS": ""}).node.default_models == []


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("true", True),
        ("1", True),
        ("yes", True),
        ("TRUE", True),
        ("false", False),
        ("0", False),
        ("no", False),
        ("off", False),
    ],
)
def test_booleans_from_the_environment(text, value):
    assert load_config(env={"HELEXA_GATEWAY_REQUIRE_AUTH": text}).gateway.require_auth is value


def test_an_unreadable_boolean_is_refused_with_the_variable_named():
    with pytest.raises(
        ConfigError, match=r"HELEXA_LOG_JSON \(\[log\] json\): expected true or false, got 'maybe'"
    ):
        load_config(env={"HELEXA_LOG_JSON": "maybe"})


def test_numbers_from_the_environment_are_typed_by_the_field():
    cfg = load_config(env={"HELEXA_ENGINE_SEED": "7", "HELEXA_NODE_MAX_QUEUE_WAIT_S": "2.5"})
    assert cfg.engine.seed == 7 and cfg.node.max_queue_wait_s == 2.5
    with pytest.raises(ConfigError, match=r"HELEXA_ENGINE_SEED .*expected an integer, got 'seven'"):
        load_config(env={"HELEXA_ENGINE_SEED": "seven"})


@pytest.mark.parametrize("text", ["", "none", "None"])
def test_empty_or_none_unsets_an_optional_value_from_the_environment(tmp_path, text):
    path = write(tmp_path, "[engine]\nmax_model_len = 4096\n")
    cfg = load_config(path, env={"HELEXA_ENGINE_MAX_MODEL_LEN": text})
    assert cfg.engine.max_model_len is None


def test_helexa_variables_that_are_not_overrides_are_ignored_or_carried_as_derived_values():
    env = {
        "HELEXA_DEBUG_POISON": "org/model",
        "HELEXA_ADMIN_PASSWORD": "s3cret",
        "HELEXA_SOMETHING_ELSE": "x",
    }
    cfg = load_config(env=env)
    assert cfg.node.debug_poison == "org/model"
    assert cfg.admin.password == "s3cret"
    assert "s3cret" not in repr(cfg)


def test_an_unknown_key_under_a_section_prefix_lists_the_valid_keys():
    message = problems_of_env({"HELEXA_NODE_LISTN": "0.0.0.0:1"})
    assert "HELEXA_NODE_LISTN: [node] has no key 'listn' (did you mean 'listen'?)" in message
    assert "valid keys: listen, default_models" in message


# --- sources ---------------------------------------------------------------------------


def test_hf_cache_precedence_is_config_then_hf_hub_cache_then_hf_home(tmp_path):
    both = {"HF_HUB_CACHE": "/hub-cache", "HF_HOME": "/hf-home"}
    assert load_config(env=both).hubs["huggingface"].cache_dir == Path("/hub-cache")
    home = {"HF_HOME": "/hf-home"}
    assert load_config(env=home).hubs["huggingface"].cache_dir == Path("/hf-home/hub")
    default = Path.home() / ".cache" / "huggingface" / "hub"
    assert load_config(env={}).hubs["huggingface"].cache_dir == default
    path = write(tmp_path, '[sources.huggingface]\ncache_dir = "/explicit"\n')
    assert load_config(path, env=both).hubs["huggingface"].cache_dir == Path("/explicit")


def test_each_hf_variable_keeps_its_meaning_where_no_source_key_overrides_it(tmp_path):
    env = {"HF_ENDPOINT": "https://mirror.example.org/", "HF_HUB_OFFLINE": "1", "HF_TOKEN": "t"}
    hf = load_config(env=env).hubs["huggingface"]
    assert (hf.endpoint, hf.offline, hf.token) == ("https://mirror.example.org", True, "t")
    path = write(
        tmp_path,
        '[sources.huggingface]\nendpoint = "https://hub.internal"\noffline = false\n'
        'token = "inline"\n',
    )
    hf = load_config(path, env=env).hubs["huggingface"]
    assert (hf.endpoint, hf.offline, hf.token) == ("https://hub.internal", False, "inline")


def test_a_source_token_is_inline_or_read_from_its_named_variable_at_load(tmp_path):
    path = write(
        tmp_path,
        '[sources.helexa]\nendpoint = "https://models.example.org"\ntoken_env = "REG"\n'
        '[sources.mirror]\nendpoint = "https://mirror.example.org"\ntoken = "inline-tok"\n',
    )
    cfg = load_config(path, env={"HF_TOKEN": "hf-tok", "REG": "reg-tok"})
    assert cfg.hubs["huggingface"].token == "hf-tok"
    assert cfg.hubs["helexa"].token == "reg-tok"
    assert cfg.hubs["mirror"].token == "inline-tok"
    for secret in ("hf-tok", "reg-tok", "inline-tok"):
        assert secret not in repr(cfg)


def test_another_source_needs_an_endpoint_and_never_borrows_the_hf_token(tmp_path):
    assert "[sources.helexa] endpoint: required" in problems_of("[sources.helexa]\n", tmp_path)
    path = write(tmp_path, '[sources.helexa]\nendpoint = "https://models.example.org"\n')
    cfg = load_config(path, env={"HF_TOKEN": "hf-tok"})
    assert cfg.hubs["helexa"].token is None
    assert cfg.hubs["helexa"].client_token() is False  # no token sent, not the stored login
    assert cfg.hubs["helexa"].cache_dir == cfg.node.state_dir / "hub" / "helexa"


def test_a_default_model_is_an_id_or_a_table_of_its_load_options(tmp_path):
    path = write(
        tmp_path,
        '[node]\ndefault_models = ["org/plain", {model = "org/M-GGUF", quant = "Q4_K_M"}, '
        '{model = "org/big", tensor_parallel = 2, devices = [0, 1], dtype = "bfloat16", '
        'revision = "v2", speculative_method = "ngram"}, "org/plain"]\n',
    )
    node = load_config(path, env={}).node
    assert node.default_loads() == [
        {"model_id": "org/plain"},
        {"model_id": "org/M-GGUF", "quant": "Q4_K_M", "tensor_parallel": 1},
        {"model_id": "org/big", "dtype": "bfloat16", "devices": [0, 1], "tensor_parallel": 2,
         "revision": "v2", "speculative_method": "ngram"},
    ]  # fmt: skip
    assert node.default_model_ids() == ["org/plain", "org/M-GGUF", "org/big"]
    for text, problem in (
        ("[node]\ndefault_models = [{quant = 'Q4_K_M'}]", "missing required key 'model'"),
        ("[node]\ndefault_models = [{model = 'a/b', qunat = 'Q4_K_M'}]", "did you mean 'quant'"),
        ("[node]\ndefault_models = [{model = 'a/b', tensor_parallel = 0}]", "a positive integer"),
        ("[node]\ndefault_models = [3]", "expected a string or a table, got 3"),
    ):
        assert problem in problems_of(text, tmp_path), text


# --- validation ------------------------------------------------------------------------


def test_a_listen_that_is_not_host_port_is_refused_with_the_file_key_and_value(tmp_path):
    message = problems_of("[node]\nlisten = 13131\n", tmp_path)
    assert str(tmp_path / "helexa.toml") in message
    assert '[node] listen: expected "host:port", got 13131' in message


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "0.0.0.0:70000", ":13131", "localhost"])
def test_listen_needs_a_host_and_a_port_in_range(tmp_path, listen):
    assert '[gateway] listen: expected "host:port"' in problems_of(
        f'[gateway]\nlisten = "{listen}"\n', tmp_path
    )


def test_ipv6_listen_addresses_are_split_into_host_and_port():
    cfg = load_config(env={"HELEXA_GATEWAY_LISTEN": "[::]:8080"})
    assert (cfg.gateway.host, cfg.gateway.port) == ("::", 8080)


def test_an_unknown_key_suggests_the_nearest_one(tmp_path):
    message = problems_of("[engine]\nblok_size = 32\n", tmp_path)
    assert "[engine] blok_size: unknown key (did you mean 'block_size'?)" in message


def test_an_unknown_section_suggests_the_nearest_one(tmp_path):
    message = problems_of('[gatway]\nlisten = "0.0.0.0:1"\n', tmp_path)
    assert "unknown section [gatway] (did you mean 'gateway'?)" in message


def test_a_misspelt_choice_suggests_the_nearest_one(tmp_path):
    message = problems_of('[engine]\ndtype = "bfloat61"\n', tmp_path)
    assert "[engine] dtype: expected one of 'auto', 'float32', 'bfloat16', 'float16'" in message
    assert "got 'bfloat61' (did you mean 'bfloat16'?)" in message


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[engine]\nblock_size = 12", "[engine] block_size: expected a power of two, got 12"),
        ("[engine]\nkv_cache_memory_fraction = 1.5", "expected a fraction in (0, 1], got 1.5"),
        ("[engine]\nmax_num_seqs = 0", "[engine] max_num_seqs: expected a positive integer, got 0"),
        ('[engine]\ndevice = "gpu"', '[engine] device: expected "auto", "cpu", "cuda" or "cuda:N"'),
        ('[engine]\nquant = "int3"', "[engine] quant: expected one of 'int8', 'int4'"),
        ("[node]\nper_principal_max = -1", "expected an integer >= 0, got -1"),
        ('[node]\nmax_running_requests = "8"', "expected a positive integer, got '8'"),
        (
            "[node]\nmax_queue_wait_s = true",
            "[node] max_queue_wait_s: expected a positive number, got True",
        ),
        (
            '[node]\ndefault_models = "a,b"',
            "[node] default_models: expected a list of strings or tables, got 'a,b'",
        ),
        (
            "[node]\ndefault_models = [1]",
            "[node] default_models[0]: expected a string or a table, got 1",
        ),
        ('[node]\nstate_dir = ""', "[node] state_dir: expected a path, got ''"),
        (
            '[node]\nadvertise_endpoint = "beast:13131"',
            "expected an http(s) URL, got 'beast:13131'",
        ),
        (
            '[gateway]\nrequire_auth = "yes"',
            "[gateway] require_auth: expected true or false, got 'yes'",
        ),
        ('[gateway]\ndatabase_url = "helexa.db"', "expected a SQLAlchemy URL, got 'helexa.db'"),
        ('[log]\nlevel = "verbose"', "[log] level: expected one of 'debug', 'info'"),
        ("node = 3", "[node]: expected a table, got 3"),
        ('[nodes]\nname = "a"', "[[nodes]]: expected an array of tables"),
    ],
)
def test_bad_values_are_refused_with_key_path_and_value(tmp_path, toml, expected):
    assert expected in problems_of(toml + "\n", tmp_path)


def test_every_problem_is_reported_at_once(tmp_path):
    node = '[[nodes]]\nname = "a"\nendpoint = "http://a:1"\n'
    text = '[node]\nlisten = 1\n[engine]\nblock_size = 3\ndtype = "f32"\n[log]\nlevle = "info"\n'
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text + node + node), env={"HELEXA_ENGINE_SEED": "x"})
    assert len(e.value.problems) == 6
    assert "6 configuration problems" in str(e.value)
    assert "[[nodes]] name: 'a' is used by more than one node" in e.value.problems


def test_node_entries_need_a_name_and_a_valid_url(tmp_path):
    message = problems_of(
        '[[nodes]]\nname = "a"\n\n[[nodes]]\nname = "b"\nendpoint = "ftp://b"\n', tmp_path
    )
    assert "[[nodes]] #1: missing required key 'endpoint'" in message
    assert "[[nodes]] #2 endpoint: expected an http(s) URL, got 'ftp://b'" in message


def test_duplicate_node_names_are_refused(tmp_path):
    node = '[[nodes]]\nname = "beast"\nendpoint = "http://beast:13131"\n'
    assert "[[nodes]] name: 'beast' is used by more than one node" in problems_of(
        node + node, tmp_path
    )


def test_a_catalogue_entry_loads_with_its_nested_cost(tmp_path):
    text = """
[[nodes]]
name = "beast"
endpoint = "http://beast.internal:13131"

[[models]]
id = "Qwen/Qwen3-8B"
quant = "Q4_K_M"
tensor_parallel = 2
pinned_on = ["beast"]
cost = { input = 0.05, output = 0.2 }
"""
    (model,) = load_config(write(tmp_path, text), env={}).models
    assert (model.id, model.quant, model.dtype) == ("Qwen/Qwen3-8B", "Q4_K_M", None)
    assert model.required_devices == 2
    assert (model.cost.input, model.cost.output) == (0.05, 0.2)


def test_catalogue_mistakes_are_refused(tmp_path):
    text = """
[[nodes]]
name = "beast"
endpoint = "http://beast:13131"

[[models]]
id = "a/b"
tensor_parallel = 2
min_devices = 1
pinned_on = ["beats"]
cost = { input = -1.0 }

[[models]]
id = "a/b"
"""
    message = problems_of(text, tmp_path)
    assert "[[models]] #1 cost.input: expected a number >= 0, got -1.0" in message
    # rules across entries wait until every [[models]] value is well-typed
    text = text.replace("input = -1.0", "input = 1.0")
    message = problems_of(text, tmp_path)
    assert "[[models]] id: 'a/b' is listed more than once" in message
    assert "[[models]] #1 (a/b) min_devices: 1 is below tensor_parallel 2" in message
    assert (
        "[[models]] #1 (a/b) pinned_on: 'beats' is not a [[nodes]] name (did you mean 'beast'?)"
        in message
    )


def test_a_catalogue_entry_chooses_speculative_decoding_and_mistakes_are_refused(tmp_path):
    ok = '[[models]]\nid = "a/b"\nspeculative_method = "ngram"\nnum_speculative_tokens = 3\n'
    (model,) = load_config(write(tmp_path, ok), env={}).models
    assert (model.speculative_method, model.speculative_model) == ("ngram", None)
    assert model.num_speculative_tokens == 3
    text = """
[[models]]
id = "a/b"
speculative_method = "ngarm"
num_speculative_tokens = 17

[[models]]
id = "c/d"
speculative_method = "ngram"
speculative_model = "c/draft"

[[models]]
id = "e/f"
speculative_method = "draft_model"
"""
    message = problems_of(text, tmp_path)
    assert (
        "[[models]] #1 speculative_method: expected one of 'ngram', 'draft_model', 'mtp', 'off'"
        in message
    )
    assert "(did you mean 'ngram'?)" in message
    assert "[[models]] #1 num_speculative_tokens: expected an integer from 1 to 16" in message
    text = text.replace('"ngarm"', '"off"').replace("= 17", "= 16")
    message = problems_of(text, tmp_path)
    assert (
        "[[models]] #2 (c/d) speculative_model: only with speculative_method 'draft_model' "
        "(it is 'ngram')" in message
    )
    assert "[[models]] #3 (e/f) speculative_model: required with speculative_method" in message
    assert "#1" not in message


def test_aliases_resolve_to_model_ids_and_may_not_loop(tmp_path):
    ok = write(tmp_path, '[aliases]\n"helexa/small" = "Qwen/Qwen3-1.7B"\n')
    assert load_config(ok, env={}).aliases == {"helexa/small": "Qwen/Qwen3-1.7B"}
    message = problems_of('[aliases]\n"a" = "a"\n"x" = "y"\n"y" = "x"\n', tmp_path)
    assert '[aliases] "a": points back at itself (a → a)' in message
    assert '[aliases] "x": points back at itself (x → y → x)' in message


def test_engine_budgets_must_fit_one_step(tmp_path):
    message = problems_of(
        "[engine]\nmax_num_batched_tokens = 256\nmax_prefill_chunk = 512\n", tmp_path
    )
    assert "[engine] max_prefill_chunk: 512 exceeds max_num_batched_tokens 256" in message


def test_gateway_metrics_may_not_share_the_api_port():
    message = problems_of_env({"HELEXA_GATEWAY_METRICS_LISTEN": "127.0.0.1:31313"})
    assert "[gateway] metrics_listen: '127.0.0.1:31313' uses the API port 31313" in message


def test_default_source_must_name_a_source():
    message = problems_of_env({"HELEXA_NODE_DEFAULT_SOURCE": "modelscope"})
    assert "[node] default_source: 'modelscope' is not a [sources.*] table" in message


def test_an_environment_override_that_fails_names_the_variable(tmp_path):
    message = problems_of_env({"HELEXA_NODE_LISTEN": "nowhere"})
    assert "HELEXA_NODE_LISTEN ([node] listen): expected \"host:port\", got 'nowhere'" in message
    assert "(no file)" in message


# --- the example file ------------------------------------------------------------------


def test_the_example_file_loads_and_equals_the_defaults():
    assert load_config(EXAMPLE, env={}) == load_config(env={})


def test_uncommenting_every_default_in_the_example_changes_nothing(tmp_path):
    text = EXAMPLE.read_text()
    uncommented = re.sub(r"(?m)^#(?=\w+ = )", "", text)
    assert uncommented != text
    assert load_config(write(tmp_path, uncommented), env={}) == load_config(env={})


def test_uncommenting_every_example_in_the_example_file_also_loads(tmp_path):
    text = re.sub(r'(?m)^#(?=\w+ = )|^# (?=(\w+|"[^"]*") = |\[)', "", EXAMPLE.read_text())
    cfg = load_config(write(tmp_path, text), env={"HF_TOKEN": "t"})
    assert [n.name for n in cfg.nodes] == ["beast"]
    assert cfg.models[0].pinned_on == ["beast"] and cfg.models[0].cost.output == 0.2
    assert cfg.sources["helexa"].endpoint == "https://models.example.org"
    assert cfg.aliases == {"helexa/small": "Qwen/Qwen3-1.7B"}
    assert cfg.engine.quant == "int8" and cfg.engine.max_model_len == 32768


def test_the_example_documents_every_key():
    comments = "\n".join(line for line in EXAMPLE.read_text().splitlines() if line.startswith("#"))
    documented = set(re.findall(r"(\w+) = ", comments))
    sections = (NodeConfig, EngineConfig, SourceConfig, GatewayConfig, NodeEntry, ModelEntry)
    sections += (Cost, AdminConfig, LogConfig, HttpConfig)
    keys = {f.name for cls in sections for f in fields(cls) if not f.metadata.get("derived")}
    assert keys - documented == set()


def test_engine_section_becomes_engine_args_with_overrides(tmp_path):
    from helexa.engine import EngineArgs

    path = tmp_path / "helexa.toml"
    path.write_text("[engine]\nblock_size = 32\nnum_threads = 4\n")
    args = EngineArgs.from_config(load_config(path, env={}).engine, "m", num_threads=2)
    assert (args.model, args.block_size, args.num_threads) == ("m", 32, 2)


def test_a_metrics_token_comes_from_the_file_or_env_and_needs_an_api_key(tmp_path):
    env = {"HELEXA_NODE_API_KEY": "k", "HELEXA_NODE_METRICS_TOKEN": "scrape-secret"}
    cfg = load_config(env=env)
    assert (cfg.node.api_key, cfg.node.metrics_token) == ("k", "scrape-secret")
    assert "scrape-secret" not in repr(cfg.node)  # a secret, like the api_key
    text = '[node]\nmetrics_token = "m"\n'
    assert "metrics_token: set without [node] api_key" in problems_of(text, tmp_path)


def test_cache_prices_default_to_the_input_price():
    assert Cost(input=2.0, output=8.0).price() == Price(2.0, 8.0, 2.0, 2.0)
    assert Cost(input=2.0, cache_read=0.2, cache_write=0.0).price() == Price(2.0, 0.0, 0.2, 0.0)
