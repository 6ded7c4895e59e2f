"""Configuration: bad values refused by name before anything is allocated, memory checked
before any pool or page allocator is built, and configs from dicts, files and HICACHE_*."""

from __future__ import annotations

import dataclasses
import json
import math
import typing

import numpy as np
import psutil
import pytest
import torch
from leak_checks import assert_no_leaks
from optional import available

from hicache import CacheConfig, HiCache, KVConfig
from hicache.cache import tiers as tiers_module
from hicache.components import ComponentSpec
from hicache.config import EvictionPolicy, PrefetchPolicy, WritePolicy
from hicache.configfile import apply_env

KV = KVConfig(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=4)


def cfg(**kw) -> CacheConfig:
    kw.setdefault("device_tokens", 64)
    return CacheConfig(KV, **kw)


# ------------------------------------------------------------------ bad values (issue 16.12)
@pytest.mark.parametrize("kw, error, match", [
    ({"host_ratio": math.inf}, ValueError, "host_ratio: expected a finite number > 0, got inf"),
    ({"host_ratio": math.nan}, ValueError, "host_ratio: expected a finite number > 0, got nan"),
    ({"host_ratio": 1e300}, ValueError, "host_ratio: expected fewer than"),
    ({"host_gb": math.inf}, ValueError, "host_gb: expected a finite number > 0"),
    ({"host_gb": 1e300}, ValueError, "host_gb: expected fewer than"),
    ({"host_gb": "4"}, TypeError, "host_gb: expected a number, got str"),
    ({"host_gb": 1.0, "host_tokens": 64}, ValueError, "host pool: expected at most one"),
    ({"extra": None}, TypeError, "extra: expected dict, got NoneType"),
    ({"allocate_kv": 1}, TypeError, "allocate_kv: expected bool, got int"),
    ({"storage": 3}, TypeError, "storage: expected str or None, got int"),
    ({"prefetch_timeout_s": math.inf}, ValueError, "prefetch_timeout_s: expected a finite"),
    ({"prefetch_timeout_s": "1"}, TypeError, "prefetch_timeout_s: expected seconds, got str"),
    ({"device_tokens": 1 << 60}, ValueError, "device pool: expected fewer than"),
    ({"device_tokens": 10**30}, ValueError, "device_tokens: expected < 4611686018427387904"),
])
def test_bad_config_values_are_refused_by_name(kw, error, match):
    with pytest.raises(error, match=match.replace("(", r"\(").replace(")", r"\)")):
        cfg(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_a_value_error(device):
    with pytest.raises(ValueError, match=f"device: '{device}' asked for, but CUDA is not available"):
        HiCache(cfg(device=device))


def _no_allocator(monkeypatch):
    """Fail the test if HiCache builds a page allocator (the checks must come first)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a page allocator was built before the memory check")

    monkeypatch.setattr(tiers_module, "PageAllocator", refuse)


@pytest.mark.parametrize("allocate_kv", [True, False])
def test_a_host_tier_beyond_memory_is_refused_before_any_allocator(monkeypatch, allocate_kv):
    _no_allocator(monkeypatch)
    with pytest.raises(ValueError, match="lower .*host_tokens") as exc:
        HiCache(cfg(host_tokens=10**12, allocate_kv=allocate_kv))
    assert "bytes asked for" in str(exc.value) and "available" in str(exc.value)


def test_memory_refusal_names_the_tier_that_asks_for_most_first(monkeypatch):
    """A huge device tier over a small host tier: the message must blame the device
    sizes first (it used to say only "lower host_tokens ..."), and the other way round."""
    _no_allocator(monkeypatch)
    with pytest.raises(ValueError) as exc:
        HiCache(cfg(device_tokens=10**14, host_tokens=64, allocate_kv=False))
    msg = str(exc.value)
    assert "lower device_tokens / device_nbytes or host_tokens" in msg, msg
    assert f"device tier: {(10**14 // KV.page_size) * 24} bytes (page allocator for" in msg, msg
    with pytest.raises(ValueError) as exc:
        HiCache(cfg(host_tokens=10**14, allocate_kv=False))
    assert "lower host_tokens / host_nbytes / host_ratio / host_gb or device_tokens" in str(
        exc.value)


def test_a_device_pool_beyond_memory_names_both_numbers_and_the_option(monkeypatch):
    _no_allocator(monkeypatch)
    available = psutil.virtual_memory().available
    tokens = (available // KV.token_nbytes + 1) * 4 * KV.page_size  # 4x what is there
    config = cfg(device_tokens=tokens)
    with pytest.raises(ValueError) as exc:
        HiCache(config)
    msg = str(exc.value)
    assert msg.startswith(f"device pool: {config.num_device_pages} pages x {KV.page_nbytes} "
                          f"bytes = {config.num_device_pages * KV.page_nbytes} bytes asked for")
    assert "bytes of available CPU memory; lower device_tokens / device_nbytes" in msg


def test_a_device_pool_that_fits_still_builds():
    with HiCache(cfg(host_tokens=128)) as cache:
        assert cache.device_pool.num_pages == 16 and cache.host_pool.num_pages == 32
        assert_no_leaks(cache)


def test_list_namespace_is_a_type_error_before_storage_keys(tmp_path):
    with HiCache(cfg(host_tokens=128, storage=f"file:{tmp_path}", model_id="test-model")) as cache:
        with pytest.raises(TypeError, match="namespace: expected str or None, got list"):
            cache.match(list(range(8)), ["tenant"])
        with pytest.raises(TypeError, match="namespace: expected str or None, got list"):
            cache.prefetch(list(range(8)), ["tenant"])
        assert_no_leaks(cache)


def test_prefetch_checks_its_tokens_without_a_third_tier():
    with HiCache(cfg(host_tokens=128)) as cache:
        with pytest.raises(TypeError, match="tokens: expected list"):
            cache.prefetch("garbage")
        assert cache.prefetch(list(range(8))) is None  # no third tier: nothing to fetch
        assert_no_leaks(cache)


def test_wait_all_takes_infinity_as_no_limit_and_refuses_nan():
    with HiCache(cfg(host_tokens=128, executor="thread")) as cache:
        h = cache.match(list(range(9)))
        assert cache.alloc(h, 8) is not None
        cache.insert(h, list(range(8)))
        cache.release(h)
        cache.wait_all(math.inf)
        with pytest.raises(ValueError, match="timeout: expected >= 0, got nan"):
            cache.wait_all(math.nan)
        assert_no_leaks(cache)


# ------------------------------------------------------------------ host_gb (issue 14.5)
def test_host_gb_is_decimal_gigabytes_in_whole_pages():
    c = cfg(host_gb=0.001)  # 10**6 bytes
    assert c.has_host_tier and c.num_host_pages == 10**6 // KV.page_nbytes
    with pytest.raises(ValueError, match="host pool: expected at least one page"):
        cfg(host_gb=1e-9)


# ------------------------------------------------------------------ from_dict / files / env
DATA = {
    "kv": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32",
           "page_size": 4},
    "device_tokens": 64,
    "host_tokens": 128,
    "write_policy": "write_back",
    "extra": {"k": 1},
}


def test_from_dict_round_trips():
    c = CacheConfig.from_dict(DATA)
    assert c == cfg(host_tokens=128, write_policy="write_back")
    assert c.extra == {"k": 1}
    assert CacheConfig.from_dict(c.to_dict()) == c
    json.dumps(c.to_dict())  # plain data


@pytest.mark.parametrize("data, error, match", [
    ({**DATA, "host_size": 3}, ValueError, "config: unknown field 'host_size'; expected some of"),
    ({k: v for k, v in DATA.items() if k != "kv"}, ValueError, "kv: missing"),
    ({**DATA, "kv": {"num_layers": 2}}, ValueError, "kv: missing num_kv_heads, head_dim"),
    ({**DATA, "kv": {**DATA["kv"], "heads": 2}}, ValueError, "kv: unknown field 'heads'"),
    ({**DATA, "kv": {**DATA["kv"], "page_size": 0}}, ValueError,
     "kv: page_size: expected >= 1, got 0"),
    ({**DATA, "kv": 3}, TypeError, "kv: expected a mapping of KV fields, got int"),
    ({**DATA, "device_tokens": "64"}, TypeError, "device_tokens: expected int, got str"),
    ({**DATA, "write_policy": "sometimes"}, ValueError, "write_policy: expected one of"),
    ([1, 2], TypeError, "config: expected a mapping of fields, got list"),
])
def test_from_dict_errors_name_the_field(data, error, match):
    with pytest.raises(error, match=match):
        CacheConfig.from_dict(data)


def test_from_json_and_yaml_files(tmp_path, monkeypatch):
    for name in [k for k in __import__("os").environ if k.startswith("HICACHE_")]:
        monkeypatch.delenv(name)
    (tmp_path / "c.json").write_text(json.dumps(DATA))
    expected = CacheConfig.from_dict(DATA)
    assert CacheConfig.from_file(tmp_path / "c.json") == expected
    if not available("yaml"):
        return  # the JSON file is checked; YAML needs pyyaml
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(DATA))
    assert CacheConfig.from_file(str(tmp_path / "c.yaml")) == expected


def test_file_errors_name_the_file_and_the_field(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({**DATA, "host_ratio": 2.0}))
    with pytest.raises(ValueError, match=f"{bad}: host pool: expected at most one size option"):
        CacheConfig.from_file(bad, env=False)
    bad.write_text("{nope")
    with pytest.raises(ValueError, match=f"{bad}: invalid JSON"):
        CacheConfig.from_file(bad)
    with pytest.raises(ValueError, match="expected a .json, .yaml or .yml file, got '.toml'"):
        CacheConfig.from_file(tmp_path / "c.toml")
    with pytest.raises(FileNotFoundError):
        CacheConfig.from_file(tmp_path / "missing.json")


def test_env_overrides_fields_and_replace_a_tiers_size_option(tmp_path, monkeypatch):
    (tmp_path / "c.json").write_text(json.dumps(DATA))
    monkeypatch.setenv("HICACHE_HOST_GB", "0.001")
    monkeypatch.setenv("HICACHE_KV_PAGE_SIZE", "8")
    monkeypatch.setenv("HICACHE_ALLOCATE_KV", "false")
    monkeypatch.setenv("HICACHE_DEVICE_TOKENS", "1_024")
    monkeypatch.setenv("HICACHE_EXTRA", '{"x": 2}')
    c = CacheConfig.from_file(tmp_path / "c.json")
    assert c.host_tokens is None and c.host_gb == 0.001  # the file's host_tokens replaced
    assert c.kv.page_size == 8 and c.allocate_kv is False and c.device_tokens == 1024
    assert c.extra == {"x": 2} and c.write_policy.value == "write_back"
    assert CacheConfig.from_file(tmp_path / "c.json", env=False) == CacheConfig.from_dict(DATA)


@pytest.mark.parametrize("name, value, match", [
    ("HICACHE_DEVICE_TOKENS", "many", "HICACHE_DEVICE_TOKENS: device_tokens: expected an integer"),
    ("HICACHE_HOST_RATIO", "x", "HICACHE_HOST_RATIO: host_ratio: expected a number"),
    ("HICACHE_ALLOCATE_KV", "maybe", "HICACHE_ALLOCATE_KV: allocate_kv: expected true or false"),
    ("HICACHE_EXTRA", "{", "HICACHE_EXTRA: extra: expected JSON"),
    ("HICACHE_MAX_PINNED_FRACTION", "half",
     "HICACHE_MAX_PINNED_FRACTION: max_pinned_fraction: expected a number"),
    ("HICACHE_KV_EVENTS", "2", "HICACHE_KV_EVENTS: kv_events: expected true or false"),
    ("HICACHE_KV_PAGE_SIZE", "8.5", "HICACHE_KV_PAGE_SIZE: page_size: expected an integer"),
])
def test_bad_env_values_name_the_variable_and_the_field(name, value, match):
    with pytest.raises(ValueError, match=match):
        apply_env(CacheConfig, DATA, {name: value})


# Every field: (HICACHE_* value, the field's value in the config, other variables it needs).
# test_every_field_has_an_env_case fails when a field is added without a case here.
ENV_CASES = {
    "device_tokens": ("1_024", 1024, {}),
    "device_nbytes": ("4096", 4096, {}),
    "host_tokens": ("256", 256, {}),
    "host_nbytes": ("8_192", 8192, {}),
    "host_ratio": ("2.5", 2.5, {}),
    "host_gb": ("0.001", 0.001, {}),
    "device": ("cpu", "cpu", {}),
    "host_reserve_nbytes": ("0", 0, {}),
    "write_policy": ("write_through_selective", WritePolicy.WRITE_THROUGH_SELECTIVE, {}),
    "backup_hit_threshold": ("3", 3, {}),
    "load_threshold_tokens": ("16", 16, {}),
    "eviction": ("lfu", EvictionPolicy.LFU, {}),
    "allocate_kv": ("false", False, {}),
    "executor": ("thread", "thread", {}),
    "tree": ("python", "python", {}),
    "lifecycle": ("python", "python", {}),
    "storage": ("file:/tmp/hicache-env-test", "file:/tmp/hicache-env-test",
                {"HICACHE_MODEL_ID": "m@r1"}),
    "model_id": ("m@r2", "m@r2", {}),
    "storage_secret": ("s3cret", "s3cret", {}),
    "prefetch_policy": ("timeout", PrefetchPolicy.TIMEOUT, {}),
    "prefetch_timeout_s": ("0.25", 0.25, {}),
    "max_pinned_fraction": ("0.25", 0.25, {}),  # refused with a TypeError once (issue 25.5)
    "kv_events": ("on", True, {}),  # likewise
    "extra": ('{"x": [1, 2]}', {"x": [1, 2]}, {}),
    "kv.num_layers": ("3", 3, {}),
    "kv.num_kv_heads": ("2", 2, {}),
    "kv.head_dim": ("8", 8, {}),
    "kv.dtype": ("bfloat16", torch.bfloat16, {}),
    "kv.page_size": ("8", 8, {}),
    "kv.components": ("window:64x2,state", (ComponentSpec("window", 64, 2), ComponentSpec("state")),
                      {}),
    "component_device_fraction": ("0.5", 0.5, {}),
    "component_host_fraction": ("0.25", 0.25, {}),
}


def test_every_field_has_an_env_case():
    fields = [f.name for f in dataclasses.fields(CacheConfig) if f.name != "kv"]
    fields += [f"kv.{f.name}" for f in dataclasses.fields(KVConfig)]
    assert sorted(ENV_CASES) == sorted(fields)


@pytest.mark.parametrize("field", sorted(ENV_CASES))
def test_every_field_is_parsed_from_the_environment_by_its_type(field):
    text, want, others = ENV_CASES[field]
    name = "HICACHE_" + field.replace(".", "_").upper()
    c = CacheConfig.from_dict(apply_env(CacheConfig, DATA, {name: text, **others}))
    got = getattr(c.kv, field[3:]) if field.startswith("kv.") else getattr(c, field)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(CacheConfig)
                                   if type(None) in typing.get_args(
                                       typing.get_type_hints(CacheConfig)[f.name])])
def test_every_optional_field_takes_none_from_the_environment(field):
    name = "HICACHE_" + field.upper()
    assert apply_env(CacheConfig, DATA, {name: "none"})[field] is None


def test_env_none_clears_an_optional_field():
    out = apply_env(CacheConfig, DATA, {"HICACHE_HOST_TOKENS": "none"})
    assert out["host_tokens"] is None
    assert not CacheConfig.from_dict(out).has_host_tier


def test_a_cuda_device_pool_is_checked_against_free_device_memory(monkeypatch):
    """Without a GPU here: torch's CUDA queries are stood in for (1 GiB free of cuda:0)."""
    from hicache.memory import pools as pool

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 2 << 30))
    fits = (1 << 30) // KV.page_nbytes
    pool.check_device_pool_memory(KV, fits, "cuda:0")  # exactly the free memory: fine
    with pytest.raises(ValueError) as exc:
        pool.check_device_pool_memory(KV, fits + 1, "cuda")
    assert str(exc.value) == (
        f"device pool: {fits + 1} pages x {KV.page_nbytes} bytes = "
        f"{(fits + 1) * KV.page_nbytes} bytes asked for, but only {1 << 30} bytes of free "
        "memory on cuda; lower device_tokens / device_nbytes"
    )
    with pytest.raises(ValueError, match="'cuda:1' asked for, but there are 1 CUDA devices"):
        pool.check_device_available("cuda:1")


