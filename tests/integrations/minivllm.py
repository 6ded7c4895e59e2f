"""A stand-in for vLLM that drives the connector's halves directly, without vLLM.

``MiniVllm`` allocates blocks, asks the scheduler half for hits, runs the worker half
through each step in vLLM's order and "computes" a block by filling it with a value
that identifies its page (a hash of the tokens up to the page's end) and layer. Every
loaded block can be checked against that value (``loaded_ok``): stale or foreign KV
cannot pass. Used by test_vllm_connector.py and test_vllm_connector_device.py.
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import torch

from hicache.integrations.vllm.common.config import ConnectorConfig
from hicache.integrations.vllm.common.plan import StepPlan
from hicache.integrations.vllm.scheduler.half import ScheduledRequest, SchedulerHalf
from hicache.integrations.vllm.worker.half import WorkerHalf
from hicache.integrations.vllm.worker.layout import block_planes

P = 4  # tokens per block (= hicache page)
L = 2  # layers
H, D = 2, 4


def page_value(tokens, page: int, layer: int) -> float:
    data = np.asarray(tokens[: (page + 1) * P], dtype=np.int64).tobytes()
    return float(zlib.crc32(data) % 100_003 + 1 + 200_000 * layer)


def make_kv(layout: str, num_blocks: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    if layout == "fused":  # vLLM's CPU backend: (num_blocks, H, block_size, 2 * D)
        shape = (num_blocks, H, P, 2 * D)
    else:  # split K/V: (2, num_blocks, block_size, H, D)
        shape = (2, num_blocks, P, H, D)
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, device=device)
            for i in range(L)}


def block_of(kv: torch.Tensor, block: int, num_blocks: int) -> list[torch.Tensor]:
    return [p[block] for p in block_planes(kv, num_blocks)]


class Hook:
    """Wraps the worker's copier: delays saves, fails the next load or save."""

    def __init__(self) -> None:
        self.save_delay_s = 0.0
        self.fail_loads = 0
        self.fail_saves = 0
        self.saves_done = 0
        self.inner = None

    def __call__(self, copier):
        self.inner = copier
        return self

    @property
    def num_layers(self) -> int:
        return self.inner.num_layers

    def load(self, host_ids, block_ids, first, last):
        if self.fail_loads:
            self.fail_loads -= 1
            raise RuntimeError("injected load failure")
        self.inner.load(host_ids, block_ids, first, last)

    def backup(self, block_ids, host_ids, first, last):
        time.sleep(self.save_delay_s)
        if self.fail_saves:
            self.fail_saves -= 1
            raise RuntimeError("injected save failure")
        self.inner.backup(block_ids, host_ids, first, last)
        if last == self.inner.num_layers:
            self.saves_done += 1


