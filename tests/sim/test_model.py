"""Reference model: paged forward vs dense reference, chunking, decode, errors, layer waits.

Tolerance: float32 throughout (weights, activations and pool). The paged and the
dense path run the same math with different matmul shapes and attention masks,
so they differ only by float32 reduction order: ~1e-6 relative on logits of unit
scale. ``ATOL = 1e-4`` leaves headroom for that and still catches any real
mistake (a wrong position, page or mask moves logits by O(1)).
"""

from __future__ import annotations

import json

import pytest
import torch

from hicache.memory import DevicePool, HostPool
from hicache.sim.costmodel import (
    FULL_MODELS,
    estimate_recompute_vs_reload,
    kv_bytes_per_token,
    prefill_flops,
    prefill_flops_per_token,
)
from hicache.sim.model import PRESET_NAMES, Model, ModelConfig, preset
from hicache.transfer import TransferEngine

ATOL = 1e-4
PAGE_SIZE = 16
NUM_PAGES = 64


def make_pool(m: Model, num_pages: int = NUM_PAGES) -> DevicePool:
    return DevicePool(m.kv_config(PAGE_SIZE), num_pages)


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed))


def scattered_pages(n: int, seed: int = 2) -> torch.Tensor:
    """Non-contiguous, out-of-order page ids, as a real allocator hands them out."""
    return torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(seed))[:n]


def test_paged_forward_matches_reference(model: Model) -> None:
    ids = tokens(100)
    pool = make_pool(model)
    paged = model.forward(ids, scattered_pages(7), 0, pool)
    ref = model.prefill_reference(ids)
    assert paged.shape == (100, 32000) and paged.dtype == torch.float32
    torch.testing.assert_close(paged, ref, atol=ATOL, rtol=0)


def test_last_only_returns_last_row(model: Model) -> None:
    ids = tokens(40)
    full = model.forward(ids, scattered_pages(3), 0, make_pool(model))
    last = model.forward(ids, scattered_pages(3), 0, make_pool(model), last_only=True)
    assert last.shape == (1, 32000)
    torch.testing.assert_close(last, full[-1:], atol=ATOL, rtol=0)


def test_chunked_prefill_matches_one_shot(model: Model) -> None:
    ids = tokens(100)
    pages = scattered_pages(7)
    pool = make_pool(model)
    # Chunk borders mid-page (37, 53) and on a page border (48 would be; 53 is not).
    chunks = [(0, 37), (37, 53), (53, 100)]
    out = [model.forward(ids[a:b], pages, a, pool) for a, b in chunks]
    torch.testing.assert_close(torch.cat(out), model.prefill_reference(ids), atol=ATOL, rtol=0)


def test_decode_one_token_at_a_time_matches_prefill(model: Model) -> None:
    ids = tokens(40)
    pages = scattered_pages(3)
    pool = make_pool(model)
    rows = [model.forward(ids[:20], pages, 0, pool, last_only=True)]
    for pos in range(20, 40):
        rows.append(model.forward(ids[pos : pos + 1], pages, pos, pool))
    ref = model.prefill_reference(ids)
    torch.testing.assert_close(torch.cat(rows), ref[19:], atol=ATOL, rtol=0)


def test_pool_holds_the_kv_the_model_wrote(model: Model) -> None:
    # A second sequence in other pages must not disturb the first one's KV.
    ids_a, ids_b = tokens(50, seed=1), tokens(50, seed=3)
    pool = make_pool(model)
    pages = scattered_pages(8)
    model.forward(ids_a, pages[:4], 0, pool)
    model.forward(ids_b, pages[4:], 0, pool)
    nxt = model.forward(ids_a[-1:].clone().fill_(7), pages[:4], 50, pool)
    ref = model.prefill_reference(torch.cat((ids_a, torch.tensor([7]))))
    torch.testing.assert_close(nxt, ref[-1:], atol=ATOL, rtol=0)


def test_out_of_vocab_token_is_a_clear_error(model: Model) -> None:
    pool = make_pool(model)
    for bad in (32000, -1):
        ids = tokens(10)
        ids[4] = bad
        with pytest.raises(ValueError, match=rf"token id {bad} .*\[0, 32000\)"):
            model.forward(ids, scattered_pages(1), 0, pool)
        with pytest.raises(ValueError, match="32000"):
            model.prefill_reference(ids)


def test_bad_arguments_raise(model: Model) -> None:
    pool = make_pool(model)
    with pytest.raises(ValueError, match=r"expected >= 3 pages .* got 2"):
        model.forward(tokens(20), scattered_pages(2), 16, pool)
    with pytest.raises(TypeError, match="int64"):
        model.forward(tokens(4).int(), scattered_pages(1), 0, pool)
    with pytest.raises(TypeError, match="int64"):
        model.forward(tokens(4), scattered_pages(1).int(), 0, pool)
    with pytest.raises(ValueError, match=r"page ids in \[0, 64\)"):
        model.forward(tokens(4), torch.tensor([64]), 0, pool)
    with pytest.raises(ValueError, match="start_pos"):
        model.forward(tokens(4), scattered_pages(1), -1, pool)
    other = DevicePool(preset("small").kv_config(PAGE_SIZE), 4)
    with pytest.raises(ValueError, match=r"expected KV shape .*\(2, 2, 16\).* got \(4, 2, 64\)"):
        model.forward(tokens(4), scattered_pages(1), 0, other)


