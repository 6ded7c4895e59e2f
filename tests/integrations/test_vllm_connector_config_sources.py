"""Where the connector's options come from: ``kv_connector_extra_config`` over
``HICACHE_<FIELD>`` variables over ``$HICACHE_CONFIG_FILE`` (YAML or JSON) over the
defaults, and every mistake named by field and source. Needs no vLLM."""

from __future__ import annotations

import json

import pytest
from optional import need

from hicache.integrations.vllm.common.config import ConnectorConfig

SECRET = "s3cr3t-do-not-show"


def _file(tmp_path, text: str, name: str = "hicache.yaml") -> str:
    if name.endswith((".yaml", ".yml")):
        need("yaml")
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_each_source_alone(tmp_path):
    assert ConnectorConfig.from_sources(None, {}) == ConnectorConfig()
    path = _file(tmp_path, "host_tokens: 4096\neviction: lfu\ncopy_cpus: [2, 3]\n"
                 "storage: file:/tmp/x\nstorage_options: {capacity_nbytes: 1000000}\n")
    cfg = ConnectorConfig.from_sources(None, {"HICACHE_CONFIG_FILE": path})
    assert (cfg.host_tokens, cfg.eviction, cfg.copy_cpus) == (4096, "lfu", [2, 3])
    assert cfg.storage_options == {"capacity_nbytes": 1000000}
    env = {"HICACHE_HOST_GB": "1.5", "HICACHE_EVICTION": "lfu", "HICACHE_COPY_CPUS": "0,1",
           "HICACHE_STORAGE_EPOCH_ON_RESET": "false", "HICACHE_LOAD_THRESHOLD_TOKENS": "1_024",
           "HICACHE_STORAGE": "file:/tmp/y", "HICACHE_STORAGE_OPTIONS": '{"low_watermark": 0.5}',
           "HICACHE_MODEL_ID": "m", "HICACHE_STORAGE_TIMEOUT_S": "2",
           "HICACHE_LOG_LEVEL": "INFO"}  # not a connector field: not the connector's
    cfg = ConnectorConfig.from_sources(None, env)
    assert (cfg.host_gb, cfg.eviction, cfg.copy_cpus) == (1.5, "lfu", [0, 1])
    assert (cfg.storage_epoch_on_reset, cfg.load_threshold_tokens) == (False, 1024)
    assert cfg.storage_options == {"low_watermark": 0.5} and cfg.model_id == "m"
    assert cfg.storage_timeout_s == 2.0
    assert ConnectorConfig.from_sources({"tree": "python"}, {}).tree == "python"


def test_json_file_and_copy_cpus_as_json(tmp_path):
    path = _file(tmp_path, json.dumps({"executor": "sync", "host_tokens": 64}), "c.json")
    cfg = ConnectorConfig.from_sources(None, {"HICACHE_CONFIG_FILE": path,
                                              "HICACHE_COPY_CPUS": "[4]",
                                              "HICACHE_EXECUTOR": "thread"})
    assert (cfg.executor, cfg.host_tokens, cfg.copy_cpus) == ("thread", 64, [4])


def test_precedence_extra_over_env_over_file_over_defaults(tmp_path):
    path = _file(tmp_path, "eviction: lfu\ntree: python\nexecutor: sync\n"
                 "load_threshold_tokens: 16\n")
    env = {"HICACHE_CONFIG_FILE": path, "HICACHE_TREE": "native", "HICACHE_EXECUTOR": "thread"}
    cfg = ConnectorConfig.from_sources({"executor": "manual"}, env)
    assert cfg.eviction == "lfu"  # file only
    assert cfg.tree == "native"  # env over file
    assert cfg.executor == "manual"  # extra over env and file
    assert cfg.load_threshold_tokens == 16
    assert cfg.write_policy == "write_through" and cfg.storage_timeout_s == 5.0  # defaults


def test_a_higher_sources_size_replaces_the_other_size(tmp_path):
    path = _file(tmp_path, "host_tokens: 4096\n")
    env = {"HICACHE_CONFIG_FILE": path, "HICACHE_HOST_GB": "2"}
    cfg = ConnectorConfig.from_sources(None, env)
    assert (cfg.host_gb, cfg.host_tokens) == (2.0, None)
    cfg = ConnectorConfig.from_sources({"host_tokens": 128}, env)
    assert (cfg.host_gb, cfg.host_tokens) == (None, 128)
    with pytest.raises(ValueError, match="at most one of host_gb or host_tokens") as exc:
        ConnectorConfig.from_sources(None, {"HICACHE_CONFIG_FILE": _file(
            tmp_path, "host_tokens: 64\nhost_gb: 1\n", "both.yaml")})
    assert "both.yaml" in str(exc.value)  # one source gave both: it is named


