"""A real vLLM engine (``AsyncLLM``, engine core in its own process, CPU backend) with the
connector, vLLM's Prometheus stat logger and its ZMQ KV events publisher; prints one
JSON line: the cached tokens per request, the hicache series missing from the
registry, the host hits it shows, and the KV events a subscriber received, by type
and medium (host memory ``CPU``, the ``file:`` third tier ``STORAGE``). Run by tests/integrations/test_vllm_prom.py:

    python tests/integrations/vllm_async_driver.py
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]

import prom_check  # noqa: E402
import vllm_driver  # noqa: E402


async def run() -> dict:
    import msgspec
    import zmq
    from prometheus_client import REGISTRY, generate_latest
    from vllm import SamplingParams, TokensPrompt
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    model = tempfile.mkdtemp(prefix="hicache-prom-model-")
    vllm_driver.make_model(model)
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='hicache-events-')}/kv"
    args = AsyncEngineArgs(
        model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        block_size=vllm_driver.BLOCK_SIZE, max_model_len=vllm_driver.MAX_MODEL_LEN,
        num_gpu_blocks_override=vllm_driver.NUM_GPU_BLOCKS, gpu_memory_utilization=0.1,
        max_num_seqs=4, seed=0, disable_log_stats=False,
        kv_transfer_config={"kv_connector": "HiCacheConnector",
                            "kv_connector_module_path": "hicache.integrations.vllm",
                            "kv_role": "kv_both",
                            "kv_connector_extra_config": {
                                "host_tokens": 8192,
                                "storage": f"file:{tempfile.mkdtemp(prefix='hicache-store-')}"}},
        kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                          "endpoint": endpoint, "topic": "kv"},
    )
    llm = AsyncLLM.from_engine_args(args)
    sub = zmq.Context().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    await asyncio.sleep(0.5)  # the subscription is up before the first batch
    prompt = list(range(1, 300))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cached = []
    try:
        for i in range(2):  # the second is served by the host tier: vLLM's cache was reset
            last = None
            async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt + [i + 1]),
                                          params, request_id=f"r{i}"):
                last = out
            cached.append(int(last.num_cached_tokens or 0))
            await llm.reset_prefix_cache()
        await asyncio.sleep(1.0)  # the last stats reach the front end
        text = generate_latest(REGISTRY).decode()
        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        events: dict[str, int] = {}
        while sub.poll(1000):
            _, _, payload = sub.recv_multipart()
            for ev in decode(payload).events:
                key = f"{type(ev).__name__}/{getattr(ev, 'medium', None)}"
                events[key] = events.get(key, 0) + 1
    finally:
        llm.shutdown()
        sub.close(linger=0)
    return {"cached": cached, "missing": prom_check.missing_hicache_metrics(text),
            "host_hit_tokens": prom_check.sample(text, "vllm:hicache_hit_tokens_total",
                                                 tier="host"),
            "host_pages_used": prom_check.sample(text, "vllm:hicache_host_pages_used"),
            "load_bytes": prom_check.sample(text, "vllm:hicache_transfer_bytes_total",
                                            operation="load"),
            "events": events}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(run())), flush=True)
