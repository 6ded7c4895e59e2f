"""Many concurrent requests against a small, constantly evicting cache, every KV read verified.

The regime: a device pool far smaller than the working set (every few requests
evict), a host tier, the CPU worker-thread executor with random delays before
every page copy and random copy failures (:mod:`hicache.sim.faults`), and several
requests in flight at once, interleaved step by step in one engine loop (match,
wait for loads, allocate, compute, insert, release). Every request writes real KV
(:mod:`hicache.sim.kvcheck`) and every read is verified: the prefix a request gets
after its loads, its whole sequence after insert, and periodically every readable
page of the cache.

With ``components`` (a hybrid model's layout, :mod:`hicache.components`, e.g.
``"window:9,state"``) every request also writes its window pages and the state
checkpoints it asks for (at its inserted length and at its full-attention match), as
a hybrid model's forward does, and every read checks the window pages a hit reads
and the checkpoint it starts from; the periodic check covers every component page.

``evictions_blocked_by_io`` in the report counts device evictions held back by IO
in flight (:class:`~hicache.sim.faults.EvictionProbe`). The ``hicache stress``
command around :class:`StressRun` is :mod:`hicache.cli.stress`.
"""

from __future__ import annotations

import random
import time
import traceback
from dataclasses import dataclass

from hicache.cache import HiCache, PrefixHandle
from hicache.checks import check_fraction, check_int, check_positive_number, check_seconds
from hicache.components import describe_components, parse_components
from hicache.config import CacheConfig, KVConfig
from hicache.sim import kvcheck
from hicache.sim.faults import EvictionProbe, FaultyCopier, install_copier


