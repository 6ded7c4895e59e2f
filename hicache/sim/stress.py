"""``hicache stress``: many concurrent requests against a small, constantly evicting cache.

The regime: a device pool far smaller than the working set (every few requests
evict), a host tier, the CPU worker-thread executor with random delays before
every page copy and random copy failures, and several requests in flight at once,
interleaved step by step in one engine loop (match, wait for loads, allocate,
compute, insert, release). Every request writes real KV (:mod:`hicache.sim.kvcheck`)
and every read is verified: the prefix a request gets after its loads, its whole
sequence after insert, and periodically every readable page of the cache.

Fault and delay injection is a test hook, not a feature of the engine:
:class:`FaultyCopier` wraps the executor's :class:`~hicache.memory.PageCopier` and
:func:`install_copier` puts it in place (the thread and manual executors call
their copier's ``load``/``backup`` for every layer range they move).

``evictions_blocked_by_io`` counts device evictions during which an idle device
leaf (unlocked, no device child) could not be taken because its IO was in
flight, and that made the eviction come up short or take a more recently used
node instead. The last stdout line is one JSON object (with ``--json``, the only
one); the exit status is 1
when a corruption, leak, invariant violation or unexpected error was seen.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import traceback

import torch

from hicache.cache import HiCache, PrefixHandle
from hicache.cli.args import (
    Parser,
    UsageError,
    add_json,
    add_metrics_port,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    probability,
    run_guarded,
    start_metrics,
)
from hicache.config import CacheConfig, EvictionPolicy, KVConfig
from hicache.memory import PageCopier
from hicache.sim import kvcheck
from hicache.transfer import ManualExecutor, ThreadExecutor
from hicache.tree import IOStatus, TreeNode


class InjectedFault(RuntimeError):
    """A copy failure injected by :class:`FaultyCopier`."""


class FaultyCopier:
    """A page copier that sleeps a random time before each copy and sometimes fails.

    ``fault_rate`` is the probability that one ``load``/``backup`` call (one layer
    of a transfer on the thread executor) raises :class:`InjectedFault` instead of
    copying; earlier layers of the same transfer have landed, later ones will not.
    A worker and a caller blocked in ``wait`` may copy (different transfers) at the
    same time, so the RNGs and counters are guarded by a lock.
    """

    def __init__(self, inner: PageCopier, seed: int, fault_rate: float = 0.0,
                 max_delay_s: float = 0.0) -> None:
        if not 0.0 <= fault_rate <= 1.0:
            raise ValueError(f"fault_rate: expected 0 <= rate <= 1, got {fault_rate}")
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s: expected >= 0, got {max_delay_s}")
        self.inner = inner
        self.fault_rate = fault_rate
        self.max_delay_s = max_delay_s
        self._rng = {"load": random.Random(seed * 2 + 1), "backup": random.Random(seed * 2 + 2)}
        self.num_faults = {"load": 0, "backup": 0}
        self._lock = threading.Lock()

    @classmethod
    def wrap(cls, cache: HiCache, seed: int, fault_rate: float = 0.0,
             max_delay_s: float = 0.0) -> FaultyCopier:
        """A FaultyCopier around ``cache``'s current copier (install it with install_copier)."""
        return cls(_executor(cache)._copier, seed, fault_rate, max_delay_s)

    @property
    def faults_injected(self) -> int:
        return self.num_faults["load"] + self.num_faults["backup"]

    def _before(self, direction: str) -> None:
        with self._lock:
            rng = self._rng[direction]
            delay_s = rng.uniform(0.0, self.max_delay_s) if self.max_delay_s else 0.0
            fault = bool(self.fault_rate) and rng.random() < self.fault_rate
            if fault:
                self.num_faults[direction] += 1
        if delay_s:
            time.sleep(delay_s)
        if fault:
            raise InjectedFault(f"injected {direction} fault")

    def load(self, host_ids: torch.Tensor, device_ids: torch.Tensor, first: int, last: int):
        self._before("load")
        self.inner.load(host_ids, device_ids, first, last)

    def backup(self, device_ids: torch.Tensor, host_ids: torch.Tensor, first: int, last: int):
        self._before("backup")
        self.inner.backup(device_ids, host_ids, first, last)


