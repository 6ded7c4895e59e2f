"""A random-call fuzzer of the native tree against the Python tree (issue 31).

Seeded random sequences of every tree call, with nodes picked from everything
seen so far (stale handles included) and hooks that call back into the tree:
``on_split`` hooks that read, that try a call they may not make (and catch the
refusal), or that raise; backup hooks that decline, back up (host room made by
``evict_host``), try a refused call, or raise. After every call both trees must
agree on the outcome (result, or exception type and message), pass their
integrity checks and hold the same state.

The default run is short (a few seconds). ``HICACHE_FUZZ_SECONDS`` runs seeds
until that many seconds have passed: ``make sanitize`` does so with the
extension built under AddressSanitizer and UndefinedBehaviorSanitizer, which is
what finds memory errors that leave no visible trace in a normal build.
"""

from __future__ import annotations

import os
import random
import time

import torch
from optional import skip_unless
from tree_observation import snapshot

from hicache.components import ComponentSpec
from hicache.tree import IOStatus, make_tree, token_key

pytestmark = skip_unless("native")

P = 2
# Namespaces come and go (a namespace's root is freed once it holds nothing: issue 46);
# bad ones (and bad counts, components and tiers) are drawn now and then, for every
# component call (issue 45, case 5): both trees must raise the same.
NAMESPACES = [None, "b", "c", "d"]
BAD_NAMESPACES = [[], 5, "\ud800", b"b", ("b",)]
BAD_COUNTS = [-1, 2**64, 2**63, -(2**64), True, 1.5, "3", None]
POLICIES = ["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]


class Side:
    """One tree and the hooks installed on it, driven by a shared choice stream."""

    def __init__(self, tree, rng_state) -> None:
        self.tree = tree
        self.rng = random.Random()
        self.rng.setstate(rng_state)  # both sides draw the same hook choices
        self.log: list = []
        self.next_host = 100_000

    def host_pages(self, n: int) -> torch.Tensor:
        start = self.next_host
        self.next_host += n
        return torch.arange(start, start + n, dtype=torch.int64)

    def on_split(self, kind: str):
        tree, log = self.tree, self.log
        if kind == "none":
            return None
        if kind == "read":
            return lambda p, s: log.append(("split", p.id, s.id, len(tree.path_to(s)), s.num_tokens))
        if kind == "refused":
            def refused(p, s):
                try:
                    tree.evict_host(2) if self.rng.random() < 0.5 else tree.match_prefix([0, 0])
                except RuntimeError as exc:
                    log.append(("refused", str(exc)))
            return refused

        def boom(p, s):
            raise KeyError("on_split failed")
        return boom

    def backup(self, kind: str):
        tree, log = self.tree, self.log
        if kind == "none":
            return None

        def hook(node):
            log.append(("offered", node.id))
            choice = kind if kind != "mixed" else self.rng.choice(["decline", "back_up", "refused"])
            if choice == "decline":
                return False
            if choice == "refused":
                tree.insert([0, 0], torch.tensor([0]))  # raises: propagates out of the eviction
            if choice == "raise":
                raise KeyError("backup failed")
            n = node.num_tokens // P
            log.append(("made room", tree.evict_host(2 * n).page_ids.tolist()))
            tree.attach_host(node, self.host_pages(n))
            tree.set_io_status(node, IOStatus.BACKING_UP)
            return True
        return hook


def summary(value):
    """What of a result both trees must agree on (nodes by id, tensors as lists)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple | list):
        return [summary(v) for v in value]
    if hasattr(value, "id") and hasattr(value, "num_tokens"):
        return ("node", value.id)
    return value


def call(fn, *args):
    try:
        return "ok", summary(fn(*args))
    except (ValueError, TypeError, RuntimeError, KeyError) as exc:
        return "raise", type(exc).__name__, str(exc)


def _component_ids(node, specs, c: int, step: int) -> torch.Tensor | None:
    """Ids for component ``c`` of ``node`` (its pages' worth for a window, one checkpoint)."""
    if node is None or not specs:
        return None
    spec = specs[c if type(c) is int and 0 <= c < len(specs) else 0]  # (a bad c: any ids)
    n = node.num_tokens // P * spec.width if spec.is_window else spec.width
    return torch.arange(n) + 700_000 + 100 * step


def _ids(node, base: int) -> torch.Tensor | None:
    """Page ids for every page of ``node`` (None without a node)."""
    return None if node is None else torch.arange(node.num_tokens // P) + base


# Component sets a hybrid run draws from (hybrid models: docs/design.md).
COMPONENT_SETS = (
    (ComponentSpec("window", window_tokens=3),),
    (ComponentSpec("state"),),
    (ComponentSpec("window", window_tokens=6, width=2), ComponentSpec("state")),
    (ComponentSpec("window", window_tokens=3), ComponentSpec("state", width=2),
     ComponentSpec("window", window_tokens=8)),
)


def component_ids(rng: random.Random, spec: ComponentSpec, num_pages: int, base: int):
    """A component's ids along a key (some pages not given), or None."""
    if rng.random() < 0.2:
        return None
    ids = torch.arange(base, base + num_pages * spec.width).view(num_pages, spec.width)
    for page in range(num_pages):
        if rng.random() < (0.2 if spec.is_window else 0.5):
            ids[page] = -1
    return ids.reshape(-1)


def run_seed(seed: int, steps: int, hybrid: bool = False) -> None:
    rng = random.Random(seed)
    policy = rng.choice(POLICIES)
    specs = rng.choice(COMPONENT_SETS) if hybrid else ()
    hook_rng = random.Random(seed + 1).getstate()
    py = Side(make_tree("python", P, policy, components=specs), hook_rng)
    nat = Side(make_tree("native", P, policy, components=specs), hook_rng)
    seen: list[tuple] = []  # (python node, native node), stale ones included
    locked: list[tuple] = []  # pairs locked once per entry (unlock takes only these)
    next_page = 0

    def tokens() -> list[int]:
        return [rng.randrange(3) for _ in range(rng.randrange(0, 11))]

    for step in range(steps):
        split_kind = rng.choice(["none", "none", "read", "refused", "raise"])
        for side in (py, nat):
            side.tree.on_split = side.on_split(split_kind)
        pick = seen[rng.randrange(len(seen))] if seen else None
        if op_unlock := (rng.random() < 0.05 and locked):
            pick = locked.pop(rng.randrange(len(locked)))
        op = rng.choice(
            ["match", "insert", "insert", "insert_host", "probe", "lock", "unlock", "host_lock",
             "host_unlock", "io", "attach_host", "attach_device", "detach_host", "detach_device",
             "evict_device", "evict_device", "evict_host", "priority", "path", "indices",
             "prune", "probe_hit", "counts"]
            + (["attach_c", "detach_c", "table", "gaps", "evict_c"] if specs else [])
        )
        if op == "unlock" and not op_unlock and pick is not None and pick[0].lock_ref:
            op = "lock"  # unlocking a node this run did not lock breaks the lock counts
        if op_unlock:
            op = "unlock"
        if op in ("lock", "unlock", "host_lock", "host_unlock", "io", "attach_host",
                  "attach_device", "detach_host", "detach_device", "priority", "path",
                  "indices", "attach_c", "detach_c", "table") and pick is None:
            op = "insert"
        ns = rng.choice(NAMESPACES) if rng.random() < 0.95 else rng.choice(BAD_NAMESPACES)
        toks = tokens()
        pages = torch.arange(next_page, next_page + len(toks) // P, dtype=torch.int64)
        next_page += len(toks) // P
        status = rng.choice(list(IOStatus))
        num = rng.randrange(0, 12) if rng.random() < 0.9 else rng.choice(BAD_COUNTS)
        drop = rng.random() < 0.5
        backup_kind = rng.choice(["none", "decline", "back_up", "mixed", "raise"])
        c = rng.randrange(len(specs)) if specs else 0
        if rng.random() < 0.05:
            c = rng.choice([-1, len(specs), True, 1.0, None])
        tier = rng.choice(["device", "host"]) if rng.random() < 0.95 else rng.choice(["disk", None])
        given = [component_ids(rng, spec, len(toks) // P, 400_000 + 1000 * step + 100 * i)
                 for i, spec in enumerate(specs)]
        kw = {"components": given} if specs else {}
        outs = []
        for side, node in ((py, pick and pick[0]), (nat, pick and pick[1])):
            t = side.tree
            n = node
            fn, *args = {
                "match": (t.match_prefix, toks, ns),
                "insert": (lambda *a, t=t, kw=kw: t.insert(*a, **kw), toks, pages, ns),
                "insert_host": (lambda *a, t=t, kw=kw: t.insert_host(*a, **kw), toks, pages + 50_000,
                                ns),
                "attach_c": (t.attach_component, n, c, tier, _component_ids(n, specs, c, step)),
                "detach_c": (t.detach_component, n, c, tier),
                "table": (t.component_table, n, c, tier),
                "probe_hit": (t.probe_hit_key, token_key(toks, P), ns),
                "gaps": (t.component_gaps, token_key(toks, P), c, tier, ns),
                "evict_c": (t.evict_component, c, tier, num),
                "prune": (t.prune_namespaces,),
                "counts": (t.num_component_pages, c, tier),
                "probe": (t.probe_path, token_key(toks, P), ns),
                "lock": (t.lock, n),
                "unlock": (t.unlock, n),
                "host_lock": (t.host_lock, n),
                "host_unlock": (t.host_unlock, n),
                "io": (t.set_io_status, n, status),
                "attach_host": (t.attach_host, n, _ids(n, 200_000 + 100 * step)),
                "attach_device": (t.attach_device, n, _ids(n, 300_000 + 100 * step)),
                "detach_host": (t.detach_host, n),
                "detach_device": (t.detach_device, n),
                "evict_device": (t.evict_device, num, side.backup(backup_kind)),
                "evict_host": (t.evict_host, num, drop),
                "priority": (t.raise_priority, n, num),
                "path": (t.path_to, n),
                "indices": (t.device_indices_of, n),
            }[op]
            outs.append(call(fn, *args))
        where = f"seed {seed} step {step} {op} (split hook {split_kind}, backup {backup_kind})"
        assert outs[0] == outs[1], f"{where}: {outs[0]} vs {outs[1]}"
        if op == "lock" and outs[0][0] == "ok":
            locked.append(pick)
        assert py.log == nat.log, f"{where}: hook logs differ"
        for side in (py, nat):
            side.tree.on_split = None
            try:
                side.tree.check_integrity()
            except AssertionError as exc:
                raise AssertionError(f"{where}: {type(side.tree).__name__}: {exc}") from None
        assert snapshot(py.tree) == snapshot(nat.tree), where
        assert py.tree.namespaces() == nat.tree.namespaces(), where
        for a, b in zip(py.tree.nodes(), nat.tree.nodes(), strict=True):
            if rng.random() < 0.2:
                seen.append((a, b))
        if rng.random() < 0.05 and ns in NAMESPACES:
            seen.append((py.tree.root(ns), nat.tree.root(ns)))
        del seen[:-60]  # older ones are often stale (removed, merged): kept on purpose


def test_fuzz_native_against_python():
    budget = float(os.environ.get("HICACHE_FUZZ_SECONDS", "0"))
    seed = 0
    start = time.monotonic()
    while True:
        run_seed(seed, steps=150, hybrid=seed % 2 == 1)
        seed += 1
        if budget <= 0 and seed >= 8:
            break
        if budget > 0 and time.monotonic() - start > budget:
            break