@pytest.mark.parametrize("env, message", [
    ({"HICACHE_HOST_GB": "lots"}, "HICACHE_HOST_GB: host_gb: expected a number, got 'lots'"),
    ({"HICACHE_HOST_GB": "0"}, "HICACHE_HOST_GB: host_gb: expected > 0, got 0.0"),
    ({"HICACHE_HOST_TOKENS": "1.5"},
     "HICACHE_HOST_TOKENS: host_tokens: expected an integer, got '1.5'"),
    ({"HICACHE_EVICTION": "mru"},
     "HICACHE_EVICTION: eviction: expected one of ['lru', 'lfu'], got 'mru'"),
    ({"HICACHE_STORAGE_EPOCH_ON_RESET": "maybe"},
     "HICACHE_STORAGE_EPOCH_ON_RESET: storage_epoch_on_reset: expected true or false, "
     "got 'maybe'"),
    ({"HICACHE_COPY_CPUS": "0,x"}, "HICACHE_COPY_CPUS: copy_cpus: expected a list of ints"),
    ({"HICACHE_STORAGE_OPTIONS": "{bad"}, "HICACHE_STORAGE_OPTIONS: storage_options: "
     "expected JSON"),
    ({"HICACHE_STORAGE_TIMEOUT_S": "nan"},
     "HICACHE_STORAGE_TIMEOUT_S: storage_timeout_s: expected a finite number, got nan"),
])
def test_a_bad_variable_is_named(env, message):
    with pytest.raises((ValueError, TypeError)) as exc:
        ConnectorConfig.from_sources(None, env)
    assert str(exc.value).startswith(message), str(exc.value)


def test_a_bad_file_value_names_the_file_and_field(tmp_path):
    path = _file(tmp_path, "host_gb: -1\n")
    with pytest.raises(ValueError) as exc:
        ConnectorConfig.from_sources(None, {"HICACHE_CONFIG_FILE": path})
    assert str(exc.value) == f"{path}: host_gb: expected > 0, got -1"
    path = _file(tmp_path, "storage: file:/x\nstorage_options: {segment_nbytes: 0}\n", "o.yaml")
    with pytest.raises(ValueError) as exc:
        ConnectorConfig.from_sources(None, {"HICACHE_CONFIG_FILE": path})
    assert str(exc.value) == f"{path}: storage_options.segment_nbytes: expected >= 1, got 0"
    path = _file(tmp_path, "host_gigabytes: 3\n", "u.yaml")
    with pytest.raises(ValueError, match=rf"^{path}: unknown field\(s\) \['host_gigabytes'\]"):
        ConnectorConfig.from_sources(None, {"HICACHE_CONFIG_FILE": path})


def test_a_bad_extra_value_is_named_as_before():
    with pytest.raises(ValueError) as exc:
        ConnectorConfig.from_sources({"host_gb": 0}, {"HICACHE_HOST_GB": "3"})
    assert str(exc.value) == "kv_connector_extra_config.host_gb: expected > 0, got 0"
    with pytest.raises(ValueError, match="^kv_connector_extra_config: unknown field"):
        ConnectorConfig.from_sources({"hostgb": 1}, {})


def test_a_cross_field_error_names_each_fields_source(tmp_path):
    path = _file(tmp_path, "copy_cpus: [1]\n")
    with pytest.raises(ValueError) as exc:
        ConnectorConfig.from_sources(None, {"HICACHE_CONFIG_FILE": path,
                                            "HICACHE_EXECUTOR": "sync"})
    msg = str(exc.value)
    assert msg.startswith(f"{path}: copy_cpus: pins the thread executor's copies"), msg
    with pytest.raises(ValueError) as exc:
        ConnectorConfig.from_sources({"storage_options": {"x": 1}}, {})
    assert str(exc.value).startswith("kv_connector_extra_config.storage_options: given without")