class MiniVllm:
    """Just enough of vLLM's scheduler and model runner to drive both halves."""

    def __init__(self, *, num_blocks=16, num_host_pages=8, layout="fused", storage=None,
                 native=None, tree="python", executor="thread", device="cpu", **extra):
        # "thread" (not the CPU default, "sync") unless a test asks: most tests here need
        # copies still in flight at the next step, which only a copy thread leaves.
        # The stand-in never asks a lookup again (vLLM's answer to None): third-tier hits
        # are read in the step ("sync") unless a test asks for a prefetch policy.
        extra.setdefault("prefetch_policy", "sync")
        cfg = ConnectorConfig(tree=tree, storage=storage, executor=executor, **extra)
        self.num_blocks = num_blocks
        self.kv = make_kv(layout, num_blocks, device)  # device: test_vllm_connector_device.py
        self.hook = Hook()
        fingerprint, model_id = "test-layout", "tiny"
        s_backend = w_backend = None
        if storage is not None:
            from hicache.storage import make_storage

            nbytes = L * 2 * H * D * P * 4
            s_backend = make_storage(storage, page_nbytes=nbytes)
            w_backend = make_storage(storage, page_nbytes=nbytes)
        self.sched = SchedulerHalf(cfg, block_size=P, num_host_pages=num_host_pages,
                                   storage_backend=s_backend,
                                   storage_identity=(fingerprint, model_id))
        self.worker = WorkerHalf(cfg, self.kv, num_blocks=num_blocks, block_size=P,
                                 num_host_pages=num_host_pages, storage_backend=w_backend,
                                 native=native, copier_hook=self.hook)
        self.free = list(range(num_blocks))
        self.reqs: dict[str, dict] = {}
        self.pending: list[ScheduledRequest] = []
        self.finished_ids: set[str] = set()  # since the last step
        self.last_errors: set[int] = set()
        self.plans: list[StepPlan] = []
        self.report_bad = True

    def add(self, rid: str, tokens: list[int], own: int = 0) -> int:
        """Schedule a new request; returns the tokens hicache will load.

        ``own``: tokens vLLM's own prefix cache serves (whole blocks, filled here)."""
        ext = self.sched.num_matched_tokens(rid, tokens, own)
        blocks = [self.free.pop(0) for _ in range(-(-len(tokens) // P))]
        for page in range(own // P):
            self.fill(tokens, blocks[page], page)
        self.sched.after_alloc(rid, tokens, blocks, ext)
        self.reqs[rid] = {"tokens": tokens, "blocks": blocks, "ext": ext, "own": own}
        self.pending.append(
            ScheduledRequest(rid, tokens, blocks, True, own + ext, len(tokens) - own - ext))
        return ext

    def preempt(self, rid: str) -> None:
        """vLLM frees a preempted request's blocks at once; they are reused first."""
        r = self.reqs[rid]
        self.free = r["blocks"] + self.free
        r["blocks"] = []

    def finish(self, rid: str, num_computed: int | None = None) -> None:
        """vLLM frees a finished request's blocks at once (the connector never delays it)."""
        r = self.reqs[rid]
        blocks = r["blocks"] if num_computed is not None else None
        self.sched.request_finished(rid, num_computed, blocks)
        self.free += self.reqs.pop(rid)["blocks"]
        self.finished_ids.add(rid)

    def step(self) -> StepPlan:
        plan = self.sched.build_plan(self.pending)
        self.plans.append(plan)
        scheduled, self.pending = self.pending, []
        w = self.worker
        w.begin_step(plan)
        w.start_loads(plan)
        for name in self.kv:
            w.wait_layer(name)
        for s in scheduled:  # the forward: compute every block not loaded
            r = self.reqs[s.req_id]
            for page in range(s.num_computed_tokens // P, len(r["blocks"])):
                self.fill(r["tokens"], r["blocks"][page], page)
        w.end_step(plan)
        w.finished(self.finished_ids)
        self.finished_ids = set()
        self.last_errors = w.load_errors()
        if self.report_bad:  # vLLM hands the worker metadata to the scheduler
            self.sched.mark_bad(w.take_bad_pages())
        return plan

    def fill(self, tokens, block: int, page: int) -> None:
        for i, kv in enumerate(self.kv.values()):
            for plane in block_of(kv, block, self.num_blocks):
                plane.fill_(page_value(tokens, page, i))

    def loaded_ok(self, rid: str) -> bool:
        """Every block hicache loaded for ``rid`` holds the KV of its page."""
        r = self.reqs[rid]
        for page in range(r["own"] // P, (r["own"] + r["ext"]) // P):
            block = r["blocks"][page]
            if block in self.last_errors:
                return False
            for i, kv in enumerate(self.kv.values()):
                for plane in block_of(kv, block, self.num_blocks):
                    if not torch.all(plane == page_value(r["tokens"], page, i)):
                        return False
        return True

    def check(self) -> None:
        self.sched.check_integrity()
        if not self.sched._early_saves:
            assert not self.sched.pins, "pins must not outlive a step"

    def quiesce(self) -> None:
        self.worker.drain()
        if self.report_bad:
            self.sched.mark_bad(self.worker.take_bad_pages())
        self.check()
        assert self.worker.num_in_flight == 0
        assert self.worker.transfers.num_in_flight == 0

    def close(self) -> None:
        self.worker.close()
        self.sched.close()


def seq(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))
