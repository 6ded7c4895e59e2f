"""The worker half's held requests (worker/sends.py): a handed-off request is named to
vLLM as sent once, when no save of it is in flight on this worker, or after the
timeout; whichever of the plan's hold and vLLM's finish comes first. Plain objects and
a fake clock: no vLLM."""

from __future__ import annotations

from hicache.integrations.vllm.worker.sends import HeldRequests, num_writes_in_flight


class _Save:
    def __init__(self, req_ids, keys=("k",), since=0.0):
        self.req_ids, self.keys, self.since = set(req_ids), list(keys), since


def test_a_held_request_is_named_once_its_saves_ended_or_timed_out():
    now = [0.0]
    held = HeldRequests(timeout_s=5.0, clock=lambda: now[0])
    held.hold(["a", "b"])
    busy = [_Save(["a"]), _Save(["b", "c"])]
    assert held.ended({"a", "b", "x"}, busy) == set() and held.num_held == 2
    assert held.ended(set(), busy[1:]) == {"a"}  # a's save landed
    now[0] = 5.0
    assert held.ended(set(), busy[1:]) == {"b"}  # b's write hangs: given up on
    assert held.ended(set(), []) == set() and held.num_held == 0


def test_a_finish_seen_before_the_hold_is_not_lost():
    held = HeldRequests(timeout_s=5.0, clock=lambda: 0.0)
    assert held.ended({"a"}, []) == set()  # not held (yet): nothing to name
    held.hold(["a"])
    assert held.ended(set(), []) == {"a"}
    held.hold(["never-finished"])  # named only once vLLM says it finished
    assert held.ended(set(), []) == set() and held.num_held == 1


def test_writes_in_flight_count_until_they_are_too_old():
    saves = [_Save(["a"], since=0.0), _Save(["b"], keys=(), since=0.0), _Save(["c"], since=9.0)]
    assert num_writes_in_flight(saves, 5.0, now=1.0) == 2  # b has no third-tier write
    assert num_writes_in_flight(saves, 5.0, now=10.0) == 1  # a's is past the timeout