def test_a_bookkeeping_only_cache_never_needs_its_device():
    with HiCache(cfg(device="cuda", host_tokens=128, allocate_kv=False)) as cache:
        h = cache.match(list(range(8)))
        assert cache.alloc(h, 8) is not None
        cache.insert(h, list(range(8)))
        cache.release(h)
        assert_no_leaks(cache)


def test_integer_fields_take_numpy_integers_and_store_python_ints():
    """Counts are checked by hicache.checks.check_int everywhere: a numpy integer is an int."""
    kv = KVConfig(num_layers=np.int64(2), num_kv_heads=np.int32(1), head_dim=8, page_size=4)
    cfg = CacheConfig(kv=kv, device_tokens=np.int64(64), load_threshold_tokens=np.int64(0))
    for value in (kv.num_layers, kv.num_kv_heads, cfg.device_tokens, cfg.load_threshold_tokens):
        assert type(value) is int
    assert cfg.num_device_pages == 16


@pytest.mark.parametrize("field", ["host_ratio", "host_gb"])
def test_host_size_numbers_name_the_same_expected_type(field):
    with pytest.raises(TypeError, match=f"{field}: expected a number, got str"):
        CacheConfig(kv=KVConfig(2, 1, 8, page_size=4), device_tokens=64, **{field: "2"})