def _executor(cache: HiCache) -> ThreadExecutor | ManualExecutor:
    ex = cache.transfers.executor
    if not isinstance(ex, ThreadExecutor | ManualExecutor):
        raise ValueError(
            f"copier hook: expected the 'thread' or 'manual' executor, got {cache.transfers.executor_name!r}"
        )
    return ex


def install_copier(cache: HiCache, copier: FaultyCopier) -> FaultyCopier:
    """Make ``cache``'s CPU executor move pages through ``copier`` from now on (test hook)."""
    _executor(cache)._copier = copier
    return copier


class EvictionProbe:
    """Counts device evictions held back by IO in flight (see the module docstring).

    Wraps ``cache.tree.evict_device`` on this one tree instance; scans the tree
    before and after each eviction, so it is for stress runs, not production.
    """

    def __init__(self, cache: HiCache) -> None:
        self.tree = cache.tree
        self.num_evictions = 0
        self.num_blocked_by_io = 0
        self._evict = cache.tree.evict_device
        self.tree.evict_device = self._probe  # instance attribute: only this tree

    def _device_leaves(self) -> tuple[list[TreeNode], dict[TreeNode, int]]:
        busy, on_device = [], {}
        for node in self.tree.nodes():
            if node.device_indices is None:
                continue
            on_device[node] = node.last_access
            if node.io_status is not IOStatus.NONE and not node.lock_ref and not any(
                c.device_indices is not None for c in node.children.values()
            ):
                busy.append(node)
        return busy, on_device

    def _probe(self, num_tokens, backup=None):
        busy, before = self._device_leaves()
        result = self._evict(num_tokens, backup)
        self.num_evictions += 1
        if busy:
            short = result.num_evicted_tokens + result.num_backup_tokens < num_tokens
            newest_taken = max(
                (t for n, t in before.items() if n.device_indices is None
                 or n.io_status is IOStatus.BACKING_UP and n not in busy),
                default=-1,
            )
            if short or min(n.last_access for n in busy) < newest_taken:
                self.num_blocked_by_io += 1
        return result


class _Request:
    __slots__ = ("h", "tokens", "ns", "stage", "tries", "conv")

    def __init__(self, h: PrefixHandle, tokens: list[int], ns: str, conv: int) -> None:
        self.h = h
        self.tokens = tokens
        self.ns = ns
        self.stage = 0  # 0 matched, 1 computed, 2 inserted
        self.tries = 0
        self.conv = conv


