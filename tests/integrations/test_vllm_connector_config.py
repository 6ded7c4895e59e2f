"""The connector's ``kv_connector_extra_config``: every number finite and in range, refused
by name at construction (the scheduler process, at start-up). Needs no vLLM."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest

from hicache.integrations.vllm.common.config import ConnectorConfig

NON_FINITE = ["NaN", "Infinity", "-Infinity"]  # as vLLM's JSON parser reads them


def _number_fields() -> list[str]:
    hints = typing.get_type_hints(ConnectorConfig)
    return [f.name for f in dataclasses.fields(ConnectorConfig)
            if {int, float} & set(typing.get_args(hints[f.name]) or (hints[f.name],))]


def test_the_number_fields_are_all_tested():
    assert _number_fields() == ["host_gb", "host_tokens", "host_reserve_gb",
                                "backup_hit_threshold", "load_threshold_tokens",
                                "storage_timeout_s", "prefetch_threshold_tokens",
                                "prefetch_timeout_base_s", "prefetch_timeout_per_ki_token_s",
                                "prefetch_timeout_max_s", "handoff_timeout_s", "audit_rate"]


def _refused(extra_json: str, name: str) -> None:
    with pytest.raises((ValueError, TypeError)) as exc:
        ConnectorConfig.from_extra(json.loads(extra_json))
    message = str(exc.value)
    assert message.startswith(f"kv_connector_extra_config.{name}: expected"), message
    assert "\n" not in message


@pytest.mark.parametrize("text", NON_FINITE)
@pytest.mark.parametrize("name", _number_fields())
def test_every_number_field_refuses_non_finite_values_by_name(name, text):
    _refused(f'{{"{name}": {text}}}', name)


@pytest.mark.parametrize("text", NON_FINITE)
def test_copy_cpus_refuses_non_finite_values(text):
    _refused(f'{{"copy_cpus": [0, {text}]}}', "copy_cpus")


@pytest.mark.parametrize("text", NON_FINITE)
@pytest.mark.parametrize("name", ["capacity_nbytes", "low_watermark", "segment_nbytes",
                                  "local_buffer_nbytes", "connect_timeout_s", "retry_after_s",
                                  "epoch_refresh_s", "epoch_wait_s", "some_future_option"])
def test_number_storage_options_refuse_non_finite_values(name, text):
    storage = "mooncake://m:1?metadata=http://m:2/metadata"
    _refused(f'{{"storage": "{storage}", "storage_options": {{"{name}": {text}}}}}',
             f"storage_options.{name}")


@pytest.mark.parametrize("extra, message", [
    ({"host_gb": 1e30}, "host_gb: expected < 4294967296, got 1e+30"),
    ({"host_gb": 0}, "host_gb: expected > 0, got 0"),
    ({"storage_timeout_s": 0}, "storage_timeout_s: expected > 0, got 0"),
    ({"storage_timeout_s": 1e9}, "storage_timeout_s: expected <= 3600, got 1000000000.0"),
    ({"host_reserve_gb": -0.5}, "host_reserve_gb: expected >= 0, got -0.5"),
    ({"host_reserve_gb": 2.0**40}, "host_reserve_gb: expected < 4294967296, got 1099511627776.0"),
    ({"host_tokens": 1 << 62}, f"host_tokens: expected < {1 << 62}, got {1 << 62}"),
    ({"host_tokens": 0}, "host_tokens: expected >= 1, got 0"),
    ({"load_threshold_tokens": -1}, "load_threshold_tokens: expected >= 0, got -1"),
    ({"backup_hit_threshold": 0}, "backup_hit_threshold: expected >= 1, got 0"),
    ({"backup_hit_threshold": 1.5}, "backup_hit_threshold: expected an int, got 1.5"),
    ({"load_threshold_tokens": 1 << 62}, f"load_threshold_tokens: expected < {1 << 62}"),
    ({"prefetch_threshold_tokens": -1}, "prefetch_threshold_tokens: expected >= 0, got -1"),
    ({"prefetch_timeout_base_s": -1}, "prefetch_timeout_base_s: expected >= 0, got -1"),
    ({"prefetch_timeout_per_ki_token_s": 4000},
     "prefetch_timeout_per_ki_token_s: expected <= 3600, got 4000"),
    ({"prefetch_timeout_max_s": 0}, "prefetch_timeout_max_s: expected > 0, got 0"),
    ({"handoff_timeout_s": -1}, "handoff_timeout_s: expected >= 0, got -1"),
    ({"handoff_timeout_s": 4000}, "handoff_timeout_s: expected <= 3600, got 4000"),
    ({"storage": "file:/x", "storage_options": {"epoch_refresh_s": 0}},
     "storage_options.epoch_refresh_s: expected > 0, got 0"),
    ({"prefetch_policy": "eager"}, "prefetch_policy: expected one of"),
    ({"copy_cpus": [0, 1 << 16]}, "copy_cpus: expected one or more CPU ids >= 0 and < 65536"),
    ({"storage": "file:/x", "storage_options": {"low_watermark": 1.5}},
     "storage_options.low_watermark: expected <= 1, got 1.5"),
    ({"storage": "file:/x", "storage_options": {"low_watermark": 0}},
     "storage_options.low_watermark: expected > 0, got 0"),
    ({"storage": "file:/x", "storage_options": {"capacity_nbytes": 0}},
     "storage_options.capacity_nbytes: expected >= 1, got 0"),
    ({"storage": "file:/x", "storage_options": {"capacity_nbytes": 1.5}},
     "storage_options.capacity_nbytes: expected an int, got 1.5"),
])
def test_numbers_out_of_range_are_refused_by_name(extra, message):
    with pytest.raises((ValueError, TypeError)) as exc:
        ConnectorConfig.from_extra(extra)
    assert str(exc.value).startswith(f"kv_connector_extra_config.{message}"), str(exc.value)


def test_the_bounds_themselves_are_accepted():
    c = ConnectorConfig.from_extra({"host_gb": 0.5, "host_reserve_gb": 0, "load_threshold_tokens":
                                    (1 << 62) - 1, "storage": "file:/x",
                                    "storage_options": {"low_watermark": 1, "fsync": True}})
    assert c.host_reserve_nbytes == 0 and c.num_host_pages(16, 1 << 20) == 5 * 10**8 // (1 << 20) == 476  # GB
    assert ConnectorConfig(host_tokens=(1 << 62) - 1).host_tokens == (1 << 62) - 1


@pytest.mark.parametrize("name", ["storage_epoch_on_reset", "save_decode",
                                  "producer_reads_storage"])
def test_switches_must_be_bools(name):
    with pytest.raises(TypeError, match=f"{name}: expected a bool, got 'yes'"):
        ConnectorConfig(**{name: "yes"})


@pytest.mark.parametrize("text, message", [
    ("load=0.2,bogus=1", "expected load=, save=, read=, write=, read_delay_ms=, "
     "write_delay_ms=, hang_after=, hang_ms=, seed=, rank= entries, got 'bogus=1'"),
    ("load", "expected load=, save=, read=, write=, read_delay_ms=, write_delay_ms=, "
     "hang_after=, hang_ms=, seed=, rank= entries, got 'load'"),
    ("write=2", "write: expected a fraction in [0, 1], got 2"),
    ("hang_ms=-5", "hang_ms: expected 0 to 600000, got -5"),
    ("hang_after=x", "hang_after: expected a number, got 'x'"),
    ("read_delay_ms=-1", "read_delay_ms: expected 0 to 60000, got -1"),
    ("write_delay_ms=70000", "write_delay_ms: expected 0 to 60000, got 70000"),
    ("read_delay_ms=0.5", "read_delay_ms: expected a number, got '0.5'"),
    ("save=lots", "save: expected a number, got 'lots'"),
    ("read=1.5", "read: expected a fraction in [0, 1], got 1.5"),
    ("seed=0.5", "seed: expected a number, got '0.5'"),
    ("rank=first", "rank: expected a number, got 'first'"),
])
def test_fault_hook_refuses_bad_entries_by_name(text, message):
    from hicache.integrations.vllm.worker.faults import FaultRates

    with pytest.raises(ValueError) as exc:
        FaultRates.parse(text)
    assert str(exc.value) == f"HICACHE_FAULTS: {message}"


def test_fault_hook_is_off_unless_set(monkeypatch):
    from hicache.integrations.vllm.worker.faults import FaultRates

    monkeypatch.delenv("HICACHE_FAULTS", raising=False)
    assert FaultRates.from_env() is None
    monkeypatch.setenv("HICACHE_FAULTS", "load=0.25,seed=3")
    assert FaultRates.from_env() == FaultRates(load=0.25, seed=3)
    monkeypatch.setenv("HICACHE_FAULTS", "load=0.25,rank=1")  # tensor-parallel rank 1 only
    assert FaultRates.from_env(0) is None
    assert FaultRates.from_env(1) == FaultRates(load=0.25, rank=1)


def test_prefetch_defaults_are_sglangs_and_the_budget_is_capped():
    """SGLang HiCache's timeout defaults, 1 s + 0.25 s per 1024 tokens; ours caps the
    budget (prefetch_timeout_max_s). No fixed threshold: the costs decide (costs.py)."""
    c = ConnectorConfig()
    assert (c.prefetch_policy, c.prefetch_threshold_tokens) == ("timeout", None)
    assert ConnectorConfig(prefetch_threshold_tokens=256).prefetch_threshold_tokens == 256
    assert c.prefetch_budget_s(0) == 1.0 and c.prefetch_budget_s(4096) == 2.0
    assert c.prefetch_budget_s(10**9) == 30.0
    for policy in ("best_effort", "wait_complete", "timeout", "sync"):
        assert ConnectorConfig(prefetch_policy=policy).prefetch_policy == policy


def test_fault_hook_read_delay(monkeypatch):
    from hicache.integrations.vllm.worker.faults import FaultRates

    monkeypatch.setenv("HICACHE_FAULTS", "read_delay_ms=7")
    assert FaultRates.from_env() == FaultRates(read_delay_ms=7)