@pytest.mark.parametrize("name, text, message", [
    ("c.toml", "a = 1", "expected a .yaml, .yml or .json file, got '.toml'"),
    ("c.yaml", "- 1\n- 2\n", "expected a mapping of connector fields, got list"),
    ("c.json", "{", "invalid JSON"),
])
def test_a_bad_file_is_named(tmp_path, name, text, message):
    path = _file(tmp_path, text, name)
    with pytest.raises(ValueError) as exc:
        ConnectorConfig.from_sources(None, {"HICACHE_CONFIG_FILE": path})
    assert path in str(exc.value) and message in str(exc.value), str(exc.value)
    with pytest.raises(ValueError, match="HICACHE_CONFIG_FILE=.*missing.yaml: cannot read it"):
        ConnectorConfig.from_sources(None, {"HICACHE_CONFIG_FILE": str(tmp_path / "missing.yaml")})


def test_an_empty_file_is_the_defaults(tmp_path):
    path = _file(tmp_path, "")
    assert ConnectorConfig.from_sources(None, {"HICACHE_CONFIG_FILE": path}) == ConnectorConfig()


def test_the_storage_secret_never_shows(tmp_path):
    env = {"HICACHE_STORAGE_SECRET": SECRET}
    cfg = ConnectorConfig.from_sources(None, env)
    assert cfg.storage_secret == SECRET and SECRET not in repr(cfg)
    # a YAML error on the secret's line reports where, not the line
    path = _file(tmp_path, f'storage: file:/x\nstorage_secret: "{SECRET}\n', "bad.yaml")
    with pytest.raises(ValueError) as exc:
        ConnectorConfig.from_sources(None, {"HICACHE_CONFIG_FILE": path})
    assert "invalid YAML" in str(exc.value) and SECRET not in str(exc.value)
    for bad in ({"storage_secret": 12345}, {"storage_secret": ""}):
        path = _file(tmp_path, json.dumps(bad), "s.json")
        with pytest.raises((ValueError, TypeError)) as exc:
            ConnectorConfig.from_sources(None, {"HICACHE_CONFIG_FILE": path})
        assert str(exc.value).startswith(f"{path}: storage_secret: expected")
        assert "12345" not in str(exc.value) and SECRET not in str(exc.value)
    # an error about another field, with the secret set, does not show it
    with pytest.raises(ValueError) as exc:
        ConnectorConfig.from_sources({"host_gb": -1}, env)
    assert SECRET not in str(exc.value)


def test_a_secret_in_vllms_config_is_refused():
    """vLLM logs kv_connector_extra_config at start-up (and `vllm serve` has it on its
    command line): a storage secret there is refused, naming where it belongs."""
    for parse in (lambda extra: ConnectorConfig.from_sources(extra, {}),
                  ConnectorConfig.from_extra):
        for value in (SECRET, 12345, None):
            with pytest.raises(ValueError) as exc:
                parse({"host_gb": 1, "storage_secret": value})
            message = str(exc.value)
            assert message.startswith("kv_connector_extra_config.storage_secret: refused")
            assert "HICACHE_STORAGE_SECRET" in message and "HICACHE_CONFIG_FILE" in message
            assert SECRET not in message and "12345" not in message and "\n" not in message


def test_vllms_scheduler_builds_the_connector_from_every_source(tmp_path, monkeypatch):
    from optional_vllm import VLLM_REQUIRED, vllm_available

    if not VLLM_REQUIRED and not vllm_available():
        pytest.skip("vllm (pip install -e '.[vllm]') not installed")
    import vllm_sched

    B = vllm_sched.B
    monkeypatch.setenv("HICACHE_CONFIG_FILE", _file(tmp_path, "eviction: lfu\ntree: native\n"))
    monkeypatch.setenv("HICACHE_TREE", "python")
    e = vllm_sched.Engine(extra={"host_tokens": 8 * B})  # and "executor": "sync"
    cfg = e.connector.hc_config
    assert (cfg.eviction, cfg.tree, cfg.host_tokens, cfg.executor) == ("lfu", "python", 8 * B,
                                                                       "sync")
    assert e.worker.hc_config == cfg  # the worker half reads the same sources
    e.close()
    monkeypatch.setenv("HICACHE_LOAD_THRESHOLD_TOKENS", "-1")
    with pytest.raises(ValueError, match="^HICACHE_LOAD_THRESHOLD_TOKENS: load_threshold_tokens: "
                       "expected >= 0, got -1"):
        vllm_sched.Engine(extra={"host_tokens": 8 * B})  # vLLM's scheduler does not start