# ------------------------------------------------- non-finite numbers, every field (issue 25.4)
def _fields_of_type(cls, kinds: set) -> list[str]:
    """The fields of ``cls`` whose declared type admits one of ``kinds``."""
    hints = typing.get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls)
            if kinds & set(typing.get_args(hints[f.name]) or (hints[f.name],))]


NUMBER_FIELDS = _fields_of_type(CacheConfig, {int, float}) + _fields_of_type(KVConfig, {int})
INT_FIELDS = _fields_of_type(CacheConfig, {int}) + _fields_of_type(KVConfig, {int})


def _build(field: str, value) -> None:
    """A config with ``field`` set to ``value`` and every other field valid."""
    if field in {f.name for f in dataclasses.fields(KVConfig)}:
        KVConfig(**{"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, field: value})
    else:
        size = {"device_tokens": None} if field == "device_nbytes" else {}
        CacheConfig(KV, **{"device_tokens": 64, **size, field: value})


def test_number_fields_are_found():
    floats = {"host_ratio", "host_gb", "prefetch_timeout_s", "max_pinned_fraction",
              "component_device_fraction", "component_host_fraction"}
    assert set(NUMBER_FIELDS) - set(INT_FIELDS) == floats
    assert len(INT_FIELDS) == 7 + 4  # 7 of CacheConfig (sizes, thresholds), 4 of KVConfig


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", NUMBER_FIELDS)
def test_every_number_field_refuses_non_finite_values_by_name(field, value):
    with pytest.raises((ValueError, TypeError)) as exc:
        _build(field, value)
    assert str(exc.value).startswith(f"{field}: expected"), str(exc.value)


@pytest.mark.parametrize("field", INT_FIELDS)
def test_every_int_field_is_bounded_inside_int64_by_name(field):
    """10**30 passed every check once and failed later in the native tree (TypeError)."""
    with pytest.raises(ValueError, match=f"^{field}: expected < {1 << 62}, got {10**30}$"):
        _build(field, 10**30)


def test_env_kinds_follow_declared_types_and_refuse_an_unknown_one():
    from hicache.configfile import _env_kind

    @dataclasses.dataclass
    class Fields:
        mode: typing.Literal["a", "b"]
        level: typing.Literal[1, 2] | None
        flag: bool | None
        ids: list[int]

    assert _env_kind(Fields, "mode") == (str, False)
    assert _env_kind(Fields, "level") == (int, True)
    assert _env_kind(Fields, "flag") == (bool, True)
    with pytest.raises(TypeError, match=r"^Fields.ids: no HICACHE_\* parser for its type"):
        _env_kind(Fields, "ids")