class StressRun:
    """One stress run; :meth:`run` returns the report dict (the JSON line)."""

    def __init__(self, args: argparse.Namespace, metrics=None) -> None:
        self.args = args
        self.metrics = metrics  # a hicache.metrics.CacheMetrics, or None
        self.rng = random.Random(args.seed)
        kv = KVConfig(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16",
                      page_size=args.page_size)
        self.P = kv.page_size
        cfg = CacheConfig(
            kv, device_tokens=args.device_pages * self.P, host_tokens=args.host_pages * self.P,
            executor="thread", host_reserve_nbytes=0, write_policy=args.write_policy,
            eviction=args.eviction,
        )
        self.cache = HiCache(cfg)
        self.copier = install_copier(
            self.cache,
            FaultyCopier.wrap(self.cache, args.seed, args.fault_rate, args.max_delay_ms / 1e3),
        )
        self.probe = EvictionProbe(self.cache)
        if metrics is not None:
            metrics.track(self.cache, "stress")
        self.live: list[_Request] = []
        self.systems = [self._tokens(self.rng.randrange(2, 6) * self.P) for _ in range(3)]
        self.histories: list[list[int]] = [[] for _ in range(args.conversations)]
        self.counts = dict(requests=0, aborted=0, corruptions=0, invariant_violations=0,
                           errors=0, verified_tokens=0)
        self.error_lines: list[str] = []

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1000) for _ in range(n)]

    # ------------------------------------------------------------------ workload
    def _new_request(self) -> None:
        conv = self.rng.randrange(len(self.histories))
        ns = f"tenant-{conv % 3}"
        hist = self.histories[conv]
        if not hist or len(hist) > self.args.max_tokens:
            hist = self.systems[conv % len(self.systems)] + self._tokens(self.rng.randrange(1, 9))
        tokens = hist + self._tokens(self.rng.randrange(1, 3 * self.P))
        h = self.cache.match(tokens, ns)
        self.live.append(_Request(h, tokens, ns, conv))

    def _verify(self, req: _Request, end: int) -> None:
        bad = kvcheck.verify_kv(self.cache.device_pool, req.h.page_table(), req.tokens, end,
                                req.ns)
        self.counts["verified_tokens"] += end
        if bad:
            self.counts["corruptions"] += 1
            self._note(f"corrupt KV read by a request at positions {bad[:8]}")

    def _advance(self, req: _Request) -> None:
        cache, h = self.cache, req.h
        if req.stage == 0:
            cache.finish_loads(h)  # False: a load failed, h.prefix_len was cut back
            self._verify(req, h.prefix_len)
            prefix_len = h.prefix_len
            missing = len(req.tokens) - prefix_len - h.num_owned_pages * self.P
            if missing > 0 and cache.alloc(h, missing) is None:
                req.tries += 1
                if req.tries > 3:  # the others hold the pool: give up, as a scheduler would
                    self._finish(req, aborted=True)
                return
            if h.prefix_len != prefix_len or (
                h.prefix_len + h.num_owned_pages * self.P < len(req.tokens)
            ):
                return  # cut back by a failure applied during alloc: allocate again
            kvcheck.write_kv(cache.device_pool, h.page_table(), req.tokens, h.prefix_len,
                             len(req.tokens), req.ns)
            req.stage = 1
        elif req.stage == 1:
            cache.insert(h, req.tokens)
            cache.finish_loads(h)  # insert may have joined a load of the same prefix
            self._verify(req, min(len(req.tokens), h.prefix_len + h.num_owned_pages * self.P))
            req.stage = 2
            if self.rng.random() < 0.5:  # done right after prefill: its backup still copies
                self._advance(req)
        else:
            self.histories[req.conv] = req.tokens + self._tokens(self.rng.randrange(1, 4 * self.P))
            self._finish(req, aborted=False)

    def _finish(self, req: _Request, aborted: bool) -> None:
        self.live.remove(req)
        self.cache.release(req.h)
        self.counts["requests"] += 1
        self.counts["aborted"] += aborted

    def _note(self, line: str) -> None:
        if len(self.error_lines) < 10:
            self.error_lines.append(line)

    def _check(self, full: bool) -> None:
        try:
            self.cache.check_integrity()
        except AssertionError as exc:
            self.counts["invariant_violations"] += 1
            self._note(f"invariant: {exc}")
        if full:
            problems = kvcheck.verify_cache(self.cache)
            self.counts["corruptions"] += len(problems)
            for p in problems:
                self._note(f"corrupt cached KV: {p}")

    # ----------------------------------------------------------------------- run
    def run(self) -> dict:
        args = self.args
        deadline = time.perf_counter() + args.seconds
        step = 0
        while time.perf_counter() < deadline:
            step += 1
            try:
                if len(self.live) < args.concurrency and (
                    not self.live or self.rng.random() < 0.4
                ):
                    self._new_request()
                else:
                    self._advance(self.rng.choice(self.live))
                if self.rng.random() < 0.1:  # abort a request mid-flight now and then
                    if self.live and self.rng.random() < 0.2:
                        self._finish(self.rng.choice(self.live), aborted=True)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                self.counts["errors"] += 1
                self._note("error: " + "".join(traceback.format_exception_only(exc)).strip())
                if self.counts["errors"] == 1:
                    traceback.print_exc(file=sys.stderr)
            self._check(full=step % args.verify_every == 0)
            if self.metrics is not None and step % args.verify_every == 0:
                self.metrics.update()  # stats() polls: only when metrics were asked for
        return self._quiesce(step)

    def _quiesce(self, steps: int) -> dict:
        cache = self.cache
        try:
            for req in list(self.live):
                cache.finish_loads(req.h)
                self._finish(req, aborted=True)
            cache.wait_all()
        except Exception as exc:  # noqa: BLE001
            self.counts["errors"] += 1
            self._note(f"error at quiescence: {exc!r}")
        self._check(full=True)
        s = cache.stats()
        P = self.P
        leaked = abs(s["device_pages_used"] - s["device_cached_tokens"] // P) + abs(
            s["host_pages_used"] - s["host_cached_tokens"] // P
        )
        if self.metrics is not None:
            self.metrics.untrack("stress")
        cache.close()
        return {
            "requests": self.counts["requests"],
            "loads": s["loads"],
            "backups": s["backups"],
            "evictions_blocked_by_io": self.probe.num_blocked_by_io,
            "faults_injected": self.copier.faults_injected,
            "corruptions": self.counts["corruptions"],
            "leaked_pages": leaked,
            "invariant_violations": self.counts["invariant_violations"],
            "errors": self.counts["errors"],
            "aborted": self.counts["aborted"],
            "loads_failed": s["loads_failed"],
            "backups_failed": s["backups_failed"],
            "backups_skipped": s["backups_skipped"],
            "evictions": self.probe.num_evictions,
            "device_evicted_tokens": s["device_evicted_tokens"],
            "host_evicted_tokens": s["host_evicted_tokens"],
            "verified_tokens": self.counts["verified_tokens"],
            "steps": steps,
            "seconds": self.args.seconds,
            "seed": self.args.seed,
            "write_policy": self.args.write_policy,
            "eviction": self.args.eviction,
            "first_problems": self.error_lines,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=positive_float, default=30.0,
                        help="how long to issue requests")
    parser.add_argument("--seed", type=nonneg_int, default=0,
                        help="seeds the workload, the delays and the faults")
    add_json(parser)
    parser.add_argument("--concurrency", type=positive_int, default=6,
                        help="requests in flight at once")
    parser.add_argument("--write-policy", default="write_through",
                        choices=["write_through", "write_through_selective", "write_back"],
                        help="when a device page gets its host copy")
    parser.add_argument("--eviction", default="lfu", choices=[p.value for p in EvictionPolicy],
                        help="lfu (default) evicts once-hit nodes first: fresh loads and backups, the "
                        "nodes with IO in flight, are then the first candidates")
    parser.add_argument("--fault-rate", type=probability, default=0.02,
                        help="probability that one page copy call fails")
    parser.add_argument("--max-delay-ms", type=nonneg_float, default=2.0,
                        help="random delay before each page copy, up to this")
    parser.add_argument("--page-size", type=positive_int, default=4, help="tokens per page")
    parser.add_argument("--device-pages", type=positive_int, default=96,
                        help="device pool pages (small, so that requests keep evicting; at least "
                        "the pages of the longest request)")
    parser.add_argument("--host-pages", type=positive_int, default=112, help="host pool pages")
    parser.add_argument("--conversations", type=positive_int, default=24,
                        help="conversations the requests continue, in three namespaces")
    parser.add_argument("--max-tokens", type=positive_int, default=96,
                        help="a conversation longer than this starts over")
    parser.add_argument("--verify-every", type=positive_int, default=25,
                        help="verify every readable page of the cache each N steps")
    add_metrics_port(parser)


