"""One error hierarchy: every error hicache raises on purpose is a HiCacheError and still
the built-in type callers caught before (ValueError, TypeError, RuntimeError)."""

from __future__ import annotations

import json
import traceback

import pytest

import hicache
from hicache import CacheConfig, KVConfig
from hicache.errors import ConfigError, ConfigTypeError, HiCacheError, config_errors
from hicache.integrations.vllm.common.config import ConnectorConfig

KV = KVConfig(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)


@pytest.mark.parametrize("name, old_type", [
    ("ConfigError", ValueError),
    ("ConfigTypeError", TypeError),
    ("LoadError", RuntimeError),
    ("NativeBuildError", RuntimeError),
    ("StorageError", Exception),
])
def test_each_error_is_a_hicache_error_and_still_its_old_type(name, old_type):
    cls = getattr(hicache, name)  # exported from the package
    assert issubclass(cls, hicache.HiCacheError) and issubclass(cls, old_type)
    assert name in hicache.__all__ and "HiCacheError" in hicache.__all__


def test_the_old_import_paths_name_the_same_classes():
    from hicache.cache import LoadError
    from hicache.cache.handle import LoadError as handle_load_error
    from hicache.native.build import NativeBuildError
    from hicache.storage import StorageError
    from hicache.storage.base import StorageError as base_storage_error

    assert LoadError is handle_load_error is hicache.LoadError
    assert StorageError is base_storage_error is hicache.StorageError
    assert NativeBuildError is hicache.NativeBuildError


@pytest.mark.parametrize("make, cls, message", [
    (lambda: CacheConfig(kv=KV, device_tokens=0), ConfigError,
     "device_tokens: expected >= 1, got 0"),
    (lambda: CacheConfig(kv=KV, device_tokens=1.5), ConfigTypeError,
     "device_tokens: expected int, got float"),
    (lambda: CacheConfig(kv=KV, device_tokens=64, eviction="random"), ConfigError,
     "eviction: expected one of"),
    (lambda: KVConfig(num_layers=0, num_kv_heads=1, head_dim=1), ConfigError,
     "num_layers: expected >= 1, got 0"),
    (lambda: CacheConfig.from_dict({"kv": {"num_layers": 1}, "bogus": 1}), ConfigError,
     "config: unknown field 'bogus'"),
    (lambda: CacheConfig.from_dict([]), ConfigTypeError,
     "config: expected a mapping of fields, got list"),
    (lambda: ConnectorConfig.from_sources({"host_gb": -1}, environ={}), ConfigError,
     "kv_connector_extra_config.host_gb"),
    (lambda: ConnectorConfig.from_sources({"nope": 1}, environ={}), ConfigError,
     "unknown field(s) ['nope']"),
    (lambda: ConnectorConfig.from_extra({"host_gb": "x"}), ConfigTypeError,
     "kv_connector_extra_config.host_gb"),
])
def test_config_mistakes_raise_config_errors_with_their_messages(make, cls, message):
    with pytest.raises(cls) as info:
        make()
    assert message in str(info.value)
    # Callers that caught ValueError / TypeError still do.
    assert isinstance(info.value, ValueError if cls is ConfigError else TypeError)
    assert isinstance(info.value, HiCacheError)


def test_a_config_file_mistake_is_a_config_error(tmp_path):
    path = tmp_path / "cache.json"
    path.write_text(json.dumps({"kv": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1},
                                "device_tokens": -4}))
    with pytest.raises(ConfigError, match=r"cache.json: device_tokens: expected >= 1, got -4"):
        CacheConfig.from_file(path, env=False)


def test_config_errors_keeps_the_message_and_where_it_was_raised():
    def validate(value):
        if value < 0:
            raise ValueError(f"x: expected >= 0, got {value}")  # the line a reader wants
        return value

    checked = config_errors(validate)
    assert checked(3) == 3
    with pytest.raises(ConfigError) as info:
        checked(-1)
    assert str(info.value) == "x: expected >= 0, got -1"
    frames = traceback.extract_tb(info.value.__traceback__)
    assert frames[-1].name == "validate" and "the line a reader wants" in frames[-1].line
    # Already a config error: passed through untouched.
    original = ConfigError("y")

    def reraise():
        raise original

    with pytest.raises(ConfigError) as again:
        config_errors(reraise)()
    assert again.value is original
