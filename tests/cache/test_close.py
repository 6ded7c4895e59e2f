"""A closed cache: every call raises before changing anything, and a transfer refused
after close leaves no node in flight.
"""

from __future__ import annotations

import pytest
from kv_layouts import LIFECYCLES, kv_one_float, seq
from leak_checks import assert_no_leaks
from manual_executor import (
    host_only,
    make_cache,
)
from serving import bookkeeping, serve


def _closed_calls():
    return [
        ("match", lambda c, h: c.match([1, 2])),
        ("alloc", lambda c, h: c.alloc(h, 2)),
        ("insert", lambda c, h: c.insert(h, [1, 2])),
        ("load_back", lambda c, h: c.load_back(h)),
        ("finish_loads", lambda c, h: c.finish_loads(h)),
        ("release", lambda c, h: c.release(h)),
        ("poll", lambda c, h: c.poll()),
        ("wait_all", lambda c, h: c.wait_all()),
        ("prefetch", lambda c, h: c.prefetch([1, 2])),
    ]


@pytest.mark.parametrize(("name", "call"), _closed_calls(), ids=[n for n, _ in _closed_calls()])
@pytest.mark.parametrize(("tree", "lifecycle"), LIFECYCLES[:1] + LIFECYCLES[2:])
def test_every_call_after_close_raises_before_changing_anything(name, call, tree, lifecycle):
    c = bookkeeping(tree, lifecycle, kv=kv_one_float(2), device_tokens=16, host_tokens=16)
    serve(c, [1, 2, 3, 4])
    h = c.match([1, 2, 3, 4, 5])
    before = c.stats()
    c.close()
    c.close()  # idempotent
    with pytest.raises(ValueError, match="HiCache is closed"):
        call(c, h)
    c.check_integrity()  # the final state stays readable
    assert c.stats() == before and c.counters == c.counters
    c._closed = False  # only to release the handle and check for leaks
    c.release(h)
    assert_no_leaks(c)


def test_a_transfer_after_close_leaves_no_node_in_flight():
    cache = make_cache()
    a = seq(100, 3)
    host_only(cache, a)
    cache.close()
    with pytest.raises(ValueError, match="HiCache is closed"):
        cache.match(a)  # used to start a load, then fail in the closed engine
    cache.check_integrity()
    assert all(n.lock_ref == 0 and n.host_lock_ref == 0 for n in cache.tree.nodes())
