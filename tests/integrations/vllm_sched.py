"""vLLM's own ``Scheduler`` / ``AsyncScheduler`` driving HiCacheConnector, without a model.

The scheduler is vLLM 0.32's, with the connector it builds itself (role SCHEDULER);
the worker half is a second connector (role WORKER) over CPU KV tensors in vLLM's CPU
layout. The "model" is a forward that writes each token's KV as a function of the
token prefix it ends (a CRC of those tokens, one value per layer; and of what else the
KV depends on: the LoRA adapter's files, the multimodal item or prompt embedding at each
position), and reads the request's earlier blocks first: a token computed over a block that does not hold the
KV of its prefix writes a poison value instead, so wrong KV propagates exactly as it
would through attention. Sampled tokens are a function of the prefix too, so a
follow-up turn built from a previous turn's output extends it.

Steps run in the engine's order: ``schedule -> execute -> update_from_output``, or
for async scheduling (the engine's batch queue) ``schedule N+1`` before
``update_from_output(N)``. Checks, recorded as they happen and asserted by
:meth:`Engine.check`:

- every block a forward reads holds its prefix's KV, unless the reader's blocks include
  one reported a load error in this step or the one before (vLLM then recomputes it),
  or the worker knows the block is wrong (it never saves it, and vLLM stops serving it);
- at the end, every host page the scheduler's tree offers holds its prefix's KV;
- no pin, host page, copy in flight or delayed block free is leaked.
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hicache.integrations.vllm.common.params import (
    check_cache_salt,
    parse_request_control,
    tree_namespace,
)
from hicache.integrations.vllm.scheduler.inputs import AdapterDigests, identity_ids, read_inputs
from hicache.tree import token_key

B = 16  # tokens per block
L = 2  # layers
H, D = 1, 4
VOCAB = 509
POISON = -1.0
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")

_MODEL_DIRS: dict[int, str] = {}


def model_dir(num_heads: int = 1) -> str:
    """A tiny model config (no weights: the scheduler only reads the config), with
    ``num_heads`` attention and KV heads (tensor parallelism shards them)."""
    if num_heads not in _MODEL_DIRS:
        from transformers import LlamaConfig

        path = tempfile.mkdtemp(prefix="hicache-sched-model-")
        LlamaConfig(vocab_size=VOCAB + 1, hidden_size=16, intermediate_size=32,
                    num_hidden_layers=L, num_attention_heads=num_heads,
                    num_key_value_heads=H * num_heads, head_dim=D,
                    max_position_embeddings=8192).save_pretrained(path)
        _MODEL_DIRS[num_heads] = path
    return _MODEL_DIRS[num_heads]


def prefix_values(tokens: Sequence[int], labels: Sequence[bytes] | None = None,
                  seed: bytes = b"") -> np.ndarray:
    """KV value of every position: a CRC of the tokens up to and including it, and of
    whatever else the KV depends on: each position's label (what a multimodal item or a
    prompt embedding puts there; positions past ``labels`` have none) and the LoRA
    adapter's weights (``seed``)."""
    out = np.empty(len(tokens), dtype=np.float64)
    crc = zlib.crc32(seed) if seed else 0
    for i, t in enumerate(tokens):
        label = labels[i] if labels is not None and i < len(labels) else b""
        crc = zlib.crc32(int(t).to_bytes(4, "little") + label, crc)
        out[i] = crc % 1_000_003 + 1
    return out


def next_token(tokens: Sequence[int]) -> int:
    """What the model "samples" after ``tokens``: a function of the prefix."""
    return zlib.crc32(np.asarray(tokens, dtype=np.int32).tobytes()) % VOCAB + 1


def adapter_weights(path: str) -> bytes:
    """A test adapter's "weights": the contents of its files (none: a missing directory)."""
    if not os.path.isdir(path):
        return b"missing"
    return b"".join(open(os.path.join(path, name), "rb").read()
                    for name in sorted(os.listdir(path)))
def random_prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids drawn from ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def extend(tokens: list[int], n: int) -> list[int]:
    """``tokens`` followed by the model's next ``n`` tokens."""
    out = list(tokens)
    for _ in range(n):
        out.append(next_token(out))
    return out