@dataclass(frozen=True)
class StressOptions:
    """The shape of one stress run (the ``hicache stress`` options, same names and defaults)."""

    seconds: float = 30.0  # how long to issue requests
    seed: int = 0  # seeds the workload, the delays and the faults
    concurrency: int = 6  # requests in flight at once
    write_policy: str = "write_through"
    eviction: str = "lfu"
    fault_rate: float = 0.02  # probability that one page copy call fails
    max_delay_ms: float = 2.0  # random delay before each page copy, up to this
    page_size: int = 4  # tokens per page
    device_pages: int = 96  # small, so that requests keep evicting
    host_pages: int = 112
    conversations: int = 24  # conversations the requests continue, in three namespaces
    max_tokens: int = 96  # a conversation longer than this starts over
    verify_every: int = 25  # verify every readable page of the cache each N steps
    components: str = ""  # a hybrid model's window and state components ("": none)

    def __post_init__(self) -> None:
        # The bounds of the command line's options (write_policy and eviction are
        # checked by CacheConfig when the run builds its cache).
        check_positive_number("seconds", self.seconds)
        check_int("seed", self.seed)
        for name in ("concurrency", "page_size", "device_pages", "host_pages",
                     "conversations", "max_tokens", "verify_every"):
            check_int(name, getattr(self, name), minimum=1)
        check_fraction("fault_rate", self.fault_rate)
        check_seconds("max_delay_ms", self.max_delay_ms)
        if not isinstance(self.components, str):
            raise TypeError(
                f"components: expected a text like 'window:9,state', got "
                f"{type(self.components).__name__}")
        parse_components(self.components)

    def kv_config(self) -> KVConfig:
        """The KV layout the run's cache holds."""
        return KVConfig(num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16",
                        page_size=self.page_size, components=self.components)


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
    """One stress run; :meth:`run` returns the report dict (the JSON line).

    ``metrics``: a :class:`hicache.metrics.CacheMetrics` that tracks the cache while
    it runs, or None. The run prints nothing: its problems are the report's
    ``first_problems`` and :attr:`first_traceback`.
    """

    def __init__(self, args: StressOptions, metrics=None) -> None:
        self.args = args
        self.metrics = metrics  # a hicache.metrics.CacheMetrics, or None
        self.rng = random.Random(args.seed)
        kv = args.kv_config()
        self.P = kv.page_size
        self.specs = kv.component_specs
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
                           errors=0, verified_tokens=0, verified_component_reads=0)
        self.error_lines: list[str] = []
        self.first_traceback: str | None = None  # of the first unexpected error, for stderr

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
        pool = self.cache.device_pool
        assert pool is not None, "a stress run's cache holds KV"
        bad = kvcheck.verify_kv(pool, req.h.page_table(), req.tokens, end, req.ns)
        self.counts["verified_tokens"] += end
        if bad:
            self.counts["corruptions"] += 1
            self._note(f"corrupt KV read by a request at positions {bad[:8]}")
        if self.specs:
            for line in self._verify_components(req, end):
                self.counts["corruptions"] += 1
                self._note(line)

    def _verify_components(self, req: _Request, end: int) -> list[str]:
        """What of the request's window pages up to ``end`` (from the window before its
        prefix's end on: what its first computed token reads) and its checkpoints
        differs from the expected: one line each."""
        h, pool, P = req.h, self.cache.device_pool, self.P
        assert pool is not None, "a stress run's cache holds KV"
        out = []
        for c, spec in enumerate(self.specs):
            if spec.is_window:
                table = h.window_table(c)
                lo = max(0, h.prefix_len // P - spec.window_pages(P)) * P
                if not bool((table[lo // P : -(-end // P)] >= 0).all()):
                    out.append(f"a window page of component {c} in [{lo}, {end}) is missing")
                    continue
                bad = kvcheck.verify_window(pool, table, req.tokens, lo, end, req.ns, c)
                self.counts["verified_component_reads"] += -(-end // P) - lo // P
                if bad:
                    out.append(f"corrupt window KV of component {c} at positions {bad[:8]}")
                continue
            state = h.state_pages(c)
            if h.prefix_len and state.read is None:
                out.append(f"no checkpoint of component {c} at the prefix's end")
            elif state.read is not None:
                self.counts["verified_component_reads"] += 1
                if not kvcheck.verify_state(pool, state.read, req.tokens, h.prefix_len,
                                            req.ns, c):
                    out.append(f"a wrong checkpoint of component {c} at {h.prefix_len}")
            for pos, ids in state.checkpoints.items():
                if pos <= end and not kvcheck.verify_state(pool, ids, req.tokens, pos, req.ns, c):
                    out.append(f"a wrong checkpoint of component {c} written at {pos}")
        return out

    def _write(self, req: _Request) -> None:
        """Write the request's KV past its prefix (and its window pages and checkpoints)."""
        h, pool = req.h, self.cache.device_pool
        assert pool is not None, "a stress run's cache holds KV"
        start, end = h.prefix_len, len(req.tokens)
        kvcheck.write_kv(pool, h.page_table(), req.tokens, start, end, req.ns)
        for c, spec in enumerate(self.specs):
            if spec.is_window:
                kvcheck.write_window(pool, h.window_table(c), req.tokens, start, end, req.ns, c)
                continue
            for pos, ids in h.state_pages(c).checkpoints.items():
                kvcheck.write_state(pool, ids, req.tokens, pos, req.ns, c)

    def _marks(self, req: _Request, missing: int) -> list[int]:
        """The checkpoints a hybrid request asks for: at the length its insert caches and
        at its full-attention match, within what this alloc gives it."""
        if all(spec.is_window for spec in self.specs):
            return []  # (no state component: nothing to checkpoint)
        h, P = req.h, self.P
        high = h.prefix_len + P * (h.num_owned_pages + -(-missing // P))
        end = len(req.tokens) // P * P
        return sorted(p for p in {end, h.full_len} if h.prefix_len < p <= min(end, high))

    def _advance(self, req: _Request) -> None:
        cache, h = self.cache, req.h
        if req.stage == 0:
            cache.finish_loads(h)  # False: a load failed, h.prefix_len was cut back
            self._verify(req, h.prefix_len)
            prefix_len = h.prefix_len
            missing = len(req.tokens) - prefix_len - h.num_owned_pages * self.P
            if missing > 0 and cache.alloc(
                    h, missing, checkpoints=self._marks(req, missing)) is None:
                req.tries += 1
                if req.tries > 3:  # the others hold the pool: give up, as a scheduler would
                    self._finish(req, aborted=True)
                return
            if h.prefix_len != prefix_len or (
                h.prefix_len + h.num_owned_pages * self.P < len(req.tokens)
            ):
                return  # cut back by a failure applied during alloc: allocate again
            self._write(req)
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
                    self.first_traceback = traceback.format_exc()
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
        # (a hybrid model's component pages share the tiers' page space)
        leaked = sum(
            abs(s[f"{t}_pages_used"] - s[f"{t}_cached_tokens"] // P
                - s.get(f"{t}_component_pages", 0))
            for t in ("device", "host"))
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
            # hybrid layouts: window pages and checkpoints a request read, verified
            "verified_component_reads": self.counts["verified_component_reads"],
            "steps": steps,
            "seconds": self.args.seconds,
            "seed": self.args.seed,
            "write_policy": self.args.write_policy,
            "eviction": self.args.eviction,
            "components": describe_components(self.specs),
            "first_problems": self.error_lines,
        }


def longest_request_tokens(args: StressOptions) -> int:
    """The longest prompt :class:`StressRun` can issue (see ``_new_request``)."""
    P = args.page_size
    restarted = 5 * P + 8  # the longest system prompt plus the longest task
    continued = args.max_tokens  # a history this long is still continued
    return max(restarted, continued) + 3 * P - 1
