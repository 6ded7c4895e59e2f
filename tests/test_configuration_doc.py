"""docs/configuration.md lists every option: a field added anywhere must be documented.

The page is the one vocabulary of CacheConfig, the vLLM connector's
kv_connector_extra_config, the HICACHE_* variables and the CLI's sizes; these tests
read the fields from the code, so a new one fails here until the page names it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from hicache.config import CacheConfig, KVConfig
from hicache.integrations.vllm.common.config import ConnectorConfig

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")


def _documented(name: str) -> bool:
    return f"`{name}`" in PAGE


def test_every_cache_config_and_kv_field_is_documented():
    fields = [f.name for f in dataclasses.fields(CacheConfig) if f.name != "kv"]
    fields += [f.name for f in dataclasses.fields(KVConfig)]
    assert [f for f in fields if not _documented(f)] == []


def test_every_connector_option_is_documented():
    fields = [f.name for f in dataclasses.fields(ConnectorConfig)]
    assert [f for f in fields if not _documented(f)] == []


def test_every_hicache_environment_variable_is_documented():
    """Every HICACHE_* name the package reads (the per-field ones by their pattern)."""
    names = set()
    for path in (ROOT / "hicache").rglob("*.py"):
        names |= set(re.findall(r"HICACHE_[A-Z][A-Z_]*[A-Z]", path.read_text(encoding="utf-8")))
    for path in (ROOT / "tests").glob("*.py"):  # HICACHE_REQUIRE_* of the shared test modules
        names |= set(re.findall(r"HICACHE_REQUIRE_[A-Z]+", path.read_text(encoding="utf-8")))
    fields = {f.name.upper() for f in dataclasses.fields(CacheConfig)}
    per_field = {n for n in names if n.removeprefix("HICACHE_") in fields
                 or n.startswith("HICACHE_KV_")}
    missing = sorted(n for n in names - per_field if n not in PAGE)
    assert missing == []
    assert "`HICACHE_<FIELD>`" in PAGE and "`HICACHE_KV_<FIELD>`" in PAGE


def test_host_gb_is_one_unit_in_the_connector_and_on_the_page():
    """host_gb counts 10^9 bytes in CacheConfig and in the connector alike."""
    from hicache.integrations.vllm.common.config import ConnectorConfig

    assert ConnectorConfig(host_gb=1).num_host_pages(1, 1000) == 10**6
    assert "## `host_gb`: one unit" in PAGE and "GB = 10^9 bytes" in PAGE
    assert "GiB = 2^30" not in PAGE


def test_the_config_docstring_links_an_existing_page():
    assert "docs/configuration.md" in CacheConfig.__doc__