def multiturn(e: Engine, seed: int, *, convs: int, turns: int, abort_rate: float = 0.0,
              reset_each_round: bool = False) -> None:
    """Conversations sharing a system prompt, each turn extending the last one's output,
    turns of several conversations interleaved with random steps between arrivals; with
    ``abort_rate``, random aborts; with ``reset_each_round``, every round run to the end
    and vLLM's own cache emptied after it (later turns then hit hicache's tiers)."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, 500) for _ in range(n)]

    system = prompt(40)
    history = {c: system + prompt(10) for c in range(convs)}
    for t in range(turns):
        for c in range(convs):
            n = rng.randrange(1, 12)
            e.add(f"c{c}t{t}", history[c], max_tokens=n)
            history[c] = extend(history[c], n) + prompt(rng.randrange(1, 24))
            for _ in range(rng.randrange(0, 4)):
                if e.scheduler.has_requests():
                    e.step()
            if abort_rate and rng.random() < abort_rate and e.scheduler.requests:
                e.abort(rng.choice(sorted(e.scheduler.requests)))
        if reset_each_round:
            e.run()
            e.quiesce()
            assert e.scheduler.reset_prefix_cache()
    e.run()


class Faults:
    """Wraps the worker's block copier (fails loads or saves at a given rate) and its
    third-tier backend (fails reads at ``read_rate``)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.load_rate = 0.0
        self.save_rate = 0.0
        self.read_rate = 0.0
        self.failed_reads = 0
        self.hang_rate = 0.0  # third-tier reads that take hang_s (past storage_timeout_s)
        self.hang_s = 0.0
        self.hung_reads = 0
        # Reads wait for this gate while it is cleared (a slow store, held by the test).
        self.read_gate = threading.Event()
        self.read_gate.set()
        self.write_gate = threading.Event()  # the same for third-tier writes
        self.write_gate.set()
        # The next short_writes writes store only their first short_keep pages (a full
        # store); their set answers short_keep, as a backend's partial batch does.
        self.short_writes = 0
        self.short_keep = 0
        self.fail_read_calls: set[int] = set()  # get_into calls (0-based) that fail
        self.num_read_calls = 0
        self.fail_next_loads = 0
        self.inner = None
        self.failed_loads = 0
        self.failed_saves = 0

    def __call__(self, copier):
        self.inner = copier
        return self

    @property
    def num_layers(self) -> int:
        return self.inner.num_layers

    def load(self, host_ids, block_ids, first, last):
        if self.fail_next_loads or self.rng.random() < self.load_rate:
            self.fail_next_loads = max(0, self.fail_next_loads - 1)
            self.failed_loads += 1
            raise RuntimeError("injected load failure")
        self.inner.load(host_ids, block_ids, first, last)

    def backup(self, block_ids, host_ids, first, last):
        if self.rng.random() < self.save_rate:
            self.failed_saves += 1
            raise RuntimeError("injected save failure")
        self.inner.backup(block_ids, host_ids, first, last)

    def wrap_backend(self, backend):
        faults = self

        class FaultyBackend:
            def __getattr__(self, name):
                return getattr(backend, name)

            def get_into(self, keys, views):
                n, faults.num_read_calls = faults.num_read_calls, faults.num_read_calls + 1
                faults.read_gate.wait(60)
                if n in faults.fail_read_calls or faults.rng.random() < faults.read_rate:
                    faults.failed_reads += 1
                    raise OSError("injected storage read failure")
                if faults.hang_rate and faults.rng.random() < faults.hang_rate:
                    faults.hung_reads += 1
                    time.sleep(faults.hang_s)
                return backend.get_into(keys, views)

            def set(self, keys, values):
                faults.write_gate.wait(60)
                if faults.short_writes and len(keys) > faults.short_keep:
                    faults.short_writes -= 1
                    keep = faults.short_keep
                    return backend.set(keys[:keep], values[:keep]) if keep else 0
                return backend.set(keys, values)

        return FaultyBackend()


@dataclass
class Violation:
    step: int
    what: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.what}"


_OPEN: dict[int, Engine] = {}  # engines made and not closed yet, by id


def close_all() -> None:
    """Close every engine not closed yet (tests/integrations/conftest.py does, after each
    test): their copy and storage threads end with the test that started them."""
    for engine in list(_OPEN.values()):
        engine.close()
    _OPEN.clear()