class JustInTimeLoad:
    """Fake load handle: layer i's prefix KV lands in the pool only when wait_layer(i) runs."""

    def __init__(self, src: DevicePool, dst: DevicePool, pages: torch.Tensor) -> None:
        self.src, self.dst, self.pages = src, dst, pages
        self.waited: list[int] = []

    def wait_layer(self, i: int) -> None:
        self.waited.append(i)
        for s, d in zip(self.src.layer(i), self.dst.layer(i), strict=True):
            d[self.pages] = s[self.pages]


def test_waits_on_each_layer_before_reading_it(model: Model) -> None:
    ids = tokens(70)
    pages = scattered_pages(5)
    computed = make_pool(model)
    model.forward(ids[:40], pages, 0, computed)
    empty = make_pool(model)  # zeros: reading a layer before its wait gives wrong logits
    handle = JustInTimeLoad(computed, empty, pages[:3])
    out = model.forward(ids[40:], pages, 40, empty, handle)
    assert handle.waited == [0, 1]
    torch.testing.assert_close(out, model.prefill_reference(ids)[40:], atol=ATOL, rtol=0)


def _prefix_in_host_pool(m: Model, ids: torch.Tensor, prefix_len: int):
    """Prefill ``prefix_len`` tokens into device pages, back them up, return the setup."""
    device = make_pool(m)
    host = HostPool(m.kv_config(PAGE_SIZE), 8)
    pages = scattered_pages(10)
    m.forward(ids[:prefix_len], pages[:5], 0, device)
    num_prefix_pages = prefix_len // PAGE_SIZE
    host_pages = torch.tensor([6, 1, 4][:num_prefix_pages])
    return device, host, pages[:num_prefix_pages], pages[5:], host_pages


@pytest.mark.parametrize("executor", ["thread", "manual"])
def test_forward_over_a_real_layer_wise_load(model: Model, executor: str) -> None:
    ids = tokens(70)
    device, host, old_pages, new_pages, host_pages = _prefix_in_host_pool(model, ids, 48)
    with TransferEngine(device, host, "thread") as backup_engine:
        assert backup_engine.backup(old_pages, host_pages).wait()
    engine = TransferEngine(device, host, executor)
    table = new_pages  # the prefix comes back into other device pages than it was computed in
    handle = engine.load(host_pages, table[:3])
    if executor == "manual":
        with pytest.raises(RuntimeError, match="layer 0 of the prefix KV never arrived"):
            model.forward(ids[48:], table, 48, device, handle)
        waited: list[int] = []

        class StepOnWait:
            def wait_layer(self, i: int) -> bool:
                waited.append(i)
                engine.executor.complete_layer(handle)
                return handle.wait_layer(i)

        out = model.forward(ids[48:], table, 48, device, StepOnWait())
        assert waited == [0, 1] and handle.done()
    else:
        out = model.forward(ids[48:], table, 48, device, handle)
        assert handle.wait() and handle.error is None
    engine.close()
    torch.testing.assert_close(out, model.prefill_reference(ids)[48:], atol=ATOL, rtol=0)


class FailedLoad:
    """Fake handle of a load that failed before layer 1."""

    def wait_layer(self, i: int) -> bool:
        return i < 1


def test_failed_load_is_an_error_not_garbage(model: Model) -> None:
    with pytest.raises(RuntimeError, match="layer 1 of the prefix KV never arrived"):
        model.forward(tokens(4), scattered_pages(2), 16, make_pool(model), FailedLoad())


def test_seeded_weights_are_deterministic() -> None:
    ids = tokens(30)
    a = Model(preset("tiny"), seed=5).prefill_reference(ids)
    b = Model(preset("tiny"), seed=5).prefill_reference(ids)
    c = Model(preset("tiny"), seed=6).prefill_reference(ids)
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 0.5


def test_identity_names_the_weights_config_and_dtype() -> None:
    """The storage-key identity is equal exactly when the KV is: same preset, config,
    dtype and weights (in any process: it is a digest, not an object id)."""
    a = Model(preset("tiny"), seed=5)
    assert a.identity() == Model(preset("tiny"), seed=5).identity()
    others = [
        Model(preset("tiny"), seed=6),  # same layout, other weights
        Model(preset("tiny", dtype="bfloat16"), seed=5),  # other compute dtype
        Model(ModelConfig(**{**preset("tiny").__dict__, "rope_theta": 500000.0}), seed=5),
    ]
    ids = {a.identity(), *(m.identity() for m in others)}
    assert len(ids) == 1 + len(others)
    assert a.kv_config(PAGE_SIZE) == others[0].kv_config(PAGE_SIZE)  # the layout cannot tell
    # The digest covers every weight: change one element, the identity changes.
    b = Model(preset("tiny"), seed=5)
    b.layers[1].wv[3, 7] += 1.0
    assert b.identity() != a.identity()
    assert len(a.weights_digest()) == 32 and a.weights_digest() == a.weights_digest()


