"""The host tier in vLLM's KV cache events: vLLM's own scheduler (vllm_sched.py) with
its ZMQ publisher bound to a local (ipc) endpoint and a subscriber connected to it. Every host page the
connector holds was announced ``BlockStored`` (medium ``CPU``) with the block hash vLLM
gives that block, every eviction was announced ``BlockRemoved``, nothing twice; a
tenant's ``cache_salt`` gives other hashes, as in vLLM's cache. Skipped without vLLM
unless ``HICACHE_REQUIRE_VLLM=1``."""

from __future__ import annotations

import random
import time

import pytest
from optional_vllm import VLLM_REQUIRED, vllm_available

pytestmark = pytest.mark.skipif(
    not VLLM_REQUIRED and not vllm_available(),
    reason="vllm (pip install -e '.[vllm]') not installed",
)


class Subscriber:
    """A router's view: a zmq SUB socket connected to vLLM's publisher; replays
    BlockStored / BlockRemoved per medium into the set of hashes held."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sock.connect(endpoint)
        self.batches: list = []
        self.seqs: list[int] = []

    def drain(self, quiet_s: float = 1.0) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        while self.sock.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"kv"
            self.seqs.append(int.from_bytes(seq, "big"))
            self.batches.append(decoder.decode(payload))

    def replay(self, medium: str) -> tuple[set, list[str]]:
        """Hashes held in ``medium`` after every event, and every violation seen."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        assert self.seqs == list(range(len(self.seqs))), "a batch was lost"
        held: set = set()
        errors: list[str] = []
        for batch in self.batches:
            for ev in batch.events:
                if isinstance(ev, AllBlocksCleared) or ev.medium != medium:
                    continue
                if isinstance(ev, BlockStored):
                    twice = held & set(ev.block_hashes)
                    if twice:
                        errors.append(f"announced twice: {sorted(twice)[:3]}")
                    held |= set(ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    unknown = set(ev.block_hashes) - held
                    if unknown:
                        errors.append(f"removed, never stored: {sorted(unknown)[:3]}")
                    held -= set(ev.block_hashes)
        return held, errors

    def ever_stored(self, medium: str) -> set:
        from vllm.distributed.kv_events import BlockStored

        return {h for b in self.batches for ev in b.events
                if isinstance(ev, BlockStored) and ev.medium == medium for h in ev.block_hashes}

    def blocks(self, medium: str) -> dict:
        """Block hash -> (its tokens, its extra keys, LoRA) as the stored events said."""
        from vllm.distributed.kv_events import BlockStored

        out = {}
        for b in self.batches:
            for ev in b.events:
                if isinstance(ev, BlockStored) and ev.medium == medium:
                    for i, h in enumerate(ev.block_hashes):
                        tokens = ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size]
                        extra = ev.extra_keys[i] if ev.extra_keys else None
                        out[h] = (tuple(tokens), extra, ev.lora_name)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _expected_host_hashes(half, B: int) -> dict:
    """Host page -> the block hash vLLM computes for the block it holds: a fresh vLLM
    Request over the node's token prefix and namespace (vLLM's cache_salt)."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, maybe_convert_block_hash
    from vllm.v1.request import Request

    out = {}
    for node in half.tree.nodes():
        if node.host_indices is None or node.parent is None:
            continue
        keys, n = [], node
        while n.parent is not None:
            keys.append(n.key)
            n = n.parent
        tokens = np.frombuffer(b"".join(reversed(keys)), dtype=np.int32).tolist()
        req = Request(request_id="truth", prompt_token_ids=tokens + [1],
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                      block_hasher=get_request_block_hasher(B, sha256),
                      cache_salt=node.namespace)
        first = (len(tokens) - len(node.key) // 4) // B
        for j, page in enumerate(node.host_indices.tolist()):
            out[page] = maybe_convert_block_hash(req.block_hashes[first + j])
    return out


def test_host_tier_announced_to_a_zmq_subscriber(sched, tmp_path):
    from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_GPU

    B = sched.B
    endpoint = f"ipc://{tmp_path}/kv-events"  # vLLM binds ipc (and tcp://*) endpoints
    e = sched.Engine(num_blocks=24, max_num_batched_tokens=256,
                     extra={"host_tokens": 8 * B, "tree": "python"},
                     kv_events={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": endpoint, "topic": "kv"})
    sub = Subscriber(endpoint)
    time.sleep(0.5)  # PUB/SUB: the subscription is up before the first batch
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 500) for _ in range(3 * B + 5)] for _ in range(3)]
    half = e.connector.scheduler_half
    # 3 prompts of 3 blocks, and the first under a tenant's salt, over 8 host pages:
    # hits, evictions, and saves of pages evicted before
    for turn, i in enumerate([0, 1, 0, 2, 1, 0, 0, 2]):
        salt = "tenant" if turn in (2, 5) else None  # same tokens: other hashes, other pages
        e.add(f"r{turn}", prompts[i] + [turn + 1], max_tokens=2, cache_salt=salt)
        e.run()
        e.quiesce()
        assert e.scheduler.reset_prefix_cache()  # vLLM forgets: the next turn hits the host tier
    e.check()
    assert half.counters.host_evicted_tokens > 0 and half.counters.host_hit_tokens > 0
    truth = _expected_host_hashes(half, B)
    assert len(truth) == half.host_allocator.num_used_pages > 0
    assert e.connector._events.announced_pages() == truth
    e.scheduler.reset_prefix_cache(reset_connector=True)  # the host tier empties...
    e.step()  # ...and the next step publishes its removals
    assert half.host_allocator.num_used_pages == 0
    e.scheduler.kv_event_publisher.shutdown()
    sub.drain()
    e.close()
    sub.close()

    stored = sub.ever_stored(MEDIUM_CPU)
    held_at_end, errors = sub.replay(MEDIUM_CPU)
    assert errors == []
    assert held_at_end == set()  # every page announced was removed
    assert set(truth.values()) <= stored
    # the host tier speaks vLLM's hash space: every block it held, vLLM held first
    assert stored <= sub.ever_stored(MEDIUM_GPU)
    # and says nothing vLLM's own events did not: per block, the same tokens and keys
    gpu, cpu = sub.blocks(MEDIUM_GPU), sub.blocks(MEDIUM_CPU)
    assert cpu and all(gpu[h] == block for h, block in cpu.items())
    # the salted tenant's blocks hash apart from the same tokens unsalted
    salted = [h for b in sub.batches for ev in b.events if getattr(ev, "medium", None) == MEDIUM_CPU
              and getattr(ev, "extra_keys", None) and ev.extra_keys[0] == ("tenant",)
              for h in ev.block_hashes]
    assert salted and stored - set(salted)


def test_no_events_unless_vllm_publishes_them(sched):
    e = sched.Engine(extra={"host_tokens": 8 * sched.B})
    e.add("a", list(range(1, 3 * sched.B)), max_tokens=2)
    e.run()
    e.check()
    assert e.connector.scheduler_half.host_allocator.num_used_pages > 0
    assert e.connector._events is None and e.connector.scheduler_half.page_listener is None
    assert list(e.connector.take_events()) == []
    e.close()