@dataclass
class Engine:
    """One vLLM scheduler and one worker connector, stepped by hand."""

    async_scheduling: bool = False
    policy: str = "recompute"
    num_blocks: int = 24
    extra: dict = field(default_factory=dict)
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 4
    seed: int = 0
    kv_events: dict | None = None  # vLLM's KVEventsConfig fields (None: events off)
    parallel: dict | None = None  # vLLM's ParallelConfig fields (None: one rank)
    role: str = "kv_both"  # kv_transfer_config.kv_role
    # vLLM's MultiConnector around the connector, with a no-op second connector after it
    # (tests/integrations/noop_connector.py); False: the connector alone
    multi: bool = False

    def __post_init__(self) -> None:
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVEventsConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import KVCacheConfig
        from vllm.v1.structured_output import StructuredOutputManager

        from hicache.integrations.vllm import HiCacheConnector
        from hicache.integrations.vllm.worker.half import WorkerHalf

        init_none_hash(sha256)
        # Third-tier hits read in the step ("sync") unless a test names a prefetch policy:
        # most tests here count what a lookup promises from storage at once.
        extra = {"host_tokens": 8 * B, "executor": "sync", "prefetch_policy": "sync",
                 **self.extra}
        tp = (self.parallel or {}).get("tensor_parallel_size", 1)
        mc = ModelConfig(model=model_dir(tp), skip_tokenizer_init=True, dtype="float32", seed=0,
                         max_model_len=4096)
        sc = SchedulerConfig(max_num_seqs=self.max_num_seqs,
                             max_num_batched_tokens=self.max_num_batched_tokens,
                             max_model_len=4096, enable_chunked_prefill=True,
                             is_encoder_decoder=False, async_scheduling=self.async_scheduling)
        hicache = {"kv_connector": "HiCacheConnector",
                   "kv_connector_module_path": "hicache.integrations.vllm",
                   "kv_role": self.role, "kv_connector_extra_config": extra}
        if self.multi:
            noop = {"kv_connector": "NoopConnector", "kv_connector_module_path": "noop_connector",
                    "kv_role": self.role}
            transfer = KVTransferConfig(
                kv_connector="MultiConnector", kv_role=self.role,
                kv_connector_extra_config={"connectors": [hicache, noop]},
                kv_load_failure_policy=self.policy)
        else:
            transfer = KVTransferConfig(**hicache, kv_load_failure_policy=self.policy)
        self.vllm_config = VllmConfig(
            model_config=mc, scheduler_config=sc,
            cache_config=self._cache_config(CacheConfig),
            kv_transfer_config=transfer, device_config=DeviceConfig("cpu"),
            kv_events_config=KVEventsConfig(**self.kv_events) if self.kv_events else None,
            parallel_config=ParallelConfig(**(self.parallel or {})),
        )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=self.num_blocks, kv_cache_tensors=[], kv_cache_groups=self._groups())
        self.vllm_config.cache_config.num_gpu_blocks = self.num_blocks
        cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = cls(
            vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config, log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vllm_config), block_size=B,
        )
        # The connector (in a MultiConnector: its first child), scheduler side
        self.connector = self.scheduler.connector
        # The encoder budget a multimodal model would get (the model config is a text
        # model's): requests with multimodal items are scheduled, their "encoder" is free.
        from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

        self.scheduler.max_num_encoder_input_tokens = 1 << 20
        self.scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=1 << 20)
        self.kv = self._kv_tensors()
        if self.multi:
            from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
                MultiConnector,
            )

            self.connector = self.scheduler.connector.sub_connectors[0]
            self.worker_api = MultiConnector(self.vllm_config, KVConnectorRole.WORKER,
                                             self.kv_cache_config)  # what the runner calls
            self.worker = self.worker_api.sub_connectors[0]
        else:
            self.worker = self.worker_api = HiCacheConnector(
                self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.faults = Faults(self.seed)
        _OPEN[id(self)] = self
        cfg = self.worker.hc_config
        backend = self.worker._open_storage()
        self.worker.worker_half = WorkerHalf(
            cfg, self.kv, num_blocks=self.num_blocks, block_size=B,
            num_host_pages=self.worker.num_host_pages, storage_backend=backend,
            copier_hook=self.faults, per_request_loads=self.worker.groups.hybrid,
        )
        if self.worker.worker_half.storage is not None:
            tier = self.worker.worker_half.storage
            tier.backend = self.faults.wrap_backend(tier.backend)
            if self.kv_events:  # as register_kv_caches does: the third tier's events
                self.worker.worker_half.write_reports = ([], [])
        self.step_no = 0
        self.last_num_scheduled = 0  # tokens the last step scheduled
        self.prompts: dict[str, list[int]] = {}  # req id -> prompt
        self.tables: dict[str, list[int]] = {}  # the model runner's block tables
        self.num_sampled: dict[str, int] = {}
        self.sequences: list[list[int]] = []  # every token sequence seen (for the final check)
        self.namespaces: list[str | None] = []  # the tree namespace of each of them
        # and its tree key (identity ids of its pages; None: refused, nothing of it kept)
        self.tree_keys: list[bytes | None] = []
        self.values: list[np.ndarray] = []  # and its KV values
        # Per request: what its KV depends on besides its tokens (position labels, adapter)
        self.inputs: dict[str, tuple[list[bytes] | None, bytes]] = {}
        self.adapters = AdapterDigests()
        self.lora_weights: dict[int, bytes] = {}  # adapter id -> the weights vLLM loaded
        self.sessions: dict = {}  # streaming-input sessions: req id -> vLLM's Request
        self.outputs: dict[str, list[int]] = {}  # finished requests' output tokens
        self.failed: set[str] = set()  # finished with FINISHED_ERROR
        self.finished_ids: set[str] = set()  # finished, as the engine reported them
        self.transfer_params: dict[str, dict] = {}  # finished requests' kv_transfer_params
        self.last_tables: dict[str, list[int]] = {}  # finished requests' last block tables
        self.invalid_by_step: dict[int, set[int]] = {}
        self.violations: list[Violation] = []
        self.loaded_by_step: dict[int, set[int]] = {}
        self._pending = None  # async: (scheduler output, model runner output) not yet updated
        self.scheduler_stats: list = []  # vLLM's SchedulerStats of every step, as the front end gets them

    def _cache_config(self, cls):
        return cls(block_size=B, enable_prefix_caching=True)

    def _groups(self) -> list:
        """vLLM's KV cache groups: one of full attention over every layer."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

        spec = FullAttentionSpec(block_size=B, num_kv_heads=H, head_size=D, dtype=torch.float32)
        return [KVCacheGroupSpec(list(LAYERS), spec)]

    def _kv_tensors(self) -> dict[str, torch.Tensor]:
        """vLLM's CPU layout: (num_blocks, H, block_size, 2 * D) per layer."""
        return {name: torch.zeros(self.num_blocks, H, B, 2 * D) for name in LAYERS}

    # ------------------------------------------------------------ requests
    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4,
            cache_salt: str | None = None, kv_transfer_params: dict | None = None, *,
            lora=None, mm: Sequence[tuple[str, int, int]] = (),
            embeds: torch.Tensor | None = None, resumable: bool = False) -> None:
        """A request: ``prompt`` (ignored with ``embeds``: a prompt of embeddings, one
        row a position), under a LoRA adapter (vLLM's ``LoRARequest``; its files are
        its weights), with multimodal items ``(identifier, offset, length)``;
        ``resumable``: a streaming-input session (vLLM 0.32's), whose later chunks
        :meth:`add_chunk` sends."""
        from vllm import SamplingParams
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
            extra_args=None if kv_transfer_params is None
            else {"kv_transfer_params": kv_transfer_params})
        features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                          mm_position=PlaceholderRange(offset=o, length=n))
                    for ident, o, n in mm]
        req = Request(request_id=req_id, prompt_token_ids=None if embeds is not None
                      else list(prompt), prompt_embeds=embeds, sampling_params=params,
                      pooling_params=None, block_hasher=get_request_block_hasher(B, sha256),
                      cache_salt=cache_salt, mm_features=features, lora_request=lora,
                      resumable=resumable)
        if resumable:  # its tokens and items grow: the model reads them off the session
            self.sessions[req_id] = req
        prompt = self.prompts[req_id] = list(req.all_token_ids)
        labels: list[bytes] | None = None
        if embeds is not None:
            labels = [row.numpy().tobytes() for row in embeds]
        elif mm:
            labels = [b""] * len(prompt)
            for ident, o, n in mm:
                for j in range(o, o + n):
                    labels[j] = f"{ident}:{j - o}".encode()
        seed = b""
        if lora is not None:  # vLLM's worker computes with the files as it first loaded them
            seed = self.lora_weights.setdefault(lora.lora_int_id,
                                                adapter_weights(lora.lora_path))
        self.inputs[req_id] = (labels, seed)
        sequence = extend(prompt, max_tokens)
        self.sequences.append(sequence)
        self.values.append(prefix_values(sequence, labels, seed))
        # Where the connector keeps this sequence's pages (its own reading of the request)
        inputs = read_inputs(req, B, self.adapters)
        control = parse_request_control(kv_transfer_params)
        refused = (inputs.refused is not None or control.error is not None
                   or check_cache_salt(cache_salt) is not None)
        self.namespaces.append(None if refused else
                               tree_namespace(cache_salt, control, inputs.adapter))
        self.tree_keys.append(None if refused else token_key(
            identity_ids(sequence, inputs.pages, 0, len(sequence) // B, B), B))
        self.scheduler.add_request(req)

    def add_chunk(self, req_id: str, tokens: list[int] | None, max_tokens: int = 2,
                  mm: Sequence[tuple[str, int, int]] = ()) -> None:
        """The next input chunk of the streaming session ``req_id`` (items' offsets
        within the chunk), as vLLM's streaming input API sends it: a request with the
        session's id; ``tokens`` None ends the session."""
        from vllm import SamplingParams
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.v1.request import Request

        features = [MultiModalFeatureSpec(data=None, modality="audio", identifier=ident,
                                          mm_position=PlaceholderRange(offset=o, length=n))
                    for ident, o, n in mm]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.scheduler.add_request(Request(
            request_id=req_id, prompt_token_ids=list(tokens or [1]), sampling_params=params,
            pooling_params=None, mm_features=features, resumable=tokens is not None))

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # --------------------------------------------------------------- steps
    def step(self, *, hold: bool = False) -> None:
        """One engine step (with async scheduling: schedule N+1, then update N).

        ``hold``: the step's output is not handed to the scheduler yet (as while the
        engine waits for the forward): :meth:`update_held` or the next step does it.
        """
        if not self.async_scheduling:
            self.update_held()
        out = self.scheduler.schedule()
        self.last_num_scheduled = out.total_num_scheduled_tokens
        result = self._execute(out)
        if not self.async_scheduling and not hold:
            self._update(out, result)
            return
        self.update_held()
        self._pending = (out, result)

    def update_held(self) -> None:
        """Hand the held step's output to the scheduler (``update_from_output``)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._update(*pending)

    def _update(self, out, result) -> None:
        from vllm.v1.engine import FinishReason

        outputs = self.scheduler.update_from_output(out, result)
        for eco in outputs.values():
            if eco.scheduler_stats is not None:
                self.scheduler_stats.append(eco.scheduler_stats)
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason == FinishReason.ERROR:
                    self.failed.add(o.request_id)
                if o.finish_reason is not None:
                    self.finished_ids.add(o.request_id)
                if o.kv_transfer_params is not None:
                    self.transfer_params[o.request_id] = o.kv_transfer_params

    def run(self, max_steps: int = 400, max_idle_s: float = 60.0) -> None:
        """Step until nothing is left (the scheduler and the connector idle). Steps that
        schedule nothing (every request waits for a third-tier read) are not counted
        against ``max_steps`` for up to ``max_idle_s`` seconds: they wait for a thread."""
        steps, idle_deadline = 0, time.monotonic() + max_idle_s
        while steps < max_steps:
            if not self.scheduler.has_requests() and self._pending is None:
                return
            if not self.scheduler.has_requests():
                self.update_held()
                continue
            self.step()
            if self.last_num_scheduled or time.monotonic() > idle_deadline:
                steps += 1
            else:
                time.sleep(0.001)
        raise AssertionError(f"not done after {max_steps} steps: a request hangs")

    def _execute(self, out):
        from vllm.v1.outputs import KVConnectorOutput

        self.step_no += 1
        n = self.step_no
        w = self.worker_api
        meta = out.kv_connector_metadata
        scheduled = self._follow_tables(out)
        # The model runner's order (vLLM 0.32, kv_connector_model_runner_mixin.py).
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            w.start_load_kv(None)
        for name in LAYERS:
            w.wait_for_layer_load(name)
        reads = self._forward(scheduled)
        if not out.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        self._check_reads(n, reads, invalid, getattr(self.worker.worker_half, "_poisoned", set()))
        worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=invalid, kv_connector_worker_meta=worker_meta,
            kv_connector_stats=w.get_kv_connector_stats(),  # as vLLM's model runner does
        )
        return self._runner_output(scheduled, kv_out)

    def _follow_tables(self, out) -> list[tuple[str, int, int]]:
        """The model runner's block tables follow the scheduler output; returns what each
        scheduled request computes: (req id, tokens computed before, tokens now)."""
        scheduled: list[tuple[str, int, int]] = []
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
            scheduled.append((new.req_id, new.num_computed_tokens,
                              out.num_scheduled_tokens[new.req_id]))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self.tables[rid] = list(ids[0])
            elif ids is not None:
                self.tables[rid].extend(ids[0])
            scheduled.append((rid, cached.num_computed_tokens[i], out.num_scheduled_tokens[rid]))
        for rid in out.finished_req_ids:
            if rid in self.tables:
                self.last_tables[rid] = self.tables.pop(rid)
        return scheduled

    def _check_reads(self, n: int, reads, invalid: set[int], known: set[int]) -> None:
        """Record a violation for every wrong read vLLM was not told of."""
        self.invalid_by_step[n] = set(invalid)
        # vLLM rolls back (or fails) every running request whose computed blocks include
        # a load error, once it sees the error: in this step, or with async scheduling the
        # next one too. What such a request reads meanwhile is discarded.
        # Blocks the connector knows hold wrong KV (computed over a failed load) are
        # vLLM's to recompute; vLLM 0.32's async rollback of a request that shared a
        # failed block keeps the token it computed in the next step.
        reported = invalid | self.invalid_by_step.get(n - 1, set())
        for rid, wrong, done in reads:
            if wrong - known and reported.isdisjoint(self.tables[rid][: (done + B - 1) // B]):
                self.violations.append(Violation(
                    n, f"{rid} read wrong KV in blocks {sorted(wrong)} "
                    f"(table {self.tables[rid][: (done + B - 1) // B]}, computed {done})"))

    def _runner_output(self, scheduled, kv_out):
        """The step's ``ModelRunnerOutput``: the sampled tokens and ``kv_out``."""
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = [rid for rid, _, _ in scheduled]
        sampled = []
        for rid, done, num in scheduled:
            # As vLLM's model runner decides: a step that reaches the request's last
            # known token samples (a prefill chunk that stops short does not).
            req = self.scheduler.requests.get(rid)
            if req is None or done + num < req.num_tokens:
                sampled.append([])
            else:
                sampled.append([next_token(self._tokens(rid, done + num))])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=[], kv_connector_output=kv_out,
        )

    def _tokens(self, req_id: str, n: int) -> list[int]:
        session = self.sessions.get(req_id)
        prompt = self.prompts[req_id] if session is None else list(session.all_token_ids)
        return extend(prompt, max(0, n - len(prompt)))[:n]

    def _forward(self, scheduled) -> list[tuple[str, set[int], int]]:
        """Write the KV of every scheduled token; returns what each request read wrong."""
        # Requests of one step may read blocks another rewrites in the same forward (a
        # recompute of a shared block): writes are repeated until they settle.
        for _ in range(len(scheduled) + 1):
            changed = False
            for rid, done, num in scheduled:
                changed |= self._compute(rid, done, num)
            if not changed:
                break
        return [(rid, self._wrong_blocks(rid, done), done) for rid, done, _ in scheduled]

    def _expected(self, rid: str, start: int, end: int) -> np.ndarray:
        labels, seed = self.inputs.get(rid, (None, b""))
        session = self.sessions.get(rid)
        if session is not None:  # the items of every chunk so far, where vLLM put them
            labels = [b""] * session.num_tokens
            for f in session.mm_features:
                o, n = f.mm_position.offset, f.mm_position.length
                for j in range(o, o + n):
                    labels[j] = f"{f.identifier}:{j - o}".encode()
        return prefix_values(self._tokens(rid, end), labels, seed)[start:end]

    def _slots(self, rid: str, start: int, end: int) -> tuple[list[int], list[int]]:
        table = self.tables[rid]
        pos = range(start, end)
        return [table[p // B] for p in pos], [p % B for p in pos]

    def _read(self, blocks, slots) -> np.ndarray:
        k = self.kv[LAYERS[0]]
        return k[torch.tensor(blocks), 0, torch.tensor(slots), 0].double().numpy()

    def _wrong_blocks(self, rid: str, done: int) -> set[int]:
        if done == 0:
            return set()
        blocks, slots = self._slots(rid, 0, done)
        got = self._read(blocks, slots)
        bad = np.nonzero(got != self._expected(rid, 0, done))[0]
        return {blocks[i] for i in bad}

    def _compute(self, rid: str, done: int, num: int) -> bool:
        ok = not self._wrong_blocks(rid, done)
        values = self._expected(rid, done, done + num) if ok else np.full(num, POISON)
        blocks, slots = self._slots(rid, done, done + num)
        b, s = torch.tensor(blocks), torch.tensor(slots)
        changed = False
        for layer, name in enumerate(LAYERS):
            v = torch.tensor(values + (0 if not ok else 2_000_000 * layer), dtype=torch.float32)
            kv = self.kv[name]
            if not torch.equal(kv[b, 0, s, 0], v):
                changed = True
            kv[b, :, s, :] = v[:, None, None]
        return changed

    # -------------------------------------------------------------- checks
    def host_page_errors(self) -> list[str]:
        """Host pages the scheduler's tree offers (not known bad) whose content is not the
        KV of their prefix."""
        half = self.connector.scheduler_half
        pool = self.worker.worker_half.host_pool
        errors = []
        seen: set[int] = set()
        for tokens, namespace, key, values in zip(self.sequences, self.namespaces,
                                                  self.tree_keys, self.values, strict=True):
            if key is None:
                continue
            num_pages = half.tree.probe_key(key, namespace) // B
            if not num_pages:
                continue
            path = half.tree.probe_path(key, namespace)
            pages = torch.cat([nd.host_indices for nd in path]).tolist()[:num_pages]
            for i, page in enumerate(pages):
                if page in seen or page in half._bad:
                    continue
                seen.add(page)
                got = pool.buffer[page].reshape(L, H, B, 2 * D)[0, 0, :, 0].double().numpy()
                want = values[i * B:(i + 1) * B]
                if not np.array_equal(got, want):
                    errors.append(f"host page {page} (page {i} of a {len(tokens)}-token "
                                  f"sequence) holds wrong KV")
        return errors

    def quiesce(self) -> None:
        """Finish the last async update, land every copy, hand bad pages to the scheduler."""
        from vllm.v1.outputs import KVConnectorOutput

        self.update_held()
        half = self.worker.worker_half
        half.drain()
        progress = half.take_prefetch_progress()
        bad = half.take_bad_pages()
        if bad or progress:
            from hicache.integrations.vllm.connector import HiCacheWorkerMetadata

            self.connector.update_connector_output(KVConnectorOutput(
                kv_connector_worker_meta=HiCacheWorkerMetadata(
                    bad_host_pages=bad, prefetch={op: {0: v} for op, v in progress.items()})))

    def close(self) -> None:
        _OPEN.pop(id(self), None)
        self.worker_api.shutdown()
        self.scheduler.connector.shutdown()

    def check(self) -> None:
        """Every recorded violation, the host tier's content, and leaks."""
        self.quiesce()
        assert not self.violations, "\n".join(map(str, self.violations[:10]))
        errors = self.host_page_errors()
        assert not errors, "\n".join(errors[:10])
        half = self.connector.scheduler_half
        half.check_integrity()
        if not self.scheduler.has_requests():
            assert half.num_live_requests == 0, f"{half.num_live_requests} requests leaked"
            assert self.worker.worker_half.num_in_flight == 0
            fetches = half.prefetch.num_fetches if half.prefetch is not None else 0
            assert fetches == 0, f"{fetches} prefetches left"
            assert not getattr(self.worker.worker_half, "_tables", None), "a block table leaked"


def env_flag(name: str) -> bool:
    return os.environ.get(name) == "1"