def longest_request_tokens(args: argparse.Namespace) -> int:
    """The longest prompt :class:`StressRun` can issue (see ``_new_request``)."""
    P = args.page_size
    restarted = 5 * P + 8  # the longest system prompt plus the longest task
    continued = args.max_tokens  # a history this long is still continued
    return max(restarted, continued) + 3 * P - 1


def check_args(args: argparse.Namespace) -> None:
    """Refuse a run that cannot test anything (every request would be aborted)."""
    need = -(-longest_request_tokens(args) // args.page_size)
    if args.device_pages < need:
        raise UsageError(
            f"--device-pages: expected at least {need} (the pages of the longest request, "
            f"{longest_request_tokens(args)} tokens), got {args.device_pages}"
        )


def run(args: argparse.Namespace) -> int:
    check_args(args)
    metrics = start_metrics(args, "hicache stress")
    try:
        report = StressRun(args, metrics).run()
    finally:
        if metrics is not None:
            metrics.close()
    for line in report.pop("first_problems"):
        print(line, file=sys.stderr)
    if not args.json:
        width = max(len(k) for k in report)
        for key, value in report.items():
            print(f"{key:<{width}}  {value}")
    ok = (
        report["corruptions"] == 0 and report["leaked_pages"] == 0
        and report["invariant_violations"] == 0 and report["errors"] == 0
    )
    print(json.dumps(report))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="hicache stress", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_guarded(run, parser.parse_args(argv), parser.prog)


if __name__ == "__main__":
    sys.exit(main())