def test_greedy_tokens_are_not_degenerate(model: Model) -> None:
    logits = model.prefill_reference(tokens(64))
    assert 0.5 < logits.std() < 5, "logits should be of unit scale"
    assert len(set(logits.argmax(-1).tolist())) > 32, "greedy tokens should vary"
    # Greedy decode must not collapse into repeating one token.
    pool = make_pool(model)
    pages = scattered_pages(4)
    nxt = model.forward(tokens(8), pages, 0, pool, last_only=True).argmax(-1)
    out = []
    for pos in range(8, 40):
        out.append(int(nxt))
        nxt = model.forward(nxt, pages, pos, pool).argmax(-1)
    assert len(set(out)) > 4


def test_bfloat16_model_runs_and_matches_its_reference() -> None:
    m = Model(preset("tiny", dtype="bfloat16"), seed=0)
    pool = DevicePool(m.kv_config(PAGE_SIZE), 8)
    assert pool.k_buffers[0].dtype == torch.bfloat16
    ids = tokens(20)
    paged = m.forward(ids, torch.arange(2), 0, pool)
    # Same ops in the same order at start_pos 0: bf16 rounds identically on both paths.
    torch.testing.assert_close(paged, m.prefill_reference(ids), atol=1e-2, rtol=0)


def test_presets_have_the_promised_shapes() -> None:
    assert set(PRESET_NAMES) >= {"tiny", "small", "llama3-8b-layers2", "llama3-70b-layers1"}
    for name in PRESET_NAMES:
        assert preset(name).vocab_size >= 32000
    l8 = preset("llama3-8b-layers2")
    assert (l8.hidden_size, l8.num_heads, l8.num_kv_heads, l8.head_dim) == (4096, 32, 8, 128)
    assert (l8.intermediate_size, l8.num_layers, l8.vocab_size) == (14336, 2, 128256)
    l70 = preset("llama3-70b-layers1")
    assert (l70.hidden_size, l70.num_heads, l70.intermediate_size, l70.num_layers) == (
        8192, 64, 28672, 1,
    )
    assert preset("tiny", dtype="bfloat16").torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="preset: expected one of"):
        preset("gpt5")
    with pytest.raises(ValueError, match="num_heads: expected a multiple of num_kv_heads=3"):
        ModelConfig("x", 32000, 64, 1, 4, 3, 16, 128)


def test_costmodel_matches_known_llama3_numbers() -> None:
    l8, l70 = FULL_MODELS["Llama-3-8B"], FULL_MODELS["Llama-3-70B"]
    assert kv_bytes_per_token(l8) == 128 * 1024  # 32 layers x 2 x 8 heads x 128 x 2 bytes
    assert kv_bytes_per_token(l70) == 320 * 1024
    assert kv_bytes_per_token(l8, "float32") == 256 * 1024
    tiny = preset("tiny")
    assert kv_bytes_per_token(tiny) == tiny.kv_config(PAGE_SIZE).token_nbytes
    # A hybrid's linear layers keep no KV per token: 4 of tiny-hybrid's 6 layers do.
    assert kv_bytes_per_token(preset("tiny-hybrid")) == 2 * 4 * 2 * 16 * 4
    # ~2 x non-embedding params (~7.0e9 for 8B) per token at short context.
    assert 1.35e10 < prefill_flops_per_token(l8, 1) < 1.45e10
    assert prefill_flops(l8, 10) == sum(prefill_flops_per_token(l8, p + 1) for p in range(10))
    e8 = estimate_recompute_vs_reload("Llama-3-8B", "H100-SXM", 4096)
    e70 = estimate_recompute_vs_reload("Llama-3-70B", "H200", 4096)
    assert 8 < e8.ratio < 15 and 35 < e70.ratio < 50
    assert e8.reload_ms == pytest.approx(4096 * 131072 / 50e9 * 1e3)


def test_recompute_bench_prints_table_then_json(capsys: pytest.CaptureFixture[str]) -> None:
    from hicache.cli.benchmarks.recompute import main

    argv = ["--preset", "tiny", "--tokens", "16,64", "--repeats", "1", "--reload-repeats", "2"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any("recompute_ms" in line for line in lines[:-1]), "expected a table before the JSON"
    result = json.loads(lines[-1])
    assert result["preset"] == "tiny"
    assert result["kv_bytes_per_token"] == preset("tiny").kv_config(PAGE_SIZE).token_nbytes
    assert result["copy_limit_gbps"] > 0
    assert [r["tokens"] for r in result["rows"]] == [16, 64]
    assert all(r["recompute_ms"] > 0 and r["reload_ms"] > 0 for r in result["rows"])
    assert "ESTIMATE" in result["estimate"]["label"]
    assert main(["--preset", "tiny", "--tokens", "20"]) == 2  # one line on stderr
    assert "multiples of the page size 16" in capsys.readouterr().err
