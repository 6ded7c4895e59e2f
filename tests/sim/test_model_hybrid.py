"""The reference model's hybrid layers (tiny-hybrid): window attention and the linear
recurrence, paged, against the dense reference; chunking, decode, checkpoints; errors.

Tolerance as in tests/sim/test_model.py: float32 throughout; the recurrence run from a
checkpoint sums the same terms in another order (~1e-6).
"""

from __future__ import annotations

import json

import pytest
import torch

from hicache.cache.request_components import StatePages
from hicache.memory import DevicePool
from hicache.sim.layers import CHUNK, recur
from hicache.sim.model import Model, ModelConfig, preset

ATOL = 1e-4
P = 16
W, S = 0, 1  # tiny-hybrid's components: its window, its linear layers' state


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(preset("tiny-hybrid"), seed=0)


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed))


class Pages:
    """A pool and disjoint page ids for one sequence: full, window, states."""

    def __init__(self, model: Model, num_pages: int = 8) -> None:
        self.pool = DevicePool(model.kv_config(P), 64)
        order = torch.randperm(64, generator=torch.Generator().manual_seed(2))
        self.full = order[:num_pages]
        self.window = order[num_pages : 2 * num_pages].view(-1, 1)
        self.spare = order[2 * num_pages :].tolist()

    def page(self) -> torch.Tensor:
        return torch.tensor([self.spare.pop()])


def test_kinds_have_their_places_in_a_page() -> None:
    cfg = preset("tiny-hybrid")
    assert cfg.num_full_layers == 2
    assert [s.describe() for s in cfg.components()] == ["window:24", "state"]
    kv = cfg.kv_config(P)
    assert kv.num_layers == 2 and kv.fingerprint().endswith("-Cwindow:24,state")
    small = preset("small-hybrid")
    assert [s.describe() for s in small.components()] == ["window:128x2", "state"]
    assert [(s.kind, s.group, s.slot) for s in small.layer_slots()[:5]] == [
        ("window", 0, 0), ("window", 0, 1), ("linear", 0, 0), ("full", 0, 0), ("window", 1, 0)]
    with pytest.raises(ValueError, match="page_size"):
        small.kv_config(8)  # a state of 16 rows does not fit a page of 8
    with pytest.raises(ValueError, match="layer_kinds"):
        ModelConfig("x", 10, 8, 2, 2, 2, 4, 8, layer_kinds=("window", "linear"))
    with pytest.raises(ValueError, match="window_tokens"):
        ModelConfig("x", 10, 8, 2, 2, 2, 4, 8, layer_kinds=("window", "full"))


def test_paged_forward_matches_reference(model: Model) -> None:
    ids = tokens(100)
    p = Pages(model)
    out = model.forward(ids, p.full, 0, p.pool,
                        components=[p.window, StatePages(None, p.page(), {})])
    torch.testing.assert_close(out, model.prefill_reference(ids), atol=ATOL, rtol=0)


def test_chunks_from_checkpoints_match_one_shot(model: Model) -> None:
    """Chunks borders mid-page and on one: each chunk starts from the checkpoint the
    one before wrote (a request resumed from the cache) or from the running state."""
    ids = tokens(100)
    p = Pages(model)
    at_48 = p.page()
    running = p.page()
    first = model.forward(ids[:48], p.full, 0, p.pool,
                          components=[p.window, StatePages(None, running, {48: at_48})])
    fresh = p.page()  # a second request starting from the checkpoint at 48
    second = model.forward(ids[48:70], p.full, 48, p.pool,
                           components=[p.window, StatePages(at_48, fresh, {})])
    third = model.forward(ids[70:], p.full, 70, p.pool,
                          components=[p.window, StatePages(fresh, fresh, {})])
    torch.testing.assert_close(torch.cat((first, second, third)), model.prefill_reference(ids),
                               atol=ATOL, rtol=0)


def test_decode_one_token_at_a_time_matches_prefill(model: Model) -> None:
    ids = tokens(60)
    p = Pages(model)
    state = p.page()
    rows = [model.forward(ids[:30], p.full, 0, p.pool, last_only=True,
                          components=[p.window, StatePages(None, state, {})])]
    for pos in range(30, 60):
        rows.append(model.forward(ids[pos : pos + 1], p.full, pos, p.pool,
                                  components=[p.window, StatePages(state, state, {})]))
    torch.testing.assert_close(torch.cat(rows), model.prefill_reference(ids)[29:],
                               atol=ATOL, rtol=0)


def test_a_window_reads_only_its_window(model: Model) -> None:
    """Window pages before the window may be gone (-1): what a cache keeps is enough."""
    ids = tokens(90)
    p = Pages(model)
    state = p.page()
    model.forward(ids[:64], p.full, 0, p.pool, components=[p.window, StatePages(None, state, {})])
    tail = p.window.clone()
    tail[:2] = -1  # pages 0 and 1: positions before 64 - 24 + 1
    out = model.forward(ids[64:], p.full, 64, p.pool,
                        components=[tail, StatePages(state, state, {})])
    torch.testing.assert_close(out, model.prefill_reference(ids)[64:], atol=ATOL, rtol=0)
    tail[2] = -1  # page 2 holds positions 41-47: inside the window of position 64
    with pytest.raises(ValueError, match="window page"):
        model.forward(ids[64:65], p.full, 64, p.pool,
                      components=[tail, StatePages(state, state, {})])


def test_hybrid_models_need_their_components(model: Model) -> None:
    p = Pages(model)
    ids = tokens(10)
    with pytest.raises(ValueError, match="2 components"):
        model.forward(ids, p.full, 0, p.pool)
    with pytest.raises(TypeError, match="window"):
        model.forward(ids, p.full, 0, p.pool, components=[p.full, StatePages(None, p.page(), {})])
    with pytest.raises(TypeError, match="running state"):
        model.forward(ids, p.full, 0, p.pool, components=[p.window, StatePages(None, None, {})])
    plain = Model(preset("tiny"), seed=0)
    with pytest.raises(ValueError, match="no window or linear"):
        plain.forward(ids, p.full, 0, DevicePool(plain.kv_config(P), 64), components=[p.window])


def test_recurrence_checkpoints_are_the_states_of_a_shorter_run() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(150, h, d, generator=gen) for h, d in ((4, 8), (2, 8), (2, 16)))
    decay = torch.tensor([0.75, 0.875])
    zero = torch.zeros(2, 8, 16)
    out, state, saved = recur(q, k, v, zero, decay, 0, checkpoints=[CHUNK, 100, 150])
    assert sorted(saved) == [CHUNK, 100, 150]
    torch.testing.assert_close(saved[150], state)
    _, at_100, _ = recur(q[:100], k[:100], v[:100], zero, decay, 0)
    torch.testing.assert_close(saved[100], at_100, atol=1e-5, rtol=1e-5)
    resumed, _, _ = recur(q[100:], k[100:], v[100:], at_100, decay, 100)
    torch.testing.assert_close(resumed, out[100:], atol=1e-5, rtol=1e-5)


def test_recompute_bench_reloads_the_window_tail_and_the_checkpoint(capsys) -> None:
    """tiny-hybrid, page 16 (window 24: a hit reads 2 window pages before it): a reload of
    n pages moves n full pages, min(2, n) window pages and one checkpoint; storing every
    window page would take n + n + 1. The bench checks the reloaded pages equal the
    recomputed ones."""
    from hicache.cli.benchmarks.recompute import main

    argv = ["--preset", "tiny-hybrid", "--tokens", "16,64", "--repeats", "1",
            "--reload-repeats", "2", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    page = preset("tiny-hybrid").kv_config(16).page_nbytes
    assert [(r["nbytes"] // page, r["dense_nbytes"] // page) for r in rows] == [(3, 3), (7, 9)]
